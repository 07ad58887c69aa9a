//! litgpt's configs (0.5.x): the YAML `litgpt finetune_lora|finetune_full --config FILE` and
//! `litgpt pretrain --config FILE` read (`checkpoint_dir` or `model_name`, `precision`,
//! `quantize`, `devices`, `lora_*`, `train`, `eval`, `optimizer`). The model is litgpt's own
//! (`litgpt:ORG/NAME`), trained as its scripts run a step: see the tracer's `litgpt_job`.

use gpumem_core::job::{Checkpointing, HalfDtype, Optimizer, Precision, Quant4, QuantLoader};

use super::{CLIP, Class, Doc, EVAL, Layout, SAVE, Table, TrainConfig, TrainConfigError};

pub(crate) const TABLE: Table = &[
    ("out_dir", Class::No),
    ("logger_name", Class::No),
    ("seed", Class::No),
    ("access_token", Class::No),
    ("tokenizer_dir", Class::No),
    ("initial_checkpoint_dir", Class::No),
    ("resume", Class::No),
    ("train.save_interval", Class::Not(SAVE)),
    ("train.log_interval", Class::No),
    ("train.lr_warmup_steps", Class::No),
    ("train.lr_warmup_fraction", Class::No),
    ("train.epochs", Class::No),
    ("train.max_tokens", Class::No),
    ("train.max_steps", Class::No),
    ("train.max_time", Class::No),
    ("train.min_lr", Class::No),
    ("train.max_norm", Class::Not(CLIP)),
    (
        "train.tie_embeddings",
        Class::Not(
            "pretrain's tied embedding and head are not modelled: state it as litgpt:NAME's own config",
        ),
    ),
    ("eval.*", Class::Not(EVAL)),
    ("optimizer.init_args.lr", Class::No),
    ("optimizer.init_args.weight_decay", Class::No),
    ("optimizer.init_args.betas", Class::No),
    ("optimizer.init_args.eps", Class::No),
    ("data.class_path", Class::No),
    ("data.init_args.seed", Class::No),
    ("data.init_args.num_workers", Class::No),
    ("data.init_args.prompt_style", Class::No),
    ("data.init_args.ignore_index", Class::No),
    ("data.init_args.mask_prompt", Class::No),
    ("data.init_args.val_split_fraction", Class::No),
    ("data.init_args.download_dir", Class::No),
    ("data.init_args.data_path", Class::No),
    ("data.init_args.file_url", Class::No),
    ("data.init_args.file_name", Class::No),
    (
        "data.init_args.*",
        Class::Not("the data module's other arguments may change the batch's shapes"),
    ),
    (
        "model_config",
        Class::Not("pretrain's config overrides: state them as litgpt:NAME(key=value,…)"),
    ),
    ("compiler", Class::Not(super::COMPILE)),
];

/// litgpt's `precision`: Lightning's names; absent, `get_default_supported_precision(training)`
/// on a GPU with bf16 (`bf16-mixed`).
fn precision(doc: &mut Doc) -> Result<Precision, TrainConfigError> {
    Ok(match doc.text("precision")?.as_deref() {
        None | Some("bf16-mixed") => Precision::AmpBf16,
        Some("bf16-true") => Precision::Bf16,
        Some("16-mixed") => Precision::AmpFp16,
        Some("16-true") => Precision::Fp16,
        Some("32-true") => Precision::Fp32,
        Some(other) => {
            return Err(doc.err(
                "precision",
                format!(
                    "`{other}` is not modelled (bf16-true, bf16-mixed, 16-true, 16-mixed, 32-true)"
                ),
            ));
        }
    })
}

/// `quantize`: Lightning Fabric's `BitsandbytesPrecision` (`bnb.nf4[-dq]`, `bnb.fp4[-dq]`).
fn quantize(doc: &mut Doc) -> Result<Option<Quant4>, TrainConfigError> {
    let Some(q) = doc.text("quantize")? else {
        return Ok(None);
    };
    let (nf4, double_quant) = match q.as_str() {
        "bnb.nf4" => (true, false),
        "bnb.nf4-dq" => (true, true),
        "bnb.fp4" => (false, false),
        "bnb.fp4-dq" => (false, true),
        "bnb.int8-training" => {
            doc.not_modelled("quantize", "8-bit base weights (LLM.int8) are not modelled");
            return Ok(None);
        }
        other => {
            return Err(doc.err(
                "quantize",
                format!("`{other}` is not modelled (bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.fp4-dq)"),
            ));
        }
    };
    Ok(Some(Quant4 {
        loader: QuantLoader::Fabric,
        ..Quant4::new(nf4, double_quant)
    }))
}

/// litgpt's names of the layers LoRA may go on (its Config's `lora_*` switches).
const LORA_PARTS: [&str; 6] = ["query", "key", "value", "projection", "mlp", "head"];

pub(crate) fn read(doc: &mut Doc, out: &mut TrainConfig) -> Result<Table, TrainConfigError> {
    // The model: the checkpoint's directory names it as litgpt downloads it
    // (checkpoints/ORG/NAME); pretraining names a litgpt config.
    let pretrain = doc.get("checkpoint_dir").is_none() && doc.get("model_name").is_some();
    if let Some(dir) = doc.text("checkpoint_dir")? {
        let parts: Vec<&str> = dir
            .trim_end_matches('/')
            .rsplit('/')
            .take(2)
            .collect::<Vec<_>>();
        let name = match parts.as_slice() {
            [name, org] if *org != "checkpoints" && !org.is_empty() => format!("{org}/{name}"),
            [name, ..] => (*name).to_string(),
            [] => return Err(doc.err("checkpoint_dir", "empty")),
        };
        out.model = Some((format!("litgpt:{name}"), "checkpoint_dir".into()));
    } else if let Some(name) = doc.text("model_name")? {
        // litgpt pretrain's step: the whole logits, cross-entropy in chunks.
        out.model = Some((
            format!("litgpt:{name}(lm_head_chunk_size=0)"),
            "model_name".into(),
        ));
    }
    let precision = precision(doc)?;
    out.precision = Some(precision);
    let quant = quantize(doc)?;
    if quant.is_some() && matches!(precision, Precision::AmpBf16 | Precision::AmpFp16) {
        return Err(doc.err(
            "quantize",
            "litgpt refuses quantization with a mixed precision (say precision: bf16-true)",
        ));
    }
    let rank = doc.count32("lora_r")?;
    let alpha = doc.number("lora_alpha")?;
    let dropout = doc.number("lora_dropout")?;
    // A config with any LoRA key is finetune_lora's, whose defaults fill the rest: r 8, alpha
    // 16, dropout 0.05, LoRA on the query and the value.
    let (mut targets, mut switches) = (Vec::new(), false);
    for part in LORA_PARTS {
        let on = doc.flag(&format!("lora_{part}"))?;
        switches |= on.is_some();
        if on.unwrap_or(matches!(part, "query" | "value")) {
            targets.push(part.to_string());
        }
    }
    let lora = rank.is_some() || alpha.is_some() || dropout.is_some() || switches;
    match rank.unwrap_or(8) {
        r if lora && r > 0 => {
            out.lora = Some(super::lora(
                doc,
                "lora_r",
                r,
                alpha.unwrap_or(16.0),
                targets,
                dropout.unwrap_or(0.05),
                quant,
            )?);
        }
        _ if quant.is_some() => {
            return Err(doc.err(
                "quantize",
                "a 4-bit model trains only its LoRA factors: give lora_r",
            ));
        }
        _ => {}
    }
    // litgpt with a bitsandbytes quantization swaps the optimizer for bitsandbytes' paged one
    // (instantiate_bnb_optimizer: torch.optim.AdamW -> bnb.optim.PagedAdamW).
    if let Some(class) = doc.text("optimizer.class_path")? {
        let o = super::optimizer(doc, "optimizer.class_path", &class, None)?;
        out.optimizer = Some(if quant.is_some() && matches!(o, Optimizer::AdamW(_)) {
            Optimizer::parse("paged_adamw_32bit")
                .map_err(|e| doc.err("optimizer.class_path", e.to_string()))?
        } else {
            o
        });
    } else if let Some(name) = doc.text("optimizer")? {
        // The CLI's short form (`optimizer: AdamW`).
        out.optimizer = Some(super::optimizer(doc, "optimizer", &name, None)?);
    }
    let micro = doc.positive("train.micro_batch_size")?;
    if let Some(m) = micro {
        out.micro_batch = Some((m, "train.micro_batch_size".into()));
    }
    if let Some(n) = doc.positive("train.max_seq_length")? {
        out.seq_len = Some(n);
    }
    // Ranks: devices × num_nodes; several are FSDP — fine-tuning's FSDPStrategy with every
    // Block checkpointed (activation_checkpointing_policy={Block}), pretraining's sharded within
    // a node and replicated across nodes (HYBRID_SHARD), unchecked.
    let devices = match doc.take("devices") {
        None => None,
        Some(serde_json::Value::String(s)) if s == "auto" => None,
        Some(serde_json::Value::Number(n)) if n.as_i64() == Some(-1) => None,
        Some(_) => doc.count32("devices")?,
    };
    let nodes = doc.count32("num_nodes")?.unwrap_or(1);
    let world = devices.map(|d| d * nodes);
    if let (Some(global), Some(m), Some(w)) =
        (doc.positive("train.global_batch_size")?, micro, world)
    {
        // gradient_accumulation_iters: global_batch_size // devices // num_nodes // micro.
        let accum = global / u64::from(w) / m;
        out.grad_accum = Some(u32::try_from(accum.max(1)).unwrap_or(u32::MAX));
    }
    out.layout = match (world, devices) {
        (Some(w), Some(d)) if w > 1 => {
            let (replicate, shard) = if pretrain { (nodes, d) } else { (1, w) };
            if !pretrain {
                out.checkpointing = Some(Checkpointing::Full);
            }
            Layout::Fsdp {
                replicate,
                shard: Some(shard),
                tensor: 1,
                pipeline: 1,
                schedule: None,
                context: 1,
                expert: 1,
                reshard_after_forward: true,
                param_dtype: match precision {
                    Precision::AmpBf16 => Some(HalfDtype::Bf16),
                    Precision::AmpFp16 => Some(HalfDtype::Fp16),
                    _ => None,
                },
                cpu_offload: false,
                // litgpt accumulates under Fabric's `no_backward_sync`: FSDP's `no_sync`.
                sync_each_batch: false,
                field: "devices",
            }
        }
        (Some(_), _) => Layout::Single,
        _ => Layout::Launcher {
            bucket_cap_mb: gpumem_core::job::DDP_BUCKET_CAP_MB,
        },
    };
    // litgpt writes every argument, an unset one as null: that states nothing.
    for key in [
        "train.max_norm",
        "train.tie_embeddings",
        "train.save_interval",
    ] {
        if matches!(doc.get(key), Some(serde_json::Value::Null)) {
            doc.no_memory(key);
        }
    }
    Ok(TABLE)
}
