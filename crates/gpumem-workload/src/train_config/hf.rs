//! Hugging Face `TrainingArguments` and TRL's `SFTConfig` (with TRL's `ModelConfig`, as `trl sft
//! --config` and the alignment handbook's recipes state them), as JSON or YAML of the arguments.

use gpumem_core::job::{
    Attention, AttentionMask, Evaluation, Filters, Generation, HalfDtype, Liger, LigerKernel,
    Precision, Quant4, Save, WholeRun,
};
use serde_json::Value;
use std::collections::BTreeMap;

use super::{
    BROADCAST_LOAD, CLIP, COMPILE, Class, Doc, EVAL, Layout, PACKED, TRAINER_SAVE, Table,
    TrainConfig, TrainConfigError, TrainerKind,
};
use crate::deepspeed;

/// The keys no reader takes, and their fate.
pub(crate) const TABLE: Table = &[
    // Evaluation (read by `evaluation` where the config evaluates) and saving: the whole run's.
    ("do_predict", Class::Not(EVAL)),
    ("eval_steps", Class::No),
    ("eval_delay", Class::No),
    ("eval_on_start", Class::No),
    ("bf16_full_eval", Class::Not(EVAL)),
    ("fp16_full_eval", Class::Not(EVAL)),
    ("eval_packing", Class::Not(EVAL)),
    ("load_best_model_at_end", Class::Not(TRAINER_SAVE)),
    ("metric_for_best_model", Class::Not(EVAL)),
    ("greater_is_better", Class::No),
    ("save_only_model", Class::Not(TRAINER_SAVE)),
    ("save_safetensors", Class::No),
    ("save_on_each_node", Class::No),
    ("save_total_limit", Class::No),
    // Loop pieces that change memory, not modelled.
    ("torch_compile_backend", Class::Not(COMPILE)),
    ("torch_compile_mode", Class::Not(COMPILE)),
    ("max_grad_norm", Class::Not(CLIP)),
    (
        "neftune_noise_alpha",
        Class::Not("NEFTune's noised embeddings are not modelled (one embedding-sized tensor)"),
    ),
    (
        "label_smoothing_factor",
        Class::Not("label smoothing's loss temporaries are not modelled"),
    ),
    (
        "auto_find_batch_size",
        Class::Not(
            "the Trainer halves the batch after an out-of-memory error; gpumem sizes the stated batch",
        ),
    ),
    (
        "torch_empty_cache_steps",
        Class::Not(
            "emptying the allocator's cache lowers reserved memory between steps; not modelled",
        ),
    ),
    (
        "optim_args",
        Class::Not("optimizer arguments beyond its name are not modelled"),
    ),
    (
        "optim_target_modules",
        Class::Not("optimizer target modules (GaLore and kin) are not modelled"),
    ),
    (
        "group_by_length",
        Class::Not(
            "length-grouped batches change the padded length per batch; sized at the stated length",
        ),
    ),
    (
        "dataset_kwargs",
        Class::Not(
            "dataset preparation arguments (packing, truncation) may change the sequence length",
        ),
    ),
    ("use_cpu", Class::Not("a CPU run: no GPU memory")),
    ("ddp_find_unused_parameters", Class::No),
    ("ddp_broadcast_buffers", Class::No),
    ("ddp_backend", Class::No),
    ("ddp_timeout", Class::No),
    ("dataloader_pin_memory", Class::No),
    ("dataloader_num_workers", Class::No),
    ("dataloader_prefetch_factor", Class::No),
    ("dataloader_persistent_workers", Class::No),
    ("dataloader_drop_last", Class::No),
    ("tf32", Class::No),
    // Not bearing on memory.
    ("output_dir", Class::No),
    ("overwrite_output_dir", Class::No),
    ("logging_dir", Class::No),
    ("logging_strategy", Class::No),
    ("logging_steps", Class::No),
    ("logging_first_step", Class::No),
    ("log_level", Class::No),
    ("log_level_replica", Class::No),
    ("report_to", Class::No),
    ("run_name", Class::No),
    ("disable_tqdm", Class::No),
    ("seed", Class::No),
    ("data_seed", Class::No),
    ("full_determinism", Class::No),
    ("learning_rate", Class::No),
    ("weight_decay", Class::No),
    ("adam_beta1", Class::No),
    ("adam_beta2", Class::No),
    ("adam_epsilon", Class::No),
    ("lr_scheduler_type", Class::No),
    ("lr_scheduler_kwargs.*", Class::No),
    ("warmup_ratio", Class::No),
    ("warmup_steps", Class::No),
    ("num_train_epochs", Class::No),
    ("max_steps", Class::No),
    ("push_to_hub", Class::No),
    ("hub_model_id", Class::No),
    ("hub_strategy", Class::No),
    ("hub_private_repo", Class::No),
    ("remove_unused_columns", Class::No),
    ("label_names", Class::No),
    ("local_rank", Class::No),
    ("average_tokens_across_devices", Class::No),
    ("include_num_input_tokens_seen", Class::No),
    ("dataset_text_field", Class::No),
    ("dataset_num_proc", Class::No),
    ("dataset_name", Class::No),
    ("dataset_config", Class::No),
    ("dataset_config_name", Class::No),
    ("do_train", Class::No),
    ("dataset_train_split", Class::No),
    ("dataset_test_split", Class::No),
    ("dataset_mixture.*", Class::No),
    ("dataset_mixer.*", Class::No),
    ("dataset_splits", Class::No),
    ("preprocessing_num_workers", Class::No),
    ("chat_template", Class::No),
    ("eos_token", Class::No),
    ("pad_token", Class::No),
    ("completion_only_loss", Class::No),
    ("assistant_only_loss", Class::No),
    ("model_revision", Class::No),
    ("tokenizer_name_or_path", Class::No),
    ("lora_task_type", Class::No),
    ("use_rslora", Class::No),
    ("hub_model_revision", Class::No),
];

/// The Trainer's `use_liger_kernel`: Liger applied to the model as the Trainer applies it, with
/// `liger_kernel_config`'s keywords (each a kernel on or off) over Liger's defaults.
fn liger(doc: &mut Doc) -> Result<Option<Liger>, TrainConfigError> {
    if doc.flag("use_liger_kernel")? != Some(true) {
        doc.no_memory("liger_kernel_config");
        return Ok(None);
    }
    let names: Vec<String> = match doc.get("liger_kernel_config") {
        None | Some(Value::Null) => vec![],
        Some(Value::Object(m)) => m.keys().cloned().collect(),
        Some(other) => {
            return Err(doc.err(
                "liger_kernel_config",
                format!("{other} is not a table of kernels"),
            ));
        }
    };
    let mut kernels = BTreeMap::new();
    for name in names {
        let key = format!("liger_kernel_config.{name}");
        let kernel = LigerKernel::parse(&name).map_err(|e| doc.err(&key, e.to_string()))?;
        let on = doc
            .flag(&key)?
            .ok_or_else(|| doc.err(&key, "is not true or false"))?;
        kernels.insert(kernel, on);
    }
    Liger::new(kernels)
        .map(Some)
        .map_err(|e| doc.err("liger_kernel_config", e.to_string()))
}

fn precision_of_dtype(
    doc: &Doc,
    field: &str,
    dtype: &str,
) -> Result<Option<bool>, TrainConfigError> {
    match dtype {
        "bfloat16" | "torch.bfloat16" | "bf16" => Ok(Some(true)),
        "float16" | "torch.float16" | "fp16" | "half" => Ok(Some(false)),
        "float32" | "torch.float32" | "fp32" => Ok(None),
        "auto" => Err(doc.err(
            field,
            "`auto` loads the checkpoint's own dtype, which the config does not state; give --precision",
        )),
        other => Err(doc.err(field, format!("`{other}` is not bfloat16, float16, float32 or auto"))),
    }
}

pub(crate) fn read(doc: &mut Doc, out: &mut TrainConfig) -> Result<Table, TrainConfigError> {
    for key in ["model_name_or_path", "model_name", "model"] {
        if let Some(m) = doc.text(key)? {
            out.model = Some((m, key.into()));
            break;
        }
    }
    for key in ["trust_remote_code", "model_init_kwargs.trust_remote_code"] {
        super::remote_code(doc, out, key)?;
    }
    if let Some(b) = doc.positive("per_device_train_batch_size")? {
        out.micro_batch = Some((b, "per_device_train_batch_size".into()));
    }
    out.grad_accum = doc.count32("gradient_accumulation_steps")?;
    super::compiled_model(doc, out, "torch_compile")?;
    // TRL's max_length (max_seq_length before), transformers' run_clm.py's block_size.
    for key in ["max_length", "max_seq_length", "block_size"] {
        if let Some(n) = doc.positive(key)? {
            out.seq_len = Some(n);
        }
    }
    // Packed (TRL's `packing`) or padding-free, every row is full — the maximum length of
    // several samples, no padding — and no padding mask is passed (TRL's default packing, "bfd",
    // is padding-free: position ids mark where each sample starts).
    let packed = doc.flag("packing")?;
    let padding_free = doc.flag("padding_free")? == Some(true);
    let padding_free = if packed == Some(true) {
        let strategy = doc.text("packing_strategy")?;
        padding_free || strategy.as_deref().unwrap_or("bfd") == "bfd"
    } else {
        // How to pack, where nothing is packed, bears on nothing.
        doc.no_memory("packing_strategy");
        padding_free
    };
    match packed {
        Some(true) => out.attention_mask = Some(AttentionMask::None),
        _ if padding_free => out.attention_mask = Some(AttentionMask::None),
        // TRL's collator pads a batch and passes its attention mask.
        Some(false) => out.attention_mask = Some(AttentionMask::Padded),
        // TRL pads (and passes the mask) unless told to pack.
        None if out.kind == TrainerKind::TrlSft => out.attention_mask = Some(AttentionMask::Padded),
        None => {}
    }
    // Precision: bf16/fp16 are autocast over fp32 weights; a model loaded in a 16-bit dtype
    // (TRL's model_init_kwargs or ModelConfig's dtype) trains its weights in it.
    // TRL's SFTConfig trains in bf16 unless told fp16 (0.19 on) and checkpoints its
    // activations, non-reentrant (0.22 on), where the config does not say.
    let trl = out.kind == TrainerKind::TrlSft;
    let fp16 = doc.flag("fp16")?.unwrap_or(false);
    let bf16 = doc.flag("bf16")?.unwrap_or(trl && !fp16);
    if bf16 && fp16 {
        return Err(doc.err("fp16", "bf16 and fp16 are both true"));
    }
    let mut loaded = None;
    for key in [
        "torch_dtype",
        "dtype",
        "model_init_kwargs.torch_dtype",
        "model_init_kwargs.dtype",
    ] {
        if let Some(d) = doc.text(key)? {
            loaded = precision_of_dtype(doc, key, &d)?.map(|bf| (bf, key));
        }
    }
    out.precision = Some(match (loaded, bf16, fp16) {
        (Some((true, _)), _, _) => Precision::Bf16,
        (Some((false, _)), _, _) => Precision::Fp16,
        (None, true, _) => Precision::AmpBf16,
        (None, _, true) => Precision::AmpFp16,
        (None, false, false) => Precision::Fp32,
    });
    if let Some(b) = doc.text("half_precision_backend")?
        && b != "auto"
    {
        doc.not_modelled(
            "half_precision_backend",
            "only torch's autocast is modelled",
        );
    }
    for key in [
        "attn_implementation",
        "model_init_kwargs.attn_implementation",
    ] {
        super::hf_attention(doc, key, out)?;
    }
    // Only FlashAttention-2 runs padding-free rows as separate samples without a mask.
    if padding_free && out.attention != Some(Attention::Flash) {
        let key = if packed == Some(true) {
            "packing"
        } else {
            "padding_free"
        };
        doc.not_modelled(key, PACKED);
    }
    if let Some(o) = doc.text("optim")? {
        out.optimizer = Some(super::optimizer(doc, "optim", &o, None)?);
    }
    if let Some(on) = doc.flag("gradient_checkpointing")?.or(trl.then_some(true)) {
        out.checkpointing = Some(super::hf_checkpointing(doc, on)?);
    }
    read_peft(doc, out)?;
    out.liger = liger(doc)?;
    let evaluation = evaluation(doc)?;
    let generation = rollouts(doc, out)?;
    let resume = doc.resumes("resume_from_checkpoint")?;
    // Ranks: a DeepSpeed config, FSDP, or DDP under the launcher.
    let bucket = doc.count32("ddp_bucket_cap_mb")?;
    out.layout = Layout::Launcher {
        bucket_cap_mb: bucket.unwrap_or(gpumem_core::job::DDP_BUCKET_CAP_MB),
    };
    if let Some(layout) = deepspeed_key(doc, "deepspeed")? {
        out.layout = layout;
    }
    if let Some(layout) = fsdp(doc, "fsdp", "fsdp_config", out.precision)? {
        if matches!(out.layout, Layout::Zero { .. }) {
            return Err(doc.err("fsdp", "both DeepSpeed and FSDP are configured"));
        }
        out.layout = layout;
    }
    let save = saving(doc, &out.layout)?;
    let stated = evaluation.is_some() || generation.is_some() || save.is_some();
    out.whole_run = (stated || resume).then_some(WholeRun {
        evaluation,
        generation,
        save,
        resume,
        broadcast_load: false,
    });
    Ok(TABLE)
}

/// The Trainer's checkpoints, where the config names them (`save_strategy` other than `no`,
/// or `save_steps`; axolotl's `saves_per_epoch` too): on one GPU, under DDP and DeepSpeed
/// (each rank's files) `torch.save` copies every tensor to the host and nothing more is on the
/// GPU (measured on an H200: docs/run.md); under FSDP accelerate writes the full state dicts,
/// gathered onto rank 0's host as they come (`offload_to_cpu`), unless `state_dict_type` is
/// sharded (transformers hands accelerate `FULL_STATE_DICT` where it is unset, FSDP2 too).
pub(crate) fn saving(doc: &mut Doc, layout: &Layout) -> Result<Option<Save>, TrainConfigError> {
    let mut named = false;
    for key in ["save_steps", "saves_per_epoch"] {
        named |= doc.take(key).is_some();
    }
    if let Some(s) = doc.text("save_strategy")? {
        named = match s.as_str() {
            "no" => false,
            "steps" | "epoch" | "best" => true,
            other => {
                return Err(doc.err(
                    "save_strategy",
                    format!("`{other}` is not no, steps, epoch or best"),
                ));
            }
        };
    }
    if !named {
        return Ok(None);
    }
    match layout {
        Layout::Fsdp { .. } => {}
        // DeepSpeed's consolidated 16-bit save (the Trainer saves the model through it).
        Layout::Zero { job, .. } if job.gathers_16bit_on_save => return Ok(Some(Save::Full)),
        _ => return Ok(Some(Save::Sharded)),
    }
    for key in [
        "fsdp_config.state_dict_type",
        "fsdp_config.fsdp_state_dict_type",
    ] {
        if let Some(t) = doc.text(key)? {
            return match t.as_str() {
                "FULL_STATE_DICT" => Ok(Some(Save::FullOffload)),
                "SHARDED_STATE_DICT" | "LOCAL_STATE_DICT" => Ok(Some(Save::Sharded)),
                other => Err(doc.err(
                    key,
                    format!(
                        "`{other}` is not FULL_STATE_DICT, SHARDED_STATE_DICT or LOCAL_STATE_DICT"
                    ),
                )),
            };
        }
    }
    Ok(Some(Save::FullOffload))
}

/// The Trainer's default `per_device_eval_batch_size`.
const EVAL_BATCH_SIZE: u64 = 8;

/// Batches an evaluation the config names is sized at: the evaluation set's size is the
/// dataset's, not the config's, and the Trainer without metrics keeps only each batch's loss,
/// so its peak is reached by the second batch.
pub(crate) const EVAL_BATCHES: u32 = 2;

/// The Trainer's evaluation loop, where the config evaluates (`eval_strategy` other than `no`,
/// or `do_eval`): at `per_device_eval_batch_size` (8 where unset), its losses only — metrics
/// (`compute_metrics`, which keeps the logits) are code, not config: `--eval-logits`.
fn evaluation(doc: &mut Doc) -> Result<Option<Evaluation>, TrainConfigError> {
    let mut on = doc.flag("do_eval")?.unwrap_or(false);
    for key in ["eval_strategy", "evaluation_strategy"] {
        if let Some(s) = doc.text(key)? {
            on = match s.as_str() {
                "no" => false,
                "steps" | "epoch" => true,
                other => return Err(doc.err(key, format!("`{other}` is not no, steps or epoch"))),
            };
        }
    }
    let batch_size = doc.positive("per_device_eval_batch_size")?;
    let accumulation_steps = doc.count32("eval_accumulation_steps")?;
    let loss_only = doc.flag("prediction_loss_only")?.unwrap_or(false);
    // What compute_metrics is given (`inputs`, `loss`) says there is one: the logits are kept.
    let mut inputs = doc
        .names("include_for_metrics")?
        .map(|given| given.iter().any(|g| g == "inputs"));
    if let Some(on) = doc.flag("include_inputs_for_metrics")? {
        inputs = Some(on || inputs.unwrap_or(false)); // its spelling before transformers 4.46
    }
    let as_list = doc.flag("eval_do_concat_batches")? == Some(false);
    Ok(on.then(|| Evaluation {
        batch_size: Some(batch_size.unwrap_or(EVAL_BATCH_SIZE)),
        accumulation_steps,
        logits: inputs.is_some() && !loss_only,
        inputs: inputs.unwrap_or(false) && !loss_only,
        as_list,
        ..Evaluation::of(EVAL_BATCHES)
    }))
}

/// TRL's online trainers (`GRPOConfig`, `RLOOConfig`: `num_generations` completions of each
/// prompt) generate with the model they train before they train on it: each GPU's generation
/// batch — `per_device_train_batch_size` × `steps_per_generation` (which defaults to the
/// gradient accumulation) — of prompts of `max_prompt_length` tokens (TRL's default 512)
/// continued by `max_completion_length` tokens (256); the step trains on prompt and completion
/// together, its sequence length theirs unless the config says another. DPO's
/// `max_completion_length` truncates a dataset's completions instead: without
/// `num_generations` it is not read here.
fn rollouts(doc: &mut Doc, out: &mut TrainConfig) -> Result<Option<Generation>, TrainConfigError> {
    if doc.get("num_generations").is_none() {
        return Ok(None);
    }
    doc.count32("num_generations")?;
    let new_tokens = doc.count32("max_completion_length")?.unwrap_or(256);
    let prompt_len = doc.positive("max_prompt_length")?.unwrap_or(512);
    let steps = doc
        .count32("steps_per_generation")?
        .or(out.grad_accum)
        .unwrap_or(1);
    if out.seq_len.is_none() {
        out.seq_len = Some(prompt_len + u64::from(new_tokens));
    }
    if doc.get("generation_batch_size").is_some() {
        doc.not_modelled(
            "generation_batch_size",
            "a generation batch over every process; each GPU is sized at per_device_train_batch_size × steps_per_generation",
        );
    }
    // The sampling filters TRL passes to generate(): top-k from 1, top-p below 1, min-p above 0
    // (none where the config is silent).
    let filters = Filters {
        top_k: doc.count32("top_k")?.filter(|&k| k > 0),
        top_p: doc.number("top_p")?.is_some_and(|p| p < 1.0),
        min_p: doc.number("min_p")?.is_some_and(|p| p > 0.0),
    };
    // The KL term's reference: a frozen copy of the model (TRL's create_reference_model), but
    // for a PEFT model, whose reference is itself with its adapters off. TRL's default beta
    // has been 0 (no reference) since 0.19.
    if doc.number("beta")?.is_some_and(|b| b > 0.0) && out.lora.is_none() {
        out.reference_model = Some(true);
    }
    if doc.flag("use_vllm")? == Some(true) {
        doc.not_modelled(
            "use_vllm",
            "completions generated by vLLM (its own memory: vllm_gpu_memory_utilization) are not modelled",
        );
        return Ok(None);
    }
    Ok(Some(Generation {
        new_tokens,
        batch_size: out.micro_batch.as_ref().map(|b| b.0 * u64::from(steps)),
        prompt_len: Some(prompt_len),
        filters,
    }))
}

/// TRL's `ModelConfig` LoRA/QLoRA keys (`use_peft`, `lora_*`, `load_in_4bit`, …) and a
/// `peft_config` mapping where one is given inline.
fn read_peft(doc: &mut Doc, out: &mut TrainConfig) -> Result<(), TrainConfigError> {
    let use_peft = doc.flag("use_peft")?.unwrap_or(false) || doc.get("peft_config").is_some();
    let four = doc.flag("load_in_4bit")?.unwrap_or(false);
    if doc.flag("load_in_8bit")? == Some(true) {
        doc.not_modelled(
            "load_in_8bit",
            "8-bit base weights (LLM.int8) are not modelled",
        );
    }
    let quant_type = doc.text("bnb_4bit_quant_type")?;
    let double = doc.flag("use_bnb_nested_quant")?;
    doc.used("bnb_4bit_compute_dtype");
    doc.used("bnb_4bit_quant_storage");
    let p = if doc.get("peft_config").is_some() {
        "peft_config."
    } else {
        ""
    };
    let rank = doc
        .count32(&format!("{p}lora_r"))?
        .or(doc.count32(&format!("{p}r"))?);
    let alpha = doc.number(&format!("{p}lora_alpha"))?;
    let dropout = doc.number(&format!("{p}lora_dropout"))?;
    let targets = doc
        .names(&format!("{p}lora_target_modules"))?
        .or(doc.names(&format!("{p}target_modules"))?);
    if doc.get(&format!("{p}lora_modules_to_save")).is_some() {
        doc.not_modelled(
            &format!("{p}lora_modules_to_save"),
            "modules trained whole beside LoRA are not modelled",
        );
    }
    if !use_peft {
        if four {
            doc.not_modelled("load_in_4bit", "a 4-bit base without LoRA does not train");
        }
        return Ok(());
    }
    let quant = if four {
        Some(Quant4::new(
            quant_type.as_deref() != Some("fp4"),
            double.unwrap_or(false),
        ))
    } else {
        None
    };
    // TRL's ModelConfig defaults: r 16, alpha 32, dropout 0.05; PEFT's targets for the model
    // (q_proj, v_proj on Llama-like models).
    let targets = match targets {
        Some(t) if t.len() == 1 && t[0] == "all-linear" => t,
        Some(t) => t,
        None => vec!["q_proj".into(), "v_proj".into()],
    };
    out.lora = Some(super::lora(
        doc,
        "lora_r",
        rank.unwrap_or(16),
        alpha.unwrap_or(32.0),
        targets,
        dropout.unwrap_or(0.05),
        quant,
    )?);
    Ok(())
}

/// A `deepspeed` key: a path to a DeepSpeed JSON (relative to the config) or the config inline.
pub(crate) fn deepspeed_key(doc: &mut Doc, key: &str) -> Result<Option<Layout>, TrainConfigError> {
    let (text, name) = match doc.get(key).cloned() {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(path)) => {
            let full = doc.dir.join(&path);
            let text = std::fs::read_to_string(&full)
                .map_err(|e| doc.err(key, format!("{}: {e}", full.display())))?;
            (text, full.display().to_string())
        }
        Some(v @ Value::Object(_)) => (v.to_string(), "(inline)".to_string()),
        Some(other) => return Err(doc.err(key, format!("{other} is not a path or a mapping"))),
    };
    doc.used(key);
    let job = deepspeed::read_config(&text).map_err(|e| doc.err(key, format!("{name}: {e}")))?;
    Ok(Some(Layout::Zero {
        job,
        field: key.into(),
    }))
}

/// Hugging Face's (and axolotl's) FSDP: `fsdp` (`full_shard auto_wrap offload`, or a list; or
/// axolotl's `true`) with `fsdp_config` (`version`/`fsdp_version`, `reshard_after_forward`,
/// `offload_params`, `sharding_strategy`, with or without the `fsdp_` prefix).
pub(crate) fn fsdp(
    doc: &mut Doc,
    key: &str,
    config_key: &str,
    precision: Option<Precision>,
) -> Result<Option<Layout>, TrainConfigError> {
    let mut words: Vec<String> = match doc.get(key).cloned() {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Vec::new(),
        Some(Value::Bool(true)) => vec!["full_shard".into()],
        Some(Value::Object(_)) if key == config_key => Vec::new(),
        Some(Value::String(s)) => s.split_whitespace().map(str::to_string).collect(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| doc.err(key, format!("{v} is not a name")))
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(doc.err(key, format!("{other} is not an FSDP option list"))),
    };
    if key != config_key {
        doc.used(key);
    }
    let has_config = doc.get(config_key).is_some_and(|v| v.is_object());
    if words.is_empty() && !has_config {
        return Ok(None);
    }
    let c = |name: &str| format!("{config_key}.{name}");
    let pick = |doc: &Doc, name: &str| {
        [c(name), c(&format!("fsdp_{name}"))]
            .into_iter()
            .find(|k| doc.get(k).is_some())
    };
    if let Some(k) = pick(doc, "version") {
        match doc.whole(&k)? {
            Some(2) | None => {}
            Some(1) => doc.not_modelled(
                &k,
                "FSDP1 (FlatParameter) is sized as FSDP2's per-parameter sharding",
            ),
            Some(v) => return Err(doc.err(&k, format!("{v} is not FSDP version 1 or 2"))),
        }
    }
    if let Some(k) = pick(doc, "sharding_strategy")
        && let Some(s) = doc.text(&k)?
    {
        words.push(s.to_ascii_lowercase());
    }
    let mut reshard = true;
    let mut cpu_offload = false;
    for w in &words {
        match w.as_str() {
            "full_shard" | "1" | "auto_wrap" => {}
            "shard_grad_op" | "2" => reshard = false,
            "offload" => cpu_offload = true,
            "no_shard" | "3" => {
                return Ok(Some(Layout::Launcher {
                    bucket_cap_mb: gpumem_core::job::DDP_BUCKET_CAP_MB,
                }));
            }
            "hybrid_shard" | "hybrid_shard_zero2" | "4" | "5" => {
                return Err(doc.err(
                    key,
                    format!("`{w}` needs the replicas' count, which the config does not state: use --strategy hsdp --nodes N"),
                ));
            }
            other => return Err(doc.err(key, format!("`{other}` is not an FSDP option gpumem models (full_shard, shard_grad_op, no_shard, offload, auto_wrap)"))),
        }
    }
    if let Some(k) = pick(doc, "reshard_after_forward")
        && let Some(r) = doc.flag(&k)?
    {
        reshard = r;
    }
    if let Some(k) = pick(doc, "offload_params")
        && let Some(o) = doc.flag(&k)?
    {
        cpu_offload = cpu_offload || o;
    }
    if let Some(k) = pick(doc, "activation_checkpointing")
        && doc.flag(&k)? == Some(true)
    {
        doc.not_modelled(&k, "FSDP's own activation checkpointing is sized as gradient_checkpointing: give that key instead");
    }
    // Rank 0 loads the model and broadcasts it parameter by parameter: each rank's GPU holds
    // one whole parameter beside its shards while it loads (accelerate's
    // fsdp2_load_full_state_dict). The steps are the same.
    for name in ["cpu_ram_efficient_loading", "sync_module_states"] {
        for k in [c(name), c(&format!("fsdp_{name}"))] {
            match doc.flag(&k)? {
                Some(true) => doc.not_modelled(&k, BROADCAST_LOAD),
                Some(false) => doc.no_memory(&k),
                None => {}
            }
        }
    }
    for name in [
        "auto_wrap_policy",
        "transformer_layer_cls_to_wrap",
        "state_dict_type",
        "use_orig_params",
        "limit_all_gathers",
        "backward_prefetch",
        "forward_prefetch",
        "min_num_params",
    ] {
        for k in [c(name), c(&format!("fsdp_{name}"))] {
            if doc.get(&k).is_some() {
                doc.no_memory(&k);
            }
        }
    }
    for name in ["backward_prefetch", "forward_prefetch", "limit_all_gathers"] {
        for k in [c(name), c(&format!("fsdp_{name}"))] {
            if doc.get(&k).is_some() {
                doc.not_modelled(&k, "prefetching and all-gather limits change how many layers are gathered at once; gpumem sizes FSDP2's defaults");
            }
        }
    }
    // Mixed precision under FSDP: the layers gathered and computed in the autocast dtype.
    let param_dtype = match precision {
        Some(Precision::AmpBf16 | Precision::Bf16) => Some(HalfDtype::Bf16),
        Some(Precision::AmpFp16 | Precision::Fp16) => Some(HalfDtype::Fp16),
        _ => None,
    };
    // Under accumulation the Trainer wraps all but the last micro-batch in accelerate's
    // `no_sync` (the gradients accumulate unsharded) unless accelerate is told to sync each.
    let sync_each_batch = doc
        .flag("accelerator_config.gradient_accumulation_kwargs.sync_each_batch")?
        .unwrap_or(false);
    Ok(Some(Layout::Fsdp {
        replicate: 1,
        shard: None,
        tensor: 1,
        pipeline: 1,
        schedule: None,
        context: 1,
        expert: 1,
        reshard_after_forward: reshard,
        param_dtype,
        cpu_offload,
        sync_each_batch,
        field: if key == "fsdp" { "fsdp" } else { "fsdp_config" },
    }))
}
