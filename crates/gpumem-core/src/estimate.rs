//! Estimators: `trace × profile → Estimate`, all fed the same trace.
//!
//! - [`Replay`] (the flagship): replays every allocation and free through the caching-allocator
//!   model ([`crate::allocator`]) and adds the profile's fixed costs: nvidia-smi ≈ context +
//!   non-allocator memory + peak reserved.
//! - [`LiveTensors`]: the peak of live tensor bytes, no allocator, no context — the seed's
//!   FakeTensor-style baseline.
//! - [`Horus`]: the seed's closed form, 4 B × (activations/sample × batch + params + batch × params).

use serde::Serialize;

use crate::allocator::{AllocatorStats, CachingAllocator, OutOfMemory};
use crate::profile::{GpuProfile, ProfileError};
use crate::trace::{Category, Event, Trace};
use crate::units::mib_to_bytes;

/// Peak memory split by what holds it, in bytes, at the moment of the peak.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Breakdown {
    pub context: u64,
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    pub activations: u64,
    pub temporaries: u64,
    pub input_batch: u64,
    pub workspace: u64,
    pub allocator_slack: u64,
}

impl Breakdown {
    fn from_categories(live: &[u64; 7]) -> Self {
        Breakdown {
            parameters: live[Category::Parameter.index()],
            gradients: live[Category::Gradient.index()],
            optimizer_state: live[Category::OptimizerState.index()],
            activations: live[Category::Activation.index()],
            temporaries: live[Category::Temporary.index()],
            input_batch: live[Category::InputBatch.index()],
            workspace: live[Category::Workspace.index()],
            ..Default::default()
        }
    }

    /// (name, bytes) pairs in display order.
    pub fn items(&self) -> [(&'static str, u64); 9] {
        [
            ("context", self.context),
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer_state", self.optimizer_state),
            ("activations", self.activations),
            ("temporaries", self.temporaries),
            ("input_batch", self.input_batch),
            ("workspace", self.workspace),
            ("allocator_slack", self.allocator_slack),
        ]
    }

    pub fn total(&self) -> u64 {
        self.items().iter().map(|(_, b)| b).sum()
    }
}

/// One point of the allocator timeline: after event `event`, these many bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TimelinePoint {
    pub event: u32,
    pub allocated: u64,
    pub reserved: u64,
}

/// What an estimator says about a trace on a GPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    pub estimator: &'static str,
    pub gpu: String,
    /// Peak memory as nvidia-smi would show it.
    pub peak_bytes: u64,
    /// A value the true peak should not exceed (see the profile's bound margins).
    pub upper_bound_bytes: u64,
    pub capacity_bytes: u64,
    /// The job runs without an out-of-memory error (the replay includes the allocator's
    /// release-and-retry path).
    pub fits: bool,
    pub breakdown: Breakdown,
    /// Allocator counters (replay only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocator: Option<AllocatorStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fragmentation_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub timeline: Vec<TimelinePoint>,
}

impl Estimate {
    /// An estimate that is just its breakdown's total (the baselines: no allocator, no margin).
    fn without_allocator(estimator: &'static str, profile: &GpuProfile, breakdown: Breakdown) -> Estimate {
        let peak = breakdown.total();
        Estimate {
            estimator,
            gpu: profile.name.clone(),
            peak_bytes: peak,
            upper_bound_bytes: peak,
            capacity_bytes: profile.capacity_bytes(),
            fits: peak <= profile.capacity_bytes(),
            breakdown,
            allocator: None,
            fragmentation_bytes: None,
            timeline: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EstimateError {
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error("the {estimator} estimator needs `{field}` in the trace header")]
    MissingField { estimator: &'static str, field: &'static str },
}

/// Every estimator implements this.
pub trait Estimator {
    fn name(&self) -> &'static str;
    fn estimate(&self, trace: &Trace, profile: &GpuProfile) -> Result<Estimate, EstimateError>;
}

/// Estimator by name, as the CLI spells it.
pub fn by_name(name: &str) -> Result<Box<dyn Estimator>, String> {
    match name {
        "replay" => Ok(Box::new(Replay::default())),
        "live-tensors" => Ok(Box::new(LiveTensors)),
        "horus" => Ok(Box::new(Horus)),
        other => Err(format!("unknown estimator `{other}` (expected replay, live-tensors or horus)")),
    }
}

pub const ESTIMATORS: [&str; 3] = ["replay", "live-tensors", "horus"];

/// Op names of convolution kernels (PyTorch's and the native families').
const CONVOLUTIONS: [&str; 2] = ["convolution", "conv2d"];

fn upper_bound(profile: &GpuProfile, trace: &Trace, peak: u64, fixed: u64) -> u64 {
    let variable = peak.saturating_sub(fixed) as f64;
    let conv_workspace = trace.largest_output(&CONVOLUTIONS) as f64 * profile.conv_workspace_bound;
    peak + mib_to_bytes(profile.bound_fixed_mib) + (variable * profile.bound_relative + conv_workspace).round() as u64
}

/// The caching-allocator replay.
#[derive(Debug, Clone, Copy, Default)]
pub struct Replay {
    /// Record the allocated/reserved timeline.
    pub timeline: bool,
}

/// Result of one replay run.
struct Run {
    stats: AllocatorStats,
    at_peak: [u64; 7],
    fragmentation: u64,
    timeline: Vec<TimelinePoint>,
    oom: Option<OutOfMemory>,
}

impl Replay {
    fn run(&self, trace: &Trace, profile: &GpuProfile, capacity: u64) -> Result<Run, EstimateError> {
        let cfg = profile.allocator_config()?;
        let workspace_op = trace.ops.iter().position(|o| o == "cublas_workspace").map(|i| i as u32);
        let workspace = profile.cublas_workspace();
        let mut alloc = CachingAllocator::new(cfg, capacity);
        let mut slots: Vec<Option<(crate::allocator::BlockId, u8, u64)>> = vec![None; trace.slots()];
        let mut live = [0u64; 7];
        let mut at_peak = [0u64; 7];
        let mut best = 0u64;
        let mut fragmentation = 0;
        let mut timeline = Vec::new();
        let mut oom = None;
        for (n, ev) in trace.events.iter().enumerate() {
            match *ev {
                Event::Alloc { slot, bytes, category, op, stream, .. } => {
                    let bytes = if category == Category::Workspace && Some(op) == workspace_op { workspace } else { bytes };
                    if bytes == 0 {
                        continue; // zero-byte tensors never reach the allocator
                    }
                    match alloc.malloc(bytes, stream) {
                        Ok(b) => {
                            let c = category.index();
                            live[c] += bytes;
                            slots[slot as usize] = Some((b, c as u8, bytes));
                            let reserved = alloc.stats().reserved;
                            if reserved > best {
                                best = reserved;
                                at_peak = live;
                                if self.timeline {
                                    fragmentation = alloc.inactive_split_bytes();
                                }
                            }
                        }
                        Err(e) => {
                            oom = Some(e);
                            break;
                        }
                    }
                }
                Event::Free { slot } => {
                    if let Some((b, c, bytes)) = slots[slot as usize].take() {
                        alloc.free(b);
                        live[c as usize] -= bytes;
                    }
                }
                Event::Op { .. } | Event::Iteration { .. } => continue,
            }
            if self.timeline {
                let s = alloc.stats();
                let point = TimelinePoint { event: n as u32, allocated: s.allocated, reserved: s.reserved };
                if timeline.last().is_none_or(|p: &TimelinePoint| (p.allocated, p.reserved) != (s.allocated, s.reserved)) {
                    timeline.push(point);
                }
            }
        }
        if !self.timeline {
            fragmentation = alloc.inactive_split_bytes();
        }
        Ok(Run { stats: *alloc.stats(), at_peak, fragmentation, timeline, oom })
    }
}

impl Estimator for Replay {
    fn name(&self) -> &'static str {
        "replay"
    }

    fn estimate(&self, trace: &Trace, profile: &GpuProfile) -> Result<Estimate, EstimateError> {
        let fixed = profile.context_bytes() + profile.non_allocator_bytes();
        let mut run = self.run(trace, profile, profile.allocator_capacity())?;
        let fits = run.oom.is_none();
        if !fits {
            // Report what the job would take on a GPU large enough to hold it.
            run = self.run(trace, profile, u64::MAX / 4)?;
        }
        let peak = fixed + run.stats.peak_reserved;
        let mut breakdown = Breakdown::from_categories(&run.at_peak);
        breakdown.context = fixed;
        breakdown.allocator_slack = run.stats.peak_reserved.saturating_sub(run.at_peak.iter().sum());
        Ok(Estimate {
            estimator: self.name(),
            gpu: profile.name.clone(),
            peak_bytes: peak,
            upper_bound_bytes: upper_bound(profile, trace, peak, fixed),
            capacity_bytes: profile.capacity_bytes(),
            fits,
            breakdown,
            allocator: Some(run.stats),
            fragmentation_bytes: Some(run.fragmentation),
            timeline: run.timeline,
        })
    }
}

/// Peak of live tensor bytes (FakeTensor-style counting): no allocator, no context.
#[derive(Debug, Clone, Copy, Default)]
pub struct LiveTensors;

impl Estimator for LiveTensors {
    fn name(&self) -> &'static str {
        "live-tensors"
    }

    fn estimate(&self, trace: &Trace, profile: &GpuProfile) -> Result<Estimate, EstimateError> {
        let mut sizes: Vec<(u64, u8)> = vec![(0, 0); trace.slots()];
        let mut live = [0u64; 7];
        let (mut total, mut peak, mut at_peak) = (0u64, 0u64, [0u64; 7]);
        for ev in &trace.events {
            match *ev {
                // The cuBLAS workspace is not a tensor: FakeTensor never sees it.
                Event::Alloc { category: Category::Workspace, .. } => {}
                Event::Alloc { slot, bytes, category, .. } => {
                    sizes[slot as usize] = (bytes, category.index() as u8);
                    live[category.index()] += bytes;
                    total += bytes;
                    if total > peak {
                        peak = total;
                        at_peak = live;
                    }
                }
                Event::Free { slot } => {
                    let (bytes, c) = sizes[slot as usize];
                    live[c as usize] -= bytes;
                    total -= bytes;
                }
                _ => {}
            }
        }
        Ok(Estimate::without_allocator(self.name(), profile, Breakdown::from_categories(&at_peak)))
    }
}

/// The seed's Horus formula: 4 B × (activations/sample × batch + params + batch × params).
#[derive(Debug, Clone, Copy, Default)]
pub struct Horus;

impl Estimator for Horus {
    fn name(&self) -> &'static str {
        "horus"
    }

    fn estimate(&self, trace: &Trace, profile: &GpuProfile) -> Result<Estimate, EstimateError> {
        let h = &trace.header;
        let p = h.parameters.ok_or(EstimateError::MissingField { estimator: "horus", field: "parameters" })?;
        let a = h.activations_per_sample.ok_or(EstimateError::MissingField { estimator: "horus", field: "activations_per_sample" })?;
        let b = h.batch_size;
        let breakdown = Breakdown {
            parameters: 4 * p,
            activations: 4 * a * b,
            temporaries: 4 * b * p,
            ..Default::default()
        };
        Ok(Estimate::without_allocator(self.name(), profile, breakdown))
    }
}
