//! What the seed's GPUMemNet knows of a native model: its layer counts and sizes (the learned
//! estimators' features come from these).

use super::ModelSpec;
use crate::graph::Activation;
use crate::job::Precision;

/// What the seed's GPUMemNet knows about a job: its layers and sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelFacts {
    /// Linear (and convolution) layers.
    pub depth: u64,
    pub activations_per_sample: u64,
    pub parameters: u64,
    pub batch: u64,
    pub linear: u64,
    pub conv: u64,
    pub batchnorm: u64,
    pub layernorm: u64,
    pub dropout: u64,
    pub activation: Activation,
}

impl ModelSpec {
    /// Its layers and sizes at `batch`, counted from its graph.
    pub fn facts(&self, batch: u64) -> ModelFacts {
        let spec = self;
        let g = spec.graph(batch, Precision::Fp32);
        let count =
            |names: &[&str]| g.nodes.iter().filter(|n| names.contains(&n.name)).count() as u64;
        let (linear, conv) = (count(&["addmm", "mm"]), count(&["conv2d"]));
        let activation = match spec {
            ModelSpec::Mlp(m) => m.act,
            ModelSpec::Cnn(c) => c.act,
            // PyTorch's Transformer layers use ReLU in their feed-forward.
            ModelSpec::Transformer(_) => Activation::Relu,
        };
        ModelFacts {
            depth: linear + conv,
            activations_per_sample: g.activations_per_sample,
            parameters: g.parameter_count(),
            batch,
            linear,
            conv,
            batchnorm: count(&["batch_norm"]),
            layernorm: count(&["layer_norm"]),
            dropout: count(&["native_dropout"]),
            activation,
        }
    }
}
