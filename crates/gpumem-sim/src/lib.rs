//! gpumem-sim: a trace-driven, discrete-event simulator of training jobs on shared GPUs.
//!
//! [`simulate`] replays [`SimJob`]s (arrival, GPUs, exclusive run time, true memory, the
//! estimate under test, utilization, priority) on a cluster of [`GpuSpec`]s under a placement
//! policy, queued by gpumem-place's scheduler (the daemon's: recovery first, priority, then
//! arrival order; optional EASY backfill), with CARMA's warm-up rule, out-of-memory crashes and
//! exclusive recovery ([`SimConfig`]), and a replaceable [`Interference`] model; the
//! [`Report`] holds makespan, waits, completion times, crashes, wasted GPU time, busy fraction,
//! SMACT and energy, plus every [`Run`] for timelines. [`carma`] loads the seed authors' CARMA
//! workload; [`jobs`] reads a job file (jobs described as the daemon takes them, multi-GPU
//! strategies included); [`synth`] makes large synthetic ones.

pub mod carma;
pub mod interference;
pub mod jobs;
mod sim;
pub mod synth;

pub use interference::{Interference, NoInterference, ProportionalSharing};
pub use sim::{GpuSpec, Outcome, Report, Run, SimConfig, SimError, SimJob, simulate};

#[cfg(test)]
mod tests;
