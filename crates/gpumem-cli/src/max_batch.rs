//! `gpumem max-batch`: the largest batch whose upper bound fits.

use clap::Args;
use gpumem_core::units::bytes_to_mib;

use crate::args::{EstimatorArgs, GpuChoice, ModelArg, WorkloadArgs, mib};
use crate::{CliError, CliResult};

#[derive(Args)]
pub struct MaxBatchArgs {
    /// A native model spec, a PyTorch reference (torchvision:, timm:, hf:, smp:, py:), or a Hub id
    /// (ORG/NAME), model directory or config.json; default: the model --train-config names.
    model: Option<String>,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    gpu: GpuChoice,
    #[command(flatten)]
    estimator: EstimatorArgs,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn max_batch(a: MaxBatchArgs) -> CliResult {
    let profile = a.gpu.load()?;
    let (arg, _) = a.workload.model_or_config(a.model.as_deref())?;
    let arg = arg.ok_or_else(|| {
        CliError::input("max-batch needs a MODEL (or a --train-config that names one)")
    })?;
    let model = ModelArg::load(&arg)?.model(
        &arg,
        "max-batch needs a model, not a trace file (a trace fixes its batch size)",
    )?;
    let est = a.estimator.estimator(&a.estimator.models()?)?;
    let name = model.to_string();
    // One source answers every batch size: a batch-symbolic trace (no re-tracing during the
    // search; a pipeline's stages one each), or for a whole run a tracer run per batch size.
    let best = a
        .workload
        .workload(model, 1)?
        .max_batch(&profile, est.as_ref())?;
    match best {
        None => {
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({"model": name, "gpu": profile.name, "max_batch": 0})
                );
            } else {
                println!(
                    "even batch 1 does not fit on {} with its upper bound",
                    profile.name
                );
            }
        }
        Some((lo, e)) => {
            if a.json {
                println!(
                    "{}",
                    serde_json::json!({"model": name, "gpu": profile.name, "max_batch": lo,
                        "peak_mib": mib(e.peak_bytes), "upper_bound_mib": mib(e.upper_bound_bytes), "capacity_mib": profile.capacity_mib})
                );
            } else {
                println!("max batch  {lo}");
                println!(
                    "at it      peak {:.1} MiB, upper bound {:.1} MiB of {} MiB",
                    bytes_to_mib(e.peak_bytes),
                    bytes_to_mib(e.upper_bound_bytes),
                    profile.capacity_mib
                );
            }
        }
    }
    Ok(())
}
