use super::*;
use crate::model::ModelRef;

/// Why a job document is refused.
fn refused(doc: &str) -> String {
    serde_json::from_str::<Options>(doc)
        .unwrap_err()
        .to_string()
}

#[test]
fn one_prefix_table() {
    assert_eq!(
        ModelRef::parse("hf:gpt2").unwrap(),
        ModelRef::Torch("hf:gpt2".into())
    );
    assert!(
        ModelRef::parse("mlp:input=8,output=2,depth=1")
            .unwrap()
            .is_native()
    );
    let e = ModelRef::parse("resnet50").unwrap_err().to_string();
    assert!(e.contains("no `family:` prefix"), "{e}");
    assert_eq!(ModelRef::recognise("resnet50").unwrap(), None);
    assert!(ModelRef::recognise("mlp:depth=x").is_err());
}

#[test]
fn options_in_json_are_spelled_as_on_the_command_line() {
    let o: Options = serde_json::from_str(r#"{"optimizer":"adamw","precision":"amp-bf16","input":"3x224x224","validate":"no-grad","outputs":"dropped"}"#).unwrap();
    assert_eq!(
        (o.optimizer, o.precision, o.validate, o.outputs),
        (
            Optimizer::ADAMW,
            Precision::AmpBf16,
            Validate::NoGrad,
            Some(Outputs::Dropped)
        )
    );
    assert_eq!(o.input.unwrap().to_string(), "3x224x224");
    assert_eq!(
        serde_json::from_str::<Options>(&serde_json::to_string(&o).unwrap()).unwrap(),
        o
    );
    let e = serde_json::from_str::<Options>(r#"{"validate":"maybe"}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown validation `maybe` (expected none, no-grad, grad)"),
        "{e}"
    );
    assert!(serde_json::from_str::<Options>(r#"{"optimiser":"sgd"}"#).is_err());
    assert!(InputShape::parse("3x0x4").is_none() && InputShape::parse("3x4").is_none());
}

#[test]
fn checks_and_native_options() {
    assert!(Options::default().native_compatible());
    let e = OptionValues {
        grad_accum: 0,
        ..OptionValues::default()
    }
    .check()
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "grad_accum (--grad-accum) must be at least 1"
    );
    // Deserializing runs the same check.
    let e = serde_json::from_str::<Options>(r#"{"grad_accum": 0}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("grad_accum (--grad-accum) must be at least 1"),
        "{e}"
    );
    let full = OptionValues {
        checkpointing: Checkpointing::Full,
        ..OptionValues::default()
    }
    .check()
    .unwrap();
    assert!(!full.native_compatible());
    let mlp = ModelRef::parse("mlp:input=8,output=2,depth=1").unwrap();
    assert!(full.check_native().is_err() && Options::default().check_native().is_ok());
    assert!(is_native_spec("mlp:input=8") && !is_native_spec("hf:gpt2") && mlp.is_native());
    // Stored jobs from before selective checkpointing read as they were written.
    for (stored, c) in [
        ("false", Checkpointing::Off),
        ("true", Checkpointing::Full),
        ("\"selective\"", Checkpointing::Selective),
        ("\"full-reentrant\"", Checkpointing::FullReentrant),
        ("\"selective-op\"", Checkpointing::SelectiveOp),
        ("\"selective-attention\"", Checkpointing::SelectiveAttention),
        (
            "\"selective-layer:3\"",
            Checkpointing::every_nth_layer(3).unwrap(),
        ),
    ] {
        let o: Options =
            serde_json::from_str(&format!(r#"{{"checkpointing": {stored}}}"#)).unwrap();
        assert_eq!(o.checkpointing, c);
        assert_eq!(
            serde_json::to_value(&o).unwrap()["checkpointing"].to_string(),
            stored
        );
    }
    // A layer frequency is at least 1, in digits; every other spelling is refused by name.
    for bad in [
        "selective-layer:0",
        "selective-layer:",
        "selective-layer:+2",
        "selective-layer:two",
        "selective-layer:99999999999",
        "Selective-op",
        "op",
    ] {
        let e = Checkpointing::parse(bad).unwrap_err().to_string();
        assert!(e.contains(bad) && e.contains("selective-layer:N"), "{e}");
    }
    assert_eq!(Checkpointing::every_nth_layer(0), None);
    for mode in [
        Checkpointing::Off,
        Checkpointing::Full,
        Checkpointing::FullReentrant,
        Checkpointing::Selective,
        Checkpointing::SelectiveOp,
        Checkpointing::SelectiveAttention,
        Checkpointing::every_nth_layer(1).unwrap(),
        Checkpointing::every_nth_layer(12).unwrap(),
    ] {
        assert_eq!(Checkpointing::parse(&mode.name()), Ok(mode));
        assert_eq!(mode.is_on(), mode != Checkpointing::Off);
    }
    assert!(
        serde_json::from_str::<Options>(r#"{"checkpointing": "half"}"#)
            .unwrap_err()
            .to_string()
            .contains("half")
    );
    let base = OptionValues {
        grad_accum: 2,
        ..OptionValues::default()
    }
    .check()
    .unwrap();
    let over = OptionOverrides {
        seq_len: Some(512),
        ..Default::default()
    }
    .over(&base)
    .unwrap();
    assert_eq!((over.seq_len, over.grad_accum), (Some(512), 2));
}

#[test]
fn a_strategy_is_a_mesh_checked_and_stated_as_json() {
    let ddp = |world_size, data_parallel| OptionValues {
        strategy: Some(Strategy::ddp(world_size, 25, false).unwrap()),
        data_parallel,
        ..OptionValues::default()
    };
    let eight = ddp(8, 1).check().unwrap();
    assert!(matches!(ddp(8, 2).check(), Err(OptionError::TwoWrappers)));
    assert!(matches!(
        Strategy::ddp(1, 25, false),
        Err(OptionError::WorldSize(1))
    ));
    // DeepSpeed runs ZeRO on one GPU (its offload, its partitioned optimizer); FSDP on one rank
    // is no strategy.
    assert_eq!(
        Strategy::zero(ZeroStage::Three, 1, Zero::default())
            .unwrap()
            .world_size(),
        1
    );
    assert!(matches!(
        Strategy::fsdp(1, 1, true, None, false),
        Err(OptionError::WorldSize(1))
    ));
    let json = serde_json::to_string(&eight).unwrap();
    assert!(
        json.contains(
            r#""strategy":{"kind":"ddp","mesh":{"replicate":8},"bucket_cap_mb":25,"bucket_view":false}"#
        ),
        "{json}"
    );
    assert_eq!(serde_json::from_str::<Options>(&json).unwrap(), eight);
    assert!(!eight.native_compatible());
    // The older spelling (a world size, and FSDP's replicas) still reads, as the same mesh.
    let old: Strategy = serde_json::from_str(
        r#"{"kind":"fsdp","world_size":8,"replicas":2,"reshard_after_forward":true}"#,
    )
    .unwrap();
    let new: Strategy =
        serde_json::from_str(r#"{"kind":"fsdp","mesh":{"replicate":2,"shard":4}}"#).unwrap();
    assert_eq!(old, new);
    // How FSDP accumulates: stated and written back where it shards; moot (held false) where
    // tensor parallelism alone takes the ranks.
    let synced: Strategy =
        serde_json::from_str(r#"{"kind":"fsdp","mesh":{"shard":4},"sync_each_batch":true}"#)
            .unwrap();
    assert!(
        serde_json::to_string(&synced)
            .unwrap()
            .contains(r#""sync_each_batch":true"#)
    );
    let moot: Strategy =
        serde_json::from_str(r#"{"kind":"fsdp","mesh":{"tensor":2},"sync_each_batch":true}"#)
            .unwrap();
    assert!(matches!(
        moot.engine(),
        Engine::Fsdp {
            sync_each_batch: false,
            ..
        }
    ));
    assert_eq!(
        (new.name(), new.world_size(), new.replicas()),
        ("hsdp", 8, 2)
    );
    // Tensor parallelism composes with FSDP on one mesh; alone it is FSDP's engine over no
    // shard ranks (torchtitan applies no FSDP at dp_shard 1).
    let two_d: Strategy =
        serde_json::from_str(r#"{"kind":"fsdp","mesh":{"shard":4,"tensor":2}}"#).unwrap();
    assert_eq!(
        (two_d.name(), two_d.world_size(), two_d.tensor_parallel()),
        ("fsdp", 8, 2)
    );
    let tp: Strategy = serde_json::from_str(r#"{"kind":"fsdp","mesh":{"tensor":4}}"#).unwrap();
    assert_eq!((tp.name(), tp.world_size()), ("tp", 4));
    let json = serde_json::to_string(&tp).unwrap();
    assert_eq!(
        serde_json::from_str::<Strategy>(&json).unwrap(),
        tp,
        "{json}"
    );
    // Pipeline stages: the schedule's settings, defaults where unstated (1F1B over as many
    // micro-batches as stages), written whole.
    let pp: Strategy =
        serde_json::from_str(r#"{"kind":"fsdp","mesh":{"pipeline":4,"tensor":2}}"#).unwrap();
    let p = pp.pipeline().unwrap();
    assert_eq!(
        (
            pp.name(),
            p.schedule(),
            p.microbatches(),
            p.virtual_stages()
        ),
        ("pp+tp", Schedule::OneForwardOneBackward, 4, 1)
    );
    let interleaved: Strategy = serde_json::from_str(
        r#"{"kind":"fsdp","mesh":{"shard":2,"pipeline":2},"schedule":"interleaved-1f1b","microbatches":8}"#,
    )
    .unwrap();
    assert_eq!(interleaved.pipeline().unwrap().virtual_stages(), 2);
    let json = serde_json::to_string(&interleaved).unwrap();
    assert!(
        json.contains(r#""schedule":"interleaved-1f1b","microbatches":8,"virtual_stages":2"#),
        "{json}"
    );
    assert_eq!(
        serde_json::from_str::<Strategy>(&json).unwrap(),
        interleaved
    );
    let e = serde_json::from_str::<Options>(
        r#"{"precision":"amp-fp16","strategy":{"kind":"fsdp","mesh":{"pipeline":2}}}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("pipeline parallelism (strategy.mesh.pipeline) with amp-fp16 (GradScaler) is not sized yet"),
        "{e}"
    );
    // Float8 linears in a pipeline stage: converted before the model is split, as torchtitan
    // converts, each stage's gathered in one byte (python/tests: the float8 test's stages).
    let f8 = serde_json::from_str::<Options>(
        r#"{"precision":"bf16","float8":{"recipe":"tensorwise","fsdp_all_gather":true},"strategy":{"kind":"fsdp","mesh":{"shard":2,"pipeline":2}}}"#,
    )
    .unwrap();
    assert!(
        f8.float8.is_some_and(|f| f.fsdp_all_gather)
            && f8.strategy.and_then(|s| s.pipeline()).is_some()
    );
    let e = serde_json::from_str::<Options>(
        r#"{"strategy":{"kind":"fsdp","mesh":{"tensor":2}},"whole_run":{"save":"sharded"}}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("with tensor parallelism"), "{e}");
    // Expert parallelism borrows its ranks from FSDP's and tensor parallelism's: it adds none,
    // and bounds the rank at the router imbalance stated (balanced, as the estimate, unless
    // stated; written only where stated).
    let ep: Strategy = serde_json::from_str(
        r#"{"kind":"fsdp","mesh":{"shard":4,"tensor":2,"expert":8},"routing_imbalance":1.5}"#,
    )
    .unwrap();
    assert_eq!(
        (
            ep.name(),
            ep.world_size(),
            ep.expert_parallel(),
            ep.routing_imbalance().map(|r| r.factor())
        ),
        ("fsdp", 8, 8, Some(1.5))
    );
    let json = serde_json::to_string(&ep).unwrap();
    assert!(json.contains(r#""routing_imbalance":1.5"#), "{json}");
    assert_eq!(serde_json::from_str::<Strategy>(&json).unwrap(), ep);
    let balanced: Strategy =
        serde_json::from_str(r#"{"kind":"fsdp","mesh":{"shard":4,"expert":2}}"#).unwrap();
    assert_eq!(
        balanced.routing_imbalance(),
        Some(RoutingImbalance::BALANCED)
    );
    assert!(
        !serde_json::to_string(&balanced)
            .unwrap()
            .contains("routing_imbalance")
    );
    // Context parallelism adds ranks, which FSDP shards over too; experts may borrow them.
    let cp: Strategy =
        serde_json::from_str(r#"{"kind":"fsdp","mesh":{"context":4,"expert":4}}"#).unwrap();
    assert_eq!(
        (cp.name(), cp.world_size(), cp.context_parallel()),
        ("fsdp", 4, 4)
    );
    // Pipeline stages of context-parallel ranks (torchtitan's 4-D meshes).
    let pp_cp: Options = serde_json::from_str(
        r#"{"strategy":{"kind":"fsdp","mesh":{"shard":2,"pipeline":2,"context":2}}}"#,
    )
    .unwrap();
    assert_eq!(pp_cp.strategy.map(|s| s.world_size()), Some(8));
    let zero: Strategy =
        serde_json::from_str(r#"{"kind":"zero","stage":3,"world_size":4,"zero":{}}"#).unwrap();
    assert_eq!(
        (zero.name(), zero.mesh().degree(MeshDim::Shard)),
        ("zero3", 4)
    );
    for (bad, needle) in [
        (
            r#"{"kind":"zero","stage":4,"world_size":4}"#,
            "ZeRO stage 4 is not 1, 2 or 3",
        ),
        (
            r#"{"kind":"zero","world_size":4}"#,
            "strategy.stage is required",
        ),
        (
            r#"{"kind":"ddp","mesh":{"replicate":4,"tensor":0}}"#,
            "strategy.mesh.tensor has degree 0",
        ),
        (
            r#"{"kind":"ddp","mesh":{"replicate":2,"tensor":2}}"#,
            "strategy.mesh.tensor: ddp",
        ),
        (
            r#"{"kind":"zero","stage":1,"mesh":{"shard":2,"tensor":2}}"#,
            "strategy.mesh.tensor: zero",
        ),
        (
            r#"{"kind":"fsdp","mesh":{"tensor":2},"cpu_offload":true}"#,
            "strategy.cpu_offload is FSDP's, and this mesh has no ranks to shard over",
        ),
        (
            r#"{"kind":"ddp","world_size":2,"sync_each_batch":false}"#,
            "sync_each_batch",
        ),
        (
            r#"{"kind":"zero","stage":3,"mesh":{"shard":2,"context":2}}"#,
            "strategy.mesh.context: zero",
        ),
        (
            r#"{"kind":"ddp","mesh":{"shard":4}}"#,
            "strategy.mesh.shard: ddp",
        ),
        (
            r#"{"kind":"zero","stage":1,"mesh":{"replicate":2,"shard":2}}"#,
            "strategy.mesh.replicate: zero",
        ),
        (
            r#"{"kind":"fsdp","world_size":4,"bucket_cap_mb":5}"#,
            "strategy.bucket_cap_mb is a ddp setting",
        ),
        (
            r#"{"kind":"fsdp","world_size":4,"replicas":4}"#,
            "groups of at least 2 ranks",
        ),
        (
            r#"{"kind":"fsdp","mesh":{"shard":4},"world_size":4}"#,
            "give one",
        ),
        (r#"{"kind":"ddp"}"#, "strategy needs a mesh"),
        (
            r#"{"kind":"zero","stage":2,"world_size":4,"zero":{"offload_param":true}}"#,
            "offload_param needs ZeRO stage 3",
        ),
        (
            r#"{"kind":"ddp","world_size":4,"bucket_cap_mb":0}"#,
            "bucket_cap_mb (--bucket-cap-mb) must be at least 1",
        ),
        (
            r#"{"kind":"fsdp","mesh":{"shard":2},"schedule":"gpipe"}"#,
            "strategy.schedule is a pipeline setting, and this mesh has no pipeline stages",
        ),
        (
            r#"{"kind":"fsdp","mesh":{"pipeline":2},"schedule":"gpipe","virtual_stages":2}"#,
            "gpipe holds exactly 1 chunk per rank",
        ),
        (
            r#"{"kind":"fsdp","mesh":{"pipeline":2},"schedule":"interleaved-1f1b","virtual_stages":1}"#,
            "interleaved-1f1b holds at least 2 chunks per rank",
        ),
        (
            r#"{"kind":"fsdp","mesh":{"pipeline":2},"microbatches":0}"#,
            "strategy.microbatches (--microbatches) 0 is out of range",
        ),
        (
            r#"{"kind":"ddp","mesh":{"replicate":2,"pipeline":2}}"#,
            "strategy.mesh.pipeline: ddp",
        ),
        (
            r#"{"kind":"fsdp","mesh":{"pipeline":2},"schedule":"zb"}"#,
            "unknown variant",
        ),
        (
            r#"{"kind":"fsdp","mesh":{"shard":4,"expert":3}}"#,
            "strategy.mesh.expert (--ep) 3 must divide the 4 shard × context × tensor ranks it borrows",
        ),
        (
            r#"{"kind":"ddp","mesh":{"replicate":4,"expert":2}}"#,
            "strategy.mesh.expert: ddp",
        ),
        (
            r#"{"kind":"fsdp","mesh":{"shard":4},"routing_imbalance":2}"#,
            "this mesh has no expert ranks (--ep)",
        ),
        (
            r#"{"kind":"fsdp","mesh":{"shard":4,"expert":2},"routing_imbalance":0.5}"#,
            "strategy.routing_imbalance (--routing-imbalance) 0.5 is out of range",
        ),
    ] {
        let e = serde_json::from_str::<Strategy>(bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{bad}: {e}");
    }
    let e = serde_json::from_str::<Options>(
        r#"{"precision":"amp-fp16","strategy":{"kind":"zero","stage":2,"world_size":4}}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("DeepSpeed's own fp16 mode"), "{e}");
}

#[test]
fn optimizers_are_read_as_trainers_name_them() {
    let p = |s: &str| Optimizer::parse(s).unwrap().name();
    // Every name gpumem writes reads back as itself.
    for o in Optimizer::all() {
        assert_eq!(Optimizer::parse(&o.name()).unwrap(), o);
    }
    assert_eq!(Optimizer::all().len(), 36);
    // Hugging Face Trainer's `optim` (its default on torch ≥ 2.8 is adamw_torch_fused).
    for (hf, ours) in [
        ("adamw_torch", "adamw"),
        ("adamw_torch_fused", "adamw-fused"),
        ("adafactor", "adafactor"),
        ("adamw_hf", "transformers-adamw"),
        ("adamw_bnb_8bit", "adamw8bit"),
        ("adamw_8bit", "adamw8bit"),
        ("paged_adamw_32bit", "paged-adamw32bit"),
        ("paged_adamw_8bit", "paged-adamw8bit"),
        ("lion_8bit", "lion8bit"),
        ("lion_32bit", "lion32bit"),
        ("paged_lion_8bit", "paged-lion8bit"),
        ("paged_lion_32bit", "paged-lion32bit"),
        ("adamw_torch_4bit", "torchao-adamw4bit"),
        ("adamw_torch_8bit", "torchao-adamw8bit"),
        ("sgd", "sgd"),
        ("adagrad", "adagrad"),
        ("rmsprop", "rmsprop"),
    ] {
        assert_eq!(p(hf), ours, "{hf}");
    }
    // Class paths (torchtune's `_component_`), bnb's alias, axolotl's names, any case.
    assert_eq!(p("torch.optim.AdamW"), "adamw");
    assert_eq!(p("bitsandbytes.optim.PagedAdamW8bit"), "paged-adamw8bit");
    assert_eq!(p("bnb.optim.PagedAdamW"), "paged-adamw32bit");
    assert_eq!(p("torchao.optim.AdamW8bit"), "torchao-adamw8bit");
    assert_eq!(p("torch.optim.Muon"), "muon");
    assert_eq!(p("torch.optim.Adafactor"), "torch-adafactor");
    assert_eq!(p("transformers.Adafactor"), "adafactor");
    assert_eq!(p("transformers.AdamW"), "transformers-adamw");
    assert_eq!(p("ao_adamw_fp8"), "torchao-adamw-fp8");
    assert_eq!(p(" ADAMW "), "adamw");
    // Older gpumem spellings.
    assert_eq!(p("sgd_momentum"), "sgd-momentum");
    assert_eq!(p("paged_adamw8bit"), "paged-adamw8bit");
    // A config's fused/foreach keys.
    let torchtune = Optimizer::parse("torch.optim.AdamW").unwrap();
    let fused = Implementation::from_flags(Some(true), None, Implementation::Foreach);
    assert_eq!(
        torchtune.with_implementation(fused).unwrap().name(),
        "adamw-fused"
    );
    let no_foreach = Implementation::from_flags(None, Some(false), Implementation::Foreach);
    assert_eq!(no_foreach, Implementation::ForLoop);
    assert_eq!(
        Optimizer::parse("adafactor")
            .unwrap()
            .with_implementation(Implementation::ForLoop)
            .unwrap()
            .name(),
        "adafactor"
    );
    assert_eq!(
        Optimizer::parse("torch-adafactor")
            .unwrap()
            .with_implementation(fused)
            .unwrap_err()
            .to_string(),
        "optimizer torch-adafactor has no fused implementation (torch has no fused kernel for it on CUDA)"
    );
    assert!(
        Optimizer::parse("paged-adamw8bit")
            .unwrap()
            .with_implementation(Implementation::ForLoop)
            .is_err()
    );
}

#[test]
fn an_optimizer_gpumem_does_not_model_is_named_with_what_it_takes() {
    let e = Optimizer::parse("lamb").unwrap_err().to_string();
    assert!(
        e.starts_with("unknown optimizer `lamb` (expected adam, adamw,"),
        "{e}"
    );
    assert!(
        e.contains("paged-adamw32bit") && e.contains("adamw_torch_fused"),
        "{e}"
    );
    assert!(!e.contains('\n'));
    let e = Optimizer::parse("galore_adamw").unwrap_err().to_string();
    assert!(e.contains("(gpumem does not model this one)"), "{e}");
    // In a job document too.
    let e = serde_json::from_str::<Options>(r#"{"optimizer":"lamb"}"#)
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown optimizer `lamb`"), "{e}");
    let o: Options = serde_json::from_str(r#"{"optimizer":"adamw_torch_fused"}"#).unwrap();
    assert_eq!(
        serde_json::to_value(&o).unwrap()["optimizer"],
        "adamw-fused",
        "written as gpumem names it"
    );
}

#[test]
fn zero_runs_only_its_own_optimizers() {
    let zero = Strategy::zero(ZeroStage::new(2).unwrap(), 4, Zero::default()).unwrap();
    let with = |name: &str| {
        OptionValues {
            optimizer: Optimizer::parse(name).unwrap(),
            strategy: Some(zero),
            ..OptionValues::default()
        }
        .check()
    };
    assert!(with("adamw-fused").is_ok());
    assert_eq!(
        with("adamw8bit").unwrap_err().to_string(),
        "optimizer adamw8bit cannot run under ZeRO, whose engine runs its own optimizer (adam, adamw, sgd or sgd-momentum)"
    );
}

#[test]
fn kept_gradients_are_stated_where_kept_and_refused_where_an_engine_owns_them() {
    let plain = serde_json::to_string(&Options::default()).unwrap();
    assert!(!plain.contains("keep_grads"), "{plain}");
    let o: Options = serde_json::from_str(r#"{"keep_grads":true}"#).unwrap();
    assert!(o.keep_grads && !o.native_compatible());
    assert!(
        serde_json::to_string(&o)
            .unwrap()
            .contains(r#""keep_grads":true"#)
    );
    assert_eq!(
        refused(r#"{"keep_grads":true,"optimizer_in_backward":true}"#),
        "keep_grads (--keep-grads) cannot go with optimizer_in_backward (it frees each gradient as it applies it)"
    );
    assert!(
        refused(
            r#"{"keep_grads":true,"optimizer":"adamw","strategy":{"kind":"zero","stage":2,"world_size":2}}"#
        )
        .contains("keep_grads (--keep-grads) cannot go with ZeRO"),
    );
    let fsdp: Options = serde_json::from_str(
        r#"{"keep_grads":true,"strategy":{"kind":"fsdp","mesh":{"shard":2}}}"#,
    )
    .unwrap();
    assert!(fsdp.keep_grads);
}

#[test]
fn the_attention_implementation_is_left_out_where_the_model_chooses() {
    let plain = serde_json::to_string(&Options::default()).unwrap();
    assert!(!plain.contains("attention\""), "{plain}");
    let o: Options = serde_json::from_str(r#"{"attention":"eager"}"#).unwrap();
    assert_eq!(o.attention, Some(Attention::Eager));
    assert!(
        serde_json::to_string(&o)
            .unwrap()
            .contains(r#""attention":"eager""#)
    );
    let e = serde_json::from_str::<Options>(r#"{"attention":"xformers"}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown attention `xformers` (expected sdpa, eager, flash)"),
        "{e}"
    );
    assert_eq!(
        Attention::from_hf("flash_attention_2"),
        Some(Attention::Flash)
    );
    assert_eq!(Attention::from_hf("flex_attention"), None);
}

#[test]
fn a_whole_run_is_stated_and_checked_as_the_job_document_spells_it() {
    let plain = serde_json::to_string(&Options::default()).unwrap();
    assert!(!plain.contains("whole_run"), "{plain}");
    let o: Options = serde_json::from_str(
        r#"{"whole_run":{"evaluation":{"batches":50,"batch_size":16,"accumulation_steps":10,"logits":true},"save":"full-offload"}}"#,
    )
    .unwrap();
    let run = o.whole_run.unwrap();
    assert_eq!(
        (run.evaluation.unwrap().batches, run.save),
        (50, Some(Save::FullOffload))
    );
    let back: Options = serde_json::from_str(&serde_json::to_string(&o).unwrap()).unwrap();
    assert_eq!(back, o);
    assert!(
        refused(r#"{"whole_run":{"evaluation":{"batches":0}}}"#)
            .contains("evaluation batches (--eval-batches) 0 is out of range")
    );
    assert!(
        refused(r#"{"whole_run":{"evaluation":{"batches":2,"accumulation_steps":0}}}"#)
            .contains("--eval-accumulation-steps")
    );
    assert!(
        refused(r#"{"whole_run":{"save":"everything"}}"#).contains("unknown save `everything`")
    );
    assert!(
        refused(r#"{"whole_run":{},"seq_lens":{"min":64,"max":512}}"#)
            .contains("one input shape; seq_lens (--seq-len MIN..MAX) is not yet taken")
    );
    let zero = r#"{"optimizer":"adamw","strategy":{"kind":"zero","mesh":{"shard":4},"stage":3},"whole_run":{"save":"full-offload"}}"#;
    assert!(refused(zero).contains("gathered module by module (--save full)"));
    for (spelled, save) in [("sharded", Save::Sharded), ("full", Save::Full)] {
        let zero_save: Options =
            serde_json::from_str(&zero.replace("full-offload", spelled)).unwrap();
        assert_eq!(zero_save.whole_run.unwrap().save, Some(save));
    }
    let resumed: Options = serde_json::from_str(r#"{"whole_run":{"resume":true}}"#).unwrap();
    assert!(resumed.whole_run.unwrap().resume);
    // DeepSpeed's load_checkpoint is sized too (python/tests: the ZeRO resume test).
    let zero_resume: Options =
        serde_json::from_str(&zero.replace(r#""save":"full-offload""#, r#""resume":true"#))
            .unwrap();
    assert!(zero_resume.whole_run.unwrap().resume);
    // A load broadcast from rank 0 is FSDP's.
    let broadcast = r#"{"whole_run":{"broadcast_load":true}"#;
    assert!(refused(&format!("{broadcast}}}")).contains("broadcast_load (--broadcast-load)"));
    let on_zero =
        format!(r#"{broadcast},"strategy":{{"kind":"zero","mesh":{{"shard":4}},"stage":2}}}}"#);
    assert!(refused(&on_zero).contains("FSDP's"));
    let fsdp: Options = serde_json::from_str(&format!(
        r#"{broadcast},"strategy":{{"kind":"fsdp","mesh":{{"shard":4}}}}}}"#
    ))
    .unwrap();
    assert!(fsdp.whole_run.unwrap().broadcast_load);
    let generating: Options =
        serde_json::from_str(r#"{"whole_run":{"generation":{"new_tokens":256,"batch_size":8}}}"#)
            .unwrap();
    let generation = generating.whole_run.unwrap().generation.unwrap();
    assert_eq!(
        (generation.new_tokens, generation.batch_size),
        (256, Some(8))
    );
    assert!(
        refused(r#"{"whole_run":{"generation":{"new_tokens":0}}}"#)
            .contains("generation new_tokens (--generate-tokens) 0 is out of range")
    );
    assert!(
        refused(r#"{"whole_run":{"generation":{"new_tokens":8,"batch_size":0}}}"#)
            .contains("--generate-batch-size")
    );
    assert!(
        refused(r#"{"whole_run":{"generation":{"new_tokens":8,"prompt_len":0}}}"#)
            .contains("--generate-prompt-len")
    );
}

#[test]
fn image_sides_vary_the_inputs_height_and_width_by_step() {
    let o: Options = serde_json::from_str(
        r#"{"input":"3x640x640","image_sides":{"min":320,"max":640,"pad_to":32,"steps":10,"seed":1}}"#,
    )
    .unwrap();
    let (schedule, axis) = o.step_sizes().unwrap();
    assert_eq!(axis, StepAxis::ImageSide);
    assert!(
        schedule
            .draw()
            .iter()
            .all(|s| s % 32 == 0 && (320..=640).contains(s))
    );
    let step = o.at_step(StepAxis::ImageSide, 416);
    assert_eq!(
        (step.input.unwrap().to_string(), step.image_sides.is_none()),
        ("3x416x416".to_string(), true)
    );
    let back: Options = serde_json::from_str(&serde_json::to_string(&o).unwrap()).unwrap();
    assert_eq!(back, o);
    assert!(refused(r#"{"image_sides":{"min":32,"max":64}}"#).contains("state input"));
    assert!(
        refused(
            r#"{"input":"3x64x64","image_sides":{"min":32,"max":64},"seq_lens":{"min":8,"max":16}}"#
        )
        .contains("seq_lens and image_sides both vary by step")
    );
    assert!(
        refused(r#"{"input":"3x64x64","image_sides":{"min":32,"max":64},"whole_run":{}}"#)
            .contains("image_sides (--input CxMIN..MAX) is not yet taken")
    );
}

#[test]
fn sequence_parallelism_is_a_tensor_parallel_setting() {
    let doc =
        r#"{"strategy":{"kind":"fsdp","mesh":{"shard":2,"tensor":2},"sequence_parallel":false}}"#;
    let o: Options = serde_json::from_str(doc).unwrap();
    let s = o.strategy.unwrap();
    assert_eq!(s.sequence_parallel(), Some(false));
    let back = serde_json::to_string(&o).unwrap();
    assert!(back.contains(r#""sequence_parallel":false"#), "{back}");
    assert_eq!(serde_json::from_str::<Options>(&back).unwrap(), o);
    // On by default, and then not written: older documents read and write as before.
    let on: Options =
        serde_json::from_str(r#"{"strategy":{"kind":"fsdp","mesh":{"shard":2,"tensor":2}}}"#)
            .unwrap();
    assert_eq!(on.strategy.unwrap().sequence_parallel(), Some(true));
    assert!(
        !serde_json::to_string(&on)
            .unwrap()
            .contains("sequence_parallel")
    );
    assert!(
        refused(r#"{"strategy":{"kind":"fsdp","mesh":{"shard":4},"sequence_parallel":false}}"#)
            .contains("applies to tensor parallelism")
    );
    assert!(
        refused(
            r#"{"strategy":{"kind":"fsdp","mesh":{"tensor":2,"pipeline":2},"sequence_parallel":false}}"#
        )
        .contains("not sized with pipeline stages")
    );
}

#[test]
fn a_compiled_loss_is_stated_where_compiled_and_refused_under_tensor_parallelism() {
    let plain = serde_json::to_string(&Options::default()).unwrap();
    assert!(!plain.contains("compile"), "{plain}");
    let o: Options = serde_json::from_str(r#"{"compile":true}"#).unwrap();
    assert!(o.compile && !o.native_compatible());
    assert!(
        serde_json::to_string(&o)
            .unwrap()
            .contains(r#""compile":true"#)
    );
    assert_eq!(
        refused(r#"{"compile":true,"strategy":{"kind":"fsdp","mesh":{"shard":2,"tensor":2}}}"#),
        "compile (--compile) cannot go with tensor parallelism (its loss runs on sharded DTensor logits)"
    );
    let fsdp: Options =
        serde_json::from_str(r#"{"compile":true,"strategy":{"kind":"fsdp","mesh":{"shard":2}}}"#)
            .unwrap();
    assert!(fsdp.compile);
}
