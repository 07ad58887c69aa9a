//! The seed authors' CARMA workload: 51 training tasks, their published run times and memory,
//! the estimates CARMA was given, and Philly-derived arrival traces.
//!
//! [`load_tasks`] joins carma_tasks.csv with carma_workloads_readme.csv through the mapping in
//! carma-tasks.toml (embedded; see its comments for the rules) into [`Task`]s; [`load_arrivals`]
//! reads a trace; [`Task::published`] gives the Horus, FakeTensor and GPUMemNet figures.

use std::collections::HashMap;
use std::path::Path;

use gpumem_core::job::{InputShape, Optimizer, OptionValues, Options, Outputs, Validate};
use gpumem_place::{Load, MIB};
use serde::Deserialize;

const MAPPING: &str = include_str!("../carma-tasks.toml");

/// What gpumem traces for a task (the `replay` estimator): the model reference, the batch the
/// script feeds it, and the loop around it (a multi-GPU task is `torch.nn.DataParallel`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TaskModel {
    pub reference: String,
    pub batch: u64,
    pub options: Options,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    prefix: String,
    workload: Option<String>,
    minutes: Option<f64>,
    per_epoch_of: Option<u32>,
    model: Option<String>,
    input: Option<String>,
    seq_len: Option<u64>,
    optimizer: Option<String>,
    /// The batch the script feeds the model, where the csv's batch_size is another figure.
    batch: Option<u64>,
    /// Training samples per epoch (the dataset's size), where known.
    train_samples: Option<u64>,
    validate: Option<String>,
    outputs: Option<String>,
    unmodelled: Option<String>,
    load: Option<Load>,
}

#[derive(Debug, Deserialize)]
struct Mapping {
    task: Vec<Entry>,
}

/// Why the CARMA workload could not be read: the file, the line and what is wrong there.
#[derive(Debug, thiserror::Error)]
pub enum CarmaError {
    /// The embedded mapping does not parse (a build with a broken carma-tasks.toml).
    #[error("carma-tasks.toml: {0}")]
    Mapping(#[from] toml::de::Error),
    /// A CSV file could not be opened or its header read.
    #[error("{file}: {source}")]
    Open { file: String, source: csv::Error },
    /// A row does not have the columns' types.
    #[error("{file}: line {line}: {source}")]
    Row {
        file: String,
        line: usize,
        source: csv::Error,
    },
    #[error("{file}: line {line}: no mapping for task `{task}` (see carma-tasks.toml)")]
    NoMapping {
        file: String,
        line: usize,
        task: String,
    },
    /// The task's run time cannot be derived.
    #[error("{file}: line {line}: {problem}")]
    RunTime {
        file: String,
        line: usize,
        problem: RunTimeProblem,
    },
    #[error("{file}: line {line}: measured_mib and gpus must be positive")]
    NotPositive { file: String, line: usize },
    /// The mapping entry `prefix` describes a training loop gpumem cannot take.
    #[error("{file}: line {line}: task `{prefix}`: {problem}")]
    Options {
        file: String,
        line: usize,
        prefix: String,
        problem: OptionsProblem,
    },
    #[error("{file}: line {line}: arrival_s must be a non-negative number")]
    Arrival {
        file: String,
        line: usize,
        arrival_s: f64,
    },
    #[error("{file}: line {line}: unknown task `{task}`")]
    UnknownTask {
        file: String,
        line: usize,
        task: String,
    },
}

/// Why a task's exclusive run time cannot be derived.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RunTimeProblem {
    #[error("mapping has neither workload nor minutes")]
    NoWorkload,
    #[error("the readme has no `{workload}` row at batch {batch}")]
    NoReadmeRow { workload: String, batch: u64 },
    /// A command (the readme gives minutes per epoch) without `--epochs`.
    #[error("`{0}` has no --epochs")]
    NoEpochs(String),
}

/// What is wrong with a mapping entry's training loop.
#[derive(Debug, thiserror::Error)]
pub enum OptionsProblem {
    #[error("input `{0}` is not CxHxW")]
    Input(String),
    /// An optimizer, validate or outputs value that is not among the choices.
    #[error(transparent)]
    Name(#[from] gpumem_core::UnknownName),
    /// The loop's options do not hold together (too many GPUs, say).
    #[error(transparent)]
    Options(#[from] gpumem_core::job::OptionError),
}

/// The loop a mapping entry describes, on `gpus` GPUs.
fn entry_options(entry: &Entry, gpus: u32) -> Result<Options, OptionsProblem> {
    let input = match &entry.input {
        Some(i) => Some(InputShape::parse(i).ok_or_else(|| OptionsProblem::Input(i.clone()))?),
        None => None,
    };
    Ok(OptionValues {
        optimizer: entry
            .optimizer
            .as_deref()
            .map_or(Ok(Optimizer::ADAM), Optimizer::parse)?,
        input,
        seq_len: entry.seq_len,
        data_parallel: gpus,
        validate: entry
            .validate
            .as_deref()
            .map_or(Ok(Validate::None), Validate::parse)?,
        outputs: entry.outputs.as_deref().map(Outputs::parse).transpose()?,
        ..OptionValues::default()
    }
    .check()?)
}

/// One CARMA task.
#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    pub name: String,
    pub command: String,
    pub batch: u64,
    pub gpus: u32,
    /// Measured peak per GPU (nvidia-smi).
    pub measured_bytes: u64,
    /// Published estimates; `None` where the estimator failed (40000 in the data).
    pub horus_bytes: Option<u64>,
    pub faketensor_bytes: Option<u64>,
    pub gpumemnet_bytes: Option<u64>,
    /// Exclusive run time.
    pub work_s: f64,
    /// Training steps in that run time (samples per epoch / batch × epochs), where the dataset's
    /// size is known: with the model's time per step, how much of the run the GPU is busy.
    pub train_steps: Option<u64>,
    /// How the run time was derived (for the docs and `--json`).
    pub work_rule: String,
    pub model: Option<TaskModel>,
    pub unmodelled: Option<String>,
    /// Solo utilization for tasks without a trace.
    pub fallback_load: Option<Load>,
}

impl Task {
    /// A published estimate by estimator name (`measured`, `horus`, `faketensor`, `gpumemnet`).
    pub fn published(&self, estimator: &str) -> Option<Option<u64>> {
        match estimator {
            "measured" => Some(Some(self.measured_bytes)),
            "horus" => Some(self.horus_bytes),
            "faketensor" => Some(self.faketensor_bytes),
            "gpumemnet" => Some(self.gpumemnet_bytes),
            _ => None,
        }
    }
}

#[derive(Debug, Deserialize)]
struct TaskRow {
    task: String,
    command: String,
    batch_size: u64,
    gpus: u32,
    measured_mib: f64,
    horus_mib: f64,
    faketensor_mib: f64,
    gpumemnet_mib: f64,
}

#[derive(Debug, Deserialize)]
struct ReadmeRow {
    model: String,
    batch_size: u64,
    exclusive_time_min: f64,
    epochs: String,
}

/// CARMA writes 40000 MiB when an estimator failed.
const FAILED_MIB: f64 = 40000.0;

fn published_bytes(mib: f64) -> Option<u64> {
    (mib.is_finite() && mib > 0.0 && mib < FAILED_MIB).then(|| (mib * MIB as f64).round() as u64)
}

fn read_csv<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<Vec<T>, CarmaError> {
    let file = || path.display().to_string();
    let mut r = csv::Reader::from_path(path).map_err(|source| CarmaError::Open {
        file: file(),
        source,
    })?;
    r.deserialize()
        .enumerate()
        .map(|(i, row)| {
            row.map_err(|source| CarmaError::Row {
                file: file(),
                line: i + 2,
                source,
            })
        })
        .collect()
}

/// `--epochs N` from a command line.
fn epochs_in(command: &str) -> Option<u32> {
    let mut words = command.split_whitespace();
    while let Some(w) = words.next() {
        if w == "--epochs" {
            return words.next()?.parse().ok();
        }
    }
    None
}

/// Reads the tasks and their run times.
pub fn load_tasks(tasks_csv: &Path, readme_csv: &Path) -> Result<Vec<Task>, CarmaError> {
    let mapping: Mapping = toml::from_str(MAPPING)?;
    let readme: Vec<ReadmeRow> = read_csv(readme_csv)?;
    let rows: Vec<TaskRow> = read_csv(tasks_csv)?;
    let mut tasks = Vec::with_capacity(rows.len());
    for (i, row) in rows.into_iter().enumerate() {
        let file = || tasks_csv.display().to_string();
        let line = i + 2;
        let entry = mapping
            .task
            .iter()
            .find(|e| row.task.starts_with(&e.prefix))
            .ok_or_else(|| CarmaError::NoMapping {
                file: file(),
                line,
                task: row.task.clone(),
            })?;
        let (work_min, epochs, work_rule) =
            run_minutes(entry, &row, &readme).map_err(|problem| CarmaError::RunTime {
                file: file(),
                line,
                problem,
            })?;
        if row.measured_mib.is_nan() || row.measured_mib <= 0.0 || row.gpus == 0 {
            return Err(CarmaError::NotPositive { file: file(), line });
        }
        // Every multi-GPU CARMA task wraps its model in torch.nn.DataParallel.
        let batch = entry.batch.unwrap_or(row.batch_size);
        let model = match &entry.model {
            Some(m) => Some(TaskModel {
                reference: m.clone(),
                batch,
                options: entry_options(entry, row.gpus).map_err(|problem| CarmaError::Options {
                    file: file(),
                    line,
                    prefix: entry.prefix.clone(),
                    problem,
                })?,
            }),
            None => None,
        };
        let train_steps = entry
            .train_samples
            .zip(epochs)
            .map(|(n, e)| n.div_ceil(batch.max(1)) * u64::from(e));
        tasks.push(Task {
            name: row.task,
            command: row.command,
            batch: row.batch_size,
            gpus: row.gpus,
            measured_bytes: (row.measured_mib * MIB as f64).round() as u64,
            horus_bytes: published_bytes(row.horus_mib),
            faketensor_bytes: published_bytes(row.faketensor_mib),
            gpumemnet_bytes: published_bytes(row.gpumemnet_mib),
            work_s: work_min * 60.0,
            train_steps,
            work_rule,
            model,
            unmodelled: entry.unmodelled.clone(),
            fallback_load: entry.load,
        });
    }
    Ok(tasks)
}

/// Minutes alone on the GPU, the epochs they cover (where known), and the rule that gave them.
fn run_minutes(
    entry: &Entry,
    row: &TaskRow,
    readme: &[ReadmeRow],
) -> Result<(f64, Option<u32>, String), RunTimeProblem> {
    if let Some(m) = entry.minutes {
        return Ok((m, None, "stated in carma-tasks.toml".into()));
    }
    let workload = entry
        .workload
        .as_deref()
        .ok_or(RunTimeProblem::NoWorkload)?;
    let candidates: Vec<&ReadmeRow> = readme.iter().filter(|r| r.model == workload).collect();
    let r = match candidates.iter().find(|r| r.batch_size == row.batch_size) {
        Some(r) => *r,
        None if candidates.len() == 1 => candidates[0],
        None => {
            return Err(RunTimeProblem::NoReadmeRow {
                workload: workload.to_string(),
                batch: row.batch_size,
            });
        }
    };
    if r.epochs == "20/50" {
        let epochs =
            epochs_in(&row.command).ok_or_else(|| RunTimeProblem::NoEpochs(row.command.clone()))?;
        Ok((
            r.exclusive_time_min * f64::from(epochs),
            Some(epochs),
            format!(
                "{workload} b{}: {} min/epoch x {epochs}",
                r.batch_size, r.exclusive_time_min
            ),
        ))
    } else if let Some(epochs) = entry.per_epoch_of {
        Ok((
            r.exclusive_time_min * f64::from(epochs),
            Some(epochs),
            format!("{workload}: {} min/epoch x {epochs}", r.exclusive_time_min),
        ))
    } else {
        Ok((
            r.exclusive_time_min,
            r.epochs.parse().ok(),
            format!("{workload} b{}: {} min", r.batch_size, r.exclusive_time_min),
        ))
    }
}

/// Reads an arrival trace (`arrival_s,task`) against the known tasks: (arrival, task index).
pub fn load_arrivals(trace_csv: &Path, tasks: &[Task]) -> Result<Vec<(f64, usize)>, CarmaError> {
    #[derive(Deserialize)]
    struct Row {
        arrival_s: f64,
        task: String,
    }
    let index: HashMap<&str, usize> = tasks
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let rows: Vec<Row> = read_csv(trace_csv)?;
    rows.into_iter()
        .enumerate()
        .map(|(i, r)| {
            let file = || trace_csv.display().to_string();
            let line = i + 2;
            if !(r.arrival_s.is_finite() && r.arrival_s >= 0.0) {
                return Err(CarmaError::Arrival {
                    file: file(),
                    line,
                    arrival_s: r.arrival_s,
                });
            }
            let t = index
                .get(r.task.as_str())
                .ok_or_else(|| CarmaError::UnknownTask {
                    file: file(),
                    line,
                    task: r.task.clone(),
                })?;
            Ok((r.arrival_s, *t))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/carma")
    }

    #[test]
    fn every_task_maps_to_a_run_time() {
        let d = data();
        if !d.exists() {
            return;
        }
        let tasks = load_tasks(
            &d.join("carma_tasks.csv"),
            &d.join("carma_workloads_readme.csv"),
        )
        .unwrap();
        assert_eq!(tasks.len(), 51);
        let by = |n: &str| tasks.iter().find(|t| t.name == n).unwrap();
        assert_eq!(by("resnet2").work_s, 32.58 * 60.0);
        assert!((by("resnet18_cifar100_50e_1").work_s - 0.49 * 50.0 * 60.0).abs() < 1e-9);
        // The `_50e_3` task's command says 20 epochs; the command wins.
        assert!((by("resnet18_cifar100_50e_3").work_s - 0.17 * 20.0 * 60.0).abs() < 1e-9);
        assert_eq!(by("xlnet_large_cased_2").gpus, 2);
        assert_eq!(
            by("BERT_base").faketensor_bytes,
            None,
            "40000 means the estimator failed"
        );
        assert_eq!(by("vgg").horus_bytes.map(|b| b / MIB), Some(21525));
        assert!(by("maskrcnn").unmodelled.is_some() && by("vgg3").model.is_some());
        // Two-GPU tasks are DataParallel; Trainer's per-device batch 8 feeds 16 per step.
        let xlnet = by("xlnet_base_cased_2").model.clone().unwrap();
        assert_eq!((xlnet.batch, xlnet.options.data_parallel), (16, 2));
        assert_eq!(by("vgg").model.as_ref().unwrap().options.data_parallel, 1);
        // Steps: ImageNet at batch 64 for one epoch; CIFAR-100 at batch 32 for 20 epochs; the
        // U-Net at its script's batch 8 for 90 epochs of VOC.
        assert_eq!(by("resnet2").train_steps, Some(1_281_167u64.div_ceil(64)));
        assert_eq!(
            by("resnet18_cifar100_20e_1").train_steps,
            Some(50_000u64.div_ceil(32) * 20)
        );
        assert_eq!(by("UNet").train_steps, Some(1_464u64.div_ceil(8) * 90));
        assert_eq!(
            by("UNet").model.as_ref().unwrap().options.validate,
            Validate::Grad
        );
        assert_eq!(by("BERT_base").train_steps, None);
        for t in &tasks {
            assert!(t.work_s > 0.0, "{}", t.name);
            assert!(
                t.model.is_some() != t.unmodelled.is_some(),
                "{}: a model or a reason",
                t.name
            );
            assert!(
                t.model.is_some() || t.fallback_load.is_some(),
                "{}: unmodelled tasks state a load",
                t.name
            );
        }
        for trace in [
            "philly_trace-t1.csv",
            "philly_trace-t2.csv",
            "philly_heavy-60-tasks.csv",
            "philly_mix-90-tasks.csv",
        ] {
            assert!(
                load_arrivals(&d.join(trace), &tasks).unwrap().len() >= 60,
                "{trace}"
            );
        }
    }

    #[test]
    fn bad_rows_are_one_line_errors() {
        let dir = std::env::temp_dir().join(format!("gpumem-carma-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let readme = dir.join("readme.csv");
        std::fs::write(&readme, "model,batch_size,gpus,exclusive_time_min,epochs,measured_gb,family\nvgg16,32,1,50,1,6.7,imagenet\nvgg16,128,1,44,1,21.9,imagenet\n").unwrap();
        let tasks = dir.join("tasks.csv");
        let head = "task,command,summary,dataset,batch_size,gpus,measured_mib,horus_mib,faketensor_mib,gpumemnet_mib\n";
        std::fs::write(&tasks, format!("{head}vgg,python vgg.py,s,d,32,1,6684,1,1,8000\nzebra,python z.py,s,d,32,1,1,1,1,1\n")).unwrap();
        let e = load_tasks(&tasks, &readme).unwrap_err().to_string();
        assert!(
            e.ends_with("line 3: no mapping for task `zebra` (see carma-tasks.toml)")
                && !e.contains('\n'),
            "{e}"
        );
        std::fs::write(
            &tasks,
            format!("{head}vgg2,python vgg.py,s,d,64,1,11760,1,1,8000\n"),
        )
        .unwrap();
        let e = load_tasks(&tasks, &readme).unwrap_err().to_string();
        assert!(
            e.contains("line 2: the readme has no `vgg16` row at batch 64"),
            "{e}"
        );
        std::fs::write(
            &tasks,
            format!("{head}vgg,python vgg.py,s,d,32,1,6684,1,1,8000\n"),
        )
        .unwrap();
        let ok = load_tasks(&tasks, &readme).unwrap();
        let trace = dir.join("trace.csv");
        std::fs::write(&trace, "arrival_s,task\n0,vgg\n5,vgg9\n").unwrap();
        let e = load_arrivals(&trace, &ok).unwrap_err().to_string();
        assert!(e.ends_with("line 3: unknown task `vgg9`"), "{e}");
        std::fs::write(&trace, "arrival_s,task\n-1,vgg\n").unwrap();
        assert!(
            load_arrivals(&trace, &ok)
                .unwrap_err()
                .to_string()
                .contains("non-negative")
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
