//! Liger's Triton kernels as a trainer switches them on: Hugging Face's Trainer and TRL
//! (`use_liger_kernel`, `liger_kernel_config`), axolotl's Liger plugin (`liger_*` keys).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// One of Liger's kernels, by the keyword Liger's `apply_liger_kernel_to_*` functions take.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum LigerKernel {
    Rope,
    RmsNorm,
    LayerNorm,
    Swiglu,
    Geglu,
    CrossEntropy,
    FusedLinearCrossEntropy,
}

impl LigerKernel {
    const ALL: [LigerKernel; 7] = [
        LigerKernel::Rope,
        LigerKernel::RmsNorm,
        LigerKernel::LayerNorm,
        LigerKernel::Swiglu,
        LigerKernel::Geglu,
        LigerKernel::CrossEntropy,
        LigerKernel::FusedLinearCrossEntropy,
    ];

    pub fn name(self) -> &'static str {
        match self {
            LigerKernel::Rope => "rope",
            LigerKernel::RmsNorm => "rms_norm",
            LigerKernel::LayerNorm => "layer_norm",
            LigerKernel::Swiglu => "swiglu",
            LigerKernel::Geglu => "geglu",
            LigerKernel::CrossEntropy => "cross_entropy",
            LigerKernel::FusedLinearCrossEntropy => "fused_linear_cross_entropy",
        }
    }

    pub fn parse(s: &str) -> Result<LigerKernel, LigerError> {
        Self::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| LigerError::Kernel(s.to_string()))
    }
}

/// Liger applied to a Hugging Face model: the kernels the job sets on or off; the others as
/// Liger's function for the model's type defaults them (rope, the norm, the MLP's gate and the
/// fused linear cross-entropy on; the plain cross-entropy off). Invariant (every constructor
/// and deserializer checks it): the plain and the fused cross-entropy are not both on, which
/// Liger asserts (the fused one is on unless set off).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(
    try_from = "BTreeMap<LigerKernel, bool>",
    into = "BTreeMap<LigerKernel, bool>"
)]
pub struct Liger(BTreeMap<LigerKernel, bool>);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LigerError {
    #[error(
        "liger: unknown kernel `{0}` (expected rope, rms_norm, layer_norm, swiglu, geglu, cross_entropy or fused_linear_cross_entropy)"
    )]
    Kernel(String),
    #[error("liger: `{0}` is not KERNEL=true or KERNEL=false")]
    Setting(String),
    #[error(
        "liger: cross_entropy and fused_linear_cross_entropy cannot both be on (the fused one is on unless set false), as Liger asserts"
    )]
    TwoLosses,
}

impl Liger {
    pub fn new(kernels: BTreeMap<LigerKernel, bool>) -> Result<Liger, LigerError> {
        let on = |k| kernels.get(&k).copied();
        if on(LigerKernel::CrossEntropy) == Some(true)
            && on(LigerKernel::FusedLinearCrossEntropy) != Some(false)
        {
            return Err(LigerError::TwoLosses);
        }
        Ok(Liger(kernels))
    }

    /// `KERNEL=BOOL,…` (`--liger`'s value; empty: Liger's defaults).
    pub fn parse(spec: &str) -> Result<Liger, LigerError> {
        let mut kernels = BTreeMap::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| LigerError::Setting(item.to_string()))?;
            let on = match v.trim() {
                "true" => true,
                "false" => false,
                _ => return Err(LigerError::Setting(item.to_string())),
            };
            kernels.insert(LigerKernel::parse(k.trim())?, on);
        }
        Liger::new(kernels)
    }

    /// The kernels the job sets, each on or off.
    pub fn kernels(&self) -> &BTreeMap<LigerKernel, bool> {
        &self.0
    }

    /// Whether the loss is Liger's fused linear cross-entropy, which never makes the logits.
    pub fn fuses_the_loss(&self) -> bool {
        self.0
            .get(&LigerKernel::FusedLinearCrossEntropy)
            .copied()
            .unwrap_or(true)
    }

    /// `KERNEL=BOOL,…`, as `parse` reads it.
    pub fn spec(&self) -> String {
        self.0
            .iter()
            .map(|(k, on)| format!("{}={on}", k.name()))
            .collect::<Vec<_>>()
            .join(",")
    }
}

impl TryFrom<BTreeMap<LigerKernel, bool>> for Liger {
    type Error = LigerError;
    fn try_from(kernels: BTreeMap<LigerKernel, bool>) -> Result<Liger, LigerError> {
        Liger::new(kernels)
    }
}

impl From<Liger> for BTreeMap<LigerKernel, bool> {
    fn from(l: Liger) -> Self {
        l.0
    }
}

impl JsonSchema for Liger {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Liger".into()
    }
    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        <BTreeMap<LigerKernel, bool>>::json_schema(generator)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_reads_as_liger_names_its_kernels() {
        let l = Liger::parse("rope=false, swiglu=true").unwrap();
        assert_eq!(l.spec(), "rope=false,swiglu=true");
        assert_eq!(Liger::parse(&l.spec()).unwrap(), l);
        assert!(l.fuses_the_loss());
        assert_eq!(Liger::parse("").unwrap(), Liger::default());
        let plain = Liger::parse("cross_entropy=true,fused_linear_cross_entropy=false").unwrap();
        assert!(!plain.fuses_the_loss());
        let json = serde_json::to_string(&plain).unwrap();
        assert_eq!(
            json,
            r#"{"cross_entropy":true,"fused_linear_cross_entropy":false}"#
        );
        assert_eq!(serde_json::from_str::<Liger>(&json).unwrap(), plain);
    }

    #[test]
    fn bad_specs_name_what_is_wrong() {
        assert_eq!(
            Liger::parse("cross_entropy=true"),
            Err(LigerError::TwoLosses)
        );
        assert!(serde_json::from_str::<Liger>(r#"{"cross_entropy":true}"#).is_err());
        assert_eq!(
            Liger::parse("rmsnorm=true"),
            Err(LigerError::Kernel("rmsnorm".into()))
        );
        assert_eq!(
            Liger::parse("rope"),
            Err(LigerError::Setting("rope".into()))
        );
        assert_eq!(
            Liger::parse("rope=yes"),
            Err(LigerError::Setting("rope=yes".into()))
        );
    }
}
