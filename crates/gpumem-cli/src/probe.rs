//! `gpumem probe`: measure, on this machine's GPU, what a CPU-side trace cannot know (the
//! stack's context, cuBLAS workspace and cuDNN's convolution workspaces) and write it into a
//! GPU profile.

use std::path::PathBuf;

use clap::Args;
use gpumem_core::profile::{self, GpuProfile};
use gpumem_torch::TorchTracer;
use gpumem_torch::probe::{ProbeReport, ProbeRequest};

use crate::{CliError, CliResult};

#[derive(Args)]
pub struct ProbeArgs {
    /// CUDA device index to probe.
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    /// The profile to write. If it exists, the probe adds to its table.
    #[arg(long)]
    out: PathBuf,
    /// What the new profile starts from when --out does not exist: a built-in name or a
    /// profile TOML file.
    #[arg(long, default_value = "h200")]
    base: String,
    /// Probe exactly these jobs' convolutions: measurement CSVs (columns model, batch_size,
    /// precision, input) or MODEL:BATCH[:PRECISION[:CxHxW]] items. Default: the documented grid
    /// (docs/probe.md).
    #[arg(long, num_args = 1..)]
    models: Vec<String>,
    /// cuDNN benchmark mode to probe: off (PyTorch's default, what the table holds), on, both.
    #[arg(long, default_value = "both", value_parser = ["off", "on", "both"])]
    benchmark: String,
    /// Time budget of each cudnn.benchmark mode's convolutions, seconds (0: none); configurations
    /// past it stay unprobed.
    #[arg(long, default_value_t = 0)]
    seconds: u64,
    /// Instead of probing: read a report `python -m gpumem_trace.probe` wrote on a GPU machine.
    #[arg(long, value_name = "REPORT.json")]
    import: Option<PathBuf>,
}

fn start(a: &ProbeArgs) -> CliResult<GpuProfile> {
    let from_file = |path: &std::path::Path| -> CliResult<GpuProfile> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| CliError::input(format!("{}: {e}", path.display())))?;
        GpuProfile::from_toml(&text)
            .map_err(|e| CliError::input(format!("{}: {e}", path.display())))
    };
    if a.out.exists() {
        return from_file(&a.out);
    }
    let base = std::path::Path::new(&a.base);
    if base.extension().is_some_and(|e| e == "toml") {
        return from_file(base);
    }
    profile::builtin(&a.base).map_err(CliError::input)
}

pub fn probe(a: ProbeArgs) -> CliResult {
    let mut profile = start(&a)?;
    let report = match &a.import {
        Some(path) => ProbeReport::read(path).map_err(CliError::input)?,
        None => {
            let tracer = TorchTracer::from_env();
            let req = ProbeRequest {
                gpu: a.gpu,
                models: a.models.clone(),
                benchmark: a.benchmark.clone(),
                seconds: a.seconds,
                ..Default::default()
            };
            let json = a.out.with_extension("probe.json");
            tracer.probe(&req, &json)?
        }
    };
    // One table per stack: another GPU's or library's workspaces would be taken as probed.
    if let Some(held) = &profile.stack {
        let r = &report.stack;
        if (&held.gpu, &held.torch, held.cudnn) != (&r.gpu, &r.torch, r.cudnn) {
            return Err(CliError::input(format!(
                "{}: holds a table measured on {} (torch {}, cuDNN {}); this report is of {} (torch {}, cuDNN {}): write it to a new profile",
                a.out.display(),
                held.gpu,
                held.torch,
                held.cudnn,
                r.gpu,
                r.torch,
                r.cudnn
            )));
        }
    }
    let applied = report.apply(&mut profile);
    if profile.calibration.is_none() {
        profile.calibration = Some(format!("context from gpumem probe on {}", report.stack.gpu));
    }
    std::fs::write(&a.out, profile.to_toml())
        .map_err(|e| CliError::other(format!("{}: {e}", a.out.display())))?;
    let s = &report.stack;
    println!(
        "{}: {} (torch {}, CUDA {}, cuDNN {}): {} convolution configurations added, {} updated, {} refused by the GPU; table now {}; context {:.0} MiB; cuBLAS workspace {} MiB; NCCL {:.0} MiB + {:.0} MiB per communicator",
        a.out.display(),
        s.gpu,
        s.torch,
        s.cuda,
        s.cudnn,
        applied.added,
        applied.replaced,
        applied.refused,
        profile.conv_workspace.len(),
        profile.cuda_context_mib,
        profile.cublas_workspace() / gpumem_core::units::MIB,
        profile.nccl_mib,
        profile.nccl_communicator_mib,
    );
    Ok(())
}
