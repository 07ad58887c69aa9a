//! Features of a training job: the seed's (GPUMemNet's inputs) and gpumem's (from the trace).

use gpumem_core::estimate::{EstimateError, Estimator, Replay};
use gpumem_core::families::ModelFacts;
use gpumem_core::graph::Activation;
use gpumem_core::profile::GpuProfile;
use gpumem_core::trace::Trace;
use gpumem_core::units::bytes_to_mib;
use gpumem_core::utilization::{HostModel, Utilization, physical};
use serde::{Deserialize, Serialize};

/// Names of [`seed_features`], in order.
pub const SEED_FEATURES: [&str; 12] = [
    "depth",
    "activations_per_sample",
    "activations_x_batch",
    "parameters",
    "batch_size",
    "batchnorm_layers",
    "dropout_layers",
    "linear_layers",
    "conv_layers",
    "layernorm_layers",
    "activation_cos",
    "activation_sin",
];

/// The seed's features; the activation function is a point on a half circle (one angle per
/// function, so similar encodings are neighbours rather than one-hot strangers).
pub fn seed_features(f: &ModelFacts) -> Vec<f64> {
    let names = Activation::NAMES;
    let k = names
        .iter()
        .position(|n| *n == f.activation.name())
        .unwrap_or(names.len() - 1);
    let angle = std::f64::consts::PI * k as f64 / (names.len() - 1) as f64;
    vec![
        f.depth as f64,
        f.activations_per_sample as f64,
        (f.activations_per_sample * f.batch) as f64,
        f.parameters as f64,
        f.batch as f64,
        f.batchnorm as f64,
        f.dropout as f64,
        f.linear as f64,
        f.conv as f64,
        f.layernorm as f64,
        angle.cos(),
        angle.sin(),
    ]
}

/// Names of [`trace_features`], in order.
pub const TRACE_FEATURES: [&str; 15] = [
    "replay_peak_mib",
    "parameter_mib",
    "gradient_mib",
    "optimizer_state_mib",
    "activation_mib",
    "gflop_per_step",
    "kernels_per_step",
    "gbyte_moved_per_step",
    "physical_smact",
    "physical_smocc",
    "physical_gract",
    "physical_dram",
    "physical_fp32",
    "physical_step_ms",
    "host_share",
];

/// What gpumem computes from the trace on a profile: the replay and its breakdown, the kernels'
/// work, and the physical utilization model's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSummary {
    pub replay_peak_bytes: u64,
    pub replay_bound_bytes: u64,
    pub utilization: Utilization,
    pub features: Vec<f64>,
}

pub fn trace_summary(trace: &Trace, profile: &GpuProfile) -> Result<TraceSummary, EstimateError> {
    let est = Replay::default().estimate(trace, profile)?;
    let u = physical(trace, profile, &HostModel::default());
    let ops = trace.op_totals();
    let b = &est.breakdown;
    let gpu_s = u.gract * u.step_s;
    let features = vec![
        bytes_to_mib(est.peak_bytes),
        bytes_to_mib(b.parameters),
        bytes_to_mib(b.gradients),
        bytes_to_mib(b.optimizer_state),
        bytes_to_mib(b.activations),
        ops.flops as f64 / 1e9,
        ops.kernels as f64,
        ops.bytes as f64 / 1e9,
        u.smact,
        u.smocc,
        u.gract,
        u.dram,
        u.fp32,
        u.step_s * 1e3,
        if u.step_s > 0.0 {
            1.0 - gpu_s / u.step_s
        } else {
            0.0
        },
    ];
    Ok(TraceSummary {
        replay_peak_bytes: est.peak_bytes,
        replay_bound_bytes: est.upper_bound_bytes,
        utilization: u,
        features,
    })
}

/// Which features a model reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FeatureSet {
    /// GPUMemNet's: the seed's features only.
    Seed,
    /// The seed's plus the trace's.
    Full,
}

impl FeatureSet {
    pub fn names(self) -> Vec<String> {
        let seed = SEED_FEATURES.iter().map(|s| s.to_string());
        match self {
            FeatureSet::Seed => seed.collect(),
            FeatureSet::Full => seed
                .chain(TRACE_FEATURES.iter().map(|s| s.to_string()))
                .collect(),
        }
    }
}
