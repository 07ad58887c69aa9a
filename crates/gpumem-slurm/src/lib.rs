//! gpumem inside Slurm: a batch job's GPU request from the model it states.
//!
//! A job states its model in its batch script, in `#GPUMEM` lines read like `#SBATCH` ones
//! (before the first command), or in its comment (`--comment "gpumem: model=… batch=…"`, which
//! overrides the script key by key):
//!
//! ```text
//! #GPUMEM model=torchvision:resnet50 batch=64 precision=amp-bf16 optimizer=adamw
//! #GPUMEM train_config=axolotl.yaml world_size=1
//! ```
//!
//! A trainer config (`train_config=FILE`, relative to the submission's directory, kind detected
//! or `train_config_kind=…`) states the rest as `gpumem estimate --train-config` reads it; its
//! model and micro-batch stand where the directives give none.
//!
//! [`decide`] sizes it on each GPU type of the [`SlurmConfig`] and answers the [`Request`] Slurm
//! should record: a `gres/shard` count on the smallest GPU type whose memory holds the upper
//! bound (with that type's node feature as a constraint where the cluster names one), and the
//! job's comment with the estimate appended — or [`SlurmError::Rejected`], a one-line reason, for
//! a job no GPU here holds. `deploy/slurm/cli_filter.lua` (client side, may trace) and
//! `deploy/slurm/job_submit.lua` (controller side, never traces: it reads a PyTorch model's
//! estimate from the comment the client side wrote) call it through `gpumem slurm request`.
//!
//! Invariant: a [`Request`] is whole or absent — every error leaves the job as submitted.

use std::path::{Path, PathBuf};

use gpumem_core::profile::{self, GpuProfile, ProfileError};
use gpumem_core::units::{bytes_to_mib, whole_mib};
use gpumem_workload::{StatedConfig, StatedError, StatedJob};
use serde::Deserialize;

/// What starts gpumem's part of a job's comment.
pub const COMMENT_TAG: &str = "gpumem:";
/// What starts a directive line in a batch script.
pub const DIRECTIVE: &str = "#GPUMEM";

/// The keys a user states.
const JOB_KEYS: [&str; 8] = [
    "model",
    "batch",
    "precision",
    "optimizer",
    "gpu",
    "world_size",
    "train_config",
    "train_config_kind",
];
/// The keys gpumem writes into the comment with its estimate.
const SIZED_KEYS: [&str; 4] = ["sized_on", "estimate_mib", "bound_mib", "shards"];

/// Why a job's request could not be decided. Each message is one line naming where.
#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    /// A directive is malformed (exit 2: the job is refused at submission, nothing applied).
    #[error("{0}")]
    Directive(String),
    /// A directive's value is not a job gpumem can size (exit 2); `whence` names the directive.
    #[error("{whence}: {source}")]
    Stated {
        whence: String,
        source: Box<gpumem_workload::StatedProblem>,
    },
    /// The cluster description cannot be read (exit 2).
    #[error("{}: {source}", path.display())]
    ConfigRead {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The cluster description is malformed (exit 2).
    #[error("{}: {source}", path.display())]
    Config {
        path: PathBuf,
        source: Box<SlurmConfigError>,
    },
    /// The PyTorch tracer failed on the job's model (exit 3); `what` names the job.
    #[error("{what}: {source}")]
    Trace {
        what: String,
        source: Box<StatedError>,
    },
    /// The job cannot be placed by its estimate: no GPU type holds it, or (controller side) a
    /// PyTorch model comes without the estimate the client side writes (exit 4).
    #[error("{0}")]
    Rejected(String),
}

/// A job as its directives state it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Job {
    pub stated: StatedJob,
    /// The GPU type the job must run on (a profile name of the cluster's), if it names one.
    pub gpu: Option<String>,
}

/// gpumem's size of a job on one GPU type, MiB (the estimate rounded, the bound rounded up).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SizeMib {
    pub estimate_mib: u64,
    pub bound_mib: u64,
}

/// An estimate a comment carries (written by gpumem on the client side), for the job that same
/// comment states.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommentEstimate {
    pub sized_on: String,
    pub sized: SizeMib,
}

/// What a submission states for gpumem: its job, and an estimate its comment carries for
/// exactly that job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Directives {
    pub job: Job,
    pub comment_estimate: Option<CommentEstimate>,
    /// The comment's text before `gpumem:` (the user's own, kept).
    pub comment_prefix: String,
    /// The keys the comment states (the others come from the script).
    pub comment_keys: Vec<String>,
}

/// `key=value` pairs of one directive text; `whence` names it in errors.
fn pairs(text: &str, whence: &str, allowed: &[&str]) -> Result<Vec<(String, String)>, SlurmError> {
    let mut out: Vec<(String, String)> = Vec::new();
    for token in text.split_whitespace() {
        let Some((key, value)) = token
            .split_once('=')
            .filter(|(k, v)| !k.is_empty() && !v.is_empty())
        else {
            return Err(SlurmError::Directive(format!(
                "{whence}: `{token}` is not key=value"
            )));
        };
        if !allowed.contains(&key) {
            let hint = if SIZED_KEYS.contains(&key) {
                " (gpumem writes it, into the comment)".to_string()
            } else {
                format!(" (known: {})", JOB_KEYS.join(", "))
            };
            return Err(SlurmError::Directive(format!(
                "{whence}: unknown key `{key}`{hint}"
            )));
        }
        if out.iter().any(|(k, _)| k == key) {
            return Err(SlurmError::Directive(format!(
                "{whence}: `{key}` is given twice"
            )));
        }
        out.push((key.to_string(), value.to_string()));
    }
    Ok(out)
}

/// The `#GPUMEM` lines of a batch script, as `sbatch` reads `#SBATCH` ones: from the top, past
/// comments and blank lines, up to the first command.
fn script_pairs(script: &str) -> Result<Vec<(String, String)>, SlurmError> {
    let mut out: Vec<(String, String)> = Vec::new();
    for (n, line) in script.lines().enumerate() {
        let trimmed = line.trim();
        if !trimmed.is_empty() && !trimmed.starts_with('#') {
            break;
        }
        let Some(rest) = line.strip_prefix(DIRECTIVE) else {
            continue;
        };
        if !rest.is_empty() && !rest.starts_with(char::is_whitespace) {
            continue; // `#GPUMEMORY…` is someone else's comment
        }
        for (key, value) in pairs(rest, &format!("{DIRECTIVE} line {}", n + 1), &JOB_KEYS)? {
            if out.iter().any(|(k, _)| *k == key) {
                return Err(SlurmError::Directive(format!(
                    "{DIRECTIVE} line {}: `{key}` is given twice",
                    n + 1
                )));
            }
            out.push((key, value));
        }
    }
    Ok(out)
}

fn get<'a>(pairs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

impl Directives {
    /// The directives of a submission: `None` where neither the script nor the comment has any.
    /// A trainer config's relative path is read in `workdir`.
    pub fn read(
        script: Option<&str>,
        comment: Option<&str>,
        workdir: &Path,
    ) -> Result<Option<Directives>, SlurmError> {
        let from_script = script.map(script_pairs).transpose()?.unwrap_or_default();
        let (comment_prefix, from_comment) =
            match comment.and_then(|c| c.find(COMMENT_TAG).map(|i| (c, i))) {
                Some((c, i)) => {
                    let all: Vec<&str> = JOB_KEYS.iter().chain(&SIZED_KEYS).copied().collect();
                    (
                        c[..i].to_string(),
                        pairs(&c[i + COMMENT_TAG.len()..], "the comment", &all)?,
                    )
                }
                None => (comment.unwrap_or_default().to_string(), Vec::new()),
            };
        if from_script.is_empty() && from_comment.is_empty() {
            return Ok(None);
        }
        // The comment is the command line's: it overrides the script key by key.
        let value = |key: &str| {
            get(&from_comment, key)
                .or_else(|| get(&from_script, key))
                .map(str::to_string)
        };
        let train_config = value("train_config").map(|file| StatedConfig {
            file,
            text: None,
            dir: workdir.to_path_buf(),
            kind: value("train_config_kind"),
        });
        for key in ["model", "batch"] {
            if train_config.is_none() && value(key).is_none() {
                return Err(SlurmError::Directive(format!(
                    "{DIRECTIVE}: `{key}` is missing (give model=… batch=…, or train_config=FILE)"
                )));
            }
        }
        let job = Job {
            stated: StatedJob {
                model: value("model"),
                batch: value("batch"),
                precision: value("precision"),
                optimizer: value("optimizer"),
                world_size: value("world_size"),
                train_config,
            },
            gpu: value("gpu"),
        };
        let comment_estimate = Self::comment_estimate(&from_comment, &from_script)?;
        let comment_keys = from_comment.into_iter().map(|(k, _)| k).collect();
        Ok(Some(Directives {
            job,
            comment_estimate,
            comment_prefix,
            comment_keys,
        }))
    }

    /// Where `key`'s value comes from, for errors.
    pub fn whence(&self, key: &str) -> String {
        if self.comment_keys.iter().any(|k| k == key) {
            format!("the comment's {key}")
        } else {
            format!("{DIRECTIVE} {key}")
        }
    }

    /// The estimate the comment carries, if it is for the job the comment states: every key the
    /// script states must be in the comment too (else the script changed the job after sizing).
    fn comment_estimate(
        comment: &[(String, String)],
        script: &[(String, String)],
    ) -> Result<Option<CommentEstimate>, SlurmError> {
        let given: Vec<&str> = SIZED_KEYS
            .iter()
            .copied()
            .filter(|k| get(comment, k).is_some())
            .collect();
        if given.is_empty() {
            return Ok(None);
        }
        if given.len() != SIZED_KEYS.len() {
            return Err(SlurmError::Directive(format!(
                "the comment: an estimate needs all of {} (it has {})",
                SIZED_KEYS.join(", "),
                given.join(", ")
            )));
        }
        let mib = |key: &str| {
            let v = get(comment, key).unwrap_or_default();
            v.parse::<u64>().map_err(|_| {
                SlurmError::Directive(format!("the comment: {key} `{v}` is not a whole number"))
            })
        };
        let sized = SizeMib {
            estimate_mib: mib("estimate_mib")?,
            bound_mib: mib("bound_mib")?,
        };
        mib("shards")?;
        let same_job = script.iter().all(|(k, _)| get(comment, k).is_some());
        Ok(same_job.then(|| CommentEstimate {
            sized_on: get(comment, "sized_on").unwrap_or_default().to_string(),
            sized,
        }))
    }
}

/// One GPU type of the cluster.
#[derive(Debug, Clone)]
pub struct GpuType {
    pub profile: GpuProfile,
    /// `gres/shard` per GPU of this type (gres.conf's `Count` for one GPU).
    pub shards: u64,
    /// The node feature that selects this type (`--constraint`).
    pub feature: Option<String>,
}

impl GpuType {
    pub fn name(&self) -> &str {
        &self.profile.name
    }

    /// Shards of one GPU that hold `bound_mib`; `None` above one GPU.
    pub fn shards_for(&self, bound_mib: u64) -> Option<u64> {
        let capacity = self.profile.capacity_mib;
        (bound_mib <= capacity).then(|| {
            (u128::from(bound_mib) * u128::from(self.shards))
                .div_ceil(u128::from(capacity))
                .max(1) as u64
        })
    }
}

/// `/etc/gpumem/slurm.toml`: the cluster's GPU types.
#[derive(Debug, Clone)]
pub struct SlurmConfig {
    pub gpus: Vec<GpuType>,
}

/// Why a cluster description (`/etc/gpumem/slurm.toml`) is malformed; `gpu` numbers a
/// `[[gpu]]` table from 1.
#[derive(Debug, thiserror::Error)]
pub enum SlurmConfigError {
    #[error("{}", .0.message())]
    Toml(Box<toml::de::Error>),
    #[error("no [[gpu]] is described")]
    NoGpu,
    #[error("[[gpu]] {gpu}: {source}")]
    Profile { gpu: usize, source: ProfileError },
    #[error("[[gpu]] {gpu}: {}: {source}", path.display())]
    ProfileRead {
        gpu: usize,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("[[gpu]] {gpu}: {}: {source}", path.display())]
    ProfileFile {
        gpu: usize,
        path: PathBuf,
        source: ProfileError,
    },
    #[error("[[gpu]] {gpu}: give `profile` (a built-in name) or `profile_file`, one of them")]
    ProfileChoice { gpu: usize },
    #[error("[[gpu]] {gpu}: shards {shards} is out of range (1..={MAX_SHARDS})")]
    Shards { gpu: usize, shards: u64 },
    #[error("[[gpu]] {gpu}: feature `{feature}` is not a Slurm feature name")]
    Feature { gpu: usize, feature: String },
    #[error("[[gpu]] {gpu}: {name} is described twice")]
    Twice { gpu: usize, name: String },
    #[error(
        "{name} needs a `feature`: with several GPU types, a job is steered to the one it is sized for by its node feature"
    )]
    NoFeature { name: String },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SlurmConfigFile {
    gpu: Vec<GpuTypeFile>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuTypeFile {
    profile: Option<String>,
    profile_file: Option<PathBuf>,
    shards: u64,
    feature: Option<String>,
}

/// The largest shard count per GPU accepted (Slurm's counts are far below).
const MAX_SHARDS: u64 = 1 << 20;

impl SlurmConfig {
    /// Reads a cluster description; `profile_file` paths are relative to its directory.
    pub fn load(path: &Path) -> Result<SlurmConfig, SlurmError> {
        let text = std::fs::read_to_string(path).map_err(|source| SlurmError::ConfigRead {
            path: path.to_path_buf(),
            source,
        })?;
        SlurmConfig::parse(&text, path.parent().unwrap_or(Path::new("."))).map_err(|source| {
            SlurmError::Config {
                path: path.to_path_buf(),
                source: Box::new(source),
            }
        })
    }

    /// Parses a cluster description (TOML: `[[gpu]]` tables of `profile` or `profile_file`,
    /// `shards`, `feature`).
    pub fn parse(text: &str, dir: &Path) -> Result<SlurmConfig, SlurmConfigError> {
        let file: SlurmConfigFile =
            toml::from_str(text).map_err(|e| SlurmConfigError::Toml(Box::new(e)))?;
        if file.gpu.is_empty() {
            return Err(SlurmConfigError::NoGpu);
        }
        let mut gpus: Vec<GpuType> = Vec::new();
        for (i, g) in file.gpu.into_iter().enumerate() {
            let gpu = i + 1;
            let profile = match (g.profile, g.profile_file) {
                (Some(name), None) => profile::builtin(&name)
                    .map_err(|source| SlurmConfigError::Profile { gpu, source })?,
                (None, Some(file)) => {
                    let path = dir.join(file);
                    let text = match std::fs::read_to_string(&path) {
                        Ok(text) => text,
                        Err(source) => {
                            return Err(SlurmConfigError::ProfileRead { gpu, path, source });
                        }
                    };
                    match GpuProfile::from_toml(&text) {
                        Ok(profile) => profile,
                        Err(source) => {
                            return Err(SlurmConfigError::ProfileFile { gpu, path, source });
                        }
                    }
                }
                _ => return Err(SlurmConfigError::ProfileChoice { gpu }),
            };
            if !(1..=MAX_SHARDS).contains(&g.shards) {
                return Err(SlurmConfigError::Shards {
                    gpu,
                    shards: g.shards,
                });
            }
            if let Some(f) = &g.feature
                && (f.is_empty()
                    || !f
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)))
            {
                return Err(SlurmConfigError::Feature {
                    gpu,
                    feature: f.clone(),
                });
            }
            if gpus.iter().any(|t| t.profile.name == profile.name) {
                return Err(SlurmConfigError::Twice {
                    gpu,
                    name: profile.name,
                });
            }
            gpus.push(GpuType {
                profile,
                shards: g.shards,
                feature: g.feature,
            });
        }
        if gpus.len() > 1
            && let Some(g) = gpus.iter().find(|g| g.feature.is_none())
        {
            return Err(SlurmConfigError::NoFeature {
                name: g.name().to_string(),
            });
        }
        Ok(SlurmConfig { gpus })
    }
}

/// What the job asked for besides its directives.
#[derive(Debug, Clone, Default)]
pub struct Submission<'a> {
    /// The batch script (absent when `sbatch` read it from standard input).
    pub script: Option<&'a str>,
    pub comment: Option<&'a str>,
    /// Its per-node GRES request (`--gres`; `gres:` prefixes as Slurm writes them are fine).
    pub gres: Option<&'a str>,
    pub constraint: Option<&'a str>,
    /// Where a relative `train_config` is read (the submission's directory; `None`: here).
    pub workdir: Option<&'a Path>,
}

/// What Slurm should record for a job gpumem sized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The whole per-node GRES request: the job's other GRES and `shard:N`.
    pub gres: String,
    /// The constraint with the GPU type's feature, where one was added.
    pub constraint: Option<String>,
    /// The job's comment: the user's own text, then `gpumem: …` with the job and its estimate.
    pub comment: String,
    pub gpu: String,
    pub shards: u64,
    pub sized: SizeMib,
}

impl Request {
    /// The request as `key=value` lines, the form the Lua hooks read (one key per line, each
    /// value one line).
    pub fn lines(&self) -> String {
        let mut out = format!("gres={}\n", self.gres);
        if let Some(c) = &self.constraint {
            out += &format!("constraint={c}\n");
        }
        out + &format!("comment={}\n", self.comment)
    }
}

/// Decides a submission's request on `cluster`: `None` for a job without directives (left as
/// submitted). Without `may_trace` (the controller side), a PyTorch model is sized only by the
/// estimate its comment carries.
pub fn decide(
    sub: &Submission,
    cluster: &SlurmConfig,
    may_trace: bool,
) -> Result<Option<Request>, SlurmError> {
    let Some(d) = Directives::read(
        sub.script,
        sub.comment,
        sub.workdir.unwrap_or(Path::new(".")),
    )?
    else {
        return Ok(None);
    };
    let job = &d.job;
    let types: Vec<&GpuType> = match &job.gpu {
        Some(name) => vec![
            cluster
                .gpus
                .iter()
                .find(|g| g.name() == name)
                .ok_or_else(|| {
                    let known: Vec<&str> = cluster.gpus.iter().map(GpuType::name).collect();
                    SlurmError::Directive(format!(
                        "gpu={name} is not a GPU type of this cluster ({})",
                        known.join(", ")
                    ))
                })?,
        ],
        None => cluster.gpus.iter().collect(),
    };
    let other_gres = other_gres(sub.gres)?;
    let what = match &job.stated.batch {
        Some(b) => format!("{} at batch {b}", job.stated.name()),
        None => job.stated.name(),
    };
    let mut sized: Vec<(&GpuType, SizeMib)> = Vec::new();
    for g in types {
        match job.stated.size(&g.profile, may_trace) {
            Ok(est) => sized.push((
                g,
                SizeMib {
                    estimate_mib: bytes_to_mib(est.peak_bytes).round() as u64,
                    bound_mib: whole_mib(est.upper_bound_bytes),
                },
            )),
            Err(StatedError::NeedsTrace(_)) => {
                if let Some(s) = d
                    .comment_estimate
                    .as_ref()
                    .filter(|s| s.sized_on == g.name())
                {
                    sized.push((g, s.sized));
                }
            }
            Err(StatedError::Invalid { field, message }) => {
                return Err(SlurmError::Stated {
                    whence: d.whence(field.key()),
                    source: Box::new(message),
                });
            }
            Err(source @ StatedError::Size(_)) => {
                return Err(SlurmError::Trace {
                    what: what.clone(),
                    source: Box::new(source),
                });
            }
        }
    }
    if sized.is_empty() {
        return Err(SlurmError::Rejected(format!(
            "{} must be traced to be sized, which the controller does not do; submit where gpumem's cli_filter runs, or pass the comment `gpumem slurm request` prints",
            job.stated.name()
        )));
    }
    // The smallest GPU that holds the bound (config order among equals) leaves the larger ones
    // for the jobs that need them.
    let best = sized
        .iter()
        .filter_map(|(g, s)| g.shards_for(s.bound_mib).map(|n| (*g, *s, n)))
        .min_by_key(|(g, _, _)| g.profile.capacity_mib);
    let Some((gpu, size, shards)) = best else {
        let needs: Vec<String> = sized
            .iter()
            .map(|(g, s)| {
                format!(
                    "{} MiB of a {} MiB {}",
                    s.bound_mib,
                    g.profile.capacity_mib,
                    g.name()
                )
            })
            .collect();
        return Err(SlurmError::Rejected(format!(
            "{what} fits on no GPU of this cluster: its upper bound needs {}",
            needs.join(", ")
        )));
    };
    let gres = other_gres
        .into_iter()
        .chain([format!("shard:{shards}")])
        .collect::<Vec<_>>()
        .join(",");
    let constraint = match (
        &gpu.feature,
        sub.constraint.filter(|c| !c.trim().is_empty()),
    ) {
        (None, _) => None,
        (Some(f), None) => Some(f.clone()),
        (Some(f), Some(c)) if c.split('&').any(|t| t == f) => None,
        (Some(f), Some(c))
            if c.chars()
                .all(|ch| ch.is_ascii_alphanumeric() || "_-.&".contains(ch)) =>
        {
            Some(format!("{c}&{f}"))
        }
        (Some(f), Some(c)) => {
            return Err(SlurmError::Directive(format!(
                "--constraint `{c}`: gpumem must add the feature `{f}` of the GPU type it sized the job for, and adds it only to features joined by &"
            )));
        }
    };
    let mut stated = Vec::new();
    for (key, value) in [
        ("model", &job.stated.model),
        ("batch", &job.stated.batch),
        ("precision", &job.stated.precision),
        ("optimizer", &job.stated.optimizer),
        ("world_size", &job.stated.world_size),
        (
            "train_config",
            &job.stated.train_config.as_ref().map(|c| c.file.clone()),
        ),
        (
            "train_config_kind",
            &job.stated
                .train_config
                .as_ref()
                .and_then(|c| c.kind.clone()),
        ),
        ("gpu", &job.gpu),
    ] {
        if let Some(v) = value {
            stated.push(format!("{key}={}", v.trim()));
        }
    }
    let prefix = d.comment_prefix.replace(['\n', '\r'], " ");
    let sep = if prefix.is_empty() || prefix.ends_with(' ') {
        ""
    } else {
        " "
    };
    let comment = format!(
        "{prefix}{sep}{COMMENT_TAG} {} sized_on={} estimate_mib={} bound_mib={} shards={shards}",
        stated.join(" "),
        gpu.name(),
        size.estimate_mib,
        size.bound_mib
    );
    Ok(Some(Request {
        gres,
        constraint,
        comment,
        gpu: gpu.name().to_string(),
        shards,
        sized: size,
    }))
}

/// The job's GRES other than GPUs and shards (gpumem sets those), without Slurm's `gres:`
/// prefixes. A request for several whole GPUs is a multi-GPU job, which gpumem does not size
/// per GPU here: refused rather than shrunk to one GPU's shards.
fn other_gres(gres: Option<&str>) -> Result<Vec<String>, SlurmError> {
    let mut kept = Vec::new();
    for item in gres
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let item = item
            .strip_prefix("gres:")
            .or_else(|| item.strip_prefix("gres/"))
            .unwrap_or(item);
        let name = item.split([':', '=']).next().unwrap_or_default();
        match name {
            "gpu" => {
                let count = item
                    .rsplit([':', '='])
                    .next()
                    .and_then(|c| c.parse::<u64>().ok())
                    .unwrap_or(1);
                if item != "gpu" && count > 1 {
                    return Err(SlurmError::Directive(format!(
                        "--gres {item}: a job with #GPUMEM is sized for one GPU, and this asks for {count}; drop one or the other"
                    )));
                }
            }
            "shard" => {}
            _ => kept.push(item.to_string()),
        }
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster(text: &str) -> SlurmConfig {
        SlurmConfig::parse(text, Path::new(".")).unwrap()
    }

    const TWO: &str = "[[gpu]]\nprofile = \"h200\"\nshards = 16\nfeature = \"h200\"\n[[gpu]]\nprofile = \"a100-40gb\"\nshards = 8\nfeature = \"a100\"\n";
    const MLP: &str = "#!/bin/bash\n#SBATCH --time=10\n#GPUMEM model=mlp:input=4096,output=10,depth=4 batch=256\n\n#GPUMEM optimizer=sgd\npython train.py\n#GPUMEM batch=9\n";

    #[test]
    fn directives_are_read_like_sbatch_lines() {
        let d = Directives::read(Some(MLP), None, Path::new("."))
            .unwrap()
            .unwrap();
        assert_eq!(
            d.job.stated.model.as_deref(),
            Some("mlp:input=4096,output=10,depth=4")
        );
        assert_eq!(
            (
                d.job.stated.batch.as_deref().unwrap_or_default(),
                d.job.stated.optimizer.as_deref()
            ),
            ("256", Some("sgd")),
            "lines after the first command are not directives"
        );
        assert!(
            Directives::read(
                Some("#!/bin/sh\n#GPUMEMORY=1\necho\n"),
                Some("a note"),
                Path::new(".")
            )
            .unwrap()
            .is_none()
        );
        // The comment overrides the script key by key; the user's own text is kept.
        let d = Directives::read(Some(MLP), Some("run 7 gpumem: batch=128"), Path::new("."))
            .unwrap()
            .unwrap();
        assert_eq!(
            (
                d.job.stated.batch.as_deref().unwrap_or_default(),
                d.comment_prefix.as_str()
            ),
            ("128", "run 7 ")
        );
    }

    #[test]
    fn a_malformed_directive_is_one_line_naming_where() {
        for (script, comment, needle) in [
            (
                "#GPUMEM model=mlp:depth=2 batch\n",
                None,
                "#GPUMEM line 1: `batch` is not key=value",
            ),
            (
                "#!/bin/sh\n#GPUMEM model=x batch=1 colour=red\n",
                None,
                "#GPUMEM line 2: unknown key `colour`",
            ),
            (
                "#GPUMEM model=x batch=1\n#GPUMEM batch=2\n",
                None,
                "#GPUMEM line 2: `batch` is given twice",
            ),
            ("#GPUMEM batch=2\n", None, "`model` is missing"),
            (
                "#GPUMEM model=x batch=1 bound_mib=5\n",
                None,
                "gpumem writes it",
            ),
            (
                "",
                Some("gpumem: model=x batch=1 bound_mib=5"),
                "an estimate needs all of",
            ),
        ] {
            let e = Directives::read(Some(script), comment, Path::new("."))
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle) && !e.contains('\n'), "{e}");
        }
    }

    #[test]
    fn a_job_gets_the_shards_of_the_smallest_gpu_that_holds_it() {
        let c = cluster(TWO);
        let r = decide(
            &Submission {
                script: Some(MLP),
                ..Default::default()
            },
            &c,
            false,
        )
        .unwrap()
        .unwrap();
        assert_eq!(r.gpu, "a100-40gb", "the smaller GPU holds it");
        assert_eq!(r.shards, c.gpus[1].shards_for(r.sized.bound_mib).unwrap());
        assert_eq!(r.gres, format!("shard:{}", r.shards));
        assert_eq!(r.constraint.as_deref(), Some("a100"));
        assert!(r.comment.starts_with("gpumem: model=mlp:input=4096,output=10,depth=4 batch=256 optimizer=sgd sized_on=a100-40gb estimate_mib="), "{}", r.comment);
        // Deciding again on what was decided changes nothing (the controller after the client).
        let again = decide(
            &Submission {
                script: Some(MLP),
                comment: Some(&r.comment),
                gres: Some(&format!("gres:{}", r.gres)),
                constraint: r.constraint.as_deref(),
                workdir: None,
            },
            &c,
            false,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (again.gres, again.constraint, again.comment),
            (r.gres.clone(), None, r.comment.clone())
        );
        // gpu= picks the type; other GRES are kept, GPU and shard requests replaced.
        let sub = Submission {
            script: Some(MLP),
            comment: Some("gpumem: gpu=h200"),
            gres: Some("gres:gpu:1,gres:nic:1"),
            constraint: Some("ib"),
            workdir: None,
        };
        let r = decide(&sub, &c, false).unwrap().unwrap();
        assert_eq!(
            (r.gpu.as_str(), r.gres.as_str(), r.constraint.as_deref()),
            (
                "h200",
                format!("nic:1,shard:{}", r.shards).as_str(),
                Some("ib&h200")
            )
        );
    }

    #[test]
    fn a_trainer_config_states_the_job_from_the_submission_directory() {
        let dir = std::env::temp_dir().join(format!("gpumem-slurm-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("args.json"),
            r#"{"per_device_train_batch_size": 256, "optim": "sgd", "output_dir": "out"}"#,
        )
        .unwrap();
        let c = cluster(TWO);
        let by_config = "#GPUMEM model=mlp:input=4096,output=10,depth=4 train_config=args.json\n";
        // `decide` on a script submitted from `workdir`; `may_trace` false is the controller side.
        let submit = |script, workdir, may_trace| {
            decide(
                &Submission {
                    script: Some(script),
                    workdir,
                    ..Default::default()
                },
                &c,
                may_trace,
            )
        };
        let r = submit(by_config, Some(&dir), true).unwrap().unwrap();
        let stated = submit(MLP, None, true).unwrap().unwrap();
        // The config's micro-batch and optimizer are the directives' batch=256 optimizer=sgd.
        assert_eq!(
            (r.gpu.as_str(), r.sized),
            (stated.gpu.as_str(), stated.sized)
        );
        assert!(
            r.comment.contains(" train_config=args.json "),
            "{}",
            r.comment
        );
        // Read in the submission's directory, not here; the controller never reads it.
        let elsewhere = submit(by_config, None, true).unwrap_err().to_string();
        assert!(
            elsewhere.starts_with("#GPUMEM train_config: args.json"),
            "{elsewhere}"
        );
        let controller = submit(by_config, Some(&dir), false).unwrap_err();
        assert!(
            matches!(controller, SlurmError::Rejected(_)),
            "{controller}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn shards_round_up_and_never_exceed_one_gpu() {
        let g = &cluster(TWO).gpus[1];
        let cap = g.profile.capacity_mib;
        assert_eq!(g.shards_for(1), Some(1));
        assert_eq!(g.shards_for(cap / 8), Some(1));
        assert_eq!(g.shards_for(cap / 8 + 1), Some(2));
        assert_eq!(g.shards_for(cap), Some(8));
        assert_eq!(g.shards_for(cap + 1), None);
    }

    #[test]
    fn what_cannot_be_placed_is_rejected_with_the_reason() {
        let c = cluster(TWO);
        let huge = "#GPUMEM model=mlp:input=65536,output=10,depth=8 batch=262144\n";
        let e = decide(
            &Submission {
                script: Some(huge),
                ..Default::default()
            },
            &c,
            false,
        )
        .unwrap_err();
        assert!(
            matches!(e, SlurmError::Rejected(_))
                && e.to_string().contains("fits on no GPU of this cluster"),
            "{e}"
        );
        // A PyTorch model on the controller without the client's estimate.
        let torch = "#GPUMEM model=torchvision:resnet50 batch=8\n";
        let e = decide(
            &Submission {
                script: Some(torch),
                ..Default::default()
            },
            &c,
            false,
        )
        .unwrap_err();
        assert!(
            matches!(e, SlurmError::Rejected(_)) && e.to_string().contains("must be traced"),
            "{e}"
        );
        // ... with it, the stated estimate decides.
        let comment = "gpumem: model=torchvision:resnet50 batch=8 sized_on=h200 estimate_mib=5000 bound_mib=5200 shards=1";
        let r = decide(
            &Submission {
                script: Some(torch),
                comment: Some(comment),
                ..Default::default()
            },
            &c,
            false,
        )
        .unwrap()
        .unwrap();
        assert_eq!((r.gpu.as_str(), r.sized.bound_mib), ("h200", 5200));
        // A script that states more than the comment's estimate knows: not that job's estimate.
        let e = decide(
            &Submission {
                script: Some("#GPUMEM model=torchvision:resnet50 batch=8 precision=fp16\n"),
                comment: Some(comment),
                ..Default::default()
            },
            &c,
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("must be traced"), "{e}");
        let e = decide(
            &Submission {
                script: Some(MLP),
                gres: Some("gpu:4"),
                ..Default::default()
            },
            &c,
            false,
        )
        .unwrap_err();
        assert!(e.to_string().contains("asks for 4"), "{e}");
        let e = decide(
            &Submission {
                script: Some(MLP),
                comment: Some("gpumem: gpu=t4"),
                ..Default::default()
            },
            &c,
            false,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("gpu=t4 is not a GPU type of this cluster (h200, a100-40gb)"),
            "{e}"
        );
        let e = decide(
            &Submission {
                script: Some("#GPUMEM model=mlp:input=8 batch=lots\n"),
                ..Default::default()
            },
            &c,
            false,
        )
        .unwrap_err();
        assert_eq!(e.to_string(), "#GPUMEM batch: `lots` is not a whole number");
        let e = decide(
            &Submission {
                script: Some(MLP),
                comment: Some("gpumem: precision=fp7"),
                ..Default::default()
            },
            &c,
            false,
        )
        .unwrap_err();
        assert!(
            e.to_string().starts_with("the comment's precision: "),
            "{e}"
        );
    }

    #[test]
    fn a_cluster_description_is_checked() {
        for (text, needle) in [
            ("", "missing field `gpu`"),
            (
                "[[gpu]]\nprofile = \"h200\"\nshards = 0\n",
                "shards 0 is out of range",
            ),
            ("[[gpu]]\nprofile = \"b300\"\nshards = 4\n", "b300"),
            ("[[gpu]]\nshards = 4\n", "give `profile`"),
            (
                "[[gpu]]\nprofile = \"h200\"\nshards = 4\n[[gpu]]\nprofile = \"t4\"\nshards = 4\nfeature = \"t4\"\n",
                "h200 needs a `feature`",
            ),
            (
                "[[gpu]]\nprofile = \"h200\"\nshards = 4\nfeature = \"a|b\"\n",
                "not a Slurm feature name",
            ),
            (
                "[[gpu]]\nprofile = \"h200\"\nshards = 4\ncolour = 1\n",
                "unknown field `colour`",
            ),
        ] {
            let e = SlurmConfig::parse(text, Path::new("."))
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle) && !e.contains('\n'), "{needle}: {e}");
        }
    }
}
