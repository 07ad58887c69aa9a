//! The `gpumem` command: estimate a training job's GPU memory before it runs.
//!
//! Subcommands: `estimate`, `max-batch`, `gpus`, `calibrate`, `eval`, `trace`, `simulate`, `learn`, `dataset`, and the daemon's `serve`, `submit`, `jobs`, `job`,
//! `cancel`, `load-test`. Expected
//! failures (bad input, unknown GPU, malformed files) print one line on stderr and exit with 2;
//! a PyTorch model that cannot be traced exits with 3; other failures (I/O while writing) exit
//! with 1. See docs/cli.md.

mod args;
mod calibrate;
mod client;
mod dataset;
mod diff;
mod estimate;
mod eval;
mod gpus;
mod k8s;
mod learn;
mod max_batch;
mod plan;
mod plot;
mod probe;
mod ray;
mod run;
mod serve;
mod simulate;
mod slurm;
mod trace;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Exit code for bad input of any kind.
pub const EXIT_BAD_INPUT: u8 = 2;
/// Exit code for other failures.
pub const EXIT_FAILURE: u8 = 1;
/// Exit code when a PyTorch model cannot be traced (no torch, or the model itself failed).
pub const EXIT_MODEL: u8 = 3;
/// A job gpumem cannot place by its estimate (`gpumem slurm request`).
pub const EXIT_REJECTED: u8 = 4;

/// An error with its exit code.
#[derive(Debug)]
pub enum CliError {
    /// The user's input is wrong (exit 2).
    Input(String),
    /// Something else failed (exit 1).
    Other(String),
    /// A PyTorch model could not be traced: Python/torch missing, or the model failed (exit 3).
    Model(String),
    /// The job cannot be placed by its estimate: `gpumem slurm request` refuses it (exit 4).
    Rejected(String),
}

impl CliError {
    pub fn input(e: impl std::fmt::Display) -> Self {
        CliError::Input(e.to_string())
    }
    pub fn other(e: impl std::fmt::Display) -> Self {
        CliError::Other(e.to_string())
    }
}

pub type CliResult<T = ()> = Result<T, CliError>;

#[derive(Parser)]
#[command(
    name = "gpumem",
    version,
    about = "How much GPU memory will this training job take? Answered before it touches a GPU."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Estimate peak GPU memory (as nvidia-smi shows it) with a breakdown and an upper bound.
    Estimate(estimate::EstimateArgs),
    /// Run your unmodified training script with CUDA stood in for, and estimate its steps:
    /// gpumem run [--steps 3] [--gpu NAME] -- python train.py ARGS…
    Run(run::RunArgs),
    /// Find the largest batch size whose upper bound fits on the GPU.
    MaxBatch(max_batch::MaxBatchArgs),
    /// The fastest setup that fits one GPU: precision × checkpointing × micro-batch (×
    /// accumulation to a global batch), with why the others lose.
    Plan(plan::PlanArgs),
    /// What a Ray task training this job should ask for on each GPU type: num_gpus and a
    /// gpu_memory_mib resource, from the upper bound.
    RayResources(ray::RayArgs),
    /// Slurm: a batch job's gres/shard request and comment from its #GPUMEM directives (called
    /// by the cli_filter and job_submit Lua hooks in deploy/slurm).
    Slurm(slurm::SlurmArgs),
    /// Kubernetes: a mutating admission webhook writing HAMi's, Volcano's or KAI's GPU-memory
    /// request from a pod's gpumem.io annotations.
    K8s(k8s::K8sArgs),
    /// List the built-in GPU profiles.
    Gpus(gpus::GpusArgs),
    /// Fit a GPU profile's fixed costs from measured runs.
    Calibrate(calibrate::CalibrateArgs),
    /// Score every estimator against measured runs.
    Eval(eval::EvalArgs),
    /// Write the training-step trace of a model.
    Trace(trace::TraceArgs),
    Simulate(simulate::SimulateArgs),
    Learn(learn::LearnArgs),
    Dataset(dataset::DatasetArgs),
    /// Hold a job's allocation sequence against PyTorch's memory snapshot of it.
    Diff(diff::DiffArgs),
    /// Measure this GPU's stack (context, cuBLAS and cuDNN workspaces) into a profile.
    Probe(probe::ProbeArgs),
    /// Run the resource manager daemon.
    Serve(serve::ServeArgs),
    /// Submit a training job to the daemon.
    Submit(client::SubmitArgs),
    /// List the daemon's jobs.
    Jobs(client::JobsArgs),
    /// One job of the daemon (or its log).
    Job(client::JobShowArgs),
    /// Cancel a job (SIGTERM, then SIGKILL after the grace period).
    Cancel(client::CancelArgs),
    /// Submit many small jobs to a daemon and report throughput and latency.
    LoadTest(client::LoadTestArgs),
    /// Internal: supervise one job run (used by the daemon).
    #[command(name = "_supervise", hide = true)]
    Supervise(SuperviseArgs),
}

#[derive(clap::Args)]
struct SuperviseArgs {
    dir: std::path::PathBuf,
    /// Track the run by its process group only (no cgroup of its own).
    #[arg(long)]
    no_cgroup: bool,
    /// Run the program as this uid (with --gid; the daemon runs as root).
    #[arg(long, requires = "gid")]
    uid: Option<u32>,
    #[arg(long, requires = "uid")]
    gid: Option<u32>,
    /// Start the program in this directory (entered as that user).
    #[arg(long)]
    cwd: Option<std::path::PathBuf>,
    #[arg(last = true, required = true)]
    argv: Vec<String>,
}

impl SuperviseArgs {
    fn supervision(&self) -> gpumem_server::launcher::Supervision {
        let run_as = self
            .uid
            .zip(self.gid)
            .map(|(uid, gid)| gpumem_server::identity::User { uid, gid });
        gpumem_server::launcher::Supervision {
            cgroup: !self.no_cgroup,
            run_as,
            cwd: self.cwd.clone(),
        }
    }
}

fn main() -> ExitCode {
    // candle spreads every matmul over all cores; gpumem's networks are tiny, so the threads cost
    // more than they give (GPUMemNet ensemble inference: 0.5 ms threaded, 26 µs on one thread).
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: first statement of main, before any thread exists.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    // `gpumem ... | head` closes stdout early: that is not an error worth a panic message.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .unwrap_or("");
        if msg.contains("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(0);
        }
        default_hook(info);
    }));
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Estimate(a) => estimate::estimate(a),
        Command::Run(a) => run::run(a),
        Command::MaxBatch(a) => max_batch::max_batch(a),
        Command::Plan(a) => plan::plan(a),
        Command::RayResources(a) => ray::ray_resources(a),
        Command::K8s(a) => k8s::k8s(a),
        Command::Slurm(a) => slurm::slurm(a),
        Command::Gpus(a) => gpus::gpus(a),
        Command::Calibrate(a) => calibrate::calibrate(a),
        Command::Eval(a) => eval::eval(a),
        Command::Trace(a) => trace::trace(a),
        Command::Simulate(a) => simulate::run(a),
        Command::Learn(a) => learn::run(a),
        Command::Dataset(a) => dataset::run(a),
        Command::Probe(a) => probe::probe(a),
        Command::Diff(a) => diff::run(a),
        Command::Serve(a) => serve::serve(a),
        Command::Submit(a) => client::submit(a),
        Command::Jobs(a) => client::jobs(a),
        Command::Job(a) => client::job(a),
        Command::Cancel(a) => client::cancel(a),
        Command::LoadTest(a) => client::load_test(a),
        Command::Supervise(a) => {
            return ExitCode::from(
                gpumem_server::launcher::supervise(&a.dir, &a.argv, &a.supervision()).clamp(0, 255)
                    as u8,
            );
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError::Input(m)) => {
            eprintln!("error: {m}");
            ExitCode::from(EXIT_BAD_INPUT)
        }
        Err(CliError::Other(m)) => {
            eprintln!("error: {m}");
            ExitCode::from(EXIT_FAILURE)
        }
        Err(CliError::Model(m)) => {
            eprintln!("error: {m}");
            ExitCode::from(EXIT_MODEL)
        }
        Err(CliError::Rejected(m)) => {
            eprintln!("error: {m}");
            ExitCode::from(EXIT_REJECTED)
        }
    }
}
