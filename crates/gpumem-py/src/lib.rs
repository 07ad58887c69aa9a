//! `gpumem._native`: the Rust core inside the Python process, for the `gpumem` package
//! (python/gpumem). Each function takes the job as the job document spells it (a model
//! reference, a batch size, the options as JSON) and answers JSON: the same report
//! `gpumem estimate --json` prints, built by the same code ([`EstimateReport`]), so the package
//! and the command say the same of a job to the byte. The interpreter's lock is released while
//! a job is sized; a live model's trace is handed back to Python ([`HostTracer`]), which traces
//! it in a fork of itself, where the model object is.

use std::path::Path;
use std::time::Duration;

use gpumem_core::profile::{self, GpuProfile};
use gpumem_core::trace::Trace;
use gpumem_core::utilization::{HostModel, physical};
use gpumem_torch::{BridgeError, HostTracer};
use gpumem_workload::plan::PlanRequest;
use gpumem_workload::report::EstimateReport;
use gpumem_workload::train_config::{self, TrainConfig, TrainerKind};
use gpumem_workload::{ModelRef, Options, SizeError, Workload, WorkloadError};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

// Raised with `(kind, message)`; the package raises the exception class of each kind.
pyo3::create_exception!(_native, NativeError, PyException);

/// Why a job could not be sized, by the kind the package names it.
enum Failure {
    /// The job as stated is wrong: its model reference, an option, the GPU.
    Input(String),
    /// The model failed while it was traced.
    Model(String),
    /// The trace outlived its deadline.
    Timeout(String),
    /// The interpreter or torch.
    Python(String),
    /// Anything else (a cache that cannot be written, a trace that cannot be searched).
    Other(String),
}

impl Failure {
    fn into_py(self) -> PyErr {
        let (kind, message) = match self {
            Failure::Input(m) => ("input", m),
            Failure::Model(m) => ("model", m),
            Failure::Timeout(m) => ("timeout", m),
            Failure::Python(m) => ("python", m),
            Failure::Other(m) => ("other", m),
        };
        NativeError::new_err((kind, message))
    }
}

impl From<BridgeError> for Failure {
    fn from(e: BridgeError) -> Failure {
        let m = e.to_string();
        match e {
            BridgeError::Reference(_) => Failure::Input(m),
            BridgeError::Timeout { .. } => Failure::Timeout(m),
            BridgeError::NoTorch(_) | BridgeError::Spawn { .. } => Failure::Python(m),
            e if e.is_model_failure() => Failure::Model(m),
            _ => Failure::Other(m),
        }
    }
}

impl From<WorkloadError> for Failure {
    fn from(e: WorkloadError) -> Failure {
        match e {
            WorkloadError::Tracer(b) => b.into(),
            e if e.is_input() => Failure::Input(e.to_string()),
            e => Failure::Other(e.to_string()),
        }
    }
}

impl From<SizeError> for Failure {
    fn from(e: SizeError) -> Failure {
        match e {
            SizeError::Workload(w) => w.into(),
            // As `gpumem estimate` reports an estimator's refusal: a job no GPU holds.
            SizeError::Estimate(e) => Failure::Input(e.to_string()),
            SizeError::Search(e) => Failure::Other(e.to_string()),
        }
    }
}

/// The GPU: a profile TOML's text where given, else a built-in profile by name.
fn load_profile(gpu: &str, toml: Option<&str>) -> Result<GpuProfile, Failure> {
    match toml {
        Some(text) => GpuProfile::from_toml(text).map_err(|e| Failure::Input(e.to_string())),
        None => profile::builtin(gpu).map_err(|e| Failure::Input(e.to_string())),
    }
}

/// A trainer's config as the package hands it over: its text, the name errors give it, its
/// kind where the caller knows it (`hf-trainer` for a Trainer's own arguments).
#[derive(serde::Deserialize)]
struct StatedConfig {
    file: String,
    text: String,
    kind: Option<String>,
}

fn train_config(config: Option<&str>) -> Result<Option<TrainConfig>, Failure> {
    let Some(config) = config else {
        return Ok(None);
    };
    let c: StatedConfig =
        serde_json::from_str(config).map_err(|e| Failure::Input(format!("train_config: {e}")))?;
    let kind = c
        .kind
        .as_deref()
        .map(TrainerKind::parse)
        .transpose()
        .map_err(|e| Failure::Input(e.to_string()))?;
    let dir = std::env::current_dir().unwrap_or_default();
    train_config::read_text(&c.file, &c.text, &dir, kind)
        .map(Some)
        .map_err(|e| Failure::Input(e.to_string()))
}

/// The job: `model` (a reference, Hub id or config path) at `batch` with the job document's
/// `options` (JSON) and what a trainer's config states over them, checked as every entry
/// point checks them.
fn workload(
    model: &str,
    batch: u64,
    options: &str,
    config: Option<&TrainConfig>,
) -> Result<Workload, Failure> {
    let mut options: Options =
        serde_json::from_str(options).map_err(|e| Failure::Input(format!("options: {e}")))?;
    if let Some(c) = config {
        let world = options.strategy.map(|s| s.world_size());
        options = c
            .over(options.values(), world)
            .map_err(|e| Failure::Input(e.to_string()))?;
    }
    let model = ModelRef::parse(model.trim()).map_err(|e| Failure::Input(e.to_string()))?;
    Ok(Workload::new(model, batch, options)?)
}

fn replay() -> Box<dyn gpumem_core::estimate::Estimator> {
    gpumem_core::estimate::by_name("replay").expect("replay is an estimator")
}

fn json(value: &impl serde::Serialize) -> Result<String, Failure> {
    serde_json::to_string(value).map_err(|e| Failure::Other(e.to_string()))
}

fn estimate_report(
    model: &str,
    batch: u64,
    options: &str,
    gpu: &str,
    toml: Option<&str>,
    config: Option<&str>,
) -> Result<String, Failure> {
    let profile = load_profile(gpu, toml)?;
    let config = train_config(config)?;
    let job = workload(model, batch, options, config.as_ref())?;
    // As `gpumem estimate` sizes it: a run whose lengths vary through one allocator, else
    // every reading of the model (fitting its batch-symbolic trace for the next batch size).
    let mut report = match job.run(&profile, replay().as_ref())? {
        Some(run) => {
            let util = physical(&run.trace, &profile, &HostModel::default());
            let strategy = job.options().strategy;
            EstimateReport::new(
                &run.trace,
                &run.estimate,
                &util,
                strategy,
                &[],
                Some(run.report),
            )
        }
        None => job
            .size(&profile, replay().as_ref(), Workload::trace_for_reestimates)?
            .report(&profile),
    };
    report.train_config = config.map(|c| c.to_json(&[]));
    json(&report)
}

/// `gpumem estimate --json` of the job, as a JSON text.
#[pyfunction]
#[pyo3(signature = (model, batch, options, gpu, profile=None, train_config=None))]
fn estimate(
    py: Python<'_>,
    model: String,
    batch: u64,
    options: String,
    gpu: String,
    profile: Option<String>,
    train_config: Option<String>,
) -> PyResult<String> {
    py.detach(move || {
        estimate_report(
            &model,
            batch,
            &options,
            &gpu,
            profile.as_deref(),
            train_config.as_deref(),
        )
    })
    .map_err(Failure::into_py)
}

fn max_batch_report(
    model: &str,
    options: &str,
    gpu: &str,
    toml: Option<&str>,
    config: Option<&str>,
) -> Result<String, Failure> {
    let profile = load_profile(gpu, toml)?;
    let config = train_config(config)?;
    let best =
        workload(model, 1, options, config.as_ref())?.max_batch(&profile, replay().as_ref())?;
    json(&match best {
        None => serde_json::json!({"gpu": profile.name, "max_batch": 0}),
        Some((batch, e)) => serde_json::json!({
            "gpu": profile.name,
            "max_batch": batch,
            "peak_bytes": e.peak_bytes,
            "upper_bound_bytes": e.upper_bound_bytes,
            "capacity_bytes": e.capacity_bytes,
        }),
    })
}

/// `gpumem max-batch` of the job: the largest batch whose upper bound fits, as a JSON text.
#[pyfunction]
#[pyo3(signature = (model, options, gpu, profile=None, train_config=None))]
fn max_batch(
    py: Python<'_>,
    model: String,
    options: String,
    gpu: String,
    profile: Option<String>,
    train_config: Option<String>,
) -> PyResult<String> {
    py.detach(move || {
        max_batch_report(
            &model,
            &options,
            &gpu,
            profile.as_deref(),
            train_config.as_deref(),
        )
    })
    .map_err(Failure::into_py)
}

fn plan_report(
    model: &str,
    options: &str,
    gpu: &str,
    toml: Option<&str>,
    request: &str,
) -> Result<String, Failure> {
    let profile = load_profile(gpu, toml)?;
    let request: PlanRequest =
        serde_json::from_str(request).map_err(|e| Failure::Input(format!("plan: {e}")))?;
    let base = workload(model, 1, options, None)?;
    let (space, link, world) = request
        .space(&base, &profile)
        .map_err(|e| Failure::Input(e.as_argument()))?;
    let plan =
        gpumem_workload::plan::plan(&base, &profile, replay().as_ref(), &space, link, &|_, _| {})?;
    json(&plan.to_json(&base.model().to_string(), &profile, &space, world, link))
}

/// `gpumem plan --json` of the job: the fastest setups that fit, as a JSON text.
#[pyfunction]
#[pyo3(signature = (model, options, gpu, request, profile=None))]
fn plan(
    py: Python<'_>,
    model: String,
    options: String,
    gpu: String,
    request: String,
    profile: Option<String>,
) -> PyResult<String> {
    py.detach(move || plan_report(&model, &options, &gpu, profile.as_deref(), &request))
        .map_err(Failure::into_py)
}

fn trace_report(trace: &str, gpu: &str, toml: Option<&str>) -> Result<String, Failure> {
    let profile = load_profile(gpu, toml)?;
    let trace = Trace::read(trace.as_bytes()).map_err(|e| Failure::Input(format!("trace: {e}")))?;
    let est = replay()
        .estimate(&trace, &profile)
        .map_err(|e| Failure::Input(e.to_string()))?;
    let util = physical(&trace, &profile, &HostModel::default());
    json(&EstimateReport::new(&trace, &est, &util, None, &[], None))
}

/// `gpumem estimate TRACE --json` of a trace's text (the one `gpumem.track` records).
#[pyfunction]
#[pyo3(signature = (trace, gpu, profile=None))]
fn estimate_trace(
    py: Python<'_>,
    trace: String,
    gpu: String,
    profile: Option<String>,
) -> PyResult<String> {
    py.detach(move || trace_report(&trace, &gpu, profile.as_deref()))
        .map_err(Failure::into_py)
}

/// The built-in GPU profiles (`gpumem gpus --json`), as a JSON text.
#[pyfunction]
fn gpus() -> PyResult<String> {
    json(&profile::catalogue()).map_err(Failure::into_py)
}

/// A Python callable `run(request_json, log_path, deadline_s) -> int | None` as this process's
/// host tracer: the exit code of the fork that traced the request (negative: the signal that
/// ended it), `None` where it outlived the deadline and was killed.
struct PyHost(Py<PyAny>);

impl HostTracer for PyHost {
    fn run(
        &self,
        request: &serde_json::Value,
        log: &Path,
        deadline: Duration,
    ) -> Option<Option<i32>> {
        Python::attach(|py| {
            let log_text = log.to_string_lossy().into_owned();
            let answer = self
                .0
                .call1(py, (request.to_string(), log_text, deadline.as_secs_f64()))
                .and_then(|code| code.bind(py).extract::<Option<i32>>());
            match answer {
                Ok(Some(code)) if code >= 0 => Some(Some(code)),
                Ok(Some(_)) => Some(None),
                Ok(None) => None,
                Err(e) => {
                    // The runner itself failed: said in the log the tracer's failure is read from.
                    let _ = std::fs::write(log, format!("the host tracer failed: {e}\n"));
                    Some(Some(3))
                }
            }
        })
    }
}

/// Makes `runner` this process's host tracer (once; `False` where one is set already).
#[pyfunction]
fn set_host_tracer(runner: Bound<'_, PyAny>) -> bool {
    gpumem_torch::set_host_tracer(Box::new(PyHost(runner.unbind())))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(estimate, m)?)?;
    m.add_function(wrap_pyfunction!(max_batch, m)?)?;
    m.add_function(wrap_pyfunction!(plan, m)?)?;
    m.add_function(wrap_pyfunction!(estimate_trace, m)?)?;
    m.add_function(wrap_pyfunction!(gpus, m)?)?;
    m.add_function(wrap_pyfunction!(set_host_tracer, m)?)?;
    m.add("NativeError", m.py().get_type::<NativeError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
