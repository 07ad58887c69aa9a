//! Batch-symbolic traces: one trace that answers any batch size.
//!
//! A model's training step issues the same allocations at every batch size; only their sizes
//! change, and for a fixed model each size is an affine function of the batch, `c0 + c1·B`.
//! [`SymbolicTrace::fit`] aligns traces taken at three batch sizes event by event, solves each
//! size exactly from the first two and checks it against the third; [`SymbolicTrace::at`]
//! evaluates the trace at any batch size, so a max-batch search needs no re-tracing.
//!
//! A whole trace costs time per block of the model (a 7B model's 32 layers), so three of them
//! cost three times one. [`SymbolicTrace::transfer`] takes the whole trace at one batch size and
//! traces of the model cut to a few blocks at three (cheap): each event of the whole trace
//! takes the functions of the batch of the cut traces' events alike at its batch size — the
//! same kernel, kind, phase and size in the same module of a block, whichever block. Nothing is
//! carried over that the traces do not show, but that the whole trace's event sequence is the
//! same at every batch size where the cut traces' is:
//! - events alike at the whole trace's batch size must have the same functions in the cut
//!   traces (two tensors of a block may coincide there and part at another batch size), or
//!   be told apart by the event before them;
//! - what happens before the first batch is made (the setup, up to the first allocation in
//!   forward) is held constant;
//! - an allocation or workspace of the whole trace the cut traces lack (a buffer over blocks)
//!   must be one the batch cannot size: made in setup, zero_grad or the optimizer's step
//!   (none sees the batch), or by an op the header names `sized_by_parameters` (ZeRO's
//!   engine's partitions, gathers and buckets, DDP's rebuilt buckets); it is held constant;
//! - a kernel the cut traces lack is held constant: the kernels over blocks are the
//!   optimizer's and the engines' over the parameters, and one over batch-sized tensors of
//!   every block would make such a tensor, which the rule above refuses.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, Write};

use serde::{Deserialize, Serialize};

use crate::depth::{generic_module, numbers};
use crate::trace::{
    Category, ConvPass, Event, Phase, RunPhase, Trace, TraceBuilder, TraceError, TraceHeader,
};

/// Why traces could not be fitted, a symbolic trace evaluated, or a stored one read back.
/// Events are numbered from 1.
#[derive(Debug, thiserror::Error)]
pub enum SymbolicError {
    #[error("need traces at three or more batch sizes")]
    TooFewTraces,
    #[error("{events} events at batch {batch} but {other_events} at batch {other_batch}")]
    EventCounts {
        events: usize,
        batch: u64,
        other_events: usize,
        other_batch: u64,
    },
    #[error("op names or ids differ between batch {batch} and {other_batch}")]
    NamesDiffer { batch: u64, other_batch: u64 },
    #[error("event {event} differs in kind across batch sizes")]
    KindDiffers { event: usize },
    #[error("allocation {event} differs across batch sizes")]
    AllocationDiffers { event: usize },
    #[error("free {event} differs across batch sizes")]
    FreeDiffers { event: usize },
    /// (batch, size) points of one event that no `c0 + c1·batch` passes through.
    #[error("event {event} is not affine in the batch size: {points:?}")]
    NotAffine {
        event: usize,
        points: Vec<(u64, u64)>,
    },
    #[error("event {event} has a negative size at batch {batch}")]
    NegativeSize { event: usize, batch: u64 },
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error("not a {FILE_FORMAT} version {FILE_VERSION}")]
    Format,
    #[error("no batch sizes it was fitted at")]
    NoBatches,
    #[error("name {0} out of range")]
    NameOutOfRange(u32),
    #[error("slot {0} out of range")]
    SlotOutOfRange(u32),
    #[error(transparent)]
    Trace(#[from] TraceError),
    #[error("ids do not match their slots")]
    IdsMismatch,
    #[error(
        "event {event} of the whole trace is alike at its batch size to events of the cut traces that differ with the batch"
    )]
    Ambiguous { event: usize },
    #[error(
        "event {event} of the whole trace is in forward or backward and in none of the cut traces: the batch may size it"
    )]
    NotInCut { event: usize },
    #[error("the cut traces are of {cut}, the whole trace of {whole}")]
    OtherModel { cut: String, whole: String },
}

/// `(c0 + c1 · batch) / d`, exact in integers, rounded up where `d` does not divide it. Sizes
/// in bytes have `d = 1`; a per-replica batch (`n` of a data-parallel job's convolution: the
/// batch split over its GPUs, rounded up as `torch.nn.DataParallel` splits it) needs `d > 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Affine {
    pub c0: i128,
    pub c1: i128,
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub d: i128,
}

fn one() -> i128 {
    1
}

fn is_one(d: &i128) -> bool {
    *d == 1
}

impl Affine {
    fn fit(points: &[(u64, u64)]) -> Option<Affine> {
        (1..=64).find_map(|d| Self::fit_scaled(points, d))
    }

    fn fit_scaled(points: &[(u64, u64)], d: i128) -> Option<Affine> {
        let (b1, y1) = (points[0].0 as i128, d * points[0].1 as i128);
        let (b2, y2) = (points[1].0 as i128, d * points[1].1 as i128);
        if (y2 - y1) % (b2 - b1) != 0 {
            return None;
        }
        let c1 = (y2 - y1) / (b2 - b1);
        let f = Affine {
            c0: y1 - c1 * b1,
            c1,
            d,
        };
        points
            .iter()
            .all(|&(b, y)| f.eval(b) == Some(y))
            .then_some(f)
    }

    fn constant(v: u64) -> Affine {
        Affine {
            c0: i128::from(v),
            c1: 0,
            d: 1,
        }
    }

    pub fn eval(&self, b: u64) -> Option<u64> {
        let v = self.c0.checked_add(self.c1.checked_mul(b as i128)?)?;
        if v < 0 || self.d < 1 {
            return None; // a damaged stored trace (d is at least 1 when fitted)
        }
        if self.d == 1 {
            return u64::try_from(v).ok(); // sizes in bytes: no 128-bit division, a plan's hot spot
        }
        u64::try_from(v.checked_add(self.d - 1)? / self.d).ok()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
enum SymEvent {
    Alloc {
        slot: u32,
        bytes: Affine,
        category: Category,
        phase: Phase,
        op: u32,
        module: u32,
        stream: u32,
    },
    Free {
        slot: u32,
    },
    Op {
        op: u32,
        flops: Affine,
        bytes_read: Affine,
        bytes_written: Affine,
    },
    Iteration {
        index: u32,
    },
    RunPhase {
        phase: RunPhase,
    },
    EmptyCache,
    Workspace {
        conv: u32,
        n: Affine,
        pass: ConvPass,
        phase: Phase,
        module: u32,
    },
}

impl SymEvent {
    /// Its numbers' functions: an allocation's size, a kernel's flops and bytes read and
    /// written, a workspace's batch; `None` for frees and iteration ends.
    fn functions(&self) -> Option<[Affine; 3]> {
        let zero = Affine::constant(0);
        match *self {
            SymEvent::Alloc { bytes, .. } => Some([bytes, zero, zero]),
            SymEvent::Op {
                flops,
                bytes_read,
                bytes_written,
                ..
            } => Some([flops, bytes_read, bytes_written]),
            SymEvent::Workspace { n, .. } => Some([n, zero, zero]),
            SymEvent::Free { .. }
            | SymEvent::Iteration { .. }
            | SymEvent::RunPhase { .. }
            | SymEvent::EmptyCache => None,
        }
    }

    /// `e` (of the trace whose names `op`, `module` and `conv` index) with these functions.
    fn with(e: &Event, f: [Affine; 3]) -> SymEvent {
        match *e {
            Event::Alloc {
                slot,
                category,
                phase,
                op,
                module,
                stream,
                ..
            } => SymEvent::Alloc {
                slot,
                bytes: f[0],
                category,
                phase,
                op,
                module,
                stream,
            },
            Event::Op { op, .. } => SymEvent::Op {
                op,
                flops: f[0],
                bytes_read: f[1],
                bytes_written: f[2],
            },
            Event::Workspace {
                conv,
                pass,
                phase,
                module,
                ..
            } => SymEvent::Workspace {
                conv,
                n: f[0],
                pass,
                phase,
                module,
            },
            Event::Free { slot } => SymEvent::Free { slot },
            Event::Iteration { index } => SymEvent::Iteration { index },
            Event::RunPhase { phase } => SymEvent::RunPhase { phase },
            Event::EmptyCache => SymEvent::EmptyCache,
        }
    }
}

/// What an event is at one batch size, its module's block index left out: how an event of a
/// whole trace finds its kind among a cut trace's.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Likeness {
    Alloc {
        bytes: u64,
        category: Category,
        phase: Phase,
        op: String,
        module: String,
        stream: u32,
    },
    Op {
        op: String,
        numbers: [u64; 3],
    },
    Workspace {
        conv: String,
        n: u64,
        pass: ConvPass,
        phase: Phase,
        module: String,
    },
}

/// `None` for frees and iteration ends.
fn likeness(t: &Trace, e: &Event) -> Option<Likeness> {
    Some(match *e {
        Event::Alloc {
            bytes,
            category,
            phase,
            op,
            module,
            stream,
            ..
        } => Likeness::Alloc {
            bytes,
            category,
            phase,
            op: t.op_name(op).into(),
            module: generic_module(t, module),
            stream,
        },
        Event::Op {
            op,
            flops,
            bytes_read,
            bytes_written,
        } => Likeness::Op {
            op: t.op_name(op).into(),
            numbers: [flops, bytes_read, bytes_written],
        },
        Event::Workspace {
            conv,
            n,
            pass,
            phase,
            module,
        } => Likeness::Workspace {
            conv: t.op_name(conv).into(),
            n,
            pass,
            phase,
            module: generic_module(t, module),
        },
        Event::Free { .. }
        | Event::Iteration { .. }
        | Event::RunPhase { .. }
        | Event::EmptyCache => return None,
    })
}

/// Each event's likeness and that of the last event before it that has one.
fn kinds(t: &Trace) -> impl Iterator<Item = (Option<Likeness>, Option<Likeness>)> + '_ {
    let mut last = None;
    t.events.iter().map(move |e| {
        let l = likeness(t, e);
        let previous = if l.is_some() {
            std::mem::replace(&mut last, l.clone())
        } else {
            last.clone()
        };
        (l, previous)
    })
}

fn constants(e: &Event) -> [Affine; 3] {
    numbers(e).map(Affine::constant)
}

/// A trace whose sizes are functions of the batch size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SymbolicTrace {
    header: TraceHeader,
    events: Vec<SymEvent>,
    ops: Vec<String>,
    ids: Vec<u64>,
    pub traced_at: Vec<u64>,
}

impl SymbolicTrace {
    /// The header of the traces it was fitted from (`batch_size`: the first of them).
    pub fn header(&self) -> &TraceHeader {
        &self.header
    }

    /// Batch sizes the bridge traces to fit a symbolic trace.
    pub const FIT_BATCHES: [u64; 3] = [4, 6, 8];

    /// Fits from traces of one model at different batch sizes (at least three).
    pub fn fit(traces: &[Trace]) -> Result<SymbolicTrace, SymbolicError> {
        if traces.len() < 3 {
            return Err(SymbolicError::TooFewTraces);
        }
        let first = &traces[0];
        let n = first.events().len();
        for t in &traces[1..] {
            if t.events().len() != n {
                return Err(SymbolicError::EventCounts {
                    events: n,
                    batch: first.header.batch_size,
                    other_events: t.events().len(),
                    other_batch: t.header.batch_size,
                });
            }
            if t.ops != first.ops || t.ids != first.ids {
                return Err(SymbolicError::NamesDiffer {
                    batch: first.header.batch_size,
                    other_batch: t.header.batch_size,
                });
            }
        }
        let batches: Vec<u64> = traces.iter().map(|t| t.header.batch_size).collect();
        let affine = |k: usize, get: &dyn Fn(&Event) -> u64| -> Result<Affine, SymbolicError> {
            let points: Vec<(u64, u64)> = traces
                .iter()
                .map(|t| (t.header.batch_size, get(&t.events()[k])))
                .collect();
            Affine::fit(&points).ok_or(SymbolicError::NotAffine {
                event: k + 1,
                points,
            })
        };
        let mut events = Vec::with_capacity(n);
        for k in 0..n {
            let e = first.events()[k];
            let same_kind = traces
                .iter()
                .all(|t| std::mem::discriminant(&t.events()[k]) == std::mem::discriminant(&e));
            if !same_kind {
                return Err(SymbolicError::KindDiffers { event: k + 1 });
            }
            events.push(match e {
                Event::Alloc { slot, category, phase, op, module, stream, .. } => {
                    let ok = traces.iter().all(|t| matches!(t.events()[k], Event::Alloc { slot: s, category: c, phase: p, op: o, module: m, stream: st, .. } if s == slot && c == category && p == phase && o == op && m == module && st == stream));
                    if !ok {
                        return Err(SymbolicError::AllocationDiffers { event: k + 1 });
                    }
                    SymEvent::Alloc { slot, bytes: affine(k, &|e| if let Event::Alloc { bytes, .. } = e { *bytes } else { 0 })?, category, phase, op, module, stream }
                }
                Event::Free { slot } => {
                    if !traces.iter().all(|t| t.events()[k] == e) {
                        return Err(SymbolicError::FreeDiffers { event: k + 1 });
                    }
                    SymEvent::Free { slot }
                }
                Event::Iteration { index } => SymEvent::Iteration { index },
                Event::RunPhase { phase } => {
                    if !traces.iter().all(|t| t.events()[k] == e) {
                        return Err(SymbolicError::KindDiffers { event: k + 1 });
                    }
                    SymEvent::RunPhase { phase }
                }
                Event::EmptyCache => SymEvent::EmptyCache,
                Event::Workspace { conv, pass, phase, module, .. } => {
                    let ok = traces.iter().all(|t| matches!(t.events()[k], Event::Workspace { conv: c, pass: p, phase: ph, module: m, .. } if c == conv && p == pass && ph == phase && m == module));
                    if !ok {
                        return Err(SymbolicError::AllocationDiffers { event: k + 1 });
                    }
                    SymEvent::Workspace { conv, n: affine(k, &|e| if let Event::Workspace { n, .. } = e { *n } else { 0 })?, pass, phase, module }
                }
                Event::Op { op, .. } => SymEvent::Op {
                    op,
                    flops: affine(k, &|e| if let Event::Op { flops, .. } = e { *flops } else { 0 })?,
                    bytes_read: affine(k, &|e| if let Event::Op { bytes_read, .. } = e { *bytes_read } else { 0 })?,
                    bytes_written: affine(k, &|e| if let Event::Op { bytes_written, .. } = e { *bytes_written } else { 0 })?,
                },
            });
        }
        Ok(SymbolicTrace {
            header: first.header.clone(),
            events,
            ops: first.ops.clone(),
            ids: first.ids.clone(),
            traced_at: batches,
        })
    }

    /// Fits from `whole`, the model's trace at one batch size, and `cut`, traces of the same
    /// model cut to a few of its blocks at three or more batch sizes (see the module's doc for
    /// what is carried over and what is refused).
    pub fn transfer(whole: &Trace, cut: &[Trace]) -> Result<SymbolicTrace, SymbolicError> {
        if let Some(c) = cut.iter().find(|c| c.header.model != whole.header.model) {
            return Err(SymbolicError::OtherModel {
                cut: c.header.model.clone(),
                whole: whole.header.model.clone(),
            });
        }
        let slopes = SymbolicTrace::fit(cut)?;
        let b0 = whole.header.batch_size;
        let at = slopes.at(b0)?;
        // Each kind of the cut traces' events at b0 → its functions (None: kinds alike at b0
        // that part at other batch sizes), and the same kind after each kind of event before it
        // (frees and iteration ends skipped), which tells apart what the kind alone does not
        // (a kernel has no module: a weight's cast and an activation's may be alike).
        let mut alike: HashMap<Likeness, Option<[Affine; 3]>> = HashMap::new();
        let mut alike_after: HashMap<(Likeness, Likeness), Option<[Affine; 3]>> = HashMap::new();
        for (l, previous, f) in kinds(&at)
            .zip(&slopes.events)
            .filter_map(|((l, p), s)| Some((l?, p, s.functions()?)))
        {
            let file = |g: &mut Option<[Affine; 3]>| {
                if *g != Some(f) {
                    *g = None
                }
            };
            if let Some(p) = previous {
                alike_after
                    .entry((l.clone(), p))
                    .and_modify(file)
                    .or_insert(Some(f));
            }
            alike.entry(l).and_modify(file).or_insert(Some(f));
        }
        let fixed: HashSet<&str> = whole
            .header
            .sized_by_parameters
            .iter()
            .map(String::as_str)
            .collect();
        let mut events = Vec::with_capacity(whole.events.len());
        // Until the first batch is made (in forward), nothing can depend on it.
        let mut batch_made = false;
        for (k, (e, (l, previous))) in whole.events.iter().zip(kinds(whole)).enumerate() {
            batch_made |= matches!(
                e,
                Event::Alloc {
                    phase: Phase::Forward | Phase::Backward,
                    ..
                }
            );
            if !batch_made {
                events.push(SymEvent::with(e, constants(e)));
                continue;
            }
            let found = l.map(|l| match alike.get(&l) {
                Some(None) => {
                    Some(previous.and_then(|p| alike_after.get(&(l, p)).copied().flatten()))
                }
                f => f.copied(),
            });
            let f = match found {
                None => [Affine::constant(0); 3], // a free or an iteration's end: no numbers
                Some(Some(Some(f))) => f,
                Some(Some(None)) => return Err(SymbolicError::Ambiguous { event: k + 1 }),
                Some(None) => {
                    let batch_blind = match *e {
                        Event::Alloc { phase, op, .. } => {
                            !matches!(phase, Phase::Forward | Phase::Backward)
                                || fixed.contains(whole.op_name(op))
                        }
                        Event::Op { .. } => true,
                        _ => false,
                    };
                    if !batch_blind {
                        return Err(SymbolicError::NotInCut { event: k + 1 });
                    }
                    constants(e)
                }
            };
            events.push(SymEvent::with(e, f));
        }
        let traced_at = std::iter::once(b0)
            .chain(slopes.traced_at.into_iter().filter(|&b| b != b0))
            .collect();
        Ok(SymbolicTrace {
            header: whole.header.clone(),
            events,
            ops: whole.ops.clone(),
            ids: whole.ids.clone(),
            traced_at,
        })
    }

    /// The trace at `batch`.
    pub fn at(&self, batch: u64) -> Result<Trace, SymbolicError> {
        let neg = |k: usize| SymbolicError::NegativeSize {
            event: k + 1,
            batch,
        };
        let mut events = Vec::with_capacity(self.events.len());
        for (k, e) in self.events.iter().enumerate() {
            events.push(match *e {
                SymEvent::Alloc {
                    slot,
                    bytes,
                    category,
                    phase,
                    op,
                    module,
                    stream,
                } => Event::Alloc {
                    slot,
                    bytes: bytes.eval(batch).ok_or_else(|| neg(k))?,
                    category,
                    phase,
                    op,
                    module,
                    stream,
                },
                SymEvent::Free { slot } => Event::Free { slot },
                SymEvent::Iteration { index } => Event::Iteration { index },
                SymEvent::RunPhase { phase } => Event::RunPhase { phase },
                SymEvent::EmptyCache => Event::EmptyCache,
                SymEvent::Workspace {
                    conv,
                    n,
                    pass,
                    phase,
                    module,
                } => Event::Workspace {
                    conv,
                    n: n.eval(batch).ok_or_else(|| neg(k))?,
                    pass,
                    phase,
                    module,
                },
                SymEvent::Op {
                    op,
                    flops,
                    bytes_read,
                    bytes_written,
                } => Event::Op {
                    op,
                    flops: flops.eval(batch).unwrap_or(0),
                    bytes_read: bytes_read.eval(batch).unwrap_or(0),
                    bytes_written: bytes_written.eval(batch).unwrap_or(0),
                },
            });
        }
        let mut header = self.header.clone();
        header.batch_size = batch;
        Ok(Trace {
            header,
            events,
            ops: self.ops.clone(),
            ids: self.ids.clone(),
        })
    }
}

/// Format name of a stored symbolic trace (gpumem's own cache files, not an exchange format).
const FILE_FORMAT: &str = "gpumem-symbolic-trace";
const FILE_VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct File<T> {
    format: String,
    version: u32,
    trace: T,
}

impl SymbolicTrace {
    /// Writes the trace as one JSON document.
    pub fn write(&self, w: impl Write) -> Result<(), SymbolicError> {
        Ok(serde_json::to_writer(
            w,
            &File {
                format: FILE_FORMAT.into(),
                version: FILE_VERSION,
                trace: self,
            },
        )?)
    }

    /// Reads what [`SymbolicTrace::write`] wrote, and checks that it evaluates to a valid trace
    /// (a damaged file is refused, never replayed; ids and frees are the same at every batch
    /// size, so one batch size checks them all).
    pub fn read(r: impl BufRead) -> Result<SymbolicTrace, SymbolicError> {
        let f: File<SymbolicTrace> = serde_json::from_reader(r)?;
        if f.format != FILE_FORMAT || f.version != FILE_VERSION {
            return Err(SymbolicError::Format);
        }
        let sym = f.trace;
        let b = *sym.traced_at.first().ok_or(SymbolicError::NoBatches)?;
        sym.at(b).and_then(|t| validated(&t))?;
        Ok(sym)
    }
}

/// `t` rebuilt through [`TraceBuilder`], which checks every id, slot and name.
fn validated(t: &Trace) -> Result<(), SymbolicError> {
    let name = |i: u32| {
        t.ops
            .get(i as usize)
            .map(String::as_str)
            .ok_or(SymbolicError::NameOutOfRange(i))
    };
    let id = |slot: u32| {
        t.ids
            .get(slot as usize)
            .copied()
            .ok_or(SymbolicError::SlotOutOfRange(slot))
    };
    let mut b = TraceBuilder::new(t.header.clone());
    for e in t.events() {
        match *e {
            Event::Alloc {
                slot,
                bytes,
                category,
                phase,
                op,
                module,
                stream,
            } => {
                let module = if module == crate::trace::NO_MODULE {
                    None
                } else {
                    Some(name(module)?)
                };
                b.alloc_with_id(
                    0,
                    id(slot)?,
                    bytes,
                    category,
                    phase,
                    name(op)?,
                    module,
                    stream,
                )?
            }
            Event::Free { slot } => b.free_at(0, id(slot)?)?,
            Event::Op {
                op,
                flops,
                bytes_read,
                bytes_written,
            } => b.op(name(op)?, flops, bytes_read, bytes_written),
            Event::Iteration { .. } => b.iteration_end(),
            Event::RunPhase { phase } => b.run_phase(phase),
            Event::EmptyCache => b.empty_cache(),
            Event::Workspace {
                conv,
                n,
                pass,
                phase,
                module,
            } => {
                let module = if module == crate::trace::NO_MODULE {
                    None
                } else {
                    Some(name(module)?)
                };
                b.workspace(name(conv)?, n, pass, phase, module)
            }
        }
    }
    let rebuilt = b.finish();
    if rebuilt.ids != t.ids {
        return Err(SymbolicError::IdsMismatch);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::families::{JobOptions, ModelSpec};
    use crate::toy::Toy;

    #[test]
    fn a_native_model_is_affine_in_the_batch() {
        let m = ModelSpec::parse(
            "cnn:classes=10,filters=16,depth=6,input=32,arch=residual,batchnorm=true,dropout=0.1",
        )
        .unwrap();
        let traces: Vec<Trace> = SymbolicTrace::FIT_BATCHES
            .iter()
            .map(|&b| m.trace(&JobOptions::new(b)).unwrap())
            .collect();
        let s = SymbolicTrace::fit(&traces).unwrap();
        for b in [1, 5, 13, 64] {
            assert_eq!(
                s.at(b).unwrap(),
                m.trace(&JobOptions::new(b)).unwrap(),
                "batch {b}"
            );
        }
    }

    #[test]
    fn a_stored_symbolic_trace_reads_back_and_damage_is_refused() {
        let m = ModelSpec::parse("mlp:input=8,output=2,depth=2").unwrap();
        let traces: Vec<Trace> = SymbolicTrace::FIT_BATCHES
            .iter()
            .map(|&b| m.trace(&JobOptions::new(b)).unwrap())
            .collect();
        let s = SymbolicTrace::fit(&traces).unwrap();
        let mut out = Vec::new();
        s.write(&mut out).unwrap();
        assert_eq!(SymbolicTrace::read(out.as_slice()).unwrap(), s);
        assert!(
            matches!(
                SymbolicTrace::read(&out[..out.len() / 2]),
                Err(SymbolicError::Json(_))
            ),
            "truncated"
        );
        let text = String::from_utf8(out).unwrap();
        // A free of a slot that was never allocated.
        let bad = text.replacen(r#"{"Free":{"slot":"#, r#"{"Free":{"slot":9999"#, 1);
        assert!(matches!(
            SymbolicTrace::read(bad.as_bytes()),
            Err(SymbolicError::SlotOutOfRange(_) | SymbolicError::Trace(_))
        ));
    }

    fn cut(toy: &Toy) -> Vec<Trace> {
        SymbolicTrace::FIT_BATCHES
            .iter()
            .map(|&b| toy.trace(b, 2, Some(12)))
            .collect()
    }

    /// The toy's symbolic trace carried over from its two-block cuts to its whole (12 blocks)
    /// trace at `b0`.
    fn carried(toy: &Toy, b0: u64) -> Result<SymbolicTrace, SymbolicError> {
        SymbolicTrace::transfer(&toy.trace(b0, 12, None), &cut(toy))
    }

    #[test]
    fn a_whole_trace_takes_the_batch_from_cut_traces() {
        let declared = Toy {
            over_blocks: Some(("zero_ipg_bucket", true, false)),
            views: true,
            ..Toy::default()
        };
        // At 4 the coinciding temporaries are alike, but not after what comes before them.
        let coinciding = Toy {
            coincide: true,
            ..Toy::default()
        };
        for (toy, b0) in [(&declared, 5), (&coinciding, 5), (&coinciding, 4)] {
            let s = carried(toy, b0).unwrap();
            assert_eq!(s.traced_at[0], b0);
            for b in [1, 4, 5, 7, 64] {
                assert_eq!(s.at(b).unwrap(), toy.trace(b, 12, None), "batch {b}");
            }
        }
    }

    #[test]
    fn what_the_cut_traces_do_not_show_is_refused() {
        // Buffers over blocks in backward that no engine declares: sized by the parameters or
        // by the batch (the hidden states of every block, stacked).
        for over_blocks in [("flatten", false, false), ("stack", false, true)] {
            let toy = Toy {
                over_blocks: Some(over_blocks),
                ..Toy::default()
            };
            assert!(
                matches!(carried(&toy, 5), Err(SymbolicError::NotInCut { .. })),
                "{over_blocks:?}"
            );
        }
        // Two views alike at the whole trace's batch size (1024 bytes at 4), after alike events.
        let toy = Toy {
            views: true,
            ..Toy::default()
        };
        assert!(matches!(
            carried(&toy, 4),
            Err(SymbolicError::Ambiguous { .. })
        ));
        let other = Trace {
            header: TraceHeader::new("other", 5),
            ..toy.trace(5, 12, None)
        };
        assert!(matches!(
            SymbolicTrace::transfer(&other, &cut(&toy)),
            Err(SymbolicError::OtherModel { .. })
        ));
    }

    #[test]
    fn a_per_replica_batch_is_the_batch_split_and_rounded_up() {
        // n of a 2-GPU DataParallel job's convolution at batch 8, 12 and 16.
        let n = Affine::fit(&[(8, 4), (12, 6), (16, 8)]).unwrap();
        assert_eq!((n.eval(20), n.eval(7), n.d), (Some(10), Some(4), 2));
        assert_eq!(
            Affine::fit(&[(4, 100), (6, 140), (8, 180)]).unwrap().d,
            1,
            "byte sizes stay whole"
        );
        assert!(Affine::fit(&[(4, 1), (6, 5), (8, 2)]).is_none());
    }

    #[test]
    fn misaligned_traces_are_refused() {
        let a = ModelSpec::parse("mlp:input=8,output=2,depth=1").unwrap();
        let b = ModelSpec::parse("mlp:input=8,output=2,depth=2").unwrap();
        let ts = vec![
            a.trace(&JobOptions::new(4)).unwrap(),
            b.trace(&JobOptions::new(6)).unwrap(),
            a.trace(&JobOptions::new(8)).unwrap(),
        ];
        assert!(matches!(
            SymbolicTrace::fit(&ts),
            Err(SymbolicError::EventCounts {
                batch: 4,
                other_batch: 6,
                ..
            })
        ));
    }
}
