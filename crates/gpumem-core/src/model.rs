//! Which model a job trains: a native family spec or a PyTorch reference, told apart by the
//! job vocabulary's one prefix table ([`crate::job::TORCH_PREFIXES`]), or a model as people name
//! it — a Hub id, a model directory, a `config.json` — read into its `hf:` reference
//! ([`crate::hub`]). Apart from the job module because it holds a parsed [`ModelSpec`] (the job
//! vocabulary depends on no model).

use std::fmt;

use crate::families::{ModelSpec, SpecError};
use crate::hub::{HubCache, HubError, HubSource};
use crate::job::{HF_CODE_PREFIX, TORCH_PREFIXES, is_native_spec};

/// Why a model argument names no model.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Hub(#[from] HubError),
}

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

    /// A PyTorch reference by its prefix, a native spec by its family, a Hub id, model directory
    /// or `config.json` read from this environment's Hub cache ([`HubCache::from_env`]), else
    /// the native parser's error (which names an unknown family prefix).
    pub fn parse(model: &str) -> Result<ModelRef, ModelError> {
        Self::parse_in(model, &HubCache::from_env())
    }

    /// [`ModelRef::parse`] with Hub ids read from `cache`. `hf-code:` followed by a Hub id,
    /// model directory or `config.json` is that checkpoint's directory, run by its own code.
    pub fn parse_in(model: &str, cache: &HubCache) -> Result<ModelRef, ModelError> {
        if let Some(named) = model.strip_prefix(HF_CODE_PREFIX) {
            let source = HubSource::of(named, cache).ok_or_else(|| HubError::NotModel {
                named: named.to_string(),
            })?;
            return Ok(ModelRef::Torch(source.code_reference(cache)?));
        }
        if let Some(m) = Self::recognise(model)? {
            return Ok(m);
        }
        if let Some(source) = HubSource::of(model, cache) {
            return Ok(ModelRef::Torch(source.read(cache)?.reference()));
        }
        Ok(ModelSpec::parse(model).map(ModelRef::Native)?)
    }

    /// Like [`ModelRef::parse`], but a name with neither kind of prefix (a measured row's
    /// `resnet50`) is `None`, not an error.
    pub fn recognise(model: &str) -> Result<Option<ModelRef>, SpecError> {
        if Self::is_torch(model) {
            return Ok(Some(ModelRef::Torch(model.to_string())));
        }
        if !is_native_spec(model) {
            return Ok(None);
        }
        ModelSpec::parse(model).map(|m| Some(ModelRef::Native(m)))
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
