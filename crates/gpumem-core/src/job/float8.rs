//! Float8 training of a model's linear layers, as torchtitan's float8 converter applies it:
//! torchao's own `Float8Linear` (traced where torchao is installed) in place of each
//! `nn.Linear` whose dimensions are multiples of 16, the output head kept in 16 bits.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// torchao's scaling recipe (`Float8LinearConfig.from_recipe_name`), by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Float8Recipe {
    /// One scale per tensor (torchao's and torchtitan's default).
    Tensorwise,
    /// One scale per row.
    Rowwise,
    /// Rowwise, the weight's gradient computed in high precision.
    RowwiseWithGwHp,
}

impl Float8Recipe {
    pub const NAMES: [&'static str; 3] = ["tensorwise", "rowwise", "rowwise_with_gw_hp"];

    pub fn name(self) -> &'static str {
        match self {
            Float8Recipe::Tensorwise => Self::NAMES[0],
            Float8Recipe::Rowwise => Self::NAMES[1],
            Float8Recipe::RowwiseWithGwHp => Self::NAMES[2],
        }
    }

    /// `None` for a name that is none of [`Self::NAMES`].
    pub fn parse(name: &str) -> Option<Float8Recipe> {
        [
            Float8Recipe::Tensorwise,
            Float8Recipe::Rowwise,
            Float8Recipe::RowwiseWithGwHp,
        ]
        .into_iter()
        .find(|r| r.name() == name)
    }
}

/// Float8 training: the recipe, and whether FSDP2 gathers the weights in float8 (torchtitan's
/// `enable_fsdp_float8_all_gather`, tensorwise only, with their scales precomputed after each
/// optimizer step). [`super::OptionValues::check`] holds that the gathers are FSDP's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Float8 {
    pub recipe: Float8Recipe,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fsdp_all_gather: bool,
}
