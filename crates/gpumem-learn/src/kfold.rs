//! k-fold cross validation: train on k−1 folds, score the held-out fold.

use serde::Serialize;

use crate::data::{Sample, Target};
use crate::model::{Head, LearnError, Spec, folds, target_of, train};

/// Scores of one held-out fold.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FoldScore {
    pub fold: usize,
    pub rows: usize,
    /// Mean absolute error (MiB for memory, fraction for utilization).
    pub mae: f64,
    /// gpumem's own answer on the same rows (replay peak or physical utilization).
    pub baseline_mae: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub classification: Option<Classification>,
    /// Memory corrections: median absolute percentage error, the replay's, and how often the
    /// conformal bound was below the truth.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub median_ape: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_median_ape: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bound_miss_rate: Option<f64>,
}

/// Bin classification scores.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Classification {
    pub accuracy: f64,
    /// Macro averages over the classes present in the fold.
    pub precision: f64,
    pub recall: f64,
    pub f1: f64,
    /// Share of rows put in a bin below the true one (the crash-causing mistake).
    pub too_low: f64,
    /// `confusion[true][predicted]`.
    pub confusion: Vec<Vec<u64>>,
}

/// All folds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    pub target: String,
    pub model: String,
    pub folds: Vec<FoldScore>,
}

impl Report {
    pub fn mean(&self, f: impl Fn(&FoldScore) -> Option<f64>) -> Option<f64> {
        let v: Vec<f64> = self.folds.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn classification(truth: &[usize], pred: &[usize], classes: usize) -> Classification {
    let mut confusion = vec![vec![0u64; classes]; classes];
    for (&t, &p) in truth.iter().zip(pred) {
        confusion[t.min(classes - 1)][p.min(classes - 1)] += 1;
    }
    let n = truth.len().max(1) as f64;
    let correct: u64 = (0..classes).map(|c| confusion[c][c]).sum();
    let (mut precision, mut recall, mut f1, mut present) = (0.0, 0.0, 0.0, 0);
    for c in 0..classes {
        let actual: u64 = confusion[c].iter().sum();
        if actual == 0 {
            continue;
        }
        let predicted: u64 = confusion.iter().map(|row| row[c]).sum();
        let p = if predicted > 0 {
            confusion[c][c] as f64 / predicted as f64
        } else {
            0.0
        };
        let r = confusion[c][c] as f64 / actual as f64;
        precision += p;
        recall += r;
        f1 += if p + r > 0.0 {
            2.0 * p * r / (p + r)
        } else {
            0.0
        };
        present += 1;
    }
    let k = present.max(1) as f64;
    let too_low = truth.iter().zip(pred).filter(|(t, p)| p < t).count() as f64 / n;
    Classification {
        accuracy: correct as f64 / n,
        precision: precision / k,
        recall: recall / k,
        f1: f1 / k,
        too_low,
        confusion,
    }
}

/// Cross-validates `spec` over `k` grouped folds; `progress(message)` while training.
pub fn kfold(
    samples: &[&Sample],
    spec: &Spec,
    k: usize,
    seed: u64,
    profile: &str,
    progress: &mut dyn FnMut(String),
) -> Result<Report, LearnError> {
    if k < 2 || k > samples.len() {
        return Err(LearnError::Folds {
            folds: k,
            rows: samples.len(),
        });
    }
    let fold = folds(samples, k, seed);
    let mut scores = Vec::new();
    for f in 0..k {
        let train_rows: Vec<&Sample> = samples
            .iter()
            .zip(&fold)
            .filter(|(_, g)| **g != f)
            .map(|(s, _)| *s)
            .collect();
        let test_rows: Vec<&Sample> = samples
            .iter()
            .zip(&fold)
            .filter(|(_, g)| **g == f)
            .map(|(s, _)| *s)
            .collect();
        let model = train(&train_rows, spec, profile, &mut |m| {
            progress(format!("fold {}/{k}: {m}", f + 1))
        })?;
        let pred = model.predict(&test_rows)?;
        let truth: Vec<f64> = test_rows
            .iter()
            .map(|s| target_of(s, spec.target))
            .collect::<Result<_, _>>()?;
        let n = truth.len().max(1) as f64;
        let mae = truth
            .iter()
            .zip(&pred)
            .map(|(t, p)| (t - p.value).abs())
            .sum::<f64>()
            / n;
        let baseline_mae = truth
            .iter()
            .zip(&test_rows)
            .map(|(t, s)| (t - s.physical(spec.target)).abs())
            .sum::<f64>()
            / n;
        let mut score = FoldScore {
            fold: f + 1,
            rows: test_rows.len(),
            mae,
            baseline_mae,
            classification: None,
            median_ape: None,
            baseline_median_ape: None,
            bound_miss_rate: None,
        };
        match &model.head {
            Head::Bins {
                bin_mib, classes, ..
            } => {
                let t: Vec<usize> = truth.iter().map(|m| (m / bin_mib) as usize).collect();
                let p: Vec<usize> = pred.iter().map(|p| p.bin.unwrap_or(0)).collect();
                score.classification = Some(classification(
                    &t,
                    &p,
                    (*classes).max(t.iter().max().map_or(0, |m| m + 1)),
                ));
            }
            Head::Correction { .. } if spec.target == Target::Memory => {
                let ape = |p: f64, t: f64| (p - t).abs() / t * 100.0;
                score.median_ape = Some(median(
                    truth
                        .iter()
                        .zip(&pred)
                        .map(|(t, p)| ape(p.value, *t))
                        .collect(),
                ));
                score.baseline_median_ape = Some(median(
                    truth
                        .iter()
                        .zip(&test_rows)
                        .map(|(t, s)| ape(s.physical(Target::Memory), *t))
                        .collect(),
                ));
                score.bound_miss_rate = Some(
                    truth
                        .iter()
                        .zip(&pred)
                        .filter(|(t, p)| p.upper.is_some_and(|u| **t > u))
                        .count() as f64
                        / n,
                );
            }
            Head::Correction { .. } => {}
        }
        scores.push(score);
    }
    Ok(Report {
        target: spec.target.name().into(),
        model: format!("{:?}", spec.kind).to_lowercase(),
        folds: scores,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classification_scores_by_hand() {
        // Truth 0,0,1,1,2; predictions 0,1,1,0,2: one too low (true 1 → 0).
        let c = classification(&[0, 0, 1, 1, 2], &[0, 1, 1, 0, 2], 3);
        assert_eq!(c.accuracy, 0.6);
        assert_eq!(c.too_low, 0.2);
        assert_eq!(
            c.confusion,
            vec![vec![1, 1, 0], vec![1, 1, 0], vec![0, 0, 1]]
        );
        // Per class precision 1/2, 1/2, 1; recall 1/2, 1/2, 1.
        assert!(
            (c.precision - 2.0 / 3.0).abs() < 1e-12
                && (c.recall - 2.0 / 3.0).abs() < 1e-12
                && (c.f1 - 2.0 / 3.0).abs() < 1e-12
        );
    }

    #[test]
    fn medians() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
