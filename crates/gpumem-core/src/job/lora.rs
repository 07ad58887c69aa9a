//! LoRA as PEFT's `LoraConfig` states it, checked wherever it is made.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// LoRA fine-tuning: the model frozen, its target layers given trainable low-rank factors.
/// Invariant (every constructor and deserializer checks it): rank ≥ 1, alpha finite and
/// positive, dropout in [0, 1), at least one target, none empty or with whitespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "LoraValues", into = "LoraValues")]
pub struct Lora {
    rank: u32,
    alpha: f64,
    targets: Vec<String>,
    dropout: f64,
    quant: Option<Quant4>,
}

/// LoRA as a job document states it (PEFT's names: `rank` is `r`, and so on).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LoraValues {
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Quant4 {
    pub nf4: bool,
    pub double_quant: bool,
    /// What quantizes the model as it loads.
    #[serde(default, skip_serializing_if = "QuantLoader::is_transformers")]
    pub loader: QuantLoader,
    /// The bitsandbytes release the job runs (its 4-bit matmul's saved tensors changed in
    /// 0.43.2); absent: the release gpumem restates (0.50).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bitsandbytes: Option<Release>,
}

impl Quant4 {
    /// As transformers' `BitsAndBytesConfig` loads it, on the release gpumem restates.
    pub fn new(nf4: bool, double_quant: bool) -> Quant4 {
        Quant4 {
            nf4,
            double_quant,
            loader: QuantLoader::Transformers,
            bitsandbytes: None,
        }
    }
}

/// What turns the model's linear layers into bitsandbytes' 4-bit ones as it loads.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum QuantLoader {
    /// transformers' bitsandbytes quantizer: every linear layer but the output embeddings,
    /// quantized from the dtype the weights load in.
    #[default]
    Transformers,
    /// Lightning Fabric's `BitsandbytesPrecision` (litgpt's `--quantize bnb.*`): every linear
    /// layer, the output head too, quantized from fp16 (so each use dequantizes to fp16 first).
    Fabric,
}

impl QuantLoader {
    fn is_transformers(&self) -> bool {
        *self == QuantLoader::Transformers
    }
}

/// A library release, `MAJOR.MINOR[.PATCH]`, ordered as releases are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Release(pub u32, pub u32, pub u32);

impl std::str::FromStr for Release {
    type Err = LoraError;

    fn from_str(s: &str) -> Result<Release, LoraError> {
        let bad = || LoraError::Release(s.to_string());
        let mut parts = s.split('.').map(|p| p.parse::<u32>().map_err(|_| bad()));
        let (major, minor) = (
            parts.next().ok_or_else(bad)??,
            parts.next().ok_or_else(bad)??,
        );
        let patch = parts.next().transpose()?.unwrap_or(0);
        match parts.next() {
            None => Ok(Release(major, minor, patch)),
            Some(_) => Err(bad()),
        }
    }
}

impl std::fmt::Display for Release {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.0, self.1, self.2)
    }
}

impl Serialize for Release {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Release {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Release, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

impl JsonSchema for Release {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Release".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "type": "string",
            "pattern": "^[0-9]+\\.[0-9]+(\\.[0-9]+)?$"
        })
    }
}

/// Why a LoRA setting is refused; each message names the setting.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    #[error("lora rank (r) must be at least 1")]
    Rank,
    #[error("lora alpha {0} is not a positive finite number")]
    Alpha(f64),
    #[error("lora dropout {0} is not in [0, 1)")]
    Dropout(f64),
    #[error(
        "lora targets: give targets=NAME[,NAME…] (module names such as q_proj,v_proj, or all-linear)"
    )]
    Targets,
    #[error(
        "lora: `{0}` is not key=value (r, alpha, targets, dropout, quant, double_quant, loader, bnb)"
    )]
    NotKeyValue(String),
    #[error(
        "lora: unknown key `{0}` (r, alpha, targets, dropout, quant, double_quant, loader, bnb)"
    )]
    UnknownKey(String),
    #[error("lora {key} `{value}` is not a number")]
    NotNumber { key: String, value: String },
    #[error("lora r `{0}` is not a whole number")]
    NotWhole(String),
    #[error("lora quant `{0}` is not nf4 or fp4")]
    Quant(String),
    #[error("lora double_quant `{0}` is not true or false")]
    NotBool(String),
    #[error("lora {0} needs quant=nf4 or quant=fp4")]
    QuantKeyAlone(&'static str),
    #[error("lora loader `{0}` is not transformers or fabric")]
    Loader(String),
    #[error("release `{0}` is not MAJOR.MINOR[.PATCH]")]
    Release(String),
    #[error("adapter config is not JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("adapter config's peft_type is {0}; gpumem models LORA")]
    PeftType(String),
    #[error("adapter config's `{0}` is missing or of the wrong type")]
    PeftField(&'static str),
}

// Sound: the numbers are finite (the invariant), so bitwise equality is equality.
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
    /// A LoRA setup, checked (see the type's invariant).
    pub fn new(
        rank: u32,
        alpha: f64,
        targets: Vec<String>,
        dropout: f64,
        quant: Option<Quant4>,
    ) -> Result<Lora, LoraError> {
        if rank == 0 {
            return Err(LoraError::Rank);
        }
        if !(alpha.is_finite() && alpha > 0.0) {
            return Err(LoraError::Alpha(alpha));
        }
        if !(0.0..1.0).contains(&dropout) {
            return Err(LoraError::Dropout(dropout));
        }
        if targets.is_empty()
            || targets
                .iter()
                .any(|t| t.is_empty() || t.contains(char::is_whitespace))
        {
            return Err(LoraError::Targets);
        }
        Ok(Lora {
            rank,
            alpha,
            targets,
            dropout,
            quant,
        })
    }

    pub fn rank(&self) -> u32 {
        self.rank
    }

    pub fn alpha(&self) -> f64 {
        self.alpha
    }

    pub fn targets(&self) -> &[String] {
        &self.targets
    }

    pub fn dropout(&self) -> f64 {
        self.dropout
    }

    pub fn quant(&self) -> Option<Quant4> {
        self.quant
    }

    /// `r=16,alpha=32,targets=q_proj,v_proj[,dropout=0.05][,quant=nf4|fp4[,double_quant=false]
    /// [,loader=transformers|fabric][,bnb=RELEASE]]` (a bare word after `targets=` is one more
    /// target). PEFT's defaults: r 8, alpha 8, dropout 0; targets are required; QLoRA's double
    /// quantization unless turned off, by transformers, on the release gpumem restates.
    pub fn parse(spec: &str) -> Result<Lora, LoraError> {
        let (mut rank, mut alpha, mut dropout, mut targets) = (8u32, 8f64, 0f64, Vec::new());
        let (mut quant, mut double_quant, mut loader, mut release) = (None, None, None, None);
        let mut after_targets = false;
        for part in spec.split(',').map(str::trim) {
            let (key, value) = match part.split_once('=') {
                Some((k, v)) => (k.trim(), v.trim()),
                None if after_targets && !part.is_empty() => ("targets", part),
                None => return Err(LoraError::NotKeyValue(part.to_string())),
            };
            let number = |v: &str| {
                v.parse::<f64>().map_err(|_| LoraError::NotNumber {
                    key: key.to_string(),
                    value: v.to_string(),
                })
            };
            match key {
                "r" | "rank" => {
                    rank = value
                        .parse()
                        .map_err(|_| LoraError::NotWhole(value.to_string()))?
                }
                "alpha" | "lora_alpha" => alpha = number(value)?,
                "dropout" | "lora_dropout" => dropout = number(value)?,
                "targets" | "target_modules" => targets.push(value.to_string()),
                "quant" => {
                    quant = Some(match value {
                        "nf4" => true,
                        "fp4" => false,
                        other => return Err(LoraError::Quant(other.to_string())),
                    })
                }
                "double_quant" => {
                    double_quant = Some(
                        value
                            .parse::<bool>()
                            .map_err(|_| LoraError::NotBool(value.to_string()))?,
                    )
                }
                "loader" => {
                    loader = Some(match value {
                        "transformers" => QuantLoader::Transformers,
                        "fabric" => QuantLoader::Fabric,
                        other => return Err(LoraError::Loader(other.to_string())),
                    })
                }
                "bnb" | "bitsandbytes" => release = Some(value.parse::<Release>()?),
                other => return Err(LoraError::UnknownKey(other.to_string())),
            }
            after_targets = matches!(key, "targets" | "target_modules");
        }
        let quant = match quant {
            Some(nf4) => Some(Quant4 {
                loader: loader.unwrap_or_default(),
                bitsandbytes: release,
                ..Quant4::new(nf4, double_quant.unwrap_or(true))
            }),
            None => {
                let stray = [
                    ("double_quant", double_quant.is_some()),
                    ("loader", loader.is_some()),
                    ("bnb", release.is_some()),
                ];
                if let Some((key, _)) = stray.into_iter().find(|(_, set)| *set) {
                    return Err(LoraError::QuantKeyAlone(key));
                }
                None
            }
        };
        Lora::new(rank, alpha, targets, dropout, quant)
    }

    /// A PEFT `adapter_config.json` (its `r`, `lora_alpha`, `target_modules`, `lora_dropout`).
    pub fn from_peft_json(text: &str) -> Result<Lora, LoraError> {
        let v: serde_json::Value = serde_json::from_str(text)?;
        if let Some(t) = v
            .get("peft_type")
            .and_then(|t| t.as_str())
            .filter(|t| *t != "LORA")
        {
            return Err(LoraError::PeftType(t.to_string()));
        }
        let rank = v
            .get("r")
            .map_or(Some(8), |r| r.as_u64())
            .and_then(|r| u32::try_from(r).ok())
            .ok_or(LoraError::PeftField("r"))?;
        let number = |key: &'static str, default: f64| {
            v.get(key)
                .map_or(Some(default), |x| x.as_f64())
                .ok_or(LoraError::PeftField(key))
        };
        let targets = match v.get("target_modules") {
            Some(serde_json::Value::String(s)) => vec![s.clone()],
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|t| {
                    t.as_str()
                        .map(str::to_string)
                        .ok_or(LoraError::PeftField("target_modules"))
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(LoraError::PeftField("target_modules")),
        };
        Lora::new(
            rank,
            number("lora_alpha", 8.0)?,
            targets,
            number("lora_dropout", 0.0)?,
            None,
        )
    }
}

impl TryFrom<LoraValues> for Lora {
    type Error = LoraError;

    fn try_from(v: LoraValues) -> Result<Lora, LoraError> {
        Lora::new(v.rank, v.alpha, v.targets, v.dropout, v.quant)
    }
}

impl From<Lora> for LoraValues {
    fn from(l: Lora) -> LoraValues {
        LoraValues {
            rank: l.rank,
            alpha: l.alpha,
            targets: l.targets,
            dropout: l.dropout,
            quant: l.quant,
        }
    }
}

impl JsonSchema for Lora {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        LoraValues::schema_name()
    }

    fn json_schema(g: &mut schemars::SchemaGenerator) -> schemars::Schema {
        LoraValues::json_schema(g)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_is_stated_as_peft_states_it() {
        let l = Lora::parse("r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05").unwrap();
        assert_eq!(
            (l.rank(), l.alpha(), l.targets().to_vec(), l.dropout()),
            (
                16,
                32.0,
                vec!["q_proj".to_string(), "v_proj".to_string()],
                0.05
            )
        );
        assert_eq!(
            Lora::parse("targets=all-linear").unwrap(),
            Lora::new(8, 8.0, vec!["all-linear".into()], 0.0, None).unwrap(),
            "PEFT's defaults"
        );
        // QLoRA: 4-bit base weights, double-quantized unless turned off.
        assert_eq!(
            Lora::parse("targets=all-linear,quant=nf4").unwrap().quant(),
            Some(Quant4::new(true, true))
        );
        // litgpt's QLoRA as its 2024 releases ran it: Fabric's quantizer, bitsandbytes 0.42.
        assert_eq!(
            Lora::parse("targets=q,quant=nf4,double_quant=false,loader=fabric,bnb=0.42")
                .unwrap()
                .quant(),
            Some(Quant4 {
                loader: QuantLoader::Fabric,
                bitsandbytes: Some(Release(0, 42, 0)),
                ..Quant4::new(true, false)
            })
        );
        assert!(Release(0, 43, 1) < Release(0, 43, 2) && Release(0, 44, 0) > Release(0, 43, 2));
        assert_eq!(
            Lora::parse("targets=q,quant=fp4,double_quant=false")
                .unwrap()
                .quant(),
            Some(Quant4::new(false, false))
        );
        let json = r#"{"peft_type": "LORA", "r": 16, "lora_alpha": 32, "lora_dropout": 0.1, "target_modules": ["q_proj", "v_proj"], "bias": "none"}"#;
        assert_eq!(
            Lora::from_peft_json(json).unwrap(),
            Lora::new(16, 32.0, l.targets().to_vec(), 0.1, None).unwrap()
        );
        for (bad, needle) in [
            ("r=0,targets=q", "at least 1"),
            ("r=16", "give targets"),
            ("r=16,q_proj", "not key=value"),
            (
                "alpha=nan,targets=q",
                "alpha NaN is not a positive finite number",
            ),
            ("alpha=-1,targets=q", "alpha -1 is not a positive"),
            ("alpha=x,targets=q", "alpha `x` is not a number"),
            ("rank=4,colour=1", "unknown key"),
            ("dropout=1,targets=q", "not in [0, 1)"),
            ("dropout=-0.1,targets=q", "not in [0, 1)"),
            ("targets=q,quant=int3", "quant `int3` is not nf4 or fp4"),
            (
                "targets=q,double_quant=true",
                "double_quant needs quant=nf4",
            ),
            ("targets=q,quant=nf4,double_quant=2", "not true or false"),
            ("targets=q,loader=fabric", "loader needs quant=nf4"),
            (
                "targets=q,quant=nf4,loader=tf",
                "loader `tf` is not transformers",
            ),
            (
                "targets=q,quant=nf4,bnb=0.x",
                "release `0.x` is not MAJOR.MINOR",
            ),
            ("targets=q,quant=nf4,bnb=1.2.3.4", "release `1.2.3.4`"),
        ] {
            let e = Lora::parse(bad).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
        }
        assert!(
            Lora::from_peft_json(r#"{"peft_type": "IA3", "target_modules": ["k"]}"#)
                .unwrap_err()
                .to_string()
                .contains("IA3")
        );
        // The document form checks as the constructor does.
        let e = serde_json::from_str::<Lora>(r#"{"rank": 8, "alpha": -2, "targets": ["q"]}"#)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("lora alpha -2 is not a positive finite number"),
            "{e}"
        );
        // The release travels as its text and back; an old document (no loader, no release)
        // reads as before.
        let fabric = Lora::parse("targets=q,quant=nf4,loader=fabric,bnb=0.42.0").unwrap();
        let json = serde_json::to_string(&fabric).unwrap();
        assert!(
            json.contains(r#""loader":"fabric","bitsandbytes":"0.42.0""#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<Lora>(&json).unwrap(), fabric);
        let plain = Lora::parse("targets=q,quant=nf4").unwrap();
        assert_eq!(
            serde_json::to_string(&plain).unwrap(),
            r#"{"rank":8,"alpha":8.0,"targets":["q"],"dropout":0.0,"quant":{"nf4":true,"double_quant":true}}"#
        );
    }
}
