//! `gpumem serve`: the resource manager daemon on this machine's GPUs (or fake ones).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use gpumem_core::profile;
use gpumem_monitor::{FakeMonitor, Monitor, NvmlMonitor};
use gpumem_server::probe::{FakeProber, Prober, TorchProber};
use gpumem_server::{Config, Daemon};
use gpumem_torch::TorchTracer;

use crate::{CliError, CliResult};

#[derive(Args)]
pub struct ServeArgs {
    /// Address to listen on. Anything but loopback needs --token.
    #[arg(long, default_value = "127.0.0.1:7878")]
    addr: String,
    /// Directory for the job store, logs and run files.
    #[arg(long, default_value = "gpumem-state")]
    state: PathBuf,
    /// Bearer token clients must send (default: GPUMEM_TOKEN; required off loopback).
    #[arg(long, env = "GPUMEM_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// No GPUs here: serve fake ones, e.g. 4xa100-40gb (jobs report memory through
    /// $GPUMEM_FAKE_MEMORY_FILE).
    #[arg(long)]
    fake_gpus: Option<String>,
    /// The GPU profile for estimates on real GPUs (built-in name).
    #[arg(long, default_value = "a100-40gb")]
    gpu: String,
    /// A profile TOML file (from `gpumem probe` or `gpumem calibrate`) for estimates; overrides
    /// --gpu (and, with --fake-gpus, the fake GPUs' own profile).
    #[arg(long)]
    profile: Option<PathBuf>,
    /// With --fake-gpus and `probe_s` set: the daemon's probes "measure" this many bytes of
    /// workspace per convolution pass instead of running on a GPU (for trying the probe path).
    #[arg(long, requires = "fake_gpus")]
    fake_probe: Option<u64>,
    /// Daemon settings (TOML): policy, headroom_mib, warmup_s, max_retries, backfill, grace_s, tick_ms, on_lost.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Start although the job store holds no job beside existing job directories (it was
    /// emptied, deleted or damaged): the old directories are set aside in STATE/jobs.lost-TIME.
    #[arg(long)]
    recover: bool,
}

pub fn serve(a: ServeArgs) -> CliResult {
    // A host name (localhost) resolves; its first address is used.
    let addr: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(a.addr.as_str())
        .ok()
        .and_then(|mut it| it.next())
        .ok_or_else(|| CliError::input(format!("--addr `{}` is not HOST:PORT", a.addr)))?;
    let config = match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|e| CliError::input(format!("{}: {e}", p.display())))?;
            Config::from_toml(&text).map_err(|e| CliError::input(format!("{}: {e}", p.display())))?
        }
        None => Config::default(),
    };
    // Checked before anything starts, as a bad-input error.
    gpumem_server::api::check_bind(addr, a.token.as_deref()).map_err(CliError::input)?;
    let (monitor, fake, prof): (Box<dyn Monitor>, _, _) = match &a.fake_gpus {
        Some(spec) => {
            let (n, name) = crate::args::gpu_count("--fake-gpus", spec, 1024)?;
            let p = profile::builtin(name).map_err(CliError::input)?;
            let m = FakeMonitor::new(n, &p.display, p.capacity_bytes());
            let gpus = m.gpus.clone();
            (Box::new(m), Some(gpus), p)
        }
        None => {
            let m = NvmlMonitor::new(None, 1000).map_err(|e| CliError::other(format!("{e} (no GPU here? use --fake-gpus 4xa100-40gb)")))?;
            (Box::new(m), None, profile::builtin(&a.gpu).map_err(CliError::input)?)
        }
    };
    let prof = match &a.profile {
        Some(_) => crate::args::GpuChoice::new(&a.gpu, a.profile.clone()).load()?,
        None => prof,
    };
    let prober: Option<Arc<dyn Prober>> = match (a.fake_probe, &a.fake_gpus) {
        (Some(bytes), _) => Some(Arc::new(FakeProber { bytes })),
        (None, Some(_)) => None, // no GPU to probe on
        (None, None) => Some(Arc::new(TorchProber { tracer: TorchTracer::from_env(), dir: a.state.join("probe") })),
    };
    let exe = std::env::current_exe().map_err(|e| CliError::other(format!("cannot find the gpumem binary: {e}")))?;
    let daemon = Daemon::open(&a.state, monitor, fake, prof, config, exe, a.recover).map_err(|e| match e {
        // Another daemon on the same state, or a lost store: the operator's to decide (exit 2).
        e @ (gpumem_server::DaemonError::InUse { .. }
        | gpumem_server::DaemonError::StoreLost { .. }
        | gpumem_server::DaemonError::Store(gpumem_server::store::StoreError::Damaged { .. } | gpumem_server::store::StoreError::Version { .. })) => CliError::input(e),
        e => CliError::other(e),
    })?;
    let daemon = match prober {
        Some(p) => daemon.with_prober(p),
        None => daemon,
    };
    gpumem_server::api::serve(Arc::new(daemon), addr, a.token).map_err(CliError::other)
}

