//! `/metrics`: the ledger in Prometheus' text exposition — jobs by state, the GPUs as last read,
//! out-of-memory crashes and the estimates' error on finished jobs.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::ledger::Ledger;
use crate::wire::JobState;

/// The exposition of `ledger` now.
pub fn render(ledger: &Ledger) -> String {
    let mut by_state: BTreeMap<&str, u64> = BTreeMap::new();
    let (mut waiting, mut running) = (0, 0);
    for j in ledger.jobs() {
        *by_state.entry(j.state.name()).or_default() += 1;
        waiting += j.state.is_waiting() as u64;
        running += (j.state == JobState::Running) as u64;
    }
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, lines: Vec<(String, f64)>| {
        let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n");
        for (labels, v) in lines {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    let one = |v: u64| vec![(String::new(), v as f64)];
    gauge(
        "gpumem_queue_length",
        "Jobs waiting for GPUs.",
        one(waiting),
    );
    gauge("gpumem_running_jobs", "Jobs running.", one(running));
    gauge(
        "gpumem_jobs",
        "Jobs by state.",
        by_state
            .iter()
            .map(|(s, n)| (format!("{{state=\"{s}\"}}"), *n as f64))
            .collect(),
    );
    let per_gpu = |f: &dyn Fn(&gpumem_monitor::GpuReading) -> Option<f64>| {
        ledger
            .gpus
            .iter()
            .filter_map(|g| Some((format!("{{gpu=\"{}\"}}", g.index), f(g)?)))
            .collect()
    };
    gauge(
        "gpumem_gpu_memory_used_bytes",
        "GPU memory in use.",
        per_gpu(&|g| Some(g.used_bytes as f64)),
    );
    gauge(
        "gpumem_gpu_memory_total_bytes",
        "GPU memory.",
        per_gpu(&|g| Some(g.total_bytes as f64)),
    );
    gauge(
        "gpumem_gpu_utilization",
        "NVML GPU utilization (0-1).",
        per_gpu(&|g| Some(g.util)),
    );
    gauge(
        "gpumem_gpu_smact",
        "DCGM SM activity (0-1).",
        per_gpu(&|g| Some(g.dcgm?.smact)),
    );
    let _ = write!(
        out,
        "# HELP gpumem_oom_crashes_total Out-of-memory crashes seen.\n# TYPE gpumem_oom_crashes_total counter\ngpumem_oom_crashes_total {}\n",
        ledger.oom_crashes
    );
    let errors: Vec<f64> = ledger
        .jobs()
        .filter(|j| j.state == JobState::Finished)
        .filter_map(|j| {
            Some(
                (j.estimate_bytes? as f64 - j.peak_bytes? as f64) / (j.peak_bytes? as f64).max(1.0),
            )
        })
        .collect();
    let mean = if errors.is_empty() {
        0.0
    } else {
        errors.iter().map(|e| e.abs()).sum::<f64>() / errors.len() as f64
    };
    let _ = write!(
        out,
        "# HELP gpumem_estimate_error_ratio Mean |estimate - peak| / peak of finished jobs.\n# TYPE gpumem_estimate_error_ratio gauge\ngpumem_estimate_error_ratio {mean}\n# HELP gpumem_estimated_finished_jobs Finished jobs with an estimate and a measured peak.\n# TYPE gpumem_estimated_finished_jobs gauge\ngpumem_estimated_finished_jobs {}\n",
        errors.len()
    );
    out
}
