//! Trainer configs as jobs: the files people train with — Hugging Face `TrainingArguments` and
//! TRL `SFTConfig` (JSON or YAML of the arguments), axolotl YAML, torchtune YAML, torchtitan
//! (a TOML file, or a Python config function's `Trainer.Config`/`JobConfig` dumped to JSON by the
//! tracer's Python), a declarative Lightning CLI YAML, DeepSpeed JSON and accelerate YAML — read
//! into one [`TrainConfig`]: the model as the config names it, the micro-batch, what it fixes of
//! the loop (the job vocabulary's types) and how its ranks are laid out.
//!
//! Every key of the file is accounted for: [`Fields`] lists each dotted key as used, not
//! modelled (with its value and why), or as not bearing on memory (learning rates, logging,
//! seeds, paths). A key no table names is reported not modelled — never silently dropped.
//! Reading a config needs none of the trainers installed (a torchtitan Python config needs
//! torchtitan, as the user's function imports it).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use gpumem_core::job::{
    Attention, AttentionMask, Checkpointing, Engine, HalfDtype, Implementation, Liger, Lora, Mesh,
    MeshDim, Optimizer, OptionError, OptionValues, Options, Pipeline, Precision, Quant4, Strategy,
    WholeRun,
};
use serde::Serialize;
use serde_json::Value;

use crate::deepspeed::DeepSpeedJob;

mod axolotl;
mod hf;
mod launchers;
mod lightning;
mod litgpt;
mod torchtitan;
mod torchtune;

#[cfg(test)]
mod tests;

/// Which trainer's config a file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TrainerKind {
    /// Hugging Face `TrainingArguments` (JSON or YAML of the arguments).
    HfTrainer,
    /// TRL's `SFTConfig` (with its `ModelConfig`, as `trl sft --config` reads them).
    TrlSft,
    Axolotl,
    Torchtune,
    /// torchtitan's TOML file (its 2025 releases).
    TorchtitanToml,
    /// torchtitan's Python config: a function returning `Trainer.Config` (or `JobConfig`).
    TorchtitanPython,
    /// A Lightning CLI YAML (`trainer:`, `model:`, `data:`, `optimizer:`).
    Lightning,
    /// litgpt's YAML (`litgpt finetune_lora|finetune_full|pretrain --config`).
    Litgpt,
    Deepspeed,
    Accelerate,
}

impl TrainerKind {
    pub const NAMES: &[&str] = &[
        "hf-trainer",
        "trl-sft",
        "axolotl",
        "torchtune",
        "torchtitan-toml",
        "torchtitan-python",
        "lightning",
        "litgpt",
        "deepspeed",
        "accelerate",
    ];

    pub fn name(self) -> &'static str {
        match self {
            TrainerKind::HfTrainer => "hf-trainer",
            TrainerKind::TrlSft => "trl-sft",
            TrainerKind::Axolotl => "axolotl",
            TrainerKind::Torchtune => "torchtune",
            TrainerKind::TorchtitanToml => "torchtitan-toml",
            TrainerKind::TorchtitanPython => "torchtitan-python",
            TrainerKind::Lightning => "lightning",
            TrainerKind::Litgpt => "litgpt",
            TrainerKind::Deepspeed => "deepspeed",
            TrainerKind::Accelerate => "accelerate",
        }
    }

    pub fn parse(s: &str) -> Result<TrainerKind, gpumem_core::UnknownName> {
        [
            TrainerKind::HfTrainer,
            TrainerKind::TrlSft,
            TrainerKind::Axolotl,
            TrainerKind::Torchtune,
            TrainerKind::TorchtitanToml,
            TrainerKind::TorchtitanPython,
            TrainerKind::Lightning,
            TrainerKind::Litgpt,
            TrainerKind::Deepspeed,
            TrainerKind::Accelerate,
        ]
        .into_iter()
        .find(|k| k.name() == s)
        .ok_or_else(|| {
            gpumem_core::UnknownName::new("trainer config kind", s, TrainerKind::NAMES.join(", "))
        })
    }
}

/// A key the config states that gpumem does not model, with its value and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NotModelled {
    pub field: String,
    pub value: Value,
    pub reason: String,
}

/// Every key of a config, accounted for once: dotted paths (`fsdp_config.fsdp_version`; a
/// subtree reported whole where a table says so, `profiler`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Fields {
    /// Read into the job.
    pub used: Vec<String>,
    /// Stated, and bearing (or maybe bearing) on memory, but not modelled.
    pub not_modelled: Vec<NotModelled>,
    /// Keys that do not bear on a training step's GPU memory (learning rate, logging, seeds,
    /// paths, …).
    pub no_memory: Vec<String>,
}

/// How a config lays out its ranks. Some trainers leave the count to the launcher (`torchrun
/// --nproc-per-node`, torchtitan's `-1` degrees): then the caller's world size decides.
#[derive(Debug, Clone, PartialEq)]
pub enum Layout {
    /// One GPU, unless launched over several: then DDP (Hugging Face's Trainer, axolotl,
    /// Lightning's `auto` under several devices), with its bucket size.
    Launcher { bucket_cap_mb: u32 },
    /// One GPU, whatever the launcher (a single-device recipe).
    Single,
    /// A strategy over ranks the config fixes.
    Fixed(Strategy),
    /// FSDP2 (HSDP with `replicate` > 1) over `context` × `tensor`-parallel groups (1: none),
    /// its MoE experts split over `expert` of the shard × context × tensor ranks (1: none);
    /// `shard` `None`: the ranks left over (torchtitan's `-1`).
    Fsdp {
        replicate: u32,
        shard: Option<u32>,
        tensor: u32,
        /// Pipeline stages, and how they step (present exactly where there are several).
        pipeline: u32,
        schedule: Option<Pipeline>,
        context: u32,
        expert: u32,
        reshard_after_forward: bool,
        param_dtype: Option<HalfDtype>,
        cpu_offload: bool,
        /// Each micro-batch's gradients reduced as made, not accumulated unsharded until the
        /// last (the trainer's way of accumulating: see [`Engine::Fsdp`]).
        sync_each_batch: bool,
        /// The key that asked for it, for errors.
        field: &'static str,
    },
    /// DeepSpeed ZeRO from a config; its ranks are `train_batch_size`'s or the caller's.
    Zero { job: DeepSpeedJob, field: String },
}

/// A trainer config, read.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    pub kind: TrainerKind,
    /// The file, as named (errors and output name it).
    pub file: String,
    /// The model as the config names it (a Hub id, a directory, a class path), and its key.
    pub model: Option<(String, String)>,
    /// Per-device micro-batch, and its key.
    pub micro_batch: Option<(u64, String)>,
    pub precision: Option<Precision>,
    pub optimizer: Option<Optimizer>,
    pub grad_accum: Option<u32>,
    pub seq_len: Option<u64>,
    pub checkpointing: Option<Checkpointing>,
    pub lora: Option<Lora>,
    pub attention_mask: Option<AttentionMask>,
    /// The attention implementation (Hugging Face's `attn_implementation`, axolotl's
    /// `flash_attention`, …).
    pub attention: Option<Attention>,
    /// torchtune's `optimizer_in_bwd`.
    pub optimizer_in_backward: Option<bool>,
    /// torchtune's `CEWithChunkedOutputLoss`'s chunk count.
    pub chunked_ce: Option<u32>,
    /// torch.compile of the loss (torchtitan's `compile`, torchtune's `compile`, Hugging
    /// Face's `torch_compile`).
    pub compile: Option<bool>,
    /// torchtune's `enable_activation_offloading`.
    pub activation_offloading: Option<bool>,
    /// TRL's KL reference model (`beta` > 0 without PEFT).
    pub reference_model: Option<bool>,
    /// Liger's kernels (Hugging Face's `use_liger_kernel`, axolotl's Liger plugin).
    pub liger: Option<Liger>,
    /// Float8 training of the linear layers (torchtitan's float8 converter).
    pub float8: Option<gpumem_core::job::Float8>,
    /// The whole run, where the config names a part of it beyond the steps (an evaluation).
    pub whole_run: Option<WholeRun>,
    pub layout: Layout,
    pub fields: Fields,
}

/// Why a trainer config cannot be read; one line naming the file and the key.
#[derive(Debug, thiserror::Error)]
pub enum TrainConfigError {
    #[error("{file}: {source}")]
    Io {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}: not {what}: {why}")]
    Parse {
        file: String,
        what: &'static str,
        why: String,
    },
    #[error(
        "{file}: cannot tell which trainer's config this is ({why}); name it with --train-config-kind ({})",
        TrainerKind::NAMES.join(", ")
    )]
    Kind { file: String, why: String },
    #[error("{file}: `{field}`: {why}")]
    Field {
        file: String,
        field: String,
        why: String,
    },
    /// The Python config function could not be called (torchtitan missing, the function failed).
    #[error("{file}: {why}")]
    Python { file: String, why: String },
}

impl TrainConfig {
    /// The strategy on `world` ranks (`None`: the launcher's count is not given).
    pub fn strategy(&self, world: Option<u32>) -> Result<Option<Strategy>, TrainConfigError> {
        let field_err = |field: &str, why: String| TrainConfigError::Field {
            file: self.file.clone(),
            field: field.into(),
            why,
        };
        match &self.layout {
            Layout::Single => match world {
                Some(w) if w > 1 => Err(field_err(
                    "(recipe)",
                    format!("a single-device config, launched over {w} ranks"),
                )),
                _ => Ok(None),
            },
            Layout::Launcher { bucket_cap_mb } => match world {
                Some(w) if w > 1 => Strategy::ddp(w, *bucket_cap_mb, false)
                    .map(Some)
                    .map_err(|e| field_err("(launcher)", e.to_string())),
                _ => Ok(None),
            },
            Layout::Fixed(s) => match world {
                Some(w) if w != s.world_size() => Err(field_err(
                    "(ranks)",
                    format!(
                        "the config lays out {} ranks, not --world-size {w}",
                        s.world_size()
                    ),
                )),
                _ => Ok(Some(*s)),
            },
            Layout::Fsdp {
                replicate,
                shard,
                tensor,
                pipeline,
                schedule,
                context,
                expert,
                reshard_after_forward,
                param_dtype,
                cpu_offload,
                sync_each_batch,
                field,
            } => {
                let group = replicate * pipeline * context * tensor;
                let shard = match (shard, world) {
                    (Some(s), Some(w)) if s * group != w => {
                        return Err(field_err(
                            field,
                            format!(
                                "{} ranks ({replicate} × {s} × {context} × {tensor}), not --world-size {w}",
                                s * group
                            ),
                        ));
                    }
                    (Some(s), _) => *s,
                    (None, Some(w)) if w % group == 0 => w / group,
                    (None, Some(w)) => {
                        return Err(field_err(
                            field,
                            format!(
                                "--world-size {w} is not a multiple of {replicate} replicas × {context} context- × {tensor} tensor-parallel ranks"
                            ),
                        ));
                    }
                    (None, None) => {
                        return Err(field_err(
                            field,
                            "the ranks are the launcher's: give --world-size (gpus in a job request)"
                                .into(),
                        ));
                    }
                };
                let sharded = shard * replicate * context > 1;
                if !sharded && *tensor == 1 {
                    return Ok(None);
                }
                // Tensor parallelism alone: no FSDP, so none of its own settings (torchtitan
                // then trains under autocast: see `over`).
                let engine = Engine::Fsdp {
                    reshard_after_forward: *reshard_after_forward,
                    param_dtype: param_dtype.filter(|_| sharded),
                    cpu_offload: *cpu_offload && sharded,
                    sync_each_batch: *sync_each_batch,
                };
                let mesh = Mesh::new(&[
                    (MeshDim::Replicate, *replicate),
                    (MeshDim::Shard, shard),
                    (MeshDim::Tensor, *tensor),
                    (MeshDim::Pipeline, *pipeline),
                    (MeshDim::Context, *context),
                    (MeshDim::Expert, *expert),
                ])
                .map_err(|e| field_err(field, e.to_string()))?;
                let strategy =
                    Strategy::new(mesh, engine).map_err(|e| field_err(field, e.to_string()))?;
                match schedule {
                    Some(p) => strategy.with_pipeline(*p),
                    None => Ok(strategy),
                }
                .map(Some)
                .map_err(|e| field_err(field, e.to_string()))
            }
            Layout::Zero { job, field } => {
                let w = match (job.world_size, world) {
                    (Some(s), Some(w)) if s != w => {
                        return Err(field_err(
                            field,
                            format!("train_batch_size makes {s} ranks, not --world-size {w}"),
                        ));
                    }
                    (Some(w), _) | (None, Some(w)) => w,
                    (None, None) => {
                        return Err(field_err(
                            field,
                            "the ranks are the launcher's: give --world-size (gpus in a job request)"
                                .into(),
                        ));
                    }
                };
                job.strategy(w)
                    .map(Some)
                    .map_err(|e| field_err(field, e.to_string()))
            }
        }
    }

    /// A job's model and micro-batch (the job's own first, else the config's) and its options
    /// (`base`, the job's own, beneath what the config states) on `world` ranks: the one
    /// reading of "this job, with that config" for every front end (CLI, daemon, Slurm,
    /// webhook). Model and micro-batch come both or neither.
    pub fn job(
        &self,
        model: Option<String>,
        batch: Option<u64>,
        base: OptionValues,
        world: Option<u32>,
    ) -> Result<(Option<String>, Option<u64>, Options), TrainConfigError> {
        let model = model.or_else(|| self.model.as_ref().map(|(m, _)| m.clone()));
        let batch = batch.or(self.micro_batch.as_ref().map(|(b, _)| *b));
        if model.is_some() != batch.is_some() {
            return Err(TrainConfigError::Field {
                file: self.file.clone(),
                field: "(job)".into(),
                why: format!(
                    "states no {}; give it in the job",
                    if model.is_none() {
                        "model"
                    } else {
                        "micro-batch"
                    }
                ),
            });
        }
        Ok((model, batch, self.over(base, world)?))
    }

    /// What the config said, as `estimate --json` carries it (`overrides`: what the caller
    /// stated over the config's values, one line each).
    pub fn to_json(&self, overrides: &[String]) -> Value {
        serde_json::json!({
            "kind": self.kind.name(),
            "file": self.file,
            "used": self.fields.used,
            "not_modelled": self.fields.not_modelled,
            "no_memory": self.fields.no_memory,
            "overrides": overrides,
        })
    }

    /// What the config states over `base` (the defaults or the caller's values), on `world`
    /// ranks, checked.
    pub fn over(
        &self,
        base: OptionValues,
        world: Option<u32>,
    ) -> Result<Options, TrainConfigError> {
        let strategy = self.strategy(world)?;
        let mut precision = self.precision;
        // FSDP's mixed-precision policy without FSDP (one GPU, or tensor parallelism alone) is
        // autocast (torchtitan's `maybe_enable_amp`).
        let unsharded = strategy.is_none_or(|s| {
            s.mesh().degree(MeshDim::Replicate) * s.mesh().degree(MeshDim::Shard) == 1
        });
        if let (
            true,
            Layout::Fsdp {
                param_dtype: Some(d),
                ..
            },
            Some(Precision::Fp32),
        ) = (unsharded, &self.layout, precision)
        {
            precision = Some(match d {
                HalfDtype::Bf16 => Precision::AmpBf16,
                HalfDtype::Fp16 => Precision::AmpFp16,
            });
        }
        OptionValues {
            precision: precision.unwrap_or(base.precision),
            optimizer: self.optimizer.unwrap_or(base.optimizer),
            grad_accum: self.grad_accum.unwrap_or(base.grad_accum),
            seq_len: self.seq_len.or(base.seq_len),
            checkpointing: self.checkpointing.unwrap_or(base.checkpointing),
            lora: self.lora.clone().or(base.lora),
            attention_mask: self.attention_mask.unwrap_or(base.attention_mask),
            attention: self.attention.or(base.attention),
            optimizer_in_backward: self
                .optimizer_in_backward
                .unwrap_or(base.optimizer_in_backward),
            chunked_ce: self.chunked_ce.or(base.chunked_ce),
            compile: self.compile.unwrap_or(base.compile),
            activation_offloading: self
                .activation_offloading
                .unwrap_or(base.activation_offloading),
            reference_model: self.reference_model.unwrap_or(base.reference_model),
            liger: self.liger.clone().or(base.liger),
            float8: self.float8.or(base.float8),
            whole_run: self.whole_run.or(base.whole_run),
            strategy: strategy.or(base.strategy),
            ..base
        }
        .check()
        .map_err(|e: OptionError| TrainConfigError::Field {
            file: self.file.clone(),
            field: "(options)".into(),
            why: e.to_string(),
        })
    }
}

/// A config's document, flattened to dotted keys, each key's fate recorded as a reader reads it.
pub(crate) struct Doc {
    pub file: String,
    /// The directory relative paths in the config are read from.
    pub dir: PathBuf,
    pub root: Value,
    leaves: BTreeMap<String, Value>,
    fate: BTreeMap<String, (Fate, Option<String>)>,
    /// Keys a trainer has moved between releases: the name readers ask for → the one this
    /// document spells it with (reads, fates and errors then name the document's key).
    moved: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq)]
enum Fate {
    Used,
    NotModelled(String),
    NoMemory,
}

/// What a table says of a key no reader took.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Class {
    /// Does not bear on memory.
    No,
    /// Bears on memory, not modelled: why.
    Not(&'static str),
}

/// Keys every kind shares the fate of: where a key of a kind's table ends in `.*`, the whole
/// subtree is one entry.
pub(crate) type Table = &'static [(&'static str, Class)];

/// Reasons shared across kinds.
pub(crate) const EVAL: &str = "this evaluation setting is not modelled: the whole run's evaluation is Hugging Face Trainer's loop (docs/run.md)";
pub(crate) const SAVE: &str =
    "a config's checkpoint saving is not read yet: give --save to size it (docs/run.md)";
/// The Hugging Face Trainer's saving keys beyond those read (`hf::saving`).
pub(crate) const TRAINER_SAVE: &str = "checkpoints are sized from save_strategy/save_steps and FSDP's state_dict_type alone: saving the model without the optimizer, or reading the best one back, is not modelled (docs/run.md)";
/// FSDP's load from rank 0 (where on; accelerate's and Hugging Face's configs): each rank's GPU
/// holds one whole parameter beside its shards while it loads — sized in a whole run with
/// --broadcast-load; a config does not turn the whole run on for it (the step's peak is above
/// it but for the smallest batches).
pub(crate) const BROADCAST_LOAD: &str = "the load's broadcast of each whole parameter from rank 0 is sized only with --broadcast-load (a whole run)";
pub(crate) const COMPILE: &str = "torch.compile fuses kernels and changes what activations are kept; gpumem traces the eager step";
/// A trainer's torch.compile of the model and its loss: the loss is modelled (`compile`), the
/// model's compiled blocks are not.
pub(crate) const COMPILED_BLOCKS: &str = "torch.compile of the loss is modelled (--compile); its fusion inside the model's compiled blocks is not (they are traced eagerly)";
pub(crate) const PACKED: &str = "packed rows are sized full (the maximum length, no padding) with no mask; under SDPA or eager attention transformers builds a block-causal mask from the packed position ids ([batch, 1, seq, seq] booleans), which is not sized";
/// Hugging Face's checkpointing (HF Trainer, TRL, axolotl): `gradient_checkpointing` `on`, with
/// `gradient_checkpointing_kwargs.use_reentrant` choosing torch's reentrant checkpoint or the
/// non-reentrant one (transformers 5's default where unset); the kwargs' other keys are not
/// modelled.
pub(crate) fn hf_checkpointing(doc: &mut Doc, on: bool) -> Result<Checkpointing, TrainConfigError> {
    if doc.get("gradient_checkpointing_kwargs").is_some() {
        doc.not_modelled(
            "gradient_checkpointing_kwargs",
            "checkpoint arguments other than use_reentrant are not modelled",
        );
    }
    let reentrant = doc
        .flag("gradient_checkpointing_kwargs.use_reentrant")?
        .unwrap_or(false);
    Ok(match (on, reentrant) {
        (false, _) => Checkpointing::Off,
        (true, false) => Checkpointing::Full,
        (true, true) => Checkpointing::FullReentrant,
    })
}
pub(crate) const OFFLOAD_ACT: &str = "activation offloading is not in the job vocabulary yet; sized with activations on the GPU (an upper bound)";
pub(crate) const CHUNKED_CE: &str = "chunked / fused linear cross-entropy is not in the job vocabulary yet; sized with the whole logits (an upper bound)";
pub(crate) const ATTN: &str =
    "gpumem models the eager, SDPA and FlashAttention-2 implementations, not this one";

/// Hugging Face's `attn_implementation` at `key`: the attention gpumem models, or reported as
/// not modelled (flex, paged, a Hub kernel).
pub(crate) fn hf_attention(
    doc: &mut Doc,
    key: &str,
    out: &mut TrainConfig,
) -> Result<(), TrainConfigError> {
    if let Some(name) = doc.text(key)? {
        match Attention::from_hf(&name) {
            Some(a) => out.attention = Some(a),
            None => doc.not_modelled(key, ATTN),
        }
    }
    Ok(())
}
pub(crate) const UNKNOWN: &str = "a key gpumem does not know: it may bear on memory";
pub(crate) const CLIP: &str =
    "gradient clipping's norm temporaries are not modelled (small: one scalar per tensor)";
pub(crate) const FP8: &str = "float8/MX training is not modelled";

/// A trainer's `torch.compile` of the whole model at `key` (Hugging Face's and axolotl's
/// `torch_compile`, torchtune's `compile`): its loss compiled as gpumem models it, its blocks
/// traced eagerly (stated as not modelled).
pub(crate) fn compiled_model(
    doc: &mut Doc,
    out: &mut TrainConfig,
    key: &str,
) -> Result<(), TrainConfigError> {
    if doc.flag(key)? == Some(true) {
        out.compile = Some(true);
        doc.not_modelled(key, COMPILED_BLOCKS);
    }
    Ok(())
}

/// `trust_remote_code` at `key` (Hugging Face's, TRL's, axolotl's): the model is loaded with
/// its checkpoint's own code where its config names some, as transformers then loads it
/// (`hf-code:`).
pub(crate) fn remote_code(
    doc: &mut Doc,
    out: &mut TrainConfig,
    key: &str,
) -> Result<(), TrainConfigError> {
    if doc.flag(key)? == Some(true)
        && let Some((model, _)) = out.model.as_mut()
        && !model.starts_with(gpumem_core::job::HF_CODE_PREFIX)
    {
        *model = format!("{}{model}", gpumem_core::job::HF_CODE_PREFIX);
    }
    Ok(())
}

fn flatten(prefix: &str, v: &Value, out: &mut BTreeMap<String, Value>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, v) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        _ if !prefix.is_empty() => {
            out.insert(prefix.to_string(), v.clone());
        }
        _ => {}
    }
}

/// `path` is `key` or under it.
fn under(path: &str, key: &str) -> bool {
    path == key
        || (path.len() > key.len() && path.starts_with(key) && path.as_bytes()[key.len()] == b'.')
}

impl Doc {
    pub fn new(file: &str, dir: &Path, root: Value) -> Doc {
        let mut leaves = BTreeMap::new();
        flatten("", &root, &mut leaves);
        Doc {
            file: file.into(),
            dir: dir.to_path_buf(),
            root,
            leaves,
            fate: BTreeMap::new(),
            moved: BTreeMap::new(),
        }
    }

    /// Readers' `path` is `older` in this document, where it has `older` and not `path` (a
    /// config written for an earlier release of its trainer).
    pub fn moved(&mut self, path: &str, older: &str) {
        if self.get(path).is_none() && self.get(older).is_some() {
            self.moved.insert(path.into(), older.into());
        }
    }

    /// `path` as this document spells it.
    fn spelled<'a>(&'a self, path: &'a str) -> &'a str {
        self.moved.get(path).map_or(path, String::as_str)
    }

    pub fn err(&self, field: &str, why: impl Into<String>) -> TrainConfigError {
        TrainConfigError::Field {
            file: self.file.clone(),
            field: self.spelled(field).into(),
            why: why.into(),
        }
    }

    /// The value at a dotted path (a leaf or a subtree).
    pub fn get(&self, path: &str) -> Option<&Value> {
        let mut v = &self.root;
        for part in self.spelled(path).split('.') {
            v = v.get(part)?;
        }
        Some(v)
    }

    fn mark(&mut self, path: &str, fate: Fate) {
        let path = self.spelled(path).to_string();
        let path = path.as_str();
        let keys: Vec<String> = self
            .leaves
            .keys()
            .filter(|k| under(k, path))
            .cloned()
            .collect();
        // A subtree marked whole is reported by its path, unless a key under it is marked
        // otherwise later.
        let group = (keys.len() != 1 || keys[0] != path).then(|| path.to_string());
        for k in keys {
            self.fate.insert(k, (fate.clone(), group.clone()));
        }
    }

    /// The keys under `path` no reader has marked yet, read into the job.
    pub fn used_rest(&mut self, path: &str) {
        let path = self.spelled(path).to_string();
        let path = path.as_str();
        let keys: Vec<String> = self
            .leaves
            .keys()
            .filter(|k| under(k, path) && !self.fate.contains_key(*k))
            .cloned()
            .collect();
        for k in keys {
            self.fate.insert(k, (Fate::Used, None));
        }
    }

    /// `path` (and all under it) read into the job.
    pub fn used(&mut self, path: &str) {
        self.mark(path, Fate::Used);
    }

    /// `path` (and all under it) stated but not modelled.
    pub fn not_modelled(&mut self, path: &str, reason: impl Into<String>) {
        self.mark(path, Fate::NotModelled(reason.into()));
    }

    /// Every key named `name` (at any depth) no reader has marked does not bear on memory.
    pub fn no_memory_named(&mut self, name: &str) {
        let keys: Vec<String> = self
            .leaves
            .keys()
            .filter(|k| k.rsplit('.').next() == Some(name) && !self.fate.contains_key(*k))
            .cloned()
            .collect();
        for k in keys {
            self.fate.insert(k, (Fate::NoMemory, None));
        }
    }

    /// `path` (and all under it) does not bear on memory.
    pub fn no_memory(&mut self, path: &str) {
        self.mark(path, Fate::NoMemory);
    }

    /// The value at `path`, marked used; `None` where absent or null.
    pub fn take(&mut self, path: &str) -> Option<Value> {
        let v = self.get(path).cloned();
        if v.is_some() {
            self.used(path);
        }
        v.filter(|v| !v.is_null())
    }

    pub fn text(&mut self, path: &str) -> Result<Option<String>, TrainConfigError> {
        match self.take(path) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.err(path, format!("{other} is not a name"))),
        }
    }

    pub fn flag(&mut self, path: &str) -> Result<Option<bool>, TrainConfigError> {
        match self.take(path) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            // YAML 1.1 spellings and Python's, as trainers' configs write them.
            Some(Value::String(s)) => match s.to_ascii_lowercase().as_str() {
                "true" | "yes" => Ok(Some(true)),
                "false" | "no" => Ok(Some(false)),
                _ => Err(self.err(path, format!("`{s}` is not true or false"))),
            },
            Some(other) => Err(self.err(path, format!("{other} is not true or false"))),
        }
    }

    /// Whether the run resumes from a checkpoint: a checkpoint's path (any non-empty text, the
    /// trainers' `resume_from_checkpoint`) or a flag.
    pub fn resumes(&mut self, path: &str) -> Result<bool, TrainConfigError> {
        match self.take(path) {
            None | Some(Value::Bool(false)) => Ok(false),
            Some(Value::String(s))
                if matches!(s.to_ascii_lowercase().as_str(), "false" | "no" | "") =>
            {
                Ok(false)
            }
            Some(Value::Bool(true) | Value::String(_)) => Ok(true),
            Some(other) => Err(self.err(
                path,
                format!("{other} is not a checkpoint's path or a flag"),
            )),
        }
    }

    /// A whole number (an integer-valued float too); `"auto"` is `None`.
    pub fn whole(&mut self, path: &str) -> Result<Option<i64>, TrainConfigError> {
        match self.take(path) {
            None => Ok(None),
            Some(Value::Number(n)) => match (n.as_i64(), n.as_f64()) {
                (Some(i), _) => Ok(Some(i)),
                (None, Some(f)) if f.fract() == 0.0 && f.abs() < 9e18 => Ok(Some(f as i64)),
                _ => Err(self.err(path, format!("{n} is not a whole number"))),
            },
            Some(Value::String(s)) if s == "auto" => Ok(None),
            Some(Value::String(s)) => s
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| self.err(path, format!("`{s}` is not a whole number"))),
            Some(other) => Err(self.err(path, format!("{other} is not a whole number"))),
        }
    }

    /// A whole number ≥ 1.
    pub fn positive(&mut self, path: &str) -> Result<Option<u64>, TrainConfigError> {
        match self.whole(path)? {
            None => Ok(None),
            Some(n) if n >= 1 => Ok(Some(n as u64)),
            Some(n) => Err(self.err(path, format!("{n} must be at least 1"))),
        }
    }

    pub fn count32(&mut self, path: &str) -> Result<Option<u32>, TrainConfigError> {
        match self.positive(path)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| self.err(path, format!("{n} is out of range"))),
        }
    }

    pub fn number(&mut self, path: &str) -> Result<Option<f64>, TrainConfigError> {
        match self.take(path) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64()),
            Some(Value::String(s)) => s
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| self.err(path, format!("`{s}` is not a number"))),
            Some(other) => Err(self.err(path, format!("{other} is not a number"))),
        }
    }

    /// A list of names (or one name), marked used.
    pub fn names(&mut self, path: &str) -> Result<Option<Vec<String>>, TrainConfigError> {
        match self.take(path) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(
                s.split([',', ' '])
                    .filter(|t| !t.is_empty())
                    .map(str::to_string)
                    .collect(),
            )),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    other => Err(self.err(path, format!("{other} is not a name"))),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(other) => Err(self.err(path, format!("{other} is not a list of names"))),
        }
    }

    /// A key stated with a value other than its "off" value is not modelled; else used.
    pub fn off_or_not_modelled(&mut self, path: &str, reason: &str) {
        let on = match self.get(path) {
            None | Some(Value::Null) => return,
            Some(Value::Bool(b)) => *b,
            Some(Value::String(s)) => !matches!(
                s.to_ascii_lowercase().as_str(),
                "" | "false" | "no" | "none" | "disabled" | "off"
            ),
            Some(Value::Number(n)) => n.as_f64() != Some(0.0),
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::Object(o)) => !o.is_empty(),
        };
        if on {
            self.not_modelled(path, reason);
        } else {
            self.used(path);
        }
    }

    /// Every key's fate: what the reader took, then `table`, else not modelled (unknown). A
    /// subtree marked whole (by a reader, or a table's `.*` entry) is one entry, unless keys
    /// under it have other fates: then each key is its own.
    pub fn finish(self, table: Table) -> Fields {
        let mut fates: BTreeMap<&str, (Fate, Option<String>)> = BTreeMap::new();
        for key in self.leaves.keys() {
            let fate = self.fate.get(key).cloned().unwrap_or_else(|| {
                table
                    .iter()
                    .find_map(|(pat, class)| {
                        let (hit, group) = match pat.strip_suffix(".*") {
                            Some(prefix) => (under(key, prefix), Some(prefix.to_string())),
                            None => (key == pat, None),
                        };
                        hit.then(|| {
                            let fate = match class {
                                Class::No => Fate::NoMemory,
                                Class::Not(r) => Fate::NotModelled((*r).into()),
                            };
                            (fate, group)
                        })
                    })
                    .unwrap_or((Fate::NotModelled(UNKNOWN.into()), None))
            });
            fates.insert(key, fate);
        }
        let mut fields = Fields::default();
        let mut done: Vec<String> = Vec::new();
        for (key, (fate, group)) in &fates {
            // A group is whole when every key under it has its fate and group.
            let whole = group.as_ref().filter(|g| {
                fates
                    .iter()
                    .filter(|(k, _)| under(k, g))
                    .all(|(_, (f, gg))| f == fate && gg.as_ref() == Some(*g))
            });
            let (name, value) = match whole {
                Some(g) => {
                    if done.contains(g) {
                        continue;
                    }
                    done.push(g.clone());
                    (g.clone(), self.get(g).cloned().unwrap_or(Value::Null))
                }
                None => ((*key).to_string(), self.leaves[*key].clone()),
            };
            match fate.clone() {
                Fate::Used => fields.used.push(name),
                Fate::NoMemory => fields.no_memory.push(name),
                Fate::NotModelled(reason) => fields.not_modelled.push(NotModelled {
                    field: name,
                    value,
                    reason,
                }),
            }
        }
        fields
    }
}

/// The optimizer a trainer names (gpumem's names, Hugging Face's `optim` values, axolotl's and
/// class paths all parse), run by the implementation a config's flag states (`fused: true`,
/// torchtitan's `implementation`) where it states one.
pub(crate) fn optimizer(
    doc: &mut Doc,
    field: &str,
    name: &str,
    implementation: Option<Implementation>,
) -> Result<Optimizer, TrainConfigError> {
    let o = Optimizer::parse(name).map_err(|e| doc.err(field, e.to_string()))?;
    match implementation {
        None => Ok(o),
        Some(i) => o
            .with_implementation(i)
            .map_err(|e| doc.err(field, e.to_string())),
    }
}

/// LoRA targets as a trainer names them, checked into a [`Lora`].
pub(crate) fn lora(
    doc: &Doc,
    field: &str,
    rank: u32,
    alpha: f64,
    targets: Vec<String>,
    dropout: f64,
    quant: Option<Quant4>,
) -> Result<Lora, TrainConfigError> {
    Lora::new(rank, alpha, targets, dropout, quant).map_err(|e| doc.err(field, e.to_string()))
}

/// The document of a file: JSON, YAML or TOML, as a JSON value.
pub(crate) fn parse_document(
    file: &str,
    text: &str,
    toml_file: bool,
) -> Result<Value, TrainConfigError> {
    if toml_file {
        return toml::from_str::<Value>(text).map_err(|e| TrainConfigError::Parse {
            file: file.into(),
            what: "TOML",
            why: e.to_string().lines().next().unwrap_or_default().to_string(),
        });
    }
    if let Ok(v) = serde_json::from_str::<Value>(text) {
        return Ok(v);
    }
    serde_norway::from_str::<Value>(text).map_err(|e| TrainConfigError::Parse {
        file: file.into(),
        what: "JSON or YAML",
        why: e.to_string(),
    })
}

/// Which trainer wrote a document, from its keys.
pub fn detect(file: &str, root: &Value, toml_file: bool) -> Result<TrainerKind, TrainConfigError> {
    let Some(m) = root.as_object() else {
        return Err(TrainConfigError::Kind {
            file: file.into(),
            why: "not a mapping".into(),
        });
    };
    let has = |k: &str| m.contains_key(k);
    if toml_file || has("_class") && root.get("training").is_some() {
        return Ok(if toml_file {
            TrainerKind::TorchtitanToml
        } else {
            TrainerKind::TorchtitanPython
        });
    }
    if has("zero_optimization") {
        return Ok(TrainerKind::Deepspeed);
    }
    if has("distributed_type") || has("compute_environment") {
        return Ok(TrainerKind::Accelerate);
    }
    if has("base_model") {
        return Ok(TrainerKind::Axolotl);
    }
    if root
        .get("model")
        .and_then(|m| m.get("_component_"))
        .is_some()
    {
        return Ok(TrainerKind::Torchtune);
    }
    if root.get("trainer").is_some_and(Value::is_object) {
        return Ok(TrainerKind::Lightning);
    }
    if root
        .get("train")
        .and_then(|t| t.get("micro_batch_size"))
        .is_some()
        && (has("checkpoint_dir") || has("model_name"))
    {
        return Ok(TrainerKind::Litgpt);
    }
    if has("parallelism") && has("training") {
        return Ok(TrainerKind::TorchtitanPython);
    }
    const TRL: [&str; 8] = [
        "max_seq_length",
        "max_length",
        "packing",
        "dataset_text_field",
        "completion_only_loss",
        "assistant_only_loss",
        "padding_free",
        "use_peft",
    ];
    const HF: [&str; 5] = [
        "per_device_train_batch_size",
        "output_dir",
        "gradient_accumulation_steps",
        "learning_rate",
        "model_name_or_path",
    ];
    if TRL.iter().any(|k| has(k)) {
        return Ok(TrainerKind::TrlSft);
    }
    if HF.iter().any(|k| has(k)) {
        return Ok(TrainerKind::HfTrainer);
    }
    Err(TrainConfigError::Kind {
        file: file.into(),
        why: "none of the keys it is known by".into(),
    })
}

/// Reads a trainer config file of `kind` (detected where `None`). A torchtitan Python config is
/// `FILE.py:FUNCTION` (or `MODULE:FUNCTION`), called by `tracer`'s interpreter.
pub fn read_file(
    spec: &str,
    kind: Option<TrainerKind>,
    tracer: &gpumem_torch::TorchTracer,
) -> Result<TrainConfig, TrainConfigError> {
    let python =
        kind == Some(TrainerKind::TorchtitanPython) || (kind.is_none() && is_python_spec(spec));
    if python {
        let (target, function) = spec
            .rsplit_once(':')
            .ok_or_else(|| TrainConfigError::Python {
                file: spec.into(),
                why: "a Python config is FILE.py:FUNCTION or MODULE:FUNCTION".into(),
            })?;
        let json = tracer
            .config_json(target, function)
            .map_err(|e| TrainConfigError::Python {
                file: spec.into(),
                why: e.to_string(),
            })?;
        let dir = Path::new(target).parent().unwrap_or(Path::new("."));
        return read_text(spec, &json, dir, Some(TrainerKind::TorchtitanPython));
    }
    let path = Path::new(spec);
    let text = std::fs::read_to_string(path).map_err(|source| TrainConfigError::Io {
        file: spec.into(),
        source,
    })?;
    read_text(spec, &text, path.parent().unwrap_or(Path::new(".")), kind)
}

/// `FILE.py:FUNCTION` or `MODULE:FUNCTION` (not a file that exists).
pub fn is_python_spec(spec: &str) -> bool {
    match spec.rsplit_once(':') {
        Some((target, f)) => {
            !Path::new(spec).exists()
                && !f.is_empty()
                && f.chars().all(|c| c.is_alphanumeric() || c == '_')
                && (target.ends_with(".py")
                    || target.split('.').all(|p| {
                        !p.is_empty() && p.chars().all(|c| c.is_alphanumeric() || c == '_')
                    }))
        }
        None => false,
    }
}

/// Reads a config's text (`file` names it in errors; `dir` is where relative paths it names
/// are read). A torchtitan Python config's text is the JSON its function's result was dumped to.
pub fn read_text(
    file: &str,
    text: &str,
    dir: &Path,
    kind: Option<TrainerKind>,
) -> Result<TrainConfig, TrainConfigError> {
    let toml_file = kind == Some(TrainerKind::TorchtitanToml)
        || (kind.is_none() && file.to_ascii_lowercase().ends_with(".toml"));
    let root = parse_document(file, text, toml_file)?;
    let kind = match kind {
        Some(k) => k,
        None => detect(file, &root, toml_file)?,
    };
    if !root.is_object() {
        return Err(TrainConfigError::Parse {
            file: file.into(),
            what: "a mapping",
            why: "the document is not a mapping of keys".into(),
        });
    }
    let mut doc = Doc::new(file, dir, root);
    let mut out = TrainConfig {
        kind,
        file: file.into(),
        model: None,
        micro_batch: None,
        precision: None,
        optimizer: None,
        grad_accum: None,
        seq_len: None,
        checkpointing: None,
        lora: None,
        attention_mask: None,
        attention: None,
        optimizer_in_backward: None,
        chunked_ce: None,
        compile: None,
        activation_offloading: None,
        reference_model: None,
        liger: None,
        float8: None,
        whole_run: None,
        layout: Layout::Launcher {
            bucket_cap_mb: gpumem_core::job::DDP_BUCKET_CAP_MB,
        },
        fields: Fields::default(),
    };
    let table = match kind {
        TrainerKind::HfTrainer | TrainerKind::TrlSft => hf::read(&mut doc, &mut out)?,
        TrainerKind::Axolotl => axolotl::read(&mut doc, &mut out)?,
        TrainerKind::Torchtune => torchtune::read(&mut doc, &mut out)?,
        TrainerKind::TorchtitanToml | TrainerKind::TorchtitanPython => {
            torchtitan::read(&mut doc, &mut out)?
        }
        TrainerKind::Lightning => lightning::read(&mut doc, &mut out)?,
        TrainerKind::Litgpt => litgpt::read(&mut doc, &mut out)?,
        TrainerKind::Deepspeed => launchers::deepspeed(&mut doc, &mut out, text)?,
        TrainerKind::Accelerate => launchers::accelerate(&mut doc, &mut out, text)?,
    };
    out.fields = doc.finish(table);
    Ok(out)
}
