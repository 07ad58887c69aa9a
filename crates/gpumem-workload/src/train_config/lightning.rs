//! A Lightning `Trainer` + `LightningModule` setup where it is declarative: the YAML a
//! `LightningCLI` reads (`fit --config FILE`): `trainer`, `model`, `data`, `optimizer`.

use gpumem_core::job::{HalfDtype, Implementation, Optimizer, Precision};
use serde_json::Value;

use super::{CLIP, COMPILE, Class, Doc, EVAL, Layout, SAVE, Table, TrainConfig, TrainConfigError};

pub(crate) const TABLE: Table = &[
    ("seed_everything", Class::No),
    ("ckpt_path", Class::No),
    ("trainer.accelerator", Class::No),
    ("trainer.max_epochs", Class::No),
    ("trainer.min_epochs", Class::No),
    ("trainer.max_steps", Class::No),
    ("trainer.max_time", Class::No),
    ("trainer.logger", Class::No),
    ("trainer.logger.*", Class::No),
    ("trainer.callbacks", Class::No),
    ("trainer.callbacks.*", Class::No),
    ("trainer.log_every_n_steps", Class::No),
    ("trainer.default_root_dir", Class::No),
    ("trainer.enable_progress_bar", Class::No),
    ("trainer.enable_model_summary", Class::No),
    ("trainer.deterministic", Class::No),
    ("trainer.benchmark", Class::No),
    ("trainer.fast_dev_run", Class::No),
    ("trainer.limit_train_batches", Class::No),
    ("trainer.reload_dataloaders_every_n_epochs", Class::No),
    ("trainer.use_distributed_sampler", Class::No),
    ("trainer.gradient_clip_algorithm", Class::No),
    ("trainer.gradient_clip_val", Class::Not(CLIP)),
    ("trainer.val_check_interval", Class::Not(EVAL)),
    ("trainer.check_val_every_n_epoch", Class::Not(EVAL)),
    ("trainer.limit_val_batches", Class::Not(EVAL)),
    ("trainer.limit_test_batches", Class::Not(EVAL)),
    ("trainer.limit_predict_batches", Class::Not(EVAL)),
    ("trainer.num_sanity_val_steps", Class::Not(EVAL)),
    ("trainer.inference_mode", Class::Not(EVAL)),
    ("trainer.enable_checkpointing", Class::Not(SAVE)),
    (
        "trainer.detect_anomaly",
        Class::Not(
            "anomaly detection keeps each op's traceback and checks every gradient; not modelled",
        ),
    ),
    ("trainer.profiler", Class::No),
    (
        "trainer.plugins",
        Class::Not("Lightning plugins (precision, checkpoint IO, …) are not modelled"),
    ),
    ("trainer.sync_batchnorm", Class::No),
    ("trainer.barebones", Class::No),
    ("lr_scheduler.*", Class::No),
    ("optimizer.init_args.lr", Class::No),
    ("optimizer.init_args.weight_decay", Class::No),
    ("optimizer.init_args.betas", Class::No),
    ("optimizer.init_args.eps", Class::No),
    ("data.class_path", Class::No),
    ("data.init_args.num_workers", Class::No),
    ("data.init_args.data_dir", Class::No),
    ("data.init_args.pin_memory", Class::No),
    (
        "model.class_path",
        Class::Not(
            "a LightningModule is user code: gpumem sizes the MODEL given on the command line (py:FILE:FUNCTION, hf:…) in its place",
        ),
    ),
    (
        "model.init_args.*",
        Class::Not(
            "the LightningModule's own arguments build the model: gpumem sizes the MODEL given on the command line in its place",
        ),
    ),
    (
        "data.init_args.*",
        Class::Not("the data module's other arguments may change the batch's shapes"),
    ),
    ("compile", Class::Not(COMPILE)),
];

/// Lightning's device count: an int, a list of indices, `-1`/`"auto"` (the launcher's).
fn devices(doc: &mut Doc) -> Result<Option<u32>, TrainConfigError> {
    match doc.take("trainer.devices") {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a.len() as u32)),
        Some(Value::String(s)) if s == "auto" || s == "-1" => Ok(None),
        Some(Value::Number(n)) if n.as_i64() == Some(-1) => Ok(None),
        Some(_) => doc.count32("trainer.devices"),
    }
}

pub(crate) fn read(doc: &mut Doc, out: &mut TrainConfig) -> Result<Table, TrainConfigError> {
    for key in [
        "model.init_args.model_name_or_path",
        "model.init_args.pretrained_model_name_or_path",
        "model.init_args.model_name",
    ] {
        if let Some(m) = doc.text(key)? {
            out.model = Some((m, key.into()));
        }
    }
    for key in [
        "data.init_args.batch_size",
        "data.init_args.train_batch_size",
        "data.batch_size",
    ] {
        if let Some(b) = doc.positive(key)? {
            out.micro_batch = Some((b, key.into()));
        }
    }
    for key in [
        "data.init_args.max_seq_length",
        "data.init_args.max_length",
        "data.init_args.seq_len",
        "data.init_args.block_size",
    ] {
        if let Some(n) = doc.positive(key)? {
            out.seq_len = Some(n);
        }
    }
    out.grad_accum = doc.count32("trainer.accumulate_grad_batches")?;
    let precision = match doc.take("trainer.precision") {
        None => None,
        Some(Value::Number(n)) => Some(n.to_string()),
        Some(Value::String(s)) => Some(s),
        Some(other) => {
            return Err(doc.err("trainer.precision", format!("{other} is not a precision")));
        }
    };
    out.precision = Some(match precision.as_deref() {
        None | Some("32" | "32-true") => Precision::Fp32,
        Some("bf16-mixed") => Precision::AmpBf16,
        Some("16" | "16-mixed") => Precision::AmpFp16,
        Some("bf16-true" | "bf16") => Precision::Bf16,
        Some("16-true") => Precision::Fp16,
        Some(other) => {
            return Err(doc.err(
                "trainer.precision",
                format!(
                    "`{other}` is not modelled (32-true, bf16-mixed, 16-mixed, bf16-true, 16-true)"
                ),
            ));
        }
    });
    if let Some(c) = doc.text("optimizer.class_path")? {
        let fused = doc.flag("optimizer.init_args.fused")?.unwrap_or(false);
        let mut o = super::optimizer(
            doc,
            "optimizer.class_path",
            &c,
            fused.then_some(Implementation::Fused),
        )?;
        if matches!(o, Optimizer::Sgd(_))
            && doc
                .number("optimizer.init_args.momentum")?
                .is_some_and(|m| m > 0.0)
        {
            o = Optimizer::SgdMomentum(o.implementation().unwrap_or_default());
        }
        out.optimizer = Some(o);
    }
    // Ranks: devices × num_nodes under trainer.strategy.
    let devices = devices(doc)?;
    let nodes = doc.count32("trainer.num_nodes")?.unwrap_or(1);
    let world = devices.map(|d| d * nodes);
    let strategy = match doc.get("trainer.strategy").cloned() {
        None | Some(Value::Null) => "auto".to_string(),
        Some(Value::String(s)) => s,
        Some(Value::Object(o)) => o
            .get("class_path")
            .and_then(Value::as_str)
            .map(|c| c.rsplit('.').next().unwrap_or(c).to_ascii_lowercase())
            .unwrap_or_default(),
        Some(other) => {
            return Err(doc.err("trainer.strategy", format!("{other} is not a strategy")));
        }
    };
    doc.used("trainer.strategy");
    let half = match out.precision {
        Some(Precision::AmpBf16 | Precision::Bf16) => Some(HalfDtype::Bf16),
        Some(Precision::AmpFp16 | Precision::Fp16) => Some(HalfDtype::Fp16),
        _ => None,
    };
    let key = "trainer.strategy";
    out.layout = match strategy.as_str() {
        "auto" | "ddp" | "ddp_spawn" | "ddp_find_unused_parameters_true" | "ddpstrategy" => {
            match world {
                Some(w) if w > 1 => Layout::Fixed(
                    gpumem_core::job::Strategy::ddp(w, gpumem_core::job::DDP_BUCKET_CAP_MB, false)
                        .map_err(|e| doc.err(key, e.to_string()))?,
                ),
                Some(_) => Layout::Single,
                None => Layout::Launcher {
                    bucket_cap_mb: gpumem_core::job::DDP_BUCKET_CAP_MB,
                },
            }
        }
        "fsdp" | "fsdpstrategy" | "modelparallelstrategy" => {
            let cpu = doc
                .flag("trainer.strategy.init_args.cpu_offload")?
                .unwrap_or(false);
            let reshard = match doc
                .text("trainer.strategy.init_args.sharding_strategy")?
                .as_deref()
            {
                None | Some("FULL_SHARD") => true,
                Some("SHARD_GRAD_OP") => false,
                Some(other) => {
                    return Err(doc.err(
                        "trainer.strategy.init_args.sharding_strategy",
                        format!("`{other}` is not modelled (FULL_SHARD, SHARD_GRAD_OP)"),
                    ));
                }
            };
            Layout::Fsdp {
                replicate: 1,
                shard: world,
                tensor: 1,
                pipeline: 1,
                schedule: None,
                context: 1,
                expert: 1,
                reshard_after_forward: reshard,
                param_dtype: half,
                cpu_offload: cpu,
                // Lightning's Trainer blocks gradient sync under accumulation for DDP alone.
                sync_each_batch: true,
                field: "trainer.strategy",
            }
        }
        s if s.starts_with("deepspeed_stage_") => {
            let stage = s.trim_start_matches("deepspeed_stage_");
            let (stage, offload) = match stage {
                "1" => (1, false),
                "2" => (2, false),
                "2_offload" => (2, true),
                "3" => (3, false),
                "3_offload" => (3, true),
                other => {
                    return Err(doc.err(key, format!("`deepspeed_stage_{other}` is not modelled")));
                }
            };
            let text = format!(
                r#"{{"zero_optimization": {{"stage": {stage}{}}}}}"#,
                if offload {
                    r#", "offload_optimizer": {"device": "cpu"}"#
                } else {
                    ""
                }
            );
            let job =
                crate::deepspeed::read_config(&text).map_err(|e| doc.err(key, e.to_string()))?;
            let job = crate::deepspeed::DeepSpeedJob {
                world_size: world,
                ..job
            };
            Layout::Zero {
                job,
                field: key.into(),
            }
        }
        other => {
            return Err(doc.err(
                key,
                format!("`{other}` is not modelled (auto, ddp, fsdp, deepspeed_stage_N)"),
            ));
        }
    };
    for k in [
        "trainer.strategy.class_path",
        "trainer.strategy.init_args.auto_wrap_policy",
        "trainer.strategy.init_args.state_dict_type",
    ] {
        if doc.get(k).is_some() {
            doc.used(k);
        }
    }
    if doc
        .get("trainer.strategy.init_args.activation_checkpointing_policy")
        .is_some()
        || doc
            .get("trainer.strategy.init_args.activation_checkpointing")
            .is_some()
    {
        out.checkpointing = Some(gpumem_core::job::Checkpointing::Full);
        doc.used("trainer.strategy.init_args.activation_checkpointing_policy");
        doc.used("trainer.strategy.init_args.activation_checkpointing");
    }
    Ok(TABLE)
}
