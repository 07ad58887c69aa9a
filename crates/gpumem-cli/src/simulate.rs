//! `gpumem simulate`: replay a CARMA workload trace, or a job file of jobs described as the
//! daemon takes them (multi-GPU strategies included), on a simulated GPU server.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use clap::Args;
use gpumem_core::estimate::{Estimator, Replay};
use gpumem_core::profile::GpuProfile;
use gpumem_core::utilization::{HostModel, Utilization, physical};
use gpumem_place::{Load, MIB, MemoryDemand, MemoryView, Policy, Rule};
use gpumem_sim::carma::{Task, TaskModel, load_arrivals, load_tasks};
use gpumem_sim::jobs::load_jobs;
use gpumem_sim::{
    GpuSpec, Interference, NoInterference, ProportionalSharing, Report, SimConfig, SimJob, simulate,
};
use gpumem_torch::BridgeError;
use gpumem_workload::{Workload, WorkloadError, side_by_side};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::args::{GpuChoice, gpu_count};
use crate::{CliError, CliResult, plot};

/// Estimators the simulator can hand to a policy.
pub const SIM_ESTIMATORS: [&str; 6] = [
    "measured",
    "replay",
    "horus",
    "faketensor",
    "gpumemnet",
    "none",
];
/// Those a job file's jobs have (CARMA published the others for its own tasks only).
const JOB_FILE_ESTIMATORS: [&str; 3] = ["measured", "replay", "none"];

#[derive(Args)]
pub struct SimulateArgs {
    /// Arrival trace (`arrival_s,task`), e.g. ../shared/data/carma/philly_trace-t1.csv.
    #[arg(long, required_unless_present = "jobs", requires = "tasks")]
    trace: Option<PathBuf>,
    /// The tasks (carma_tasks.csv).
    #[arg(long, requires = "trace")]
    tasks: Option<PathBuf>,
    /// A job file instead of a CARMA trace (TOML `[[job]]` tables: arrival_s, work_s, and the
    /// fields of the daemon's API: model, batch and [options] (a multi-GPU strategy's ranks
    /// are the job's GPUs), or mem_mib; measured_mib where known). See docs/simulate.md.
    #[arg(long, conflicts_with_all = ["trace", "tasks", "workloads"])]
    jobs: Option<PathBuf>,
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
    unmodelled: Vec<String>,
}

/// The cluster of `--gpus COUNTxGPU`, its GPUs described by `--profile` when given.
fn cluster(spec: &str, file: Option<&Path>) -> CliResult<(usize, GpuProfile)> {
    let (count, name) = gpu_count("--gpus", spec, 100_000)?;
    Ok((
        count,
        GpuChoice::new(name, file.map(Path::to_path_buf)).load()?,
    ))
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
fn solo_load(u: &Utilization, task: &Task) -> Load {
    busy_load(
        u,
        task.train_steps
            .map_or(1.0, |n| (n as f64 * u.step_s / task.work_s).min(1.0)),
    )
}

/// The physical model's figures while the steps run, diluted to the share `busy` of the time.
fn busy_load(u: &Utilization, busy: f64) -> Load {
    Load {
        smact: u.smact * busy,
        smocc: u.smocc * busy,
        dram: u.dram * busy,
    }
}

/// gpumem's answer for each distinct model of a workload, traced once each (side by side, and
/// cached by the tracer): its replay estimate and bound, and the physical model's utilization
/// while its steps run. A model whose library this interpreter lacks (say
/// segmentation-models-pytorch) is left out with a warning: its jobs run without a gpumem
/// estimate, as the ones gpumem cannot trace at all do.
fn model_all<'a>(
    models: impl IntoIterator<Item = &'a TaskModel>,
    profile: &GpuProfile,
) -> CliResult<HashMap<TaskModel, (MemoryDemand, Utilization)>> {
    let mut distinct: Vec<&TaskModel> = Vec::new();
    for m in models {
        if !distinct.contains(&m) {
            distinct.push(m);
        }
    }
    let bar = ProgressBar::new(distinct.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("tracing {bar:30} {pos}/{len}").expect("valid template"),
    );
    let traced = side_by_side(&distinct, |m| {
        let t = Workload::parse(&m.reference, m.batch, m.options.clone())
            .and_then(|w| w.trace(profile));
        bar.inc(1);
        t
    });
    let mut out = HashMap::new();
    for (m, traced) in distinct.into_iter().zip(traced) {
        let trace = match traced {
            Ok(t) => t,
            Err(WorkloadError::Tracer(BridgeError::Reference(e))) => {
                bar.suspend(|| {
                    eprintln!(
                        "warning: {} b{}: {e}; its jobs run without a gpumem estimate",
                        m.reference, m.batch
                    )
                });
                continue;
            }
            Err(e) if e.is_input() => {
                return Err(CliError::input(format!(
                    "{} b{}: {e}",
                    m.reference, m.batch
                )));
            }
            Err(e) => {
                return Err(CliError::Model(format!(
                    "{} b{}: {e}",
                    m.reference, m.batch
                )));
            }
        };
        let est = Replay::default()
            .estimate(&trace, profile)
            .map_err(CliError::input)?;
        let memory = MemoryDemand {
            estimate_bytes: est.peak_bytes,
            upper_bound_bytes: est.upper_bound_bytes,
        };
        out.insert(
            m.clone(),
            (memory, physical(&trace, profile, &HostModel::default())),
        );
    }
    bar.finish_and_clear();
    Ok(out)
}

/// What is simulated: a CARMA trace's arrivals of its tasks, with gpumem's answers for their
/// models; or a job file's jobs, each sized once (`memory`: what it states, else gpumem's
/// estimate; `true_bytes`: what it measured, else that).
enum Source {
    Carma {
        arrivals: Vec<(f64, usize)>,
        tasks: Vec<Task>,
        modelled: HashMap<String, Modelled>,
    },
    Jobs(Vec<SimJob>),
}

impl Source {
    fn carma(
        trace: &Path,
        tasks: &Path,
        workloads: &Path,
        profile: &GpuProfile,
    ) -> CliResult<Source> {
        let tasks = load_tasks(tasks, workloads).map_err(CliError::input)?;
        let arrivals = load_arrivals(trace, &tasks).map_err(CliError::input)?;
        let used: Vec<&Task> = tasks
            .iter()
            .enumerate()
            .filter(|(i, _)| arrivals.iter().any(|a| a.1 == *i))
            .map(|(_, t)| t)
            .collect();
        let by_model = model_all(used.iter().filter_map(|t| t.model.as_ref()), profile)?;
        let modelled = used
            .iter()
            .filter_map(|t| {
                let (memory, u) = by_model.get(t.model.as_ref()?)?;
                Some((
                    t.name.clone(),
                    Modelled {
                        memory: *memory,
                        load: solo_load(u, t),
                    },
                ))
            })
            .collect();
        Ok(Source::Carma {
            arrivals,
            tasks,
            modelled,
        })
    }

    fn job_file(path: &Path, profile: &GpuProfile) -> CliResult<Source> {
        let specs = load_jobs(path).map_err(CliError::input)?;
        // What gpumem traces for a job: its model at its batch, where it states no memory.
        let models: Vec<Option<TaskModel>> = specs
            .iter()
            .map(|j| {
                j.model().map(|(reference, batch)| TaskModel {
                    reference: reference.to_string(),
                    batch,
                    options: j.options.clone(),
                })
            })
            .collect();
        let modelled = model_all(models.iter().flatten(), profile)?;
        let jobs = specs.into_iter().zip(&models).map(|(j, m)| {
            let ours = m.as_ref().and_then(|m| modelled.get(m));
            let memory = j.stated_bytes().map(MemoryDemand::point).or(ours.map(|o| o.0));
            let name = j.name.clone().unwrap_or_default();
            // Every job needs a truth to crash by: what it measured, states, or gpumem estimates.
            let Some(true_bytes) = j.measured_bytes().or(memory.map(|e| e.estimate_bytes)) else {
                return Err(CliError::input(format!("{}: job `{name}`: gpumem cannot estimate it here and it states no measured_mib", path.display())));
            };
            // While it runs a job keeps its GPUs as busy as its steps do.
            let load = ours.map(|(_, u)| busy_load(u, 1.0)).unwrap_or_default();
            Ok(SimJob { name, arrival_s: j.arrival_s, gpus: j.gpus(), work_s: j.work_s, true_bytes, memory, load, priority: j.priority })
        });
        Ok(Source::Jobs(jobs.collect::<CliResult<_>>()?))
    }

    /// The simulated jobs in arrival order as `estimator` sees them.
    fn sim_jobs(&self, estimator: &str) -> Vec<SimJob> {
        match self {
            Source::Carma {
                arrivals,
                tasks,
                modelled,
            } => arrivals
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
                .collect(),
            Source::Jobs(jobs) => jobs
                .iter()
                .map(|j| SimJob {
                    memory: match estimator {
                        "measured" => Some(MemoryDemand::point(j.true_bytes)),
                        "none" => None,
                        _ => j.memory,
                    },
                    ..j.clone()
                })
                .collect(),
        }
    }

    /// Distinct jobs (tasks) that `estimator` has no figure for.
    fn unmodelled(&self, estimator: &str) -> Vec<String> {
        let mut out: Vec<String> = self
            .sim_jobs(estimator)
            .into_iter()
            .filter(|j| j.memory.is_none())
            .map(|j| j.name)
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    fn estimators(&self) -> &'static [&'static str] {
        match self {
            Source::Carma { .. } => &SIM_ESTIMATORS,
            Source::Jobs(_) => &JOB_FILE_ESTIMATORS,
        }
    }
}

fn memory_view(estimator: &str, headroom_mib: u64) -> MemoryView {
    match estimator {
        "measured" => MemoryView::Oracle,
        "none" => MemoryView::Blind,
        _ => MemoryView::Estimate {
            headroom_bytes: headroom_mib * MIB,
        },
    }
}

pub fn run(a: SimulateArgs) -> CliResult {
    if !SIM_ESTIMATORS.contains(&a.estimator.as_str()) {
        return Err(CliError::input(format!(
            "unknown estimator `{}` (expected {})",
            a.estimator,
            SIM_ESTIMATORS.join(", ")
        )));
    }
    for (name, v) in [
        ("--crash-after-s", a.crash_after_s),
        ("--warmup-s", a.warmup_s),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return Err(CliError::input(format!(
                "{name} must be a non-negative number"
            )));
        }
    }
    let interference: Box<dyn Interference> = match a.interference.as_str() {
        "proportional" => Box::new(ProportionalSharing::default()),
        "none" => Box::new(NoInterference),
        other => {
            return Err(CliError::input(format!(
                "unknown interference model `{other}` (expected proportional or none)"
            )));
        }
    };
    if !(a.max_pressure.is_finite() && a.max_pressure >= 1.0) {
        return Err(CliError::input(
            "--max-pressure must be a number of at least 1",
        ));
    }
    let tune = |p: Policy| Policy {
        safe_headroom_bytes: a.safe_headroom_mib * MIB,
        max_pressure: a.max_pressure,
        ..p
    };
    let policy = tune(
        Policy::parse(&a.policy, memory_view(&a.estimator, a.headroom_mib))
            .map_err(CliError::input)?,
    );
    let (count, profile) = cluster(&a.gpus, a.profile.as_deref())?;
    let (source, input) = match (&a.jobs, &a.trace, &a.tasks) {
        (Some(jobs), ..) => (Source::job_file(jobs, &profile)?, jobs),
        (None, Some(trace), Some(tasks)) => {
            let workloads = a
                .workloads
                .clone()
                .unwrap_or_else(|| tasks.with_file_name("carma_workloads_readme.csv"));
            (Source::carma(trace, tasks, &workloads, &profile)?, trace)
        }
        _ => {
            return Err(CliError::input(
                "give --trace and --tasks (a CARMA workload) or --jobs (a job file)",
            ));
        }
    };
    if !source.estimators().contains(&a.estimator.as_str()) {
        return Err(CliError::input(format!(
            "--estimator {}: a job file's jobs have {} (CARMA published the others for its own tasks)",
            a.estimator,
            JOB_FILE_ESTIMATORS.join(", ")
        )));
    }
    let spec = GpuSpec {
        capacity_bytes: profile.capacity_bytes(),
        idle_w: profile.idle_power_w,
        max_w: profile.power_w,
    };
    let base = SimConfig {
        crash_after_s: a.crash_after_s,
        max_retries: a.max_retries,
        warmup_s: a.warmup_s,
        backfill: a.backfill,
        ..SimConfig::new(vec![spec; count], policy)
    };
    let input_name = input
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let one = |policy: Policy, estimator: &str| -> CliResult<Report> {
        let cfg = SimConfig {
            policy,
            ..base.clone()
        };
        simulate(&source.sim_jobs(estimator), &cfg, interference.as_ref()).map_err(CliError::input)
    };

    if a.compare {
        let mut rows: Vec<(String, Report)> = Vec::new();
        for (policy, estimator) in comparison(source.estimators()) {
            let p = tune(Policy {
                memory: memory_view(estimator, a.headroom_mib),
                ..policy
            });
            rows.push((estimator.to_string(), one(p, estimator)?));
        }
        if a.json {
            let out: Vec<SimJson> = rows
                .iter()
                .map(|(e, r)| SimJson {
                    report: r,
                    estimator: e,
                    trace: input_name.clone(),
                    gpus: &a.gpus,
                    unmodelled: source.unmodelled(e),
                })
                .collect();
            println!(
                "{}",
                serde_json::to_string_pretty(&out).map_err(CliError::other)?
            );
        } else {
            print_table(&input_name, &a.gpus, &rows, &source.unmodelled("replay"));
        }
        return Ok(());
    }

    let report = one(policy, &a.estimator)?;
    if let Some(svg) = &a.timeline {
        let labels: Vec<String> = source
            .sim_jobs("none")
            .into_iter()
            .map(|j| j.name)
            .collect();
        let title = format!(
            "{input_name}: {} / {} on {}",
            report.policy, a.estimator, a.gpus
        );
        plot::timeline(
            svg,
            &svg.with_extension("png"),
            &title,
            count,
            &report.runs,
            &labels,
        )
        .map_err(CliError::other)?;
    }
    let unmodelled = source.unmodelled(&a.estimator);
    if a.json {
        let out = SimJson {
            report: &report,
            estimator: &a.estimator,
            trace: input_name,
            gpus: &a.gpus,
            unmodelled,
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(CliError::other)?
        );
        return Ok(());
    }
    println!(
        "{input_name}: {} jobs on {} ({}), policy {}, estimator {}",
        report.jobs, a.gpus, profile.display, report.policy, a.estimator
    );
    println!("  makespan          {:>10.2} h", report.makespan_s / 3600.0);
    println!(
        "  waiting time      {:>10.1} min mean, {:.1} min p95",
        report.mean_wait_s / 60.0,
        report.p95_wait_s / 60.0
    );
    println!(
        "  completion time   {:>10.1} min mean",
        report.mean_jct_s / 60.0
    );
    println!(
        "  OOM crashes       {:>10}  ({:.1} GPU-min wasted, {} jobs failed)",
        report.oom_crashes, report.wasted_gpu_min, report.failed_jobs
    );
    println!(
        "  GPU busy          {:>10.1} %   mean SMACT {:.2}",
        report.mean_busy * 100.0,
        report.mean_smact
    );
    println!("  energy            {:>10.2} kWh", report.energy_kwh);
    if !unmodelled.is_empty() {
        println!(
            "  without an estimate ({}): {}",
            if report.policy == "safe-pack" {
                "run alone"
            } else {
                "need an empty GPU"
            },
            unmodelled.join(", ")
        );
    }
    Ok(())
}

/// Every policy × estimator of `--compare` (estimator-independent rules once); `estimators`
/// those the workload has, `none` aside.
fn comparison(estimators: &[&'static str]) -> Vec<(Policy, &'static str)> {
    let blind = MemoryView::Blind;
    let sized: Vec<&'static str> = estimators
        .iter()
        .copied()
        .filter(|e| *e != "none")
        .collect();
    let mut out = vec![
        (Policy::new(Rule::Exclusive, blind), "none"),
        (Policy::new(Rule::RoundRobin, blind), "none"),
    ];
    for rule in [
        Rule::FirstFit,
        Rule::BestFit,
        Rule::MostFreeMemory,
        Rule::LeastUtilized,
    ] {
        for carma in [false, true] {
            for &est in &sized {
                out.push((
                    Policy {
                        carma_filter: carma,
                        ..Policy::new(rule, blind)
                    },
                    est,
                ));
            }
        }
    }
    for &est in &sized {
        out.push((Policy::new(Rule::SafePack, blind), est));
    }
    out
}

fn print_table(trace: &str, gpus: &str, rows: &[(String, Report)], unmodelled: &[String]) {
    let exclusive = rows
        .iter()
        .find(|(_, r)| r.policy == "exclusive")
        .map_or(f64::NAN, |(_, r)| r.makespan_s);
    println!(
        "{trace} on {gpus}: {} jobs",
        rows.first().map_or(0, |(_, r)| r.jobs)
    );
    println!(
        "{:<24} {:<11} {:>10} {:>9} {:>9} {:>9} {:>9} {:>7} {:>10} {:>6} {:>7}",
        "policy",
        "estimator",
        "makespan h",
        "vs excl",
        "wait min",
        "p95 wait",
        "JCT min",
        "crashes",
        "wasted min",
        "SMACT",
        "kWh"
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
        println!(
            "gpumem cannot model yet (safe-pack runs them alone): {}",
            unmodelled.join(", ")
        );
    }
}
