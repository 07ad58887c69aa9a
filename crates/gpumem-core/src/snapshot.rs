//! PyTorch's memory snapshot (`torch.cuda.memory._snapshot()`, pickled; `python -m
//! gpumem_trace.record` writes one): the caching allocator's own record of a real run, read
//! without Python. Only the first device's trace is used: its allocation requests in order and
//! the allocated and reserved peaks they make.

use std::collections::HashMap;

use serde::Deserialize;

use crate::allocator::MIN_BLOCK_SIZE;

#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("not a PyTorch memory snapshot: {0}")]
    Pickle(#[from] serde_pickle::Error),
    #[error(
        "the snapshot holds no allocator trace (record it with torch.cuda.memory._record_memory_history on)"
    )]
    NoTrace,
}

#[derive(Deserialize)]
struct Raw {
    #[serde(default)]
    device_traces: Vec<Vec<RawEntry>>,
    /// What `gpumem_trace.record` ran, beside PyTorch's keys.
    #[serde(default)]
    gpumem: Option<Recorded>,
}

#[derive(Deserialize)]
struct RawEntry {
    action: String,
    #[serde(default)]
    addr: u64,
    #[serde(default)]
    size: u64,
}

/// What `gpumem_trace.record` says it ran (absent from a snapshot taken by other means).
#[derive(Debug, Clone, Deserialize)]
pub struct Recorded {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub batch: Option<u64>,
    #[serde(default)]
    pub max_allocated: Option<u64>,
    #[serde(default)]
    pub max_reserved: Option<u64>,
}

/// One allocation request of the real run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alloc {
    pub bytes: u64,
}

/// The real run as the allocator recorded it.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Allocation requests in order.
    pub allocs: Vec<Alloc>,
    /// Peak of allocated bytes (blocks rounded as the allocator rounds them) and the index in
    /// `allocs` of the request that reached it.
    pub peak_allocated: u64,
    pub peak_allocated_at: usize,
    /// Peak of reserved bytes (segments obtained from cudaMalloc).
    pub peak_reserved: u64,
    pub recorded: Option<Recorded>,
}

impl Snapshot {
    pub fn read(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
        // A snapshot may hold Python objects of other packages (torch's version string): they
        // are not needed and are read as None.
        let options = serde_pickle::DeOptions::new().replace_unresolved_globals();
        let raw: Raw = serde_pickle::from_slice(bytes, options)?;
        let trace = raw
            .device_traces
            .into_iter()
            .find(|t| !t.is_empty())
            .ok_or(SnapshotError::NoTrace)?;
        let round = |b: u64| b.max(1).div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE;
        let mut live: HashMap<u64, u64> = HashMap::new();
        let (mut allocated, mut reserved) = (0u64, 0u64);
        let mut s = Snapshot {
            allocs: Vec::new(),
            peak_allocated: 0,
            peak_allocated_at: 0,
            peak_reserved: 0,
            recorded: raw.gpumem,
        };
        for e in trace {
            match e.action.as_str() {
                "alloc" => {
                    live.insert(e.addr, e.size);
                    allocated += round(e.size);
                    s.allocs.push(Alloc { bytes: e.size });
                    if allocated > s.peak_allocated {
                        (s.peak_allocated, s.peak_allocated_at) = (allocated, s.allocs.len() - 1);
                    }
                }
                "free_requested" | "free" => {
                    if let Some(size) = live.remove(&e.addr) {
                        allocated -= round(size);
                    }
                }
                // Expandable segments grow and shrink by mapping pages.
                "segment_alloc" | "segment_map" => {
                    reserved += e.size;
                    s.peak_reserved = s.peak_reserved.max(reserved);
                }
                "segment_free" | "segment_unmap" => reserved = reserved.saturating_sub(e.size),
                _ => {}
            }
        }
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_refused_in_one_line() {
        let e = Snapshot::read(b"not a pickle").unwrap_err().to_string();
        assert!(
            e.starts_with("not a PyTorch memory snapshot") && !e.contains('\n'),
            "{e}"
        );
    }
}
