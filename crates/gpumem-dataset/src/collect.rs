//! Measuring jobs one at a time: a runner trains the job, a monitor samples the GPU, a row goes
//! to the CSV.

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use gpumem_core::estimate::{EstimateError, Estimator, Replay};
use gpumem_core::families::{JobError, JobOptions, ModelSpec, SpecError};
use gpumem_core::job::Precision;
use gpumem_core::profile::GpuProfile;
use gpumem_core::rng::SplitMix64;
use gpumem_core::units::bytes_to_mib;
use gpumem_core::utilization::{HostModel, physical};
use gpumem_monitor::{Dcgm, FakeGpus, Monitor, MonitorError};
use gpumem_torch::{BridgeError, TorchTracer};
use serde::Deserialize;

use crate::SyntheticJob;

/// Why a runner could not start a job.
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    #[error(transparent)]
    Bridge(#[from] BridgeError),
    #[error("cannot start the runner with `{python}`: {source} (set GPUMEM_PYTHON)")]
    Spawn {
        python: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Job(#[from] JobError),
    #[error(transparent)]
    Estimate(#[from] EstimateError),
    #[error("fake GPUs poisoned")]
    Poisoned,
    #[error("no fake GPU {0}")]
    NoFakeGpu(u32),
}

/// Why a collection stopped. One line, naming the output CSV (and its line) where it is at fault.
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    #[error("no GPU {gpu} (the monitor sees {count})")]
    NoGpu { gpu: u32, count: usize },
    #[error("{file}: {source}")]
    Csv { file: String, source: csv::Error },
    #[error("{file}: line {line}: {source}")]
    CsvLine {
        file: String,
        line: usize,
        source: csv::Error,
    },
    #[error("{file}: exists with other columns; not appending to it (choose another --out)")]
    OtherColumns { file: String },
    #[error("{file}: {source}")]
    Io {
        file: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Monitor(#[from] MonitorError),
    #[error(transparent)]
    Runner(#[from] RunnerError),
}

/// What the runner reports when a job ends.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
pub struct RunReport {
    /// `ok`, `oom`, `error` or `timeout`.
    pub status: String,
    #[serde(default)]
    pub steps: u64,
    #[serde(default)]
    pub seconds: f64,
    #[serde(default)]
    pub max_allocated: u64,
    #[serde(default)]
    pub max_reserved: u64,
    #[serde(default)]
    pub torch: String,
    #[serde(default)]
    pub error: Option<String>,
}

/// A job in progress.
pub trait Running {
    /// The report once the job has ended; `None` while it runs.
    fn poll(&mut self) -> Option<RunReport>;
    fn kill(&mut self);
}

/// Something that trains jobs.
pub trait Runner {
    fn start(&mut self, job: &SyntheticJob, gpu: u32) -> Result<Box<dyn Running>, RunnerError>;
    /// Whether its measurements are made up (gpumem's estimate plus noise).
    fn synthetic(&self) -> bool;
}

/// The Python workload runner (`python -m gpumem_trace.run`) on a real GPU.
pub struct PythonRunner {
    pub tracer: TorchTracer,
    /// How long each job trains (the seed: about a minute).
    pub seconds: f64,
    /// The runner's device: `cuda:0` (the chosen GPU, made the only visible one) or `cpu` (tests).
    pub device: String,
}

struct PythonJob {
    child: Child,
}

impl Running for PythonJob {
    fn poll(&mut self) -> Option<RunReport> {
        match self.child.try_wait() {
            Ok(None) => None,
            Ok(Some(status)) => {
                let (mut out, mut err) = (String::new(), String::new());
                if let Some(mut o) = self.child.stdout.take() {
                    let _ = o.read_to_string(&mut out);
                }
                if let Some(e) = self.child.stderr.take() {
                    err = BufReader::new(e)
                        .lines()
                        .map_while(Result::ok)
                        .last()
                        .unwrap_or_default();
                }
                Some(
                    out.lines()
                        .rev()
                        .find_map(|l| serde_json::from_str::<RunReport>(l).ok())
                        .unwrap_or_else(|| RunReport {
                            status: "error".into(),
                            error: Some(format!(
                                "runner exited with {status} without a report: {err}"
                            )),
                            ..RunReport::default()
                        }),
                )
            }
            Err(e) => Some(RunReport {
                status: "error".into(),
                error: Some(e.to_string()),
                ..RunReport::default()
            }),
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Runner for PythonRunner {
    fn start(&mut self, job: &SyntheticJob, gpu: u32) -> Result<Box<dyn Running>, RunnerError> {
        let mut cmd = self.tracer.module_command("gpumem_trace.run")?;
        cmd.arg(&job.model)
            .args([
                "--batch",
                &job.batch.to_string(),
                "--seconds",
                &self.seconds.to_string(),
                "--device",
                &self.device,
            ])
            .env("CUDA_VISIBLE_DEVICES", gpu.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let child = cmd.spawn().map_err(|source| RunnerError::Spawn {
            python: self.tracer.python.clone(),
            source,
        })?;
        Ok(Box::new(PythonJob { child }))
    }

    fn synthetic(&self) -> bool {
        false
    }
}

/// Without a GPU: the job "runs" for `seconds` on a fake GPU, showing gpumem's replay estimate
/// (±1% noise) as its memory and the physical model's utilization (±0.02) — synthetic data for
/// testing the pipeline end to end, never for judging gpumem.
pub struct SimulatedRunner {
    pub profile: GpuProfile,
    pub gpus: FakeGpus,
    pub seconds: f64,
    pub seed: u64,
}

struct SimulatedJob {
    gpus: FakeGpus,
    gpu: usize,
    until: Instant,
    report: RunReport,
}

impl Running for SimulatedJob {
    fn poll(&mut self) -> Option<RunReport> {
        if Instant::now() < self.until {
            return None;
        }
        self.kill();
        Some(self.report.clone())
    }

    fn kill(&mut self) {
        if let Ok(mut g) = self.gpus.lock()
            && let Some(g) = g.get_mut(self.gpu)
        {
            g.processes.clear();
            g.dcgm = Dcgm::default();
        }
    }
}

impl Runner for SimulatedRunner {
    fn start(&mut self, job: &SyntheticJob, gpu: u32) -> Result<Box<dyn Running>, RunnerError> {
        let spec = ModelSpec::parse(&job.model)?;
        let trace = spec.trace(&JobOptions::on(&self.profile, job.batch))?;
        let est = Replay::default().estimate(&trace, &self.profile)?;
        let u = physical(&trace, &self.profile, &HostModel::default());
        // Noise depends on the seed and the job, not on the order jobs run in (resuming keeps it).
        let mut rng = SplitMix64(
            self.seed
                ^ SplitMix64(
                    job.id
                        .bytes()
                        .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b))),
                )
                .next_u64(),
        );
        let mut noisy = |x: f64, amp: f64| x + amp * (2.0 * rng.unit() - 1.0);
        let memory = (noisy(est.peak_bytes as f64, est.peak_bytes as f64 * 0.01).max(0.0) as u64)
            .min(self.profile.capacity_bytes());
        let dcgm = Dcgm {
            gract: noisy(u.gract, 0.02).clamp(0.0, 1.0),
            smact: noisy(u.smact, 0.02).clamp(0.0, 1.0),
            smocc: noisy(u.smocc, 0.01).clamp(0.0, 1.0),
            dram: noisy(u.dram, 0.01).clamp(0.0, 1.0),
            fp32: noisy(u.fp32, 0.01).clamp(0.0, 1.0),
        };
        {
            let mut g = self.gpus.lock().map_err(|_| RunnerError::Poisoned)?;
            let g = g.get_mut(gpu as usize).ok_or(RunnerError::NoFakeGpu(gpu))?;
            g.processes = vec![(4242, memory)];
            g.dcgm = dcgm;
        }
        let stats = est.allocator.unwrap_or_default();
        let report = RunReport {
            status: if est.fits { "ok".into() } else { "oom".into() },
            steps: 1,
            seconds: self.seconds,
            max_allocated: stats.peak_allocated,
            max_reserved: stats.peak_reserved,
            torch: format!("simulated ({})", self.profile.torch),
            error: (!est.fits).then(|| "gpumem's replay runs out of memory".to_string()),
        };
        Ok(Box::new(SimulatedJob {
            gpus: self.gpus.clone(),
            gpu: gpu as usize,
            until: Instant::now() + Duration::from_secs_f64(self.seconds),
            report,
        }))
    }

    fn synthetic(&self) -> bool {
        true
    }
}

/// How to collect.
#[derive(Debug, Clone)]
pub struct CollectConfig {
    pub gpu: u32,
    pub out: PathBuf,
    /// A job still running after this long is killed (status `timeout`).
    pub timeout_s: f64,
    /// Monitor samples per second (≥ 10).
    pub sample_hz: f64,
}

/// The CSV columns: the seed's schema, then gpumem's.
pub const COLUMNS: [&str; 29] = [
    "Filename",
    "Depth",
    "Activations-Params",
    "Activation Function",
    "Total Activations",
    "Total Parameters",
    "Batch Size",
    "Batch Normalization Layers",
    "Dropout Layers",
    "Max GPU Memory (MiB)",
    "Avg GPUTL",
    "Avg GRACT",
    "Avg SMACT",
    "Avg SMOCC",
    "Avg FP32A",
    "Avg DRAMA",
    "job_id",
    "model",
    "family",
    "status",
    "gpu",
    "driver",
    "cuda",
    "torch",
    "torch_max_allocated (MiB)",
    "torch_max_reserved (MiB)",
    "baseline (MiB)",
    "monitor_samples",
    "synthetic",
];

/// Ids of the jobs a CSV already holds (for resuming).
fn done_ids(path: &Path) -> Result<HashSet<String>, CollectError> {
    if !path.exists() {
        return Ok(HashSet::new());
    }
    let file = || path.display().to_string();
    let mut r = csv::Reader::from_path(path).map_err(|source| CollectError::Csv {
        file: file(),
        source,
    })?;
    let headers = r
        .headers()
        .map_err(|source| CollectError::Csv {
            file: file(),
            source,
        })?
        .clone();
    if headers.iter().collect::<Vec<_>>() != COLUMNS {
        return Err(CollectError::OtherColumns { file: file() });
    }
    let id = COLUMNS
        .iter()
        .position(|c| *c == "job_id")
        .expect("job_id column");
    r.records()
        .enumerate()
        .map(|(i, rec)| {
            rec.map(|r| r[id].to_string())
                .map_err(|source| CollectError::CsvLine {
                    file: file(),
                    line: i + 2,
                    source,
                })
        })
        .collect()
}

/// The seed's per-layer list: (kind, output features per sample, parameters).
fn layers(spec: &ModelSpec, batch: u64) -> String {
    let g = spec.graph(batch, Precision::Fp32);
    let kinds = [
        ("addmm", "linear"),
        ("mm", "linear"),
        ("conv2d", "conv2d"),
        ("batch_norm", "batch_normalization"),
        ("layer_norm", "layer_norm"),
        ("native_dropout", "dropout"),
    ];
    let items: Vec<String> = g
        .nodes
        .iter()
        .filter_map(|n| {
            let kind = kinds.iter().find(|(op, _)| *op == n.name)?.1;
            let out = n
                .outputs
                .first()
                .map_or(0, |&t| g.t(t).numel / batch.max(1));
            let params: u64 = n
                .inputs
                .iter()
                .filter(|i| g.params.contains(i))
                .map(|&i| g.t(i).numel)
                .sum();
            Some(format!("('{kind}', {out}, {params})"))
        })
        .collect();
    format!("[{}]", items.join(", "))
}

/// Progress of a collection.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    pub ran: usize,
    pub skipped: usize,
    pub ok: usize,
}

/// Runs every job not yet in `cfg.out`, appending a row per job; `progress(done, total, id,
/// status)` after each.
pub fn collect(
    jobs: &[SyntheticJob],
    runner: &mut dyn Runner,
    monitor: &mut dyn Monitor,
    cfg: &CollectConfig,
    mut progress: impl FnMut(usize, usize, &str, &str),
) -> Result<Summary, CollectError> {
    if cfg.gpu as usize >= monitor.gpu_count() {
        return Err(CollectError::NoGpu {
            gpu: cfg.gpu,
            count: monitor.gpu_count(),
        });
    }
    let done = done_ids(&cfg.out)?;
    let fresh = !cfg.out.exists();
    let out = || cfg.out.display().to_string();
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&cfg.out)
        .map_err(|source| CollectError::Io {
            file: out(),
            source,
        })?;
    let mut w = csv::WriterBuilder::new()
        .has_headers(false)
        .from_writer(file);
    let csv_error = |source| CollectError::Csv {
        file: out(),
        source,
    };
    let io = |source| CollectError::Io {
        file: out(),
        source,
    };
    if fresh {
        w.write_record(COLUMNS).map_err(csv_error)?;
        w.flush().map_err(io)?;
    }
    let system = monitor.system();
    let period = Duration::from_secs_f64(1.0 / cfg.sample_hz.max(10.0));
    let mut summary = Summary {
        skipped: jobs.iter().filter(|j| done.contains(&j.id)).count(),
        ..Summary::default()
    };
    for job in jobs.iter().filter(|j| !done.contains(&j.id)) {
        let spec = ModelSpec::parse(&job.model)?;
        let baseline = monitor.read(cfg.gpu)?.used_bytes;
        let started = Instant::now();
        let mut running = runner.start(job, cfg.gpu)?;
        let (mut peak, mut samples, mut util, mut name) = (0u64, 0u64, 0.0, String::new());
        let (mut dcgm, mut dcgm_n) = (Dcgm::default(), 0u64);
        let report = loop {
            if let Ok(r) = monitor.read(cfg.gpu) {
                peak = peak.max(r.used_bytes);
                util += r.util;
                samples += 1;
                name = r.name;
                if let Some(d) = r.dcgm {
                    dcgm = Dcgm {
                        gract: dcgm.gract + d.gract,
                        smact: dcgm.smact + d.smact,
                        smocc: dcgm.smocc + d.smocc,
                        dram: dcgm.dram + d.dram,
                        fp32: dcgm.fp32 + d.fp32,
                    };
                    dcgm_n += 1;
                }
            }
            if let Some(r) = running.poll() {
                break r;
            }
            if started.elapsed().as_secs_f64() > cfg.timeout_s {
                running.kill();
                break RunReport {
                    status: "timeout".into(),
                    error: Some(format!("killed after {} s", cfg.timeout_s)),
                    ..RunReport::default()
                };
            }
            std::thread::sleep(period);
        };
        let facts = spec.facts(job.batch);
        let avg = |x: f64, n: u64| {
            if n > 0 {
                format!("{:.6}", x / n as f64)
            } else {
                String::new()
            }
        };
        let mib = |b: u64| format!("{:.1}", bytes_to_mib(b));
        let row: Vec<String> = vec![
            format!("{}.out", job.id),
            facts.depth.to_string(),
            layers(&spec, job.batch),
            facts.activation.name().to_string(),
            facts.activations_per_sample.to_string(),
            facts.parameters.to_string(),
            job.batch.to_string(),
            facts.batchnorm.to_string(),
            facts.dropout.to_string(),
            mib(peak),
            avg(util * 100.0, samples),
            avg(dcgm.gract, dcgm_n),
            avg(dcgm.smact, dcgm_n),
            avg(dcgm.smocc, dcgm_n),
            avg(dcgm.fp32, dcgm_n),
            avg(dcgm.dram, dcgm_n),
            job.id.clone(),
            job.model.clone(),
            job.family.clone(),
            report.status.clone(),
            name,
            system.driver.clone(),
            system.cuda.clone(),
            report.torch.clone(),
            mib(report.max_allocated),
            mib(report.max_reserved),
            mib(baseline),
            samples.to_string(),
            runner.synthetic().to_string(),
        ];
        w.write_record(&row).map_err(csv_error)?;
        // Flushed per row: an interrupted collection loses at most the job in flight.
        w.flush().map_err(io)?;
        summary.ran += 1;
        summary.ok += usize::from(report.status == "ok");
        progress(
            summary.ran + summary.skipped,
            jobs.len(),
            &job.id,
            &report.status,
        );
    }
    Ok(summary)
}
