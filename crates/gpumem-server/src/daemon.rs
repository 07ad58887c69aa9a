//! The daemon's state and its scheduling loop.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Arc, Mutex, MutexGuard, RwLock, mpsc};
use std::time::{SystemTime, UNIX_EPOCH};

use gpumem_core::profile::GpuProfile;
use gpumem_core::trace::Trace;
use gpumem_core::units::bytes_to_mib;
use gpumem_monitor::{FakeGpus, Monitor};
use gpumem_place::{Cluster, Load, MIB, MemoryDemand, MemoryView, Policy, Resident, UnknownPolicy};
use gpumem_torch::probe::ProbeReport;
use gpumem_workload::Workload;
use serde::Deserialize;

use gpumem_monitor::GpuReading;
use gpumem_place::{Forecast, Queued, SchedOptions, Scheduler};

use crate::identity::{Admins, User};
use crate::launcher::{Exit, JobDir, Launch, Supervision, launch};
use crate::probe::Prober;
use crate::store::{JobRecord, Store, StoreError};
use crate::wire::{GpuView, JobRequest, JobState, JobView, MAX_MEM_MIB, Submitted};

/// What happens to a job whose supervisor vanished before the job's program could start (one
/// that may have started is never run again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnLost {
    Requeue,
    Fail,
}

/// `gpumem serve --config FILE.toml`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Any placement policy of gpumem-place (`safe-pack`, `first-fit+carma`, …).
    pub policy: String,
    /// Free memory kept above an estimate (CARMA: 2 GiB).
    pub headroom_mib: u64,
    /// A GPU just given a job is not offered again until the job's memory shows up or this passes.
    pub warmup_s: f64,
    /// Exclusive re-runs after out-of-memory crashes before a job fails.
    pub max_retries: u32,
    /// EASY backfill: when the head of the queue must wait, later jobs start where they do not
    /// delay it (on reserved GPUs only if their `expected_s` ends before the head's turn).
    pub backfill: bool,
    /// Seconds between SIGTERM and SIGKILL when cancelling.
    pub grace_s: f64,
    /// Scheduling period.
    pub tick_ms: u64,
    pub on_lost: OnLost,
    /// How a job with a model is sized: any estimator `gpumem estimate` takes (`replay`,
    /// `live-tensors`, `horus`, or `learned` with `learned_model`).
    pub estimator: String,
    /// The hybrid's memory model (a `gpumem learn train --target memory --model gbt` file).
    pub learned_model: Option<PathBuf>,
    /// Seconds a job whose convolutions the profile has not probed waits for the daemon to
    /// probe them on an idle GPU before it is placed by its upper bound (0: no probing).
    pub probe_s: u64,
    /// Accept `py:FILE:function` models: sizing one runs that file's code in the daemon, as the
    /// daemon's user (off by default).
    pub allow_py_models: bool,
    /// Submissions sized at once (each traces its model in Python); the others wait their turn.
    pub max_traces: u32,
    /// Give each run a cgroup v2 directory of its own where the machine allows it (false: its
    /// process group and its supervisor's subreaping alone track its processes).
    pub cgroups: bool,
    /// A group whose members, like root and the daemon's own user, see and cancel every job.
    pub admin_group: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            policy: "safe-pack".into(),
            headroom_mib: 2048,
            warmup_s: 30.0,
            max_retries: 3,
            backfill: false,
            grace_s: 10.0,
            tick_ms: 200,
            on_lost: OnLost::Requeue,
            estimator: "replay".into(),
            learned_model: None,
            probe_s: 0,
            allow_py_models: false,
            max_traces: 2,
            cgroups: true,
            admin_group: None,
        }
    }
}

/// Why a `--config` file is refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Not TOML, or a key that is not a setting (toml's message, on one line).
    #[error("{}", .0.to_string().replace('\n', " "))]
    Toml(#[from] toml::de::Error),
    #[error(transparent)]
    Policy(#[from] UnknownPolicy),
    /// The estimator (or its learned model) cannot be used.
    #[error(transparent)]
    Estimator(#[from] gpumem_learn::model::LearnError),
    /// `admin_group` names no group of this machine.
    #[error("admin_group = {0:?}: no such group")]
    NoGroup(String),
    /// A number out of its range (`value` as written back).
    #[error("{key} = {value} is out of range ({range})")]
    Range {
        key: &'static str,
        value: String,
        range: &'static str,
    },
}

impl Config {
    pub fn from_toml(text: &str) -> Result<Config, ConfigError> {
        let c: Config = toml::from_str(text)?;
        // Every number bounded: a daemon that sleeps for ever between ticks or waits an
        // infinite grace cannot be stopped but by SIGKILL; a headroom beyond bytes wraps.
        let seconds = |key, v: f64| {
            (v.is_finite() && (0.0..=86_400.0).contains(&v))
                .then_some(())
                .ok_or(ConfigError::Range {
                    key,
                    value: v.to_string(),
                    range: "0..=86400 seconds",
                })
        };
        seconds("warmup_s", c.warmup_s)?;
        seconds("grace_s", c.grace_s)?;
        if !(10..=60_000).contains(&c.tick_ms) {
            return Err(ConfigError::Range {
                key: "tick_ms",
                value: c.tick_ms.to_string(),
                range: "10..=60000",
            });
        }
        if c.headroom_mib > MAX_MEM_MIB {
            return Err(ConfigError::Range {
                key: "headroom_mib",
                value: c.headroom_mib.to_string(),
                range: "0..=16777216",
            });
        }
        if !(1..=64).contains(&c.max_traces) {
            return Err(ConfigError::Range {
                key: "max_traces",
                value: c.max_traces.to_string(),
                range: "1..=64",
            });
        }
        if c.probe_s > 3600 {
            return Err(ConfigError::Range {
                key: "probe_s",
                value: c.probe_s.to_string(),
                range: "0..=3600 seconds",
            });
        }
        if c.max_retries > 100 {
            return Err(ConfigError::Range {
                key: "max_retries",
                value: c.max_retries.to_string(),
                range: "0..=100",
            });
        }
        if let Some(g) = &c.admin_group
            && crate::identity::group_id(g).is_none()
        {
            return Err(ConfigError::NoGroup(g.clone()));
        }
        // After the ranges: the policy's headroom is counted in bytes.
        c.policy()?;
        gpumem_learn::estimator(&c.estimator, c.learned_model.as_deref())?;
        Ok(c)
    }

    pub fn policy(&self) -> Result<Policy, UnknownPolicy> {
        Policy::parse(
            &self.policy,
            MemoryView::Estimate {
                headroom_bytes: self.headroom_mib * MIB,
            },
        )
    }

    /// gpumem-place's scheduler with these settings.
    pub fn sched(&self) -> Result<SchedOptions, UnknownPolicy> {
        Ok(SchedOptions {
            policy: self.policy()?,
            backfill: self.backfill,
            max_retries: self.max_retries,
            warmup_s: self.warmup_s,
        })
    }
}

/// The daemon's profile with what its probes measured (0600, in the state directory).
const PROBED_PROFILE: &str = "profile.toml";

fn write_private(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Why a job's workload could not be sized.
#[derive(Debug, thiserror::Error)]
pub enum SizeError {
    /// The configured estimator cannot be made.
    #[error(transparent)]
    Estimator(#[from] gpumem_learn::model::LearnError),
    /// The workload cannot be traced or sized.
    #[error(transparent)]
    Job(#[from] gpumem_workload::SizeError),
    #[error(transparent)]
    Estimate(#[from] gpumem_core::estimate::EstimateError),
}

/// A job's workload sized: gpumem's estimate and upper bound with the configured estimator,
/// the trace they came from, and its convolutions the profile has not probed.
pub struct Sized {
    pub peak: u64,
    pub bound: u64,
    pub trace: Trace,
    pub unprobed: Vec<(String, u64)>,
}

/// Sizes `workload` on `profile` with the configured estimator (an ambiguous spec by its largest
/// reading).
pub fn estimate(
    config: &Config,
    profile: &GpuProfile,
    workload: &Workload,
) -> Result<Sized, SizeError> {
    let estimator = gpumem_learn::estimator(&config.estimator, config.learned_model.as_deref())?;
    let sizing = workload.size(profile, estimator.as_ref(), Workload::trace)?;
    let unprobed = profile.workspaces().unprobed(&sizing.trace);
    Ok(Sized {
        peak: sizing.estimate.peak_bytes,
        bound: sizing.estimate.upper_bound_bytes,
        trace: sizing.trace,
        unprobed,
    })
}

fn size(config: &Config, profile: &GpuProfile, trace: &Trace) -> Result<(u64, u64), SizeError> {
    let estimator = gpumem_learn::estimator(&config.estimator, config.learned_model.as_deref())?;
    let est = estimator.estimate(trace, profile)?;
    Ok((est.peak_bytes, est.upper_bound_bytes))
}

/// A job held for a probe of its convolutions.
struct ProbeWait {
    job: u64,
    trace: Trace,
    configs: Vec<(String, u64)>,
    /// When it is placed by its bound if no probe has answered.
    until: f64,
}

/// The probe running now, on `gpu`, in its own thread.
struct Probing {
    gpu: u32,
    configs: Vec<(String, u64)>,
    result: mpsc::Receiver<Result<ProbeReport, String>>,
}

struct Inner {
    store: Store,
    jobs: BTreeMap<u64, JobRecord>,
    monitor: Box<dyn Monitor>,
    /// Runs started by this daemon process (the others were re-attached after a restart).
    children: HashMap<u64, Child>,
    /// Cancelled runs: when to send SIGKILL.
    kill_at: HashMap<u64, f64>,
    /// The waiting jobs, in the order and under the rules of gpumem-place's scheduler.
    sched: Scheduler,
    /// The GPUs as last read (those the monitor could read).
    gpus: Vec<GpuReading>,
    /// Memory each running job shows now (per GPU).
    observed: HashMap<u64, u64>,
    /// GPU → (job, until): not offered while that job's memory has not shown up.
    warm: HashMap<u32, (u64, f64)>,
    oom_crashes: u64,
    /// Running jobs one of whose GPUs was at its memory limit at the last reading: a crash
    /// now is out-of-memory whatever its log says.
    at_limit: std::collections::HashSet<u64>,
    probe_wait: Vec<ProbeWait>,
    probing: Option<Probing>,
    /// Convolutions a probe was asked for (measured or not): never asked again.
    probe_tried: std::collections::HashSet<(String, u64)>,
    /// When the store's WAL was last copied into its database file.
    checkpointed: f64,
}

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
    #[error(transparent)]
    Policy(#[from] UnknownPolicy),
}

/// Creates the state directory private to the daemon's user (0700, its job directories too)
/// and takes its exclusive lock, writing this process's pid into it. A second daemon on the
/// same directory is refused while the first lives; the kernel drops the lock with the process,
/// so a killed daemon leaves nothing to clean up.
fn lock_state_dir(dir: &Path) -> Result<std::fs::File, DaemonError> {
    use std::io::{Read, Seek, Write};
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let io = |source| DaemonError::StateDir {
        dir: dir.display().to_string(),
        source,
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir.join("jobs"))
        .map_err(io)?;
    for d in [dir.to_path_buf(), dir.join("jobs")] {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(dir.join("lock"))
        .map_err(io)?;
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

/// Why a job could not be cancelled (the API answers 404, 409 and 500).
#[derive(Debug, thiserror::Error)]
pub enum CancelError {
    /// No such job, or not the caller's to see.
    #[error("no job {0}")]
    NoJob(u64),
    #[error("job {id} has already ended ({})", .state.name())]
    Ended { id: u64, state: JobState },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The daemon: jobs, GPUs, policy.
pub struct Daemon {
    inner: Mutex<Inner>,
    /// The state directory's lock, held for the daemon's life (released when the file closes).
    _lock: std::fs::File,
    pub state_dir: PathBuf,
    /// The `gpumem` binary that supervises runs.
    supervisor: PathBuf,
    fake: Option<FakeGpus>,
    /// The GPU profile; the daemon's probes add to its workspace table (kept in
    /// STATE/profile.toml across restarts).
    profile: RwLock<GpuProfile>,
    prober: Option<Arc<dyn Prober>>,
    pub config: Config,
    /// The user the daemon runs as: root runs each job as its owner, anyone else only their own.
    user: User,
    admins: Admins,
}

/// A submission from a user a non-root daemon cannot run jobs as.
#[derive(Debug, thiserror::Error)]
#[error(
    "this daemon runs as {daemon} and can run jobs only as {daemon}, not as {user} (a daemon started by root runs each job as its submitter)"
)]
pub struct ForeignUser {
    pub user: String,
    pub daemon: String,
}

impl Daemon {
    /// Opens the state directory (creating it), loading every job it holds. A store that holds
    /// no job beside job directories was lost or damaged: refused, unless `recover`, which sets
    /// the directories aside (`jobs.lost-SECONDS`) and begins a new store, so no new job reuses
    /// an old one's id and files.
    pub fn open(
        state_dir: &Path,
        monitor: Box<dyn Monitor>,
        fake: Option<FakeGpus>,
        profile: GpuProfile,
        config: Config,
        supervisor: PathBuf,
        recover: bool,
    ) -> Result<Daemon, DaemonError> {
        let lock = lock_state_dir(state_dir)?;
        let io = |source| DaemonError::StateDir {
            dir: state_dir.display().to_string(),
            source,
        };
        // Job directories a lost or damaged store named are set aside, never reused.
        let set_aside_jobs = |stamp: u64| -> Result<(), DaemonError> {
            std::fs::rename(
                state_dir.join("jobs"),
                state_dir.join(format!("jobs.lost-{stamp}")),
            )
            .map_err(io)?;
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(state_dir.join("jobs"))
                .map_err(io)
        };
        let store = match Store::open(&state_dir.join("jobs.db")) {
            // A damaged store is set aside whole, with the job directories it named.
            Err(StoreError::Damaged { .. }) if recover => {
                let stamp = now() as u64;
                for from in crate::store::files(&state_dir.join("jobs.db"))
                    .into_iter()
                    .filter(|f| f.exists())
                {
                    std::fs::rename(&from, format!("{}.damaged-{stamp}", from.display()))
                        .map_err(io)?;
                }
                set_aside_jobs(stamp)?;
                Store::open(&state_dir.join("jobs.db"))?
            }
            other => other?,
        };
        let jobs: BTreeMap<u64, JobRecord> = store.load()?.into_iter().map(|j| (j.id, j)).collect();
        let job_dirs = std::fs::read_dir(state_dir.join("jobs"))
            .map_err(|source| DaemonError::StateDir {
                dir: state_dir.display().to_string(),
                source,
            })?
            .count();
        if jobs.is_empty() && job_dirs > 0 {
            if !recover {
                return Err(DaemonError::StoreLost {
                    dir: state_dir.display().to_string(),
                    job_dirs,
                });
            }
            set_aside_jobs(now() as u64)?;
        }
        let mut store = store;
        store.set_id_floor(highest_job_dir(state_dir));
        let mut inner = Inner {
            store,
            jobs,
            monitor,
            children: HashMap::new(),
            kill_at: HashMap::new(),
            sched: Scheduler::new(config.sched()?),
            gpus: Vec::new(),
            observed: HashMap::new(),
            warm: HashMap::new(),
            oom_crashes: 0,
            at_limit: Default::default(),
            probe_wait: Vec::new(),
            probing: None,
            probe_tried: Default::default(),
            checkpointed: 0.0,
        };
        let t = now();
        let waiting: Vec<u64> = inner
            .jobs
            .values()
            .filter(|j| j.state.is_waiting())
            .map(|j| j.id)
            .collect();
        for id in waiting {
            let before = inner.jobs[&id].state;
            queue(&mut inner, id, t);
            let job = &inner.jobs[&id];
            if job.state != before {
                inner.store.transition(job, t, job.error.as_deref())?;
            }
        }
        let mut profile = profile;
        if let Ok(text) = std::fs::read_to_string(state_dir.join(PROBED_PROFILE)) {
            // What earlier probes measured on this machine, over the configured table.
            let stored = GpuProfile::from_toml(&text).map_err(|e| DaemonError::ProbedProfile {
                dir: state_dir.display().to_string(),
                message: e.to_string(),
            })?;
            // Only for the same GPU and stack: a table measured under another cuDNN does not hold.
            if stored.name == profile.name && stored.stack == profile.stack {
                gpumem_core::workspace::merge(&mut profile.conv_workspace, stored.conv_workspace);
            }
        }
        let user = User::current();
        let admins = Admins {
            daemon: user,
            group: config
                .admin_group
                .as_deref()
                .and_then(crate::identity::group_id),
        };
        Ok(Daemon {
            inner: Mutex::new(inner),
            _lock: lock,
            state_dir: state_dir.to_path_buf(),
            supervisor,
            fake,
            profile: RwLock::new(profile),
            prober: None,
            config,
            user,
            admins,
        })
    }

    /// Probes the convolutions of jobs the profile has not seen (with `probe_s` > 0).
    pub fn with_prober(mut self, prober: Arc<dyn Prober>) -> Self {
        self.prober = Some(prober);
        self
    }

    /// The GPU profile jobs are sized on now.
    pub fn profile(&self) -> GpuProfile {
        self.profile
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Stores a submission gpumem sized. One whose convolutions the profile lacks, where the
    /// daemon probes (`probe_s`), waits sized by its upper bound until a probe of them answers
    /// or `probe_s` passes, then joins the queue; any other is queued at once.
    pub fn submit_sized(
        &self,
        owner: User,
        request: JobRequest,
        sized: Sized,
    ) -> Result<Submitted, StoreError> {
        if self.prober.is_none() || self.config.probe_s == 0 || sized.unprobed.is_empty() {
            return self.submit(owner, request, Some((sized.peak, sized.bound)));
        }
        let mut inner = self.lock();
        let t = now();
        let mut job = JobRecord::queued(owner, request, Some((sized.bound, sized.bound)), t);
        job.id = inner.store.insert(&job)?;
        job.error = Some(
            "waiting for a probe of its convolutions; sized by its upper bound meanwhile".into(),
        );
        let out = submitted(&job);
        inner.probe_wait.push(ProbeWait {
            job: job.id,
            trace: sized.trace,
            configs: sized.unprobed,
            until: t + self.config.probe_s as f64,
        });
        inner.jobs.insert(job.id, job);
        Ok(out)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves consistent data (every write goes to SQLite first).
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn gpu_count(&self) -> usize {
        self.lock().monitor.gpu_count()
    }

    /// Whether this daemon can run jobs as `u`: root as anyone, any other user as itself.
    pub fn can_run_as(&self, u: User) -> Result<(), ForeignUser> {
        if self.user.is_root() || u.uid == self.user.uid {
            return Ok(());
        }
        Err(ForeignUser {
            user: u.name(),
            daemon: self.user.name(),
        })
    }

    /// Stores a validated submission of `owner` (one [`Daemon::can_run_as`] allows); `estimate`
    /// is (peak, bound) bytes per GPU.
    pub fn submit(
        &self,
        owner: User,
        request: JobRequest,
        estimate: Option<(u64, u64)>,
    ) -> Result<Submitted, StoreError> {
        let mut inner = self.lock();
        let mut job = JobRecord::queued(owner, request, estimate, now());
        job.id = inner.store.insert(&job)?;
        let out = submitted(&job);
        let id = job.id;
        inner.jobs.insert(id, job);
        queue(&mut inner, id, now());
        Ok(out)
    }

    /// Whether `caller` may see (and cancel) `job`: its owner and the admins.
    fn visible(&self, caller: User, job: &JobRecord) -> bool {
        job.owner.uid == caller.uid || self.admins.contain(caller)
    }

    /// The jobs `caller` may see.
    pub fn jobs(&self, caller: User, state: Option<JobState>) -> Vec<JobView> {
        self.lock()
            .jobs
            .values()
            .filter(|j| state.is_none_or(|s| j.state == s) && self.visible(caller, j))
            .map(view)
            .collect()
    }

    pub fn job(&self, caller: User, id: u64) -> Option<JobView> {
        self.lock()
            .jobs
            .get(&id)
            .filter(|j| self.visible(caller, j))
            .map(view)
    }

    pub fn log_tail(&self, caller: User, id: u64, bytes: u64) -> Option<String> {
        self.lock()
            .jobs
            .get(&id)
            .filter(|j| self.visible(caller, j))
            .map(|_| JobDir::new(&self.state_dir, id).log_tail(bytes))
    }

    pub fn gpus(&self) -> Vec<GpuView> {
        let inner = self.lock();
        inner
            .gpus
            .iter()
            .map(|r| {
                let jobs = inner
                    .jobs
                    .values()
                    .filter(|j| j.state == JobState::Running && j.assigned.contains(&r.index))
                    .map(|j| j.id)
                    .collect();
                GpuView::new(r, jobs)
            })
            .collect()
    }

    /// Cancels a job: at once if it waits, by SIGTERM (then SIGKILL after the grace period) if
    /// it runs. `Err` if it has already ended or does not exist.
    pub fn cancel(&self, caller: User, id: u64) -> Result<JobView, CancelError> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        let job = inner
            .jobs
            .get_mut(&id)
            .filter(|j| self.visible(caller, j))
            .ok_or(CancelError::NoJob(id))?;
        if job.state.is_final() {
            return Err(CancelError::Ended {
                id,
                state: job.state,
            });
        }
        let t = now();
        if job.state.is_waiting() {
            inner.sched.remove(id);
            job.state = JobState::Cancelled;
            job.finished_at = Some(t);
            inner
                .store
                .transition(job, t, Some("cancelled while waiting"))?;
        } else {
            job.cancel_requested = true;
            inner.store.transition(job, t, Some("cancel requested"))?;
            // Recorded as cancelled when its supervisor records the end: every process gone.
            if let Some(procs) = JobDir::new(&self.state_dir, id).procs() {
                procs.signal(libc::SIGTERM);
            }
            inner.kill_at.insert(id, t + self.config.grace_s);
        }
        Ok(view(job))
    }

    /// One scheduling round: collect ended runs, read the GPUs, place waiting jobs.
    pub fn tick(&self) -> Result<(), StoreError> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        let t = now();
        self.reap(inner, t)?;
        self.observe(inner, t);
        self.probe(inner, t)?;
        self.place(inner, t)?;
        // At most a second of the store lives only in its WAL.
        if t - inner.checkpointed >= 1.0 {
            inner.store.checkpoint()?;
            inner.checkpointed = t;
        }
        Ok(())
    }

    /// Collects a finished probe into the profile, sizes again and queues the jobs it answers
    /// (and those that waited long enough), and starts a probe of what is still wanted on an
    /// idle GPU.
    fn probe(&self, inner: &mut Inner, t: f64) -> Result<(), StoreError> {
        let Some(prober) = self.prober.clone() else {
            return Ok(());
        };
        if inner.probing.is_none() && inner.probe_wait.is_empty() {
            return Ok(());
        }
        let mut note = None;
        if let Some(p) = &inner.probing {
            match p.result.try_recv() {
                Ok(Ok(report)) => {
                    // Probed once: what the GPU refused or the probe's time cut off is not
                    // asked again (the job is placed by its bound instead).
                    inner.probe_tried.extend(p.configs.iter().cloned());
                    let mut profile = self.profile.write().unwrap_or_else(|p| p.into_inner());
                    report.apply_workspaces(&mut profile);
                    // Kept for the next start; a failed write only loses the cache.
                    let _ = write_private(
                        &self.state_dir.join(PROBED_PROFILE),
                        profile.to_toml().as_bytes(),
                    );
                    inner.probing = None;
                }
                Ok(Err(e)) => {
                    note = Some(format!("probe failed: {e}; placed by its upper bound"));
                    inner.probing = None;
                }
                Err(mpsc::TryRecvError::Empty) => {}
                Err(mpsc::TryRecvError::Disconnected) => {
                    note = Some("probe failed; placed by its upper bound".to_string());
                    inner.probing = None;
                }
            }
        }
        let profile = self.profile();
        let table = profile.workspaces();
        let mut ready = Vec::new();
        for mut w in std::mem::take(&mut inner.probe_wait) {
            if !inner.jobs.get(&w.job).is_some_and(|j| j.state.is_waiting()) {
                continue; // cancelled while it waited
            }
            w.configs = table.unprobed(&w.trace);
            let untried = w.configs.iter().any(|c| !inner.probe_tried.contains(c));
            // A failed probe releases every waiting job: the next one would likely fail too.
            if !untried || t >= w.until || note.is_some() {
                ready.push(w);
            } else {
                inner.probe_wait.push(w);
            }
        }
        // Every ready job is queued even if the store refuses one (the first error is returned).
        let mut result = Ok(());
        for ProbeWait {
            job: id,
            trace,
            configs,
            ..
        } in ready
        {
            let probed = configs.is_empty();
            let job = inner.jobs.get_mut(&id).expect("a waiting job exists");
            if probed {
                if let Ok((peak, bound)) = size(&self.config, &profile, &trace) {
                    (job.estimate_bytes, job.bound_bytes) = (Some(peak), Some(bound));
                }
                job.error = None;
            } else {
                job.error = Some(note.clone().unwrap_or_else(|| format!("its convolutions could not all be probed within {} s; placed by its upper bound", self.config.probe_s)));
            }
            let why = if probed {
                "sized after probing its convolutions"
            } else {
                "placed by its upper bound"
            };
            queue(inner, id, t);
            let stored = inner.store.transition(&inner.jobs[&id], t, Some(why));
            result = result.and(stored);
        }
        if inner.probing.is_none() && !inner.probe_wait.is_empty() {
            let busy: Vec<u32> = inner
                .jobs
                .values()
                .filter(|j| matches!(j.state, JobState::Starting | JobState::Running))
                .flat_map(|j| j.assigned.clone())
                .collect();
            let idle = inner
                .gpus
                .iter()
                .map(|r| r.index)
                .find(|g| !busy.contains(g) && !inner.warm.contains_key(g));
            if let Some(gpu) = idle {
                let mut configs: Vec<(String, u64)> = inner
                    .probe_wait
                    .iter()
                    .flat_map(|w| w.configs.clone())
                    .filter(|c| !inner.probe_tried.contains(c))
                    .collect();
                configs.sort();
                configs.dedup();
                let seconds = inner
                    .probe_wait
                    .iter()
                    .map(|w| (w.until - t).max(1.0))
                    .fold(f64::INFINITY, f64::min)
                    .ceil() as u64;
                let (tx, rx) = mpsc::channel();
                let asked = configs.clone();
                std::thread::spawn(move || {
                    let _ = tx.send(prober.probe(gpu, &asked, seconds));
                });
                inner.probing = Some(Probing {
                    gpu,
                    configs,
                    result: rx,
                });
            }
        }
        result
    }

    /// Follows each active run: started, ended (its supervisor's exit record: every process
    /// gone), or on its own after its supervisor was killed — then tracked by its processes,
    /// leftovers killed once its leader ends, and finished when none is left. Never run again
    /// once its program may have started.
    fn reap(&self, inner: &mut Inner, t: f64) -> Result<(), StoreError> {
        let active: Vec<u64> = inner
            .jobs
            .values()
            .filter(|j| matches!(j.state, JobState::Starting | JobState::Running))
            .map(|j| j.id)
            .collect();
        for id in active {
            let dir = JobDir::new(&self.state_dir, id);
            // Our supervisor's end reaped (no zombie); what it means is read from the run's files.
            if let Some(child) = inner.children.get_mut(&id)
                && !matches!(child.try_wait(), Ok(None))
            {
                inner.children.remove(&id);
            }
            let job = inner.jobs.get_mut(&id).expect("active job exists");
            if job.state == JobState::Starting
                && let Some(pid) = dir.pid()
            {
                job.pid = Some(pid);
                job.state = JobState::Running;
                inner.store.transition(job, t, Some("running"))?;
            }
            if let Some(exit) = dir.exit() {
                self.finish(inner, id, Some(exit), &dir, t)?;
                continue;
            }
            let job = &inner.jobs[&id];
            let kill_due = inner
                .kill_at
                .get(&id)
                .is_some_and(|&deadline| t >= deadline);
            let supervised = inner.children.contains_key(&id)
                || job.pid.is_some_and(|pid| dir.supervised_by(pid));
            if supervised {
                if kill_due && let Some(p) = dir.procs() {
                    p.signal(libc::SIGKILL);
                }
                continue;
            }
            // The supervisor is gone without recording an end. Read after its death is known,
            // so whatever it wrote before dying is seen.
            let Some(procs) = dir.procs() else {
                // The program never started: the daemon died between recording the placement
                // and the start (no supervisor pid after 5 s), or the supervisor before it.
                let never = job.pid.is_some() || t - job.started_at.unwrap_or(t) > 5.0;
                if never {
                    self.lost(inner, id, t)?;
                }
                continue;
            };
            if procs.leader_running() {
                if kill_due {
                    procs.signal(libc::SIGKILL);
                }
            } else if procs.alive() {
                procs.signal(libc::SIGKILL); // what the ended job left behind
            } else if let Some(exit) = dir.exit() {
                self.finish(inner, id, Some(exit), &dir, t)?; // recorded just before it died
            } else {
                procs.remove_cgroup();
                self.finish(inner, id, None, &dir, t)?;
            }
        }
        Ok(())
    }

    /// A job whose program never started: requeued or failed, as `on_lost` says.
    fn lost(&self, inner: &mut Inner, id: u64, t: f64) -> Result<(), StoreError> {
        let note = "its supervisor vanished before the job started";
        let job = inner.jobs.get_mut(&id).expect("job exists");
        match self.config.on_lost {
            OnLost::Requeue => {
                job.assigned.clear();
                job.pid = None;
                job.error = Some(format!("requeued: {note}"));
                queue(inner, id, t);
            }
            OnLost::Fail => {
                job.state = JobState::Failed;
                job.finished_at = Some(t);
                job.error = Some(note.into());
            }
        }
        inner.store.transition(&inner.jobs[&id], t, Some(note))
    }

    /// Records the end of a run whose processes are all gone; `exit` is `None` where its
    /// supervisor was killed before it could record one.
    fn finish(
        &self,
        inner: &mut Inner,
        id: u64,
        exit: Option<Exit>,
        dir: &JobDir,
        t: f64,
    ) -> Result<(), StoreError> {
        inner.kill_at.remove(&id);
        inner.observed.remove(&id);
        let job = inner.jobs.get_mut(&id).expect("job exists");
        job.exit_code = exit.map(Exit::code);
        job.pid = None;
        let note = match exit {
            _ if job.cancel_requested => {
                job.state = JobState::Cancelled;
                "cancelled"
            }
            None => {
                // Not run again: it may have done its work.
                job.state = JobState::Failed;
                job.error = Some("its supervisor was killed, so its exit status is unknown (it ran once and is not run again)".into());
                "failed"
            }
            Some(e) if e.success() => {
                job.state = JobState::Finished;
                "finished"
            }
            Some(_) if dir.ran_out_of_memory() || inner.at_limit.contains(&id) => {
                inner.oom_crashes += 1;
                job.retries += 1;
                job.error = Some(format!(
                    "out of GPU memory on {:?}; re-running alone",
                    job.assigned
                ));
                // The scheduler decides: recovery (alone) or, past the retry limit, failure.
                queue(inner, id, t);
                "out of memory"
            }
            Some(e) => {
                job.state = JobState::Failed;
                let last = dir
                    .log_tail(4096)
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("")
                    .to_string();
                job.error = Some(format!("exit code {}: {last}", e.code()));
                "failed"
            }
        };
        let job = inner.jobs.get_mut(&id).expect("job exists");
        if job.state.is_final() {
            job.finished_at = Some(t);
        }
        inner.store.transition(job, t, Some(note))
    }

    /// Reads the GPUs (fake GPUs first learn what their jobs report) and each job's memory.
    fn observe(&self, inner: &mut Inner, t: f64) {
        let running: Vec<&JobRecord> = inner
            .jobs
            .values()
            .filter(|j| j.state == JobState::Running)
            .collect();
        let mut observed: HashMap<u64, u64> = HashMap::new();
        if let Some(fake) = &self.fake
            && let Ok(mut gpus) = fake.lock()
        {
            for g in gpus.iter_mut() {
                g.processes.clear();
            }
            for j in &running {
                let bytes: u64 =
                    std::fs::read_to_string(JobDir::new(&self.state_dir, j.id).fake_memory())
                        .ok()
                        .and_then(|s| s.trim().parse().ok())
                        .unwrap_or(0);
                observed.insert(j.id, bytes);
                for &g in &j.assigned {
                    if let Some(gpu) = gpus.get_mut(g as usize) {
                        gpu.processes.push((j.pid.unwrap_or(0), bytes));
                    }
                }
            }
        }
        // Real GPUs: a job's memory is that of its run's processes, found once per reading (a
        // scan of /proc) whatever the number of its GPUs.
        let run_pids: HashMap<u64, Vec<u32>> = match self.fake {
            Some(_) => HashMap::new(),
            None => running
                .iter()
                .map(|j| {
                    (
                        j.id,
                        JobDir::new(&self.state_dir, j.id)
                            .procs()
                            .map(|p| p.pids())
                            .unwrap_or_default(),
                    )
                })
                .collect(),
        };
        let mut readings = Vec::new();
        for g in 0..inner.monitor.gpu_count() as u32 {
            let Ok(r) = inner.monitor.read(g) else {
                continue;
            };
            if self.fake.is_none() {
                for j in &running {
                    if j.assigned.contains(&g) {
                        let pids = &run_pids[&j.id];
                        let mine: u64 = r
                            .processes
                            .iter()
                            .filter(|(pid, _)| pids.contains(pid))
                            .map(|p| p.1)
                            .sum();
                        let e = observed.entry(j.id).or_default();
                        *e = (*e).max(mine);
                    }
                }
            }
            readings.push(r);
        }
        let full: Vec<u32> = readings
            .iter()
            .filter(|r| at_memory_limit(r.used_bytes, r.total_bytes))
            .map(|r| r.index)
            .collect();
        let at_limit = running
            .iter()
            .filter(|j| j.assigned.iter().any(|g| full.contains(g)))
            .map(|j| j.id)
            .collect();
        for (id, bytes) in &observed {
            if let Some(j) = inner.jobs.get_mut(id) {
                j.peak_bytes = Some(j.peak_bytes.unwrap_or(0).max(*bytes));
            }
        }
        inner
            .warm
            .retain(|_, (job, until)| t < *until && observed.get(job).copied().unwrap_or(0) == 0);
        inner.at_limit = at_limit;
        inner.observed = observed;
        inner.gpus = readings;
    }

    /// Starts what the scheduler decides on the GPUs as read now.
    fn place(&self, inner: &mut Inner, t: f64) -> Result<(), StoreError> {
        let mut cluster = self.cluster(inner, t);
        let decisions = inner
            .sched
            .schedule(&mut cluster, t, &mut Stated(&inner.jobs));
        let mut result = Ok(());
        for d in decisions {
            if result.is_ok() {
                let gpus: Vec<u32> = d.gpus.iter().map(|&k| inner.gpus[k].index).collect();
                result = self.start(inner, d.job, &gpus, t);
            }
            if result.is_err() && inner.jobs[&d.job].state.is_waiting() {
                // Not started (the store refused its placement): back in line for the next tick.
                // A job whose start was recorded is never queued again here.
                queue(inner, d.job, t);
            }
        }
        result
    }

    /// The GPUs as the scheduler sees them: each job at what it shows (its bound while it
    /// warms up), other processes' memory as one more resident, CARMA's warm-up.
    fn cluster(&self, inner: &Inner, t: f64) -> Cluster {
        let mut cluster = Cluster::new(inner.gpus.iter().map(|r| r.total_bytes));
        for (k, r) in inner.gpus.iter().enumerate() {
            let gpu = &mut cluster.gpus[k];
            let mine: Vec<&JobRecord> = inner
                .jobs
                .values()
                .filter(|j| {
                    matches!(j.state, JobState::Starting | JobState::Running)
                        && j.assigned.contains(&r.index)
                })
                .collect();
            let n = mine.len().max(1) as f64;
            let load = Load {
                smact: r.dcgm.map_or(r.util, |d| d.smact) / n,
                smocc: r.dcgm.map_or(0.0, |d| d.smocc) / n,
                dram: r.dcgm.map_or(0.0, |d| d.dram) / n,
            };
            let mut ours = 0;
            for j in &mine {
                let used = inner.observed.get(&j.id).copied().unwrap_or(0);
                ours += used;
                gpu.residents.push(Resident {
                    job: j.id,
                    used_bytes: used,
                    bound_bytes: j.bound_bytes.or(j.estimate_bytes).unwrap_or(0),
                    warm_at_s: if used > 0 {
                        f64::NEG_INFINITY
                    } else {
                        j.started_at.unwrap_or(t) + self.config.warmup_s
                    },
                    load,
                    exclusive: inner.sched.alone(&placement_view(j), j.retries),
                });
            }
            // Memory of processes that are not the daemon's jobs (other users, the driver).
            let other = r.used_bytes.saturating_sub(ours);
            if other > 0 {
                gpu.residents.push(Resident {
                    job: u64::MAX - k as u64,
                    used_bytes: other,
                    bound_bytes: 0,
                    warm_at_s: f64::NEG_INFINITY,
                    load: Load::default(),
                    exclusive: false,
                });
            }
            if let Some(&(_, until)) = inner.warm.get(&r.index) {
                gpu.warm_until_s = until;
            }
            if inner.probing.as_ref().is_some_and(|p| p.gpu == r.index) {
                // The probe has it to itself: its measurements need a quiet GPU.
                gpu.residents.push(Resident {
                    job: u64::MAX - 1024 - k as u64,
                    used_bytes: r.total_bytes,
                    bound_bytes: 0,
                    warm_at_s: f64::NEG_INFINITY,
                    load: Load::default(),
                    exclusive: true,
                });
            }
        }
        cluster
    }

    fn start(&self, inner: &mut Inner, id: u64, gpus: &[u32], t: f64) -> Result<(), StoreError> {
        let dir = JobDir::new(&self.state_dir, id);
        let job = inner.jobs.get_mut(&id).expect("job exists");
        let mut placed = job.clone();
        placed.state = JobState::Starting;
        placed.assigned = gpus.to_vec();
        placed.started_at = Some(t);
        placed.pid = None;
        // Recorded before the process exists: after a crash of the daemon here, the job is
        // requeued (no pid file appears), never run twice.
        inner
            .store
            .transition(&placed, t, Some(&format!("placed on GPUs {gpus:?}")))?;
        *job = placed;
        let how = Supervision {
            cgroup: self.config.cgroups,
            run_as: self.user.is_root().then_some(job.owner),
            cwd: job.request.cwd.as_ref().map(PathBuf::from),
        };
        let launch_spec = Launch {
            request: &job.request,
            dir: &dir,
            gpus,
            job_id: id,
            attempt: job.retries + 1,
            fake: self.fake.is_some(),
            how,
        };
        match launch(&self.supervisor, &launch_spec) {
            Ok(child) => {
                job.pid = Some(child.id());
                inner.store.update(job)?;
                inner.children.insert(id, child);
                for &g in gpus {
                    inner.warm.insert(g, (id, t + self.config.warmup_s));
                }
            }
            Err(e) => {
                job.state = JobState::Failed;
                job.finished_at = Some(t);
                job.error = Some(e.to_string());
                inner.store.transition(job, t, Some("could not start"))?;
            }
        }
        Ok(())
    }

    /// Prometheus text exposition.
    pub fn metrics(&self) -> String {
        let inner = self.lock();
        let mut by_state: BTreeMap<&str, u64> = BTreeMap::new();
        for j in inner.jobs.values() {
            *by_state.entry(j.state.name()).or_default() += 1;
        }
        let mut out = String::new();
        let mut gauge = |name: &str, help: &str, lines: Vec<(String, f64)>| {
            out += &format!("# HELP {name} {help}\n# TYPE {name} gauge\n");
            for (labels, v) in lines {
                out += &format!("{name}{labels} {v}\n");
            }
        };
        let waiting = inner.jobs.values().filter(|j| j.state.is_waiting()).count();
        let running = inner
            .jobs
            .values()
            .filter(|j| j.state == JobState::Running)
            .count();
        gauge(
            "gpumem_queue_length",
            "Jobs waiting for GPUs.",
            vec![(String::new(), waiting as f64)],
        );
        gauge(
            "gpumem_running_jobs",
            "Jobs running.",
            vec![(String::new(), running as f64)],
        );
        gauge(
            "gpumem_jobs",
            "Jobs by state.",
            by_state
                .iter()
                .map(|(s, n)| (format!("{{state=\"{s}\"}}"), *n as f64))
                .collect(),
        );
        gauge(
            "gpumem_gpu_memory_used_bytes",
            "GPU memory in use.",
            inner
                .gpus
                .iter()
                .map(|g| (format!("{{gpu=\"{}\"}}", g.index), g.used_bytes as f64))
                .collect(),
        );
        gauge(
            "gpumem_gpu_memory_total_bytes",
            "GPU memory.",
            inner
                .gpus
                .iter()
                .map(|g| (format!("{{gpu=\"{}\"}}", g.index), g.total_bytes as f64))
                .collect(),
        );
        gauge(
            "gpumem_gpu_utilization",
            "NVML GPU utilization (0-1).",
            inner
                .gpus
                .iter()
                .map(|g| (format!("{{gpu=\"{}\"}}", g.index), g.util))
                .collect(),
        );
        gauge(
            "gpumem_gpu_smact",
            "DCGM SM activity (0-1).",
            inner
                .gpus
                .iter()
                .filter_map(|g| Some((format!("{{gpu=\"{}\"}}", g.index), g.dcgm?.smact)))
                .collect(),
        );
        out += &format!(
            "# HELP gpumem_oom_crashes_total Out-of-memory crashes seen.\n# TYPE gpumem_oom_crashes_total counter\ngpumem_oom_crashes_total {}\n",
            inner.oom_crashes
        );
        let errors: Vec<f64> = inner
            .jobs
            .values()
            .filter(|j| j.state == JobState::Finished)
            .filter_map(|j| {
                Some(
                    (j.estimate_bytes? as f64 - j.peak_bytes? as f64)
                        / (j.peak_bytes? as f64).max(1.0),
                )
            })
            .collect();
        let mean = if errors.is_empty() {
            0.0
        } else {
            errors.iter().map(|e| e.abs()).sum::<f64>() / errors.len() as f64
        };
        out += &format!(
            "# HELP gpumem_estimate_error_ratio Mean |estimate - peak| / peak of finished jobs.\n# TYPE gpumem_estimate_error_ratio gauge\ngpumem_estimate_error_ratio {mean}\n# HELP gpumem_estimated_finished_jobs Finished jobs with an estimate and a measured peak.\n# TYPE gpumem_estimated_finished_jobs gauge\ngpumem_estimated_finished_jobs {}\n",
            errors.len()
        );
        out
    }
}

/// Whether a GPU using `used` of `total` bytes is at its limit: less than 1% (at least 256 MiB)
/// free, where an allocation PyTorch cannot serve fails.
fn at_memory_limit(used: u64, total: u64) -> bool {
    used.saturating_add((total / 100).max(256 * MIB)) >= total
}

/// Hands the waiting job `id` to the scheduler (ties of priority in id order: submission);
/// its state follows the answer: queued, recovering, or failed past the retry limit.
fn queue(inner: &mut Inner, id: u64, t: f64) {
    let job = inner.jobs.get_mut(&id).expect("job exists");
    match inner.sched.enqueue(
        placement_view(job),
        job.request.priority,
        job.id,
        job.retries,
    ) {
        Queued::Waiting => job.state = JobState::Queued,
        Queued::Recovering => job.state = JobState::OomRecovering,
        Queued::Failed => {
            job.state = JobState::Failed;
            job.finished_at = Some(t);
            job.error = Some(format!("out of GPU memory {} times", job.retries));
        }
    }
}

/// What the scheduler sees of a job (it marks one that ran out of memory to run alone).
fn placement_view(j: &JobRecord) -> gpumem_place::Job {
    let memory = match (j.estimate_bytes, j.bound_bytes) {
        (Some(e), b) => Some(MemoryDemand {
            estimate_bytes: e,
            upper_bound_bytes: b.unwrap_or(e).max(e),
        }),
        _ => None,
    };
    gpumem_place::Job {
        id: j.id,
        gpus: j.request.gpus,
        memory,
        true_bytes: None,
        load: Load::default(),
        exclusive: false,
    }
}

/// Run times as submitters state them (`expected_s`): what backfilling goes by.
struct Stated<'a>(&'a BTreeMap<u64, JobRecord>);

impl Forecast for Stated<'_> {
    fn end_s(&self, job: u64) -> f64 {
        self.0
            .get(&job)
            .and_then(|j| Some(j.started_at? + j.request.expected_s?))
            .unwrap_or(f64::INFINITY)
    }
    fn run_s(&self, job: u64) -> Option<f64> {
        self.0.get(&job)?.request.expected_s
    }
}

/// The answer to a submission.
fn submitted(j: &JobRecord) -> Submitted {
    Submitted {
        id: j.id,
        state: j.state,
        estimate_mib: j.estimate_bytes.map(bytes_to_mib),
        bound_mib: j.bound_bytes.map(bytes_to_mib),
    }
}

fn view(j: &JobRecord) -> JobView {
    JobView {
        id: j.id,
        owner: j.owner.uid,
        state: j.state,
        request: j.request.clone(),
        assigned: j.assigned.clone(),
        estimate_mib: j.estimate_bytes.map(bytes_to_mib),
        bound_mib: j.bound_bytes.map(bytes_to_mib),
        peak_mib: j.peak_bytes.map(bytes_to_mib),
        submitted_at: j.submitted_at,
        started_at: j.started_at,
        finished_at: j.finished_at,
        exit_code: j.exit_code,
        retries: j.retries,
        error: j.error.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpumem_monitor::FakeMonitor;

    #[test]
    fn config_errors_are_one_line() {
        for (text, message) in [
            (
                "tick_ms = 18446744073709551615",
                "tick_ms = 18446744073709551615 is out of range (10..=60000)",
            ),
            (
                "headroom_mib = 18446744073709551615",
                "headroom_mib = 18446744073709551615 is out of range (0..=16777216)",
            ),
            (
                "warmup_s = inf",
                "warmup_s = inf is out of range (0..=86400 seconds)",
            ),
            (
                "grace_s = 1e308",
                &format!("grace_s = {} is out of range (0..=86400 seconds)", 1e308f64),
            ),
            (
                "grace_s = -1",
                "grace_s = -1 is out of range (0..=86400 seconds)",
            ),
            (
                "max_retries = 4000000000",
                "max_retries = 4000000000 is out of range (0..=100)",
            ),
            ("max_traces = 0", "max_traces = 0 is out of range (1..=64)"),
            (
                "probe_s = 3601",
                "probe_s = 3601 is out of range (0..=3600 seconds)",
            ),
        ] {
            assert_eq!(
                Config::from_toml(text).unwrap_err().to_string(),
                message,
                "{text}"
            );
        }
        let e = Config::from_toml("tick_ms = 5").unwrap_err();
        assert!(matches!(e, ConfigError::Range { key: "tick_ms", .. }));
        assert_eq!(e.to_string(), "tick_ms = 5 is out of range (10..=60000)");
        let e = Config::from_toml("policy = \"tetris\"").unwrap_err();
        assert!(
            matches!(e, ConfigError::Policy(_))
                && e.to_string().starts_with("unknown policy `tetris`"),
            "{e}"
        );
        let e = Config::from_toml("surprise = 1").unwrap_err();
        assert!(
            matches!(e, ConfigError::Toml(_))
                && e.to_string().contains("surprise")
                && !e.to_string().contains('\n'),
            "{e}"
        );
        assert!(matches!(
            Config::from_toml("estimator = \"learned\"").unwrap_err(),
            ConfigError::Estimator(_)
        ));
    }

    #[test]
    fn the_memory_limit_leaves_one_percent() {
        let gib = 1 << 30;
        assert!(
            at_memory_limit(80 * gib - 800 * MIB, 80 * gib) && !at_memory_limit(79 * gib, 80 * gib)
        );
        // At least 256 MiB on a small GPU; never an overflow.
        assert!(at_memory_limit(gib - 200 * MIB, gib) && !at_memory_limit(gib - 300 * MIB, gib));
        assert!(at_memory_limit(u64::MAX, u64::MAX));
    }

    #[test]
    fn ids_never_reuse_a_job_directory() {
        let dir = std::env::temp_dir().join(format!("gpumem-daemon-ids-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // Directories the store does not know: a lost WAL's last job, a store set aside.
        std::fs::create_dir_all(dir.join("jobs/7")).unwrap();
        std::fs::create_dir_all(dir.join("jobs.lost-100/12")).unwrap();
        let monitor = FakeMonitor::new(1, "fake", 40 << 30);
        let profile = gpumem_core::profile::builtin("a100-40gb").unwrap();
        let d = Daemon::open(
            &dir,
            Box::new(monitor),
            None,
            profile,
            Config::default(),
            "/nonexistent".into(),
            true,
        )
        .unwrap();
        let submit = || {
            d.submit(
                User::current(),
                serde_json::from_str(r#"{"command": ["true"]}"#).unwrap(),
                None,
            )
            .unwrap()
            .id
        };
        assert_eq!((submit(), submit()), (13, 14));
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn cancelling_says_why_not() {
        let dir = std::env::temp_dir().join(format!("gpumem-daemon-cancel-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let monitor = FakeMonitor::new(1, "fake", 40 << 30);
        let profile = gpumem_core::profile::builtin("a100-40gb").unwrap();
        let d = Daemon::open(
            &dir,
            Box::new(monitor),
            None,
            profile,
            Config::default(),
            "/nonexistent".into(),
            false,
        )
        .unwrap();
        let me = User::current();
        let id = d
            .submit(
                me,
                serde_json::from_str(r#"{"command": ["true"]}"#).unwrap(),
                None,
            )
            .unwrap()
            .id;
        // Another user neither sees nor cancels it (root and the daemon's own user see all).
        let other = User {
            uid: me.uid + 4242,
            gid: me.gid + 4242,
        };
        assert!(
            d.job(other, id).is_none()
                && d.jobs(other, None).is_empty()
                && d.log_tail(other, id, 10).is_none()
        );
        assert!(matches!(d.cancel(other, id), Err(CancelError::NoJob(_))));
        assert_eq!(d.job(me, id).unwrap().owner, me.uid);
        assert_eq!(d.cancel(me, id).unwrap().state, JobState::Cancelled);
        let e = d.cancel(me, id).unwrap_err();
        assert!(matches!(
            e,
            CancelError::Ended {
                state: JobState::Cancelled,
                ..
            }
        ));
        assert_eq!(
            e.to_string(),
            format!("job {id} has already ended (cancelled)")
        );
        let e = d.cancel(me, 99).unwrap_err();
        assert!(matches!(e, CancelError::NoJob(99)));
        assert_eq!(e.to_string(), "no job 99");
        std::fs::remove_dir_all(&dir).ok();
    }
}
