//! The fastest setup of a job that fits one GPU: precision × activation checkpointing ×
//! micro-batch (× gradient accumulation to a global batch), each sized by its upper bound and
//! timed by the physical model. One batch-symbolic trace per (precision, checkpointing) answers
//! every micro-batch, so a PyTorch model is traced a handful of times, not once per point.

use gpumem_core::estimate::{Estimate, Estimator};
use gpumem_core::graph::Precision;
use gpumem_core::profile::GpuProfile;
use gpumem_core::utilization::{HostModel, physical};

use crate::{SizeError, Workload, WorkloadError};

/// Setups whose time per sample is this close to the fastest's count as as fast.
pub const TIE: f64 = 0.01;

/// What to search.
#[derive(Debug, Clone)]
pub struct Space {
    pub precisions: Vec<Precision>,
    pub checkpointing: Vec<bool>,
    /// Samples per optimizer step over every rank of the job's strategy (a whole multiple of its
    /// world size): micro-batches then divide each rank's share (the rest is gradient
    /// accumulation). `None`: micro-batches are powers of two up to the largest that fits, each
    /// its own step.
    pub global_batch: Option<u64>,
}

/// One setup, sized and timed.
#[derive(Debug, Clone)]
pub struct Setup {
    pub precision: Precision,
    pub checkpointing: bool,
    pub micro_batch: u64,
    pub grad_accum: u64,
    pub estimate: Estimate,
    /// Seconds per micro-batch step (forward, backward, optimizer) by the physical model.
    pub step_s: f64,
}

impl Setup {
    /// Seconds per sample: what ranks setups (for a fixed global batch, the time of its step
    /// over the batch; the optimizer's step is counted once per micro-batch, a small
    /// overestimate for many accumulation steps).
    pub fn seconds_per_sample(&self) -> f64 {
        self.step_s / self.micro_batch as f64
    }
}

/// A (precision, checkpointing) pair that could not be planned, and why.
#[derive(Debug, Clone)]
pub struct Skipped {
    pub precision: Precision,
    pub checkpointing: bool,
    pub reason: String,
}

/// The search's answer: every setup that fits, fastest first (among those within [`TIE`] of the
/// fastest, the one with the smallest upper bound first); the largest micro-batch that does
/// not fit per pair (where the search reached one); the pairs that could not be traced.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    pub fits: Vec<Setup>,
    pub too_big: Vec<Setup>,
    pub skipped: Vec<Skipped>,
}

/// The micro-batches to try: divisors of the global batch, or powers of two and `max` itself —
/// those up to `max` (the largest that fits), and the next one above it, to show it does not.
fn micro_batches(global: Option<u64>, max: u64) -> Vec<u64> {
    let candidates: Vec<u64> = match global {
        Some(g) => (1..=g).filter(|m| g % m == 0).collect(),
        None => {
            let mut v: Vec<u64> = std::iter::successors(Some(1u64), |b| b.checked_mul(2)).take_while(|b| *b <= max.saturating_mul(2)).collect();
            v.push(max);
            v.sort_unstable();
            v.dedup();
            v
        }
    };
    let above = candidates.iter().copied().find(|m| *m > max);
    candidates.into_iter().filter(|m| *m <= max).chain(above).collect()
}

/// Plans `base` (its model and fixed options; its precision, checkpointing and batch are
/// searched) on `profile`.
pub fn plan(base: &Workload, profile: &GpuProfile, estimator: &dyn Estimator, space: &Space) -> Result<Plan, SizeError> {
    let host = HostModel::default();
    let world = u64::from(base.options().strategy.map_or(1, |s| s.world_size()));
    let rank_batch = space.global_batch.map(|g| g / world);
    let mut out = Plan::default();
    for &precision in &space.precisions {
        for &checkpointing in &space.checkpointing {
            let skip = |reason: String| Skipped { precision, checkpointing, reason };
            let options = crate::Options { precision, checkpointing, grad_accum: 1, ..base.options().clone() };
            let workload = match Workload::new(base.model().clone(), 1, options) {
                Ok(w) => w,
                Err(e) => {
                    out.skipped.push(skip(e.to_string()));
                    continue;
                }
            };
            let sym = match workload.symbolic(profile) {
                Ok(s) => s,
                // A model that cannot take this pair (no blocks to checkpoint, a precision the
                // families refuse) is skipped; the tracer missing altogether is an error.
                Err(WorkloadError::Invalid(m)) => {
                    out.skipped.push(skip(m));
                    continue;
                }
                Err(e @ WorkloadError::Tracer(gpumem_torch::BridgeError::BadReference(_) | gpumem_torch::BridgeError::Model(_))) => {
                    out.skipped.push(skip(e.to_string()));
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            let Some((max, _)) = sym.max_batch(profile, estimator).map_err(|e| WorkloadError::Invalid(e.to_string()))? else {
                let estimate = estimator.estimate(&sym.at(1).map_err(|e| WorkloadError::Invalid(e.to_string()))?, profile)?;
                out.too_big.push(Setup { precision, checkpointing, micro_batch: 1, grad_accum: rank_batch.unwrap_or(1), estimate, step_s: 0.0 });
                continue;
            };
            for m in micro_batches(rank_batch, max) {
                let trace = sym.at(m).map_err(|e| WorkloadError::Invalid(e.to_string()))?;
                let estimate = estimator.estimate(&trace, profile)?;
                let setup = Setup { precision, checkpointing, micro_batch: m, grad_accum: rank_batch.map_or(1, |g| g / m), step_s: physical(&trace, profile, &host).step_s, estimate };
                if m > max {
                    out.too_big.push(setup);
                } else {
                    out.fits.push(setup);
                }
            }
        }
    }
    out.fits.sort_by(|a, b| a.seconds_per_sample().total_cmp(&b.seconds_per_sample()));
    // Within 1% of the fastest, the physical model cannot tell setups apart: the one that needs
    // least memory leads (it leaves the GPU room, or other jobs a share of it).
    if let Some(fastest) = out.fits.first().map(Setup::seconds_per_sample) {
        let near = out.fits.iter().take_while(|s| s.seconds_per_sample() <= fastest * (1.0 + TIE)).count();
        if let Some(i) = (0..near).min_by_key(|&i| out.fits[i].estimate.upper_bound_bytes) {
            let lead = out.fits.remove(i);
            out.fits.insert(0, lead);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem_core::estimate::Replay;
    use gpumem_core::profile::builtin;

    #[test]
    fn micro_batches_divide_the_global_batch_or_double() {
        assert_eq!(micro_batches(Some(12), 100), vec![1, 2, 3, 4, 6, 12]);
        assert_eq!(micro_batches(Some(12), 4), vec![1, 2, 3, 4, 6], "the next one above the largest that fits, to show it does not");
        assert_eq!(micro_batches(None, 100), vec![1, 2, 4, 8, 16, 32, 64, 100, 128]);
        assert_eq!(micro_batches(None, 64), vec![1, 2, 4, 8, 16, 32, 64, 128]);
    }

    #[test]
    fn the_fastest_setup_that_fits_comes_first() {
        let t4 = builtin("t4").unwrap();
        let base = Workload::parse("mlp:input=4096,output=10,depth=6,arch=uniform", 1, crate::Options::default()).unwrap();
        let space = Space { precisions: vec![Precision::Fp32, Precision::AmpFp16], checkpointing: vec![false], global_batch: Some(4096) };
        let p = plan(&base, &t4, &Replay::default(), &space).unwrap();
        assert!(!p.fits.is_empty());
        assert!(p.fits.windows(2).all(|w| w[0].seconds_per_sample() <= w[1].seconds_per_sample()));
        assert!(p.fits.iter().all(|s| s.estimate.upper_bound_bytes <= t4.capacity_bytes() && s.micro_batch * s.grad_accum == 4096));
        assert!(p.too_big.iter().all(|s| s.estimate.upper_bound_bytes > t4.capacity_bytes()));
        // The same micro-batch trains faster in mixed precision on a T4's tensor cores.
        let best = &p.fits[0];
        assert_eq!(best.precision, Precision::AmpFp16, "{best:?}");
        // Checkpointing is for PyTorch models: skipped with the reason, not an error.
        let space = Space { checkpointing: vec![true], ..space };
        let p = plan(&base, &t4, &Replay::default(), &space).unwrap();
        assert!(p.fits.is_empty() && p.skipped.len() == 2 && p.skipped[0].reason.contains("apply to PyTorch models"));
    }
}
