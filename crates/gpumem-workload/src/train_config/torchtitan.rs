//! torchtitan's configuration: the TOML files of its 2025 releases (`JobConfig`'s sections), and
//! the Python configs of its newer ones (a function returning `Trainer.Config`, or a
//! `JobConfig`), which the tracer's Python calls and dumps to JSON — each dataclass as a mapping
//! with its class in `_class`. Absent keys take torchtitan's defaults where they bear on memory
//! (`mixed_precision_param` bfloat16, optimizer `implementation` fused, FSDP over the ranks
//! left, `-1`).

use gpumem_core::job::{
    Checkpointing, Engine, Float8, Float8Recipe, HalfDtype, Implementation, LayerFrequency, Mesh,
    MeshDim, Pipeline, Precision, Schedule, Strategy,
};
use serde_json::Value;

use super::{
    CHUNKED_CE, CLIP, COMPILE, COMPILED_BLOCKS, Class, Doc, EVAL, FP8, Layout, OFFLOAD_ACT, SAVE,
    Table, TrainConfig, TrainConfigError, TrainerKind,
};

pub(crate) const TABLE: Table = &[
    ("job.*", Class::No),
    ("profiling.*", Class::No),
    ("profiler.*", Class::No),
    ("metrics.*", Class::No),
    ("comm.*", Class::No),
    ("debug.*", Class::No),
    ("lr_scheduler.*", Class::No),
    ("experimental.*", Class::No),
    ("memory_estimation.*", Class::No),
    ("fault_tolerance.*", Class::No),
    ("dataloader.*", Class::No),
    ("tokenizer.*", Class::No),
    ("optimizer.lr", Class::No),
    ("optimizer.eps", Class::No),
    ("optimizer.weight_decay", Class::No),
    ("optimizer.beta1", Class::No),
    ("optimizer.beta2", Class::No),
    ("training.steps", Class::No),
    ("training.dataset", Class::No),
    ("training.dataset_path", Class::No),
    ("training.seed", Class::No),
    ("training.deterministic", Class::No),
    ("training.gc_freq", Class::No),
    ("training.gc_debug", Class::No),
    ("training.disable_cuda_graphs", Class::No),
    ("training.max_norm", Class::Not(CLIP)),
    ("model.print_after_conversion", Class::No),
    ("model.tokenizer_path", Class::No),
    (
        "model_spec.*",
        Class::Not(
            "torchtitan's own model definition is not traced: the model is read from hf_assets_path's config.json",
        ),
    ),
    ("loss.*", Class::Not(CHUNKED_CE)),
    ("parallelism.pipeline_parallel_schedule", Class::No),
    ("parallelism.pipeline_parallel_schedule_csv", Class::No),
    ("parallelism.pipeline_parallel_split_points", Class::No),
    ("parallelism.pipeline_parallel_microbatch_size", Class::No),
    (
        "parallelism.pipeline_parallel_first_stage_less_layers",
        Class::No,
    ),
    (
        "parallelism.pipeline_parallel_last_stage_less_layers",
        Class::No,
    ),
    ("parallelism.pipeline_parallel_layers_per_stage", Class::No),
    ("parallelism.module_fqns_per_model_part", Class::No),
    ("parallelism.num_pp_microbatches", Class::No),
    ("parallelism.context_parallel_rotate_method", Class::No),
    ("parallelism.context_parallel_load_balancer", Class::No),
    ("parallelism.disable_loss_parallel", Class::No),
    ("parallelism.enable_async_tensor_parallel", Class::No),
    ("parallelism.enable_sequence_parallel", Class::No),
    ("parallelism.spmd_backend", Class::No),
    ("parallelism.expert_tensor_parallel_degree", Class::No),
    ("parallelism.enable_compiled_autograd", Class::Not(COMPILE)),
    (
        "parallelism.enable_fsdp_symm_mem",
        Class::Not("FSDP's symmetric-memory buffers are not modelled"),
    ),
    ("compile.components", Class::No),
    ("compile.backend", Class::No),
    ("activation_checkpoint.preserve_rng_state", Class::No),
    ("activation_checkpoint.determinism_check", Class::No),
    ("activation_checkpoint.debug", Class::No),
    ("activation_checkpoint.early_stop", Class::No),
    ("activation_checkpoint._class", Class::No),
];

/// A dumped dataclass's class (`_class`) under `path`, its last two dotted parts
/// (`SelectiveAC.Config`).
fn class_at(doc: &Doc, path: &str) -> Option<String> {
    let c = doc.get(&format!("{path}._class"))?.as_str()?;
    let parts: Vec<&str> = c.rsplit('.').take(2).collect();
    Some(parts.into_iter().rev().collect::<Vec<_>>().join("."))
}

/// Keys torchtitan's TOML kept elsewhere before its `[parallelism]` and `[compile]` sections
/// (its releases of 2024 to early 2025: `training.*_degree`, `experimental.*`,
/// `training.compile`): where a config has the older key and not the newer, the older is read.
const MOVED: &[(&str, &str)] = &[
    (
        "parallelism.data_parallel_replicate_degree",
        "training.data_parallel_replicate_degree",
    ),
    (
        "parallelism.data_parallel_shard_degree",
        "training.data_parallel_shard_degree",
    ),
    (
        "parallelism.tensor_parallel_degree",
        "training.tensor_parallel_degree",
    ),
    (
        "parallelism.disable_loss_parallel",
        "training.disable_loss_parallel",
    ),
    (
        "parallelism.enable_async_tensor_parallel",
        "experimental.enable_async_tensor_parallel",
    ),
    (
        "parallelism.pipeline_parallel_degree",
        "experimental.pipeline_parallel_degree",
    ),
    (
        "parallelism.pipeline_parallel_schedule",
        "experimental.pipeline_parallel_schedule",
    ),
    (
        "parallelism.pipeline_parallel_split_points",
        "experimental.pipeline_parallel_split_points",
    ),
    (
        "parallelism.context_parallel_degree",
        "experimental.context_parallel_degree",
    ),
    (
        "parallelism.context_parallel_rotate_method",
        "experimental.context_parallel_rotate_method",
    ),
    (
        "parallelism.enable_compiled_autograd",
        "experimental.enable_compiled_autograd",
    ),
    ("compile.enable", "training.compile"),
    ("checkpoint.enable", "checkpoint.enable_checkpoint"),
];

/// The number of micro-batches of those releases' pipelines (`None`: one per pipeline rank),
/// where the newer ones state each micro-batch's size.
const OLD_MICROBATCHES: &str = "experimental.pipeline_parallel_microbatches";

pub(crate) fn read(doc: &mut Doc, out: &mut TrainConfig) -> Result<Table, TrainConfigError> {
    for (path, older) in MOVED {
        doc.moved(path, older);
    }
    // The model: the Hugging Face assets directory (config.json beside the tokenizer).
    for key in ["model.hf_assets_path", "hf_assets_path"] {
        if let Some(p) = doc.text(key)? {
            out.model = Some((p, key.into()));
        }
    }
    if out.model.is_none() {
        let name = doc.text("model.name")?;
        let flavor = doc.text("model.flavor")?;
        if let (Some(n), Some(f)) = (name, flavor) {
            out.model = Some((format!("torchtitan:{n}(flavor={f})"), "model.flavor".into()));
        }
    } else {
        // name and flavor choose torchtitan's definition of what hf_assets_path holds.
        doc.used("model.name");
        doc.used("model.flavor");
    }
    // torchtitan's float8 converter, by each release's name for it: its section's settings
    // become gpumem's float8 (torchao's Float8Linear, traced); MX and grouped-GEMM converters
    // are not modelled.
    let converters = doc.names("model.converters")?.unwrap_or_default();
    let float8_section = converters
        .iter()
        .find_map(|c| match c.as_str() {
            "float8" => Some("float8"),
            "quantize.linear.float8" => Some("quantize.linear.float8"),
            "quantize.dense.float8" => Some("quantize.dense.float8"),
            _ => None,
        })
        .or_else(|| {
            (doc.get("float8.enable_float8_linear") == Some(&Value::Bool(true))).then_some("float8")
        });
    let others = converters
        .iter()
        .any(|c| !c.ends_with("float8") || c.contains("grouped_mm"));
    if others {
        doc.not_modelled("model.converters", FP8);
    }
    // The converters' sections: another converter's not modelled, none's inactive; then the
    // float8 one's settings read (over what that marked).
    for section in ["float8", "quantize", "mx"] {
        if doc.get(section).is_some() {
            if others {
                doc.not_modelled(section, FP8);
            } else {
                doc.no_memory(section);
            }
        }
    }
    if let Some(section) = float8_section {
        out.float8 = Some(float8(doc, section)?);
    }
    // The older releases chose the norm by name; the traced model's is RMSNorm.
    match doc.text("model.norm_type")?.as_deref() {
        None | Some("rmsnorm") => {}
        Some(_) => doc.not_modelled(
            "model.norm_type",
            "torchtitan's model is traced with its RMSNorm",
        ),
    }
    // Micro-batch and sequence: JobConfig's training.local_batch_size (or batch_size) and
    // seq_len; Trainer.Config's tokens per micro-batch over the context length.
    let seq = doc
        .positive("training.seq_len")?
        .or(doc.positive("training.max_context_length")?);
    out.seq_len = seq;
    let local = match doc.positive("training.local_batch_size")? {
        Some(b) => Some((b, "training.local_batch_size".to_string())),
        None => doc
            .positive("training.batch_size")?
            .map(|b| (b, "training.batch_size".to_string())),
    };
    out.micro_batch = match (
        local,
        doc.positive("training.num_tokens_per_microbatch_per_dp_rank")?,
    ) {
        (Some(b), _) => Some(b),
        (None, Some(tokens)) => {
            let seq = seq.ok_or_else(|| {
                doc.err(
                    "training.max_context_length",
                    "missing: the micro-batch is tokens per micro-batch over it",
                )
            })?;
            if tokens % seq != 0 {
                return Err(doc.err(
                    "training.num_tokens_per_microbatch_per_dp_rank",
                    format!("{tokens} is not a multiple of the context length {seq}"),
                ));
            }
            Some((
                tokens / seq,
                "training.num_tokens_per_microbatch_per_dp_rank".into(),
            ))
        }
        (None, None) => None,
    };
    // Precision: training.dtype bfloat16 trains the parameters themselves in bf16; else fp32
    // weights with FSDP's mixed-precision policy (autocast on one GPU).
    let pure = match doc.text("training.dtype")?.as_deref() {
        None | Some("float32") => false,
        Some("bfloat16") => true,
        Some(other) => {
            return Err(doc.err(
                "training.dtype",
                format!("`{other}` is not bfloat16 or float32"),
            ));
        }
    };
    let param = match doc.text("training.mixed_precision_param")?.as_deref() {
        None | Some("bfloat16") => Some(HalfDtype::Bf16),
        Some("float32") => None,
        Some(other) => {
            return Err(doc.err(
                "training.mixed_precision_param",
                format!("`{other}` is not bfloat16 or float32"),
            ));
        }
    };
    match doc.text("training.mixed_precision_reduce")?.as_deref() {
        None | Some("float32") => {}
        Some(_) => doc.not_modelled(
            "training.mixed_precision_reduce",
            "gradients are reduced into fp32 shards in gpumem's FSDP",
        ),
    }
    out.precision = Some(if pure {
        Precision::Bf16
    } else {
        Precision::Fp32
    });
    doc.off_or_not_modelled("training.enable_cpu_offload", "torchtitan's CPU offload of the optimizer state is sized as FSDP2's CPUOffloadPolicy only under FSDP: not modelled here");
    // Optimizer: JobConfig's name and implementation (fused by default); Trainer.Config's class.
    let name = doc
        .text("optimizer.name")?
        .or_else(|| class_at(doc, "optimizer"));
    if let Some(name) = name {
        doc.used("optimizer._class");
        // torchtitan's default implementation is fused.
        let implementation = match doc.text("optimizer.implementation")? {
            None => Implementation::Fused,
            Some(i) => Implementation::parse(&i)
                .map_err(|e| doc.err("optimizer.implementation", e.to_string()))?,
        };
        doc.used("optimizer.implementation");
        let plain = name
            .rsplit('.')
            .find(|p| *p != "Config")
            .unwrap_or(&name)
            .to_string();
        out.optimizer = Some(super::optimizer(
            doc,
            "optimizer.name",
            &plain,
            Some(implementation),
        )?);
        doc.used("optimizer.name");
    }
    doc.off_or_not_modelled("optimizer.early_step_in_backward", "the optimizer step in backward is not in the job vocabulary yet; sized as a step after backward (an upper bound)");
    // Activation checkpointing: JobConfig's mode and selective_ac_option; Trainer.Config's class.
    let mode = match doc.text("activation_checkpoint.mode")? {
        Some(m) => Some(m),
        None => class_at(doc, "activation_checkpoint").map(|c| match c.split('.').next() {
            Some("FullAC") => "full".to_string(),
            Some("SelectiveAC") => "selective".to_string(),
            Some("NoAC") => "none".to_string(),
            _ => c,
        }),
    };
    let key = "activation_checkpoint.mode";
    out.checkpointing = match mode.as_deref() {
        None => None,
        Some("none") => Some(Checkpointing::Off),
        Some("full") => Some(Checkpointing::Full),
        Some("selective") => {
            let option = match doc.take("activation_checkpoint.selective_ac_option") {
                None => "op".to_string(),
                Some(Value::String(s)) => s,
                Some(other) => other.to_string(),
            };
            match option.as_str() {
                // torchtitan's own policy (not gpumem's `selective`, which saves every matmul).
                "op" => Some(Checkpointing::SelectiveOp),
                // Every N-th block; 0 (torchtitan reads it as every block) is every block.
                n if n.parse::<u32>().is_ok() => Some(Checkpointing::SelectiveLayer(
                    LayerFrequency::new(n.parse::<u32>().unwrap_or(1).max(1))
                        .expect("a frequency of at least 1"),
                )),
                other => {
                    return Err(doc.err(
                        "activation_checkpoint.selective_ac_option",
                        format!("`{other}` is not op or a whole number"),
                    ));
                }
            }
        }
        Some(other) => {
            doc.not_modelled(key, "this checkpointing policy is not modelled: sized without checkpointing (an upper bound)");
            let _ = other;
            Some(Checkpointing::Off)
        }
    };
    if out.checkpointing.is_some() {
        doc.used_rest("activation_checkpoint");
    }
    if doc
        .get("activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns")
        .is_some()
        || doc
            .get("activation_checkpoint.force_recompute_mm_shapes_by_fqns")
            .is_some()
    {
        for k in [
            "activation_checkpoint.per_op_sac_force_recompute_mm_shapes_by_fqns",
            "activation_checkpoint.force_recompute_mm_shapes_by_fqns",
        ] {
            doc.off_or_not_modelled(k, "matmuls forced to be recomputed are not modelled");
        }
    }
    compile(doc, out)?;
    doc.off_or_not_modelled("activation_checkpoint.cpu_offload", OFFLOAD_ACT);
    // Saving and validation: the whole run's, where enabled.
    for (section, enable, why) in [
        ("checkpoint", "checkpoint.enable", SAVE),
        ("validation", "validation.enable", EVAL),
        ("validator", "validator.enable", EVAL),
    ] {
        if doc.get(section).is_some() {
            let on = match doc.get(enable) {
                Some(Value::Bool(b)) => *b,
                // Trainer.Config: a validator or checkpointer configured is one in use.
                _ => out.kind == TrainerKind::TorchtitanPython,
            };
            if on {
                doc.not_modelled(section, why);
            } else {
                // Off: no pass gpumem would size; the switch is read, the rest is idle.
                doc.no_memory(section);
                doc.used(enable);
            }
        }
    }
    // Ranks.
    let degree = |doc: &mut Doc, key: &str| -> Result<i64, TrainConfigError> {
        Ok(doc.whole(&format!("parallelism.{key}"))?.unwrap_or(1))
    };
    for (key, dim) in [
        ("tensor_parallel_degree", MeshDim::Tensor),
        ("pipeline_parallel_degree", MeshDim::Pipeline),
        ("context_parallel_degree", MeshDim::Context),
        ("expert_parallel_degree", MeshDim::Expert),
    ] {
        let d = degree(doc, key)?;
        // Every one is torchtitan's own code on its model (the tracer's): apply_tp, its
        // pipeline split, apply_cp_to_attention_module, apply_moe_ep_tp. A degree the mesh
        // cannot take is refused in the mesh's words.
        if d > 1
            && !matches!(
                dim,
                MeshDim::Tensor | MeshDim::Pipeline | MeshDim::Context | MeshDim::Expert
            )
        {
            let why = Mesh::new(&[(dim, d as u32)])
                .and_then(|m| {
                    Strategy::new(
                        m,
                        Engine::Fsdp {
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
            return Err(doc.err(&format!("parallelism.{key}"), why));
        }
    }
    // A degree the mesh takes: a whole number of ranks, at least 1.
    let ranks = |doc: &mut Doc, key: &str| -> Result<u32, TrainConfigError> {
        let d = degree(doc, key)?;
        u32::try_from(d).ok().filter(|r| *r >= 1).ok_or_else(|| {
            doc.err(
                &format!("parallelism.{key}"),
                format!("{d} is not a degree"),
            )
        })
    };
    let tensor_degree = ranks(doc, "tensor_parallel_degree")?;
    if tensor_degree > 1 {
        // What torchtitan's apply_tp takes beyond the mesh: the tracer runs its defaults.
        if doc.flag("parallelism.disable_loss_parallel")? == Some(true) {
            doc.not_modelled(
                "parallelism.disable_loss_parallel",
                "tensor parallelism is traced with torchtitan's default loss parallelism (the logits kept sharded)",
            );
        }
        doc.off_or_not_modelled(
            "parallelism.enable_async_tensor_parallel",
            "async tensor parallelism's symmetric-memory buffers are not modelled",
        );
        if doc.flag("parallelism.enable_sequence_parallel")? == Some(false) {
            doc.not_modelled(
                "parallelism.enable_sequence_parallel",
                "tensor parallelism is traced with sequence parallelism, torchtitan's default",
            );
        }
    }
    let context_degree = ranks(doc, "context_parallel_degree")?;
    if context_degree > 1 {
        // What the tracer runs: PyTorch's default rotation (all-gather) and head-tail balancing.
        for (key, traced, why) in [
            (
                "parallelism.context_parallel_rotate_method",
                "allgather",
                "context parallelism is traced with keys and values all-gathered (allgather, torchtitan's default)",
            ),
            (
                "parallelism.context_parallel_load_balancer",
                "headtail",
                "context parallelism is traced with head-tail load balancing, torchtitan's default",
            ),
        ] {
            if doc.text(key)?.is_some_and(|v| v != traced) {
                doc.not_modelled(key, why);
            }
        }
    }
    let expert_degree = ranks(doc, "expert_parallel_degree")?;
    if expert_degree > 1
        && doc
            .whole("parallelism.expert_tensor_parallel_degree")?
            .is_some_and(|etp| etp > 1)
    {
        doc.not_modelled(
            "parallelism.expert_tensor_parallel_degree",
            "tensor parallelism inside the experts is not modelled: they are traced with ETP 1, torchtitan's default",
        );
    }
    let pipeline_degree = ranks(doc, "pipeline_parallel_degree")?;
    let schedule = if pipeline_degree > 1 {
        Some(pipeline(doc, out, pipeline_degree)?)
    } else {
        None
    };
    if context_degree > 1 || expert_degree > 1 || pipeline_degree > 1 {
        // torchtitan's own split, context and expert parallelism run on its own model: the one
        // name and flavor choose, not the assets' config.json (a Hugging Face model's).
        if let (Some(n), Some(f)) = (doc.text("model.name")?, doc.text("model.flavor")?) {
            out.model = Some((format!("torchtitan:{n}(flavor={f})"), "model.flavor".into()));
        }
    }
    let replicate = ranks(doc, "data_parallel_replicate_degree")?;
    let shard = match doc.whole("parallelism.data_parallel_shard_degree")? {
        None | Some(-1) => None,
        Some(n) if n >= 1 => Some(n as u32),
        Some(n) => {
            return Err(doc.err(
                "parallelism.data_parallel_shard_degree",
                format!("{n} is not -1 or a degree"),
            ));
        }
    };
    let reshard = match doc
        .text("parallelism.fsdp_reshard_after_forward")?
        .as_deref()
    {
        // torchtitan's default keeps a pipeline's gathered layers across its micro-batches.
        None | Some("default") => pipeline_degree == 1,
        Some("always") => true,
        Some("never") => false,
        Some(other) => {
            return Err(doc.err(
                "parallelism.fsdp_reshard_after_forward",
                format!("`{other}` is not default, always or never"),
            ));
        }
    };
    if tensor_degree > 1 && shard == Some(1) && replicate > 1 {
        return Err(doc.err(
            "parallelism.data_parallel_replicate_degree",
            "DDP over tensor-parallel groups (no shard ranks) is not sized yet",
        ));
    }
    out.layout = if shard == Some(1) && replicate > 1 {
        Layout::Fixed(
            Strategy::ddp(replicate, gpumem_core::job::DDP_BUCKET_CAP_MB, false).map_err(|e| {
                doc.err("parallelism.data_parallel_replicate_degree", e.to_string())
            })?,
        )
    } else {
        Layout::Fsdp {
            replicate,
            shard,
            tensor: tensor_degree,
            pipeline: pipeline_degree,
            schedule,
            context: context_degree,
            expert: expert_degree,
            reshard_after_forward: reshard,
            param_dtype: if pure { None } else { param },
            cpu_offload: false,
            // torchtitan reduce-scatters each micro-batch's gradients (no `no_sync`).
            sync_each_batch: true,
            field: "parallelism.data_parallel_shard_degree",
        }
    };
    // Accumulation: the global batch over the micro-batches of every data-parallel rank.
    let global = doc
        .whole("training.global_batch_size")?
        .or(doc.whole("training.num_tokens_per_train_step")?);
    if let Some(g) = global.filter(|g| *g > 0) {
        let key = if doc.get("training.global_batch_size").is_some() {
            "training.global_batch_size"
        } else {
            "training.num_tokens_per_train_step"
        };
        match (shard, out.micro_batch.as_ref()) {
            (Some(s), Some((m, _))) => {
                let per_step = u64::from(s) * u64::from(replicate) * m * if key.contains("tokens") { seq.unwrap_or(1) } else { 1 };
                if !(g as u64).is_multiple_of(per_step) {
                    return Err(doc.err(key, format!("{g} is not a multiple of {per_step} per step")));
                }
                out.grad_accum = Some(
                    u32::try_from(g as u64 / per_step).map_err(|_| doc.err(key, "too many accumulation steps"))?,
                );
            }
            _ => doc.not_modelled(key, "the accumulation it implies depends on the data-parallel ranks (-1): give --grad-accum"),
        }
    }
    // Trainer.Config's loss (a chunked wrapper by default) and torchtitan's own model
    // definition, whole.
    if doc.get("loss").is_some() {
        doc.not_modelled("loss", CHUNKED_CE);
    }
    if doc.get("model_spec").is_some() {
        doc.not_modelled(
            "model_spec",
            "torchtitan's own model definition is not traced: the model is read from hf_assets_path's config.json",
        );
    }
    // A dumped dataclass's class names it; what it configures is read by its fields.
    doc.no_memory_named("_class");
    Ok(TABLE)
}

/// A torchtitan pipeline's schedule as its config states it: `pipeline_parallel_schedule`
/// (PyTorch's names, any case; 1F1B by default), micro-batches of
/// `pipeline_parallel_microbatch_size` samples out of the local batch, and torchtitan's stages
/// per rank (1 for a single-stage schedule, 2 for a multi-stage one). Its default split is the
/// tracer's (torchtitan's own `generate_llm_fqn_per_model_part`); another is listed as not
/// modelled.
fn pipeline(doc: &mut Doc, out: &TrainConfig, degree: u32) -> Result<Pipeline, TrainConfigError> {
    const KEY: &str = "parallelism.pipeline_parallel_schedule";
    let name = doc.text(KEY)?.unwrap_or_else(|| "1F1B".into());
    let (schedule, per_rank) = match name.to_ascii_lowercase().as_str() {
        "gpipe" => (Schedule::Gpipe, 1),
        "1f1b" => (Schedule::OneForwardOneBackward, 1),
        "interleaved1f1b" => (Schedule::Interleaved, 2),
        "interleavedzerobubble" => (Schedule::ZeroBubble, 2),
        _ => {
            return Err(doc.err(
                KEY,
                format!(
                    "`{name}` is not a schedule gpumem steps (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble)"
                ),
            ));
        }
    };
    for (key, default) in [
        ("parallelism.pipeline_parallel_first_stage_less_layers", 1),
        ("parallelism.pipeline_parallel_last_stage_less_layers", 1),
    ] {
        if doc.whole(key)?.is_some_and(|v| v != default) {
            doc.not_modelled(
                key,
                "the tracer splits the model as torchtitan does by default",
            );
        }
    }
    for key in [
        "parallelism.pipeline_parallel_layers_per_stage",
        "parallelism.module_fqns_per_model_part",
        "parallelism.pipeline_parallel_split_points",
    ] {
        if doc.get(key).is_some_and(|v| !v.is_null()) {
            doc.not_modelled(
                key,
                "the tracer splits the model as torchtitan does by default",
            );
        }
    }
    const SIZE: &str = "parallelism.pipeline_parallel_microbatch_size";
    let local = out.micro_batch.as_ref().map(|(b, _)| *b).ok_or_else(|| {
        doc.err(
            "training.local_batch_size",
            "missing: a pipeline's micro-batches are parts of it",
        )
    })?;
    if doc.get("experimental.pipeline_parallel_degree").is_some() {
        // A config of torchtitan's older releases: their count of micro-batches (docs/intake.md:
        // their split, by layer count alone, is traced as 0.2.2 splits).
        let count = match doc.positive(OLD_MICROBATCHES)? {
            Some(m) => m,
            None => u64::from(degree),
        };
        if count == 0 || local % count != 0 {
            return Err(doc.err(
                OLD_MICROBATCHES,
                format!("{count} micro-batches do not divide the local batch of {local}"),
            ));
        }
        let microbatches = u32::try_from(count).unwrap_or(u32::MAX);
        return Pipeline::new(schedule, microbatches, per_rank)
            .map_err(|e| doc.err(OLD_MICROBATCHES, e.to_string()));
    }
    let size = doc.positive(SIZE)?.unwrap_or(1);
    if local % size != 0 {
        return Err(doc.err(
            SIZE,
            format!("{size} does not divide the local batch of {local}"),
        ));
    }
    let microbatches = u32::try_from(local / size).unwrap_or(u32::MAX);
    Pipeline::new(schedule, microbatches, per_rank).map_err(|e| doc.err(SIZE, e.to_string()))
}

/// torchtitan's float8 section (`float8`, `quantize.linear.float8`, `quantize.dense.float8`): its
/// recipe (`recipe_name`; none: tensorwise) and FSDP's float8 all-gathers. gpumem converts every
/// linear layer whose dimensions are multiples of 16 but the output head (torchtitan's configs'
/// `filter_fqns = ["output"]`); another filter is reported as not modelled.
fn float8(doc: &mut Doc, section: &str) -> Result<Float8, TrainConfigError> {
    let key = |name: &str| format!("{section}.{name}");
    let recipe = match doc.text(&key("recipe_name"))? {
        None => Float8Recipe::Tensorwise,
        Some(name) => Float8Recipe::parse(&name).ok_or_else(|| {
            doc.err(
                &key("recipe_name"),
                format!(
                    "`{name}` is not a float8 recipe gpumem models ({})",
                    Float8Recipe::NAMES.join(", ")
                ),
            )
        })?,
    };
    let fsdp_all_gather = doc.flag(&key("enable_fsdp_float8_all_gather"))? == Some(true);
    // With the all-gathers gpumem precomputes the scales, as torchtitan's hook does.
    doc.used(&key("precompute_float8_dynamic_scale_for_fsdp"));
    doc.used(&key("enable_float8_linear"));
    let filters = doc.names(&key("filter_fqns"))?;
    if filters.is_some_and(|f| f.iter().any(|f| f != "output")) {
        doc.not_modelled(
            &key("filter_fqns"),
            "gpumem keeps the output head alone out of float8",
        );
    }
    for name in ["emulate", "force_recompute_fp8_weight_in_bwd"] {
        doc.no_memory(&key(name));
    }
    Ok(Float8 {
        recipe,
        fsdp_all_gather,
    })
}

/// torchtitan's `compile`: `compile.components` (absent: its default, the model and the loss)
/// say what `torch.compile` compiles. The older `training.compile` (before August 2025)
/// compiled the loss only in some releases (October to December 2024, April to August 2025)
/// and a config does not say which: read as the model's blocks alone, the larger estimate (a
/// note says to add --compile for those releases). The loss is modelled where it runs on plain
/// tensors (under tensor parallelism it is loss-parallel on DTensors: traced eagerly, stated).
fn compile(doc: &mut Doc, out: &mut TrainConfig) -> Result<(), TrainConfigError> {
    let older = doc.spelled("compile.enable") != "compile.enable";
    if doc.flag("compile.enable")? != Some(true) {
        return Ok(());
    }
    if older {
        doc.not_modelled("compile.enable", OLDER_COMPILE);
        return Ok(());
    }
    let named = |doc: &Doc, part: &str| match doc.get("compile.components") {
        Some(Value::Array(parts)) => parts.iter().any(|p| p.as_str() == Some(part)),
        _ => true,
    };
    let tensor_parallel = doc
        .get("parallelism.tensor_parallel_degree")
        .and_then(Value::as_u64)
        .is_some_and(|d| d > 1);
    if named(doc, "loss") && !tensor_parallel {
        out.compile = Some(true);
    }
    let key = if doc.get("compile.components").is_some() {
        "compile.components"
    } else {
        "compile.enable"
    };
    if named(doc, "model") || (named(doc, "loss") && tensor_parallel) {
        let why = if tensor_parallel {
            COMPILE
        } else {
            COMPILED_BLOCKS
        };
        doc.not_modelled(key, why);
    } else {
        doc.used(key);
    }
    Ok(())
}

/// Why the older `training.compile` is read as the model's blocks alone.
const OLDER_COMPILE: &str = "torch.compile of the model's blocks is not modelled (traced eagerly); torchtitan's releases of October to December 2024 and April to August 2025 compiled the loss under this key too: add --compile for them";
