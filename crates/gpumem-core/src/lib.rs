//! gpumem-core: how much GPU memory a training job will take, before it touches a GPU.
//!
//! The pipeline is `model → Trace → Estimator + GpuProfile → Estimate`:
//! - [`trace::Trace`]: the allocations, frees and kernels of a few training iterations, in order
//!   (read from a file, or produced by [`families`] through [`graph`] and [`step`]).
//! - [`allocator::CachingAllocator`]: PyTorch's CUDA caching allocator, byte-exact.
//! - [`profile::GpuProfile`]: a GPU and software stack as data (built-ins in profiles/gpus.toml).
//! - [`estimate::Estimator`]: [`estimate::Replay`] (allocator replay + fixed costs),
//!   [`estimate::LiveTensors`] and [`estimate::Horus`] baselines, all on the same trace.
//! - [`calibrate`] fits a profile's fixed cost from measurements; [`eval`] scores estimators;
//!   [`dataset`] reads measurement CSVs.
//!
//! ```
//! use gpumem_core::{estimate::{Estimator, Replay}, families::{JobOptions, ModelSpec}, profile};
//! let model = ModelSpec::parse("mlp:input=1024,output=10,depth=3,act=gelu").unwrap();
//! let trace = model.trace(&JobOptions::new(256)).unwrap();
//! let est = Replay::default().estimate(&trace, &profile::builtin("a100-40gb").unwrap()).unwrap();
//! assert!(est.fits && est.upper_bound_bytes >= est.peak_bytes);
//! ```

pub mod allocator;
pub mod calibrate;
pub mod dataset;
pub mod depth;
pub mod diff;
pub mod estimate;
pub mod eval;
pub mod families;
pub mod graph;
pub mod hub;
pub mod job;
pub mod model;
pub mod profile;
pub mod rng;
pub mod run;
pub mod search;
pub mod snapshot;
pub mod step;
pub mod symbolic;
#[cfg(test)]
mod toy;
pub mod trace;
pub mod units;
pub mod utilization;
pub mod workspace;

/// A name that is not one of the known choices (an optimizer, a precision, an activation, an
/// estimator, ...): `unknown WHAT `NAME` (expected EXPECTED)`. Shared by the crates that parse
/// names from the command line and from files.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} `{name}` (expected {expected})")]
pub struct UnknownName {
    /// What kind of name (`optimizer`, `precision`, ...).
    pub what: &'static str,
    /// The name as given.
    pub name: String,
    /// The names accepted, as a phrase (`adam, adamw, sgd or sgd-momentum`).
    pub expected: String,
}

impl UnknownName {
    pub fn new(what: &'static str, name: &str, expected: impl Into<String>) -> Self {
        UnknownName {
            what,
            name: name.to_string(),
            expected: expected.into(),
        }
    }
}
