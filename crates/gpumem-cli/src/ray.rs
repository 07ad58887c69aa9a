//! `gpumem ray-resources`: what a Ray task or actor that trains this job should ask for, per GPU
//! type — the `num_gpus` fraction Ray packs by, and a custom `gpu_memory_mib` resource that
//! accounts for the memory itself.

use clap::Args;
use gpumem_core::profile::{self, GpuProfile};
use gpumem_core::units::{bytes_to_mib, whole_mib};
use gpumem_workload::Workload;
use serde::Serialize;

use crate::args::{EstimatorArgs, ModelArg, WorkloadArgs, mib};
use crate::{CliError, CliResult};

#[derive(Args)]
pub struct RayArgs {
    /// A native model spec, a PyTorch reference (torchvision:, timm:, hf:, smp:, py:), or a Hub id
    /// (ORG/NAME), model directory or config.json.
    model: String,
    #[arg(long, default_value_t = 32)]
    batch: i64,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// GPU types, built-in profile names, comma-separated (default: every built-in one; each
    /// traces the model once).
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<String>,
    #[command(flatten)]
    estimator: EstimatorArgs,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// What to ask Ray for on one GPU type.
#[derive(Serialize)]
struct RayGpu {
    gpu: String,
    capacity_mib: u64,
    peak_mib: f64,
    upper_bound_mib: f64,
    /// The upper bound fits on one GPU of this type.
    fits: bool,
    /// The share of one GPU the upper bound takes, rounded up to a hundredth (absent where it
    /// does not fit).
    #[serde(skip_serializing_if = "Option::is_none")]
    num_gpus: Option<f64>,
    /// The upper bound in whole MiB, for a custom resource each node declares as its GPUs' MiB.
    gpu_memory_mib: u64,
}

#[derive(Serialize)]
struct RayJson {
    model: String,
    batch_size: u64,
    gpus: Vec<RayGpu>,
}

/// The share of a GPU of `capacity_mib` that `bound_mib` takes, rounded up to a hundredth;
/// `None` above one GPU.
fn gpu_fraction(bound_mib: f64, capacity_mib: u64) -> Option<f64> {
    let hundredths = (bound_mib / capacity_mib as f64 * 100.0).ceil().max(1.0);
    (hundredths <= 100.0).then_some(hundredths / 100.0)
}

pub fn ray_resources(a: RayArgs) -> CliResult {
    let model = ModelArg::load(&a.model)?
        .model(&a.model, "ray-resources needs a model, not a trace file")?;
    let profiles: Vec<GpuProfile> = if a.gpus.is_empty() {
        profile::catalogue()
    } else {
        a.gpus
            .iter()
            .map(|g| profile::builtin(g).map_err(CliError::input))
            .collect::<CliResult<_>>()?
    };
    let estimator = a.estimator.estimator(&a.estimator.models()?)?;
    let workload = a.workload.workload(model, a.batch)?;
    let mut rows = Vec::new();
    for p in &profiles {
        let est = workload
            .size(p, estimator.as_ref(), Workload::trace)?
            .estimate;
        let (peak, bound) = (est.peak_bytes, est.upper_bound_bytes);
        // The requests come from the exact bytes: the bound as displayed (to a tenth of a MiB)
        // may round below them.
        rows.push(RayGpu {
            gpu: p.name.clone(),
            capacity_mib: p.capacity_mib,
            peak_mib: mib(peak),
            upper_bound_mib: mib(bound),
            fits: bound <= p.capacity_bytes(),
            num_gpus: gpu_fraction(bytes_to_mib(bound), p.capacity_mib)
                .filter(|_| bound <= p.capacity_bytes()),
            gpu_memory_mib: whole_mib(bound),
        });
    }
    let out = RayJson {
        model: workload.model().to_string(),
        batch_size: workload.batch(),
        gpus: rows,
    };
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(CliError::other)?
        );
        return Ok(());
    }
    println!("{} at batch {}", out.model, out.batch_size);
    println!(
        "{:<16} {:>12} {:>12} {:>12} {:>9} {:>15}",
        "gpu", "capacity MiB", "estimate MiB", "bound MiB", "num_gpus", "gpu_memory_mib"
    );
    for g in &out.gpus {
        let share = g
            .num_gpus
            .map_or("does not fit".to_string(), |f| format!("{f:.2}"));
        println!(
            "{:<16} {:>12} {:>12.1} {:>12.1} {:>9} {:>15}",
            g.gpu, g.capacity_mib, g.peak_mib, g.upper_bound_mib, share, g.gpu_memory_mib
        );
    }
    if let Some(g) = out.gpus.iter().find(|g| g.num_gpus.is_some()) {
        println!();
        println!(
            "on {}: @ray.remote(num_gpus={:.2}, resources={{\"gpu_memory_mib\": {}}})",
            g.gpu,
            g.num_gpus.unwrap_or(1.0),
            g.gpu_memory_mib
        );
        println!(
            "(each node declares its GPUs' memory: ray start --resources='{{\"gpu_memory_mib\": {}}}' for one such GPU)",
            g.capacity_mib
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_share_is_rounded_up_to_a_hundredth() {
        assert_eq!(gpu_fraction(10240.0, 40960), Some(0.25));
        assert_eq!(gpu_fraction(10240.5, 40960), Some(0.26));
        assert_eq!(gpu_fraction(1.0, 40960), Some(0.01), "never zero");
        assert_eq!(gpu_fraction(40960.0, 40960), Some(1.0));
        assert_eq!(gpu_fraction(40961.0, 40960), None);
    }
}
