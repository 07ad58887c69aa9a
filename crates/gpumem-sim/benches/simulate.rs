//! Scale: 100,000 synthetic jobs on 1,000 GPUs (target: under 10 s).

use gpumem_place::{MemoryView, Policy};
use gpumem_sim::{GpuSpec, ProportionalSharing, SimConfig, simulate, synth};

fn main() {
    divan::main();
}

const GIB: u64 = 1 << 30;

#[divan::bench(args = ["exclusive", "first-fit", "best-fit", "safe-pack"], sample_count = 3, sample_size = 1)]
fn jobs_100k_on_1000_gpus(bencher: divan::Bencher, policy: &str) {
    // About 1.5 jobs per GPU-hour over a week: a busy but not hopeless cluster.
    let jobs = synth::workload(100_000, 7.0 * 86_400.0, 80 * GIB, 42);
    let gpus = vec![
        GpuSpec {
            capacity_bytes: 80 * GIB,
            idle_w: 60.0,
            max_w: 700.0
        };
        1000
    ];
    let cfg = SimConfig::new(
        gpus,
        Policy::parse(
            policy,
            MemoryView::Estimate {
                headroom_bytes: 2 * GIB,
            },
        )
        .unwrap(),
    );
    bencher.bench(|| {
        simulate(
            divan::black_box(&jobs),
            &cfg,
            &ProportionalSharing::default(),
        )
        .unwrap()
    });
}
