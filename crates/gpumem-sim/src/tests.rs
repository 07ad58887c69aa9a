use gpumem_place::{Load, MemoryDemand, MemoryView, Policy};
use proptest::prelude::*;

use super::*;

const GIB: u64 = 1 << 30;

fn gpus(n: usize) -> Vec<GpuSpec> {
    vec![
        GpuSpec {
            capacity_bytes: 40 * GIB,
            idle_w: 60.0,
            max_w: 400.0
        };
        n
    ]
}

fn job(
    name: &str,
    arrival_s: f64,
    gpus: u32,
    work_s: f64,
    true_gib: u64,
    estimate_gib: u64,
    smact: f64,
) -> SimJob {
    SimJob {
        name: name.into(),
        arrival_s,
        gpus,
        work_s,
        true_bytes: true_gib * GIB,
        memory: Some(MemoryDemand::point(estimate_gib * GIB)),
        load: Load {
            smact,
            smocc: 0.1,
            dram: 0.1,
        },
        priority: 0,
    }
}

fn config(n: usize, policy: &str) -> SimConfig {
    let view = MemoryView::Estimate {
        headroom_bytes: 2 * GIB,
    };
    SimConfig {
        warmup_s: 0.0,
        ..SimConfig::new(gpus(n), Policy::parse(policy, view).unwrap())
    }
}

fn run(jobs: &[SimJob], cfg: &SimConfig) -> Report {
    simulate(jobs, cfg, &ProportionalSharing::default()).unwrap()
}

#[test]
fn one_job_alone_takes_its_run_time() {
    let r = run(
        &[job("a", 10.0, 1, 100.0, 5, 5, 0.5)],
        &config(1, "exclusive"),
    );
    assert_eq!(
        (r.makespan_s, r.mean_wait_s, r.mean_jct_s, r.oom_crashes),
        (100.0, 0.0, 100.0, 0)
    );
    assert!(
        (r.mean_busy - 1.0).abs() < 1e-12 && (r.mean_smact - 0.5).abs() < 1e-12,
        "{r:?}"
    );
    // 60 W idle + 340 W × 0.5 SMACT for 100 s.
    assert!(
        (r.energy_kwh - 230.0 * 100.0 / 3.6e6).abs() < 1e-12,
        "{r:?}"
    );
}

#[test]
fn exclusive_queues_and_collocation_overlaps() {
    let jobs = [
        job("a", 0.0, 1, 100.0, 5, 5, 0.3),
        job("b", 0.0, 1, 100.0, 5, 5, 0.3),
    ];
    let ex = run(&jobs, &config(1, "exclusive"));
    assert_eq!(
        (ex.makespan_s, ex.mean_wait_s, ex.p95_wait_s),
        (200.0, 50.0, 100.0)
    );
    let packed = run(&jobs, &config(1, "first-fit"));
    assert_eq!(
        (packed.makespan_s, packed.mean_wait_s),
        (100.0, 0.0),
        "0.6 summed SMACT: no slowdown"
    );
}

#[test]
fn saturated_gpus_slow_both_jobs() {
    let jobs = [
        job("a", 0.0, 1, 100.0, 5, 5, 0.8),
        job("b", 0.0, 1, 100.0, 5, 5, 0.8),
    ];
    let r = run(&jobs, &config(1, "first-fit"));
    assert!(
        (r.makespan_s - 160.0).abs() < 1e-9,
        "1.6 pressure: both at 1/1.6 speed, {r:?}"
    );
    let calm = simulate(&jobs, &config(1, "first-fit"), &NoInterference).unwrap();
    assert_eq!(calm.makespan_s, 100.0);
}

#[test]
fn an_underestimate_crashes_and_recovers_exclusively() {
    // b claims 10 GiB but takes 30: beside a's 20 GiB the GPU overflows.
    let jobs = [
        job("a", 0.0, 1, 1000.0, 20, 20, 0.3),
        job("b", 1.0, 1, 500.0, 30, 10, 0.3),
    ];
    let r = run(&jobs, &config(1, "first-fit"));
    assert_eq!((r.oom_crashes, r.failed_jobs), (1, 0));
    assert!(
        (r.wasted_gpu_min - 1.0).abs() < 1e-12,
        "crash after 60 s on one GPU: {r:?}"
    );
    let b: Vec<&Run> = r.runs.iter().filter(|x| x.job == 1).collect();
    assert_eq!(b.len(), 2);
    assert_eq!(
        (b[0].outcome, b[0].start_s, b[0].end_s),
        (Outcome::Crashed, 1.0, 61.0)
    );
    assert_eq!(
        (b[1].outcome, b[1].start_s, b[1].end_s),
        (Outcome::Finished, 1000.0, 1500.0)
    );
    // The oracle form never crashes.
    let oracle = SimConfig {
        policy: Policy::parse("first-fit", MemoryView::Oracle).unwrap(),
        ..config(1, "first-fit")
    };
    assert_eq!(run(&jobs, &oracle).oom_crashes, 0);
}

#[test]
fn a_job_larger_than_the_gpu_fails_after_its_retries() {
    let jobs = [job("huge", 0.0, 1, 100.0, 50, 10, 0.3)];
    let r = run(&jobs, &config(1, "first-fit"));
    assert_eq!((r.oom_crashes, r.failed_jobs), (4, 1), "1 try + 3 retries");
    assert_eq!(r.runs.last().unwrap().outcome, Outcome::Failed);
}

#[test]
fn multi_gpu_jobs_start_on_all_their_gpus_at_once() {
    let jobs = [
        job("one", 0.0, 1, 100.0, 5, 5, 0.3),
        job("two", 1.0, 2, 50.0, 5, 5, 0.3),
    ];
    let r = run(&jobs, &config(2, "exclusive"));
    let two = r.runs.iter().find(|x| x.job == 1).unwrap();
    assert_eq!(
        (two.gpus.clone(), two.start_s, two.end_s),
        (vec![0, 1], 100.0, 150.0)
    );
}

#[test]
fn backfill_uses_gaps_without_delaying_the_head() {
    let jobs = [
        job("long", 0.0, 1, 1000.0, 5, 5, 0.3),
        job("wide", 1.0, 2, 100.0, 5, 5, 0.3),
        job("short", 2.0, 1, 100.0, 5, 5, 0.3),
        job("late-long", 3.0, 1, 5000.0, 5, 5, 0.3),
    ];
    let fifo = run(&jobs, &config(2, "exclusive"));
    let easy = run(
        &jobs,
        &SimConfig {
            backfill: true,
            ..config(2, "exclusive")
        },
    );
    let start = |r: &Report, j: usize| r.runs.iter().find(|x| x.job == j).unwrap().start_s;
    assert_eq!((start(&fifo, 1), start(&fifo, 2)), (1000.0, 1100.0));
    assert_eq!(start(&easy, 2), 2.0, "short ends before wide's reservation");
    assert_eq!(start(&easy, 1), 1000.0, "the head is not delayed");
    assert!(
        start(&easy, 3) >= 1000.0,
        "late-long would delay the head, so it waits"
    );
}

#[test]
fn higher_priority_jobs_start_first() {
    let mut jobs = vec![
        job("first", 0.0, 1, 100.0, 5, 5, 0.3),
        job("low", 1.0, 1, 100.0, 5, 5, 0.3),
        job("high", 2.0, 1, 100.0, 5, 5, 0.3),
    ];
    jobs[2].priority = 1;
    let r = run(&jobs, &config(1, "exclusive"));
    let start = |j: usize| r.runs.iter().find(|x| x.job == j).unwrap().start_s;
    assert_eq!((start(0), start(2), start(1)), (0.0, 100.0, 200.0));
    // All at priority 0: arrival order.
    jobs[2].priority = 0;
    let r = run(&jobs, &config(1, "exclusive"));
    assert_eq!(r.runs.iter().map(|x| x.job).collect::<Vec<_>>(), [0, 1, 2]);
    // Jobs that arrive together are ordered by priority before any starts.
    let mut together = vec![
        job("low", 0.0, 1, 100.0, 5, 5, 0.3),
        job("high", 0.0, 1, 100.0, 5, 5, 0.3),
    ];
    together[1].priority = 1;
    let r = run(&together, &config(1, "exclusive"));
    assert_eq!(r.runs.iter().map(|x| x.job).collect::<Vec<_>>(), [1, 0]);
}

#[test]
fn warm_up_keeps_a_fresh_gpu_off_the_market() {
    let jobs = [
        job("a", 0.0, 1, 100.0, 5, 5, 0.1),
        job("b", 1.0, 1, 100.0, 5, 5, 0.1),
    ];
    let cfg = SimConfig {
        warmup_s: 30.0,
        ..config(1, "first-fit")
    };
    let r = run(&jobs, &cfg);
    assert_eq!(r.runs.iter().find(|x| x.job == 1).unwrap().start_s, 30.0);
}

#[test]
fn bad_jobs_are_rejected_with_their_name() {
    let cfg = config(2, "first-fit");
    let e = simulate(&[job("big", 0.0, 3, 1.0, 1, 1, 0.1)], &cfg, &NoInterference).unwrap_err();
    assert_eq!(
        e.to_string(),
        "job 0 (`big`) needs 3 GPUs; the cluster has 2"
    );
    let e = simulate(
        &[job("nan", f64::NAN, 1, 1.0, 1, 1, 0.1)],
        &cfg,
        &NoInterference,
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "job 0 (`nan`): arrival time must be a finite non-negative number"
    );
}

#[test]
fn same_inputs_same_report() {
    let jobs = synth::workload(300, 3600.0, 40 * GIB, 7);
    let cfg = config(8, "best-fit");
    assert_eq!(run(&jobs, &cfg), run(&jobs, &cfg));
    assert_ne!(
        synth::workload(300, 3600.0, 40 * GIB, 7),
        synth::workload(300, 3600.0, 40 * GIB, 8)
    );
}

fn policies() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec![
        "exclusive",
        "round-robin",
        "first-fit",
        "best-fit",
        "most-free-memory",
        "least-utilized",
        "first-fit+carma",
        "safe-pack",
    ])
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Every job ends exactly once (finished or failed), crashes stay within the retry cap, and
    /// whenever a GPU's true memory exceeds its capacity a crash is recorded there.
    #[test]
    fn invariants(seed in 0u64..1_000_000, n in 1usize..40, g in 1usize..5, policy in policies(),
                  underestimate in 0.3f64..1.2, backfill in any::<bool>()) {
        let mut jobs = synth::workload(n, 2000.0, 40 * GIB, seed);
        for j in &mut jobs {
            j.gpus = j.gpus.min(g as u32);
            // Make some estimates wrong, low or high, so crashes happen.
            j.memory = Some(MemoryDemand::point((j.true_bytes as f64 * underestimate) as u64));
        }
        let cfg = SimConfig { backfill, warmup_s: 5.0, ..SimConfig::new(gpus(g), Policy::parse(policy, MemoryView::Estimate { headroom_bytes: GIB }).unwrap()) };
        let r = simulate(&jobs, &cfg, &ProportionalSharing::default()).unwrap();
        for j in 0..n {
            let ends = r.runs.iter().filter(|x| x.job == j && x.outcome != Outcome::Crashed).count();
            prop_assert_eq!(ends, 1, "job {} ended {} times", j, ends);
            let crashes = r.runs.iter().filter(|x| x.job == j && x.outcome != Outcome::Finished).count();
            prop_assert!(crashes as u32 <= cfg.max_retries + 1);
        }
        let crashed_runs = r.runs.iter().filter(|x| x.outcome != Outcome::Finished).count() as u64;
        prop_assert_eq!(crashed_runs, r.oom_crashes);
        for x in &r.runs {
            for &gpu in &x.gpus {
                let active: Vec<&Run> = r.runs.iter().filter(|y| y.gpus.contains(&gpu) && y.start_s <= x.start_s && y.end_s > x.start_s).collect();
                let used: u64 = active.iter().map(|y| jobs[y.job].true_bytes).sum();
                if used > 40 * GIB {
                    prop_assert!(active.iter().any(|y| y.outcome != Outcome::Finished),
                        "GPU {} over capacity at {} with no crash", gpu, x.start_s);
                }
            }
        }
        prop_assert!(r.mean_busy <= 1.0 + 1e-9 && r.mean_smact <= r.mean_busy + 1e-9);
    }
}
