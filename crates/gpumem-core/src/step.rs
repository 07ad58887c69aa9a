//! Lowers op graphs into a training-step trace with PyTorch's memory semantics.
//!
//! [`TrainingLoop`] describes the loop (optimizer, precision, PyTorch release, iterations and
//! their batch sizes, an optional warm-up forward such as torchsummary's); [`TrainingLoop::trace`]
//! replays it over graphs built per batch size and records every allocation and free in the order
//! PyTorch issues them (spec §3, §4, §6): parameters copied at setup; per iteration the loop head
//! drops the previous batch, the new batch is copied in, `zero_grad(set_to_none=True)` frees the
//! gradients, the forward allocates outputs and keeps what autograd saves, the previous `outputs`
//! and `loss` die when reassigned, the backward allocates gradients node by node (stealing the
//! first one into `p.grad`, accumulating later ones in place) and releases saved tensors, and the
//! optimizer creates its state at the first step and allocates its step's temporaries
//! ([`optimizer`]: each optimizer and implementation).

use std::collections::HashMap;

use crate::graph::{Bw, Graph, Role, TensorId};
use crate::job::{Optimizer, OptionValues, Precision};
use crate::profile::CUBLAS_WORKSPACE_BYTES;
use crate::trace::{Category, ConvPass, Phase, Trace, TraceBuilder, TraceHeader};

pub mod optimizer;

pub use optimizer::{
    BNB_BLOCK, BNB_MIN_8BIT_SIZE, BNB_PAGED_MIN, BNB_QMAP_BYTES, NotNative, Param, StepEvent,
    native, step_events,
};

/// bitsandbytes' 8-bit Adam state for a parameter of `numel` elements (`(bytes, what)`): a byte
/// per element and an fp32 absmax per block for each moment, or fp32 per element below
/// [`BNB_MIN_8BIT_SIZE`] (bitsandbytes 0.50 `Optimizer2State.init_state`).
pub fn bnb_8bit_state(numel: u64) -> Vec<(u64, &'static str)> {
    if numel < BNB_MIN_8BIT_SIZE {
        return vec![(4 * numel, "state1"), (4 * numel, "state2")];
    }
    let absmax = 4 * numel.div_ceil(BNB_BLOCK);
    vec![
        (numel, "state1"),
        (numel, "state2"),
        (absmax, "absmax1"),
        (absmax, "absmax2"),
    ]
}

/// PyTorch behaviour that changed between releases (spec §3.1.9, §4.1, §4.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TorchBehaviour {
    /// 1.13: `zero_grad` keeps zeroed grads, single-tensor optimizers.
    V1_13,
    /// 2.0: foreach Adam computes `denom` out of place (two parameter-sized temporaries).
    V2_0,
    /// 2.1 and later: foreach Adam adds eps in place (one parameter-sized temporary).
    V2_1,
}

impl TorchBehaviour {
    pub fn parse(version: &str) -> Self {
        let mut it = version.split('.').map(|p| {
            p.chars()
                .take_while(char::is_ascii_digit)
                .collect::<String>()
                .parse::<u32>()
                .unwrap_or(0)
        });
        match (it.next().unwrap_or(2), it.next().unwrap_or(1)) {
            (0 | 1, _) => TorchBehaviour::V1_13,
            (2, 0) => TorchBehaviour::V2_0,
            _ => TorchBehaviour::V2_1,
        }
    }
}

/// How the training loop runs.
#[derive(Debug, Clone)]
pub struct TrainingLoop {
    pub optimizer: Optimizer,
    pub precision: Precision,
    pub torch: TorchBehaviour,
    /// Batch size of each simulated iteration, in order.
    pub batches: Vec<u64>,
    /// Batch size of a forward-only warm-up before training (torchsummary), if any.
    pub warmup_batch: Option<u64>,
    /// cuBLAS workspace bytes to record (replay substitutes the profile's size).
    pub cublas_workspace: u64,
}

impl TrainingLoop {
    /// `iterations` full batches of `batch`; when the epoch has `samples` samples, the short last
    /// batch of the epoch is replayed too (it can fragment the cache), followed by two more.
    pub fn new(
        optimizer: Optimizer,
        precision: Precision,
        batch: u64,
        samples: Option<u64>,
    ) -> Self {
        let mut batches = vec![batch; 3];
        if let Some(s) = samples {
            let tail = s % batch;
            if tail != 0 && s > batch {
                batches.push(tail);
                batches.extend([batch, batch]);
            }
        }
        TrainingLoop {
            optimizer,
            precision,
            torch: TorchBehaviour::V2_1,
            batches,
            warmup_batch: None,
            cublas_workspace: CUBLAS_WORKSPACE_BYTES,
        }
    }

    /// Builds the trace. `build(b)` must return graphs with the same parameters for every `b`.
    pub fn trace(&self, header: TraceHeader, build: &mut dyn FnMut(u64) -> Graph) -> Trace {
        let mut e = Emitter::new(self, header);
        let first = build(self.batches[0]);
        e.setup(&first);
        if let Some(wb) = self.warmup_batch {
            let g = build(wb);
            e.forward_only(&g);
        }
        let mut cache: HashMap<u64, Graph> = HashMap::new();
        cache.insert(self.batches[0], first);
        for &b in &self.batches {
            let g = cache.entry(b).or_insert_with(|| build(b));
            e.iteration(g);
        }
        e.b.finish()
    }
}

/// Gradient buffers of one backward pass, shared by pass-through ops (add, cat, clone):
/// (trace id, references).
#[derive(Debug, Default)]
struct GradBufs(Vec<(u64, u32)>);

impl GradBufs {
    fn new_buf(&mut self, id: u64) -> usize {
        self.0.push((id, 1));
        self.0.len() - 1
    }
}

struct Emitter<'a> {
    cfg: &'a TrainingLoop,
    b: TraceBuilder,
    /// Trace id of each parameter/buffer, by position in `setup_order`.
    persistent: Vec<u64>,
    /// Trace id of each parameter's `.grad`, by position in `params`.
    grads: Vec<Option<u64>>,
    optimizer_steps: u32,
    /// What the user's variables still hold from the previous iteration.
    prev_inputs: Vec<u64>,
    prev_output: Option<u64>,
    prev_loss: Option<u64>,
    main_workspace: bool,
    autograd_workspace: bool,
    /// GradScaler's scale and growth tracker exist (created at the first `scale`).
    scaler_ready: bool,
}

/// Per-pass state: trace ids and reference counts of the graph's live tensors.
struct Pass {
    id: Vec<Option<u64>>,
    refs: Vec<u32>,
}

impl<'a> Emitter<'a> {
    fn new(cfg: &'a TrainingLoop, mut header: TraceHeader) -> Self {
        header.options = OptionValues {
            optimizer: cfg.optimizer,
            precision: cfg.precision,
            ..header.options.values()
        }
        .check()
        .expect("an optimizer and a precision over valid options are valid");
        Emitter {
            cfg,
            b: TraceBuilder::new(header),
            persistent: Vec::new(),
            grads: Vec::new(),
            optimizer_steps: 0,
            prev_inputs: Vec::new(),
            prev_output: None,
            prev_loss: None,
            main_workspace: false,
            autograd_workspace: false,
            scaler_ready: false,
        }
    }

    fn setup(&mut self, g: &Graph) {
        for &t in &g.setup_order {
            let tensor = g.t(t);
            // Buffers (BatchNorm running statistics) are model state, like parameters.
            let id = self.b.alloc(
                tensor.bytes(),
                Category::Parameter,
                Phase::Setup,
                "to_device",
            );
            self.persistent.push(id);
        }
        self.grads = vec![None; g.params.len()];
    }

    /// Ids of the persistent tensors of `g` (parameters and buffers).
    fn new_pass(&self, g: &Graph) -> Pass {
        let mut id = vec![None; g.tensors.len()];
        for (k, &t) in g.setup_order.iter().enumerate() {
            id[t.0 as usize] = Some(self.persistent[k]);
        }
        // Forward uses + savers + holds.
        let mut refs = vec![0u32; g.tensors.len()];
        for n in &g.nodes {
            for &i in &n.inputs {
                refs[i.0 as usize] += 1;
            }
            for &s in &n.saved {
                refs[s.0 as usize] += 1;
            }
        }
        for &c in &g.autocast_cache {
            refs[c.0 as usize] += 1;
        }
        if let Some(o) = g.output {
            refs[o.0 as usize] += 1;
        }
        if let Some(l) = g.loss {
            refs[l.0 as usize] += 1;
        }
        for &h in &g.user_holds {
            refs[h.0 as usize] += 1;
        }
        for &(t, _) in &g.holds {
            refs[t.0 as usize] += 1;
        }
        Pass { id, refs }
    }

    fn release(&mut self, g: &Graph, p: &mut Pass, t: TensorId) {
        let k = t.0 as usize;
        if matches!(g.t(t).role, Role::Param | Role::Buffer) {
            return;
        }
        debug_assert!(p.refs[k] > 0, "tensor released more often than referenced");
        p.refs[k] -= 1;
        if p.refs[k] == 0 {
            if let Some(id) = p.id[k].take() {
                self.b.free(id);
            }
            // A dead view lets go of its base.
            if let Some(base) = g.t(t).base {
                self.release(g, p, base);
            }
        }
    }

    fn workspace(&mut self, phase: Phase) {
        // One per thread: the main thread's, and the autograd engine's for backward.
        let done = if phase == Phase::Backward {
            &mut self.autograd_workspace
        } else {
            &mut self.main_workspace
        };
        if !*done {
            *done = true;
            let bytes = self.cfg.cublas_workspace;
            self.b
                .alloc(bytes, Category::Workspace, phase, "cublas_workspace");
        }
    }

    /// Runs forward nodes, releasing each tensor when its last reference goes.
    fn forward(&mut self, g: &Graph, p: &mut Pass, phase: Phase, nodes: std::ops::Range<usize>) {
        for ni in nodes {
            let n = &g.nodes[ni];
            for &o in &n.outputs {
                match g.t(o).base {
                    // A view allocates nothing and keeps its base alive.
                    Some(base) => p.refs[base.0 as usize] += 1,
                    None => {
                        p.id[o.0 as usize] =
                            Some(
                                self.b
                                    .alloc(g.t(o).bytes(), Category::Activation, phase, n.name),
                            )
                    }
                }
            }
            if n.cublas {
                self.workspace(phase);
            }
            if let Some(c) = &n.conv {
                self.b
                    .workspace(&c.key, c.n, ConvPass::Forward, phase, None);
            }
            for &bytes in &n.temps {
                let id = self.b.alloc(bytes, Category::Temporary, phase, n.name);
                self.b.free(id);
            }
            self.b.op(n.name, n.flops, n.bytes_read, n.bytes_written);
            for &i in &n.inputs {
                self.release(g, p, i);
            }
            for &o in &n.outputs {
                if p.refs[o.0 as usize] == 0 {
                    p.refs[o.0 as usize] = 1;
                    self.release(g, p, o);
                }
            }
            for &(t, _) in g.holds.iter().filter(|(_, at)| *at == ni) {
                self.release(g, p, t);
            }
        }
    }

    /// A forward without backward whose graph dies at the end (torchsummary's pass).
    fn forward_only(&mut self, g: &Graph) {
        let mut p = self.new_pass(g);
        for &i in &g.inputs {
            let id = self.b.alloc(
                g.t(i).bytes(),
                Category::InputBatch,
                Phase::Setup,
                "warmup_input",
            );
            p.id[i.0 as usize] = Some(id);
        }
        self.forward(g, &mut p, Phase::Setup, 0..g.model_nodes);
        // The output dies, then the graph: saved tensors are released newest first.
        for ni in (0..g.model_nodes).rev() {
            for &o in &g.nodes[ni].outputs {
                if let Some(id) = p.id[o.0 as usize].take() {
                    self.b.free(id);
                }
            }
        }
        for k in 0..p.id.len() {
            if matches!(g.tensors[k].role, Role::Input | Role::Activation)
                && let Some(id) = p.id[k].take()
            {
                self.b.free(id);
            }
        }
    }

    fn iteration(&mut self, g: &Graph) {
        let mut p = self.new_pass(g);
        // Loop head: rebinding `inputs, labels` drops last iteration's GPU copies.
        for id in std::mem::take(&mut self.prev_inputs) {
            self.b.free(id);
        }
        for &i in &g.inputs {
            let id = self.b.alloc(
                g.t(i).bytes(),
                Category::InputBatch,
                Phase::Forward,
                "to_device",
            );
            p.id[i.0 as usize] = Some(id);
        }
        self.zero_grad();
        self.forward(g, &mut p, Phase::Forward, 0..g.model_nodes);
        if let Some(id) = self.prev_output.take() {
            self.b.free(id);
        }
        self.forward(g, &mut p, Phase::Forward, g.model_nodes..g.nodes.len());
        if let Some(id) = self.prev_loss.take() {
            self.b.free(id);
        }
        for &c in &g.autocast_cache {
            self.release(g, &mut p, c);
        }
        let root = self.scale_loss();
        self.backward(g, &mut p, root);
        self.step(g);
        // What the user's variables keep until the next iteration.
        self.prev_output = g.output.and_then(|o| p.id[o.0 as usize].take());
        self.prev_loss = g.loss.and_then(|l| p.id[l.0 as usize].take());
        for &h in &g.user_holds {
            if let Some(id) = p.id[h.0 as usize].take() {
                self.prev_inputs.push(id);
            }
        }
        debug_assert!(
            p.id.iter()
                .enumerate()
                .all(|(k, id)| id.is_none()
                    || matches!(g.tensors[k].role, Role::Param | Role::Buffer)),
            "a tensor outlived its iteration"
        );
        self.b.iteration_end();
    }

    fn zero_grad(&mut self) {
        if self.cfg.torch == TorchBehaviour::V1_13 {
            return; // grads are zeroed in place and kept
        }
        for k in 0..self.grads.len() {
            if let Some(id) = self.grads[k].take() {
                self.b.free(id);
            }
        }
    }

    /// GradScaler (fp16): `scaler.scale(loss)` multiplies by a lazily created scale tensor.
    fn scale_loss(&mut self) -> Option<u64> {
        if self.cfg.precision != Precision::AmpFp16 {
            return None;
        }
        if !self.scaler_ready {
            self.b
                .alloc(4, Category::OptimizerState, Phase::Forward, "grad_scaler");
            self.b
                .alloc(4, Category::OptimizerState, Phase::Forward, "grad_scaler");
            self.scaler_ready = true;
        }
        Some(
            self.b
                .alloc(4, Category::Temporary, Phase::Forward, "scale_loss"),
        )
    }

    /// The autograd engine, node by node in reverse creation order: the node allocates its
    /// outputs (and temporaries); when it returns, its incoming gradients die, then its saved
    /// tensors; then its outputs go to the next nodes' input buffers (spec §3.1.6–3.1.8).
    fn backward(&mut self, g: &Graph, p: &mut Pass, scaled_root: Option<u64>) {
        let Some(loss) = g.loss else { return };
        let mut bufs = GradBufs::default();
        let mut grad: Vec<Option<usize>> = vec![None; g.tensors.len()];
        let ones = self
            .b
            .alloc(4, Category::Temporary, Phase::Backward, "ones_like");
        let root = bufs.new_buf(ones);
        // The engine also holds the root gradient until the whole backward returns.
        bufs.0[root].1 += 1;
        grad[loss.0 as usize] = Some(root);
        let param_index: HashMap<TensorId, usize> =
            g.params.iter().enumerate().map(|(k, &t)| (t, k)).collect();
        for ni in (0..g.nodes.len()).rev() {
            let n = &g.nodes[ni];
            let incoming: Vec<usize> = n
                .outputs
                .iter()
                .filter_map(|o| grad[o.0 as usize].take())
                .collect();
            let mut outputs: Vec<(TensorId, usize)> = Vec::new();
            if !n.bw.is_empty() && !incoming.is_empty() {
                let mut temps = Vec::new();
                for step in &n.bw {
                    match *step {
                        Bw::Temp(bytes) => temps.push(self.b.alloc(
                            bytes,
                            Category::Temporary,
                            Phase::Backward,
                            n.name,
                        )),
                        Bw::Grad(i) | Bw::PassThrough(i) => {
                            let t = n.inputs[i];
                            let tensor = g.t(t);
                            if !tensor.requires_grad {
                                continue;
                            }
                            let out = match *step {
                                Bw::PassThrough(_) => {
                                    bufs.0[incoming[0]].1 += 1;
                                    incoming[0]
                                }
                                _ => {
                                    let cat = if tensor.role == Role::Param {
                                        Category::Gradient
                                    } else {
                                        Category::Temporary
                                    };
                                    let id =
                                        self.b.alloc(tensor.bytes(), cat, Phase::Backward, n.name);
                                    if n.cublas {
                                        self.workspace(Phase::Backward);
                                    }
                                    // cuDNN computes the input's gradient, then the weight's,
                                    // each with its own workspace.
                                    if let Some(c) = &n.conv {
                                        let pass = match i {
                                            0 => Some(ConvPass::BackwardData),
                                            1 => Some(ConvPass::BackwardFilter),
                                            _ => None,
                                        };
                                        if let Some(pass) = pass {
                                            self.b.workspace(
                                                &c.key,
                                                c.n,
                                                pass,
                                                Phase::Backward,
                                                None,
                                            );
                                        }
                                    }
                                    bufs.new_buf(id)
                                }
                            };
                            outputs.push((t, out));
                        }
                    }
                }
                // Backward reads what forward read and wrote, and writes input-sized gradients.
                self.b.op(
                    n.name,
                    2 * n.flops,
                    n.bytes_read + n.bytes_written,
                    n.bytes_read,
                );
                for id in temps {
                    self.b.free(id);
                }
            }
            for b in incoming {
                self.drop_grad(&mut bufs, b);
            }
            for &s in &n.saved {
                self.release(g, p, s);
            }
            for (t, out) in outputs {
                match param_index.get(&t) {
                    Some(&k) => self.accumulate_param(&mut bufs, k, out, g.t(t).bytes()),
                    None => self.accumulate(&mut bufs, &mut grad, t, out, g.t(t).bytes()),
                }
            }
        }
        self.drop_grad(&mut bufs, root);
        if let Some(id) = scaled_root {
            self.b.free(id);
        }
    }

    fn drop_grad(&mut self, bufs: &mut GradBufs, b: usize) {
        let e = &mut bufs.0[b];
        e.1 -= 1;
        if e.1 == 0 {
            self.b.free(e.0);
        }
    }

    /// InputBuffer::accumulate: keep the first gradient; add a later one in place into whichever
    /// of the two is exclusively owned (the other reference dies), else sum out of place.
    fn accumulate(
        &mut self,
        bufs: &mut GradBufs,
        grad: &mut [Option<usize>],
        t: TensorId,
        new: usize,
        bytes: u64,
    ) {
        let k = t.0 as usize;
        let Some(old) = grad[k] else {
            grad[k] = Some(new);
            return;
        };
        if bufs.0[old].1 == 1 {
            self.drop_grad(bufs, new);
        } else if bufs.0[new].1 == 1 {
            grad[k] = Some(new);
            self.drop_grad(bufs, old);
        } else {
            let id = self
                .b
                .alloc(bytes, Category::Temporary, Phase::Backward, "accumulate");
            grad[k] = Some(bufs.new_buf(id));
            self.drop_grad(bufs, old);
            self.drop_grad(bufs, new);
        }
    }

    /// AccumulateGrad: the first gradient becomes `p.grad` (stolen, when nothing else holds
    /// it; else a clone); later ones are added in place.
    fn accumulate_param(&mut self, bufs: &mut GradBufs, k: usize, new: usize, bytes: u64) {
        if self.grads[k].is_none() {
            if bufs.0[new].1 == 1 {
                self.grads[k] = Some(bufs.0[new].0);
                return;
            }
            self.grads[k] = Some(self.b.alloc(
                bytes,
                Category::Gradient,
                Phase::Backward,
                "accumulate_grad",
            ));
        }
        self.drop_grad(bufs, new);
    }

    fn step(&mut self, g: &Graph) {
        let sizes: Vec<u64> = g.params.iter().map(|&t| g.t(t).bytes()).collect();
        let have: Vec<usize> = (0..sizes.len())
            .filter(|&k| self.grads[k].is_some() || self.cfg.torch == TorchBehaviour::V1_13)
            .collect();
        let ph = Phase::Optimizer;
        if self.cfg.precision == Precision::AmpFp16 {
            // unscale_: found_inf and the inverse scale (scalars); grads are unscaled in place.
            let f = self.b.alloc(4, Category::Temporary, ph, "unscale");
            let inv = self.b.alloc(4, Category::Temporary, ph, "unscale");
            self.b.free(inv);
            self.b.free(f);
        }
        let first = self.optimizer_steps == 0;
        self.optimizer_steps += 1;
        let params: Vec<Param> = have
            .iter()
            .map(|&k| {
                let t = g.t(g.params[k]);
                Param {
                    numel: t.numel,
                    elem_bytes: t.dtype.size(),
                }
            })
            .collect();
        let mut ids = Vec::new();
        for ev in step_events(self.cfg.optimizer, self.cfg.torch, &params, first) {
            match ev {
                StepEvent::Alloc {
                    bytes,
                    category,
                    what,
                } => ids.push(self.b.alloc(bytes, category, ph, what)),
                StepEvent::Free(k) => self.b.free(ids[k]),
            }
        }
        let total: u64 = sizes.iter().sum();
        self.b
            .op("optimizer_step", 10 * total / 4, 4 * total, 2 * total);
    }
}
