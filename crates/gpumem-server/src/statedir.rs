//! The state directory: made private (0700) and locked for one daemon's life, its job store
//! opened (a lost or damaged one refused, or set aside with `--recover`), and the profile the
//! daemon's probes measured (STATE/profile.toml, 0600).

use std::os::unix::fs::DirBuilderExt;
use std::path::Path;

use gpumem_core::profile::GpuProfile;

use crate::config::DaemonConfigError;
use crate::store::{JobRecord, Store, StoreError};

/// Why the daemon could not open its state.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The state directory could not be created, locked or made private.
    #[error("{dir}: {source}")]
    StateDir { dir: String, source: std::io::Error },
    /// STATE/profile.toml (what the daemon's probes measured) cannot be read.
    #[error("{dir}/profile.toml: {message}")]
    ProbedProfile { dir: String, message: String },
    /// The store holds no job but job directories exist: it was emptied, deleted or damaged.
    #[error(
        "{dir}/jobs.db holds no jobs but {dir}/jobs has {job_dirs} job directories: the job store was lost or damaged; start with --recover to set them aside and begin a new store"
    )]
    StoreLost { dir: String, job_dirs: usize },
    /// Another daemon holds the state directory (a second one would run its jobs again).
    #[error("{dir} is in use by another gpumem serve{}", .pid.map(|p| format!(" (pid {p})")).unwrap_or_default())]
    InUse { dir: String, pid: Option<u32> },
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The settings name a policy or an estimator that cannot be made.
    #[error(transparent)]
    Config(#[from] DaemonConfigError),
}

/// The daemon's profile with what its probes measured (0600, in the state directory).
const PROBED_PROFILE: &str = "profile.toml";

fn io_error(dir: &Path) -> impl Fn(std::io::Error) -> DaemonError + '_ {
    move |source| DaemonError::StateDir {
        dir: dir.display().to_string(),
        source,
    }
}

/// Creates the state directory private to the daemon's user (0700, its job directories too)
/// and takes its exclusive lock, writing this process's pid into it. A second daemon on the
/// same directory is refused while the first lives; the kernel drops the lock with the process,
/// so a killed daemon leaves nothing to clean up. The lock lasts as long as the file is open.
pub fn lock(dir: &Path) -> Result<std::fs::File, DaemonError> {
    use std::io::{Read, Seek, Write};
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let io = io_error(dir);
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir.join("jobs"))
        .map_err(&io)?;
    for d in [dir.to_path_buf(), dir.join("jobs")] {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).map_err(&io)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(dir.join("lock"))
        .map_err(&io)?;
    // SAFETY: flock on a file descriptor this function owns.
    if unsafe {
        libc::flock(
            std::os::unix::io::AsRawFd::as_raw_fd(&f),
            libc::LOCK_EX | libc::LOCK_NB,
        )
    } != 0
    {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(io(err));
        }
        let mut holder = String::new();
        let _ = f.read_to_string(&mut holder);
        return Err(DaemonError::InUse {
            dir: dir.display().to_string(),
            pid: holder.trim().parse().ok(),
        });
    }
    f.set_len(0)
        .and_then(|_| f.rewind())
        .and_then(|_| write!(f, "{}", std::process::id()))
        .and_then(|_| f.flush())
        .map_err(io)?;
    Ok(f)
}

/// Opens the job store of a locked state directory and loads every job. A store that holds no
/// job beside job directories was lost or damaged: refused, unless `recover`, which sets the
/// directories aside (`jobs.lost-SECONDS`) and begins a new store, so no new job reuses an old
/// one's id and files.
pub fn open_store(
    dir: &Path,
    recover: bool,
    now: f64,
) -> Result<(Store, Vec<JobRecord>), DaemonError> {
    let io = io_error(dir);
    // Job directories a lost or damaged store named are set aside, never reused.
    let set_aside_jobs = |stamp: u64| -> Result<(), DaemonError> {
        std::fs::rename(dir.join("jobs"), dir.join(format!("jobs.lost-{stamp}"))).map_err(&io)?;
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(dir.join("jobs"))
            .map_err(&io)
    };
    let db = dir.join("jobs.db");
    let mut store = match Store::open(&db) {
        // A damaged store is set aside whole, with the job directories it named.
        Err(StoreError::Damaged { .. }) if recover => {
            let stamp = now as u64;
            for from in crate::store::files(&db).into_iter().filter(|f| f.exists()) {
                std::fs::rename(&from, format!("{}.damaged-{stamp}", from.display()))
                    .map_err(&io)?;
            }
            set_aside_jobs(stamp)?;
            Store::open(&db)?
        }
        other => other?,
    };
    let jobs = store.load()?;
    let job_dirs = std::fs::read_dir(dir.join("jobs")).map_err(&io)?.count();
    if jobs.is_empty() && job_dirs > 0 {
        if !recover {
            return Err(DaemonError::StoreLost {
                dir: dir.display().to_string(),
                job_dirs,
            });
        }
        set_aside_jobs(now as u64)?;
    }
    store.set_id_floor(highest_job_dir(dir));
    Ok((store, jobs))
}

/// The highest job id any directory under STATE/jobs or a set-aside STATE/jobs.lost-* has: a
/// new job's id is above it, so no job ever gets another's directory or log.
fn highest_job_dir(state_dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(state_dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n == "jobs" || n.starts_with("jobs.lost-"))
        })
        .filter_map(|e| std::fs::read_dir(e.path()).ok())
        .flat_map(|dir| dir.filter_map(|j| j.ok()?.file_name().to_str()?.parse::<u64>().ok()))
        .max()
        .unwrap_or(0)
}

/// `profile` with the workspaces earlier probes measured on this machine (STATE/profile.toml)
/// over its own table — only for the same GPU and stack: a table measured under another cuDNN
/// does not hold.
pub fn probed_profile(dir: &Path, mut profile: GpuProfile) -> Result<GpuProfile, DaemonError> {
    if let Ok(text) = std::fs::read_to_string(dir.join(PROBED_PROFILE)) {
        let stored = GpuProfile::from_toml(&text).map_err(|e| DaemonError::ProbedProfile {
            dir: dir.display().to_string(),
            message: e.to_string(),
        })?;
        if stored.name == profile.name && stored.stack == profile.stack {
            gpumem_core::workspace::merge(&mut profile.conv_workspace, stored.conv_workspace);
        }
    }
    Ok(profile)
}

/// Keeps the profile with what a probe measured for the next start (0600; written aside and
/// renamed, so a crash leaves the old file or the new one).
pub fn save_probed_profile(dir: &Path, profile: &GpuProfile) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(PROBED_PROFILE);
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(profile.to_toml().as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}
