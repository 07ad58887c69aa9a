//! Estimators: `trace × profile → Estimate`, all fed the same trace.
//!
//! - [`Replay`] (the flagship): replays every allocation and free through the caching-allocator
//!   model ([`crate::allocator`]) and adds the profile's fixed costs: nvidia-smi ≈ context +
//!   non-allocator memory + peak reserved.
//! - [`LiveTensors`]: the peak of live tensor bytes, no allocator, no context — the seed's
//!   FakeTensor-style baseline.
//! - [`Horus`]: the seed's closed form, 4 B × (activations/sample × batch + params + batch × params).

use serde::Serialize;

use crate::UnknownName;
use crate::allocator::{AllocatorStats, CachingAllocator, OutOfMemory};
use crate::profile::{GpuProfile, ProfileError};
use crate::trace::{CATEGORIES, Category, ConvPass, Event, Phase, RunPhase, Trace};
use crate::units::{MIB, mib_to_bytes};
use crate::workspace::{WorkspaceSource, WorkspaceTable};

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
    fn from_categories(live: &[u64; CATEGORIES]) -> Self {
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

/// One point of the allocator timeline: after event `event`, the live bytes per category (in
/// [`Category::ALL`] order), and what the allocator has allocated and reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TimelinePoint {
    pub event: u32,
    pub live: [u64; CATEGORIES],
    pub allocated: u64,
    pub reserved: u64,
}

/// Where in the training step an instant falls: the allocation that reached it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeakAt {
    /// The part of the whole run (a whole run's trace only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_phase: Option<RunPhase>,
    pub phase: Phase,
    /// The kernel that allocated.
    pub op: String,
    /// The module it ran for (its path in the model, e.g. `layer4.2.conv3`), where known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub module: Option<String>,
    /// 0-based training iteration; the trace's iteration count for a validation pass after
    /// training.
    pub iteration: u32,
    /// Index of the event in the trace.
    pub event: u32,
}

impl PeakAt {
    pub(crate) fn of(trace: &Trace, event: usize, iteration: u32) -> Option<PeakAt> {
        let (phase, op, module) = match trace.events()[event] {
            Event::Alloc {
                phase, op, module, ..
            } => (phase, trace.op_name(op).to_string(), module),
            // A peak inside a convolution kernel, while cuDNN holds its workspace.
            Event::Workspace {
                phase,
                pass,
                module,
                ..
            } => (
                phase,
                format!("convolution {} workspace", pass.name()),
                module,
            ),
            _ => return None,
        };
        Some(PeakAt {
            run_phase: trace.run_phase_at(event),
            phase,
            op,
            module: trace.module(module).map(str::to_string),
            iteration,
            event: event as u32,
        })
    }

    /// "backward, layer4.2.conv3 (convolution_backward), iteration 2"; in a whole run, the
    /// run's part first ("evaluate: forward, lm_head (mm)").
    pub fn describe(&self, iterations: u32) -> String {
        // Past the last iteration, outside a whole run's parts: a validation pass.
        let steps = self.iteration < iterations;
        let phase = match self.run_phase {
            Some(run) => format!("{}: {}", run.name(), self.phase.name()),
            None if steps => self.phase.name().to_string(),
            None => "validation".to_string(),
        };
        let module = self
            .module
            .as_deref()
            .map(|m| format!("{m} "))
            .unwrap_or_default();
        let iteration = if !steps || self.run_phase.is_some_and(|p| p != RunPhase::Train) {
            String::new()
        } else {
            format!(", iteration {}", self.iteration + 1)
        };
        format!("{phase}, {module}({}){iteration}", self.op)
    }
}

/// Memory at one instant of the replay: what is live by category (with the context, and
/// `allocator_slack` = reserved − live), and where in the step it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Moment {
    pub breakdown: Breakdown,
    pub allocated: u64,
    pub reserved: u64,
    pub at: PeakAt,
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
    /// What is live at the peak of allocated memory (the replay's; for the baselines, their
    /// own peak), by category; `allocator_slack` is reserved − live at that instant.
    pub breakdown: Breakdown,
    /// Where the peak of allocated memory happens (replay and live-tensors).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_at: Option<PeakAt>,
    /// The peak of reserved memory — what nvidia-smi shows — where it falls at another instant
    /// than the peak of allocated memory (replay only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_peak: Option<Moment>,
    /// Allocator counters (replay only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocator: Option<AllocatorStats>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fragmentation_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub timeline: Vec<TimelinePoint>,
    /// Where the convolution workspaces' sizes came from (the least certain lookup), for a
    /// trace with convolutions (replay only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace_source: Option<WorkspaceSource>,
    /// The most host-backed memory live at once (bitsandbytes' paged optimizer state, CUDA
    /// managed memory): not in the peak, which it does not raise — the driver pages it out to
    /// the host when the GPU needs the room — but nvidia-smi shows it while the GPU has room.
    #[serde(skip_serializing_if = "is_zero")]
    pub host_backed_bytes: u64,
    /// A whole run's parts, each with its own peak, in the order the run first reaches them
    /// (replay only; empty for the training steps alone).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<PhasePeak>,
}

/// The peak of one part of a whole run, in the estimate's terms: what nvidia-smi shows
/// (`peak_bytes`: the fixed costs plus the most the allocator reserved during it, its cache from
/// the parts before included), reserved and allocated, and where allocated memory peaks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PhasePeak {
    pub name: RunPhase,
    pub peak_bytes: u64,
    pub reserved_bytes: u64,
    pub allocated_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at: Option<PeakAt>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// The most bytes of [`Category::HostBacked`] live at once in `trace`.
pub fn host_backed_peak(trace: &Trace) -> u64 {
    let mut sizes = vec![0u64; trace.slots()];
    let (mut live, mut peak) = (0u64, 0u64);
    for ev in trace.events() {
        match *ev {
            Event::Alloc {
                slot,
                bytes,
                category: Category::HostBacked,
                ..
            } => {
                sizes[slot as usize] = bytes;
                live += bytes;
                peak = peak.max(live);
            }
            Event::Free { slot } => {
                live -= std::mem::take(&mut sizes[slot as usize]);
            }
            _ => {}
        }
    }
    peak
}

impl Estimate {
    /// An estimate that is just its breakdown's total (the baselines: no allocator, no margin).
    fn without_allocator(
        estimator: &'static str,
        profile: &GpuProfile,
        breakdown: Breakdown,
    ) -> Estimate {
        let peak = breakdown.total();
        Estimate {
            estimator,
            gpu: profile.name.clone(),
            peak_bytes: peak,
            upper_bound_bytes: peak,
            capacity_bytes: profile.capacity_bytes(),
            fits: peak <= profile.capacity_bytes(),
            breakdown,
            peak_at: None,
            reserved_peak: None,
            allocator: None,
            fragmentation_bytes: None,
            timeline: Vec::new(),
            workspace_source: None,
            host_backed_bytes: 0,
            phases: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EstimateError {
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error("the {estimator} estimator needs `{field}` in the trace header")]
    MissingField {
        estimator: &'static str,
        field: &'static str,
    },
    /// A learned estimator could not answer (its model, or a model it has no features for):
    /// its own error's message (the learned estimators live above this crate).
    #[error("{0}")]
    Learned(String),
}

/// Every estimator implements this. An estimate is a function of the trace and the profile:
/// estimators hold no state a call changes, and callers share one across threads.
pub trait Estimator: Send + Sync {
    fn name(&self) -> &'static str;
    fn estimate(&self, trace: &Trace, profile: &GpuProfile) -> Result<Estimate, EstimateError>;
}

/// Estimator by name, as the CLI spells it.
pub fn by_name(name: &str) -> Result<Box<dyn Estimator>, UnknownName> {
    match name {
        "replay" => Ok(Box::new(Replay::default())),
        "live-tensors" => Ok(Box::new(LiveTensors)),
        "horus" => Ok(Box::new(Horus)),
        other => Err(UnknownName::new(
            "estimator",
            other,
            "replay, live-tensors or horus",
        )),
    }
}

pub const ESTIMATORS: [&str; 3] = ["replay", "live-tensors", "horus"];

/// Op names of convolution kernels (PyTorch's and the native families').
const CONVOLUTIONS: [&str; 2] = ["convolution", "conv2d"];

/// The estimate plus the profile's margins; convolution workspaces not probed on this stack
/// (sized by the fitted model, or not modelled) get the allowance for cuDNN's choices.
pub(crate) fn upper_bound(
    profile: &GpuProfile,
    trace: &Trace,
    peak: u64,
    fixed: u64,
    workspaces: Option<WorkspaceSource>,
) -> u64 {
    let variable = peak.saturating_sub(fixed) as f64;
    let allowance = if workspaces == Some(WorkspaceSource::Probed) {
        0.0
    } else {
        profile.conv_workspace_bound
    };
    let conv_workspace = trace.largest_output(&CONVOLUTIONS) as f64 * allowance;
    peak + mib_to_bytes(profile.bound_fixed_mib)
        + (variable * profile.bound_relative + conv_workspace).round() as u64
}

/// How the replay sizes what a trace leaves to the GPU: the cuBLAS workspace from the
/// profile's architecture, convolution workspaces from its probed table.
pub struct GpuSizes<'a> {
    cublas_op: Option<u32>,
    cublas: u64,
    cublaslt_op: Option<u32>,
    cublaslt: u64,
    convs: WorkspaceTable<'a>,
}

impl<'a> GpuSizes<'a> {
    pub fn new(trace: &Trace, profile: &'a GpuProfile) -> Self {
        let op = |name: &str| {
            trace
                .op_names()
                .iter()
                .position(|o| o == name)
                .map(|i| i as u32)
        };
        GpuSizes {
            cublas_op: op("cublas_workspace"),
            cublas: profile.cublas_workspace(),
            cublaslt_op: op("cublaslt_workspace"),
            cublaslt: profile.cublaslt_workspace_bytes.unwrap_or(0),
            convs: profile.workspaces(),
        }
    }

    /// The bytes an allocation event asks of the allocator.
    pub fn alloc(&self, bytes: u64, category: Category, op: u32) -> u64 {
        if category == Category::HostBacked {
            0 // managed memory: never the caching allocator's
        } else if category != Category::Workspace {
            bytes
        } else if Some(op) == self.cublas_op {
            self.cublas
        } else if Some(op) == self.cublaslt_op {
            self.cublaslt
        } else {
            bytes
        }
    }

    /// The requests (none of zero bytes) of a convolution's workspace event, and their source.
    pub fn workspace(
        &self,
        trace: &Trace,
        conv: u32,
        n: u64,
        pass: ConvPass,
    ) -> (Vec<u64>, WorkspaceSource) {
        let (mut bytes, source) = self.convs.lookup(trace.op_name(conv), n, pass);
        bytes.retain(|&b| b > 0);
        (bytes, source)
    }
}

/// The caching-allocator replay.
#[derive(Debug, Clone, Copy, Default)]
pub struct Replay {
    /// Record the allocated/reserved timeline.
    pub timeline: bool,
}

/// An instant of a replay: the event that reached it, the live bytes per category then, and
/// the allocator's totals.
#[derive(Debug, Clone, Copy, Default)]
struct Instant {
    event: usize,
    iteration: u32,
    run_phase: Option<RunPhase>,
    live: [u64; CATEGORIES],
    allocated: u64,
    reserved: u64,
}

/// The peaks a replay has reached so far, and the fragmentation at the reserved one; a whole
/// run's, also each part's (its allocated and reserved peaks).
#[derive(Default)]
struct Peaks {
    allocated: Instant,
    reserved: Instant,
    fragmentation: u64,
    parts: Vec<(RunPhase, Instant, Instant)>,
}

impl Peaks {
    /// After a malloc at event `n`: the instant it makes, and any new peak.
    fn reach(
        &mut self,
        now: &mut Instant,
        n: usize,
        alloc: &CachingAllocator,
        fragmentation: bool,
    ) {
        let s = alloc.stats();
        (now.event, now.allocated, now.reserved) = (n, s.allocated, s.reserved);
        if now.allocated > self.allocated.allocated {
            self.allocated = *now;
        }
        if now.reserved > self.reserved.reserved {
            self.reserved = *now;
            if fragmentation {
                self.fragmentation = alloc.inactive_split_bytes();
            }
        }
        self.reach_in_part(now);
    }

    /// `now` within the current part of a whole run (none outside one).
    fn reach_in_part(&mut self, now: &Instant) {
        let Some(phase) = now.run_phase else { return };
        let Some(part) = self.parts.iter_mut().find(|p| p.0 == phase) else {
            self.parts.push((phase, *now, *now)); // its first instant: its start
            return;
        };
        if now.allocated > part.1.allocated {
            part.1 = *now;
        }
        if now.reserved > part.2.reserved {
            part.2 = *now;
        }
    }
}

/// Result of one replay run.
struct Run {
    stats: AllocatorStats,
    allocated_peak: Instant,
    reserved_peak: Instant,
    parts: Vec<(RunPhase, Instant, Instant)>,
    fragmentation: u64,
    timeline: Vec<TimelinePoint>,
    oom: Option<OutOfMemory>,
    workspace_source: Option<WorkspaceSource>,
}

impl Replay {
    /// What a job that does not fit takes on a GPU large enough to hold it: the replay at the
    /// smallest capacity it runs in. Not the replay without a limit — a real allocator whose
    /// `cudaMalloc` fails frees its cache and retries, so a cache that only grows (an
    /// evaluation loop concatenating its logits leaves every shorter copy cached) never
    /// reaches the GPU. Searched between the allocated peak, which no capacity goes below,
    /// and the unbounded replay's reserved peak, to within 1% (at least 2 MiB).
    fn on_the_smallest_gpu_that_holds(
        &self,
        trace: &Trace,
        profile: &GpuProfile,
    ) -> Result<Run, EstimateError> {
        let mut holds = self.run(trace, profile, u64::MAX / 4)?;
        let mut too_small = holds.stats.peak_allocated.saturating_sub(1);
        let mut large_enough = holds.stats.peak_reserved;
        while large_enough - too_small > (large_enough / 100).max(2 * MIB) {
            let capacity = too_small + (large_enough - too_small) / 2;
            let run = self.run(trace, profile, capacity)?;
            if run.oom.is_none() {
                (holds, large_enough) = (run, capacity);
            } else {
                too_small = capacity;
            }
        }
        Ok(holds)
    }

    fn run(
        &self,
        trace: &Trace,
        profile: &GpuProfile,
        capacity: u64,
    ) -> Result<Run, EstimateError> {
        let cfg = profile.allocator_config()?;
        let sizes = GpuSizes::new(trace, profile);
        let mut workspace_source = None;
        let mut alloc = CachingAllocator::new(cfg, capacity);
        let mut slots: Vec<Option<(crate::allocator::BlockId, u8, u64)>> =
            vec![None; trace.slots()];
        let mut now = Instant::default();
        let mut peaks = Peaks::default();
        let mut timeline = Vec::new();
        let mut oom = None;
        for (n, ev) in trace.events().iter().enumerate() {
            match *ev {
                Event::Alloc {
                    slot,
                    bytes,
                    category,
                    op,
                    stream,
                    ..
                } => {
                    let bytes = sizes.alloc(bytes, category, op);
                    if bytes == 0 {
                        continue; // zero-byte tensors never reach the allocator
                    }
                    match alloc.malloc(bytes, stream) {
                        Ok(b) => {
                            let c = category.index();
                            now.live[c] += bytes;
                            slots[slot as usize] = Some((b, c as u8, bytes));
                            peaks.reach(&mut now, n, &alloc, self.timeline);
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
                        now.live[c as usize] -= bytes;
                    }
                }
                Event::Iteration { .. } => {
                    now.iteration += 1;
                    continue;
                }
                Event::RunPhase { phase } => {
                    // A part starts with what the parts before left reserved and allocated
                    // (read here: `now` was last set at a malloc, before the frees since).
                    let s = alloc.stats();
                    (now.run_phase, now.event) = (Some(phase), n);
                    (now.allocated, now.reserved) = (s.allocated, s.reserved);
                    peaks.reach_in_part(&now);
                    continue;
                }
                Event::Op { .. } => continue,
                Event::EmptyCache => {
                    alloc.release_cached_blocks();
                    continue;
                }
                Event::Workspace {
                    conv,
                    n: batch,
                    pass,
                    ..
                } => {
                    // Taken and given back inside the kernel: it raises the peaks (and can make
                    // the allocator reserve a segment) but outlives nothing. A workspace the
                    // allocator cannot serve (after emptying its cache, as PyTorch's does) is no
                    // OOM: PyTorch catches it and runs cuDNN's next engine, which needs none.
                    let (bytes, source) = sizes.workspace(trace, conv, batch, pass);
                    workspace_source = workspace_source.max(Some(source));
                    let c = Category::Workspace.index();
                    for bytes in bytes {
                        if let Ok(b) = alloc.malloc(bytes, 0) {
                            now.live[c] += bytes;
                            peaks.reach(&mut now, n, &alloc, self.timeline);
                            alloc.free(b);
                            now.live[c] -= bytes;
                        }
                    }
                }
            }
            if self.timeline {
                let s = alloc.stats();
                if timeline.last().is_none_or(|p: &TimelinePoint| {
                    (p.allocated, p.reserved, p.live) != (s.allocated, s.reserved, now.live)
                }) {
                    timeline.push(TimelinePoint {
                        event: n as u32,
                        live: now.live,
                        allocated: s.allocated,
                        reserved: s.reserved,
                    });
                }
            }
        }
        if !self.timeline {
            peaks.fragmentation = alloc.inactive_split_bytes();
        }
        let Peaks {
            allocated: allocated_peak,
            reserved: reserved_peak,
            fragmentation,
            parts,
        } = peaks;
        Ok(Run {
            stats: *alloc.stats(),
            allocated_peak,
            reserved_peak,
            parts,
            fragmentation,
            timeline,
            oom,
            workspace_source,
        })
    }
}

impl Instant {
    /// The breakdown of this instant, the fixed costs counted as context.
    fn moment(&self, trace: &Trace, fixed: u64) -> Option<Moment> {
        let mut breakdown = Breakdown::from_categories(&self.live);
        breakdown.context = fixed;
        breakdown.allocator_slack = self.reserved.saturating_sub(self.live.iter().sum());
        Some(Moment {
            breakdown,
            allocated: self.allocated,
            reserved: self.reserved,
            at: PeakAt::of(trace, self.event, self.iteration)?,
        })
    }
}

impl Estimator for Replay {
    fn name(&self) -> &'static str {
        "replay"
    }

    fn estimate(&self, trace: &Trace, profile: &GpuProfile) -> Result<Estimate, EstimateError> {
        let fixed = profile.fixed_bytes(trace.runs_convolutions(), trace.communicators());
        let mut run = self.run(
            trace,
            profile,
            profile.capacity_bytes().saturating_sub(fixed),
        )?;
        let fits = run.oom.is_none();
        if !fits {
            run = self.on_the_smallest_gpu_that_holds(trace, profile)?;
        }
        let peak = fixed + run.stats.peak_reserved;
        let at_allocated = run.allocated_peak.moment(trace, fixed);
        let reserved_peak = (run.reserved_peak.event != run.allocated_peak.event)
            .then(|| run.reserved_peak.moment(trace, fixed))
            .flatten();
        Ok(Estimate {
            estimator: self.name(),
            gpu: profile.name.clone(),
            peak_bytes: peak,
            upper_bound_bytes: upper_bound(profile, trace, peak, fixed, run.workspace_source),
            capacity_bytes: profile.capacity_bytes(),
            fits,
            breakdown: at_allocated.as_ref().map_or(
                Breakdown {
                    context: fixed,
                    ..Default::default()
                },
                |m| m.breakdown,
            ),
            peak_at: at_allocated.map(|m| m.at),
            reserved_peak,
            allocator: Some(run.stats),
            fragmentation_bytes: Some(run.fragmentation),
            timeline: run.timeline,
            workspace_source: run.workspace_source,
            host_backed_bytes: host_backed_peak(trace),
            phases: run
                .parts
                .iter()
                .map(|(name, allocated, reserved)| PhasePeak {
                    name: *name,
                    peak_bytes: fixed + reserved.reserved,
                    reserved_bytes: reserved.reserved,
                    allocated_bytes: allocated.allocated,
                    at: PeakAt::of(trace, allocated.event, allocated.iteration),
                })
                .collect(),
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
        let mut live = [0u64; CATEGORIES];
        let (mut total, mut peak, mut at_peak) = (0u64, 0u64, [0u64; CATEGORIES]);
        let (mut iteration, mut peak_event) = (0u32, None);
        for (n, ev) in trace.events().iter().enumerate() {
            match *ev {
                // The cuBLAS workspace is not a tensor: FakeTensor never sees it. Managed memory
                // is no part of the peak.
                Event::Alloc {
                    category: Category::Workspace | Category::HostBacked,
                    ..
                } => {}
                Event::Alloc {
                    slot,
                    bytes,
                    category,
                    ..
                } => {
                    sizes[slot as usize] = (bytes, category.index() as u8);
                    live[category.index()] += bytes;
                    total += bytes;
                    if total > peak {
                        peak = total;
                        at_peak = live;
                        peak_event = Some((n, iteration));
                    }
                }
                Event::Free { slot } => {
                    let (bytes, c) = sizes[slot as usize];
                    live[c as usize] -= bytes;
                    total -= bytes;
                }
                Event::Iteration { .. } => iteration += 1,
                // Not tensors: FakeTensor never sees them.
                Event::Op { .. }
                | Event::Workspace { .. }
                | Event::RunPhase { .. }
                | Event::EmptyCache => {}
            }
        }
        let mut est =
            Estimate::without_allocator(self.name(), profile, Breakdown::from_categories(&at_peak));
        est.peak_at = peak_event.and_then(|(n, i)| PeakAt::of(trace, n, i));
        est.host_backed_bytes = host_backed_peak(trace);
        Ok(est)
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
        let p = h.parameters.ok_or(EstimateError::MissingField {
            estimator: "horus",
            field: "parameters",
        })?;
        let a = h
            .activations_per_sample
            .ok_or(EstimateError::MissingField {
                estimator: "horus",
                field: "activations_per_sample",
            })?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::builtin;
    use crate::trace::{TraceBuilder, TraceHeader};
    use crate::units::MIB;

    /// `torch.cuda.empty_cache()` gives back the segments with nothing allocated in them: a
    /// part after it starts with only what is live reserved.
    #[test]
    fn empty_cache_gives_back_what_nothing_holds() {
        let mut b = TraceBuilder::new(TraceHeader::new("t", 1));
        b.run_phase(RunPhase::Train);
        b.alloc(100 * MIB, Category::Parameter, Phase::Setup, "op");
        let act = b.alloc(60 * MIB, Category::Activation, Phase::Forward, "op");
        b.free(act);
        b.run_phase(RunPhase::Evaluate);
        b.empty_cache();
        b.run_phase(RunPhase::Save);
        let t = b.finish();
        let e = Replay::default()
            .estimate(&t, &builtin("a100-40gb").unwrap())
            .unwrap();
        let reserved: Vec<_> = e.phases.iter().map(|p| p.reserved_bytes / MIB).collect();
        // Evaluation starts with the freed 60 MiB cached; the save, after the emptying, without.
        assert_eq!(reserved, [160, 160, 100]);
    }

    /// A whole run's parts each report their own peak: the load holds the weights, training
    /// adds its step's tensors, and evaluation starts with training's cache still reserved.
    #[test]
    fn each_part_of_a_whole_run_has_its_peak_and_inherits_the_cache() {
        let mut b = TraceBuilder::new(TraceHeader::new("t", 1));
        let alloc =
            |b: &mut TraceBuilder, bytes, category, phase| b.alloc(bytes, category, phase, "op");
        b.run_phase(RunPhase::Load);
        alloc(&mut b, 100 * MIB, Category::Parameter, Phase::Setup);
        b.run_phase(RunPhase::Train);
        let act = alloc(&mut b, 60 * MIB, Category::Activation, Phase::Forward);
        b.free(act);
        b.iteration_end();
        b.run_phase(RunPhase::Evaluate);
        let logits = alloc(&mut b, 30 * MIB, Category::Activation, Phase::Forward);
        let more = alloc(&mut b, 40 * MIB, Category::Activation, Phase::Forward);
        b.free(logits);
        b.free(more);
        // A part that allocates nothing holds what is left: the weights, in the cache.
        b.run_phase(RunPhase::Save);
        let t = b.finish();
        assert!(t.is_whole_run());
        let profile = builtin("a100-40gb").unwrap();
        let e = Replay::default().estimate(&t, &profile).unwrap();
        let parts: Vec<_> = e
            .phases
            .iter()
            .map(|p| (p.name, p.allocated_bytes / MIB, p.reserved_bytes / MIB))
            .collect();
        assert_eq!(
            parts,
            [
                (RunPhase::Load, 100, 100),
                (RunPhase::Train, 160, 160),
                // 30 MiB fits training's freed 60 MiB segment; 40 more does not.
                (RunPhase::Evaluate, 170, 200),
                (RunPhase::Save, 100, 200),
            ]
        );
        let fixed = e.peak_bytes - e.allocator.unwrap().peak_reserved;
        assert!(
            e.phases
                .iter()
                .all(|p| p.peak_bytes == fixed + p.reserved_bytes)
        );
        assert_eq!(
            e.phases[2].peak_bytes, e.peak_bytes,
            "the run peaks in evaluation"
        );
        let at = e.phases[2].at.as_ref().unwrap();
        assert_eq!(at.run_phase, Some(RunPhase::Evaluate));
        assert_eq!(at.describe(1), "evaluate: forward, (op)");
        assert_eq!(
            e.peak_at.unwrap().run_phase,
            Some(RunPhase::Evaluate),
            "the whole run's peak names its part"
        );
    }

    /// Three 6 MiB activations share one 20 MiB segment (the allocated peak, 18 MiB, in
    /// forward); two are freed, leaving holes of 6 and 8 MiB, so the optimizer's 9 MiB
    /// temporary needs a segment of its own (the reserved peak, with less allocated).
    #[test]
    fn the_breakdown_is_the_allocated_peaks_and_the_reserved_peak_has_its_own() {
        let mut b = TraceBuilder::new(TraceHeader::new("t", 1));
        for (id, module) in [(1, "fc1"), (2, "fc2"), (3, "fc3")] {
            b.alloc_with_id(
                0,
                id,
                6 * MIB,
                Category::Activation,
                Phase::Forward,
                "mm",
                Some(module),
                0,
            )
            .unwrap();
        }
        b.free(1);
        b.free(3);
        b.iteration_end();
        b.alloc_with_id(
            0,
            4,
            9 * MIB,
            Category::Temporary,
            Phase::Optimizer,
            "_foreach_sqrt",
            None,
            0,
        )
        .unwrap();
        let t = b.finish();
        let profile = builtin("a100-40gb").unwrap();
        let e = Replay::default().estimate(&t, &profile).unwrap();
        assert_eq!(e.breakdown.activations, 18 * MIB);
        let at = e.peak_at.as_ref().unwrap();
        assert_eq!(
            (at.phase, at.op.as_str(), at.module.as_deref(), at.iteration),
            (Phase::Forward, "mm", Some("fc3"), 0)
        );
        assert_eq!(at.describe(1), "forward, fc3 (mm), iteration 1");
        assert_eq!(
            e.breakdown.allocator_slack,
            2 * MIB,
            "the segment's unused 2 MiB"
        );
        let r = e
            .reserved_peak
            .as_ref()
            .expect("reserved peaks at the optimizer's new segment");
        assert_eq!(
            (r.at.phase, r.at.iteration, r.at.module.as_deref()),
            (Phase::Optimizer, 1, None)
        );
        assert_eq!(
            (r.breakdown.activations, r.breakdown.temporaries, r.reserved),
            (6 * MIB, 9 * MIB, 40 * MIB)
        );
        assert_eq!(
            r.breakdown.total(),
            e.peak_bytes,
            "at the reserved peak the breakdown is the whole peak"
        );
        assert!(e.breakdown.total() < e.peak_bytes);
        assert_eq!(
            r.at.describe(1),
            "validation, (_foreach_sqrt)",
            "an iteration past the trace's count is its validation pass"
        );
    }

    /// A job that runs a convolution pays cuDNN's share of the context; a workspace the
    /// allocator cannot serve is dropped (cuDNN's next engine), not an out-of-memory.
    #[test]
    fn a_workspace_that_cannot_fit_falls_back_and_cudnn_costs_its_share() {
        const C: &str = "in=64x56x56;w=64x64x3x3;stride=1x1;pad=1x1;dil=1x1;groups=1;dtype=float32;layout=contiguous";
        let mut profile = builtin("a100-40gb").unwrap();
        assert_eq!(
            profile.fixed_bytes(true, 0) - profile.fixed_bytes(false, 0),
            290 * MIB
        );
        profile.capacity_mib = (profile.fixed_bytes(true, 0) / MIB) + 100;
        let mut b = TraceBuilder::new(TraceHeader::new("t", 1));
        b.alloc_with_id(
            0,
            1,
            60 * MIB,
            Category::Activation,
            Phase::Forward,
            "conv2d",
            None,
            0,
        )
        .unwrap();
        // 1.0 × (input + output + weight): ~98 MiB at batch 64 (no room beside 60), ~12.4 at 8.
        b.workspace(C, 64, ConvPass::Forward, Phase::Forward, None);
        b.workspace(C, 8, ConvPass::Forward, Phase::Forward, None);
        b.iteration_end();
        let t = b.finish();
        assert!(t.runs_convolutions());
        let e = Replay::default().estimate(&t, &profile).unwrap();
        assert!(e.fits);
        assert_eq!(e.workspace_source, Some(WorkspaceSource::Policy));
        assert_eq!(
            e.peak_bytes,
            profile.fixed_bytes(true, 0) + 60 * MIB + 14 * MIB,
            "the 8-batch workspace's 14 MiB segment"
        );
    }

    /// One rank of a distributed job pays NCCL's buffers where the profile knows them.
    #[test]
    fn a_distributed_rank_pays_nccls_buffers() {
        let mut profile = builtin("h100-80gb-sxm").unwrap();
        let job = |strategy: Option<&str>| {
            let mut b = TraceBuilder::new(TraceHeader {
                options: crate::job::OptionValues {
                    strategy: strategy.map(|_| crate::job::Strategy::ddp(8, 25, false).unwrap()),
                    ..Default::default()
                }
                .check()
                .unwrap(),
                ..TraceHeader::new("t", 1)
            });
            b.alloc(10 * MIB, Category::Activation, Phase::Forward, "mm");
            b.iteration_end();
            b.finish()
        };
        let peak = |t: &Trace, p: &GpuProfile| Replay::default().estimate(t, p).unwrap().peak_bytes;
        assert_eq!(
            peak(&job(Some("ddp")), &profile),
            peak(&job(None), &profile),
            "not measured: not included"
        );
        profile.nccl_mib = 400.0;
        assert_eq!(
            peak(&job(Some("fsdp")), &profile),
            peak(&job(None), &profile) + 400 * MIB
        );
        // And each communicator its buffers: a trace that names its process groups (FSDP's
        // and a tensor-parallel group) pays two; one that names none (older), one.
        profile.nccl_communicator_mib = 100.0;
        let mut two = job(Some("fsdp"));
        two.header.communicators = ["17", "27"]
            .map(|name| crate::trace::Communicator {
                name: name.into(),
                ranks: 4,
            })
            .to_vec();
        assert_eq!(peak(&two, &profile), peak(&job(None), &profile) + 600 * MIB);
        assert_eq!(
            peak(&job(Some("ddp")), &profile),
            peak(&job(None), &profile) + 500 * MIB
        );
    }

    /// A job too large for the GPU is sized as the smallest GPU that holds it would run it:
    /// concatenating ever longer copies caches every shorter one, which a GPU without limit
    /// would keep but a real one frees when `cudaMalloc` fails.
    #[test]
    fn a_job_that_does_not_fit_is_sized_where_its_cache_would_be_freed() {
        let mut profile = builtin("l4").unwrap();
        profile.capacity_mib = (profile.fixed_bytes(false, 0) / MIB) + 100;
        let mut b = TraceBuilder::new(TraceHeader::new("t", 1));
        let mut kept = b.alloc(20 * MIB, Category::Activation, Phase::Forward, "cat");
        for n in 2..=10 {
            let longer = b.alloc(n * 20 * MIB, Category::Activation, Phase::Forward, "cat");
            b.free(kept);
            kept = longer;
        }
        b.iteration_end();
        let t = b.finish();
        let e = Replay::default().estimate(&t, &profile).unwrap();
        assert!(!e.fits, "200 + 180 MiB at once exceed 100");
        let fixed = profile.fixed_bytes(false, 0);
        let needs = e.peak_bytes - fixed;
        assert!(
            (380 * MIB..=400 * MIB).contains(&needs),
            "the two largest at once, not all ten cached (1100 MiB): {needs}"
        );
    }
}
