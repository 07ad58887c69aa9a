//! `gpumem serve`: the resource manager daemon on this machine's GPUs (or fake ones).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use gpumem_core::profile;
use gpumem_monitor::{FakeMonitor, Monitor, NvmlMonitor};
use gpumem_server::api::{Listen, Token};
use gpumem_server::probe::{FakeProber, Prober, TorchProber};
use gpumem_server::{Config, Daemon};
use gpumem_torch::TorchTracer;

use crate::{CliError, CliResult};

#[derive(Args)]
pub struct ServeArgs {
    /// The Unix socket to listen on (default: /run/gpumem.sock as root, else
    /// $XDG_RUNTIME_DIR/gpumem.sock, else /tmp/gpumem-UID.sock). Callers are known by their
    /// peer credentials.
    #[arg(long, conflicts_with = "addr")]
    socket: Option<PathBuf>,
    /// Listen on TCP at HOST:PORT instead (every request then needs the token of
    /// --token-file or GPUMEM_TOKEN, and acts as the daemon's user).
    #[arg(long)]
    addr: Option<String>,
    /// A file holding the bearer token for --addr (default: GPUMEM_TOKEN), at least 16
    /// characters; never on the command line, which every user can read.
    #[arg(long, requires = "addr")]
    token_file: Option<PathBuf>,
    /// Directory for the job store, logs and run files.
    #[arg(long, default_value = "gpumem-state")]
    state: PathBuf,
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
    let listen = listen(&a)?;
    let config = match &a.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| CliError::input(format!("{}: {e}", p.display())))?;
            Config::from_toml(&text)
                .map_err(|e| CliError::input(format!("{}: {e}", p.display())))?
        }
        None => Config::default(),
    };
    let (monitor, fake, prof): (Box<dyn Monitor>, _, _) = match &a.fake_gpus {
        Some(spec) => {
            let (n, name) = crate::args::gpu_count("--fake-gpus", spec, 1024)?;
            let p = profile::builtin(name).map_err(CliError::input)?;
            let m = FakeMonitor::new(n, &p.display, p.capacity_bytes());
            let gpus = m.gpus.clone();
            (Box::new(m), Some(gpus), p)
        }
        None => {
            let m = NvmlMonitor::new(None, 1000).map_err(|e| {
                CliError::other(format!("{e} (no GPU here? use --fake-gpus 4xa100-40gb)"))
            })?;
            (
                Box::new(m),
                None,
                profile::builtin(&a.gpu).map_err(CliError::input)?,
            )
        }
    };
    let prof = match &a.profile {
        Some(_) => crate::args::GpuChoice::new(&a.gpu, a.profile.clone()).load()?,
        None => prof,
    };
    let prober: Option<Arc<dyn Prober>> = match (a.fake_probe, &a.fake_gpus) {
        (Some(bytes), _) => Some(Arc::new(FakeProber { bytes })),
        (None, Some(_)) => None, // no GPU to probe on
        (None, None) => Some(Arc::new(TorchProber {
            tracer: TorchTracer::from_env(),
            dir: a.state.join("probe"),
        })),
    };
    let exe = std::env::current_exe()
        .map_err(|e| CliError::other(format!("cannot find the gpumem binary: {e}")))?;
    let daemon = Daemon::open(&a.state, monitor, fake, prof, config, exe, a.recover).map_err(
        |e| match e {
            // Another daemon on the same state, or a lost store: the operator's to decide (exit 2).
            e @ (gpumem_server::DaemonError::InUse { .. }
            | gpumem_server::DaemonError::StoreLost { .. }
            | gpumem_server::DaemonError::Store(
                gpumem_server::store::StoreError::Damaged { .. }
                | gpumem_server::store::StoreError::Version { .. },
            )) => CliError::input(e),
            e => CliError::other(e),
        },
    )?;
    let daemon = match prober {
        Some(p) => daemon.with_prober(p),
        None => daemon,
    };
    gpumem_server::api::serve(Arc::new(daemon), listen).map_err(|e| match e {
        e @ gpumem_server::api::ListenError::SocketInUse(_) => CliError::input(e),
        e => CliError::other(e),
    })
}

/// The socket, or TCP with its token (checked before anything starts, as bad input).
fn listen(a: &ServeArgs) -> CliResult<Listen> {
    let Some(text) = &a.addr else {
        return Ok(Listen::Unix(a.socket.clone().unwrap_or_else(|| {
            gpumem_server::api::default_socket(gpumem_server::identity::User::current())
        })));
    };
    // A host name (localhost) resolves; its first address is used.
    let addr: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(text.as_str())
        .ok()
        .and_then(|mut it| it.next())
        .ok_or_else(|| CliError::input(format!("--addr `{text}` is not HOST:PORT")))?;
    let token = Token::from_file_or_env(a.token_file.as_deref()).map_err(CliError::input)?;
    let token =
        token.ok_or_else(|| CliError::input(gpumem_server::api::ListenError::NoToken { addr }))?;
    Ok(Listen::Tcp { addr, token })
}
