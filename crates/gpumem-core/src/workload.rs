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
            Some((family, _)) if ModelSpec::FAMILIES.contains(&family) => ModelSpec::parse(model).map(|m| Some(ModelRef::Native(m))),
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
        let v: Vec<u64> = s.split('x').map(|p| p.parse::<u64>().ok().filter(|&n| n > 0)).collect::<Option<_>>()?;
        let [channels, height, width] = v[..] else { return None };
        Some(InputShape { channels, height, width })
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
    /// Activation checkpointing.
    pub checkpointing: bool,
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
}

impl Default for Options {
    fn default() -> Self {
        Options {
            optimizer: Optimizer::Adam,
            precision: Precision::Fp32,
            input: None,
            seq_len: None,
            checkpointing: false,
            channels_last: false,
            grad_accum: 1,
            data_parallel: 1,
            validate: Validate::None,
            outputs: None,
            attention_mask: AttentionMask::None,
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
        Ok(())
    }

    /// What a native family model can be given of these options: the optimizer and the
    /// precision, in an otherwise plain loop (the families refuse pure precision themselves).
    pub fn native_part(&self) -> Options {
        Options { optimizer: self.optimizer, precision: self.precision, ..Options::default() }
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
    pub fn serialize<S: serde::Serializer>(i: &Option<InputShape>, s: S) -> Result<S::Ok, S::Error> {
        match i {
            Some(i) => s.serialize_str(&i.to_string()),
            None => s.serialize_none(),
        }
    }
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<InputShape>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(t) => InputShape::parse(&t).map(Some).ok_or_else(|| serde::de::Error::custom(format!("input `{t}` is not CxHxW"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_prefix_table() {
        assert_eq!(ModelRef::parse("hf:gpt2").unwrap(), ModelRef::Torch("hf:gpt2".into()));
        assert!(ModelRef::parse("mlp:input=8,output=2,depth=1").unwrap().is_native());
        let e = ModelRef::parse("resnet50").unwrap_err().to_string();
        assert!(e.contains("no `family:` prefix"), "{e}");
        assert_eq!(ModelRef::recognise("resnet50").unwrap(), None);
        assert!(ModelRef::recognise("mlp:depth=x").is_err());
    }

    #[test]
    fn options_in_json_are_spelled_as_on_the_command_line() {
        let o: Options = serde_json::from_str(r#"{"optimizer":"adamw","precision":"amp-bf16","input":"3x224x224","validate":"no-grad","outputs":"dropped"}"#).unwrap();
        assert_eq!((o.optimizer, o.precision, o.validate, o.outputs), (Optimizer::AdamW, Precision::AmpBf16, Validate::NoGrad, Some(Outputs::Dropped)));
        assert_eq!(o.input.unwrap().to_string(), "3x224x224");
        assert_eq!(serde_json::from_str::<Options>(&serde_json::to_string(&o).unwrap()).unwrap(), o);
        let e = serde_json::from_str::<Options>(r#"{"validate":"maybe"}"#).unwrap_err().to_string();
        assert!(e.contains("unknown validation `maybe` (expected none, no-grad, grad)"), "{e}");
        assert!(serde_json::from_str::<Options>(r#"{"optimiser":"sgd"}"#).is_err());
        assert!(InputShape::parse("3x0x4").is_none() && InputShape::parse("3x4").is_none());
    }

    #[test]
    fn checks_and_native_options() {
        assert!(Options::default().check().is_ok() && Options::default().native_compatible());
        let o = Options { grad_accum: 0, ..Options::default() };
        assert_eq!(o.check().unwrap_err().to_string(), "--grad-accum must be at least 1");
        assert!(!Options { checkpointing: true, ..Options::default() }.native_compatible());
        let over = OptionOverrides { seq_len: Some(512), ..Default::default() }.over(&Options { grad_accum: 2, ..Options::default() });
        assert_eq!((over.seq_len, over.grad_accum), (Some(512), 2));
    }
}
