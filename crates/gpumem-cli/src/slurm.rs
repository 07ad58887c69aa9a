//! `gpumem slurm request`: the GPU request a Slurm batch job's `#GPUMEM` directives call for
//! (gpumem-slurm does the work). The Lua hooks in `deploy/slurm/` run it at submission.

use std::io::Read;
use std::path::PathBuf;

use clap::{Args, Subcommand};
use gpumem_slurm::{SlurmConfig, SlurmError, Submission};
use serde_json::json;

use crate::{CliError, CliResult};

#[derive(Args)]
pub struct SlurmArgs {
    #[command(subcommand)]
    command: SlurmCommand,
}

#[derive(Subcommand)]
enum SlurmCommand {
    /// Size a batch job from its #GPUMEM directives and print the gres, constraint and comment
    /// Slurm should record (key=value lines; nothing for a job without directives).
    Request(RequestArgs),
}

#[derive(Args)]
struct RequestArgs {
    /// The batch script (`-`: standard input); its #GPUMEM lines before the first command.
    script: Option<PathBuf>,
    /// The job's comment; `gpumem: key=value …` in it overrides the script's directives.
    #[arg(long)]
    comment: Option<String>,
    /// The job's GRES request so far (its GPU and shard requests are replaced, others kept).
    #[arg(long)]
    gres: Option<String>,
    /// The job's constraint so far (the GPU type's feature is added with &).
    #[arg(long)]
    constraint: Option<String>,
    /// The submission's directory (sbatch's --chdir), where a relative `train_config=` is
    /// read; the current directory by default.
    #[arg(long)]
    chdir: Option<PathBuf>,
    /// The cluster's GPU types (TOML).
    #[arg(
        long,
        env = "GPUMEM_SLURM_CONFIG",
        default_value = "/etc/gpumem/slurm.toml"
    )]
    config: PathBuf,
    /// Never run the PyTorch tracer (the controller side): a PyTorch model is sized by the
    /// estimate its comment carries.
    #[arg(long)]
    no_trace: bool,
    /// Print one JSON object instead of key=value lines.
    #[arg(long)]
    json: bool,
}

pub fn slurm(a: SlurmArgs) -> CliResult {
    let SlurmCommand::Request(r) = a.command;
    let cluster = SlurmConfig::load(&r.config).map_err(error)?;
    let script = match &r.script {
        None => None,
        Some(p) if p.as_os_str() == "-" => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .map_err(|e| CliError::input(format!("standard input: {e}")))?;
            Some(text)
        }
        Some(p) => Some(
            std::fs::read_to_string(p)
                .map_err(|e| CliError::input(format!("{}: {e}", p.display())))?,
        ),
    };
    let sub = Submission {
        script: script.as_deref(),
        comment: r.comment.as_deref(),
        gres: r.gres.as_deref(),
        constraint: r.constraint.as_deref(),
        workdir: r.chdir.as_deref(),
    };
    let request = gpumem_slurm::decide(&sub, &cluster, !r.no_trace).map_err(error)?;
    match (request, r.json) {
        (None, false) => {}
        (None, true) => println!("{}", json!({ "action": "untouched" })),
        (Some(req), false) => print!("{}", req.lines()),
        (Some(req), true) => println!(
            "{}",
            json!({
                "action": "set", "gres": req.gres, "constraint": req.constraint, "comment": req.comment, "gpu": req.gpu,
                "shards": req.shards, "estimate_mib": req.sized.estimate_mib, "upper_bound_mib": req.sized.bound_mib,
            })
        ),
    }
    Ok(())
}

fn error(e: SlurmError) -> CliError {
    match e {
        SlurmError::Directive(_)
        | SlurmError::Stated { .. }
        | SlurmError::ConfigRead { .. }
        | SlurmError::Config { .. } => CliError::input(e),
        SlurmError::Trace { .. } => CliError::Model(e.to_string()),
        SlurmError::Rejected(m) => CliError::Rejected(m),
    }
}
