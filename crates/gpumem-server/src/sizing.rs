//! Sizing a job: its workload traced and estimated on the daemon's profile by the configured
//! estimator, which is made once when the daemon opens (a learned model is read once).

use gpumem_core::estimate::Estimator;
use gpumem_core::profile::GpuProfile;
use gpumem_core::trace::Trace;
use gpumem_workload::Workload;

/// Why a job's workload could not be sized.
#[derive(Debug, thiserror::Error)]
pub enum JobSizeError {
    /// The workload cannot be traced or sized.
    #[error(transparent)]
    Job(#[from] gpumem_workload::SizeError),
    #[error(transparent)]
    Estimate(#[from] gpumem_core::estimate::EstimateError),
}

/// A job's workload sized: gpumem's estimate and upper bound with the configured estimator,
/// the trace they came from, and its convolutions the profile has not probed.
pub struct JobSize {
    pub peak: u64,
    pub bound: u64,
    pub trace: Trace,
    pub unprobed: Vec<(String, u64)>,
}

/// The configured estimator.
pub struct Sizer {
    estimator: Box<dyn Estimator>,
}

impl Sizer {
    pub fn new(estimator: Box<dyn Estimator>) -> Sizer {
        Sizer { estimator }
    }

    /// Sizes `workload` on `profile` (an ambiguous spec by its largest reading).
    pub fn workload(
        &self,
        profile: &GpuProfile,
        workload: &Workload,
    ) -> Result<JobSize, JobSizeError> {
        let sizing = workload.size(profile, self.estimator.as_ref(), Workload::trace)?;
        let unprobed = profile.workspaces().unprobed(&sizing.trace);
        Ok(JobSize {
            peak: sizing.estimate.peak_bytes,
            bound: sizing.estimate.upper_bound_bytes,
            trace: sizing.trace,
            unprobed,
        })
    }

    /// (peak, bound) bytes of a trace already made (sized again after a probe).
    pub fn trace(&self, profile: &GpuProfile, trace: &Trace) -> Result<(u64, u64), JobSizeError> {
        let est = self.estimator.estimate(trace, profile)?;
        Ok((est.peak_bytes, est.upper_bound_bytes))
    }
}
