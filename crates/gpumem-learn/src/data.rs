//! Datasets: measured rows (the seed's MLP schema, or gpumem's `model,batch_size,measured_mib`)
//! turned into [`Sample`]s with features and targets.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::Path;

use gpumem_core::dataset::read_measurements;
use gpumem_core::workload::ModelRef;
use gpumem_core::families::JobOptions;
use gpumem_core::graph::Activation;
use gpumem_core::profile::GpuProfile;
use gpumem_core::units::bytes_to_mib;
use serde::{Deserialize, Serialize};

use crate::features::{FeatureSet, TraceSummary, seed_features, trace_summary};
use gpumem_core::families::ModelFacts;

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
    pub const ALL: [Target; 6] = [Target::Memory, Target::Smact, Target::Smocc, Target::Gract, Target::Dram, Target::Fp32];

    pub fn parse(s: &str) -> Result<Target, String> {
        Target::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| format!("unknown target `{s}` (expected memory, smact, smocc, gract, dram or fp32)"))
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
    pub fn new(line: usize, label: String, group: String, facts: ModelFacts, summary: TraceSummary) -> Sample {
        Sample { line, label, group, facts, summary, targets: HashMap::new() }
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

/// Seed-schema facts from a row's own columns (what GPUMemNet was trained on).
fn seed_row_facts(rec: &csv::StringRecord, headers: &csv::StringRecord, batch: u64) -> Option<Result<ModelFacts, String>> {
    let get = |name: &str| column(headers, name).and_then(|i| rec.get(i)).map(str::trim);
    let depth = get("Depth")?;
    let num = |name: &str| -> Result<u64, String> {
        let v = get(name).unwrap_or("");
        v.parse::<f64>().ok().filter(|x| *x >= 0.0 && x.is_finite()).map(|x| x as u64).ok_or_else(|| format!("column {name}: `{v}` is not a count"))
    };
    Some((|| {
        let layers = get("Activations-Params").unwrap_or("");
        let kinds = |k: &str| layers.matches(&format!("('{k}")).count() as u64;
        let act = get("Activation Function").unwrap_or("relu");
        Ok(ModelFacts {
            depth: depth.parse().map_err(|_| format!("column Depth: `{depth}` is not a count"))?,
            activations_per_sample: num("Total Activations")?,
            parameters: num("Total Parameters")?,
            batch,
            linear: kinds("linear"),
            conv: kinds("conv"),
            batchnorm: num("Batch Normalization Layers")?,
            layernorm: kinds("layer_norm"),
            dropout: num("Dropout Layers")?,
            activation: Activation::parse(act).map_err(|e| format!("column Activation Function: {e}"))?,
        })
    })())
}

/// Reads a dataset and computes every row's features on `profile`. `progress(done, total)` is
/// called as rows are processed. Errors name the file, line and column.
pub fn load(path: &Path, profile: &GpuProfile, mut progress: impl FnMut(usize, usize)) -> Result<Vec<Sample>, String> {
    let name = path.display().to_string();
    let open = || File::open(path).map_err(|e| format!("{name}: {e}"));
    let rows = read_measurements(&name, BufReader::new(open()?))?;
    let mut rdr = csv::Reader::from_reader(BufReader::new(open()?));
    let headers = rdr.headers().map_err(|e| format!("{name}: {e}"))?.clone();
    let records: Vec<csv::StringRecord> = rdr.records().collect::<Result<_, _>>().map_err(|e| format!("{name}: {e}"))?;
    let mut out = Vec::with_capacity(rows.len());
    for (k, m) in rows.iter().enumerate() {
        let at = |e: String| format!("{name} line {}: {e}", m.line);
        let rec = &records[m.line - 2];
        let Some(ModelRef::Native(spec)) = &m.model else {
            return Err(at("learned features need a native model spec (mlp:, cnn:, transformer:) or the seed's schema".into()));
        };
        let mut job = JobOptions::on(profile, m.batch);
        job.optimizer = m.options.optimizer.unwrap_or(job.optimizer);
        job.precision = m.options.precision.unwrap_or(job.precision);
        let trace = spec.trace(&job).map_err(at)?;
        let summary = trace_summary(&trace, profile).map_err(at)?;
        let facts = match seed_row_facts(rec, &headers, m.batch) {
            Some(f) => f.map_err(at)?,
            None => spec.facts(m.batch),
        };
        let group = m.label.split("_batch:").next().unwrap_or(&m.label).to_string();
        let mut sample = Sample::new(m.line, m.label.clone(), group, facts, summary);
        sample.set_target(Target::Memory, bytes_to_mib(m.measured_bytes));
        for t in &Target::ALL[1..] {
            if let Some(i) = column(&headers, t.column()) {
                let v = rec.get(i).unwrap_or("").trim();
                let x: f64 = v.parse().map_err(|_| at(format!("column {}: `{v}` is not a number", t.column())))?;
                if !(0.0..=1.0).contains(&x) {
                    return Err(at(format!("column {}: {x} is not a fraction in [0, 1]", t.column())));
                }
                sample.set_target(*t, x);
            }
        }
        out.push(sample);
        progress(k + 1, rows.len());
    }
    Ok(out)
}
