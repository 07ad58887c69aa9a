//! `--train-config`: trainer configs as jobs, through the binary. The sizing runs need torch
//! (GPUMEM_PYTHON); without it they report a skip, unless GPUMEM_TEST_REQUIRE_TORCH=1.

mod common;
use common::{bad_input, gpumem};

const DIR: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../docs/examples/train-configs"
);

fn torch() -> bool {
    match std::env::var("GPUMEM_PYTHON") {
        Ok(p) if !p.is_empty() => true,
        _ => {
            assert!(
                std::env::var("GPUMEM_TEST_REQUIRE_TORCH").as_deref() != Ok("1"),
                "GPUMEM_PYTHON is not set but torch is required"
            );
            eprintln!("SKIPPED: set GPUMEM_PYTHON to an interpreter with torch");
            false
        }
    }
}

#[test]
fn a_config_that_leaves_ranks_to_the_launcher_needs_world_size() {
    bad_input(
        &[
            "estimate",
            "--train-config",
            &format!("{DIR}/torchtitan-llama3_8b.toml"),
        ],
        "`parallelism.data_parallel_shard_degree`: the ranks are the launcher's: give --world-size",
    );
    bad_input(
        &[
            "estimate",
            "--train-config",
            &format!("{DIR}/nonexistent.yaml"),
        ],
        "nonexistent.yaml: No such file",
    );
}

/// Each kind's example sized with a small stand-in of its model (the configs name Hub models),
/// its options mapped: the JSON carries every key's fate and the overrides.
#[test]
fn example_configs_are_sized_with_a_stand_in_model() {
    if !torch() {
        return;
    }
    let stand_in = "hf:LlamaForCausalLM(hidden_size=128,intermediate_size=256,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,vocab_size=1024)";
    for (file, extra) in [
        ("hf-trainer-run_clm.json", vec![]),
        ("trl-sft-zephyr-qlora.yaml", vec!["--seq-len", "256"]),
        ("axolotl-qlora-1b.yml", vec!["--seq-len", "256"]),
        (
            "torchtune-8B_lora_single_device.yaml",
            vec!["--seq-len", "256"],
        ),
        (
            "torchtitan-llama3_8b.toml",
            vec!["--world-size", "2", "--seq-len", "256"],
        ),
        ("lightning-cli.yaml", vec![]),
    ] {
        let path = format!("{DIR}/{file}");
        let mut args = vec!["estimate", stand_in, "--train-config", &path, "--json"];
        args.extend(extra);
        let o = gpumem(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{file}: {err}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert!(v["peak_bytes"].as_u64().unwrap() > 0, "{file}");
        let tc = &v["train_config"];
        assert!(!tc["used"].as_array().unwrap().is_empty(), "{file}");
        assert!(
            tc["overrides"]
                .as_array()
                .unwrap()
                .iter()
                .any(|o| o.as_str().unwrap().starts_with("MODEL ")),
            "{file}: {tc}"
        );
    }
}

/// torchtune's `compile: True` compiles its chunked cross-entropy: read from the config, carried
/// to the tracer, and sized below the same config eager (no slice's fp32 log-probabilities);
/// the model's compiled layers stated as not modelled.
#[test]
fn a_torchtune_config_that_compiles_sizes_its_compiled_loss() {
    if !torch() {
        return;
    }
    let stand_in = "hf:LlamaForCausalLM(hidden_size=128,intermediate_size=256,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,vocab_size=32000)";
    let text = std::fs::read_to_string(format!("{DIR}/torchtune-8B_lora_single_device.yaml"))
        .unwrap()
        .replace("compile: False", "compile: True");
    assert!(text.contains("compile: True"), "the fixture states compile");
    let compiled = common::scratch("train-config-compile", "compiled.yaml");
    std::fs::write(&compiled, text).unwrap();
    let sized = |path: &str| {
        let o = gpumem(&[
            "estimate",
            stand_in,
            "--train-config",
            path,
            "--seq-len",
            "512",
            "--json",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let eager = sized(&format!("{DIR}/torchtune-8B_lora_single_device.yaml"));
    let v = sized(compiled.to_str().unwrap());
    let peak = |v: &serde_json::Value| v["allocator"]["peak_allocated"].as_u64().unwrap();
    // Batch 2 x 512 tokens, 8 slices: one slice's fp32 log-probabilities, 8 MiB, and more.
    assert!(
        peak(&v) + (2 * 512 / 8 * 32000 * 4) <= peak(&eager),
        "{} vs {}",
        peak(&v),
        peak(&eager)
    );
    let not_modelled = v["train_config"]["not_modelled"].to_string();
    assert!(
        not_modelled.contains("compile"),
        "the compiled layers are stated: {not_modelled}"
    );
}
