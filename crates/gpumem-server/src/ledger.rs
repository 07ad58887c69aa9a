//! The ledger: the job store and the jobs in memory, owned together. Every change of a job goes
//! through [`Ledger::apply`], which writes the record [`lifecycle::next`] gives to the store
//! first and only then to memory; a store that refuses leaves memory as it was (the scheduler's
//! queue, whose answer a requeue needs, is put back). Beside the jobs it keeps what the daemon
//! last saw of the GPUs and runs, and builds the scheduler's view of them. It does no I/O but
//! the store's: the daemon reads files, processes and GPUs outside it.

use std::collections::{BTreeMap, HashMap, HashSet};

use gpumem_monitor::GpuReading;
use gpumem_place::{Cluster, Decision, Forecast, Load, MemoryDemand, Resident, Scheduler};

use crate::launcher::Exit;
use crate::lifecycle::{self, Ending, Event, Record};
use crate::observe::Observation;
use crate::probe::ProbeWait;
use crate::store::{JobRecord, Store, StoreError};
use crate::wire::JobState;

/// How a run ended, as its files say (read outside the ledger).
pub struct RunEnd {
    /// `None`: its supervisor was killed before it could record one.
    pub exit: Option<Exit>,
    /// Its log shows an out-of-memory error.
    pub oom_in_log: bool,
    /// The last line of its log.
    pub last_line: String,
}

pub struct Ledger {
    store: Store,
    jobs: BTreeMap<u64, JobRecord>,
    /// The waiting jobs, in the order and under the rules of gpumem-place's scheduler.
    sched: Scheduler,
    /// Cancelled runs: when to send SIGKILL.
    pub kill_at: HashMap<u64, f64>,
    /// The GPUs as last read (those the monitor could read).
    pub gpus: Vec<GpuReading>,
    /// Memory each running job shows now (per GPU).
    observed: HashMap<u64, u64>,
    /// GPU → (job, until): not offered while that job's memory has not shown up.
    pub warm: HashMap<u32, (u64, f64)>,
    /// Running jobs one of whose GPUs was at its memory limit at the last reading: a crash
    /// now is out-of-memory whatever its log says.
    at_limit: HashSet<u64>,
    pub oom_crashes: u64,
    /// Submissions waiting for a probe of their convolutions (stored as queued, not yet in the
    /// scheduler's queue).
    pub probe_wait: Vec<ProbeWait>,
    /// When the store's WAL was last copied into its database file.
    checkpointed: f64,
}

impl Ledger {
    /// The ledger of a store's jobs; the waiting ones are handed to `sched` again.
    pub fn open(
        store: Store,
        jobs: Vec<JobRecord>,
        sched: Scheduler,
        t: f64,
    ) -> Result<Ledger, StoreError> {
        let mut ledger = Ledger {
            store,
            jobs: jobs.into_iter().map(|j| (j.id, j)).collect(),
            sched,
            kill_at: HashMap::new(),
            gpus: Vec::new(),
            observed: HashMap::new(),
            warm: HashMap::new(),
            at_limit: HashSet::new(),
            oom_crashes: 0,
            probe_wait: Vec::new(),
            checkpointed: 0.0,
        };
        let waiting: Vec<u64> = ledger
            .jobs
            .values()
            .filter(|j| j.state.is_waiting())
            .map(|j| j.id)
            .collect();
        for id in waiting {
            ledger.apply(id, Event::Restored, t)?;
        }
        Ok(ledger)
    }

    pub fn jobs(&self) -> impl Iterator<Item = &JobRecord> {
        self.jobs.values()
    }

    pub fn job(&self, id: u64) -> Option<&JobRecord> {
        self.jobs.get(&id)
    }

    /// Stores a new submission (its id from the store) and, unless it waits for a probe, hands
    /// it to the scheduler.
    pub fn insert(&mut self, mut job: JobRecord, queue: bool) -> Result<&JobRecord, StoreError> {
        job.id = self.store.insert(&job)?;
        let id = job.id;
        if queue {
            // A new job has no crash: the scheduler queues it.
            self.sched.enqueue(
                placement_view(&job),
                job.request.priority,
                job.id,
                job.retries,
            );
        }
        Ok(self.jobs.entry(id).or_insert(job))
    }

    /// Moves job `id` by `event`: the store first, then memory.
    pub fn apply(&mut self, id: u64, event: Event, t: f64) -> Result<(), StoreError> {
        let Ledger { jobs, sched, .. } = self;
        let job = jobs.get(&id).expect("the job exists");
        let mut enqueued = false;
        let next = lifecycle::next(job, event, t, &mut |j| {
            enqueued = true;
            sched.enqueue(placement_view(j), j.request.priority, j.id, j.retries)
        });
        let stored = match next.record {
            Record::Transition => self.store.transition(&next.job, t, next.note.as_deref()),
            Record::Update => self.store.update(&next.job),
            Record::Nothing => Ok(()),
        };
        if let Err(e) = stored {
            if enqueued {
                self.sched.remove(id);
            }
            return Err(e);
        }
        self.jobs.insert(id, next.job);
        Ok(())
    }

    /// Cancels a waiting job (out of the scheduler's queue once the store has it).
    pub fn withdraw(&mut self, id: u64, t: f64) -> Result<(), StoreError> {
        self.apply(id, Event::Withdrawn, t)?;
        self.sched.remove(id);
        Ok(())
    }

    /// Records the end of a run: cancelled if that was asked, out of memory if its log says so
    /// or its GPU was at its limit, else as its exit status says.
    pub fn end(&mut self, id: u64, end: RunEnd, t: f64) -> Result<(), StoreError> {
        let job = &self.jobs[&id];
        let how = match end.exit {
            _ if job.cancel_requested => Ending::Cancelled,
            None => Ending::Unknown,
            Some(e) if e.success() => Ending::Succeeded,
            Some(_) if end.oom_in_log || self.at_limit.contains(&id) => Ending::OutOfMemory,
            Some(_) => Ending::Failed {
                last_line: end.last_line,
            },
        };
        let oom = how == Ending::OutOfMemory;
        self.apply(
            id,
            Event::Ended {
                exit: end.exit,
                how,
            },
            t,
        )?;
        self.kill_at.remove(&id);
        self.observed.remove(&id);
        if oom {
            self.oom_crashes += 1;
        }
        Ok(())
    }

    /// Puts a job the scheduler took but that could not be placed back in line (its state has
    /// not changed).
    pub fn back_in_line(&mut self, id: u64) {
        let j = &self.jobs[&id];
        self.sched
            .enqueue(placement_view(j), j.request.priority, j.id, j.retries);
    }

    /// Takes in a reading of the GPUs and of each running job's memory: peaks, what is at its
    /// limit, and which GPUs still warm up.
    pub fn observed(&mut self, o: Observation, t: f64) {
        for (id, bytes) in &o.jobs {
            if let Some(j) = self.jobs.get_mut(id) {
                j.peak_bytes = Some(j.peak_bytes.unwrap_or(0).max(*bytes));
            }
        }
        let observed = &o.jobs;
        self.warm
            .retain(|_, (job, until)| t < *until && observed.get(job).copied().unwrap_or(0) == 0);
        self.at_limit = o.at_limit;
        self.observed = o.jobs;
        self.gpus = o.gpus;
    }

    /// GPUs given to jobs starting or running.
    pub fn busy_gpus(&self) -> Vec<u32> {
        self.jobs
            .values()
            .filter(|j| matches!(j.state, JobState::Starting | JobState::Running))
            .flat_map(|j| j.assigned.clone())
            .collect()
    }

    /// What the scheduler decides on the GPUs as last read (the jobs it starts leave its queue).
    pub fn schedule(&mut self, t: f64, warmup_s: f64, probing: Option<u32>) -> Vec<Decision> {
        let mut cluster = self.cluster(t, warmup_s, probing);
        self.sched
            .schedule(&mut cluster, t, &mut Stated(&self.jobs))
    }

    /// The GPUs as the scheduler sees them: each job at what it shows (its bound while it
    /// warms up), other processes' memory as one more resident, CARMA's warm-up, and the GPU a
    /// probe has to itself.
    fn cluster(&self, t: f64, warmup_s: f64, probing: Option<u32>) -> Cluster {
        let mut cluster = Cluster::new(self.gpus.iter().map(|r| r.total_bytes));
        for (k, r) in self.gpus.iter().enumerate() {
            let gpu = &mut cluster.gpus[k];
            let mine: Vec<&JobRecord> = self
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
                let used = self.observed.get(&j.id).copied().unwrap_or(0);
                ours += used;
                gpu.residents.push(Resident {
                    job: j.id,
                    used_bytes: used,
                    bound_bytes: j.bound_bytes.or(j.estimate_bytes).unwrap_or(0),
                    warm_at_s: if used > 0 {
                        f64::NEG_INFINITY
                    } else {
                        j.started_at.unwrap_or(t) + warmup_s
                    },
                    load,
                    exclusive: self.sched.alone(&placement_view(j), j.retries),
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
            if let Some(&(_, until)) = self.warm.get(&r.index) {
                gpu.warm_until_s = until;
            }
            if probing == Some(r.index) {
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

    /// Copies the store's WAL into its database file at most once a second, so at most a
    /// second of the store lives only in its WAL.
    pub fn checkpoint(&mut self, t: f64) -> Result<(), StoreError> {
        if t - self.checkpointed >= 1.0 {
            self.store.checkpoint()?;
            self.checkpointed = t;
        }
        Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::User;

    /// A transition the store refuses changes nothing in memory: not the job, not the
    /// scheduler's queue its requeue went into.
    #[test]
    fn a_refused_write_changes_nothing() {
        let path = std::env::temp_dir().join(format!("gpumem-ledger-{}.db", std::process::id()));
        let clean = || {
            for f in crate::store::files(&path) {
                let _ = std::fs::remove_file(f);
            }
        };
        clean();
        let sched = Scheduler::new(crate::Config::default().sched().unwrap());
        let mut ledger = Ledger::open(Store::open(&path).unwrap(), Vec::new(), sched, 0.0).unwrap();
        let job = JobRecord::queued(
            User { uid: 1, gid: 1 },
            serde_json::from_str(r#"{"command": ["true"]}"#).unwrap(),
            Some((1 << 30, 1 << 30)),
            0.0,
        );
        let id = ledger.insert(job, true).unwrap().id;
        assert!(ledger.sched.contains(id));
        ledger.sched.remove(id); // as the scheduler does when it places a job
        ledger
            .apply(id, Event::Placed { gpus: vec![0] }, 1.0)
            .unwrap();
        let starting = ledger.job(id).unwrap().clone();
        assert_eq!(starting.state, JobState::Starting);
        rusqlite::Connection::open(&path)
            .unwrap()
            .execute_batch("DROP TABLE events")
            .unwrap();
        assert!(
            ledger
                .apply(id, Event::Lost { requeue: true }, 9.0)
                .is_err()
        );
        assert_eq!(ledger.job(id), Some(&starting));
        assert!(!ledger.sched.contains(id), "the requeue is taken back");
        clean();
    }
}
