//! gpumem-dataset: the seed's data pipeline, so anyone can measure their own GPU and stack.
//!
//! - [`generate`]: random [`Job`]s of the MLP, CNN and Transformer families from the seed's
//!   parameter ranges ([`generate::Ranges`], overridable), deterministic for a seed; job lists are
//!   JSON Lines ([`read_jobs`], [`write_jobs`]).
//! - [`collect`]: runs jobs one at a time through a [`collect::Runner`] — the Python workload
//!   runner on a GPU ([`collect::PythonRunner`]) or, without one, [`collect::SimulatedRunner`]
//!   (gpumem's own estimate plus noise, marked synthetic) — while sampling a
//!   [`gpumem_monitor::Monitor`], and appends one row per job to a CSV in the seed's schema plus
//!   gpumem's columns. Resumable: jobs already in the CSV are skipped.

pub mod collect;
pub mod generate;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// One training job to measure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Job {
    pub id: String,
    pub family: String,
    /// A native model spec (`mlp:…`, `cnn:…`, `transformer:…`).
    pub model: String,
    pub batch: u64,
}

/// Reads a job list (one JSON object per line; blank lines ignored).
pub fn read_jobs(path: &Path) -> Result<Vec<Job>, String> {
    let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut jobs = Vec::new();
    for (i, line) in BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|e| format!("{}: line {}: {e}", path.display(), i + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let job: Job = serde_json::from_str(&line).map_err(|e| format!("{}: line {}: {e}", path.display(), i + 1))?;
        gpumem_core::families::ModelSpec::parse(&job.model).map_err(|e| format!("{}: line {}: {e}", path.display(), i + 1))?;
        if job.batch == 0 {
            return Err(format!("{}: line {}: batch must be at least 1", path.display(), i + 1));
        }
        if jobs.iter().any(|j: &Job| j.id == job.id) {
            return Err(format!("{}: line {}: job id `{}` repeats", path.display(), i + 1, job.id));
        }
        jobs.push(job);
    }
    Ok(jobs)
}

/// Writes a job list.
pub fn write_jobs(path: &Path, jobs: &[Job]) -> Result<(), String> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?);
    for j in jobs {
        writeln!(f, "{}", serde_json::to_string(j).map_err(|e| e.to_string())?).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    f.flush().map_err(|e| format!("{}: {e}", path.display()))
}
