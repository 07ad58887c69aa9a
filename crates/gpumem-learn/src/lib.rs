//! gpumem-learn: learned estimators beside the computed ones.
//!
//! - [`features`]: a job's features — the seed's ([`gpumem_core::families::ModelFacts`] → GPUMemNet's
//!   inputs) and gpumem's from the trace ([`features::TraceSummary`]: replay peak and breakdown,
//!   FLOPs, kernels, bytes moved, the physical utilization model).
//! - [`data`]: measured datasets → [`data::Sample`]s with [`data::Target`]s (memory, SMACT,
//!   SMOCC, GRACT, DRAMA, FP32 activity).
//! - [`net`]: MLP and Transformer-encoder networks on candle; [`gbt`]: gradient-boosted trees.
//! - [`model`]: [`model::LearnedModel`], a versioned file. Two heads: GPUMemNet's memory-bin
//!   classifier ensemble (seed features only), and a correction of gpumem's own answer — the
//!   hybrid memory estimator (replay × (1 + learned relative residual), with a split-conformal
//!   upper bound of stated miss rate) and the utilization estimator (physical model + learned
//!   residual).
//! - [`hybrid`]: the hybrid as an [`gpumem_core::estimate::Estimator`] like the computed ones,
//!   and [`hybrid::estimator`], how every command selects an estimator by name.
//! - [`kfold`]: grouped k-fold cross validation with classification and regression scores.

pub mod data;
pub mod features;
pub mod gbt;
pub mod hybrid;
pub mod kfold;
pub mod model;
pub mod net;

pub use data::{Sample, Target};
pub use hybrid::{Hybrid, estimator};
pub use model::{Kind, LearnedModel, Prediction, Spec};
