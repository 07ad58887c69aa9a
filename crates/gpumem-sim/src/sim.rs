//! The discrete-event engine: arrivals, placement, interference, crashes, recovery.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use gpumem_place::{
    Cluster, Decision, Forecast, Job, Load, MemoryDemand, Policy, Queued, SchedOptions, Scheduler,
};
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
    /// Higher starts first (0 unless given).
    pub priority: i32,
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
    /// The scheduler's: re-runs alone after crashes before a job fails.
    pub max_retries: u32,
    /// The scheduler's: a GPU just given a job is not offered again for this long.
    pub warmup_s: f64,
    /// The scheduler's: EASY backfill behind a head that must wait.
    pub backfill: bool,
}

impl SimConfig {
    pub fn new(gpus: Vec<GpuSpec>, policy: Policy) -> Self {
        let o = SchedOptions::new(policy);
        SimConfig {
            gpus,
            policy,
            crash_after_s: 60.0,
            max_retries: o.max_retries,
            warmup_s: o.warmup_s,
            backfill: o.backfill,
        }
    }

    /// gpumem-place's scheduler with these knobs.
    pub fn sched(&self) -> SchedOptions {
        SchedOptions {
            policy: self.policy,
            backfill: self.backfill,
            max_retries: self.max_retries,
            warmup_s: self.warmup_s,
        }
    }
}

/// How one run of a job ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    Finished,
    /// Out of memory; queued for recovery (to run alone).
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
    TooManyGpus {
        index: usize,
        name: String,
        gpus: u32,
        have: usize,
    },
    #[error("job {index} (`{name}`): {what} must be a finite non-negative number")]
    BadNumber {
        index: usize,
        name: String,
        what: &'static str,
    },
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

/// Everything but the cluster and the scheduler, which the engine lends to each other: the
/// scheduler places on the cluster and the engine (its [`Forecast`]) starts each job as it is
/// placed, so the next decision (and a backfill reservation) sees the new rates.
struct Engine<'a> {
    jobs: &'a [SimJob],
    cfg: &'a SimConfig,
    interference: &'a dyn Interference,
    state: Vec<JobState>,
    /// Arrivals so far: the submission order.
    arrived: u64,
    events: BinaryHeap<Reverse<Event>>,
    seq: u64,
    meters: Vec<GpuMeter>,
    runs: Vec<Run>,
    crashes: u64,
    failed: u64,
    wasted_gpu_s: f64,
}

/// Runs `jobs` on the cluster of `cfg`. Deterministic: same inputs, same report.
pub fn simulate(
    jobs: &[SimJob],
    cfg: &SimConfig,
    interference: &dyn Interference,
) -> Result<Report, SimError> {
    if cfg.gpus.is_empty() {
        return Err(SimError::NoGpus);
    }
    for (index, j) in jobs.iter().enumerate() {
        let bad = |what| SimError::BadNumber {
            index,
            name: j.name.clone(),
            what,
        };
        if !(j.arrival_s.is_finite() && j.arrival_s >= 0.0) {
            return Err(bad("arrival time"));
        }
        if !(j.work_s.is_finite() && j.work_s >= 0.0) {
            return Err(bad("run time"));
        }
        if j.gpus == 0 || j.gpus as usize > cfg.gpus.len() {
            return Err(SimError::TooManyGpus {
                index,
                name: j.name.clone(),
                gpus: j.gpus,
                have: cfg.gpus.len(),
            });
        }
    }
    let mut cluster = Cluster::new(cfg.gpus.iter().map(|g| g.capacity_bytes));
    let mut sched = Scheduler::new(cfg.sched());
    let mut e = Engine {
        jobs,
        cfg,
        interference,
        state: vec![JobState::default(); jobs.len()],
        arrived: 0,
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
            Kind::Arrive(j) => {
                sched.enqueue(e.view(j), jobs[j].priority, e.arrived, 0);
                e.arrived += 1;
            }
            Kind::Finish(j, v) => {
                if e.state[j].running.as_ref().is_none_or(|r| r.version != v) {
                    continue;
                }
                e.stop(j, now, Outcome::Finished, &mut cluster);
            }
            Kind::Crash(j) => {
                e.crashes += 1;
                e.state[j].retries += 1;
                let queued = sched.enqueue(e.view(j), jobs[j].priority, 0, e.state[j].retries);
                let outcome = if queued == Queued::Failed {
                    Outcome::Failed
                } else {
                    Outcome::Crashed
                };
                let gpus = e.stop(j, now, outcome, &mut cluster);
                e.wasted_gpu_s += (now - e.state[j].start) * gpus as f64;
                if outcome == Outcome::Failed {
                    e.failed += 1;
                }
            }
            Kind::Warm => {}
        }
        // The scheduler runs after each event, but jobs that arrive at the same instant are all
        // queued first, so they start in priority order (as the daemon orders the submissions of
        // one tick).
        let more_arrive_now = matches!(ev.kind, Kind::Arrive(_))
            && e.events.peek().is_some_and(|Reverse(next)| {
                next.at == now && matches!(next.kind, Kind::Arrive(_))
            });
        if !more_arrive_now {
            sched.schedule(&mut cluster, now, &mut e);
        }
    }
    if !sched.is_empty() {
        return Err(SimError::Unplaced(sched.len()));
    }
    Ok(e.report(&cluster))
}

impl Forecast for Engine<'_> {
    fn end_s(&self, job: u64) -> f64 {
        self.state[job as usize]
            .running
            .as_ref()
            .map_or(f64::INFINITY, |r| r.since + r.remaining / r.rate.max(1e-9))
    }

    fn run_s(&self, job: u64) -> Option<f64> {
        Some(self.jobs[job as usize].work_s)
    }

    fn slows(&self, loads: &[Load]) -> bool {
        self.interference.rates(loads).iter().any(|&r| r < 1.0)
    }

    fn placed(&mut self, d: &Decision, cluster: &Cluster, now: f64) {
        self.start(d.job as usize, &d.gpus, now, cluster);
    }
}

impl Engine<'_> {
    fn push(&mut self, at: f64, kind: Kind) {
        self.seq += 1;
        self.events.push(Reverse(Event {
            at,
            seq: self.seq,
            kind,
        }));
    }

    /// What the scheduler sees of job `j` (it marks a crashed job to run alone).
    fn view(&self, j: usize) -> Job {
        let s = &self.jobs[j];
        Job {
            id: j as u64,
            gpus: s.gpus,
            memory: s.memory,
            true_bytes: Some(s.true_bytes),
            load: s.load,
            exclusive: false,
        }
    }

    /// Starts the run of `j` that the scheduler has just assigned on `gpus`; the job that
    /// pushed a GPU over capacity crashes.
    fn start(&mut self, j: usize, gpus: &[usize], now: f64, cluster: &Cluster) {
        let over = gpus
            .iter()
            .any(|&g| cluster.gpus[g].used_bytes() > cluster.gpus[g].capacity_bytes);
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
        self.changed(gpus, now, cluster);
    }

    /// Ends the current run of `j`; returns how many GPUs it held.
    fn stop(&mut self, j: usize, now: f64, outcome: Outcome, cluster: &mut Cluster) -> usize {
        let run = self.state[j].running.take().expect("a running job");
        cluster.release(j as u64);
        if outcome != Outcome::Crashed {
            self.state[j].end = Some(now);
        }
        let n = run.gpus.len();
        self.changed(&run.gpus, now, cluster);
        self.runs.push(Run {
            job: j,
            gpus: run.gpus,
            start_s: run.start,
            end_s: now,
            outcome,
        });
        n
    }

    /// The residents of `gpus` changed: settle meters and progress, then re-rate every job there.
    fn changed(&mut self, gpus: &[usize], now: f64, cluster: &Cluster) {
        let mut affected: Vec<usize> = Vec::new();
        for &g in gpus {
            self.meter(g, now, cluster);
            affected.extend(cluster.gpus[g].residents.iter().map(|r| r.job as usize));
        }
        affected.sort_unstable();
        affected.dedup();
        for j in affected {
            let rate = self.rate_of(j, cluster);
            let Some(r) = self.state[j].running.as_mut() else {
                continue;
            };
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
    fn meter(&mut self, g: usize, now: f64, cluster: &Cluster) {
        let gpu = &cluster.gpus[g];
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
    fn rate_of(&self, j: usize, cluster: &Cluster) -> f64 {
        let Some(r) = &self.state[j].running else {
            return 1.0;
        };
        r.gpus
            .iter()
            .map(|&g| {
                let residents = &cluster.gpus[g].residents;
                let loads: Vec<Load> = residents.iter().map(|x| x.load).collect();
                let at = residents
                    .iter()
                    .position(|x| x.job == j as u64)
                    .unwrap_or(0);
                self.interference
                    .rates(&loads)
                    .get(at)
                    .copied()
                    .unwrap_or(1.0)
            })
            .fold(1.0, f64::min)
    }

    fn report(mut self, cluster: &Cluster) -> Report {
        let first = self
            .jobs
            .iter()
            .map(|j| j.arrival_s)
            .fold(f64::INFINITY, f64::min);
        let last = self
            .state
            .iter()
            .filter_map(|s| s.end)
            .fold(first, f64::max);
        let makespan = if self.jobs.is_empty() {
            0.0
        } else {
            last - first
        };
        for g in 0..self.meters.len() {
            self.meter(g, last, cluster);
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
