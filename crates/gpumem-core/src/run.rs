//! A run: training steps of varying shape (sequence lengths that vary by step), one after
//! another, through ONE caching allocator. The caching allocator's reserved memory creeps up
//! over such a run, as blocks of new sizes are cached and split, so a run's peak can sit above
//! its longest single step's.
//!
//! A [`StepSequence`] is the traces of the run's distinct shapes (each a fixed-shape trace of at
//! least three iterations) and the order its steps take them in. [`StepSequence::splice`]
//! builds the run's trace from their step segments: step 0 is its shape's first iteration
//! (with the setup before it: the model's parameters), step 1 its shape's second, and every
//! later step its shape's last, steady iteration — what the training loop does at a step
//! depends only on the step's own shape and on which tensors the step before left alive, so
//! the spliced trace is the loop's own traced in that order, allocation for allocation (the
//! bridge test `a_run_spliced_from_its_lengths_is_the_run_traced_in_order`). The tensors a step
//! leaves alive are matched to the ones the next segment expects by kind and, within a kind, by
//! allocation order, as the loop makes them in the same order at every shape.
//!
//! [`StepSequence::any_order_bound`] bounds the reserved memory of ANY order of the same
//! shapes (docs/intake.md, "Lengths that vary by step").

use std::collections::BTreeMap;

use serde::Serialize;

use crate::allocator::{BlockId, CachingAllocator};
use crate::estimate::{EstimateError, GpuSizes};
use crate::job::LengthSummary;
use crate::profile::GpuProfile;
use crate::trace::{Category, Event, Trace, TraceBuilder, TraceHeader};

/// Why steps cannot be spliced into a run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunError {
    #[error("a run needs at least one step and one shape")]
    Empty,
    #[error("step {step} names shape {shape}, and there are {shapes}")]
    NoShape {
        step: usize,
        shape: usize,
        shapes: usize,
    },
    #[error(
        "the trace of shape {shape} has {iterations} iteration(s); splicing steps needs at least {MIN_ITERATIONS} (setup, first, steady)"
    )]
    Iterations { shape: usize, iterations: u32 },
    #[error(
        "step {step} (shape {shape}): the step before left {left} {kind} tensor(s) alive, and this shape's step expects {expected}: the loop keeps different tensors across steps at different shapes"
    )]
    Carried {
        step: usize,
        shape: usize,
        kind: &'static str,
        left: usize,
        expected: usize,
    },
    #[error(transparent)]
    Estimate(#[from] EstimateError),
}

/// Iterations a shape's trace must have: the first (optimizer state made), the second, and a
/// steady one the later steps repeat.
pub const MIN_ITERATIONS: u32 = 3;

/// Steps of each shape replayed by [`StepSequence::any_order_bound`]: its first two and then
/// the steady step until the allocator's state repeats (the steady step's requests are the same
/// each time, so its private allocator settles within a few).
pub const BOUND_STEPS: usize = 6;

/// One shape's trace cut at its iteration ends: where each iteration's events start, and which
/// of the shape's slots are alive at each start (ascending: allocation order).
struct Segments<'a> {
    trace: &'a Trace,
    /// `starts[j]..starts[j + 1]` is iteration j's events (the setup is in iteration 0's);
    /// the last entry is where the events after the last iteration (validation) start, and
    /// `ends` where the trace ends.
    starts: Vec<usize>,
    live_at: Vec<Vec<u32>>,
}

impl<'a> Segments<'a> {
    fn new(shape: usize, trace: &'a Trace) -> Result<Segments<'a>, RunError> {
        let mut starts = vec![0];
        let mut live_at = vec![Vec::new()];
        let mut live = vec![false; trace.slots()];
        for (n, ev) in trace.events().iter().enumerate() {
            match *ev {
                Event::Alloc { slot, .. } => live[slot as usize] = true,
                Event::Free { slot } => live[slot as usize] = false,
                Event::Iteration { .. } => {
                    starts.push(n + 1);
                    live_at.push(
                        (0..live.len() as u32)
                            .filter(|&s| live[s as usize])
                            .collect(),
                    );
                }
                _ => {}
            }
        }
        let iterations = starts.len() as u32 - 1;
        if iterations < MIN_ITERATIONS {
            return Err(RunError::Iterations { shape, iterations });
        }
        Ok(Segments {
            trace,
            starts,
            live_at,
        })
    }

    /// Iterations in the trace.
    fn iterations(&self) -> usize {
        self.starts.len() - 1
    }

    /// The events of iteration `j` (the tail after the last iteration at `j == iterations()`).
    fn events(&self, j: usize) -> &'a [Event] {
        let end = self
            .starts
            .get(j + 1)
            .copied()
            .unwrap_or(self.trace.events().len());
        &self.trace.events()[self.starts[j]..end]
    }
}

/// The distinct shapes of a run and the order its steps take them in.
pub struct StepSequence<'a> {
    shapes: Vec<Segments<'a>>,
    order: Vec<usize>,
}

/// What a step segment was: where its allocations come from, for the bound's replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// Made before the end of the first step and alive at the end of the run: the parameters,
    /// the optimizer's state.
    Persistent,
    /// Made by a step of this shape.
    Shape(usize),
}

impl<'a> StepSequence<'a> {
    /// `shapes[order[k]]` is step k's shape. Each shape's trace must have at least
    /// [`MIN_ITERATIONS`] iterations.
    pub fn new(shapes: &[&'a Trace], order: Vec<usize>) -> Result<StepSequence<'a>, RunError> {
        if shapes.is_empty() || order.is_empty() {
            return Err(RunError::Empty);
        }
        if let Some((step, &shape)) = order.iter().enumerate().find(|(_, s)| **s >= shapes.len()) {
            return Err(RunError::NoShape {
                step,
                shape,
                shapes: shapes.len(),
            });
        }
        let shapes = shapes
            .iter()
            .enumerate()
            .map(|(i, t)| Segments::new(i, t))
            .collect::<Result<_, _>>()?;
        Ok(StepSequence { shapes, order })
    }

    pub fn steps(&self) -> usize {
        self.order.len()
    }

    /// The run's trace under `header` (its `iterations` set to the steps): every step's
    /// segment in order, then what the last step's trace does after its iterations.
    pub fn splice(&self, header: TraceHeader) -> Result<Trace, RunError> {
        let mut b = TraceBuilder::new(header);
        self.walk(|part| match part {
            Part::Alloc { id, ev, trace } => {
                if let Event::Alloc {
                    bytes,
                    category,
                    phase,
                    op,
                    module,
                    stream,
                    ..
                } = *ev
                {
                    b.alloc_with_id(
                        0,
                        id,
                        bytes,
                        category,
                        phase,
                        trace.op_name(op),
                        trace.module(module),
                        stream,
                    )
                    .expect("fresh ids, sizes from a valid trace");
                }
            }
            Part::Free { id } => b.free(id),
            Part::Other { ev, trace } => match *ev {
                Event::Op {
                    op,
                    flops,
                    bytes_read,
                    bytes_written,
                } => b.op(trace.op_name(op), flops, bytes_read, bytes_written),
                Event::Workspace {
                    conv,
                    n,
                    pass,
                    phase,
                    module,
                } => b.workspace(trace.op_name(conv), n, pass, phase, trace.module(module)),
                Event::Iteration { .. } => b.iteration_end(),
                Event::RunPhase { phase } => b.run_phase(phase),
                Event::EmptyCache => b.empty_cache(),
                Event::Alloc { .. } | Event::Free { .. } => unreachable!("walk parts them"),
            },
        })?;
        Ok(b.finish())
    }

    /// Walks the run's events, each allocation given a fresh id (increasing), each free the id
    /// of what it frees: the one place the step segments are joined.
    fn walk(&self, mut f: impl FnMut(Part<'_, 'a>)) -> Result<(), RunError> {
        // What is alive between segments, in allocation order (ids increase), with its kind.
        let mut live: BTreeMap<u64, Category> = BTreeMap::new();
        let mut next_id = 1u64;
        let last = self.order.len() - 1;
        let segments = self.order.iter().enumerate().map(|(k, &s)| {
            let shape = &self.shapes[s];
            (k, s, k.min(shape.iterations() - 1))
        });
        // The last step's trace goes on after its iterations (a validation pass).
        let tail = (
            last + 1,
            self.order[last],
            self.shapes[self.order[last]].iterations(),
        );
        for (step, shape_i, j) in segments.chain(std::iter::once(tail)) {
            let shape = &self.shapes[shape_i];
            let trace = shape.trace;
            // What the step before left alive is matched to what this segment expects by kind
            // and, within a kind, by allocation order (the loop makes them in the same order at
            // every shape; kinds interleave differently after the first step).
            let kinds = slot_kinds(trace);
            let mut map: Vec<Option<u64>> = vec![None; trace.slots()];
            for kind in Category::ALL {
                let expected: Vec<u32> = shape.live_at[j]
                    .iter()
                    .copied()
                    .filter(|&s| kinds[s as usize] == kind)
                    .collect();
                let left: Vec<u64> = live
                    .iter()
                    .filter(|&(_, &k)| k == kind)
                    .map(|(&id, _)| id)
                    .collect();
                if left.len() != expected.len() {
                    return Err(RunError::Carried {
                        step,
                        shape: shape_i,
                        kind: kind.name(),
                        left: left.len(),
                        expected: expected.len(),
                    });
                }
                for (slot, id) in expected.into_iter().zip(left) {
                    map[slot as usize] = Some(id);
                }
            }
            for ev in shape.events(j) {
                match *ev {
                    Event::Alloc { slot, category, .. } => {
                        let id = next_id;
                        next_id += 1;
                        map[slot as usize] = Some(id);
                        live.insert(id, category);
                        f(Part::Alloc { id, ev, trace });
                    }
                    Event::Free { slot } => {
                        let id = map[slot as usize].expect("a valid trace frees what is alive");
                        live.remove(&id);
                        f(Part::Free { id });
                    }
                    _ => f(Part::Other { ev, trace }),
                }
            }
        }
        Ok(())
    }

    /// A bound on the reserved memory of the allocator over ANY order of this run's steps
    /// (the same shapes, each as many times or fewer): each shape's steps replayed alone
    /// in an allocator of their own, and the run's persistent tensors in one more; the sum
    /// of those allocators' peaks. See docs/intake.md for what it guarantees.
    pub fn any_order_bound(&self, profile: &GpuProfile) -> Result<AnyOrderBound, RunError> {
        let mut shapes = Vec::new();
        let mut persistent = 0u64;
        for s in &self.shapes {
            let alone = StepSequence {
                shapes: vec![Segments::new(0, s.trace)?],
                order: vec![0; BOUND_STEPS],
            };
            let peaks = alone.replay_in_arenas(profile)?;
            persistent = persistent.max(peaks.persistent);
            shapes.push(peaks.shape);
        }
        Ok(AnyOrderBound {
            reserved_bytes: persistent + shapes.iter().sum::<u64>(),
            persistent_bytes: persistent,
            shape_bytes: shapes,
        })
    }

    /// A one-shape sequence replayed with its persistent tensors in one allocator and all the
    /// rest in another: the peak each reserves.
    fn replay_in_arenas(&self, profile: &GpuProfile) -> Result<ArenaPeaks, RunError> {
        let owners = self.owners()?;
        let cfg = profile.allocator_config().map_err(EstimateError::from)?;
        let sizes = GpuSizes::new(self.shapes[0].trace, profile);
        let mut arenas = [
            CachingAllocator::new(cfg.clone(), u64::MAX / 4),
            CachingAllocator::new(cfg, u64::MAX / 4),
        ];
        let mut blocks: BTreeMap<u64, (usize, BlockId)> = BTreeMap::new();
        self.walk(|part| match part {
            Part::Alloc { id, ev, .. } => {
                if let Event::Alloc {
                    bytes,
                    category,
                    op,
                    stream,
                    ..
                } = *ev
                {
                    let bytes = sizes.alloc(bytes, category, op);
                    if bytes > 0 {
                        let a = usize::from(owners[id as usize - 1] != Owner::Persistent);
                        let b = arenas[a].malloc(bytes, stream).expect("no capacity limit");
                        blocks.insert(id, (a, b));
                    }
                }
            }
            Part::Free { id } => {
                if let Some((a, b)) = blocks.remove(&id) {
                    arenas[a].free(b);
                }
            }
            Part::Other { ev, trace } => {
                if let Event::Workspace { conv, n, pass, .. } = *ev {
                    // Taken and given back inside the kernel, as the replay does.
                    for bytes in sizes.workspace(trace, conv, n, pass).0 {
                        let b = arenas[1].malloc(bytes, 0).expect("no capacity limit");
                        arenas[1].free(b);
                    }
                }
            }
        })?;
        Ok(ArenaPeaks {
            persistent: arenas[0].stats().peak_reserved,
            shape: arenas[1].stats().peak_reserved,
        })
    }

    /// Who owns each allocation of the run, in allocation order: persistent if made in the
    /// first step (or the setup before it) and alive at the end of the run's steps.
    fn owners(&self) -> Result<Vec<Owner>, RunError> {
        let mut owners = Vec::new();
        let mut first_step_ids = Vec::new();
        let mut alive_at_end: Vec<bool> = Vec::new();
        let mut step = 0usize;
        self.walk(|part| match part {
            Part::Alloc { id, .. } => {
                owners.push(Owner::Shape(self.order[step.min(self.order.len() - 1)]));
                alive_at_end.push(true);
                if step == 0 {
                    first_step_ids.push(id);
                }
            }
            Part::Free { id } => {
                if step < self.order.len() {
                    alive_at_end[id as usize - 1] = false;
                }
            }
            Part::Other { ev, .. } => {
                if matches!(ev, Event::Iteration { .. }) {
                    step += 1;
                }
            }
        })?;
        for id in first_step_ids {
            if alive_at_end[id as usize - 1] {
                owners[id as usize - 1] = Owner::Persistent;
            }
        }
        Ok(owners)
    }
}

/// Each slot's category in `trace`.
fn slot_kinds(trace: &Trace) -> Vec<Category> {
    let mut kinds = vec![Category::Temporary; trace.slots()];
    for ev in trace.events() {
        if let Event::Alloc { slot, category, .. } = *ev {
            kinds[slot as usize] = category;
        }
    }
    kinds
}

/// One joined event: an allocation (with the run's id for it), a free (of a run id), or any
/// other event, with the trace it comes from (its names).
enum Part<'e, 'a> {
    Alloc {
        id: u64,
        ev: &'a Event,
        trace: &'e Trace,
    },
    Free {
        id: u64,
    },
    Other {
        ev: &'a Event,
        trace: &'e Trace,
    },
}

struct ArenaPeaks {
    persistent: u64,
    shape: u64,
}

/// A run sized: what its lengths were, what was traced, and its reserved memory (the
/// allocator's, without the context) against its longest single step's and the any-order
/// bound. What `--json` states of a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RunReport {
    pub lengths: LengthSummary,
    /// The lengths traced, one trace each; every step is one of them.
    pub traced_lengths: Vec<u64>,
    /// Whether steps' lengths were rounded up to a traced length (more distinct lengths than
    /// [`MAX_TRACED_LENGTHS`]): the run replayed is then of those, each step at least as long.
    pub rounded_up: bool,
    /// The run's peak reserved memory, its steps in the drawn order.
    pub reserved_bytes: u64,
    /// A fixed-length run at the longest traced length: its peak reserved memory.
    pub longest_step_reserved_bytes: u64,
    /// The reserved memory no order of these steps exceeds (the estimate's upper bound is
    /// raised to cover it).
    pub any_order: AnyOrderBound,
}

/// Most distinct lengths a run traces: beyond them, each step's length is rounded up to the
/// nearest of this many, taken at even ranks of the drawn lengths (the longest always one).
pub const MAX_TRACED_LENGTHS: usize = 16;

/// The lengths to trace for `lengths`, and each step's index among them: every distinct
/// length, or where there are more than [`MAX_TRACED_LENGTHS`], that many of them at even
/// ranks, each step rounded up to the next.
pub fn traced_lengths(lengths: &[u64]) -> (Vec<u64>, Vec<usize>, bool) {
    let mut distinct = lengths.to_vec();
    distinct.sort_unstable();
    distinct.dedup();
    let rounded = distinct.len() > MAX_TRACED_LENGTHS;
    if rounded {
        let n = distinct.len();
        distinct = (1..=MAX_TRACED_LENGTHS)
            .map(|i| distinct[(i * n).div_ceil(MAX_TRACED_LENGTHS) - 1])
            .collect();
        distinct.dedup();
    }
    let order = lengths
        .iter()
        .map(|l| distinct.partition_point(|d| d < l))
        .collect();
    (distinct, order, rounded)
}

/// The run of `seq` sized on `profile`: its trace under `header`, the estimate `estimator`
/// makes of it with the upper bound raised to cover any order of its steps (the profile's
/// margins over [`StepSequence::any_order_bound`]), and the report's reserved figures.
pub fn size_run(
    seq: &StepSequence<'_>,
    header: TraceHeader,
    profile: &GpuProfile,
    estimator: &dyn crate::estimate::Estimator,
    lengths: LengthSummary,
    traced: Vec<u64>,
    rounded_up: bool,
) -> Result<(Trace, crate::estimate::Estimate, RunReport), RunError> {
    use crate::estimate::{Estimator, Replay};
    let trace = seq.splice(header)?;
    let replay = Replay::default();
    let reserved_of = |t: &Trace| -> Result<u64, RunError> {
        Ok(replay
            .estimate(t, profile)?
            .allocator
            .map_or(0, |a| a.peak_reserved))
    };
    let reserved_bytes = reserved_of(&trace)?;
    // `traced[i]` is shape i's length: the longest step is the longest length's trace alone.
    let longest = (0..seq.shapes.len())
        .max_by_key(|&i| traced.get(i))
        .expect("a sequence has a shape");
    let longest_step_reserved_bytes = reserved_of(seq.shapes[longest].trace)?;
    let any_order = seq.any_order_bound(profile)?;
    let mut estimate = estimator.estimate(&trace, profile)?;
    let fixed = profile.fixed_bytes(trace.runs_convolutions(), trace.communicators());
    let covered = any_order.reserved_bytes.max(reserved_bytes);
    estimate.upper_bound_bytes = estimate.upper_bound_bytes.max(crate::estimate::upper_bound(
        profile,
        &trace,
        fixed + covered,
        fixed,
        estimate.workspace_source,
    ));
    let report = RunReport {
        lengths,
        traced_lengths: traced,
        rounded_up,
        reserved_bytes,
        longest_step_reserved_bytes,
        any_order,
    };
    Ok((trace, estimate, report))
}

/// The reserved memory no order of a run's steps exceeds (docs/intake.md): the persistent
/// tensors' allocator plus each shape's own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AnyOrderBound {
    pub reserved_bytes: u64,
    /// The parameters' and optimizer state's allocator (the most over the shapes).
    pub persistent_bytes: u64,
    /// Each shape's steps in an allocator of their own, by shape.
    pub shape_bytes: Vec<u64>,
}

#[cfg(test)]
mod tests;
