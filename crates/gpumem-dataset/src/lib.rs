//! gpumem-dataset: the seed's data pipeline, so anyone can measure their own GPU and stack.
//!
//! - [`generate`]: random [`SyntheticJob`]s of the MLP, CNN and Transformer families from the seed's
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

use gpumem_core::families::SpecError;
use serde::{Deserialize, Serialize};

/// One training job to measure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyntheticJob {
    pub id: String,
    pub family: String,
    /// A native model spec (`mlp:…`, `cnn:…`, `transformer:…`).
    pub model: String,
    pub batch: u64,
}

/// A job list that cannot be read or written. One line: `FILE[: line N]: what is wrong`.
#[derive(Debug, thiserror::Error)]
pub enum JobsError {
    #[error("{file}: {source}")]
    Io {
        file: String,
        source: std::io::Error,
    },
    #[error("{file}: line {line}: {source}")]
    ReadLine {
        file: String,
        line: usize,
        source: std::io::Error,
    },
    #[error("{file}: line {line}: {source}")]
    Json {
        file: String,
        line: usize,
        source: serde_json::Error,
    },
    #[error("{file}: line {line}: {source}")]
    Spec {
        file: String,
        line: usize,
        source: Box<SpecError>,
    },
    #[error("{file}: line {line}: batch must be at least 1")]
    ZeroBatch { file: String, line: usize },
    #[error("{file}: line {line}: job id `{id}` repeats")]
    RepeatedId {
        file: String,
        line: usize,
        id: String,
    },
}

/// Reads a job list (one JSON object per line; blank lines ignored).
pub fn read_jobs(path: &Path) -> Result<Vec<SyntheticJob>, JobsError> {
    let file = || path.display().to_string();
    let f = std::fs::File::open(path).map_err(|source| JobsError::Io {
        file: file(),
        source,
    })?;
    let mut jobs = Vec::new();
    for (i, text) in BufReader::new(f).lines().enumerate() {
        let line = i + 1;
        let text = text.map_err(|source| JobsError::ReadLine {
            file: file(),
            line,
            source,
        })?;
        if text.trim().is_empty() {
            continue;
        }
        let job: SyntheticJob = serde_json::from_str(&text).map_err(|source| JobsError::Json {
            file: file(),
            line,
            source,
        })?;
        gpumem_core::families::ModelSpec::parse(&job.model).map_err(|e| JobsError::Spec {
            file: file(),
            line,
            source: Box::new(e),
        })?;
        if job.batch == 0 {
            return Err(JobsError::ZeroBatch { file: file(), line });
        }
        if jobs.iter().any(|j: &SyntheticJob| j.id == job.id) {
            return Err(JobsError::RepeatedId {
                file: file(),
                line,
                id: job.id,
            });
        }
        jobs.push(job);
    }
    Ok(jobs)
}

/// Writes a job list.
pub fn write_jobs(path: &Path, jobs: &[SyntheticJob]) -> Result<(), JobsError> {
    let io = |source| JobsError::Io {
        file: path.display().to_string(),
        source,
    };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    for j in jobs {
        writeln!(
            f,
            "{}",
            serde_json::to_string(j).expect("a job is strings and a number")
        )
        .map_err(io)?;
    }
    f.flush().map_err(io)
}
