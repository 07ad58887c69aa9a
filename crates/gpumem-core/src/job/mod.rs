//! The job vocabulary: what a training job is, as data — which model (`crate::model::ModelRef`:
//! a native spec or a PyTorch reference, told apart by the one prefix table here) and the
//! options of the loop around it ([`Options`]: optimizer, precision, checkpointing, [`Lora`], the multi-GPU
//! [`Strategy`] as a device [`Mesh`]). Every entry point (flags, job files, JSON over the API,
//! trace headers, the tracer's request) reads these types, and each checks itself where it is
//! made, so an invalid job cannot be represented. The `gpumem-workload` crate turns a job into
//! a trace.

use std::fmt;

use serde::{Deserialize, Serialize};

use schemars::JsonSchema;

use crate::UnknownName;

pub mod float8;
pub mod lengths;
pub mod liger;
pub mod lora;
pub mod mesh;
pub mod optim;
pub mod whole_run;

pub use float8::{Float8, Float8Recipe};
pub use lengths::{LengthError, LengthSchedule, LengthSource, LengthSummary, StepAxis};
pub use liger::{Liger, LigerError, LigerKernel};
pub use lora::{Lora, LoraError, LoraValues, Quant4, QuantLoader, Release};
pub use mesh::{
    DDP_BUCKET_CAP_MB, Engine, EngineKind, HalfDtype, MAX_MICROBATCHES, MAX_ROUTING_IMBALANCE,
    MAX_WORLD_SIZE, Mesh, MeshDim, MeshValues, Pipeline, RoutingImbalance, Schedule, Strategy,
    StrategyValues, Zero, ZeroStage,
};
pub use optim::{
    Adafactor, Bnb, BnbAlgorithm, BnbBits, Implementation, Loop, NoImplementation, Optimizer,
    Torchao,
};
pub use whole_run::{Evaluation, EvaluationError, Filters, Generation, GenerationError, WholeRun};

/// Prefixes of model references only the PyTorch tracer can resolve. `live:` names a model
/// object in the Python process that asks (the Python API's), traced there and nowhere else.
pub const TORCH_PREFIXES: [&str; 9] = [
    "torchvision:",
    "timm:",
    "hf:",
    HF_CODE_PREFIX,
    "smp:",
    "py:",
    "torchtitan:",
    "litgpt:",
    LIVE_PREFIX,
];

/// The prefix of a live model: `live:KEY`, KEY its fingerprint in the process that holds it.
pub const LIVE_PREFIX: &str = "live:";

/// The prefix of a checkpoint run by its own code (`trust_remote_code`): `hf-code:DIR`, DIR the
/// model directory holding its `config.json` and the modeling files its `auto_map` names.
pub const HF_CODE_PREFIX: &str = "hf-code:";

/// The native families' spec prefixes (before the `:`): the models gpumem builds itself.
pub const NATIVE_FAMILIES: [&str; 3] = ["mlp", "cnn", "transformer"];

/// Whether `model` names a native family model (by its prefix; the spec itself is not read).
pub fn is_native_spec(model: &str) -> bool {
    model
        .split_once(':')
        .is_some_and(|(family, _)| NATIVE_FAMILIES.contains(&family))
}

/// An image input shape `CxHxW`. Invariant: every size positive (made only by `parse`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InputShape {
    channels: u64,
    height: u64,
    width: u64,
}

impl InputShape {
    /// `channels` square images of `side`; `None` where either is 0.
    pub fn square(channels: u64, side: u64) -> Option<InputShape> {
        (channels > 0 && side > 0).then_some(InputShape {
            channels,
            height: side,
            width: side,
        })
    }

    pub fn parse(s: &str) -> Option<InputShape> {
        let v: Vec<u64> = s
            .split('x')
            .map(|p| p.parse::<u64>().ok().filter(|&n| n > 0))
            .collect::<Option<_>>()?;
        let [channels, height, width] = v[..] else {
            return None;
        };
        Some(InputShape {
            channels,
            height,
            width,
        })
    }
}

impl fmt::Display for InputShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}x{}", self.channels, self.height, self.width)
    }
}

/// A closed set of option values spelled as on the command line and in JSON.
macro_rules! spelled {
    ($(#[$doc:meta])* $name:ident ($what:literal) { $($(#[$vdoc:meta])* $variant:ident = $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
        pub enum $name {
            #[default]
            $($(#[$vdoc])* $variant),+
        }

        impl $name {
            pub const NAMES: &[&str] = &[$($text),+];

            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }

            pub fn parse(s: &str) -> Result<$name, UnknownName> {
                match s {
                    $($text => Ok($name::$variant),)+
                    other => Err(UnknownName::new($what, other, $name::NAMES.join(", "))),
                }
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<$name, D::Error> {
                let s = String::deserialize(d)?;
                $name::parse(&s).map_err(serde::de::Error::custom)
            }
        }
    };
}

/// Activation checkpointing of a PyTorch model's repeated blocks, as a trainer means it:
/// "selective" and "gradient checkpointing" mean different things in different trainers, so each
/// mode names whose meaning it is (docs/intake.md, "Activation checkpointing as trainers mean
/// it"). Spelled `off`, `full`, `full-reentrant`, `selective`, `selective-op`,
/// `selective-layer:N`. Invariant: a layer frequency is at least 1 (made only by `parse` and
/// [`Checkpointing::every_nth_layer`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Checkpointing {
    #[default]
    Off,
    /// Each block recomputed whole in backward under non-reentrant `torch.utils.checkpoint`
    /// (the model's own switch where it has one, asked for non-reentrant; torchtitan's `full`).
    Full,
    /// As `Full`, under reentrant `torch.utils.checkpoint` (`use_reentrant=True`: Hugging Face's
    /// `gradient_checkpointing_kwargs={"use_reentrant": True}`, the default of transformers
    /// before 4.35 and of torch's `checkpoint` before 2.4).
    FullReentrant,
    /// gpumem's own op-level policy (the meaning of `--selective-checkpointing` since it was
    /// added): every matmul (`mm`, `addmm`, `bmm`) and attention output of each block saved,
    /// everything else recomputed. No trainer runs exactly this.
    Selective,
    /// torchtitan's `mode = "selective"`, `selective_ac_option = "op"` (release 0.2.2): its
    /// save list (`mm`, the attention kernels, `max`, reduce-scatter, …) with every second `mm`
    /// of a block recomputed, counted per block and pass.
    SelectiveOp,
    /// Megatron-LM's and NeMo's `selective` granularity (Korthikanti et al.'s selective
    /// recomputation): each attention's core — QKᵀ, softmax, dropout, ·V — recomputed in
    /// backward from the q, k and v it saves; the rest of each block kept.
    SelectiveAttention,
    /// torchtitan's layer-wise selective checkpointing, `selective_ac_option = "N"`: every Nth
    /// block (the 1-based count divisible by N) recomputed whole, the others kept; N = 1 is
    /// `Full`.
    SelectiveLayer(LayerFrequency),
}

/// How often layer-wise selective checkpointing wraps a block: every `get()`th. Invariant: ≥ 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LayerFrequency(u32);

impl LayerFrequency {
    pub fn new(n: u32) -> Option<LayerFrequency> {
        (n >= 1).then_some(LayerFrequency(n))
    }

    pub fn get(self) -> u32 {
        self.0
    }
}

impl Checkpointing {
    /// The spellings, as a phrase for messages.
    pub const EXPECTED: &str = "off, full, full-reentrant, selective, selective-op, selective-attention or selective-layer:N (N ≥ 1)";

    /// torchtitan's layer-wise mode, every `n`th block; `None` for 0.
    pub fn every_nth_layer(n: u32) -> Option<Checkpointing> {
        LayerFrequency::new(n).map(Checkpointing::SelectiveLayer)
    }

    pub fn parse(s: &str) -> Result<Checkpointing, UnknownName> {
        let unknown = || UnknownName::new("checkpointing", s, Checkpointing::EXPECTED);
        Ok(match s {
            "off" => Checkpointing::Off,
            "full" => Checkpointing::Full,
            "full-reentrant" => Checkpointing::FullReentrant,
            "selective" => Checkpointing::Selective,
            "selective-op" => Checkpointing::SelectiveOp,
            "selective-attention" => Checkpointing::SelectiveAttention,
            _ => {
                let n = s.strip_prefix("selective-layer:").ok_or_else(unknown)?;
                // Digits only: no sign, no spaces (`u32::from_str` takes a leading `+`).
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(unknown());
                }
                n.parse()
                    .ok()
                    .and_then(Checkpointing::every_nth_layer)
                    .ok_or_else(unknown)?
            }
        })
    }

    /// The spelling `parse` reads.
    pub fn name(self) -> String {
        self.to_string()
    }

    /// Whether any block is checkpointed.
    pub fn is_on(self) -> bool {
        self != Checkpointing::Off
    }
}

impl fmt::Display for Checkpointing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpointing::Off => f.write_str("off"),
            Checkpointing::Full => f.write_str("full"),
            Checkpointing::FullReentrant => f.write_str("full-reentrant"),
            Checkpointing::Selective => f.write_str("selective"),
            Checkpointing::SelectiveOp => f.write_str("selective-op"),
            Checkpointing::SelectiveAttention => f.write_str("selective-attention"),
            Checkpointing::SelectiveLayer(n) => write!(f, "selective-layer:{}", n.get()),
        }
    }
}

impl Serialize for Checkpointing {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

impl<'de> Deserialize<'de> for Checkpointing {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Checkpointing, D::Error> {
        let s = String::deserialize(d)?;
        Checkpointing::parse(&s).map_err(serde::de::Error::custom)
    }
}

spelled!(
    /// An evaluation pass after training (two eval-mode batches).
    Validate ("validation") {
        None = "none",
        NoGrad = "no-grad",
        /// A validation loop without `torch.no_grad()`: each output's graph stays alive.
        Grad = "grad",
    }
);

spelled!(
    /// Whether the training loop holds the model's output through backward.
    Outputs ("outputs") {
        /// `outputs = model(x); loss = criterion(outputs, y)`.
        Kept = "kept",
        /// `loss = model(**batch).loss`, as Hugging Face's Trainer runs.
        Dropped = "dropped",
    }
);

spelled!(
    /// The attention mask a Hugging Face model gets.
    AttentionMask ("attention mask") {
        None = "none",
        /// A padded batch's mask, which the model materialises (and which keeps flash attention out).
        Padded = "padded",
    }
);

spelled!(
    /// The attention a Hugging Face model runs (its `attn_implementation`); absent, the
    /// model's own default (SDPA where transformers has it, else its eager code).
    Attention ("attention") {
        /// `F.scaled_dot_product_attention`, whose kernel PyTorch's CUDA dispatch chooses.
        Sdpa = "sdpa",
        /// The model's own attention code: the scores and their softmax materialised.
        Eager = "eager",
        /// FlashAttention-2 (`flash_attention_2`): traced as SDPA's flash kernel, which keeps
        /// the same tensors for backward; a padded batch is unpadded, not masked.
        Flash = "flash",
    }
);

spelled!(
    /// How a whole run saves its checkpoint (docs/run.md), after its steps and evaluation.
    Save ("save") {
        /// Each rank writes what it holds: torch.distributed.checkpoint's sharded state dicts
        /// under FSDP2; on one GPU or under DDP, `torch.save` of the state dicts, which copies
        /// each tensor to the host — nothing more on the GPU.
        Sharded = "sharded",
        /// FSDP2's full state dicts (`get_model_state_dict` and `get_optimizer_state_dict` with
        /// `full_state_dict=True`): every parameter and optimizer state gathered whole onto
        /// every rank's GPU and held there until it is written. Under ZeRO-3, DeepSpeed's
        /// consolidated 16-bit weights, gathered module by module (ZeRO-1/2: nothing more).
        Full = "full",
        /// The same with `cpu_offload=True`: each gathered tensor sent to the host (rank 0's)
        /// as soon as it is gathered.
        FullOffload = "full-offload",
    }
);

impl Attention {
    /// Hugging Face's name for it (`attn_implementation`: `eager`, `sdpa`, `flash_attention_2`
    /// or `_3`), or `None` for one gpumem does not model (flex, paged, a Hub kernel).
    pub fn from_hf(name: &str) -> Option<Attention> {
        match name {
            "eager" => Some(Attention::Eager),
            "sdpa" => Some(Attention::Sdpa),
            "flash_attention_2" | "flash_attention_3" => Some(Attention::Flash),
            _ => None,
        }
    }
}

/// Training precision: fp32, autocast to a low dtype (`amp-*`), or pure low precision (weights,
/// gradients and optimizer state in fp16/bf16; PyTorch models only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Precision {
    Fp32,
    AmpFp16,
    AmpBf16,
    Fp16,
    Bf16,
}

impl Precision {
    pub fn parse(s: &str) -> Result<Self, UnknownName> {
        match s {
            "fp32" => Ok(Precision::Fp32),
            "amp-fp16" => Ok(Precision::AmpFp16),
            "amp-bf16" => Ok(Precision::AmpBf16),
            "fp16" => Ok(Precision::Fp16),
            "bf16" => Ok(Precision::Bf16),
            other => Err(UnknownName::new(
                "precision",
                other,
                "fp32, amp-fp16, amp-bf16, fp16 or bf16",
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::AmpFp16 => "amp-fp16",
            Precision::AmpBf16 => "amp-bf16",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
        }
    }

    /// Weights and optimizer state in a low dtype (no autocast).
    pub fn is_pure(self) -> bool {
        matches!(self, Precision::Fp16 | Precision::Bf16)
    }
}

/// The options of the training loop around a model, as stated (by flags, a job file, JSON or
/// a trace header) and not yet checked: [`OptionValues::check`] makes them [`Options`]. The
/// defaults are a plain loop: Adam, fp32, the model's own input, one GPU, no checkpointing or
/// accumulation, no validation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct OptionValues {
    /// The optimizer by gpumem's name (`adamw`, `adamw-fused`, `paged-adamw8bit`, …; see
    /// docs/intake.md); reading, any name `Optimizer::parse` takes.
    #[serde(with = "optimizer_name")]
    #[schemars(schema_with = "optimizer_name::schema")]
    pub optimizer: Optimizer,
    #[serde(with = "precision_name")]
    #[schemars(with = "String")]
    pub precision: Precision,
    /// Input shape of image models, `CxHxW` (default: the model's own).
    #[serde(with = "input_text")]
    #[schemars(with = "Option<String>")]
    pub input: Option<InputShape>,
    /// Sequence length of sequence models.
    pub seq_len: Option<u64>,
    /// Sequence lengths that vary by step (batches padded to their longest sample): a seeded
    /// schedule, in place of one `seq_len`. Left out where absent, so a fixed-length job's
    /// documents read as before.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq_lens: Option<LengthSchedule>,
    /// The side of square images that varies by step (multi-scale training): a seeded
    /// schedule over `input`'s height and width, its channels kept. Left out where absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_sides: Option<LengthSchedule>,
    /// Activation checkpointing: `off`, `full`, `full-reentrant`, `selective`, `selective-op`,
    /// `selective-attention` or `selective-layer:N` (stored as `false`/`true` for off and full, as before the modes).
    #[serde(with = "checkpointing_compat")]
    #[schemars(with = "serde_json::Value")]
    pub checkpointing: Checkpointing,
    /// The channels_last memory format.
    pub channels_last: bool,
    /// Gradient accumulation steps.
    pub grad_accum: u32,
    /// GPUs of a `torch.nn.DataParallel` job (1: none); the job's batch is then the whole batch
    /// the wrapper splits, and the trace is GPU 0's.
    pub data_parallel: u32,
    #[schemars(with = "String")]
    pub validate: Validate,
    /// `None`: the model source's usual loop (Hugging Face's Trainer drops it, others keep it).
    #[schemars(with = "Option<String>")]
    pub outputs: Option<Outputs>,
    #[schemars(with = "String")]
    pub attention_mask: AttentionMask,
    /// The attention implementation of a Hugging Face model; absent, the model's default.
    /// Left out where absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub attention: Option<Attention>,
    /// LoRA fine-tuning: the model frozen, its target layers given trainable low-rank factors.
    pub lora: Option<Lora>,
    /// A multi-GPU job's mesh and engine; the trace is one rank's, the batch that rank's.
    pub strategy: Option<Strategy>,
    /// The optimizer steps inside backward, one parameter at a time as its gradient is ready,
    /// and frees that gradient (torchtune's `optimizer_in_bwd`, PyTorch's
    /// `register_post_accumulate_grad_hook` recipe). Left out where false.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub optimizer_in_backward: bool,
    /// `zero_grad(set_to_none=False)`: the gradients zeroed in place and kept allocated between
    /// steps, as PyTorch before 2.0 did by default (and Hugging Face's Trainer with it), rather
    /// than freed. Left out where false.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub keep_grads: bool,
    /// Chunked cross-entropy (torchtune's `CEWithChunkedOutputLoss`): a causal language model's
    /// output projection run on this many chunks of the sequence, each upcast to fp32 for the
    /// loss one at a time, in place of the model's own loss. Left out where absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chunked_ce: Option<u32>,
    /// `torch.compile` as the trainer applies it to its loss (torchtitan's `compile`
    /// components, torchtune's `compile_loss`, a Hugging Face model's `loss_function`): the loss
    /// traced as AOTAutograd partitions it and Inductor fuses it, its fp32 logits never
    /// materialised. A compiled model's blocks are traced eagerly. Left out where false.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub compile: bool,
    /// The activations saved for backward offloaded to the host as forward makes them and
    /// brought back for backward, by torchtune's `OffloadActivations` (its
    /// `enable_activation_offloading`; torchtune's code, traced where it is installed). Left out
    /// where false.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub activation_offloading: bool,
    /// A frozen copy of the model beside it — TRL's KL reference (GRPO, DPO, PPO with
    /// `beta` > 0 and no PEFT adapter) — run without gradients on each step's batch before the
    /// model, its per-token log-probabilities kept for the loss. Left out where false.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub reference_model: bool,
    /// Liger's kernels in place of a Hugging Face model's own ops (Liger's code, traced where
    /// it is installed). Left out where absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub liger: Option<Liger>,
    /// Float8 training of the linear layers (torchao's `Float8Linear`, torchtitan's float8
    /// converter). Left out where absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub float8: Option<Float8>,
    /// The whole run, not the training steps alone (docs/run.md): the load, the steps, and the
    /// parts it states. Left out where absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub whole_run: Option<WholeRun>,
}

impl Default for OptionValues {
    fn default() -> Self {
        OptionValues {
            optimizer: Optimizer::ADAM,
            precision: Precision::Fp32,
            input: None,
            seq_len: None,
            seq_lens: None,
            image_sides: None,
            checkpointing: Checkpointing::Off,
            channels_last: false,
            grad_accum: 1,
            data_parallel: 1,
            validate: Validate::None,
            outputs: None,
            attention_mask: AttentionMask::None,
            attention: None,
            lora: None,
            strategy: None,
            optimizer_in_backward: false,
            keep_grads: false,
            chunked_ce: None,
            compile: false,
            activation_offloading: false,
            reference_model: false,
            liger: None,
            float8: None,
            whole_run: None,
        }
    }
}

/// The options of the training loop around a model, checked: read through `Deref` as
/// [`OptionValues`]; changed only by checking new values ([`Options::values`], then
/// [`OptionValues::check`]). Invariant: every field in range, and the fields agree with one
/// another (see [`OptionError`]); the parts ([`Lora`], [`Strategy`]) hold their own.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(try_from = "OptionValues", into = "OptionValues")]
pub struct Options(OptionValues);

impl std::ops::Deref for Options {
    type Target = OptionValues;

    fn deref(&self) -> &OptionValues {
        &self.0
    }
}

impl TryFrom<OptionValues> for Options {
    type Error = OptionError;

    fn try_from(v: OptionValues) -> Result<Options, OptionError> {
        v.check()
    }
}

impl From<Options> for OptionValues {
    fn from(o: Options) -> OptionValues {
        o.0
    }
}

impl JsonSchema for Options {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        OptionValues::schema_name()
    }

    fn json_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
        OptionValues::json_schema(g)
    }
}

/// An option out of range or at odds with another, named as a job document spells it (and the
/// command line's flag where it has one).
#[derive(Debug, thiserror::Error)]
pub enum OptionError {
    #[error("grad_accum (--grad-accum) must be at least 1")]
    GradAccum,
    #[error(transparent)]
    Evaluation(#[from] EvaluationError),
    #[error(transparent)]
    Generation(#[from] GenerationError),
    #[error("whole_run (--whole-run) is sized at one input shape; {0} is not yet taken with it")]
    WholeRunOneLength(&'static str),
    #[error(
        "broadcast_load (--broadcast-load): a load broadcast from rank 0 is FSDP's (--strategy fsdp)"
    )]
    BroadcastLoad,
    #[error(
        "save (--save) full-offload: a ZeRO job saves its partitions (--save sharded) or its consolidated 16-bit weights, gathered module by module (--save full)"
    )]
    ZeroFullSave,
    #[error("chunked_ce (--chunked-ce) {0} is out of range (1..={MAX_CE_CHUNKS})")]
    CeChunks(u32),
    #[error(
        "liger (--liger) with its fused_linear_cross_entropy and chunked_ce (--chunked-ce) both replace the loss: give one (or set fused_linear_cross_entropy=false)"
    )]
    LigerAndChunkedCe,
    #[error("reference_model (--reference-model) cannot go with {0}")]
    ReferenceModel(&'static str),
    #[error("optimizer_in_backward (--optimizer-in-backward) cannot go with {0}")]
    OptimizerInBackward(&'static str),
    #[error("keep_grads (--keep-grads) cannot go with {0}")]
    KeepGrads(&'static str),
    #[error("compile (--compile) cannot go with {0}")]
    Compile(&'static str),
    #[error(
        "float8.fsdp_all_gather (--float8-all-gather) gathers FSDP's weights in float8: it needs {0}"
    )]
    Float8AllGather(&'static str),
    #[error("data_parallel (--data-parallel) {0} is out of range (1..={MAX_DATA_PARALLEL})")]
    DataParallel(u32),
    #[error("seq_len (--seq-len) must be at least 1")]
    SeqLen,
    #[error("seq_len and seq_lens both state the sequence length: give one")]
    TwoSeqLens,
    #[error("seq_lens and image_sides both vary by step: give one")]
    TwoStepSchedules,
    #[error("image_sides (--input CxMIN..MAX) varies input's height and width: state input")]
    ImageSidesInput,
    #[error(transparent)]
    SeqLens(#[from] LengthError),
    #[error(
        "strategy's world size (--world-size) {0} is out of range (2..={MAX_WORLD_SIZE}; 1..={MAX_WORLD_SIZE} under ZeRO)"
    )]
    WorldSize(u32),
    #[error("strategy.sequence_parallel (--no-sequence-parallel) {0}")]
    SequenceParallel(&'static str),
    #[error("strategy.mesh.{0} has degree 0 (every mesh dimension has at least 1 rank)")]
    MeshDegree(&'static str),
    #[error(
        "strategy.mesh.expert (--ep) {expert} must divide the {borrowed} shard × context × tensor ranks it borrows"
    )]
    ExpertRanks { expert: u32, borrowed: u32 },
    #[error(
        "strategy.routing_imbalance (--routing-imbalance) is expert parallelism's, and this mesh has no expert ranks (--ep): without them a rank computes all its tokens' experts, however they are routed"
    )]
    NoExperts,
    #[error(
        "strategy.routing_imbalance (--routing-imbalance) {0} is out of range (1..={MAX_ROUTING_IMBALANCE})"
    )]
    RoutingImbalance(f64),
    #[error("strategy.mesh.{dim}: {engine} does not split its ranks that way")]
    EngineDim {
        engine: &'static str,
        dim: &'static str,
    },
    #[error(
        "strategy.{0} is FSDP's, and this mesh has no ranks to shard over (tensor parallelism alone)"
    )]
    NoShards(&'static str),
    #[error("strategy.{0} is a pipeline setting, and this mesh has no pipeline stages (--pp)")]
    PipelineSetting(&'static str),
    #[error("strategy.microbatches (--microbatches) {0} is out of range (1..={MAX_MICROBATCHES})")]
    Microbatches(u32),
    #[error(
        "strategy.virtual_stages (--virtual-stages) {virtual_stages}: {schedule} holds {needs} per rank"
    )]
    VirtualStages {
        schedule: &'static str,
        virtual_stages: u32,
        needs: &'static str,
    },
    #[error("{0} with {1} is not sized yet")]
    NotSizedWith(&'static str, &'static str),
    #[error("strategy needs a mesh (or world_size)")]
    NoMesh,
    #[error("strategy states a mesh and world_size or replicas: give one")]
    TwoMeshes,
    #[error("strategy.{setting} is a {owner} setting, and this strategy is {kind}")]
    Setting {
        setting: &'static str,
        owner: &'static str,
        kind: &'static str,
    },
    #[error("strategy.stage is required for zero (1, 2 or 3)")]
    NoStage,
    #[error("strategy.bucket_cap_mb (--bucket-cap-mb) must be at least 1")]
    BucketCap,
    #[error("a job is data_parallel (--data-parallel) or has a strategy (--strategy), not both")]
    TwoWrappers,
    #[error("strategy.stage: ZeRO stage {0} is not 1, 2 or 3")]
    ZeroStage(u8),
    #[error("strategy.zero.reduce_bucket_size must be at least 1")]
    ReduceBucket,
    #[error("strategy.zero.offload_param needs ZeRO stage 3")]
    OffloadParam,
    /// DeepSpeed scales the loss of fp16 training inside its engine; torch's GradScaler does not
    /// drive one.
    #[error(
        "ZeRO trains fp16 in DeepSpeed's own fp16 mode (--precision fp16, loss scaling inside the engine), not under torch's GradScaler (amp-fp16)"
    )]
    ZeroAmpFp16,
    #[error(
        "HSDP's replicas (--nodes) {replicas} must divide the world size (--world-size) {world_size} into groups of at least 2 ranks"
    )]
    Replicas { replicas: u32, world_size: u32 },
    /// DeepSpeed runs its own Adam, AdamW or SGD over its partitions.
    #[error(
        "optimizer {0} cannot run under ZeRO, whose engine runs its own optimizer (adam, adamw, sgd or sgd-momentum)"
    )]
    ZeroOptimizer(String),
    #[error(transparent)]
    Lora(#[from] LoraError),
}

/// A multi-GPU job whose GPU count is not its strategy's world size (a job's ranks are its GPUs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "options.strategy has world_size {world_size}, and a job's ranks are its GPUs: gpus must be {world_size}, not {gpus}"
)]
pub struct RanksNotGpus {
    pub world_size: u32,
    pub gpus: u32,
}

/// Options a native family model cannot take, on a native model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "--input, --seq-len, --checkpointing, --channels-last, --grad-accum, --data-parallel, --validate, --outputs, --attention-mask, --attention, --lora, --liger, --chunked-ce, --activation-offloading, --reference-model, --optimizer-in-backward, --keep-grads, --compile and --strategy apply to PyTorch models ({})",
    TORCH_PREFIXES.join(", ")
)]
pub struct TorchOnly;

/// Most GPUs a DataParallel job is modelled over.
pub const MAX_DATA_PARALLEL: u32 = 64;
/// Most chunks of a chunked cross-entropy (torchtune uses 8; each chunk is a slice of the sequence).
pub const MAX_CE_CHUNKS: u32 = 1024;

impl OptionValues {
    /// The schedule of a size that varies by step, and what it sizes (at most one: checked).
    pub fn step_sizes(&self) -> Option<(&LengthSchedule, StepAxis)> {
        match (&self.seq_lens, &self.image_sides) {
            (Some(s), _) => Some((s, StepAxis::SeqLen)),
            (None, Some(s)) => Some((s, StepAxis::ImageSide)),
            (None, None) => None,
        }
    }

    /// These values as [`Options`], or the first option out of range or at odds with another.
    pub fn check(self) -> Result<Options, OptionError> {
        if self.grad_accum == 0 {
            return Err(OptionError::GradAccum);
        }
        if self.data_parallel == 0 || self.data_parallel > MAX_DATA_PARALLEL {
            return Err(OptionError::DataParallel(self.data_parallel));
        }
        if self.seq_len == Some(0) {
            return Err(OptionError::SeqLen);
        }
        if self.seq_len.is_some() && self.seq_lens.is_some() {
            return Err(OptionError::TwoSeqLens);
        }
        if self.image_sides.is_some() {
            if self.seq_lens.is_some() {
                return Err(OptionError::TwoStepSchedules);
            }
            if self.input.is_none() {
                return Err(OptionError::ImageSidesInput);
            }
        }
        if self.chunked_ce.is_some_and(|n| n == 0 || n > MAX_CE_CHUNKS) {
            return Err(OptionError::CeChunks(self.chunked_ce.unwrap_or_default()));
        }
        if self.reference_model {
            let clash = if self.lora.is_some() {
                // TRL's reference is then the model itself with its adapters off.
                Some(
                    "lora (--lora): a LoRA job's reference is its base model with the adapters off, no copy",
                )
            } else if self
                .strategy
                .is_some_and(|s| s.engine().kind() != EngineKind::Ddp)
            {
                Some(
                    "a sharded strategy (only one GPU or DDP: the reference is whole on each rank)",
                )
            } else {
                None
            };
            if let Some(clash) = clash {
                return Err(OptionError::ReferenceModel(clash));
            }
        }
        if self.chunked_ce.is_some() && self.liger.as_ref().is_some_and(Liger::fuses_the_loss) {
            return Err(OptionError::LigerAndChunkedCe);
        }
        if let Some(run) = &self.whole_run {
            if let Some(e) = &run.evaluation {
                e.check()?;
            }
            if let Some(g) = &run.generation {
                g.check()?;
            }
            if let Some((_, axis)) = self.step_sizes() {
                return Err(OptionError::WholeRunOneLength(axis.field()));
            }
            if self.strategy.is_some_and(|s| s.tensor_parallel() > 1) {
                return Err(OptionError::NotSizedWith(
                    "whole_run (--whole-run)",
                    "tensor parallelism (strategy.mesh.tensor)",
                ));
            }
            if self.strategy.is_some_and(|s| s.context_parallel() > 1) {
                return Err(OptionError::NotSizedWith(
                    "whole_run (--whole-run)",
                    "context parallelism (strategy.mesh.context)",
                ));
            }
            if run.broadcast_load
                && !self
                    .strategy
                    .is_some_and(|s| s.engine().kind() == EngineKind::Fsdp)
            {
                return Err(OptionError::BroadcastLoad);
            }
            if run.save == Some(Save::FullOffload)
                && self.strategy.is_some_and(|s| s.zero_stage().is_some())
            {
                return Err(OptionError::ZeroFullSave);
            }
        }
        if self.optimizer_in_backward {
            let clash = if self.grad_accum > 1 {
                Some("gradient accumulation (each gradient is applied and freed in backward)")
            } else if self.precision == Precision::AmpFp16 {
                Some("amp-fp16 (GradScaler unscales every gradient before one step)")
            } else if self.strategy.is_some() || self.data_parallel > 1 {
                Some(
                    "a multi-GPU strategy (sized on one GPU, as torchtune's single-device recipes run it)",
                )
            } else {
                None
            };
            if let Some(clash) = clash {
                return Err(OptionError::OptimizerInBackward(clash));
            }
        }
        if self.keep_grads {
            let clash = if self.optimizer_in_backward {
                Some("optimizer_in_backward (it frees each gradient as it applies it)")
            } else if self.strategy.is_some_and(|s| s.zero_stage().is_some()) {
                Some("ZeRO (DeepSpeed's engine keeps the gradients in its own buffers)")
            } else {
                None
            };
            if let Some(clash) = clash {
                return Err(OptionError::KeepGrads(clash));
            }
        }
        if self.compile && self.strategy.is_some_and(|s| s.tensor_parallel() > 1) {
            return Err(OptionError::Compile(
                "tensor parallelism (its loss runs on sharded DTensor logits)",
            ));
        }
        if let Some(f8) = self.float8.filter(|f| f.fsdp_all_gather) {
            let fsdp = self.strategy.is_some_and(|s| {
                s.engine().kind() == EngineKind::Fsdp && s.mesh().fsdp_ranks() > 1
            });
            if f8.recipe != Float8Recipe::Tensorwise {
                return Err(OptionError::Float8AllGather("the tensorwise recipe"));
            }
            if !fsdp {
                return Err(OptionError::Float8AllGather("--strategy fsdp or hsdp"));
            }
        }
        if let Some(strategy) = self.strategy {
            if strategy.zero_stage().is_some() && self.precision == Precision::AmpFp16 {
                return Err(OptionError::ZeroAmpFp16);
            }
            if strategy.zero_stage().is_some() && self.optimizer.zero_family().is_none() {
                return Err(OptionError::ZeroOptimizer(self.optimizer.name()));
            }
            if self.data_parallel > 1 {
                return Err(OptionError::TwoWrappers);
            }
            if strategy.pipeline().is_some() {
                // The stages run their own loop (pipeline.py): what it does not run is refused.
                let clash = if self.whole_run.is_some() {
                    Some("whole_run (--whole-run)")
                } else if let Some((_, axis)) = self.step_sizes() {
                    Some(axis.field())
                } else if self.precision == Precision::AmpFp16 {
                    Some("amp-fp16 (GradScaler)")
                } else if self.chunked_ce.is_some() {
                    Some("chunked_ce (--chunked-ce)")
                } else if self.liger.is_some() {
                    Some("liger (--liger)")
                } else if self.activation_offloading {
                    Some("activation_offloading (--activation-offloading)")
                } else if self.validate != Validate::None {
                    Some("validate (--validate)")
                } else if self.attention_mask != AttentionMask::None {
                    Some("attention_mask (--attention-mask)")
                } else if strategy.tensor_parallel() > 1
                    && strategy.pipeline().map(|p| p.schedule()) == Some(Schedule::ZeroBubble)
                {
                    // Its split backward detaches each stage's output in place, which a tensor-
                    // parallel stage's (a view of its shard) cannot be.
                    Some("the zero-bubble schedule and tensor parallelism (--tp)")
                } else {
                    None
                };
                if let Some(clash) = clash {
                    return Err(OptionError::NotSizedWith(
                        "pipeline parallelism (strategy.mesh.pipeline)",
                        clash,
                    ));
                }
            }
        }
        Ok(Options(self))
    }
}

impl Options {
    /// The batch sizes this job splits evenly are its multiples: a DataParallel job's GPUs each
    /// get the same rows, a pipeline's micro-batches the same share.
    pub fn batch_unit(&self) -> u64 {
        let microbatches = self
            .strategy
            .and_then(|s| s.pipeline())
            .map_or(1, |p| p.microbatches());
        u64::from(self.data_parallel.max(1)) * u64::from(microbatches)
    }

    /// A copy of the values, to change and check again.
    pub fn values(&self) -> OptionValues {
        self.0.clone()
    }

    /// These options at one size of their schedule (`axis`): the fixed-shape job a step of
    /// that size is (drawn sizes are at least 1, so the result is checked).
    pub fn at_step(&self, axis: StepAxis, size: u64) -> Options {
        let size = size.max(1);
        Options(match axis {
            StepAxis::SeqLen => OptionValues {
                seq_len: Some(size),
                seq_lens: None,
                ..self.0.clone()
            },
            StepAxis::ImageSide => OptionValues {
                input: self.input.map(|i| InputShape {
                    height: size,
                    width: size,
                    ..i
                }),
                image_sides: None,
                ..self.0.clone()
            },
        })
    }

    /// A job of these options on `gpus` GPUs: a strategy's ranks must be exactly its GPUs.
    pub fn check_gpus(&self, gpus: u32) -> Result<(), RanksNotGpus> {
        match self.strategy.map(|s| s.world_size()) {
            Some(world_size) if world_size != gpus => Err(RanksNotGpus { world_size, gpus }),
            _ => Ok(()),
        }
    }

    /// What a native family model can be given of these options: the optimizer and the
    /// precision, in an otherwise plain loop (the families refuse pure precision themselves).
    pub fn native_part(&self) -> Options {
        Options(OptionValues {
            optimizer: self.optimizer,
            precision: self.precision,
            ..OptionValues::default()
        })
    }

    /// Whether a native family model can take all of these options.
    pub fn native_compatible(&self) -> bool {
        *self == self.native_part()
    }

    /// These options on a native family model, which takes only the native part.
    pub fn check_native(&self) -> Result<(), TorchOnly> {
        if !self.native_compatible() {
            return Err(TorchOnly);
        }
        Ok(())
    }
}

/// What a measured row says of its job beyond the model and batch; unset fields take the
/// defaults the caller gives.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OptionOverrides {
    pub optimizer: Option<Optimizer>,
    pub precision: Option<Precision>,
    pub input: Option<InputShape>,
    pub seq_len: Option<u64>,
    pub data_parallel: Option<u32>,
    pub outputs: Option<Outputs>,
}

impl OptionOverrides {
    /// `base` with these overrides, checked again (a row's precision may not suit its strategy).
    pub fn over(&self, base: &Options) -> Result<Options, OptionError> {
        OptionValues {
            optimizer: self.optimizer.unwrap_or(base.optimizer),
            precision: self.precision.unwrap_or(base.precision),
            input: self.input.or(base.input),
            seq_len: self.seq_len.or(base.seq_len),
            data_parallel: self.data_parallel.unwrap_or(base.data_parallel),
            outputs: self.outputs.or(base.outputs),
            ..base.values()
        }
        .check()
    }
}

mod checkpointing_compat {
    use super::*;
    pub fn serialize<S: serde::Serializer>(c: &Checkpointing, s: S) -> Result<S::Ok, S::Error> {
        match c {
            Checkpointing::Off => s.serialize_bool(false),
            Checkpointing::Full => s.serialize_bool(true),
            other => s.serialize_str(&other.name()),
        }
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Checkpointing, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Stored {
            Flag(bool),
            Name(String),
        }
        match Stored::deserialize(d)? {
            Stored::Flag(on) => Ok(if on {
                Checkpointing::Full
            } else {
                Checkpointing::Off
            }),
            Stored::Name(n) => Checkpointing::parse(&n).map_err(serde::de::Error::custom),
        }
    }
}

mod optimizer_name {
    use super::*;
    pub fn serialize<S: serde::Serializer>(o: &Optimizer, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&o.name())
    }
    /// gpumem's names, the one vocabulary the tracer's request carries.
    pub fn schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let names: Vec<String> = Optimizer::all().iter().map(|o| o.name()).collect();
        schemars::json_schema!({ "type": "string", "enum": names })
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Optimizer, D::Error> {
        Optimizer::parse(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

mod precision_name {
    use super::*;
    pub fn serialize<S: serde::Serializer>(p: &Precision, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(p.name())
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Precision, D::Error> {
        Precision::parse(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

mod input_text {
    use super::*;
    pub fn serialize<S: serde::Serializer>(
        i: &Option<InputShape>,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        match i {
            Some(i) => s.serialize_str(&i.to_string()),
            None => s.serialize_none(),
        }
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<Option<InputShape>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(t) => InputShape::parse(&t)
                .map(Some)
                .ok_or_else(|| serde::de::Error::custom(format!("input `{t}` is not CxHxW"))),
        }
    }
}

#[cfg(test)]
mod tests;
