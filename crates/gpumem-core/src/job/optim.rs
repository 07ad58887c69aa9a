//! Optimizers as trainers name them: an algorithm of one library, with the implementation of
//! its step where the library has several (torch.optim's for-loop, foreach and fused). Every
//! value of [`Optimizer`] is a combination that exists (torch's Adafactor has no fused kernel,
//! bitsandbytes' and torchao's optimizers have one implementation each), so a job cannot state
//! one that does not. [`Optimizer::parse`] reads gpumem's names, Hugging Face Trainer's `optim`
//! values, axolotl's and torchtune's spellings (class paths); [`Optimizer::name`] is the one
//! spelling gpumem writes (flags, job files, JSON, trace headers, the tracer's request).

use std::fmt;

use crate::UnknownName;

/// How a torch.optim optimizer runs its step (its `foreach`/`fused` arguments).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Implementation {
    /// `foreach=False`: one parameter at a time, each with its own temporaries.
    ForLoop,
    /// `foreach=True`: `_foreach_*` kernels over the whole list, temporaries list-wide.
    /// gpumem's default, and PyTorch's own when every parameter is on a CUDA device.
    #[default]
    Foreach,
    /// `fused=True`: one fused kernel, no temporaries (the step counters live on the GPU).
    Fused,
}

/// The implementations of an optimizer that torch gives no fused kernel for CUDA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Loop {
    ForLoop,
    #[default]
    Foreach,
}

impl From<Loop> for Implementation {
    fn from(l: Loop) -> Implementation {
        match l {
            Loop::ForLoop => Implementation::ForLoop,
            Loop::Foreach => Implementation::Foreach,
        }
    }
}

impl Implementation {
    pub const NAMES: [&'static str; 3] = ["for-loop", "foreach", "fused"];

    pub fn name(self) -> &'static str {
        match self {
            Implementation::ForLoop => "for-loop",
            Implementation::Foreach => "foreach",
            Implementation::Fused => "fused",
        }
    }

    pub fn parse(s: &str) -> Result<Implementation, UnknownName> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "for-loop" | "forloop" | "single-tensor" => Ok(Implementation::ForLoop),
            "foreach" => Ok(Implementation::Foreach),
            "fused" => Ok(Implementation::Fused),
            _ => Err(UnknownName::new(
                "optimizer implementation",
                s,
                "for-loop, foreach or fused",
            )),
        }
    }

    /// The implementation a config's `fused` and `foreach` keys select (torchtune's and
    /// torch.optim's keyword arguments; `None`: the key is absent), over `default`. `fused: true`
    /// wins; `foreach: false` alone is the for-loop; `foreach: true` alone is foreach.
    pub fn from_flags(fused: Option<bool>, foreach: Option<bool>, default: Implementation) -> Self {
        match (fused, foreach) {
            (Some(true), _) => Implementation::Fused,
            (_, Some(false)) => Implementation::ForLoop,
            (_, Some(true)) => Implementation::Foreach,
            (Some(false), None) if default == Implementation::Fused => Implementation::Foreach,
            _ => default,
        }
    }

    fn suffix(self) -> &'static str {
        match self {
            Implementation::ForLoop => "-for-loop",
            Implementation::Foreach => "",
            Implementation::Fused => "-fused",
        }
    }
}

/// Which Adafactor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Adafactor {
    /// `torch.optim.Adafactor` (torch 2.5 and later): factored row/column variances, no first
    /// moment.
    Torch(Loop),
    /// `transformers.optimization.Adafactor` as Hugging Face's Trainer makes it for
    /// `optim="adafactor"` (`scale_parameter=False, relative_step=False`, no first moment):
    /// factored row/column second moments, a for-loop.
    Transformers,
}

/// The algorithm of a bitsandbytes optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BnbAlgorithm {
    Adam,
    AdamW,
    /// One state (`exp_avg`).
    Lion,
}

/// bitsandbytes' state format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BnbBits {
    /// Blockwise-quantized: a byte per element and an fp32 absmax per 256 (fp32 below 4096
    /// elements).
    Eight,
    /// fp32 per element.
    ThirtyTwo,
}

/// A bitsandbytes optimizer (0.50): its CUDA kernels update in place (no temporaries).
/// `paged`: its large states (100,000 elements and more) are CUDA managed memory, which the
/// driver pages out to the host under pressure — gpumem states them as host-backed, outside
/// the GPU's peak.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bnb {
    pub algorithm: BnbAlgorithm,
    pub bits: BnbBits,
    pub paged: bool,
}

/// torchao's low-bit AdamW (`torchao.optim`): its two moments as block-quantized tensor
/// subclasses, stepped by one compiled kernel per parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Torchao {
    /// `AdamW8bit`: a byte per element, an fp32 scale per 256.
    AdamW8bit,
    /// `AdamW4bit`: half a byte per element, an fp32 scale per 128.
    AdamW4bit,
    /// `AdamWFp8`: an fp8 (e4m3) byte per element, an fp32 scale per 256.
    AdamWFp8,
}

/// The optimizer of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Optimizer {
    /// `torch.optim.Adam`.
    Adam(Implementation),
    /// `torch.optim.AdamW` (weight decay 0.01, decoupled).
    AdamW(Implementation),
    /// transformers' own `AdamW` (`transformers.optimization.AdamW`), what Hugging Face's
    /// Trainer made for `optim="adamw_hf"` (its default until transformers 4.32; the class was
    /// removed in 2025): one parameter at a time, its two moments made when first stepped.
    TransformersAdamW,
    /// `torch.optim.SGD` without momentum (no state).
    Sgd(Implementation),
    /// `torch.optim.SGD(momentum=0.9)`: one momentum buffer per parameter.
    SgdMomentum(Implementation),
    /// `torch.optim.Adagrad` (no fused kernel on CUDA).
    Adagrad(Loop),
    /// `torch.optim.RMSprop`.
    RmsProp(Loop),
    Adafactor(Adafactor),
    /// `torch.optim.Muon` (torch 2.9 and later) for the 2-D parameters, which is all it takes;
    /// the others (biases, norms, embeddings' kin of other ranks) in `torch.optim.AdamW`
    /// (foreach), as torch's documentation and trainers pair them.
    Muon,
    Bnb(Bnb),
    Torchao(Torchao),
}

impl Default for Optimizer {
    fn default() -> Self {
        Optimizer::ADAM
    }
}

/// Spellings that name an optimizer and its implementation: gpumem's own, then the trainers'.
/// Each is matched lower-cased.
const SPELLINGS: &[(&str, Optimizer)] = {
    use BnbAlgorithm::{Adam as BA, AdamW as BW, Lion as BL};
    use BnbBits::{Eight as E, ThirtyTwo as T};
    use Implementation::{Foreach as F, Fused as U};
    use Optimizer as O;
    const fn bnb(algorithm: BnbAlgorithm, bits: BnbBits, paged: bool) -> Optimizer {
        Optimizer::Bnb(Bnb {
            algorithm,
            bits,
            paged,
        })
    }
    &[
        // gpumem's older spellings.
        ("sgd_momentum", O::SgdMomentum(F)),
        ("momentum", O::SgdMomentum(F)),
        ("adam-8bit", bnb(BA, E, false)),
        ("adamw-8bit", bnb(BW, E, false)),
        ("paged_adamw8bit", bnb(BW, E, true)),
        ("paged-adamw-8bit", bnb(BW, E, true)),
        // Hugging Face Trainer's `optim` (transformers 5.24 `OptimizerNames`); axolotl's
        // `optimizer` takes the same names.
        ("adamw_torch", O::AdamW(F)),
        ("adamw_torch_fused", O::AdamW(U)),
        ("adafactor", O::Adafactor(Adafactor::Transformers)),
        ("adamw_hf", O::TransformersAdamW),
        ("adamw_torch_4bit", O::Torchao(Torchao::AdamW4bit)),
        ("adamw_torch_8bit", O::Torchao(Torchao::AdamW8bit)),
        ("sgd", O::Sgd(F)),
        ("adagrad", O::Adagrad(Loop::Foreach)),
        ("adamw_bnb_8bit", bnb(BW, E, false)),
        ("adamw_8bit", bnb(BW, E, false)),
        ("lion_8bit", bnb(BL, E, false)),
        ("lion_32bit", bnb(BL, T, false)),
        ("paged_adamw_32bit", bnb(BW, T, true)),
        ("paged_adamw_8bit", bnb(BW, E, true)),
        ("paged_lion_32bit", bnb(BL, T, true)),
        ("paged_lion_8bit", bnb(BL, E, true)),
        ("rmsprop", O::RmsProp(Loop::Foreach)),
        // axolotl's own additions.
        ("ao_adamw_8bit", O::Torchao(Torchao::AdamW8bit)),
        ("ao_adamw_4bit", O::Torchao(Torchao::AdamW4bit)),
        ("ao_adamw_fp8", O::Torchao(Torchao::AdamWFp8)),
        // Class paths (torchtune's `_component_`, axolotl's `optimizer_cls`): torch.optim's
        // classes take their implementation from the config's `fused`/`foreach` keys
        // (`Optimizer::with_implementation`).
        ("torch.optim.adam", O::Adam(F)),
        ("torch.optim.adamw", O::AdamW(F)),
        ("torch.optim.sgd", O::Sgd(F)),
        ("torch.optim.adagrad", O::Adagrad(Loop::Foreach)),
        ("torch.optim.rmsprop", O::RmsProp(Loop::Foreach)),
        (
            "torch.optim.adafactor",
            O::Adafactor(Adafactor::Torch(Loop::Foreach)),
        ),
        ("torch.optim.muon", O::Muon),
        ("transformers.adamw", O::TransformersAdamW),
        ("transformers.optimization.adamw", O::TransformersAdamW),
        (
            "transformers.adafactor",
            O::Adafactor(Adafactor::Transformers),
        ),
        (
            "transformers.optimization.adafactor",
            O::Adafactor(Adafactor::Transformers),
        ),
        ("bitsandbytes.optim.adam", bnb(BA, T, false)),
        ("bitsandbytes.optim.adam32bit", bnb(BA, T, false)),
        ("bitsandbytes.optim.adam8bit", bnb(BA, E, false)),
        ("bitsandbytes.optim.pagedadam", bnb(BA, T, true)),
        ("bitsandbytes.optim.pagedadam32bit", bnb(BA, T, true)),
        ("bitsandbytes.optim.pagedadam8bit", bnb(BA, E, true)),
        ("bitsandbytes.optim.adamw", bnb(BW, T, false)),
        ("bitsandbytes.optim.adamw32bit", bnb(BW, T, false)),
        ("bitsandbytes.optim.adamw8bit", bnb(BW, E, false)),
        ("bitsandbytes.optim.pagedadamw", bnb(BW, T, true)),
        ("bitsandbytes.optim.pagedadamw32bit", bnb(BW, T, true)),
        ("bitsandbytes.optim.pagedadamw8bit", bnb(BW, E, true)),
        ("bitsandbytes.optim.lion", bnb(BL, T, false)),
        ("bitsandbytes.optim.lion32bit", bnb(BL, T, false)),
        ("bitsandbytes.optim.lion8bit", bnb(BL, E, false)),
        ("bitsandbytes.optim.pagedlion", bnb(BL, T, true)),
        ("bitsandbytes.optim.pagedlion32bit", bnb(BL, T, true)),
        ("bitsandbytes.optim.pagedlion8bit", bnb(BL, E, true)),
        ("torchao.optim.adamw8bit", O::Torchao(Torchao::AdamW8bit)),
        ("torchao.optim.adamw4bit", O::Torchao(Torchao::AdamW4bit)),
        ("torchao.optim.adamwfp8", O::Torchao(Torchao::AdamWFp8)),
        (
            "torchao.prototype.low_bit_optim.adamw8bit",
            O::Torchao(Torchao::AdamW8bit),
        ),
        (
            "torchao.prototype.low_bit_optim.adamw4bit",
            O::Torchao(Torchao::AdamW4bit),
        ),
        (
            "torchao.prototype.low_bit_optim.adamwfp8",
            O::Torchao(Torchao::AdamWFp8),
        ),
    ]
};

/// Names trainers use for optimizers gpumem does not model, with what they are: refused by
/// name rather than as a typo.
const NOT_MODELLED: &[&str] = &[
    "adamw_torch_xla",
    "adamw_torch_npu_fused",
    "adamw_apex_fused",
    "adamw_anyprecision",
    "ademamix",
    "ademamix_8bit",
    "paged_ademamix_32bit",
    "paged_ademamix_8bit",
    "rmsprop_bnb",
    "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit",
    "galore_adamw",
    "galore_adamw_8bit",
    "galore_adafactor",
    "galore_adamw_layerwise",
    "galore_adamw_8bit_layerwise",
    "galore_adafactor_layerwise",
    "lomo",
    "adalomo",
    "grokadamw",
    "schedule_free_radam",
    "schedule_free_adamw",
    "schedule_free_sgd",
    "apollo_adamw",
    "apollo_adamw_layerwise",
    "stable_adamw",
];

impl Optimizer {
    /// torch.optim.Adam with gpumem's default implementation (foreach).
    pub const ADAM: Optimizer = Optimizer::Adam(Implementation::Foreach);
    pub const ADAMW: Optimizer = Optimizer::AdamW(Implementation::Foreach);
    pub const SGD: Optimizer = Optimizer::Sgd(Implementation::Foreach);
    pub const SGD_MOMENTUM: Optimizer = Optimizer::SgdMomentum(Implementation::Foreach);

    /// Every optimizer gpumem models, each once, in the order the docs list them.
    pub fn all() -> Vec<Optimizer> {
        use Implementation::*;
        let mut v = Vec::new();
        for i in [Foreach, ForLoop, Fused] {
            v.extend([
                Optimizer::Adam(i),
                Optimizer::AdamW(i),
                Optimizer::Sgd(i),
                Optimizer::SgdMomentum(i),
            ]);
        }
        for l in [Loop::Foreach, Loop::ForLoop] {
            v.extend([
                Optimizer::Adagrad(l),
                Optimizer::RmsProp(l),
                Optimizer::Adafactor(Adafactor::Torch(l)),
            ]);
        }
        v.extend([
            Optimizer::TransformersAdamW,
            Optimizer::Adafactor(Adafactor::Transformers),
            Optimizer::Muon,
        ]);
        for paged in [false, true] {
            for bits in [BnbBits::Eight, BnbBits::ThirtyTwo] {
                for algorithm in [BnbAlgorithm::Adam, BnbAlgorithm::AdamW, BnbAlgorithm::Lion] {
                    v.push(Optimizer::Bnb(Bnb {
                        algorithm,
                        bits,
                        paged,
                    }));
                }
            }
        }
        v.extend([
            Optimizer::Torchao(Torchao::AdamW8bit),
            Optimizer::Torchao(Torchao::AdamW4bit),
            Optimizer::Torchao(Torchao::AdamWFp8),
        ]);
        v
    }

    /// gpumem's name: the one spelling it writes, and reads back.
    pub fn name(self) -> String {
        let (base, i): (&str, Implementation) = match self {
            Optimizer::Adam(i) => ("adam", i),
            Optimizer::AdamW(i) => ("adamw", i),
            Optimizer::Sgd(i) => ("sgd", i),
            Optimizer::SgdMomentum(i) => ("sgd-momentum", i),
            Optimizer::Adagrad(l) => ("adagrad", l.into()),
            Optimizer::RmsProp(l) => ("rmsprop", l.into()),
            Optimizer::Adafactor(Adafactor::Torch(l)) => ("torch-adafactor", l.into()),
            Optimizer::TransformersAdamW => return "transformers-adamw".into(),
            Optimizer::Adafactor(Adafactor::Transformers) => return "adafactor".into(),
            Optimizer::Muon => return "muon".into(),
            Optimizer::Bnb(b) => {
                return format!(
                    "{}{}{}",
                    if b.paged { "paged-" } else { "" },
                    match b.algorithm {
                        BnbAlgorithm::Adam => "adam",
                        BnbAlgorithm::AdamW => "adamw",
                        BnbAlgorithm::Lion => "lion",
                    },
                    match b.bits {
                        BnbBits::Eight => "8bit",
                        BnbBits::ThirtyTwo => "32bit",
                    }
                );
            }
            Optimizer::Torchao(t) => {
                return match t {
                    Torchao::AdamW8bit => "torchao-adamw8bit",
                    Torchao::AdamW4bit => "torchao-adamw4bit",
                    Torchao::AdamWFp8 => "torchao-adamw-fp8",
                }
                .into();
            }
        };
        format!("{base}{}", i.suffix())
    }

    /// An optimizer by any name gpumem reads: its own ([`Optimizer::name`]), Hugging Face
    /// Trainer's `optim` values, axolotl's, and class paths (`torch.optim.AdamW`,
    /// `bitsandbytes.optim.PagedAdamW8bit`, `torchao.optim.AdamW8bit`, `bnb.optim.…`);
    /// case-insensitive.
    pub fn parse(s: &str) -> Result<Optimizer, UnknownName> {
        let key = s.trim().to_ascii_lowercase();
        let key = match key.strip_prefix("bnb.optim.") {
            Some(class) => format!("bitsandbytes.optim.{class}"),
            None => key,
        };
        if let Some(o) = Optimizer::all().into_iter().find(|o| o.name() == key) {
            return Ok(o);
        }
        if let Some(&(_, o)) = SPELLINGS.iter().find(|(n, _)| *n == key) {
            return Ok(o);
        }
        let expected = format!(
            "{}; Hugging Face Trainer's {}; or a class path of torch.optim, bitsandbytes.optim or torchao.optim{}",
            Optimizer::all()
                .iter()
                .map(|o| o.name())
                .collect::<Vec<_>>()
                .join(", "),
            SPELLINGS
                .iter()
                .map(|(n, _)| *n)
                .filter(|n| n.contains('_') && !n.contains('.') && !n.starts_with("ao_"))
                .filter(|n| !["sgd_momentum", "paged_adamw8bit"].contains(n))
                .chain(["sgd", "adagrad", "rmsprop", "adafactor"])
                .collect::<Vec<_>>()
                .join(", "),
            if NOT_MODELLED.contains(&key.as_str()) {
                " (gpumem does not model this one)"
            } else {
                ""
            }
        );
        Err(UnknownName::new("optimizer", s.trim(), expected))
    }

    /// This optimizer run by `implementation`, where its library has it: torch.optim's Adam,
    /// AdamW and SGD have all three, Adagrad, RMSprop and Adafactor no fused kernel on CUDA;
    /// the others one implementation each (theirs). For a config's `fused`/`foreach` keys
    /// (see [`Implementation::from_flags`]).
    pub fn with_implementation(
        self,
        implementation: Implementation,
    ) -> Result<Optimizer, NoImplementation> {
        let looped = |l: fn(Loop) -> Optimizer| match implementation {
            Implementation::ForLoop => Ok(l(Loop::ForLoop)),
            Implementation::Foreach => Ok(l(Loop::Foreach)),
            Implementation::Fused => Err(NoImplementation {
                optimizer: self.name(),
                implementation,
            }),
        };
        match self {
            Optimizer::Adam(_) => Ok(Optimizer::Adam(implementation)),
            Optimizer::AdamW(_) => Ok(Optimizer::AdamW(implementation)),
            Optimizer::Sgd(_) => Ok(Optimizer::Sgd(implementation)),
            Optimizer::SgdMomentum(_) => Ok(Optimizer::SgdMomentum(implementation)),
            Optimizer::Adagrad(_) => looped(Optimizer::Adagrad),
            Optimizer::RmsProp(_) => looped(Optimizer::RmsProp),
            Optimizer::Adafactor(Adafactor::Torch(_)) => {
                looped(|l| Optimizer::Adafactor(Adafactor::Torch(l)))
            }
            _ if Some(implementation) == self.implementation() => Ok(self),
            _ => Err(NoImplementation {
                optimizer: self.name(),
                implementation,
            }),
        }
    }

    /// The torch.optim implementation of the step, where the optimizer has a choice.
    pub fn implementation(self) -> Option<Implementation> {
        match self {
            Optimizer::Adam(i)
            | Optimizer::AdamW(i)
            | Optimizer::Sgd(i)
            | Optimizer::SgdMomentum(i) => Some(i),
            Optimizer::Adagrad(l)
            | Optimizer::RmsProp(l)
            | Optimizer::Adafactor(Adafactor::Torch(l)) => Some(l.into()),
            // transformers' AdamW and Adafactor are for-loops; Muon steps one parameter at a
            // time.
            Optimizer::TransformersAdamW
            | Optimizer::Adafactor(Adafactor::Transformers)
            | Optimizer::Muon => Some(Implementation::ForLoop),
            Optimizer::Bnb(_) | Optimizer::Torchao(_) => None,
        }
    }

    /// A lower bound of the optimizer state a GPU holds per trainable element, for parameters
    /// of `word` bytes: torch's states are in the parameters' dtype; bitsandbytes' 8-bit and
    /// torchao's low-bit ones a byte (half for 4-bit) per element and moment; paged states and
    /// factored or 2-D-only ones may be none.
    pub fn state_floor(self, word: u64) -> u64 {
        match self {
            Optimizer::Adam(_) | Optimizer::AdamW(_) | Optimizer::TransformersAdamW => 2 * word,
            Optimizer::SgdMomentum(_) | Optimizer::Adagrad(_) | Optimizer::RmsProp(_) => word,
            Optimizer::Sgd(_) | Optimizer::Adafactor(_) | Optimizer::Muon => 0,
            Optimizer::Bnb(Bnb { paged: true, .. }) => 0,
            Optimizer::Bnb(b) => {
                let per_state = match b.bits {
                    BnbBits::Eight => 1,
                    BnbBits::ThirtyTwo => 4,
                };
                per_state
                    * if b.algorithm == BnbAlgorithm::Lion {
                        1
                    } else {
                        2
                    }
            }
            Optimizer::Torchao(Torchao::AdamW4bit) => 1,
            Optimizer::Torchao(_) => 2,
        }
    }

    /// The algorithm's family, for engines that run their own optimizer (DeepSpeed ZeRO):
    /// `adam`, `adamw`, `sgd`, `sgd-momentum`, or `None` for the others.
    pub fn zero_family(self) -> Option<&'static str> {
        match self {
            Optimizer::Adam(_) => Some("adam"),
            Optimizer::AdamW(_) | Optimizer::TransformersAdamW => Some("adamw"),
            Optimizer::Sgd(_) => Some("sgd"),
            Optimizer::SgdMomentum(_) => Some("sgd-momentum"),
            _ => None,
        }
    }
}

impl fmt::Display for Optimizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// An implementation an optimizer's library does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("optimizer {optimizer} has no {} implementation{}", implementation.name(), match implementation {
    Implementation::Fused => " (torch has no fused kernel for it on CUDA)",
    _ => " (its library runs its own kernels)",
})]
pub struct NoImplementation {
    pub optimizer: String,
    pub implementation: Implementation,
}
