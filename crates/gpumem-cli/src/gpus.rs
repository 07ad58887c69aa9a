//! `gpumem gpus`: the built-in GPU profiles, or a daemon's live GPUs.

use clap::Args;
use gpumem_core::profile;
use gpumem_core::units::bytes_to_mib;

use crate::{CliError, CliResult};

#[derive(Args)]
pub struct GpusArgs {
    /// Print JSON.
    #[arg(long)]
    json: bool,
    /// Show a running daemon's GPUs (live memory, utilization, jobs) instead of the profiles:
    /// unix:PATH or http://HOST:PORT; `--server` alone means GPUMEM_SERVER or the default socket.
    #[arg(long, num_args = 0..=1, default_missing_value = "")]
    server: Option<String>,
    /// A file holding the bearer token of a daemon on TCP (default: GPUMEM_TOKEN).
    #[arg(long)]
    token_file: Option<std::path::PathBuf>,
}

pub fn gpus(a: GpusArgs) -> CliResult {
    if let Some(url) = a.server {
        let url = Some(url)
            .filter(|u| !u.is_empty())
            .or_else(|| std::env::var("GPUMEM_SERVER").ok());
        return crate::client::live_gpus(
            &crate::client::ServerArgs::new(url, a.token_file),
            a.json,
        );
    }
    let all = profile::catalogue();
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&all).map_err(CliError::other)?
        );
        return Ok(());
    }
    println!(
        "{:<16} {:<32} {:>10} {:>5} {:>8} {:>8} {:>8} {:>9} {:>8}",
        "name", "device", "MiB", "SMs", "fp32 TF", "bf16 TF", "GB/s", "context", "cuBLAS ws"
    );
    for p in all {
        println!(
            "{:<16} {:<32} {:>10} {:>5} {:>8.1} {:>8.1} {:>8.0} {:>9.0} {:>8.3}",
            p.name,
            p.display,
            p.capacity_mib,
            p.sm_count,
            p.tflops.fp32,
            p.tflops.bf16,
            p.memory_bandwidth_gbs,
            p.cuda_context_mib,
            bytes_to_mib(p.cublas_workspace())
        );
    }
    Ok(())
}
