//! A multi-GPU launch as the config files users already have state it — a DeepSpeed JSON
//! ([`crate::deepspeed`]) or an accelerate YAML ([`crate::accelerate`]): what both readers give
//! (the strategy and the loop settings a config fixes) and why a config cannot be read.

use std::path::PathBuf;

use gpumem_core::job::{Optimizer, Precision};

use crate::{OptionError, OptionValues, Options, Strategy};

/// What a launch config states: the strategy over its ranks, and what it fixes of the loop.
#[derive(Debug, Clone, PartialEq)]
pub struct LaunchConfig {
    pub strategy: Option<Strategy>,
    pub stated: LoopSettings,
}

/// What a config fixes of the training loop; `None` leaves the command line's value (absent,
/// or `"auto"`, which Hugging Face's Trainer fills in).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LoopSettings {
    pub precision: Option<Precision>,
    pub optimizer: Option<Optimizer>,
    pub micro_batch: Option<u64>,
    pub grad_accum: Option<u32>,
}

impl LoopSettings {
    /// `options` with what is stated here in place of its values (the batch is the caller's),
    /// checked again (a stated precision may not suit the strategy).
    pub fn over(&self, options: OptionValues) -> Result<Options, OptionError> {
        OptionValues {
            precision: self.precision.unwrap_or(options.precision),
            optimizer: self.optimizer.unwrap_or(options.optimizer),
            grad_accum: self.grad_accum.unwrap_or(options.grad_accum),
            ..options
        }
        .check()
    }
}

/// Why a launch config (DeepSpeed JSON, accelerate YAML) cannot be read; the message names the
/// key.
#[derive(Debug, thiserror::Error)]
pub enum LaunchConfigError {
    #[error("not JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("not JSON: the config is not a JSON object")]
    NotJsonObject,
    #[error("not JSON: not YAML: {0}")]
    Yaml(#[from] serde_norway::Error),
    #[error("not JSON: the config is not a YAML mapping")]
    NotYamlMapping,
    #[error("`{key}`: {why}")]
    Key { key: String, why: String },
    /// The config states a strategy gpumem refuses (too few ranks, say).
    #[error(transparent)]
    Options(#[from] OptionError),
    /// A file the config names cannot be read.
    #[error("`{key}`: {}: {source}", path.display())]
    File {
        key: String,
        path: PathBuf,
        source: std::io::Error,
    },
    /// A DeepSpeed config the config names cannot be read.
    #[error("`{key}`: {}: {source}", path.display())]
    Named {
        key: String,
        path: PathBuf,
        source: Box<LaunchConfigError>,
    },
}

/// A key's value is wrong: `why`.
pub(crate) fn bad(key: &str, why: impl Into<String>) -> LaunchConfigError {
    LaunchConfigError::Key {
        key: key.into(),
        why: why.into(),
    }
}
