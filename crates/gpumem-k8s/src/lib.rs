//! gpumem as a Kubernetes mutating admission webhook.
//!
//! A pod annotated with its model (`gpumem.io/model`, `gpumem.io/batch`, optionally
//! `gpumem.io/precision`, `gpumem.io/optimizer`, `gpumem.io/gpu`, `gpumem.io/container`) gets
//! the GPU-memory request of the cluster's sharing system filled in from gpumem's upper bound:
//! HAMi's `nvidia.com/gpumem` limit (with `nvidia.com/gpu: 1`), Volcano's
//! `volcano.sh/vgpu-memory` (with `volcano.sh/vgpu-number: 1`), or KAI's `gpu-memory`
//! annotation — all in MiB — and `gpumem.io/estimate-mib` / `gpumem.io/upper-bound-mib`
//! annotations saying where the number came from. A pod without `gpumem.io/model` passes
//! untouched; one whose annotations cannot be estimated passes untouched with a warning (the
//! webhook never blocks a pod). Estimates are cached per (model, batch, options, GPU).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use gpumem_core::profile;
use gpumem_core::units::{bytes_to_mib, whole_mib};
use gpumem_workload::{StatedError, StatedJob};
use json_patch::{AddOperation, Patch, PatchOperation, jsonptr::PointerBuf};
use k8s_openapi::api::core::v1::Pod;
use kube_core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use serde_json::{Value, json};

/// The annotations the webhook reads.
pub const MODEL: &str = "gpumem.io/model";
pub const BATCH: &str = "gpumem.io/batch";
pub const PRECISION: &str = "gpumem.io/precision";
pub const OPTIMIZER: &str = "gpumem.io/optimizer";
pub const GPU: &str = "gpumem.io/gpu";
pub const CONTAINER: &str = "gpumem.io/container";

/// The GPU-sharing system whose request the webhook writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharing {
    /// HAMi: container limits `nvidia.com/gpu` and `nvidia.com/gpumem` (MiB).
    Hami,
    /// Volcano: container limits `volcano.sh/vgpu-number` and `volcano.sh/vgpu-memory` (MiB).
    Volcano,
    /// NVIDIA KAI: the pod annotation `gpu-memory` (MiB).
    Kai,
}

impl Sharing {
    pub fn parse(s: &str) -> Result<Sharing, String> {
        match s {
            "hami" => Ok(Sharing::Hami),
            "volcano" => Ok(Sharing::Volcano),
            "kai" => Ok(Sharing::Kai),
            other => Err(format!(
                "unknown sharing system `{other}`; known: hami, volcano, kai"
            )),
        }
    }

    /// The container limits it reads (GPU count, memory MiB); `None` for KAI (an annotation).
    fn limits(self) -> Option<(&'static str, &'static str)> {
        match self {
            Sharing::Hami => Some(("nvidia.com/gpu", "nvidia.com/gpumem")),
            Sharing::Volcano => Some(("volcano.sh/vgpu-number", "volcano.sh/vgpu-memory")),
            Sharing::Kai => None,
        }
    }
}

/// A pod's job as its annotations state it, and the GPU type it is sized for (the cache key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Job {
    stated: StatedJob,
    gpu: String,
}

/// gpumem's estimate and upper bound, MiB.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sized {
    estimate_mib: f64,
    bound_mib: u64,
}

/// The webhook: its sharing system, its default GPU type and its estimates so far.
pub struct Webhook {
    sharing: Sharing,
    default_gpu: String,
    cache: Mutex<HashMap<Job, Result<Sized, String>>>,
}

impl Webhook {
    /// A webhook writing `sharing`'s request, for pods that name no GPU type sized on
    /// `default_gpu` (a built-in profile).
    pub fn new(sharing: Sharing, default_gpu: &str) -> Result<Webhook, String> {
        profile::builtin(default_gpu).map_err(|e| e.to_string())?;
        Ok(Webhook {
            sharing,
            default_gpu: default_gpu.to_string(),
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// The routes: `POST /mutate` (AdmissionReview v1 in and out), `GET /healthz`.
    pub fn router(self: Arc<Self>) -> Router {
        Router::new()
            .route("/mutate", post(mutate))
            .route("/healthz", get(|| async { "ok" }))
            .with_state(self)
    }

    /// Answers one AdmissionReview (JSON): always allowed, with a patch where the pod's
    /// annotations could be sized, a warning where they could not.
    pub fn review(&self, body: &[u8]) -> Result<Value, String> {
        let review: AdmissionReview<Pod> = serde_json::from_slice(body)
            .map_err(|e| format!("not an AdmissionReview of a pod: {e}"))?;
        let request: AdmissionRequest<Pod> = review.try_into().map_err(|e| format!("{e}"))?;
        let mut response = AdmissionResponse::from(&request);
        if let Some(pod) = &request.object {
            match self.patch(pod) {
                Ok(Some(patch)) => {
                    response = response.with_patch(patch).map_err(|e| e.to_string())?
                }
                Ok(None) => {}
                Err(warning) => {
                    response.warnings = Some(vec![format!(
                        "gpumem: {warning}; the pod is admitted unchanged"
                    )])
                }
            }
        }
        serde_json::to_value(response.into_review()).map_err(|e| e.to_string())
    }

    /// The patch for `pod`: `None` without `gpumem.io/model`, `Err(warning)` where its
    /// annotations cannot be sized.
    fn patch(&self, pod: &Pod) -> Result<Option<Patch>, String> {
        let notes = pod.metadata.annotations.clone().unwrap_or_default();
        let Some(model) = notes.get(MODEL) else {
            return Ok(None);
        };
        let batch = notes
            .get(BATCH)
            .ok_or_else(|| format!("{MODEL} needs {BATCH}"))?;
        let job = Job {
            stated: StatedJob {
                model: model.clone(),
                batch: batch.clone(),
                precision: notes.get(PRECISION).cloned(),
                optimizer: notes.get(OPTIMIZER).cloned(),
            },
            gpu: notes
                .get(GPU)
                .cloned()
                .unwrap_or_else(|| self.default_gpu.clone()),
        };
        let sized = self.sized(&job)?;
        let containers = pod
            .spec
            .as_ref()
            .map(|s| s.containers.as_slice())
            .unwrap_or_default();
        let index = match notes.get(CONTAINER) {
            Some(name) => containers
                .iter()
                .position(|c| &c.name == name)
                .ok_or_else(|| format!("{CONTAINER}: the pod has no container `{name}`"))?,
            None if containers.is_empty() => return Err("the pod has no container".into()),
            None => 0,
        };
        let mut ops = Vec::new();
        let mib = sized.bound_mib.to_string();
        let mut annotations = vec![
            (
                "gpumem.io/estimate-mib".to_string(),
                format!("{:.0}", sized.estimate_mib),
            ),
            ("gpumem.io/upper-bound-mib".to_string(), mib.clone()),
        ];
        match self.sharing.limits() {
            Some((count, memory)) => {
                let resources = containers[index].resources.as_ref();
                let limits = resources.and_then(|r| r.limits.as_ref());
                let base = format!("/spec/containers/{index}/resources");
                let mut wanted = serde_json::Map::new();
                if !limits.is_some_and(|l| l.contains_key(count)) {
                    wanted.insert(count.to_string(), json!("1"));
                }
                wanted.insert(memory.to_string(), json!(mib));
                match (resources, limits) {
                    (None, _) => ops.push(add(&base, json!({ "limits": wanted }))),
                    (Some(_), None) => {
                        ops.push(add(&format!("{base}/limits"), Value::Object(wanted)))
                    }
                    (Some(_), Some(_)) => ops.extend(
                        wanted
                            .into_iter()
                            .map(|(k, v)| add(&format!("{base}/limits/{}", escape(&k)), v)),
                    ),
                }
            }
            None => annotations.push(("gpu-memory".to_string(), mib)),
        }
        ops.extend(
            annotations
                .into_iter()
                .map(|(k, v)| add(&format!("/metadata/annotations/{}", escape(&k)), json!(v))),
        );
        Ok(Some(Patch(ops)))
    }

    /// The job's size, estimated once.
    fn sized(&self, job: &Job) -> Result<Sized, String> {
        if let Some(known) = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(job)
        {
            return known.clone();
        }
        let sized = estimate(job);
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(job.clone(), sized.clone());
        sized
    }
}

/// gpumem's replay estimate and upper bound of `job` (an ambiguous spec's largest reading).
fn estimate(job: &Job) -> Result<Sized, String> {
    let profile = profile::builtin(&job.gpu).map_err(|e| format!("{GPU}: {e}"))?;
    let est = job.stated.size(&profile, true).map_err(|e| match e {
        StatedError::Invalid { field, message } => format!("gpumem.io/{}: {message}", field.key()),
        e => e.to_string(),
    })?;
    let (peak, bound) = (est.peak_bytes, est.upper_bound_bytes);
    let bound_mib = whole_mib(bound);
    if bound > profile.capacity_bytes() {
        return Err(format!(
            "its upper bound, {bound_mib} MiB, exceeds one {} ({} MiB)",
            profile.name, profile.capacity_mib
        ));
    }
    Ok(Sized {
        estimate_mib: bytes_to_mib(peak),
        bound_mib,
    })
}

fn add(path: &str, value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation {
        path: PointerBuf::parse(path).expect("a valid JSON pointer"),
        value,
    })
}

/// A key as one JSON-pointer segment (`/` and `~` escaped).
fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

async fn mutate(
    axum::extract::State(hook): axum::extract::State<Arc<Webhook>>,
    body: Bytes,
) -> Response {
    // Sizing may trace a PyTorch model: off the async threads.
    let answer = tokio::task::spawn_blocking(move || hook.review(&body))
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
    match answer {
        Ok(v) => ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response(),
        Err(e) => (StatusCode::BAD_REQUEST, axum::Json(json!({ "error": e }))).into_response(),
    }
}

/// Why the webhook could not serve.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The certificate or key file cannot be read or used.
    #[error("{file}: {message}")]
    Tls { file: String, message: String },
    #[error("{addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Runtime(std::io::Error),
}

/// Serves the webhook over HTTPS (what the API server calls) on `addr` until SIGINT or SIGTERM,
/// with the PEM certificate chain and private key given.
pub fn serve_tls(
    hook: Arc<Webhook>,
    addr: std::net::SocketAddr,
    cert: &std::path::Path,
    key: &std::path::Path,
) -> Result<(), ServeError> {
    use tokio_rustls::rustls::{self, pki_types::pem::PemObject};
    let tls = |file: &std::path::Path, e: &dyn std::fmt::Display| ServeError::Tls {
        file: file.display().to_string(),
        message: e.to_string(),
    };
    let chain: Vec<_> = rustls::pki_types::CertificateDer::pem_file_iter(cert)
        .map_err(|e| tls(cert, &e))?
        .collect::<Result<_, _>>()
        .map_err(|e| tls(cert, &e))?;
    let private = rustls::pki_types::PrivateKeyDer::from_pem_file(key).map_err(|e| tls(key, &e))?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| tls(cert, &e))?
    .with_no_client_auth()
    .with_single_cert(chain, private)
    .map_err(|e| tls(key, &e))?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { addr: addr.to_string(), source })?;
        eprintln!("gpumem k8s webhook: listening on https://{}", listener.local_addr().map_err(ServeError::Runtime)?);
        let app = hook.router();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(ServeError::Runtime)?;
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break,
                _ = term.recv() => break,
                accepted = listener.accept() => {
                    let Ok((tcp, _)) = accepted else { continue };
                    let (acceptor, app) = (acceptor.clone(), app.clone());
                    tokio::spawn(async move {
                        // A failed handshake ends that connection only.
                        let Ok(stream) = tokio::time::timeout(std::time::Duration::from_secs(10), acceptor.accept(tcp)).await.map_err(|_| ()).and_then(|r| r.map_err(|_| ())) else { return };
                        let _ = hyper::server::conn::http1::Builder::new()
                            .timer(hyper_util::rt::TokioTimer::new())
                            .header_read_timeout(std::time::Duration::from_secs(10))
                            .serve_connection(hyper_util::rt::TokioIo::new(stream), hyper_util::service::TowerToHyperService::new(app))
                            .await;
                    });
                }
            }
        }
        Ok(())
    })
}
