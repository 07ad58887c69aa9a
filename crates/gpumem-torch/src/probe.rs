//! `gpumem_trace.probe`'s report (one JSON document, measured on a GPU) and how it goes into a
//! GPU profile: the stack's versions, the cuBLAS workspace, the context, and the convolution
//! workspace table (added to what the profile already holds; a configuration probed again
//! takes the new figures).

use std::collections::BTreeMap;
use std::path::Path;

use gpumem_core::profile::{GpuProfile, Stack};
use gpumem_core::units::MIB;
use gpumem_core::workspace::ConvWorkspace;
use serde::Deserialize;

use crate::{BridgeError, TorchTracer};

/// The probe's report. Fields the profile does not use (SDPA kernels, benchmark mode, the
/// order of a backward's allocations) stay in the JSON for the reader.
#[derive(Debug, Clone, Deserialize)]
pub struct ProbeReport {
    pub stack: Stack,
    #[serde(default)]
    pub context: Vec<ContextPoint>,
    #[serde(default)]
    pub cublas: BTreeMap<String, Vec<u64>>,
    #[serde(default)]
    pub conv: ProbedConvs,
    /// NCCL's memory outside the allocator, where this torch has NCCL.
    #[serde(default)]
    pub nccl: Option<ProbedNccl>,
}

/// NCCL measured on `ranks` GPUs: its own memory once, and one more communicator's.
#[derive(Debug, Clone, Deserialize)]
pub struct ProbedNccl {
    pub ranks: u32,
    pub base_bytes: u64,
    pub communicator_bytes: u64,
}

/// Device memory in use outside PyTorch's allocator at a point of the probe.
#[derive(Debug, Clone, Deserialize)]
pub struct ContextPoint {
    pub at: String,
    pub used: u64,
    pub reserved: u64,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ProbedConvs {
    /// `cudnn.benchmark` off: the engine cuDNN's heuristics pick (PyTorch's default).
    #[serde(default)]
    pub heuristic: Vec<ProbedConv>,
    #[serde(default)]
    pub benchmark: Vec<ProbedConv>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ProbedConv {
    #[serde(flatten)]
    pub workspace: ConvWorkspace,
    /// Set when the GPU refused the configuration.
    #[serde(default)]
    pub error: Option<String>,
}

/// What applying a report changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub added: usize,
    pub replaced: usize,
    pub refused: usize,
}

impl ProbeReport {
    pub fn read(path: &Path) -> Result<ProbeReport, BridgeError> {
        let bytes = std::fs::read(path).map_err(|source| BridgeError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_slice(&bytes).map_err(|source| BridgeError::ProbeReport {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Device memory outside the allocator once the libraries a training job loads (CUDA,
    /// cuBLAS, cuDNN) are in: the largest such point of the probe before attention kernels.
    pub fn context_bytes(&self) -> Option<u64> {
        self.context
            .iter()
            .filter(|p| p.at != "sdpa")
            .map(|p| p.used.saturating_sub(p.reserved))
            .max()
    }

    /// Writes the report into `profile`: stack, cuBLAS workspace, context, NCCL's own memory
    /// (and a communicator's, where measured with peers: one rank's holds no peer buffers)
    /// and the `cudnn.benchmark`-off workspace table (merged by configuration and batch).
    pub fn apply(&self, profile: &mut GpuProfile) -> Applied {
        if let Some(n) = &self.nccl {
            profile.nccl_mib = n.base_bytes as f64 / MIB as f64;
            if n.ranks > 1 {
                profile.nccl_communicator_mib = n.communicator_bytes as f64 / MIB as f64;
            }
        }
        profile.stack = Some(self.stack.clone());
        if let Some(&ws) = self.cublas.get("mm").and_then(|v| v.first()) {
            profile.cublas_workspace_bytes = Some(ws);
        }
        if let Some(lt) = self.cublas.get("addmm_lt") {
            profile.cublaslt_workspace_bytes = Some(lt.iter().sum());
        }
        if let Some(ctx) = self.context_bytes() {
            profile.cuda_context_mib = ctx as f64 / MIB as f64;
        }
        self.apply_workspaces(profile)
    }

    /// Only the convolution workspace table (a daemon's probe of one job's convolutions leaves
    /// the calibrated context alone).
    pub fn apply_workspaces(&self, profile: &mut GpuProfile) -> Applied {
        let measured = self
            .conv
            .heuristic
            .iter()
            .filter(|c| c.error.is_none())
            .map(|c| c.workspace.clone());
        let (added, replaced) =
            gpumem_core::workspace::merge(&mut profile.conv_workspace, measured);
        Applied {
            added,
            replaced,
            refused: self
                .conv
                .heuristic
                .iter()
                .filter(|c| c.error.is_some())
                .count(),
        }
    }
}

/// How to run the probe on this machine's GPU.
#[derive(Debug, Clone, Default)]
pub struct ProbeRequest {
    /// CUDA device index (CUDA_VISIBLE_DEVICES for the probe).
    pub gpu: u32,
    /// Jobs whose convolutions to probe (`MODEL:BATCH[:PRECISION[:CxHxW]]` or measurement
    /// CSVs); none: the documented grid.
    pub models: Vec<String>,
    /// `off`, `on` or `both` (cudnn.benchmark).
    pub benchmark: String,
    /// Time budget of each cudnn.benchmark mode's convolutions, seconds (0: none); those past
    /// it stay unprobed.
    pub seconds: u64,
    /// Exactly these convolutions (configuration, batch) instead of `models`' or the grid's.
    pub configs: Vec<(String, u64)>,
    /// Only the convolutions: skip the attention-kernel cases and NCCL (a daemon's probe of
    /// one job, on a GPU other jobs share).
    pub convolutions_only: bool,
}

impl TorchTracer {
    /// Runs `python -m gpumem_trace.probe` on GPU `req.gpu` and reads its report.
    pub fn probe(&self, req: &ProbeRequest, out: &Path) -> Result<ProbeReport, BridgeError> {
        let mut cmd = self.module_command("gpumem_trace.probe")?;
        cmd.env("CUDA_VISIBLE_DEVICES", req.gpu.to_string())
            .arg("--out")
            .arg(out);
        if !req.configs.is_empty() {
            let list: Vec<serde_json::Value> = req
                .configs
                .iter()
                .map(|(c, n)| serde_json::json!({"config": c, "n": n}))
                .collect();
            let path = out.with_extension("configs.json");
            std::fs::write(
                &path,
                serde_json::to_vec(&list).expect("JSON of strings and numbers"),
            )
            .map_err(|source| BridgeError::Io {
                path: path.clone(),
                source,
            })?;
            cmd.arg("--configs").arg(path);
        } else if !req.models.is_empty() {
            cmd.arg("--models").args(&req.models);
        }
        if req.convolutions_only {
            cmd.args(["--no-sdpa", "--no-nccl"]);
        }
        if !req.benchmark.is_empty() {
            cmd.arg("--benchmark").arg(&req.benchmark);
        }
        if req.seconds > 0 {
            cmd.arg("--seconds").arg(req.seconds.to_string());
        }
        // The probe's own budget plus the imports and the context; a probe stuck in the driver
        // is killed rather than holding its GPU for ever.
        let limit = std::time::Duration::from_secs(if req.seconds > 0 {
            2 * req.seconds + 120
        } else {
            3600
        });
        let res = crate::output_within(cmd, limit).map_err(|source| BridgeError::Spawn {
            python: self.python.clone(),
            source,
        })?;
        let Some(res) = res else {
            return Err(BridgeError::Crashed {
                what: "probe",
                how: format!("killed after {} s", limit.as_secs()),
                tail: String::new(),
            });
        };
        if !res.status.success() {
            let msg = crate::tail(&String::from_utf8_lossy(&res.stderr), 3);
            return Err(match res.status.code() {
                Some(2) => BridgeError::Reference(msg),
                _ => BridgeError::Crashed {
                    what: "probe",
                    how: res.status.to_string(),
                    tail: msg,
                },
            });
        }
        ProbeReport::read(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REPORT: &str = r#"{"stack":{"gpu":"NVIDIA H200","capability":"9.0","torch":"2.11.0+cu130","cuda":"13.0","cudnn":91900,"driver":"580.159.04"},
      "context":[{"at":"cuda","used":554500096,"reserved":2097152},{"at":"cudnn","used":774701056,"reserved":37748736},{"at":"sdpa","used":984416256,"reserved":146800640}],
      "cublas":{"mm":[33554432],"addmm_lt":[1048576]},
      "conv":{"heuristic":[
        {"config":"A","n":32,"fwd":[100],"bwd_data":[],"bwd_filter":[7],"backward_sequence":[[1,false]]},
        {"config":"B","n":32,"error":"RuntimeError: no engine"}],
       "benchmark":[{"config":"A","n":32,"fwd":[50],"search":{"fwd":900}}]},
      "sdpa":[{"dtype":"float16","head_dim":64,"mask":"none","gqa":false,"kernel":"cudnn"}]}"#;

    /// NCCL's own memory goes into the profile from any probe; a communicator's only from one
    /// with peers (a one-rank communicator holds no peer buffers).
    #[test]
    fn nccl_is_taken_as_far_as_the_probe_measured_it() {
        let mut p = gpumem_core::profile::builtin("h200").unwrap();
        let with = |nccl: &str| -> ProbeReport {
            serde_json::from_str(&REPORT.replacen('{', &format!("{{\"nccl\":{nccl},"), 1)).unwrap()
        };
        with(r#"{"ranks":1,"base_bytes":209715200,"communicator_bytes":2097152}"#).apply(&mut p);
        assert_eq!((p.nccl_mib, p.nccl_communicator_mib), (200.0, 0.0));
        with(r#"{"ranks":8,"base_bytes":209715200,"communicator_bytes":314572800}"#).apply(&mut p);
        assert_eq!((p.nccl_mib, p.nccl_communicator_mib), (200.0, 300.0));
        let back = GpuProfile::from_toml(&p.to_toml()).unwrap();
        assert_eq!(back.nccl_communicator_mib, 300.0);
    }

    #[test]
    fn a_report_goes_into_the_profile_and_a_second_adds_to_its_table() {
        let r: ProbeReport = serde_json::from_str(REPORT).unwrap();
        let mut p = gpumem_core::profile::builtin("h200").unwrap();
        assert_eq!(
            r.apply(&mut p),
            Applied {
                added: 1,
                replaced: 0,
                refused: 1
            }
        );
        assert_eq!(
            (p.cublas_workspace(), p.cublaslt_workspace_bytes),
            (33554432, Some(1048576))
        );
        assert_eq!(p.stack.as_ref().unwrap().cudnn, 91900);
        assert_eq!(
            p.context_bytes(),
            774701056 - 37748736,
            "the libraries' context, before attention kernels"
        );
        assert_eq!(p.conv_workspace[0].fwd, vec![100], "cudnn.benchmark off");
        let mut again = r.clone();
        again.conv.heuristic[0].workspace.fwd = vec![120];
        let c = ConvWorkspace {
            config: "C".into(),
            n: 8,
            fwd: vec![],
            bwd_data: vec![1],
            bwd_filter: vec![],
        };
        again.conv.heuristic[1] = ProbedConv {
            workspace: c,
            error: None,
        };
        assert_eq!(
            again.apply(&mut p),
            Applied {
                added: 1,
                replaced: 1,
                refused: 0
            }
        );
        assert_eq!(p.conv_workspace.len(), 2);
        assert_eq!(p.conv_workspace[0].fwd, vec![120]);
        let back = GpuProfile::from_toml(&p.to_toml()).unwrap();
        assert_eq!(back, p, "the table survives the TOML round trip");
    }
}
