//! The daemon: what callers ask of it, and its scheduling tick.
//!
//! The jobs and their store are owned together by one [`Ledger`] behind a mutex held only for
//! memory work and the store's writes — never across reading files, /proc or the GPUs, nor
//! across starting or signalling processes. A caller's request takes it briefly (the API calls
//! these methods on tokio's blocking pool, never on its async threads). The tick owns what only
//! it touches — the monitor, the supervisors it started, the running probe — behind a mutex of
//! its own, and works in rounds: note what to look at under the ledger's lock, do the I/O
//! without it, then apply what it found as transitions (each written to the store first).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use gpumem_core::profile::GpuProfile;
use gpumem_core::units::bytes_to_mib;
use gpumem_monitor::{FakeGpus, Monitor};
use gpumem_place::Scheduler;
use gpumem_workload::Workload;

use crate::config::Config;
use crate::identity::{Admins, User};
use crate::launcher::JobDir;
use crate::ledger::Ledger;
use crate::lifecycle::{Event, PROBE_WAIT};
use crate::observe::{self, Observer};
use crate::probe::{Answer, ProbeWait, Prober, Probes};
use crate::runs::{self, Seen, Start, Starter};
use crate::sizing::{JobSize, JobSizeError, Sizer};
use crate::statedir::{self, DaemonError};
use crate::store::{JobRecord, StoreError};
use crate::wire::{GpuView, JobRequest, JobState, JobView, Submitted};

pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
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

/// A submission from a user a non-root daemon cannot run jobs as.
#[derive(Debug, thiserror::Error)]
#[error(
    "this daemon runs as {daemon} and can run jobs only as {daemon}, not as {user} (a daemon started by root runs each job as its submitter)"
)]
pub struct ForeignUser {
    pub user: String,
    pub daemon: String,
}

/// What only the tick touches.
struct Ticker {
    observer: Observer,
    /// Runs started by this daemon process (the others were re-attached after a restart).
    children: HashMap<u64, Child>,
    /// Probing, where the daemon probes.
    probes: Option<Probes>,
}

/// The daemon: jobs, GPUs, policy.
pub struct Daemon {
    ledger: Mutex<Ledger>,
    ticker: Mutex<Ticker>,
    /// The state directory's lock, held for the daemon's life (released when the file closes).
    _lock: std::fs::File,
    pub state_dir: PathBuf,
    starter: Starter,
    /// The GPU profile; the daemon's probes add to its workspace table (kept in
    /// STATE/profile.toml across restarts).
    profile: RwLock<GpuProfile>,
    sizer: Sizer,
    /// Whether the daemon probes (it has a prober).
    probes: bool,
    gpu_count: usize,
    pub config: Config,
    /// The user the daemon runs as: root runs each job as its owner, anyone else only their own.
    user: User,
    admins: Admins,
}

/// A lock whose holder panicked still guards consistent data: the ledger changes memory only
/// after the store has the change.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Daemon {
    /// Opens the state directory (creating it and taking its lock), loading every job it holds
    /// and queueing the waiting ones again. A store that holds no job beside job directories
    /// was lost or damaged: refused, unless `recover` (see [`statedir::open_store`]).
    pub fn open(
        state_dir: &Path,
        monitor: Box<dyn Monitor>,
        fake: Option<FakeGpus>,
        profile: GpuProfile,
        config: Config,
        supervisor: PathBuf,
        recover: bool,
    ) -> Result<Daemon, DaemonError> {
        let lock = statedir::lock(state_dir)?;
        let (store, jobs) = statedir::open_store(state_dir, recover, now())?;
        let resolved = config.resolve()?;
        let ledger = Ledger::open(store, jobs, Scheduler::new(resolved.sched), now())?;
        let profile = statedir::probed_profile(state_dir, profile)?;
        let user = User::current();
        let admins = Admins {
            daemon: user,
            group: config
                .admin_group
                .as_deref()
                .and_then(crate::identity::group_id),
        };
        let observer = Observer::new(monitor, fake.clone(), state_dir.to_path_buf());
        Ok(Daemon {
            ledger: Mutex::new(ledger),
            gpu_count: observer.gpu_count(),
            ticker: Mutex::new(Ticker {
                observer,
                children: HashMap::new(),
                probes: None,
            }),
            _lock: lock,
            state_dir: state_dir.to_path_buf(),
            starter: Starter {
                state_dir: state_dir.to_path_buf(),
                supervisor,
                fake: fake.is_some(),
                cgroups: config.cgroups,
                as_owner: user.is_root(),
            },
            profile: RwLock::new(profile),
            sizer: Sizer::new(resolved.estimator),
            probes: false,
            config,
            user,
            admins,
        })
    }

    /// Probes the convolutions of jobs the profile has not seen (with `probe_s` > 0).
    pub fn with_prober(mut self, prober: Arc<dyn Prober>) -> Self {
        let ticker = self.ticker.get_mut().unwrap_or_else(|p| p.into_inner());
        ticker.probes = Some(Probes::new(prober));
        self.probes = true;
        self
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        lock(&self.ledger)
    }

    /// The GPU profile jobs are sized on now.
    pub fn profile(&self) -> GpuProfile {
        self.profile
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Sizes a workload on the profile as it is now, with the configured estimator.
    pub fn size(&self, workload: &Workload) -> Result<JobSize, JobSizeError> {
        self.sizer.workload(&self.profile(), workload)
    }

    /// The GPUs the monitor had when the daemon opened.
    pub fn gpu_count(&self) -> usize {
        self.gpu_count
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
        let job = JobRecord::queued(owner, request, estimate, now());
        Ok(submitted(self.ledger().insert(job, true)?))
    }

    /// Stores a submission gpumem sized. One whose convolutions the profile lacks, where the
    /// daemon probes (`probe_s`), waits sized by its upper bound until a probe of them answers
    /// or `probe_s` passes, then joins the queue; any other is queued at once.
    pub fn submit_sized(
        &self,
        owner: User,
        request: JobRequest,
        sized: JobSize,
    ) -> Result<Submitted, StoreError> {
        if !self.probes || self.config.probe_s == 0 || sized.unprobed.is_empty() {
            return self.submit(owner, request, Some((sized.peak, sized.bound)));
        }
        let t = now();
        let mut job = JobRecord::queued(owner, request, Some((sized.bound, sized.bound)), t);
        job.error = Some(PROBE_WAIT.into());
        let mut ledger = self.ledger();
        let out = submitted(ledger.insert(job, false)?);
        ledger.probe_wait.push(ProbeWait {
            job: out.id,
            trace: sized.trace,
            configs: sized.unprobed,
            until: t + self.config.probe_s as f64,
        });
        Ok(out)
    }

    /// Whether `caller` may see (and cancel) `job`: its owner and the admins (`admin`: whether
    /// the caller is one, asked once, outside the ledger).
    fn visible(caller: User, admin: bool, job: &JobRecord) -> bool {
        admin || job.owner.uid == caller.uid
    }

    /// The jobs `caller` may see.
    pub fn jobs(&self, caller: User, state: Option<JobState>) -> Vec<JobView> {
        let admin = self.admins.contain(caller);
        self.ledger()
            .jobs()
            .filter(|j| state.is_none_or(|s| j.state == s) && Self::visible(caller, admin, j))
            .map(view)
            .collect()
    }

    pub fn job(&self, caller: User, id: u64) -> Option<JobView> {
        let admin = self.admins.contain(caller);
        self.ledger()
            .job(id)
            .filter(|j| Self::visible(caller, admin, j))
            .map(view)
    }

    /// The last `bytes` of a job's log (read after the ledger is let go).
    pub fn log_tail(&self, caller: User, id: u64, bytes: u64) -> Option<String> {
        self.job(caller, id)?;
        Some(JobDir::new(&self.state_dir, id).log_tail(bytes))
    }

    pub fn gpus(&self) -> Vec<GpuView> {
        let ledger = self.ledger();
        ledger
            .gpus
            .iter()
            .map(|r| {
                let jobs = ledger
                    .jobs()
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
        let admin = self.admins.contain(caller);
        let t = now();
        let (out, running) = {
            let mut ledger = self.ledger();
            let job = ledger
                .job(id)
                .filter(|j| Self::visible(caller, admin, j))
                .ok_or(CancelError::NoJob(id))?;
            if job.state.is_final() {
                return Err(CancelError::Ended {
                    id,
                    state: job.state,
                });
            }
            let running = !job.state.is_waiting();
            if running {
                ledger.apply(id, Event::CancelRequested, t)?;
                ledger.kill_at.insert(id, t + self.config.grace_s);
            } else {
                ledger.withdraw(id, t)?;
            }
            (view(ledger.job(id).expect("the job exists")), running)
        };
        // Recorded as cancelled when its supervisor records the end: every process gone.
        if running && let Some(procs) = JobDir::new(&self.state_dir, id).procs() {
            procs.signal(libc::SIGTERM);
        }
        Ok(out)
    }

    /// Prometheus text exposition.
    pub fn metrics(&self) -> String {
        crate::metrics::render(&self.ledger())
    }

    /// One scheduling round: collect ended runs, read the GPUs, probe, place waiting jobs.
    pub fn tick(&self) -> Result<(), StoreError> {
        let mut ticker = lock(&self.ticker);
        let t = now();
        self.reap(&mut ticker, t)?;
        self.observe(&mut ticker, t);
        self.probe(&mut ticker, t)?;
        self.place(&mut ticker, t)?;
        self.ledger().checkpoint(t)
    }

    /// Follows each active run by its files and processes, and records what happened. Never
    /// runs a job again once its program may have started.
    fn reap(&self, ticker: &mut Ticker, t: f64) -> Result<(), StoreError> {
        let active: Vec<runs::Active> = {
            let ledger = self.ledger();
            ledger
                .jobs()
                .filter(|j| matches!(j.state, JobState::Starting | JobState::Running))
                .map(|j| runs::Active {
                    id: j.id,
                    state: j.state,
                    pid: j.pid,
                    started_at: j.started_at,
                    kill_due: ledger.kill_at.get(&j.id).is_some_and(|&d| t >= d),
                })
                .collect()
        };
        for run in active {
            let seen = runs::follow(&self.state_dir, &mut ticker.children, &run, t);
            if seen.is_empty() {
                continue;
            }
            let mut ledger = self.ledger();
            for s in seen {
                match s {
                    Seen::Started { pid } => ledger.apply(run.id, Event::Started { pid }, t)?,
                    Seen::Ended(end) => ledger.end(run.id, end, t)?,
                    Seen::Lost => {
                        let requeue = self.config.on_lost == crate::config::OnLost::Requeue;
                        ledger.apply(run.id, Event::Lost { requeue }, t)?
                    }
                }
            }
        }
        Ok(())
    }

    /// Reads the GPUs and each running job's memory, and hands the reading to the ledger.
    fn observe(&self, ticker: &mut Ticker, t: f64) {
        let running: Vec<observe::Running> = self
            .ledger()
            .jobs()
            .filter(|j| j.state == JobState::Running)
            .map(|j| observe::Running {
                id: j.id,
                assigned: j.assigned.clone(),
                pid: j.pid,
            })
            .collect();
        let observation = ticker.observer.observe(&running);
        self.ledger().observed(observation, t);
    }

    /// Collects a finished probe into the profile, sizes again and queues the jobs it answers
    /// (and those that waited long enough), and starts a probe of what is still wanted on an
    /// idle GPU.
    fn probe(&self, ticker: &mut Ticker, t: f64) -> Result<(), StoreError> {
        let Some(probes) = &mut ticker.probes else {
            return Ok(());
        };
        let note = match probes.answer() {
            Answer::Pending => None,
            Answer::Measured(report) => {
                let profile = {
                    let mut profile = self.profile.write().unwrap_or_else(|p| p.into_inner());
                    report.apply_workspaces(&mut profile);
                    profile.clone()
                };
                // Kept for the next start; a failed write only loses the cache.
                let _ = statedir::save_probed_profile(&self.state_dir, &profile);
                None
            }
            Answer::Failed(note) => Some(note),
        };
        let waits: Vec<ProbeWait> = {
            let mut ledger = self.ledger();
            if probes.idle() && ledger.probe_wait.is_empty() {
                return Ok(());
            }
            let waits = std::mem::take(&mut ledger.probe_wait);
            // Those cancelled while they waited are dropped.
            waits
                .into_iter()
                .filter(|w| ledger.job(w.job).is_some_and(|j| j.state.is_waiting()))
                .collect()
        };
        let profile = self.profile();
        let table = profile.workspaces();
        let (mut ready, mut still) = (Vec::new(), Vec::new());
        for mut w in waits {
            w.configs = table.unprobed(&w.trace);
            // A failed probe releases every waiting job: the next one would likely fail too.
            if !probes.wanted(&w) || t >= w.until || note.is_some() {
                let event = match w.configs.is_empty() {
                    true => Event::Probed {
                        size: self.sizer.trace(&profile, &w.trace).ok(),
                    },
                    false => Event::Unprobed {
                        why: note.clone().unwrap_or_else(|| format!("its convolutions could not all be probed within {} s; placed by its upper bound", self.config.probe_s)),
                    },
                };
                ready.push((w.job, event));
            } else {
                still.push(w);
            }
        }
        let mut ledger = self.ledger();
        // Every ready job is queued even if the store refuses one (the first error is returned).
        let mut result = Ok(());
        for (id, event) in ready {
            if ledger.job(id).is_some_and(|j| j.state.is_waiting()) {
                result = result.and(ledger.apply(id, event, t));
            }
        }
        still.append(&mut ledger.probe_wait);
        ledger.probe_wait = still;
        if probes.idle() && !ledger.probe_wait.is_empty() {
            let busy = ledger.busy_gpus();
            let idle = ledger
                .gpus
                .iter()
                .map(|r| r.index)
                .find(|g| !busy.contains(g) && !ledger.warm.contains_key(g));
            if let Some(gpu) = idle {
                probes.start(gpu, &ledger.probe_wait, t);
            }
        }
        result
    }

    /// Starts what the scheduler decides on the GPUs as read now: each placement recorded
    /// first, the processes started after, outside the ledger.
    fn place(&self, ticker: &mut Ticker, t: f64) -> Result<(), StoreError> {
        let probing = ticker.probes.as_ref().and_then(Probes::gpu);
        let mut result = Ok(());
        let starts: Vec<Start> = {
            let mut ledger = self.ledger();
            let decisions = ledger.schedule(t, self.config.warmup_s, probing);
            let mut starts = Vec::new();
            for d in decisions {
                let gpus: Vec<u32> = d.gpus.iter().map(|&k| ledger.gpus[k].index).collect();
                if result.is_ok() {
                    // Recorded before the process exists: after a crash of the daemon here,
                    // the job is requeued (no pid file appears), never run twice.
                    result = ledger.apply(d.job, Event::Placed { gpus: gpus.clone() }, t);
                }
                let job = ledger.job(d.job).expect("a placed job exists");
                if job.state.is_waiting() {
                    // Not started (the store refused its placement): back in line for the next
                    // tick. A job whose start was recorded is never queued again here.
                    ledger.back_in_line(d.job);
                    continue;
                }
                starts.push(Start {
                    id: d.job,
                    gpus,
                    request: job.request.clone(),
                    owner: job.owner,
                    attempt: job.retries + 1,
                });
            }
            starts
        };
        let launched: Vec<_> = starts
            .into_iter()
            .map(|s| (self.starter.start(&s), s))
            .collect();
        let mut ledger = self.ledger();
        for (child, s) in launched {
            let stored = match child {
                Ok(child) => {
                    let pid = child.id();
                    ticker.children.insert(s.id, child);
                    for &g in &s.gpus {
                        ledger.warm.insert(g, (s.id, t + self.config.warmup_s));
                    }
                    ledger.apply(s.id, Event::Launched { pid }, t)
                }
                Err(e) => ledger.apply(
                    s.id,
                    Event::NotLaunched {
                        error: e.to_string(),
                    },
                    t,
                ),
            };
            result = result.and(stored);
        }
        result
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

    /// A job whose convolutions the profile lacks waits sized by its bound until the probe
    /// answers, then is sized again and queued; the measured table is kept for the next start.
    #[test]
    fn a_probe_sizes_a_waiting_job_again() {
        let dir = std::env::temp_dir().join(format!("gpumem-daemon-probe-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let monitor = FakeMonitor::new(1, "fake", 140 << 30);
        let profile = gpumem_core::profile::builtin("h200").unwrap();
        let config = Config {
            probe_s: 60,
            ..Config::default()
        };
        let prober = Arc::new(crate::probe::FakeProber { bytes: 100 << 20 });
        let d = Daemon::open(
            &dir,
            Box::new(monitor),
            None,
            profile,
            config,
            "/nonexistent".into(),
            false,
        )
        .unwrap()
        .with_prober(prober);
        let me = User::current();
        let workload = Workload::parse(
            "cnn:classes=10,filters=32,depth=2,input=32",
            4,
            Default::default(),
        )
        .unwrap();
        let size = d.size(&workload).unwrap();
        assert!(!size.unprobed.is_empty(), "a CNN has convolutions to probe");
        // Two GPUs on a one-GPU daemon: it stays queued once sized.
        let request = serde_json::from_str(r#"{"command": ["true"], "gpus": 2}"#).unwrap();
        let s = d.submit_sized(me, request, size).unwrap();
        assert_eq!(
            s.estimate_mib, s.bound_mib,
            "sized by its bound while it waits"
        );
        assert_eq!(d.job(me, s.id).unwrap().error.as_deref(), Some(PROBE_WAIT));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while d.job(me, s.id).unwrap().error.is_some() && std::time::Instant::now() < deadline {
            d.tick().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let j = d.job(me, s.id).unwrap();
        assert_eq!((j.state, j.error.as_deref()), (JobState::Queued, None));
        assert!(j.estimate_mib < j.bound_mib, "{j:?}");
        assert!(dir.join("profile.toml").exists());
        std::fs::remove_dir_all(&dir).ok();
    }
}
