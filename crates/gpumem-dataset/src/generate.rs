//! Random training jobs from the seed's parameter ranges, deterministic for a seed.

use gpumem_core::UnknownName;
use gpumem_core::families::{ModelSpec, SpecError};
use gpumem_core::graph::Activation;
use gpumem_core::rng::SplitMix64;
use serde::{Deserialize, Serialize};

use crate::SyntheticJob;

/// An inclusive integer range.
pub type Span = [u64; 2];

/// Ranges that cannot be drawn from. One line naming the range (`mlp.batch`).
#[derive(Debug, thiserror::Error)]
pub enum RangesError {
    #[error("{}", .0.to_string().replace('\n', " "))]
    Toml(#[from] toml::de::Error),
    #[error("{name}: [{lo}, {hi}] is not a range of positive numbers")]
    NotRange {
        name: &'static str,
        lo: u64,
        hi: u64,
    },
    #[error("{name} is empty")]
    Empty { name: &'static str },
    /// The ranges drew a model the family does not accept.
    #[error("generated an invalid spec `{model}`: {source} (check --ranges)")]
    InvalidSpec { model: String, source: SpecError },
}

/// The MLP family's ranges (the seed's: synthetic-families.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MlpRanges {
    pub input: Span,
    /// Batch sizes are multiples of 4 in the seed.
    pub batch: Span,
    pub depth: Span,
    pub dropout: [f64; 2],
    pub archs: Vec<String>,
    pub acts: Vec<String>,
}

impl Default for MlpRanges {
    fn default() -> Self {
        MlpRanges {
            input: [4, 4096],
            batch: [4, 1024],
            depth: [1, 10],
            dropout: [0.1, 0.5],
            archs: ["pyramid", "uniform", "bottleneck", "gradual"]
                .map(String::from)
                .to_vec(),
            acts: Activation::NAMES.map(String::from).to_vec(),
        }
    }
}

/// The CNN family's ranges (the seed's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CnnRanges {
    pub classes: Span,
    pub filters: Span,
    pub depth: Span,
    /// Even batch sizes.
    pub batch: Span,
    /// Even square input sizes.
    pub input: Span,
    pub channels: Vec<u64>,
    pub dropout: [f64; 2],
    pub archs: Vec<String>,
    pub acts: Vec<String>,
}

impl Default for CnnRanges {
    fn default() -> Self {
        CnnRanges {
            classes: [100, 1000],
            filters: [32, 512],
            depth: [1, 30],
            batch: [2, 64],
            input: [16, 224],
            channels: vec![3, 1],
            dropout: [0.1, 0.5],
            archs: [
                "pyramid",
                "reverse_pyramid",
                "uniform",
                "bottleneck",
                "gradual",
                "hourglass",
                "residual",
                "dense",
            ]
            .map(String::from)
            .to_vec(),
            acts: Activation::NAMES
                .iter()
                .filter(|a| **a != "identity")
                .map(|a| a.to_string())
                .collect(),
        }
    }
}

/// The Transformer family's ranges (the seed names the parameters but not their ranges; these
/// are gpumem's, chosen to span small to BERT-base-sized models).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransformerRanges {
    pub vocab: Span,
    /// Embedding sizes are drawn as multiples of the head count.
    pub embed: Span,
    pub layers: Span,
    pub heads: Vec<u64>,
    /// Feed-forward size as a multiple of the embedding.
    pub ff_multiple: Span,
    pub seq: Span,
    pub classes: Span,
    pub batch: Span,
    pub dropout: [f64; 2],
    pub archs: Vec<String>,
}

impl Default for TransformerRanges {
    fn default() -> Self {
        TransformerRanges {
            vocab: [1000, 50_000],
            embed: [64, 1024],
            layers: [1, 12],
            heads: vec![1, 2, 4, 8, 16],
            ff_multiple: [1, 4],
            seq: [16, 512],
            classes: [2, 1000],
            batch: [2, 64],
            dropout: [0.0, 0.3],
            archs: ["standard", "decoder_only", "hybrid"]
                .map(String::from)
                .to_vec(),
        }
    }
}

/// All families' ranges; a `--ranges` TOML file overrides any subset (`[mlp] batch = [4, 256]`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Ranges {
    pub mlp: MlpRanges,
    pub cnn: CnnRanges,
    pub transformer: TransformerRanges,
}

impl Ranges {
    pub fn from_toml(text: &str) -> Result<Ranges, RangesError> {
        let r: Ranges = toml::from_str(text)?;
        r.check()?;
        Ok(r)
    }

    fn check(&self) -> Result<(), RangesError> {
        let spans: [(&str, Span); 15] = [
            ("mlp.input", self.mlp.input),
            ("mlp.batch", self.mlp.batch),
            ("mlp.depth", self.mlp.depth),
            ("cnn.classes", self.cnn.classes),
            ("cnn.filters", self.cnn.filters),
            ("cnn.depth", self.cnn.depth),
            ("cnn.batch", self.cnn.batch),
            ("cnn.input", self.cnn.input),
            ("transformer.vocab", self.transformer.vocab),
            ("transformer.embed", self.transformer.embed),
            ("transformer.layers", self.transformer.layers),
            ("transformer.seq", self.transformer.seq),
            ("transformer.classes", self.transformer.classes),
            ("transformer.batch", self.transformer.batch),
            ("transformer.ff_multiple", self.transformer.ff_multiple),
        ];
        for (name, [lo, hi]) in spans {
            if lo == 0 || lo > hi {
                return Err(RangesError::NotRange { name, lo, hi });
            }
        }
        let lists: [(&str, usize); 6] = [
            ("mlp.archs", self.mlp.archs.len()),
            ("mlp.acts", self.mlp.acts.len()),
            ("cnn.archs", self.cnn.archs.len()),
            ("cnn.acts", self.cnn.acts.len()),
            ("cnn.channels", self.cnn.channels.len()),
            ("transformer.heads", self.transformer.heads.len()),
        ];
        for (name, n) in lists {
            if n == 0 {
                return Err(RangesError::Empty { name });
            }
        }
        Ok(())
    }
}

/// Which family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Mlp,
    Cnn,
    Transformer,
}

impl Family {
    pub fn parse(s: &str) -> Result<Family, UnknownName> {
        match s {
            "mlp" => Ok(Family::Mlp),
            "cnn" => Ok(Family::Cnn),
            "transformer" => Ok(Family::Transformer),
            other => Err(UnknownName::new("family", other, "mlp, cnn or transformer")),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Family::Mlp => "mlp",
            Family::Cnn => "cnn",
            Family::Transformer => "transformer",
        }
    }
}

struct Draw(SplitMix64);

impl Draw {
    fn int(&mut self, [lo, hi]: Span) -> u64 {
        lo + self.0.next_u64() % (hi - lo + 1)
    }
    fn multiple(&mut self, span: Span, of: u64) -> u64 {
        let lo = span[0].div_ceil(of).max(1);
        let hi = (span[1] / of).max(lo);
        self.int([lo, hi]) * of
    }
    fn float(&mut self, [lo, hi]: [f64; 2]) -> f64 {
        // Three decimals, as people write them.
        ((lo + (hi - lo) * self.0.unit()) * 1000.0).round() / 1000.0
    }
    fn coin(&mut self) -> bool {
        self.0.next_u64() & 1 == 1
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[(self.0.next_u64() % items.len() as u64) as usize]
    }
}

/// `count` jobs of `family`, ids `FAMILY-000001`…; each spec parses as a native model.
pub fn generate(
    family: Family,
    count: usize,
    seed: u64,
    ranges: &Ranges,
) -> Result<Vec<SyntheticJob>, RangesError> {
    ranges.check()?;
    let mut d = Draw(SplitMix64(seed ^ (family as u64).wrapping_mul(0x9E37_79B9)));
    (0..count)
        .map(|i| {
            let (model, batch) = match family {
                Family::Mlp => mlp(&mut d, &ranges.mlp),
                Family::Cnn => cnn(&mut d, &ranges.cnn),
                Family::Transformer => transformer(&mut d, &ranges.transformer),
            };
            let spec = ModelSpec::parse(&model).map_err(|source| RangesError::InvalidSpec {
                model: model.clone(),
                source,
            })?;
            Ok(SyntheticJob {
                id: format!("{}-{:06}", family.name(), i + 1),
                family: family.name().into(),
                model: spec.to_spec_string(),
                batch,
            })
        })
        .collect()
}

fn mlp(d: &mut Draw, r: &MlpRanges) -> (String, u64) {
    let input = d.int(r.input);
    let output = d.int([1, (input / 4).max(2)]);
    let depth = d.int(r.depth);
    let dropout = if d.coin() { d.float(r.dropout) } else { 0.0 };
    let head = if output == 1 && d.coin() {
        "sigmoid"
    } else {
        "identity"
    };
    let spec = format!(
        "mlp:input={input},output={output},depth={depth},arch={},act={},dropout={dropout},batchnorm={},head={head},samples=4096,summary=true",
        d.pick(&r.archs),
        d.pick(&r.acts),
        d.coin()
    );
    (spec, d.multiple(r.batch, 4))
}

fn cnn(d: &mut Draw, r: &CnnRanges) -> (String, u64) {
    let dropout = if d.coin() { d.float(r.dropout) } else { 0.0 };
    let pool_every = if d.coin() { 0 } else { 5 };
    let spec = format!(
        "cnn:classes={},filters={},depth={},input={},channels={},arch={},act={},dropout={dropout},batchnorm={},pooling={},pool_every={pool_every},summary=true",
        d.int(r.classes),
        d.int(r.filters),
        d.int(r.depth),
        d.multiple(r.input, 2),
        d.pick(&r.channels),
        d.pick(&r.archs),
        d.pick(&r.acts),
        d.coin(),
        d.coin()
    );
    (spec, d.multiple(r.batch, 2))
}

fn transformer(d: &mut Draw, r: &TransformerRanges) -> (String, u64) {
    let heads = *d.pick(&r.heads);
    let embed = d.multiple(r.embed, heads);
    let (vocab, layers, ff, seq, classes, dropout) = (
        d.int(r.vocab),
        d.int(r.layers),
        embed * d.int(r.ff_multiple),
        d.int(r.seq),
        d.int(r.classes),
        d.float(r.dropout),
    );
    let arch = d.pick(&r.archs);
    // hybrid splits its layers between an encoder and a decoder: at least one each.
    let layers = if arch == "hybrid" {
        layers.max(2)
    } else {
        layers
    };
    let spec = format!(
        "transformer:vocab={vocab},embed={embed},layers={layers},heads={heads},ff={ff},seq={seq},classes={classes},dropout={dropout},arch={arch}"
    );
    (spec, d.int(r.batch))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_are_valid_deterministic_and_in_range() {
        for family in [Family::Mlp, Family::Cnn, Family::Transformer] {
            let a = generate(family, 200, 7, &Ranges::default()).unwrap();
            assert_eq!(a, generate(family, 200, 7, &Ranges::default()).unwrap());
            assert_ne!(a, generate(family, 200, 8, &Ranges::default()).unwrap());
            for j in &a {
                let spec = ModelSpec::parse(&j.model).unwrap();
                assert_eq!(spec.family(), family.name());
                match family {
                    Family::Mlp => assert!(j.batch % 4 == 0 && (4..=1024).contains(&j.batch)),
                    Family::Cnn => assert!(j.batch % 2 == 0 && (2..=64).contains(&j.batch)),
                    Family::Transformer => assert!((2..=64).contains(&j.batch)),
                }
            }
        }
        let mlp = generate(Family::Mlp, 1, 1, &Ranges::default()).unwrap();
        assert_eq!(mlp[0].id, "mlp-000001");
    }

    #[test]
    fn ranges_override_and_validate() {
        let r = Ranges::from_toml("[mlp]\nbatch = [8, 8]\ninput = [16, 16]\n").unwrap();
        assert!(
            generate(Family::Mlp, 20, 1, &r)
                .unwrap()
                .iter()
                .all(|j| j.batch == 8 && j.model.contains("input=16,"))
        );
        assert_eq!(
            r.cnn,
            CnnRanges::default(),
            "untouched families keep the seed's ranges"
        );
        assert_eq!(
            Ranges::from_toml("[mlp]\nbatch = [8, 4]\n")
                .unwrap_err()
                .to_string(),
            "mlp.batch: [8, 4] is not a range of positive numbers"
        );
        let e = Ranges::from_toml("[mlp]\nwidth = [1, 2]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("width") && !e.contains('\n'), "{e}");
        assert_eq!(
            Ranges::from_toml("[cnn]\nacts = []\n")
                .unwrap_err()
                .to_string(),
            "cnn.acts is empty"
        );
        let e = generate(
            Family::Mlp,
            5,
            1,
            &Ranges::from_toml("[mlp]\nacts = [\"swoosh\"]\n").unwrap(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("generated an invalid spec `mlp:") && e.ends_with("unknown activation `swoosh` (expected one of relu, leaky_relu, prelu, elu, selu, tanh, softplus, swish, mish, gelu, identity) (check --ranges)"), "{e}");
    }
}
