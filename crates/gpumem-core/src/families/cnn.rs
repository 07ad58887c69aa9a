//! The seed's CNN family (GPUMemNet `NeuroNetGen_scripts/CNN/cnn.py`).

use std::fmt;

use super::{Keys, SeedValues, SpecError};
use crate::graph::{Activation, Dtype, Graph, GraphBuilder, LayerParams, NormParams, TensorId};
use crate::job::Precision;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CnnArch {
    Pyramid,
    ReversePyramid,
    Uniform,
    Bottleneck,
    Gradual,
    Hourglass,
    Residual,
    Dense,
}

const ARCHS: [(&str, CnnArch); 8] = [
    ("pyramid", CnnArch::Pyramid),
    ("reverse_pyramid", CnnArch::ReversePyramid),
    ("uniform", CnnArch::Uniform),
    ("bottleneck", CnnArch::Bottleneck),
    ("gradual", CnnArch::Gradual),
    ("hourglass", CnnArch::Hourglass),
    ("residual", CnnArch::Residual),
    ("dense", CnnArch::Dense),
];

const MAX_FILTERS: f64 = 2048.0;

/// A CNN of the seed's family.
#[derive(Debug, Clone, PartialEq)]
pub struct Cnn {
    pub channels: u64,
    pub classes: u64,
    pub filters: u64,
    pub depth: u64,
    /// Square input side.
    pub input: u64,
    pub arch: CnnArch,
    pub act: Activation,
    pub dropout: f64,
    pub batchnorm: bool,
    pub pooling: bool,
    /// Pool (dense: a transition) every this many blocks; 0 = the seed's depth-based interval;
    /// `None`: not stated — 5, and for a dense network ambiguous (see [`Cnn::alternatives`]).
    pub pool_every: Option<u64>,
    pub samples: Option<u64>,
    /// The seed's full-batch torchinfo summary (a no-grad forward) before training.
    pub summary: bool,
}

/// The pooling interval a spec without `pool_every` has (one of a dense spec's two readings).
const DEFAULT_POOL_EVERY: u64 = 5;

impl Cnn {
    pub(crate) fn from_keys(kv: &mut Keys) -> Result<Self, SpecError> {
        let arch_name = kv.word("arch", Some("pyramid"))?;
        let arch = ARCHS
            .iter()
            .find(|(n, _)| *n == arch_name)
            .map(|&(_, a)| a)
            .ok_or_else(|| SpecError::UnknownChoice {
                family: "cnn",
                key: "arch",
                value: arch_name.clone(),
                expected: ARCHS.map(|(n, _)| n).join(", "),
            })?;
        let act = Activation::parse(&kv.word("act", Some("relu"))?)?;
        let c = Cnn {
            channels: kv.uint("channels", Some(3), 1, 64)?,
            classes: kv.uint("classes", None, 1, 1 << 20)?,
            filters: kv.uint("filters", None, 1, 2048)?,
            depth: kv.uint("depth", None, 1, 200)?,
            input: kv.uint("input", None, 8, 4096)?,
            arch,
            act,
            dropout: kv.float("dropout", 0.0, 0.0, 0.999)?,
            batchnorm: kv.boolean("batchnorm", false)?,
            pooling: kv.boolean("pooling", true)?,
            pool_every: kv.optional_uint("pool_every", 0, 1000)?,
            samples: match kv.uint("samples", Some(0), 0, 1 << 40)? {
                0 => None,
                n => Some(n),
            },
            summary: kv.boolean("summary", false)?,
        };
        if c.act == Activation::Identity {
            return Err(SpecError::CnnIdentity);
        }
        Ok(c)
    }

    /// Rebuilds a row of the seed's CNN dataset from its `Filename` (`input_channels:C_
    /// num_classes:K_depth:D_arch:A_base_filters:F_batch:B_input_size:S_act:ACT_dropout:P_
    /// dropout:USE_batchnorm:USE.out`) with the seed's loop: no pooling layers (its launcher
    /// never asked for them), 4,096 samples, the full-batch summary first. Returns the model and
    /// batch size. A dense row's transition interval was drawn at random and not recorded: this
    /// gives the depth rule's (`pool_every = 0`).
    pub fn from_seed_filename(name: &str) -> Result<(Cnn, u64), SpecError> {
        const KEYS: [&str; 11] = [
            "input_channels:",
            "num_classes:",
            "depth:",
            "arch:",
            "base_filters:",
            "batch:",
            "input_size:",
            "act:",
            "dropout:",
            "dropout:",
            "batchnorm:",
        ];
        let v = SeedValues::read(name, &KEYS)?;
        let arch = ARCHS
            .iter()
            .find(|(n, _)| *n == v.word(3))
            .map(|&(_, a)| a)
            .ok_or_else(|| SpecError::UnknownChoice {
                family: "cnn",
                key: "arch",
                value: v.word(3).to_string(),
                expected: ARCHS.map(|(n, _)| n).join(", "),
            })?;
        let cnn = Cnn {
            channels: v.uint(0)?,
            classes: v.uint(1)?,
            filters: v.uint(4)?.min(MAX_FILTERS as u64),
            depth: v.uint(2)?,
            input: v.uint(6)?,
            arch,
            act: Activation::parse(v.word(7))?,
            dropout: if v.flag(9) { v.rate(8)? } else { 0.0 },
            batchnorm: v.flag(10),
            pooling: false,
            pool_every: Some(0),
            samples: Some(4096),
            summary: true,
        };
        Ok((cnn, v.uint(5)?))
    }

    /// The seed's dense runs drew their transition interval at random (5 or the depth rule) and
    /// did not record it: a dense spec without `pool_every` means either network, both given
    /// here; any other spec means itself.
    pub fn alternatives(&self) -> Vec<Cnn> {
        if self.arch != CnnArch::Dense || self.pool_every.is_some() {
            return vec![self.clone()];
        }
        [DEFAULT_POOL_EVERY, 0]
            .map(|n| Cnn {
                pool_every: Some(n),
                ..self.clone()
            })
            .to_vec()
    }

    fn pooling_interval(&self) -> u64 {
        let every = self.pool_every.unwrap_or(DEFAULT_POOL_EVERY);
        if every > 0 {
            return every;
        }
        let total = ((self.input / 7).max(1) as f64).log2().floor().max(1.0);
        ((self.depth as f64 / total).ceil() as u64).max(1)
    }

    /// Output channels of plain block `i` (all archs but residual and dense).
    fn plain_channels(&self, i: u64) -> u64 {
        let (base, d) = (self.filters as f64, self.depth as f64);
        let i = i as f64;
        let grow = |exp: f64| (MAX_FILTERS / base).powf(exp);
        let v = match self.arch {
            CnnArch::Pyramid => (base * grow(1.0 / d).powf(i)).min(MAX_FILTERS),
            CnnArch::ReversePyramid => (base / grow(1.0 / d).powf(i)).max(1.0),
            CnnArch::Uniform => base,
            CnnArch::Gradual => (base * grow(1.0 / (2.0 * d)).powf(i)).min(MAX_FILTERS),
            CnnArch::Bottleneck => {
                let g = if self.depth <= 2 {
                    2.0
                } else {
                    grow(1.0 / (d - 1.0))
                };
                if i == 0.0 {
                    base * 2.0
                } else {
                    (base * g.powf(i - 1.0)).min(MAX_FILTERS)
                }
            }
            CnnArch::Hourglass => {
                let contracting = (self.depth / 2) as f64;
                let expanding = d - contracting;
                if i < contracting {
                    (base * grow(1.0 / contracting).powf(i)).min(MAX_FILTERS)
                } else {
                    (base * grow(1.0 / expanding).powf(d - i - 1.0)).max(base)
                }
            }
            CnnArch::Residual | CnnArch::Dense => base,
        };
        // Python's int() truncates; the float may sit a hair below an integer.
        (v + 1e-9).floor().max(1.0) as u64
    }

    /// ConvBlock: conv 3×3 (or k), optional BatchNorm2d, activation, optional dropout.
    #[allow(clippy::too_many_arguments)]
    fn conv_block(
        &self,
        g: &mut GraphBuilder,
        x: TensorId,
        b: u64,
        cin: u64,
        cout: u64,
        hw: u64,
        k: u64,
        stride: u64,
        pad: u64,
        dropout: bool,
        act: Activation,
    ) -> (TensorId, u64) {
        let (mut y, hw) = g.conv2d(x, b, cin, cout, hw, k, stride, pad, true);
        if self.batchnorm {
            y = g.batch_norm(y, cout);
        }
        y = g.activation(y, act);
        if dropout {
            y = g.dropout(y, self.dropout);
        }
        (y, hw)
    }

    /// A 3×3 ConvBlock whose parameters were registered already.
    #[allow(clippy::too_many_arguments)]
    fn conv_block_with(
        &self,
        g: &mut GraphBuilder,
        x: TensorId,
        (conv, norm): (LayerParams, Option<NormParams>),
        b: u64,
        cin: u64,
        cout: u64,
        hw: u64,
        stride: u64,
        dropout: bool,
    ) -> (TensorId, u64) {
        let (mut y, hw) = g.conv2d_with(x, conv, b, cin, cout, hw, 3, stride, 1);
        if let Some(n) = norm {
            y = g.batch_norm_with(y, n, cout);
        }
        y = g.activation(y, self.act);
        if dropout {
            y = g.dropout(y, self.dropout);
        }
        (y, hw)
    }

    pub fn graph(&self, batch: u64, precision: Precision) -> Graph {
        let mut g = GraphBuilder::new(precision);
        let b = batch;
        let x0 = g.input(b * self.channels * self.input * self.input, Dtype::F32);
        let labels = g.input(b, Dtype::I64);
        let (mut x, mut c, mut hw) = (x0, self.channels, self.input);
        let drop = self.dropout > 0.0;
        let mut acts = 0u64;
        match self.arch {
            CnnArch::Residual => {
                let growth = (MAX_FILTERS / self.filters as f64).powf(1.0 / self.depth as f64);
                for i in 0..self.depth / 2 {
                    let out = ((self.filters as f64 * growth.powi(i as i32) + 1e-9).floor())
                        .min(MAX_FILTERS) as u64;
                    let stride = if i % 2 == 1 && hw > 7 { 2 } else { 1 };
                    // Parameters in definition order (conv1, conv2, shortcut); the shortcut runs first.
                    let bn = self.batchnorm;
                    let c1 = (
                        g.conv_params(c, out, 3, true),
                        bn.then(|| g.batch_norm_params(out)),
                    );
                    let c2 = (
                        g.conv_params(out, out, 3, true),
                        bn.then(|| g.batch_norm_params(out)),
                    );
                    let shortcut = (c != out || stride != 1).then(|| {
                        (
                            g.conv_params(c, out, 1, true),
                            bn.then(|| g.batch_norm_params(out)),
                        )
                    });
                    let residual = match shortcut {
                        Some((conv, norm)) => {
                            let (mut s, _) = g.conv2d_with(x, conv, b, c, out, hw, 1, stride, 0);
                            if let Some(n) = norm {
                                s = g.batch_norm_with(s, n, out);
                            }
                            s
                        }
                        None => x,
                    };
                    let (y, h1) = self.conv_block_with(&mut g, x, c1, b, c, out, hw, stride, drop);
                    let (y, h2) = self.conv_block_with(&mut g, y, c2, b, out, out, h1, 1, drop);
                    x = g.add(y, residual);
                    acts += 2 * out * h2 * h2;
                    c = out;
                    hw = h2;
                    if hw <= 7 {
                        break;
                    }
                }
            }
            CnnArch::Dense => {
                let units = self.depth / 4;
                let every = self.pooling_interval();
                for i in 0..units {
                    let mut features = vec![x];
                    for l in 0..4u64 {
                        let inp = if features.len() == 1 {
                            features[0]
                        } else {
                            g.cat(&features)
                        };
                        let (y, _) = self.conv_block(
                            &mut g,
                            inp,
                            b,
                            c + l * 32,
                            32,
                            hw,
                            3,
                            1,
                            1,
                            drop,
                            self.act,
                        );
                        features.push(y);
                        acts += 32 * hw * hw;
                    }
                    x = g.cat(&features);
                    c += 128;
                    if i % every == 0 && i != units - 1 {
                        let (y, _) = self.conv_block(
                            &mut g,
                            x,
                            b,
                            c,
                            c / 2,
                            hw,
                            1,
                            1,
                            0,
                            false,
                            Activation::Relu,
                        );
                        x = y;
                        c /= 2;
                        if hw > 1 {
                            let (y, h) = g.avg_pool2d(x, b, c, hw);
                            x = y;
                            hw = h;
                        }
                    }
                }
            }
            _ => {
                let every = self.pooling_interval();
                for i in 0..self.depth {
                    let out = self.plain_channels(i);
                    let (y, h) = self.conv_block(&mut g, x, b, c, out, hw, 3, 1, 1, drop, self.act);
                    x = y;
                    hw = h;
                    c = out;
                    acts += out * hw * hw;
                    if self.pooling && i % every == 0 && i != 0 && hw > 7 {
                        let (y, h) = g.max_pool2d(x, b, c, hw);
                        x = y;
                        hw = h;
                    }
                }
            }
        }
        let pooled = g.global_avg_pool(x, b, c);
        let logits = g.linear(pooled, c, self.classes, true);
        let out = if self.classes > 1 {
            g.softmax(logits)
        } else {
            g.activation(logits, Activation::Sigmoid)
        };
        acts += c + 2 * self.classes;
        g.end_model(out);
        g.set_activations_per_sample(acts);
        let loss = g.cross_entropy(out, labels);
        g.finish(loss)
    }
}

impl fmt::Display for Cnn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let arch = ARCHS
            .iter()
            .find(|(_, a)| *a == self.arch)
            .map(|(n, _)| *n)
            .unwrap_or("pyramid");
        let act = self.act.name();
        write!(
            f,
            "cnn:channels={},classes={},filters={},depth={},input={},arch={},act={},dropout={},batchnorm={},pooling={}",
            self.channels,
            self.classes,
            self.filters,
            self.depth,
            self.input,
            arch,
            act,
            self.dropout,
            self.batchnorm,
            self.pooling
        )?;
        if let Some(n) = self.pool_every {
            write!(f, ",pool_every={n}")?;
        }
        super::write_loop_keys(f, self.samples, self.summary)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::families::ModelSpec;

    fn cnn(s: &str) -> Cnn {
        match ModelSpec::parse(s).unwrap() {
            ModelSpec::Cnn(c) => c,
            _ => unreachable!(),
        }
    }

    #[test]
    fn channel_schedules_follow_the_seed() {
        let c = cnn("cnn:classes=10,filters=32,depth=4,input=64,arch=pyramid");
        // growth (2048/32)^(1/4) = 2.828…
        assert_eq!(
            (0..4).map(|i| c.plain_channels(i)).collect::<Vec<_>>(),
            vec![32, 90, 256, 724]
        );
        let c = cnn("cnn:classes=10,filters=64,depth=4,input=64,arch=bottleneck");
        assert_eq!(c.plain_channels(0), 128);
        assert_eq!(c.plain_channels(1), 64);
        let c = cnn("cnn:classes=10,filters=64,depth=4,input=64,arch=hourglass");
        assert_eq!(
            (0..4).map(|i| c.plain_channels(i)).collect::<Vec<_>>(),
            vec![64, 362, 362, 64]
        );
    }

    #[test]
    fn convolutions_name_their_workspaces_as_the_tracer_does() {
        use crate::families::JobOptions;
        use crate::trace::{ConvPass, Event};
        let t = ModelSpec::parse("cnn:classes=10,filters=16,depth=2,input=32,arch=uniform")
            .unwrap()
            .trace(&JobOptions::new(4))
            .unwrap();
        let passes = |key: &str| {
            let mut p: Vec<ConvPass> = t
                .events()
                .iter()
                .filter_map(|ev| match *ev {
                    Event::Workspace {
                        conv, n: 4, pass, ..
                    } if t.op_name(conv) == key => Some(pass),
                    _ => None,
                })
                .collect();
            p.sort();
            p.dedup();
            p
        };
        let first = "in=3x32x32;w=16x3x3x3;stride=1x1;pad=1x1;dil=1x1;groups=1;dtype=float32;layout=contiguous";
        let second = "in=16x32x32;w=16x16x3x3;stride=1x1;pad=1x1;dil=1x1;groups=1;dtype=float32;layout=contiguous";
        // The image needs no gradient: the first convolution has no backward-data pass.
        assert_eq!(
            passes(first),
            vec![ConvPass::Forward, ConvPass::BackwardFilter]
        );
        assert_eq!(passes(second), ConvPass::ALL.to_vec());
        assert!(t.runs_convolutions());
    }

    #[test]
    fn every_arch_builds_a_trainable_graph() {
        for (name, _) in ARCHS {
            let c = cnn(&format!(
                "cnn:classes=10,filters=16,depth=8,input=32,arch={name},batchnorm=true,dropout=0.1"
            ));
            let g = c.graph(4, Precision::Fp32);
            assert!(g.parameter_count() > 0, "{name}");
            assert!(g.nodes.iter().any(|n| n.name == "conv2d"), "{name}");
        }
    }
}
