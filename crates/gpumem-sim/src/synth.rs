//! Synthetic workloads for scale tests: many jobs, deterministic for a seed.

use gpumem_core::rng::SplitMix64;
use gpumem_place::{Load, MIB, MemoryDemand};

use crate::sim::SimJob;

/// `count` jobs arriving over `span_s` on GPUs of `capacity_bytes`: 1–8 GPUs (mostly 1),
/// memory 2–95% of a GPU, run times 1 min–4 h (log-uniform), estimates within ±10% of the truth
/// with a 10% upper-bound margin, utilization 0.1–0.95.
pub fn workload(count: usize, span_s: f64, capacity_bytes: u64, seed: u64) -> Vec<SimJob> {
    let mut rng = SplitMix64(seed);
    let mut arrivals: Vec<f64> = (0..count).map(|_| rng.unit() * span_s).collect();
    arrivals.sort_by(f64::total_cmp);
    arrivals
        .into_iter()
        .enumerate()
        .map(|(i, arrival_s)| {
            let gpus = match rng.unit() {
                u if u < 0.8 => 1,
                u if u < 0.9 => 2,
                u if u < 0.97 => 4,
                _ => 8,
            };
            let true_bytes = ((0.02 + 0.93 * rng.unit()) * capacity_bytes as f64) as u64;
            let estimate = (true_bytes as f64 * (0.9 + 0.2 * rng.unit())) as u64;
            let smact = 0.1 + 0.85 * rng.unit();
            SimJob {
                name: format!("job{i}"),
                arrival_s,
                gpus,
                work_s: 60.0 * (240.0f64).powf(rng.unit()),
                true_bytes,
                memory: Some(MemoryDemand {
                    estimate_bytes: estimate,
                    upper_bound_bytes: estimate + estimate / 10 + 64 * MIB,
                }),
                load: Load {
                    smact,
                    smocc: smact * 0.4,
                    dram: 0.5 * rng.unit(),
                },
                priority: 0,
            }
        })
        .collect()
}
