//! A job file: the jobs of a simulation that are not CARMA's, each described as the daemon
//! takes a submission — a model and batch with its loop's options (a multi-GPU strategy
//! included: a job's ranks are its GPUs), or an explicit memory request per GPU — plus when it
//! arrives, how long it runs alone and, where known, its measured peak per GPU.
//!
//! ```toml
//! [[job]]
//! name = "llama-fsdp"
//! arrival_s = 0
//! work_s = 3600
//! model = "hf:LlamaForCausalLM(num_hidden_layers=16)"
//! batch = 4
//! measured_mib = 30500            # optional: the truth that decides crashes
//! [job.options]
//! precision = "bf16"
//! seq_len = 2048
//! strategy = { kind = "fsdp", world_size = 4 }
//! ```

use std::path::Path;

use gpumem_core::job::{Options, RanksNotGpus, TorchOnly, is_native_spec};
use gpumem_place::MIB;
use serde::Deserialize;

/// The largest memory figure a job may state, MiB (16 TiB: beyond any GPU, and bytes of it
/// never wrap).
pub const MAX_MIB: u64 = 1 << 24;

/// One job of a job file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSpec {
    /// Default: `job N`, N its place in the file from 1.
    #[serde(default)]
    pub name: Option<String>,
    pub arrival_s: f64,
    /// Run time alone on its GPUs.
    pub work_s: f64,
    /// Default: the strategy's world size, else 1.
    #[serde(default)]
    pub gpus: Option<u32>,
    /// A model for gpumem to estimate (with `batch`; per rank under a strategy)...
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub batch: Option<u64>,
    /// ...and the loop around it, as the daemon's API and `gpumem submit`'s job files state it.
    #[serde(default)]
    pub options: Options,
    /// ...or a stated memory request per GPU, which wins over the model (the daemon's rule).
    #[serde(default)]
    pub mem_mib: Option<u64>,
    /// Measured peak per GPU as nvidia-smi shows it. Without it the job's truth is what it
    /// states (`mem_mib`), else gpumem's estimate.
    #[serde(default)]
    pub measured_mib: Option<u64>,
    #[serde(default)]
    pub priority: i32,
}

impl JobSpec {
    /// The GPUs the job runs on: all its ranks at once.
    pub fn gpus(&self) -> u32 {
        self.gpus
            .or(self.options.strategy.map(|s| s.world_size()))
            .unwrap_or(1)
    }

    /// The model gpumem estimates for it, with its batch; `None` where the job states its
    /// memory or names no model.
    pub fn model(&self) -> Option<(&str, u64)> {
        if self.mem_mib.is_some() {
            return None;
        }
        Some((self.model.as_deref()?, self.batch?))
    }

    pub fn stated_bytes(&self) -> Option<u64> {
        self.mem_mib.map(|m| m * MIB)
    }

    pub fn measured_bytes(&self) -> Option<u64> {
        self.measured_mib.map(|m| m * MIB)
    }

    fn check(&self) -> Result<(), JobProblem> {
        if self.model.is_some() != self.batch.is_some() {
            return Err(JobProblem::ModelWithoutBatch);
        }
        if self.model.is_none() && self.mem_mib.is_none() && self.measured_mib.is_none() {
            return Err(JobProblem::NoMemory);
        }
        if self.batch == Some(0) {
            return Err(JobProblem::ZeroBatch);
        }
        for (what, mib) in [
            ("mem_mib", self.mem_mib),
            ("measured_mib", self.measured_mib),
        ] {
            if let Some(m) = mib.filter(|&m| m == 0 || m > MAX_MIB) {
                return Err(JobProblem::Mib { what, mib: m });
            }
        }
        // The options checked themselves as they were read; what a native model takes of them
        // is checked here, where the file and the job can be named.
        if let Some(gpus) = self.gpus {
            self.options.check_gpus(gpus)?;
        }
        if self.model.as_deref().is_some_and(is_native_spec) {
            self.options.check_native()?;
        }
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JobFile {
    job: Vec<JobSpec>,
}

/// Why a job file could not be read: the file, and the job (numbered from 1) where it is a
/// job's fault.
#[derive(Debug, thiserror::Error)]
pub enum JobsError {
    #[error("{file}: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    /// Not TOML of a job file's shape (`line` where toml names one).
    #[error("{file}: {}", toml_message(*line, source))]
    Toml {
        file: String,
        line: Option<usize>,
        source: Box<toml::de::Error>,
    },
    #[error("{file}: no [[job]] tables")]
    Empty { file: String },
    #[error("{file}: job {index} (`{name}`): {problem}")]
    Job {
        file: String,
        index: usize,
        name: String,
        problem: JobProblem,
    },
}

/// What is wrong with one job.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JobProblem {
    #[error("model and batch go together")]
    ModelWithoutBatch,
    #[error(
        "nothing says how much memory it takes: give a model and batch, mem_mib or measured_mib"
    )]
    NoMemory,
    #[error("batch must be positive")]
    ZeroBatch,
    #[error("{what} {mib} is out of range (1..={MAX_MIB})")]
    Mib { what: &'static str, mib: u64 },
    #[error(transparent)]
    Ranks(#[from] RanksNotGpus),
    #[error(transparent)]
    TorchOnly(#[from] TorchOnly),
}

/// toml's message on one line, after the line it names.
fn toml_message(line: Option<usize>, e: &toml::de::Error) -> String {
    let message = e.message().trim_end().replace('\n', " ");
    line.map_or(message.clone(), |l| format!("line {l}: {message}"))
}

/// Reads and checks a job file; the jobs in file order, each named.
pub fn load_jobs(path: &Path) -> Result<Vec<JobSpec>, JobsError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| JobsError::Read {
        file: file.clone(),
        source,
    })?;
    parse_jobs(&text, &file)
}

/// [`load_jobs`] of a file's text; `file` names it in errors.
pub fn parse_jobs(text: &str, file: &str) -> Result<Vec<JobSpec>, JobsError> {
    let parsed: JobFile = toml::from_str(text).map_err(|e| {
        let line = e
            .span()
            .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
        JobsError::Toml {
            file: file.into(),
            line,
            source: Box::new(e),
        }
    })?;
    if parsed.job.is_empty() {
        return Err(JobsError::Empty { file: file.into() });
    }
    parsed
        .job
        .into_iter()
        .enumerate()
        .map(|(i, mut job)| {
            let name = job
                .name
                .get_or_insert_with(|| format!("job {}", i + 1))
                .clone();
            job.check().map_err(|problem| JobsError::Job {
                file: file.into(),
                index: i + 1,
                name,
                problem,
            })?;
            Ok(job)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use gpumem_core::job::Precision;
    use gpumem_core::job::{Strategy, Zero};

    use super::*;

    #[test]
    fn a_job_file_describes_jobs_as_the_daemon_takes_them() {
        let text = r#"
[[job]]
arrival_s = 0
work_s = 3600
model = "hf:gpt2"
batch = 4
measured_mib = 30500
[job.options]
precision = "bf16"
seq_len = 1024
strategy = { kind = "zero", stage = 3, world_size = 4 }

[[job]]
name = "stated"
arrival_s = 10
work_s = 60
gpus = 2
mem_mib = 2048
model = "mlp:1000x2"
batch = 8
"#;
        let jobs = parse_jobs(text, "jobs.toml").unwrap();
        assert_eq!(jobs[0].name.as_deref(), Some("job 1"));
        assert_eq!(jobs[0].gpus(), 4, "a strategy's ranks are its GPUs");
        assert_eq!(jobs[0].options.precision, Precision::Bf16);
        assert_eq!(
            jobs[0].options.strategy,
            Some(Strategy::zero(gpumem_core::job::ZeroStage::Three, 4, Zero::default()).unwrap()),
            "DeepSpeed's defaults where the table is silent"
        );
        assert_eq!(jobs[0].model(), Some(("hf:gpt2", 4)));
        assert_eq!(jobs[0].measured_bytes(), Some(30500 * MIB));
        assert_eq!(
            (jobs[1].gpus(), jobs[1].model(), jobs[1].stated_bytes()),
            (2, None, Some(2048 * MIB)),
            "a stated request wins over the model"
        );
    }

    #[test]
    fn bad_jobs_are_named_with_what_is_wrong() {
        let err = |text: &str| parse_jobs(text, "j.toml").unwrap_err().to_string();
        let job = |extra: &str| format!("[[job]]\narrival_s = 0\nwork_s = 1\n{extra}\n");
        assert_eq!(
            err(&job("model = \"hf:gpt2\"")),
            "j.toml: job 1 (`job 1`): model and batch go together"
        );
        assert!(err(&job("")).contains("nothing says how much memory"));
        assert!(err(&job("name = \"x\"\ngpus = 2\nmem_mib = 1\n[job.options]\nstrategy = { kind = \"ddp\", world_size = 4 }")).ends_with("job 1 (`x`): options.strategy has world_size 4, and a job's ranks are its GPUs: gpus must be 4, not 2"));
        assert!(err(&job("mem_mib = 0")).contains("mem_mib 0 is out of range"));
        let e = err(&job("mem_mib = 1\n[job.options]\ngrad_accum = 0"));
        assert!(
            e.starts_with("j.toml: line ")
                && e.contains("grad_accum (--grad-accum) must be at least 1"),
            "{e}"
        );
        assert!(
            err(&job("mem_mib = 1\ncolour = 3"))
                .starts_with("j.toml: line 5: unknown field `colour`, expected one of `name`")
        );
        assert_eq!(err(""), "j.toml: line 1: missing field `job`");
        assert_eq!(err("job = []"), "j.toml: no [[job]] tables");
    }
}
