//! The subcommands.

use std::fs::File;
use std::io::{BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use clap::Args;
use gpumem_core::calibrate::fit_context;
use gpumem_core::dataset::{Measurement, ModelRef, is_input_shape, read_measurements};
use gpumem_core::estimate::{Breakdown, ESTIMATORS, Estimate, Estimator, PeakAt, Replay, by_name};
use gpumem_core::eval::{Metrics, Outcome, metrics};
use gpumem_core::families::{JobOptions, MAX_BATCH, ModelSpec};
use gpumem_core::graph::Precision;
use gpumem_core::profile::{self, GpuProfile};
use gpumem_torch::{BridgeError, TorchTracer, TraceRequest, is_reference};
use gpumem_core::search;
use gpumem_core::step::Optimizer;
use gpumem_core::trace::Trace;
use gpumem_core::units::bytes_to_mib;
use gpumem_core::utilization::{HostModel, Utilization, physical};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::{CliError, CliResult};

/// The model `gpumem estimate` uses when none is given: the first row of the seed's MLP data.
pub const DEFAULT_MODEL: &str = "mlp:input=2346,output=197,depth=2,arch=pyramid,act=relu,dropout=0.338,batchnorm=true,samples=4096,summary=true";
const DEFAULT_BATCH: u64 = 996;

/// Which GPU: a built-in profile or a profile file.
#[derive(Args, Clone)]
pub struct GpuChoice {
    /// Built-in GPU profile (see `gpumem gpus`).
    #[arg(long, default_value = "a100-40gb")]
    gpu: String,
    /// A profile TOML file (for example one written by `gpumem calibrate`); overrides --gpu.
    #[arg(long)]
    profile: Option<PathBuf>,
}

impl GpuChoice {
    pub fn new(gpu: &str, profile: Option<PathBuf>) -> Self {
        GpuChoice { gpu: gpu.into(), profile }
    }

    pub fn load(&self) -> CliResult<GpuProfile> {
        match &self.profile {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| CliError::input(format!("{}: {e}", path.display())))?;
                GpuProfile::from_toml(&text).map_err(|e| CliError::input(format!("{}: {e}", path.display())))
            }
            None => profile::builtin(&self.gpu).map_err(CliError::input),
        }
    }
}

/// `COUNTxGPU` (e.g. `4xa100-40gb`) of option `flag`, with 1..=`max` GPUs.
pub fn gpu_count<'a>(flag: &str, spec: &'a str, max: usize) -> CliResult<(usize, &'a str)> {
    spec.split_once('x')
        .and_then(|(n, g)| Some((n.parse::<usize>().ok().filter(|n| (1..=max).contains(n))?, g)))
        .ok_or_else(|| CliError::input(format!("{flag} `{spec}` is not COUNTxGPU (e.g. 4xa100-40gb)")))
}

/// The training job around a model.
#[derive(Args, Clone)]
pub struct JobArgs {
    /// Optimizer: adam, adamw, sgd or sgd-momentum.
    #[arg(long, default_value = "adam")]
    optimizer: String,
    /// Precision: fp32, amp-fp16, amp-bf16 (autocast), or fp16/bf16 (pure: weights, gradients
    /// and optimizer state in that dtype; PyTorch models).
    #[arg(long, default_value = "fp32")]
    precision: String,
    /// Input shape CxHxW (PyTorch image models; default: the model's own).
    #[arg(long)]
    input: Option<String>,
    /// Sequence length (PyTorch sequence models).
    #[arg(long)]
    seq_len: Option<u64>,
    /// Activation checkpointing (PyTorch models that support it).
    #[arg(long)]
    checkpointing: bool,
    /// channels_last memory format (PyTorch image models).
    #[arg(long)]
    channels_last: bool,
    /// Gradient accumulation steps (PyTorch models).
    #[arg(long, default_value_t = 1)]
    grad_accum: u32,
    /// GPUs of a torch.nn.DataParallel job (PyTorch models): --batch is then the whole batch
    /// the wrapper splits, and the estimate is GPU 0's, the most loaded.
    #[arg(long, default_value_t = 1)]
    data_parallel: u32,
    /// After training, two eval-mode batches (PyTorch models): none, no-grad, or grad (a
    /// validation loop without torch.no_grad(), which keeps each output's graph alive).
    #[arg(long, default_value = "none", value_parser = ["none", "no-grad", "grad"])]
    validate: String,
    /// Whether the training loop holds the model's output through backward (PyTorch models):
    /// kept (`outputs = model(x); loss = criterion(outputs, y)`) or dropped (`loss =
    /// model(**batch).loss`, as Hugging Face's Trainer runs). Default: dropped for hf: models,
    /// kept for the others.
    #[arg(long, value_parser = ["kept", "dropped"])]
    outputs: Option<String>,
    /// Hugging Face models: `padded` passes the attention mask of a padded batch, which the
    /// model materialises (and which keeps flash attention out); `none` passes no mask.
    #[arg(long, default_value = "none", value_parser = ["none", "padded"])]
    attention_mask: String,
}

impl JobArgs {
    fn options(&self, batch: i64, profile: &GpuProfile) -> CliResult<JobOptions> {
        if batch < 1 || batch as u64 > MAX_BATCH {
            return Err(CliError::input(format!("--batch {batch} is out of range (1..={MAX_BATCH})")));
        }
        let mut job = JobOptions::on(profile, batch as u64);
        job.optimizer = Optimizer::parse(&self.optimizer).map_err(CliError::input)?;
        job.precision = Precision::parse(&self.precision).map_err(CliError::input)?;
        Ok(job)
    }

    /// The tracer request for a PyTorch reference.
    fn request(&self, model: &str, job: &JobOptions, profile: &GpuProfile) -> CliResult<TraceRequest> {
        if self.grad_accum == 0 {
            return Err(CliError::input("--grad-accum must be at least 1"));
        }
        if self.data_parallel == 0 || self.data_parallel > 64 {
            return Err(CliError::input(format!("--data-parallel {} is out of range (1..=64)", self.data_parallel)));
        }
        if let Some(i) = &self.input
            && !is_input_shape(i)
        {
            return Err(CliError::input(format!("--input `{i}` is not CxHxW")));
        }
        let mut r = TraceRequest::for_gpu(model, job.batch, profile);
        r.optimizer = job.optimizer.name().into();
        r.precision = job.precision.name().into();
        r.input = self.input.clone();
        r.seq_len = self.seq_len;
        r.checkpointing = self.checkpointing;
        r.channels_last = self.channels_last;
        r.grad_accum = self.grad_accum;
        r.data_parallel = self.data_parallel;
        r.validate = self.validate.clone();
        r.outputs = self.outputs.clone();
        r.attention_mask = self.attention_mask.clone();
        Ok(r)
    }

    fn native_only_check(&self) -> CliResult {
        if self.input.is_some() || self.seq_len.is_some() || self.checkpointing || self.channels_last || self.grad_accum != 1 || self.data_parallel != 1 || self.validate != "none" || self.outputs.is_some() || self.attention_mask != "none" {
            return Err(CliError::input(
                "--input, --seq-len, --checkpointing, --channels-last, --grad-accum, --data-parallel, --validate, --outputs and --attention-mask apply to PyTorch models (torchvision:, timm:, hf:, smp:, py:)",
            ));
        }
        Ok(())
    }
}

fn bridge_error(e: BridgeError) -> CliError {
    match e {
        BridgeError::BadReference(m) => CliError::Input(m),
        BridgeError::Io(m) => CliError::Other(m),
        BridgeError::Python(m) | BridgeError::Model(m) => CliError::Model(m),
    }
}

/// A model argument: a native spec, a trace file, or a PyTorch reference.
enum Model {
    Native(ModelSpec),
    TraceFile(Trace),
    Torch(String),
}

fn load_model(arg: &str) -> CliResult<Model> {
    let path = Path::new(arg);
    if path.is_file() {
        let f = File::open(path).map_err(|e| CliError::input(format!("{arg}: {e}")))?;
        return Trace::read(BufReader::new(f)).map(Model::TraceFile).map_err(|e| CliError::input(format!("{arg}: {e}")));
    }
    if arg.ends_with(".jsonl") || arg.ends_with(".trace") {
        return Err(CliError::input(format!("{arg}: no such trace file")));
    }
    if is_reference(arg) {
        return Ok(Model::Torch(arg.to_string()));
    }
    ModelSpec::parse(arg).map(Model::Native).map_err(CliError::input)
}

fn model_trace(model: &Model, args: &JobArgs, job: &JobOptions, profile: &GpuProfile) -> CliResult<Trace> {
    match model {
        Model::Native(m) => {
            args.native_only_check()?;
            m.trace(job).map_err(CliError::input)
        }
        Model::TraceFile(t) => Ok(t.clone()),
        Model::Torch(r) => TorchTracer::from_env().trace_for_reestimates(&args.request(r, job, profile)?).map_err(bridge_error),
    }
}

fn estimator(name: &str) -> CliResult<Box<dyn Estimator>> {
    by_name(name).map_err(|e| CliError::input(if name == "learned" { "--estimator learned applies to `estimate` with --learned-model".into() } else { e.to_string() }))
}

fn mib(b: u64) -> f64 {
    (bytes_to_mib(b) * 10.0).round() / 10.0
}

#[derive(Args)]
pub struct EstimateArgs {
    /// A native spec (mlp:…, cnn:…, transformer:…), a PyTorch reference (torchvision:, timm:,
    /// hf:, smp:, py:) or a trace file. Default: a seed MLP.
    model: Option<String>,
    /// Batch size (ignored for trace files, which fix their own).
    #[arg(long, allow_negative_numbers = true)]
    batch: Option<i64>,
    #[command(flatten)]
    job: JobArgs,
    #[command(flatten)]
    gpu: GpuChoice,
    /// replay (default), live-tensors, horus, or learned (the hybrid: needs a memory model from
    /// `gpumem learn train --target memory --model gbt` in --learned-model).
    #[arg(long, default_value = "replay")]
    estimator: String,
    /// A model from `gpumem learn train` (repeatable): a memory model adds its estimate (and
    /// bound), a utilization model replaces the physical model's figure. Native specs only.
    #[arg(long)]
    learned_model: Vec<PathBuf>,
    /// Draw the replay's memory over the traced step (live bytes per category stacked,
    /// reserved memory as a line) into this SVG file.
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Print one JSON object (see docs/json.md).
    #[arg(long)]
    json: bool,
}

/// A learned model's answer for the job.
#[derive(Serialize)]
struct LearnedJson {
    target: &'static str,
    model: String,
    value: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    upper: Option<f64>,
}

fn learned_needs_native() -> CliError {
    CliError::input("--learned-model needs a native model spec (its features come from the model's layers)")
}

/// The learned models' predictions for a native model, and the utilization they leave.
fn learned(paths: &[PathBuf], model: &Model, trace: &Trace, batch: u64, profile: &GpuProfile, util: &mut Utilization) -> CliResult<Vec<LearnedJson>> {
    if paths.is_empty() {
        return Ok(Vec::new());
    }
    let Model::Native(spec) = model else { return Err(learned_needs_native()) };
    let summary = gpumem_learn::features::trace_summary(trace, profile).map_err(CliError::input)?;
    let sample = gpumem_learn::Sample::new(0, spec.to_spec_string(), String::new(), gpumem_learn::features::ModelFacts::of_native(spec, batch), summary);
    let mut out = Vec::new();
    for path in paths {
        let m = crate::learn::read_model(path)?;
        let p = m.predict(&[&sample]).map_err(CliError::input)?[0];
        use gpumem_learn::Target;
        match m.target {
            Target::Memory => {}
            Target::Smact => util.smact = p.value,
            Target::Smocc => util.smocc = p.value,
            Target::Gract => util.gract = p.value,
            Target::Dram => util.dram = p.value,
            Target::Fp32 => util.fp32 = p.value,
        }
        out.push(LearnedJson { target: m.target.name(), model: path.display().to_string(), value: p.value, upper: p.upper });
    }
    Ok(out)
}

/// The stable JSON output of `estimate`.
#[derive(Serialize)]
struct EstimateJson<'a> {
    model: String,
    batch_size: u64,
    estimator: &'a str,
    gpu: &'a str,
    peak_mib: f64,
    peak_bytes: u64,
    upper_bound_mib: f64,
    upper_bound_bytes: u64,
    capacity_mib: f64,
    fits: bool,
    upper_bound_fits: bool,
    breakdown: serde_json::Map<String, serde_json::Value>,
    breakdown_bytes: &'a gpumem_core::estimate::Breakdown,
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_at: Option<&'a PeakAt>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reserved_peak: Option<MomentJson<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    allocator: Option<&'a gpumem_core::allocator::AllocatorStats>,
    /// Run-average DCGM fields (physical model, or learned models where given).
    utilization: UtilizationJson,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    learned: Vec<LearnedJson>,
}

/// The breakdown at the peak of reserved memory, where it is not the allocated peak's.
#[derive(Serialize)]
struct MomentJson<'a> {
    peak_at: &'a PeakAt,
    allocated_mib: f64,
    reserved_mib: f64,
    breakdown: serde_json::Map<String, serde_json::Value>,
    breakdown_bytes: &'a Breakdown,
}

fn breakdown_mib(b: &Breakdown) -> serde_json::Map<String, serde_json::Value> {
    b.items().iter().map(|(k, v)| (format!("{k}_mib"), serde_json::json!(mib(*v)))).collect()
}

#[derive(Serialize)]
struct UtilizationJson {
    smact: f64,
    smocc: f64,
    gract: f64,
    dram: f64,
    fp32: f64,
    step_ms: f64,
}

pub fn estimate(a: EstimateArgs) -> CliResult {
    let profile = a.gpu.load()?;
    let (spec, batch) = match &a.model {
        Some(m) => (m.clone(), a.batch.unwrap_or(32)),
        None => (DEFAULT_MODEL.to_string(), a.batch.unwrap_or(DEFAULT_BATCH as i64)),
    };
    let model = load_model(&spec)?;
    if !a.learned_model.is_empty() && !matches!(model, Model::Native(_)) {
        return Err(learned_needs_native());
    }
    let job = a.job.options(batch, &profile)?;
    let trace = model_trace(&model, &a.job, &job, &profile)?;
    let hybrid = a.estimator == "learned";
    let mut est = if a.timeline.is_some() {
        if hybrid || a.estimator != "replay" {
            return Err(CliError::input("--timeline draws the replay estimator's allocator; use --estimator replay"));
        }
        Replay { timeline: true }.estimate(&trace, &profile)
    } else {
        estimator(if hybrid { "replay" } else { &a.estimator })?.estimate(&trace, &profile)
    }
    .map_err(CliError::input)?;
    if let Some(svg) = &a.timeline {
        let title = format!("{} · batch {} · {}", trace.header.model, trace.header.batch_size, profile.name);
        crate::plot::memory_timeline(svg, &title, &est.timeline, est.peak_at.as_ref().map(|p| p.event)).map_err(CliError::other)?;
    }
    let model_name = trace.header.model.clone();
    let mut util = physical(&trace, &profile, &HostModel::default());
    let learned = learned(&a.learned_model, &model, &trace, trace.header.batch_size, &profile, &mut util)?;
    if hybrid {
        // The hybrid: replay's breakdown, the learned peak and its conformal bound.
        let Some(l) = learned.iter().find(|l| l.target == "memory" && l.upper.is_some()) else {
            return Err(CliError::input("--estimator learned needs a hybrid memory model: --learned-model M.json (gpumem learn train --target memory --model gbt)"));
        };
        est.estimator = "learned";
        est.peak_bytes = gpumem_core::units::mib_to_bytes(l.value);
        est.upper_bound_bytes = gpumem_core::units::mib_to_bytes(l.upper.unwrap_or(l.value)).max(est.peak_bytes);
        est.fits = est.fits && est.peak_bytes <= est.capacity_bytes;
    }
    if a.json {
        let out = EstimateJson {
            model: model_name,
            batch_size: trace.header.batch_size,
            estimator: est.estimator,
            gpu: &est.gpu,
            peak_mib: mib(est.peak_bytes),
            peak_bytes: est.peak_bytes,
            upper_bound_mib: mib(est.upper_bound_bytes),
            upper_bound_bytes: est.upper_bound_bytes,
            capacity_mib: mib(est.capacity_bytes),
            fits: est.fits,
            upper_bound_fits: est.upper_bound_bytes <= est.capacity_bytes,
            breakdown: breakdown_mib(&est.breakdown),
            breakdown_bytes: &est.breakdown,
            peak_at: est.peak_at.as_ref(),
            reserved_peak: est.reserved_peak.as_ref().map(|m| MomentJson {
                peak_at: &m.at,
                allocated_mib: mib(m.allocated),
                reserved_mib: mib(m.reserved),
                breakdown: breakdown_mib(&m.breakdown),
                breakdown_bytes: &m.breakdown,
            }),
            allocator: est.allocator.as_ref(),
            utilization: UtilizationJson { smact: util.smact, smocc: util.smocc, gract: util.gract, dram: util.dram, fp32: util.fp32, step_ms: util.step_s * 1e3 },
            learned,
        };
        println!("{}", serde_json::to_string_pretty(&out).map_err(CliError::other)?);
        return Ok(());
    }
    print_estimate(&model_name, trace.header.batch_size, trace.header.iterations, &profile, &est);
    println!();
    println!(
        "utilization  SMACT {:.2}  SMOCC {:.2}  GRACT {:.2}  DRAMA {:.2}  FP32A {:.2}  ({:.1} ms/step){}",
        util.smact,
        util.smocc,
        util.gract,
        util.dram,
        util.fp32,
        util.step_s * 1e3,
        if learned.iter().any(|l| l.target != "memory") { "  [learned where given]" } else { "  [physical model]" }
    );
    for l in learned.iter().filter(|l| l.target == "memory") {
        match l.upper {
            Some(u) => println!("learned      {:.1} MiB, upper bound {u:.1} MiB ({})", l.value, l.model),
            None => println!("learned      {:.1} MiB ({})", l.value, l.model),
        }
    }
    Ok(())
}

fn print_estimate(model: &str, batch: u64, iterations: u32, profile: &GpuProfile, est: &Estimate) {
    println!("model      {model}");
    println!("batch      {batch}");
    println!("gpu        {} ({} MiB)", profile.display, profile.capacity_mib);
    println!("estimator  {}", est.estimator);
    println!();
    println!("peak         {:>10.1} MiB   (as nvidia-smi will show it)", bytes_to_mib(est.peak_bytes));
    println!("upper bound  {:>10.1} MiB", bytes_to_mib(est.upper_bound_bytes));
    let verdict = match (est.fits, est.upper_bound_bytes <= est.capacity_bytes) {
        (true, true) => "fits, with its upper bound",
        (true, false) => "fits, but its upper bound does not: little headroom",
        (false, _) => "does NOT fit: out of memory",
    };
    println!("verdict      {verdict}");
    println!();
    match &est.peak_at {
        Some(at) => println!("at the peak of allocated memory — {}:", at.describe(iterations)),
        None => println!("at the peak:"),
    }
    print_breakdown(&est.breakdown);
    if let Some(m) = &est.reserved_peak {
        println!();
        println!(
            "the peak of reserved memory, {:.1} MiB (with {:.1} MiB allocated) — {}:",
            bytes_to_mib(m.reserved),
            bytes_to_mib(m.allocated),
            m.at.describe(iterations)
        );
        print_breakdown(&m.breakdown);
    }
}

fn print_breakdown(b: &Breakdown) {
    for (name, bytes) in b.items() {
        if bytes > 0 {
            let note = if name == "allocator_slack" { "   (reserved − allocated: cached and split blocks, rounding)" } else { "" };
            println!("  {name:<16} {:>10.1} MiB{note}", bytes_to_mib(bytes));
        }
    }
}

#[derive(Args)]
pub struct MaxBatchArgs {
    /// A native model spec or a PyTorch reference (torchvision:, timm:, hf:, smp:, py:).
    model: String,
    #[command(flatten)]
    job: JobArgs,
    #[command(flatten)]
    gpu: GpuChoice,
    #[arg(long, default_value = "replay")]
    estimator: String,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn max_batch(a: MaxBatchArgs) -> CliResult {
    let profile = a.gpu.load()?;
    let model = load_model(&a.model)?;
    let est = estimator(&a.estimator)?;
    let job = a.job.options(1, &profile)?;
    let (name, best) = match &model {
        Model::Native(m) => {
            a.job.native_only_check()?;
            (m.to_spec_string(), search::max_batch(m, &job, &profile, est.as_ref()).map_err(CliError::input)?)
        }
        Model::Torch(r) => {
            // One batch-symbolic trace answers every batch size: no re-tracing during the search.
            // DataParallel: search the rows per GPU; the answer is the whole batch.
            let sym = TorchTracer::from_env().symbolic(&a.job.request(r, &job, &profile)?).map_err(bridge_error)?;
            let gpus = u64::from(a.job.data_parallel);
            let best = search::max_batch_with(&mut |b| sym.at(b * gpus), &profile, est.as_ref()).map_err(CliError::input)?;
            (r.clone(), best.map(|(b, e)| (b * gpus, e)))
        }
        Model::TraceFile(_) => return Err(CliError::input(format!("{}: max-batch needs a model, not a trace file (a trace fixes its batch size)", a.model))),
    };
    match best {
        None => {
            if a.json {
                println!("{}", serde_json::json!({"model": name, "gpu": profile.name, "max_batch": 0}));
            } else {
                println!("even batch 1 does not fit on {} with its upper bound", profile.name);
            }
        }
        Some((lo, e)) => {
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({"model": name, "gpu": profile.name, "max_batch": lo,
                        "peak_mib": mib(e.peak_bytes), "upper_bound_mib": mib(e.upper_bound_bytes), "capacity_mib": profile.capacity_mib})
                );
            } else {
                println!("max batch  {lo}");
                println!("at it      peak {:.1} MiB, upper bound {:.1} MiB of {} MiB", bytes_to_mib(e.peak_bytes), bytes_to_mib(e.upper_bound_bytes), profile.capacity_mib);
            }
        }
    }
    Ok(())
}

#[derive(Args)]
pub struct GpusArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Show a running daemon's GPUs (live memory, utilization, jobs) instead of the profiles;
    /// `--server` alone means GPUMEM_SERVER or http://127.0.0.1:7878.
    #[arg(long, num_args = 0..=1, default_missing_value = "")]
    server: Option<String>,
    /// Bearer token for --server (default: GPUMEM_TOKEN).
    #[arg(long, env = "GPUMEM_TOKEN", hide_env_values = true)]
    token: Option<String>,
}

pub fn gpus(a: GpusArgs) -> CliResult {
    if let Some(url) = a.server {
        let url = Some(url).filter(|u| !u.is_empty());
        return crate::server::live_gpus(&crate::server::server_args_for_gpus(url, a.token), a.json);
    }
    let all = profile::catalogue();
    if a.json {
        println!("{}", serde_json::to_string_pretty(&all).map_err(CliError::other)?);
        return Ok(());
    }
    println!("{:<16} {:<32} {:>10} {:>5} {:>8} {:>8} {:>8} {:>9} {:>8}", "name", "device", "MiB", "SMs", "fp32 TF", "bf16 TF", "GB/s", "context", "cuBLAS ws");
    for p in all {
        println!(
            "{:<16} {:<32} {:>10} {:>5} {:>8.1} {:>8.1} {:>8.0} {:>9.0} {:>8.3}",
            p.name,
            p.display,
            p.capacity_mib,
            p.sm_count,
            p.tflops.fp32,
            p.tflops.bf16,
            p.memory_bandwidth_gbs,
            p.cuda_context_mib,
            bytes_to_mib(p.cublas_workspace())
        );
    }
    Ok(())
}

fn read_csv(path: &Path) -> CliResult<Vec<Measurement>> {
    let f = File::open(path).map_err(|e| CliError::input(format!("{}: {e}", path.display())))?;
    read_measurements(&path.display().to_string(), BufReader::new(f)).map_err(CliError::input)
}

/// The trace for a measured row: native models directly, PyTorch references through the
/// bridge. `Err(reason)` inside `Ok` means the row cannot be modelled here (it is skipped).
fn row_trace(m: &Measurement, job: &JobArgs, profile: &GpuProfile) -> CliResult<Result<Trace, String>> {
    let mut opts = job.options(m.batch as i64, profile)?;
    if let Some(o) = m.optimizer {
        opts.optimizer = o;
    }
    if let Some(p) = m.precision {
        opts.precision = p;
    }
    match &m.model {
        ModelRef::Native(spec) => spec.trace(&opts).map(Ok).map_err(|e| CliError::input(format!("line {}: {e}", m.line))),
        ModelRef::External(r) if is_reference(r) => {
            let mut req = job.request(r, &opts, profile)?;
            req.input = m.input.clone().or(req.input);
            req.seq_len = m.seq_len.or(req.seq_len);
            req.data_parallel = m.data_parallel.unwrap_or(req.data_parallel);
            req.outputs = m.outputs.clone().or(req.outputs);
            Ok(TorchTracer::from_env().trace(&req).map_err(|e| e.to_string()))
        }
        ModelRef::External(r) => Ok(Err(format!("`{r}` is neither a native spec nor a PyTorch reference"))),
    }
}

#[derive(Args)]
pub struct CalibrateArgs {
    /// Measurements CSV (columns model, batch_size, measured_mib[, optimizer, precision], or the
    /// seed's MLP schema).
    measurements: Option<PathBuf>,
    /// Instead of a CSV: the daemon's state directory; its finished jobs with a model and a
    /// measured peak are the rows (their job ids are the `lines`).
    #[arg(long, conflicts_with = "measurements")]
    from_history: Option<PathBuf>,
    #[command(flatten)]
    gpu: GpuChoice,
    #[command(flatten)]
    job: JobArgs,
    /// Which rows to fit on, chosen by a rule and never by error: `all`, `first:N`,
    /// `smallest:N` (the N rows with the fewest parameters), or `lines:L1,L2` (file lines).
    #[arg(long, default_value = "all")]
    rows: String,
    /// Where to write the calibrated profile.
    #[arg(long)]
    out: PathBuf,
}

/// Finished daemon jobs with a model, a batch and a measured peak, as measurement rows.
fn history_rows(state: &Path) -> CliResult<Vec<Measurement>> {
    let db = state.join("jobs.db");
    if !db.exists() {
        return Err(CliError::input(format!("{}: no job store here (a `gpumem serve --state` directory?)", state.display())));
    }
    let store = gpumem_server::store::Store::open(&db).map_err(CliError::input)?;
    let rows: Vec<Measurement> = store
        .load()
        .map_err(CliError::input)?
        .into_iter()
        .filter(|j| j.state == gpumem_server::wire::JobState::Finished)
        .filter_map(|j| {
            let model = j.request.model.as_deref().and_then(|m| ModelSpec::parse(m).ok())?;
            Some(Measurement {
                line: j.id as usize,
                label: format!("job {}", j.id),
                model: ModelRef::Native(model),
                batch: j.request.batch?,
                measured_bytes: j.peak_bytes.filter(|&p| p > 0)?,
                optimizer: None,
                precision: None,
                published: Vec::new(),
                input: None,
                seq_len: None,
                data_parallel: None,
                outputs: None,
            })
        })
        .collect();
    if rows.is_empty() {
        return Err(CliError::input(format!("{}: no finished job has a native model spec and a measured peak", state.display())));
    }
    Ok(rows)
}

pub fn calibrate(a: CalibrateArgs) -> CliResult {
    let profile = a.gpu.load()?;
    let (rows, source) = match (&a.measurements, &a.from_history) {
        (Some(p), None) => (read_csv(p)?, p.display().to_string()),
        (None, Some(dir)) => (history_rows(dir)?, format!("{} (history)", dir.display())),
        _ => return Err(CliError::input("give a measurements CSV or --from-history STATE_DIR")),
    };
    let mut runs = Vec::new();
    for m in &rows {
        match row_trace(m, &a.job, &profile)? {
            Ok(t) => runs.push((m, t)),
            Err(why) => eprintln!("skipped line {}: {why}", m.line),
        }
    }
    if runs.is_empty() {
        return Err(CliError::input(format!("{source}: no row has a model gpumem can trace")));
    }
    let bad_rows = || CliError::input(format!("--rows {}: expected all, first:N, smallest:N or lines:L1,L2,...", a.rows));
    let (rule, n) = match a.rows.split_once(':') {
        None if a.rows == "all" => ("all", runs.len()),
        Some(("lines", list)) => {
            let lines: Vec<usize> = list.split(',').map(|l| l.trim().parse::<usize>()).collect::<Result<_, _>>().map_err(|_| bad_rows())?;
            if let Some(l) = lines.iter().find(|l| !runs.iter().any(|(m, _)| m.line == **l)) {
                return Err(CliError::input(format!("--rows {}: line {l} is not a traced row of {source}", a.rows)));
            }
            runs.retain(|(m, _)| lines.contains(&m.line));
            ("lines", runs.len())
        }
        Some((r @ ("first" | "smallest"), n)) => (r, n.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(bad_rows)?),
        _ => return Err(bad_rows()),
    };
    if rule == "smallest" {
        runs.sort_by_key(|(m, t)| (t.header.parameters.unwrap_or(u64::MAX), m.line));
    }
    runs.truncate(n);
    let fit_input: Vec<(Trace, u64)> = runs.iter().map(|(m, t)| (t.clone(), m.measured_bytes)).collect();
    let cal = fit_context(&profile, &fit_input).map_err(CliError::input)?;
    println!("fitted {} on {} rows ({}):", profile.name, cal.rows, if rule == "all" { "all".to_string() } else { a.rows.clone() });
    println!("  cuda_context_mib  {:.1}   (was {:.1})", cal.context_mib, profile.cuda_context_mib);
    println!("  bound_fixed_mib   {:.1}", cal.profile.bound_fixed_mib);
    println!("residuals (measured - fitted estimate):");
    for ((m, _), r) in runs.iter().zip(&cal.residuals_mib) {
        println!("  line {:>5}  {:>+8.1} MiB  {}", m.line, r, m.label);
    }
    let mut f = File::create(&a.out).map_err(|e| CliError::other(format!("{}: {e}", a.out.display())))?;
    f.write_all(cal.profile.to_toml().as_bytes()).map_err(|e| CliError::other(format!("{}: {e}", a.out.display())))?;
    println!("wrote {}", a.out.display());
    Ok(())
}

#[derive(Args)]
pub struct EvalArgs {
    /// Measurements CSV.
    measurements: PathBuf,
    #[command(flatten)]
    gpu: GpuChoice,
    #[command(flatten)]
    job: JobArgs,
    /// Where the per-row CSV and the scatter plots go.
    #[arg(long, default_value = "gpumem-eval")]
    out_dir: PathBuf,
    /// Bin width for bin accuracy, in MiB.
    #[arg(long, default_value_t = 1024)]
    bin_mib: u64,
    /// Memory models from `gpumem learn train` to score beside the others (repeatable; native
    /// datasets only). Score them on rows they were not trained on.
    #[arg(long)]
    learned_model: Vec<PathBuf>,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct EvalSummary {
    estimator: String,
    #[serde(flatten)]
    metrics: Metrics,
}

pub fn eval(a: EvalArgs) -> CliResult {
    let profile = a.gpu.load()?;
    if a.bin_mib == 0 {
        return Err(CliError::input("--bin-mib must be positive"));
    }
    let rows = read_csv(&a.measurements)?;
    let mut names: Vec<String> = ESTIMATORS.iter().map(|s| s.to_string()).collect();
    let published: Vec<String> = rows[0].published.iter().map(|(n, _)| format!("published:{n}")).collect();
    names.extend(published.iter().cloned());
    let estimators: Vec<Box<dyn Estimator>> = ESTIMATORS.iter().map(|n| by_name(n).expect("known")).collect();
    let mut outcomes: Vec<Vec<(usize, Outcome)>> = vec![Vec::new(); names.len()];
    let mut skipped = Vec::new();
    let bar = ProgressBar::new(rows.len() as u64);
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} rows {eta}").expect("valid template"));
    for (ri, m) in rows.iter().enumerate() {
        bar.inc(1);
        for (k, (_, v)) in m.published.iter().enumerate() {
            if let Some(v) = v {
                outcomes[ESTIMATORS.len() + k].push((ri, Outcome { measured: m.measured_bytes, predicted: *v, upper: *v }));
            }
        }
        let trace = match row_trace(m, &a.job, &profile)? {
            Ok(t) => t,
            Err(why) => {
                skipped.push((m, why));
                continue;
            }
        };
        for (k, e) in estimators.iter().enumerate() {
            let est = e.estimate(&trace, &profile).map_err(|e| CliError::input(format!("line {}: {e}", m.line)))?;
            outcomes[k].push((ri, Outcome { measured: m.measured_bytes, predicted: est.peak_bytes, upper: est.upper_bound_bytes }));
        }
    }
    bar.finish_and_clear();
    if !a.learned_model.is_empty() {
        let samples = crate::learn::load_dataset(&a.measurements, &profile)?;
        let refs: Vec<&gpumem_learn::Sample> = samples.iter().collect();
        for path in &a.learned_model {
            let model = crate::learn::read_model(path)?;
            if model.target != gpumem_learn::Target::Memory {
                return Err(CliError::input(format!("{}: eval scores memory models; this one predicts {}", path.display(), model.target.name())));
            }
            let stem = path.file_stem().map_or("model".into(), |s| s.to_string_lossy().into_owned());
            names.push(format!("learned:{stem}"));
            let mut scored = Vec::new();
            for (s, p) in samples.iter().zip(model.predict(&refs).map_err(CliError::input)?) {
                if let Some(ri) = rows.iter().position(|m| m.line == s.line) {
                    let mib = |x: f64| gpumem_core::units::mib_to_bytes(x);
                    scored.push((ri, Outcome { measured: rows[ri].measured_bytes, predicted: mib(p.value), upper: mib(p.upper.unwrap_or(p.value)) }));
                }
            }
            outcomes.push(scored);
        }
    }
    let summaries: Vec<EvalSummary> = names
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| !o.is_empty())
        .map(|(n, o)| EvalSummary { estimator: n.clone(), metrics: metrics(&o.iter().map(|(_, x)| *x).collect::<Vec<_>>(), a.bin_mib) })
        .collect();
    std::fs::create_dir_all(&a.out_dir).map_err(|e| CliError::other(format!("{}: {e}", a.out_dir.display())))?;
    write_rows_csv(&a.out_dir.join("rows.csv"), &rows, &names, &outcomes)?;
    let series: Vec<(String, Vec<(f64, f64)>)> = names
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| !o.is_empty())
        .map(|(n, o)| (n.clone(), o.iter().map(|(_, x)| (bytes_to_mib(x.measured), bytes_to_mib(x.predicted))).collect()))
        .collect();
    crate::plot::scatter(&a.out_dir.join("scatter.svg"), &a.out_dir.join("scatter.png"), &series).map_err(CliError::other)?;
    if a.json {
        let out = serde_json::json!({"gpu": profile.name, "rows": rows.len(), "skipped": skipped.len(), "bin_mib": a.bin_mib, "estimators": summaries});
        println!("{}", serde_json::to_string_pretty(&out).map_err(CliError::other)?);
    } else {
        println!("{} rows, {} modelled, {} skipped; GPU profile {} (context {:.1} MiB); bins of {} MiB", rows.len(), rows.len() - skipped.len(), skipped.len(), profile.name, profile.cuda_context_mib, a.bin_mib);
        println!();
        println!("{:<24} {:>6} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>8} {:>7} {:>8}", "estimator", "rows", "mean%", "median%", "p90%", "p95%", "<=5%", "<=10%", "under3%", "bin", "ub-miss");
        for s in &summaries {
            let m = &s.metrics;
            println!(
                "{:<24} {:>6} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>6.1}% {:>6.1}% {:>7.2}% {:>6.1}% {:>7.2}%",
                s.estimator, m.rows, m.mean_ape, m.median_ape, m.p90_ape, m.p95_ape, 100.0 * m.within_5pct, 100.0 * m.within_10pct, 100.0 * m.under_3pct, 100.0 * m.bin_accuracy, 100.0 * m.bound_misses
            );
        }
        for (m, why) in &skipped {
            println!("skipped line {}: {}: {why}", m.line, m.label);
        }
        println!();
        println!("wrote {}, {} and {}", a.out_dir.join("rows.csv").display(), a.out_dir.join("scatter.svg").display(), a.out_dir.join("scatter.png").display());
    }
    Ok(())
}

fn write_rows_csv(path: &Path, rows: &[Measurement], names: &[String], outcomes: &[Vec<(usize, Outcome)>]) -> CliResult {
    let f = File::create(path).map_err(|e| CliError::other(format!("{}: {e}", path.display())))?;
    let mut w = csv::Writer::from_writer(BufWriter::new(f));
    let mut header = vec!["line".to_string(), "model".into(), "batch_size".into(), "measured_mib".into()];
    for n in names {
        header.push(format!("{n}_mib"));
        header.push(format!("{n}_upper_mib"));
        header.push(format!("{n}_error_pct"));
    }
    let io = |e: csv::Error| CliError::other(format!("{}: {e}", path.display()));
    w.write_record(&header).map_err(io)?;
    let mut per_row: Vec<Vec<Option<Outcome>>> = vec![vec![None; names.len()]; rows.len()];
    for (k, o) in outcomes.iter().enumerate() {
        for (ri, x) in o {
            per_row[*ri][k] = Some(*x);
        }
    }
    for (m, cols) in rows.iter().zip(per_row) {
        let mut rec = vec![m.line.to_string(), m.label.clone(), m.batch.to_string(), format!("{:.1}", bytes_to_mib(m.measured_bytes))];
        for c in cols {
            match c {
                Some(x) => {
                    rec.push(format!("{:.1}", bytes_to_mib(x.predicted)));
                    rec.push(format!("{:.1}", bytes_to_mib(x.upper)));
                    rec.push(format!("{:.3}", x.signed_pct()));
                }
                None => rec.extend([String::new(), String::new(), String::new()]),
            }
        }
        w.write_record(&rec).map_err(io)?;
    }
    w.flush().map_err(|e| CliError::other(format!("{}: {e}", path.display())))?;
    Ok(())
}

#[derive(Args)]
pub struct TraceArgs {
    /// A native model spec or a PyTorch reference.
    model: String,
    #[arg(long, allow_negative_numbers = true, default_value_t = 32)]
    batch: i64,
    #[command(flatten)]
    job: JobArgs,
    #[command(flatten)]
    gpu: GpuChoice,
    /// Output file (JSON Lines, docs/trace-format.md).
    #[arg(long)]
    out: PathBuf,
}

pub fn trace(a: TraceArgs) -> CliResult {
    let profile = a.gpu.load()?;
    let model = load_model(&a.model)?;
    if let Model::TraceFile(_) = model {
        return Err(CliError::input(format!("{}: already a trace file", a.model)));
    }
    let job = a.job.options(a.batch, &profile)?;
    let t = model_trace(&model, &a.job, &job, &profile)?;
    let f = File::create(&a.out).map_err(|e| CliError::other(format!("{}: {e}", a.out.display())))?;
    let mut w = BufWriter::new(f);
    t.write(&mut w).and_then(|_| w.flush()).map_err(|e| CliError::other(format!("{}: {e}", a.out.display())))?;
    println!("wrote {} ({} events, {} iterations)", a.out.display(), t.events.len(), t.header.iterations);
    Ok(())
}
