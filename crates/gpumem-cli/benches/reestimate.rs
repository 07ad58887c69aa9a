//! A second `gpumem estimate` of a PyTorch model at another batch size, end to end: a new
//! process that finds the model's batch-symbolic trace in the cache, evaluates it at the new
//! batch size and replays it (the target: ≤ 50 ms). The cache is filled once, before timing, by a
//! first estimate that runs the tracer (`GPUMEM_PYTHON` with torch and torchvision); without
//! torch the benchmark says so and measures nothing.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use divan::Bencher;

const MODELS: [&str; 2] = [
    "torchvision:resnet50",
    "hf:GPT2LMHeadModel(n_embd=768,n_layer=12,n_head=12)",
];

fn main() {
    divan::main();
}

fn cache() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("reestimate-cache")
}

fn estimate(model: &str, batch: u64) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpumem"));
    c.args([
        "estimate",
        model,
        "--batch",
        &batch.to_string(),
        "--gpu",
        "h200",
        "--json",
    ])
    .env("GPUMEM_CACHE", cache());
    if model.starts_with("hf:") {
        c.args(["--seq-len", "1024", "--optimizer", "adamw"]);
    }
    c
}

/// Fills the cache with each model's symbolic trace (one traced estimate each); false if the
/// interpreter has no torch.
fn prepared() -> bool {
    static READY: OnceLock<bool> = OnceLock::new();
    *READY.get_or_init(|| {
        MODELS.iter().all(|m| {
            let out = estimate(m, 32).output().expect("gpumem runs");
            if !out.status.success() {
                eprintln!(
                    "reestimate: skipped, the first estimate of {m} failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            out.status.success()
        })
    })
}

#[divan::bench(args = MODELS, sample_count = 20)]
fn second_estimate_at_another_batch(bencher: Bencher, model: &str) {
    if !prepared() {
        return;
    }
    let mut batch = 40;
    bencher.bench_local(|| {
        batch += 8; // a batch size no trace was taken at
        let out = estimate(model, batch).output().expect("gpumem runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    });
}
