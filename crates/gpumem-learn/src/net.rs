//! Small neural networks on candle (CPU): GPUMemNet's MLP and Transformer-encoder models.
//!
//! Weights are plain [`Var`]s initialised from a seeded generator (so training is reproducible)
//! and stored as [`NetWeights`] (names, shapes, values) inside a model file.

use candle_core::{Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use gpumem_core::rng::SplitMix64;
use serde::{Deserialize, Serialize};

/// Network shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "kind")]
pub enum Arch {
    /// Fully connected, ReLU and dropout between layers.
    Mlp { hidden: Vec<usize> },
    /// Each feature is a token (a learned per-feature embedding of its value); pre-norm encoder
    /// layers; mean pooling; a linear head.
    Transformer {
        d_model: usize,
        heads: usize,
        layers: usize,
    },
}

/// Training knobs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainConfig {
    pub epochs: usize,
    pub batch_size: usize,
    pub lr: f64,
    pub weight_decay: f64,
    pub dropout: f64,
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            epochs: 150,
            batch_size: 64,
            lr: 2e-3,
            weight_decay: 1e-4,
            dropout: 0.1,
            seed: 1,
        }
    }
}

/// What the network is fitted to.
pub enum Labels<'a> {
    /// Class indices (cross-entropy).
    Classes(&'a [u32], usize),
    /// Values (mean squared error).
    Values(&'a [f32]),
}

/// Stored weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NetWeights {
    pub arch: Arch,
    pub inputs: usize,
    pub outputs: usize,
    pub tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
}

/// A network ready to run or train.
#[derive(Debug)]
pub struct Net {
    arch: Arch,
    inputs: usize,
    outputs: usize,
    params: Vec<(String, Var)>,
}

/// A network that cannot be built, loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("d_model {d_model} is not a multiple of {heads} heads")]
    Heads { d_model: usize, heads: usize },
    #[error("model weights: expected {expected} tensors, found {found}")]
    TensorCount { expected: usize, found: usize },
    #[error("model weights: tensor `{stored}` {shape:?} does not fit `{name}` {dims:?}")]
    TensorShape {
        stored: String,
        shape: Vec<usize>,
        name: String,
        dims: Vec<usize>,
    },
    #[error("no training rows")]
    NoRows,
    #[error("a row has {found} features; the network takes {width}")]
    RowWidth { found: usize, width: usize },
}

type Result<T> = std::result::Result<T, NetError>;

/// Creates a network's parameters in a fixed order from a seeded generator.
struct Init {
    rng: SplitMix64,
    params: Vec<(String, Var)>,
}

impl Init {
    fn tensor(
        &mut self,
        name: &str,
        shape: &[usize],
        fan_in: usize,
        fill: Option<f32>,
    ) -> Result<()> {
        let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| fill.unwrap_or(((self.rng.unit() * 2.0 - 1.0) * bound) as f32))
            .collect();
        let t = Tensor::from_vec(v, shape, &Device::Cpu)?;
        self.params.push((name.to_string(), Var::from_tensor(&t)?));
        Ok(())
    }

    fn linear(&mut self, name: &str, inputs: usize, outputs: usize) -> Result<()> {
        self.tensor(&format!("{name}.w"), &[outputs, inputs], inputs, None)?;
        self.tensor(&format!("{name}.b"), &[outputs], inputs, None)
    }

    fn layer_norm(&mut self, name: &str, width: usize) -> Result<()> {
        self.tensor(&format!("{name}.g"), &[width], 1, Some(1.0))?;
        self.tensor(&format!("{name}.b"), &[width], 1, Some(0.0))
    }
}

impl Net {
    /// A freshly initialised network (uniform ±1/√fan_in, LayerNorm gains 1).
    pub fn new(arch: Arch, inputs: usize, outputs: usize, seed: u64) -> Result<Net> {
        let mut init = Init {
            rng: SplitMix64(seed),
            params: Vec::new(),
        };
        match &arch {
            Arch::Mlp { hidden } => {
                let mut width = inputs;
                for (k, &h) in hidden.iter().enumerate() {
                    init.linear(&format!("l{k}"), width, h)?;
                    width = h;
                }
                init.linear("out", width, outputs)?;
            }
            Arch::Transformer {
                d_model,
                heads,
                layers,
            } => {
                if *heads == 0 || d_model % heads != 0 {
                    return Err(NetError::Heads {
                        d_model: *d_model,
                        heads: *heads,
                    });
                }
                let d = *d_model;
                init.tensor("emb.w", &[inputs, d], 1, None)?;
                init.tensor("emb.b", &[inputs, d], 1, None)?;
                for l in 0..*layers {
                    for ln in ["ln1", "ln2"] {
                        init.layer_norm(&format!("b{l}.{ln}"), d)?;
                    }
                    for p in ["q", "k", "v", "o"] {
                        init.linear(&format!("b{l}.{p}"), d, d)?;
                    }
                    init.linear(&format!("b{l}.ff1"), d, 2 * d)?;
                    init.linear(&format!("b{l}.ff2"), 2 * d, d)?;
                }
                init.layer_norm("lnf", d)?;
                init.linear("out", d, outputs)?;
            }
        }
        Ok(Net {
            arch,
            inputs,
            outputs,
            params: init.params,
        })
    }

    pub fn from_weights(w: &NetWeights) -> Result<Net> {
        let mut net = Net::new(w.arch.clone(), w.inputs, w.outputs, 0)?;
        if net.params.len() != w.tensors.len() {
            return Err(NetError::TensorCount {
                expected: net.params.len(),
                found: w.tensors.len(),
            });
        }
        for ((name, var), (wn, shape, values)) in net.params.iter_mut().zip(&w.tensors) {
            if name != wn
                || var.dims() != shape.as_slice()
                || values.len() != shape.iter().product::<usize>()
            {
                return Err(NetError::TensorShape {
                    stored: wn.clone(),
                    shape: shape.clone(),
                    name: name.clone(),
                    dims: var.dims().to_vec(),
                });
            }
            *var = Var::from_tensor(&Tensor::from_vec(
                values.clone(),
                shape.as_slice(),
                &Device::Cpu,
            )?)?;
        }
        Ok(net)
    }

    pub fn weights(&self) -> Result<NetWeights> {
        let tensors = self
            .params
            .iter()
            .map(|(n, v)| {
                Ok((
                    n.clone(),
                    v.dims().to_vec(),
                    v.as_tensor()
                        .flatten_all()
                        .and_then(|t| t.to_vec1::<f32>())?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(NetWeights {
            arch: self.arch.clone(),
            inputs: self.inputs,
            outputs: self.outputs,
            tensors,
        })
    }

    fn p(&self, name: &str) -> &Tensor {
        self.params
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_tensor())
            .expect("parameter exists by construction")
    }

    fn linear(&self, x: &Tensor, name: &str) -> candle_core::Result<Tensor> {
        x.broadcast_matmul(&self.p(&format!("{name}.w")).t()?)?
            .broadcast_add(self.p(&format!("{name}.b")))
    }

    fn layer_norm(&self, x: &Tensor, name: &str) -> candle_core::Result<Tensor> {
        candle_nn::ops::layer_norm(
            x,
            self.p(&format!("{name}.g")),
            self.p(&format!("{name}.b")),
            1e-5,
        )
    }

    /// Outputs for `x` [batch, inputs]; `dropout` = (rate, generator) while training.
    fn forward(
        &self,
        x: &Tensor,
        mut dropout: Option<(f64, &mut SplitMix64)>,
    ) -> candle_core::Result<Tensor> {
        let mut drop = |h: Tensor| -> candle_core::Result<Tensor> {
            match dropout.as_mut() {
                Some((p, rng)) if *p > 0.0 => {
                    let keep = 1.0 - *p;
                    let mask: Vec<f32> = (0..h.elem_count())
                        .map(|_| {
                            if rng.unit() < keep {
                                (1.0 / keep) as f32
                            } else {
                                0.0
                            }
                        })
                        .collect();
                    h.mul(&Tensor::from_vec(mask, h.shape(), h.device())?)
                }
                _ => Ok(h),
            }
        };
        match &self.arch {
            Arch::Mlp { hidden } => {
                let mut h = x.clone();
                for k in 0..hidden.len() {
                    h = drop(self.linear(&h, &format!("l{k}"))?.relu()?)?;
                }
                self.linear(&h, "out")
            }
            Arch::Transformer {
                d_model,
                heads,
                layers,
            } => {
                let (b, f) = x.dims2()?;
                let (d, nh) = (*d_model, *heads);
                let dh = d / nh;
                let mut h = x
                    .unsqueeze(2)?
                    .broadcast_mul(self.p("emb.w"))?
                    .broadcast_add(self.p("emb.b"))?;
                for l in 0..*layers {
                    let n = self.layer_norm(&h, &format!("b{l}.ln1"))?;
                    let split =
                        |t: Tensor| t.reshape((b, f, nh, dh))?.transpose(1, 2)?.contiguous();
                    let q = split(self.linear(&n, &format!("b{l}.q"))?)?;
                    let k = split(self.linear(&n, &format!("b{l}.k"))?)?;
                    let v = split(self.linear(&n, &format!("b{l}.v"))?)?;
                    let att = candle_nn::ops::softmax_last_dim(
                        &(q.matmul(&k.t()?)? / (dh as f64).sqrt())?,
                    )?;
                    let o = att.matmul(&v)?.transpose(1, 2)?.reshape((b, f, d))?;
                    h = (h + drop(self.linear(&o, &format!("b{l}.o"))?)?)?;
                    let n = self.layer_norm(&h, &format!("b{l}.ln2"))?;
                    let ff = self.linear(
                        &self.linear(&n, &format!("b{l}.ff1"))?.gelu()?,
                        &format!("b{l}.ff2"),
                    )?;
                    h = (h + drop(ff)?)?;
                }
                let pooled = self.layer_norm(&h.mean(1)?, "lnf")?;
                self.linear(&pooled, "out")
            }
        }
    }

    /// Raw outputs (logits or values) for each row.
    pub fn predict(&self, rows: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let x = matrix(rows, self.inputs)?;
        Ok(self.forward(&x, None).and_then(|t| t.to_vec2::<f32>())?)
    }

    /// Trains in place with AdamW; `progress(epoch, mean loss)` after each epoch.
    pub fn train(
        &mut self,
        rows: &[Vec<f32>],
        labels: &Labels,
        cfg: &TrainConfig,
        progress: &mut dyn FnMut(usize, f64),
    ) -> Result<()> {
        let n = rows.len();
        if n == 0 {
            return Err(NetError::NoRows);
        }
        let vars: Vec<Var> = self.params.iter().map(|(_, v)| v.clone()).collect();
        let mut opt = AdamW::new(
            vars,
            ParamsAdamW {
                lr: cfg.lr,
                weight_decay: cfg.weight_decay,
                ..Default::default()
            },
        )?;
        let mut rng = SplitMix64(cfg.seed ^ 0xD1CE);
        let mut order: Vec<usize> = (0..n).collect();
        for epoch in 0..cfg.epochs {
            rng.shuffle(&mut order);
            let (mut total, mut batches) = (0.0, 0);
            for chunk in order.chunks(cfg.batch_size.max(1)) {
                let x = matrix(
                    &chunk.iter().map(|&i| rows[i].clone()).collect::<Vec<_>>(),
                    self.inputs,
                )?;
                let out = self.forward(&x, Some((cfg.dropout, &mut rng)))?;
                let loss = match labels {
                    Labels::Classes(y, _) => {
                        let t = Tensor::from_vec(
                            chunk.iter().map(|&i| y[i]).collect::<Vec<u32>>(),
                            chunk.len(),
                            &Device::Cpu,
                        )?;
                        candle_nn::loss::cross_entropy(&out, &t)
                    }
                    Labels::Values(y) => {
                        let t = Tensor::from_vec(
                            chunk.iter().map(|&i| y[i]).collect::<Vec<f32>>(),
                            (chunk.len(), 1),
                            &Device::Cpu,
                        )?;
                        candle_nn::loss::mse(&out, &t)
                    }
                }?;
                opt.backward_step(&loss)?;
                total += loss.to_scalar::<f32>()? as f64;
                batches += 1;
            }
            progress(epoch + 1, total / batches.max(1) as f64);
        }
        Ok(())
    }
}

fn matrix(rows: &[Vec<f32>], width: usize) -> Result<Tensor> {
    if let Some(r) = rows.iter().find(|r| r.len() != width) {
        return Err(NetError::RowWidth {
            found: r.len(),
            width,
        });
    }
    Ok(Tensor::from_vec(
        rows.concat(),
        (rows.len(), width),
        &Device::Cpu,
    )?)
}

/// Row-wise softmax of logits.
pub fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    exp.iter().map(|e| e / sum).collect()
}
