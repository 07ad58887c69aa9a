//! `gpumem run -- python train.py ARGS…`: the user's script, unmodified, run with CUDA stood in
//! for by the tracer (gpumem-torch's `run_script`), its recorded steps sized as `estimate` sizes
//! a trace file.

use std::path::PathBuf;

use clap::{Args, Parser};

use crate::args::GpuChoice;
use crate::estimate::{EstimateArgs, estimate};
use crate::{CliError, CliResult};

#[derive(Args)]
pub struct RunArgs {
    /// Optimizer steps to record before the script is stopped (backward passes where the
    /// script makes no optimizer and updates its weights by hand).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    steps: u32,
    #[command(flatten)]
    gpu: GpuChoice,
    /// Also write the recorded trace here (`gpumem estimate FILE --gpu …` sizes it again).
    #[arg(long)]
    trace_out: Option<PathBuf>,
    /// Print one JSON object, as `estimate --json` does.
    #[arg(long)]
    json: bool,
    /// The script as you run it: python SCRIPT ARGS… or python -m MODULE ARGS….
    #[arg(last = true, required = true, value_name = "COMMAND")]
    command: Vec<String>,
}

/// `estimate`'s own arguments, parsed from the flags it is handed.
#[derive(Parser)]
struct AsEstimate {
    #[command(flatten)]
    estimate: EstimateArgs,
}

pub fn run(a: RunArgs) -> CliResult {
    let profile = a.gpu.load()?;
    let tracer = gpumem_torch::TorchTracer::from_env();
    let trace = tracer.run_script(&a.command, a.steps, &profile)?;
    let path = match &a.trace_out {
        Some(p) => p.clone(),
        None => {
            let dir = tracer.cache_dir.join("runs");
            std::fs::create_dir_all(&dir)
                .map_err(|e| CliError::other(format!("{}: {e}", dir.display())))?;
            dir.join(format!("run-{}.jsonl", std::process::id()))
        }
    };
    let file = std::fs::File::create(&path)
        .map_err(|e| CliError::input(format!("{}: {e}", path.display())))?;
    trace
        .write(std::io::BufWriter::new(file))
        .map_err(|e| CliError::other(format!("{}: {e}", path.display())))?;
    let mut flags = vec!["estimate".into(), path.display().to_string()];
    flags.extend(a.gpu.flags());
    if a.json {
        flags.push("--json".into());
    }
    let sized = AsEstimate::try_parse_from(flags)
        .map_err(CliError::other)
        .and_then(|e| estimate(e.estimate));
    if a.trace_out.is_none() {
        let _ = std::fs::remove_file(&path);
    }
    sized
}
