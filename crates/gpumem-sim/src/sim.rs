//! The discrete-event engine: arrivals, placement, interference, crashes, recovery.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use gpumem_place::{Cluster, Job, Load, MemoryDemand, Policy};
use serde::Serialize;

use crate::interference::Interference;

/// One job of a workload trace.
#[derive(Debug, Clone, PartialEq)]
pub struct SimJob {
    pub name: String,
    pub arrival_s: f64,
    pub gpus: u32,
    /// Run time alone on its GPUs.
    pub work_s: f64,
    /// Peak memory per GPU as nvidia-smi shows it: the truth that decides crashes.
    pub true_bytes: u64,
    /// What the estimator under test says (per GPU); `None` if it failed.
    pub memory: Option<MemoryDemand>,
    pub load: Load,
}

/// A GPU of the simulated cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GpuSpec {
    pub capacity_bytes: u64,
    pub idle_w: f64,
    pub max_w: f64,
}

/// Knobs of a simulation.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub gpus: Vec<GpuSpec>,
    pub policy: Policy,
    /// A job that pushed its GPU over capacity dies this long after it started.
    pub crash_after_s: f64,
    /// Crashed jobs are re-placed exclusively at most this many times, then fail.
    pub max_retries: u32,
    /// A GPU just given a job is not offered again for this long (CARMA: 30 s).
    pub warmup_s: f64,
    /// Start later jobs when the head must wait, on GPUs the head's reservation does not need.
    pub backfill: bool,
}

impl SimConfig {
    pub fn new(gpus: Vec<GpuSpec>, policy: Policy) -> Self {
        SimConfig { gpus, policy, crash_after_s: 60.0, max_retries: 3, warmup_s: 30.0, backfill: false }
    }
}

/// How one run of a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    Finished,
    /// Out of memory; requeued for exclusive recovery.
    Crashed,
    /// Out of memory with no retries left.
    Failed,
}

/// One run of a job on its GPUs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Run {
    pub job: usize,
    pub gpus: Vec<usize>,
    pub start_s: f64,
    pub end_s: f64,
    pub outcome: Outcome,
}

/// What a simulation measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub policy: String,
    pub jobs: usize,
    pub makespan_s: f64,
    pub mean_wait_s: f64,
    pub p95_wait_s: f64,
    pub mean_jct_s: f64,
    pub oom_crashes: u64,
    pub failed_jobs: u64,
    pub wasted_gpu_min: f64,
    /// Share of GPU time with at least one job, averaged over GPUs.
    pub mean_busy: f64,
    pub mean_smact: f64,
    pub energy_kwh: f64,
    #[serde(skip)]
    pub runs: Vec<Run>,
}

/// Why a simulation could not run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    #[error("job {index} (`{name}`) needs {gpus} GPUs; the cluster has {have}")]
    TooManyGpus { index: usize, name: String, gpus: u32, have: usize },
    #[error("job {index} (`{name}`): {what} must be a finite non-negative number")]
    BadNumber { index: usize, name: String, what: &'static str },
    #[error("the cluster has no GPUs")]
    NoGpus,
    #[error("{0} jobs could never be placed (the policy refuses even an empty GPU)")]
    Unplaced(usize),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Arrive(usize),
    /// (job, version): stale versions are ignored.
    Finish(usize, u64),
    Crash(usize),
    /// A warm-up ended: GPUs may be offered again.
    Warm,
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Event {
    at: f64,
    seq: u64,
    kind: Kind,
}
impl Eq for Event {}
impl Ord for Event {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.at.total_cmp(&o.at).then(self.seq.cmp(&o.seq))
    }
}
impl PartialOrd for Event {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

#[derive(Debug, Clone)]
struct Running {
    gpus: Vec<usize>,
    start: f64,
    /// Exclusive-seconds of work left at `since`.
    remaining: f64,
    since: f64,
    rate: f64,
    version: u64,
    crashing: bool,
}

#[derive(Debug, Clone, Default)]
struct JobState {
    running: Option<Running>,
    retries: u32,
    recovering: bool,
    start: f64,
    end: Option<f64>,
}

/// Time integrals of one GPU.
#[derive(Debug, Clone, Copy, Default)]
struct GpuMeter {
    since: f64,
    smact: f64,
    busy: bool,
    busy_s: f64,
    smact_s: f64,
}

struct Engine<'a> {
    jobs: &'a [SimJob],
    cfg: &'a SimConfig,
    interference: &'a dyn Interference,
    cluster: Cluster,
    state: Vec<JobState>,
    queue: VecDeque<usize>,
    recovery: VecDeque<usize>,
    events: BinaryHeap<Reverse<Event>>,
    seq: u64,
    meters: Vec<GpuMeter>,
    runs: Vec<Run>,
    crashes: u64,
    failed: u64,
    wasted_gpu_s: f64,
}

/// Runs `jobs` on the cluster of `cfg`. Deterministic: same inputs, same report.
pub fn simulate(jobs: &[SimJob], cfg: &SimConfig, interference: &dyn Interference) -> Result<Report, SimError> {
    if cfg.gpus.is_empty() {
        return Err(SimError::NoGpus);
    }
    for (index, j) in jobs.iter().enumerate() {
        let bad = |what| SimError::BadNumber { index, name: j.name.clone(), what };
        if !(j.arrival_s.is_finite() && j.arrival_s >= 0.0) {
            return Err(bad("arrival time"));
        }
        if !(j.work_s.is_finite() && j.work_s >= 0.0) {
            return Err(bad("run time"));
        }
        if j.gpus == 0 || j.gpus as usize > cfg.gpus.len() {
            return Err(SimError::TooManyGpus { index, name: j.name.clone(), gpus: j.gpus, have: cfg.gpus.len() });
        }
    }
    let mut e = Engine {
        jobs,
        cfg,
        interference,
        cluster: Cluster::new(cfg.gpus.iter().map(|g| g.capacity_bytes)),
        state: vec![JobState::default(); jobs.len()],
        queue: VecDeque::new(),
        recovery: VecDeque::new(),
        events: BinaryHeap::new(),
        seq: 0,
        meters: vec![GpuMeter::default(); cfg.gpus.len()],
        runs: Vec::new(),
        crashes: 0,
        failed: 0,
        wasted_gpu_s: 0.0,
    };
    for (j, job) in jobs.iter().enumerate() {
        e.push(job.arrival_s, Kind::Arrive(j));
    }
    while let Some(Reverse(ev)) = e.events.pop() {
        let now = ev.at;
        match ev.kind {
            Kind::Arrive(j) => e.queue.push_back(j),
            Kind::Finish(j, v) => {
                if e.state[j].running.as_ref().is_none_or(|r| r.version != v) {
                    continue;
                }
                e.stop(j, now, Outcome::Finished);
            }
            Kind::Crash(j) => {
                e.crashes += 1;
                e.state[j].retries += 1;
                let outcome = if e.state[j].retries > cfg.max_retries { Outcome::Failed } else { Outcome::Crashed };
                let gpus = e.stop(j, now, outcome);
                e.wasted_gpu_s += (now - e.state[j].start) * gpus as f64;
                if outcome == Outcome::Crashed {
                    e.state[j].recovering = true;
                    e.recovery.push_back(j);
                } else {
                    e.failed += 1;
                }
            }
            Kind::Warm => {}
        }
        e.schedule(now);
    }
    let unplaced = e.queue.len() + e.recovery.len();
    if unplaced > 0 {
        return Err(SimError::Unplaced(unplaced));
    }
    Ok(e.report())
}

impl Engine<'_> {
    fn push(&mut self, at: f64, kind: Kind) {
        self.seq += 1;
        self.events.push(Reverse(Event { at, seq: self.seq, kind }));
    }

    fn view(&self, j: usize) -> Job {
        let s = &self.jobs[j];
        Job {
            id: j as u64,
            gpus: s.gpus,
            memory: s.memory,
            true_bytes: Some(s.true_bytes),
            load: s.load,
            exclusive: self.state[j].recovering,
        }
    }

    /// Places queue heads (recovery first) until one must wait; then, with backfill, later jobs.
    fn schedule(&mut self, now: f64) {
        loop {
            let (from_recovery, head) = match (self.recovery.front(), self.queue.front()) {
                (Some(&j), _) => (true, j),
                (None, Some(&j)) => (false, j),
                (None, None) => return,
            };
            let job = self.view(head);
            match self.cfg.policy.place(&self.cluster, &job, now) {
                Some(gpus) => {
                    if from_recovery {
                        self.recovery.pop_front();
                    } else {
                        self.queue.pop_front();
                    }
                    self.start(head, &job, &gpus, now);
                }
                None => {
                    if self.cfg.backfill {
                        self.backfill(head, now);
                    }
                    return;
                }
            }
        }
    }

    /// EASY backfilling: reserve for the head the GPUs it gets once enough running jobs end (in
    /// their predicted order); start later jobs on other GPUs, or on reserved ones only if they
    /// end before the reservation without slowing anyone, so the head is never delayed.
    fn backfill(&mut self, head: usize, now: f64) {
        let head_job = self.view(head);
        let mut ending: Vec<(f64, usize)> = self
            .state
            .iter()
            .enumerate()
            .filter_map(|(j, s)| s.running.as_ref().map(|r| (r.since + r.remaining / r.rate.max(1e-9), j)))
            .collect();
        ending.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut future = self.cluster.clone();
        let mut reservation = None;
        for (at, j) in ending {
            future.release(j as u64);
            if let Some(g) = self.cfg.policy.place(&future, &head_job, f64::INFINITY) {
                reservation = Some((at, g));
                break;
            }
        }
        let Some((shadow, reserved)) = reservation else { return };
        let candidates: Vec<(bool, usize)> = self
            .recovery
            .iter()
            .map(|&j| (true, j))
            .chain(self.queue.iter().map(|&j| (false, j)))
            .filter(|&(_, j)| j != head)
            .collect();
        for (from_recovery, j) in candidates {
            let job = self.view(j);
            if let Some(gpus) = self.cfg.policy.place(&self.cluster, &job, now)
                && (gpus.iter().all(|g| !reserved.contains(g)) || self.done_before(&job, &gpus, now, shadow))
            {
                let q = if from_recovery { &mut self.recovery } else { &mut self.queue };
                q.retain(|&x| x != j);
                self.start(j, &job, &gpus, now);
            }
        }
    }

    /// A backfilled job may use reserved GPUs if, at full speed and slowing nobody, it ends
    /// before the head's reserved start.
    fn done_before(&self, job: &Job, gpus: &[usize], now: f64, shadow: f64) -> bool {
        now + self.jobs[job.id as usize].work_s <= shadow
            && gpus.iter().all(|&g| {
                let mut loads: Vec<Load> = self.cluster.gpus[g].residents.iter().map(|r| r.load).collect();
                loads.push(job.load);
                self.interference.rates(&loads).iter().all(|&r| r >= 1.0)
            })
    }

    fn start(&mut self, j: usize, job: &Job, gpus: &[usize], now: f64) {
        let alone = self.cfg.policy.runs_alone(job);
        self.cluster.assign(job, gpus, alone, now, self.cfg.warmup_s);
        let over = gpus.iter().any(|&g| self.cluster.gpus[g].used_bytes() > self.cluster.gpus[g].capacity_bytes);
        self.state[j].start = now;
        self.state[j].running = Some(Running {
            gpus: gpus.to_vec(),
            start: now,
            remaining: self.jobs[j].work_s,
            since: now,
            rate: 1.0,
            version: 0,
            crashing: over,
        });
        if over {
            self.push(now + self.cfg.crash_after_s, Kind::Crash(j));
        }
        if self.cfg.warmup_s > 0.0 {
            self.push(now + self.cfg.warmup_s, Kind::Warm);
        }
        self.changed(gpus, now);
    }

    /// Ends the current run of `j`; returns how many GPUs it held.
    fn stop(&mut self, j: usize, now: f64, outcome: Outcome) -> usize {
        let run = self.state[j].running.take().expect("a running job");
        self.cluster.release(j as u64);
        if outcome != Outcome::Crashed {
            self.state[j].end = Some(now);
        }
        let n = run.gpus.len();
        self.changed(&run.gpus, now);
        self.runs.push(Run { job: j, gpus: run.gpus, start_s: run.start, end_s: now, outcome });
        n
    }

    /// The residents of `gpus` changed: settle meters and progress, then re-rate every job there.
    fn changed(&mut self, gpus: &[usize], now: f64) {
        let mut affected: Vec<usize> = Vec::new();
        for &g in gpus {
            self.meter(g, now);
            affected.extend(self.cluster.gpus[g].residents.iter().map(|r| r.job as usize));
        }
        affected.sort_unstable();
        affected.dedup();
        for j in affected {
            let rate = self.rate_of(j);
            let Some(r) = self.state[j].running.as_mut() else { continue };
            r.remaining = (r.remaining - (now - r.since) * r.rate).max(0.0);
            r.since = now;
            r.rate = rate;
            r.version += 1;
            if !r.crashing {
                let (at, v) = (now + r.remaining / rate.max(1e-9), r.version);
                self.push(at, Kind::Finish(j, v));
            }
        }
    }

    /// Integrates GPU `g`'s busy time and SMACT up to `now`, then takes its current state.
    fn meter(&mut self, g: usize, now: f64) {
        let gpu = &self.cluster.gpus[g];
        let m = &mut self.meters[g];
        let dt = now - m.since;
        if m.busy {
            m.busy_s += dt;
        }
        m.smact_s += m.smact * dt;
        m.since = now;
        m.busy = !gpu.residents.is_empty();
        m.smact = gpu.load().observed().smact;
    }

    /// A job runs at the pace of its slowest GPU.
    fn rate_of(&self, j: usize) -> f64 {
        let Some(r) = &self.state[j].running else { return 1.0 };
        r.gpus
            .iter()
            .map(|&g| {
                let residents = &self.cluster.gpus[g].residents;
                let loads: Vec<Load> = residents.iter().map(|x| x.load).collect();
                let at = residents.iter().position(|x| x.job == j as u64).unwrap_or(0);
                self.interference.rates(&loads).get(at).copied().unwrap_or(1.0)
            })
            .fold(1.0, f64::min)
    }

    fn report(mut self) -> Report {
        let first = self.jobs.iter().map(|j| j.arrival_s).fold(f64::INFINITY, f64::min);
        let last = self.state.iter().filter_map(|s| s.end).fold(first, f64::max);
        let makespan = if self.jobs.is_empty() { 0.0 } else { last - first };
        for g in 0..self.meters.len() {
            self.meter(g, last);
        }
        let mut waits = Vec::new();
        let mut jct = 0.0;
        for (s, j) in self.state.iter().zip(self.jobs) {
            if let Some(end) = s.end {
                waits.push(s.start - j.arrival_s);
                jct += end - j.arrival_s;
            }
        }
        let done = waits.len().max(1) as f64;
        waits.sort_by(f64::total_cmp);
        let gpu_s = makespan * self.meters.len() as f64;
        let ratio = |x: f64| if gpu_s > 0.0 { x / gpu_s } else { 0.0 };
        let joules: f64 = self
            .meters
            .iter()
            .zip(&self.cfg.gpus)
            .map(|(m, g)| g.idle_w * makespan + (g.max_w - g.idle_w) * m.smact_s)
            .sum();
        Report {
            policy: self.cfg.policy.to_string(),
            jobs: self.jobs.len(),
            makespan_s: makespan,
            mean_wait_s: waits.iter().sum::<f64>() / done,
            p95_wait_s: percentile(&waits, 0.95),
            mean_jct_s: jct / done,
            oom_crashes: self.crashes,
            failed_jobs: self.failed,
            wasted_gpu_min: self.wasted_gpu_s / 60.0,
            mean_busy: ratio(self.meters.iter().map(|m| m.busy_s).sum()),
            mean_smact: ratio(self.meters.iter().map(|m| m.smact_s).sum()),
            energy_kwh: joules / 3.6e6,
            runs: self.runs,
        }
    }
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}
