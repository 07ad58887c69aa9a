//! Models as people name them (issue 33, part 1): a Hub id read offline from a Hugging Face
//! cache laid out as `huggingface_hub` lays it out, a model directory and a config.json give the
//! estimate the `hf:` spelling of the same model gives. The cache holds the published
//! config.json files in data/hub-configs/ (see its README).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{scratch, torch};

/// The repository's published configs, `ORG/NAME` → their config.json.
fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/hub-configs")
}

/// A Hub cache holding each fixture at a snapshot `refs/main` points to.
fn hub_cache(suite: &str) -> PathBuf {
    let root = scratch(suite, "hub");
    for org in std::fs::read_dir(fixtures()).unwrap() {
        let org = org.unwrap().path();
        if !org.is_dir() {
            continue;
        }
        for name in std::fs::read_dir(&org).unwrap() {
            let name = name.unwrap().path();
            let repo = root.join(format!(
                "models--{}--{}",
                org.file_name().unwrap().to_str().unwrap(),
                name.file_name().unwrap().to_str().unwrap()
            ));
            let snapshot = repo.join("snapshots/0123456789abcdef0123456789abcdef01234567");
            std::fs::create_dir_all(&snapshot).unwrap();
            std::fs::create_dir_all(repo.join("refs")).unwrap();
            std::fs::write(
                repo.join("refs/main"),
                "0123456789abcdef0123456789abcdef01234567",
            )
            .unwrap();
            std::fs::copy(name.join("config.json"), snapshot.join("config.json")).unwrap();
        }
    }
    root
}

fn gpumem_in(cache: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(args)
        .env("HF_HUB_CACHE", cache)
        .output()
        .expect("gpumem runs")
}

/// `estimate --json` of `model` on an H200 (pure bf16, batch 1, 64 tokens): its peak and bound.
fn sized(cache: &Path, model: &str) -> (f64, f64, String) {
    let o = gpumem_in(
        cache,
        &[
            "estimate",
            model,
            "--batch",
            "1",
            "--seq-len",
            "64",
            "--precision",
            "bf16",
            "--gpu",
            "h200",
            "--json",
        ],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{model}: {err}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    (
        v["peak_mib"].as_f64().unwrap(),
        v["upper_bound_mib"].as_f64().unwrap(),
        v["model"].as_str().unwrap().to_string(),
    )
}

/// Each published model as a person spells it by hand: the class and the keys that shape it.
const SPELLED: [(&str, &str); 7] = [
    (
        "meta-llama/Llama-3.1-8B",
        r#"hf:LlamaForCausalLM(hidden_size=4096,intermediate_size=14336,num_hidden_layers=32,num_attention_heads=32,num_key_value_heads=8,vocab_size=128256,max_position_embeddings=131072,rope_theta=500000.0,rope_scaling={"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192})"#,
    ),
    (
        "Qwen/Qwen2.5-7B",
        "hf:Qwen2ForCausalLM(hidden_size=3584,intermediate_size=18944,num_hidden_layers=28,num_attention_heads=28,num_key_value_heads=4,vocab_size=152064,max_position_embeddings=131072,rope_theta=1000000.0,tie_word_embeddings=false)",
    ),
    (
        "mistralai/Mistral-7B-v0.3",
        "hf:MistralForCausalLM(hidden_size=4096,intermediate_size=14336,num_hidden_layers=32,num_attention_heads=32,num_key_value_heads=8,vocab_size=32768,max_position_embeddings=32768,rope_theta=1000000.0,sliding_window=null)",
    ),
    (
        "google/gemma-2-9b",
        "hf:Gemma2ForCausalLM(hidden_size=3584,intermediate_size=14336,num_hidden_layers=42,num_attention_heads=16,num_key_value_heads=8,head_dim=256,vocab_size=256000,query_pre_attn_scalar=256,sliding_window=4096,attn_logit_softcapping=50.0,final_logit_softcapping=30.0,pad_token_id=0)",
    ),
    (
        "mistralai/Mixtral-8x7B-v0.1",
        "hf:MixtralForCausalLM(hidden_size=4096,intermediate_size=14336,num_hidden_layers=32,num_attention_heads=32,num_key_value_heads=8,vocab_size=32000,num_local_experts=8,num_experts_per_tok=2,max_position_embeddings=32768,rope_theta=1000000.0)",
    ),
    (
        "Qwen/Qwen3-30B-A3B",
        "hf:Qwen3MoeForCausalLM(hidden_size=2048,intermediate_size=6144,moe_intermediate_size=768,num_hidden_layers=48,num_attention_heads=32,num_key_value_heads=4,head_dim=128,vocab_size=151936,num_experts=128,num_experts_per_tok=8,norm_topk_prob=true,max_position_embeddings=40960,rope_theta=1000000.0)",
    ),
    (
        "google/vit-base-patch16-224",
        "hf:ViTForImageClassification(hidden_size=768,num_hidden_layers=12,num_attention_heads=12,intermediate_size=3072,image_size=224,patch_size=16,num_labels=1000)",
    ),
];

#[test]
fn a_hub_id_a_directory_and_a_config_file_size_as_the_hf_spelling_does() {
    if !torch("the Hub intake test") {
        return;
    }
    let cache = hub_cache("hub-same");
    for (id, spelled) in SPELLED {
        let by_id = sized(&cache, id);
        let dir = fixtures().join(id);
        let by_dir = sized(&cache, dir.to_str().unwrap());
        let by_file = sized(&cache, dir.join("config.json").to_str().unwrap());
        // The same config, so the same reference (and the same cached trace).
        assert_eq!(by_id, by_dir, "{id}: directory");
        assert_eq!(by_id, by_file, "{id}: config.json");
        assert!(by_id.2.starts_with("hf:"), "{id}: {}", by_id.2);
        let by_hand = sized(&cache, spelled);
        assert_eq!(
            (by_id.0, by_id.1),
            (by_hand.0, by_hand.1),
            "{id} vs {spelled}"
        );
    }
}

#[test]
fn a_missing_model_or_a_config_without_an_architecture_is_one_line() {
    let cache = hub_cache("hub-errors");
    let one_line = |args: &[&str], needle: &str| {
        // Offline: the CLI's fetch of a missing config fails at once, as without a network.
        let o = Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args(args)
            .env("HF_HUB_CACHE", &cache)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .expect("gpumem runs");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: `{err}` lacks `{needle}`");
    };
    one_line(
        &["estimate", "no-such-org/no-such-model"],
        "`no-such-org/no-such-model` is not in the Hugging Face cache",
    );
    one_line(
        &["estimate", "meta-llama/Llama-3.1-8B@v9"],
        "is cached, but not at revision `v9`",
    );
    let bare = scratch("hub-errors", "bare.json");
    std::fs::write(&bare, r#"{"model_type": "llama", "hidden_size": 64}"#).unwrap();
    one_line(
        &["estimate", bare.to_str().unwrap()],
        "has no `architectures` entry",
    );
    let empty = scratch("hub-errors", "empty-dir");
    std::fs::create_dir_all(&empty).unwrap();
    one_line(&["estimate", empty.to_str().unwrap()], "has no config.json");
}

/// `hf-code:`: a checkpoint whose model is only in its own modeling files (the tracer's
/// fixture, cached as `org/tiny-remote`) is sized by that code under each of its names, one
/// reference for all; without the prefix its class is unknown to transformers, and a missing
/// modeling file is one line.
#[test]
fn a_checkpoints_own_code_sizes_under_any_of_its_names() {
    if !torch("the hf-code: test") {
        return;
    }
    let cache = scratch("hub-code", "hub");
    let snapshot = cache.join("models--org--tiny-remote/snapshots/0123456789abcdef");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(cache.join("models--org--tiny-remote/refs")).unwrap();
    std::fs::write(
        cache.join("models--org--tiny-remote/refs/main"),
        "0123456789abcdef",
    )
    .unwrap();
    let fixture =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../python/tests/fixtures/remote_code");
    for f in std::fs::read_dir(&fixture).unwrap() {
        let f = f.unwrap().path();
        if f.is_file() {
            std::fs::copy(&f, snapshot.join(f.file_name().unwrap())).unwrap();
        }
    }
    let by_id = sized(&cache, "hf-code:org/tiny-remote");
    let dir = std::fs::canonicalize(&snapshot).unwrap();
    assert_eq!(by_id.2, format!("hf-code:{}", dir.display()));
    assert!(by_id.0 > 0.0);
    let by_dir = sized(&cache, &format!("hf-code:{}", snapshot.display()));
    let by_file = sized(
        &cache,
        &format!("hf-code:{}", snapshot.join("config.json").display()),
    );
    assert_eq!(by_id, by_dir);
    assert_eq!(by_id, by_file);
    let plain = gpumem_in(&cache, &["estimate", "org/tiny-remote", "--batch", "1"]);
    let err = String::from_utf8_lossy(&plain.stderr);
    assert!(
        !plain.status.success() && err.contains("runs as hf-code:ORG/NAME"),
        "{err}"
    );
    std::fs::remove_file(snapshot.join("modeling_tiny_remote.py")).unwrap();
    let o = gpumem_in(&cache, &["estimate", "hf-code:org/tiny-remote"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("modeling_tiny_remote.py is missing"), "{err}");
}
