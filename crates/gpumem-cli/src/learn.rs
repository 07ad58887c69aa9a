//! `gpumem learn`: train, cross-validate and apply learned estimators.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use gpumem_core::profile::GpuProfile;
use gpumem_learn::kfold::{Report, kfold};
use gpumem_learn::{Kind, LearnedModel, Sample, Spec, Target, data};
use indicatif::{ProgressBar, ProgressStyle};

use crate::args::GpuChoice;
use crate::{CliError, CliResult};

#[derive(Args)]
pub struct LearnArgs {
    #[command(subcommand)]
    command: LearnCommand,
}

#[derive(Subcommand)]
enum LearnCommand {
    /// Train a model on a dataset and write it to a file.
    Train(TrainArgs),
    /// k-fold cross validation: the fold table, or JSON.
    Kfold(KfoldArgs),
    /// Predict every row of a dataset with a trained model.
    Predict(PredictArgs),
}

/// What to learn.
#[derive(Args, Clone)]
struct LearnSpec {
    /// memory, smact, smocc, gract, dram or fp32.
    #[arg(long, default_value = "memory")]
    target: String,
    /// mlp or transformer (memory: GPUMemNet's bin classifier on the seed's features; utilization:
    /// a regressor of the physical model's residual), or gbt (memory: the hybrid replay +
    /// residual estimator with a conformal bound; utilization: physical + boosted residual).
    #[arg(long, default_value = "gbt")]
    model: String,
    /// GPUMemNet's memory bin width, MiB (the seed: 1024 for MLPs, 8192 for CNNs/Transformers).
    #[arg(long, default_value_t = 1024.0)]
    bins: f64,
    /// Ensemble members (networks of different depths; default 3 MLPs or 1 Transformer).
    #[arg(long)]
    members: Option<usize>,
    /// Training epochs per network (default 150 for MLPs, 1500 for Transformers).
    #[arg(long)]
    epochs: Option<usize>,
    /// AdamW learning rate of the networks (default 0.002 for MLPs, 0.003 for Transformers).
    #[arg(long)]
    lr: Option<f64>,
    /// Boosted trees.
    #[arg(long, default_value_t = 300)]
    trees: usize,
    /// The hybrid upper bound's stated miss rate.
    #[arg(long, default_value_t = 0.01)]
    miss_rate: f64,
    /// Seed for initialisation, shuffles and folds.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[command(flatten)]
    gpu: GpuChoice,
}

impl LearnSpec {
    fn spec(&self) -> CliResult<Spec> {
        let mut s = Spec::new(
            Target::parse(&self.target).map_err(CliError::input)?,
            Kind::parse(&self.model).map_err(CliError::input)?,
        );
        if !(self.bins >= 1.0 && self.bins.is_finite()) {
            return Err(CliError::input("--bins must be at least 1 MiB"));
        }
        if !(self.miss_rate > 0.0 && self.miss_rate < 1.0) {
            return Err(CliError::input("--miss-rate must be between 0 and 1"));
        }
        if self.members == Some(0) || self.epochs == Some(0) || self.trees == 0 {
            return Err(CliError::input(
                "--members, --epochs and --trees must be at least 1",
            ));
        }
        if self.lr.is_some_and(|lr| !(lr > 0.0 && lr < 1.0)) {
            return Err(CliError::input("--lr must be between 0 and 1"));
        }
        s.net.lr = self.lr.unwrap_or(s.net.lr);
        s.bin_mib = self.bins;
        s.members = self.members.unwrap_or(s.members);
        s.net.epochs = self.epochs.unwrap_or(s.net.epochs);
        s.net.seed = self.seed;
        s.gbt.trees = self.trees;
        s.miss_rate = self.miss_rate;
        Ok(s)
    }
}

#[derive(Args)]
struct TrainArgs {
    /// Dataset CSV (the seed's MLP schema, or model,batch_size,measured_mib with native specs).
    dataset: PathBuf,
    #[command(flatten)]
    spec: LearnSpec,
    /// Where to write the model (JSON).
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct KfoldArgs {
    dataset: PathBuf,
    #[command(flatten)]
    spec: LearnSpec,
    #[arg(long, default_value_t = 3)]
    folds: usize,
    /// Print JSON (per-fold scores).
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct PredictArgs {
    /// A model written by `gpumem learn train`.
    model: PathBuf,
    dataset: PathBuf,
    #[command(flatten)]
    gpu: GpuChoice,
    /// Where to write the rows with a `predicted` column (and `upper` for hybrid models).
    #[arg(long)]
    out: PathBuf,
}

pub fn run(a: LearnArgs) -> CliResult {
    match a.command {
        LearnCommand::Train(t) => train_cmd(t),
        LearnCommand::Kfold(k) => kfold_cmd(k),
        LearnCommand::Predict(p) => predict_cmd(p),
    }
}

/// A progress bar on a terminal; silent otherwise.
fn bar(len: u64, what: &str) -> ProgressBar {
    let bar = if std::io::stderr().is_terminal() {
        ProgressBar::new(len)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template(&format!("{what} {{bar:30}} {{pos}}/{{len}} {{msg}}"))
            .expect("valid template"),
    );
    bar
}

pub fn load_dataset(path: &Path, profile: &GpuProfile) -> CliResult<Vec<Sample>> {
    let pb = bar(0, "features");
    let rows = data::load(path, profile, |done, total| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
    })
    .map_err(CliError::input)?;
    pb.finish_and_clear();
    Ok(rows)
}

fn with_target<'a>(rows: &'a [Sample], t: Target, path: &Path) -> CliResult<Vec<&'a Sample>> {
    let keep: Vec<&Sample> = rows.iter().filter(|s| s.target(t).is_some()).collect();
    if keep.is_empty() {
        return Err(CliError::input(format!(
            "{}: no rows measure {}",
            path.display(),
            t.name()
        )));
    }
    Ok(keep)
}

fn spinner() -> ProgressBar {
    let pb = if std::io::stderr().is_terminal() {
        ProgressBar::new_spinner()
    } else {
        ProgressBar::hidden()
    };
    pb.set_style(
        ProgressStyle::with_template("{spinner} {elapsed} {msg}").expect("valid template"),
    );
    pb
}

fn train_cmd(a: TrainArgs) -> CliResult {
    let spec = a.spec.spec()?;
    let profile = a.spec.gpu.load()?;
    let rows = load_dataset(&a.dataset, &profile)?;
    let rows = with_target(&rows, spec.target, &a.dataset)?;
    let pb = spinner();
    let started = std::time::Instant::now();
    let model = gpumem_learn::model::train(&rows, &spec, &profile.name, &mut |m| pb.set_message(m))
        .map_err(CliError::input)?;
    pb.finish_and_clear();
    std::fs::write(&a.out, model.to_json().map_err(CliError::other)?)
        .map_err(|e| CliError::other(format!("{}: {e}", a.out.display())))?;
    println!(
        "trained {} {} on {} rows in {:.1} s; wrote {}",
        a.spec.model,
        spec.target.name(),
        rows.len(),
        started.elapsed().as_secs_f64(),
        a.out.display()
    );
    Ok(())
}

fn kfold_cmd(a: KfoldArgs) -> CliResult {
    let spec = a.spec.spec()?;
    let profile = a.spec.gpu.load()?;
    let rows = load_dataset(&a.dataset, &profile)?;
    let rows = with_target(&rows, spec.target, &a.dataset)?;
    let pb = spinner();
    let report = kfold(
        &rows,
        &spec,
        a.folds,
        a.spec.seed,
        &profile.name,
        &mut |m| pb.set_message(m),
    )
    .map_err(CliError::input)?;
    pb.finish_and_clear();
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).map_err(CliError::other)?
        );
    } else {
        print_report(&report, spec.target);
    }
    Ok(())
}

fn print_report(r: &Report, t: Target) {
    let unit = if t == Target::Memory { "MiB" } else { "" };
    println!(
        "{}-fold cross validation: target {}, model {}",
        r.folds.len(),
        r.target,
        r.model
    );
    for f in &r.folds {
        let mut line = format!(
            "fold {}: {} rows, MAE {:.4}{unit} (gpumem alone {:.4}{unit})",
            f.fold, f.rows, f.mae, f.baseline_mae
        );
        if let Some(c) = &f.classification {
            line += &format!(
                ", accuracy {:.4}, precision {:.4}, recall {:.4}, F1 {:.4}, too-low bin {:.2}%",
                c.accuracy,
                c.precision,
                c.recall,
                c.f1,
                c.too_low * 100.0
            );
        }
        if let (Some(m), Some(b), Some(miss)) =
            (f.median_ape, f.baseline_median_ape, f.bound_miss_rate)
        {
            line += &format!(
                ", median APE {m:.2}% (replay {b:.2}%), bound misses {:.2}%",
                miss * 100.0
            );
        }
        println!("{line}");
    }
    let mean = |f: &dyn Fn(&gpumem_learn::kfold::FoldScore) -> Option<f64>| {
        r.mean(f).map_or("-".into(), |v| format!("{v:.4}"))
    };
    println!(
        "mean: MAE {} (gpumem alone {}), accuracy {}, too-low {}, median APE {}, bound misses {}",
        mean(&|f| Some(f.mae)),
        mean(&|f| Some(f.baseline_mae)),
        mean(&|f| f.classification.as_ref().map(|c| c.accuracy)),
        mean(&|f| f.classification.as_ref().map(|c| c.too_low)),
        mean(&|f| f.median_ape),
        mean(&|f| f.bound_miss_rate)
    );
    if let Some(c) = r
        .folds
        .iter()
        .filter_map(|f| f.classification.as_ref())
        .next()
    {
        let n = c.confusion.len();
        let mut total = vec![vec![0u64; n]; n];
        for f in r.folds.iter().filter_map(|f| f.classification.as_ref()) {
            for (i, row) in f.confusion.iter().enumerate().take(n) {
                for (j, v) in row.iter().enumerate().take(n) {
                    total[i][j] += v;
                }
            }
        }
        println!("confusion (rows: true bin, columns: predicted bin), all folds:");
        for (i, row) in total.iter().enumerate() {
            if row.iter().any(|&v| v > 0) {
                println!(
                    "  bin {i:>2}: {}",
                    row.iter().map(|v| format!("{v:>5}")).collect::<String>()
                );
            }
        }
    }
}

fn predict_cmd(a: PredictArgs) -> CliResult {
    let model = LearnedModel::read(&a.model).map_err(CliError::input)?;
    let profile = a.gpu.load()?;
    let rows = load_dataset(&a.dataset, &profile)?;
    let refs: Vec<&Sample> = rows.iter().collect();
    let pred = model.predict(&refs).map_err(CliError::input)?;
    let mut rdr = csv::Reader::from_path(&a.dataset)
        .map_err(|e| CliError::input(format!("{}: {e}", a.dataset.display())))?;
    let mut w = csv::Writer::from_path(&a.out)
        .map_err(|e| CliError::other(format!("{}: {e}", a.out.display())))?;
    let mut header = rdr.headers().map_err(CliError::input)?.clone();
    header.push_field("predicted");
    let bounded = pred.iter().any(|p| p.upper.is_some());
    if bounded {
        header.push_field("upper");
    }
    w.write_record(&header).map_err(CliError::other)?;
    for ((rec, p), s) in rdr.records().zip(&pred).zip(&rows) {
        let mut rec = rec.map_err(|e| {
            CliError::input(format!("{} line {}: {e}", a.dataset.display(), s.line))
        })?;
        rec.push_field(&format!("{:.6}", p.value));
        if bounded {
            rec.push_field(&p.upper.map_or(String::new(), |u| format!("{u:.6}")));
        }
        w.write_record(&rec).map_err(CliError::other)?;
    }
    w.flush().map_err(CliError::other)?;
    println!(
        "predicted {} rows ({} of {}); wrote {}",
        pred.len(),
        model.target.name(),
        a.dataset.display(),
        a.out.display()
    );
    Ok(())
}
