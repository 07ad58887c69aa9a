//! `gpumem simulate` end to end on the seed authors' CARMA workload (../shared/data/carma).
//!
//! The replay estimates trace real PyTorch models, so the full runs need GPUMEM_PYTHON (CI sets
//! it and GPUMEM_TEST_REQUIRE_TORCH=1); the error paths run everywhere.

use std::path::{Path, PathBuf};

mod common;
use common::{bad_input, gpumem};

fn tmp(name: &str) -> PathBuf {
    common::scratch("sim-test", name)
}

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data")
}

fn carma(file: &str) -> String {
    data().join("carma").join(file).display().to_string()
}

fn torch() -> bool {
    common::torch("the CARMA simulations")
}

#[test]
fn bad_simulate_input_is_a_one_line_error() {
    if !data().exists() {
        return;
    }
    let (t1, tasks) = (carma("philly_trace-t1.csv"), carma("carma_tasks.csv"));
    let base = ["simulate", "--trace", &t1, "--tasks", &tasks];
    let with = |extra: &[&'static str]| -> Vec<String> {
        base.iter()
            .map(|s| s.to_string())
            .chain(extra.iter().map(|s| s.to_string()))
            .collect()
    };
    let run = |args: Vec<String>, needle: &str| {
        bad_input(&args.iter().map(String::as_str).collect::<Vec<_>>(), needle)
    };
    run(with(&["--policy", "fastest"]), "unknown policy `fastest`");
    run(
        with(&["--estimator", "oracle"]),
        "unknown estimator `oracle`",
    );
    run(
        with(&["--gpus", "four-a100"]),
        "--gpus `four-a100` is not COUNTxGPU",
    );
    run(with(&["--gpus", "4xb200"]), "unknown GPU `b200`");
    run(
        with(&["--max-pressure", "0.5"]),
        "--max-pressure must be a number of at least 1",
    );
    run(
        with(&["--interference", "magic"]),
        "unknown interference model `magic`",
    );
    let trace = tmp("bad-trace.csv");
    std::fs::write(&trace, "arrival_s,task\n0,vgg\n10,resnet9000\n").unwrap();
    bad_input(
        &[
            "simulate",
            "--trace",
            trace.to_str().unwrap(),
            "--tasks",
            &tasks,
        ],
        "bad-trace.csv: line 3: unknown task `resnet9000`",
    );
    bad_input(
        &["simulate", "--trace", "/nonexistent.csv", "--tasks", &tasks],
        "/nonexistent.csv",
    );
}

/// The acceptance runs: every policy × estimator on all four traces. gpumem's safe-pack with its
/// own replay estimates never crashes, nor does any oracle policy.
#[test]
fn carma_traces_compare() {
    if !data().exists() || !torch() {
        return;
    }
    let profile = tmp("carma-a100.toml");
    let rw = data().join("paper_realworld_a100_40gb.csv");
    // Rule stated in advance: calibrate on one row, resnet50 at batch 32 (file line 4).
    let o = gpumem(&[
        "calibrate",
        rw.to_str().unwrap(),
        "--rows",
        "lines:4",
        "--out",
        profile.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tasks = carma("carma_tasks.csv");
    for trace in [
        "philly_trace-t1.csv",
        "philly_trace-t2.csv",
        "philly_heavy-60-tasks.csv",
        "philly_mix-90-tasks.csv",
    ] {
        let t = carma(trace);
        let args = [
            "simulate",
            "--trace",
            &t,
            "--tasks",
            &tasks,
            "--profile",
            profile.to_str().unwrap(),
            "--compare",
            "--json",
        ];
        let o = gpumem(&args);
        assert!(
            o.status.success(),
            "{trace}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(rows.len(), 47, "{trace}");
        for r in &rows {
            for key in [
                "makespan_s",
                "mean_wait_s",
                "p95_wait_s",
                "mean_jct_s",
                "oom_crashes",
                "wasted_gpu_min",
                "mean_smact",
                "energy_kwh",
                "policy",
                "estimator",
            ] {
                assert!(r.get(key).is_some(), "{trace}: missing {key}");
            }
            if r["estimator"] == "measured"
                || (r["policy"] == "safe-pack" && r["estimator"] == "replay")
            {
                assert_eq!(r["oom_crashes"], 0, "{trace}: {r}");
            }
        }
        let safe = rows
            .iter()
            .find(|r| r["policy"] == "safe-pack" && r["estimator"] == "replay")
            .unwrap();
        let unmodelled: Vec<&str> = safe["unmodelled"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let cannot = ["dlrm", "maskrcnn", "mnist_train"];
        assert!(
            !unmodelled.is_empty() && unmodelled.iter().all(|t| cannot.contains(t)),
            "{trace}: {unmodelled:?}"
        );
        // The acceptance: at least 25% shorter than exclusive placement, with no crash (above).
        let exclusive = rows.iter().find(|r| r["policy"] == "exclusive").unwrap();
        let (safe_s, excl_s) = (
            safe["makespan_s"].as_f64().unwrap(),
            exclusive["makespan_s"].as_f64().unwrap(),
        );
        assert!(
            safe_s <= 0.75 * excl_s,
            "{trace}: safe-pack + replay {safe_s:.0} s vs exclusive {excl_s:.0} s"
        );
        // Deterministic.
        assert_eq!(gpumem(&args).stdout, o.stdout, "{trace}");
    }
    // One run with a timeline.
    let svg = tmp("timeline.svg");
    let t1 = carma("philly_trace-t1.csv");
    let o = gpumem(&[
        "simulate",
        "--trace",
        &t1,
        "--tasks",
        &tasks,
        "--profile",
        profile.to_str().unwrap(),
        "--timeline",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("makespan") && text.contains("OOM crashes") && text.contains("run alone"),
        "{text}"
    );
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    assert!(svg.with_extension("png").exists());
}

/// A job file's jobs: what is wrong is named by file, line or job.
#[test]
fn bad_job_files_are_one_line_errors() {
    let file = |name: &str, text: &str| {
        let p = tmp(name);
        std::fs::write(&p, text).unwrap();
        p.display().to_string()
    };
    let unknown = file(
        "unknown.toml",
        "[[job]]\narrival_s = 0\nwork_s = 1\nmem_mib = 10\ncolour = 1\n",
    );
    bad_input(
        &["simulate", "--jobs", &unknown],
        "unknown.toml: line 5: unknown field `colour`",
    );
    let ranks = file(
        "ranks.toml",
        "[[job]]\nname = \"a\"\narrival_s = 0\nwork_s = 1\nmem_mib = 10\ngpus = 2\n[job.options]\nstrategy = { kind = \"fsdp\", world_size = 4 }\n",
    );
    bad_input(
        &["simulate", "--jobs", &ranks],
        "job 1 (`a`): options.strategy has world_size 4",
    );
    let big = file(
        "big.toml",
        "[[job]]\narrival_s = 0\nwork_s = 1\nmem_mib = 10\ngpus = 8\n",
    );
    bad_input(
        &["simulate", "--jobs", &big, "--gpus", "4xh100-80gb-sxm"],
        "job 0 (`job 1`) needs 8 GPUs; the cluster has 4",
    );
    let ok = file(
        "ok.toml",
        "[[job]]\narrival_s = 0\nwork_s = 1\nmem_mib = 10\n",
    );
    bad_input(
        &["simulate", "--jobs", &ok, "--estimator", "horus"],
        "--estimator horus: a job file's jobs have measured, replay, none",
    );
    bad_input(
        &["simulate", "--jobs", "/nonexistent.toml"],
        "/nonexistent.toml",
    );
}

/// Multi-GPU jobs described as the daemon takes them (a strategy's ranks are the job's GPUs),
/// sized by gpumem per rank, each placed on all its GPUs at once.
#[test]
fn a_job_file_places_every_rank_of_a_multi_gpu_job_at_once() {
    if !torch() {
        return;
    }
    let model = "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)";
    let jobs = tmp("jobs.toml");
    let job = |name: &str, strategy: &str| {
        format!(
            "[[job]]\nname = \"{name}\"\narrival_s = 0\nwork_s = 1000\nmodel = \"{model}\"\nbatch = 4\n[job.options]\nseq_len = 64\nstrategy = {strategy}\n"
        )
    };
    let text = job("two-ranks", "{ kind = \"ddp\", world_size = 2 }")
        + &job("four-ranks", "{ kind = \"fsdp\", world_size = 4 }")
        + "[[job]]\nname = \"stated\"\narrival_s = 5\nwork_s = 100\nmem_mib = 1024\nmeasured_mib = 1500\n";
    std::fs::write(&jobs, text).unwrap();
    let run = |policy: &str| -> serde_json::Value {
        let o = gpumem(&[
            "simulate",
            "--jobs",
            jobs.to_str().unwrap(),
            "--gpus",
            "4xh100-80gb-sxm",
            "--policy",
            policy,
            "--interference",
            "none",
            "--json",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    // Alone on its GPUs, the four-rank job cannot start beside the two-rank one: it waits for
    // all four GPUs, then runs its 1000 s.
    let exclusive = run("exclusive");
    assert_eq!(exclusive["jobs"], 3);
    assert!(
        exclusive["makespan_s"].as_f64().unwrap() >= 2000.0,
        "{exclusive}"
    );
    // gpumem's per-rank bounds let both share the GPUs: all ranks start together, no crash.
    let safe = run("safe-pack");
    assert_eq!(safe["oom_crashes"], 0, "{safe}");
    assert!(safe["makespan_s"].as_f64().unwrap() <= 1100.0, "{safe}"); // 30 s of warm-up (CARMA's rule)
    assert_eq!(safe["unmodelled"], serde_json::json!([]), "{safe}");
}
