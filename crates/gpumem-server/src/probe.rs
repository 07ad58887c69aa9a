//! The daemon probes what its profile has not seen: a submitted job whose convolutions'
//! workspaces are not in the profile's table waits (at most `probe_s`, sized by its upper bound
//! meanwhile) while `gpumem_trace.probe` measures exactly those configurations on an idle GPU;
//! the result goes into the daemon's profile (kept in STATE/profile.toml) and the job is sized
//! again before it is placed. Here: the [`Prober`]s, and the daemon's side of probing — the
//! jobs that wait ([`ProbeWait`]) and the probe running in its own thread ([`Probes`]).

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, mpsc};

use gpumem_core::trace::Trace;
use gpumem_torch::probe::{ProbeReport, ProbeRequest};
use gpumem_torch::{BridgeError, TorchTracer};

/// Why a probe measured nothing.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// Its working directory could not be made.
    #[error("{dir}: {source}")]
    Dir { dir: String, source: std::io::Error },
    /// The tracer's probe failed.
    #[error(transparent)]
    Probe(#[from] BridgeError),
    /// The report does not read.
    #[error(transparent)]
    Report(#[from] serde_json::Error),
}

/// Measures convolution workspaces on one GPU.
pub trait Prober: Send + Sync {
    fn probe(
        &self,
        gpu: u32,
        configs: &[(String, u64)],
        seconds: u64,
    ) -> Result<ProbeReport, ProbeError>;
}

/// The real prober: `python -m gpumem_trace.probe --configs ...` on the GPU (cuDNN's heuristic
/// mode, which jobs run under by default; no attention cases).
pub struct TorchProber {
    pub tracer: TorchTracer,
    /// Where the probe's configuration list and report are written (made private, 0700).
    pub dir: PathBuf,
}

impl Prober for TorchProber {
    fn probe(
        &self,
        gpu: u32,
        configs: &[(String, u64)],
        seconds: u64,
    ) -> Result<ProbeReport, ProbeError> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(|source| ProbeError::Dir {
                dir: self.dir.display().to_string(),
                source,
            })?;
        let req = ProbeRequest {
            gpu,
            configs: configs.to_vec(),
            benchmark: "off".into(),
            seconds,
            convolutions_only: true,
            ..Default::default()
        };
        Ok(self
            .tracer
            .probe(&req, &self.dir.join(format!("gpu{gpu}.json")))?)
    }
}

/// For `gpumem serve --fake-gpus ... --fake-probe BYTES` (no GPU to measure on): every probed
/// pass "measures" one workspace of BYTES. The daemon's path around it is the real one.
pub struct FakeProber {
    pub bytes: u64,
}

impl Prober for FakeProber {
    fn probe(
        &self,
        _gpu: u32,
        configs: &[(String, u64)],
        _seconds: u64,
    ) -> Result<ProbeReport, ProbeError> {
        let b = self.bytes;
        let convs: Vec<serde_json::Value> = configs.iter().map(|(c, n)| serde_json::json!({"config": c, "n": n, "fwd": [b], "bwd_data": [b], "bwd_filter": [b]})).collect();
        let report = serde_json::json!({"stack": {"gpu": "fake", "cuda": "", "torch": "", "cudnn": 0}, "conv": {"heuristic": convs}});
        Ok(serde_json::from_value(report)?)
    }
}

/// A submission held for a probe of its convolutions.
pub struct ProbeWait {
    pub job: u64,
    pub trace: Trace,
    /// Its convolutions the profile has not probed.
    pub configs: Vec<(String, u64)>,
    /// When it is placed by its bound if no probe has answered.
    pub until: f64,
}

/// What became of the probe running.
pub enum Answer {
    /// None runs, or it has not answered yet.
    Pending,
    Measured(ProbeReport),
    /// It failed: the note the jobs waiting for it get.
    Failed(String),
}

/// The daemon's probes: one at a time, each in its own thread, on one GPU.
pub struct Probes {
    prober: Arc<dyn Prober>,
    running: Option<Running>,
    /// Convolutions a probe was asked for (measured or not): never asked again.
    tried: HashSet<(String, u64)>,
}

struct Running {
    gpu: u32,
    configs: Vec<(String, u64)>,
    result: mpsc::Receiver<Result<ProbeReport, ProbeError>>,
}

impl Probes {
    pub fn new(prober: Arc<dyn Prober>) -> Probes {
        Probes {
            prober,
            running: None,
            tried: HashSet::new(),
        }
    }

    /// The GPU a probe runs on now.
    pub fn gpu(&self) -> Option<u32> {
        self.running.as_ref().map(|r| r.gpu)
    }

    /// The running probe's answer, if it has come.
    pub fn answer(&mut self) -> Answer {
        let Some(r) = &self.running else {
            return Answer::Pending;
        };
        let answer = match r.result.try_recv() {
            // Probed once: what the GPU refused or the probe's time cut off is not asked again
            // (the job is placed by its bound instead).
            Ok(Ok(report)) => {
                self.tried.extend(r.configs.iter().cloned());
                Answer::Measured(report)
            }
            Ok(Err(e)) => Answer::Failed(format!("probe failed: {e}; placed by its upper bound")),
            Err(mpsc::TryRecvError::Empty) => return Answer::Pending,
            Err(mpsc::TryRecvError::Disconnected) => {
                Answer::Failed("probe failed; placed by its upper bound".to_string())
            }
        };
        self.running = None;
        answer
    }

    /// Whether a probe could still measure something `w` lacks.
    pub fn wanted(&self, w: &ProbeWait) -> bool {
        w.configs.iter().any(|c| !self.tried.contains(c))
    }

    /// Starts a probe on `gpu` of what `waiting` lacks and no probe was asked for, for as long
    /// as the first of them may still wait; nothing if one runs.
    pub fn start(&mut self, gpu: u32, waiting: &[ProbeWait], t: f64) {
        if self.running.is_some() {
            return;
        }
        let mut configs: Vec<(String, u64)> = waiting
            .iter()
            .flat_map(|w| w.configs.clone())
            .filter(|c| !self.tried.contains(c))
            .collect();
        configs.sort();
        configs.dedup();
        let seconds = waiting
            .iter()
            .map(|w| (w.until - t).max(1.0))
            .fold(f64::INFINITY, f64::min)
            .ceil() as u64;
        let (tx, rx) = mpsc::channel();
        let (prober, asked) = (self.prober.clone(), configs.clone());
        std::thread::spawn(move || {
            let _ = tx.send(prober.probe(gpu, &asked, seconds));
        });
        self.running = Some(Running {
            gpu,
            configs,
            result: rx,
        });
    }

    pub fn idle(&self) -> bool {
        self.running.is_none()
    }
}
