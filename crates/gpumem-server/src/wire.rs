//! The daemon's wire types: what clients send and what they get back (JSON).

use std::collections::BTreeMap;

use gpumem_core::job::{Options, RanksNotGpus};
use serde::{Deserialize, Serialize};

use gpumem_core::units::bytes_to_mib;
use gpumem_monitor::GpuReading;

/// A job's life: `queued` → `running` → `finished` | `failed` | `cancelled`; an out-of-memory
/// crash goes to `oom-recovering` (waiting for an exclusive GPU) and back to `running`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum JobState {
    Queued,
    /// Being launched (recorded before the process starts, so a restart can tell).
    Starting,
    Running,
    Finished,
    Failed,
    Cancelled,
    OomRecovering,
}

impl JobState {
    pub fn name(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Starting => "starting",
            JobState::Running => "running",
            JobState::Finished => "finished",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
            JobState::OomRecovering => "oom-recovering",
        }
    }

    pub fn parse(s: &str) -> Option<JobState> {
        [
            JobState::Queued,
            JobState::Starting,
            JobState::Running,
            JobState::Finished,
            JobState::Failed,
            JobState::Cancelled,
            JobState::OomRecovering,
        ]
        .into_iter()
        .find(|j| j.name() == s)
    }

    pub fn is_final(self) -> bool {
        matches!(
            self,
            JobState::Finished | JobState::Failed | JobState::Cancelled
        )
    }

    /// Waiting for GPUs.
    pub fn is_waiting(self) -> bool {
        matches!(self, JobState::Queued | JobState::OomRecovering)
    }
}

/// A submission.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobRequest {
    /// The program and its arguments, run directly (no shell).
    pub command: Vec<String>,
    /// Run `command` (a single string) through `/bin/sh -c` instead.
    #[serde(default)]
    pub shell: bool,
    #[serde(default)]
    pub name: Option<String>,
    /// Working directory (default: the daemon's).
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default = "one")]
    pub gpus: u32,
    /// A model for the estimate (with `batch`): a native spec or a PyTorch reference...
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub batch: Option<u64>,
    /// ...and the training loop around it (optimizer, precision, ...: the CLI's options).
    #[serde(default)]
    pub options: Options,
    /// ...or a trainer's config that states them (its model, micro-batch and options; `model`,
    /// `batch` given here take precedence, `options` fill in what it does not state)...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_config: Option<TrainConfigDoc>,
    /// ...or an explicit memory request per GPU.
    #[serde(default)]
    pub mem_mib: Option<u64>,
    /// Higher runs first; ties in submission order.
    #[serde(default)]
    pub priority: i32,
    /// How long the job is expected to run, in seconds. Only backfilling reads it: a job that
    /// states it may start ahead of a waiting head when it ends before the head's turn (and a
    /// running job that states it lets the head's turn be predicted). Nothing enforces it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_s: Option<f64>,
}

fn one() -> u32 {
    1
}

/// A trainer's config sent with a job: the file's text, read on the daemon as `gpumem estimate
/// --train-config` reads the file (a torchtitan Python config as its dumped JSON: the daemon
/// runs no submitter's code to read a config).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainConfigDoc {
    /// The file's name, as errors name it; its extension tells TOML from YAML and JSON.
    pub file: String,
    pub text: String,
    /// Which trainer's config (`hf-trainer`, `axolotl`, …), where its contents do not tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
}

/// Why a submission is refused (the daemon answers 400 with this line).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    #[error("command must name a program")]
    NoProgram,
    /// `shell` with a command of `args` strings.
    #[error("a shell job's command is one string")]
    ShellArgs { args: usize },
    #[error("command: at most {MAX_ARGS} arguments of {MAX_ARG_BYTES} bytes, no NUL bytes")]
    Command,
    #[error("env: at most {MAX_ENV} variables; names without `=` or NUL")]
    Env,
    #[error("gpus must be between 1 and {max}")]
    Gpus { gpus: u32, max: usize },
    #[error("model and batch go together")]
    ModelWithoutBatch,
    /// A multi-GPU strategy whose world size is not the job's GPU count.
    #[error(transparent)]
    Ranks(#[from] RanksNotGpus),
    #[error("batch and mem_mib must be positive")]
    ZeroSize,
    /// A memory request beyond any GPU (and beyond what bytes can count without wrapping).
    #[error("mem_mib {0} is out of range (1..={MAX_MEM_MIB})")]
    MemMib(u64),
    #[error("expected_s must be a positive number of seconds")]
    ExpectedS(f64),
    /// A name of `bytes` bytes.
    #[error("name: at most {MAX_NAME_BYTES} bytes")]
    Name { bytes: usize },
    /// The working directory cannot be a job's: not absolute, a NUL byte, or not a directory.
    #[error("cwd `{}`: {why}", .cwd.escape_debug())]
    Cwd { cwd: String, why: &'static str },
}

/// Limits a request must respect.
pub const MAX_ARGS: usize = 256;
pub const MAX_ARG_BYTES: usize = 4096;
pub const MAX_ENV: usize = 128;
pub const MAX_NAME_BYTES: usize = 200;
/// Most memory a request or a headroom may name: 16 TiB, far above any GPU, and its bytes fit
/// a u64 (and SQLite's signed integers) with room to add.
pub const MAX_MEM_MIB: u64 = 1 << 24;

impl JobRequest {
    /// Why the request is unacceptable, if it is.
    pub fn validate(&self, max_gpus: usize) -> Result<(), RequestError> {
        if self.command.is_empty() || self.command[0].is_empty() {
            return Err(RequestError::NoProgram);
        }
        if self.shell && self.command.len() != 1 {
            return Err(RequestError::ShellArgs {
                args: self.command.len(),
            });
        }
        if self.command.len() > MAX_ARGS
            || self
                .command
                .iter()
                .any(|a| a.len() > MAX_ARG_BYTES || a.contains('\0'))
        {
            return Err(RequestError::Command);
        }
        if self.env.len() > MAX_ENV
            || self.env.iter().any(|(k, v)| {
                k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0')
            })
        {
            return Err(RequestError::Env);
        }
        if self.gpus == 0 || self.gpus as usize > max_gpus {
            return Err(RequestError::Gpus {
                gpus: self.gpus,
                max: max_gpus,
            });
        }
        if self.train_config.is_none() && self.model.is_some() != self.batch.is_some() {
            return Err(RequestError::ModelWithoutBatch);
        }
        self.options.check_gpus(self.gpus)?;
        if self.batch == Some(0) || self.mem_mib == Some(0) {
            return Err(RequestError::ZeroSize);
        }
        if let Some(m) = self.mem_mib.filter(|&m| m > MAX_MEM_MIB) {
            return Err(RequestError::MemMib(m));
        }
        if let Some(s) = self.expected_s
            && !(s.is_finite() && s > 0.0)
        {
            return Err(RequestError::ExpectedS(s));
        }
        if let Some(n) = &self.name
            && n.len() > MAX_NAME_BYTES
        {
            return Err(RequestError::Name { bytes: n.len() });
        }
        if let Some(cwd) = &self.cwd {
            let bad = |why| {
                Err(RequestError::Cwd {
                    cwd: cwd.chars().take(200).collect(),
                    why,
                })
            };
            if cwd.contains('\0') || cwd.len() > MAX_ARG_BYTES {
                return bad("a path without NUL bytes, at most 4096 bytes");
            }
            if !cwd.starts_with('/') {
                return bad("not an absolute path");
            }
            if !std::path::Path::new(cwd).is_dir() {
                return bad("no such directory");
            }
        }
        Ok(())
    }
}

/// A job as the daemon reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobView {
    pub id: u64,
    /// The uid of the user who submitted it (and whom it runs as).
    pub owner: u32,
    pub state: JobState,
    pub request: JobRequest,
    /// GPUs of the current or last run.
    pub assigned: Vec<u32>,
    pub estimate_mib: Option<f64>,
    pub bound_mib: Option<f64>,
    /// The most memory the monitor saw for it (per GPU).
    pub peak_mib: Option<f64>,
    pub submitted_at: f64,
    pub started_at: Option<f64>,
    pub finished_at: Option<f64>,
    pub exit_code: Option<i32>,
    /// Out-of-memory crashes so far.
    pub retries: u32,
    pub error: Option<String>,
}

/// A GPU as the daemon sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuView {
    pub index: u32,
    pub name: String,
    pub used_mib: f64,
    pub total_mib: f64,
    pub util: f64,
    pub smact: Option<f64>,
    pub smocc: Option<f64>,
    pub dram: Option<f64>,
    pub jobs: Vec<u64>,
}

impl GpuView {
    /// A monitor's reading (bytes) as the API shows it (MiB), with the jobs running there.
    pub fn new(r: &GpuReading, jobs: Vec<u64>) -> GpuView {
        GpuView {
            index: r.index,
            name: r.name.clone(),
            used_mib: bytes_to_mib(r.used_bytes),
            total_mib: bytes_to_mib(r.total_bytes),
            util: r.util,
            smact: r.dcgm.map(|d| d.smact),
            smocc: r.dcgm.map(|d| d.smocc),
            dram: r.dcgm.map(|d| d.dram),
            jobs,
        }
    }
}

/// Response to a submission.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Submitted {
    pub id: u64,
    pub state: JobState,
    pub estimate_mib: Option<f64>,
    pub bound_mib: Option<f64>,
}

/// An error body: `{"error": "one line"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ApiError {
    pub error: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(json: &str) -> JobRequest {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        let cases = [
            (r#"{"command": []}"#, "command must name a program"),
            (
                r#"{"command": ["a", "b"], "shell": true}"#,
                "a shell job's command is one string",
            ),
            (
                r#"{"command": ["a\u0000"]}"#,
                "command: at most 256 arguments of 4096 bytes, no NUL bytes",
            ),
            (
                r#"{"command": ["a"], "env": {"A=B": "1"}}"#,
                "env: at most 128 variables; names without `=` or NUL",
            ),
            (
                r#"{"command": ["a"], "gpus": 3}"#,
                "gpus must be between 1 and 2",
            ),
            (
                r#"{"command": ["a"], "model": "mlp"}"#,
                "model and batch go together",
            ),
            (
                r#"{"command": ["a"], "mem_mib": 0}"#,
                "batch and mem_mib must be positive",
            ),
            (
                r#"{"command": ["a"], "mem_mib": 17592186044416}"#,
                "mem_mib 17592186044416 is out of range (1..=16777216)",
            ),
            (
                r#"{"command": ["a"], "expected_s": -1}"#,
                "expected_s must be a positive number of seconds",
            ),
            (
                r#"{"command": ["a"], "cwd": "/tmp\u0000x"}"#,
                "cwd `/tmp\\0x`: a path without NUL bytes, at most 4096 bytes",
            ),
            (
                r#"{"command": ["a"], "cwd": "relative"}"#,
                "cwd `relative`: not an absolute path",
            ),
            (
                r#"{"command": ["a"], "cwd": "/nonexistent-gpumem-dir"}"#,
                "cwd `/nonexistent-gpumem-dir`: no such directory",
            ),
        ];
        for (json, message) in cases {
            assert_eq!(
                request(json).validate(2).unwrap_err().to_string(),
                message,
                "{json}"
            );
        }
        let long = request(&format!(
            r#"{{"command": ["a"], "name": "{}"}}"#,
            "n".repeat(201)
        ));
        assert_eq!(long.validate(2), Err(RequestError::Name { bytes: 201 }));
        assert_eq!(
            long.validate(2).unwrap_err().to_string(),
            "name: at most 200 bytes"
        );
        assert_eq!(
            request(r#"{"command": ["a"], "gpus": 2, "cwd": "/"}"#).validate(2),
            Ok(())
        );
        // A DDP job's ranks are its GPUs: all placed at once, each with the rank's estimate.
        let ddp = |gpus| {
            request(&format!(
                r#"{{"command": ["torchrun", "train.py"], "gpus": {gpus}, "model": "hf:gpt2", "batch": 8, "options": {{"strategy": {{"kind": "ddp", "world_size": 2, "bucket_cap_mb": 25, "bucket_view": false}}}}}}"#
            ))
        };
        assert_eq!(ddp(2).validate(2), Ok(()));
        assert_eq!(
            ddp(1).validate(2).unwrap_err().to_string(),
            "options.strategy has world_size 2, and a job's ranks are its GPUs: gpus must be 2, not 1"
        );
    }
}
