//! Runs as the tick follows them, by their files and processes (I/O, outside the ledger):
//! started (its supervisor's pid file), ended (its exit record: every process gone), or on its
//! own after its supervisor was killed — then tracked by its processes, leftovers killed once
//! its leader ends, and ended when none is left. And starting runs under a supervisor.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Child;

use crate::identity::User;
use crate::launcher::{Exit, JobDir, Launch, LaunchError, Supervision, launch};
use crate::ledger::RunEnd;
use crate::wire::{JobRequest, JobState};

/// An active job as the ledger last had it.
pub struct Active {
    pub id: u64,
    pub state: JobState,
    /// Its supervisor's pid, where recorded.
    pub pid: Option<u32>,
    pub started_at: Option<f64>,
    /// It was cancelled and its grace period is over.
    pub kill_due: bool,
}

/// What the files and processes of a run say happened.
pub enum Seen {
    /// Its supervisor recorded its pid: the program is starting.
    Started {
        pid: u32,
    },
    Ended(RunEnd),
    /// Its supervisor vanished before its program started.
    Lost,
}

/// Follows one active run: what happened since the last look, in order (a run may have started
/// and ended). Reaps the run's supervisor where this daemon started it, and SIGKILLs what is due
/// (a cancelled run past its grace, leftovers of an ended one).
pub fn follow(
    state_dir: &Path,
    children: &mut HashMap<u64, Child>,
    run: &Active,
    t: f64,
) -> Vec<Seen> {
    let id = run.id;
    let dir = JobDir::new(state_dir, id);
    let mut seen = Vec::new();
    // Our supervisor's end reaped (no zombie); what it means is read from the run's files.
    if let Some(child) = children.get_mut(&id)
        && !matches!(child.try_wait(), Ok(None))
    {
        children.remove(&id);
    }
    let mut pid = run.pid;
    if run.state == JobState::Starting
        && let Some(p) = dir.pid()
    {
        pid = Some(p);
        seen.push(Seen::Started { pid: p });
    }
    if let Some(exit) = dir.exit() {
        seen.push(Seen::Ended(ended(&dir, Some(exit))));
        return seen;
    }
    let supervised = children.contains_key(&id) || pid.is_some_and(|p| dir.supervised_by(p));
    if supervised {
        if run.kill_due
            && let Some(p) = dir.procs()
        {
            p.signal(libc::SIGKILL);
        }
        return seen;
    }
    // The supervisor is gone without recording an end. Read after its death is known, so
    // whatever it wrote before dying is seen.
    let Some(procs) = dir.procs() else {
        // The program never started: the daemon died between recording the placement and the
        // start (no supervisor pid after 5 s), or the supervisor before it.
        if pid.is_some() || t - run.started_at.unwrap_or(t) > 5.0 {
            seen.push(Seen::Lost);
        }
        return seen;
    };
    if procs.leader_running() {
        if run.kill_due {
            procs.signal(libc::SIGKILL);
        }
    } else if procs.alive() {
        procs.signal(libc::SIGKILL); // what the ended job left behind
    } else if let Some(exit) = dir.exit() {
        seen.push(Seen::Ended(ended(&dir, Some(exit)))); // recorded just before it died
    } else {
        procs.remove_cgroup();
        seen.push(Seen::Ended(ended(&dir, None)));
    }
    seen
}

/// A run's end as its files tell it (its log read only where it failed).
fn ended(dir: &JobDir, exit: Option<Exit>) -> RunEnd {
    let failed = exit.is_some_and(|e| !e.success());
    RunEnd {
        exit,
        oom_in_log: failed && dir.ran_out_of_memory(),
        last_line: match failed {
            true => dir
                .log_tail(4096)
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("")
                .to_string(),
            false => String::new(),
        },
    }
}

/// A run to start: a job the ledger recorded as starting on `gpus`.
pub struct Start {
    pub id: u64,
    pub gpus: Vec<u32>,
    pub request: JobRequest,
    pub owner: User,
    /// Its attempt (1 + its out-of-memory crashes).
    pub attempt: u32,
}

/// How the daemon starts runs.
pub struct Starter {
    pub state_dir: PathBuf,
    /// The `gpumem` binary that supervises runs.
    pub supervisor: PathBuf,
    /// Fake GPUs: the run reports its memory in a file.
    pub fake: bool,
    pub cgroups: bool,
    /// A daemon run by root starts each program as its owner.
    pub as_owner: bool,
}

impl Starter {
    /// Starts `s` under a supervisor of its own.
    pub fn start(&self, s: &Start) -> Result<Child, LaunchError> {
        let dir = JobDir::new(&self.state_dir, s.id);
        let how = Supervision {
            cgroup: self.cgroups,
            run_as: self.as_owner.then_some(s.owner),
            cwd: s.request.cwd.as_ref().map(PathBuf::from),
        };
        launch(
            &self.supervisor,
            &Launch {
                request: &s.request,
                dir: &dir,
                gpus: &s.gpus,
                job_id: s.id,
                attempt: s.attempt,
                fake: self.fake,
                how,
            },
        )
    }
}
