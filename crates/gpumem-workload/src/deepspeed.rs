//! DeepSpeed as its users describe a job: the JSON config they already have (read into gpumem's
//! ZeRO [`Strategy`] (`Strategy::zero`) and loop options), and DeepSpeed's own model-state formulas
//! (`estimate_zero2/3_model_states_mem_needs`), reproduced to the byte so gpumem's per-rank
//! estimate can be shown beside the figure DeepSpeed users know.

use gpumem_core::job::Optimizer;
use gpumem_core::job::Precision;
use serde_json::Value;

use crate::launch::{LaunchConfig, LaunchConfigError, LoopSettings, bad};
use crate::{OptionError, Strategy, Zero, ZeroStage};
use gpumem_core::job::Engine;

/// What a DeepSpeed config says about a job.
#[derive(Debug, Clone, PartialEq)]
pub struct DeepSpeedJob {
    /// ZeRO's stage and settings; its world size is the caller's.
    pub stage: ZeroStage,
    pub zero: Zero,
    pub stated: LoopSettings,
    /// `train_batch_size / (micro-batch × accumulation)`, where all three are stated.
    pub world_size: Option<u32>,
    /// Stage 3 saves the model's 16-bit weights consolidated
    /// (`stage3_gather_16bit_weights_on_model_save`), gathered module by module.
    pub gathers_16bit_on_save: bool,
}

impl DeepSpeedJob {
    /// The strategy on `world_size` ranks.
    pub fn strategy(&self, world_size: u32) -> Result<Strategy, OptionError> {
        Strategy::zero(self.stage, world_size, self.zero)
    }

    /// The launch on `world_size` ranks.
    pub fn launch(&self, world_size: u32) -> Result<LaunchConfig, OptionError> {
        Ok(LaunchConfig {
            strategy: Some(self.strategy(world_size)?),
            stated: self.stated,
        })
    }
}

/// A count as DeepSpeed takes it: an integer or a float such as `5e8`; `"auto"` is `None`.
fn count(v: &Value, key: &str) -> Result<Option<u64>, LaunchConfigError> {
    match v {
        Value::String(s) if s == "auto" => Ok(None),
        Value::Number(n) => match (n.as_u64(), n.as_f64()) {
            (Some(u), _) => Ok(Some(u)),
            (None, Some(f)) if f >= 0.0 && f.fract() == 0.0 && f < 1.8e19 => Ok(Some(f as u64)),
            _ => Err(bad(key, format!("{n} is not a whole number of elements"))),
        },
        other => Err(bad(key, format!("{other} is not a number or \"auto\""))),
    }
}

fn flag(v: &Value, key: &str) -> Result<Option<bool>, LaunchConfigError> {
    match v {
        Value::Bool(b) => Ok(Some(*b)),
        Value::String(s) if s == "auto" => Ok(None),
        other => Err(bad(key, format!("{other} is not true, false or \"auto\""))),
    }
}

/// `offload_optimizer`/`offload_param`: a device other than `none` offloads.
fn offload(section: &Value, key: &str) -> Result<bool, LaunchConfigError> {
    match section.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(o) => match o.get("device").and_then(Value::as_str) {
            None | Some("none") => Ok(false),
            Some("cpu" | "nvme") => Ok(true),
            Some(d) => Err(bad(
                &format!("zero_optimization.{key}.device"),
                format!("`{d}` is not none, cpu or nvme"),
            )),
        },
    }
}

/// Reads a DeepSpeed config (the JSON a `deepspeed` launch or Hugging Face's `--deepspeed`
/// takes). Keys that do not change memory are ignored; ZeRO stage 0 is refused (plain data
/// parallelism: `--strategy ddp`).
pub fn read_config(text: &str) -> Result<DeepSpeedJob, LaunchConfigError> {
    let root: Value = serde_json::from_str(text)?;
    if !root.is_object() {
        return Err(LaunchConfigError::NotJsonObject);
    }
    let z = root
        .get("zero_optimization")
        .cloned()
        .unwrap_or(Value::Object(Default::default()));
    let stage = match z.get("stage") {
        None => {
            return Err(bad(
                "zero_optimization.stage",
                "missing (gpumem models ZeRO stages 1, 2 and 3)",
            ));
        }
        Some(v) => count(v, "zero_optimization.stage")?
            .ok_or_else(|| bad("zero_optimization.stage", "must be stated, not \"auto\""))?,
    };
    let stage = match stage {
        1 => ZeroStage::One,
        2 => ZeroStage::Two,
        3 => ZeroStage::Three,
        0 => {
            return Err(bad(
                "zero_optimization.stage",
                "stage 0 is plain data parallelism: estimate it with --strategy ddp",
            ));
        }
        s => {
            return Err(bad(
                "zero_optimization.stage",
                format!("{s} is not 1, 2 or 3"),
            ));
        }
    };
    let mut zero = Zero::default();
    let counts: [(&str, &mut u64); 5] = [
        ("reduce_bucket_size", &mut zero.reduce_bucket_size),
        (
            "stage3_prefetch_bucket_size",
            &mut zero.prefetch_bucket_size,
        ),
        ("stage3_max_live_parameters", &mut zero.max_live_parameters),
        ("stage3_max_reuse_distance", &mut zero.max_reuse_distance),
        (
            "stage3_param_persistence_threshold",
            &mut zero.param_persistence_threshold,
        ),
    ];
    for (key, slot) in counts {
        if let Some(n) = z
            .get(key)
            .map(|v| count(v, &format!("zero_optimization.{key}")))
            .transpose()?
            .flatten()
        {
            *slot = n;
        }
    }
    if zero.reduce_bucket_size == 0 {
        return Err(bad(
            "zero_optimization.reduce_bucket_size",
            "must be at least 1",
        ));
    }
    if let Some(v) = z.get("overlap_comm") {
        zero.overlap_comm = flag(v, "zero_optimization.overlap_comm")?;
    }
    if let Some(v) = z.get("contiguous_gradients") {
        zero.contiguous_gradients =
            flag(v, "zero_optimization.contiguous_gradients")?.unwrap_or(true);
    }
    // `cpu_offload: true` is the older spelling of offloading the optimizer.
    let legacy = match z.get("cpu_offload") {
        Some(v) => flag(v, "zero_optimization.cpu_offload")?.unwrap_or(false),
        None => false,
    };
    let mut gathers_16bit_on_save = false;
    for key in [
        "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save",
    ] {
        if let Some(v) = z.get(key) {
            gathers_16bit_on_save |= flag(v, &format!("zero_optimization.{key}"))?.unwrap_or(false);
        }
    }
    zero.offload_optimizer = legacy || offload(&z, "offload_optimizer")?;
    zero.offload_param = offload(&z, "offload_param")?;
    if zero.offload_param && stage != ZeroStage::Three {
        return Err(bad("zero_optimization.offload_param", "needs stage 3"));
    }

    // `None`: not stated (absent, or "auto"), which leaves the command line's (or accelerate's)
    // precision; DeepSpeed's own default is fp32.
    let enabled = |section: &str| -> Result<Option<bool>, LaunchConfigError> {
        match root.get(section).and_then(|s| s.get("enabled")) {
            None => Ok(None),
            Some(v) => flag(v, &format!("{section}.enabled")),
        }
    };
    // `bfloat16` is DeepSpeed's other spelling of `bf16`.
    let bf16 = match (enabled("bf16")?, enabled("bfloat16")?) {
        (Some(true), _) | (_, Some(true)) => Some(true),
        (a, b) => a.or(b),
    };
    // DeepSpeed's bf16/fp16 modes keep 16-bit weights (gpumem's pure precisions) with an fp32
    // master copy in the ZeRO optimizer.
    let precision = match (bf16, enabled("fp16")?) {
        (Some(true), Some(true)) => {
            return Err(bad("fp16.enabled", "bf16 and fp16 are both enabled"));
        }
        (Some(true), _) => Some(Precision::Bf16),
        (_, Some(true)) => Some(Precision::Fp16),
        (None, None) => None,
        _ => Some(Precision::Fp32),
    };
    let optimizer = match root.get("optimizer").and_then(|o| o.get("type")) {
        None => None,
        Some(Value::String(t)) => Some(match t.to_ascii_lowercase().as_str() {
            "adam" | "fusedadam" | "cpuadam" | "deepspeedcpuadam" => Optimizer::ADAM,
            "adamw" => Optimizer::ADAMW,
            "sgd" => Optimizer::SGD,
            other => {
                return Err(bad(
                    "optimizer.type",
                    format!("`{other}` is not modelled (Adam, AdamW, SGD)"),
                ));
            }
        }),
        Some(other) => return Err(bad("optimizer.type", format!("{other} is not a name"))),
    };
    let get = |key: &str| {
        root.get(key)
            .map(|v| count(v, key))
            .transpose()
            .map(Option::flatten)
    };
    let micro_batch = get("train_micro_batch_size_per_gpu")?;
    let grad_accum = match get("gradient_accumulation_steps")? {
        Some(n) => Some(u32::try_from(n).ok().filter(|n| *n >= 1).ok_or_else(|| {
            bad(
                "gradient_accumulation_steps",
                format!("{n} is out of range"),
            )
        })?),
        None => None,
    };
    if micro_batch == Some(0) {
        return Err(bad("train_micro_batch_size_per_gpu", "must be at least 1"));
    }
    let world_size = match (get("train_batch_size")?, micro_batch, grad_accum) {
        (Some(total), Some(m), Some(g)) => {
            let per_step = m * u64::from(g);
            if !total.is_multiple_of(per_step) {
                return Err(bad(
                    "train_batch_size",
                    format!("{total} is not a multiple of micro-batch {m} × accumulation {g}"),
                ));
            }
            Some(
                u32::try_from(total / per_step)
                    .map_err(|_| bad("train_batch_size", "implies too many ranks"))?,
            )
        }
        _ => None,
    };
    Ok(DeepSpeedJob {
        stage,
        zero,
        stated: LoopSettings {
            precision,
            optimizer,
            micro_batch,
            grad_accum,
        },
        world_size,
        gathers_16bit_on_save: gathers_16bit_on_save && stage == ZeroStage::Three,
    })
}

/// Bytes DeepSpeed's estimators give for one GPU and for the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelStates {
    pub gpu_bytes: u64,
    pub cpu_bytes: u64,
}

/// DeepSpeed's `additional_buffer_factor` default.
pub const BUFFER_FACTOR: f64 = 1.5;

/// Python's `int(x)` of a non-negative float.
fn int(x: f64) -> u64 {
    x as u64
}

/// `estimate_zero2_model_states_mem_needs(total_params, num_gpus_per_node, num_nodes,
/// cpu_offload, additional_buffer_factor)` (deepspeed/runtime/zero/stage_1_and_2.py): 16-bit
/// parameters on every GPU and 18 bytes per parameter (16-bit and fp32 gradients, fp32
/// parameters, Adam's two moments) partitioned, or only the 16-bit parameters when offloaded.
/// Python's float arithmetic, to the byte.
pub fn zero2_model_states(
    total_params: u64,
    gpus_per_node: u64,
    nodes: u64,
    cpu_offload: bool,
    buffer_factor: f64,
) -> ModelStates {
    let (p, gpus) = (total_params as f64, (nodes * gpus_per_node) as f64);
    if cpu_offload {
        ModelStates {
            gpu_bytes: 2 * total_params,
            cpu_bytes: int(p * (4.0 * gpus).max(16.0) * buffer_factor),
        }
    } else {
        ModelStates {
            gpu_bytes: 2 * total_params + int(18.0 * p / gpus),
            cpu_bytes: int(p * 4.0 * gpus_per_node as f64 * buffer_factor),
        }
    }
}

/// `estimate_zero3_model_states_mem_needs(total_params, largest_layer_params, num_gpus_per_node,
/// num_nodes, cpu_offload, cpu_offload_params, zero_init, additional_buffer_factor)`
/// (deepspeed/runtime/zero/stage3.py): the largest layer's gathered 16-bit parameters and
/// gradients (4 bytes each) plus the partitioned states; Python's float arithmetic, to the byte.
#[allow(clippy::too_many_arguments)]
pub fn zero3_model_states(
    total_params: u64,
    largest_layer_params: u64,
    gpus_per_node: u64,
    nodes: u64,
    cpu_offload: bool,
    cpu_offload_params: bool,
    zero_init: bool,
    buffer_factor: f64,
) -> ModelStates {
    let (p, gpus, per_node) = (
        total_params as f64,
        (nodes * gpus_per_node) as f64,
        gpus_per_node as f64,
    );
    let gpus_factor = 1.0 / nodes as f64;
    let largest = 4 * largest_layer_params;
    let (gpu_bytes, cpu_bytes) = match (cpu_offload, cpu_offload_params) {
        (true, true) => (
            largest,
            if zero_init {
                p * 18.0 * gpus_factor * buffer_factor
            } else {
                p * (4.0 * per_node).max(18.0 * gpus_factor) * buffer_factor
            },
        ),
        (true, false) => (
            largest + int(2.0 * p / gpus),
            if zero_init {
                p * 16.0 * gpus_factor * buffer_factor
            } else {
                p * (4.0 * per_node).max(16.0 * gpus_factor) * buffer_factor
            },
        ),
        (false, _) => (
            largest + int(18.0 * p / gpus),
            if zero_init {
                largest_layer_params as f64 * 4.0 * per_node * buffer_factor
            } else {
                p * 4.0 * per_node * buffer_factor
            },
        ),
    };
    ModelStates {
        gpu_bytes,
        cpu_bytes: int(cpu_bytes),
    }
}

/// DeepSpeed's figure for a ZeRO-2 or ZeRO-3 job of `world_size` ranks on one node, as its
/// `estimate_zero*_model_states_mem_needs` would give it for the config's offload settings
/// (zero.Init assumed for stage 3); `None` for other strategies.
pub fn model_states(
    strategy: Strategy,
    total_params: u64,
    largest_layer_params: u64,
) -> Option<ModelStates> {
    let world_size = strategy.world_size();
    match strategy.engine() {
        Engine::Zero {
            stage: ZeroStage::Two,
            zero,
        } => Some(zero2_model_states(
            total_params,
            u64::from(world_size),
            1,
            zero.offload_optimizer,
            BUFFER_FACTOR,
        )),
        Engine::Zero {
            stage: ZeroStage::Three,
            zero,
        } => Some(zero3_model_states(
            total_params,
            largest_layer_params,
            u64::from(world_size),
            1,
            zero.offload_optimizer,
            zero.offload_param,
            true,
            BUFFER_FACTOR,
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DeepSpeed's own figures, from its functions as published (deepspeed/runtime/zero/
    /// stage_1_and_2.py and stage3.py, as of August 2026), for the configurations its docs walk through
    /// (t5-3b: 2,851,598,336 parameters, largest layer 32,899,072; bigscience/T0_3B alike) and
    /// uneven ones where Python's float division truncates.
    #[test]
    fn deepspeed_model_state_formulas_to_the_byte() {
        let (p, l) = (2_851_598_336u64, 32_899_072u64);
        // estimate_zero2_model_states_mem_needs(p, 8, 1, False) = (cpu, gpu)
        assert_eq!(
            zero2_model_states(p, 8, 1, false, 1.5),
            ModelStates {
                gpu_bytes: 2 * p + 6_416_096_256,
                cpu_bytes: 136_876_720_128
            }
        );
        assert_eq!(
            zero2_model_states(p, 8, 1, true, 1.5),
            ModelStates {
                gpu_bytes: 5_703_196_672,
                cpu_bytes: 136_876_720_128
            }
        );
        assert_eq!(
            zero2_model_states(p, 1, 1, true, 1.5),
            ModelStates {
                gpu_bytes: 5_703_196_672,
                cpu_bytes: 68_438_360_064
            }
        );
        assert_eq!(
            zero2_model_states(p, 1, 1, false, 1.5),
            ModelStates {
                gpu_bytes: 57_031_966_720,
                cpu_bytes: 17_109_590_016
            }
        );
        // 7 GPUs over 1,000,000,007 parameters: 18·p/7 = 2,571,428,589.43… → 2,571,428,589.
        assert_eq!(
            zero2_model_states(1_000_000_007, 7, 1, false, 1.5).gpu_bytes,
            2_000_000_014 + 2_571_428_589
        );
        // estimate_zero3_model_states_mem_needs(p, l, 8, 1, offload, offload_params, zero_init)
        assert_eq!(
            zero3_model_states(p, l, 8, 1, false, false, true, 1.5),
            ModelStates {
                gpu_bytes: 131_596_288 + 6_416_096_256,
                cpu_bytes: 1_579_155_456
            }
        );
        assert_eq!(
            zero3_model_states(p, l, 8, 1, false, false, false, 1.5).cpu_bytes,
            136_876_720_128
        );
        assert_eq!(
            zero3_model_states(p, l, 8, 1, true, true, true, 1.5),
            ModelStates {
                gpu_bytes: 131_596_288,
                cpu_bytes: 76_993_155_072
            }
        );
        assert_eq!(
            zero3_model_states(p, l, 8, 1, true, false, true, 1.5),
            ModelStates {
                gpu_bytes: 131_596_288 + 712_899_584,
                cpu_bytes: 68_438_360_064
            }
        );
        assert_eq!(
            zero3_model_states(p, l, 8, 1, true, true, false, 1.5).cpu_bytes,
            136_876_720_128
        );
        assert_eq!(
            zero3_model_states(p, l, 4, 2, true, true, true, 1.5).cpu_bytes,
            38_496_577_536
        );
        assert_eq!(
            zero3_model_states(1_000_000_007, 3, 7, 1, false, false, true, 1.5).gpu_bytes,
            12 + 2_571_428_589
        );
    }

    #[test]
    fn a_config_as_users_write_it() {
        let job = read_config(
            r#"{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                "bf16": {"enabled": true}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "zero_optimization": {"stage": 3, "overlap_comm": true, "reduce_bucket_size": 5e8,
                  "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": 1e4,
                  "offload_optimizer": {"device": "cpu", "pin_memory": true}}}"#,
        )
        .unwrap();
        assert_eq!((job.stage, job.world_size), (ZeroStage::Three, Some(8)));
        assert_eq!(
            job.stated,
            LoopSettings {
                precision: Some(Precision::Bf16),
                optimizer: Some(Optimizer::ADAMW),
                micro_batch: Some(4),
                grad_accum: Some(2)
            }
        );
        assert_eq!(
            job.zero,
            Zero {
                overlap_comm: Some(true),
                param_persistence_threshold: 10_000,
                offload_optimizer: true,
                ..Zero::default()
            }
        );
        // Hugging Face's "auto" everywhere leaves the command line's values.
        let auto = read_config(r#"{"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2, "cpu_offload": true}}"#).unwrap();
        assert_eq!(
            (auto.stated, auto.world_size, auto.zero.offload_optimizer),
            (LoopSettings::default(), None, true)
        );
    }

    #[test]
    fn config_errors_name_the_key() {
        let err = |text: &str| read_config(text).unwrap_err().to_string();
        assert_eq!(err("[1]"), "not JSON: the config is not a JSON object");
        assert!(err("{").starts_with("not JSON: "));
        assert_eq!(
            err(r#"{"zero_optimization": {}}"#),
            "`zero_optimization.stage`: missing (gpumem models ZeRO stages 1, 2 and 3)"
        );
        assert_eq!(
            err(r#"{"zero_optimization": {"stage": 0}}"#),
            "`zero_optimization.stage`: stage 0 is plain data parallelism: estimate it with --strategy ddp"
        );
        assert_eq!(
            err(r#"{"zero_optimization": {"stage": 2, "reduce_bucket_size": -1}}"#),
            "`zero_optimization.reduce_bucket_size`: -1 is not a whole number of elements"
        );
        assert_eq!(
            err(r#"{"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}"#),
            "`zero_optimization.offload_param`: needs stage 3"
        );
        assert_eq!(
            err(r#"{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}}}"#),
            "`zero_optimization.offload_optimizer.device`: `gpu` is not none, cpu or nvme"
        );
        assert_eq!(
            err(r#"{"zero_optimization": {"stage": 1}, "optimizer": {"type": "Lamb"}}"#),
            "`optimizer.type`: `lamb` is not modelled (Adam, AdamW, SGD)"
        );
        assert_eq!(
            err(
                r#"{"zero_optimization": {"stage": 1}, "train_batch_size": 10, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}"#
            ),
            "`train_batch_size`: 10 is not a multiple of micro-batch 4 × accumulation 1"
        );
    }
}
