//! What several subcommands take alike: the GPU, the model argument, and the workload options
//! around it; and how library errors become exit codes.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use clap::Args;
use gpumem_core::dataset::Measurement;
use gpumem_core::estimate::Estimator;
use gpumem_core::job::{EngineKind, Optimizer, OptionValues, Precision, StrategyValues};
use gpumem_core::profile::{self, GpuProfile};
use gpumem_core::search::SearchError;
use gpumem_core::trace::Trace;
use gpumem_core::units::bytes_to_mib;
use gpumem_learn::{Hybrid, LearnedModel};
use gpumem_torch::BridgeError;
use gpumem_workload::deepspeed;
use gpumem_workload::{
    AttentionMask, Checkpointing, HalfDtype, InputShape, Lora, ModelRef, Options, Outputs,
    Strategy, Validate, Workload, WorkloadError,
};
use gpumem_workload::{accelerate, launch::LaunchConfig};

use crate::{CliError, CliResult};

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
        GpuChoice {
            gpu: gpu.into(),
            profile,
        }
    }

    pub fn load(&self) -> CliResult<GpuProfile> {
        match &self.profile {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| CliError::input(format!("{}: {e}", path.display())))?;
                GpuProfile::from_toml(&text)
                    .map_err(|e| CliError::input(format!("{}: {e}", path.display())))
            }
            None => profile::builtin(&self.gpu).map_err(CliError::input),
        }
    }
}

/// `COUNTxGPU` (e.g. `4xa100-40gb`) of option `flag`, with 1..=`max` GPUs.
pub fn gpu_count<'a>(flag: &str, spec: &'a str, max: usize) -> CliResult<(usize, &'a str)> {
    spec.split_once('x')
        .and_then(|(n, g)| {
            Some((
                n.parse::<usize>().ok().filter(|n| (1..=max).contains(n))?,
                g,
            ))
        })
        .ok_or_else(|| {
            CliError::input(format!(
                "{flag} `{spec}` is not COUNTxGPU (e.g. 4xa100-40gb)"
            ))
        })
}

/// The training loop around a model: the command-line form of [`Options`].
#[derive(Args, Clone)]
pub struct WorkloadArgs {
    /// Optimizer, as gpumem or the trainer names it: adam, adamw, sgd, sgd-momentum (each
    /// foreach, or -for-loop, -fused), adagrad, rmsprop, adafactor, torch-adafactor, muon,
    /// bitsandbytes' [paged-]adam|adamw|lion 8bit|32bit, torchao-adamw8bit|4bit|-fp8; Hugging
    /// Face Trainer's `optim` values (adamw_torch_fused, paged_adamw_8bit, …) and class paths
    /// (torch.optim.AdamW, bitsandbytes.optim.PagedAdamW8bit, …). See docs/intake.md.
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
    /// Selective activation checkpointing (PyTorch models): each repeated block checkpointed
    /// with a policy that saves its matmul and attention outputs and recomputes the rest
    /// (torchtitan's op-level mode). Implies --checkpointing.
    #[arg(long)]
    selective_checkpointing: bool,
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
    #[arg(long, default_value = "none", value_parser = Validate::parse)]
    validate: Validate,
    /// Whether the training loop holds the model's output through backward (PyTorch models):
    /// kept (`outputs = model(x); loss = criterion(outputs, y)`) or dropped (`loss =
    /// model(**batch).loss`, as Hugging Face's Trainer runs). Default: dropped for hf: models,
    /// kept for the others.
    #[arg(long, value_parser = Outputs::parse)]
    outputs: Option<Outputs>,
    /// Hugging Face models: `padded` passes the attention mask of a padded batch, which the
    /// model materialises (and which keeps flash attention out); `none` passes no mask.
    #[arg(long, default_value = "none", value_parser = AttentionMask::parse)]
    attention_mask: AttentionMask,
    /// LoRA fine-tuning (PyTorch models), as PEFT sets it up: `r=16,alpha=32,targets=q_proj,v_proj`
    /// (`targets=all-linear`: every linear layer but the output head), or a PEFT
    /// adapter_config.json. The model's own weights are frozen: no gradients, no optimizer state.
    /// `quant=nf4` (or fp4) is QLoRA: the model loaded in 4 bits first (bitsandbytes' Linear4bit
    /// for every linear layer but the output head; `double_quant=false` without QLoRA's double
    /// quantization).
    #[arg(long)]
    lora: Option<String>,
    #[command(flatten)]
    strategy: StrategyArgs,
}

/// A multi-GPU job's wrapper, as the command line names it.
#[derive(Args, Clone)]
pub struct StrategyArgs {
    /// A multi-GPU job (PyTorch models): `ddp` (DistributedDataParallel), `fsdp` (FSDP2's
    /// fully_shard per layer) or `hsdp` (FSDP2 over --nodes machines), traced as PyTorch's own
    /// wrapper runs on rank 0 of --world-size ranks (a fake process group); `zero1`, `zero2`,
    /// `zero3` (DeepSpeed ZeRO with its default settings; --deepspeed for a config), modelled
    /// from DeepSpeed's rules. --batch is then each rank's. NCCL's own buffers are included
    /// where the profile states them (nccl_mib).
    #[arg(long, requires = "world_size")]
    strategy: Option<String>,
    /// Ranks of a --strategy job.
    #[arg(long)]
    pub world_size: Option<u32>,
    /// Machines of an hsdp job (FSDP2 sharded within a machine, replicated across them).
    #[arg(long)]
    nodes: Option<u32>,
    /// DDP's gradient bucket size, MiB.
    #[arg(long, default_value_t = gpumem_core::job::DDP_BUCKET_CAP_MB)]
    bucket_cap_mb: u32,
    /// DDP's gradient_as_bucket_view: the gradients are views of the buckets.
    #[arg(long)]
    gradient_as_bucket_view: bool,
    /// FSDP2's reshard_after_forward=False: each layer's gathered parameters stay from its
    /// forward to its backward.
    #[arg(long)]
    no_reshard_after_forward: bool,
    /// FSDP2's MixedPrecisionPolicy param_dtype, bf16 or fp16: layers gathered and computed in
    /// it, gradients reduced into fp32 shards.
    #[arg(long, value_parser = ["bf16", "fp16"])]
    fsdp_param_dtype: Option<String>,
    /// FSDP2's CPUOffloadPolicy: shards, gradients and the optimizer step on the host; each
    /// layer's shards copied to the GPU for its all-gather.
    #[arg(long)]
    fsdp_cpu_offload: bool,
    /// A DeepSpeed config (JSON) for a ZeRO job: its zero_optimization settings, and what it
    /// states of the loop (bf16/fp16, optimizer type, train_micro_batch_size_per_gpu,
    /// gradient_accumulation_steps; "auto" leaves the flag's value) replace the flags. Ranks:
    /// --world-size, or train_batch_size / (micro-batch × accumulation).
    #[arg(long, conflicts_with = "strategy")]
    deepspeed: Option<PathBuf>,
    /// An accelerate config (YAML, as `accelerate config` writes it): distributed_type NO,
    /// MULTI_GPU (DDP), FSDP (traced as FSDP2) or DEEPSPEED (its deepspeed_config_file or inline
    /// settings), num_processes ranks, mixed_precision (autocast; DeepSpeed's bf16/fp16 mode
    /// under DeepSpeed) replace the flags.
    #[arg(long, conflicts_with_all = ["strategy", "deepspeed"])]
    accelerate: Option<PathBuf>,
}

impl StrategyArgs {
    /// The launch config --deepspeed or --accelerate names, read, its ranks resolved.
    pub fn launch(&self) -> CliResult<Option<LaunchConfig>> {
        let read = |flag: &str, path: &Path| {
            std::fs::read_to_string(path)
                .map_err(|e| CliError::input(format!("{flag} {}: {e}", path.display())))
        };
        if let Some(path) = &self.accelerate {
            let dir = path.parent().unwrap_or(Path::new("."));
            let l = accelerate::read_accelerate(&read("--accelerate", path)?, dir)
                .map_err(|e| CliError::input(format!("--accelerate {}: {e}", path.display())))?;
            let stated = l.strategy.map_or(1, |s| s.world_size());
            if let Some(flag) = self.world_size.filter(|w| *w != stated) {
                return Err(CliError::input(format!(
                    "--world-size {flag} disagrees with the accelerate config's num_processes ({stated})"
                )));
            }
            return Ok(Some(l));
        }
        let Some(path) = &self.deepspeed else {
            return Ok(None);
        };
        let job = deepspeed::read_config(&read("--deepspeed", path)?)
            .map_err(|e| CliError::input(format!("--deepspeed {}: {e}", path.display())))?;
        let world_size = match (self.world_size, job.world_size) {
            (Some(flag), Some(stated)) if flag != stated => {
                return Err(CliError::input(format!(
                    "--world-size {flag} disagrees with the DeepSpeed config's train_batch_size, which makes {stated} ranks"
                )));
            }
            (Some(n), _) | (None, Some(n)) => n,
            (None, None) => {
                return Err(CliError::input(
                    "--deepspeed: the config does not state train_batch_size, train_micro_batch_size_per_gpu and gradient_accumulation_steps; give --world-size",
                ));
            }
        };
        job.launch(world_size)
            .map(Some)
            .map_err(|e| CliError::input(format!("--deepspeed {}: {e}", path.display())))
    }

    /// The strategy the flags name; `None` for a one-GPU job.
    pub fn strategy(&self) -> CliResult<Option<Strategy>> {
        match self.launch()? {
            Some(launch) => Ok(launch.strategy),
            None => self.named(),
        }
    }

    /// The strategy --strategy and its flags name (no launch config), in the job document's
    /// spelling: checked as a job file's or an API request's strategy is.
    fn named(&self) -> CliResult<Option<Strategy>> {
        let Some(world_size) = self.world_size else {
            return Ok(None); // --strategy requires --world-size (clap)
        };
        let Some(name) = self.strategy.as_deref() else {
            return Err(CliError::input(
                "--world-size needs --strategy or --deepspeed",
            ));
        };
        let named = StrategyValues::named(name, world_size).ok_or_else(|| {
            CliError::input(format!(
                "--strategy `{name}` is not ddp, fsdp, hsdp, zero1, zero2 or zero3"
            ))
        })?;
        let fsdp = named.kind == EngineKind::Fsdp;
        if self.fsdp_cpu_offload && !fsdp {
            return Err(CliError::input(
                "--fsdp-cpu-offload is for --strategy fsdp or hsdp",
            ));
        }
        let values = match named.kind {
            EngineKind::Fsdp => StrategyValues {
                reshard_after_forward: Some(!self.no_reshard_after_forward),
                param_dtype: self.fsdp_param_dtype.as_deref().map(|d| {
                    if d == "bf16" {
                        HalfDtype::Bf16
                    } else {
                        HalfDtype::Fp16
                    }
                }),
                replicas: match (name, self.nodes) {
                    ("hsdp", Some(nodes)) => Some(nodes),
                    ("hsdp", None) => return Err(CliError::input("--strategy hsdp needs --nodes")),
                    (_, Some(_)) => return Err(CliError::input("--nodes is for --strategy hsdp")),
                    (_, None) => None,
                },
                cpu_offload: self.fsdp_cpu_offload.then_some(true),
                ..named
            },
            EngineKind::Ddp => StrategyValues {
                bucket_cap_mb: Some(self.bucket_cap_mb),
                bucket_view: Some(self.gradient_as_bucket_view),
                ..named
            },
            EngineKind::Zero => named,
        };
        Strategy::try_from(values)
            .map(Some)
            .map_err(CliError::input)
    }
}

impl WorkloadArgs {
    /// The typed options, each parsed value named by its flag where it is wrong.
    pub fn options(&self) -> CliResult<Options> {
        let input = match &self.input {
            Some(i) => Some(
                InputShape::parse(i)
                    .ok_or_else(|| CliError::input(format!("--input `{i}` is not CxHxW")))?,
            ),
            None => None,
        };
        let options = OptionValues {
            optimizer: Optimizer::parse(&self.optimizer).map_err(CliError::input)?,
            precision: Precision::parse(&self.precision).map_err(CliError::input)?,
            input,
            seq_len: self.seq_len,
            checkpointing: match (self.checkpointing, self.selective_checkpointing) {
                (_, true) => Checkpointing::Selective,
                (true, false) => Checkpointing::Full,
                (false, false) => Checkpointing::Off,
            },
            channels_last: self.channels_last,
            grad_accum: self.grad_accum,
            data_parallel: self.data_parallel,
            validate: self.validate,
            outputs: self.outputs,
            attention_mask: self.attention_mask,
            lora: self.lora.as_deref().map(lora).transpose()?,
            strategy: None,
        };
        // The launch config, read once: its strategy, and what it fixes of the loop.
        match self.strategy.launch()? {
            Some(launch) => launch.stated.over(OptionValues {
                strategy: launch.strategy,
                ..options
            }),
            None => OptionValues {
                strategy: self.strategy.named()?,
                ..options
            }
            .check(),
        }
        .map_err(CliError::input)
    }

    /// The micro-batch a launch config states (DeepSpeed's `train_micro_batch_size_per_gpu`),
    /// which a command's default batch gives way to.
    pub fn stated_batch(&self) -> CliResult<Option<i64>> {
        Ok(self
            .strategy
            .launch()?
            .and_then(|l| l.stated.micro_batch)
            .map(|b| i64::try_from(b).unwrap_or(i64::MAX)))
    }

    /// The workload of `model` at `batch` (as typed: negative sizes are refused here).
    pub fn workload(&self, model: ModelRef, batch: i64) -> CliResult<Workload> {
        let batch = u64::try_from(batch).map_err(|_| {
            CliError::input(format!(
                "--batch {batch} is out of range (1..={})",
                gpumem_core::families::MAX_BATCH
            ))
        })?;
        Ok(Workload::new(model, batch, self.options()?)?)
    }
}

/// `--lora`: a PEFT adapter_config.json where the text names a file, else the inline form.
pub fn lora(spec: &str) -> CliResult<Lora> {
    let path = std::path::Path::new(spec);
    let parsed = if spec.ends_with(".json") || path.is_file() {
        let text = std::fs::read_to_string(path)
            .map_err(|e| CliError::input(format!("--lora {spec}: {e}")))?;
        Lora::from_peft_json(&text)
    } else {
        Lora::parse(spec)
    };
    parsed.map_err(|e| CliError::input(format!("--lora {spec}: {e}")))
}

impl From<WorkloadError> for CliError {
    fn from(e: WorkloadError) -> Self {
        match e {
            WorkloadError::Tracer(b) => b.into(),
            e if e.is_input() => CliError::input(e),
            e => CliError::Model(e.to_string()),
        }
    }
}

impl From<gpumem_workload::SizeError> for CliError {
    fn from(e: gpumem_workload::SizeError) -> Self {
        match e {
            gpumem_workload::SizeError::Workload(w) => w.into(),
            // As `estimate` reports an estimator's refusal: bad input (a job too large for any GPU).
            gpumem_workload::SizeError::Estimate(e) => CliError::input(e),
            gpumem_workload::SizeError::Search(SearchError::Estimate(e)) => CliError::input(e),
            // Evaluating or searching gpumem's own symbolic trace failed: not the user's input.
            gpumem_workload::SizeError::Search(e) => CliError::other(e),
        }
    }
}

impl From<BridgeError> for CliError {
    fn from(e: BridgeError) -> Self {
        match e {
            BridgeError::Reference(m) => CliError::Input(m),
            e @ BridgeError::Io { .. } => CliError::other(e),
            e => CliError::Model(e.to_string()),
        }
    }
}

/// Which estimator answers, and the learned models beside it.
#[derive(Args, Clone)]
pub struct EstimatorArgs {
    /// replay (default), live-tensors, horus, or learned (the hybrid: needs a memory model from
    /// `gpumem learn train --target memory --model gbt` in --learned-model).
    #[arg(long, default_value = "replay")]
    pub estimator: String,
    /// A model from `gpumem learn train` (repeatable): the memory model with a bound is the
    /// hybrid of --estimator learned; `estimate` also prints each model's own answer (a
    /// utilization model replaces the physical model's figure). Native specs only.
    #[arg(long)]
    pub learned_model: Vec<PathBuf>,
}

impl EstimatorArgs {
    /// The learned models, read.
    pub fn models(&self) -> CliResult<Vec<(PathBuf, LearnedModel)>> {
        self.learned_model
            .iter()
            .map(|p| Ok((p.clone(), LearnedModel::read(p).map_err(CliError::input)?)))
            .collect()
    }

    /// The estimator by name; `learned` is the hybrid among `models`.
    pub fn estimator(&self, models: &[(PathBuf, LearnedModel)]) -> CliResult<Box<dyn Estimator>> {
        let hybrid = models
            .iter()
            .find(|(_, m)| Hybrid::accepts(m))
            .map(|(p, _)| p.as_path());
        gpumem_learn::estimator(&self.estimator, hybrid).map_err(CliError::input)
    }
}

/// A model argument: a trace file, or a model (native spec or PyTorch reference).
pub enum ModelArg {
    TraceFile(Trace),
    Model(ModelRef),
}

impl ModelArg {
    pub fn load(arg: &str) -> CliResult<ModelArg> {
        let path = Path::new(arg);
        if path.is_file() {
            let f = File::open(path).map_err(|e| CliError::input(format!("{arg}: {e}")))?;
            return Trace::read(BufReader::new(f))
                .map(ModelArg::TraceFile)
                .map_err(|e| CliError::input(format!("{arg}: {e}")));
        }
        if arg.ends_with(".jsonl") || arg.ends_with(".trace") {
            return Err(CliError::input(format!("{arg}: no such trace file")));
        }
        ModelRef::parse(arg)
            .map(ModelArg::Model)
            .map_err(CliError::input)
    }

    /// The model, where the argument is not a trace file (`what` says which command needs one).
    pub fn model(self, arg: &str, what: &str) -> CliResult<ModelRef> {
        match self {
            ModelArg::Model(m) => Ok(m),
            ModelArg::TraceFile(_) => Err(CliError::input(format!("{arg}: {what}"))),
        }
    }
}

/// A measurements CSV.
pub fn read_csv(path: &Path) -> CliResult<Vec<Measurement>> {
    Ok(read_rows(path)?.measured)
}

/// A measurement CSV's rows, those that did not fit on the GPU too.
pub fn read_rows(path: &Path) -> CliResult<gpumem_core::dataset::Rows> {
    let f = File::open(path).map_err(|e| CliError::input(format!("{}: {e}", path.display())))?;
    gpumem_core::dataset::read_rows(&path.display().to_string(), BufReader::new(f))
        .map_err(CliError::input)
}

/// Bytes as MiB rounded to 0.1, for JSON output.
pub fn mib(b: u64) -> f64 {
    (bytes_to_mib(b) * 10.0).round() / 10.0
}

/// The trace of a measured row's job (its own options over `defaults`). `Err(reason)` inside
/// `Ok` means the row cannot be modelled here and is skipped: its model is not one gpumem can
/// trace, or the tracer failed on it.
pub fn row_trace(
    m: &Measurement,
    defaults: &Options,
    profile: &GpuProfile,
) -> CliResult<Result<Trace, String>> {
    let Some(w) = Workload::of_row(m, defaults)? else {
        return Ok(Err(format!(
            "`{}` is neither a native spec nor a PyTorch reference",
            m.label
        )));
    };
    match w.trace(profile) {
        Ok(t) => Ok(Ok(t)),
        Err(e @ WorkloadError::Tracer(_)) => Ok(Err(e.to_string())),
        Err(e) => Err(CliError::input(format!("line {}: {e}", m.line))),
    }
}
