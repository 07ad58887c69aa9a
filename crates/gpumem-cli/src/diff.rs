//! `gpumem diff`: gpumem's allocation sequence for a job held against PyTorch's own memory
//! snapshot of the same step on a GPU (`python -m gpumem_trace.record`): the first divergence,
//! what each side has that the other has not, and the two peaks side by side.

use std::path::PathBuf;

use clap::Args;
use gpumem_core::diff::{Diff, diff};
use gpumem_core::snapshot::Snapshot;
use gpumem_core::units::bytes_to_mib;

use crate::args::{GpuChoice, ModelArg, WorkloadArgs};
use crate::{CliError, CliResult};

#[derive(Args)]
pub struct DiffArgs {
    /// The job as `estimate` takes it: a PyTorch reference or native spec, or a trace file.
    model: String,
    #[arg(long, default_value_t = 32)]
    batch: i64,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    gpu: GpuChoice,
    /// PyTorch's snapshot of the same job (`python -m gpumem_trace.record ... --out FILE`).
    #[arg(long)]
    snapshot: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

pub fn run(a: DiffArgs) -> CliResult {
    let profile = a.gpu.load()?;
    let bytes = std::fs::read(&a.snapshot)
        .map_err(|e| CliError::input(format!("{}: {e}", a.snapshot.display())))?;
    let snap = Snapshot::read(&bytes)
        .map_err(|e| CliError::input(format!("{}: {e}", a.snapshot.display())))?;
    let trace = match ModelArg::load(&a.model)? {
        ModelArg::TraceFile(t) => t,
        ModelArg::Model(m) => a
            .workload
            .workload(m, a.batch)?
            .trace_for_reestimates(&profile)?,
    };
    let d = diff(&trace, &profile, &snap).map_err(CliError::input)?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&d).map_err(CliError::other)?
        );
    } else {
        print(&d, trace.header.iterations);
    }
    Ok(())
}

fn print(d: &Diff, iterations: u32) {
    let mib = |b: u64| bytes_to_mib(b);
    println!(
        "requests     gpumem {}, PyTorch {}; {} matched in order",
        d.gpumem_requests, d.torch_requests, d.matched
    );
    println!(
        "peaks        allocated: PyTorch {:.1} MiB, gpumem {:.1} MiB",
        mib(d.peaks.torch_allocated),
        mib(d.peaks.gpumem_allocated)
    );
    println!(
        "             reserved:  PyTorch {:.1} MiB, gpumem {:.1} MiB",
        mib(d.peaks.torch_reserved),
        mib(d.peaks.gpumem_reserved)
    );
    match &d.first_divergence {
        None => println!("divergence   none: every request matches"),
        Some(v) => {
            let when = if v.before_peak {
                "before PyTorch's allocated peak"
            } else {
                "after PyTorch's allocated peak"
            };
            println!(
                "divergence   after {} matching requests (PyTorch's request {}, {when}):",
                v.after_matching,
                v.torch_index + 1
            );
            for r in &v.gpumem {
                let at =
                    r.at.as_ref()
                        .map(|a| a.describe(iterations))
                        .unwrap_or_default();
                println!(
                    "  gpumem     {:>12} B  {}  {at}",
                    r.bytes,
                    r.category.name()
                );
            }
            println!(
                "  PyTorch    {}",
                v.torch
                    .iter()
                    .map(|b| format!("{b} B"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    if !d.gpumem_only.is_empty() {
        println!("only gpumem's:");
        for (c, bytes, n) in &d.gpumem_only {
            println!(
                "  {:<16} {:>10.1} MiB in {n} requests",
                c.name(),
                mib(*bytes)
            );
        }
    }
    if d.torch_only_count > 0 {
        println!(
            "only PyTorch's: {:.1} MiB in {} requests",
            mib(d.torch_only_bytes),
            d.torch_only_count
        );
    }
}
