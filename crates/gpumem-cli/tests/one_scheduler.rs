//! The simulator and the daemon drive the same scheduler (gpumem-place's `Scheduler`): the same
//! jobs — different memory, some priorities, one that must wait for an empty GPU and blocks the
//! queue behind it — start in the same order on the same GPUs in `gpumem simulate` and in
//! `gpumem serve` (fake GPUs, real job processes, the test driving the daemon's ticks).

use std::path::Path;
use std::time::{Duration, Instant};

use gpumem_core::profile;
use gpumem_monitor::FakeMonitor;
use gpumem_place::{Load, MemoryDemand};
use gpumem_server::identity::User;
use gpumem_server::launcher::JobDir;
use gpumem_server::wire::{JobRequest, JobState};
use gpumem_server::{Config, Daemon};
use gpumem_sim::{GpuSpec, NoInterference, SimConfig, SimJob, simulate};

const GIB: u64 = 1 << 30;

/// (GiB per GPU, seconds, priority), all submitted at once in this order on four 40 GiB GPUs.
const JOBS: [(u64, f64, i32); 8] = [
    (30, 3.0, 0),
    (20, 5.0, 0),
    (26, 2.0, 2),
    (30, 6.0, 0),
    (36, 2.0, 0),
    (16, 4.0, 1),
    (6, 3.0, 0),
    (9, 1.5, 0),
];

/// What started, instant by instant: (job index, GPUs), by job index within an instant.
type Starts = Vec<Vec<(usize, Vec<usize>)>>;

fn by_instant(mut starts: Vec<(f64, usize, Vec<usize>)>) -> Starts {
    starts.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut out: Starts = Vec::new();
    let mut last = f64::NAN;
    for (t, j, gpus) in starts {
        if t != last {
            out.push(Vec::new());
            last = t;
        }
        out.last_mut().expect("a group").push((j, gpus));
    }
    out
}

fn config(backfill: bool) -> Config {
    Config {
        policy: "safe-pack".into(),
        backfill,
        tick_ms: 50,
        ..Config::default()
    }
}

fn simulated(cfg: &Config) -> Starts {
    let gpus = vec![
        GpuSpec {
            capacity_bytes: 40 * GIB,
            idle_w: 0.0,
            max_w: 0.0
        };
        4
    ];
    // The daemon offers a GPU again as soon as its new job's memory shows up, which in a
    // simulation is at once: a GPU just given a job is off the market for an instant only.
    let sim = SimConfig {
        warmup_s: 1e-3,
        max_retries: cfg.max_retries,
        backfill: cfg.backfill,
        ..SimConfig::new(gpus, cfg.policy().unwrap())
    };
    let jobs: Vec<SimJob> = JOBS
        .iter()
        .enumerate()
        .map(|(i, &(gib, work_s, priority))| SimJob {
            name: format!("j{i}"),
            arrival_s: 0.0,
            gpus: 1,
            work_s,
            true_bytes: gib * GIB,
            memory: Some(MemoryDemand::point(gib * GIB)),
            load: Load::default(),
            priority,
        })
        .collect();
    let r = simulate(&jobs, &sim, &NoInterference).unwrap();
    assert_eq!((r.oom_crashes, r.runs.len()), (0, JOBS.len()));
    by_instant(
        r.runs
            .iter()
            .map(|x| (x.start_s, x.job, x.gpus.clone()))
            .collect(),
    )
}

/// Whether a job's process has reported its fake memory.
fn memory_shown(dir: &Path, id: u64) -> bool {
    std::fs::read_to_string(JobDir::new(dir, id).fake_memory())
        .is_ok_and(|s| s.trim().parse::<u64>().is_ok())
}

fn served(cfg: Config, name: &str) -> Starts {
    let dir = std::env::temp_dir().join(format!(
        "gpumem-one-scheduler-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let monitor = FakeMonitor::new(4, "fake A100", 40 * GIB);
    let fake = monitor.gpus.clone();
    let profile = profile::builtin("a100-40gb").unwrap();
    let tick = Duration::from_millis(cfg.tick_ms);
    let d = Daemon::open(
        &dir,
        Box::new(monitor),
        Some(fake),
        profile,
        cfg,
        env!("CARGO_BIN_EXE_gpumem").into(),
        false,
    )
    .unwrap();
    let mut ids = Vec::new();
    for &(gib, secs, priority) in &JOBS {
        let request: JobRequest = serde_json::from_value(serde_json::json!({
            "command": [format!("echo {} > \"$GPUMEM_FAKE_MEMORY_FILE\"; sleep {secs}", gib * GIB)],
            "shell": true,
            "mem_mib": gib * 1024,
            "priority": priority,
            "expected_s": secs,
        }))
        .unwrap();
        ids.push(
            d.submit(User::current(), request, Some((gib * GIB, gib * GIB)))
                .unwrap()
                .id,
        );
    }
    let started = Instant::now();
    loop {
        d.tick().unwrap();
        let jobs = d.jobs(User::current(), None);
        if jobs.iter().all(|j| j.state.is_final()) {
            break;
        }
        // The next tick sees every job started so far running with its memory shown, as the
        // simulation sees it at once (process start-up must not look like a long warm-up).
        for j in jobs
            .iter()
            .filter(|j| matches!(j.state, JobState::Starting | JobState::Running))
        {
            while !(JobDir::new(&dir, j.id).pid().is_some() && memory_shown(&dir, j.id)) {
                assert!(
                    started.elapsed() < Duration::from_secs(120),
                    "job {} never started",
                    j.id
                );
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the jobs did not finish"
        );
        std::thread::sleep(tick);
    }
    let jobs = d.jobs(User::current(), None);
    assert!(
        jobs.iter().all(|j| j.state == JobState::Finished),
        "{jobs:?}"
    );
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
    by_instant(
        jobs.iter()
            .map(|j| {
                let index = ids
                    .iter()
                    .position(|&id| id == j.id)
                    .expect("a submitted job");
                (
                    j.started_at.expect("it ran"),
                    index,
                    j.assigned.iter().map(|&g| g as usize).collect(),
                )
            })
            .collect(),
    )
}

#[test]
fn simulator_and_daemon_start_the_same_jobs_on_the_same_gpus() {
    let cfg = config(false);
    let sim = simulated(&cfg);
    // Priorities first (job 2, then 5), then submission order; safe-pack gives each an empty
    // GPU (a GPU just given a job waits for its memory to show). Job 3 (30 GiB) fits nowhere
    // and blocks the queue until job 2 ends; job 4 (36 GiB) then waits for an empty GPU, and
    // jobs 6 and 7 wait behind it; then they fill the tightest gaps.
    let expected: Starts = vec![
        vec![(0, vec![2]), (1, vec![3]), (2, vec![0]), (5, vec![1])],
        vec![(3, vec![0])],
        vec![(4, vec![2]), (6, vec![0]), (7, vec![3])],
    ];
    assert_eq!(sim, expected, "the simulator");
    assert_eq!(served(cfg, "fifo"), sim, "the daemon");
}

#[test]
fn with_backfill_too() {
    let cfg = config(true);
    let sim = simulated(&cfg);
    // Job 3 is promised GPU 0 when job 2 ends (t = 2). Meanwhile job 6 starts on GPU 2, which
    // it does not need, and job 7 on GPU 0 itself, as it ends by t = 1.5 (the daemon reads the
    // jobs' expected_s); job 4 waits for GPU 2 to empty.
    let expected: Starts = vec![
        vec![(0, vec![2]), (1, vec![3]), (2, vec![0]), (5, vec![1])],
        vec![(6, vec![2]), (7, vec![0])],
        vec![(3, vec![0])],
        vec![(4, vec![2])],
    ];
    assert_eq!(sim, expected, "the simulator");
    assert_eq!(served(cfg, "easy"), sim, "the daemon");
}
