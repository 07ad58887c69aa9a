//! torchtune's recipe YAML (`tune run RECIPE --config FILE`).

use gpumem_core::job::{
    AttentionMask, Checkpointing, Implementation, Optimizer, Precision, Quant4,
};

use super::{
    CHUNKED_CE, CLIP, Class, Doc, EVAL, Layout, SAVE, Table, TrainConfig, TrainConfigError,
};

pub(crate) const TABLE: Table = &[
    ("output_dir", Class::No),
    ("tokenizer.*", Class::No),
    ("checkpointer.*", Class::No),
    ("save_adapter_weights_only", Class::Not(SAVE)),
    ("dataset.*", Class::No),
    ("dataset_val.*", Class::Not(EVAL)),
    ("run_val_every_n_steps", Class::Not(EVAL)),
    ("seed", Class::No),
    ("shuffle", Class::No),
    ("epochs", Class::No),
    ("max_steps_per_epoch", Class::No),
    ("lr_scheduler.*", Class::No),
    ("optimizer.lr", Class::No),
    ("optimizer.weight_decay", Class::No),
    ("optimizer.betas", Class::No),
    ("optimizer.eps", Class::No),
    ("metric_logger.*", Class::No),
    ("log_every_n_steps", Class::No),
    ("log_peak_memory_stats", Class::No),
    ("log_level", Class::No),
    ("device", Class::No),
    ("profiler.*", Class::No),
    ("activation_offloading_use_streams", Class::No),
    (
        "custom_sharded_layers",
        Class::Not("layers sharded on their own (FSDP units beyond each block) are not modelled"),
    ),
    ("low_cpu_ram", Class::No),
];

/// torchtune's module names as Hugging Face's Llama names them (gpumem resolves the model as
/// its Hugging Face checkpoint).
fn hf_name(doc: &Doc, module: &str) -> Result<&'static str, TrainConfigError> {
    Ok(match module {
        "q_proj" => "q_proj",
        "k_proj" => "k_proj",
        "v_proj" => "v_proj",
        "output_proj" => "o_proj",
        other => {
            return Err(doc.err(
                "model.lora_attn_modules",
                format!("`{other}` is not q_proj, k_proj, v_proj or output_proj"),
            ));
        }
    })
}

pub(crate) fn read(doc: &mut Doc, out: &mut TrainConfig) -> Result<Table, TrainConfigError> {
    let builder = doc
        .text("model._component_")?
        .ok_or_else(|| doc.err("model._component_", "missing"))?;
    let last = builder.rsplit('.').next().unwrap_or(&builder).to_string();
    // Resumed, the recipe reads the optimizer state back before its first step.
    if doc.resumes("resume_from_checkpoint")? {
        out.whole_run = Some(gpumem_core::job::WholeRun {
            resume: true,
            ..Default::default()
        });
    }
    // The model: the Hugging Face checkpoint the checkpointer reads, where it reads one.
    let hf = doc
        .get("checkpointer._component_")
        .and_then(|v| v.as_str())
        .is_some_and(|c| c.ends_with("FullModelHFCheckpointer"));
    match doc
        .get("checkpointer.checkpoint_dir")
        .and_then(|v| v.as_str())
    {
        Some(dir) if hf => {
            out.model = Some((dir.to_string(), "checkpointer.checkpoint_dir".into()));
            doc.used("checkpointer.checkpoint_dir");
            doc.used("checkpointer._component_");
        }
        _ => out.model = Some((builder.clone(), "model._component_".into())),
    }
    if let Some(b) = doc.positive("batch_size")? {
        out.micro_batch = Some((b, "batch_size".into()));
    }
    out.grad_accum = doc.count32("gradient_accumulation_steps")?;
    out.seq_len = doc.positive("tokenizer.max_seq_len")?;
    // torchtune's padded collate passes no attention mask (causal attention over the pads);
    // packed (PackedDataset), every row is max_seq_len tokens of several samples, whose
    // block-causal mask is FlexAttention's BlockMask on GPUs that run it (capability 7.5 on).
    doc.flag("dataset.packed")?;
    out.attention_mask = Some(AttentionMask::None);
    // dtype: torchtune trains the weights themselves in it (no autocast).
    out.precision = Some(match doc.text("dtype")?.as_deref() {
        None | Some("fp32") => Precision::Fp32,
        Some("bf16") => Precision::Bf16,
        Some("fp16") => Precision::Fp16,
        Some(other) => return Err(doc.err("dtype", format!("`{other}` is not bf16, fp32 or fp16"))),
    });
    if let Some(c) = doc.text("optimizer._component_")? {
        let fused = doc.flag("optimizer.fused")?.unwrap_or(false);
        let mut o = super::optimizer(
            doc,
            "optimizer._component_",
            &c,
            fused.then_some(Implementation::Fused),
        )?;
        if fused {
            doc.used("optimizer.fused");
        }
        if c.to_ascii_lowercase().ends_with("sgd")
            && doc.number("optimizer.momentum")?.is_some_and(|m| m > 0.0)
        {
            o = Optimizer::SgdMomentum(o.implementation().unwrap_or_default());
        }
        out.optimizer = Some(o);
    }
    out.optimizer_in_backward = doc.flag("optimizer_in_bwd")?;
    match doc.text("loss._component_")?.as_deref() {
        Some("torch.nn.CrossEntropyLoss") | None => {}
        // The recipes chunk the model's output projection to the loss's chunk count.
        Some(c) if c.ends_with("CEWithChunkedOutputLoss") => {
            let chunks = doc.count32("loss.num_output_chunks")?.unwrap_or(8);
            out.chunked_ce = Some(chunks);
        }
        Some(_) => doc.not_modelled("loss", CHUNKED_CE),
    }
    super::compiled_model(doc, out, "compile")?;
    doc.off_or_not_modelled("clip_grad_norm", CLIP);
    if let Some(on) = doc.flag("enable_activation_checkpointing")? {
        out.checkpointing = Some(if on {
            Checkpointing::Full
        } else {
            Checkpointing::Off
        });
    }
    out.activation_offloading = doc.flag("enable_activation_offloading")?;
    doc.off_or_not_modelled("ac_mode", "torchtune's selective modes are not mapped");
    doc.off_or_not_modelled("ac_option", "torchtune's selective modes are not mapped");
    // LoRA: the builder's name says LoRA or QLoRA, its arguments the rest.
    let qlora = last.starts_with("qlora_") || doc.flag("model.quantize_base")?.unwrap_or(false);
    if last.starts_with("lora_") || qlora {
        let mut targets: Vec<String> = Vec::new();
        for m in doc.names("model.lora_attn_modules")?.unwrap_or_default() {
            targets.push(hf_name(doc, &m)?.into());
        }
        if doc.flag("model.apply_lora_to_mlp")?.unwrap_or(false) {
            targets.extend(["gate_proj", "up_proj", "down_proj"].map(String::from));
        }
        if doc.flag("model.apply_lora_to_output")?.unwrap_or(false) {
            targets.push("lm_head".into());
        }
        let rank = doc
            .count32("model.lora_rank")?
            .ok_or_else(|| doc.err("model.lora_rank", "missing for a LoRA builder"))?;
        let alpha = doc.number("model.lora_alpha")?.unwrap_or(16.0);
        let dropout = doc.number("model.lora_dropout")?.unwrap_or(0.0);
        // torchtune's QLoRA: torchao's NF4 with its scalers quantized again.
        let quant = qlora.then_some(Quant4::new(true, true));
        out.lora = Some(super::lora(
            doc,
            "model.lora_attn_modules",
            rank,
            alpha,
            targets,
            dropout,
            quant,
        )?);
        doc.off_or_not_modelled(
            "model.use_dora",
            "DoRA's magnitude vectors and its extra forward are not modelled",
        );
    }
    // Ranks: the distributed recipes shard with FSDP2 over the launcher's ranks.
    let distributed = [
        "fsdp_cpu_offload",
        "fsdp_reshard_after_forward",
        "data_parallel_shard_dim",
        "data_parallel_replicate_dim",
        "tensor_parallel_dim",
    ]
    .iter()
    .any(|k| doc.get(k).is_some());
    out.layout = if distributed {
        for (key, dim) in [
            ("tensor_parallel_dim", gpumem_core::job::MeshDim::Tensor),
            ("context_parallel_dim", gpumem_core::job::MeshDim::Context),
        ] {
            if let Some(n) = doc.count32(key)?
                && n > 1
            {
                if dim == gpumem_core::job::MeshDim::Tensor {
                    // torchtune's recipes apply their own models' plans.
                    return Err(doc.err(
                        key,
                        "tensor parallelism in torchtune's recipes is not sized yet (--tp sizes a Hugging Face model's)",
                    ));
                }
                let e = gpumem_core::job::Mesh::new(&[(dim, n)])
                    .and_then(|m| {
                        gpumem_core::job::Strategy::new(
                            m,
                            gpumem_core::job::Engine::Fsdp {
                                reshard_after_forward: true,
                                param_dtype: None,
                                cpu_offload: false,
                                sync_each_batch: false,
                            },
                        )
                    })
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default();
                return Err(doc.err(key, e));
            }
        }
        let replicate = doc.count32("data_parallel_replicate_dim")?.unwrap_or(1);
        let shard = match doc.whole("data_parallel_shard_dim")? {
            None | Some(-1) => None,
            Some(n) if n >= 1 => Some(n as u32),
            Some(n) => {
                return Err(doc.err(
                    "data_parallel_shard_dim",
                    format!("{n} is not -1 or a degree"),
                ));
            }
        };
        Layout::Fsdp {
            replicate,
            shard,
            tensor: 1,
            pipeline: 1,
            schedule: None,
            context: 1,
            expert: 1,
            reshard_after_forward: doc.flag("fsdp_reshard_after_forward")?.unwrap_or(true),
            param_dtype: None,
            cpu_offload: doc.flag("fsdp_cpu_offload")?.unwrap_or(false),
            // torchtune's recipes reduce each micro-batch's gradients (no `no_sync`).
            sync_each_batch: true,
            field: "fsdp_cpu_offload",
        }
    } else {
        Layout::Single
    };
    Ok(TABLE)
}
