//! The optimizer's step as PyTorch (2.1 and later) and the optimizer libraries issue its
//! allocations, for the native families: the state each optimizer makes at its first step and
//! the temporaries of each implementation. Checked event for event against the real optimizers
//! run on meta tensors (`python/tests/test_optimizers.py` records them into
//! `crates/gpumem-core/tests/data/optimizer-steps.json`, which `tests/optimizers.rs` replays).

use crate::job::{Adafactor, Bnb, BnbAlgorithm, BnbBits, Implementation, Optimizer, Torchao};
use crate::trace::Category;

use super::TorchBehaviour;

/// bitsandbytes' 8-bit optimizers keep tensors smaller than this in 32 bits (`min_8bit_size`).
pub const BNB_MIN_8BIT_SIZE: u64 = 4096;
/// Elements per absmax scale of bitsandbytes' blockwise-quantized state.
pub const BNB_BLOCK: u64 = 256;
/// bitsandbytes' paged optimizers page states of at least this many elements
/// (`Optimizer8bit.get_state_buffer`: `p.numel() < 1e5` stays in ordinary device memory).
pub const BNB_PAGED_MIN: u64 = 100_000;
/// A quantization map (`dynamic`, `udynamic`: 256 fp32) bitsandbytes moves to the GPU once.
pub const BNB_QMAP_BYTES: u64 = 256 * 4;
/// torchao quantizes states of at least this many elements whose count its block divides.
pub const TORCHAO_MIN_SIZE: u64 = 4096;

/// A parameter as the optimizer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Param {
    pub numel: u64,
    /// Bytes per element of the parameter (and of the states made like it).
    pub elem_bytes: u64,
}

impl Param {
    fn bytes(self) -> u64 {
        self.numel * self.elem_bytes
    }
}

/// One event of a step: an allocation (which the step keeps as state, or frees later), or the
/// free of the step's `k`-th allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepEvent {
    Alloc {
        bytes: u64,
        category: Category,
        what: &'static str,
    },
    Free(usize),
}

/// An optimizer a native family model cannot train with, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "optimizer {optimizer} applies to PyTorch models here: {why} (the native families model adam, adamw, sgd and sgd-momentum in every implementation, transformers' AdamW, bitsandbytes' and torchao's optimizers)"
)]
pub struct NotNative {
    pub optimizer: String,
    pub why: &'static str,
}

/// Whether the native families model `optimizer`'s step.
pub fn native(optimizer: Optimizer) -> Result<(), NotNative> {
    let why = match optimizer {
        Optimizer::Adafactor(Adafactor::Torch(_) | Adafactor::Transformers) => {
            "its factored state is sized by each parameter's rows and columns, and the native graphs hold parameter sizes, not shapes"
        }
        Optimizer::Muon => {
            "it takes only the 2-D parameters, and the native graphs hold parameter sizes, not shapes"
        }
        Optimizer::Adagrad(_) | Optimizer::RmsProp(_) => {
            "its step is traced from torch's own code by the tracer, not modelled natively"
        }
        _ => return Ok(()),
    };
    Err(NotNative {
        optimizer: optimizer.name(),
        why,
    })
}

struct Events(Vec<StepEvent>, usize);

impl Events {
    fn alloc(&mut self, bytes: u64, category: Category, what: &'static str) -> usize {
        self.0.push(StepEvent::Alloc {
            bytes,
            category,
            what,
        });
        self.1 += 1;
        self.1 - 1
    }
    fn state(&mut self, bytes: u64, what: &'static str) {
        self.alloc(bytes, Category::OptimizerState, what);
    }
    fn temp(&mut self, bytes: u64, what: &'static str) -> usize {
        self.alloc(bytes, Category::Temporary, what)
    }
    fn free(&mut self, k: usize) {
        self.0.push(StepEvent::Free(k));
    }
}

/// The allocations and frees of one `optimizer.step()` over `params` (those with gradients, in
/// the optimizer's order); `first`: the step that makes the state. Panics on an optimizer
/// [`native`] refuses.
pub fn step_events(
    optimizer: Optimizer,
    torch: TorchBehaviour,
    params: &[Param],
    first: bool,
) -> Vec<StepEvent> {
    let mut e = Events(Vec::new(), 0);
    match optimizer {
        Optimizer::Adam(i) | Optimizer::AdamW(i) => adam(&mut e, i, torch, params, first),
        Optimizer::TransformersAdamW => transformers_adamw(&mut e, params, first),
        Optimizer::Sgd(_) => {}
        Optimizer::SgdMomentum(_) => {
            if first {
                // A clone of the gradient (`empty_like` for the fused kernel), per parameter.
                for p in params {
                    e.state(p.bytes(), "momentum_buffer");
                }
            }
        }
        Optimizer::Bnb(b) => {
            if first {
                bnb(&mut e, b, params);
            }
        }
        Optimizer::Torchao(t) => {
            if first {
                torchao(&mut e, t, params);
            }
        }
        other => panic!("{}", native(other).unwrap_err()),
    }
    e.0
}

fn adam(e: &mut Events, i: Implementation, torch: TorchBehaviour, params: &[Param], first: bool) {
    if first {
        for p in params {
            // `_init_group`: the step counter is a CPU scalar, on the device for the fused
            // kernel; then the two moments, `zeros_like(p)`.
            if i == Implementation::Fused {
                e.state(4, "step");
            }
            e.state(p.bytes(), "exp_avg");
            e.state(p.bytes(), "exp_avg_sq");
        }
    }
    if torch == TorchBehaviour::V1_13 {
        // 1.13's single-tensor Adam: `denom = (exp_avg_sq.sqrt() / bc).add_(eps)`.
        for p in params {
            let s = e.temp(p.bytes(), "sqrt");
            let d = e.temp(p.bytes(), "div");
            e.free(s);
            e.free(d);
        }
        return;
    }
    match i {
        Implementation::Foreach => {
            // exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs): a list of parameter-sized temporaries
            // (2.0 also added eps out of place: a second list).
            let sqrt: Vec<usize> = params
                .iter()
                .map(|p| e.temp(p.bytes(), "_foreach_sqrt"))
                .collect();
            let denom: Vec<usize> = if torch == TorchBehaviour::V2_0 {
                params
                    .iter()
                    .map(|p| e.temp(p.bytes(), "_foreach_add"))
                    .collect()
            } else {
                Vec::new()
            };
            // Python frees a list's items last to first.
            for k in sqrt.into_iter().chain(denom).rev() {
                e.free(k);
            }
        }
        Implementation::ForLoop => {
            // `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`: the square root
            // dies once divided; the previous parameter's `denom` when the name is rebound.
            let mut denom = None;
            for p in params {
                let s = e.temp(p.bytes(), "sqrt");
                let d = e.temp(p.bytes(), "div");
                e.free(s);
                if let Some(old) = denom.replace(d) {
                    e.free(old);
                }
            }
            if let Some(d) = denom {
                e.free(d);
            }
        }
        // `_fused_adam_`: one kernel, in place.
        Implementation::Fused => {}
    }
}

/// transformers' AdamW: per parameter, its moments where it has none yet (`zeros_like(p)`),
/// then `denom = exp_avg_sq.sqrt().add_(eps)`, which lives until the next parameter's replaces
/// it; the rest of the update is in place.
fn transformers_adamw(e: &mut Events, params: &[Param], first: bool) {
    let mut denom = None;
    for p in params {
        if first {
            e.state(p.bytes(), "exp_avg");
            e.state(p.bytes(), "exp_avg_sq");
        }
        let d = e.temp(p.bytes(), "sqrt");
        if let Some(old) = denom.replace(d) {
            e.free(old);
        }
    }
    if let Some(d) = denom {
        e.free(d);
    }
}

fn bnb(e: &mut Events, b: Bnb, params: &[Param]) {
    let two_states = b.algorithm != BnbAlgorithm::Lion;
    let mut qmaps = false;
    for p in params {
        // `get_state_buffer`: managed memory for a paged optimizer's larger states.
        let kept = |e: &mut Events, bytes: u64, what: &'static str| {
            if b.paged && p.numel >= BNB_PAGED_MIN {
                e.alloc(bytes, Category::HostBacked, what);
            } else {
                e.state(bytes, what);
            }
        };
        if b.bits == BnbBits::ThirtyTwo || p.numel < BNB_MIN_8BIT_SIZE {
            kept(e, 4 * p.numel, "state1");
            if two_states {
                kept(e, 4 * p.numel, "state2");
            }
            continue;
        }
        if !qmaps {
            // The maps go to the GPU with the first 8-bit state (Lion's one, Adam's two).
            e.state(BNB_QMAP_BYTES, "qmap_dynamic");
            if two_states {
                e.state(BNB_QMAP_BYTES, "qmap_udynamic");
            }
            qmaps = true;
        }
        kept(e, p.numel, "state1");
        if two_states {
            kept(e, p.numel, "state2");
        }
        let absmax = 4 * p.numel.div_ceil(BNB_BLOCK);
        e.state(absmax, "absmax1");
        if two_states {
            e.state(absmax, "absmax2");
        }
    }
}

/// torchao's state of a parameter: `(block, bytes of the codes, entries of each map)` of its
/// quantized format, where it is quantized.
fn torchao(e: &mut Events, t: Torchao, params: &[Param]) {
    let (block, signed_map, unsigned_map) = match t {
        Torchao::AdamW8bit => (256, 256, 256),
        Torchao::AdamW4bit => (128, 16, 16),
        Torchao::AdamWFp8 => (256, 0, 0),
    };
    for p in params {
        if p.numel < TORCHAO_MIN_SIZE || !p.numel.is_multiple_of(block) {
            // `zeros_like(p)`, twice.
            e.state(p.bytes(), "exp_avg");
            e.state(p.bytes(), "exp_avg_sq");
            continue;
        }
        for map in [signed_map, unsigned_map] {
            let codes = match t {
                Torchao::AdamW4bit => p.numel / 2,
                _ => p.numel,
            };
            e.state(codes, "codes");
            e.state(4 * (p.numel / block), "scale");
            if map > 0 {
                e.state(4 * map, "qmap");
            }
        }
    }
}
