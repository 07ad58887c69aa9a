//! `gpumem simulate`: replay a CARMA workload trace on a simulated GPU server.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use clap::Args;
use gpumem_core::estimate::{Estimator, Replay};
use gpumem_core::profile::GpuProfile;
use gpumem_core::utilization::{HostModel, physical};
use gpumem_place::{Load, MIB, MemoryDemand, MemoryView, Policy, Rule};
use gpumem_sim::carma::{Task, TaskModel, load_arrivals, load_tasks};
use gpumem_sim::{GpuSpec, Interference, NoInterference, ProportionalSharing, Report, SimConfig, SimJob, simulate};
use gpumem_torch::BridgeError;
use gpumem_workload::{Workload, WorkloadError};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::args::{GpuChoice, gpu_count};
use crate::{CliError, CliResult, plot};

/// Estimators the simulator can hand to a policy.
pub const SIM_ESTIMATORS: [&str; 6] = ["measured", "replay", "horus", "faketensor", "gpumemnet", "none"];

#[derive(Args)]
pub struct SimulateArgs {
    /// Arrival trace (`arrival_s,task`), e.g. ../shared/data/carma/philly_trace-t1.csv.
    #[arg(long)]
    trace: PathBuf,
    /// The tasks (carma_tasks.csv).
    #[arg(long)]
    tasks: PathBuf,
    /// Published run times (default: carma_workloads_readme.csv beside --tasks).
    #[arg(long)]
    workloads: Option<PathBuf>,
    /// The cluster: COUNTxGPU (built-in profile name).
    #[arg(long, default_value = "4xa100-40gb")]
    gpus: String,
    /// A profile file for the GPUs (e.g. calibrated with `gpumem calibrate`); overrides the
    /// profile named in --gpus.
    #[arg(long)]
    profile: Option<PathBuf>,
    /// exclusive, round-robin, first-fit, best-fit, most-free-memory, least-utilized (each
    /// optionally +carma for CARMA's utilization filter) or safe-pack.
    #[arg(long, default_value = "safe-pack")]
    policy: String,
    /// Memory estimates the policy sees: measured (the oracle), replay (gpumem), horus,
    /// faketensor, gpumemnet (CARMA's published figures) or none (memory-blind).
    #[arg(long, default_value = "replay")]
    estimator: String,
    /// Free memory a non-oracle policy keeps above an estimate (CARMA: 2048).
    #[arg(long, default_value_t = 2048)]
    headroom_mib: u64,
    /// safe-pack: margin kept above a job's upper bound.
    #[arg(long, default_value_t = 512)]
    safe_headroom_mib: u64,
    /// safe-pack: the most summed utilization (max of SMACT and DRAMA sums) it puts on a shared GPU.
    #[arg(long, default_value_t = 2.0)]
    max_pressure: f64,
    /// Start later jobs in gaps that do not delay the head of the queue.
    #[arg(long)]
    backfill: bool,
    /// Seconds from start to crash for a job that overflows its GPU.
    #[arg(long, default_value_t = 60.0)]
    crash_after_s: f64,
    /// Exclusive re-placements after crashes before a job fails.
    #[arg(long, default_value_t = 3)]
    max_retries: u32,
    /// Seconds a GPU that just got a job is not offered again (CARMA's warm-up).
    #[arg(long, default_value_t = 30.0)]
    warmup_s: f64,
    /// proportional (jobs share a saturated GPU in proportion) or none.
    #[arg(long, default_value = "proportional")]
    interference: String,
    /// Run every policy × estimator and print one table.
    #[arg(long)]
    compare: bool,
    /// Print JSON (one object; an array with --compare).
    #[arg(long)]
    json: bool,
    /// Write a per-GPU timeline (SVG; a PNG beside it).
    #[arg(long)]
    timeline: Option<PathBuf>,
}

/// The stable JSON of one simulation.
#[derive(Serialize)]
struct SimJson<'a> {
    #[serde(flatten)]
    report: &'a Report,
    estimator: &'a str,
    trace: String,
    gpus: &'a str,
    /// Tasks the estimator could not size (safe-pack runs them alone).
    unmodelled: Vec<&'a str>,
}

/// The cluster of `--gpus COUNTxGPU`, its GPUs described by `--profile` when given.
fn cluster(spec: &str, file: Option<&Path>) -> CliResult<(usize, GpuProfile)> {
    let (count, name) = gpu_count("--gpus", spec, 100_000)?;
    Ok((count, GpuChoice::new(name, file.map(Path::to_path_buf)).load()?))
}

/// gpumem's own answer for a task: replay estimate and bound, and its utilization alone.
#[derive(Debug, Clone, Copy)]
struct Modelled {
    memory: MemoryDemand,
    load: Load,
}

/// A task's utilization alone: the physical model's figures while its kernels run, times the
/// share of its measured run time the GPU is busy (steps × modelled step time over the run
/// time; the rest is the input pipeline and the host). DCGM's run averages dilute the same way.
/// Where the steps are unknown the GPU is taken as always busy (the cautious side).
fn solo_load(u: &gpumem_core::utilization::Utilization, task: &Task) -> Load {
    let busy = task.train_steps.map_or(1.0, |n| (n as f64 * u.step_s / task.work_s).min(1.0));
    Load { smact: u.smact * busy, smocc: u.smocc * busy, dram: u.dram * busy }
}

/// Traces every distinct modelled task once (cached by the tracer) and estimates it.
fn model_tasks(tasks: &[&Task], profile: &GpuProfile) -> CliResult<HashMap<String, Modelled>> {
    let mut distinct: Vec<&TaskModel> = Vec::new();
    for t in tasks {
        if let Some(m) = &t.model
            && !distinct.contains(&m)
        {
            distinct.push(m);
        }
    }
    let bar = ProgressBar::new(distinct.len() as u64);
    bar.set_style(ProgressStyle::with_template("tracing {bar:30} {pos}/{len} {msg}").expect("valid template"));
    let mut by_key = HashMap::new();
    for m in distinct {
        bar.set_message(format!("{} b{}", m.reference, m.batch));
        let traced = Workload::parse(&m.reference, m.batch, m.options.clone()).and_then(|w| w.trace(profile));
        let trace = match traced {
            Ok(t) => t,
            // A library this interpreter lacks (say segmentation-models-pytorch): the task is
            // left unmodelled here, as the tasks gpumem cannot trace at all are.
            Err(WorkloadError::Tracer(BridgeError::BadReference(e))) => {
                bar.suspend(|| eprintln!("warning: {} b{}: {e}; its tasks run without a gpumem estimate", m.reference, m.batch));
                bar.inc(1);
                continue;
            }
            Err(e @ (WorkloadError::Invalid(_) | WorkloadError::Batch(_))) => return Err(CliError::input(format!("{} b{}: {e}", m.reference, m.batch))),
            Err(e) => return Err(CliError::Model(format!("{} b{}: {e}", m.reference, m.batch))),
        };
        let est = Replay::default().estimate(&trace, profile).map_err(CliError::input)?;
        let u = physical(&trace, profile, &HostModel::default());
        let memory = MemoryDemand { estimate_bytes: est.peak_bytes, upper_bound_bytes: est.upper_bound_bytes };
        by_key.insert(m, (memory, u));
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(tasks
        .iter()
        .filter_map(|t| {
            let (memory, u) = by_key.get(t.model.as_ref()?)?;
            Some((t.name.clone(), Modelled { memory: *memory, load: solo_load(u, t) }))
        })
        .collect())
}

/// The simulated jobs of a trace as `estimator` sees them.
fn jobs(arrivals: &[(f64, usize)], tasks: &[Task], modelled: &HashMap<String, Modelled>, estimator: &str) -> Vec<SimJob> {
    arrivals
        .iter()
        .map(|&(arrival_s, i)| {
            let t = &tasks[i];
            let ours = modelled.get(&t.name);
            let memory = match estimator {
                "replay" => ours.map(|m| m.memory),
                "none" => None,
                other => t.published(other).flatten().map(MemoryDemand::point),
            };
            SimJob {
                name: t.name.clone(),
                arrival_s,
                gpus: t.gpus,
                work_s: t.work_s,
                true_bytes: t.measured_bytes,
                memory,
                load: ours.map(|m| m.load).or(t.fallback_load).unwrap_or_default(),
                priority: 0,
            }
        })
        .collect()
}

fn memory_view(estimator: &str, headroom_mib: u64) -> MemoryView {
    match estimator {
        "measured" => MemoryView::Oracle,
        "none" => MemoryView::Blind,
        _ => MemoryView::Estimate { headroom_bytes: headroom_mib * MIB },
    }
}

pub fn run(a: SimulateArgs) -> CliResult {
    if !SIM_ESTIMATORS.contains(&a.estimator.as_str()) {
        return Err(CliError::input(format!("unknown estimator `{}` (expected {})", a.estimator, SIM_ESTIMATORS.join(", "))));
    }
    for (name, v) in [("--crash-after-s", a.crash_after_s), ("--warmup-s", a.warmup_s)] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(CliError::input(format!("{name} must be a non-negative number")));
        }
    }
    let interference: Box<dyn Interference> = match a.interference.as_str() {
        "proportional" => Box::new(ProportionalSharing::default()),
        "none" => Box::new(NoInterference),
        other => return Err(CliError::input(format!("unknown interference model `{other}` (expected proportional or none)"))),
    };
    if !(a.max_pressure.is_finite() && a.max_pressure >= 1.0) {
        return Err(CliError::input("--max-pressure must be a number of at least 1"));
    }
    let tune = |p: Policy| Policy { safe_headroom_bytes: a.safe_headroom_mib * MIB, max_pressure: a.max_pressure, ..p };
    let policy = tune(Policy::parse(&a.policy, memory_view(&a.estimator, a.headroom_mib)).map_err(CliError::input)?);
    let (count, profile) = cluster(&a.gpus, a.profile.as_deref())?;
    let workloads = a.workloads.clone().unwrap_or_else(|| a.tasks.with_file_name("carma_workloads_readme.csv"));
    let tasks = load_tasks(&a.tasks, &workloads).map_err(CliError::input)?;
    let arrivals = load_arrivals(&a.trace, &tasks).map_err(CliError::input)?;
    let used: Vec<&Task> = {
        let mut seen: Vec<usize> = arrivals.iter().map(|&(_, i)| i).collect();
        seen.sort_unstable();
        seen.dedup();
        seen.into_iter().map(|i| &tasks[i]).collect()
    };
    let modelled = model_tasks(&used, &profile)?;
    let spec = GpuSpec { capacity_bytes: profile.capacity_bytes(), idle_w: profile.idle_power_w, max_w: profile.power_w };
    let base = SimConfig {
        crash_after_s: a.crash_after_s,
        max_retries: a.max_retries,
        warmup_s: a.warmup_s,
        backfill: a.backfill,
        ..SimConfig::new(vec![spec; count], policy)
    };
    let trace_name = a.trace.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let unmodelled_by = |estimator: &str| -> Vec<&str> {
        let sim = jobs(&arrivals, &tasks, &modelled, estimator);
        used.iter().filter(|t| sim.iter().any(|j| j.name == t.name && j.memory.is_none())).map(|t| t.name.as_str()).collect()
    };
    let one = |policy: Policy, estimator: &str| -> CliResult<Report> {
        let cfg = SimConfig { policy, ..base.clone() };
        simulate(&jobs(&arrivals, &tasks, &modelled, estimator), &cfg, interference.as_ref()).map_err(CliError::input)
    };

    if a.compare {
        let mut rows: Vec<(String, Report)> = Vec::new();
        for (policy, estimator) in comparison() {
            let p = tune(Policy { memory: memory_view(estimator, a.headroom_mib), ..policy });
            rows.push((estimator.to_string(), one(p, estimator)?));
        }
        if a.json {
            let out: Vec<SimJson> = rows
                .iter()
                .map(|(e, r)| SimJson { report: r, estimator: e, trace: trace_name.clone(), gpus: &a.gpus, unmodelled: unmodelled_by(e) })
                .collect();
            println!("{}", serde_json::to_string_pretty(&out).map_err(CliError::other)?);
        } else {
            print_table(&trace_name, &a.gpus, &rows, &unmodelled_by("replay"));
        }
        return Ok(());
    }

    let report = one(policy, &a.estimator)?;
    if let Some(svg) = &a.timeline {
        let labels: Vec<String> = arrivals.iter().map(|&(_, i)| tasks[i].name.clone()).collect();
        let title = format!("{trace_name}: {} / {} on {}", report.policy, a.estimator, a.gpus);
        plot::timeline(svg, &svg.with_extension("png"), &title, count, &report.runs, &labels).map_err(CliError::other)?;
    }
    let unmodelled = unmodelled_by(&a.estimator);
    if a.json {
        let out = SimJson { report: &report, estimator: &a.estimator, trace: trace_name, gpus: &a.gpus, unmodelled };
        println!("{}", serde_json::to_string_pretty(&out).map_err(CliError::other)?);
        return Ok(());
    }
    println!("{trace_name}: {} jobs on {} ({}), policy {}, estimator {}", report.jobs, a.gpus, profile.display, report.policy, a.estimator);
    println!("  makespan          {:>10.2} h", report.makespan_s / 3600.0);
    println!("  waiting time      {:>10.1} min mean, {:.1} min p95", report.mean_wait_s / 60.0, report.p95_wait_s / 60.0);
    println!("  completion time   {:>10.1} min mean", report.mean_jct_s / 60.0);
    println!("  OOM crashes       {:>10}  ({:.1} GPU-min wasted, {} jobs failed)", report.oom_crashes, report.wasted_gpu_min, report.failed_jobs);
    println!("  GPU busy          {:>10.1} %   mean SMACT {:.2}", report.mean_busy * 100.0, report.mean_smact);
    println!("  energy            {:>10.2} kWh", report.energy_kwh);
    if !unmodelled.is_empty() {
        println!("  without an estimate ({}): {}", if report.policy == "safe-pack" { "run alone" } else { "need an empty GPU" }, unmodelled.join(", "));
    }
    Ok(())
}

/// Every policy × estimator of `--compare` (estimator-independent rules once).
fn comparison() -> Vec<(Policy, &'static str)> {
    let blind = MemoryView::Blind;
    let mut out = vec![(Policy::new(Rule::Exclusive, blind), "none"), (Policy::new(Rule::RoundRobin, blind), "none")];
    for rule in [Rule::FirstFit, Rule::BestFit, Rule::MostFreeMemory, Rule::LeastUtilized] {
        for carma in [false, true] {
            for est in ["measured", "replay", "horus", "faketensor", "gpumemnet"] {
                out.push((Policy { carma_filter: carma, ..Policy::new(rule, blind) }, est));
            }
        }
    }
    for est in ["measured", "replay", "horus", "faketensor", "gpumemnet"] {
        out.push((Policy::new(Rule::SafePack, blind), est));
    }
    out
}

fn print_table(trace: &str, gpus: &str, rows: &[(String, Report)], unmodelled: &[&str]) {
    let exclusive = rows.iter().find(|(_, r)| r.policy == "exclusive").map_or(f64::NAN, |(_, r)| r.makespan_s);
    println!("{trace} on {gpus}: {} jobs", rows.first().map_or(0, |(_, r)| r.jobs));
    println!(
        "{:<24} {:<11} {:>10} {:>9} {:>9} {:>9} {:>9} {:>7} {:>10} {:>6} {:>7}",
        "policy", "estimator", "makespan h", "vs excl", "wait min", "p95 wait", "JCT min", "crashes", "wasted min", "SMACT", "kWh"
    );
    for (est, r) in rows {
        println!(
            "{:<24} {:<11} {:>10.2} {:>8.1}% {:>9.1} {:>9.1} {:>9.1} {:>7} {:>10.1} {:>6.2} {:>7.2}",
            r.policy,
            est,
            r.makespan_s / 3600.0,
            (r.makespan_s / exclusive - 1.0) * 100.0,
            r.mean_wait_s / 60.0,
            r.p95_wait_s / 60.0,
            r.mean_jct_s / 60.0,
            r.oom_crashes,
            r.wasted_gpu_min,
            r.mean_smact,
            r.energy_kwh
        );
    }
    if !unmodelled.is_empty() {
        println!("gpumem cannot model yet (safe-pack runs them alone): {}", unmodelled.join(", "));
    }
}
