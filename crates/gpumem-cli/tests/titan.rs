//! torchtitan jobs through the whole estimate: torchtitan's own model (`torchtitan:llama3`)
//! under its activation checkpointing modes, traced in an interpreter with torchtitan
//! (GPUMEM_TITAN_PYTHON; scripts/test.sh makes it, with torchtitan 0.2.2 and torch 2.10.0).
//! Skipped without it unless GPUMEM_TEST_REQUIRE_TITAN=1 (CI), where its absence fails.
//! python/tests/test_titan.py holds the traced tensors to torchtitan's own policy op by op;
//! here the estimate must move with `selective_ac_option` as those tensors do.

mod common;

use std::process::Command;

use common::{bad_input, scratch};

const TITAN: &str = "torchtitan:llama3(flavor=debugmodel)";

fn titan_python() -> Option<String> {
    match std::env::var("GPUMEM_TITAN_PYTHON") {
        Ok(p) => Some(p),
        Err(_) => {
            assert!(
                std::env::var("GPUMEM_TEST_REQUIRE_TITAN").as_deref() != Ok("1"),
                "GPUMEM_TITAN_PYTHON is not set but torchtitan is required"
            );
            eprintln!(
                "SKIPPED: set GPUMEM_TITAN_PYTHON to an interpreter with torchtitan 0.2.2 to estimate torchtitan jobs"
            );
            None
        }
    }
}

/// gpumem's output for `args` in the torchtitan interpreter, its cache under `suite`; a
/// failure fails the test.
fn titan_gpumem(python: &str, suite: &str, args: &[&str]) -> String {
    let o = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(args)
        .env("GPUMEM_PYTHON", python)
        .env("GPUMEM_CACHE", scratch(suite, "cache"))
        .output()
        .expect("gpumem runs");
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// `gpumem estimate` of the debug model at 2 × 8,192 tokens in amp-bf16 (the context-parallel
/// tests' job), with `extra`.
fn long_sequence_estimate(python: &str, suite: &str, extra: &[&str]) -> String {
    let job = [
        "estimate",
        TITAN,
        "--batch",
        "2",
        "--seq-len",
        "8192",
        "--gpu",
        "h100-80gb-sxm",
        "--precision",
        "amp-bf16",
    ];
    titan_gpumem(python, suite, &[&job[..], extra].concat())
}

/// The estimate's peak and activations (bytes, MiB) for one checkpointing mode.
fn estimate(python: &str, mode: &str) -> (u64, f64) {
    let o = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args([
            "estimate",
            TITAN,
            "--batch",
            "2",
            "--seq-len",
            "1024",
            "--gpu",
            "h100-80gb-sxm",
            &format!("--checkpointing={mode}"),
            "--json",
        ])
        .env("GPUMEM_PYTHON", python)
        .env("GPUMEM_CACHE", scratch("titan", "cache"))
        .output()
        .expect("gpumem runs");
    assert!(
        o.status.success(),
        "{mode}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    (
        v["peak_bytes"].as_u64().unwrap(),
        v["breakdown"]["activations_mib"].as_f64().unwrap(),
    )
}

/// torchtitan's modes order as the tensors they keep: full keeps least, no checkpointing most;
/// op-level and every-second-layer lie between and differ (on debugmodel, seq 1024: the op
/// policy keeps 4 of 7 matmul outputs and attention's in every block, the layer policy
/// everything in every other block — more).
#[test]
fn the_estimate_moves_with_selective_ac_option() {
    let Some(python) = titan_python() else {
        return;
    };
    let [off, full, op, layer2] =
        ["off", "full", "selective-op", "selective-layer:2"].map(|m| estimate(&python, m));
    assert!(full.0 < op.0 && op.0 < off.0, "{full:?} {op:?} {off:?}");
    assert!(
        full.0 < layer2.0 && layer2.0 < off.0,
        "{full:?} {layer2:?} {off:?}"
    );
    assert!(op.0 < layer2.0, "op {op:?} against layer:2 {layer2:?}");
    // gpumem's own selective policy saves every matmul: more than torchtitan's op policy.
    let gpumem_selective = estimate(&python, "selective");
    assert!(op.0 < gpumem_selective.0, "{op:?} {gpumem_selective:?}");
}

/// Without torchtitan installed, a torchtitan model is refused in one line that says so.
#[test]
fn a_torchtitan_model_without_torchtitan_says_to_install_it() {
    if !common::torch("a torchtitan model without torchtitan") {
        return;
    }
    let python = std::env::var("GPUMEM_PYTHON").unwrap();
    let has_titan = Command::new(&python)
        .args(["-c", "import torchtitan"])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if has_titan {
        eprintln!("SKIPPED: GPUMEM_PYTHON has torchtitan");
        return;
    }
    bad_input(
        &["estimate", TITAN, "--batch", "2", "--seq-len", "64"],
        "pip install torchtitan==0.2.2",
    );
}

#[test]
fn checkpointing_modes_are_checked_in_one_line() {
    bad_input(
        &[
            "estimate",
            "hf:GPT2LMHeadModel(n_layer=2)",
            "--checkpointing=selective-layer:0",
        ],
        "selective-layer:N",
    );
    bad_input(
        &[
            "estimate",
            "hf:GPT2LMHeadModel(n_layer=2)",
            "--checkpointing=selective-op",
            "--selective-checkpointing",
        ],
        "--selective-checkpointing",
    );
    bad_input(
        &[
            "estimate",
            "mlp:input=8,output=2,depth=1",
            "--checkpointing=selective-op",
        ],
        "PyTorch models",
    );
}

/// Expert parallelism on torchtitan's DeepSeek-V3 debug shape (8 experts, top-3): the estimate
/// routes tokens evenly, the bound is traced again at the stated imbalance and covers it, and
/// the rank's mesh says EP borrows FSDP's ranks (4 GPUs, not 16).
#[test]
fn an_expert_parallel_job_is_estimated_balanced_and_bounded_at_its_imbalance() {
    let Some(python) = titan_python() else {
        return;
    };
    let run = |extra: &[&str]| {
        let mut args = vec![
            "estimate",
            "torchtitan:deepseek_v3(flavor=debugmodel)",
            "--batch",
            "2",
            "--seq-len",
            "256",
            "--gpu",
            "h100-80gb-sxm",
            "--strategy",
            "fsdp",
            "--world-size",
            "4",
            "--ep",
            "4",
        ];
        args.extend_from_slice(extra);
        titan_gpumem(&python, "titan-ep", &args)
    };
    let balanced: serde_json::Value = serde_json::from_str(&run(&["--json"])).unwrap();
    assert_eq!(balanced["strategy"]["mesh"]["expert"], 4);
    assert!(balanced.get("routing").is_none(), "{balanced}");
    let bounded: serde_json::Value =
        serde_json::from_str(&run(&["--routing-imbalance", "2", "--json"])).unwrap();
    let routing = &bounded["routing"];
    assert_eq!(routing["imbalance"], 2.0);
    // The estimate is the balanced router's; the imbalanced rank peaks higher, under the bound.
    assert_eq!(bounded["peak_bytes"], balanced["peak_bytes"]);
    let (peak, imbalanced) = (
        bounded["peak_bytes"].as_u64().unwrap(),
        routing["peak_bytes"].as_u64().unwrap(),
    );
    assert!(imbalanced > peak, "{bounded}");
    assert!(
        bounded["upper_bound_bytes"].as_u64().unwrap()
            >= routing["upper_bound_bytes"].as_u64().unwrap()
    );
    assert!(
        bounded["upper_bound_bytes"].as_u64().unwrap()
            > balanced["upper_bound_bytes"].as_u64().unwrap()
    );
    let text = run(&["--routing-imbalance", "2"]);
    assert!(
        text.contains("fsdp: shard 4 = 4 GPUs, experts split over 4 of them"),
        "{text}"
    );
    assert!(text.contains("routing      at imbalance 2×"), "{text}");
}

/// Expert and context parallelism are FSDP's and torchtitan's: degrees the mesh cannot take, a
/// strategy they cannot compose with, an imbalance out of range, a pipeline or whole run with
/// context parallelism are refused in one line.
#[test]
fn expert_and_context_parallel_jobs_are_checked_in_one_line() {
    for (args, needle) in [
        (
            &["--strategy", "fsdp", "--world-size", "4", "--ep", "3"][..],
            "strategy.mesh.expert (--ep) 3 must divide the 4 shard × context × tensor ranks it borrows",
        ),
        (
            &["--strategy", "ddp", "--world-size", "4", "--ep", "2"][..],
            "--ep borrows the ranks of --strategy fsdp or hsdp, not ddp",
        ),
        (
            &[
                "--strategy",
                "fsdp",
                "--world-size",
                "4",
                "--ep",
                "2",
                "--routing-imbalance",
                "0.5",
            ][..],
            "--routing-imbalance) 0.5 is out of range",
        ),
        (
            &["--strategy", "ddp", "--world-size", "4", "--cp", "2"][..],
            "--tp, --pp and --cp compose with --strategy fsdp or hsdp, not ddp",
        ),
        (
            &["--cp", "2", "--whole-run"][..],
            "whole_run (--whole-run) with context parallelism (strategy.mesh.context) is not sized yet",
        ),
    ] {
        let mut all = vec!["estimate", "hf:LlamaForCausalLM(num_hidden_layers=2)"];
        all.extend_from_slice(args);
        bad_input(&all, needle);
    }
}

/// Context parallelism on torchtitan's Llama debug shape at 8,192 tokens: each rank's chunks
/// of the sequence (its activations fall with the ranks), FSDP over the CP ranks, on one mesh
/// with FSDP and tensor parallelism.
#[test]
fn a_context_parallel_rank_holds_its_chunks() {
    let Some(python) = titan_python() else {
        return;
    };
    let run = |extra: &[&str]| long_sequence_estimate(&python, "titan-cp", extra);
    let json = |extra: &[&str]| -> serde_json::Value {
        let mut all = extra.to_vec();
        all.push("--json");
        serde_json::from_str(&run(&all)).unwrap()
    };
    let activations = |v: &serde_json::Value| v["breakdown"]["activations_mib"].as_f64().unwrap();
    let one = json(&[]);
    let four = json(&["--cp", "4"]);
    assert_eq!(four["strategy"]["mesh"]["context"], 4);
    assert!(
        activations(&four) < activations(&one) / 3.0,
        "{} against {}",
        activations(&four),
        activations(&one)
    );
    assert!(four["peak_bytes"].as_u64() < one["peak_bytes"].as_u64());
    let text = run(&[
        "--strategy",
        "fsdp",
        "--world-size",
        "8",
        "--cp",
        "2",
        "--tp",
        "2",
    ]);
    assert!(
        text.contains("fsdp: shard 2 × tensor 2 × context 2 = 8 GPUs"),
        "{text}"
    );
    // Its largest batch: traced at each batch size tried (the input cut loops over the rows,
    // so no batch-symbolic trace), the bound within the GPU there.
    let largest: serde_json::Value = serde_json::from_str(&titan_gpumem(
        &python,
        "titan-cp",
        &[
            "max-batch",
            TITAN,
            "--seq-len",
            "8192",
            "--gpu",
            "l4",
            "--cp",
            "4",
            "--json",
        ],
    ))
    .unwrap();
    assert!(largest["max_batch"].as_u64().unwrap() >= 1, "{largest}");
    assert!(
        largest["upper_bound_mib"].as_f64().unwrap() <= largest["capacity_mib"].as_f64().unwrap()
    );
}

/// Pipeline stages of torchtitan's own model, cut as torchtitan cuts it: every stage sized, the
/// worst answering.
#[test]
fn a_torchtitan_models_pipeline_stages_are_each_sized() {
    let Some(python) = titan_python() else {
        return;
    };
    let out = titan_gpumem(
        &python,
        "titan-pp",
        &[
            "estimate",
            TITAN,
            "--batch",
            "4",
            "--seq-len",
            "512",
            "--gpu",
            "h100-80gb-sxm",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let stages = v["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 2, "{v}");
    assert_eq!(
        stages[0]["peak_bytes"], v["peak_bytes"],
        "the worst answers"
    );
}

/// Pipeline stages of context-parallel ranks: the batch cut to the rank's chunks of the
/// sequence before the schedule splits it into micro-batches (torchtitan's train step), so each
/// stage's activations fall with the context ranks, alone and on a 4-D mesh with FSDP and
/// tensor parallelism.
#[test]
fn a_pipeline_stage_of_context_parallel_ranks_holds_its_chunks() {
    let Some(python) = titan_python() else {
        return;
    };
    let run = |extra: &[&str]| -> serde_json::Value {
        let pipeline = [&["--pp", "2", "--microbatches", "2", "--json"], extra].concat();
        serde_json::from_str(&long_sequence_estimate(&python, "titan-pp-cp", &pipeline)).unwrap()
    };
    let activations = |v: &serde_json::Value| v["breakdown"]["activations_mib"].as_f64().unwrap();
    let alone = run(&[]);
    let halves = run(&["--cp", "2"]);
    assert_eq!(halves["stages"].as_array().unwrap().len(), 2, "{halves}");
    assert!(
        activations(&halves) < 0.6 * activations(&alone),
        "{} against {}",
        activations(&halves),
        activations(&alone)
    );
    let mesh = run(&[
        "--strategy",
        "fsdp",
        "--world-size",
        "16",
        "--cp",
        "2",
        "--tp",
        "2",
    ]);
    assert_eq!(mesh["strategy"]["mesh"]["context"], 2);
    assert_eq!(mesh["strategy"]["mesh"]["pipeline"], 2);
    assert!(activations(&mesh) < activations(&halves));
}

/// The largest batch of an expert-parallel job bounded at a router imbalance fits both
/// routings' bounds: no larger than the balanced one's, and its bound is the larger reading's.
#[test]
fn an_imbalanced_router_lowers_the_largest_batch() {
    let Some(python) = titan_python() else {
        return;
    };
    let largest = |extra: &[&str]| -> (u64, f64) {
        let mut args = vec![
            "max-batch",
            "torchtitan:deepseek_v3(flavor=debugmodel)",
            "--seq-len",
            "8192",
            "--gpu",
            "h100-80gb-sxm",
            "--strategy",
            "fsdp",
            "--world-size",
            "4",
            "--ep",
            "4",
            "--json",
        ];
        args.extend_from_slice(extra);
        let v: serde_json::Value =
            serde_json::from_str(&titan_gpumem(&python, "titan-ep-max", &args)).unwrap();
        (
            v["max_batch"].as_u64().unwrap(),
            v["upper_bound_mib"].as_f64().unwrap(),
        )
    };
    let (balanced, _) = largest(&[]);
    let (imbalanced, bound) = largest(&["--routing-imbalance", "4"]);
    assert!(imbalanced < balanced, "{imbalanced} against {balanced}");
    assert!(bound <= 81559.0, "{bound}");
}
