//! The largest batch size that fits: exponential search for a failing size, then bisection.
//! A batch fits when the job does not run out of memory and its upper bound is within capacity.

use crate::estimate::{Estimate, EstimateError, Estimator};
use crate::families::{JobError, JobOptions, MAX_BATCH, ModelSpec};
use crate::profile::GpuProfile;
use crate::symbolic::SymbolicError;
use crate::trace::Trace;

/// Why the search stopped: the model could not be traced at a batch size, or not estimated.
#[derive(Debug, thiserror::Error)]
pub enum SearchError {
    #[error(transparent)]
    Job(#[from] JobError),
    #[error(transparent)]
    Symbolic(#[from] SymbolicError),
    #[error(transparent)]
    Estimate(#[from] EstimateError),
}

/// The largest batch in 1..=MAX_BATCH whose estimate fits with its upper bound, and that
/// estimate; `None` if even batch 1 does not.
pub fn max_batch(
    model: &ModelSpec,
    job: &JobOptions,
    profile: &GpuProfile,
    estimator: &dyn Estimator,
) -> Result<Option<(u64, Estimate)>, SearchError> {
    max_batch_with(
        &mut |b| Ok::<_, SearchError>(model.trace(&JobOptions { batch: b, ..*job })?),
        profile,
        estimator,
    )
}

/// The same search over any source of traces by batch size (a symbolic trace, or a tracer run
/// per batch size), failing with that source's error.
pub fn max_batch_with<E: From<EstimateError>>(
    trace_at: &mut dyn FnMut(u64) -> Result<Trace, E>,
    profile: &GpuProfile,
    estimator: &dyn Estimator,
) -> Result<Option<(u64, Estimate)>, E> {
    let mut fits = |b: u64| -> Result<Option<Estimate>, E> {
        let trace = trace_at(b)?;
        let e = estimator.estimate(&trace, profile)?;
        Ok((e.fits && e.upper_bound_bytes <= e.capacity_bytes).then_some(e))
    };
    let (mut lo, mut best) = (0u64, None);
    let mut hi = 1u64;
    while hi <= MAX_BATCH {
        match fits(hi)? {
            Some(e) => {
                lo = hi;
                best = Some(e);
                hi *= 2;
            }
            None => break,
        }
    }
    let mut hi = hi.min(MAX_BATCH + 1);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match fits(mid)? {
            Some(e) => {
                lo = mid;
                best = Some(e);
            }
            None => hi = mid,
        }
    }
    Ok(best.map(|e| (lo, e)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate::Replay;
    use crate::profile::builtin;

    #[test]
    fn the_found_batch_fits_and_the_next_does_not() {
        let model =
            ModelSpec::parse("cnn:classes=100,filters=64,depth=6,input=64,arch=uniform").unwrap();
        let p = builtin("t4").unwrap();
        let job = JobOptions::new(1);
        let (b, e) = max_batch(&model, &job, &p, &Replay::default())
            .unwrap()
            .unwrap();
        assert!(e.upper_bound_bytes <= e.capacity_bytes);
        let next = Replay::default()
            .estimate(
                &model
                    .trace(&JobOptions {
                        batch: b + 1,
                        ..job
                    })
                    .unwrap(),
                &p,
            )
            .unwrap();
        assert!(
            !next.fits || next.upper_bound_bytes > next.capacity_bytes,
            "batch {} also fits",
            b + 1
        );
    }
}
