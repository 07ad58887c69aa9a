//! What several subcommands take alike: the GPU, the model argument, and the workload options
//! around it; and how library errors become exit codes.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use clap::Args;
use gpumem_core::dataset::Measurement;
use gpumem_core::estimate::Estimator;
use gpumem_core::hub::{HubCache, HubError, HubSource};
use gpumem_core::job::{
    EngineKind, Evaluation, Filters, Generation, LengthSchedule, LengthSource, Liger, MeshValues,
    Optimizer, OptionValues, Precision, RoutingImbalance, Save, Schedule, StrategyValues, WholeRun,
};
use gpumem_core::model::ModelError;
use gpumem_core::profile::{self, GpuProfile};
use gpumem_core::search::SearchError;
use gpumem_core::trace::Trace;
use gpumem_learn::{Hybrid, LearnedModel};
use gpumem_torch::{BridgeError, TorchTracer};
use gpumem_workload::deepspeed;
use gpumem_workload::train_config::{self, TrainConfig, TrainerKind};
use gpumem_workload::{
    Attention, AttentionMask, Checkpointing, HalfDtype, InputShape, Lora, ModelRef, Options,
    Outputs, Strategy, Validate, Workload, WorkloadError,
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

    /// The flags that choose this GPU again.
    pub fn flags(&self) -> Vec<String> {
        match &self.profile {
            Some(path) => vec!["--profile".into(), path.display().to_string()],
            None => vec!["--gpu".into(), self.gpu.clone()],
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

/// The whole run a job states (docs/run.md): the command-line form of [`WholeRun`], shared by
/// `estimate`, `max-batch` and `plan`.
#[derive(Args, Clone)]
pub struct WholeRunArgs {
    /// Size the whole run (docs/run.md), not the training step alone: the model's load (a
    /// QLoRA model quantized as it loads), the steps, and the evaluation --eval-batches states;
    /// each part's peak is reported.
    #[arg(long)]
    whole_run: bool,
    /// The whole run ends with Hugging Face Trainer's evaluation loop of N batches (implies
    /// --whole-run).
    #[arg(long, value_name = "N")]
    eval_batches: Option<u32>,
    /// Samples per evaluation batch (per_device_eval_batch_size; default: --batch).
    #[arg(long, value_name = "B", requires = "eval_batches")]
    eval_batch_size: Option<u64>,
    /// Every K evaluation batches the kept predictions move to the host
    /// (eval_accumulation_steps; default: they stay on the GPU to the end).
    #[arg(long, value_name = "K", requires = "eval_batches")]
    eval_accumulation_steps: Option<u32>,
    /// The evaluation keeps each batch's logits and labels for metrics (a Trainer with a
    /// compute_metrics); without it, the losses only.
    #[arg(long, requires = "eval_batches")]
    eval_logits: bool,
    /// With --eval-logits, each batch's inputs are kept too (include_for_metrics=["inputs"]).
    #[arg(long, requires = "eval_logits")]
    eval_inputs: bool,
    /// What the evaluation keeps stays a list of batches (eval_do_concat_batches=False).
    #[arg(long, requires = "eval_batches")]
    eval_no_concat: bool,
    /// After the evaluation, the model generates N tokens after each prompt (implies
    /// --whole-run): model.generate() as TRL's rollouts run it, through the model's own
    /// key/value cache.
    #[arg(long, value_name = "N")]
    generate_tokens: Option<u32>,
    /// Prompts per generation batch (default: --batch).
    #[arg(long, value_name = "B", requires = "generate_tokens")]
    generate_batch_size: Option<u64>,
    /// Tokens per prompt (default: --seq-len).
    #[arg(long, value_name = "L", requires = "generate_tokens")]
    generate_prompt_len: Option<u64>,
    /// Each token sampled from the K most likely (transformers' top-k filter).
    #[arg(long, value_name = "K", requires = "generate_tokens")]
    generate_top_k: Option<u32>,
    /// Each token sampled from the nucleus of probability P (transformers' top-p filter; 1 is
    /// none).
    #[arg(long, value_name = "P", requires = "generate_tokens", value_parser = probability)]
    generate_top_p: Option<f64>,
    /// Tokens under P times the most likely one's probability masked (transformers' min-p
    /// filter; 0 is none).
    #[arg(long, value_name = "P", requires = "generate_tokens", value_parser = probability)]
    generate_min_p: Option<f64>,
    /// The whole run ends with a checkpoint's save (implies --whole-run): sharded (each rank
    /// its own; on one GPU, torch.save: nothing more on the GPU), full (FSDP2's full state
    /// dicts, gathered on every rank's GPU; ZeRO-3's consolidated 16-bit weights, gathered
    /// module by module) or full-offload (each gathered tensor sent to the host as it is
    /// gathered).
    #[arg(long, value_parser = Save::parse, value_name = "HOW")]
    save: Option<Save>,
    /// The run resumes from a checkpoint (implies --whole-run): the optimizer state is read in
    /// during the load, beside the live model — on one GPU and under DDP as torch.load onto
    /// the GPU (Hugging Face's Trainer), under FSDP2 as torch.distributed.checkpoint's sharded
    /// load.
    #[arg(long)]
    resume: bool,
    /// FSDP: the model loads on rank 0 and is broadcast one whole parameter at a time
    /// (accelerate's cpu_ram_efficient_loading, sync_module_states; implies --whole-run).
    #[arg(long)]
    broadcast_load: bool,
}

/// A probability, 0 to 1.
fn probability(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("`{s}` is not a probability (0 to 1)")),
    }
}

impl WholeRunArgs {
    /// The whole run the flags state: `--whole-run`, or any `--eval-*`, `--generate-*`, `--save`,
    /// `--resume` or `--broadcast-load`.
    pub fn whole_run(&self) -> Option<WholeRun> {
        let evaluation = self.eval_batches.map(|batches| Evaluation {
            batches,
            batch_size: self.eval_batch_size,
            accumulation_steps: self.eval_accumulation_steps,
            logits: self.eval_logits,
            inputs: self.eval_inputs,
            as_list: self.eval_no_concat,
        });
        let generation = self.generate_tokens.map(|new_tokens| Generation {
            new_tokens,
            batch_size: self.generate_batch_size,
            prompt_len: self.generate_prompt_len,
            filters: Filters {
                top_k: self.generate_top_k,
                top_p: self.generate_top_p.is_some_and(|p| p < 1.0),
                min_p: self.generate_min_p.is_some_and(|p| p > 0.0),
            },
        });
        let stated = evaluation.is_some() || generation.is_some();
        let load = self.resume || self.broadcast_load;
        (self.whole_run || stated || self.save.is_some() || load).then_some(WholeRun {
            evaluation,
            generation,
            save: self.save,
            resume: self.resume,
            broadcast_load: self.broadcast_load,
        })
    }
}

/// The training loop around a model: the command-line form of [`Options`].
#[derive(Args, Clone)]
pub struct WorkloadArgs {
    /// Optimizer (default adam), as gpumem or the trainer names it: adam, adamw, sgd, sgd-momentum (each
    /// foreach, or -for-loop, -fused), adagrad, rmsprop, adafactor, torch-adafactor, muon,
    /// bitsandbytes' [paged-]adam|adamw|lion 8bit|32bit, torchao-adamw8bit|4bit|-fp8; Hugging
    /// Face Trainer's `optim` values (adamw_torch_fused, paged_adamw_8bit, …) and class paths
    /// (torch.optim.AdamW, bitsandbytes.optim.PagedAdamW8bit, …). See docs/intake.md.
    #[arg(long)]
    optimizer: Option<String>,
    /// Precision: fp32 (default), amp-fp16, amp-bf16 (autocast), or fp16/bf16 (pure: weights,
    /// gradients and optimizer state in that dtype; PyTorch models).
    #[arg(long)]
    precision: Option<String>,
    /// Input shape CxHxW (PyTorch image models; default: the model's own), or `CxMIN..MAX`
    /// for square images whose side varies by step (multi-scale training: a seeded run of
    /// --steps steps, uniform over the range, each side a multiple of --pad-to-multiple-of).
    #[arg(long)]
    input: Option<String>,
    /// Sequence length (PyTorch sequence models): `N`, or `MIN..MAX` for batches padded to a
    /// length that varies by step (a seeded run of --steps steps, uniform over the range).
    #[arg(long)]
    seq_len: Option<String>,
    /// A dataset's token-length histogram (CSV `length,count` lines): each step's length
    /// drawn from it, weighted by the counts.
    #[arg(long, conflicts_with = "seq_len")]
    seq_len_histogram: Option<PathBuf>,
    /// With a varying length or image side: each step's rounded up to a multiple of this
    /// (Hugging Face's pad_to_multiple_of; a detector's stride, 32 for YOLO).
    #[arg(long, default_value_t = 1)]
    pad_to_multiple_of: u64,
    /// With a varying length or image side: how many steps the run draws.
    #[arg(long, default_value_t = gpumem_core::job::lengths::DEFAULT_STEPS)]
    steps: u32,
    /// With a varying length or image side: the seed of the draws.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Activation checkpointing of the repeated blocks (PyTorch models), as a trainer means it:
    /// `--checkpointing` alone is full (non-reentrant); `--checkpointing=MODE` one of off,
    /// full, full-reentrant, selective (gpumem's: every matmul and attention output saved),
    /// selective-op (torchtitan's op policy), selective-attention (Megatron-LM's and NeMo's
    /// selective: each attention's core recomputed), selective-layer:N (torchtitan's every Nth
    /// block).
    #[arg(long, num_args = 0..=1, require_equals = true, default_missing_value = "full", value_name = "MODE")]
    checkpointing: Option<String>,
    /// Same as --checkpointing=selective: each repeated block checkpointed with gpumem's policy,
    /// which saves every matmul and attention output and recomputes the rest.
    #[arg(long)]
    selective_checkpointing: bool,
    /// channels_last memory format (PyTorch image models).
    #[arg(long)]
    channels_last: bool,
    /// Gradient accumulation steps (PyTorch models; default 1).
    #[arg(long)]
    grad_accum: Option<u32>,
    /// The optimizer steps in backward (PyTorch models): each parameter's step runs as its
    /// gradient is ready, and frees that gradient (torchtune's optimizer_in_bwd). One GPU,
    /// no gradient accumulation.
    #[arg(long)]
    optimizer_in_backward: bool,
    /// The gradients kept between steps (PyTorch models): `zero_grad(set_to_none=False)`
    /// zeroes them in place instead of freeing them, as PyTorch before 2.0 did by default.
    #[arg(long)]
    keep_grads: bool,
    /// torch.compile as the trainer applies it to the loss (PyTorch models; torchtitan's and
    /// torchtune's compiled loss, a Hugging Face model's loss_function): the loss traced as
    /// AOTAutograd and Inductor compile it. A compiled model's blocks are traced eagerly.
    #[arg(long)]
    compile: bool,
    /// Chunked cross-entropy (causal language models): the output projection on N chunks of
    /// the sequence, each upcast to fp32 for the loss in turn (torchtune's
    /// CEWithChunkedOutputLoss; it uses 8), in place of the model's own loss.
    #[arg(long, value_name = "N")]
    chunked_ce: Option<u32>,
    /// Float8 training of the linear layers by torchao's own Float8Linear (torchao installed
    /// beside torch), as torchtitan's float8 converter swaps it in: every nn.Linear whose
    /// dimensions are multiples of 16 but the output head. RECIPE: torchao's tensorwise,
    /// rowwise or rowwise_with_gw_hp.
    #[arg(long, value_name = "RECIPE", value_parser = float8_recipe)]
    float8: Option<gpumem_core::job::Float8Recipe>,
    /// With --float8 tensorwise under FSDP: the weights all-gathered in float8 (torchtitan's
    /// enable_fsdp_float8_all_gather).
    #[arg(long, requires = "float8")]
    float8_all_gather: bool,
    /// The activations saved for backward offloaded to the host in forward and brought back in
    /// backward, by torchtune's own OffloadActivations (torchtune's
    /// enable_activation_offloading; torchtune must be installed beside torch).
    #[arg(long)]
    activation_offloading: bool,
    /// A frozen copy of the model beside it, run without gradients on each step's batch before
    /// it (TRL's KL reference: GRPO, DPO, PPO with beta > 0 and no PEFT adapter). One GPU or
    /// DDP; not with --lora (TRL's reference is then the base model, adapters off).
    #[arg(long)]
    reference_model: bool,
    /// Liger's kernels in place of a Hugging Face model's own (as `use_liger_kernel` switches
    /// them on): alone, Liger's defaults for the model's type (rope, the norm, the MLP's gate,
    /// the fused linear cross-entropy); KERNEL=true|false,… sets kernels by Liger's names
    /// (rope, rms_norm, layer_norm, swiglu, geglu, cross_entropy, fused_linear_cross_entropy),
    /// after an `=`: `--liger=rope=false`.
    /// Liger's own code is traced: it must be installed beside torch.
    #[arg(
        long,
        value_name = "KERNELS",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = ""
    )]
    liger: Option<String>,
    #[command(flatten)]
    whole_run: WholeRunArgs,
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
    /// Hugging Face models: the attention implementation (`attn_implementation`): sdpa, eager
    /// (the model's own code: scores and softmax materialised) or flash (FlashAttention-2:
    /// fp16/bf16 on an Ampere or newer GPU). Default: the model's own default.
    #[arg(long, value_parser = Attention::parse)]
    attention: Option<Attention>,
    /// LoRA fine-tuning (PyTorch models), as PEFT sets it up: `r=16,alpha=32,targets=q_proj,v_proj`
    /// (`targets=all-linear`: every linear layer but the output head), or a PEFT
    /// adapter_config.json. The model's own weights are frozen: no gradients, no optimizer state.
    /// `quant=nf4` (or fp4) is QLoRA: the model loaded in 4 bits first (bitsandbytes' Linear4bit
    /// for every linear layer but the output head; `double_quant=false` without QLoRA's double
    /// quantization; `loader=fabric`: Lightning Fabric's quantizer, litgpt's, head included;
    /// `bnb=0.42`: the bitsandbytes release, whose 4-bit layers kept their inputs before 0.43.2).
    #[arg(long)]
    lora: Option<String>,
    #[command(flatten)]
    strategy: StrategyArgs,
    /// A trainer's config as the job (docs/intake.md): Hugging Face TrainingArguments or TRL
    /// SFTConfig (JSON/YAML), axolotl YAML, torchtune YAML, torchtitan TOML, a torchtitan Python
    /// config `FILE.py:FUNCTION` (called by GPUMEM_PYTHON), a Lightning CLI YAML, DeepSpeed JSON or
    /// accelerate YAML. Its model, micro-batch and loop are the job's; flags given explicitly
    /// override them (each override is stated); keys gpumem does not model are listed.
    /// --world-size gives the launcher's ranks where the config leaves them to it.
    #[arg(long, conflicts_with_all = ["deepspeed", "accelerate"])]
    train_config: Option<String>,
    /// The config's kind where it cannot be told from its keys: hf-trainer, trl-sft, axolotl,
    /// torchtune, torchtitan-toml, torchtitan-python, lightning, litgpt, deepspeed, accelerate.
    #[arg(long, requires = "train_config", value_parser = TrainerKind::parse)]
    train_config_kind: Option<TrainerKind>,
    /// The config, read once.
    #[arg(skip)]
    read: std::sync::OnceLock<TrainConfig>,
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
    /// Tensor-parallel ranks (docs/parallelism.md): each layer split over N ranks with
    /// PyTorch's DTensor plans as torchtitan applies them, sequence parallelism between layers.
    /// Alone, a job of N ranks; with --strategy fsdp or hsdp, N of --world-size's ranks, FSDP
    /// sharding over the rest. Hugging Face decoders (their base_model_tp_plan).
    #[arg(long, conflicts_with_all = ["deepspeed", "accelerate"])]
    pub tp: Option<u32>,
    /// With --tp: no sequence parallelism — the norms and the stream between layers whole on
    /// every rank, each row-wise layer's output all-reduced (Megatron-LM without
    /// --sequence-parallel).
    #[arg(long, requires = "tp")]
    no_sequence_parallel: bool,
    /// Pipeline stages (docs/parallelism.md): the decoder's layers cut into N consecutive
    /// stages, one rank each, micro-batches through them in --pp-schedule's order; every
    /// stage's rank is sized and the worst answers. Alone, a job of N ranks (× --tp); with
    /// --strategy fsdp or hsdp, within --world-size. Hugging Face decoders.
    #[arg(long, conflicts_with_all = ["deepspeed", "accelerate"])]
    pub pp: Option<u32>,
    /// Context-parallel ranks (docs/parallelism.md): each rank its chunks of the sequence,
    /// attention over the whole of it by PyTorch's ring attention (keys and values gathered),
    /// with torchtitan's own apply_cp_to_attention_module; FSDP shards over these ranks too.
    /// Composes as --tp does. torchtitan's models.
    #[arg(long, conflicts_with_all = ["deepspeed", "accelerate"])]
    pub cp: Option<u32>,
    /// Expert-parallel ranks (docs/parallelism.md): a torchtitan mixture-of-experts model's
    /// routed experts split over N ranks borrowed from --strategy fsdp's (and --tp's), tokens
    /// sent to them by all-to-all, with torchtitan's own apply_moe_ep_tp. The estimate routes
    /// tokens evenly over the experts.
    #[arg(long, requires = "strategy", conflicts_with_all = ["deepspeed", "accelerate"])]
    pub ep: Option<u32>,
    /// The router imbalance the upper bound assumes (with --ep; default 1, balanced): each
    /// rank's experts get F times their even share of the tokens, as far as top-k routing
    /// allows. Traced on its own beside the estimate's balanced trace.
    #[arg(long, requires = "ep")]
    routing_imbalance: Option<f64>,
    /// The pipeline schedule: gpipe, 1f1b (default), interleaved-1f1b or zero-bubble.
    #[arg(long, requires = "pp")]
    pp_schedule: Option<String>,
    /// Micro-batches each rank's --batch is split into (default: the stages).
    #[arg(long, requires = "pp")]
    microbatches: Option<u32>,
    /// Chunks of layers per pipeline rank (interleaved-1f1b: at least 2, its default;
    /// zero-bubble: default 1).
    #[arg(long, requires = "pp")]
    virtual_stages: Option<u32>,
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
    /// Under --grad-accum, FSDP reduce-scatters each micro-batch's gradients as backward makes
    /// them (torchtitan, torchtune, Lightning's Trainer, accelerate's sync_each_batch=True).
    /// Without it they accumulate unsharded until the last micro-batch (FSDP's no_sync, as
    /// accelerate, Hugging Face's Trainer and Fabric accumulate): one whole gradient more.
    #[arg(long)]
    sync_each_batch: bool,
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
        let model_parallel = match (self.tp, self.pp, self.cp) {
            (None, None, None) => None,
            (tp, pp, cp) => Some(
                [tp, pp, cp]
                    .into_iter()
                    .map(|d| d.unwrap_or(1))
                    .fold(1u32, u32::saturating_mul),
            ),
        };
        let (name, world_size) = match (self.strategy.as_deref(), self.world_size, model_parallel) {
            // Tensor or pipeline parallelism alone: FSDP's engine over no shard ranks.
            (None, None, Some(ranks)) => ("fsdp", ranks),
            (None, Some(_), Some(_)) => {
                return Err(CliError::input(
                    "--tp, --pp or --cp with --world-size needs --strategy fsdp or hsdp (how the other ranks share the model)",
                ));
            }
            (None, Some(_), None) => {
                return Err(CliError::input(
                    "--world-size needs --strategy or --deepspeed",
                ));
            }
            (Some(name), Some(w), _) => (name, w),
            // --strategy requires --world-size (clap). FSDP's settings with no strategy to take
            // them (plan --gpus plans FSDP with its defaults) are refused, not ignored.
            (_, None, _) => {
                let fsdp = [
                    (self.fsdp_param_dtype.is_some(), "--fsdp-param-dtype"),
                    (self.fsdp_cpu_offload, "--fsdp-cpu-offload"),
                    (self.no_reshard_after_forward, "--no-reshard-after-forward"),
                    (self.sync_each_batch, "--sync-each-batch"),
                ];
                return match fsdp.into_iter().find(|(given, _)| *given) {
                    Some((_, flag)) => Err(CliError::input(format!(
                        "{flag} is for --strategy fsdp or hsdp with --world-size"
                    ))),
                    None => Ok(None),
                };
            }
        };
        let named = StrategyValues::named(name, world_size).ok_or_else(|| {
            CliError::input(format!(
                "--strategy `{name}` is not ddp, fsdp, hsdp, zero1, zero2 or zero3"
            ))
        })?;
        let fsdp = named.kind == EngineKind::Fsdp;
        if model_parallel.is_some() && !fsdp {
            return Err(CliError::input(format!(
                "--tp, --pp and --cp compose with --strategy fsdp or hsdp, not {name}"
            )));
        }
        for (given, flag) in [
            (self.fsdp_cpu_offload, "--fsdp-cpu-offload"),
            (self.sync_each_batch, "--sync-each-batch"),
        ] {
            if given && !fsdp {
                return Err(CliError::input(format!(
                    "{flag} is for --strategy fsdp or hsdp"
                )));
            }
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
                sync_each_batch: self.sync_each_batch.then_some(true),
                ..named
            },
            EngineKind::Ddp => StrategyValues {
                bucket_cap_mb: Some(self.bucket_cap_mb),
                bucket_view: Some(self.gradient_as_bucket_view),
                ..named
            },
            EngineKind::Zero => named,
        };
        if self.ep.is_some() && !fsdp {
            return Err(CliError::input(format!(
                "--ep borrows the ranks of --strategy fsdp or hsdp, not {name}"
            )));
        }
        let routing_imbalance = self
            .routing_imbalance
            .map(RoutingImbalance::new)
            .transpose()
            .map_err(CliError::input)?;
        let values = match model_parallel.or(self.ep) {
            Some(_) => StrategyValues {
                mesh: Some(MeshValues {
                    expert: self.ep,
                    ..model_parallel_mesh(
                        world_size,
                        values.replicas.unwrap_or(1),
                        [
                            self.tp.unwrap_or(1),
                            self.pp.unwrap_or(1),
                            self.cp.unwrap_or(1),
                        ],
                    )?
                }),
                routing_imbalance,
                sequence_parallel: self.no_sequence_parallel.then_some(false),
                world_size: None,
                replicas: None,
                schedule: self
                    .pp_schedule
                    .as_deref()
                    .map(|name| {
                        Schedule::parse(name).ok_or_else(|| {
                            CliError::input(format!(
                                "--pp-schedule `{name}` is not gpipe, 1f1b, interleaved-1f1b or zero-bubble"
                            ))
                        })
                    })
                    .transpose()?,
                microbatches: self.microbatches,
                virtual_stages: self.virtual_stages,
                ..values
            },
            None => values,
        };
        Strategy::try_from(values)
            .map(Some)
            .map_err(CliError::input)
    }
}

/// The mesh of `world_size` ranks in `pp` pipeline stages of `cp` context-parallel groups of
/// `tp` tensor-parallel ranks each, FSDP sharding over the rest within `replicas` groups.
fn model_parallel_mesh(
    world_size: u32,
    replicas: u32,
    [tp, pp, cp]: [u32; 3],
) -> CliResult<MeshValues> {
    let group = [tp, pp, cp].into_iter().fold(replicas, u32::saturating_mul);
    if group == 0 || !world_size.is_multiple_of(group) {
        let nodes = if replicas > 1 {
            format!(" × --nodes {replicas}")
        } else {
            String::new()
        };
        return Err(CliError::input(format!(
            "--world-size {world_size} is not a multiple of --tp {tp} × --pp {pp} × --cp {cp}{nodes}"
        )));
    }
    Ok(MeshValues {
        replicate: Some(replicas),
        shard: Some(world_size / group),
        tensor: Some(tp),
        pipeline: Some(pp),
        context: Some(cp),
        ..MeshValues::default()
    })
}

impl WorkloadArgs {
    /// `--seq-len N`.
    fn fixed_seq_len(&self) -> CliResult<Option<u64>> {
        match &self.seq_len {
            Some(t) if !t.contains("..") => t.trim().parse::<u64>().map(Some).map_err(|_| {
                CliError::input(format!(
                    "--seq-len `{t}` is not a length N or a range MIN..MAX"
                ))
            }),
            _ => Ok(None),
        }
    }

    /// `--seq-len MIN..MAX` or `--seq-len-histogram FILE`, with the run's steps and seed.
    fn seq_lens(&self) -> CliResult<Option<LengthSchedule>> {
        let source = match (&self.seq_len, &self.seq_len_histogram) {
            (Some(t), _) if t.contains("..") => {
                LengthSchedule::parse_range(t).map_err(CliError::input)?
            }
            (_, Some(file)) => {
                let text = std::fs::read_to_string(file).map_err(|e| {
                    CliError::input(format!("--seq-len-histogram {}: {e}", file.display()))
                })?;
                LengthSchedule::parse_histogram(&text)
                    .map_err(|e| CliError::input(format!("{}: {e}", file.display())))?
            }
            _ => return Ok(None),
        };
        LengthSchedule::new(source, self.pad_to_multiple_of, self.steps, self.seed)
            .map(Some)
            .map_err(CliError::input)
    }

    /// `--input CxHxW`, or `CxMIN..MAX`: the largest square and the schedule of its sides.
    fn input(&self) -> CliResult<(Option<InputShape>, Option<LengthSchedule>)> {
        let Some(text) = &self.input else {
            return Ok((None, None));
        };
        let bad = || CliError::input(format!("--input `{text}` is not CxHxW or CxMIN..MAX"));
        if !text.contains("..") {
            return Ok((Some(InputShape::parse(text).ok_or_else(bad)?), None));
        }
        let (channels, range) = text.split_once('x').ok_or_else(bad)?;
        let channels = channels.parse::<u64>().map_err(|_| bad())?;
        let source = LengthSchedule::parse_range(range).map_err(|_| {
            CliError::input(format!(
                "--input `{text}`: the side's range is MIN..MAX, whole numbers with 1 <= MIN <= MAX"
            ))
        })?;
        let LengthSource::Range { max, .. } = source else {
            return Err(bad());
        };
        let schedule = LengthSchedule::new(source, self.pad_to_multiple_of, self.steps, self.seed)
            .map_err(CliError::input)?;
        let largest = max.div_ceil(self.pad_to_multiple_of) * self.pad_to_multiple_of;
        let shape = InputShape::square(channels, largest).ok_or_else(bad)?;
        Ok((Some(shape), Some(schedule)))
    }

    /// Whether the sequence length or the image side varies by step.
    pub fn varies(&self) -> CliResult<bool> {
        Ok(self.seq_lens()?.is_some() || self.input()?.1.is_some())
    }

    /// The trainer config --train-config names, read (once).
    pub fn train_config(&self) -> CliResult<Option<&TrainConfig>> {
        let Some(spec) = &self.train_config else {
            return Ok(None);
        };
        if let Some(c) = self.read.get() {
            return Ok(Some(c));
        }
        let c = train_config::read_file(
            spec,
            self.train_config_kind,
            &gpumem_torch::TorchTracer::from_env(),
        )
        .map_err(|e| CliError::input(format!("--train-config {e}")))?;
        Ok(Some(self.read.get_or_init(|| c)))
    }

    /// The typed options, each parsed value named by its flag where it is wrong.
    pub fn options(&self) -> CliResult<Options> {
        Ok(self.options_and_overrides()?.0)
    }

    /// The typed options, and where a flag given explicitly overrode what --train-config
    /// states (each as one line).
    pub fn options_and_overrides(&self) -> CliResult<(Options, Vec<String>)> {
        let (input, image_sides) = self.input()?;
        let optimizer = self
            .optimizer
            .as_deref()
            .map(Optimizer::parse)
            .transpose()
            .map_err(CliError::input)?;
        let precision = self
            .precision
            .as_deref()
            .map(Precision::parse)
            .transpose()
            .map_err(CliError::input)?;
        let checkpointing = match (&self.checkpointing, self.selective_checkpointing) {
            (None, true) => Some(Checkpointing::Selective),
            (None, false) => None,
            (Some(mode), selective) => {
                let mode = Checkpointing::parse(mode)
                    .map_err(|e| CliError::input(format!("--checkpointing: {e}")))?;
                if selective && mode != Checkpointing::Selective && mode != Checkpointing::Full {
                    return Err(CliError::input(format!(
                        "--selective-checkpointing is --checkpointing=selective, not `{mode}`"
                    )));
                }
                Some(if selective {
                    Checkpointing::Selective
                } else {
                    mode
                })
            }
        };
        let lora = self.lora.as_deref().map(lora).transpose()?;
        let liger = self
            .liger
            .as_deref()
            .map(|spec| Liger::parse(spec).map_err(|e| CliError::input(format!("--{e}"))))
            .transpose()?;
        let float8 = self.float8.map(|recipe| gpumem_core::job::Float8 {
            recipe,
            fsdp_all_gather: self.float8_all_gather,
        });
        let options = OptionValues {
            optimizer: optimizer.unwrap_or_default(),
            precision: precision.unwrap_or(Precision::Fp32),
            input,
            seq_len: self.fixed_seq_len()?,
            seq_lens: self.seq_lens()?,
            image_sides: image_sides.clone(),
            checkpointing: checkpointing.unwrap_or(Checkpointing::Off),
            channels_last: self.channels_last,
            grad_accum: self.grad_accum.unwrap_or(1),
            data_parallel: self.data_parallel,
            validate: self.validate,
            outputs: self.outputs,
            attention_mask: self.attention_mask,
            attention: self.attention,
            lora: lora.clone(),
            strategy: None,
            optimizer_in_backward: self.optimizer_in_backward,
            keep_grads: self.keep_grads,
            chunked_ce: self.chunked_ce,
            compile: self.compile,
            activation_offloading: self.activation_offloading,
            reference_model: self.reference_model,
            liger: liger.clone(),
            float8,
            whole_run: self.whole_run.whole_run(),
        };
        if let Some(config) = self.train_config()? {
            let named = if self.strategy.strategy.is_some() {
                self.strategy.named()?
            } else {
                None
            };
            let stated = config
                .over(OptionValues::default(), self.strategy.world_size)
                .map_err(|e| CliError::input(format!("--train-config {e}")))?;
            let mut overrides = Vec::new();
            // What a flag changed of what the config states (not what it leaves unstated).
            let mut note = |flag: &str, given: String, stated: String| {
                if given != stated {
                    overrides.push(format!("{flag} {given} over the config's {stated}"));
                }
            };
            let mut v = stated.values();
            if let Some(o) = optimizer {
                note("--optimizer", o.name(), v.optimizer.name());
                v.optimizer = o;
            }
            if let Some(p) = precision {
                note("--precision", p.name().into(), v.precision.name().into());
                v.precision = p;
            }
            if let Some(n) = options.seq_len {
                if v.seq_len.is_some() || v.seq_lens.is_some() {
                    note("--seq-len", n.to_string(), format!("{:?}", v.seq_len));
                }
                v.seq_len = Some(n);
                v.seq_lens = None;
            }
            if let Some(l) = &options.seq_lens {
                if v.seq_len.is_some() || v.seq_lens.is_some() {
                    note("--seq-len", format!("{l:?}"), format!("{:?}", v.seq_len));
                }
                v.seq_lens = Some(l.clone());
                v.seq_len = None;
            }
            if let Some(c) = checkpointing {
                note("--checkpointing", c.name(), v.checkpointing.name());
                v.checkpointing = c;
            }
            if let Some(g) = self.grad_accum {
                note("--grad-accum", g.to_string(), v.grad_accum.to_string());
                v.grad_accum = g;
            }
            if let Some(l) = lora {
                if v.lora.is_some() {
                    note("--lora", format!("{l:?}"), format!("{:?}", v.lora));
                }
                v.lora = Some(l);
            }
            if let Some(s) = named {
                note(
                    "--strategy",
                    s.name().into(),
                    v.strategy
                        .map_or("one GPU".into(), |s| s.name().to_string()),
                );
                v.strategy = Some(s);
            }
            if self.attention_mask != AttentionMask::None {
                note(
                    "--attention-mask",
                    self.attention_mask.name().into(),
                    v.attention_mask.name().into(),
                );
                v.attention_mask = self.attention_mask;
            }
            if let Some(a) = self.attention {
                note(
                    "--attention",
                    a.name().into(),
                    v.attention
                        .map_or("the model's default", Attention::name)
                        .into(),
                );
                v.attention = Some(a);
            }
            if self.optimizer_in_backward {
                v.optimizer_in_backward = true;
            }
            if self.keep_grads {
                v.keep_grads = true;
            }
            if self.compile {
                v.compile = true;
            }
            if let Some(n) = self.chunked_ce {
                if v.chunked_ce.is_some() {
                    note("--chunked-ce", n.to_string(), format!("{:?}", v.chunked_ce));
                }
                v.chunked_ce = Some(n);
            }
            if self.activation_offloading {
                v.activation_offloading = true;
            }
            if self.reference_model {
                v.reference_model = true;
            }
            if let Some(f8) = float8 {
                if let Some(stated) = v.float8 {
                    note("--float8", format!("{f8:?}"), format!("{stated:?}"));
                }
                v.float8 = Some(f8);
            }
            if let Some(l) = liger {
                if let Some(stated) = &v.liger {
                    note("--liger", l.spec(), stated.spec());
                }
                v.liger = Some(l);
            }
            if let Some(run) = options.whole_run {
                note(
                    "--whole-run/--eval-*",
                    format!("{run:?}"),
                    format!("{:?}", v.whole_run),
                );
                v.whole_run = Some(run);
            }
            v.input = input;
            v.image_sides = image_sides;
            v.channels_last = self.channels_last;
            v.data_parallel = self.data_parallel;
            v.validate = self.validate;
            v.outputs = self.outputs;
            let options = v.check().map_err(CliError::input)?;
            return Ok((options, overrides));
        }
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
        .map(|o| (o, Vec::new()))
        .map_err(CliError::input)
    }

    /// The model to size: the one given, else the one --train-config names; with a note where
    /// the given one overrides the config's.
    pub fn model_or_config(
        &self,
        given: Option<&str>,
    ) -> CliResult<(Option<String>, Option<String>)> {
        let stated = self.train_config()?.and_then(|c| c.model.clone());
        Ok(match (given, stated) {
            (Some(g), Some((m, key))) if g != m => (
                Some(g.to_string()),
                Some(format!("MODEL {g} over the config's {key} {m}")),
            ),
            (Some(g), _) => (Some(g.to_string()), None),
            (None, Some((m, _))) => (Some(m), None),
            (None, None) => (None, None),
        })
    }

    /// What --train-config said, as `--json` carries it (`None` without one).
    pub fn train_config_json(&self, overrides: &[String]) -> CliResult<Option<serde_json::Value>> {
        Ok(self.train_config()?.map(|c| c.to_json(overrides)))
    }

    /// What --train-config did not model and what flags overrode, as text lines.
    pub fn print_train_config(&self, overrides: &[String]) -> CliResult {
        let Some(c) = self.train_config()? else {
            return Ok(());
        };
        println!();
        println!(
            "train config {} ({}): {} keys used, {} not modelled, {} not bearing on memory",
            c.file,
            c.kind.name(),
            c.fields.used.len(),
            c.fields.not_modelled.len(),
            c.fields.no_memory.len()
        );
        for o in overrides {
            println!("override     {o}");
        }
        for n in &c.fields.not_modelled {
            println!("not modelled: {} = {} ({})", n.field, n.value, n.reason);
        }
        Ok(())
    }

    /// The micro-batch a launch config states (DeepSpeed's `train_micro_batch_size_per_gpu`),
    /// which a command's default batch gives way to.
    pub fn stated_batch(&self) -> CliResult<Option<i64>> {
        if let Some(c) = self.train_config()? {
            return Ok(c
                .micro_batch
                .as_ref()
                .map(|(b, _)| i64::try_from(*b).unwrap_or(i64::MAX)));
        }
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

/// A model argument: a trace file, or a model (native spec, PyTorch reference, Hub id, model
/// directory or config.json).
pub enum ModelArg {
    TraceFile(Trace),
    Model(ModelRef),
}

impl ModelArg {
    pub fn load(arg: &str) -> CliResult<ModelArg> {
        let path = Path::new(arg);
        // A `.json` file is a model's config.json; traces are `.jsonl`.
        if path.is_file() && path.extension().is_none_or(|e| e != "json") {
            let f = File::open(path).map_err(|e| CliError::input(format!("{arg}: {e}")))?;
            return Trace::read(BufReader::new(f))
                .map(ModelArg::TraceFile)
                .map_err(|e| CliError::input(format!("{arg}: {e}")));
        }
        if arg.ends_with(".jsonl") || arg.ends_with(".trace") {
            return Err(CliError::input(format!("{arg}: no such trace file")));
        }
        match ModelRef::parse(arg) {
            Err(ModelError::Hub(HubError::NotCached { .. })) => fetched(arg),
            m => m.map(ModelArg::Model).map_err(CliError::input),
        }
    }

    /// The model, where the argument is not a trace file (`what` says which command needs one).
    pub fn model(self, arg: &str, what: &str) -> CliResult<ModelRef> {
        match self {
            ModelArg::Model(m) => Ok(m),
            ModelArg::TraceFile(_) => Err(CliError::input(format!("{arg}: {what}"))),
        }
    }
}

/// A Hub id that is not cached, after its config.json alone is downloaded into the cache by the
/// tracer's Python (`huggingface_hub`); where that cannot be done, the not-cached error with the
/// reason appended.
fn fetched(arg: &str) -> CliResult<ModelArg> {
    let cache = HubCache::from_env();
    let not_cached = |why: String| {
        let e = ModelRef::parse_in(arg, &cache).err().map(|e| e.to_string());
        CliError::input(format!("{} (fetching it: {why})", e.unwrap_or_default()))
    };
    let Some(HubSource::Id(id)) = HubSource::of(arg, &cache) else {
        return Err(not_cached("not a Hub id".into()));
    };
    TorchTracer::from_env()
        .fetch_hub_config(id.repo(), id.revision())
        .map_err(not_cached)?;
    eprintln!("fetched {id}'s config.json into {}", cache.root().display());
    ModelRef::parse_in(arg, &cache)
        .map(ModelArg::Model)
        .map_err(CliError::input)
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

pub use gpumem_core::units::mib;

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

/// `--float8`'s recipe, by torchao's name.
fn float8_recipe(name: &str) -> Result<gpumem_core::job::Float8Recipe, String> {
    gpumem_core::job::Float8Recipe::parse(name).ok_or_else(|| {
        format!(
            "`{name}` is not a float8 recipe ({})",
            gpumem_core::job::Float8Recipe::NAMES.join(", ")
        )
    })
}
