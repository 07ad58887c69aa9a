//! gpumem-server: the resource manager daemon behind `gpumem serve`.
//!
//! People submit training jobs over a JSON HTTP API ([`api`], axum, on a Unix socket whose
//! callers are known by their peer credentials — [`identity`] — or TCP behind a token); the
//! [`daemon::Daemon`]
//! estimates each job (gpumem's replay, or an explicit request), keeps every job and state change
//! in SQLite ([`store::Store`], WAL), reads the GPUs through a [`gpumem_monitor::Monitor`] (NVML
//! and DCGM, or fake GPUs), places waiting jobs with gpumem-place's scheduler (the simulator's:
//! priority, recovery first, optional EASY backfill) and policy (CARMA's warm-up rule: a GPU just
//! given a job is not offered again until its memory shows up or `warmup_s` passes),
//! launches them as their submitters under a supervisor process ([`launcher`]: own process
//! group and cgroup, log file, exit file; no shell unless asked), detects out-of-memory crashes and re-runs them alone up to a retry cap,
//! and survives its own restart: runs whose processes live are re-attached, never run twice.
//! Wire types are in [`wire`].
//!
//! The daemon along its seams: [`config`] (settings, the policy and estimator made once),
//! [`sizing`], `statedir` (the locked state directory and its store), [`lifecycle`] (a job's
//! state machine), `ledger` (the jobs and their store, owned together; every transition stored
//! before memory changes), `runs` (following and starting runs), `observe` (the GPUs), [`probe`]
//! and `metrics`; [`daemon`] ties them together and does its I/O outside the ledger's lock.

pub mod api;
pub mod config;
pub mod daemon;
pub mod identity;
pub mod launcher;
mod ledger;
pub mod lifecycle;
mod metrics;
mod observe;
pub mod probe;
mod runs;
pub mod sizing;
mod statedir;
pub mod store;
pub mod wire;

pub use config::Config;
pub use daemon::Daemon;
pub use statedir::DaemonError;
