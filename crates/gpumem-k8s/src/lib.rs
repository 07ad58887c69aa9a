//! gpumem as a Kubernetes mutating admission webhook.
//!
//! A pod annotated with its model (`gpumem.io/model`, `gpumem.io/batch`, optionally
//! `gpumem.io/precision`, `gpumem.io/optimizer`, `gpumem.io/world-size`, `gpumem.io/gpu`,
//! `gpumem.io/container`) or with the trainer config it runs (`gpumem.io/train-config`: the
//! config's text, YAML/JSON/TOML, with `gpumem.io/train-config-kind` where it is not detected;
//! its model and micro-batch stand where the annotations state none) gets
//! the GPU-memory request of the cluster's sharing system filled in from gpumem's upper bound:
//! HAMi's `nvidia.com/gpumem` limit (with `nvidia.com/gpu: 1`), Volcano's
//! `volcano.sh/vgpu-memory` (with `volcano.sh/vgpu-number: 1`), or KAI's `gpu-memory`
//! annotation — all in MiB — and `gpumem.io/estimate-mib` / `gpumem.io/upper-bound-mib`
//! annotations saying where the number came from. A pod with neither `gpumem.io/model` nor
//! `gpumem.io/train-config` passes untouched; one whose annotations cannot be estimated passes
//! untouched with a warning (the webhook never blocks a pod). Estimates are cached per stated
//! job and GPU.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use gpumem_core::profile::{self, ProfileError};
use gpumem_core::units::{bytes_to_mib, whole_mib};
use gpumem_workload::{StatedConfig, StatedError, StatedField, StatedJob};
use json_patch::{AddOperation, Patch, PatchOperation, jsonptr::PointerBuf};
use k8s_openapi::api::core::v1::Pod;
use kube_core::admission::{
    AdmissionRequest, AdmissionResponse, AdmissionReview, ConvertAdmissionReviewError,
    SerializePatchError,
};
use serde_json::{Value, json};
use tokio_rustls::rustls;

/// The annotations the webhook reads.
pub const MODEL: &str = "gpumem.io/model";
pub const BATCH: &str = "gpumem.io/batch";
pub const PRECISION: &str = "gpumem.io/precision";
pub const OPTIMIZER: &str = "gpumem.io/optimizer";
pub const GPU: &str = "gpumem.io/gpu";
pub const CONTAINER: &str = "gpumem.io/container";
pub const WORLD_SIZE: &str = "gpumem.io/world-size";
pub const TRAIN_CONFIG: &str = "gpumem.io/train-config";
pub const TRAIN_CONFIG_KIND: &str = "gpumem.io/train-config-kind";

/// The annotation that states `field`.
fn annotation(field: StatedField) -> &'static str {
    match field {
        StatedField::Model => MODEL,
        StatedField::Batch => BATCH,
        StatedField::Precision => PRECISION,
        StatedField::Optimizer => OPTIMIZER,
        StatedField::WorldSize => WORLD_SIZE,
        StatedField::TrainConfig => TRAIN_CONFIG,
    }
}

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

/// A sharing system's name that is none of those known (the name as given).
#[derive(Debug, thiserror::Error)]
#[error("unknown sharing system `{0}`; known: hami, volcano, kai")]
pub struct UnknownSharing(pub String);

impl Sharing {
    pub fn parse(s: &str) -> Result<Sharing, UnknownSharing> {
        match s {
            "hami" => Ok(Sharing::Hami),
            "volcano" => Ok(Sharing::Volcano),
            "kai" => Ok(Sharing::Kai),
            other => Err(UnknownSharing(other.to_string())),
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

/// gpumem's estimate and upper bound of a pod's job, MiB.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PodSizeMib {
    estimate_mib: f64,
    bound_mib: u64,
}

/// Why a request could not be answered (400).
#[derive(Debug, thiserror::Error)]
pub enum ReviewError {
    #[error("not an AdmissionReview of a pod: {0}")]
    NotReview(serde_json::Error),
    #[error("{0}")]
    Request(#[from] ConvertAdmissionReviewError),
    #[error("{0}")]
    Patch(#[from] SerializePatchError),
    #[error("{0}")]
    Answer(serde_json::Error),
    /// The review's task ended without an answer (it panicked).
    #[error("{0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Why a pod's annotations could not be sized: the warning it is admitted with.
#[derive(Debug, thiserror::Error)]
enum Unsized {
    #[error("{MODEL} needs {BATCH} (or a {TRAIN_CONFIG} that states the micro-batch)")]
    NoBatch,
    #[error("{CONTAINER}: the pod has no container `{0}`")]
    NoSuchContainer(String),
    #[error("the pod has no container")]
    NoContainer,
    #[error(transparent)]
    Job(Arc<JobUnsized>),
}

/// Why a job could not be sized (cached with the job).
#[derive(Debug, thiserror::Error)]
enum JobUnsized {
    #[error("{GPU}: {0}")]
    Gpu(ProfileError),
    /// An annotation's value is wrong.
    #[error("{}: {message}", annotation(*field))]
    Invalid {
        field: StatedField,
        message: gpumem_workload::StatedProblem,
    },
    #[error(transparent)]
    Size(StatedError),
    #[error("its upper bound, {bound_mib} MiB, exceeds one {gpu} ({capacity_mib} MiB)")]
    TooLarge {
        bound_mib: u64,
        gpu: String,
        capacity_mib: u64,
    },
}

/// The webhook: its sharing system, its default GPU type and its estimates so far.
pub struct Webhook {
    sharing: Sharing,
    default_gpu: String,
    cache: Mutex<HashMap<Job, Result<PodSizeMib, Arc<JobUnsized>>>>,
}

impl Webhook {
    /// A webhook writing `sharing`'s request, for pods that name no GPU type sized on
    /// `default_gpu` (a built-in profile).
    pub fn new(sharing: Sharing, default_gpu: &str) -> Result<Webhook, ProfileError> {
        profile::builtin(default_gpu)?;
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
    pub fn review(&self, body: &[u8]) -> Result<Value, ReviewError> {
        let review: AdmissionReview<Pod> =
            serde_json::from_slice(body).map_err(ReviewError::NotReview)?;
        let request: AdmissionRequest<Pod> = review.try_into()?;
        let mut response = AdmissionResponse::from(&request);
        if let Some(pod) = &request.object {
            match self.patch(pod) {
                Ok(Some(patch)) => response = response.with_patch(patch)?,
                Ok(None) => {}
                Err(warning) => {
                    response.warnings = Some(vec![format!(
                        "gpumem: {warning}; the pod is admitted unchanged"
                    )])
                }
            }
        }
        serde_json::to_value(response.into_review()).map_err(ReviewError::Answer)
    }

    /// The patch for `pod`: `None` without `gpumem.io/model`, `Err(warning)` where its
    /// annotations cannot be sized.
    fn patch(&self, pod: &Pod) -> Result<Option<Patch>, Unsized> {
        let notes = pod.metadata.annotations.clone().unwrap_or_default();
        let train_config = notes.get(TRAIN_CONFIG).map(|text| StatedConfig {
            file: TRAIN_CONFIG.into(),
            text: Some(text.clone()),
            dir: PathBuf::from("."),
            kind: notes.get(TRAIN_CONFIG_KIND).cloned(),
        });
        let model = notes.get(MODEL).cloned();
        if model.is_none() && train_config.is_none() {
            return Ok(None);
        }
        if train_config.is_none() && !notes.contains_key(BATCH) {
            return Err(Unsized::NoBatch);
        }
        let job = Job {
            stated: StatedJob {
                model,
                batch: notes.get(BATCH).cloned(),
                precision: notes.get(PRECISION).cloned(),
                optimizer: notes.get(OPTIMIZER).cloned(),
                world_size: notes.get(WORLD_SIZE).cloned(),
                train_config,
            },
            gpu: notes
                .get(GPU)
                .cloned()
                .unwrap_or_else(|| self.default_gpu.clone()),
        };
        let sized = self.sized(&job).map_err(Unsized::Job)?;
        let containers = pod
            .spec
            .as_ref()
            .map(|s| s.containers.as_slice())
            .unwrap_or_default();
        let index = match notes.get(CONTAINER) {
            Some(name) => containers
                .iter()
                .position(|c| &c.name == name)
                .ok_or_else(|| Unsized::NoSuchContainer(name.clone()))?,
            None if containers.is_empty() => return Err(Unsized::NoContainer),
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
    fn sized(&self, job: &Job) -> Result<PodSizeMib, Arc<JobUnsized>> {
        if let Some(known) = self
            .cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(job)
        {
            return known.clone();
        }
        let sized = estimate(job).map_err(Arc::new);
        self.cache
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(job.clone(), sized.clone());
        sized
    }
}

/// gpumem's replay estimate and upper bound of `job` (an ambiguous spec's largest reading).
fn estimate(job: &Job) -> Result<PodSizeMib, JobUnsized> {
    let profile = profile::builtin(&job.gpu).map_err(JobUnsized::Gpu)?;
    let est = job.stated.size(&profile, true).map_err(|e| match e {
        StatedError::Invalid { field, message } => JobUnsized::Invalid { field, message },
        e => JobUnsized::Size(e),
    })?;
    let (peak, bound) = (est.peak_bytes, est.upper_bound_bytes);
    let bound_mib = whole_mib(bound);
    if bound > profile.capacity_bytes() {
        return Err(JobUnsized::TooLarge {
            bound_mib,
            gpu: profile.name,
            capacity_mib: profile.capacity_mib,
        });
    }
    Ok(PodSizeMib {
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
        .unwrap_or_else(|e| Err(ReviewError::Task(e)));
    match answer {
        Ok(v) => ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response(),
        Err(e) => (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({ "error": e.to_string() })),
        )
            .into_response(),
    }
}

/// Why the webhook could not serve.
#[derive(Debug, thiserror::Error)]
pub enum WebhookServeError {
    /// The certificate or key file cannot be read (not PEM, or not there).
    #[error("{}: {source}", file.display())]
    Pem {
        file: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    /// The certificate or key cannot be used.
    #[error("{}: {source}", file.display())]
    Tls {
        file: PathBuf,
        source: rustls::Error,
    },
    #[error("{addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
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
) -> Result<(), WebhookServeError> {
    use rustls::pki_types::pem::PemObject;
    let pem = |file: &std::path::Path| {
        let file = file.to_path_buf();
        move |source| WebhookServeError::Pem { file, source }
    };
    let tls = |file: &std::path::Path| {
        let file = file.to_path_buf();
        move |source| WebhookServeError::Tls { file, source }
    };
    let chain: Vec<_> = rustls::pki_types::CertificateDer::pem_file_iter(cert)
        .map_err(pem(cert))?
        .collect::<Result<_, _>>()
        .map_err(pem(cert))?;
    let private = rustls::pki_types::PrivateKeyDer::from_pem_file(key).map_err(pem(key))?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(tls(cert))?
    .with_no_client_auth()
    .with_single_cert(chain, private)
    .map_err(tls(key))?;
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(WebhookServeError::Runtime)?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| WebhookServeError::Bind { addr, source })?;
        eprintln!("gpumem k8s webhook: listening on https://{}", listener.local_addr().map_err(WebhookServeError::Runtime)?);
        let app = hook.router();
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(WebhookServeError::Runtime)?;
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
