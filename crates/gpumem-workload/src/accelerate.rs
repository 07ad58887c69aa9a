//! An accelerate config (`accelerate config`'s YAML) read into a [`LaunchConfig`]; a DeepSpeed
//! config file it names is read by [`crate::deepspeed`].

use std::path::Path;

use gpumem_core::job::Precision;
use serde_norway::Value;

use crate::deepspeed;
use crate::launch::{LaunchConfig, LaunchConfigError, LoopSettings, bad};
use crate::{HalfDtype, Strategy, Zero, ZeroStage};

fn text<'a>(v: &'a Value, key: &str) -> Result<Option<&'a str>, LaunchConfigError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        // YAML reads `no` as a string in accelerate's files (quoted) but a bare `false` as a flag.
        Some(Value::Bool(false)) => Ok(Some("no")),
        Some(other) => Err(bad(key, format!("{other:?} is not a name"))),
    }
}

fn whole(v: &Value, key: &str) -> Result<Option<u64>, LaunchConfigError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| bad(key, format!("{n} is not a whole number"))),
        Some(Value::String(s)) if s == "auto" => Ok(None),
        Some(other) => Err(bad(key, format!("{other:?} is not a whole number"))),
    }
}

fn flag(v: &Value, key: &str) -> Result<Option<bool>, LaunchConfigError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(bad(key, format!("{other:?} is not true or false"))),
    }
}

/// Reads an accelerate config (`accelerate config`'s YAML, as `accelerate launch
/// --config_file` takes it); `dir` is where a `deepspeed_config_file` it names is looked for
/// when relative. `distributed_type`: NO (one GPU), MULTI_GPU (DDP), FSDP (traced as FSDP2;
/// `fsdp_reshard_after_forward`, or version 1's `fsdp_sharding_strategy` FULL_SHARD /
/// SHARD_GRAD_OP / NO_SHARD), DEEPSPEED (its `deepspeed_config_file`, or the inline
/// `zero_stage`, `offload_*_device`, `gradient_accumulation_steps`); ranks `num_processes`;
/// `mixed_precision` bf16/fp16 is autocast (and FSDP's mixed-precision policy), DeepSpeed's
/// bf16/fp16 mode under DeepSpeed.
pub fn read_accelerate(yaml: &str, dir: &Path) -> Result<LaunchConfig, LaunchConfigError> {
    let root: Value = serde_norway::from_str(yaml)?;
    if !root.is_mapping() {
        return Err(LaunchConfigError::NotYamlMapping);
    }
    let world = whole(&root, "num_processes")?.unwrap_or(1);
    let world = u32::try_from(world)
        .ok()
        .filter(|w| *w >= 1)
        .ok_or_else(|| bad("num_processes", format!("{world} is out of range")))?;
    let kind = text(&root, "distributed_type")?
        .unwrap_or("NO")
        .to_ascii_uppercase();
    let half = match text(&root, "mixed_precision")?.unwrap_or("no") {
        "no" => None,
        "bf16" => Some(HalfDtype::Bf16),
        "fp16" => Some(HalfDtype::Fp16),
        other => {
            return Err(bad(
                "mixed_precision",
                format!("`{other}` is not modelled (no, bf16, fp16)"),
            ));
        }
    };
    let amp = match half {
        None => Precision::Fp32,
        Some(HalfDtype::Bf16) => Precision::AmpBf16,
        Some(HalfDtype::Fp16) => Precision::AmpFp16,
    };
    let plain = |strategy| LaunchConfig {
        strategy,
        stated: LoopSettings {
            precision: Some(amp),
            ..LoopSettings::default()
        },
    };
    let ddp = || Strategy::ddp(world, gpumem_core::job::DDP_BUCKET_CAP_MB, false);
    match kind.as_str() {
        "NO" => Ok(plain(None)),
        "MULTI_GPU" => Ok(plain(Some(ddp()?))),
        "FSDP" => {
            let f = root.get("fsdp_config").cloned().unwrap_or(Value::Null);
            let cpu_offload = flag(&f, "fsdp_offload_params")?.unwrap_or(false);
            let reshard = match (
                flag(&f, "fsdp_reshard_after_forward")?,
                text(&f, "fsdp_sharding_strategy")?,
            ) {
                (Some(r), _) => r,
                (None, None | Some("FULL_SHARD" | "1")) => true,
                (None, Some("SHARD_GRAD_OP" | "2")) => false,
                (None, Some("NO_SHARD" | "3")) => return Ok(plain(Some(ddp()?))),
                (None, Some(other)) => {
                    return Err(bad(
                        "fsdp_config.fsdp_sharding_strategy",
                        format!("`{other}` is not modelled (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD)"),
                    ));
                }
            };
            Ok(plain(Some(Strategy::fsdp(
                world,
                1,
                reshard,
                half,
                cpu_offload,
            )?)))
        }
        "DEEPSPEED" => {
            let d = root.get("deepspeed_config").cloned().unwrap_or(Value::Null);
            let precision = Some(match half {
                None => Precision::Fp32,
                Some(HalfDtype::Bf16) => Precision::Bf16,
                Some(HalfDtype::Fp16) => Precision::Fp16,
            });
            if let Some(file) = text(&d, "deepspeed_config_file")? {
                let key = "deepspeed_config.deepspeed_config_file";
                let path = dir.join(file);
                let json = match std::fs::read_to_string(&path) {
                    Ok(json) => json,
                    Err(source) => {
                        return Err(LaunchConfigError::File {
                            key: key.into(),
                            path,
                            source,
                        });
                    }
                };
                let job = match deepspeed::read_config(&json) {
                    Ok(job) => job,
                    Err(source) => {
                        return Err(LaunchConfigError::Named {
                            key: key.into(),
                            path,
                            source: Box::new(source),
                        });
                    }
                };
                if let Some(stated) = job.world_size.filter(|w| *w != world) {
                    return Err(bad(
                        "num_processes",
                        format!(
                            "{world} disagrees with the DeepSpeed config's train_batch_size, which makes {stated} ranks"
                        ),
                    ));
                }
                let mut launch = job.launch(world)?;
                launch.stated.precision = launch.stated.precision.or(precision);
                return Ok(launch);
            }
            let stage = whole(&d, "zero_stage")?.ok_or_else(|| {
                bad(
                    "deepspeed_config.zero_stage",
                    "missing (or name a deepspeed_config_file)",
                )
            })?;
            let stage = match stage {
                1 => ZeroStage::One,
                2 => ZeroStage::Two,
                3 => ZeroStage::Three,
                0 => return Ok(plain(Some(ddp()?))),
                s => {
                    return Err(bad(
                        "deepspeed_config.zero_stage",
                        format!("{s} is not 0, 1, 2 or 3"),
                    ));
                }
            };
            let offloads = |key: &str| -> Result<bool, LaunchConfigError> {
                match text(&d, key)? {
                    None | Some("none") => Ok(false),
                    Some("cpu" | "nvme") => Ok(true),
                    Some(other) => Err(bad(
                        &format!("deepspeed_config.{key}"),
                        format!("`{other}` is not none, cpu or nvme"),
                    )),
                }
            };
            let zero = Zero {
                offload_optimizer: offloads("offload_optimizer_device")?,
                offload_param: offloads("offload_param_device")?,
                ..Zero::default()
            };
            if zero.offload_param && stage != ZeroStage::Three {
                return Err(bad(
                    "deepspeed_config.offload_param_device",
                    "needs zero_stage 3",
                ));
            }
            let grad_accum = match whole(&d, "gradient_accumulation_steps")? {
                Some(n) => Some(u32::try_from(n).ok().filter(|n| *n >= 1).ok_or_else(|| {
                    bad(
                        "deepspeed_config.gradient_accumulation_steps",
                        format!("{n} is out of range"),
                    )
                })?),
                None => None,
            };
            Ok(LaunchConfig {
                strategy: Some(Strategy::zero(stage, world, zero)?),
                stated: LoopSettings {
                    precision,
                    grad_accum,
                    ..LoopSettings::default()
                },
            })
        }
        other => Err(bad(
            "distributed_type",
            format!("`{other}` is not modelled (NO, MULTI_GPU, FSDP, DEEPSPEED)"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use gpumem_core::job::{Engine, Optimizer};

    use super::*;
    use crate::OptionValues;

    fn read(yaml: &str) -> Result<LaunchConfig, LaunchConfigError> {
        read_accelerate(yaml, Path::new("/nonexistent"))
    }

    #[test]
    fn accelerate_configs_as_accelerate_config_writes_them() {
        let fsdp = read(
            "compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\ndowncast_bf16: 'no'\nfsdp_config:\n  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_offload_params: false\n  fsdp_reshard_after_forward: true\n  fsdp_version: 2\nmachine_rank: 0\nmixed_precision: bf16\nnum_machines: 1\nnum_processes: 8\nuse_cpu: false\n",
        )
        .unwrap();
        assert_eq!(
            fsdp.strategy,
            Some(Strategy::fsdp(8, 1, true, Some(HalfDtype::Bf16), false).unwrap())
        );
        assert_eq!(fsdp.stated.precision, Some(Precision::AmpBf16));
        let v1 = read("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\nmixed_precision: 'no'\nnum_processes: 4\n").unwrap();
        assert_eq!(
            (v1.strategy, v1.stated.precision),
            (
                Some(Strategy::fsdp(4, 1, false, None, false).unwrap()),
                Some(Precision::Fp32)
            )
        );
        let ddp =
            read("distributed_type: MULTI_GPU\nmixed_precision: fp16\nnum_processes: 2\n").unwrap();
        assert_eq!(
            (ddp.strategy.map(|s| s.name()), ddp.stated.precision),
            (Some("ddp"), Some(Precision::AmpFp16))
        );
        let ds = read("distributed_type: DEEPSPEED\ndeepspeed_config:\n  gradient_accumulation_steps: 4\n  offload_optimizer_device: cpu\n  offload_param_device: none\n  zero3_init_flag: true\n  zero_stage: 3\nmixed_precision: bf16\nnum_processes: 8\n").unwrap();
        assert_eq!(
            ds.strategy,
            Some(
                Strategy::zero(
                    ZeroStage::new(3).unwrap(),
                    8,
                    Zero {
                        offload_optimizer: true,
                        ..Zero::default()
                    }
                )
                .unwrap()
            )
        );
        assert_eq!(
            (ds.stated.precision, ds.stated.grad_accum),
            (Some(Precision::Bf16), Some(4))
        );
        // What it states replaces the flags' values.
        let o = ds
            .stated
            .over(OptionValues {
                precision: Precision::Fp32,
                grad_accum: 1,
                ..OptionValues::default()
            })
            .unwrap();
        assert_eq!(
            (o.precision, o.grad_accum, o.optimizer),
            (Precision::Bf16, 4, Optimizer::ADAM)
        );
        assert_eq!(
            read("distributed_type: 'NO'\nnum_processes: 1\n")
                .unwrap()
                .strategy,
            None
        );
    }

    #[test]
    fn a_deepspeed_config_file_it_names_is_read_beside_it() {
        let dir = std::env::temp_dir().join(format!("gpumem-accelerate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("ds.json"),
            r#"{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 3}"#,
        )
        .unwrap();
        let l = read_accelerate("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\nmixed_precision: bf16\nnum_processes: 4\n", &dir).unwrap();
        assert_eq!(
            (
                l.strategy.map(|s| s.name()),
                l.stated.micro_batch,
                l.stated.precision
            ),
            (Some("zero2"), Some(3), Some(Precision::Bf16))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn accelerate_config_errors_name_the_key() {
        let err = |yaml: &str| read(yaml).unwrap_err().to_string();
        assert!(
            err("a: [").starts_with("not JSON: not YAML: "),
            "{}",
            err("a: [")
        );
        assert_eq!(
            err("distributed_type: TPU\n"),
            "`distributed_type`: `TPU` is not modelled (NO, MULTI_GPU, FSDP, DEEPSPEED)"
        );
        assert_eq!(
            err("distributed_type: MULTI_GPU\nmixed_precision: fp8\n"),
            "`mixed_precision`: `fp8` is not modelled (no, bf16, fp16)"
        );
        let offload = read(
            "distributed_type: FSDP\nfsdp_config:\n  fsdp_offload_params: true\nnum_processes: 2\n",
        )
        .unwrap();
        assert!(matches!(
            offload.strategy,
            Some(s) if s.world_size() == 2 && matches!(s.engine(), Engine::Fsdp { cpu_offload: true, .. })
        ));
        assert_eq!(
            err("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD\n"),
            "`fsdp_config.fsdp_sharding_strategy`: `HYBRID_SHARD` is not modelled (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD)"
        );
        assert_eq!(
            err(
                "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\n  offload_param_device: cpu\n"
            ),
            "`deepspeed_config.offload_param_device`: needs zero_stage 3"
        );
        assert_eq!(
            err("distributed_type: MULTI_GPU\nnum_processes: 0\n"),
            "`num_processes`: 0 is out of range"
        );
        assert!(err("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: missing.json\n").starts_with("`deepspeed_config.deepspeed_config_file`: /nonexistent/missing.json: "));
    }
}
