//! Calibration: fit a profile's fixed cost (the CUDA context and whatever else the process holds
//! outside the allocator) from measured runs, robustly, never per row.
//!
//! For each run, the replay gives the allocator's peak reserved bytes; measured − reserved is
//! that run's view of the fixed cost. The fit is their median (robust to a few odd runs);
//! [`Calibration::residuals`] are what is left per run after the fit.

use serde::Serialize;

use crate::estimate::EstimateError;
use crate::profile::GpuProfile;
use crate::trace::Trace;
use crate::units::{MIB, bytes_to_mib};

/// The result of a fit.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Calibration {
    pub context_mib: f64,
    /// measured − (fitted context + replay peak), per run, in MiB.
    pub residuals_mib: Vec<f64>,
    pub rows: usize,
    /// The profile with the fitted context (and a bound margin no smaller than the fit's spread).
    #[serde(skip)]
    pub profile: GpuProfile,
}

/// Fits `cuda_context_mib` of `profile` from (trace, measured bytes) pairs.
pub fn fit_context(
    profile: &GpuProfile,
    runs: &[(Trace, u64)],
) -> Result<Calibration, EstimateError> {
    let mut zero = profile.clone();
    zero.cuda_context_mib = 0.0;
    let replay = crate::estimate::Replay::default();
    let mut reserved = Vec::with_capacity(runs.len());
    for (trace, _) in runs {
        use crate::estimate::Estimator;
        reserved.push(replay.estimate(trace, &zero)?.peak_bytes);
    }
    let mut views: Vec<f64> = runs
        .iter()
        .zip(&reserved)
        .map(|((_, m), r)| *m as f64 - *r as f64)
        .collect();
    views.sort_by(f64::total_cmp);
    let n = views.len();
    let median = if n == 0 {
        profile.context_bytes() as f64
    } else if n % 2 == 1 {
        views[n / 2]
    } else {
        (views[n / 2 - 1] + views[n / 2]) / 2.0
    };
    let context = median.max(0.0);
    let residuals_mib: Vec<f64> = runs
        .iter()
        .zip(&reserved)
        .map(|((_, m), r)| bytes_to_mib(*m) - (context + *r as f64) / MIB as f64)
        .collect();
    let mut p = profile.clone();
    p.cuda_context_mib = (context / MIB as f64 * 1000.0).round() / 1000.0;
    let spread = residuals_mib.iter().fold(0.0f64, |a, r| a.max(r.abs()));
    p.bound_fixed_mib = p.bound_fixed_mib.max(2.0 * spread);
    p.calibration = Some(format!(
        "fitted on {n} runs: context = median(measured - replay reserved); max |residual| {spread:.1} MiB"
    ));
    Ok(Calibration {
        context_mib: p.cuda_context_mib,
        residuals_mib,
        rows: n,
        profile: p,
    })
}
