//! A trace held against a real run: gpumem's allocation requests (as the replay makes them,
//! workspaces sized from the profile) lined up with those of PyTorch's own memory snapshot by
//! a Myers diff of their sizes. The first place they part is where gpumem's model of the step
//! and PyTorch's run differ; what is left over on each side, by category, says how much.

use serde::Serialize;
use similar::{Algorithm, DiffOp, capture_diff_slices};

use crate::estimate::{EstimateError, Estimator, GpuSizes, PeakAt, Replay};
use crate::profile::GpuProfile;
use crate::snapshot::Snapshot;
use crate::trace::{Category, Event, Trace};

/// One of gpumem's requests: its size and the trace event (with the iteration) that made it.
#[derive(Debug, Clone, Copy)]
struct Request {
    bytes: u64,
    event: usize,
    iteration: u32,
    category: Category,
}

fn requests(trace: &Trace, profile: &GpuProfile) -> Vec<Request> {
    let sizes = GpuSizes::new(trace, profile);
    let mut out = Vec::new();
    let mut iteration = 0;
    for (event, ev) in trace.events().iter().enumerate() {
        match *ev {
            Event::Alloc {
                bytes,
                category,
                op,
                ..
            } => {
                let bytes = sizes.alloc(bytes, category, op);
                if bytes > 0 {
                    out.push(Request {
                        bytes,
                        event,
                        iteration,
                        category,
                    });
                }
            }
            Event::Workspace { conv, n, pass, .. } => {
                for bytes in sizes.workspace(trace, conv, n, pass).0 {
                    out.push(Request {
                        bytes,
                        event,
                        iteration,
                        category: Category::Workspace,
                    });
                }
            }
            Event::Iteration { .. } => iteration += 1,
            _ => {}
        }
    }
    out
}

/// A request of one side at the place the two part.
#[derive(Debug, Clone, Serialize)]
pub struct GpumemRequest {
    pub bytes: u64,
    pub category: Category,
    /// Phase, module and op of the event, as the estimate names a peak.
    pub at: Option<PeakAt>,
}

/// Where the two sequences first part.
#[derive(Debug, Clone, Serialize)]
pub struct Divergence {
    /// Requests that matched before it.
    pub after_matching: usize,
    /// gpumem's next requests there (up to three; none: gpumem has an extra request missing).
    pub gpumem: Vec<GpumemRequest>,
    /// PyTorch's next requests there (up to three), by size.
    pub torch: Vec<u64>,
    /// Index of PyTorch's request there, and whether it comes before PyTorch's allocated peak.
    pub torch_index: usize,
    pub before_peak: bool,
}

/// The two peaks, side by side (bytes of the allocator; no context).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Peaks {
    pub gpumem_allocated: u64,
    pub torch_allocated: u64,
    pub gpumem_reserved: u64,
    pub torch_reserved: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Diff {
    pub gpumem_requests: usize,
    pub torch_requests: usize,
    pub matched: usize,
    pub first_divergence: Option<Divergence>,
    /// Bytes gpumem asks for that PyTorch did not, by category (`Category::ALL` order).
    pub gpumem_only: Vec<(Category, u64, usize)>,
    /// Requests PyTorch made that gpumem's trace has not: bytes and count.
    pub torch_only_bytes: u64,
    pub torch_only_count: usize,
    pub peaks: Peaks,
}

/// Lines `trace` (replayed on `profile`) up with the real run of `snapshot`.
pub fn diff(
    trace: &Trace,
    profile: &GpuProfile,
    snapshot: &Snapshot,
) -> Result<Diff, EstimateError> {
    let ours = requests(trace, profile);
    let a: Vec<u64> = ours.iter().map(|r| r.bytes).collect();
    let b: Vec<u64> = snapshot.allocs.iter().map(|r| r.bytes).collect();
    let ops = capture_diff_slices(Algorithm::Myers, &a, &b);
    let mut d = Diff {
        gpumem_requests: a.len(),
        torch_requests: b.len(),
        matched: 0,
        first_divergence: None,
        gpumem_only: Vec::new(),
        torch_only_bytes: 0,
        torch_only_count: 0,
        peaks: Peaks {
            gpumem_allocated: 0,
            torch_allocated: snapshot.peak_allocated,
            gpumem_reserved: 0,
            torch_reserved: snapshot.peak_reserved,
        },
    };
    let mut only = [(0u64, 0usize); crate::trace::CATEGORIES];
    let describe = |r: &Request| GpumemRequest {
        bytes: r.bytes,
        category: r.category,
        at: PeakAt::of(trace, r.event, r.iteration),
    };
    for op in &ops {
        let (ours_range, theirs_range) = (op.old_range(), op.new_range());
        if let DiffOp::Equal { len, .. } = op {
            d.matched += len;
            continue;
        }
        if d.first_divergence.is_none() {
            d.first_divergence = Some(Divergence {
                after_matching: d.matched,
                gpumem: ours[ours_range.start..ours_range.end.min(ours_range.start + 3)]
                    .iter()
                    .map(describe)
                    .collect(),
                torch: b[theirs_range.start..theirs_range.end.min(theirs_range.start + 3)].to_vec(),
                torch_index: theirs_range.start,
                before_peak: theirs_range.start <= snapshot.peak_allocated_at,
            });
        }
        for r in &ours[ours_range] {
            only[r.category.index()].0 += r.bytes;
            only[r.category.index()].1 += 1;
        }
        d.torch_only_bytes += b[theirs_range.clone()].iter().sum::<u64>();
        d.torch_only_count += theirs_range.len();
    }
    d.gpumem_only = Category::ALL
        .iter()
        .map(|&c| (c, only[c.index()].0, only[c.index()].1))
        .filter(|x| x.2 > 0)
        .collect();
    let est = Replay::default().estimate(trace, profile)?;
    if let Some(stats) = est.allocator {
        (d.peaks.gpumem_allocated, d.peaks.gpumem_reserved) =
            (stats.peak_allocated, stats.peak_reserved);
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::Alloc;
    use crate::trace::{Phase, TraceBuilder, TraceHeader};

    fn snapshot(sizes: &[u64]) -> Snapshot {
        Snapshot {
            allocs: sizes.iter().map(|&bytes| Alloc { bytes }).collect(),
            peak_allocated: 0,
            peak_allocated_at: 2,
            peak_reserved: 0,
            recorded: None,
        }
    }

    #[test]
    fn the_first_parting_is_found_and_the_leftovers_counted() {
        let mut b = TraceBuilder::new(TraceHeader::new("t", 1));
        for (id, bytes) in [(1, 1000), (2, 2000), (3, 3000), (4, 4000)] {
            b.alloc_with_id(
                0,
                id,
                bytes,
                Category::Activation,
                Phase::Forward,
                "mm",
                Some("fc"),
                0,
            )
            .unwrap();
        }
        let t = b.finish();
        let profile = crate::profile::builtin("h200").unwrap();
        let same = diff(&t, &profile, &snapshot(&[1000, 2000, 3000, 4000])).unwrap();
        assert_eq!(
            (
                same.matched,
                same.first_divergence.is_none(),
                same.torch_only_count
            ),
            (4, true, 0)
        );
        // PyTorch made a 512-byte request gpumem does not know of, and no 3000 one.
        let d = diff(&t, &profile, &snapshot(&[1000, 2000, 512, 4000])).unwrap();
        let first = d.first_divergence.unwrap();
        assert_eq!(
            (
                first.after_matching,
                first.torch_index,
                first.torch.as_slice(),
                first.before_peak
            ),
            (2, 2, &[512u64][..], true)
        );
        assert_eq!(first.gpumem[0].bytes, 3000);
        assert_eq!(
            first.gpumem[0].at.as_ref().unwrap().module.as_deref(),
            Some("fc")
        );
        assert_eq!(d.gpumem_only, vec![(Category::Activation, 3000, 1)]);
        assert_eq!(
            (d.torch_only_bytes, d.torch_only_count, d.matched),
            (512, 1, 3)
        );
    }
}
