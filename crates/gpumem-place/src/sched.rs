//! The scheduler: which waiting jobs start now, and on which GPUs.
//!
//! One [`Scheduler`] holds the waiting jobs and the rules that order them; the simulator drives
//! it at simulated time and the daemon at real time, so both place the same jobs the same way.
//! The rules:
//! - **Order**: the recovery queue first (jobs that ran out of memory, in the order they
//!   crashed), then the queue; within each, higher priority first, ties in submission order.
//! - **Recovery**: a job that ran out of memory waits in the recovery queue and runs alone from
//!   then on (CARMA's rule), at most `max_retries` times; one more crash and it fails.
//! - **Head-of-line blocking**: jobs start in order until the first that cannot start now (the
//!   head); the ones behind it wait too.
//! - **EASY backfill** (optional): the head gets a reservation — the GPUs it will get once
//!   enough running jobs end, in their predicted order; later jobs start now on other GPUs, or
//!   on reserved ones only if they end before the reservation without slowing anyone there, so
//!   the head is never delayed. With a reservation at an unknown time (a running job without a
//!   predicted end), later jobs use only GPUs the head does not need.
//!
//! Pure: no clock (the caller passes `now_s`), no I/O; memory in integer bytes. The caller owns
//! the [`Cluster`] (the simulator's truth, or the daemon's reading of its monitor) and a
//! [`Forecast`] of run times; [`Scheduler::schedule`] assigns the jobs it starts on the cluster
//! and returns its [`Decision`]s, which the caller carries out (starting processes, or
//! simulated runs).

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};

use crate::{Cluster, Job, Load, Policy};

/// How the scheduler works.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SchedOptions {
    pub policy: Policy,
    /// EASY backfilling behind a head that must wait.
    pub backfill: bool,
    /// Re-runs after out-of-memory crashes before a job fails.
    pub max_retries: u32,
    /// A GPU just given a job is not offered again for this long (CARMA: 30 s).
    pub warmup_s: f64,
}

impl SchedOptions {
    pub fn new(policy: Policy) -> Self {
        SchedOptions {
            policy,
            backfill: false,
            max_retries: 3,
            warmup_s: 30.0,
        }
    }
}

/// Where [`Scheduler::enqueue`] put a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Queued {
    /// In the queue.
    Waiting,
    /// In the recovery queue, to run alone.
    Recovering,
    /// Not queued: it ran out of memory more than `max_retries` times.
    Failed,
}

/// A job to start now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub job: u64,
    pub gpus: Vec<usize>,
    /// No other job may join it on its GPUs while it runs.
    pub alone: bool,
    /// Started behind a head that must wait.
    pub backfilled: bool,
}

/// What the caller knows about time; only backfilling asks.
pub trait Forecast {
    /// When running job `job` is expected to end (`f64::INFINITY` when unknown).
    fn end_s(&self, job: u64) -> f64;
    /// How long waiting job `job` runs alone, if known.
    fn run_s(&self, job: u64) -> Option<f64>;
    /// Whether jobs with these solo loads, together on one GPU, run slower than alone. By
    /// default: when their summed pressure exceeds 1.
    fn slows(&self, loads: &[Load]) -> bool {
        loads
            .iter()
            .fold(Load::default(), |a, &l| a.plus(l))
            .pressure()
            > 1.0
    }
    /// Called as each decision is made, after the job is assigned on `cluster` and before the
    /// next decision: a caller whose forecasts depend on what runs where (the simulator's
    /// interference rates) carries it out here. Callers that carry out the returned list need
    /// nothing here.
    fn placed(&mut self, _decision: &Decision, _cluster: &Cluster, _now_s: f64) {}
}

/// A forecast that knows nothing: backfilling then uses only GPUs a waiting head does not need.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoForecast;

impl Forecast for NoForecast {
    fn end_s(&self, _job: u64) -> f64 {
        f64::INFINITY
    }
    fn run_s(&self, _job: u64) -> Option<f64> {
        None
    }
}

/// Queue position: recovery first, higher priority first, then submission (or crash) order; the
/// job id keeps keys unique.
type Key = (bool, Reverse<i32>, u64, u64);

/// The waiting jobs and the rules that start them.
#[derive(Debug, Clone)]
pub struct Scheduler {
    opts: SchedOptions,
    waiting: BTreeMap<Key, Job>,
    keys: HashMap<u64, Key>,
    /// Counts crashes as they are queued: the recovery queue's order.
    crashes_queued: u64,
}

impl Scheduler {
    pub fn new(opts: SchedOptions) -> Self {
        Scheduler {
            opts,
            waiting: BTreeMap::new(),
            keys: HashMap::new(),
            crashes_queued: 0,
        }
    }

    pub fn options(&self) -> &SchedOptions {
        &self.opts
    }

    /// Whether `job`, having run out of memory `crashes` times, must have its GPUs to itself:
    /// after a crash always (CARMA's recovery rule), otherwise as the policy says.
    pub fn alone(&self, job: &Job, crashes: u32) -> bool {
        self.opts
            .policy
            .runs_alone(&recovering(job.clone(), crashes))
    }

    /// Queues `job`. `submitted` orders jobs of equal priority (lower first: a submission
    /// counter or id); `crashes` counts its out-of-memory crashes so far. A job that never
    /// crashed joins the queue; one that did joins the recovery queue, behind earlier crashes,
    /// and runs alone — unless it crashed more than `max_retries` times: then it is not queued.
    /// A job already waiting is moved.
    pub fn enqueue(&mut self, job: Job, priority: i32, submitted: u64, crashes: u32) -> Queued {
        self.remove(job.id);
        if crashes > self.opts.max_retries {
            return Queued::Failed;
        }
        let (key, queued) = if crashes > 0 {
            self.crashes_queued += 1;
            (
                (false, Reverse(priority), self.crashes_queued, job.id),
                Queued::Recovering,
            )
        } else {
            (
                (true, Reverse(priority), submitted, job.id),
                Queued::Waiting,
            )
        };
        self.keys.insert(job.id, key);
        self.waiting.insert(key, recovering(job, crashes));
        queued
    }

    /// Takes a waiting job out (cancelled); `None` if it is not waiting.
    pub fn remove(&mut self, id: u64) -> Option<Job> {
        let key = self.keys.remove(&id)?;
        self.waiting.remove(&key)
    }

    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.keys.contains_key(&id)
    }

    /// The waiting jobs in the order they will be considered.
    pub fn waiting(&self) -> impl Iterator<Item = &Job> {
        self.waiting.values()
    }

    /// Starts waiting jobs at `now_s`: in order until one must wait, then (with backfill) later
    /// ones that do not delay it. Each job started is assigned on `cluster` (so the next
    /// decision sees it) and handed to `forecast.placed`; the decisions are returned in order.
    pub fn schedule(
        &mut self,
        cluster: &mut Cluster,
        now_s: f64,
        forecast: &mut dyn Forecast,
    ) -> Vec<Decision> {
        let mut out = Vec::new();
        while let Some((&key, job)) = self.waiting.first_key_value() {
            match self.opts.policy.place(cluster, job, now_s) {
                Some(gpus) => self.start(key, gpus, false, cluster, now_s, forecast, &mut out),
                None => {
                    if self.opts.backfill {
                        self.backfill(key, cluster, now_s, forecast, &mut out);
                    }
                    break;
                }
            }
        }
        out
    }

    /// EASY backfilling behind the head `head` (see the module docs).
    fn backfill(
        &mut self,
        head: Key,
        cluster: &mut Cluster,
        now_s: f64,
        forecast: &mut dyn Forecast,
        out: &mut Vec<Decision>,
    ) {
        let head_job = &self.waiting[&head];
        let mut running: Vec<u64> = cluster
            .gpus
            .iter()
            .flat_map(|g| g.residents.iter().map(|r| r.job))
            .collect();
        running.sort_unstable();
        running.dedup();
        let mut ending: Vec<(f64, u64)> = running
            .into_iter()
            .map(|j| (forecast.end_s(j), j))
            .collect();
        ending.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut future = cluster.clone();
        let mut reservation = None;
        for (at, j) in ending {
            future.release(j);
            if let Some(g) = self.opts.policy.place(&future, head_job, f64::INFINITY) {
                reservation = Some((at, g));
                break;
            }
        }
        let Some((shadow, reserved)) = reservation else {
            return;
        };
        let later: Vec<Key> = self
            .waiting
            .keys()
            .copied()
            .filter(|&k| k != head)
            .collect();
        for key in later {
            let job = &self.waiting[&key];
            let Some(gpus) = self.opts.policy.place(cluster, job, now_s) else {
                continue;
            };
            let clear = gpus.iter().all(|g| !reserved.contains(g));
            if clear || self.done_before(job, &gpus, cluster, now_s, shadow, forecast) {
                self.start(key, gpus, true, cluster, now_s, forecast, out);
            }
        }
    }

    /// A backfilled job may use reserved GPUs if, at full speed and slowing nobody, it ends
    /// before the head's reserved start.
    fn done_before(
        &self,
        job: &Job,
        gpus: &[usize],
        cluster: &Cluster,
        now_s: f64,
        shadow: f64,
        forecast: &dyn Forecast,
    ) -> bool {
        let Some(run_s) = forecast.run_s(job.id) else {
            return false;
        };
        shadow.is_finite()
            && now_s + run_s <= shadow
            && gpus.iter().all(|&g| {
                let mut loads: Vec<Load> =
                    cluster.gpus[g].residents.iter().map(|r| r.load).collect();
                loads.push(job.load);
                !forecast.slows(&loads)
            })
    }

    #[allow(clippy::too_many_arguments)]
    fn start(
        &mut self,
        key: Key,
        gpus: Vec<usize>,
        backfilled: bool,
        cluster: &mut Cluster,
        now_s: f64,
        forecast: &mut dyn Forecast,
        out: &mut Vec<Decision>,
    ) {
        let job = self.waiting.remove(&key).expect("a waiting job");
        self.keys.remove(&job.id);
        let alone = self.opts.policy.runs_alone(&job);
        cluster.assign(&job, &gpus, alone, now_s, self.opts.warmup_s);
        let decision = Decision {
            job: job.id,
            gpus,
            alone,
            backfilled,
        };
        forecast.placed(&decision, cluster, now_s);
        out.push(decision);
    }
}

/// CARMA's recovery rule: a job that has run out of memory runs alone from then on.
fn recovering(job: Job, crashes: u32) -> Job {
    Job {
        exclusive: job.exclusive || crashes > 0,
        ..job
    }
}
