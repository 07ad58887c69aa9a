//! A job's life as a state machine: the [`Event`]s that move a job, and in one function
//! ([`next`]) what each does to its record and what its history records. Pure: the
//! [`Ledger`](crate::ledger::Ledger) writes the record `next` returns to the store, and only
//! then to memory.
//!
//! ```text
//! queued ─┬─ Placed ──> starting ── Started ──> running ── Ended ──> finished | failed | cancelled
//!         │                │  └ NotLaunched ──> failed        │ └ Ended(out of memory) ──> oom-recovering (or failed)
//!         │                └──── Lost ──> queued (or failed) ─┘
//!         └─ Withdrawn ──> cancelled
//! ```

use gpumem_place::Queued;

use crate::launcher::Exit;
use crate::store::JobRecord;
use crate::wire::JobState;

/// Why a submission waiting for a probe is sized by its bound meanwhile (its error until then).
pub const PROBE_WAIT: &str =
    "waiting for a probe of its convolutions; sized by its upper bound meanwhile";

/// What happens to a job.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The daemon restarted: a waiting job rejoins the queue.
    Restored,
    /// A probe measured its convolutions: sized again (`None` where sizing failed), queued.
    Probed { size: Option<(u64, u64)> },
    /// No probe answers for it (`why`): queued sized by its upper bound.
    Unprobed { why: String },
    /// The scheduler gave it these GPUs: recorded before its process exists.
    Placed { gpus: Vec<u32> },
    /// Its supervisor started (not a change of state: its pid is kept).
    Launched { pid: u32 },
    /// Its supervisor could not be started.
    NotLaunched { error: String },
    /// Its supervisor recorded its pid: the program is starting.
    Started { pid: u32 },
    /// Cancelled while it waited.
    Withdrawn,
    /// Cancellation asked for while it runs (it ends as cancelled once its processes are gone).
    CancelRequested,
    /// Its run ended: every process of it gone. `exit` is `None` where its supervisor was killed
    /// before it could record one.
    Ended { exit: Option<Exit>, how: Ending },
    /// Its supervisor vanished before its program started: requeued, or failed (`on_lost`).
    Lost { requeue: bool },
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Ending {
    /// Cancellation was asked for.
    Cancelled,
    /// Its supervisor was killed: exit status unknown, never run again.
    Unknown,
    Succeeded,
    /// It ran out of GPU memory: re-run alone, up to the retry limit.
    OutOfMemory,
    /// Any other failure, with the last line of its log.
    Failed {
        last_line: String,
    },
}

/// How the store records a job's next record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// A transition: the record and a history entry, atomically.
    Transition,
    /// The record's fields only.
    Update,
    /// Nothing changed.
    Nothing,
}

/// A job's record after an event, the note its history entry carries, and how it is stored.
pub struct Next {
    pub job: JobRecord,
    pub note: Option<String>,
    pub record: Record,
}

impl Event {
    /// Whether the event can happen to a job in `state`.
    pub fn from(&self, state: JobState) -> bool {
        match self {
            Event::Restored
            | Event::Probed { .. }
            | Event::Unprobed { .. }
            | Event::Placed { .. }
            | Event::Withdrawn => state.is_waiting(),
            Event::Launched { .. } | Event::NotLaunched { .. } | Event::Started { .. } => {
                state == JobState::Starting
            }
            Event::CancelRequested | Event::Ended { .. } | Event::Lost { .. } => {
                matches!(state, JobState::Starting | JobState::Running)
            }
        }
    }
}

enum Kind {
    Restored,
    Launched,
    Other,
}

const LOST: &str = "its supervisor vanished before the job started";

/// `job` after `event` at `t`. Where the event puts the job (back) in line, `enqueue` hands it
/// to the scheduler, whose answer sets its state: queued, recovering, or failed past the retry
/// limit. A job entering a final state finishes at `t`.
pub fn next(
    job: &JobRecord,
    event: Event,
    t: f64,
    enqueue: &mut dyn FnMut(&JobRecord) -> Queued,
) -> Next {
    debug_assert!(event.from(job.state), "{event:?} from {:?}", job.state);
    let kind = match event {
        Event::Restored => Kind::Restored,
        Event::Launched { .. } => Kind::Launched,
        _ => Kind::Other,
    };
    let mut j = job.clone();
    let mut queue = |j: &mut JobRecord| match enqueue(j) {
        Queued::Waiting => j.state = JobState::Queued,
        Queued::Recovering => j.state = JobState::OomRecovering,
        Queued::Failed => {
            j.state = JobState::Failed;
            j.error = Some(format!("out of GPU memory {} times", j.retries));
        }
    };
    let note: Option<String> = match event {
        Event::Restored => {
            // A probe it waited for died with the daemon before: it is placed by its bound.
            if j.error.as_deref() == Some(PROBE_WAIT) {
                j.error = None;
            }
            queue(&mut j);
            j.error.clone()
        }
        Event::Probed { size } => {
            if let Some((peak, bound)) = size {
                (j.estimate_bytes, j.bound_bytes) = (Some(peak), Some(bound));
            }
            j.error = None;
            queue(&mut j);
            Some("sized after probing its convolutions".into())
        }
        Event::Unprobed { why } => {
            j.error = Some(why);
            queue(&mut j);
            Some("placed by its upper bound".into())
        }
        Event::Placed { gpus } => {
            j.state = JobState::Starting;
            j.started_at = Some(t);
            j.pid = None;
            let note = format!("placed on GPUs {gpus:?}");
            j.assigned = gpus;
            Some(note)
        }
        Event::Launched { pid } => {
            j.pid = Some(pid);
            None
        }
        Event::NotLaunched { error } => {
            j.state = JobState::Failed;
            j.error = Some(error);
            Some("could not start".into())
        }
        Event::Started { pid } => {
            j.pid = Some(pid);
            j.state = JobState::Running;
            Some("running".into())
        }
        Event::Withdrawn => {
            j.state = JobState::Cancelled;
            Some("cancelled while waiting".into())
        }
        Event::CancelRequested => {
            j.cancel_requested = true;
            Some("cancel requested".into())
        }
        Event::Ended { exit, how } => {
            j.exit_code = exit.map(Exit::code);
            j.pid = None;
            Some(match how {
                Ending::Cancelled => {
                    j.state = JobState::Cancelled;
                    "cancelled".into()
                }
                Ending::Unknown => {
                    j.state = JobState::Failed;
                    j.error = Some("its supervisor was killed, so its exit status is unknown (it ran once and is not run again)".into());
                    "failed".into()
                }
                Ending::Succeeded => {
                    j.state = JobState::Finished;
                    "finished".into()
                }
                Ending::OutOfMemory => {
                    j.retries += 1;
                    j.error = Some(format!(
                        "out of GPU memory on {:?}; re-running alone",
                        j.assigned
                    ));
                    // The scheduler decides: recovery (alone) or, past the retry limit, failure.
                    queue(&mut j);
                    "out of memory".into()
                }
                Ending::Failed { last_line } => {
                    j.state = JobState::Failed;
                    let code = j.exit_code.unwrap_or_default();
                    j.error = Some(format!("exit code {code}: {last_line}"));
                    "failed".into()
                }
            })
        }
        Event::Lost { requeue: true } => {
            j.assigned.clear();
            j.pid = None;
            j.error = Some(format!("requeued: {LOST}"));
            queue(&mut j);
            Some(LOST.into())
        }
        Event::Lost { requeue: false } => {
            j.state = JobState::Failed;
            j.error = Some(LOST.into());
            Some(LOST.into())
        }
    };
    if j.state.is_final() && !job.state.is_final() {
        j.finished_at = Some(t);
    }
    // A restart's requeue is recorded only where it changes the job; a launch keeps its pid
    // without a history entry; every other event is a transition, even within one state.
    let record = match kind {
        Kind::Launched => Record::Update,
        Kind::Restored if j.state == job.state => match j == *job {
            true => Record::Nothing,
            false => Record::Update,
        },
        _ => Record::Transition,
    };
    Next {
        job: j,
        note,
        record,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::User;

    fn job() -> JobRecord {
        let mut j = JobRecord::queued(
            User { uid: 1, gid: 1 },
            serde_json::from_str(r#"{"command": ["true"]}"#).unwrap(),
            Some((1 << 30, 2 << 30)),
            1.0,
        );
        j.id = 7;
        j
    }

    fn no_queue(_: &JobRecord) -> Queued {
        panic!("not queued")
    }

    /// A run out of memory is queued again by the scheduler's answer; past the retry limit it
    /// fails, finished then, with the retry count as its error.
    #[test]
    fn out_of_memory_is_recovered_then_failed() {
        let placed = next(&job(), Event::Placed { gpus: vec![2] }, 2.0, &mut no_queue);
        assert_eq!(
            (placed.job.state, placed.job.started_at, placed.record),
            (JobState::Starting, Some(2.0), Record::Transition)
        );
        assert_eq!(placed.note.as_deref(), Some("placed on GPUs [2]"));
        let launched = next(&placed.job, Event::Launched { pid: 9 }, 2.0, &mut no_queue);
        assert_eq!(
            (launched.job.pid, launched.record),
            (Some(9), Record::Update)
        );
        let running = next(&launched.job, Event::Started { pid: 9 }, 3.0, &mut no_queue);
        let oom = Event::Ended {
            exit: Some(Exit::Code(1)),
            how: Ending::OutOfMemory,
        };
        let crashes = |verdict| {
            let mut asked = None;
            let n = next(&running.job, oom.clone(), 4.0, &mut |j| {
                asked = Some(j.retries);
                verdict
            });
            assert_eq!(asked, Some(1), "the scheduler counts the new crash");
            n
        };
        let again = crashes(Queued::Recovering);
        assert_eq!(again.job.state, JobState::OomRecovering);
        assert_eq!(
            (again.job.retries, again.job.pid, again.job.exit_code),
            (1, None, Some(1))
        );
        assert_eq!(
            again.job.error.as_deref(),
            Some("out of GPU memory on [2]; re-running alone")
        );
        assert_eq!(again.job.finished_at, None);
        let failed = crashes(Queued::Failed);
        assert_eq!(failed.job.state, JobState::Failed);
        assert_eq!(failed.job.finished_at, Some(4.0));
        assert_eq!(
            failed.job.error.as_deref(),
            Some("out of GPU memory 1 times")
        );
        assert_eq!(failed.note.as_deref(), Some("out of memory"));
    }

    #[test]
    fn a_restart_records_only_what_it_changes() {
        let same = next(&job(), Event::Restored, 5.0, &mut |_| Queued::Waiting);
        assert_eq!(same.record, Record::Nothing);
        let mut waited = job();
        waited.error = Some(PROBE_WAIT.into());
        let cleared = next(&waited, Event::Restored, 5.0, &mut |_| Queued::Waiting);
        assert_eq!((cleared.record, cleared.job), (Record::Update, job()));
        let failed = next(&job(), Event::Restored, 5.0, &mut |_| Queued::Failed);
        assert_eq!(failed.record, Record::Transition);
        assert_eq!(failed.note, failed.job.error);
    }

    #[test]
    fn events_name_the_states_they_leave() {
        assert!(Event::Withdrawn.from(JobState::OomRecovering));
        assert!(!Event::Withdrawn.from(JobState::Running));
        assert!(Event::CancelRequested.from(JobState::Starting));
        assert!(!Event::Started { pid: 1 }.from(JobState::Running));
        assert!(!Event::Lost { requeue: true }.from(JobState::Finished));
    }
}
