//! Gradient-boosted regression trees (the `gbdt` crate: squared error, deterministic when every
//! row and feature is used).

use gbdt::config::{Config, Loss};
use gbdt::decision_tree::{Data, DataVec};
use gbdt::gradient_boost::GBDT;
use serde::{Deserialize, Serialize};

/// Booster knobs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GbtConfig {
    pub trees: usize,
    pub max_depth: u32,
    pub learning_rate: f32,
    pub min_leaf: usize,
}

impl Default for GbtConfig {
    fn default() -> Self {
        GbtConfig {
            trees: 300,
            max_depth: 5,
            learning_rate: 0.05,
            min_leaf: 5,
        }
    }
}

/// Training rows that cannot be boosted on: none, without features, or not one target per row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("gradient boosting needs rows with features and one target each")]
pub struct GbtInputError;

/// A trained booster.
#[derive(Serialize, Deserialize)]
pub struct Gbt {
    model: GBDT,
}

impl std::fmt::Debug for Gbt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gbt { .. }")
    }
}

fn rows(x: &[Vec<f32>], y: Option<&[f32]>) -> DataVec {
    x.iter()
        .enumerate()
        .map(|(i, r)| Data::new_training_data(r.clone(), 1.0, y.map_or(0.0, |y| y[i]), None))
        .collect()
}

impl Gbt {
    pub fn train(x: &[Vec<f32>], y: &[f32], cfg: &GbtConfig) -> Result<Gbt, GbtInputError> {
        let width = x.first().map_or(0, Vec::len);
        if x.is_empty() || width == 0 || x.len() != y.len() {
            return Err(GbtInputError);
        }
        let mut c = Config::new();
        c.set_feature_size(width);
        c.set_max_depth(cfg.max_depth);
        c.set_iterations(cfg.trees);
        c.set_shrinkage(cfg.learning_rate);
        c.set_min_leaf_size(cfg.min_leaf);
        c.set_loss(&gbdt::config::loss2string(&Loss::LAD));
        c.set_data_sample_ratio(1.0);
        c.set_feature_sample_ratio(1.0);
        c.set_training_optimization_level(2);
        let mut model = GBDT::new(&c);
        let mut data = rows(x, Some(y));
        model.fit(&mut data);
        Ok(Gbt { model })
    }

    pub fn predict(&self, x: &[Vec<f32>]) -> Vec<f32> {
        if x.is_empty() {
            return Vec::new();
        }
        self.model.predict(&rows(x, None))
    }
}
