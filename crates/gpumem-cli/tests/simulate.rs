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
    let with = |extra: &[&'static str]| -> Vec<String> { base.iter().map(|s| s.to_string()).chain(extra.iter().map(|s| s.to_string())).collect() };
    let run = |args: Vec<String>, needle: &str| bad_input(&args.iter().map(String::as_str).collect::<Vec<_>>(), needle);
    run(with(&["--policy", "fastest"]), "unknown policy `fastest`");
    run(with(&["--estimator", "oracle"]), "unknown estimator `oracle`");
    run(with(&["--gpus", "four-a100"]), "--gpus `four-a100` is not COUNTxGPU");
    run(with(&["--gpus", "4xb200"]), "unknown GPU `b200`");
    run(with(&["--max-pressure", "0.5"]), "--max-pressure must be a number of at least 1");
    run(with(&["--interference", "magic"]), "unknown interference model `magic`");
    let trace = tmp("bad-trace.csv");
    std::fs::write(&trace, "arrival_s,task\n0,vgg\n10,resnet9000\n").unwrap();
    bad_input(&["simulate", "--trace", trace.to_str().unwrap(), "--tasks", &tasks], "bad-trace.csv: line 3: unknown task `resnet9000`");
    bad_input(&["simulate", "--trace", "/nonexistent.csv", "--tasks", &tasks], "/nonexistent.csv");
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
    let o = gpumem(&["calibrate", rw.to_str().unwrap(), "--rows", "lines:4", "--out", profile.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let tasks = carma("carma_tasks.csv");
    for trace in ["philly_trace-t1.csv", "philly_trace-t2.csv", "philly_heavy-60-tasks.csv", "philly_mix-90-tasks.csv"] {
        let t = carma(trace);
        let args = ["simulate", "--trace", &t, "--tasks", &tasks, "--profile", profile.to_str().unwrap(), "--compare", "--json"];
        let o = gpumem(&args);
        assert!(o.status.success(), "{trace}: {}", String::from_utf8_lossy(&o.stderr));
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(rows.len(), 47, "{trace}");
        for r in &rows {
            for key in ["makespan_s", "mean_wait_s", "p95_wait_s", "mean_jct_s", "oom_crashes", "wasted_gpu_min", "mean_smact", "energy_kwh", "policy", "estimator"] {
                assert!(r.get(key).is_some(), "{trace}: missing {key}");
            }
            if r["estimator"] == "measured" || (r["policy"] == "safe-pack" && r["estimator"] == "replay") {
                assert_eq!(r["oom_crashes"], 0, "{trace}: {r}");
            }
        }
        let safe = rows.iter().find(|r| r["policy"] == "safe-pack" && r["estimator"] == "replay").unwrap();
        let unmodelled: Vec<&str> = safe["unmodelled"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        let cannot = ["dlrm", "maskrcnn", "mnist_train"];
        assert!(!unmodelled.is_empty() && unmodelled.iter().all(|t| cannot.contains(t)), "{trace}: {unmodelled:?}");
        // The acceptance: at least 25% shorter than exclusive placement, with no crash (above).
        let exclusive = rows.iter().find(|r| r["policy"] == "exclusive").unwrap();
        let (safe_s, excl_s) = (safe["makespan_s"].as_f64().unwrap(), exclusive["makespan_s"].as_f64().unwrap());
        assert!(safe_s <= 0.75 * excl_s, "{trace}: safe-pack + replay {safe_s:.0} s vs exclusive {excl_s:.0} s");
        // Deterministic.
        assert_eq!(gpumem(&args).stdout, o.stdout, "{trace}");
    }
    // One run with a timeline.
    let svg = tmp("timeline.svg");
    let t1 = carma("philly_trace-t1.csv");
    let o = gpumem(&["simulate", "--trace", &t1, "--tasks", &tasks, "--profile", profile.to_str().unwrap(), "--timeline", svg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("makespan") && text.contains("OOM crashes") && text.contains("run alone"), "{text}");
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    assert!(svg.with_extension("png").exists());
}
