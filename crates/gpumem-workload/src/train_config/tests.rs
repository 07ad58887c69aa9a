use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use gpumem_core::job::{
    AttentionMask, Checkpointing, Engine, HalfDtype, Optimizer, OptionValues, Precision, Quant4,
    Schedule,
};
use serde_json::Value;

use super::*;

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/examples/train-configs")
}

fn read(name: &str) -> TrainConfig {
    let path = examples().join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    read_text(&path.display().to_string(), &text, &examples(), None)
        .unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// Every key of the document (dotted, leaves) — the walk the accounting must cover.
fn keys(v: &Value, prefix: &str, out: &mut Vec<String>) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, v) in m {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                keys(v, &p, out);
            }
        }
        _ if !prefix.is_empty() => out.push(prefix.to_string()),
        _ => {}
    }
}

/// Every key of the file is in exactly one of used / not modelled / no memory (a reported
/// subtree covers its keys), and each key in `memory` (the fields bearing on memory) is used
/// or reported not modelled, never in the no-memory list.
fn accounted(name: &str, c: &TrainConfig, memory: &[&str]) {
    let path = examples().join(name);
    let text = std::fs::read_to_string(&path).unwrap();
    let root = parse_document(name, &text, name.ends_with(".toml")).unwrap();
    let mut all = Vec::new();
    keys(&root, "", &mut all);
    let f = &c.fields;
    let covers = |entry: &str, key: &str| under(key, entry);
    for key in &all {
        let n = f.used.iter().filter(|e| covers(e, key)).count()
            + f.not_modelled
                .iter()
                .filter(|e| covers(&e.field, key))
                .count()
            + f.no_memory.iter().filter(|e| covers(e, key)).count();
        assert_eq!(n, 1, "{name}: `{key}` is accounted {n} times: {f:#?}");
    }
    let listed: BTreeSet<&str> = f
        .used
        .iter()
        .map(String::as_str)
        .chain(f.not_modelled.iter().map(|n| n.field.as_str()))
        .chain(f.no_memory.iter().map(String::as_str))
        .collect();
    assert_eq!(
        listed.len(),
        f.used.len() + f.not_modelled.len() + f.no_memory.len(),
        "{name}: an entry is listed twice"
    );
    for m in memory {
        assert!(
            f.used.iter().any(|e| covers(e, m))
                || f.not_modelled.iter().any(|e| covers(&e.field, m)),
            "{name}: memory-relevant `{m}` is neither used nor reported not modelled: {f:#?}"
        );
    }
}

fn used(c: &TrainConfig, key: &str) -> bool {
    c.fields.used.iter().any(|u| u == key)
}

fn not_modelled(c: &TrainConfig, key: &str) -> bool {
    c.fields.not_modelled.iter().any(|n| n.field == key)
}

#[test]
fn hf_training_arguments_json() {
    let c = read("hf-trainer-run_clm.json");
    assert_eq!(c.kind, TrainerKind::HfTrainer);
    assert_eq!(c.model.as_ref().unwrap().0, "openai-community/gpt2");
    assert_eq!(c.micro_batch.as_ref().unwrap().0, 8);
    assert_eq!(
        (
            c.precision,
            c.optimizer,
            c.grad_accum,
            c.seq_len,
            c.checkpointing
        ),
        (
            Some(Precision::AmpBf16),
            Some(o("adamw")),
            Some(4),
            Some(512),
            Some(Checkpointing::Full)
        )
    );
    accounted(
        "hf-trainer-run_clm.json",
        &c,
        &[
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "bf16",
            "optim",
            "gradient_checkpointing",
            "block_size",
            "model_name_or_path",
            "per_device_eval_batch_size",
            "save_steps",
            "do_eval",
            "eval_strategy",
        ],
    );
    // The Trainer's evaluation, losses only (metrics are code), at the eval batch size.
    assert_eq!(
        c.whole_run.and_then(|r| r.evaluation),
        Some(gpumem_core::job::Evaluation {
            batch_size: Some(8),
            ..gpumem_core::job::Evaluation::of(2)
        })
    );
    assert!(used(&c, "per_device_eval_batch_size") && used(&c, "save_steps"));
    // It saves checkpoints: on one GPU (or DDP) torch.save's, nothing more on the GPU.
    assert_eq!(
        c.whole_run.and_then(|r| r.save),
        Some(gpumem_core::job::Save::Sharded)
    );
    // One GPU, or DDP over the launcher's ranks.
    assert_eq!(c.strategy(None).unwrap(), None);
    assert_eq!(c.strategy(Some(4)).unwrap().unwrap().name(), "ddp");
}

#[test]
fn trl_sft_config_yaml_with_qlora() {
    let c = read("trl-sft-zephyr-qlora.yaml");
    assert_eq!(c.kind, TrainerKind::TrlSft);
    assert_eq!(c.model.as_ref().unwrap().0, "mistralai/Mistral-7B-v0.1");
    assert_eq!(c.micro_batch.as_ref().unwrap().0, 4);
    // torch_dtype bfloat16 loads the weights in bf16.
    assert_eq!(
        (
            c.precision,
            c.grad_accum,
            c.seq_len,
            c.checkpointing,
            c.attention_mask
        ),
        (
            Some(Precision::Bf16),
            Some(2),
            Some(2048),
            Some(Checkpointing::Full),
            Some(AttentionMask::Padded)
        )
    );
    let lora = c.lora.as_ref().unwrap();
    assert_eq!(
        (lora.rank(), lora.alpha(), lora.targets().len()),
        (16, 16.0, 7)
    );
    assert_eq!(lora.quant(), Some(Quant4::new(true, false)));
    assert!(used(&c, "gradient_checkpointing_kwargs.use_reentrant"));
    assert_eq!(c.attention, Some(Attention::Flash));
    assert!(used(&c, "attn_implementation"));
    accounted(
        "trl-sft-zephyr-qlora.yaml",
        &c,
        &[
            "per_device_train_batch_size",
            "torch_dtype",
            "load_in_4bit",
            "lora_r",
            "lora_target_modules",
            "max_seq_length",
            "gradient_checkpointing_kwargs.use_reentrant",
            "per_device_eval_batch_size",
            "do_eval",
            "save_steps",
            "attn_implementation",
        ],
    );
}

#[test]
fn axolotl_qlora_yaml() {
    let c = read("axolotl-qlora-1b.yml");
    assert_eq!(c.kind, TrainerKind::Axolotl);
    assert_eq!(c.model.as_ref().unwrap().0, "NousResearch/Llama-3.2-1B");
    assert_eq!(c.micro_batch.as_ref().unwrap().0, 2);
    assert_eq!(
        (
            c.precision,
            c.optimizer,
            c.grad_accum,
            c.seq_len,
            c.checkpointing
        ),
        (
            Some(Precision::Bf16),
            Some(o("adamw8bit")),
            Some(4),
            Some(2048),
            Some(Checkpointing::Full)
        )
    );
    let lora = c.lora.as_ref().unwrap();
    assert_eq!(
        (lora.rank(), lora.alpha(), lora.targets().len()),
        (32, 16.0, 7)
    );
    assert!(lora.quant().is_some());
    // Packed under FlashAttention-2: full rows of several samples, no mask.
    assert!(used(&c, "sample_packing") && c.attention_mask == Some(AttentionMask::None));
    assert_eq!(c.attention, Some(Attention::Flash));
    assert!(used(&c, "attn_implementation"));
    accounted(
        "axolotl-qlora-1b.yml",
        &c,
        &[
            "micro_batch_size",
            "sequence_len",
            "sample_packing",
            "load_in_4bit",
            "adapter",
            "lora_r",
            "optimizer",
            "bf16",
            "gradient_checkpointing",
            "val_set_size",
            "eval_sample_packing",
            "saves_per_epoch",
        ],
    );
    // val_set_size: the Trainer's evaluation at micro_batch_size (no eval_batch_size).
    let evaluation = c.whole_run.and_then(|r| r.evaluation).unwrap();
    assert_eq!((evaluation.batch_size, evaluation.logits), (Some(2), false));
}

#[test]
fn torchtune_lora_single_device_yaml() {
    let c = read("torchtune-8B_lora_single_device.yaml");
    assert_eq!(c.kind, TrainerKind::Torchtune);
    assert_eq!(
        c.model.as_ref().unwrap().0,
        "/tmp/Meta-Llama-3.1-8B-Instruct/"
    );
    assert_eq!(c.micro_batch.as_ref().unwrap().0, 2);
    // dtype bf16 is pure bf16 weights; max_seq_len null: the flag's.
    assert_eq!(
        (
            c.precision,
            c.optimizer,
            c.grad_accum,
            c.seq_len,
            c.checkpointing,
            c.attention_mask
        ),
        (
            Some(Precision::Bf16),
            Some(o("adamw-fused")),
            Some(8),
            None,
            Some(Checkpointing::Full),
            Some(AttentionMask::None)
        )
    );
    let lora = c.lora.as_ref().unwrap();
    assert_eq!(lora.rank(), 8);
    assert_eq!(
        lora.targets(),
        [
            "q_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj"
        ]
    );
    assert_eq!(lora.quant(), None);
    assert!(
        not_modelled(&c, "loss"),
        "LinearCrossEntropyLoss is chunked"
    );
    assert_eq!(
        c.optimizer,
        Some(o("adamw-fused")),
        "torchtune's fused: True"
    );
    assert!(used(&c, "optimizer.fused"));
    assert_eq!(c.layout, Layout::Single);
    accounted(
        "torchtune-8B_lora_single_device.yaml",
        &c,
        &[
            "batch_size",
            "dtype",
            "model.lora_rank",
            "model.apply_lora_to_mlp",
            "optimizer.fused",
            "loss._component_",
            "compile",
            "enable_activation_checkpointing",
            "enable_activation_offloading",
            "gradient_accumulation_steps",
            "tokenizer.max_seq_len",
            "dataset.packed",
        ],
    );
}

#[test]
fn torchtune_full_single_device_yaml() {
    let c = read("torchtune-8B_full_single_device.yaml");
    // Its optimizer steps in backward, and its loss chunks the output projection 8 ways.
    assert_eq!(
        (
            c.optimizer_in_backward,
            c.chunked_ce,
            c.optimizer,
            c.grad_accum
        ),
        (Some(true), Some(8), Some(o("paged-adamw8bit")), Some(1))
    );
    let options = c.over(OptionValues::default(), None).unwrap();
    assert!(options.optimizer_in_backward && options.chunked_ce == Some(8));
    // Its activation offloading, off here, is read (torchtune's own hooks, where on).
    assert_eq!(c.activation_offloading, Some(false));
    assert!(used(&c, "enable_activation_offloading"));
    let on = read_text(
        "c.yaml",
        "model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\nbatch_size: 2\nenable_activation_offloading: true\n",
        Path::new("."),
        None,
    )
    .unwrap();
    assert!(
        on.over(OptionValues::default(), None)
            .unwrap()
            .activation_offloading
    );
    accounted(
        "torchtune-8B_full_single_device.yaml",
        &c,
        &[
            "batch_size",
            "dtype",
            "optimizer._component_",
            "loss._component_",
            "optimizer_in_bwd",
            "enable_activation_checkpointing",
            "enable_activation_offloading",
            "gradient_accumulation_steps",
            "tokenizer.max_seq_len",
            "dataset.packed",
            "compile",
        ],
    );
}

#[test]
fn torchtitan_toml() {
    let c = read("torchtitan-llama3_8b.toml");
    assert_eq!(c.kind, TrainerKind::TorchtitanToml);
    assert_eq!(c.model.as_ref().unwrap().0, "./assets/hf/Llama-3.1-8B");
    assert_eq!(c.micro_batch.as_ref().unwrap().0, 1);
    assert_eq!(
        (c.precision, c.optimizer, c.seq_len, c.checkpointing),
        (
            Some(Precision::Fp32),
            Some(o("adamw-fused")),
            Some(8192),
            Some(Checkpointing::SelectiveOp)
        )
    );
    // data_parallel_shard_degree -1: FSDP2 over the launcher's ranks, bf16 parameters.
    assert!(c.strategy(None).is_err());
    let s = c.strategy(Some(64)).unwrap().unwrap();
    assert_eq!((s.name(), s.world_size()), ("fsdp", 64));
    assert!(matches!(
        s.engine(),
        Engine::Fsdp {
            param_dtype: Some(HalfDtype::Bf16),
            reshard_after_forward: true,
            sync_each_batch: true,
            ..
        }
    ));
    // On one GPU torchtitan autocasts.
    let one = c.over(OptionValues::default(), Some(1)).unwrap();
    assert_eq!((one.precision, one.strategy), (Precision::AmpBf16, None));
    assert!(not_modelled(&c, "training.max_norm"));
    accounted(
        "torchtitan-llama3_8b.toml",
        &c,
        &[
            "training.local_batch_size",
            "training.seq_len",
            "parallelism.data_parallel_shard_degree",
            "parallelism.tensor_parallel_degree",
            "activation_checkpoint.mode",
            "activation_checkpoint.selective_ac_option",
            "optimizer.name",
            "compile.enable",
            "model.hf_assets_path",
            "validation.enable",
            "checkpoint.enable",
        ],
    );
}

#[test]
fn torchtitan_tensor_parallel_is_a_mesh_dimension_and_pipelines_are_refused() {
    let c = read_text(
        "t.toml",
        "[parallelism]\ndata_parallel_shard_degree = 4\ntensor_parallel_degree = 2\ndisable_loss_parallel = true\n",
        Path::new("."),
        None,
    )
    .unwrap();
    let s = c.strategy(None).unwrap().unwrap();
    assert_eq!(
        (s.name(), s.world_size(), s.tensor_parallel()),
        ("fsdp", 8, 2)
    );
    assert!(used(&c, "parallelism.tensor_parallel_degree"));
    assert!(not_modelled(&c, "parallelism.disable_loss_parallel"));
    // Tensor parallelism alone: no FSDP; its mixed-precision policy is autocast then.
    let c = read_text(
        "t.toml",
        "[parallelism]\ndata_parallel_shard_degree = 1\ntensor_parallel_degree = 4\n",
        Path::new("."),
        None,
    )
    .unwrap();
    assert_eq!(c.strategy(None).unwrap().unwrap().name(), "tp");
    // Expert parallelism borrows FSDP's ranks: 4 GPUs, experts over all 4 (ETP above 1 is
    // listed as not modelled).
    let c = read_text(
        "t.toml",
        "[parallelism]\ndata_parallel_shard_degree = 4\nexpert_parallel_degree = 4\nexpert_tensor_parallel_degree = 2\n",
        Path::new("."),
        None,
    )
    .unwrap();
    let s = c.strategy(None).unwrap().unwrap();
    assert_eq!((s.world_size(), s.expert_parallel()), (4, 4));
    assert!(used(&c, "parallelism.expert_parallel_degree"));
    assert!(not_modelled(
        &c,
        "parallelism.expert_tensor_parallel_degree"
    ));
    // Context parallelism adds ranks (FSDP shards over them too); a rotation other than the
    // traced all-gather is listed as not modelled.
    let c = read_text(
        "t.toml",
        "[parallelism]\ndata_parallel_shard_degree = 2\ncontext_parallel_degree = 4\ncontext_parallel_rotate_method = \"alltoall\"\n",
        Path::new("."),
        None,
    )
    .unwrap();
    let s = c.strategy(None).unwrap().unwrap();
    assert_eq!((s.world_size(), s.context_parallel()), (8, 4));
    assert!(not_modelled(
        &c,
        "parallelism.context_parallel_rotate_method"
    ));
    let e = read_text(
        "t.toml",
        "[parallelism]\ndata_parallel_shard_degree = 4\nexpert_parallel_degree = 3\n",
        Path::new("."),
        None,
    )
    .unwrap()
    .strategy(None)
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("must divide the 4 shard × context × tensor ranks"),
        "{e}"
    );
    // Pipeline stages as torchtitan steps them: its schedule's name, micro-batches of the
    // local batch, two stages per rank for a multi-stage schedule; gathered layers kept across
    // micro-batches (its default reshard policy with a pipeline); torchtitan's own model.
    let c = read_text(
        "t.toml",
        "[model]\nname = \"llama3\"\nflavor = \"8B\"\nhf_assets_path = \"./assets/hf/Llama-3.1-8B\"\n[training]\nlocal_batch_size = 8\n[parallelism]\ndata_parallel_shard_degree = 4\npipeline_parallel_degree = 2\npipeline_parallel_schedule = \"Interleaved1F1B\"\npipeline_parallel_microbatch_size = 2\npipeline_parallel_first_stage_less_layers = 2\n",
        Path::new("."),
        None,
    )
    .unwrap();
    let s = c.strategy(None).unwrap().unwrap();
    let p = s.pipeline().unwrap();
    assert_eq!(
        (
            s.world_size(),
            p.schedule(),
            p.microbatches(),
            p.virtual_stages()
        ),
        (8, Schedule::Interleaved, 4, 2)
    );
    assert!(matches!(
        s.engine(),
        Engine::Fsdp {
            reshard_after_forward: false,
            ..
        }
    ));
    assert_eq!(
        c.model.as_ref().map(|m| m.0.as_str()),
        Some("torchtitan:llama3(flavor=8B)")
    );
    assert!(not_modelled(
        &c,
        "parallelism.pipeline_parallel_first_stage_less_layers"
    ));
    let e = read_text(
        "t.toml",
        "[training]\nlocal_batch_size = 8\n[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = \"DualPipeV\"\n",
        Path::new("."),
        None,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("`DualPipeV` is not a schedule gpumem steps"),
        "{e}"
    );
    let every2 = read_text(
        "t.toml",
        "[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"2\"\n",
        Path::new("."),
        None,
    )
    .unwrap();
    assert_eq!(
        every2.checkpointing,
        Some(Checkpointing::parse("selective-layer:2").unwrap())
    );
    assert!(used(&every2, "activation_checkpoint.selective_ac_option"));
}

/// torchtitan's TOML of December 2024 (its published benchmarks' commit): the degrees under
/// `[training]` and `[experimental]`, compile under `[training]`, float8 in its own section, and
/// a pipeline's micro-batches as a count (one per pipeline rank by default).
#[test]
fn torchtitan_toml_of_2024() {
    let name = "torchtitan-2024-llama3_405b.toml";
    let c = read(name);
    assert_eq!(c.kind, TrainerKind::TorchtitanToml);
    assert_eq!(
        c.model.as_ref().unwrap().0,
        "torchtitan:llama3(flavor=405B)"
    );
    let s = c.strategy(Some(128)).unwrap().unwrap();
    assert_eq!((s.world_size(), s.tensor_parallel()), (128, 8));
    assert_eq!(c.checkpointing, Some(Checkpointing::Full));
    assert!(used(&c, "training.tensor_parallel_degree"));
    assert!(not_modelled(&c, "training.compile"));
    // Its float8 section: torchao's tensorwise Float8Linear, weights all-gathered in float8.
    assert_eq!(
        c.float8,
        Some(gpumem_core::job::Float8 {
            recipe: gpumem_core::job::Float8Recipe::Tensorwise,
            fsdp_all_gather: true
        })
    );
    assert!(used(&c, "float8.enable_fsdp_float8_all_gather"));
    assert!(not_modelled(
        &c,
        "experimental.enable_async_tensor_parallel"
    ));
    accounted(
        name,
        &c,
        &[
            "training.batch_size",
            "training.seq_len",
            "training.data_parallel_shard_degree",
            "training.tensor_parallel_degree",
            "training.compile",
            "experimental.pipeline_parallel_degree",
            "experimental.context_parallel_degree",
            "activation_checkpoint.mode",
            "float8.enable_float8_linear",
            "checkpoint.enable_checkpoint",
        ],
    );
    // torchtitan's 405B benchmark in 3-D: FSDP 8 × TP 8 × PP 8, interleaved 1F1B over 32
    // samples a rank; micro-batches one per pipeline rank unless counted.
    let toml = |extra: &str| {
        format!(
            "[model]\nname = \"llama3\"\nflavor = \"405B\"\n[training]\nbatch_size = 32\nseq_len = 8192\ndata_parallel_shard_degree = -1\ntensor_parallel_degree = 8\n[experimental]\npipeline_parallel_degree = 8\npipeline_parallel_schedule = \"Interleaved1F1B\"\ncontext_parallel_degree = 1\n{extra}"
        )
    };
    let c = read_text("t.toml", &toml(""), Path::new("."), None).unwrap();
    let s = c.strategy(Some(512)).unwrap().unwrap();
    let p = s.pipeline().unwrap();
    assert_eq!(
        (
            s.tensor_parallel(),
            p.schedule(),
            p.microbatches(),
            p.virtual_stages()
        ),
        (8, Schedule::Interleaved, 8, 2)
    );
    assert!(used(&c, "experimental.pipeline_parallel_degree"));
    let c = read_text(
        "t.toml",
        &toml("pipeline_parallel_microbatches = 16\n"),
        Path::new("."),
        None,
    )
    .unwrap();
    assert_eq!(
        c.strategy(Some(512))
            .unwrap()
            .unwrap()
            .pipeline()
            .unwrap()
            .microbatches(),
        16
    );
    let e = read_text(
        "t.toml",
        &toml("pipeline_parallel_microbatches = 5\n"),
        Path::new("."),
        None,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("experimental.pipeline_parallel_microbatches"),
        "{e}"
    );
}

/// A torchtitan Python config's result as `gpumem_trace.config` dumps it (the `Trainer.Config`
/// of `docs/examples/train-configs/torchtitan_llama3_8b.py`, its fields abridged).
#[test]
fn torchtitan_python_dump() {
    let json = r#"{"_class": "torchtitan.trainer.Trainer.Config",
      "hf_assets_path": "./assets/hf/Llama-3.1-8B",
      "model_spec": {"_class": "torchtitan.protocols.model_spec.ModelSpec", "name": "llama3", "flavor": "8B"},
      "loss": {"_class": "torchtitan.components.loss.ChunkedLossWrapper.Config", "loss_fn": {"global_vocab_size": 128256}},
      "optimizer": {"_class": "torchtitan.components.optimizer.AdamW.Config", "lr": 0.0003, "implementation": "fused"},
      "training": {"_class": "torchtitan.config.configs.TrainingConfig", "num_tokens_per_microbatch_per_dp_rank": 8192,
                   "num_tokens_per_train_step": -1, "max_context_length": 8192, "max_norm": 1.0, "steps": 1000,
                   "enable_cpu_offload": false, "dtype": "float32", "mixed_precision_param": "bfloat16",
                   "mixed_precision_reduce": "float32", "gc_freq": 50},
      "parallelism": {"_class": "torchtitan.config.configs.ParallelismConfig", "data_parallel_replicate_degree": 1,
                      "data_parallel_shard_degree": -1, "fsdp_reshard_after_forward": "default", "tensor_parallel_degree": 1,
                      "pipeline_parallel_degree": 1, "context_parallel_degree": 1, "expert_parallel_degree": 1},
      "activation_checkpoint": {"_class": "torchtitan.distributed.activation_checkpoint.SelectiveAC.Config",
                                "preserve_rng_state": true, "force_recompute_mm_shapes_by_fqns": []},
      "compile": {"_class": "torchtitan.config.configs.CompileConfig", "enable": false, "components": ["model", "loss"]},
      "checkpoint": {"_class": "torchtitan.components.checkpointer.CheckpointManager.Config", "interval": 500},
      "validator": {"_class": "torchtitan.components.validate.Validator.Config", "freq": 500, "steps": 1200}}"#;
    let c = read_text(
        "cfg.py:llama3_8b",
        json,
        Path::new("."),
        Some(TrainerKind::TorchtitanPython),
    )
    .unwrap();
    assert_eq!(c.model.as_ref().unwrap().0, "./assets/hf/Llama-3.1-8B");
    assert_eq!(c.micro_batch.as_ref().unwrap().0, 1);
    assert_eq!(
        (c.seq_len, c.checkpointing, c.optimizer),
        (
            Some(8192),
            Some(Checkpointing::SelectiveOp),
            Some(o("adamw-fused"))
        )
    );
    assert!(
        not_modelled(&c, "loss") && not_modelled(&c, "validator") && not_modelled(&c, "checkpoint"),
        "{:#?}",
        c.fields
    );
    assert_eq!(c.strategy(Some(8)).unwrap().unwrap().name(), "fsdp");
}

#[test]
fn lightning_cli_yaml() {
    let c = read("lightning-cli.yaml");
    assert_eq!(c.kind, TrainerKind::Lightning);
    assert_eq!(c.model.as_ref().unwrap().0, "openai-community/gpt2");
    assert_eq!(c.micro_batch.as_ref().unwrap().0, 16);
    assert_eq!(
        (c.precision, c.optimizer, c.grad_accum, c.seq_len),
        (
            Some(Precision::AmpBf16),
            Some(o("adamw")),
            Some(2),
            Some(512)
        )
    );
    assert_eq!(c.layout, Layout::Single);
    accounted(
        "lightning-cli.yaml",
        &c,
        &[
            "trainer.precision",
            "trainer.devices",
            "trainer.accumulate_grad_batches",
            "data.init_args.batch_size",
            "data.init_args.max_seq_length",
            "optimizer.class_path",
            "trainer.gradient_clip_val",
            "model.class_path",
        ],
    );
}

#[test]
fn litgpt_qlora_yaml() {
    let c = read("litgpt-llama-3-8b-qlora.yaml");
    assert_eq!(c.kind, TrainerKind::Litgpt);
    // litgpt's own model of the checkpoint's Hub id, its LoRA in litgpt's names.
    assert_eq!(
        c.model.as_ref().unwrap().0,
        "litgpt:meta-llama/Meta-Llama-3-8B"
    );
    assert_eq!(c.micro_batch.as_ref().unwrap().0, 2);
    // bnb.nf4 swaps AdamW for bitsandbytes' paged one; 8 samples / 1 device / micro 2.
    assert_eq!(
        (c.precision, c.optimizer, c.grad_accum, c.seq_len),
        (
            Some(Precision::Bf16),
            Some(o("paged_adamw_32bit")),
            Some(4),
            Some(512)
        )
    );
    let lora = c.lora.as_ref().unwrap();
    assert_eq!(
        (lora.rank(), lora.alpha(), lora.targets(), lora.dropout()),
        (
            32,
            16.0,
            &["query".to_string(), "value".to_string()][..],
            0.05
        )
    );
    let quant = lora.quant().unwrap();
    assert!(quant.nf4 && !quant.double_quant);
    assert_eq!(quant.loader, gpumem_core::job::QuantLoader::Fabric);
    assert_eq!(c.layout, Layout::Single);
    assert!(not_modelled(&c, "eval"));
    accounted(
        "litgpt-llama-3-8b-qlora.yaml",
        &c,
        &[
            "checkpoint_dir",
            "precision",
            "quantize",
            "devices",
            "lora_r",
            "lora_query",
            "lora_mlp",
            "train.micro_batch_size",
            "train.global_batch_size",
            "train.max_seq_length",
            "optimizer.class_path",
            "eval.interval",
            "train.save_interval",
        ],
    );
    // Several devices: fine-tuning's FSDP with every Block checkpointed; pretraining's
    // sharded within a node, replicated across nodes, unchecked.
    let yaml = |extra: &str| {
        read_text(
            "l.yaml",
            &format!("train:\n  micro_batch_size: 1\n{extra}"),
            &examples(),
            None,
        )
        .unwrap()
    };
    let full = yaml("checkpoint_dir: checkpoints/microsoft/phi-2\ndevices: 4\n");
    assert_eq!(full.model.as_ref().unwrap().0, "litgpt:microsoft/phi-2");
    assert_eq!(
        full.precision,
        Some(Precision::AmpBf16),
        "bf16-mixed by default"
    );
    assert_eq!(full.checkpointing, Some(Checkpointing::Full));
    assert!(matches!(
        full.layout,
        Layout::Fsdp {
            replicate: 1,
            shard: Some(4),
            ..
        }
    ));
    // finetune_lora's defaults fill what a config leaves out: alpha 16, dropout 0.05, LoRA on
    // the query and the value unless a switch says otherwise.
    let defaults = yaml("checkpoint_dir: checkpoints/microsoft/phi-2\nlora_r: 4\nlora_mlp: true\n");
    let l = defaults.lora.as_ref().unwrap();
    assert_eq!(
        (l.rank(), l.alpha(), l.dropout(), l.targets()),
        (
            4,
            16.0,
            0.05,
            &["query".to_string(), "value".into(), "mlp".into()][..]
        )
    );
    let pre = yaml("model_name: tiny-llama-1.1b\ndevices: 8\nnum_nodes: 2\n");
    assert_eq!(
        pre.model.as_ref().unwrap().0,
        "litgpt:tiny-llama-1.1b(lm_head_chunk_size=0)"
    );
    assert_eq!(pre.checkpointing, None);
    assert!(matches!(
        pre.layout,
        Layout::Fsdp {
            replicate: 2,
            shard: Some(8),
            ..
        }
    ));
    let bad = read_text(
        "l.yaml",
        "checkpoint_dir: x\nquantize: bnb.nf4\ntrain:\n  micro_batch_size: 1\n",
        &examples(),
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(
        bad.contains("quantize") && bad.contains("bf16-true"),
        "{bad}"
    );
}

#[test]
fn deepspeed_and_accelerate_as_trainer_configs() {
    let ds = read("ds_config_zero2.json");
    assert_eq!(ds.kind, TrainerKind::Deepspeed);
    assert_eq!(ds.optimizer, Some(o("adamw")));
    assert_eq!(ds.strategy(Some(4)).unwrap().unwrap().name(), "zero2");
    assert!(not_modelled(&ds, "zero_optimization.allgather_bucket_size"));
    accounted(
        "ds_config_zero2.json",
        &ds,
        &[
            "zero_optimization.stage",
            "zero_optimization.offload_optimizer.device",
            "bf16.enabled",
            "train_micro_batch_size_per_gpu",
        ],
    );
    let acc = read("accelerate-fsdp2.yaml");
    assert_eq!(acc.kind, TrainerKind::Accelerate);
    assert_eq!(acc.precision, Some(Precision::AmpBf16));
    assert_eq!(acc.strategy(None).unwrap().unwrap().world_size(), 8);
    accounted(
        "accelerate-fsdp2.yaml",
        &acc,
        &[
            "distributed_type",
            "num_processes",
            "mixed_precision",
            "fsdp_config.fsdp_offload_params",
            "fsdp_config.fsdp_activation_checkpointing",
            // The load's broadcast from rank 0: listed, not hidden.
            "fsdp_config.fsdp_cpu_ram_efficient_loading",
        ],
    );
    assert!(not_modelled(
        &acc,
        "fsdp_config.fsdp_cpu_ram_efficient_loading"
    ));
}

#[test]
fn errors_name_the_file_and_the_field() {
    let err = |text: &str| {
        read_text("c.yaml", text, Path::new("."), None)
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        err("base_model: x\nmicro_batch_size: 0\n"),
        "c.yaml: `micro_batch_size`: 0 must be at least 1"
    );
    assert_eq!(
        err("base_model: x\noptimizer: lamb\n"),
        "c.yaml: `optimizer`: unknown optimizer `lamb` (expected one of: adam, adamw, sgd, sgd-momentum, adam8bit, adamw8bit or paged-adamw8bit)"
            .replace("unknown optimizer `lamb` (expected one of: adam, adamw, sgd, sgd-momentum, adam8bit, adamw8bit or paged-adamw8bit)", &gpumem_core::job::Optimizer::parse("lamb").unwrap_err().to_string())
    );
    assert_eq!(
        err("per_device_train_batch_size: 4\nbf16: true\nfp16: true\n"),
        "c.yaml: `fp16`: bf16 and fp16 are both true"
    );
    assert!(err("hello: 1\n").starts_with("c.yaml: cannot tell which trainer's config this is"));
    assert_eq!(
        err("trainer:\n  precision: transformer-engine\n"),
        "c.yaml: `trainer.precision`: `transformer-engine` is not modelled (32-true, bf16-mixed, 16-mixed, bf16-true, 16-true)"
    );
    // An unknown key is reported, not dropped.
    let c = read_text(
        "c.yaml",
        "base_model: x\nfancy_new_memory_knob: 3\n",
        Path::new("."),
        None,
    )
    .unwrap();
    assert!(
        c.fields
            .not_modelled
            .iter()
            .any(|n| n.field == "fancy_new_memory_knob" && n.reason == UNKNOWN)
    );
}

/// A run resumed from a checkpoint — Hugging Face's and axolotl's `resume_from_checkpoint` (a
/// path), axolotl's `auto_resume_from_checkpoints`, torchtune's flag — is a whole run whose load
/// reads the optimizer state in; a resume turned off is not.
#[test]
fn a_resumed_run_reads_its_optimizer_state_in() {
    let resumes = |text: &str| {
        read_text("c.yaml", text, Path::new("."), None)
            .unwrap()
            .whole_run
            .is_some_and(|r| r.resume)
    };
    assert!(resumes(
        "per_device_train_batch_size: 4\nresume_from_checkpoint: out/checkpoint-500\n"
    ));
    assert!(!resumes(
        "per_device_train_batch_size: 4\nresume_from_checkpoint: null\n"
    ));
    assert!(resumes(
        "base_model: x\nauto_resume_from_checkpoints: true\n"
    ));
    assert!(!resumes("base_model: x\nresume_from_checkpoint: false\n"));
    let tune = "model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\nresume_from_checkpoint: true\n";
    assert!(resumes(tune));
    let err = read_text(
        "c.yaml",
        "base_model: x\nresume_from_checkpoint: 3\n",
        Path::new("."),
        None,
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        err,
        "c.yaml: `resume_from_checkpoint`: 3 is not a checkpoint's path or a flag"
    );
}

/// Trainer optimizer names with semantics of their own (fused AdamW, 32-bit paged AdamW,
/// Adafactor, Lion, torchao's 8-bit AdamW): modelled, not noted.
#[test]
fn trainer_optimizer_names_that_the_optimizer_vocabulary_models() {
    for name in [
        "adamw_torch_fused",
        "paged_adamw_32bit",
        "adafactor",
        "lion_8bit",
        "torchao.optim.AdamW8bit",
    ] {
        let text = format!("base_model: x\noptimizer: {name}\n");
        let c = read_text("c.yaml", &text, Path::new("."), None)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(c.optimizer.is_some(), "{name}");
        assert!(used(&c, "optimizer"), "{name} is modelled, not noted");
    }
}

#[test]
fn trainer_spellings_of_modelled_optimizers() {
    for (name, o) in [
        ("adamw_torch", o("adamw")),
        ("adamw_torch_fused", o("adamw-fused")),
        ("adamw_bnb_8bit", o("adamw8bit")),
        ("paged_adamw_8bit", o("paged-adamw8bit")),
        ("sgd", o("sgd")),
        ("adamw", o("adamw")),
    ] {
        let text = format!("base_model: x\noptimizer: {name}\n");
        let c = read_text("c.yaml", &text, Path::new("."), None).unwrap();
        assert_eq!(c.optimizer, Some(o), "{name}");
    }
    let e = read_text(
        "c.yaml",
        "base_model: x\noptimizer: lamb\n",
        Path::new("."),
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("c.yaml: `optimizer`: "), "{e}");
}

/// The Trainer's checkpoints as a config names them: none unless saving is named; under FSDP
/// accelerate's full state dict (gathered to the host) unless it is sharded, FSDP2's default.
#[test]
fn checkpoint_saving_as_the_trainer_does_it() {
    use gpumem_core::job::Save;
    let save = |kind, text: &str| {
        read_text("c.yaml", text, Path::new("."), Some(kind))
            .unwrap_or_else(|e| panic!("{e}"))
            .whole_run
            .and_then(|r| r.save)
    };
    let hf = |text: &str| save(TrainerKind::HfTrainer, text);
    let fsdp = "fsdp: full_shard\nfsdp_config: {min_num_params: 1}\n";
    assert_eq!(hf("save_strategy: 'no'\n"), None);
    assert_eq!(hf("save_strategy: steps\n"), Some(Save::Sharded));
    assert_eq!(
        hf(&format!("{fsdp}save_steps: 100\n")),
        Some(Save::FullOffload)
    );
    assert_eq!(
        hf(
            "fsdp: full_shard\nfsdp_config: {state_dict_type: SHARDED_STATE_DICT}\nsave_strategy: epoch\n"
        ),
        Some(Save::Sharded)
    );
    // transformers gives accelerate FULL_STATE_DICT where it is unset, FSDP2 too.
    assert_eq!(
        hf("fsdp: full_shard\nfsdp_config: {version: 2}\nsave_strategy: epoch\n"),
        Some(Save::FullOffload)
    );
    assert_eq!(
        save(
            TrainerKind::Axolotl,
            "base_model: m\nsaves_per_epoch: 1\nfsdp_config: {fsdp_state_dict_type: FULL_STATE_DICT}\n"
        ),
        Some(Save::FullOffload)
    );
    let bad = read_text(
        "c.yaml",
        "save_strategy: sometimes\n",
        Path::new("."),
        Some(TrainerKind::HfTrainer),
    )
    .unwrap_err()
    .to_string();
    assert!(
        bad.contains("save_strategy") && bad.contains("sometimes"),
        "{bad}"
    );
}

/// TRL's SFTConfig differs from TrainingArguments where a config is silent: bf16 unless fp16,
/// and non-reentrant gradient checkpointing on.
#[test]
fn trl_defaults_bf16_and_checkpointing_where_unsaid() {
    let read = |kind, text: &str| {
        let c = read_text("c.yaml", text, Path::new("."), Some(kind)).unwrap();
        (c.precision, c.checkpointing)
    };
    let text = "per_device_train_batch_size: 2\n";
    assert_eq!(
        read(TrainerKind::TrlSft, text),
        (Some(Precision::AmpBf16), Some(Checkpointing::Full))
    );
    assert_eq!(
        read(TrainerKind::HfTrainer, text),
        (Some(Precision::Fp32), None)
    );
    assert_eq!(
        read(
            TrainerKind::TrlSft,
            "fp16: true\ngradient_checkpointing: false\n"
        ),
        (Some(Precision::AmpFp16), Some(Checkpointing::Off))
    );
}

/// An optimizer by gpumem's name.
fn o(name: &str) -> Optimizer {
    Optimizer::parse(name).unwrap()
}

/// The attention implementation as each trainer names it; one gpumem does not model is reported.
#[test]
fn attention_implementations_as_trainers_name_them() {
    let read = |kind, text: &str| {
        read_text("c.yaml", text, Path::new("."), Some(kind)).unwrap_or_else(|e| panic!("{e}"))
    };
    for (text, attention) in [
        ("base_model: m\nflash_attention: true\n", Attention::Flash),
        ("base_model: m\nsdp_attention: true\n", Attention::Sdpa),
        ("base_model: m\neager_attention: true\n", Attention::Eager),
        (
            "base_model: m\nattn_implementation: eager\n",
            Attention::Eager,
        ),
    ] {
        let c = read(TrainerKind::Axolotl, text);
        assert_eq!(c.attention, Some(attention), "{text}");
    }
    let off = read(
        TrainerKind::Axolotl,
        "base_model: m\nflash_attention: false\n",
    );
    assert_eq!(off.attention, None);
    assert!(used(&off, "flash_attention"));
    let hf = read(
        TrainerKind::HfTrainer,
        "model_init_kwargs:\n  attn_implementation: sdpa\n",
    );
    assert_eq!(hf.attention, Some(Attention::Sdpa));
    let flex = read(
        TrainerKind::HfTrainer,
        "attn_implementation: flex_attention\n",
    );
    assert_eq!(flex.attention, None);
    assert!(not_modelled(&flex, "attn_implementation"));
}

/// TRL's GRPO generates each GPU's completions with the model it trains, before it trains on
/// them: a whole run with that generation, at the config's prompt and completion lengths; the
/// step trains on both. DPO's `max_completion_length` (a truncation) generates nothing; nor
/// does a config whose completions vLLM serves, which says so.
#[test]
fn trl_grpo_generates_its_completions_before_it_trains() {
    let grpo = "model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\nbf16: true\nper_device_train_batch_size: 8\ngradient_accumulation_steps: 2\nnum_generations: 8\nmax_prompt_length: 256\nmax_completion_length: 512\nbeta: 0.04\n";
    let read = |text: &str| read_text("config.yaml", text, &examples(), None).unwrap();
    let c = read(grpo);
    let g = c.whole_run.and_then(|r| r.generation).unwrap();
    assert_eq!(
        (g.new_tokens, g.batch_size, g.prompt_len, c.seq_len),
        (512, Some(16), Some(256), Some(768))
    );
    assert!(used(&c, "num_generations") && used(&c, "beta"));
    // beta > 0: the KL term's reference model, a frozen copy — but not for a PEFT model, whose
    // reference is itself with its adapters off.
    assert_eq!(c.reference_model, Some(true));
    let peft = read(&format!("{grpo}use_peft: true\nlora_r: 16\n"));
    assert_eq!(peft.reference_model, None);
    assert_eq!(
        read(&grpo.replace("beta: 0.04", "beta: 0.0")).reference_model,
        None
    );
    // Its sampling filters, as TRL passes them to generate(): top-p below 1 sorts each token's
    // scores; a top-p of 1 and a min-p of 0 filter nothing.
    let filters = |text: &str| {
        read(&format!("{grpo}{text}"))
            .whole_run
            .and_then(|r| r.generation)
            .unwrap()
            .filters
    };
    assert_eq!(
        filters("top_k: 50\ntop_p: 0.9\nmin_p: 0.0\n"),
        gpumem_core::job::Filters {
            top_k: Some(50),
            top_p: true,
            min_p: false
        }
    );
    assert!(filters("top_p: 1.0\n").is_none());
    let dpo =
        read("model_name_or_path: x\nper_device_train_batch_size: 2\nmax_completion_length: 128\n");
    assert!(dpo.whole_run.and_then(|r| r.generation).is_none());
    let served = read(&format!("{grpo}use_vllm: true\n"));
    assert!(served.whole_run.is_none() && not_modelled(&served, "use_vllm"));
}

/// A Hugging Face config that saves under ZeRO-3 with `stage3_gather_16bit_weights_on_model_save`
/// saves DeepSpeed's consolidated 16-bit weights (`--save full`); without it each rank's
/// partitions (`sharded`).
#[test]
fn zero3_saves_consolidated_weights_where_the_deepspeed_config_gathers_them() {
    let config = |gather: bool| {
        format!(
            r#"{{"model_name_or_path": "gpt2", "per_device_train_batch_size": 2, "save_strategy": "steps",
               "deepspeed": {{"zero_optimization": {{"stage": 3, "stage3_gather_16bit_weights_on_model_save": {gather}}}}}}}"#
        )
    };
    let save = |gather| {
        read_text("args.json", &config(gather), &examples(), None)
            .unwrap()
            .whole_run
            .and_then(|r| r.save)
    };
    assert_eq!(save(true), Some(gpumem_core::job::Save::Full));
    assert_eq!(save(false), Some(gpumem_core::job::Save::Sharded));
}

/// What a config gives compute_metrics (`include_for_metrics`) says it has one: the evaluation
/// keeps the logits, and the inputs where listed; `eval_do_concat_batches: false` keeps a list;
/// `prediction_loss_only` keeps the losses alone whatever else is said.
#[test]
fn the_evaluation_keeps_what_compute_metrics_is_given() {
    let evaluation = |extra: &str| {
        let text = format!(
            r#"{{"model_name_or_path": "gpt2", "per_device_train_batch_size": 2, "eval_strategy": "steps"{extra}}}"#
        );
        read_text("args.json", &text, &examples(), None)
            .unwrap()
            .whole_run
            .and_then(|r| r.evaluation)
            .unwrap()
    };
    let plain = evaluation("");
    assert!(!plain.logits && !plain.inputs && !plain.as_list);
    let e = evaluation(
        r#", "include_for_metrics": ["inputs", "loss"], "eval_do_concat_batches": false"#,
    );
    assert!(e.logits && e.inputs && e.as_list);
    let e = evaluation(r#", "include_for_metrics": ["loss"], "prediction_loss_only": true"#);
    assert!(!e.logits && !e.inputs);
    let e = evaluation(r#", "include_inputs_for_metrics": true"#);
    assert!(e.logits && e.inputs);
}

/// An FSDP config that loads on rank 0 and broadcasts (`cpu_ram_efficient_loading`,
/// `sync_module_states`) says so among what is not modelled; off, it is nothing to memory.
#[test]
fn an_fsdp_broadcast_load_is_listed_as_not_modelled() {
    let read = |on: bool| {
        let text = format!(
            r#"{{"model_name_or_path": "gpt2", "per_device_train_batch_size": 2, "fsdp": "full_shard auto_wrap",
               "fsdp_config": {{"version": 2, "cpu_ram_efficient_loading": {on}}}}}"#
        );
        read_text("args.json", &text, &examples(), None).unwrap()
    };
    assert!(not_modelled(
        &read(true),
        "fsdp_config.cpu_ram_efficient_loading"
    ));
    assert!(!not_modelled(
        &read(false),
        "fsdp_config.cpu_ram_efficient_loading"
    ));
}

/// torchtitan's float8 converter under each release's name: its recipe and all-gathers read,
/// another filter than the output head's reported, an MX converter still not modelled.
#[test]
fn torchtitan_float8_converters() {
    use gpumem_core::job::{Float8, Float8Recipe};
    let toml = |converters: &str, section: &str, keys: &str| {
        let text = format!(
            "[model]\nname = \"llama3\"\nflavor = \"8B\"\nconverters = [{converters}]\n[training]\nlocal_batch_size = 1\nseq_len = 8192\n[{section}]\n{keys}"
        );
        read_text("t.toml", &text, Path::new("."), None)
    };
    let c = toml(
        "\"quantize.linear.float8\"",
        "quantize.linear.float8",
        "recipe_name = \"rowwise\"\nfilter_fqns = [\"output\"]\n",
    )
    .unwrap();
    assert_eq!(
        c.float8,
        Some(Float8 {
            recipe: Float8Recipe::Rowwise,
            fsdp_all_gather: false
        })
    );
    assert!(used(&c, "quantize.linear.float8.filter_fqns") && used(&c, "model.converters"));
    let c = toml(
        "\"float8\"",
        "float8",
        "enable_fsdp_float8_all_gather = true\nfilter_fqns = [\"output\", \"attention.wq\"]\n",
    )
    .unwrap();
    assert_eq!(
        c.float8.map(|f| (f.recipe, f.fsdp_all_gather)),
        Some((Float8Recipe::Tensorwise, true))
    );
    assert!(not_modelled(&c, "float8.filter_fqns"));
    let c = toml(
        "\"quantize.linear.mx\"",
        "quantize.linear.mx",
        "recipe_name = \"mxfp8\"\n",
    )
    .unwrap();
    assert!(c.float8.is_none() && not_modelled(&c, "model.converters"));
    let bad = toml("\"float8\"", "float8", "recipe_name = \"fp4\"\n").unwrap_err();
    assert!(
        bad.to_string()
            .contains("`float8.recipe_name`: `fp4` is not a float8 recipe"),
        "{bad}"
    );
}

/// FSDP under accumulation as each trainer runs it: Hugging Face's Trainer (accelerate's
/// `no_sync`) and litgpt (Fabric's) hold the gradients unsharded until the last micro-batch,
/// unless accelerate is told `sync_each_batch`; torchtitan reduces each micro-batch's.
#[test]
fn fsdp_accumulation_syncs_as_each_trainer_does() {
    let synced = |kind, text: &str, world| {
        let c =
            read_text("c.yaml", text, Path::new("."), Some(kind)).unwrap_or_else(|e| panic!("{e}"));
        let s = c.strategy(world).unwrap().unwrap();
        match s.engine() {
            Engine::Fsdp {
                sync_each_batch, ..
            } => (sync_each_batch, c),
            other => panic!("{other:?}"),
        }
    };
    let hf = "per_device_train_batch_size: 2\ngradient_accumulation_steps: 4\nfsdp: full_shard\n";
    assert!(!synced(TrainerKind::HfTrainer, hf, Some(4)).0);
    let (on, c) = synced(
        TrainerKind::HfTrainer,
        &format!(
            "{hf}accelerator_config:\n  gradient_accumulation_kwargs:\n    sync_each_batch: true\n"
        ),
        Some(4),
    );
    assert!(
        on && used(
            &c,
            "accelerator_config.gradient_accumulation_kwargs.sync_each_batch"
        )
    );
    let litgpt = "checkpoint_dir: checkpoints/meta-llama/Meta-Llama-3-8B\ndevices: 4\ntrain:\n  global_batch_size: 16\n  micro_batch_size: 1\n";
    assert!(!synced(TrainerKind::Litgpt, litgpt, None).0);
    assert!(
        read("torchtitan-llama3_8b.toml")
            .strategy(Some(8))
            .unwrap()
            .is_some_and(|s| matches!(
                s.engine(),
                Engine::Fsdp {
                    sync_each_batch: true,
                    ..
                }
            ))
    );
}

/// Liger's kernels as the trainers switch them on: Hugging Face's `use_liger_kernel` (Liger's
/// defaults, `liger_kernel_config` over them) and axolotl's Liger plugin (each `liger_*` key,
/// absent ones off); the keys are used, not reported, and Liger off leaves them without bearing.
#[test]
fn liger_kernels_as_the_trainers_switch_them_on() {
    let config = |text: &str| read_text("c.yaml", text, Path::new("."), None);
    let hf = config(
        "per_device_train_batch_size: 2\nuse_liger_kernel: true\nliger_kernel_config:\n  rope: false\n  swiglu: true\n",
    )
    .unwrap();
    assert_eq!(
        hf.liger,
        Some(gpumem_core::job::Liger::parse("rope=false,swiglu=true").unwrap())
    );
    assert!(used(&hf, "use_liger_kernel") && used(&hf, "liger_kernel_config.rope"));
    let defaults = config("per_device_train_batch_size: 2\nuse_liger_kernel: true\n").unwrap();
    assert_eq!(defaults.liger, Some(gpumem_core::job::Liger::default()));
    let off = config(
        "per_device_train_batch_size: 2\nuse_liger_kernel: false\nliger_kernel_config:\n  rope: false\n",
    )
    .unwrap();
    assert_eq!(off.liger, None);
    assert!(!not_modelled(&off, "liger_kernel_config"));
    let e = config(
        "per_device_train_batch_size: 2\nuse_liger_kernel: true\nliger_kernel_config:\n  rmsnorm: true\n",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("c.yaml: `liger_kernel_config.rmsnorm`: liger: unknown kernel `rmsnorm`"),
        "{e}"
    );

    let axolotl = config(
        "base_model: x\nplugins:\n  - axolotl.integrations.liger.LigerPlugin\nliger_rms_norm: true\nliger_glu_activation: true\nliger_fused_linear_cross_entropy: true\n",
    )
    .unwrap();
    assert_eq!(
        axolotl.liger,
        Some(
            gpumem_core::job::Liger::parse(
                "rope=false,rms_norm=true,layer_norm=false,swiglu=true,geglu=true,cross_entropy=false,fused_linear_cross_entropy=true"
            )
            .unwrap()
        )
    );
    assert!(used(&axolotl, "plugins") && used(&axolotl, "liger_rms_norm"));
    let other = config(
        "base_model: x\nplugins:\n  - axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin\nliger_rope: true\n",
    )
    .unwrap();
    assert_eq!(other.liger, None);
    assert!(not_modelled(&other, "plugins") && !not_modelled(&other, "liger_rope"));
}

/// Packed batches: full rows of several samples with no padding mask (TRL's `packing`,
/// `padding_free`, axolotl's `sample_packing`, torchtune's `dataset.packed`). Padding-free rows
/// under an attention other than FlashAttention-2 get a block-causal mask from their position
/// ids, which is reported as not sized; TRL's "wrapped" packing has none.
#[test]
fn packed_batches_are_full_rows_without_a_mask() {
    let config = |text: &str| read_text("c.yaml", text, Path::new("."), None).unwrap();
    let trl = "model_name_or_path: x\nmax_length: 1024\npacking: true\n";
    let flash = config(&format!("{trl}attn_implementation: flash_attention_2\n"));
    assert_eq!(flash.attention_mask, Some(AttentionMask::None));
    assert!(used(&flash, "packing"));
    let sdpa = config(trl);
    assert_eq!(sdpa.attention_mask, Some(AttentionMask::None));
    assert!(not_modelled(&sdpa, "packing"));
    let wrapped = config(&format!("{trl}packing_strategy: wrapped\n"));
    assert!(used(&wrapped, "packing") && used(&wrapped, "packing_strategy"));
    let unpacked = config(
        "model_name_or_path: x\nper_device_train_batch_size: 2\npacking: false\npacking_strategy: wrapped\n",
    );
    assert_eq!(unpacked.attention_mask, Some(AttentionMask::Padded));
    assert!(
        unpacked
            .fields
            .no_memory
            .iter()
            .any(|k| k == "packing_strategy")
    );
    let axolotl = config("base_model: x\nsample_packing: true\nsdp_attention: true\n");
    assert_eq!(axolotl.attention_mask, Some(AttentionMask::None));
    assert!(not_modelled(&axolotl, "sample_packing"));
    let tune = config(
        "model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\nbatch_size: 2\ndataset:\n  packed: true\n",
    );
    assert_eq!(tune.attention_mask, Some(AttentionMask::None));
    assert!(used(&tune, "dataset.packed"));
}

/// torch.compile as each trainer states it: the loss compiled where it runs on plain tensors,
/// the model's compiled blocks stated as not modelled.
#[test]
fn a_compiled_loss_is_read_and_compiled_blocks_are_stated() {
    let titan = |compile: &str| {
        let path = examples().join("torchtitan-llama3_8b.toml");
        let text = std::fs::read_to_string(&path).unwrap().replace(
            "[compile]\nenable=false\ncomponents = [\"model\", \"loss\"]",
            compile,
        );
        assert!(text.contains("[compile]"), "the fixture states compile");
        read_text("t.toml", &text, &examples(), None).unwrap()
    };
    let both = titan("[compile]\nenable=true\ncomponents = [\"model\", \"loss\"]");
    assert_eq!(both.compile, Some(true));
    assert!(not_modelled(&both, "compile.components"));
    let loss = titan("[compile]\nenable=true\ncomponents = [\"loss\"]");
    assert_eq!(loss.compile, Some(true));
    assert!(used(&loss, "compile.components"));
    let model = titan("[compile]\nenable=true\ncomponents = [\"model\"]");
    assert_eq!(model.compile, None);
    assert!(not_modelled(&model, "compile.components"));
    assert_eq!(titan("[compile]\nenable=false").compile, None);
    // torchtitan's 2024 TOML compiles under tensor parallelism: a loss-parallel loss on
    // DTensors, traced eagerly.
    let tp = read("torchtitan-2024-llama3_405b.toml");
    assert_eq!(tp.compile, None);
    assert!(not_modelled(&tp, "training.compile"));
    // Without it too: the older key compiled the loss in some releases only (read as eager).
    let path = examples().join("torchtitan-2024-llama3_405b.toml");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("tensor_parallel_degree = 8", "tensor_parallel_degree = 1");
    let older = read_text("t.toml", &text, &examples(), None).unwrap();
    assert_eq!(older.compile, None);
    assert!(not_modelled(&older, "training.compile"));

    let tune = read_text(
        "c.yaml",
        "model:\n  _component_: torchtune.models.llama3_2.llama3_2_1b\nbatch_size: 2\ncompile: True\n",
        Path::new("."),
        None,
    )
    .unwrap();
    assert_eq!(tune.compile, Some(true));
    assert!(not_modelled(&tune, "compile"));
    assert!(tune.over(OptionValues::default(), None).unwrap().compile);
    let hf = read_text(
        "args.json",
        r#"{"model_name_or_path": "gpt2", "per_device_train_batch_size": 2, "torch_compile": true}"#,
        Path::new("."),
        None,
    )
    .unwrap();
    assert_eq!(hf.compile, Some(true));
    assert!(not_modelled(&hf, "torch_compile"));
}

/// `trust_remote_code: true` loads the model with its checkpoint's own code (`hf-code:`),
/// where its config names some (resolved then; a config naming none is the model transformers
/// has).
#[test]
fn trust_remote_code_runs_the_checkpoints_own_code() {
    let hf = read_text(
        "args.json",
        r#"{"model_name_or_path": "Qwen/Qwen-7B-Chat", "per_device_train_batch_size": 1, "trust_remote_code": true}"#,
        Path::new("."),
        None,
    )
    .unwrap();
    assert_eq!(hf.model.as_ref().unwrap().0, "hf-code:Qwen/Qwen-7B-Chat");
    assert!(used(&hf, "trust_remote_code"));
    let trl = read_text(
        "sft.yaml",
        "model_name_or_path: THUDM/chatglm3-6b\nmodel_init_kwargs:\n  trust_remote_code: true\n",
        Path::new("."),
        None,
    )
    .unwrap();
    assert_eq!(trl.model.as_ref().unwrap().0, "hf-code:THUDM/chatglm3-6b");
    let axolotl = read_text(
        "a.yml",
        "base_model: baichuan-inc/Baichuan2-7B-Chat\nmicro_batch_size: 1\ntrust_remote_code: true\nsequence_len: 512\n",
        Path::new("."),
        None,
    )
    .unwrap();
    assert_eq!(
        axolotl.model.as_ref().unwrap().0,
        "hf-code:baichuan-inc/Baichuan2-7B-Chat"
    );
    let off = read_text(
        "args.json",
        r#"{"model_name_or_path": "gpt2", "trust_remote_code": false}"#,
        Path::new("."),
        None,
    )
    .unwrap();
    assert_eq!(off.model.as_ref().unwrap().0, "gpt2");
}
