//! axolotl's YAML (`axolotl train config.yml`).

use std::collections::BTreeMap;

use gpumem_core::job::{
    Attention, AttentionMask, Checkpointing, Evaluation, Liger, LigerKernel, Precision, Quant4,
    WholeRun,
};
use serde_json::Value;

use super::{
    ATTN, CLIP, COMPILE, Class, Doc, EVAL, OFFLOAD_ACT, PACKED, Table, TrainConfig,
    TrainConfigError, hf,
};

pub(crate) const TABLE: Table = &[
    ("evals_per_epoch", Class::No),
    ("eval_steps", Class::No),
    ("eval_sample_packing", Class::Not(EVAL)),
    ("eval_table_size", Class::Not(EVAL)),
    ("do_bench_eval", Class::Not(EVAL)),
    ("save_first_step", Class::No),
    ("save_safetensors", Class::No),
    ("torch_compile_backend", Class::Not(COMPILE)),
    ("cut_cross_entropy", Class::Not(super::CHUNKED_CE)),
    ("max_grad_norm", Class::Not(CLIP)),
    (
        "group_by_length",
        Class::Not(
            "length-grouped batches change the padded length per batch; sized at sequence_len",
        ),
    ),
    (
        "tokens",
        Class::Not("added tokens resize the embeddings; sized at the model's vocabulary"),
    ),
    (
        "lora_modules_to_save",
        Class::Not("modules trained whole beside LoRA are not modelled"),
    ),
    (
        "peft_use_dora",
        Class::Not("DoRA's magnitude vectors and its extra forward are not modelled"),
    ),
    ("peft_use_rslora", Class::No),
    (
        "neftune_noise_alpha",
        Class::Not("NEFTune's noised embeddings are not modelled"),
    ),
    (
        "unfrozen_parameters",
        Class::Not("partly frozen full fine-tunes are not modelled"),
    ),
    (
        "auto_find_batch_size",
        Class::Not(
            "the Trainer halves the batch after an out-of-memory error; gpumem sizes the stated batch",
        ),
    ),
    ("tf32", Class::No),
    ("model_type", Class::No),
    ("tokenizer_type", Class::No),
    ("tokenizer_config", Class::No),
    ("tokenizer_use_fast", Class::No),
    ("hub_model_id", Class::No),
    ("hub_strategy", Class::No),
    ("datasets.*", Class::No),
    ("test_datasets.*", Class::No),
    ("dataset_prepared_path", Class::No),
    ("dataset_processes", Class::No),
    ("shuffle_merged_datasets", Class::No),
    ("chat_template", Class::No),
    ("default_system_message", Class::No),
    ("train_on_inputs", Class::No),
    ("output_dir", Class::No),
    ("lora_model_dir", Class::No),
    ("lora_fan_in_fan_out", Class::No),
    ("wandb_project", Class::No),
    ("wandb_entity", Class::No),
    ("wandb_watch", Class::No),
    ("wandb_name", Class::No),
    ("wandb_log_model", Class::No),
    ("mlflow_tracking_uri", Class::No),
    ("mlflow_experiment_name", Class::No),
    ("num_epochs", Class::No),
    ("max_steps", Class::No),
    ("lr_scheduler", Class::No),
    ("learning_rate", Class::No),
    ("warmup_ratio", Class::No),
    ("warmup_steps", Class::No),
    ("weight_decay", Class::No),
    ("adam_beta1", Class::No),
    ("adam_beta2", Class::No),
    ("adam_epsilon", Class::No),
    ("cosine_min_lr_ratio", Class::No),
    ("logging_steps", Class::No),
    ("early_stopping_patience", Class::No),
    ("loss_watchdog_threshold", Class::No),
    ("loss_watchdog_patience", Class::No),
    ("special_tokens.*", Class::No),
    ("seed", Class::No),
    ("strict", Class::No),
    ("debug", Class::No),
    ("local_rank", Class::No),
];

/// axolotl's plugins: its Liger plugin applies Liger's function for the model's type with each
/// kernel its `liger_*` key turns on (an absent key is off: the plugin passes `None`); the GLU
/// key is Liger's `swiglu` or `geglu`, whichever the model's function takes. Other plugins are
/// not modelled.
fn liger(doc: &mut Doc) -> Result<Option<Liger>, TrainConfigError> {
    const KEYS: [(&str, &[LigerKernel]); 6] = [
        ("liger_rope", &[LigerKernel::Rope]),
        ("liger_rms_norm", &[LigerKernel::RmsNorm]),
        ("liger_layer_norm", &[LigerKernel::LayerNorm]),
        (
            "liger_glu_activation",
            &[LigerKernel::Swiglu, LigerKernel::Geglu],
        ),
        ("liger_cross_entropy", &[LigerKernel::CrossEntropy]),
        (
            "liger_fused_linear_cross_entropy",
            &[LigerKernel::FusedLinearCrossEntropy],
        ),
    ];
    let plugins = doc.names("plugins")?.unwrap_or_default();
    let (ligers, others): (Vec<_>, Vec<_>) =
        plugins.iter().partition(|p| p.ends_with("LigerPlugin"));
    if !others.is_empty() {
        doc.not_modelled(
            "plugins",
            format!(
                "axolotl plugins other than Liger's ({}) replace modules and losses; not modelled",
                others
                    .iter()
                    .map(|p| p.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        );
    }
    if ligers.is_empty() {
        for (key, _) in KEYS {
            doc.no_memory(key);
        }
        return Ok(None);
    }
    let mut kernels = BTreeMap::new();
    for (key, set) in KEYS {
        let on = doc.flag(key)?.unwrap_or(false);
        kernels.extend(set.iter().map(|k| (*k, on)));
    }
    Liger::new(kernels)
        .map(Some)
        .map_err(|e| doc.err("liger_cross_entropy", e.to_string()))
}

pub(crate) fn read(doc: &mut Doc, out: &mut TrainConfig) -> Result<Table, TrainConfigError> {
    if let Some(m) = doc.text("base_model")? {
        out.model = Some((m, "base_model".into()));
    }
    super::remote_code(doc, out, "trust_remote_code")?;
    if doc.get("base_model_config").is_some() {
        doc.used("base_model_config");
    }
    if let Some(b) = doc.positive("micro_batch_size")? {
        out.micro_batch = Some((b, "micro_batch_size".into()));
    }
    out.grad_accum = doc.count32("gradient_accumulation_steps")?;
    out.seq_len = doc.positive("sequence_len")?;
    super::compiled_model(doc, out, "torch_compile")?;
    out.liger = liger(doc)?;
    // An evaluation split (val_set_size: a fraction or a count) runs the Trainer's evaluation
    // loop at eval_batch_size (axolotl's default: micro_batch_size), losses only.
    let evaluates = doc.number("val_set_size")?.is_some_and(|v| v > 0.0);
    let eval_batch = doc.positive("eval_batch_size")?;
    // A run resumed (a checkpoint's path, or the newest one found) reads its optimizer state in.
    let resume =
        doc.resumes("resume_from_checkpoint")? | doc.resumes("auto_resume_from_checkpoints")?;
    if evaluates || resume {
        out.whole_run = Some(WholeRun {
            evaluation: evaluates.then(|| Evaluation {
                batch_size: eval_batch.or(out.micro_batch.as_ref().map(|b| b.0)),
                ..Evaluation::of(hf::EVAL_BATCHES)
            }),
            resume,
            ..WholeRun::default()
        });
    }
    // Packed (axolotl's multipack), every row is full — sequence_len tokens of several samples —
    // and carries their position ids, no padding mask.
    let packed = doc.flag("sample_packing")? == Some(true);
    out.attention_mask = Some(if packed {
        AttentionMask::None
    } else {
        AttentionMask::Padded
    });
    // pad_to_sequence_len: every batch padded to sequence_len, which is the length sized.
    doc.flag("pad_to_sequence_len")?;
    // Precision: axolotl loads the model in bf16/fp16 when bf16/fp16 is on (`auto`: bf16 where
    // the GPU has it) and trains under the Trainer's autocast: 16-bit weights.
    let half = |doc: &mut Doc, key: &str| -> Result<bool, TrainConfigError> {
        match doc.take(key) {
            None => Ok(false),
            Some(Value::String(s)) if s == "auto" => Ok(true),
            Some(_) => Ok(doc.flag(key)?.unwrap_or(false)),
        }
    };
    let bf16 = half(doc, "bf16")? || half(doc, "bfloat16")?;
    let fp16 = half(doc, "fp16")? || half(doc, "float16")?;
    if doc.flag("float32")? == Some(true) && (bf16 || fp16) {
        return Err(doc.err("float32", "float32 and a 16-bit dtype are both set"));
    }
    out.precision = Some(match (bf16, fp16) {
        (true, true) => return Err(doc.err("fp16", "bf16 and fp16 are both set")),
        (true, false) => Precision::Bf16,
        (false, true) => Precision::Fp16,
        (false, false) => Precision::Fp32,
    });
    // axolotl's switches, each naming the transformers implementation it loads the model with.
    for (key, attention) in [
        ("flash_attention", Attention::Flash),
        ("sdp_attention", Attention::Sdpa),
        ("eager_attention", Attention::Eager),
    ] {
        if doc.flag(key)? == Some(true) {
            out.attention = Some(attention);
        }
    }
    for key in ["xformers_attention", "s2_attention", "flex_attention"] {
        if doc.get(key).is_some() {
            doc.off_or_not_modelled(key, ATTN);
        }
    }
    super::hf_attention(doc, "attn_implementation", out)?;
    // FlashAttention-2 runs packed samples apart (varlen) with no mask; axolotl's other
    // implementations get a block-diagonal mask.
    if packed && out.attention != Some(Attention::Flash) {
        doc.not_modelled("sample_packing", PACKED);
    }
    if let Some(o) = doc.text("optimizer")? {
        out.optimizer = Some(super::optimizer(doc, "optimizer", &o, None)?);
    }
    if doc.get("optim_args").is_some() {
        doc.not_modelled(
            "optim_args",
            "optimizer arguments beyond its name are not modelled",
        );
    }
    match doc.take("gradient_checkpointing") {
        None => {}
        Some(Value::String(s)) if s == "offload" || s == "offload_disk" => {
            out.checkpointing = Some(Checkpointing::Full);
            doc.not_modelled("gradient_checkpointing", OFFLOAD_ACT);
        }
        Some(_) => {
            let on = doc.flag("gradient_checkpointing")?.unwrap_or(false);
            out.checkpointing = Some(super::hf_checkpointing(doc, on)?);
        }
    }
    if doc.get("activation_offloading").is_some() {
        doc.off_or_not_modelled("activation_offloading", OFFLOAD_ACT);
    }
    // LoRA / QLoRA.
    let adapter = doc.text("adapter")?;
    let four = doc.flag("load_in_4bit")?.unwrap_or(false);
    if doc.flag("load_in_8bit")? == Some(true) {
        doc.not_modelled(
            "load_in_8bit",
            "8-bit base weights (LLM.int8) are not modelled",
        );
    }
    let rank = doc.count32("lora_r")?;
    let alpha = doc.number("lora_alpha")?;
    let dropout = doc.number("lora_dropout")?;
    let mut targets = doc.names("lora_target_modules")?.unwrap_or_default();
    if doc.flag("lora_target_linear")? == Some(true) {
        targets = vec!["all-linear".into()];
    }
    match adapter.as_deref() {
        None | Some("") => {
            if four {
                doc.not_modelled(
                    "load_in_4bit",
                    "a 4-bit base without an adapter does not train",
                );
            }
        }
        Some(a @ ("lora" | "qlora")) => {
            if a == "qlora" && !four {
                return Err(doc.err("load_in_4bit", "adapter qlora needs load_in_4bit: true"));
            }
            let rank = rank.ok_or_else(|| doc.err("lora_r", "missing (adapter is set)"))?;
            // axolotl's QLoRA: nf4 with double quantization (its BitsAndBytesConfig).
            let quant = four.then_some(Quant4::new(true, true));
            out.lora = Some(super::lora(
                doc,
                "lora_target_modules",
                rank,
                alpha.unwrap_or(f64::from(rank)),
                targets,
                dropout.unwrap_or(0.0),
                quant,
            )?);
        }
        Some(other) => {
            return Err(doc.err(
                "adapter",
                format!("`{other}` is not modelled (lora, qlora)"),
            ));
        }
    }
    if let Some(layout) = hf::deepspeed_key(doc, "deepspeed")? {
        out.layout = layout;
    }
    if let Some(layout) = hf::fsdp(doc, "fsdp", "fsdp_config", out.precision)? {
        out.layout = layout;
    } else if doc.get("fsdp_config").is_some() || doc.get("fsdp_version").is_some() {
        if doc.whole("fsdp_version")? == Some(1) {
            doc.not_modelled(
                "fsdp_version",
                "FSDP1 (FlatParameter) is sized as FSDP2's per-parameter sharding",
            );
        }
        if let Some(layout) = hf::fsdp(doc, "fsdp_config", "fsdp_config", out.precision)? {
            out.layout = layout;
        }
    }
    if doc.get("ddp_bucket_cap_mb").is_some()
        && let super::Layout::Launcher { bucket_cap_mb } = &mut out.layout
    {
        *bucket_cap_mb = doc.count32("ddp_bucket_cap_mb")?.unwrap_or(*bucket_cap_mb);
    }
    if let Some(save) = hf::saving(doc, &out.layout)? {
        out.whole_run.get_or_insert_with(WholeRun::default).save = Some(save);
    }
    Ok(TABLE)
}
