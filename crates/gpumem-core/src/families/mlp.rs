//! The seed's MLP family (GPUMemNet `mlp_next.py`).

use std::fmt;

use super::{Keys, SeedValues, SpecError};
use crate::graph::{Activation, Dtype, Graph, GraphBuilder};
use crate::job::Precision;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpArch {
    Pyramid,
    Uniform,
    Bottleneck,
    Gradual,
}

impl MlpArch {
    fn parse(s: &str) -> Result<Self, SpecError> {
        Ok(match s {
            "pyramid" => MlpArch::Pyramid,
            "uniform" => MlpArch::Uniform,
            "bottleneck" => MlpArch::Bottleneck,
            "gradual" => MlpArch::Gradual,
            other => {
                return Err(SpecError::UnknownChoice {
                    family: "mlp",
                    key: "arch",
                    value: other.into(),
                    expected: "pyramid, uniform, bottleneck or gradual".into(),
                });
            }
        })
    }
    fn name(self) -> &'static str {
        match self {
            MlpArch::Pyramid => "pyramid",
            MlpArch::Uniform => "uniform",
            MlpArch::Bottleneck => "bottleneck",
            MlpArch::Gradual => "gradual",
        }
    }
}

/// The output layer's activation when `output == 1` (the seed picks one at random).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlpHead {
    Sigmoid,
    Identity,
}

/// An MLP of the seed's family.
#[derive(Debug, Clone, PartialEq)]
pub struct Mlp {
    pub input: u64,
    pub output: u64,
    pub depth: u64,
    pub arch: MlpArch,
    pub act: Activation,
    /// Dropout rate; 0 means no dropout layers.
    pub dropout: f64,
    pub batchnorm: bool,
    pub head: MlpHead,
    /// Dataset size (the epoch's short last batch is replayed); `None` = every batch full.
    pub samples: Option<u64>,
    /// Run the seed's torchsummary forward (batch 2) before training.
    pub summary: bool,
}

const MAX_WIDTH: u64 = 1 << 20;

impl Mlp {
    pub(crate) fn from_keys(kv: &mut Keys) -> Result<Self, SpecError> {
        let input = kv.uint("input", None, 1, MAX_WIDTH)?;
        let output = kv.uint("output", None, 1, MAX_WIDTH)?;
        let depth = kv.uint("depth", None, 1, 1000)?;
        let arch = MlpArch::parse(&kv.word("arch", Some("pyramid"))?)?;
        let act = Activation::parse(&kv.word("act", Some("relu"))?)?;
        let dropout = kv.float("dropout", 0.0, 0.0, 0.999)?;
        let batchnorm = kv.boolean("batchnorm", false)?;
        let head = match kv.word("head", Some("identity"))?.as_str() {
            "sigmoid" => MlpHead::Sigmoid,
            "identity" => MlpHead::Identity,
            other => {
                return Err(SpecError::UnknownChoice {
                    family: "mlp",
                    key: "head",
                    value: other.into(),
                    expected: "sigmoid or identity".into(),
                });
            }
        };
        let samples = match kv.uint("samples", Some(0), 0, 1 << 40)? {
            0 => None,
            n => Some(n),
        };
        let summary = kv.boolean("summary", false)?;
        Ok(Mlp {
            input,
            output,
            depth,
            arch,
            act,
            dropout,
            batchnorm,
            head,
            samples,
            summary,
        })
    }

    /// Rebuilds a row of the seed's dataset from its `Filename`
    /// (`input:I_output:O_depth:D_arch:A_batch:B_act:F_dropout:P_dropout:USE_batchnorm:USE.out`),
    /// with the seed's loop: 4,096 samples, torchsummary first. Returns the model and batch size.
    pub fn from_seed_filename(name: &str) -> Result<(Mlp, u64), SpecError> {
        const KEYS: [&str; 9] = [
            "input:",
            "output:",
            "depth:",
            "arch:",
            "batch:",
            "act:",
            "dropout:",
            "dropout:",
            "batchnorm:",
        ];
        let v = SeedValues::read(name, &KEYS)?;
        let mlp = Mlp {
            input: v.uint(0)?,
            output: v.uint(1)?,
            depth: v.uint(2)?,
            arch: MlpArch::parse(v.word(3))?,
            act: Activation::parse(v.word(5)).unwrap_or(Activation::Relu),
            dropout: if v.flag(7) { v.rate(6)? } else { 0.0 },
            batchnorm: v.flag(8),
            head: MlpHead::Identity,
            samples: Some(4096),
            summary: true,
        };
        Ok((mlp, v.uint(4)?))
    }

    /// (in, out) of every hidden block, then of the output layer.
    pub fn layer_sizes(&self) -> Vec<(u64, u64)> {
        let (i, o, d) = (self.input, self.output, self.depth);
        let mut v = Vec::new();
        let mut inf = i;
        match self.arch {
            MlpArch::Pyramid | MlpArch::Bottleneck => {
                let blocks = if self.arch == MlpArch::Bottleneck {
                    d + 1
                } else {
                    d
                };
                for _ in 0..blocks {
                    let out = (inf / 2).max(o);
                    v.push((inf, out));
                    inf = out;
                }
            }
            MlpArch::Uniform => v.extend((0..d).map(|_| (i, i))),
            MlpArch::Gradual => {
                let dec = i.saturating_sub(o) / d;
                for _ in 0..d {
                    let out = inf.saturating_sub(dec).max(o);
                    v.push((inf, out));
                    inf = out;
                }
            }
        }
        v.push((inf, o));
        v
    }

    pub fn graph(&self, batch: u64, precision: Precision) -> Graph {
        let mut g = GraphBuilder::new(precision);
        let x0 = g.input(batch * self.input, Dtype::F32);
        let labels = g.input(batch, Dtype::I64);
        let sizes = self.layer_sizes();
        let mut x = x0;
        let mut acts = 0;
        for &(i, o) in &sizes[..sizes.len() - 1] {
            x = g.linear(x, i, o, true);
            acts += o;
            if self.batchnorm {
                x = g.batch_norm(x, o);
                acts += o;
            }
            x = g.activation(x, self.act);
            acts += o;
            if self.dropout > 0.0 {
                x = g.dropout(x, self.dropout);
                acts += o;
            }
        }
        let (i, o) = sizes[sizes.len() - 1];
        x = g.linear(x, i, o, true);
        acts += 2 * o;
        let out = if o > 1 {
            g.softmax(x)
        } else if self.head == MlpHead::Sigmoid {
            g.activation(x, Activation::Sigmoid)
        } else {
            x
        };
        g.end_model(out);
        g.set_activations_per_sample(acts);
        let loss = if o > 1 {
            g.cross_entropy(out, labels)
        } else {
            // labels = labels.view(-1, 1).float()
            let lf = g.node(
                "to_copy",
                &[labels],
                &[(batch, Dtype::F32)],
                &[],
                &[],
                0,
                false,
            )[0];
            g.rebind(labels, lf);
            g.bce_with_logits(out, lf)
        };
        g.finish(loss)
    }
}

impl fmt::Display for Mlp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let act = self.act.name();
        write!(
            f,
            "mlp:input={},output={},depth={},arch={},act={},dropout={},batchnorm={}",
            self.input,
            self.output,
            self.depth,
            self.arch.name(),
            act,
            self.dropout,
            self.batchnorm
        )?;
        if self.output == 1 && self.head == MlpHead::Sigmoid {
            write!(f, ",head=sigmoid")?;
        }
        super::write_loop_keys(f, self.samples, self.summary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_filename_rebuilds_the_network() {
        let (m, b) = Mlp::from_seed_filename("input:2346_output:197_depth:2_arch:pyramid_batch:996_act:relu_dropout:0.3382392352475416_dropout:True_batchnorm:True.out").unwrap();
        assert_eq!(b, 996);
        assert_eq!(m.layer_sizes(), vec![(2346, 1173), (1173, 586), (586, 197)]);
        let g = m.graph(b, Precision::Fp32);
        // The dataset's Total Parameters and Total Activations for this row.
        assert_eq!(g.parameter_count(), 3_560_152);
        assert_eq!(g.activations_per_sample, 7430);
        let (m, _) = Mlp::from_seed_filename("input:100_output:7_depth:3_arch:gradual_batch:8_act:leaky_relu_dropout:0.2_dropout:False_batchnorm:False.out").unwrap();
        assert_eq!(m.act, Activation::LeakyRelu);
        assert_eq!(m.dropout, 0.0);
        assert_eq!(m.layer_sizes(), vec![(100, 69), (69, 38), (38, 7), (7, 7)]);
        assert_eq!(
            Mlp::from_seed_filename("input:x_output:1")
                .unwrap_err()
                .to_string(),
            "seed filename `input:x_output:1`: missing `depth:`"
        );
        let e = Mlp::from_seed_filename("input:x_output:1_depth:2_arch:pyramid_batch:8_act:relu_dropout:0.2_dropout:False_batchnorm:False.out").unwrap_err();
        assert!(
            e.to_string()
                .ends_with(".out`: input `x` is not a whole number"),
            "{e}"
        );
    }

    #[test]
    fn bottleneck_and_uniform_shapes() {
        let m = Mlp::from_keys(
            &mut Keys::parse("mlp", "input=64,output=4,depth=2,arch=bottleneck").unwrap(),
        )
        .unwrap();
        assert_eq!(m.layer_sizes(), vec![(64, 32), (32, 16), (16, 8), (8, 4)]);
        let m = Mlp::from_keys(
            &mut Keys::parse("mlp", "input=64,output=4,depth=2,arch=uniform").unwrap(),
        )
        .unwrap();
        assert_eq!(m.layer_sizes(), vec![(64, 64), (64, 64), (64, 4)]);
    }
}
