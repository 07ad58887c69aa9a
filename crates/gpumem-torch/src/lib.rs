//! gpumem-torch: trace real PyTorch models through the `gpumem_trace` Python package.
//!
//! [`TorchTracer`] runs the tracer (embedded in this binary and unpacked into the cache directory)
//! with the user's interpreter (`GPUMEM_PYTHON`, else `python3`), caches each trace by
//! (reference, options, torch version, tracer version), and turns tracer failures into
//! [`BridgeError`]s carrying the tail of the Python error. [`TraceRequest`] is what to trace;
//! [`TorchTracer::symbolic`] traces a model at three batch sizes and fits a
//! [`gpumem_core::symbolic::SymbolicTrace`], so any batch size is answered without re-tracing.

use std::fs;
use std::io::{BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, UNIX_EPOCH};

pub mod cache;

use gpumem_core::depth;
use gpumem_core::job::{HF_CODE_PREFIX, Options, RoutingImbalance};
use gpumem_core::profile::SdpaBackend;
use gpumem_core::symbolic::{SymbolicError, SymbolicTrace};
use gpumem_core::trace::{Trace, TraceError};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The tracer's sources, embedded so that `gpumem` needs only torch in the user's interpreter.
const SOURCES: [(&str, &str); 34] = [
    (
        "__init__.py",
        include_str!("../../../python/gpumem_trace/__init__.py"),
    ),
    (
        "__main__.py",
        include_str!("../../../python/gpumem_trace/__main__.py"),
    ),
    ("ac.py", include_str!("../../../python/gpumem_trace/ac.py")),
    (
        "amp.py",
        include_str!("../../../python/gpumem_trace/amp.py"),
    ),
    (
        "compiled.py",
        include_str!("../../../python/gpumem_trace/compiled.py"),
    ),
    (
        "config.py",
        include_str!("../../../python/gpumem_trace/config.py"),
    ),
    (
        "cuda.py",
        include_str!("../../../python/gpumem_trace/cuda.py"),
    ),
    (
        "device.py",
        include_str!("../../../python/gpumem_trace/device.py"),
    ),
    (
        "distributed.py",
        include_str!("../../../python/gpumem_trace/distributed.py"),
    ),
    (
        "families.py",
        include_str!("../../../python/gpumem_trace/families.py"),
    ),
    (
        "float8.py",
        include_str!("../../../python/gpumem_trace/float8.py"),
    ),
    (
        "generation.py",
        include_str!("../../../python/gpumem_trace/generation.py"),
    ),
    (
        "hf_trainer.py",
        include_str!("../../../python/gpumem_trace/hf_trainer.py"),
    ),
    (
        "liger.py",
        include_str!("../../../python/gpumem_trace/liger.py"),
    ),
    (
        "loop.py",
        include_str!("../../../python/gpumem_trace/loop.py"),
    ),
    (
        "lora.py",
        include_str!("../../../python/gpumem_trace/lora.py"),
    ),
    (
        "losses.py",
        include_str!("../../../python/gpumem_trace/losses.py"),
    ),
    (
        "models.py",
        include_str!("../../../python/gpumem_trace/models.py"),
    ),
    (
        "offload.py",
        include_str!("../../../python/gpumem_trace/offload.py"),
    ),
    (
        "optimizers.py",
        include_str!("../../../python/gpumem_trace/optimizers.py"),
    ),
    (
        "parallel.py",
        include_str!("../../../python/gpumem_trace/parallel.py"),
    ),
    (
        "pipeline.py",
        include_str!("../../../python/gpumem_trace/pipeline.py"),
    ),
    (
        "pool.py",
        include_str!("../../../python/gpumem_trace/pool.py"),
    ),
    (
        "probe.py",
        include_str!("../../../python/gpumem_trace/probe.py"),
    ),
    (
        "record.py",
        include_str!("../../../python/gpumem_trace/record.py"),
    ),
    (
        "request.py",
        include_str!("../../../python/gpumem_trace/request.py"),
    ),
    (
        "routing.py",
        include_str!("../../../python/gpumem_trace/routing.py"),
    ),
    (
        "run.py",
        include_str!("../../../python/gpumem_trace/run.py"),
    ),
    (
        "script.py",
        include_str!("../../../python/gpumem_trace/script.py"),
    ),
    (
        "sdpa.py",
        include_str!("../../../python/gpumem_trace/sdpa.py"),
    ),
    (
        "standin.py",
        include_str!("../../../python/gpumem_trace/standin.py"),
    ),
    (
        "tracer.py",
        include_str!("../../../python/gpumem_trace/tracer.py"),
    ),
    (
        "track.py",
        include_str!("../../../python/gpumem_trace/track.py"),
    ),
    (
        "zero.py",
        include_str!("../../../python/gpumem_trace/zero.py"),
    ),
];

mod pool;
pub mod probe;

/// The tracer of the process gpumem runs in, where that process is Python (the `gpumem`
/// package's): it traces a request in a fork of itself, where the user's live model objects
/// are (`live:` references), as the pool traces in forks of its own. Set once, by the host.
pub trait HostTracer: Send + Sync {
    /// Runs the tracer's `request` with its output into `log`: its exit code (`None`: a signal
    /// ended it), or `None` where it outlived `deadline` and was killed.
    fn run(
        &self,
        request: &serde_json::Value,
        log: &Path,
        deadline: Duration,
    ) -> Option<Option<i32>>;
}

static HOST: std::sync::OnceLock<Box<dyn HostTracer>> = std::sync::OnceLock::new();

/// Makes `tracer` this process's host tracer; `false` where one is set already.
pub fn set_host_tracer(tracer: Box<dyn HostTracer>) -> bool {
    HOST.set(tracer).is_ok()
}

/// What to trace: a PyTorch reference at a batch size, the typed options of its loop, and what
/// the tracer needs of the target GPU. Built from a workload (`gpumem-workload`), or directly by
/// this crate's tests.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TraceRequest {
    pub model: String,
    /// The whole batch (a DataParallel job's is what the wrapper splits; the trace is GPU 0's).
    pub batch: u64,
    pub options: Options,
    /// Compute capability of the GPU the job will run on (`9.0`): with the installed torch it
    /// decides which attention kernel runs.
    pub gpu_capability: String,
    /// An attention kernel the profile forces.
    pub sdpa: Option<SdpaBackend>,
    pub iterations: u32,
    /// One sequence length per iteration, run in this order (a run whose lengths vary by step,
    /// traced as the loop runs it; `iterations` is then their count). Empty: every iteration at
    /// the options' own length.
    pub seq_lens: Vec<u64>,
    /// Which pipeline stage's rank is traced (0 where the job has no pipeline stages).
    pub pipeline_rank: u32,
    /// The router's stand-in for this trace: balanced (the estimate's), or the imbalance the
    /// strategy's upper bound assumes (its own trace).
    pub routing_imbalance: RoutingImbalance,
}

impl TraceRequest {
    /// A request with default options for an A100 (compute capability 8.0).
    pub fn new(model: impl Into<String>, batch: u64) -> Self {
        TraceRequest {
            model: model.into(),
            batch,
            options: Options::default(),
            gpu_capability: "8.0".into(),
            sdpa: None,
            iterations: 3,
            seq_lens: Vec::new(),
            pipeline_rank: 0,
            routing_imbalance: RoutingImbalance::BALANCED,
        }
    }

    /// A request at `batch` for a job that will run on `profile`'s GPU (its attention kernel).
    pub fn for_gpu(
        model: impl Into<String>,
        batch: u64,
        options: Options,
        profile: &gpumem_core::profile::GpuProfile,
    ) -> Self {
        TraceRequest {
            options,
            gpu_capability: profile.compute_capability.clone(),
            sdpa: profile.sdpa,
            ..TraceRequest::new(model, batch)
        }
    }
}

/// The tracer's request: one JSON document per run (python/gpumem_trace/request.py loads it
/// straight into its options; request.schema.json beside it is this type's JSON Schema, which
/// the Python tests hold the loader to).
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct TracerRequest {
    /// The format of this document ([`TracerRequest::VERSION`]).
    pub version: u32,
    pub model: String,
    /// Batch sizes, each traced into the file at the same place in `outs`.
    pub batches: Vec<u64>,
    pub outs: Vec<PathBuf>,
    pub options: Options,
    /// Compute capability of the GPU the job will run on (`9.0`).
    pub gpu_capability: String,
    /// An attention kernel the profile forces.
    pub sdpa: Option<SdpaBackend>,
    pub iterations: u32,
    /// One sequence length per iteration, in this order (empty: the options' own length).
    pub seq_lens: Vec<u64>,
    /// Which pipeline stage's rank to trace (`options.strategy`'s pipeline; 0 where none).
    pub pipeline_rank: u32,
    /// The router's stand-in: the traced expert-parallel rank's experts get this many times
    /// their even share of the token-expert choices (1: balanced; the tracer's routing.py).
    pub routing_imbalance: RoutingImbalance,
    /// Trace the model cut to each of these depths of its repeated blocks (into `OUT.depthK`)
    /// where it has enough of them; else whole.
    pub depths: Vec<u32>,
    /// With `depths` and several batch sizes: the whole depth at the first only, every batch
    /// size cut to the first depth (see [`TorchTracer::run_and_cache`]).
    pub slopes: bool,
    /// Run every iteration, even those the loop's steady state repeats.
    pub every_iteration: bool,
    /// The tracer's own alarm (a courtesy: gpumem kills a run that outlives its deadline).
    pub timeout_s: u64,
    /// Where the tracer writes its answer, `{status, kind, message, where}` (none: a person's
    /// run, answered on stderr only).
    pub result: Option<PathBuf>,
}

impl TracerRequest {
    pub const VERSION: u32 = 1;

    /// The JSON Schema of the request, as committed in python/gpumem_trace/request.schema.json.
    pub fn schema() -> String {
        let schema = schemars::schema_for!(TracerRequest);
        serde_json::to_string_pretty(&schema).expect("a schema is JSON") + "\n"
    }
}

/// The tracer's answer: `{status, kind, message, where}` (python/gpumem_trace/request.py's
/// `Failure`, or `OK`).
#[derive(Debug, Clone, Deserialize)]
struct TracerAnswer {
    status: AnswerStatus,
    kind: Option<FailureKind>,
    message: Option<String>,
    #[serde(rename = "where")]
    at: Option<String>,
}

impl TracerAnswer {
    /// A failed answer's error (`model` and `timeout_s` name a timeout).
    fn into_error(self, model: &str, timeout_s: u64) -> BridgeError {
        let message = self.message.unwrap_or_default();
        match self.kind {
            Some(FailureKind::Reference) => BridgeError::Reference(message),
            Some(FailureKind::Timeout) => BridgeError::Timeout {
                model: model.to_string(),
                seconds: timeout_s,
            },
            Some(FailureKind::Python) => BridgeError::NoTorch(message),
            Some(FailureKind::Model) | None => BridgeError::Model {
                message,
                at: self.at,
            },
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum AnswerStatus {
    Ok,
    Failed,
}

/// What failed, as the tracer tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum FailureKind {
    /// The model reference or an option is wrong.
    Reference,
    /// The model itself failed.
    Model,
    /// The tracer's own alarm ended the trace.
    Timeout,
    /// The interpreter or torch.
    Python,
}

/// Why a trace could not be had.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// The model reference or an option is wrong (the tracer's answer of kind `reference`).
    #[error("{0}")]
    Reference(String),
    /// The model itself failed while tracing (the tracer's message, and where).
    #[error("tracer failed: {message}{}", .at.as_ref().map(|w| format!(" (at {w})")).unwrap_or_default())]
    Model { message: String, at: Option<String> },
    /// The trace outlived its deadline and was killed.
    #[error("tracer failed: tracing {model} timed out after {seconds} s")]
    Timeout { model: String, seconds: u64 },
    /// The interpreter could not be started.
    #[error("cannot run the Python interpreter `{python}`: {source} (set GPUMEM_PYTHON)")]
    Spawn {
        python: String,
        source: std::io::Error,
    },
    /// torch is not importable, or too old (the tracer's answer of kind `python`, or the
    /// version check's output).
    #[error("{0}")]
    NoTorch(String),
    /// The tracer (or probe) ended without an answer: a crash, or a signal.
    #[error("{what} failed ({how}): {tail}")]
    Crashed {
        what: &'static str,
        how: String,
        tail: String,
    },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the tracer wrote a bad trace for {model} at batch {batch}: {source}")]
    BadTrace {
        model: String,
        batch: u64,
        source: TraceError,
    },
    #[error("the tracer wrote no trace for {model} at batch {batch}")]
    NoTrace { model: String, batch: u64 },
    #[error(
        "{model}: its traces do not align across batch sizes ({source}); trace each batch size instead"
    )]
    NotAligned {
        model: String,
        source: SymbolicError,
    },
    #[error("{}: not a probe report: {source}", path.display())]
    ProbeReport {
        path: PathBuf,
        source: serde_json::Error,
    },
}

/// Seconds gpumem waits past a run's `timeout_s` before it kills the run: the tracer's own
/// alarm, which starts once torch is imported, usually ends it first with a clean answer.
const DEADLINE_GRACE_S: u64 = 10;

impl BridgeError {
    /// Whether the model itself could not be traced (it failed, hung, or traced into something
    /// gpumem cannot use), rather than the reference being wrong or Python or the cache failing.
    pub fn is_model_failure(&self) -> bool {
        matches!(
            self,
            BridgeError::Model { .. }
                | BridgeError::Timeout { .. }
                | BridgeError::BadTrace { .. }
                | BridgeError::NoTrace { .. }
                | BridgeError::NotAligned { .. }
        )
    }
}

/// Runs the tracer and caches its traces.
#[derive(Debug, Clone)]
pub struct TorchTracer {
    pub python: String,
    pub cache_dir: PathBuf,
    /// Bytes of traces kept in `cache_dir` before the least recently used are removed
    /// ([`cache::evict`]).
    pub cache_max_bytes: u64,
    /// Seconds before a trace is abandoned.
    pub timeout_s: u64,
}

/// A name for a temporary file or directory, unique per process and call: the threads of one
/// process (parallel tests, a daemon's requests) may write the same cache entry at once.
fn temp_suffix() -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!(
        "tmp{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// FNV-1a: a stable hash for cache keys (std's hasher may change between releases).
fn fnv(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain([0u8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

fn tail(text: &str, lines: usize) -> String {
    let v: Vec<&str> = text
        .lines()
        .filter(|l| {
            !l.trim().is_empty()
                && !l.contains("Failed to initialize NumPy")
                && !l.contains("_conversion_method_template")
        })
        .collect();
    v[v.len().saturating_sub(lines)..].join(" | ")
}

impl TorchTracer {
    /// Interpreter from `GPUMEM_PYTHON`, else the `python` beside this program (the virtual
    /// environment the gpumem-estimate wheel installed it into), else `python3`; cache under
    /// `GPUMEM_CACHE`, else `$XDG_CACHE_HOME/gpumem`, else `~/.cache/gpumem`, holding at most
    /// `GPUMEM_CACHE_MAX_MIB` of traces (default [`cache::DEFAULT_MAX_BYTES`]).
    pub fn from_env() -> Self {
        let beside = || {
            let exe = std::env::current_exe().ok()?;
            let python = exe.parent()?.join("python");
            let venv = exe.parent()?.parent()?.join("pyvenv.cfg");
            (venv.exists() && python.exists()).then(|| python.to_string_lossy().into_owned())
        };
        let python = std::env::var("GPUMEM_PYTHON")
            .ok()
            .filter(|s| !s.is_empty())
            .or_else(beside)
            .unwrap_or_else(|| "python3".into());
        let cache_dir = std::env::var_os("GPUMEM_CACHE")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("gpumem")))
            .or_else(|| std::env::var_os("HOME").map(|d| PathBuf::from(d).join(".cache/gpumem")))
            .unwrap_or_else(|| std::env::temp_dir().join("gpumem"));
        let timeout_s = std::env::var("GPUMEM_TRACE_TIMEOUT")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(900);
        let cache_max_bytes = match std::env::var("GPUMEM_CACHE_MAX_MIB") {
            Err(_) => cache::DEFAULT_MAX_BYTES,
            Ok(s) => s.trim().parse::<u64>().map(|mib| mib << 20).unwrap_or_else(|_| {
                // Once per process: a daemon or a plan reads the environment many times.
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    eprintln!(
                        "warning: GPUMEM_CACHE_MAX_MIB={s:?} is not a whole number of MiB; the trace cache keeps its default {} MiB",
                        cache::DEFAULT_MAX_BYTES >> 20
                    )
                });
                cache::DEFAULT_MAX_BYTES
            }),
        };
        TorchTracer {
            python,
            cache_dir,
            cache_max_bytes,
            timeout_s,
        }
    }

    fn io(&self, what: &Path, e: std::io::Error) -> BridgeError {
        BridgeError::Io {
            path: what.to_path_buf(),
            source: e,
        }
    }

    /// Unpacks the embedded tracer (once per version of its sources); returns its parent dir.
    fn package_dir(&self) -> Result<PathBuf, BridgeError> {
        let digest = fnv(&SOURCES
            .iter()
            .flat_map(|(n, s)| [*n, *s])
            .collect::<Vec<_>>());
        let root = self.cache_dir.join(format!("tracer-{digest:016x}"));
        let pkg = root.join("gpumem_trace");
        if !pkg.join("tracer.py").exists() {
            let tmp = self
                .cache_dir
                .join(format!("tracer-{digest:016x}.{}", temp_suffix()));
            let tpkg = tmp.join("gpumem_trace");
            fs::create_dir_all(&tpkg).map_err(|e| self.io(&tpkg, e))?;
            for (name, text) in SOURCES {
                fs::write(tpkg.join(name), text).map_err(|e| self.io(&tpkg, e))?;
            }
            if fs::rename(&tmp, &root).is_err() {
                // Another process won the race; its copy is identical.
                let _ = fs::remove_dir_all(&tmp);
            }
        }
        Ok(root)
    }

    /// The torch version of the interpreter, remembered per interpreter and re-checked only when
    /// torch's version file changes (so cache hits spawn no Python).
    pub fn torch_version(&self) -> Result<String, BridgeError> {
        let memo = self
            .cache_dir
            .join(format!("python-{:016x}.txt", fnv(&[&self.python])));
        if let Ok(text) = fs::read_to_string(&memo) {
            let mut it = text.lines();
            if let (Some(ver), Some(file), Some(stamp)) = (it.next(), it.next(), it.next())
                && mtime(Path::new(file)).map(|m| m.to_string()) == Some(stamp.to_string())
            {
                return Ok(ver.to_string());
            }
        }
        let out = Command::new(&self.python)
            .args(["-c", "import importlib.util as u, importlib.metadata as m; s=u.find_spec('torch'); print(m.version('torch')); print(s.submodule_search_locations[0] + '/version.py')"])
            .output()
            .map_err(|source| BridgeError::Spawn { python: self.python.clone(), source })?;
        if !out.status.success() {
            return Err(BridgeError::NoTorch(format!(
                "torch is not installed for `{}` ({}); install it there or set GPUMEM_PYTHON",
                self.python,
                tail(&String::from_utf8_lossy(&out.stderr), 1)
            )));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let mut it = text.lines();
        let ver = it.next().unwrap_or("unknown").trim().to_string();
        if let Some(file) = it.next()
            && let Some(stamp) = mtime(Path::new(file.trim()))
        {
            let _ = fs::create_dir_all(&self.cache_dir);
            let _ = fs::write(&memo, format!("{ver}\n{}\n{stamp}\n", file.trim()));
        }
        Ok(ver)
    }

    fn cache_key(&self, req: &TraceRequest, torch: &str) -> u64 {
        // A user's model file is part of the key: editing it must not serve a stale trace. So
        // are a checkpoint's own modeling files and config (`hf-code:DIR`).
        let user_file = req
            .model
            .strip_prefix("py:")
            .and_then(|r| r.rsplit_once(':'))
            .map(|(path, _)| mtime(Path::new(path)).unwrap_or(0).to_string())
            .or_else(|| {
                let dir = Path::new(req.model.strip_prefix(HF_CODE_PREFIX)?);
                let newest = fs::read_dir(dir)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path())
                    .filter(|p| p.extension().is_some_and(|e| e == "py" || e == "json"))
                    .filter_map(|p| mtime(&p))
                    .max();
                Some(newest.unwrap_or(0).to_string())
            })
            .unwrap_or_default();
        fnv(&[
            &format!("{req:?}"),
            torch,
            env!("CARGO_PKG_VERSION"),
            &format!("{:x}", fnv(&SOURCES.map(|s| s.1))),
            &user_file,
        ])
    }

    fn cache_path(&self, req: &TraceRequest, torch: &str) -> PathBuf {
        self.cache_dir
            .join("traces")
            .join(format!("{:016x}.jsonl", self.cache_key(req, torch)))
    }

    /// Where the batch-symbolic trace of `req`'s model and options (any batch) is kept.
    fn symbolic_path(&self, req: &TraceRequest, torch: &str) -> PathBuf {
        let key = self.cache_key(
            &TraceRequest {
                batch: 0,
                ..req.clone()
            },
            torch,
        );
        self.cache_dir
            .join("traces")
            .join(format!("{key:016x}.sym.json"))
    }

    fn cached_symbolic(&self, req: &TraceRequest, torch: &str) -> Option<SymbolicTrace> {
        let path = self.symbolic_path(req, torch);
        let sym = SymbolicTrace::read(BufReader::new(fs::File::open(&path).ok()?)).ok()?;
        cache::touch(&path);
        Some(sym)
    }

    /// Keeps the trace cache within its budget once new traces are in it.
    fn evict(&self) {
        cache::evict(
            &self.cache_dir.join("traces"),
            self.cache_max_bytes,
            std::time::SystemTime::now(),
        );
    }

    /// Batch sizes a symbolic trace of `req` is fitted at, besides `with` where given: whole
    /// multiples of the job's batch unit ([`Options::batch_unit`]: a DataParallel job's GPUs,
    /// a pipeline's micro-batches), so the fit is exact at any multiple.
    fn fit_batches(req: &TraceRequest, with: Option<u64>) -> Vec<u64> {
        let unit = req.options.batch_unit();
        let mut batches: Vec<u64> = with.into_iter().collect();
        for b in SymbolicTrace::FIT_BATCHES.map(|b| b * unit) {
            if batches.len() < SymbolicTrace::FIT_BATCHES.len() && !batches.contains(&b) {
                batches.push(b);
            }
        }
        batches
    }

    /// The trace for `req`: evaluated from the model's batch-symbolic trace where one is
    /// cached, else from the trace cache, else by running the tracer.
    pub fn trace(&self, req: &TraceRequest) -> Result<Trace, BridgeError> {
        self.trace_with(req, false)
    }

    /// [`TorchTracer::trace`], and where the tracer must run, two more batch sizes in the same
    /// process to fit the model's batch-symbolic trace: the next batch size of this model and
    /// options then costs no Python at all (what a user trying batch sizes wants).
    pub fn trace_for_reestimates(&self, req: &TraceRequest) -> Result<Trace, BridgeError> {
        self.trace_with(req, true)
    }

    fn trace_with(&self, req: &TraceRequest, fit: bool) -> Result<Trace, BridgeError> {
        let torch = self.torch_version()?;
        if !req.seq_lens.is_empty() || req.options.whole_run.is_some() {
            return self.trace_in_order(req, &torch);
        }
        let symbolic_ok = req.batch.is_multiple_of(req.options.batch_unit());
        if symbolic_ok
            && let Some(sym) = self.cached_symbolic(req, &torch)
            && let Ok(t) = sym.at(req.batch)
        {
            return Ok(t);
        }
        let path = self.cache_path(req, &torch);
        if let Some(t) = cached_trace(&path) {
            return Ok(t);
        }
        let batches = if fit && symbolic_ok {
            Self::fit_batches(req, Some(req.batch))
        } else {
            vec![req.batch]
        };
        let mut traces = self.run_and_cache(req, &torch, &batches)?;
        if traces.len() == SymbolicTrace::FIT_BATCHES.len() {
            let _ = self.cache_symbolic(req, &torch, &traces);
        }
        Ok(traces.swap_remove(0))
    }

    /// A request whose lengths vary by iteration, or a whole run's: traced whole, every
    /// iteration run (no depth cut, no symbolic trace: neither carries over steps of different
    /// shapes, nor the parts of a run), and cached.
    fn trace_in_order(&self, req: &TraceRequest, torch: &str) -> Result<Trace, BridgeError> {
        let path = self.cache_path(req, torch);
        if let Some(t) = cached_trace(&path) {
            return Ok(t);
        }
        let dir = self.cache_dir.join("traces");
        fs::create_dir_all(&dir).map_err(|e| self.io(&dir, e))?;
        let tmp = path.with_extension(temp_suffix());
        self.run(req, &[req.batch], &[&tmp], false)?;
        let t = self.read_tracer_output(req, &tmp, req.batch)?;
        fs::rename(&tmp, &path).map_err(|e| self.io(&path, e))?;
        self.evict();
        Ok(t)
    }

    /// Runs the tracer once for `batches` (the first is `req`'s own batch size where it matters)
    /// and caches each trace; returns them in that order. A model with many identical blocks
    /// is traced cut to [`depth::DEPTHS`] and rebuilt at its whole depth
    /// ([`depth::extrapolate`]) — or whole, where its strategy's buffers span blocks — at
    /// one batch size only; at the others it is traced cut to the shallowest depth, and
    /// [`SymbolicTrace::transfer`] carries what the batch does to those cut traces' events over
    /// to that whole trace. Where either does not hold, it is traced whole after all.
    fn run_and_cache(
        &self,
        req: &TraceRequest,
        torch: &str,
        batches: &[u64],
    ) -> Result<Vec<Trace>, BridgeError> {
        let dir = self.cache_dir.join("traces");
        fs::create_dir_all(&dir).map_err(|e| self.io(&dir, e))?;
        let jobs: Vec<(PathBuf, PathBuf)> = batches
            .iter()
            .map(|&b| {
                let path = self.cache_path(
                    &TraceRequest {
                        batch: b,
                        ..req.clone()
                    },
                    torch,
                );
                let tmp = path.with_extension(temp_suffix());
                (path, tmp)
            })
            .collect();
        let tmps: Vec<&Path> = jobs.iter().map(|(_, tmp)| tmp.as_path()).collect();
        // The tracer takes the whole depth at the first batch size it is given: the one with
        // the largest odd factor, at which a block's tensors least often coincide in size with
        // one another (the model's sizes are mostly powers of two; at 4, a 2048-token batch's
        // activation may weigh what a 4096-wide weight does), which SymbolicTrace::transfer
        // cannot tell apart.
        let lead = (0..batches.len())
            .max_by_key(|&i| {
                (
                    batches[i] >> batches[i].trailing_zeros(),
                    std::cmp::Reverse(i),
                )
            })
            .unwrap_or(0);
        let order: Vec<usize> = std::iter::once(lead)
            .chain((0..batches.len()).filter(|&i| i != lead))
            .collect();
        self.run(
            req,
            &order.iter().map(|&i| batches[i]).collect::<Vec<_>>(),
            &order.iter().map(|&i| tmps[i]).collect::<Vec<_>>(),
            true,
        )?;
        // Cut to the shallowest depth at every batch size: what the batch does to each event.
        let shallowest = |out: &Path| depth_path(out, depth::DEPTHS[0]);
        let cut: Option<Vec<Trace>> =
            if carries_batch(batches) && tmps.iter().all(|t| shallowest(t).exists()) {
                Some(
                    tmps.iter()
                        .zip(batches)
                        .map(|(t, &b)| self.read_tracer_output(req, &shallowest(t), b))
                        .collect::<Result<_, _>>()?,
                )
            } else {
                None
            };
        let mut traces: Vec<Option<Trace>> = vec![None; batches.len()];
        for (i, (&tmp, &b)) in tmps.iter().zip(batches).enumerate() {
            if tmp.exists() {
                traces[i] = Some(self.read_tracer_output(req, tmp, b)?);
            } else if i == lead || cut.is_none() {
                traces[i] = self.rebuild_depth(req, tmp, b)?;
            }
        }
        if let (Some(cut), Some(whole)) = (&cut, &traces[lead])
            && let Ok(sym) = SymbolicTrace::transfer(whole, cut)
        {
            for (t, &b) in traces.iter_mut().zip(batches) {
                if t.is_none() {
                    *t = sym.at(b).ok();
                }
            }
        }
        for tmp in &tmps {
            let _ = fs::remove_file(shallowest(tmp));
        }
        // A batch size whose cut trace does not align with the lead's (at batch 1 a slice of
        // a one-row tensor is contiguous, and Hugging Face's loss makes no copy of its labels)
        // is cut at every depth on its own where the lead's rebuilt: a third of a whole trace.
        if traces[lead].is_some() && !tmps[lead].exists() {
            for i in 0..batches.len() {
                if traces[i].is_some() {
                    continue;
                }
                self.run(req, &batches[i..=i], &tmps[i..=i], true)?;
                traces[i] = if tmps[i].exists() {
                    Some(self.read_tracer_output(req, tmps[i], batches[i])?)
                } else {
                    self.rebuild_depth(req, tmps[i], batches[i])?
                };
            }
        }
        let whole: Vec<usize> = (0..batches.len())
            .filter(|&i| traces[i].is_none())
            .collect();
        if !whole.is_empty() {
            let again: Vec<&Path> = whole.iter().map(|&i| tmps[i]).collect();
            self.run(
                req,
                &whole.iter().map(|&i| batches[i]).collect::<Vec<_>>(),
                &again,
                false,
            )?;
            for &i in &whole {
                traces[i] = Some(self.read_tracer_output(req, tmps[i], batches[i])?);
            }
        }
        let mut out = Vec::new();
        for ((path, tmp), t) in jobs.iter().zip(traces) {
            let t = t.expect("every batch traced, cut or whole");
            if !tmp.exists() {
                // Rebuilt from cut traces: cached as the tracer's own would be.
                let mut w =
                    std::io::BufWriter::new(fs::File::create(tmp).map_err(|e| self.io(tmp, e))?);
                t.write(&mut w)
                    .and_then(|()| w.flush())
                    .map_err(|e| self.io(tmp, e))?;
            }
            fs::rename(tmp, path).map_err(|e| self.io(path, e))?;
            out.push(t);
        }
        self.evict();
        Ok(out)
    }

    fn read_tracer_output(
        &self,
        req: &TraceRequest,
        path: &Path,
        batch: u64,
    ) -> Result<Trace, BridgeError> {
        let f = fs::File::open(path).map_err(|e| self.io(path, e))?;
        Trace::read(BufReader::new(f)).map_err(|source| BridgeError::BadTrace {
            model: req.model.clone(),
            batch,
            source,
        })
    }

    /// The whole model's trace from the cut ones the tracer wrote next to `out` (removed);
    /// `None` where the events one block adds do not repeat.
    fn rebuild_depth(
        &self,
        req: &TraceRequest,
        out: &Path,
        batch: u64,
    ) -> Result<Option<Trace>, BridgeError> {
        let paths = depth::DEPTHS.map(|d| depth_path(out, d));
        let read: Result<Vec<Trace>, BridgeError> = paths
            .iter()
            .map(|p| self.read_tracer_output(req, p, batch))
            .collect();
        for p in &paths {
            let _ = fs::remove_file(p);
        }
        let cut: [Trace; 3] = read?.try_into().map_err(|_| BridgeError::NoTrace {
            model: req.model.clone(),
            batch,
        })?;
        let blocks = cut[0].header.blocks.unwrap_or(0);
        Ok(depth::extrapolate(&cut, blocks).ok())
    }

    /// Fits and stores the symbolic trace; a model whose traces do not align (batch-dependent
    /// control flow) has none, and is traced per batch size.
    fn cache_symbolic(
        &self,
        req: &TraceRequest,
        torch: &str,
        traces: &[Trace],
    ) -> Result<SymbolicTrace, SymbolicError> {
        let sym = SymbolicTrace::fit(traces)?;
        let path = self.symbolic_path(req, torch);
        let tmp = path.with_extension(temp_suffix());
        let written = fs::File::create(&tmp).ok().and_then(|f| {
            let mut w = std::io::BufWriter::new(f);
            sym.write(&mut w).ok()?;
            w.flush().ok()
        });
        if written.is_some() {
            let _ = fs::rename(&tmp, &path);
        } else {
            let _ = fs::remove_file(&tmp);
        }
        Ok(sym)
    }

    /// `python -m MODULE` with the embedded package importable (the tracer, or the workload
    /// runner `gpumem_trace.run`).
    /// Downloads a Hub repository's `config.json` alone (never weights) into the Hub cache
    /// `huggingface_hub` uses, with this interpreter's `huggingface_hub`, within 60 seconds.
    /// `Err` with the reason where it is not installed, the network does not answer, or the
    /// repository has no config.
    pub fn fetch_hub_config(&self, repo: &str, revision: Option<&str>) -> Result<(), String> {
        const FETCH: &str = "import sys\nfrom huggingface_hub import hf_hub_download\nhf_hub_download(sys.argv[1], 'config.json', revision=sys.argv[2] or None)";
        let mut cmd = Command::new(&self.python);
        cmd.args(["-c", FETCH, repo, revision.unwrap_or("")]);
        match output_within(cmd, std::time::Duration::from_secs(60)) {
            Ok(Some(out)) if out.status.success() => Ok(()),
            Ok(Some(out)) => Err(tail(&String::from_utf8_lossy(&out.stderr), 1)),
            Ok(None) => Err("no answer within 60 s".into()),
            Err(e) => Err(format!("cannot run {}: {e}", self.python)),
        }
    }

    pub fn module_command(&self, module: &str) -> Result<Command, BridgeError> {
        let pkg = self.package_dir()?;
        let mut pythonpath = pkg.into_os_string();
        if let Some(old) = std::env::var_os("PYTHONPATH") {
            pythonpath.push(":");
            pythonpath.push(old);
        }
        let mut cmd = Command::new(&self.python);
        cmd.arg("-m")
            .arg(module)
            .env("PYTHONPATH", pythonpath)
            .env("PYTHONDONTWRITEBYTECODE", "1");
        Ok(cmd)
    }

    /// A trainer's Python config: `function()` of `target` (a `.py` file or an importable
    /// module) called by `python -m gpumem_trace.config` in this interpreter, its result dumped
    /// as JSON (each dataclass with its class in `_class`). Its failure is one line: a package
    /// the config imports is not installed, the file or function is missing, the function
    /// failed. Bounded by the tracer's deadline.
    pub fn config_json(&self, target: &str, function: &str) -> Result<String, BridgeError> {
        let mut cmd = self.module_command("gpumem_trace.config")?;
        cmd.arg(target).arg(function);
        let out = cmd.output().map_err(|source| BridgeError::Spawn {
            python: self.python.clone(),
            source,
        })?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            return Err(BridgeError::Reference(tail(&err, 1)));
        }
        String::from_utf8(out.stdout).map_err(|e| {
            BridgeError::Reference(format!(
                "{target}:{function}: the config's JSON is not UTF-8: {e}"
            ))
        })
    }

    /// The tracer's request to trace `req` at `batches` into `outs`, its answer into `result`;
    /// `cut`: cut to [`depth::DEPTHS`] (see [`TorchTracer::run_and_cache`]).
    pub fn request(
        &self,
        req: &TraceRequest,
        batches: &[u64],
        outs: &[&Path],
        cut: bool,
        result: &Path,
    ) -> TracerRequest {
        TracerRequest {
            version: TracerRequest::VERSION,
            model: req.model.clone(),
            batches: batches.to_vec(),
            outs: outs.iter().map(|o| o.to_path_buf()).collect(),
            options: req.options.clone(),
            gpu_capability: req.gpu_capability.clone(),
            sdpa: req.sdpa,
            iterations: req.iterations,
            seq_lens: req.seq_lens.clone(),
            pipeline_rank: req.pipeline_rank,
            routing_imbalance: req.routing_imbalance,
            depths: if cut {
                depth::DEPTHS.to_vec()
            } else {
                Vec::new()
            },
            slopes: cut && carries_batch(batches),
            every_iteration: false,
            timeout_s: self.timeout_s,
            result: Some(result.to_path_buf()),
        }
    }

    /// `cut`: with `depths` (see [`TorchTracer::run_and_cache`]). In a fork of this process's
    /// tracer pool where it runs (see the `pool` module), else as a process of its own; either
    /// is killed (with what it forked) once it outlives `timeout_s`.
    fn run(
        &self,
        req: &TraceRequest,
        batches: &[u64],
        outs: &[&Path],
        cut: bool,
    ) -> Result<(), BridgeError> {
        // This run's own files (runs of one process and of others share the cache).
        let scratch = |what: &str| {
            self.cache_dir
                .join("traces")
                .join(format!("tracer.{}.{what}", temp_suffix()))
        };
        let (result, log) = (scratch("answer.json"), scratch("log"));
        let request = self.request(req, batches, outs, cut, &result);
        // The tracer's own alarm, which starts after its imports, answers a timeout cleanly;
        // gpumem's deadline, a little later, stops what ignored it.
        let deadline = std::time::Duration::from_secs(self.timeout_s.max(1) + DEADLINE_GRACE_S);
        let doc = serde_json::to_value(&request).map_err(|e| {
            self.io(
                &self.cache_dir,
                std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            )
        })?;
        let pooled = if req.model.starts_with(gpumem_core::job::LIVE_PREFIX) {
            let host = HOST.get().ok_or_else(|| {
                BridgeError::Reference(format!(
                    "{}: a live model is traced only by the Python process that holds it (the gpumem package's estimate)",
                    req.model
                ))
            })?;
            Some(host.run(&doc, &log, deadline))
        } else {
            self.pool().and_then(|p| p.run(&doc, &log, deadline).ok())
        };
        let ended = match pooled {
            Some(ended) => {
                let stderr = fs::read_to_string(&log).unwrap_or_default();
                let _ = fs::remove_file(&log);
                ended.map(|code| (code, stderr))
            }
            None => {
                let file = scratch("request.json");
                fs::write(&file, doc.to_string()).map_err(|e| self.io(&file, e))?;
                let mut cmd = self.module_command("gpumem_trace")?;
                cmd.arg("--request").arg(&file);
                let res = output_within(cmd, deadline).map_err(|source| BridgeError::Spawn {
                    python: self.python.clone(),
                    source,
                });
                let _ = fs::remove_file(&file);
                res?.map(|out| {
                    (
                        out.status.code(),
                        String::from_utf8_lossy(&out.stderr).into_owned(),
                    )
                })
            }
        };
        let answer = fs::read(&result)
            .ok()
            .and_then(|b| serde_json::from_slice::<TracerAnswer>(&b).ok());
        let _ = fs::remove_file(&result);
        if matches!((&ended, &answer), (Some((Some(0), _)), Some(a)) if a.status == AnswerStatus::Ok)
        {
            return Ok(());
        }
        for out in outs {
            let _ = fs::remove_file(out);
            for d in depth::DEPTHS {
                let _ = fs::remove_file(depth_path(out, d));
            }
        }
        let _ = fs::remove_file(result.with_extension("json.tmp"));
        remove_handed_failures(outs);
        let Some((code, stderr)) = ended else {
            return Err(BridgeError::Timeout {
                model: req.model.clone(),
                seconds: self.timeout_s,
            });
        };
        let Some(answer) = answer.filter(|a| a.status == AnswerStatus::Failed) else {
            return Err(BridgeError::Crashed {
                what: "tracer",
                how: code.map_or("ended by a signal".into(), |c| format!("exit status {c}")),
                tail: tail(&stderr, 3),
            });
        };
        Err(answer.into_error(&req.model, self.timeout_s))
    }

    /// `gpumem run`: `command` — `python SCRIPT ARGS…` or `python -m MODULE ARGS…`, run by
    /// that interpreter, unmodified — with CUDA stood in for as `gpu` (its display name,
    /// capability and memory), stopped after `steps` optimizer steps (backward passes where it
    /// makes no optimizer), and its trace. The script's output goes to this process's stderr;
    /// it is killed with what it started past the tracer's deadline.
    pub fn run_script(
        &self,
        command: &[String],
        steps: u32,
        gpu: &gpumem_core::profile::GpuProfile,
    ) -> Result<Trace, BridgeError> {
        let not_python = || {
            BridgeError::Reference(
                "gpumem run runs `python SCRIPT ARGS…` or `python -m MODULE ARGS…`".into(),
            )
        };
        let (python, script) = command.split_first().ok_or_else(not_python)?;
        let name = Path::new(python).file_name().and_then(|n| n.to_str());
        if script.is_empty() || !name.is_some_and(|n| n.starts_with("python")) {
            return Err(not_python());
        }
        let tracer = TorchTracer {
            python: python.clone(),
            ..self.clone()
        };
        let dir = self.cache_dir.join("traces");
        fs::create_dir_all(&dir).map_err(|e| self.io(&dir, e))?;
        let scratch = |what: &str| dir.join(format!("run.{}.{what}", temp_suffix()));
        let (out, result) = (scratch("trace.jsonl"), scratch("answer.json"));
        let stand_in = serde_json::json!({
            "display": gpu.display, "capability": gpu.compute_capability, "capacity_mib": gpu.capacity_mib,
        });
        let mut cmd = tracer.module_command("gpumem_trace.script")?;
        cmd.arg("--steps")
            .arg(steps.to_string())
            .arg("--gpu")
            .arg(stand_in.to_string())
            .arg("--out")
            .arg(&out)
            .arg("--result")
            .arg(&result)
            .arg("--timeout")
            .arg(self.timeout_s.max(1).to_string())
            .arg("--")
            .args(script);
        let deadline = std::time::Duration::from_secs(self.timeout_s.max(1) + DEADLINE_GRACE_S);
        let ended = status_within(cmd, deadline).map_err(|source| BridgeError::Spawn {
            python: python.clone(),
            source,
        })?;
        let answer = fs::read(&result)
            .ok()
            .and_then(|b| serde_json::from_slice::<TracerAnswer>(&b).ok());
        let _ = fs::remove_file(&result);
        let trace = read_trace(&out);
        let _ = fs::remove_file(&out);
        let model = format!("run:{}", script.join(" "));
        match (ended, answer, trace) {
            (None, ..) => Err(BridgeError::Timeout {
                model,
                seconds: self.timeout_s,
            }),
            (Some(_), Some(a), Some(t)) if a.status == AnswerStatus::Ok => Ok(t),
            (Some(_), Some(a), _) if a.status == AnswerStatus::Failed => {
                Err(a.into_error(&model, self.timeout_s))
            }
            (Some(status), ..) => Err(BridgeError::Crashed {
                what: "gpumem run",
                how: status
                    .code()
                    .map_or("ended by a signal".into(), |c| format!("exit status {c}")),
                tail: "its output is above".into(),
            }),
        }
    }

    /// This interpreter's tracer pool, started at its first trace.
    fn pool(&self) -> Option<std::sync::Arc<pool::Pool>> {
        let pkg = self.package_dir().ok()?;
        pool::Pool::shared(format!("{}\n{}", self.python, pkg.display()), || {
            self.module_command("gpumem_trace.pool").ok()
        })
    }

    /// The batch-symbolic trace of `req`'s model and options: from the cache, or fitted from
    /// traces at [`SymbolicTrace::FIT_BATCHES`] (one tracer run).
    pub fn symbolic(&self, req: &TraceRequest) -> Result<SymbolicTrace, BridgeError> {
        let torch = self.torch_version()?;
        if let Some(sym) = self.cached_symbolic(req, &torch) {
            return Ok(sym);
        }
        let batches = Self::fit_batches(req, None);
        let cached: Vec<Option<Trace>> = batches
            .iter()
            .map(|&b| {
                cached_trace(&self.cache_path(
                    &TraceRequest {
                        batch: b,
                        ..req.clone()
                    },
                    &torch,
                ))
            })
            .collect();
        let traces = if cached.iter().all(Option::is_some) {
            cached.into_iter().flatten().collect()
        } else {
            self.run_and_cache(req, &torch, &batches)?
        };
        self.cache_symbolic(req, &torch, &traces)
            .map_err(|source| BridgeError::NotAligned {
                model: req.model.clone(),
                source,
            })
    }
}

/// Runs `cmd` in a process group of its own, its output captured; `None` where it outlived
/// `limit` and was killed with everything it started (its group).
pub(crate) fn output_within(
    mut cmd: Command,
    limit: std::time::Duration,
) -> std::io::Result<Option<std::process::Output>> {
    use std::os::unix::process::CommandExt;
    use std::process::Stdio;
    dies_with_this_process(&mut cmd);
    let mut child = cmd
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    // Drained in threads: a full pipe must not stall the child.
    let drain = |mut r: Box<dyn std::io::Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            v
        })
    };
    let read_out = drain(Box::new(child.stdout.take().expect("piped")));
    let read_err = drain(Box::new(child.stderr.take().expect("piped")));
    let status = wait_within(&mut child, limit)?;
    // A killed group's pipes close with it (a straggler holding them is killed too).
    let (stdout, stderr) = (
        read_out.join().unwrap_or_default(),
        read_err.join().unwrap_or_default(),
    );
    Ok(status.map(|status| std::process::Output {
        status,
        stdout,
        stderr,
    }))
}

/// `cmd`'s exit status, its output on this process's stderr (stdout too: this process's own
/// stdout stays its answer's), `None` where it outlived `limit` and was killed with its group.
fn status_within(
    mut cmd: Command,
    limit: std::time::Duration,
) -> std::io::Result<Option<std::process::ExitStatus>> {
    use std::os::fd::AsFd;
    use std::os::unix::process::CommandExt;
    let stderr = std::io::stderr().as_fd().try_clone_to_owned()?;
    dies_with_this_process(&mut cmd);
    let mut child = cmd.process_group(0).stdout(stderr).spawn()?;
    wait_within(&mut child, limit)
}

/// A child in a group of its own is out of reach of a terminal's Ctrl-C: it dies with this
/// process instead.
fn dies_with_this_process(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    // SAFETY: prctl(2) is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// The child's exit status, or `None` where it outlived `limit` (then its group is killed).
fn wait_within(
    child: &mut std::process::Child,
    limit: std::time::Duration,
) -> std::io::Result<Option<std::process::ExitStatus>> {
    let start = std::time::Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if start.elapsed() > limit {
            kill_group(child.id());
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// SIGKILL to the process group `pid` leads.
fn kill_group(pid: u32) {
    if let Ok(pid) = i32::try_from(pid) {
        // SAFETY: kill(2) with a negative pid signals a group; no memory is involved.
        unsafe {
            libc::kill(-pid, libc::SIGKILL);
        }
    }
}

/// Whether a cut run of `batches` traces the whole depth at one of them and carries the batch
/// over from the model cut to the shallowest depth at each (`--slopes`).
fn carries_batch(batches: &[u64]) -> bool {
    batches.len() >= SymbolicTrace::FIT_BATCHES.len()
}

/// Removes what the tracer's forks hand back beside `outs` (`OUT.failure.PID`), which a killed
/// run leaves behind.
fn remove_handed_failures(outs: &[&Path]) {
    for out in outs {
        let (Some(dir), Some(name)) = (out.parent(), out.file_name()) else {
            continue;
        };
        let prefix = format!("{}.failure.", name.to_string_lossy());
        for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = fs::remove_file(entry.path());
            }
        }
    }
}

/// Where the tracer writes `out`'s trace cut to `depth` blocks.
fn depth_path(out: &Path, depth: u32) -> PathBuf {
    let mut p = out.as_os_str().to_owned();
    p.push(format!(".depth{depth}"));
    PathBuf::from(p)
}

fn read_trace(path: &Path) -> Option<Trace> {
    Trace::read(BufReader::new(fs::File::open(path).ok()?)).ok()
}

/// A trace from the cache, marked as used ([`cache::touch`]).
fn cached_trace(path: &Path) -> Option<Trace> {
    let t = read_trace(path)?;
    cache::touch(path);
    Some(t)
}

fn mtime(p: &Path) -> Option<u128> {
    fs::metadata(p)
        .ok()?
        .modified()
        .ok()?
        .duration_since(UNIX_EPOCH)
        .ok()
        .map(|d| d.as_nanos())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_schema_is_committed() {
        // The Python tests hold the tracer's loader to this file; it must be the Rust types'.
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../python/gpumem_trace/request.schema.json");
        let schema = TracerRequest::schema();
        if std::env::var_os("GPUMEM_BLESS").is_some() {
            fs::write(&path, &schema).unwrap();
        }
        assert_eq!(
            fs::read_to_string(&path).unwrap_or_default(),
            schema,
            "regenerate it: GPUMEM_BLESS=1 cargo test -p gpumem-torch the_request_schema"
        );
    }

    #[test]
    fn every_tracer_source_is_embedded() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../python/gpumem_trace");
        let mut on_disk: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".py"))
            .collect();
        on_disk.sort();
        let embedded: Vec<&str> = SOURCES.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            on_disk, embedded,
            "SOURCES must list python/gpumem_trace/*.py, sorted"
        );
    }

    #[test]
    fn a_missing_interpreter_is_a_clear_error() {
        let t = TorchTracer {
            python: "/nonexistent/python".into(),
            cache_dir: std::env::temp_dir().join("gpumem-bridge-test"),
            cache_max_bytes: 0,
            timeout_s: 5,
        };
        let e = t
            .trace(&TraceRequest::new("timm:resnet50", 2))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot run the Python interpreter `/nonexistent/python`"),
            "{e}"
        );
    }
}
