//! `gpumem estimate`: one job's peak, upper bound, breakdown at the peak and utilization.

use std::path::PathBuf;

use clap::Args;
use gpumem_core::estimate::{Breakdown, Estimate, Estimator, Replay};
use gpumem_core::families::ModelSpec;
use gpumem_core::job::{RoutingImbalance, StepAxis, Strategy};
use gpumem_core::profile::GpuProfile;
use gpumem_core::trace::Trace;
use gpumem_core::units::bytes_to_mib;
use gpumem_core::utilization::{HostModel, Utilization, physical};
use gpumem_core::workspace::WorkspaceSource;
use gpumem_learn::{LearnedModel, Sample, Target};
use gpumem_workload::ModelRef;
use gpumem_workload::report::EstimateReport;
use serde::Serialize;

use crate::args::{EstimatorArgs, GpuChoice, ModelArg, WorkloadArgs, mib};
use crate::{CliError, CliResult};

/// The model `gpumem estimate` uses when none is given: the first row of the seed's MLP data.
pub const DEFAULT_MODEL: &str = "mlp:input=2346,output=197,depth=2,arch=pyramid,act=relu,dropout=0.338,batchnorm=true,samples=4096,summary=true";
const DEFAULT_BATCH: u64 = 996;

#[derive(Args)]
pub struct EstimateArgs {
    /// A native spec (mlp:…, cnn:…, transformer:…), a PyTorch reference (torchvision:, timm:,
    /// hf:, smp:, py:), a Hugging Face Hub id (ORG/NAME, read offline from the local Hub cache),
    /// a model directory or its config.json, or a trace file. Default: the model --train-config
    /// names, else a seed MLP.
    model: Option<String>,
    /// Batch size (ignored for trace files, which fix their own).
    #[arg(long, allow_negative_numbers = true)]
    batch: Option<i64>,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    gpu: GpuChoice,
    #[command(flatten)]
    estimator: EstimatorArgs,
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
    CliError::input(
        "--learned-model needs a native model spec (its features come from the model's layers)",
    )
}

/// The learned models' predictions for a native model, and the utilization they leave.
fn learned(
    models: &[(PathBuf, LearnedModel)],
    spec: &ModelSpec,
    trace: &Trace,
    profile: &GpuProfile,
    util: &mut Utilization,
) -> CliResult<Vec<LearnedJson>> {
    if models.is_empty() {
        return Ok(Vec::new());
    }
    let summary = gpumem_learn::features::trace_summary(trace, profile).map_err(CliError::input)?;
    let sample = Sample::new(
        0,
        spec.to_spec_string(),
        String::new(),
        spec.facts(trace.header.batch_size),
        summary,
    );
    let mut out = Vec::new();
    for (path, m) in models {
        let p = &m.predict(&[&sample]).map_err(CliError::input)?[0];
        match m.target {
            Target::Memory => {}
            Target::Smact => util.smact = p.value,
            Target::Smocc => util.smocc = p.value,
            Target::Gract => util.gract = p.value,
            Target::Dram => util.dram = p.value,
            Target::Fp32 => util.fp32 = p.value,
        }
        out.push(LearnedJson {
            target: m.target.name(),
            model: path.display().to_string(),
            value: p.value,
            upper: p.upper,
        });
    }
    Ok(out)
}

pub fn estimate(a: EstimateArgs) -> CliResult {
    let profile = a.gpu.load()?;
    let batch = a.batch.or(a.workload.stated_batch()?);
    let (model, model_override) = a.workload.model_or_config(a.model.as_deref())?;
    let (_, mut overrides) = a.workload.options_and_overrides()?;
    overrides.extend(model_override);
    let (arg, batch) = match &model {
        Some(m) => (m.clone(), batch.unwrap_or(32)),
        None => (
            DEFAULT_MODEL.to_string(),
            batch.unwrap_or(DEFAULT_BATCH as i64),
        ),
    };
    let models = a.estimator.models()?;
    if a.timeline.is_some() && a.estimator.estimator != "replay" {
        return Err(CliError::input(
            "--timeline draws the replay estimator's allocator; use --estimator replay",
        ));
    }
    let estimator: Box<dyn Estimator> = match a.timeline {
        Some(_) => Box::new(Replay { timeline: true }),
        None => a.estimator.estimator(&models)?,
    };
    let mut run = None;
    let (trace, est, native, readings, strategy) = match ModelArg::load(&arg)? {
        ModelArg::TraceFile(t) => {
            let est = estimator.estimate(&t, &profile).map_err(CliError::input)?;
            (t, est, None, Vec::new(), None)
        }
        ModelArg::Model(m) if a.workload.varies()? => {
            // Lengths that vary by step: the run's steps through one allocator.
            let workload = a.workload.workload(m, batch)?;
            let sized = workload
                .run(&profile, estimator.as_ref())?
                .expect("a varying length is a run");
            let strategy = workload.options().strategy;
            run = Some(sized.report);
            (sized.trace, sized.estimate, None, Vec::new(), strategy)
        }
        ModelArg::Model(m) => {
            // Every reading of the spec sized; an ambiguous one answers with its largest.
            let sizing = a.workload.workload(m, batch)?.size(
                &profile,
                estimator.as_ref(),
                gpumem_workload::Workload::trace_for_reestimates,
            )?;
            let native = match sizing.workload.model() {
                ModelRef::Native(spec) => Some(spec.clone()),
                ModelRef::Torch(_) => None,
            };
            let strategy = sizing.workload.options().strategy;
            (
                sizing.trace,
                sizing.estimate,
                native,
                sizing.readings,
                strategy,
            )
        }
    };
    if !models.is_empty() && native.is_none() {
        return Err(learned_needs_native());
    }
    if let Some(svg) = &a.timeline {
        let title = format!(
            "{} · batch {} · {}",
            trace.header.model, trace.header.batch_size, profile.name
        );
        crate::plot::memory_timeline(
            svg,
            &title,
            &est.timeline,
            est.peak_at.as_ref().map(|p| p.event),
        )
        .map_err(CliError::other)?;
    }
    let model_name = trace.header.model.clone();
    let mut util = physical(&trace, &profile, &HostModel::default());
    let learned = match &native {
        Some(spec) => learned(&models, spec, &trace, &profile, &mut util)?,
        None => Vec::new(),
    };
    let mut report = EstimateReport::new(&trace, &est, &util, strategy, &readings, run);
    if a.json {
        report.learned = learned
            .iter()
            .map(serde_json::to_value)
            .collect::<Result<_, _>>()
            .map_err(CliError::other)?;
        report.train_config = a.workload.train_config_json(&overrides)?;
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(CliError::other)?
        );
        return Ok(());
    }
    print_estimate(
        &shown_model(&arg, &model_name),
        trace.header.batch_size,
        trace.header.iterations,
        &profile,
        &est,
    );
    if let Some(s) = &report.strategy {
        print_ranks(s);
    }
    for s in &report.stages {
        println!(
            "stage {:<6} peak {:>10.1} MiB, upper bound {:.1} MiB",
            s.stage, s.peak_mib, s.upper_bound_mib
        );
    }
    if let Some(r) = &report.routing {
        println!(
            "routing      at imbalance {}× (this rank's experts get that many times their even share of tokens) the rank peaks at {:.1} MiB, upper bound {:.1} MiB: the upper bound above covers it",
            r.imbalance, r.peak_mib, r.upper_bound_mib
        );
    }
    if let Some(r) = &report.run {
        print_run(r);
    }
    if let Some(a) = &report.ambiguity {
        println!("note         {}", a.note);
        for r in &a.readings {
            println!(
                "             {}: {:.1} MiB (bound {:.1} MiB)",
                r.model, r.peak_mib, r.upper_bound_mib
            );
        }
    }
    if let Some(d) = &report.deepspeed {
        println!(
            "deepspeed    {}: {:.1} MiB per GPU (model states only), {:.1} MiB host",
            d.formula, d.gpu_mib, d.cpu_mib
        );
    }
    if trace.header.options.strategy.is_some() {
        let communicators = trace.communicators();
        if profile.nccl_mib == 0.0 && profile.nccl_communicator_mib == 0.0 {
            println!(
                "note         NCCL's own buffers are not included (this profile states no nccl_mib or nccl_communicator_mib); the rank uses {communicators} communicator(s)"
            );
        } else {
            println!(
                "nccl         {:.1} MiB outside the allocator: {:.1} MiB, and {communicators} communicator(s) × {:.1} MiB",
                profile.nccl_mib + f64::from(communicators) * profile.nccl_communicator_mib,
                profile.nccl_mib,
                profile.nccl_communicator_mib
            );
        }
    }
    println!();
    println!(
        "utilization  SMACT {:.2}  SMOCC {:.2}  GRACT {:.2}  DRAMA {:.2}  FP32A {:.2}  ({:.1} ms/step){}",
        util.smact,
        util.smocc,
        util.gract,
        util.dram,
        util.fp32,
        util.step_s * 1e3,
        if learned.iter().any(|l| l.target != "memory") {
            "  [learned where given]"
        } else {
            "  [physical model]"
        }
    );
    for l in learned.iter().filter(|l| l.target == "memory") {
        match l.upper {
            Some(u) => println!(
                "learned      {:.1} MiB, upper bound {u:.1} MiB ({})",
                l.value, l.model
            ),
            None => println!("learned      {:.1} MiB ({})", l.value, l.model),
        }
    }
    a.workload.print_train_config(&overrides)?;
    Ok(())
}

/// The model as the text output names it: a Hub id, directory or config.json by the user's
/// name and its class (the `hf:` reference it became carries every config key; `--json` has it).
fn shown_model(arg: &str, reference: &str) -> String {
    match reference.strip_prefix("hf:") {
        Some(r) if !arg.starts_with("hf:") && arg != reference => {
            format!("{arg} (hf:{})", r.split('(').next().unwrap_or(r))
        }
        _ => reference.to_string(),
    }
}

/// A run's lengths (or image sides), and its reserved memory against its longest step's and
/// the bound.
fn print_run(r: &gpumem_core::run::RunReport) {
    let l = &r.lengths;
    let what = match l.axis {
        StepAxis::SeqLen => "lengths    ",
        StepAxis::ImageSide => "image sides",
    };
    println!(
        "{what}  {} steps, {}..{} ({} distinct): {}",
        l.steps, l.min, l.max, l.distinct, l.distribution
    );
    if r.rounded_up {
        println!(
            "             each step rounded up to one of {} traced lengths ({}..{})",
            r.traced_lengths.len(),
            r.traced_lengths[0],
            r.traced_lengths[r.traced_lengths.len() - 1]
        );
    }
    println!(
        "run          reserved {:.1} MiB over the run, {:.1} MiB for the longest step alone ({}), any order at most {:.1} MiB (allocator only)",
        mib(r.reserved_bytes),
        mib(r.longest_step_reserved_bytes),
        r.traced_lengths.last().copied().unwrap_or(0),
        mib(r.any_order.reserved_bytes)
    );
}

/// A multi-GPU job's mesh, whose one rank the estimate is.
fn print_ranks(s: &Strategy) {
    let experts = s.routing_imbalance().map_or(String::new(), |r| {
        format!(
            ", experts split over {} of them (the estimate routes tokens evenly; {})",
            s.expert_parallel(),
            if r == RoutingImbalance::BALANCED {
                "so does the bound: --routing-imbalance F bounds an uneven router".to_string()
            } else {
                format!("the bound at {}× imbalance", r.factor())
            }
        )
    });
    let pipeline = s.pipeline().map_or(String::new(), |p| {
        format!(
            ", {} over {} micro-batches{}",
            p.schedule().name(),
            p.microbatches(),
            if p.virtual_stages() > 1 {
                format!(", {} chunks per rank", p.virtual_stages())
            } else {
                String::new()
            }
        )
    });
    let layout = match s.sequence_parallel() {
        Some(false) => ", no sequence parallelism",
        _ => "",
    };
    println!(
        "ranks        {}: {} = {} GPUs{layout}{experts}{pipeline} (the estimate is one rank's{})",
        s.name(),
        s.mesh().label(),
        s.world_size(),
        if pipeline.is_empty() {
            ""
        } else {
            ": the worst stage's"
        }
    );
}

fn print_estimate(model: &str, batch: u64, iterations: u32, profile: &GpuProfile, est: &Estimate) {
    println!("model      {model}");
    println!("batch      {batch}");
    println!(
        "gpu        {} ({} MiB)",
        profile.display, profile.capacity_mib
    );
    println!("estimator  {}", est.estimator);
    println!();
    println!(
        "peak         {:>10.1} MiB   (as nvidia-smi will show it)",
        bytes_to_mib(est.peak_bytes)
    );
    println!(
        "upper bound  {:>10.1} MiB",
        bytes_to_mib(est.upper_bound_bytes)
    );
    let verdict = match (est.fits, est.upper_bound_bytes <= est.capacity_bytes) {
        (true, true) => "fits, with its upper bound",
        (true, false) => "fits, but its upper bound does not: little headroom",
        (false, _) => "does NOT fit: out of memory",
    };
    println!("verdict      {verdict}");
    // The parts after the peak's inherit its cache: the peak is in the first that reaches it.
    let peak_part = est
        .phases
        .iter()
        .position(|p| p.peak_bytes == est.peak_bytes);
    for (i, p) in est.phases.iter().enumerate() {
        println!(
            "  {:<10} {:>10.1} MiB   (reserved {:.1}, allocated {:.1}){}",
            p.name.name(),
            bytes_to_mib(p.peak_bytes),
            bytes_to_mib(p.reserved_bytes),
            bytes_to_mib(p.allocated_bytes),
            if Some(i) == peak_part {
                "   the run's peak"
            } else {
                ""
            }
        );
    }
    if est.host_backed_bytes > 0 {
        println!(
            "host-backed  {:>10.1} MiB  paged optimizer state (CUDA managed memory): not in the peak, paged out to the host when the GPU needs the room; nvidia-smi shows it while the GPU has room",
            bytes_to_mib(est.host_backed_bytes)
        );
    }
    if let Some(source) = est.workspace_source {
        let why = match source {
            WorkspaceSource::Probed => "cuDNN workspaces as probed on this GPU and stack",
            WorkspaceSource::Fitted => {
                "some cuDNN workspaces fitted from the profile's probed table (the bound covers them)"
            }
            WorkspaceSource::Policy => {
                "some cuDNN workspaces sized by the profile's policy for this architecture (the bound covers them)"
            }
            WorkspaceSource::Default => {
                "cuDNN workspaces not modelled (no probed table: `gpumem probe`); the bound covers them"
            }
        };
        println!("workspaces   {} — {why}", source.name());
    }
    println!();
    match &est.peak_at {
        Some(at) => println!(
            "at the peak of allocated memory — {}:",
            at.describe(iterations)
        ),
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
            let note = if name == "allocator_slack" {
                "   (reserved − allocated: cached and split blocks, rounding)"
            } else {
                ""
            };
            println!("  {name:<16} {:>10.1} MiB{note}", bytes_to_mib(bytes));
        }
    }
}
