//! The whole run around the training steps (docs/run.md): the model's load, the steps, the
//! trainer's evaluation loop after them, generation, the checkpoint's save — and, resumed, the
//! checkpoint's optimizer state read in at the load. A job states it with [`WholeRun`]; absent,
//! gpumem sizes the training steps alone, as it always has.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::Save;

/// Most evaluation batches a job may state (an evaluation set of a million samples at 10 a
/// batch, and still a trace of a few minutes' tracing).
pub const MAX_EVAL_BATCHES: u32 = 100_000;

/// A whole run: the model loaded onto the GPU as its trainer loads it (a 4-bit QLoRA model one
/// weight at a time, each first in 16 bits), the training steps, then what is stated here.
/// The load and the steps are always part of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, JsonSchema)]
#[serde(default, deny_unknown_fields)]
pub struct WholeRun {
    /// The trainer's evaluation loop after the training steps (Hugging Face Trainer's); absent,
    /// none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<Evaluation>,
    /// Generation after the evaluation (`model.generate()`: TRL's rollouts); absent, none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub generation: Option<Generation>,
    /// The checkpoint saved at the end (`sharded`, `full`, `full-offload`); absent, none.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub save: Option<Save>,
    /// The run resumes from a checkpoint: the optimizer state is read in during the load,
    /// beside the live model, before the first step (the weights are read into the parameters
    /// in place).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub resume: bool,
    /// FSDP: the model loads on rank 0 and is broadcast parameter by parameter
    /// (accelerate's `cpu_ram_efficient_loading`, FSDP's `sync_module_states`): each rank's GPU
    /// holds one whole parameter beside its shards while it loads.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub broadcast_load: bool,
}

/// Hugging Face Trainer's evaluation loop (`Trainer.evaluate`): the model in eval mode under
/// `torch.no_grad()`, batch after batch; each batch's loss is kept on the GPU, and with metrics
/// its logits and labels too, concatenated batch by batch (`EvalLoopContainer`) until
/// `eval_accumulation_steps` moves them to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Evaluation {
    /// Batches one evaluation runs (the evaluation set's size over its batch size).
    pub batches: u32,
    /// Samples per evaluation batch (`per_device_eval_batch_size`); absent, the training batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u64>,
    /// Every this many batches the accumulated predictions move to the host
    /// (`eval_accumulation_steps`); absent, they stay on the GPU until the loop ends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accumulation_steps: Option<u32>,
    /// Each batch's logits and labels are kept for metrics (the Trainer has a
    /// `compute_metrics`); false, only the losses (`prediction_loss_only`, the Trainer's way
    /// without metrics).
    #[serde(default)]
    pub logits: bool,
    /// With `logits`, each batch's inputs are kept too (`include_for_metrics: ["inputs"]`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inputs: bool,
    /// What is kept stays a list of batches, never concatenated
    /// (`eval_do_concat_batches: false`): no old-and-new copy at each batch.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub as_list: bool,
}

/// Why an evaluation is refused; each message names the field and its flag.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EvaluationError {
    #[error("evaluation batches (--eval-batches) {0} is out of range (1..={MAX_EVAL_BATCHES})")]
    Batches(u32),
    #[error("evaluation batch_size (--eval-batch-size) must be at least 1")]
    BatchSize,
    #[error("evaluation accumulation_steps (--eval-accumulation-steps) must be at least 1")]
    AccumulationSteps,
}

impl Evaluation {
    /// `batches` of the training batch's size, losses only.
    pub fn of(batches: u32) -> Evaluation {
        Evaluation {
            batches,
            batch_size: None,
            accumulation_steps: None,
            logits: false,
            inputs: false,
            as_list: false,
        }
    }

    pub fn check(&self) -> Result<(), EvaluationError> {
        if self.batches == 0 || self.batches > MAX_EVAL_BATCHES {
            return Err(EvaluationError::Batches(self.batches));
        }
        if self.batch_size == Some(0) {
            return Err(EvaluationError::BatchSize);
        }
        if self.accumulation_steps == Some(0) {
            return Err(EvaluationError::AccumulationSteps);
        }
        Ok(())
    }
}

/// Most tokens one generation may add to a prompt.
pub const MAX_NEW_TOKENS: u32 = 1 << 20;

/// Generation as `model.generate()` runs it — TRL's rollouts, a decoder-only model's generating
/// evaluation — after the training steps and any evaluation: a batch of prompts run through the
/// model once (its key/value cache filled, the last position's logits kept), then `new_tokens`
/// tokens added one at a time through that cache, each chosen from the last position's logits
/// in fp32 (sampling: their softmax), in eval mode under `torch.no_grad()`. Every prompt runs
/// to `new_tokens` (the longest generation: the bound).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Generation {
    /// Tokens generated after each prompt (`max_new_tokens`, TRL's `max_completion_length`).
    pub new_tokens: u32,
    /// Prompts per batch; absent, the training batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u64>,
    /// Tokens per prompt (TRL's `max_prompt_length`); absent, the job's sequence length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_len: Option<u64>,
    /// The sampling filters on each token's scores, as `generate()` applies them; absent, none.
    #[serde(default, skip_serializing_if = "Filters::is_none")]
    pub filters: Filters,
}

/// transformers' sampling warpers, in the order `generate()` applies them: top-k (`top_k`: the
/// scores below the k-th largest masked), top-p (`top_p` below 1: the scores sorted, softmaxed
/// and summed to find the nucleus) and min-p (`min_p`: those under a fraction of the most
/// likely token's probability masked). Their values do not change what they allocate, so top-p
/// and min-p are stated as on or off.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Filters {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<u32>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub top_p: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub min_p: bool,
}

impl Filters {
    pub fn is_none(&self) -> bool {
        *self == Filters::default()
    }
}

/// Why a generation is refused; each message names the field and its flag.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GenerationError {
    #[error("generation new_tokens (--generate-tokens) {0} is out of range (1..={MAX_NEW_TOKENS})")]
    NewTokens(u32),
    #[error("generation batch_size (--generate-batch-size) must be at least 1")]
    BatchSize,
    #[error("generation prompt_len (--generate-prompt-len) must be at least 1")]
    PromptLen,
    #[error(
        "generation top_k (--generate-top-k) must be at least 1 (0 is no filter: leave it out)"
    )]
    TopK,
}

impl Generation {
    pub fn check(&self) -> Result<(), GenerationError> {
        if self.new_tokens == 0 || self.new_tokens > MAX_NEW_TOKENS {
            return Err(GenerationError::NewTokens(self.new_tokens));
        }
        if self.batch_size == Some(0) {
            return Err(GenerationError::BatchSize);
        }
        if self.prompt_len == Some(0) {
            return Err(GenerationError::PromptLen);
        }
        if self.filters.top_k == Some(0) {
            return Err(GenerationError::TopK);
        }
        Ok(())
    }
}
