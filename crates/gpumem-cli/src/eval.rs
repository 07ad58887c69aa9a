//! `gpumem eval`: score every estimator against measured rows.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use clap::Args;
use gpumem_core::dataset::Measurement;
use gpumem_core::estimate::{ESTIMATORS, Estimator, by_name};
use gpumem_core::eval::{Metrics, Outcome, metrics};
use gpumem_core::units::bytes_to_mib;
use gpumem_learn::LearnedModel;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use crate::args::{GpuChoice, WorkloadArgs, read_rows, row_trace};
use crate::{CliError, CliResult};

#[derive(Args)]
pub struct EvalArgs {
    /// Measurements CSV.
    measurements: PathBuf,
    #[command(flatten)]
    gpu: GpuChoice,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Where the per-row CSV and the scatter plots go.
    #[arg(long, default_value = "gpumem-eval")]
    out_dir: PathBuf,
    /// Bin width for bin accuracy, in MiB.
    #[arg(long, default_value_t = 1024)]
    bin_mib: u64,
    /// Memory models from `gpumem learn train` to score beside the others (repeatable; native
    /// datasets only). Score them on rows they were not trained on.
    #[arg(long)]
    learned_model: Vec<PathBuf>,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
}

/// The rows that ran out of memory, as checks: does the estimate (does the bound) exceed the GPU?
#[derive(Serialize)]
struct DidNotFit {
    rows: usize,
    estimate_over: usize,
    bound_over: usize,
    skipped: usize,
}

fn did_not_fit(
    rows: &[Measurement],
    defaults: &gpumem_core::job::Options,
    profile: &gpumem_core::profile::GpuProfile,
    replay: &dyn Estimator,
) -> CliResult<Option<DidNotFit>> {
    if rows.is_empty() {
        return Ok(None);
    }
    let mut d = DidNotFit {
        rows: rows.len(),
        estimate_over: 0,
        bound_over: 0,
        skipped: 0,
    };
    for m in rows {
        // A job refused outright (too large for any GPU) or not traceable: not a check here.
        let Ok(Ok(trace)) = row_trace(m, defaults, profile) else {
            d.skipped += 1;
            continue;
        };
        let est = replay
            .estimate(&trace, profile)
            .map_err(|e| CliError::input(format!("line {}: {e}", m.line)))?;
        d.estimate_over += usize::from(est.peak_bytes > profile.capacity_bytes());
        d.bound_over += usize::from(est.upper_bound_bytes > profile.capacity_bytes());
    }
    Ok(Some(d))
}

#[derive(Serialize)]
struct EvalSummary {
    estimator: String,
    #[serde(flatten)]
    metrics: Metrics,
}

pub fn eval(a: EvalArgs) -> CliResult {
    let profile = a.gpu.load()?;
    if a.bin_mib == 0 {
        return Err(CliError::input("--bin-mib must be positive"));
    }
    let all = read_rows(&a.measurements)?;
    let rows = all.measured;
    let defaults = a.workload.options()?;
    let mut names: Vec<String> = ESTIMATORS.iter().map(|s| s.to_string()).collect();
    let published: Vec<String> = rows[0]
        .published
        .iter()
        .map(|(n, _)| format!("published:{n}"))
        .collect();
    names.extend(published.iter().cloned());
    let estimators: Vec<Box<dyn Estimator>> = ESTIMATORS
        .iter()
        .map(|n| by_name(n).expect("known"))
        .collect();
    let mut outcomes: Vec<Vec<(usize, Outcome)>> = vec![Vec::new(); names.len()];
    let mut skipped = Vec::new();
    let bar = ProgressBar::new(rows.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} rows {eta}").expect("valid template"),
    );
    for (ri, m) in rows.iter().enumerate() {
        bar.inc(1);
        for (k, (_, v)) in m.published.iter().enumerate() {
            if let Some(v) = v {
                outcomes[ESTIMATORS.len() + k].push((
                    ri,
                    Outcome {
                        measured: m.measured_bytes,
                        predicted: *v,
                        upper: *v,
                    },
                ));
            }
        }
        let trace = match row_trace(m, &defaults, &profile)? {
            Ok(t) => t,
            Err(why) => {
                skipped.push((m, why));
                continue;
            }
        };
        for (k, e) in estimators.iter().enumerate() {
            let est = e
                .estimate(&trace, &profile)
                .map_err(|e| CliError::input(format!("line {}: {e}", m.line)))?;
            outcomes[k].push((
                ri,
                Outcome {
                    measured: m.measured_bytes,
                    predicted: est.peak_bytes,
                    upper: est.upper_bound_bytes,
                },
            ));
        }
    }
    bar.finish_and_clear();
    if let Some((m, why)) = skipped.first().filter(|_| skipped.len() == rows.len()) {
        // Nothing to score: not a success (exit 3, as for a model that cannot be traced).
        return Err(CliError::Model(format!(
            "{}: no row could be modelled (line {}: {why})",
            a.measurements.display(),
            m.line
        )));
    }
    let did_not_fit = did_not_fit(
        &all.did_not_fit,
        &defaults,
        &profile,
        estimators[0].as_ref(),
    )?;
    if !a.learned_model.is_empty() {
        let samples = crate::learn::load_dataset(&a.measurements, &profile)?;
        let refs: Vec<&gpumem_learn::Sample> = samples.iter().collect();
        for path in &a.learned_model {
            let model = LearnedModel::read(path).map_err(CliError::input)?;
            if model.target != gpumem_learn::Target::Memory {
                return Err(CliError::input(format!(
                    "{}: eval scores memory models; this one predicts {}",
                    path.display(),
                    model.target.name()
                )));
            }
            let stem = path
                .file_stem()
                .map_or("model".into(), |s| s.to_string_lossy().into_owned());
            names.push(format!("learned:{stem}"));
            let mut scored = Vec::new();
            for (s, p) in samples
                .iter()
                .zip(model.predict(&refs).map_err(CliError::input)?)
            {
                if let Some(ri) = rows.iter().position(|m| m.line == s.line) {
                    let mib = |x: f64| gpumem_core::units::mib_to_bytes(x);
                    scored.push((
                        ri,
                        Outcome {
                            measured: rows[ri].measured_bytes,
                            predicted: mib(p.value),
                            upper: mib(p.upper.unwrap_or(p.value)),
                        },
                    ));
                }
            }
            outcomes.push(scored);
        }
    }
    let summaries: Vec<EvalSummary> = names
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| !o.is_empty())
        .map(|(n, o)| EvalSummary {
            estimator: n.clone(),
            metrics: metrics(&o.iter().map(|(_, x)| *x).collect::<Vec<_>>(), a.bin_mib),
        })
        .collect();
    std::fs::create_dir_all(&a.out_dir)
        .map_err(|e| CliError::other(format!("{}: {e}", a.out_dir.display())))?;
    write_rows_csv(&a.out_dir.join("rows.csv"), &rows, &names, &outcomes)?;
    let series: Vec<(String, Vec<(f64, f64)>)> = names
        .iter()
        .zip(&outcomes)
        .filter(|(_, o)| !o.is_empty())
        .map(|(n, o)| {
            (
                n.clone(),
                o.iter()
                    .map(|(_, x)| (bytes_to_mib(x.measured), bytes_to_mib(x.predicted)))
                    .collect(),
            )
        })
        .collect();
    crate::plot::scatter(
        &a.out_dir.join("scatter.svg"),
        &a.out_dir.join("scatter.png"),
        &series,
    )
    .map_err(CliError::other)?;
    if a.json {
        let out = serde_json::json!({"gpu": profile.name, "rows": rows.len(), "skipped": skipped.len(), "bin_mib": a.bin_mib, "estimators": summaries, "did_not_fit": did_not_fit});
        println!(
            "{}",
            serde_json::to_string_pretty(&out).map_err(CliError::other)?
        );
    } else {
        println!(
            "{} rows, {} modelled, {} skipped; GPU profile {} (context {:.1} MiB); bins of {} MiB",
            rows.len(),
            rows.len() - skipped.len(),
            skipped.len(),
            profile.name,
            profile.cuda_context_mib,
            a.bin_mib
        );
        println!();
        println!(
            "{:<24} {:>6} {:>8} {:>8} {:>8} {:>8} {:>7} {:>7} {:>8} {:>7} {:>8}",
            "estimator",
            "rows",
            "mean%",
            "median%",
            "p90%",
            "p95%",
            "<=5%",
            "<=10%",
            "under3%",
            "bin",
            "ub-miss"
        );
        for s in &summaries {
            let m = &s.metrics;
            println!(
                "{:<24} {:>6} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>6.1}% {:>6.1}% {:>7.2}% {:>6.1}% {:>7.2}%",
                s.estimator,
                m.rows,
                m.mean_ape,
                m.median_ape,
                m.p90_ape,
                m.p95_ape,
                100.0 * m.within_5pct,
                100.0 * m.within_10pct,
                100.0 * m.under_3pct,
                100.0 * m.bin_accuracy,
                100.0 * m.bound_misses
            );
        }
        for (m, why) in &skipped {
            println!("skipped line {}: {}: {why}", m.line, m.label);
        }
        if let Some(d) = &did_not_fit {
            println!();
            println!(
                "{} rows did not fit on the GPU (out of memory): the replay's estimate exceeds its {:.0} MiB on {} of them, its upper bound on {} ({} not modelled)",
                d.rows,
                bytes_to_mib(profile.capacity_bytes()),
                d.estimate_over,
                d.bound_over,
                d.skipped
            );
        }
        println!();
        println!(
            "wrote {}, {} and {}",
            a.out_dir.join("rows.csv").display(),
            a.out_dir.join("scatter.svg").display(),
            a.out_dir.join("scatter.png").display()
        );
    }
    Ok(())
}

fn write_rows_csv(
    path: &Path,
    rows: &[Measurement],
    names: &[String],
    outcomes: &[Vec<(usize, Outcome)>],
) -> CliResult {
    let f = File::create(path).map_err(|e| CliError::other(format!("{}: {e}", path.display())))?;
    let mut w = csv::Writer::from_writer(BufWriter::new(f));
    let mut header = vec![
        "line".to_string(),
        "model".into(),
        "batch_size".into(),
        "measured_mib".into(),
    ];
    for n in names {
        header.push(format!("{n}_mib"));
        header.push(format!("{n}_upper_mib"));
        header.push(format!("{n}_error_pct"));
    }
    let io = |e: csv::Error| CliError::other(format!("{}: {e}", path.display()));
    w.write_record(&header).map_err(io)?;
    let mut per_row: Vec<Vec<Option<Outcome>>> = vec![vec![None; names.len()]; rows.len()];
    for (k, o) in outcomes.iter().enumerate() {
        for (ri, x) in o {
            per_row[*ri][k] = Some(*x);
        }
    }
    for (m, cols) in rows.iter().zip(per_row) {
        let mut rec = vec![
            m.line.to_string(),
            m.label.clone(),
            m.batch.to_string(),
            format!("{:.1}", bytes_to_mib(m.measured_bytes)),
        ];
        for c in cols {
            match c {
                Some(x) => {
                    rec.push(format!("{:.1}", bytes_to_mib(x.predicted)));
                    rec.push(format!("{:.1}", bytes_to_mib(x.upper)));
                    rec.push(format!("{:.3}", x.signed_pct()));
                }
                None => rec.extend([String::new(), String::new(), String::new()]),
            }
        }
        w.write_record(&rec).map_err(io)?;
    }
    w.flush()
        .map_err(|e| CliError::other(format!("{}: {e}", path.display())))?;
    Ok(())
}
