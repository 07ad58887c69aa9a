//! Learned models as versioned files: training, prediction, loading with a feature check.

use std::sync::OnceLock;

use gpumem_core::UnknownName;
use serde::{Deserialize, Serialize};

use crate::data::{Sample, Target};
use crate::features::FeatureSet;
use crate::gbt::{Gbt, GbtConfig, GbtInputError};
use crate::net::{Arch, Labels, Net, NetError, NetWeights, TrainConfig, softmax};

pub const FORMAT: &str = "gpumem-learned";
pub const VERSION: u32 = 1;

/// Why a model could not be trained, cross-validated, read or run.
#[derive(Debug, thiserror::Error)]
pub enum LearnError {
    #[error("{rows} rows are too few to train on (at least 10)")]
    TooFewRows { rows: usize },
    #[error("--bins must be at least 1 MiB")]
    BinWidth,
    #[error("--folds {folds} must be between 2 and the number of rows ({rows})")]
    Folds { folds: usize, rows: usize },
    /// A row without the target being learned (`line` of the dataset).
    #[error("line {line}: no {target} measurement")]
    NoMeasurement { line: usize, target: &'static str },
    #[error("{file}: not a gpumem model: {source}")]
    NotJson {
        file: String,
        source: serde_json::Error,
    },
    #[error("{file}: not a gpumem model (format is not `{FORMAT}`)")]
    Format { file: String },
    /// `version` as the file has it (a JSON value: a number, or whatever else it holds).
    #[error("{file}: model version {version} is not {VERSION}; retrain it with this gpumem")]
    Version {
        file: String,
        version: serde_json::Value,
    },
    #[error("{file}: bad model: {source}")]
    BadModel {
        file: String,
        source: serde_json::Error,
    },
    #[error("{file}: trained on features [{}], but this gpumem computes [{}]; retrain it", .trained.join(", "), .computed.join(", "))]
    Features {
        file: String,
        trained: Vec<String>,
        computed: Vec<String>,
    },
    #[error("{file}: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    /// `--estimator learned` with no model, or with one that is not a hybrid memory model.
    #[error("{}--estimator learned needs a hybrid memory model: --learned-model M.json (gpumem learn train --target memory --model gbt)", .file.as_ref().map(|f| format!("{f}: ")).unwrap_or_default())]
    NotHybrid { file: Option<String> },
    #[error(
        "the learned estimator needs a native model spec (its features come from the model's layers)"
    )]
    NotNative,
    #[error(transparent)]
    Estimator(#[from] gpumem_core::UnknownName),
    #[error("{0}")]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Net(#[from] NetError),
    #[error(transparent)]
    Gbt(#[from] GbtInputError),
}

/// Which learner.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    Mlp,
    Transformer,
    Gbt,
}

impl Kind {
    pub fn parse(s: &str) -> Result<Kind, UnknownName> {
        match s {
            "mlp" => Ok(Kind::Mlp),
            "transformer" => Ok(Kind::Transformer),
            "gbt" => Ok(Kind::Gbt),
            other => Err(UnknownName::new("model", other, "mlp, transformer or gbt")),
        }
    }
}

/// Signed log then standardisation: sizes span orders of magnitude.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Scaler {
    mean: Vec<f64>,
    std: Vec<f64>,
}

fn squash(x: f64) -> f64 {
    x.signum() * x.abs().ln_1p()
}

impl Scaler {
    pub fn fit(rows: &[Vec<f64>]) -> Scaler {
        let w = rows.first().map_or(0, Vec::len);
        let n = rows.len().max(1) as f64;
        let mean: Vec<f64> = (0..w)
            .map(|j| rows.iter().map(|r| squash(r[j])).sum::<f64>() / n)
            .collect();
        let std = (0..w)
            .map(|j| {
                let var = rows
                    .iter()
                    .map(|r| (squash(r[j]) - mean[j]).powi(2))
                    .sum::<f64>()
                    / n;
                if var > 1e-12 { var.sqrt() } else { 1.0 }
            })
            .collect();
        Scaler { mean, std }
    }

    pub fn apply(&self, row: &[f64]) -> Vec<f32> {
        row.iter()
            .enumerate()
            .map(|(j, &x)| ((squash(x) - self.mean[j]) / self.std[j]) as f32)
            .collect()
    }
}

/// A split-conformal upper bound: prediction × (1 + margin) misses at most `miss_rate` of
/// exchangeable new rows.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Conformal {
    pub miss_rate: f64,
    pub relative_margin: f64,
}

/// A regressor of the correction.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Regressor {
    Gbt(Gbt),
    Nets(Vec<NetWeights>),
}

/// What the model outputs.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", tag = "head")]
pub enum Head {
    /// GPUMemNet: memory classes of `bin_mib` each; an ensemble averages probabilities.
    Bins {
        bin_mib: f64,
        classes: usize,
        members: Vec<NetWeights>,
    },
    /// gpumem's own answer (replay peak, physical utilization) plus a learned correction:
    /// relative for memory, absolute for utilization.
    Correction {
        regressor: Regressor,
        bound: Option<Conformal>,
    },
}

/// A trained model file.
#[derive(Debug, Serialize, Deserialize)]
pub struct LearnedModel {
    pub format: String,
    pub version: u32,
    pub target: Target,
    pub kind: Kind,
    pub features: FeatureSet,
    pub feature_names: Vec<String>,
    pub scaler: Scaler,
    pub head: Head,
    pub trained_rows: usize,
    /// The GPU profile the trace features were computed on.
    pub profile: String,
    /// The networks, built from their weights on first use.
    #[serde(skip)]
    nets: OnceLock<Vec<Net>>,
}

/// What to train.
#[derive(Debug, Clone, PartialEq)]
pub struct Spec {
    pub target: Target,
    pub kind: Kind,
    /// GPUMemNet's bin width (1024 MiB for MLPs, 8192 for CNNs and Transformers).
    pub bin_mib: f64,
    /// Ensemble members (differently deep networks).
    pub members: usize,
    pub net: TrainConfig,
    pub gbt: GbtConfig,
    /// The upper bound's stated miss rate (memory corrections).
    pub miss_rate: f64,
}

impl Spec {
    /// Defaults per learner. The Transformer learns slowly from 12 scalar tokens: one network
    /// trained 1,500 epochs at 3e-3 reaches GPUMemNet's accuracy where three at 150 do not
    /// (docs/learn.md).
    pub fn new(target: Target, kind: Kind) -> Spec {
        let (members, net) = match kind {
            Kind::Transformer => (
                1,
                TrainConfig {
                    epochs: 1500,
                    lr: 3e-3,
                    ..TrainConfig::default()
                },
            ),
            _ => (3, TrainConfig::default()),
        };
        Spec {
            target,
            kind,
            bin_mib: 1024.0,
            members,
            net,
            gbt: GbtConfig::default(),
            miss_rate: 0.01,
        }
    }

    fn classifies(&self) -> bool {
        self.target == Target::Memory && self.kind != Kind::Gbt
    }

    pub fn feature_set(&self) -> FeatureSet {
        if self.classifies() {
            FeatureSet::Seed
        } else {
            FeatureSet::Full
        }
    }

    fn arch(&self, member: usize) -> Arch {
        match self.kind {
            Kind::Transformer => Arch::Transformer {
                d_model: 32,
                heads: 4,
                layers: 1 + member,
            },
            _ => Arch::Mlp {
                hidden: [128, 64, 64, 32, 32][..(2 + member).min(5)].to_vec(),
            },
        }
    }
}

/// One prediction.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Prediction {
    /// MiB for memory (a bin's upper edge for GPUMemNet), a fraction for utilization.
    pub value: f64,
    /// Memory corrections: the conformal upper bound (MiB).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upper: Option<f64>,
    /// GPUMemNet: the predicted bin.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bin: Option<usize>,
}

pub(crate) fn target_of(s: &Sample, t: Target) -> Result<f64, LearnError> {
    s.target(t).ok_or(LearnError::NoMeasurement {
        line: s.line,
        target: t.name(),
    })
}

/// The correction a model learns for a sample: measured vs gpumem's own answer.
fn correction(s: &Sample, t: Target) -> Result<f64, LearnError> {
    let y = target_of(s, t)?;
    let base = s.physical(t);
    Ok(if t == Target::Memory {
        y / base.max(1.0) - 1.0
    } else {
        y - base
    })
}

fn apply(s: &Sample, t: Target, c: f64) -> f64 {
    let base = s.physical(t);
    if t == Target::Memory {
        base * (1.0 + c)
    } else {
        (base + c).clamp(0.0, 1.0)
    }
}

fn train_nets(
    spec: &Spec,
    x: &[Vec<f32>],
    labels: &Labels,
    outputs: usize,
    progress: &mut dyn FnMut(String),
) -> Result<Vec<NetWeights>, NetError> {
    (0..spec.members.max(1))
        .map(|m| {
            let mut net = Net::new(
                spec.arch(m),
                x[0].len(),
                outputs,
                spec.net.seed.wrapping_add(m as u64 * 7919),
            )?;
            let cfg = TrainConfig {
                seed: spec.net.seed.wrapping_add(m as u64),
                ..spec.net
            };
            net.train(x, labels, &cfg, &mut |epoch, loss| {
                progress(format!(
                    "member {}/{} epoch {epoch}/{} loss {loss:.4}",
                    m + 1,
                    spec.members.max(1),
                    cfg.epochs
                ))
            })?;
            net.weights()
        })
        .collect()
}

fn fit_regressor(
    spec: &Spec,
    x: &[Vec<f32>],
    y: &[f32],
    progress: &mut dyn FnMut(String),
) -> Result<Regressor, LearnError> {
    Ok(match spec.kind {
        Kind::Gbt => {
            progress(format!("boosting {} trees", spec.gbt.trees));
            Regressor::Gbt(Gbt::train(x, y, &spec.gbt)?)
        }
        _ => Regressor::Nets(train_nets(spec, x, &Labels::Values(y), 1, progress)?),
    })
}

fn build(weights: &[NetWeights]) -> Result<Vec<Net>, NetError> {
    weights.iter().map(Net::from_weights).collect()
}

fn regress(r: &Regressor, nets: &[Net], x: &[Vec<f32>]) -> Result<Vec<f64>, NetError> {
    Ok(match r {
        Regressor::Gbt(g) => g.predict(x).into_iter().map(f64::from).collect(),
        Regressor::Nets(_) => {
            let mut sum = vec![0.0; x.len()];
            for net in nets {
                for (s, out) in sum.iter_mut().zip(net.predict(x)?) {
                    *s += f64::from(out[0]) / nets.len() as f64;
                }
            }
            sum
        }
    })
}

/// Deterministic grouped folds: every group's rows land in one fold.
pub fn folds(samples: &[&Sample], k: usize, seed: u64) -> Vec<usize> {
    let mut groups: Vec<&str> = samples.iter().map(|s| s.group.as_str()).collect();
    groups.sort_unstable();
    groups.dedup();
    gpumem_core::rng::SplitMix64(seed).shuffle(&mut groups);
    let fold_of: std::collections::HashMap<&str, usize> = groups
        .iter()
        .enumerate()
        .map(|(i, g)| (*g, i % k.max(1)))
        .collect();
    samples.iter().map(|s| fold_of[s.group.as_str()]).collect()
}

/// Trains a model on `samples`.
pub fn train(
    samples: &[&Sample],
    spec: &Spec,
    profile: &str,
    progress: &mut dyn FnMut(String),
) -> Result<LearnedModel, LearnError> {
    if samples.len() < 10 {
        return Err(LearnError::TooFewRows {
            rows: samples.len(),
        });
    }
    let set = spec.feature_set();
    let raw: Vec<Vec<f64>> = samples.iter().map(|s| s.features(set)).collect();
    let scaler = Scaler::fit(&raw);
    let x: Vec<Vec<f32>> = raw.iter().map(|r| scaler.apply(r)).collect();
    let head = if spec.classifies() {
        if spec.bin_mib.is_nan() || spec.bin_mib < 1.0 {
            return Err(LearnError::BinWidth);
        }
        let bins: Vec<u32> = samples
            .iter()
            .map(|s| Ok((target_of(s, Target::Memory)? / spec.bin_mib) as u32))
            .collect::<Result<_, LearnError>>()?;
        let classes = *bins.iter().max().unwrap_or(&0) as usize + 2;
        Head::Bins {
            bin_mib: spec.bin_mib,
            classes,
            members: train_nets(
                spec,
                &x,
                &Labels::Classes(&bins, classes),
                classes,
                progress,
            )?,
        }
    } else {
        let y: Vec<f32> = samples
            .iter()
            .map(|s| correction(s, spec.target).map(|c| c as f32))
            .collect::<Result<_, _>>()?;
        let bound = if spec.target == Target::Memory {
            Some(conformal(samples, &x, &y, spec, progress)?)
        } else {
            None
        };
        Head::Correction {
            regressor: fit_regressor(spec, &x, &y, progress)?,
            bound,
        }
    };
    Ok(LearnedModel {
        format: FORMAT.into(),
        version: VERSION,
        target: spec.target,
        kind: spec.kind,
        features: set,
        feature_names: set.names(),
        scaler,
        head,
        trained_rows: samples.len(),
        profile: profile.into(),
        nets: OnceLock::new(),
    })
}

/// Cross-fitted relative errors on the training rows (5 inner folds) → the margin covering the
/// ⌈(n+1)(1−α/2)⌉-th smallest. Split conformal at α/2 rather than α: the guarantee holds on
/// average, and a few hundred held-out rows scatter by ±0.4 points around it; half the stated
/// rate keeps a held-out fold's realized misses under the stated rate.
fn conformal(
    samples: &[&Sample],
    x: &[Vec<f32>],
    y: &[f32],
    spec: &Spec,
    progress: &mut dyn FnMut(String),
) -> Result<Conformal, LearnError> {
    let k = 5;
    let fold = folds(samples, k, spec.net.seed ^ 0xC0F0);
    let mut errors = Vec::with_capacity(samples.len());
    for f in 0..k {
        let (train_idx, test_idx): (Vec<usize>, Vec<usize>) =
            (0..samples.len()).partition(|&i| fold[i] != f);
        if train_idx.is_empty() || test_idx.is_empty() {
            continue;
        }
        progress(format!("conformal calibration fold {}/{k}", f + 1));
        let r = fit_regressor(
            spec,
            &pick(x, &train_idx),
            &pick(y, &train_idx),
            &mut |_| {},
        )?;
        let nets = match &r {
            Regressor::Nets(w) => build(w)?,
            Regressor::Gbt(_) => Vec::new(),
        };
        let pred = regress(&r, &nets, &pick(x, &test_idx))?;
        for (&i, c) in test_idx.iter().zip(pred) {
            let p = apply(samples[i], Target::Memory, c).max(1.0);
            errors.push(target_of(samples[i], Target::Memory)? / p - 1.0);
        }
    }
    errors.sort_by(f64::total_cmp);
    let n = errors.len();
    let rank = (((n + 1) as f64) * (1.0 - spec.miss_rate / 2.0)).ceil() as usize;
    let margin = errors
        .get(rank.clamp(1, n.max(1)) - 1)
        .copied()
        .unwrap_or(0.0)
        .max(0.0);
    Ok(Conformal {
        miss_rate: spec.miss_rate,
        relative_margin: margin,
    })
}

fn pick<T: Clone>(v: &[T], idx: &[usize]) -> Vec<T> {
    idx.iter().map(|&i| v[i].clone()).collect()
}

impl LearnedModel {
    /// Reads a model file (see [`LearnedModel::from_json`]).
    pub fn read(path: &std::path::Path) -> Result<LearnedModel, LearnError> {
        let text = std::fs::read_to_string(path).map_err(|source| LearnError::Read {
            file: path.display().to_string(),
            source,
        })?;
        LearnedModel::from_json(&path.display().to_string(), &text)
    }

    /// Reads a model file, refusing other formats, versions and feature sets.
    pub fn from_json(name: &str, text: &str) -> Result<LearnedModel, LearnError> {
        let head: serde_json::Value =
            serde_json::from_str(text).map_err(|source| LearnError::NotJson {
                file: name.into(),
                source,
            })?;
        if head.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
            return Err(LearnError::Format { file: name.into() });
        }
        if head.get("version").and_then(|v| v.as_u64()) != Some(u64::from(VERSION)) {
            return Err(LearnError::Version {
                file: name.into(),
                version: head["version"].clone(),
            });
        }
        let m: LearnedModel =
            serde_json::from_value(head).map_err(|source| LearnError::BadModel {
                file: name.into(),
                source,
            })?;
        let expected = m.features.names();
        if m.feature_names != expected {
            return Err(LearnError::Features {
                file: name.into(),
                trained: m.feature_names,
                computed: expected,
            });
        }
        Ok(m)
    }

    pub fn to_json(&self) -> Result<String, LearnError> {
        Ok(serde_json::to_string(self)?)
    }

    /// The networks, built from their weights on first use (a failed build is not kept).
    fn nets(&self) -> Result<&[Net], NetError> {
        if let Some(nets) = self.nets.get() {
            return Ok(nets);
        }
        let weights: &[NetWeights] = match &self.head {
            Head::Bins { members, .. }
            | Head::Correction {
                regressor: Regressor::Nets(members),
                ..
            } => members,
            Head::Correction {
                regressor: Regressor::Gbt(_),
                ..
            } => &[],
        };
        let built = build(weights)?;
        Ok(self.nets.get_or_init(|| built))
    }

    /// Predictions for many samples (batched through the networks).
    pub fn predict(&self, samples: &[&Sample]) -> Result<Vec<Prediction>, LearnError> {
        let x: Vec<Vec<f32>> = samples
            .iter()
            .map(|s| self.scaler.apply(&s.features(self.features)))
            .collect();
        let nets = self.nets()?;
        match &self.head {
            Head::Bins {
                bin_mib, classes, ..
            } => {
                let mut probs = vec![vec![0.0f32; *classes]; x.len()];
                for net in nets {
                    for (p, logits) in probs.iter_mut().zip(net.predict(&x)?) {
                        for (a, b) in p.iter_mut().zip(softmax(&logits)) {
                            *a += b;
                        }
                    }
                }
                Ok(probs
                    .iter()
                    .map(|p| {
                        let bin = p
                            .iter()
                            .enumerate()
                            .max_by(|a, b| a.1.total_cmp(b.1))
                            .map_or(0, |(i, _)| i);
                        Prediction {
                            value: (bin + 1) as f64 * bin_mib,
                            upper: None,
                            bin: Some(bin),
                        }
                    })
                    .collect())
            }
            Head::Correction { regressor, bound } => Ok(regress(regressor, nets, &x)?
                .into_iter()
                .zip(samples)
                .map(|(c, s)| {
                    let value = apply(s, self.target, c);
                    Prediction {
                        value,
                        upper: bound.map(|b| value * (1.0 + b.relative_margin)),
                        bin: None,
                    }
                })
                .collect()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::features::trace_summary;
    use gpumem_core::families::{JobOptions, ModelSpec};
    use gpumem_core::profile::builtin;
    use gpumem_core::rng::SplitMix64;

    /// Native MLP jobs whose "measured" memory is the replay's plus a batch-dependent excess
    /// and whose SMACT is the physical model's, shifted.
    fn samples(n: usize) -> Vec<Sample> {
        let profile = builtin("a100-40gb").unwrap();
        let mut rng = SplitMix64(11);
        (0..n)
            .map(|i| {
                let input = 16 + (rng.unit() * 2000.0) as u64;
                let batch = 8 + (rng.unit() * 500.0) as u64;
                let spec = format!("mlp:input={input},output=10,depth={},act=relu", 1 + i % 4);
                let m = ModelSpec::parse(&spec).unwrap();
                let trace = m.trace(&JobOptions::new(batch)).unwrap();
                let mut s = Sample::new(
                    i + 2,
                    spec.clone(),
                    spec,
                    m.facts(batch),
                    trace_summary(&trace, &profile).unwrap(),
                );
                let peak = s.physical(Target::Memory);
                s.set_target(Target::Memory, peak * (1.0 + batch as f64 / 10_000.0));
                let smact = s.physical(Target::Smact);
                s.set_target(Target::Smact, (smact * 0.5 + 0.05).min(1.0));
                s
            })
            .collect()
    }

    #[test]
    fn corrections_learn_what_gpumem_misses() {
        let rows = samples(120);
        let refs: Vec<&Sample> = rows.iter().collect();
        for target in [Target::Memory, Target::Smact] {
            let mut spec = Spec::new(target, Kind::Gbt);
            spec.gbt.trees = 100;
            let m = train(&refs, &spec, "a100-40gb", &mut |_| {}).unwrap();
            let pred = m.predict(&refs).unwrap();
            let err = |f: &dyn Fn(&Sample) -> f64| {
                refs.iter()
                    .map(|s| (f(s) - s.target(target).unwrap()).abs())
                    .sum::<f64>()
            };
            let learned: f64 = refs
                .iter()
                .zip(&pred)
                .map(|(s, p)| (p.value - s.target(target).unwrap()).abs())
                .sum();
            assert!(
                learned < err(&|s| s.physical(target)) / 2.0,
                "{target:?}: the correction halves gpumem's own error"
            );
            if target == Target::Memory {
                assert!(
                    pred.iter().all(|p| p.upper.unwrap() >= p.value),
                    "a bound above every estimate"
                );
            }
        }
    }

    #[test]
    fn classifier_ensembles_separate_bins() {
        let rows = samples(120);
        let refs: Vec<&Sample> = rows.iter().collect();
        let mut spec = Spec::new(Target::Memory, Kind::Mlp);
        spec.bin_mib = 8.0;
        spec.members = 2;
        spec.net.epochs = 60;
        let m = train(&refs, &spec, "a100-40gb", &mut |_| {}).unwrap();
        assert_eq!(
            m.features,
            FeatureSet::Seed,
            "GPUMemNet sees only the seed's features"
        );
        let pred = m.predict(&refs).unwrap();
        let right = refs
            .iter()
            .zip(&pred)
            .filter(|(s, p)| p.bin == Some((s.target(Target::Memory).unwrap() / 8.0) as usize))
            .count();
        assert!(
            right * 2 > refs.len(),
            "better than chance on its own training rows: {right}/{}",
            refs.len()
        );
    }

    #[test]
    fn transformer_classifiers_train_and_round_trip() {
        let rows = samples(60);
        let refs: Vec<&Sample> = rows.iter().collect();
        let mut spec = Spec::new(Target::Memory, Kind::Transformer);
        assert_eq!(
            (spec.members, spec.net.epochs),
            (1, 1500),
            "the defaults that reach the seed's accuracy"
        );
        spec.bin_mib = 8.0;
        spec.members = 2;
        spec.net.epochs = 20;
        let m = train(&refs, &spec, "a100-40gb", &mut |_| {}).unwrap();
        let p = m.predict(&refs).unwrap();
        assert!(p.iter().all(|p| p.bin.is_some() && p.value > 0.0));
        let back = LearnedModel::from_json("t.json", &m.to_json().unwrap()).unwrap();
        assert_eq!(back.predict(&refs).unwrap(), p);
    }

    #[test]
    fn model_files_round_trip_and_refuse_strangers() {
        let rows = samples(30);
        let refs: Vec<&Sample> = rows.iter().collect();
        let mut spec = Spec::new(Target::Smact, Kind::Mlp);
        spec.net.epochs = 3;
        spec.members = 1;
        let m = train(&refs, &spec, "a100-40gb", &mut |_| {}).unwrap();
        let json = m.to_json().unwrap();
        let back = LearnedModel::from_json("m.json", &json).unwrap();
        assert_eq!(back.predict(&refs).unwrap(), m.predict(&refs).unwrap());
        let e = LearnedModel::from_json("m.json", &json.replace("\"version\":1", "\"version\":9"))
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "m.json: model version 9 is not 1; retrain it with this gpumem"
        );
        let e =
            LearnedModel::from_json("m.json", &json.replace("\"physical_smact\"", "\"weather\""))
                .unwrap_err()
                .to_string();
        assert!(
            e.starts_with("m.json: trained on features [")
                && e.contains("weather")
                && !e.contains('\n'),
            "{e}"
        );
        let e = LearnedModel::from_json("m.json", "{\"format\":\"onnx\"}").unwrap_err();
        assert_eq!(
            e.to_string(),
            "m.json: not a gpumem model (format is not `gpumem-learned`)"
        );
        let e = LearnedModel::from_json("m.json", "{")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("m.json: not a gpumem model: "), "{e}");
    }

    #[test]
    fn folds_keep_groups_together_and_are_deterministic() {
        let rows = samples(40);
        let mut refs: Vec<&Sample> = rows.iter().collect();
        let mut twin = rows[0].clone();
        twin.line = 999;
        refs.push(&twin);
        let f = folds(&refs, 4, 5);
        assert_eq!(f, folds(&refs, 4, 5));
        assert_eq!(f[0], f[40], "a configuration never straddles folds");
        assert!((0..4).all(|k| f.contains(&k)));
    }

    #[test]
    fn too_few_rows_is_an_error() {
        let rows = samples(5);
        let refs: Vec<&Sample> = rows.iter().collect();
        let e = train(
            &refs,
            &Spec::new(Target::Memory, Kind::Gbt),
            "x",
            &mut |_| {},
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "5 rows are too few to train on (at least 10)"
        );
    }
}
