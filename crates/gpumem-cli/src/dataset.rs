//! `gpumem dataset`: generate synthetic training jobs and measure them.

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Args, Subcommand};
use gpumem_core::profile;
use gpumem_dataset::collect::{CollectConfig, PythonRunner, Runner, SimulatedRunner, collect};
use gpumem_dataset::generate::{Family, Ranges, generate};
use gpumem_dataset::{read_jobs, write_jobs};
use gpumem_monitor::{FakeMonitor, Monitor, NvmlMonitor};
use gpumem_torch::TorchTracer;
use indicatif::{ProgressBar, ProgressStyle};

use crate::{CliError, CliResult};

#[derive(Args)]
pub struct DatasetArgs {
    #[command(subcommand)]
    command: DatasetCommand,
}

#[derive(Subcommand)]
enum DatasetCommand {
    /// Random jobs of one family from the seed's ranges, one JSON object per line.
    Generate(GenerateArgs),
    /// Run jobs one at a time and record their peak memory and utilization (resumable).
    Collect(CollectArgs),
}

#[derive(Args)]
struct GenerateArgs {
    /// mlp, cnn or transformer.
    #[arg(long)]
    family: String,
    #[arg(long)]
    count: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// A TOML file overriding any of the seed's ranges (see docs/dataset.md).
    #[arg(long)]
    ranges: Option<PathBuf>,
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct CollectArgs {
    /// A job list from `gpumem dataset generate`.
    jobs: PathBuf,
    /// The GPU to run on (its index, as nvidia-smi numbers it).
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    /// No GPU: simulate one of this built-in profile (memory from gpumem's estimate plus noise,
    /// marked synthetic).
    #[arg(long)]
    fake_gpu: Option<String>,
    /// Seconds each job trains (the seed: about 60).
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// Kill a job still running after this many seconds.
    #[arg(long, default_value_t = 300.0)]
    timeout: f64,
    /// Monitor samples per second (at least 10).
    #[arg(long, default_value_t = 10.0)]
    sample_hz: f64,
    /// Noise seed of --fake-gpu.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The CSV to append to (created with a header if new).
    #[arg(long)]
    out: PathBuf,
}

pub fn run(a: DatasetArgs) -> CliResult {
    match a.command {
        DatasetCommand::Generate(g) => generate_cmd(g),
        DatasetCommand::Collect(c) => collect_cmd(c),
    }
}

fn generate_cmd(a: GenerateArgs) -> CliResult {
    let family = Family::parse(&a.family).map_err(CliError::input)?;
    if a.count == 0 {
        return Err(CliError::input("--count must be at least 1"));
    }
    let ranges = match &a.ranges {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| CliError::input(format!("{}: {e}", p.display())))?;
            Ranges::from_toml(&text)
                .map_err(|e| CliError::input(format!("{}: {e}", p.display())))?
        }
        None => Ranges::default(),
    };
    let jobs = generate(family, a.count, a.seed, &ranges).map_err(CliError::input)?;
    write_jobs(&a.out, &jobs).map_err(CliError::other)?;
    println!(
        "wrote {} {} jobs to {}",
        jobs.len(),
        family.name(),
        a.out.display()
    );
    Ok(())
}

fn collect_cmd(a: CollectArgs) -> CliResult {
    if !(a.seconds.is_finite() && a.seconds >= 0.0 && a.timeout.is_finite() && a.timeout > 0.0) {
        return Err(CliError::input(
            "--seconds must be non-negative and --timeout positive",
        ));
    }
    if !(a.sample_hz.is_finite() && a.sample_hz >= 10.0) {
        return Err(CliError::input("--sample-hz must be at least 10"));
    }
    let jobs = read_jobs(&a.jobs).map_err(CliError::input)?;
    let (mut runner, mut monitor, gpu): (Box<dyn Runner>, Box<dyn Monitor>, u32) = match &a.fake_gpu
    {
        Some(name) => {
            let p = profile::builtin(name).map_err(CliError::input)?;
            let fake = FakeMonitor::new(1, &p.display, p.capacity_bytes());
            let runner = SimulatedRunner {
                profile: p,
                gpus: fake.gpus.clone(),
                seconds: a.seconds.min(1.0),
                seed: a.seed,
            };
            (Box::new(runner), Box::new(fake), 0)
        }
        None => {
            let monitor = NvmlMonitor::new(Some(&[a.gpu]), 100)
                .map_err(|e| CliError::other(format!("{e} (no GPU here? use --fake-gpu NAME)")))?;
            let runner = PythonRunner {
                tracer: TorchTracer::from_env(),
                seconds: a.seconds,
                device: "cuda:0".into(),
            };
            (Box::new(runner), Box::new(monitor), a.gpu)
        }
    };
    let bar = if std::io::stderr().is_terminal() {
        ProgressBar::new(jobs.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} {eta}").expect("valid template"),
    );
    let cfg = CollectConfig {
        gpu,
        out: a.out.clone(),
        timeout_s: a.timeout,
        sample_hz: a.sample_hz,
    };
    let summary = collect(
        &jobs,
        runner.as_mut(),
        monitor.as_mut(),
        &cfg,
        |done, _, id, status| {
            bar.set_position(done as u64);
            bar.set_message(format!("{id}: {status}"));
        },
    )
    .map_err(CliError::input)?;
    bar.finish_and_clear();
    println!(
        "ran {} jobs ({} ok), skipped {} already in {}{}",
        summary.ran,
        summary.ok,
        summary.skipped,
        a.out.display(),
        if a.fake_gpu.is_some() {
            " (synthetic: fake GPU)"
        } else {
            ""
        }
    );
    Ok(())
}
