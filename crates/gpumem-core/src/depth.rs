//! Depth extrapolation: the trace of a model with many identical blocks (a transformer's
//! layers) rebuilt from traces of the same model cut to a few of them.
//!
//! Tracing costs time per layer (PyTorch's dispatch on meta tensors), so a 32-layer 7B model
//! costs ten times a 3-layer cut of it. The tracer cuts the block stack to [`DEPTHS`]
//! (`gpumem_trace --depths`); here the events one more block adds are found by aligning the
//! traces (the fewest runs of inserted events), and repeated up to the whole depth.
//!
//! Nothing is assumed that the three traces do not show: the whole is rebuilt only where
//! - the third trace is the first with runs of events inserted twice over, next to each other
//!   (nothing removed, nothing changed but kernels' numbers), and the second is the first with
//!   each inserted once;
//! - every kernel's numbers are affine in the depth where the first trace has the kernel, and
//!   the same in each copy where a block inserts it;
//! - no allocation changes its size with the depth (sizes are part of what is aligned): a
//!   buffer over all blocks, such as a gradient bucket, may reach a cap beyond the traced
//!   depths (DDP's `bucket_cap_mb`, ZeRO's bucket sizes);
//! - every free frees the same tensor relative to the others of its kind (same size, category,
//!   phase and stream, and kernel where that holds) in all three: the n-th newest or the n-th
//!   oldest live one.
//!
//! Else [`DepthError`] says why, and the caller traces the whole model.

use std::collections::HashMap;

use crate::trace::{Event, NO_MODULE, Phase, RunPhase, Trace, TraceBuilder};

/// The depths the tracer cuts a model to (`--depths`): three, so that what one block adds is
/// seen twice and checked.
pub const DEPTHS: [u32; 3] = [2, 3, 4];

/// Why three cut traces do not rebuild the whole model.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DepthError {
    #[error("the traces are not of depths {0:?} of one model")]
    NotDepths(Vec<Option<u32>>),
    #[error("what one more block adds is not a repeat: {0}")]
    NotPeriodic(String),
}

fn not_periodic(why: impl Into<String>) -> DepthError {
    DepthError::NotPeriodic(why.into())
}

/// Where an event of the rebuilt trace comes from: event `i` of the shallowest trace, or event
/// `offset` of the `chunk`-th run of events one block inserts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Source {
    Base(usize),
    Chunk { chunk: usize, offset: usize },
}

/// One run of events one more block inserts: before event `gap` of the shallowest trace; its
/// first copy in the deepest is events `start..start + len`.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    gap: usize,
    start: usize,
    len: usize,
}

/// How a free picks its tensor among the live ones of its kind, in allocation order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pick {
    Newest(usize),
    Oldest(usize),
}

/// An event without its ids and its module path's indices, as much of it as a [`Detail`] keeps:
/// what the alignment and the frees' kinds compare.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Shape {
    Alloc {
        bytes: u64,
        category: u8,
        phase: u8,
        op: String,
        module: String,
        stream: u32,
    },
    /// `of`: the freed allocation's kernel and module, where aligned exactly.
    Free {
        bytes: u64,
        category: u8,
        of: Option<(String, String)>,
    },
    /// `numbers` left out where aligned loosely: a kernel over every block's tensors at once
    /// (`_foreach_add_`) grows with the depth.
    Op {
        op: String,
        numbers: Option<[u64; 3]>,
    },
    Iteration {
        index: u32,
    },
    RunPhase(RunPhase),
    EmptyCache,
    Workspace {
        conv: String,
        pass: u8,
        phase: u8,
        module: String,
    },
}

/// `layers.3.mlp` → `layers.#.mlp`: the same module of another block.
pub(crate) fn generic_module(t: &Trace, module: u32) -> String {
    if module == NO_MODULE {
        return String::new();
    }
    t.op_name(module)
        .split('.')
        .map(|p| {
            if p.bytes().all(|b| b.is_ascii_digit()) {
                "#"
            } else {
                p
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// How much of an event its shape keeps.
#[derive(Clone, Copy, PartialEq)]
enum Detail {
    /// Everything but ids and module indices.
    Exact,
    /// Kernels' numbers left out.
    Loose,
    /// Also allocations' modules: a tensor's kind, among which a free picks (one block's
    /// input may be the block before's output or, for the first, another module's).
    Kind,
    /// Also allocations' kernels: a coarser kind.
    Size,
}

fn shapes(t: &Trace, detail: Detail) -> Vec<Shape> {
    let mut allocated = vec![(0u64, 0u8, String::new(), String::new()); t.slots()];
    t.events()
        .iter()
        .map(|e| match *e {
            Event::Alloc {
                slot,
                bytes,
                category,
                phase,
                op,
                module,
                stream,
            } => {
                allocated[slot as usize] = (
                    bytes,
                    category as u8,
                    t.op_name(op).to_string(),
                    generic_module(t, module),
                );
                let op = if detail == Detail::Size {
                    String::new()
                } else {
                    t.op_name(op).to_string()
                };
                let module = if matches!(detail, Detail::Kind | Detail::Size) {
                    String::new()
                } else {
                    generic_module(t, module)
                };
                Shape::Alloc {
                    bytes,
                    category: category as u8,
                    phase: phase as u8,
                    op,
                    module,
                    stream,
                }
            }
            Event::Free { slot } => {
                let (bytes, category, op, module) = &allocated[slot as usize];
                Shape::Free {
                    bytes: *bytes,
                    category: *category,
                    of: (detail == Detail::Exact).then(|| (op.clone(), module.clone())),
                }
            }
            Event::Op { op, .. } => Shape::Op {
                op: t.op_name(op).to_string(),
                numbers: (detail == Detail::Exact).then(|| numbers(e)),
            },
            Event::Iteration { index } => Shape::Iteration { index },
            Event::RunPhase { phase } => Shape::RunPhase(phase),
            Event::EmptyCache => Shape::EmptyCache,
            Event::Workspace {
                conv,
                pass,
                phase,
                module,
                ..
            } => Shape::Workspace {
                conv: t.op_name(conv).to_string(),
                pass: pass as u8,
                phase: phase as u8,
                module: generic_module(t, module),
            },
        })
        .collect()
}

fn module_of(e: &Event) -> Option<u32> {
    match *e {
        Event::Alloc { module, .. } | Event::Workspace { module, .. } => {
            (module != NO_MODULE).then_some(module)
        }
        _ => None,
    }
}

/// A module path whose indices (`layers.7`) follow the depth and the copy: each is
/// `first + per_copy * copy + per_block * (depth - 2)`, fitted on the traces, so that the
/// rebuilt trace names each block's modules as the whole model's would.
#[derive(Debug, Clone)]
struct ModuleName {
    parts: Vec<NamePart>,
}

/// One dot-separated part of a [`ModuleName`].
#[derive(Debug, Clone)]
enum NamePart {
    /// The same text at every depth and copy.
    Literal(String),
    /// An index: `first + per_copy * copy + per_block * (depth - 2)`.
    Index {
        first: i64,
        per_copy: i64,
        per_block: i64,
    },
}

impl ModuleName {
    /// From the path in each instance: (depth, copy, path). `None` where the paths differ in
    /// more than their indices; the first is kept as it is where the indices do not fit.
    fn fit(paths: &[(u32, usize, &str)]) -> Option<ModuleName> {
        let split: Vec<Vec<&str>> = paths.iter().map(|p| p.2.split('.').collect()).collect();
        let literal = ModuleName {
            parts: split
                .first()?
                .iter()
                .map(|p| NamePart::Literal(p.to_string()))
                .collect(),
        };
        let value = |depth: u32, copy: usize, k: usize| -> Option<i64> {
            let i = paths.iter().position(|p| p.0 == depth && p.1 == copy)?;
            split[i].get(k)?.parse().ok()
        };
        let mut parts = Vec::new();
        for (k, part) in split[0].iter().enumerate() {
            if split.iter().any(|s| {
                s.len() != split[0].len() || (s[k] != *part && s[k].parse::<i64>().is_err())
            }) {
                return Some(literal);
            }
            if part.parse::<i64>().is_err() {
                parts.push(NamePart::Literal(part.to_string()));
                continue;
            }
            // A block's own events are seen twice at the deepest depth; others once per depth.
            let fitted = match (
                value(DEPTHS[0], 0, k),
                value(DEPTHS[1], 0, k),
                value(DEPTHS[2], 0, k),
                value(DEPTHS[2], 1, k),
            ) {
                (Some(v2), Some(v3), _, None) => Some(NamePart::Index {
                    first: v2,
                    per_copy: 0,
                    per_block: v3 - v2,
                }),
                (None, Some(v3), Some(v4), Some(v4b)) => Some(NamePart::Index {
                    first: v3 - (v4 - v3),
                    per_copy: v4b - v4,
                    per_block: v4 - v3,
                }),
                _ => None,
            };
            match fitted {
                Some(f) => parts.push(f),
                None => return Some(literal),
            }
        }
        Some(ModuleName { parts })
    }

    fn at(&self, blocks: u32, copy: usize) -> String {
        let depth = i64::from(blocks - DEPTHS[0]);
        let parts: Vec<String> = self
            .parts
            .iter()
            .map(|p| match p {
                NamePart::Index {
                    first,
                    per_copy,
                    per_block,
                } => (first + per_copy * copy as i64 + per_block * depth)
                    .max(0)
                    .to_string(),
                NamePart::Literal(text) => text.clone(),
            })
            .collect();
        parts.join(".")
    }
}

/// An event's numbers: an allocation's size, a kernel's flops and bytes, a workspace's batch.
pub(crate) fn numbers(e: &Event) -> [u64; 3] {
    match *e {
        Event::Alloc { bytes, .. } => [bytes, 0, 0],
        Event::Op {
            flops,
            bytes_read,
            bytes_written,
            ..
        } => [flops, bytes_read, bytes_written],
        Event::Workspace { n, .. } => [n, 0, 0],
        Event::Free { .. }
        | Event::Iteration { .. }
        | Event::RunPhase { .. }
        | Event::EmptyCache => [0; 3],
    }
}

/// The sources of the trace with `copies` blocks more than the shallowest, in order, with which
/// copy each is.
fn unrolled(base: usize, chunks: &[Chunk], copies: usize) -> Vec<(Source, usize)> {
    let mut out = Vec::new();
    let mut next = chunks.iter().enumerate().peekable();
    for gap in 0..=base {
        while let Some((k, c)) = next.next_if(|(_, c)| c.gap == gap) {
            for copy in 0..copies {
                out.extend((0..c.len).map(|offset| (Source::Chunk { chunk: k, offset }, copy)));
            }
        }
        if gap < base {
            out.push((Source::Base(gap), 0));
        }
    }
    out
}

/// Per free (by position): the position of the allocation it frees, and how many live
/// allocations of the same kind were made before and after it.
type Picks = HashMap<usize, (usize, usize, usize)>;

/// For each free of `t`: the position of the allocation it frees, and how many live
/// allocations of the same kind (`kind` of each position) were made before and after it.
fn picks(t: &Trace, kind: &[u32]) -> Picks {
    let mut at = vec![0usize; t.slots()];
    let mut live: HashMap<u32, Vec<usize>> = HashMap::new();
    let mut out = HashMap::new();
    for (pos, e) in t.events().iter().enumerate() {
        match *e {
            Event::Alloc { slot, .. } => {
                at[slot as usize] = pos;
                live.entry(kind[pos]).or_default().push(pos);
            }
            Event::Free { slot } => {
                let alloc = at[slot as usize];
                let list = live
                    .get_mut(&kind[alloc])
                    .expect("an allocation is live until freed");
                let i = list
                    .iter()
                    .position(|&p| p == alloc)
                    .expect("an allocation is live until freed");
                list.remove(i);
                out.insert(pos, (alloc, i, list.len() - i));
            }
            _ => {}
        }
    }
    out
}

/// The most cells (a byte each) one alignment fills: a longer pair of traces is aligned micro-batch
/// by micro-batch ([`segmented_insertions`]), or not at all (the model is then traced whole).
const MAX_CELLS: usize = 1 << 28;

/// Where each forward of `t` starts: its first allocation in the forward phase after one in
/// another phase (0 first). Under gradient accumulation one per micro-batch, so a trace of many
/// aligns as many short ones.
fn forward_starts(t: &Trace) -> Vec<usize> {
    let mut starts = vec![0];
    let mut last = None;
    for (i, e) in t.events().iter().enumerate() {
        if let Event::Alloc { phase, .. } = *e {
            if phase == Phase::Forward && last.is_some_and(|p| p != Phase::Forward) {
                starts.push(i);
            }
            last = Some(phase);
        }
    }
    starts
}

/// [`insertions`] of `long` into `short` (each `[exact, loose]`), whole where that fits in
/// [`MAX_CELLS`], else forward by forward (`starts` of each: [`forward_starts`]), where both
/// have as many and no inserted run spans two of them. `None` where neither aligns.
fn segmented_insertions(
    short: [&[u32]; 2],
    long: [&[u32]; 2],
    starts: [&[usize]; 2],
) -> Option<Vec<Chunk>> {
    let (n, m) = (short[0].len(), long[0].len());
    if (n + 1).saturating_mul(m.saturating_sub(n) + 1) <= MAX_CELLS
        || starts[0].len() != starts[1].len()
    {
        return insertions(short, long);
    }
    let ends = |s: &[usize], len: usize| s.iter().skip(1).copied().chain([len]).collect::<Vec<_>>();
    let (short_ends, long_ends) = (ends(starts[0], n), ends(starts[1], m));
    let mut chunks = Vec::new();
    for k in 0..starts[0].len() {
        let (a, b) = (starts[0][k], short_ends[k]);
        let (c, d) = (starts[1][k], long_ends[k]);
        let part = insertions(
            [&short[0][a..b], &short[1][a..b]],
            [&long[0][c..d], &long[1][c..d]],
        )?;
        chunks.extend(part.into_iter().map(|ch| Chunk {
            gap: ch.gap + a,
            start: ch.start + c,
            len: ch.len,
        }));
    }
    Some(chunks)
}

/// `long` as `short` with the fewest runs of events inserted (the runs one block adds, whole,
/// where the events repeat); `None` if `short` is not a subsequence of `long`. A minimal diff
/// may cut one block's run in two at different places, which do not repeat; fewest runs is a
/// dynamic program over the band of `long`'s extra length. Each side is `[exact, loose]`: events
/// match loosely, and among alignments with as few runs, the most match exactly.
fn insertions(short: [&[u32]; 2], long: [&[u32]; 2]) -> Option<Vec<Chunk>> {
    let (n, m) = (short[0].len(), long[0].len());
    let w = m.checked_sub(n)?;
    if (n + 1).saturating_mul(w + 1) > MAX_CELLS {
        return None;
    }
    const NONE: u64 = u64::MAX;
    const RUN: u64 = 1 << 32; // a run costs more than any number of loose matches
    // Cell (i, k) aligns short[..i] with long[..i + k]; `matched`: its last event is short's,
    // `inserted`: long's. `from` keeps, per cell, whether each state came from `inserted`.
    let (mut matched, mut inserted) = (vec![NONE; w + 1], vec![NONE; w + 1]);
    let mut from = vec![0u8; (n + 1) * (w + 1)];
    for i in 0..=n {
        for k in 0..=w {
            let j = i + k;
            // matched[k] and inserted[k] still hold row i - 1.
            let m_new = if i == 0 {
                if k == 0 { 0 } else { NONE }
            } else if short[1][i - 1] == long[1][j - 1] {
                let via_inserted = inserted[k] < matched[k];
                from[i * (w + 1) + k] |= via_inserted as u8;
                matched[k]
                    .min(inserted[k])
                    .saturating_add(u64::from(short[0][i - 1] != long[0][j - 1]))
            } else {
                NONE
            };
            let i_new = if k == 0 {
                NONE
            } else {
                let open = matched[k - 1].saturating_add(RUN);
                let via_inserted = inserted[k - 1] <= open;
                from[i * (w + 1) + k] |= (via_inserted as u8) << 1;
                open.min(inserted[k - 1])
            };
            matched[k] = m_new;
            inserted[k] = i_new;
        }
    }
    let (mut i, mut k) = (n, w);
    let mut in_insert = inserted[w] < matched[w];
    if matched[w].min(inserted[w]) == NONE {
        return None;
    }
    let mut chunks: Vec<Chunk> = Vec::new();
    while i > 0 || k > 0 {
        let f = from[i * (w + 1) + k];
        if in_insert {
            match chunks.last_mut() {
                Some(c) if c.gap == i && c.start == i + k => c.start -= 1,
                _ => chunks.push(Chunk {
                    gap: i,
                    start: i + k - 1,
                    len: 0,
                }),
            }
            let c = chunks.last_mut().expect("just pushed");
            c.len += 1;
            in_insert = f & 2 != 0;
            k -= 1;
        } else {
            in_insert = f & 1 != 0;
            i -= 1;
        }
    }
    chunks.reverse();
    Some(chunks)
}

/// `run` as squares `X X Y Y ...`: each half's (start, length), the longest first; `None` if
/// it is not.
fn squares(run: &[u32]) -> Option<Vec<(usize, usize)>> {
    fn from(run: &[u32], at: usize, failed: &mut Vec<bool>) -> Option<Vec<(usize, usize)>> {
        if at == run.len() {
            return Some(Vec::new());
        }
        if failed[at] {
            return None;
        }
        for half in (1..=(run.len() - at) / 2).rev() {
            if run[at..at + half] == run[at + half..at + 2 * half]
                && let Some(mut rest) = from(run, at + 2 * half, failed)
            {
                rest.insert(0, (at, half));
                return Some(rest);
            }
        }
        failed[at] = true;
        None
    }
    from(run, 0, &mut vec![false; run.len()])
}

/// The trace of the whole model (`blocks` blocks) from its traces at [`DEPTHS`], in order.
pub fn extrapolate(traces: &[Trace; 3], blocks: u32) -> Result<Trace, DepthError> {
    let depths: Vec<Option<u32>> = traces.iter().map(|t| t.header.depth).collect();
    if depths != DEPTHS.map(Some)
        || traces.iter().any(|t| t.header.blocks != Some(blocks))
        || blocks <= DEPTHS[2]
    {
        return Err(DepthError::NotDepths(depths));
    }
    let mut ids: HashMap<Shape, u32> = HashMap::new();
    let mut intern = |detail: Detail| -> Vec<Vec<u32>> {
        traces
            .iter()
            .map(|t| {
                shapes(t, detail)
                    .into_iter()
                    .map(|x| {
                        let n = ids.len() as u32;
                        *ids.entry(x).or_insert(n)
                    })
                    .collect()
            })
            .collect()
    };
    let (exact, interned) = (intern(Detail::Exact), intern(Detail::Loose));
    // What two blocks more insert, each run a square (X X, or X X Y Y ... where two runs of
    // blocks meet, as an optimizer's per-parameter loops do): one block inserts each half.
    let two_more = segmented_insertions(
        [&exact[0], &interned[0]],
        [&exact[2], &interned[2]],
        [&forward_starts(&traces[0]), &forward_starts(&traces[2])],
    )
    .ok_or_else(|| {
        not_periodic(format!(
            "the {}-block trace is not the {}-block one with events inserted",
            DEPTHS[2], DEPTHS[0]
        ))
    })?;
    let mut chunks = Vec::new();
    for run in two_more {
        let halves = squares(&exact[2][run.start..run.start + run.len]).ok_or_else(|| {
            not_periodic(format!(
                "what two blocks insert at event {} of the {}-block trace is not one block's twice",
                run.gap + 2,
                DEPTHS[0]
            ))
        })?;
        chunks.extend(halves.into_iter().map(|(at, len)| Chunk {
            gap: run.gap,
            start: run.start + at,
            len,
        }));
    }
    let base = traces[0].events().len();
    let orders: Vec<Vec<(Source, usize)>> = (0..3)
        .map(|copies| unrolled(base, &chunks, copies))
        .collect();
    let shape_of = |s: Source| match s {
        Source::Base(i) => interned[0][i],
        Source::Chunk { chunk, offset } => interned[2][chunks[chunk].start + offset],
    };
    if orders[1].len() != interned[1].len()
        || orders[1]
            .iter()
            .zip(&interned[1])
            .any(|(&(s, _), &x)| shape_of(s) != x)
    {
        return Err(not_periodic(format!(
            "the {}-block trace is not the {}-block one with one block's events inserted",
            DEPTHS[1], DEPTHS[0]
        )));
    }

    // Every instance of each source: (trace, position).
    let mut instances: HashMap<Source, Vec<(usize, usize)>> = HashMap::new();
    for (t, order) in orders.iter().enumerate() {
        for (pos, &(s, _)) in order.iter().enumerate() {
            instances.entry(s).or_default().push((t, pos));
        }
    }
    let event = |t: usize, pos: usize| &traces[t].events()[pos];
    // Numbers: affine in the depth where the event is the shallowest trace's; the same in each
    // copy where a block inserts it.
    let mut values: HashMap<Source, ([u64; 3], [i128; 3])> = HashMap::new();
    for (&s, inst) in &instances {
        let v: Vec<[u64; 3]> = inst.iter().map(|&(t, p)| numbers(event(t, p))).collect();
        let step: [i128; 3] = match s {
            Source::Base(_) => std::array::from_fn(|k| v[1][k] as i128 - v[0][k] as i128),
            Source::Chunk { .. } => [0; 3],
        };
        let (t, p) = inst[0];
        let ok = v.iter().zip(inst).all(|(x, &(ti, _))| {
            (0..3).all(|k| x[k] as i128 == v[0][k] as i128 + step[k] * (ti as i128 - t as i128))
        });
        if !ok {
            return Err(not_periodic(format!(
                "event {} of the {}-block trace changes its numbers with the depth other than by a fixed step",
                p + 2,
                DEPTHS[t]
            )));
        }
        values.insert(s, (v[0], step));
    }
    // Frees: which live tensor of its kind each one frees, the same rule in every instance;
    // kinds told apart by their kernel where that holds, else by size alone (a chain of blocks
    // whose first input another kernel made).
    let kinds = [intern(Detail::Kind), intern(Detail::Size)];
    let kind_of = |g: usize, s: Source| match s {
        Source::Base(i) => kinds[g][0][i],
        Source::Chunk { chunk, offset } => kinds[g][2][chunks[chunk].start + offset],
    };
    let freed: Vec<Vec<Picks>> = (0..2)
        .map(|g| (0..3).map(|t| picks(&traces[t], &kinds[g][t])).collect())
        .collect();
    let rule = |g: usize, inst: &[(usize, usize)]| -> Option<(Source, Pick)> {
        let seen: Vec<(usize, (usize, usize, usize))> =
            inst.iter().map(|&(t, p)| (t, freed[g][t][&p])).collect();
        let target = orders[seen[0].0][seen[0].1.0].0;
        if !seen
            .iter()
            .all(|&(t, (alloc, ..))| kind_of(g, orders[t][alloc].0) == kind_of(g, target))
        {
            return None;
        }
        if seen.iter().all(|&(_, (_, _, newer))| newer == seen[0].1.2) {
            Some((target, Pick::Newest(seen[0].1.2)))
        } else if seen.iter().all(|&(_, (_, older, _))| older == seen[0].1.1) {
            Some((target, Pick::Oldest(seen[0].1.1)))
        } else {
            None
        }
    };
    let mut rules: HashMap<Source, (usize, Source, Pick)> = HashMap::new();
    for (&s, inst) in &instances {
        let Some(&(t0, p0)) = inst
            .first()
            .filter(|&&(t, p)| matches!(event(t, p), Event::Free { .. }))
        else {
            continue;
        };
        let Some((g, (target, pick))) = (0..2).find_map(|g| Some((g, rule(g, inst)?))) else {
            return Err(not_periodic(format!(
                "the free at event {} of the {}-block trace frees a different tensor at other depths",
                p0 + 2,
                DEPTHS[t0]
            )));
        };
        rules.insert(s, (g, target, pick));
    }

    // Rebuild at the whole depth.
    let extra = i128::from(blocks - DEPTHS[0]);
    let at = |s: Source| -> [u64; 3] {
        let (v, step) = values[&s];
        std::array::from_fn(|k| (v[k] as i128 + step[k] * extra).max(0) as u64)
    };
    let mut header = traces[0].header.clone();
    header.depth = None;
    header.blocks = None;
    header.activations_per_sample = match traces.each_ref().map(|t| t.header.activations_per_sample)
    {
        [Some(a), Some(b), _] => {
            Some((i128::from(a) + (i128::from(b) - i128::from(a)) * extra).max(0) as u64)
        }
        _ => None,
    };
    let mut out = TraceBuilder::new(header);
    // The live tensors of each kind, by either grain, in allocation order.
    let mut live: HashMap<(usize, u32), Vec<u64>> = HashMap::new();
    let mut kinds_of_id: HashMap<u64, [u32; 2]> = HashMap::new();
    let mut next_id = 1u64;
    let mut names: HashMap<Source, ModuleName> = HashMap::new();
    for (&s, inst) in &instances {
        let paths: Vec<(u32, usize, &str)> = inst
            .iter()
            .filter_map(|&(t, p)| {
                Some((
                    DEPTHS[t],
                    orders[t][p].1,
                    traces[t].module(module_of(event(t, p))?)?,
                ))
            })
            .collect();
        if let Some(name) = ModuleName::fit(&paths) {
            names.insert(s, name);
        }
    }
    for (s, copy) in unrolled(base, &chunks, (blocks - DEPTHS[0]) as usize) {
        let (t, p) = match s {
            Source::Base(i) => (0, i),
            Source::Chunk { chunk, offset } => (2, chunks[chunk].start + offset),
        };
        let tr = &traces[t];
        let [a, b, c] = at(s);
        let module = names.get(&s).map(|n| n.at(blocks, copy));
        match *event(t, p) {
            Event::Alloc {
                category,
                phase,
                op,
                stream,
                ..
            } => {
                for g in 0..2 {
                    live.entry((g, kind_of(g, s))).or_default().push(next_id);
                }
                kinds_of_id.insert(next_id, [kind_of(0, s), kind_of(1, s)]);
                out.alloc_with_id(
                    0,
                    next_id,
                    a,
                    category,
                    phase,
                    tr.op_name(op),
                    module.as_deref(),
                    stream,
                )
                .map_err(|e| not_periodic(e.message))?;
                next_id += 1;
            }
            Event::Free { .. } => {
                let (g, target, pick) = rules[&s];
                let list = live
                    .get_mut(&(g, kind_of(g, target)))
                    .filter(|l| !l.is_empty());
                let Some(list) = list else {
                    return Err(not_periodic(
                        "a free finds no tensor of its kind at the whole depth",
                    ));
                };
                let i = match pick {
                    Pick::Newest(n) => list.len().checked_sub(n + 1),
                    Pick::Oldest(n) => (n < list.len()).then_some(n),
                };
                let Some(i) = i else {
                    return Err(not_periodic(
                        "a free finds too few tensors of its kind at the whole depth",
                    ));
                };
                let id = list.remove(i);
                let kinds = kinds_of_id
                    .remove(&id)
                    .expect("a live tensor has its kinds");
                live.get_mut(&(1 - g, kinds[1 - g]))
                    .expect("a live tensor is listed by both grains")
                    .retain(|&x| x != id);
                out.free(id);
            }
            Event::Op { op, .. } => out.op(tr.op_name(op), a, b, c),
            Event::Iteration { .. } => out.iteration_end(),
            Event::RunPhase { phase } => out.run_phase(phase),
            Event::EmptyCache => out.empty_cache(),
            Event::Workspace {
                conv, pass, phase, ..
            } => out.workspace(tr.op_name(conv), a, pass, phase, module.as_deref()),
        }
    }
    Ok(out.finish())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::toy::Toy;

    /// The toy model (crate::toy) at batch 4; `flat`: with a buffer over all blocks.
    fn toy(depth: u32, cut_of: Option<u32>, flat: bool) -> Trace {
        Toy {
            over_blocks: flat.then_some(("flatten", false, false)),
            ..Toy::default()
        }
        .trace(4, depth, cut_of)
    }

    fn text(t: &Trace) -> String {
        let mut out = Vec::new();
        t.write(&mut out).unwrap();
        String::from_utf8(out)
            .unwrap()
            .split_once('\n')
            .unwrap()
            .1
            .to_string()
    }

    #[test]
    fn the_rebuilt_trace_is_the_whole_models_event_for_event() {
        let cut = DEPTHS.map(|d| toy(d, Some(10), false));
        let rebuilt = extrapolate(&cut, 10).unwrap();
        assert_eq!(rebuilt.header.depth, None);
        assert_eq!(text(&rebuilt), text(&toy(10, None, false)));
    }

    /// Traces too long to align at once (a step of many accumulated micro-batches) align
    /// forward by forward: each one's block runs found, placed in the whole trace.
    #[test]
    fn long_traces_align_forward_by_forward() {
        let (micro, block) = (20_000, 7);
        let segment = |blocks: usize| {
            let mut s = vec![0];
            s.extend(std::iter::repeat_n(block, blocks));
            s.push(1);
            s
        };
        let (short, long) = (segment(2).repeat(micro), segment(4).repeat(micro));
        assert!((short.len() + 1) * (long.len() - short.len() + 1) > MAX_CELLS);
        assert!(insertions([&short, &short], [&long, &long]).is_none());
        let starts = |len: usize| (0..micro).map(|k| k * len).collect::<Vec<_>>();
        let chunks =
            segmented_insertions([&short, &short], [&long, &long], [&starts(4), &starts(6)])
                .unwrap();
        assert_eq!(chunks.len(), micro);
        for (k, c) in chunks.iter().enumerate() {
            assert_eq!(c.len, 2);
            assert!((4 * k + 1..=4 * k + 3).contains(&c.gap), "{k}: {c:?}");
            assert_eq!(long[c.start..c.start + 2], [block, block]);
        }
    }

    #[test]
    fn a_buffer_over_all_blocks_is_refused() {
        let cut = DEPTHS.map(|d| toy(d, Some(10), true));
        assert!(matches!(
            extrapolate(&cut, 10),
            Err(DepthError::NotPeriodic(_))
        ));
    }

    #[test]
    fn traces_not_at_the_cut_depths_are_refused() {
        let cut = [
            toy(2, Some(10), false),
            toy(3, Some(10), false),
            toy(5, Some(10), false),
        ];
        assert!(matches!(
            extrapolate(&cut, 10),
            Err(DepthError::NotDepths(_))
        ));
        let cut = DEPTHS.map(|d| toy(d, Some(10), false));
        assert!(matches!(
            extrapolate(&cut, 9),
            Err(DepthError::NotDepths(_))
        ));
    }

    #[test]
    fn events_that_do_not_repeat_are_refused() {
        // The deepest cut trace has an event the others do not.
        let mut cut = DEPTHS.map(|d| toy(d, Some(10), false));
        let mut file = Vec::new();
        cut[2].write(&mut file).unwrap();
        let (header, events) = std::str::from_utf8(&file)
            .unwrap()
            .split_once('\n')
            .unwrap();
        let extra = format!(
            "{header}\n{{\"ev\":\"op\",\"op\":\"extra\",\"flops\":1,\"bytes_read\":1,\"bytes_written\":1}}\n{events}"
        );
        cut[2] = Trace::read(extra.as_bytes()).unwrap();
        assert!(matches!(
            extrapolate(&cut, 10),
            Err(DepthError::NotPeriodic(_))
        ));
    }
}
