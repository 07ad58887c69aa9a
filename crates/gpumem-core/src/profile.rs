//! GPU profiles as data: a device plus the software stack's fixed costs.
//!
//! [`GpuProfile`] holds capacity, SM count, peak rates, bandwidth, the CUDA context (the fitted
//! fixed cost), cuBLAS workspace sizing, the attention kernel the GPU runs, allocator options and
//! the upper-bound margins. [`catalogue`] returns the built-in profiles (profiles/gpus.toml,
//! embedded); [`GpuProfile::from_toml`] reads a user's file, such as one `gpumem calibrate` wrote.

use serde::{Deserialize, Serialize};

use crate::allocator::{AllocatorConfig, AllocatorConfigError};
use crate::trace::ConvPass;
use crate::units::{MIB, mib_to_bytes};
use crate::workspace::{ConvWorkspace, WorkspacePolicy, WorkspaceTable};

const BUILTIN: &str = include_str!("../profiles/gpus.toml");

/// PyTorch's default cuBLAS workspace per (handle, stream) below Hopper (A100, V100, T4, ...):
/// `CUBLAS_WORKSPACE_CONFIG` unset means `:4096:2:16:8`, 2 × 4 MiB + 8 × 16 KiB = 8,519,680 bytes
/// (spec §2.3.3).
pub const CUBLAS_WORKSPACE_BYTES: u64 = 8_519_680;
/// The same default on Hopper (compute capability 9.x): 4 MiB × 8 = 32 MiB.
pub const CUBLAS_WORKSPACE_HOPPER_BYTES: u64 = 32 * MIB;

/// Peak dense throughput in TFLOP/s per precision.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tflops {
    pub fp32: f64,
    pub tf32: f64,
    pub fp16: f64,
    pub bf16: f64,
}

/// A scaled-dot-product-attention kernel a profile forces on its jobs (as
/// `torch.nn.attention.sdpa_kernel` would); without one the tracer picks the kernel PyTorch's
/// dispatch picks for the GPU's compute capability, the installed torch and the inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum SdpaBackend {
    Flash,
    #[serde(alias = "mem_efficient")]
    Efficient,
    Cudnn,
    Math,
}

impl SdpaBackend {
    /// The name in profiles and on the tracer's command line.
    pub fn name(self) -> &'static str {
        match self {
            SdpaBackend::Flash => "flash",
            SdpaBackend::Efficient => "efficient",
            SdpaBackend::Cudnn => "cudnn",
            SdpaBackend::Math => "math",
        }
    }
}

fn default_workspaces() -> u32 {
    2
}
fn default_bound_fixed() -> f64 {
    64.0
}
fn default_bound_relative() -> f64 {
    0.04
}
fn default_conv_workspace_bound() -> f64 {
    4.0
}
fn is_zero(v: &f64) -> bool {
    *v == 0.0
}
fn default_torch() -> String {
    "2.1".into()
}

/// One GPU and software stack. Field units are those of the TOML file (MiB at the edges).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuProfile {
    pub name: String,
    pub display: String,
    pub compute_capability: String,
    pub capacity_mib: u64,
    pub sm_count: u32,
    pub tflops: Tflops,
    pub memory_bandwidth_gbs: f64,
    /// Board power limit and idle draw, watts (for energy estimates).
    #[serde(default)]
    pub power_w: f64,
    #[serde(default)]
    pub idle_power_w: f64,
    /// Memory the process holds outside PyTorch's allocator (context, kernels, libraries).
    pub cuda_context_mib: f64,
    /// Other memory outside the allocator (NCCL buffers, cuFFT plans…).
    #[serde(default)]
    pub non_allocator_mib: f64,
    /// What loading cuDNN adds outside the allocator, for jobs that run a convolution, where
    /// `cuda_context_mib` was fitted on jobs that never load it (0 where the context includes
    /// it, as a probed one does).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cudnn_context_mib: f64,
    /// What NCCL holds outside the allocator in each process of a distributed job (DDP, FSDP,
    /// ZeRO, …) once, whatever its communicators, where measured on a machine with several of
    /// these GPUs (0: not known, not included).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub nccl_mib: f64,
    /// What each NCCL communicator (a process group a rank's collectives run on: FSDP's, a
    /// tensor-parallel group, HSDP's replicas, …) holds outside the allocator beyond
    /// `nccl_mib`: its channels' buffers (0: not known, not included; docs/probe.md).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub nccl_communicator_mib: f64,
    /// Overrides the per-architecture cuBLAS workspace size (bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cublas_workspace_bytes: Option<u64>,
    /// The cuBLASLt workspace a thread keeps once it runs a matmul with a fused bias (bytes;
    /// measured by `gpumem probe`). Unset: not modelled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cublaslt_workspace_bytes: Option<u64>,
    /// cuBLAS workspaces in a training step (main thread + autograd thread).
    #[serde(default = "default_workspaces")]
    pub cublas_workspaces: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sdpa: Option<SdpaBackend>,
    /// `PYTORCH_CUDA_ALLOC_CONF` of the jobs that will run here.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub allocator: String,
    /// PyTorch release whose behaviour the traces follow (optimizer temporaries, zero_grad).
    #[serde(default = "default_torch")]
    pub torch: String,
    /// Upper bound = estimate + bound_fixed_mib + bound_relative × (estimate − context).
    #[serde(default = "default_bound_fixed")]
    pub bound_fixed_mib: f64,
    #[serde(default = "default_bound_relative")]
    pub bound_relative: f64,
    /// The bound also allows this many times the largest convolution output for cuDNN's
    /// workspaces, which cuDNN sizes at run time by the algorithm it picks (not modelled).
    #[serde(default = "default_conv_workspace_bound")]
    pub conv_workspace_bound: f64,
    /// Where the fixed costs came from (written by `gpumem calibrate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<String>,
    /// The software stack `gpumem probe` measured (its workspace table holds for this stack).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stack: Option<Stack>,
    /// How convolution workspaces the table has nothing to go by are sized (cuDNN's engines
    /// on this architecture and cuDNN major version); unset: not modelled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conv_workspace_policy: Option<WorkspacePolicy>,
    /// Convolution workspaces measured by `gpumem probe`, per configuration and batch.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conv_workspace: Vec<ConvWorkspace>,
}

/// The GPU and library versions a probe ran on (as its report states them; other keys there
/// are ignored).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stack {
    pub gpu: String,
    #[serde(default)]
    pub driver: String,
    pub cuda: String,
    pub torch: String,
    /// cuDNN as torch reports it (91900 = 9.19.0).
    pub cudnn: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ProfileFile {
    gpu: Vec<GpuProfile>,
}

/// Why a profile could not be loaded or found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProfileError {
    #[error("unknown GPU `{name}`; known: {known}")]
    Unknown { name: String, known: String },
    /// Not TOML of a profile file's shape (toml's message, on one line).
    #[error("bad profile: {}", .0.to_string().replace('\n', " ").trim())]
    Toml(Box<toml::de::Error>),
    #[error("bad profile: expected one [[gpu]] table, found {0}")]
    NotOne(usize),
    #[error("bad profile `{name}`: {message}")]
    Invalid { name: String, message: &'static str },
    #[error("bad profile `{name}`: {source}")]
    Allocator {
        name: String,
        source: AllocatorConfigError,
    },
}

impl GpuProfile {
    pub fn capacity_bytes(&self) -> u64 {
        self.capacity_mib * MIB
    }
    pub fn context_bytes(&self) -> u64 {
        mib_to_bytes(self.cuda_context_mib)
    }
    pub fn non_allocator_bytes(&self) -> u64 {
        mib_to_bytes(self.non_allocator_mib)
    }
    /// Compute capability major version (8 for "8.0").
    pub fn cc_major(&self) -> u32 {
        self.compute_capability
            .split('.')
            .next()
            .and_then(|m| m.parse().ok())
            .unwrap_or(0)
    }
    /// PyTorch's default cuBLAS workspace for this architecture (spec §2.3.3).
    pub fn cublas_workspace(&self) -> u64 {
        self.cublas_workspace_bytes
            .unwrap_or(if self.cc_major() == 9 {
                CUBLAS_WORKSPACE_HOPPER_BYTES
            } else {
                CUBLAS_WORKSPACE_BYTES
            })
    }
    /// The convolution workspaces as the replay looks them up: the probed table, then the
    /// policy.
    pub fn workspaces(&self) -> WorkspaceTable<'_> {
        WorkspaceTable::new(&self.conv_workspace, self.conv_workspace_policy)
    }
    pub fn allocator_config(&self) -> Result<AllocatorConfig, ProfileError> {
        AllocatorConfig::parse(&self.allocator).map_err(|source| ProfileError::Allocator {
            name: self.name.clone(),
            source,
        })
    }
    /// Bytes the caching allocator may reserve before cudaMalloc fails.
    pub fn allocator_capacity(&self) -> u64 {
        self.capacity_bytes()
            .saturating_sub(self.context_bytes() + self.non_allocator_bytes())
    }
    /// Memory a job holds outside the allocator: the context, other fixed costs, cuDNN's share
    /// where the job loads it, NCCL's where it is one process of a distributed job (its own,
    /// and each of its `communicators`' buffers).
    pub fn fixed_bytes(&self, loads_cudnn: bool, communicators: u32) -> u64 {
        self.context_bytes()
            + self.non_allocator_bytes()
            + if loads_cudnn {
                mib_to_bytes(self.cudnn_context_mib)
            } else {
                0
            }
            + if communicators > 0 {
                mib_to_bytes(self.nccl_mib)
                    + u64::from(communicators) * mib_to_bytes(self.nccl_communicator_mib)
            } else {
                0
            }
    }

    fn validate(&self) -> Result<(), ProfileError> {
        let bad = |message: &'static str| {
            Err(ProfileError::Invalid {
                name: self.name.clone(),
                message,
            })
        };
        if !(1..=MAX_CAPACITY_MIB).contains(&self.capacity_mib) {
            return bad("capacity_mib must be between 1 and 16777216 (16 TiB)");
        }
        if !(self.cuda_context_mib >= 0.0 && self.cuda_context_mib < self.capacity_mib as f64) {
            return bad("cuda_context_mib must be between 0 and capacity_mib");
        }
        // Every other size at most the GPU, every factor finite: sums of them stay in bytes.
        let within = |x: f64, max: f64| x.is_finite() && (0.0..=max).contains(&x);
        let capacity = self.capacity_mib as f64;
        if ![
            self.non_allocator_mib,
            self.cudnn_context_mib,
            self.nccl_mib,
            self.nccl_communicator_mib,
            self.bound_fixed_mib,
        ]
        .iter()
        .all(|&x| within(x, capacity))
        {
            return bad(
                "non_allocator_mib, cudnn_context_mib, nccl_mib, nccl_communicator_mib and bound_fixed_mib must be between 0 and capacity_mib",
            );
        }
        if !within(self.bound_relative, 10.0) || !within(self.conv_workspace_bound, 100.0) {
            return bad(
                "bound_relative must be between 0 and 10, conv_workspace_bound between 0 and 100",
            );
        }
        let t = &self.tflops;
        if ![
            self.memory_bandwidth_gbs,
            self.power_w,
            self.idle_power_w,
            t.fp32,
            t.tf32,
            t.fp16,
            t.bf16,
        ]
        .iter()
        .all(|&x| within(x, 1e9))
        {
            return bad(
                "tflops, memory_bandwidth_gbs, power_w and idle_power_w must be between 0 and 1e9",
            );
        }
        if [self.cublas_workspace_bytes, self.cublaslt_workspace_bytes]
            .iter()
            .flatten()
            .any(|&b| b > crate::trace::MAX_ALLOC_BYTES)
            || self.cublas_workspaces > 64
        {
            return bad("cuBLAS workspaces must be at most 1 PiB, and at most 64 of them");
        }
        if self.conv_workspace.iter().any(|e| {
            e.n == 0
                || ConvPass::ALL.iter().any(|&p| {
                    e.sizes(p)
                        .iter()
                        .any(|&b| b > crate::trace::MAX_ALLOC_BYTES)
                })
        }) {
            return bad("conv_workspace entries need n of at least 1 and sizes of at most 1 PiB");
        }
        if let Some(Err(message)) = self.conv_workspace_policy.map(|p| p.validate()) {
            return bad(message);
        }
        self.allocator_config()?;
        Ok(())
    }

    /// Reads a TOML file holding one or more `[[gpu]]` tables; returns them all.
    pub fn parse_many(text: &str) -> Result<Vec<GpuProfile>, ProfileError> {
        let file: ProfileFile =
            toml::from_str(text).map_err(|e| ProfileError::Toml(Box::new(e)))?;
        for p in &file.gpu {
            p.validate()?;
        }
        Ok(file.gpu)
    }

    /// Reads a file with exactly one `[[gpu]]` table.
    pub fn from_toml(text: &str) -> Result<GpuProfile, ProfileError> {
        let mut all = Self::parse_many(text)?;
        if all.len() != 1 {
            return Err(ProfileError::NotOne(all.len()));
        }
        Ok(all.remove(0))
    }

    pub fn to_toml(&self) -> String {
        #[derive(Serialize)]
        struct Out<'a> {
            gpu: [&'a GpuProfile; 1],
        }
        toml::to_string(&Out { gpu: [self] }).expect("profiles serialize")
    }
}

/// The largest GPU a profile may describe (16 TiB), as the daemon's largest request.
pub const MAX_CAPACITY_MIB: u64 = 16 << 20;

/// The built-in profiles.
pub fn catalogue() -> Vec<GpuProfile> {
    GpuProfile::parse_many(BUILTIN).expect("built-in profiles are valid")
}

/// A built-in profile by name (case-insensitive; `_` and `-` are the same).
pub fn builtin(name: &str) -> Result<GpuProfile, ProfileError> {
    let norm = |s: &str| s.to_ascii_lowercase().replace('_', "-");
    let all = catalogue();
    let wanted = norm(name);
    all.iter()
        .find(|p| norm(&p.name) == wanted)
        .cloned()
        .ok_or_else(|| ProfileError::Unknown {
            name: name.to_string(),
            known: all
                .iter()
                .map(|p| p.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalogue_has_the_required_gpus() {
        let names: Vec<String> = catalogue().into_iter().map(|p| p.name).collect();
        for n in [
            "a100-40gb",
            "a100-80gb",
            "h100-80gb-sxm",
            "h100-80gb-pcie",
            "h200",
            "v100-16gb",
            "v100-32gb",
            "t4",
            "l4",
            "a10",
            "l40s",
            "rtx3090",
            "rtx4090",
        ] {
            assert!(names.iter().any(|x| x == n), "{n} missing");
        }
    }

    #[test]
    fn workspace_follows_architecture() {
        assert_eq!(builtin("A100_40GB").unwrap().cublas_workspace(), 8_519_680);
        assert_eq!(
            builtin("h100-80gb-sxm").unwrap().cublas_workspace(),
            32 << 20
        );
    }

    #[test]
    fn round_trip_and_errors() {
        let p = builtin("t4").unwrap();
        assert_eq!(GpuProfile::from_toml(&p.to_toml()).unwrap(), p);
        let e = builtin("b300").unwrap_err().to_string();
        assert!(e.starts_with("unknown GPU `b300`; known: a100-40gb"), "{e}");
        let e = GpuProfile::from_toml(
            &p.to_toml()
                .replace("capacity_mib = 15360", "capacity_mib = 0"),
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad profile `t4`: capacity_mib must be between 1 and 16777216 (16 TiB)"
        );
        // Found by the fuzz harness: a bound factor past f64's integers overflowed the bound.
        let e = GpuProfile::from_toml(&p.to_toml().replace(
            "conv_workspace_bound = 4.0",
            "conv_workspace_bound = 1.8e20",
        ))
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "bad profile `t4`: bound_relative must be between 0 and 10, conv_workspace_bound between 0 and 100"
        );
        assert!(
            GpuProfile::from_toml("[[gpu]]\nname = 3")
                .unwrap_err()
                .to_string()
                .starts_with("bad profile:")
        );
    }
}
