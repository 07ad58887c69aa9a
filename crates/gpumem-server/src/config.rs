//! The daemon's settings (`gpumem serve --config FILE.toml`): read, range-checked, and what
//! they name — the placement policy and the estimator (with its learned model) — made once.

use std::path::PathBuf;

use gpumem_core::estimate::Estimator;
use gpumem_place::{MIB, MemoryView, Policy, SchedOptions, UnknownPolicy};
use serde::Deserialize;

use crate::wire::MAX_MEM_MIB;

/// What happens to a job whose supervisor vanished before the job's program could start (one
/// that may have started is never run again).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum OnLost {
    Requeue,
    Fail,
}

/// `gpumem serve --config FILE.toml`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Any placement policy of gpumem-place (`safe-pack`, `first-fit+carma`, …).
    pub policy: String,
    /// Free memory kept above an estimate (CARMA: 2 GiB).
    pub headroom_mib: u64,
    /// A GPU just given a job is not offered again until the job's memory shows up or this passes.
    pub warmup_s: f64,
    /// Exclusive re-runs after out-of-memory crashes before a job fails.
    pub max_retries: u32,
    /// EASY backfill: when the head of the queue must wait, later jobs start where they do not
    /// delay it (on reserved GPUs only if their `expected_s` ends before the head's turn).
    pub backfill: bool,
    /// Seconds between SIGTERM and SIGKILL when cancelling.
    pub grace_s: f64,
    /// Scheduling period.
    pub tick_ms: u64,
    pub on_lost: OnLost,
    /// How a job with a model is sized: any estimator `gpumem estimate` takes (`replay`,
    /// `live-tensors`, `horus`, or `learned` with `learned_model`).
    pub estimator: String,
    /// The hybrid's memory model (a `gpumem learn train --target memory --model gbt` file).
    pub learned_model: Option<PathBuf>,
    /// Seconds a job whose convolutions the profile has not probed waits for the daemon to
    /// probe them on an idle GPU before it is placed by its upper bound (0: no probing).
    pub probe_s: u64,
    /// Accept `py:FILE:function` models: sizing one runs that file's code in the daemon, as the
    /// daemon's user (off by default).
    pub allow_py_models: bool,
    /// Submissions sized at once (each traces its model in Python); the others wait their turn.
    pub max_traces: u32,
    /// Give each run a cgroup v2 directory of its own where the machine allows it (false: its
    /// process group and its supervisor's subreaping alone track its processes).
    pub cgroups: bool,
    /// A group whose members, like root and the daemon's own user, see and cancel every job.
    pub admin_group: Option<String>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            policy: "safe-pack".into(),
            headroom_mib: 2048,
            warmup_s: 30.0,
            max_retries: 3,
            backfill: false,
            grace_s: 10.0,
            tick_ms: 200,
            on_lost: OnLost::Requeue,
            estimator: "replay".into(),
            learned_model: None,
            probe_s: 0,
            allow_py_models: false,
            max_traces: 2,
            cgroups: true,
            admin_group: None,
        }
    }
}

/// Why a `--config` file (or a daemon's settings) is refused.
#[derive(Debug, thiserror::Error)]
pub enum DaemonConfigError {
    /// Not TOML, or a key that is not a setting (toml's message, on one line).
    #[error("{}", .0.to_string().replace('\n', " "))]
    Toml(#[from] toml::de::Error),
    #[error(transparent)]
    Policy(#[from] UnknownPolicy),
    /// The estimator (or its learned model) cannot be used.
    #[error(transparent)]
    Estimator(#[from] gpumem_learn::model::LearnError),
    /// `admin_group` names no group of this machine.
    #[error("admin_group = {0:?}: no such group")]
    NoGroup(String),
    /// A number out of its range (`value` as written back).
    #[error("{key} = {value} is out of range ({range})")]
    Range {
        key: &'static str,
        value: String,
        range: &'static str,
    },
}

/// What a configuration names, made from its texts once: the scheduler's options (the policy
/// parsed) and the estimator (a learned model read once, not per job).
pub struct Resolved {
    pub sched: SchedOptions,
    pub estimator: Box<dyn Estimator>,
}

impl Config {
    /// Reads and checks a configuration: every number in range, the policy and the estimator
    /// known (and its learned model readable).
    pub fn from_toml(text: &str) -> Result<Config, DaemonConfigError> {
        let c: Config = toml::from_str(text)?;
        c.check()?;
        c.resolve()?;
        Ok(c)
    }

    /// Every number bounded: a daemon that sleeps for ever between ticks or waits an infinite
    /// grace cannot be stopped but by SIGKILL; a headroom beyond bytes wraps.
    fn check(&self) -> Result<(), DaemonConfigError> {
        let range = |key, value: String, range| DaemonConfigError::Range { key, value, range };
        for (key, v) in [("warmup_s", self.warmup_s), ("grace_s", self.grace_s)] {
            if !(v.is_finite() && (0.0..=86_400.0).contains(&v)) {
                return Err(range(key, v.to_string(), "0..=86400 seconds"));
            }
        }
        if !(10..=60_000).contains(&self.tick_ms) {
            return Err(range("tick_ms", self.tick_ms.to_string(), "10..=60000"));
        }
        if self.headroom_mib > MAX_MEM_MIB {
            let v = self.headroom_mib.to_string();
            return Err(range("headroom_mib", v, "0..=16777216"));
        }
        if !(1..=64).contains(&self.max_traces) {
            return Err(range("max_traces", self.max_traces.to_string(), "1..=64"));
        }
        if self.probe_s > 3600 {
            let v = self.probe_s.to_string();
            return Err(range("probe_s", v, "0..=3600 seconds"));
        }
        if self.max_retries > 100 {
            return Err(range(
                "max_retries",
                self.max_retries.to_string(),
                "0..=100",
            ));
        }
        if let Some(g) = &self.admin_group
            && crate::identity::group_id(g).is_none()
        {
            return Err(DaemonConfigError::NoGroup(g.clone()));
        }
        Ok(())
    }

    /// The policy and the estimator these settings name, made (after the ranges: the policy's
    /// headroom is counted in bytes).
    pub fn resolve(&self) -> Result<Resolved, DaemonConfigError> {
        Ok(Resolved {
            sched: self.sched()?,
            estimator: gpumem_learn::estimator(&self.estimator, self.learned_model.as_deref())?,
        })
    }

    pub fn policy(&self) -> Result<Policy, UnknownPolicy> {
        Policy::parse(
            &self.policy,
            MemoryView::Estimate {
                headroom_bytes: self.headroom_mib * MIB,
            },
        )
    }

    /// gpumem-place's scheduler with these settings.
    pub fn sched(&self) -> Result<SchedOptions, UnknownPolicy> {
        Ok(SchedOptions {
            policy: self.policy()?,
            backfill: self.backfill,
            max_retries: self.max_retries,
            warmup_s: self.warmup_s,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_errors_are_one_line() {
        for (text, message) in [
            (
                "tick_ms = 18446744073709551615",
                "tick_ms = 18446744073709551615 is out of range (10..=60000)",
            ),
            (
                "headroom_mib = 18446744073709551615",
                "headroom_mib = 18446744073709551615 is out of range (0..=16777216)",
            ),
            (
                "warmup_s = inf",
                "warmup_s = inf is out of range (0..=86400 seconds)",
            ),
            (
                "grace_s = 1e308",
                &format!("grace_s = {} is out of range (0..=86400 seconds)", 1e308f64),
            ),
            (
                "grace_s = -1",
                "grace_s = -1 is out of range (0..=86400 seconds)",
            ),
            (
                "max_retries = 4000000000",
                "max_retries = 4000000000 is out of range (0..=100)",
            ),
            ("max_traces = 0", "max_traces = 0 is out of range (1..=64)"),
            (
                "probe_s = 3601",
                "probe_s = 3601 is out of range (0..=3600 seconds)",
            ),
        ] {
            assert_eq!(
                Config::from_toml(text).unwrap_err().to_string(),
                message,
                "{text}"
            );
        }
        let e = Config::from_toml("tick_ms = 5").unwrap_err();
        assert!(matches!(e, DaemonConfigError::Range { key: "tick_ms", .. }));
        assert_eq!(e.to_string(), "tick_ms = 5 is out of range (10..=60000)");
        let e = Config::from_toml("policy = \"tetris\"").unwrap_err();
        assert!(
            matches!(e, DaemonConfigError::Policy(_))
                && e.to_string().starts_with("unknown policy `tetris`"),
            "{e}"
        );
        let e = Config::from_toml("surprise = 1").unwrap_err();
        assert!(
            matches!(e, DaemonConfigError::Toml(_))
                && e.to_string().contains("surprise")
                && !e.to_string().contains('\n'),
            "{e}"
        );
        assert!(matches!(
            Config::from_toml("estimator = \"learned\"").unwrap_err(),
            DaemonConfigError::Estimator(_)
        ));
    }
}
