//! The daemon probes what its profile has not seen: a submitted job whose convolutions'
//! workspaces are not in the profile's table waits (at most `probe_s`, sized by its upper bound
//! meanwhile) while `gpumem_trace.probe` measures exactly those configurations on an idle GPU;
//! the result goes into the daemon's profile (kept in STATE/profile.toml) and the job is sized
//! again before it is placed.

use std::path::PathBuf;

use gpumem_torch::TorchTracer;
use gpumem_torch::probe::{ProbeReport, ProbeRequest};

/// Measures convolution workspaces on one GPU.
pub trait Prober: Send + Sync {
    fn probe(
        &self,
        gpu: u32,
        configs: &[(String, u64)],
        seconds: u64,
    ) -> Result<ProbeReport, String>;
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
    ) -> Result<ProbeReport, String> {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)
            .map_err(|e| format!("{}: {e}", self.dir.display()))?;
        let req = ProbeRequest {
            gpu,
            configs: configs.to_vec(),
            benchmark: "off".into(),
            seconds,
            no_sdpa: true,
            ..Default::default()
        };
        self.tracer
            .probe(&req, &self.dir.join(format!("gpu{gpu}.json")))
            .map_err(|e| e.to_string())
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
    ) -> Result<ProbeReport, String> {
        let b = self.bytes;
        let convs: Vec<serde_json::Value> = configs.iter().map(|(c, n)| serde_json::json!({"config": c, "n": n, "fwd": [b], "bwd_data": [b], "bwd_filter": [b]})).collect();
        let report = serde_json::json!({"stack": {"gpu": "fake", "cuda": "", "torch": "", "cudnn": 0}, "conv": {"heuristic": convs}});
        serde_json::from_value(report).map_err(|e| e.to_string())
    }
}
