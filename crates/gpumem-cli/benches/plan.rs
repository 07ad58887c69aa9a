//! `gpumem plan` end to end for a Llama-7B shape on 8 × H100 and on 4 × A100-40GB (FSDP2 and
//! ZeRO-3, bf16, checkpointing on, global batch 64): a new process per plan, as a user runs it.
//! The first plan of each traces the model (one batch-symbolic trace per strategy, side by
//! side, in forks of one tracer pool) into a fresh cache, timed once and printed as the cold
//! time; the benchmark then times the plan with those traces cached. The target, ≤ 10 s, is
//! for both. `GPUMEM_PYTHON` with torch and transformers; without them the benchmark says so
//! and measures nothing.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

use divan::Bencher;

const LLAMA_7B: &str = "hf:LlamaForCausalLM(hidden_size=4096,intermediate_size=11008,num_hidden_layers=32,num_attention_heads=32,num_key_value_heads=32,vocab_size=32000)";
const CLUSTERS: [&str; 2] = ["8xh100-80gb-sxm", "4xa100-40gb"];

fn main() {
    divan::main();
}

fn cache() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("plan-cache")
}

fn plan(gpus: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpumem"));
    c.args([
        "plan",
        LLAMA_7B,
        "--seq-len",
        "2048",
        "--gpus",
        gpus,
        "--strategies",
        "fsdp,zero3",
        "--precisions",
        "bf16",
        "--checkpointing",
        "on",
        "--global-batch",
        "64",
        "--json",
    ])
    .env("GPUMEM_CACHE", cache());
    c
}

/// Plans each cluster once into a fresh cache (printing the cold time); false if that failed
/// (no torch).
fn prepared() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        let _ = std::fs::remove_dir_all(cache());
        CLUSTERS.iter().all(|gpus| {
            let t = Instant::now();
            let out = plan(gpus).output().expect("gpumem runs");
            if !out.status.success() {
                eprintln!(
                    "plan: skipped, the first plan on {gpus} failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
                return false;
            }
            eprintln!(
                "plan: {gpus} cold (traces made): {:.1} s",
                t.elapsed().as_secs_f64()
            );
            true
        })
    })
}

#[divan::bench(args = CLUSTERS, sample_count = 10)]
fn plan_with_traces_cached(bencher: Bencher, gpus: &str) {
    if !prepared() {
        return;
    }
    bencher.bench_local(|| {
        let out = plan(gpus).output().expect("gpumem runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    });
}
