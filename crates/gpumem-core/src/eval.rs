//! Accuracy metrics for an estimator against measurements.

use serde::Serialize;

use crate::units::MIB;

/// Error statistics over rows (percentages are 0–100, shares 0–1).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Metrics {
    pub rows: usize,
    pub mean_ape: f64,
    pub median_ape: f64,
    pub p90_ape: f64,
    pub p95_ape: f64,
    pub within_5pct: f64,
    pub within_10pct: f64,
    /// Share of rows predicted more than 3% below the measurement.
    pub under_3pct: f64,
    /// Share of rows whose prediction lands in the measurement's bin.
    pub bin_accuracy: f64,
    /// Share of rows whose upper bound is below the measurement.
    pub bound_misses: f64,
}

/// One row: measured, predicted and upper bound, in bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    pub measured: u64,
    pub predicted: u64,
    pub upper: u64,
}

impl Outcome {
    pub fn ape(&self) -> f64 {
        (self.predicted as f64 - self.measured as f64).abs() / self.measured as f64 * 100.0
    }
    pub fn signed_pct(&self) -> f64 {
        (self.predicted as f64 - self.measured as f64) / self.measured as f64 * 100.0
    }
}

/// Nearest-rank percentile of sorted values.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// Metrics with bins of `bin_mib` MiB.
pub fn metrics(rows: &[Outcome], bin_mib: u64) -> Metrics {
    let n = rows.len();
    let mut apes: Vec<f64> = rows.iter().map(Outcome::ape).collect();
    apes.sort_by(f64::total_cmp);
    let share = |f: &dyn Fn(&Outcome) -> bool| {
        if n == 0 {
            f64::NAN
        } else {
            rows.iter().filter(|r| f(r)).count() as f64 / n as f64
        }
    };
    let bin = bin_mib * MIB;
    Metrics {
        rows: n,
        mean_ape: apes.iter().sum::<f64>() / n.max(1) as f64,
        median_ape: percentile(&apes, 50.0),
        p90_ape: percentile(&apes, 90.0),
        p95_ape: percentile(&apes, 95.0),
        within_5pct: share(&|r| r.ape() <= 5.0),
        within_10pct: share(&|r| r.ape() <= 10.0),
        under_3pct: share(&|r| r.signed_pct() < -3.0),
        bin_accuracy: share(&|r| r.predicted / bin == r.measured / bin),
        bound_misses: share(&|r| r.upper < r.measured),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_on_a_small_example() {
        let o = |m: u64, p: u64| Outcome {
            measured: m * MIB,
            predicted: p * MIB,
            upper: (p + 10) * MIB,
        };
        let rows = [o(1000, 1000), o(1000, 1020), o(1000, 950), o(2000, 2300)];
        let m = metrics(&rows, 1024);
        assert_eq!(m.rows, 4);
        assert_eq!(m.median_ape, 2.0);
        assert_eq!(m.p95_ape, 15.0);
        assert_eq!(m.within_5pct, 0.75);
        assert_eq!(m.under_3pct, 0.25);
        assert_eq!(m.bin_accuracy, 0.75);
        assert_eq!(m.bound_misses, 0.25);
    }
}
