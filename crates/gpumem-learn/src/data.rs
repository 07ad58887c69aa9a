//! Datasets: measured rows (the seed's MLP schema, or gpumem's `model,batch_size,measured_mib`)
//! turned into [`Sample`]s with features and targets.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use gpumem_core::UnknownName;
use gpumem_core::dataset::{CsvError, read_measurements};
use gpumem_core::estimate::EstimateError;
use gpumem_core::families::{JobError, JobOptions};
use gpumem_core::graph::Activation;
use gpumem_core::model::ModelRef;
use gpumem_core::profile::GpuProfile;
use gpumem_core::units::bytes_to_mib;
use serde::{Deserialize, Serialize};

use crate::features::{FeatureSet, TraceSummary, seed_features, trace_summary};
use gpumem_core::families::ModelFacts;

/// A dataset that cannot be turned into samples. One line: `FILE[ line N][: column C]: what`.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{file}: {source}")]
    Open {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}: {source}")]
    Csv { file: String, source: csv::Error },
    /// The rows as `calibrate` and `eval` read them.
    #[error(transparent)]
    Measurements(#[from] CsvError),
    #[error(
        "{file} line {line}: learned features need a native model spec (mlp:, cnn:, transformer:) or the seed's schema"
    )]
    NotNative { file: String, line: usize },
    #[error("{file} line {line}: {source}")]
    Job {
        file: String,
        line: usize,
        source: JobError,
    },
    #[error("{file} line {line}: {source}")]
    Estimate {
        file: String,
        line: usize,
        source: EstimateError,
    },
    #[error("{file} line {line}: column {column}: {problem}")]
    Cell {
        file: String,
        line: usize,
        column: &'static str,
        problem: CellProblem,
    },
}

/// What is wrong with a cell that features or targets are read from.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CellProblem {
    #[error("`{0}` is not a count")]
    NotCount(String),
    #[error("`{0}` is not a number")]
    NotNumber(String),
    #[error("{0} is not a fraction in [0, 1]")]
    NotFraction(f64),
    #[error(transparent)]
    Activation(#[from] UnknownName),
}

/// What a model predicts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Target {
    /// Peak memory (MiB, as nvidia-smi shows it).
    Memory,
    Smact,
    Smocc,
    Gract,
    Dram,
    Fp32,
}

impl Target {
    pub const ALL: [Target; 6] = [
        Target::Memory,
        Target::Smact,
        Target::Smocc,
        Target::Gract,
        Target::Dram,
        Target::Fp32,
    ];

    pub fn parse(s: &str) -> Result<Target, UnknownName> {
        Target::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| {
                UnknownName::new("target", s, "memory, smact, smocc, gract, dram or fp32")
            })
    }

    pub fn name(self) -> &'static str {
        match self {
            Target::Memory => "memory",
            Target::Smact => "smact",
            Target::Smocc => "smocc",
            Target::Gract => "gract",
            Target::Dram => "dram",
            Target::Fp32 => "fp32",
        }
    }

    /// The dataset column it is read from (the seed's names).
    fn column(self) -> &'static str {
        match self {
            Target::Memory => "Max GPU Memory (MiB)",
            Target::Smact => "Avg SMACT",
            Target::Smocc => "Avg SMOCC",
            Target::Gract => "Avg GRACT",
            Target::Dram => "Avg DRAMA",
            Target::Fp32 => "Avg FP32A",
        }
    }
}

/// One measured job.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// 1-based file line.
    pub line: usize,
    pub label: String,
    /// The configuration without its batch size: folds never split a group.
    pub group: String,
    pub facts: ModelFacts,
    pub summary: TraceSummary,
    targets: HashMap<Target, f64>,
}

impl Sample {
    pub fn new(
        line: usize,
        label: String,
        group: String,
        facts: ModelFacts,
        summary: TraceSummary,
    ) -> Sample {
        Sample {
            line,
            label,
            group,
            facts,
            summary,
            targets: HashMap::new(),
        }
    }

    pub fn features(&self, set: FeatureSet) -> Vec<f64> {
        let mut f = seed_features(&self.facts);
        if set == FeatureSet::Full {
            f.extend_from_slice(&self.summary.features);
        }
        f
    }

    pub fn target(&self, t: Target) -> Option<f64> {
        self.targets.get(&t).copied()
    }

    pub fn set_target(&mut self, t: Target, value: f64) {
        self.targets.insert(t, value);
    }

    /// What gpumem's own physical/replay model says for `t` (the baseline a learned model corrects).
    pub fn physical(&self, t: Target) -> f64 {
        let u = &self.summary.utilization;
        match t {
            Target::Memory => bytes_to_mib(self.summary.replay_peak_bytes),
            Target::Smact => u.smact,
            Target::Smocc => u.smocc,
            Target::Gract => u.gract,
            Target::Dram => u.dram,
            Target::Fp32 => u.fp32,
        }
    }
}

fn column(headers: &csv::StringRecord, name: &str) -> Option<usize> {
    headers.iter().position(|h| h.trim() == name)
}

/// Seed-schema facts from a row's own columns (what GPUMemNet was trained on): the MLP
/// dataset's layer list and counts, or the CNN dataset's per-kind counts; an error names the
/// column.
fn seed_row_facts(
    rec: &csv::StringRecord,
    headers: &csv::StringRecord,
    batch: u64,
    rebuilt: Activation,
) -> Option<Result<ModelFacts, (&'static str, CellProblem)>> {
    let get = |name: &str| {
        column(headers, name)
            .and_then(|i| rec.get(i))
            .map(str::trim)
    };
    let depth = get("Depth")?;
    let num = |name: &'static str| {
        let v = get(name).unwrap_or("");
        v.parse::<f64>()
            .ok()
            .filter(|x| *x >= 0.0 && x.is_finite())
            .map(|x| x as u64)
            .ok_or_else(|| (name, CellProblem::NotCount(v.into())))
    };
    Some((|| {
        let layers = get("Activations-Params").unwrap_or("");
        let kinds = |k: &str| layers.matches(&format!("('{k}")).count() as u64;
        let act = get("Activation Function").unwrap_or("relu");
        // The CNN dataset counts each kind in a column of its own.
        let count = |column: &'static str, or: Result<u64, (&'static str, CellProblem)>| {
            if get(column).is_some() {
                num(column)
            } else {
                or
            }
        };
        Ok(ModelFacts {
            depth: depth
                .parse()
                .map_err(|_| ("Depth", CellProblem::NotCount(depth.into())))?,
            activations_per_sample: num("Total Activations")?,
            parameters: num("Total Parameters")?,
            batch,
            linear: count("Linear Count", Ok(kinds("linear")))?,
            conv: count("Conv2d Count", Ok(kinds("conv")))?,
            batchnorm: count("BatchNorm2d Count", num("Batch Normalization Layers"))?,
            layernorm: kinds("layer_norm"),
            dropout: count("Dropout Count", num("Dropout Layers"))?,
            // The CNN dataset names PyTorch's classes (LeakyReLU, SiLU), or None where its
            // summary failed: then the activation the file name rebuilt.
            activation: match act.to_ascii_lowercase().as_str() {
                "none" => rebuilt,
                "leakyrelu" => Activation::LeakyRelu,
                "silu" => Activation::Swish,
                a => Activation::parse(a).map_err(|e| ("Activation Function", e.into()))?,
            },
        })
    })())
}

/// Reads a dataset and computes every row's features on `profile`. `progress(done, total)` is
/// called as rows are processed. Errors name the file, line and column.
pub fn load(
    path: &Path,
    profile: &GpuProfile,
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<Sample>, DataError> {
    let name = path.display().to_string();
    let open = || {
        File::open(path).map_err(|source| DataError::Open {
            file: name.clone(),
            source,
        })
    };
    let rows = read_measurements(&name, BufReader::new(open()?))?;
    let mut rdr = csv::Reader::from_reader(BufReader::new(open()?));
    let csv_error = |source| DataError::Csv {
        file: name.clone(),
        source,
    };
    let headers = rdr.headers().map_err(csv_error)?.clone();
    let records: Vec<csv::StringRecord> =
        rdr.records().collect::<Result<_, _>>().map_err(csv_error)?;
    let mut out = Vec::with_capacity(rows.len());
    for (k, m) in rows.iter().enumerate() {
        let line = m.line;
        let file = || name.clone();
        let cell = |(column, problem)| DataError::Cell {
            file: file(),
            line,
            column,
            problem,
        };
        let rec = &records[m.line - 2];
        let Some(ModelRef::Native(spec)) = &m.model else {
            return Err(DataError::NotNative { file: file(), line });
        };
        let mut job = JobOptions::on(profile, m.batch);
        job.optimizer = m.options.optimizer.unwrap_or(job.optimizer);
        job.precision = m.options.precision.unwrap_or(job.precision);
        let trace = spec.trace(&job).map_err(|source| DataError::Job {
            file: file(),
            line,
            source,
        })?;
        let summary = trace_summary(&trace, profile).map_err(|source| DataError::Estimate {
            file: file(),
            line,
            source,
        })?;
        let facts = match seed_row_facts(rec, &headers, m.batch, spec.facts(m.batch).activation) {
            Some(f) => f.map_err(cell)?,
            None => spec.facts(m.batch),
        };
        let group = m
            .label
            .split("_batch:")
            .next()
            .unwrap_or(&m.label)
            .to_string();
        let mut sample = Sample::new(m.line, m.label.clone(), group, facts, summary);
        sample.set_target(Target::Memory, bytes_to_mib(m.measured_bytes));
        for t in &Target::ALL[1..] {
            if let Some(i) = column(&headers, t.column()) {
                let v = rec.get(i).unwrap_or("").trim();
                let x: f64 = v
                    .parse()
                    .map_err(|_| cell((t.column(), CellProblem::NotNumber(v.into()))))?;
                if x == -1.0 {
                    continue; // the seed's mark for a run whose DCGM fields were not collected
                }
                if !(0.0..=1.0).contains(&x) {
                    return Err(cell((t.column(), CellProblem::NotFraction(x))));
                }
                sample.set_target(*t, x);
            }
        }
        out.push(sample);
        progress(k + 1, rows.len());
    }
    Ok(out)
}
