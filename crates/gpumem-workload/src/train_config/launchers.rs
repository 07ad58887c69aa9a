//! The launch configs gpumem already reads — DeepSpeed JSON ([`crate::deepspeed`]) and
//! accelerate YAML ([`crate::accelerate`]) — as trainer configs: the same readers, and every
//! key accounted for.

use super::{CLIP, Class, Doc, Layout, SAVE, Table, TrainConfig, TrainConfigError};
use crate::{accelerate, deepspeed};

const NOT_BUCKETS: &str =
    "DeepSpeed's all-gather and sub-group buffers beyond the reduce bucket are not modelled";

pub(crate) const DEEPSPEED: Table = &[
    ("optimizer.params.*", Class::No),
    ("scheduler.*", Class::No),
    ("steps_per_print", Class::No),
    ("wall_clock_breakdown", Class::No),
    ("zero_allow_untested_optimizer", Class::No),
    ("gradient_clipping", Class::Not(CLIP)),
    ("prescale_gradients", Class::No),
    ("fp16.loss_scale", Class::No),
    ("fp16.loss_scale_window", Class::No),
    ("fp16.initial_scale_power", Class::No),
    ("fp16.hysteresis", Class::No),
    ("fp16.min_loss_scale", Class::No),
    ("fp16.auto_cast", Class::No),
    ("zero_optimization.offload_optimizer.pin_memory", Class::No),
    ("zero_optimization.offload_param.pin_memory", Class::No),
    ("zero_optimization.offload_optimizer.nvme_path", Class::No),
    ("zero_optimization.offload_param.nvme_path", Class::No),
    ("zero_optimization.reduce_scatter", Class::No),
    ("zero_optimization.round_robin_gradients", Class::No),
    ("zero_optimization.allgather_partitions", Class::No),
    (
        "zero_optimization.allgather_bucket_size",
        Class::Not(NOT_BUCKETS),
    ),
    ("zero_optimization.sub_group_size", Class::Not(NOT_BUCKETS)),
    (
        "activation_checkpointing.*",
        Class::Not(
            "DeepSpeed's own activation checkpointing is not modelled: give --checkpointing",
        ),
    ),
    ("flops_profiler.*", Class::No),
    ("tensorboard.*", Class::No),
    ("wandb.*", Class::No),
    ("comms_logger.*", Class::No),
];

pub(crate) fn deepspeed(
    doc: &mut Doc,
    out: &mut TrainConfig,
    text: &str,
) -> Result<Table, TrainConfigError> {
    let job = deepspeed::read_config(text).map_err(|e| doc.err("(deepspeed)", e.to_string()))?;
    for key in [
        "zero_optimization.stage",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_max_reuse_distance",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.overlap_comm",
        "zero_optimization.contiguous_gradients",
        "zero_optimization.cpu_offload",
        "zero_optimization.offload_optimizer.device",
        "zero_optimization.offload_param.device",
        // Read for the trainer's save (a Hugging Face config that names one: `hf::saving`).
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
        "zero_optimization.gather_16bit_weights_on_model_save",
        "bf16.enabled",
        "bfloat16.enabled",
        "fp16.enabled",
        "optimizer.type",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "train_batch_size",
    ] {
        doc.used(key);
    }
    out.micro_batch = job
        .stated
        .micro_batch
        .map(|b| (b, "train_micro_batch_size_per_gpu".into()));
    out.precision = job.stated.precision;
    out.optimizer = job.stated.optimizer;
    out.grad_accum = job.stated.grad_accum;
    out.layout = Layout::Zero {
        job,
        field: "zero_optimization".into(),
    };
    Ok(DEEPSPEED)
}

pub(crate) const ACCELERATE: Table = &[
    ("compute_environment", Class::No),
    ("machine_rank", Class::No),
    ("main_process_ip", Class::No),
    ("main_process_port", Class::No),
    ("main_training_function", Class::No),
    ("num_machines", Class::No),
    ("rdzv_backend", Class::No),
    ("same_network", Class::No),
    ("tpu_env", Class::No),
    ("tpu_use_cluster", Class::No),
    ("tpu_use_sudo", Class::No),
    ("use_cpu", Class::No),
    ("downcast_bf16", Class::No),
    ("debug", Class::No),
    ("enable_cpu_affinity", Class::No),
    ("gpu_ids", Class::No),
    ("dynamo_config.*", Class::Not(super::COMPILE)),
    ("fsdp_config.fsdp_auto_wrap_policy", Class::No),
    ("fsdp_config.fsdp_transformer_layer_cls_to_wrap", Class::No),
    ("fsdp_config.fsdp_state_dict_type", Class::No),
    (
        "fsdp_config.fsdp_cpu_ram_efficient_loading",
        Class::Not(super::BROADCAST_LOAD),
    ),
    (
        "fsdp_config.fsdp_sync_module_states",
        Class::Not(super::BROADCAST_LOAD),
    ),
    ("fsdp_config.fsdp_use_orig_params", Class::No),
    ("fsdp_config.fsdp_min_num_params", Class::No),
    (
        "fsdp_config.fsdp_backward_prefetch",
        Class::Not(
            "prefetching changes how many layers are gathered at once; gpumem sizes FSDP2's defaults",
        ),
    ),
    (
        "fsdp_config.fsdp_forward_prefetch",
        Class::Not(
            "prefetching changes how many layers are gathered at once; gpumem sizes FSDP2's defaults",
        ),
    ),
    (
        "fsdp_config.fsdp_activation_checkpointing",
        Class::Not("FSDP's own activation checkpointing: give --checkpointing"),
    ),
    ("deepspeed_config.zero3_init_flag", Class::No),
    ("deepspeed_config.zero3_save_16bit_model", Class::Not(SAVE)),
    ("deepspeed_config.deepspeed_multinode_launcher", Class::No),
];

pub(crate) fn accelerate(
    doc: &mut Doc,
    out: &mut TrainConfig,
    text: &str,
) -> Result<Table, TrainConfigError> {
    let launch = accelerate::read_accelerate(text, &doc.dir)
        .map_err(|e| doc.err("(accelerate)", e.to_string()))?;
    for key in [
        "distributed_type",
        "num_processes",
        "mixed_precision",
        "fsdp_config.fsdp_offload_params",
        "fsdp_config.fsdp_reshard_after_forward",
        "fsdp_config.fsdp_sharding_strategy",
        "deepspeed_config.deepspeed_config_file",
        "deepspeed_config.zero_stage",
        "deepspeed_config.offload_optimizer_device",
        "deepspeed_config.offload_param_device",
        "deepspeed_config.gradient_accumulation_steps",
    ] {
        doc.used(key);
    }
    if doc.whole("fsdp_config.fsdp_version")? == Some(1) {
        doc.not_modelled(
            "fsdp_config.fsdp_version",
            "FSDP1 (FlatParameter) is sized as FSDP2's per-parameter sharding",
        );
    }
    out.micro_batch = launch
        .stated
        .micro_batch
        .map(|b| (b, "deepspeed_config.deepspeed_config_file".into()));
    out.precision = launch.stated.precision;
    out.optimizer = launch.stated.optimizer;
    out.grad_accum = launch.stated.grad_accum;
    out.layout = match launch.strategy {
        Some(s) => Layout::Fixed(s),
        None => Layout::Single,
    };
    Ok(ACCELERATE)
}
