//! The op graph of one training step, and the helpers the model families build it with.
//!
//! A [`Graph`] lists tensors (parameters, buffers, the input batch, activations) and forward
//! [`Node`]s in execution order. Each node says what it allocates, what autograd saves for its
//! backward (spec §3.2) and what its backward allocates ([`Bw`]). [`GraphBuilder`] knows the
//! PyTorch ops the families use — linear, conv2d, batch/layer norm, activations, dropout,
//! pooling, softmax, losses, attention — including autocast's casts (spec §5).
//! [`crate::step`] lowers a graph into a trace.

use std::collections::HashMap;

use crate::UnknownName;
use crate::job::Precision;

/// Element types and their sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    F16,
    BF16,
    I64,
    I32,
    Bool,
}

impl Dtype {
    /// The name after `torch.` (as the tracer writes dtypes).
    pub fn torch_name(self) -> &'static str {
        match self {
            Dtype::F32 => "float32",
            Dtype::F16 => "float16",
            Dtype::BF16 => "bfloat16",
            Dtype::I64 => "int64",
            Dtype::I32 => "int32",
            Dtype::Bool => "bool",
        }
    }
    pub fn size(self) -> u64 {
        match self {
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I64 => 8,
            Dtype::Bool => 1,
        }
    }
}

// The job vocabulary's precision, as the graph computes in it.
impl Precision {
    /// The autocast dtype, if autocast is on.
    pub fn low(self) -> Option<Dtype> {
        match self {
            Precision::AmpFp16 => Some(Dtype::F16),
            Precision::AmpBf16 => Some(Dtype::BF16),
            Precision::Fp32 | Precision::Fp16 | Precision::Bf16 => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Param,
    Buffer,
    Input,
    Activation,
}

/// A tensor's storage. Views are not separate tensors: a view op returns its input's id.
#[derive(Debug, Clone)]
pub struct Tensor {
    pub numel: u64,
    pub dtype: Dtype,
    pub role: Role,
    pub requires_grad: bool,
    /// A view of this tensor's storage: allocates nothing and keeps its base alive; its
    /// gradient is a tensor of its own size.
    pub base: Option<TensorId>,
}

impl Tensor {
    pub fn bytes(&self) -> u64 {
        self.numel * self.dtype.size()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TensorId(pub u32);

/// A conv or linear layer's weight and optional bias, registered ahead of use.
pub type LayerParams = (TensorId, Option<TensorId>);
/// A normalization layer's weight and bias.
pub type NormParams = (TensorId, TensorId);

/// One step of a node's backward, in the order PyTorch allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bw {
    /// A new gradient for input `i` (skipped when that input needs no grad).
    Grad(usize),
    /// Input `i`'s gradient is the incoming gradient itself (add, clone, cat slices).
    PassThrough(usize),
    /// A buffer of this many bytes that lives until the node returns.
    Temp(u64),
}

/// Which tensor a node saves for backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Saved {
    In(usize),
    Out(usize),
}

#[derive(Debug, Clone)]
pub struct Node {
    pub name: &'static str,
    pub inputs: Vec<TensorId>,
    pub outputs: Vec<TensorId>,
    pub saved: Vec<TensorId>,
    /// Buffers allocated after the outputs and freed before the node returns.
    pub temps: Vec<u64>,
    pub bw: Vec<Bw>,
    pub flops: u64,
    /// Bytes the forward kernel(s) read (inputs) and write (outputs).
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Calls cuBLAS (the first call on a thread allocates that thread's workspace).
    pub cublas: bool,
    /// A convolution: its configuration as the profile's workspace table names it, and the
    /// batch; each pass takes the workspace cuDNN's engine asks for.
    pub conv: Option<ConvConfig>,
}

/// A convolution's key in a workspace table (the tracer's `conv_config`, batch apart) and its
/// batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvConfig {
    pub key: String,
    pub n: u64,
}

/// The op graph of one training step at one batch size.
#[derive(Debug, Clone, Default)]
pub struct Graph {
    pub tensors: Vec<Tensor>,
    pub nodes: Vec<Node>,
    /// Trainable parameters in registration order (the optimizer's order).
    pub params: Vec<TensorId>,
    /// Parameters and buffers in the order `model.to(device)` copies them.
    pub setup_order: Vec<TensorId>,
    /// The batch tensors the training loop moves to the GPU.
    pub inputs: Vec<TensorId>,
    /// What the loop's variables keep until the next loop head (the batch, or a converted copy).
    pub user_holds: Vec<TensorId>,
    /// Nodes `0..model_nodes` are the model's forward; the rest compute the loss.
    pub model_nodes: usize,
    /// The model's output, held by the user's `outputs` variable until the next forward.
    pub output: Option<TensorId>,
    /// The tensor `backward()` is called on.
    pub loss: Option<TensorId>,
    /// Weight casts held by the autocast cache until the forward ends.
    pub autocast_cache: Vec<TensorId>,
    /// Per-sample activation count (the Horus formula's input).
    pub activations_per_sample: u64,
    /// Python variables that keep a tensor alive past its last use: (tensor, node after which
    /// the variable is dropped), e.g. a layer's `src` argument until the layer returns.
    pub holds: Vec<(TensorId, usize)>,
}

impl Graph {
    pub fn t(&self, id: TensorId) -> &Tensor {
        &self.tensors[id.0 as usize]
    }
    pub fn parameter_count(&self) -> u64 {
        self.params.iter().map(|&p| self.t(p).numel).sum()
    }
}

/// Activation functions of the seed's families.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activation {
    Relu,
    LeakyRelu,
    Prelu,
    Elu,
    Selu,
    Tanh,
    Softplus,
    Swish,
    Mish,
    Gelu,
    Identity,
    Sigmoid,
}

impl Activation {
    pub const NAMES: [&'static str; 11] = [
        "relu",
        "leaky_relu",
        "prelu",
        "elu",
        "selu",
        "tanh",
        "softplus",
        "swish",
        "mish",
        "gelu",
        "identity",
    ];

    pub fn parse(s: &str) -> Result<Self, UnknownName> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "relu" => Activation::Relu,
            "leaky_relu" | "leakyrelu" | "leaky" => Activation::LeakyRelu,
            "prelu" => Activation::Prelu,
            "elu" => Activation::Elu,
            "selu" => Activation::Selu,
            "tanh" => Activation::Tanh,
            "softplus" => Activation::Softplus,
            "swish" | "silu" => Activation::Swish,
            "mish" => Activation::Mish,
            "gelu" => Activation::Gelu,
            "identity" => Activation::Identity,
            "sigmoid" => Activation::Sigmoid,
            other => {
                return Err(UnknownName::new(
                    "activation",
                    other,
                    format!("one of {}", Self::NAMES.join(", ")),
                ));
            }
        })
    }

    /// The spec name (`relu`, `leaky_relu`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Activation::Relu => "relu",
            Activation::LeakyRelu => "leaky_relu",
            Activation::Prelu => "prelu",
            Activation::Elu => "elu",
            Activation::Selu => "selu",
            Activation::Tanh => "tanh",
            Activation::Softplus => "softplus",
            Activation::Swish => "swish",
            Activation::Mish => "mish",
            Activation::Gelu => "gelu",
            Activation::Identity => "identity",
            Activation::Sigmoid => "sigmoid",
        }
    }

    /// Whether autograd saves the output (`result`) rather than the input (`self`).
    fn saves_result(self) -> bool {
        matches!(
            self,
            Activation::Relu | Activation::Tanh | Activation::Sigmoid
        )
    }
}

/// Builds a [`Graph`] op by op, applying autograd's saving rules and autocast.
#[derive(Debug)]
pub struct GraphBuilder {
    g: Graph,
    precision: Precision,
    cast_cache: HashMap<TensorId, TensorId>,
}

impl GraphBuilder {
    pub fn new(precision: Precision) -> Self {
        GraphBuilder {
            g: Graph::default(),
            precision,
            cast_cache: HashMap::new(),
        }
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    pub fn t(&self, id: TensorId) -> &Tensor {
        self.g.t(id)
    }

    fn tensor(&mut self, numel: u64, dtype: Dtype, role: Role, requires_grad: bool) -> TensorId {
        self.g.tensors.push(Tensor {
            numel,
            dtype,
            role,
            requires_grad,
            base: None,
        });
        TensorId((self.g.tensors.len() - 1) as u32)
    }

    /// A trainable fp32 parameter, copied to the GPU at setup.
    pub fn param(&mut self, numel: u64) -> TensorId {
        let id = self.tensor(numel, Dtype::F32, Role::Param, true);
        self.g.params.push(id);
        self.g.setup_order.push(id);
        id
    }

    /// A persistent buffer (BatchNorm running statistics).
    pub fn buffer(&mut self, numel: u64, dtype: Dtype) -> TensorId {
        let id = self.tensor(numel, dtype, Role::Buffer, false);
        self.g.setup_order.push(id);
        id
    }

    /// A batch tensor moved to the GPU each iteration.
    pub fn input(&mut self, numel: u64, dtype: Dtype) -> TensorId {
        let id = self.tensor(numel, dtype, Role::Input, false);
        self.g.inputs.push(id);
        self.g.user_holds.push(id);
        id
    }

    /// Adds a node. Outputs require grad iff an input does; a node whose outputs need no grad
    /// has no backward and saves nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn node(
        &mut self,
        name: &'static str,
        inputs: &[TensorId],
        outputs: &[(u64, Dtype)],
        saved: &[Saved],
        bw: &[Bw],
        flops: u64,
        cublas: bool,
    ) -> Vec<TensorId> {
        let rg = inputs.iter().any(|&i| self.g.t(i).requires_grad);
        let outs: Vec<TensorId> = outputs
            .iter()
            .map(|&(n, d)| self.tensor(n, d, Role::Activation, rg))
            .collect();
        let resolve = |s: &Saved| match *s {
            Saved::In(i) => inputs[i],
            Saved::Out(i) => outs[i],
        };
        let mut saved_ids: Vec<TensorId> = if rg {
            saved.iter().map(resolve).collect()
        } else {
            Vec::new()
        };
        saved_ids.dedup();
        let bytes_read = inputs.iter().map(|&i| self.g.t(i).bytes()).sum();
        let bytes_written = outs.iter().map(|&i| self.g.t(i).bytes()).sum();
        self.g.nodes.push(Node {
            name,
            inputs: inputs.to_vec(),
            outputs: outs.clone(),
            saved: saved_ids,
            temps: Vec::new(),
            bw: if rg { bw.to_vec() } else { Vec::new() },
            flops,
            bytes_read,
            bytes_written,
            cublas,
            conv: None,
        });
        outs
    }

    /// The loop rebinds a batch variable to a converted copy (`labels = labels.float()`): the
    /// copy is held instead of the original.
    pub fn rebind(&mut self, old: TensorId, new: TensorId) {
        for h in &mut self.g.user_holds {
            if *h == old {
                *h = new;
            }
        }
    }

    /// A Python variable holds `t` until the node added last (a function's argument, held
    /// until the function returns).
    pub fn hold_until_now(&mut self, t: TensorId) {
        let last = self.g.nodes.len().saturating_sub(1);
        self.g.holds.push((t, last));
    }

    /// Adds forward temporaries to the last node.
    pub fn with_temps(&mut self, temps: &[u64]) {
        if let Some(n) = self.g.nodes.last_mut() {
            n.temps.extend_from_slice(temps);
        }
    }

    /// Marks the end of the model's forward; `output` is what the user keeps.
    pub fn end_model(&mut self, output: TensorId) {
        self.g.model_nodes = self.g.nodes.len();
        self.g.output = Some(output);
    }

    pub fn set_activations_per_sample(&mut self, n: u64) {
        self.g.activations_per_sample = n;
    }

    pub fn finish(mut self, loss: TensorId) -> Graph {
        self.g.loss = Some(loss);
        if self.g.output.is_none() {
            self.g.model_nodes = self.g.nodes.len();
        }
        self.g
    }

    /// The dtype a compute op produces under the current precision.
    fn compute_dtype(&self) -> Dtype {
        self.precision.low().unwrap_or(Dtype::F32)
    }

    /// Autocast's cast of `x` to the low dtype for a matmul-like op (spec §5.2): parameters are
    /// cast once per forward and cached; other fp32 tensors are cast every time.
    fn autocast(&mut self, x: TensorId) -> TensorId {
        let Some(low) = self.precision.low() else {
            return x;
        };
        let t = self.g.t(x).clone();
        if t.dtype != Dtype::F32 {
            return x;
        }
        if t.role == Role::Param
            && let Some(&c) = self.cast_cache.get(&x)
        {
            return c;
        }
        let c = self.node(
            "to_copy",
            &[x],
            &[(t.numel, low)],
            &[],
            &[Bw::Grad(0)],
            0,
            false,
        )[0];
        if t.role == Role::Param {
            self.cast_cache.insert(x, c);
            self.g.autocast_cache.push(c);
        }
        c
    }

    /// Cast up to fp32 for ops autocast runs in fp32 (layer_norm, losses).
    fn cast_up(&mut self, x: TensorId) -> TensorId {
        let t = self.g.t(x).clone();
        if self.precision.low().is_none() || t.dtype == Dtype::F32 {
            return x;
        }
        self.node(
            "to_copy",
            &[x],
            &[(t.numel, Dtype::F32)],
            &[],
            &[Bw::Grad(0)],
            0,
            false,
        )[0]
    }

    /// `nn.Linear` on an input of `rows × in_f` (2-D or a contiguous N-D input): addmm.
    pub fn linear(&mut self, x: TensorId, in_f: u64, out_f: u64, bias: bool) -> TensorId {
        let w = self.param(out_f * in_f);
        let b = if bias { Some(self.param(out_f)) } else { None };
        self.linear_with(x, w, b, in_f, out_f)
    }

    /// Registers a linear layer's weight (and bias) now.
    pub fn linear_params(
        &mut self,
        in_f: u64,
        out_f: u64,
        bias: bool,
    ) -> (TensorId, Option<TensorId>) {
        let w = self.param(out_f * in_f);
        (w, bias.then(|| self.param(out_f)))
    }

    /// A linear layer with given weights (shared or pre-registered parameters).
    pub fn linear_with(
        &mut self,
        x: TensorId,
        w: TensorId,
        b: Option<TensorId>,
        in_f: u64,
        out_f: u64,
    ) -> TensorId {
        let rows = self.g.t(x).numel / in_f;
        let flops = 2 * rows * in_f * out_f;
        let xc = self.autocast(x);
        let wc = self.autocast(w);
        let dt = self.compute_dtype();
        let x_rg = self.g.t(xc).requires_grad;
        // mm saves mat1 only if mat2 needs grad (always: a weight) and mat2 only if mat1 does.
        let mut saved = vec![Saved::In(1)];
        if x_rg {
            saved.push(Saved::In(2));
        }
        match b {
            Some(b) => {
                let bc = self.autocast(b);
                // AddmmBackward computes mat1's grad, then mat2's, then the bias reduction.
                self.node(
                    "addmm",
                    &[bc, xc, wc],
                    &[(rows * out_f, dt)],
                    &saved,
                    &[Bw::Grad(1), Bw::Grad(2), Bw::Grad(0)],
                    flops,
                    true,
                )[0]
            }
            None => {
                let saved: Vec<Saved> = saved
                    .iter()
                    .map(|s| {
                        if let Saved::In(i) = s {
                            Saved::In(i - 1)
                        } else {
                            *s
                        }
                    })
                    .collect();
                self.node(
                    "mm",
                    &[xc, wc],
                    &[(rows * out_f, dt)],
                    &saved,
                    &[Bw::Grad(0), Bw::Grad(1)],
                    flops,
                    true,
                )[0]
            }
        }
    }

    /// `nn.BatchNorm1d/2d` in training mode over `channels`.
    pub fn batch_norm(&mut self, x: TensorId, channels: u64) -> TensorId {
        let params = self.batch_norm_params(channels);
        self.batch_norm_with(x, params, channels)
    }

    /// Registers a BatchNorm's weight, bias and running statistics now.
    pub fn batch_norm_params(&mut self, channels: u64) -> (TensorId, TensorId) {
        let w = self.param(channels);
        let b = self.param(channels);
        self.buffer(channels, Dtype::F32);
        self.buffer(channels, Dtype::F32);
        self.buffer(1, Dtype::I64);
        (w, b)
    }

    /// A BatchNorm with parameters from [`GraphBuilder::batch_norm_params`].
    pub fn batch_norm_with(
        &mut self,
        x: TensorId,
        (w, b): (TensorId, TensorId),
        channels: u64,
    ) -> TensorId {
        let t = self.g.t(x).clone();
        let outs = self.node(
            "batch_norm",
            &[x, w, b],
            &[
                (t.numel, t.dtype),
                (channels, Dtype::F32),
                (channels, Dtype::F32),
            ],
            &[Saved::In(0), Saved::In(1), Saved::Out(1), Saved::Out(2)],
            &[Bw::Grad(0), Bw::Grad(1), Bw::Grad(2)],
            8 * t.numel,
            false,
        );
        outs[0]
    }

    /// `nn.LayerNorm(features)`; autocast runs it in fp32 (output fp32).
    pub fn layer_norm(&mut self, x: TensorId, features: u64) -> TensorId {
        let params = (self.param(features), self.param(features));
        self.layer_norm_with(x, params, features)
    }

    /// A LayerNorm whose weight and bias were registered already.
    pub fn layer_norm_with(
        &mut self,
        x: TensorId,
        (w, b): (TensorId, TensorId),
        features: u64,
    ) -> TensorId {
        let x32 = self.cast_up(x);
        let n = self.g.t(x32).numel;
        let rows = n / features;
        let outs = self.node(
            "layer_norm",
            &[x32, w, b],
            &[(n, Dtype::F32), (rows, Dtype::F32), (rows, Dtype::F32)],
            &[
                Saved::In(0),
                Saved::In(1),
                Saved::In(2),
                Saved::Out(1),
                Saved::Out(2),
            ],
            &[Bw::Grad(0), Bw::Grad(1), Bw::Grad(2)],
            8 * n,
            false,
        );
        outs[0]
    }

    /// An element-wise activation module.
    pub fn activation(&mut self, x: TensorId, act: Activation) -> TensorId {
        let t = self.g.t(x).clone();
        match act {
            Activation::Identity => x,
            Activation::Prelu => {
                let w = self.param(1);
                // The weight gradient comes out at full input size, then is summed to [1].
                self.node(
                    "prelu",
                    &[x, w],
                    &[(t.numel, t.dtype)],
                    &[Saved::In(0), Saved::In(1)],
                    &[Bw::Grad(0), Bw::Temp(t.bytes()), Bw::Grad(1)],
                    2 * t.numel,
                    false,
                )[0]
            }
            _ => {
                let saved = if act.saves_result() {
                    Saved::Out(0)
                } else {
                    Saved::In(0)
                };
                let name = match act {
                    Activation::Relu => "relu",
                    Activation::LeakyRelu => "leaky_relu",
                    Activation::Elu | Activation::Selu => "elu",
                    Activation::Tanh => "tanh",
                    Activation::Softplus => "softplus",
                    Activation::Swish => "silu",
                    Activation::Mish => "mish",
                    Activation::Gelu => "gelu",
                    Activation::Sigmoid => "sigmoid",
                    Activation::Identity | Activation::Prelu => unreachable!(),
                };
                self.node(
                    name,
                    &[x],
                    &[(t.numel, t.dtype)],
                    &[saved],
                    &[Bw::Grad(0)],
                    4 * t.numel,
                    false,
                )[0]
            }
        }
    }

    /// `nn.Dropout(p)` in training: output plus a 1-byte mask, the mask saved.
    pub fn dropout(&mut self, x: TensorId, p: f64) -> TensorId {
        if p <= 0.0 {
            return x;
        }
        let t = self.g.t(x).clone();
        self.node(
            "native_dropout",
            &[x],
            &[(t.numel, t.dtype), (t.numel, Dtype::Bool)],
            &[Saved::Out(1)],
            &[Bw::Grad(0)],
            2 * t.numel,
            false,
        )[0]
    }

    /// Softmax over the last dim; autocast computes it in fp32.
    pub fn softmax(&mut self, x: TensorId) -> TensorId {
        let t = self.g.t(x).clone();
        if self.precision == Precision::AmpBf16 && t.dtype == Dtype::BF16 {
            // bf16 input is converted to an fp32 copy first (fp16 has a fused half→float kernel).
            let x32 = self.cast_up(x);
            return self.node(
                "softmax",
                &[x32],
                &[(t.numel, Dtype::F32)],
                &[Saved::Out(0)],
                &[Bw::Grad(0)],
                5 * t.numel,
                false,
            )[0];
        }
        let dt = if self.precision.low().is_some() {
            Dtype::F32
        } else {
            t.dtype
        };
        self.node(
            "softmax",
            &[x],
            &[(t.numel, dt)],
            &[Saved::Out(0)],
            &[Bw::Grad(0)],
            5 * t.numel,
            false,
        )[0]
    }

    /// `nn.CrossEntropyLoss()` = log_softmax + nll_loss (mean). Returns the scalar loss.
    pub fn cross_entropy(&mut self, logits: TensorId, labels: TensorId) -> TensorId {
        let t = self.g.t(logits).clone();
        let x = if self.precision == Precision::AmpBf16 {
            self.cast_up(logits)
        } else {
            logits
        };
        let dt = if self.precision.low().is_some() {
            Dtype::F32
        } else {
            t.dtype
        };
        let logp = self.node(
            "log_softmax",
            &[x],
            &[(t.numel, dt)],
            &[Saved::Out(0)],
            &[Bw::Grad(0)],
            5 * t.numel,
            false,
        )[0];
        let outs = self.node(
            "nll_loss",
            &[logp, labels],
            &[(1, Dtype::F32), (1, Dtype::F32)],
            &[Saved::In(0), Saved::In(1), Saved::Out(1)],
            &[Bw::Grad(0)],
            t.numel,
            false,
        );
        outs[0]
    }

    /// `nn.BCEWithLogitsLoss()` (mean) on `[B, 1]` logits and float targets.
    pub fn bce_with_logits(&mut self, logits: TensorId, target: TensorId) -> TensorId {
        let x = self.cast_up(logits);
        let n = self.g.t(x).numel;
        let loss = self.node(
            "bce_with_logits",
            &[x, target],
            &[(1, Dtype::F32)],
            &[Saved::In(0), Saved::In(1)],
            &[Bw::Grad(0), Bw::Temp(4 * n)],
            8 * n,
            false,
        )[0];
        // log_sigmoid output and buffer, (1 - target), the product: freed inside the op.
        self.with_temps(&[4 * n, 4 * n, 4 * n, 4 * n]);
        loss
    }

    /// Element-wise `a + b` (residual connections): nothing saved, the gradient passes through.
    pub fn add(&mut self, a: TensorId, b: TensorId) -> TensorId {
        let t = self.g.t(a).clone();
        self.node(
            "add",
            &[a, b],
            &[(t.numel, t.dtype)],
            &[],
            &[Bw::PassThrough(0), Bw::PassThrough(1)],
            t.numel,
            false,
        )[0]
    }

    /// `torch.cat` along channels: the gradient of each input is a slice of the incoming one.
    pub fn cat(&mut self, xs: &[TensorId]) -> TensorId {
        let numel = xs.iter().map(|&x| self.g.t(x).numel).sum();
        let dt = self.g.t(xs[0]).dtype;
        let bw: Vec<Bw> = (0..xs.len()).map(Bw::PassThrough).collect();
        self.node("cat", xs, &[(numel, dt)], &[], &bw, numel, false)[0]
    }

    /// Views of equal parts of `x` (`proj[0], proj[1], ...` of a packed projection). Each view's
    /// backward (`select_backward`) fills a zeroed buffer of the whole `x`; the first becomes
    /// `x`'s gradient and the later ones are added into it in place.
    pub fn unpack(&mut self, x: TensorId, parts: u64) -> Vec<TensorId> {
        let t = self.g.t(x).clone();
        let part = (t.numel / parts, t.dtype);
        // The views' strided gradients are first copied (one part at a time), then scattered.
        let part_bytes = part.0 * part.1.size();
        let outs = self.node(
            "unpack",
            &[x],
            &vec![part; parts as usize],
            &[],
            &[Bw::Temp(part_bytes), Bw::Grad(0), Bw::Temp(t.bytes())],
            0,
            false,
        );
        for &o in &outs {
            self.g.tensors[o.0 as usize].base = Some(x);
        }
        outs
    }

    /// A strided view of `x` (a transpose): no memory, but its incoming gradient is strided too
    /// and gets copied before the producer's backward can use it.
    pub fn strided_view(&mut self, x: TensorId) -> TensorId {
        let t = self.g.t(x).clone();
        let v = self.node(
            "transpose",
            &[x],
            &[(t.numel, t.dtype)],
            &[],
            &[Bw::Grad(0)],
            0,
            false,
        )[0];
        self.g.tensors[v.0 as usize].base = Some(x);
        v
    }

    /// A `.contiguous()` copy of a reshaped view whose backward has to copy the gradient back
    /// into the original layout (a reshape of a non-contiguous gradient).
    pub fn contiguous_copy(&mut self, x: TensorId) -> TensorId {
        let t = self.g.t(x).clone();
        self.node(
            "clone",
            &[x],
            &[(t.numel, t.dtype)],
            &[],
            &[Bw::Grad(0)],
            t.numel,
            false,
        )[0]
    }

    /// A copy (`.contiguous()`, a non-viewable reshape): nothing saved, gradient passes through.
    pub fn copy(&mut self, x: TensorId) -> TensorId {
        let t = self.g.t(x).clone();
        self.node(
            "clone",
            &[x],
            &[(t.numel, t.dtype)],
            &[],
            &[Bw::PassThrough(0)],
            t.numel,
            false,
        )[0]
    }

    /// `nn.Conv2d(in_c, out_c, k, stride, padding)` on `batch × in_c × h × w`; returns the output
    /// and its spatial size.
    #[allow(clippy::too_many_arguments)]
    pub fn conv2d(
        &mut self,
        x: TensorId,
        batch: u64,
        in_c: u64,
        out_c: u64,
        hw: u64,
        k: u64,
        stride: u64,
        pad: u64,
        bias: bool,
    ) -> (TensorId, u64) {
        let params = self.conv_params(in_c, out_c, k, bias);
        self.conv2d_with(x, params, batch, in_c, out_c, hw, k, stride, pad)
    }

    /// Registers a conv's weight (and bias) now, for modules whose parameters are defined in
    /// another order than they run.
    pub fn conv_params(
        &mut self,
        in_c: u64,
        out_c: u64,
        k: u64,
        bias: bool,
    ) -> (TensorId, Option<TensorId>) {
        let w = self.param(out_c * in_c * k * k);
        let b = if bias { Some(self.param(out_c)) } else { None };
        (w, b)
    }

    /// A conv with parameters from [`GraphBuilder::conv_params`].
    #[allow(clippy::too_many_arguments)]
    pub fn conv2d_with(
        &mut self,
        x: TensorId,
        (w, b): (TensorId, Option<TensorId>),
        batch: u64,
        in_c: u64,
        out_c: u64,
        hw: u64,
        k: u64,
        stride: u64,
        pad: u64,
    ) -> (TensorId, u64) {
        let out_hw = (hw + 2 * pad - k) / stride + 1;
        let out_numel = batch * out_c * out_hw * out_hw;
        let flops = 2 * out_numel * in_c * k * k;
        let xc = self.autocast(x);
        let wc = self.autocast(w);
        let dt = self.compute_dtype();
        let mut inputs = vec![xc, wc];
        let mut bw = vec![Bw::Grad(0), Bw::Grad(1)];
        if let Some(b) = b {
            let bc = self.autocast(b);
            inputs.push(bc);
            bw.push(Bw::Grad(2));
        }
        let y = self.node(
            "conv2d",
            &inputs,
            &[(out_numel, dt)],
            &[Saved::In(0), Saved::In(1)],
            &bw,
            flops,
            false,
        )[0];
        let key = format!(
            "in={in_c}x{hw}x{hw};w={out_c}x{in_c}x{k}x{k};stride={stride}x{stride};pad={pad}x{pad};dil=1x1;groups=1;dtype={};layout=contiguous",
            dt.torch_name()
        );
        self.g.nodes.last_mut().expect("just pushed").conv = Some(ConvConfig { key, n: batch });
        (y, out_hw)
    }

    /// `nn.MaxPool2d(2)`: output plus int64 indices, both saved with the input.
    pub fn max_pool2d(&mut self, x: TensorId, batch: u64, c: u64, hw: u64) -> (TensorId, u64) {
        let out_hw = hw / 2;
        let n = batch * c * out_hw * out_hw;
        let dt = self.g.t(x).dtype;
        let outs = self.node(
            "max_pool2d",
            &[x],
            &[(n, dt), (n, Dtype::I64)],
            &[Saved::In(0), Saved::Out(1)],
            &[Bw::Grad(0)],
            4 * n,
            false,
        );
        (outs[0], out_hw)
    }

    /// `nn.AvgPool2d(2)`: saves its input.
    pub fn avg_pool2d(&mut self, x: TensorId, batch: u64, c: u64, hw: u64) -> (TensorId, u64) {
        let out_hw = hw / 2;
        let n = batch * c * out_hw * out_hw;
        let dt = self.g.t(x).dtype;
        let y = self.node(
            "avg_pool2d",
            &[x],
            &[(n, dt)],
            &[Saved::In(0)],
            &[Bw::Grad(0)],
            4 * n,
            false,
        )[0];
        (y, out_hw)
    }

    /// `nn.AdaptiveAvgPool2d(1)`: PyTorch computes a mean over H×W, which saves nothing.
    pub fn global_avg_pool(&mut self, x: TensorId, batch: u64, c: u64) -> TensorId {
        let dt = self.g.t(x).dtype;
        let n = self.g.t(x).numel;
        self.node(
            "mean",
            &[x],
            &[(batch * c, dt)],
            &[],
            &[Bw::Grad(0)],
            n,
            false,
        )[0]
    }

    /// `nn.Embedding(vocab, dim)` lookup of `tokens` int64 ids; its weight grad is dense.
    pub fn embedding(&mut self, ids: TensorId, vocab: u64, dim: u64) -> TensorId {
        let w = self.param(vocab * dim);
        self.embedding_with(ids, w, dim)
    }

    /// An embedding lookup in a table registered already.
    pub fn embedding_with(&mut self, ids: TensorId, w: TensorId, dim: u64) -> TensorId {
        let n = self.g.t(ids).numel;
        // The backward sorts the indices (int64 temporaries) before the scatter-add.
        self.node(
            "embedding",
            &[w, ids],
            &[(n * dim, Dtype::F32)],
            &[Saved::In(1)],
            &[Bw::Temp(8 * n), Bw::Temp(8 * n), Bw::Grad(0)],
            n * dim,
            false,
        )[0]
    }

    /// Scaled dot-product attention on `batch × heads × seq × head_dim` q, k, v, with the kernel
    /// the GPU and dtype allow (flash for fp16/bf16 where the GPU has it, else memory-efficient).
    /// Saves q, k, v, the output and the log-sum-exp; its backward returns dq, dk, dv.
    #[allow(clippy::too_many_arguments)]
    pub fn sdpa(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        batch: u64,
        heads: u64,
        seq: u64,
        head_dim: u64,
        flash: bool,
    ) -> TensorId {
        let dt = self.g.t(q).dtype;
        let n = batch * heads * seq * head_dim;
        let flops = 4 * batch * heads * seq * seq * head_dim;
        let saved = [
            Saved::In(0),
            Saved::In(1),
            Saved::In(2),
            Saved::Out(0),
            Saved::Out(1),
            Saved::Out(2),
            Saved::Out(3),
        ];
        if flash && dt != Dtype::F32 {
            let rounded = seq.div_ceil(128) * 128;
            let d_round = head_dim.div_ceil(32) * 32;
            // out, logsumexp, the philox seed [2] and offset (uint64); backward: fp32 dq_accum
            // and softmax_d buffers.
            let outs = self.node(
                "flash_attention",
                &[q, k, v],
                &[
                    (n, dt),
                    (batch * heads * seq, Dtype::F32),
                    (2, Dtype::I64),
                    (1, Dtype::I64),
                ],
                &saved,
                &[
                    Bw::Temp(4 * batch * rounded * heads * d_round),
                    Bw::Temp(4 * batch * heads * rounded),
                    Bw::Grad(0),
                    Bw::Grad(1),
                    Bw::Grad(2),
                ],
                flops,
                false,
            );
            outs[0]
        } else {
            let lse = batch * heads * seq.div_ceil(32) * 32;
            // out, logsumexp, the philox seed and offset (int64 scalars)
            let outs = self.node(
                "efficient_attention",
                &[q, k, v],
                &[(n, dt), (lse, Dtype::F32), (1, Dtype::I64), (1, Dtype::I64)],
                &saved,
                &[Bw::Grad(0), Bw::Grad(1), Bw::Grad(2)],
                flops,
                false,
            );
            outs[0]
        }
    }
}
