//! `gpumem trace`: write a job's training-step trace.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;

use clap::Args;

use crate::args::{GpuChoice, ModelArg, WorkloadArgs};
use crate::{CliError, CliResult};

#[derive(Args)]
pub struct TraceArgs {
    /// A native model spec, a PyTorch reference, or a Hub id (ORG/NAME), model directory or
    /// config.json.
    model: String,
    #[arg(long, allow_negative_numbers = true, default_value_t = 32)]
    batch: i64,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    gpu: GpuChoice,
    /// Output file (JSON Lines, docs/trace-format.md).
    #[arg(long)]
    out: PathBuf,
}

pub fn trace(a: TraceArgs) -> CliResult {
    let profile = a.gpu.load()?;
    let model = ModelArg::load(&a.model)?.model(&a.model, "already a trace file")?;
    let t = a
        .workload
        .workload(model, a.batch)?
        .trace_for_reestimates(&profile)?;
    let f =
        File::create(&a.out).map_err(|e| CliError::other(format!("{}: {e}", a.out.display())))?;
    let mut w = BufWriter::new(f);
    t.write(&mut w)
        .and_then(|_| w.flush())
        .map_err(|e| CliError::other(format!("{}: {e}", a.out.display())))?;
    println!(
        "wrote {} ({} events, {} iterations)",
        a.out.display(),
        t.events().len(),
        t.header.iterations
    );
    Ok(())
}
