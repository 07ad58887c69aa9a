//! The hybrid memory estimator behind the one [`Estimator`] trait: replay's estimate and
//! breakdown, with the peak a learned correction gives and its conformal upper bound. The
//! learned model's features come from a native model's layers, so it answers native specs only.

use std::path::Path;

use gpumem_core::estimate::{Estimate, EstimateError, Estimator, Replay, by_name};
use gpumem_core::families::ModelSpec;
use gpumem_core::profile::GpuProfile;
use gpumem_core::trace::Trace;
use gpumem_core::units::mib_to_bytes;

use crate::features::trace_summary;
use crate::model::{Head, LearnError, LearnedModel};
use crate::{Sample, Target};

/// The estimators by name, as every command spells them: the computed ones, and `learned` (the
/// hybrid), which needs its memory model's file.
pub fn estimator(
    name: &str,
    learned_model: Option<&Path>,
) -> Result<Box<dyn Estimator>, LearnError> {
    match (name, learned_model) {
        ("learned", Some(path)) => Ok(Box::new(Hybrid::read(path)?)),
        ("learned", None) => Err(LearnError::NotHybrid { file: None }),
        (other, _) => Ok(by_name(other)?),
    }
}

/// Replay corrected by a learned memory model with a conformal bound.
#[derive(Debug)]
pub struct Hybrid {
    model: LearnedModel,
}

impl Hybrid {
    /// `None` for a model that is not a memory correction with a bound (GPUMemNet's bins, a
    /// utilization model).
    pub fn new(model: LearnedModel) -> Option<Hybrid> {
        Hybrid::accepts(&model).then_some(Hybrid { model })
    }

    /// Whether `model` is a memory correction with a conformal bound.
    pub fn accepts(model: &LearnedModel) -> bool {
        matches!(
            (&model.target, &model.head),
            (Target::Memory, Head::Correction { bound: Some(_), .. })
        )
    }

    pub fn read(path: &Path) -> Result<Hybrid, LearnError> {
        Hybrid::new(LearnedModel::read(path)?).ok_or_else(|| LearnError::NotHybrid {
            file: Some(path.display().to_string()),
        })
    }
}

impl Estimator for Hybrid {
    fn name(&self) -> &'static str {
        "learned"
    }

    fn estimate(&self, trace: &Trace, profile: &GpuProfile) -> Result<Estimate, EstimateError> {
        let learned = |e: LearnError| EstimateError::Learned(e.to_string());
        let spec =
            ModelSpec::parse(&trace.header.model).map_err(|_| learned(LearnError::NotNative))?;
        let mut est = Replay::default().estimate(trace, profile)?;
        let sample = Sample::new(
            0,
            trace.header.model.clone(),
            String::new(),
            spec.facts(trace.header.batch_size),
            trace_summary(trace, profile)?,
        );
        let predictions = self.model.predict(&[&sample]).map_err(learned)?;
        let p = &predictions[0];
        est.estimator = self.name();
        est.peak_bytes = mib_to_bytes(p.value);
        est.upper_bound_bytes = mib_to_bytes(p.upper.unwrap_or(p.value)).max(est.peak_bytes);
        est.fits = est.fits && est.peak_bytes <= est.capacity_bytes;
        Ok(est)
    }
}
