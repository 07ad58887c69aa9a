//! `gpumem plan`: the fastest setup of a training job that fits its GPUs — multi-GPU strategy ×
//! precision × activation checkpointing × micro-batch (× gradient accumulation to a global
//! batch) — with why the others lose (gpumem-workload's `plan` does the search).

use clap::Args;
use gpumem_core::job::{MeshDim, Optimizer, OptionValues, Precision};
use gpumem_workload::plan::{Interconnect, Plan, PlanRequest, Setup, plan as search};
use gpumem_workload::{Checkpointing, InputShape, Strategy};

use crate::args::{
    EstimatorArgs, GpuChoice, ModelArg, StrategyArgs, WholeRunArgs, gpu_count, lora, mib,
};
use crate::{CliError, CliResult};

#[derive(Args)]
pub struct PlanArgs {
    /// A native model spec, a PyTorch reference (torchvision:, timm:, hf:, smp:, py:), or a Hub id
    /// (ORG/NAME), model directory or config.json.
    model: String,
    #[command(flatten)]
    gpu: GpuChoice,
    /// The job's GPUs, COUNTxGPU (e.g. 8xh100-80gb-sxm): every strategy of --strategies is
    /// planned over all of them (overrides --gpu).
    #[arg(long, conflicts_with_all = ["strategy", "world_size", "tp", "pp", "cp"])]
    gpus: Option<String>,
    /// Strategies to consider with --gpus (PyTorch models): ddp, fsdp, zero1, zero2, zero3
    /// (default: all of them; ZeRO with DeepSpeed's default settings).
    #[arg(long, value_delimiter = ',', requires = "gpus")]
    strategies: Vec<String>,
    /// Tensor-parallel degrees of FSDP's meshes to search with --gpus (default: powers of two up
    /// to a machine's GPUs, searched as far as a rank needs; listing any degree searches every
    /// mesh of them). docs/parallelism.md.
    #[arg(long, value_delimiter = ',', requires = "gpus")]
    tp_degrees: Vec<u32>,
    /// Pipeline stages to search with --gpus (default: 2, 4, 8; 1F1B over as many
    /// micro-batches as stages).
    #[arg(long, value_delimiter = ',', requires = "gpus")]
    pp_degrees: Vec<u32>,
    /// Context-parallel degrees to search with --gpus (default: powers of two up to 8 from
    /// sequences of 16,384 tokens, else none).
    #[arg(long, value_delimiter = ',', requires = "gpus")]
    cp_degrees: Vec<u32>,
    /// Expert-parallel degrees (mixture-of-experts models) to search with --gpus (default:
    /// none).
    #[arg(long, value_delimiter = ',', requires = "gpus")]
    ep_degrees: Vec<u32>,
    /// GPUs per machine: tensor parallelism stays within one (default 8).
    #[arg(long, requires = "gpus")]
    gpus_per_node: Option<u32>,
    /// NCCL bus bandwidth per rank, GB/s, that times the strategies' collectives (default: the
    /// GPU's usual link: NVLink on SXM parts, else PCIe).
    #[arg(long)]
    bus_gbs: Option<f64>,
    /// Samples per optimizer step: micro-batches divide it, gradient accumulation makes up the
    /// rest. Without it, micro-batches are powers of two up to the largest that fits.
    #[arg(long)]
    global_batch: Option<u64>,
    /// Precisions to consider (default: fp32, amp-bf16 where the GPU has bf16, amp-fp16; pure
    /// bf16 or fp16 only when listed).
    #[arg(long, value_delimiter = ',')]
    precisions: Vec<String>,
    /// Activation checkpointing to consider (PyTorch models): both (off and full), all (and
    /// selective), on, or one mode: off, full, full-reentrant, selective, selective-op,
    /// selective-attention, selective-layer:N.
    #[arg(long, default_value = "both")]
    checkpointing: String,
    /// Optimizer, as gpumem or the trainer names it (as `estimate --optimizer`; docs/intake.md).
    #[arg(long, default_value = "adam")]
    optimizer: String,
    /// Sequence length (PyTorch sequence models).
    #[arg(long)]
    seq_len: Option<u64>,
    /// Input shape CxHxW (PyTorch image models).
    #[arg(long)]
    input: Option<String>,
    /// LoRA fine-tuning, as `gpumem estimate --lora` takes it.
    #[arg(long)]
    lora: Option<String>,
    /// With --strategy, plan one rank of a multi-GPU job; --global-batch is then over all ranks.
    #[command(flatten)]
    strategy: StrategyArgs,
    /// Plan the whole run (load, steps, evaluation, save; docs/run.md): only setups whose whole
    /// run fits are kept. Each micro-batch tried is then traced whole, a tracer run each.
    #[command(flatten)]
    whole_run: WholeRunArgs,
    #[command(flatten)]
    estimator: EstimatorArgs,
    /// Setups to print, fastest first.
    #[arg(long, default_value_t = 10)]
    top: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

fn label(strategy: Option<Strategy>, precision: Precision, checkpointing: Checkpointing) -> String {
    // A mesh with model parallelism names its dimensions (FSDP's shard ranks are the rest).
    let on = strategy
        .map(|s| {
            let mesh = s.mesh();
            if mesh.model_parallel() == 1 && s.expert_parallel() == 1 {
                format!("{} · ", s.name())
            } else {
                let short = |d: MeshDim| match d {
                    MeshDim::Replicate => "replicas",
                    MeshDim::Shard => "fsdp",
                    MeshDim::Tensor => "tp",
                    MeshDim::Pipeline => "pp",
                    MeshDim::Context => "cp",
                    MeshDim::Expert => "ep",
                };
                let dims: Vec<String> = MeshDim::ALL
                    .into_iter()
                    .filter(|&d| mesh.degree(d) > 1)
                    .map(|d| format!("{} {}", short(d), mesh.degree(d)))
                    .collect();
                format!("{} · ", dims.join("×"))
            }
        })
        .unwrap_or_default();
    let ckpt = match checkpointing {
        Checkpointing::Off => String::new(),
        Checkpointing::Full => " + checkpointing".to_string(),
        Checkpointing::Selective => " + selective checkpointing".to_string(),
        other => format!(" + {other} checkpointing"),
    };
    format!("{on}{}{ckpt}", precision.name())
}

pub fn plan(a: PlanArgs) -> CliResult {
    let (gpus, profile) = match &a.gpus {
        Some(spec) => {
            let (n, gpu) = gpu_count("--gpus", spec, gpumem_core::job::MAX_WORLD_SIZE as usize)?;
            (Some(n as u32), GpuChoice::new(gpu, None).load()?)
        }
        None => (None, a.gpu.load()?),
    };
    let model = ModelArg::load(&a.model)?.model(
        &a.model,
        "plan needs a model, not a trace file (a trace fixes its setup)",
    )?;
    let estimator = a.estimator.estimator(&a.estimator.models()?)?;
    let input = a
        .input
        .as_deref()
        .map(|i| {
            InputShape::parse(i)
                .ok_or_else(|| CliError::input(format!("--input `{i}` is not CxHxW")))
        })
        .transpose()?;
    let options = OptionValues {
        optimizer: Optimizer::parse(&a.optimizer).map_err(CliError::input)?,
        seq_len: a.seq_len,
        input,
        lora: a.lora.as_deref().map(lora).transpose()?,
        strategy: a.strategy.strategy()?,
        whole_run: a.whole_run.whole_run(),
        ..OptionValues::default()
    }
    .check()
    .map_err(CliError::input)?;
    let name = model.to_string();
    let base = gpumem_workload::Workload::new(model, 1, options)?;
    let request = PlanRequest {
        gpus,
        strategies: a.strategies,
        precisions: a.precisions,
        checkpointing: Some(a.checkpointing),
        global_batch: a.global_batch,
        bus_gbs: a.bus_gbs,
        tp: a.tp_degrees,
        pp: a.pp_degrees,
        cp: a.cp_degrees,
        ep: a.ep_degrees,
        gpus_per_node: a.gpus_per_node,
    };
    let (space, link, world) = request
        .space(&base, &profile)
        .map_err(|e| CliError::input(e.as_flag()))?;
    // A cold plan traces the model once per setup (seconds to minutes each): say how far it is.
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("tracing {bar:30} {pos}/{len} setups")
            .expect("valid template"),
    );
    let traced = |done: usize, of: usize| {
        bar.set_length(of as u64);
        bar.set_position(done as u64);
    };
    let p = search(&base, &profile, estimator.as_ref(), &space, link, &traced).map_err(
        |e| match e {
            gpumem_workload::SizeError::Workload(w) => CliError::from(w),
            e => CliError::other(e),
        },
    )?;
    bar.finish_and_clear();
    if a.json {
        let out = p.to_json(&name, &profile, &space, world, link);
        println!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(CliError::other)?
        );
        return Ok(());
    }
    print_table(&name, &profile, a.global_batch, world, link, a.top, &p);
    Ok(())
}

fn print_table(
    name: &str,
    profile: &gpumem_core::profile::GpuProfile,
    global: Option<u64>,
    world: u64,
    link: Interconnect,
    top: usize,
    p: &Plan,
) {
    let on = match world {
        1 => format!("one {} ({} MiB)", profile.name, profile.capacity_mib),
        n => format!(
            "{n} × {} ({} MiB each; collectives at {} GB/s per rank, not overlapped), sized per rank",
            profile.name, profile.capacity_mib, link.bus_gbs
        ),
    };
    match global {
        Some(g) => println!("{name} on {on}, {g} samples per optimizer step"),
        None => println!("{name} on {on}"),
    }
    // A rank's time per sample times its share of the global batch.
    let global = global.map(|g| g / world);
    let Some(best) = p.fits.first() else {
        println!("nothing fits: {}", why_nothing(p));
        return;
    };
    let time = |s: &Setup| match global {
        Some(g) => format!("{:>10.1}", s.seconds_per_sample() * g as f64 * 1e3),
        None => format!("{:>10.0}", 1.0 / s.seconds_per_sample()),
    };
    let unit = if global.is_some() {
        "ms/step"
    } else {
        "samples/s"
    };
    println!(
        "{:>3}  {:<44} {:>6} {:>6} {:>12} {:>12} {:>10}  vs best",
        "#", "setup", "micro", "accum", "peak MiB", "bound MiB", unit
    );
    for (i, s) in p.fits.iter().take(top).enumerate() {
        let slower = if i == 0 {
            "best".to_string()
        } else {
            format!(
                "{:+.0}%",
                (s.seconds_per_sample() / best.seconds_per_sample() - 1.0) * 100.0
            )
        };
        println!(
            "{:>3}  {:<44} {:>6} {:>6} {:>12.1} {:>12.1} {}  {slower}",
            i + 1,
            label(s.strategy, s.precision, s.checkpointing),
            s.micro_batch,
            s.grad_accum,
            mib(s.estimate.peak_bytes),
            mib(s.estimate.upper_bound_bytes),
            time(s)
        );
    }
    println!();
    println!(
        "best: {}, micro-batch {} × {} accumulation steps (upper bound {:.0} of {} MiB)",
        label(best.strategy, best.precision, best.checkpointing),
        best.micro_batch,
        best.grad_accum,
        mib(best.estimate.upper_bound_bytes),
        profile.capacity_mib
    );
    let mut why = Vec::new();
    let key = |s: &Setup| (s.strategy, s.precision, s.checkpointing);
    let mut kinds: Vec<(Option<Strategy>, Precision, Checkpointing)> =
        p.fits.iter().chain(&p.too_big).map(key).collect();
    kinds.sort_by_key(|&(s, p, c)| label(s, p, c));
    kinds.dedup();
    for (strategy, precision, ckpt) in kinds {
        let mine = p
            .fits
            .iter()
            .find(|s| key(s) == (strategy, precision, ckpt));
        let over = p
            .too_big
            .iter()
            .find(|s| key(s) == (strategy, precision, ckpt));
        let limit = over.map(|s| {
            format!(
                "micro-batch {} does not fit (bound {:.0} MiB)",
                s.micro_batch,
                mib(s.estimate.upper_bound_bytes)
            )
        });
        let line = match mine {
            Some(s) if std::ptr::eq(s, best) => {
                limit.map(|l| format!("(the best's own limit: {l})"))
            }
            Some(s) => Some(format!(
                "at best micro-batch {}: {:+.0}% time per sample{}",
                s.micro_batch,
                (s.seconds_per_sample() / best.seconds_per_sample() - 1.0) * 100.0,
                limit.map(|l| format!("; {l}")).unwrap_or_default()
            )),
            None => Some(limit.unwrap_or_else(|| "nothing fits".into())),
        };
        if let Some(line) = line {
            why.push(format!("  {:<44} {line}", label(strategy, precision, ckpt)));
        }
    }
    why.extend(p.skipped.iter().map(|s| {
        format!(
            "  {:<44} not planned: {}",
            label(s.strategy, s.precision, s.checkpointing),
            s.reason
        )
    }));
    if !why.is_empty() {
        println!("why the others lose:");
        println!("{}", why.join("\n"));
    }
}

fn why_nothing(p: &Plan) -> String {
    let smallest = p
        .too_big
        .iter()
        .min_by_key(|s| s.estimate.upper_bound_bytes);
    match smallest {
        Some(s) => format!(
            "the smallest setup, {} at micro-batch {}, needs {:.0} MiB (upper bound)",
            label(s.strategy, s.precision, s.checkpointing),
            s.micro_batch,
            mib(s.estimate.upper_bound_bytes)
        ),
        None => p
            .skipped
            .iter()
            .map(|s| {
                format!(
                    "{}: {}",
                    label(s.strategy, s.precision, s.checkpointing),
                    s.reason
                )
            })
            .collect::<Vec<_>>()
            .join("; "),
    }
}
