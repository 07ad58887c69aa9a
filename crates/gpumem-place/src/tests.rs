use super::*;

const GIB: u64 = 1 << 30;

fn job(id: u64, gpus: u32, estimate_gib: u64, true_gib: u64, smact: f64) -> Job {
    Job {
        id,
        gpus,
        memory: Some(MemoryDemand {
            estimate_bytes: estimate_gib * GIB,
            upper_bound_bytes: estimate_gib * GIB + GIB,
        }),
        true_bytes: Some(true_gib * GIB),
        load: Load {
            smact,
            smocc: smact / 2.0,
            dram: smact / 2.0,
        },
        exclusive: false,
    }
}

/// Four 40 GiB GPUs holding `used` GiB each (one resident per non-zero entry).
fn cluster(used: [u64; 4]) -> Cluster {
    let mut c = Cluster::new([40 * GIB; 4]);
    for (g, &u) in used.iter().enumerate() {
        if u > 0 {
            let j = job(100 + g as u64, 1, u, u, 0.3);
            c.assign(&j, &[g], false, -100.0, 0.0);
        }
    }
    c
}

fn estimate() -> MemoryView {
    MemoryView::Estimate {
        headroom_bytes: 2 * GIB,
    }
}

fn place(rule: &str, view: MemoryView, c: &Cluster, j: &Job) -> Option<Vec<usize>> {
    Policy::parse(rule, view).unwrap().place(c, j, 0.0)
}

#[test]
fn exclusive_takes_only_empty_gpus() {
    let c = cluster([1, 0, 5, 0]);
    assert_eq!(
        place("exclusive", MemoryView::Blind, &c, &job(1, 1, 1, 1, 0.1)),
        Some(vec![1])
    );
    assert_eq!(
        place("exclusive", MemoryView::Blind, &c, &job(1, 2, 1, 1, 0.1)),
        Some(vec![1, 3])
    );
    assert_eq!(
        place("exclusive", MemoryView::Blind, &c, &job(1, 3, 1, 1, 0.1)),
        None
    );
}

#[test]
fn first_fit_takes_the_lowest_index_that_fits() {
    let c = cluster([30, 20, 10, 0]);
    // 15 + 2 headroom fits on GPUs 1 (20 free), 2 and 3; the first is 1.
    assert_eq!(
        place("first-fit", estimate(), &c, &job(1, 1, 15, 15, 0.1)),
        Some(vec![1])
    );
    // Oracle: true 9 GiB fits on GPU 0 (10 free).
    assert_eq!(
        place("first-fit", MemoryView::Oracle, &c, &job(1, 1, 15, 9, 0.1)),
        Some(vec![0])
    );
    // A two-GPU job: the two lowest that fit (5 + 2 ≤ 10 free on GPU 0).
    assert_eq!(
        place("first-fit", estimate(), &c, &job(1, 2, 5, 5, 0.1)),
        Some(vec![0, 1])
    );
    assert_eq!(
        place("first-fit", estimate(), &c, &job(1, 2, 9, 9, 0.1)),
        Some(vec![1, 2])
    );
}

#[test]
fn best_fit_leaves_the_smallest_hole() {
    let c = cluster([30, 20, 10, 0]);
    assert_eq!(
        place("best-fit", estimate(), &c, &job(1, 1, 7, 7, 0.1)),
        Some(vec![0])
    );
    assert_eq!(
        place("best-fit", estimate(), &c, &job(1, 1, 15, 15, 0.1)),
        Some(vec![1])
    );
    // Equal holes: the lower index wins.
    let tie = cluster([10, 10, 0, 0]);
    assert_eq!(
        place("best-fit", estimate(), &tie, &job(1, 1, 5, 5, 0.1)),
        Some(vec![0])
    );
}

#[test]
fn most_free_memory_spreads() {
    let c = cluster([30, 20, 10, 0]);
    assert_eq!(
        place("most-free-memory", estimate(), &c, &job(1, 1, 1, 1, 0.1)),
        Some(vec![3])
    );
    assert_eq!(
        place("most-free-memory", estimate(), &c, &job(1, 2, 1, 1, 0.1)),
        Some(vec![2, 3])
    );
}

#[test]
fn least_utilized_follows_smact() {
    let mut c = cluster([0, 0, 0, 0]);
    for (g, s) in [(0, 0.6), (1, 0.2), (2, 0.9), (3, 0.4)] {
        c.assign(&job(10 + g as u64, 1, 1, 1, s), &[g], false, -100.0, 0.0);
    }
    assert_eq!(
        place("least-utilized", estimate(), &c, &job(1, 1, 1, 1, 0.1)),
        Some(vec![1])
    );
    assert_eq!(
        place("least-utilized", estimate(), &c, &job(1, 2, 1, 1, 0.1)),
        Some(vec![1, 3])
    );
}

#[test]
fn round_robin_cycles_and_ignores_memory() {
    // The cursor starts after the GPU that took the last job (GPU 0, nearly full).
    let mut c = cluster([39, 0, 0, 0]);
    let j = job(1, 1, 20, 20, 0.1);
    let p = Policy::parse("round-robin", MemoryView::Blind).unwrap();
    let mut order = Vec::new();
    for t in 0..5 {
        let g = p.place(&c, &j, t as f64).unwrap();
        c.assign(&j, &g, false, t as f64, 0.0);
        order.push(g[0]);
    }
    assert_eq!(order, [1, 2, 3, 0, 1]);
}

#[test]
fn estimate_form_needs_headroom_and_failed_estimates_need_an_empty_gpu() {
    let c = cluster([25, 25, 25, 25]);
    // 15 GiB free: 14 + 2 does not fit, 13 + 2 does.
    assert_eq!(
        place("first-fit", estimate(), &c, &job(1, 1, 14, 1, 0.1)),
        None
    );
    assert_eq!(
        place("first-fit", estimate(), &c, &job(1, 1, 13, 1, 0.1)),
        Some(vec![0])
    );
    let mut failed = job(1, 1, 1, 1, 0.1);
    failed.memory = None;
    assert_eq!(place("first-fit", estimate(), &c, &failed), None);
    assert_eq!(
        place("first-fit", estimate(), &cluster([25, 0, 25, 25]), &failed),
        Some(vec![1])
    );
    // An estimate above the GPU's size still gets an empty GPU (it can get nothing better).
    assert_eq!(
        place(
            "best-fit",
            estimate(),
            &cluster([1, 0, 1, 1]),
            &job(1, 1, 45, 1, 0.1)
        ),
        Some(vec![1])
    );
}

#[test]
fn carma_filter_skips_busy_gpus() {
    let mut c = cluster([0, 0, 0, 0]);
    let busy = Job {
        load: Load {
            smact: 0.85,
            smocc: 0.5,
            dram: 0.1,
        },
        ..job(10, 1, 1, 1, 0.0)
    };
    let compute_only = Job {
        load: Load {
            smact: 0.85,
            smocc: 0.2,
            dram: 0.1,
        },
        ..job(11, 1, 1, 1, 0.0)
    };
    c.assign(&busy, &[0], false, -100.0, 0.0);
    c.assign(&compute_only, &[1], false, -100.0, 0.0);
    let j = job(1, 1, 1, 1, 0.1);
    assert_eq!(place("first-fit", estimate(), &c, &j), Some(vec![0]));
    assert_eq!(
        place("first-fit+carma", estimate(), &c, &j),
        Some(vec![1]),
        "SMOCC below 0.45 and DRAMA below 0.4 pass"
    );
}

#[test]
fn warming_gpus_are_not_offered() {
    let mut c = cluster([0, 0, 0, 0]);
    c.assign(&job(10, 1, 1, 1, 0.1), &[0], false, 0.0, 30.0);
    let j = job(1, 1, 1, 1, 0.1);
    let p = Policy::parse("first-fit", estimate()).unwrap();
    assert_eq!(p.place(&c, &j, 10.0), Some(vec![1]));
    assert_eq!(p.place(&c, &j, 31.0), Some(vec![0]));
}

#[test]
fn multi_gpu_jobs_get_all_their_gpus_or_wait() {
    let c = cluster([35, 35, 35, 0]);
    assert_eq!(
        place("first-fit", estimate(), &c, &job(1, 2, 5, 5, 0.1)),
        None
    );
    assert_eq!(
        place("first-fit", estimate(), &c, &job(1, 1, 5, 5, 0.1)),
        Some(vec![3])
    );
    assert_eq!(
        place("first-fit", estimate(), &c, &job(1, 5, 1, 1, 0.1)),
        None,
        "more GPUs than exist"
    );
}

#[test]
fn recovery_jobs_run_alone_and_keep_others_off() {
    let mut c = cluster([5, 0, 0, 0]);
    let mut r = job(1, 1, 1, 1, 0.1);
    r.exclusive = true;
    let p = Policy::parse("first-fit", estimate()).unwrap();
    let g = p.place(&c, &r, 0.0).unwrap();
    assert_eq!(g, vec![1]);
    c.assign(&r, &g, p.runs_alone(&r), 0.0, 0.0);
    // GPU 1 is held exclusively: three GPUs remain.
    assert_eq!(p.place(&c, &job(2, 3, 1, 1, 0.1), 1.0), Some(vec![0, 2, 3]));
    assert_eq!(p.place(&c, &job(2, 4, 1, 1, 0.1), 1.0), None);
}

#[test]
fn safe_pack_admits_by_upper_bound_against_residents_bounds() {
    let mut c = cluster([0, 0, 0, 0]);
    // A resident that shows 10 GiB so far but may grow to 20 GiB while it warms up (until t = 30).
    let mut r = job(10, 1, 19, 10, 0.2);
    r.memory = Some(MemoryDemand {
        estimate_bytes: 19 * GIB,
        upper_bound_bytes: 20 * GIB,
    });
    c.assign(&r, &[0], false, 0.0, 30.0);
    // A daemon may offer the GPU as soon as the job's memory shows up.
    c.gpus[0].warm_until_s = 0.0;
    let p = Policy::parse("safe-pack", MemoryView::Blind).unwrap();
    // Bound 19 + 0.5 headroom ≤ 20 free-by-bound: shares GPU 0 (tightest fit below saturation).
    assert_eq!(p.place(&c, &job(1, 1, 18, 18, 0.3), 10.0), Some(vec![0]));
    // Bound 20 + 0.5 does not fit beside the resident's bound (though 30 GiB show free): empty GPU.
    assert_eq!(p.place(&c, &job(1, 1, 19, 19, 0.3), 10.0), Some(vec![1]));
    // Warmed up, the resident counts at what it shows: 30 GiB free.
    assert_eq!(p.place(&c, &job(1, 1, 19, 19, 0.3), 40.0), Some(vec![0]));
}

#[test]
fn safe_pack_avoids_saturation_when_it_can() {
    let mut c = cluster([0, 0, 0, 0]);
    for g in 0..3 {
        c.assign(&job(10 + g as u64, 1, 5, 5, 0.8), &[g], false, -100.0, 0.0);
    }
    let p = Policy::parse("safe-pack", MemoryView::Blind).unwrap();
    // Pressure 0.8 + 0.5 > 1: the empty GPU 3 first.
    assert_eq!(p.place(&c, &job(1, 1, 5, 5, 0.5), 0.0), Some(vec![3]));
    c.assign(&job(13, 1, 5, 5, 0.8), &[3], false, -100.0, 0.0);
    // All shared: the least pressure within the cap (1.3 ≤ 2).
    assert_eq!(p.place(&c, &job(1, 1, 5, 5, 0.5), 0.0), Some(vec![0]));
    // 0.8 + 1.3 = 2.1 above the cap: wait.
    assert_eq!(p.place(&c, &job(1, 1, 5, 5, 1.3), 0.0), None);
    // Below saturation, consolidate: a lightly loaded shared GPU beats an empty one.
    let mut light = cluster([0, 0, 0, 0]);
    light.assign(&job(20, 1, 5, 5, 0.2), &[2], false, -100.0, 0.0);
    assert_eq!(p.place(&light, &job(1, 1, 5, 5, 0.3), 0.0), Some(vec![2]));
}

#[test]
fn safe_pack_runs_jobs_it_cannot_model_alone() {
    let c = cluster([5, 0, 0, 0]);
    let p = Policy::parse("safe-pack", MemoryView::Blind).unwrap();
    let mut j = job(1, 1, 1, 1, 0.1);
    j.memory = None;
    assert!(p.runs_alone(&j));
    assert_eq!(p.place(&c, &j, 0.0), Some(vec![1]));
}

#[test]
fn unknown_policy_is_a_one_line_error() {
    let e = Policy::parse("fastest", MemoryView::Blind)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown policy `fastest`") && e.contains("safe-pack") && !e.contains('\n'),
        "{e}"
    );
    assert!(
        Policy::parse("best-fit+carma", MemoryView::Blind)
            .unwrap()
            .carma_filter
    );
}

#[test]
fn release_removes_the_job_everywhere() {
    let mut c = cluster([0, 0, 0, 0]);
    let j = job(7, 2, 1, 1, 0.1);
    c.assign(&j, &[1, 3], false, 0.0, 0.0);
    assert_eq!(c.release(7), vec![1, 3]);
    assert!(c.gpus.iter().all(|g| g.residents.is_empty()));
}

mod sched {
    use std::collections::HashMap;

    use super::*;
    use crate::{Decision, Forecast, NoForecast, Queued, SchedOptions, Scheduler};

    fn scheduler(rule: &str, backfill: bool) -> Scheduler {
        let policy = Policy::parse(rule, estimate()).unwrap();
        Scheduler::new(SchedOptions {
            backfill,
            warmup_s: 0.0,
            ..SchedOptions::new(policy)
        })
    }

    fn started(d: &[Decision]) -> Vec<(u64, Vec<usize>)> {
        d.iter().map(|d| (d.job, d.gpus.clone())).collect()
    }

    /// Predicted ends of running jobs and run times of waiting ones, by job id.
    #[derive(Default)]
    struct Times {
        ends: HashMap<u64, f64>,
        runs: HashMap<u64, f64>,
    }

    impl Forecast for Times {
        fn end_s(&self, job: u64) -> f64 {
            self.ends.get(&job).copied().unwrap_or(f64::INFINITY)
        }
        fn run_s(&self, job: u64) -> Option<f64> {
            self.runs.get(&job).copied()
        }
    }

    #[test]
    fn higher_priority_first_then_submission_order() {
        let mut s = scheduler("exclusive", false);
        let mut c = Cluster::new([40 * GIB; 1]);
        for (id, priority, submitted) in [(1, 0, 1), (2, 5, 2), (3, 0, 0), (4, 5, 3)] {
            assert_eq!(
                s.enqueue(job(id, 1, 1, 1, 0.1), priority, submitted, 0),
                Queued::Waiting
            );
        }
        assert_eq!(s.waiting().map(|j| j.id).collect::<Vec<_>>(), [2, 4, 3, 1]);
        assert_eq!(
            started(&s.schedule(&mut c, 0.0, &mut NoForecast)),
            [(2, vec![0])]
        );
        c.release(2);
        assert_eq!(
            started(&s.schedule(&mut c, 1.0, &mut NoForecast)),
            [(4, vec![0])]
        );
    }

    #[test]
    fn the_head_blocks_the_queue() {
        let mut s = scheduler("first-fit", false);
        let mut c = cluster([30, 0, 0, 0]);
        // A four-GPU head cannot start (GPU 0 is too full); the small job behind it waits too.
        s.enqueue(job(1, 4, 15, 15, 0.1), 0, 0, 0);
        s.enqueue(job(2, 1, 1, 1, 0.1), 0, 1, 0);
        assert!(s.schedule(&mut c, 0.0, &mut NoForecast).is_empty());
        assert_eq!(s.len(), 2);
        // Once the head is cancelled, the small job starts.
        assert!(s.remove(1).is_some() && !s.contains(1));
        assert_eq!(
            started(&s.schedule(&mut c, 0.0, &mut NoForecast)),
            [(2, vec![0])]
        );
        assert!(s.is_empty());
    }

    #[test]
    fn crashed_jobs_recover_first_alone_until_the_retry_limit() {
        let mut s = scheduler("first-fit", false);
        let mut c = cluster([5, 0, 0, 0]);
        s.enqueue(job(1, 1, 1, 1, 0.1), 9, 0, 0);
        assert_eq!(s.enqueue(job(2, 1, 1, 1, 0.1), 0, 1, 1), Queued::Recovering);
        assert_eq!(
            s.enqueue(job(3, 1, 1, 1, 0.1), 0, 2, 4),
            Queued::Failed,
            "1 try + 3 retries"
        );
        assert!(!s.contains(3));
        // Recovery before priority; the recovering job runs alone (an empty GPU), the other
        // joins GPU 0.
        let d = s.schedule(&mut c, 0.0, &mut NoForecast);
        assert_eq!(started(&d), [(2, vec![1]), (1, vec![0])]);
        assert_eq!((d[0].alone, d[1].alone), (true, false));
        assert!(c.gpus[1].residents[0].exclusive);
        assert!(s.alone(&job(2, 1, 1, 1, 0.1), 1) && !s.alone(&job(2, 1, 1, 1, 0.1), 0));
        // Recovering jobs keep the order they crashed in.
        s.enqueue(job(4, 1, 1, 1, 0.1), 0, 0, 2);
        s.enqueue(job(5, 1, 1, 1, 0.1), 0, 0, 1);
        assert_eq!(s.waiting().map(|j| j.id).collect::<Vec<_>>(), [4, 5]);
    }

    #[test]
    fn backfill_uses_gaps_without_delaying_the_head() {
        // Two GPUs; job 10 runs on GPU 0 until t = 1000. A two-GPU head waits for it.
        let mut c = Cluster::new([40 * GIB; 2]);
        c.assign(&job(10, 1, 5, 5, 0.3), &[0], true, 0.0, 0.0);
        let mut t = Times::default();
        t.ends.insert(10, 1000.0);
        t.runs.extend([(2, 100.0), (3, 5000.0)]);
        let queue = |s: &mut Scheduler| {
            s.enqueue(job(1, 2, 5, 5, 0.3), 0, 0, 0);
            s.enqueue(job(2, 1, 5, 5, 0.3), 0, 1, 0);
            s.enqueue(job(3, 1, 5, 5, 0.3), 0, 2, 0);
        };
        let mut fifo = scheduler("exclusive", false);
        queue(&mut fifo);
        assert!(
            fifo.schedule(&mut c.clone(), 2.0, &mut t).is_empty(),
            "without backfill all wait"
        );
        let mut easy = scheduler("exclusive", true);
        queue(&mut easy);
        let d = easy.schedule(&mut c.clone(), 2.0, &mut t);
        // Job 2 ends (t = 102) before the head's reservation (t = 1000); job 3 would not.
        assert_eq!(started(&d), [(2, vec![1])]);
        assert!(d[0].backfilled);
        // Without predictions only GPUs the head does not need are used: none here.
        let mut blind = scheduler("exclusive", true);
        queue(&mut blind);
        assert!(
            blind
                .schedule(&mut c.clone(), 2.0, &mut NoForecast)
                .is_empty()
        );
    }

    #[test]
    fn backfill_takes_reserved_gpus_only_for_jobs_that_end_in_time() {
        // Three GPUs with 20 GiB jobs: the one on GPU 0 ends at t = 100, the others at unknown
        // times. A 30 GiB head waits; it is promised GPU 0 at t = 100.
        let mut c = Cluster::new([40 * GIB; 3]);
        for g in 0..3 {
            c.assign(&job(10 + g as u64, 1, 20, 20, 0.3), &[g], false, 0.0, 0.0);
        }
        let mut t = Times::default();
        t.ends.insert(10, 100.0);
        let mut s = scheduler("first-fit", true);
        s.enqueue(job(1, 1, 30, 30, 0.3), 0, 0, 0);
        // First-fit puts a 10 GiB job on GPU 0, which is reserved: with no run time it waits.
        s.enqueue(job(2, 1, 10, 10, 0.3), 0, 1, 0);
        assert!(s.schedule(&mut c.clone(), 0.0, &mut t).is_empty());
        // Ending by t = 50 it may use GPU 0.
        t.runs.insert(2, 50.0);
        assert_eq!(
            started(&s.schedule(&mut c.clone(), 0.0, &mut t)),
            [(2, vec![0])]
        );
    }

    #[test]
    fn backfill_without_predictions_keeps_off_the_heads_gpus() {
        // GPU 0 nearly full, GPUs 1 and 2 with 5 GiB free; no end is known. The 9 GiB head
        // (11 with headroom) fits nowhere now; it is promised GPU 0 at an unknown time.
        let mut c = Cluster::new([40 * GIB; 3]);
        for (g, used) in [(0, 38), (1, 35), (2, 35)] {
            c.assign(
                &job(10 + g as u64, 1, used, used, 0.3),
                &[g],
                false,
                0.0,
                0.0,
            );
        }
        let mut s = scheduler("first-fit", true);
        s.enqueue(job(1, 1, 9, 9, 0.3), 0, 0, 0);
        s.enqueue(job(2, 1, 1, 1, 0.3), 0, 1, 0);
        let d = s.schedule(&mut c, 0.0, &mut NoForecast);
        assert_eq!(started(&d), [(2, vec![1])]);
        assert!(d[0].backfilled && s.contains(1));
    }
}
