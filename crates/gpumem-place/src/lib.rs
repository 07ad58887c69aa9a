//! gpumem-place: which shared GPUs a training job should run on.
//!
//! Plain types describe the state: a [`Job`] (GPUs needed, a [`MemoryDemand`] from some
//! estimator, a utilization [`Load`], and in simulation its true memory), a [`Gpu`] (capacity and
//! its [`Resident`] jobs) and a [`Cluster`]. A [`Policy`] is a [`Rule`] plus how it reads memory
//! ([`MemoryView`]) and whether it applies CARMA's utilization filter; [`Policy::place`] is pure:
//! state in, GPU indices out (all of a multi-GPU job's GPUs at once, or none).
//!
//! Rules: `exclusive`; `round-robin` (memory-blind, as CARMA's); `first-fit`, `best-fit`,
//! `most-free-memory`, `least-utilized`, each by true memory (oracle), by estimate + headroom
//! (CARMA's 2 GiB) or blind; and gpumem's `safe-pack`, which admits a job only if its upper bound
//! fits beside what the residents show (their bounds while they warm up), runs jobs it cannot
//! model alone, consolidates while summed utilization stays below saturation and caps it above.
//!
//! [`sched`] is the one scheduler the simulator and the daemon both drive: queue order
//! (priority, then submission), the recovery queue, head-of-line blocking, optional EASY
//! backfill; [`Scheduler::schedule`] is pure too (the caller passes the time).

use std::fmt;

pub mod sched;

pub use sched::{Decision, Forecast, NoForecast, Queued, SchedOptions, Scheduler};

use serde::{Deserialize, Serialize};

pub const MIB: u64 = 1 << 20;

/// Run-average utilization of a job alone on a GPU (DCGM fields, fractions 0–1).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Load {
    pub smact: f64,
    pub smocc: f64,
    pub dram: f64,
}

impl Load {
    pub fn plus(self, o: Load) -> Load {
        Load {
            smact: self.smact + o.smact,
            smocc: self.smocc + o.smocc,
            dram: self.dram + o.dram,
        }
    }
    /// How oversubscribed a GPU with this summed load is: above 1, jobs slow each other down.
    pub fn pressure(self) -> f64 {
        self.smact.max(self.dram)
    }
    /// What a monitor would read on a GPU with this summed load.
    pub fn observed(self) -> Load {
        Load {
            smact: self.smact.min(1.0),
            smocc: self.smocc.min(1.0),
            dram: self.dram.min(1.0),
        }
    }
}

/// An estimator's answer for one GPU's share of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryDemand {
    pub estimate_bytes: u64,
    /// Estimators without a bound repeat their estimate here.
    pub upper_bound_bytes: u64,
}

impl MemoryDemand {
    pub fn point(bytes: u64) -> Self {
        MemoryDemand {
            estimate_bytes: bytes,
            upper_bound_bytes: bytes,
        }
    }
}

/// A job asking for GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    pub id: u64,
    pub gpus: u32,
    /// Per GPU; `None` when the estimator failed or cannot model the job.
    pub memory: Option<MemoryDemand>,
    /// Per GPU, as the GPU will show it (simulation and oracle policies only).
    pub true_bytes: Option<u64>,
    pub load: Load,
    /// Must run alone (recovery after an out-of-memory crash).
    pub exclusive: bool,
}

/// A job running on a GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Resident {
    pub job: u64,
    /// What the GPU shows for it (the monitor's reading; the truth in simulation).
    pub used_bytes: u64,
    /// The upper bound it was admitted with (0 when unknown).
    pub bound_bytes: u64,
    /// From then on `used_bytes` shows its steady peak (training reaches it in the first steps).
    pub warm_at_s: f64,
    pub load: Load,
    pub exclusive: bool,
}

/// One GPU and what runs on it.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpu {
    pub capacity_bytes: u64,
    pub residents: Vec<Resident>,
    /// Not offered to new jobs before this time (CARMA's warm-up: a job's memory shows up late).
    pub warm_until_s: f64,
}

impl Gpu {
    pub fn new(capacity_bytes: u64) -> Self {
        Gpu {
            capacity_bytes,
            residents: Vec::new(),
            warm_until_s: f64::NEG_INFINITY,
        }
    }
    pub fn used_bytes(&self) -> u64 {
        self.residents.iter().map(|r| r.used_bytes).sum()
    }
    /// Free memory as a monitor sees it.
    pub fn free_bytes(&self) -> u64 {
        self.capacity_bytes.saturating_sub(self.used_bytes())
    }
    /// Free memory when residents still warming up may grow to their upper bounds.
    pub fn free_bound_bytes(&self, now_s: f64) -> u64 {
        let held: u64 = self
            .residents
            .iter()
            .map(|r| {
                if now_s >= r.warm_at_s {
                    r.used_bytes
                } else {
                    r.used_bytes.max(r.bound_bytes)
                }
            })
            .sum();
        self.capacity_bytes.saturating_sub(held)
    }
    pub fn load(&self) -> Load {
        self.residents
            .iter()
            .fold(Load::default(), |a, r| a.plus(r.load))
    }
    fn held_exclusively(&self) -> bool {
        self.residents.iter().any(|r| r.exclusive)
    }
}

/// GPUs plus the round-robin cursor.
#[derive(Debug, Clone, PartialEq)]
pub struct Cluster {
    pub gpus: Vec<Gpu>,
    pub next_round_robin: usize,
}

impl Cluster {
    pub fn new(capacities: impl IntoIterator<Item = u64>) -> Self {
        Cluster {
            gpus: capacities.into_iter().map(Gpu::new).collect(),
            next_round_robin: 0,
        }
    }

    /// Puts `job` on `gpus` (as [`Policy::place`] chose) at time `now_s`; `alone` keeps others
    /// off those GPUs while it runs ([`Policy::runs_alone`]).
    pub fn assign(&mut self, job: &Job, gpus: &[usize], alone: bool, now_s: f64, warmup_s: f64) {
        for &g in gpus {
            let gpu = &mut self.gpus[g];
            gpu.residents.push(Resident {
                job: job.id,
                used_bytes: job.true_bytes.unwrap_or(0),
                bound_bytes: job.memory.map_or(0, |m| m.upper_bound_bytes),
                warm_at_s: now_s + warmup_s,
                load: job.load,
                exclusive: alone,
            });
            gpu.warm_until_s = now_s + warmup_s;
        }
        if let Some(&last) = gpus.last() {
            self.next_round_robin = (last + 1) % self.gpus.len().max(1);
        }
    }

    /// Removes `job` from every GPU; returns the GPUs it was on.
    pub fn release(&mut self, job: u64) -> Vec<usize> {
        let mut on = Vec::new();
        for (g, gpu) in self.gpus.iter_mut().enumerate() {
            let before = gpu.residents.len();
            gpu.residents.retain(|r| r.job != job);
            if gpu.residents.len() != before {
                on.push(g);
            }
        }
        on
    }
}

/// The placement rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Rule {
    Exclusive,
    RoundRobin,
    FirstFit,
    BestFit,
    MostFreeMemory,
    LeastUtilized,
    SafePack,
}

impl Rule {
    pub const ALL: [Rule; 7] = [
        Rule::Exclusive,
        Rule::RoundRobin,
        Rule::FirstFit,
        Rule::BestFit,
        Rule::MostFreeMemory,
        Rule::LeastUtilized,
        Rule::SafePack,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Rule::Exclusive => "exclusive",
            Rule::RoundRobin => "round-robin",
            Rule::FirstFit => "first-fit",
            Rule::BestFit => "best-fit",
            Rule::MostFreeMemory => "most-free-memory",
            Rule::LeastUtilized => "least-utilized",
            Rule::SafePack => "safe-pack",
        }
    }
}

/// How a rule reads a job's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryView {
    /// Ignore memory.
    Blind,
    /// The job's true memory must fit in the free memory (simulation only).
    Oracle,
    /// Free memory ≥ estimate + headroom; a job without an estimate needs an empty GPU.
    Estimate { headroom_bytes: u64 },
}

/// CARMA's utilization filter: a GPU this busy takes no new job.
pub fn carma_busy(load: Load) -> bool {
    let l = load.observed();
    l.smact >= 0.8 && (l.smocc >= 0.45 || l.dram >= 0.40)
}

/// A policy name that is not `RULE` or `RULE+carma`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown policy `{0}` (expected one of {known}, optionally with +carma)", known = Rule::ALL.map(Rule::name).join(", "))]
pub struct UnknownPolicy(pub String);

/// A placement policy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Policy {
    pub rule: Rule,
    pub memory: MemoryView,
    pub carma_filter: bool,
    /// safe-pack: margin above the upper bound.
    pub safe_headroom_bytes: u64,
    /// safe-pack: the summed utilization pressure it accepts on a shared GPU (2: under
    /// proportional sharing no job drops below half speed).
    pub max_pressure: f64,
}

impl Policy {
    pub fn new(rule: Rule, memory: MemoryView) -> Self {
        Policy {
            rule,
            memory,
            carma_filter: false,
            safe_headroom_bytes: 512 * MIB,
            max_pressure: 2.0,
        }
    }

    /// Parses `RULE` or `RULE+carma` (the utilization filter).
    pub fn parse(name: &str, memory: MemoryView) -> Result<Policy, UnknownPolicy> {
        let (rule_name, carma) = match name.strip_suffix("+carma") {
            Some(r) => (r, true),
            None => (name, false),
        };
        let rule = Rule::ALL
            .into_iter()
            .find(|r| r.name() == rule_name)
            .ok_or_else(|| UnknownPolicy(name.to_string()))?;
        Ok(Policy {
            carma_filter: carma,
            ..Policy::new(rule, memory)
        })
    }

    /// Whether `job` must have its GPUs to itself: recovery, the exclusive rule, and safe-pack
    /// for jobs without an estimate.
    pub fn runs_alone(&self, job: &Job) -> bool {
        job.exclusive
            || self.rule == Rule::Exclusive
            || (self.rule == Rule::SafePack && job.memory.is_none())
    }

    /// The GPUs `job` should start on now, or `None` if it must wait.
    pub fn place(&self, cluster: &Cluster, job: &Job, now_s: f64) -> Option<Vec<usize>> {
        let want = job.gpus as usize;
        if want == 0 || want > cluster.gpus.len() {
            return None;
        }
        let alone = self.runs_alone(job);
        let mut candidates: Vec<(usize, f64)> = Vec::new();
        for (g, gpu) in cluster.gpus.iter().enumerate() {
            if gpu.held_exclusively() || (alone && !gpu.residents.is_empty()) {
                continue;
            }
            if gpu.warm_until_s > now_s && !gpu.residents.is_empty() {
                continue;
            }
            if self.carma_filter && carma_busy(gpu.load()) {
                continue;
            }
            if let Some(score) = self.score(gpu, job, now_s) {
                candidates.push((g, score));
            }
        }
        if candidates.len() < want {
            return None;
        }
        if self.rule == Rule::RoundRobin {
            let n = cluster.gpus.len();
            let start = cluster.next_round_robin % n;
            candidates.sort_by_key(|&(g, _)| (g + n - start) % n);
        } else {
            // Lower score first; ties go to the lower index (stable sort).
            candidates.sort_by(|a, b| a.1.total_cmp(&b.1));
        }
        let mut chosen: Vec<usize> = candidates[..want].iter().map(|&(g, _)| g).collect();
        chosen.sort_unstable();
        Some(chosen)
    }

    /// `None` if `job` may not go on `gpu`; otherwise a rank key (lower is preferred).
    fn score(&self, gpu: &Gpu, job: &Job, now_s: f64) -> Option<f64> {
        if self.rule == Rule::SafePack {
            return self.safe_pack_score(gpu, job, now_s);
        }
        let free = gpu.free_bytes();
        let need = match self.memory {
            // An empty GPU is the most any job can get: it always qualifies.
            _ if gpu.residents.is_empty() => 0,
            MemoryView::Blind => 0,
            MemoryView::Oracle => job.true_bytes?,
            MemoryView::Estimate { headroom_bytes } => match job.memory {
                Some(m) => m.estimate_bytes + headroom_bytes,
                None => return None,
            },
        };
        if need > free {
            return None;
        }
        Some(match self.rule {
            Rule::Exclusive | Rule::FirstFit | Rule::RoundRobin => 0.0,
            Rule::BestFit => (free - need) as f64,
            Rule::MostFreeMemory => -(free as f64),
            Rule::LeastUtilized => gpu.load().observed().smact,
            Rule::SafePack => unreachable!("handled above"),
        })
    }

    /// safe-pack: the upper bound must fit beside what residents show (or, while they warm up,
    /// their bounds). Shared GPUs that stay at or below saturation come first, tightest memory
    /// fit first (consolidating keeps empty GPUs for large and multi-GPU jobs); then an empty
    /// GPU; then shared GPUs that would saturate, least pressure first, up to `max_pressure`.
    fn safe_pack_score(&self, gpu: &Gpu, job: &Job, now_s: f64) -> Option<f64> {
        if gpu.residents.is_empty() {
            return Some(1.0);
        }
        let need = job.memory?.upper_bound_bytes + self.safe_headroom_bytes;
        let free = gpu.free_bound_bytes(now_s);
        let pressure = gpu.load().plus(job.load).pressure();
        if need > free || pressure > self.max_pressure {
            return None;
        }
        if pressure <= 1.0 {
            // In [0, 1): tighter fit first.
            Some((free - need) as f64 / gpu.capacity_bytes.max(1) as f64)
        } else {
            Some(1.0 + pressure)
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}{}",
            self.rule.name(),
            if self.carma_filter { "+carma" } else { "" }
        )
    }
}

#[cfg(test)]
mod tests;
