//! What a training job is, as data: which model ([`ModelRef`]: a native spec or a PyTorch
//! reference, told apart by the one prefix table here) and the options of the loop around it
//! ([`Options`]). The `gpumem-workload` crate turns the two into a trace; the CLI, the
//! simulator, the daemon and measurement rows all describe jobs with these types.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::UnknownName;
use crate::families::{ModelSpec, SpecError};
use crate::graph::Precision;
use crate::step::Optimizer;

/// Prefixes of model references only the PyTorch tracer can resolve.
pub const TORCH_PREFIXES: [&str; 5] = ["torchvision:", "timm:", "hf:", "smp:", "py:"];

/// Which model a job trains.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelRef {
    /// A native family model gpumem builds itself (`mlp:`, `cnn:`, `transformer:`).
    Native(ModelSpec),
    /// A reference only the PyTorch tracer can resolve (`torchvision:`, `timm:`, `hf:`, `smp:`, `py:`).
    Torch(String),
}

impl ModelRef {
    /// Whether `model` names a PyTorch model (by its prefix).
    pub fn is_torch(model: &str) -> bool {
        TORCH_PREFIXES.iter().any(|p| model.starts_with(p))
    }

    /// A PyTorch reference by its prefix, else a native spec (whose parse error names what is
    /// wrong, including an unknown family prefix).
    pub fn parse(model: &str) -> Result<ModelRef, SpecError> {
        match Self::recognise(model)? {
            Some(m) => Ok(m),
            None => ModelSpec::parse(model).map(ModelRef::Native),
        }
    }

    /// Like [`ModelRef::parse`], but a name with neither kind of prefix (a measured row's
    /// `resnet50`) is `None`, not an error.
    pub fn recognise(model: &str) -> Result<Option<ModelRef>, SpecError> {
        if Self::is_torch(model) {
            return Ok(Some(ModelRef::Torch(model.to_string())));
        }
        match model.split_once(':') {
            Some((family, _)) if ModelSpec::FAMILIES.contains(&family) => {
                ModelSpec::parse(model).map(|m| Some(ModelRef::Native(m)))
            }
            _ => Ok(None),
        }
    }

    pub fn is_native(&self) -> bool {
        matches!(self, ModelRef::Native(_))
    }
}

impl fmt::Display for ModelRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelRef::Native(s) => f.write_str(&s.to_spec_string()),
            ModelRef::Torch(r) => f.write_str(r),
        }
    }
}

/// An image input shape `CxHxW`, every size positive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InputShape {
    pub channels: u64,
    pub height: u64,
    pub width: u64,
}

impl InputShape {
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

spelled!(
    /// Activation checkpointing of a PyTorch model's repeated blocks.
    Checkpointing ("checkpointing") {
        Off = "off",
        /// Each block recomputed whole in backward (the model's own switch where it has one).
        Full = "full",
        /// Selective, op-level (torchtitan's "op" mode): each block's matmul and attention
        /// outputs saved, the rest recomputed.
        Selective = "selective",
    }
);

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

/// The options of the training loop around a model. The defaults are a plain loop: Adam, fp32,
/// the model's own input, one GPU, no checkpointing or accumulation, no validation.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Options {
    #[serde(with = "optimizer_name")]
    pub optimizer: Optimizer,
    #[serde(with = "precision_name")]
    pub precision: Precision,
    /// Input shape of image models (default: the model's own).
    #[serde(with = "input_text")]
    pub input: Option<InputShape>,
    /// Sequence length of sequence models.
    pub seq_len: Option<u64>,
    /// Activation checkpointing (stored as `false`/`true` for off/full, as before selective).
    #[serde(with = "checkpointing_compat")]
    pub checkpointing: Checkpointing,
    /// The channels_last memory format.
    pub channels_last: bool,
    /// Gradient accumulation steps.
    pub grad_accum: u32,
    /// GPUs of a `torch.nn.DataParallel` job (1: none); the job's batch is then the whole batch
    /// the wrapper splits, and the trace is GPU 0's.
    pub data_parallel: u32,
    pub validate: Validate,
    /// `None`: the model source's usual loop (Hugging Face's Trainer drops it, others keep it).
    pub outputs: Option<Outputs>,
    pub attention_mask: AttentionMask,
    /// LoRA fine-tuning: the model frozen, its target layers given trainable low-rank factors.
    pub lora: Option<Lora>,
    /// A multi-GPU wrapper; the trace is one rank's, the batch that rank's.
    pub strategy: Option<Strategy>,
}

/// How a multi-GPU job is wrapped (traced with PyTorch's own wrapper on a fake process group).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Strategy {
    /// `DistributedDataParallel`: `bucket_cap_mb` its gradient buckets (MiB, PyTorch's 25),
    /// `bucket_view` its `gradient_as_bucket_view`.
    Ddp {
        world_size: u32,
        #[serde(default = "ddp_bucket_cap_mb")]
        bucket_cap_mb: u32,
        #[serde(default)]
        bucket_view: bool,
    },
    /// FSDP2 (`fully_shard` on each repeated block, then the model): parameters, gradients and
    /// optimizer state sharded over the ranks, each layer's parameters gathered for its
    /// forward and backward; `reshard_after_forward` frees them between the two;
    /// `param_dtype`: `MixedPrecisionPolicy`'s (layers gathered and computed in it, gradients
    /// reduced into fp32 shards); `replicas` > 1 is HSDP: sharded within groups of
    /// `world_size / replicas` ranks (a node's), replicated across the groups; `cpu_offload`:
    /// `CPUOffloadPolicy` (shards, gradients and the optimizer step on the host; each layer's
    /// shards copied to the GPU for its all-gather).
    Fsdp {
        world_size: u32,
        #[serde(default = "yes")]
        reshard_after_forward: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        param_dtype: Option<HalfDtype>,
        #[serde(default = "one")]
        replicas: u32,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        cpu_offload: bool,
    },
    /// DeepSpeed ZeRO stage 1 (optimizer state partitioned), 2 (and gradients) or 3 (and
    /// parameters), modelled from its config (DeepSpeed need not be installed).
    Zero {
        stage: u8,
        world_size: u32,
        #[serde(default)]
        zero: Zero,
    },
}

// Serde's defaults for a hand-written strategy (a job file's `[options.strategy]`): PyTorch's.
fn one() -> u32 {
    1
}

fn yes() -> bool {
    true
}

fn ddp_bucket_cap_mb() -> u32 {
    DDP_BUCKET_CAP_MB
}

/// `DistributedDataParallel`'s default `bucket_cap_mb`.
pub const DDP_BUCKET_CAP_MB: u32 = 25;

/// A 16-bit floating-point dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HalfDtype {
    Bf16,
    Fp16,
}

impl HalfDtype {
    pub fn name(self) -> &'static str {
        match self {
            HalfDtype::Bf16 => "bf16",
            HalfDtype::Fp16 => "fp16",
        }
    }
}

/// What of DeepSpeed's `zero_optimization` decides a rank's memory, in DeepSpeed's units
/// (elements) and with its defaults. `overlap_comm: None` is DeepSpeed's own default (on for
/// stage 3 only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Zero {
    pub reduce_bucket_size: u64,
    pub overlap_comm: Option<bool>,
    pub contiguous_gradients: bool,
    pub prefetch_bucket_size: u64,
    pub max_live_parameters: u64,
    pub max_reuse_distance: u64,
    pub param_persistence_threshold: u64,
    /// Master weights, optimizer state and fp32 gradients on the host (`offload_optimizer`).
    pub offload_optimizer: bool,
    /// Stage 3's parameter partitions on the host (`offload_param`).
    pub offload_param: bool,
}

impl Default for Zero {
    fn default() -> Self {
        Zero {
            reduce_bucket_size: 500_000_000,
            overlap_comm: None,
            contiguous_gradients: true,
            prefetch_bucket_size: 50_000_000,
            max_live_parameters: 1_000_000_000,
            max_reuse_distance: 1_000_000_000,
            param_persistence_threshold: 100_000,
            offload_optimizer: false,
            offload_param: false,
        }
    }
}

/// The most ranks a strategy is traced for.
pub const MAX_WORLD_SIZE: u32 = 1 << 16;

impl Strategy {
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Ddp { .. } => "ddp",
            Strategy::Fsdp { replicas: 2.., .. } => "hsdp",
            Strategy::Fsdp { .. } => "fsdp",
            Strategy::Zero { stage: 1, .. } => "zero1",
            Strategy::Zero { stage: 2, .. } => "zero2",
            Strategy::Zero { .. } => "zero3",
        }
    }

    pub fn world_size(self) -> u32 {
        match self {
            Strategy::Ddp { world_size, .. }
            | Strategy::Fsdp { world_size, .. }
            | Strategy::Zero { world_size, .. } => world_size,
        }
    }
}

/// LoRA as PEFT's `LoraConfig` states it (`r`, `lora_alpha`, `target_modules`, `lora_dropout`).
/// Invariant: rank ≥ 1, alpha and dropout finite (dropout in [0, 1)), at least one target.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lora {
    pub rank: u32,
    pub alpha: f64,
    /// Module names (a module matches one that is its name or its name's last dotted parts), or
    /// `all-linear`: every linear layer but the output embeddings.
    pub targets: Vec<String>,
    #[serde(default)]
    pub dropout: f64,
    /// QLoRA: the model loaded in 4 bits first (bitsandbytes' `Linear4bit` for every linear
    /// layer but the output embeddings), as transformers' `BitsAndBytesConfig(load_in_4bit=True)`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quant: Option<Quant4>,
}

/// 4-bit base weights (nf4 and fp4 hold the same bytes); `double_quant`: the block statistics
/// quantized again (`bnb_4bit_use_double_quant`, QLoRA's recipe).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quant4 {
    pub nf4: bool,
    pub double_quant: bool,
}

// Sound: the numbers are finite (checked where a Lora is made), so bitwise equality is equality.
impl Eq for Lora {}

impl std::hash::Hash for Lora {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (
            self.rank,
            self.alpha.to_bits(),
            &self.targets,
            self.dropout.to_bits(),
            self.quant,
        )
            .hash(h);
    }
}

impl Lora {
    /// `r=16,alpha=32,targets=q_proj,v_proj[,dropout=0.05][,quant=nf4|fp4[,double_quant=false]]`
    /// (a bare word after `targets=` is one more target). PEFT's defaults: r 8, alpha 8, dropout
    /// 0; targets are required; QLoRA's double quantization unless turned off.
    pub fn parse(spec: &str) -> Result<Lora, String> {
        let (mut rank, mut alpha, mut dropout, mut targets) = (8u32, 8f64, 0f64, Vec::new());
        let (mut quant, mut double_quant) = (None, None);
        let mut after_targets = false;
        for part in spec.split(',').map(str::trim) {
            let (key, value) = match part.split_once('=') {
                Some((k, v)) => (k.trim(), v.trim()),
                None if after_targets && !part.is_empty() => ("targets", part),
                None => {
                    return Err(format!(
                        "`{part}` is not key=value (r, alpha, targets, dropout, quant, double_quant)"
                    ));
                }
            };
            let number = |v: &str| {
                v.parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| format!("{key} `{v}` is not a number"))
            };
            match key {
                "r" | "rank" => {
                    rank = value
                        .parse()
                        .map_err(|_| format!("r `{value}` is not a whole number"))?
                }
                "alpha" | "lora_alpha" => alpha = number(value)?,
                "dropout" | "lora_dropout" => dropout = number(value)?,
                "targets" | "target_modules" => targets.push(value.to_string()),
                "quant" => {
                    quant = Some(match value {
                        "nf4" => true,
                        "fp4" => false,
                        other => return Err(format!("quant `{other}` is not nf4 or fp4")),
                    })
                }
                "double_quant" => {
                    double_quant = Some(
                        value
                            .parse::<bool>()
                            .map_err(|_| format!("double_quant `{value}` is not true or false"))?,
                    )
                }
                other => {
                    return Err(format!(
                        "unknown key `{other}` (r, alpha, targets, dropout, quant, double_quant)"
                    ));
                }
            }
            after_targets = matches!(key, "targets" | "target_modules");
        }
        let quant = match (quant, double_quant) {
            (Some(nf4), d) => Some(Quant4 {
                nf4,
                double_quant: d.unwrap_or(true),
            }),
            (None, Some(_)) => return Err("double_quant needs quant=nf4 or quant=fp4".into()),
            (None, None) => None,
        };
        Ok(Lora {
            quant,
            ..Lora::new(rank, alpha, targets, dropout)?
        })
    }

    /// A PEFT `adapter_config.json` (its `r`, `lora_alpha`, `target_modules`, `lora_dropout`).
    pub fn from_peft_json(text: &str) -> Result<Lora, String> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        if let Some(t) = v
            .get("peft_type")
            .and_then(|t| t.as_str())
            .filter(|t| *t != "LORA")
        {
            return Err(format!("peft_type is {t}; gpumem models LORA"));
        }
        let rank = v
            .get("r")
            .map_or(Some(8), |r| r.as_u64())
            .and_then(|r| u32::try_from(r).ok())
            .ok_or("`r` is not a whole number")?;
        let number = |key: &str, default: f64| {
            v.get(key)
                .map_or(Some(default), |x| x.as_f64())
                .ok_or(format!("`{key}` is not a number"))
        };
        let targets = match v.get("target_modules") {
            Some(serde_json::Value::String(s)) => vec![s.clone()],
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|t| {
                    t.as_str()
                        .map(str::to_string)
                        .ok_or("`target_modules` holds a non-string")
                })
                .collect::<Result<_, _>>()?,
            _ => {
                return Err(
                    "`target_modules` is missing (a list of module names, or \"all-linear\")"
                        .into(),
                );
            }
        };
        Lora::new(
            rank,
            number("lora_alpha", 8.0)?,
            targets,
            number("lora_dropout", 0.0)?,
        )
    }

    fn new(rank: u32, alpha: f64, targets: Vec<String>, dropout: f64) -> Result<Lora, String> {
        if rank == 0 {
            return Err("r must be at least 1".into());
        }
        if !(0.0..1.0).contains(&dropout) {
            return Err(format!("dropout {dropout} is not in [0, 1)"));
        }
        if targets.is_empty()
            || targets
                .iter()
                .any(|t| t.is_empty() || t.contains(char::is_whitespace))
        {
            return Err(
                "give targets=NAME[,NAME…] (module names such as q_proj,v_proj, or all-linear)"
                    .into(),
            );
        }
        Ok(Lora {
            rank,
            alpha,
            targets,
            dropout,
            quant: None,
        })
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            optimizer: Optimizer::Adam,
            precision: Precision::Fp32,
            input: None,
            seq_len: None,
            checkpointing: Checkpointing::Off,
            channels_last: false,
            grad_accum: 1,
            data_parallel: 1,
            validate: Validate::None,
            outputs: None,
            attention_mask: AttentionMask::None,
            lora: None,
            strategy: None,
        }
    }
}

/// An option out of range, named as the command line spells it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    #[error("--grad-accum must be at least 1")]
    GradAccum,
    #[error("--data-parallel {0} is out of range (1..={MAX_DATA_PARALLEL})")]
    DataParallel(u32),
    #[error("--seq-len must be at least 1")]
    SeqLen,
    #[error("--world-size {0} is out of range (2..={MAX_WORLD_SIZE})")]
    WorldSize(u32),
    #[error("--bucket-cap-mb must be at least 1")]
    BucketCap,
    #[error("a job is --data-parallel or --strategy, not both")]
    TwoWrappers,
    #[error("ZeRO stage {0} is not 1, 2 or 3")]
    ZeroStage(u8),
    #[error("ZeRO's reduce_bucket_size must be at least 1")]
    ReduceBucket,
    #[error("offload_param needs ZeRO stage 3")]
    OffloadParam,
    /// DeepSpeed scales the loss of fp16 training inside its engine; torch's GradScaler does not
    /// drive one.
    #[error(
        "ZeRO trains fp16 in DeepSpeed's own fp16 mode (--precision fp16, loss scaling inside the engine), not under torch's GradScaler (amp-fp16)"
    )]
    ZeroAmpFp16,
    #[error(
        "HSDP's --nodes {replicas} must divide --world-size {world_size} into groups of at least 2 ranks"
    )]
    Replicas { replicas: u32, world_size: u32 },
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

/// Most GPUs a DataParallel job is modelled over.
pub const MAX_DATA_PARALLEL: u32 = 64;

impl Options {
    /// The first option out of range.
    pub fn check(&self) -> Result<(), OptionError> {
        if self.grad_accum == 0 {
            return Err(OptionError::GradAccum);
        }
        if self.data_parallel == 0 || self.data_parallel > MAX_DATA_PARALLEL {
            return Err(OptionError::DataParallel(self.data_parallel));
        }
        if self.seq_len == Some(0) {
            return Err(OptionError::SeqLen);
        }
        if let Some(strategy) = self.strategy {
            if !(2..=MAX_WORLD_SIZE).contains(&strategy.world_size()) {
                return Err(OptionError::WorldSize(strategy.world_size()));
            }
            match strategy {
                Strategy::Ddp {
                    bucket_cap_mb: 0, ..
                } => return Err(OptionError::BucketCap),
                Strategy::Zero { stage, .. } if !(1..=3).contains(&stage) => {
                    return Err(OptionError::ZeroStage(stage));
                }
                Strategy::Zero { zero, .. } if zero.reduce_bucket_size == 0 => {
                    return Err(OptionError::ReduceBucket);
                }
                Strategy::Zero { stage, zero, .. } if zero.offload_param && stage != 3 => {
                    return Err(OptionError::OffloadParam);
                }
                Strategy::Zero { .. } if self.precision == Precision::AmpFp16 => {
                    return Err(OptionError::ZeroAmpFp16);
                }
                Strategy::Fsdp {
                    world_size,
                    replicas,
                    ..
                } if replicas == 0
                    || !world_size.is_multiple_of(replicas)
                    || (replicas > 1 && world_size / replicas < 2) =>
                {
                    return Err(OptionError::Replicas {
                        replicas,
                        world_size,
                    });
                }
                _ => {}
            }
            if self.data_parallel > 1 {
                return Err(OptionError::TwoWrappers);
            }
        }
        Ok(())
    }

    /// A job of these options on `gpus` GPUs: a strategy's ranks must be exactly its GPUs.
    pub fn check_gpus(&self, gpus: u32) -> Result<(), RanksNotGpus> {
        match self.strategy.map(Strategy::world_size) {
            Some(world_size) if world_size != gpus => Err(RanksNotGpus { world_size, gpus }),
            _ => Ok(()),
        }
    }

    /// What a native family model can be given of these options: the optimizer and the
    /// precision, in an otherwise plain loop (the families refuse pure precision themselves).
    pub fn native_part(&self) -> Options {
        Options {
            optimizer: self.optimizer,
            precision: self.precision,
            ..Options::default()
        }
    }

    /// Whether a native family model can take all of these options.
    pub fn native_compatible(&self) -> bool {
        *self == self.native_part()
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
    pub fn over(&self, base: &Options) -> Options {
        Options {
            optimizer: self.optimizer.unwrap_or(base.optimizer),
            precision: self.precision.unwrap_or(base.precision),
            input: self.input.or(base.input),
            seq_len: self.seq_len.or(base.seq_len),
            data_parallel: self.data_parallel.unwrap_or(base.data_parallel),
            outputs: self.outputs.or(base.outputs),
            ..base.clone()
        }
    }
}

mod checkpointing_compat {
    use super::*;
    pub fn serialize<S: serde::Serializer>(c: &Checkpointing, s: S) -> Result<S::Ok, S::Error> {
        match c {
            Checkpointing::Off => s.serialize_bool(false),
            Checkpointing::Full => s.serialize_bool(true),
            Checkpointing::Selective => s.serialize_str(c.name()),
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
        s.serialize_str(o.name())
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
mod tests {
    use super::*;

    #[test]
    fn one_prefix_table() {
        assert_eq!(
            ModelRef::parse("hf:gpt2").unwrap(),
            ModelRef::Torch("hf:gpt2".into())
        );
        assert!(
            ModelRef::parse("mlp:input=8,output=2,depth=1")
                .unwrap()
                .is_native()
        );
        let e = ModelRef::parse("resnet50").unwrap_err().to_string();
        assert!(e.contains("no `family:` prefix"), "{e}");
        assert_eq!(ModelRef::recognise("resnet50").unwrap(), None);
        assert!(ModelRef::recognise("mlp:depth=x").is_err());
    }

    #[test]
    fn options_in_json_are_spelled_as_on_the_command_line() {
        let o: Options = serde_json::from_str(r#"{"optimizer":"adamw","precision":"amp-bf16","input":"3x224x224","validate":"no-grad","outputs":"dropped"}"#).unwrap();
        assert_eq!(
            (o.optimizer, o.precision, o.validate, o.outputs),
            (
                Optimizer::AdamW,
                Precision::AmpBf16,
                Validate::NoGrad,
                Some(Outputs::Dropped)
            )
        );
        assert_eq!(o.input.unwrap().to_string(), "3x224x224");
        assert_eq!(
            serde_json::from_str::<Options>(&serde_json::to_string(&o).unwrap()).unwrap(),
            o
        );
        let e = serde_json::from_str::<Options>(r#"{"validate":"maybe"}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown validation `maybe` (expected none, no-grad, grad)"),
            "{e}"
        );
        assert!(serde_json::from_str::<Options>(r#"{"optimiser":"sgd"}"#).is_err());
        assert!(InputShape::parse("3x0x4").is_none() && InputShape::parse("3x4").is_none());
    }

    #[test]
    fn checks_and_native_options() {
        assert!(Options::default().check().is_ok() && Options::default().native_compatible());
        let o = Options {
            grad_accum: 0,
            ..Options::default()
        };
        assert_eq!(
            o.check().unwrap_err().to_string(),
            "--grad-accum must be at least 1"
        );
        assert!(
            !Options {
                checkpointing: Checkpointing::Full,
                ..Options::default()
            }
            .native_compatible()
        );
        // Stored jobs from before selective checkpointing read as they were written.
        for (stored, c) in [
            ("false", Checkpointing::Off),
            ("true", Checkpointing::Full),
            ("\"selective\"", Checkpointing::Selective),
        ] {
            let o: Options =
                serde_json::from_str(&format!(r#"{{"checkpointing": {stored}}}"#)).unwrap();
            assert_eq!(o.checkpointing, c);
            assert_eq!(
                serde_json::to_value(&o).unwrap()["checkpointing"].to_string(),
                stored
            );
        }
        assert!(
            serde_json::from_str::<Options>(r#"{"checkpointing": "half"}"#)
                .unwrap_err()
                .to_string()
                .contains("half")
        );
        let over = OptionOverrides {
            seq_len: Some(512),
            ..Default::default()
        }
        .over(&Options {
            grad_accum: 2,
            ..Options::default()
        });
        assert_eq!((over.seq_len, over.grad_accum), (Some(512), 2));
    }

    #[test]
    fn lora_is_stated_as_peft_states_it() {
        let l = Lora::parse("r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05").unwrap();
        assert_eq!(
            (l.rank, l.alpha, l.targets.clone(), l.dropout),
            (
                16,
                32.0,
                vec!["q_proj".to_string(), "v_proj".to_string()],
                0.05
            )
        );
        assert_eq!(
            Lora::parse("targets=all-linear").unwrap(),
            Lora {
                rank: 8,
                alpha: 8.0,
                targets: vec!["all-linear".into()],
                dropout: 0.0,
                quant: None
            },
            "PEFT's defaults"
        );
        // QLoRA: 4-bit base weights, double-quantized unless turned off.
        assert_eq!(
            Lora::parse("targets=all-linear,quant=nf4").unwrap().quant,
            Some(Quant4 {
                nf4: true,
                double_quant: true
            })
        );
        assert_eq!(
            Lora::parse("targets=q,quant=fp4,double_quant=false")
                .unwrap()
                .quant,
            Some(Quant4 {
                nf4: false,
                double_quant: false
            })
        );
        let json = r#"{"peft_type": "LORA", "r": 16, "lora_alpha": 32, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"], "bias": "none"}"#;
        assert_eq!(
            Lora::from_peft_json(json).unwrap(),
            Lora { dropout: 0.1, ..l }
        );
        for (bad, needle) in [
            ("r=0,targets=q", "at least 1"),
            ("r=16", "give targets"),
            ("r=16,q_proj", "not key=value"),
            ("alpha=nan,targets=q", "not a number"),
            ("rank=4,colour=1", "unknown key"),
            ("dropout=1,targets=q", "not in [0, 1)"),
            ("targets=q,quant=int3", "quant `int3` is not nf4 or fp4"),
            (
                "targets=q,double_quant=true",
                "double_quant needs quant=nf4",
            ),
            ("targets=q,quant=nf4,double_quant=2", "not true or false"),
        ] {
            assert!(Lora::parse(bad).unwrap_err().contains(needle), "{bad}");
        }
        assert!(
            Lora::from_peft_json(r#"{"peft_type": "IA3", "target_modules": ["k"]}"#)
                .unwrap_err()
                .contains("IA3")
        );
        assert!(
            !Options {
                lora: Some(Lora::parse("targets=q").unwrap()),
                ..Options::default()
            }
            .native_compatible()
        );
    }

    #[test]
    fn a_strategy_is_checked_and_stated_as_json() {
        let ddp = |world_size, data_parallel| Options {
            strategy: Some(Strategy::Ddp {
                world_size,
                bucket_cap_mb: 25,
                bucket_view: false,
            }),
            data_parallel,
            ..Options::default()
        };
        assert_eq!(ddp(8, 1).check(), Ok(()));
        assert_eq!(ddp(1, 1).check(), Err(OptionError::WorldSize(1)));
        assert_eq!(ddp(8, 2).check(), Err(OptionError::TwoWrappers));
        let json = serde_json::to_string(&ddp(8, 1)).unwrap();
        assert!(
            json.contains(
                r#""strategy":{"kind":"ddp","world_size":8,"bucket_cap_mb":25,"bucket_view":false}"#
            ),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<Options>(&json).unwrap(), ddp(8, 1));
        assert!(!ddp(8, 1).native_compatible());
        let fsdp = Options {
            strategy: Some(Strategy::Fsdp {
                world_size: 1,
                reshard_after_forward: true,
                param_dtype: None,
                replicas: 1,
                cpu_offload: false,
            }),
            ..Options::default()
        };
        assert_eq!(fsdp.check(), Err(OptionError::WorldSize(1)));
    }
}
