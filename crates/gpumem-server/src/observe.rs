//! Watching the GPUs: the monitor's readings (NVML and DCGM, or fake GPUs, which first learn
//! what their jobs report) and the memory each running job shows. All of it I/O, done by the
//! tick outside the ledger, which takes in the [`Observation`].

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use gpumem_monitor::{FakeGpus, GpuReading, Monitor};
use gpumem_place::MIB;

use crate::launcher::JobDir;

/// A running job as the observer needs it.
pub struct Running {
    pub id: u64,
    pub assigned: Vec<u32>,
    /// Its supervisor's pid.
    pub pid: Option<u32>,
}

/// One reading.
pub struct Observation {
    /// The GPUs the monitor could read.
    pub gpus: Vec<GpuReading>,
    /// Memory each running job shows (per GPU: the most on any of its GPUs).
    pub jobs: HashMap<u64, u64>,
    /// Running jobs one of whose GPUs is at its memory limit.
    pub at_limit: HashSet<u64>,
}

/// The daemon's GPUs.
pub struct Observer {
    monitor: Box<dyn Monitor>,
    /// Fake GPUs: each job's memory is what it wrote into its fake memory file.
    fake: Option<FakeGpus>,
    state_dir: PathBuf,
}

impl Observer {
    pub fn new(monitor: Box<dyn Monitor>, fake: Option<FakeGpus>, state_dir: PathBuf) -> Self {
        Observer {
            monitor,
            fake,
            state_dir,
        }
    }

    pub fn gpu_count(&self) -> usize {
        self.monitor.gpu_count()
    }

    /// Reads the GPUs (fake GPUs first learn what their jobs report) and each job's memory.
    pub fn observe(&mut self, running: &[Running]) -> Observation {
        let mut observed: HashMap<u64, u64> = HashMap::new();
        if let Some(fake) = &self.fake
            && let Ok(mut gpus) = fake.lock()
        {
            for g in gpus.iter_mut() {
                g.processes.clear();
            }
            for j in running {
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
        for g in 0..self.monitor.gpu_count() as u32 {
            let Ok(r) = self.monitor.read(g) else {
                continue;
            };
            if self.fake.is_none() {
                for j in running {
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
        Observation {
            gpus: readings,
            jobs: observed,
            at_limit,
        }
    }
}

/// Whether a GPU using `used` of `total` bytes is at its limit: less than 1% (at least 256 MiB)
/// free, where an allocation PyTorch cannot serve fails.
fn at_memory_limit(used: u64, total: u64) -> bool {
    used.saturating_add((total / 100).max(256 * MIB)) >= total
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
