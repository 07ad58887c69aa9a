//! The `gpumem` binary end to end: outputs, error paths and exit codes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

mod common;
use common::{bad_input, gpumem};

fn tmp(name: &str) -> PathBuf {
    common::scratch("cli-test", name)
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn write(name: &str, text: &str) -> PathBuf {
    let p = tmp(name);
    std::fs::write(&p, text).unwrap();
    p
}

const MLP: &str =
    "mlp:input=1024,output=10,depth=3,arch=pyramid,act=relu,dropout=0.2,batchnorm=true";

#[test]
fn estimate_on_the_embedded_default() {
    let o = gpumem(&["estimate"]);
    assert!(o.status.success());
    let s = stdout(&o);
    assert!(
        s.contains("peak") && s.contains("upper bound") && s.contains("context"),
        "{s}"
    );
}

#[test]
fn estimate_json_contract() {
    for est in ["replay", "live-tensors", "horus"] {
        let o = gpumem(&[
            "estimate",
            MLP,
            "--batch",
            "64",
            "--gpu",
            "h100-80gb-sxm",
            "--estimator",
            est,
            "--json",
        ]);
        assert!(o.status.success(), "{est}");
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        for key in [
            "peak_mib",
            "peak_bytes",
            "upper_bound_mib",
            "capacity_mib",
            "fits",
            "breakdown",
            "estimator",
            "gpu",
        ] {
            assert!(v.get(key).is_some(), "{est}: missing {key}");
        }
        assert_eq!(v["estimator"], est);
        assert_eq!(v["gpu"], "h100-80gb-sxm");
        assert!(v["upper_bound_bytes"].as_u64() >= v["peak_bytes"].as_u64());
    }
}

/// The breakdown is the allocated peak's: context + live categories + slack add up to what is
/// reserved then; `peak_at` says where it is; the reserved peak, where elsewhere, has its own.
#[test]
fn estimate_explains_its_peak() {
    let o = gpumem(&["estimate", MLP, "--batch", "64", "--json"]);
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let at = &v["peak_at"];
    assert!(
        ["forward", "backward", "optimizer"].contains(&at["phase"].as_str().unwrap()),
        "{at}"
    );
    assert!(
        at["op"].is_string() && at["iteration"].is_u64() && at["event"].is_u64(),
        "{at}"
    );
    let total: u64 = v["breakdown_bytes"]
        .as_object()
        .unwrap()
        .values()
        .map(|b| b.as_u64().unwrap())
        .sum();
    assert!(total <= v["peak_bytes"].as_u64().unwrap());
    if let Some(r) = v.get("reserved_peak") {
        let total: u64 = r["breakdown_bytes"]
            .as_object()
            .unwrap()
            .values()
            .map(|b| b.as_u64().unwrap())
            .sum();
        assert_eq!(
            total,
            v["peak_bytes"].as_u64().unwrap(),
            "at the reserved peak the breakdown is the whole peak"
        );
    } else {
        assert_eq!(total, v["peak_bytes"].as_u64().unwrap());
    }
    let text = stdout(&gpumem(&["estimate", MLP, "--batch", "64"]));
    assert!(
        text.contains("at the peak of allocated memory — "),
        "{text}"
    );
    let svg = tmp("timeline.svg");
    let o = gpumem(&[
        "estimate",
        MLP,
        "--batch",
        "64",
        "--timeline",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(
        drawn.starts_with("<svg") && drawn.contains("activation") && drawn.contains("reserved"),
        "{}",
        &drawn[..200.min(drawn.len())]
    );
    bad_input(
        &[
            "estimate",
            MLP,
            "--estimator",
            "horus",
            "--timeline",
            svg.to_str().unwrap(),
        ],
        "--timeline draws the replay",
    );
}

#[test]
fn estimate_reads_a_trace_file_written_by_trace() {
    let out = tmp("m.jsonl");
    let o = gpumem(&[
        "trace",
        MLP,
        "--batch",
        "32",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let from_file = gpumem(&["estimate", out.to_str().unwrap(), "--json"]);
    let native = gpumem(&["estimate", MLP, "--batch", "32", "--json"]);
    let a: serde_json::Value = serde_json::from_slice(&from_file.stdout).unwrap();
    let b: serde_json::Value = serde_json::from_slice(&native.stdout).unwrap();
    assert_eq!(a["peak_bytes"], b["peak_bytes"]);
}

#[test]
fn bad_inputs_exit_2_with_one_line() {
    bad_input(&["estimate", MLP, "--gpu", "b300"], "unknown GPU `b300`");
    bad_input(
        &["estimate", MLP, "--lora", "r=8,targets=q_proj"],
        "--optimizer-in-backward, --keep-grads, --compile and --strategy apply to PyTorch models",
    );
    bad_input(
        &["estimate", "hf:gpt2", "--lora", "r=0,targets=q_proj"],
        "--lora r=0,targets=q_proj: lora rank (r) must be at least 1",
    );
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--lora",
            "/nonexistent/adapter_config.json",
        ],
        "--lora /nonexistent/adapter_config.json:",
    );
    bad_input(
        &["estimate", "hf:gpt2", "--world-size", "4"],
        "--world-size needs --strategy",
    );
    bad_input(
        &["estimate", "hf:gpt2", "--liger=rope=maybe"],
        "--liger: `rope=maybe` is not KERNEL=true or KERNEL=false",
    );
    bad_input(
        &["estimate", "hf:gpt2", "--liger", "--chunked-ce", "8"],
        "liger (--liger) with its fused_linear_cross_entropy and chunked_ce (--chunked-ce) both replace the loss",
    );
    bad_input(&["estimate", MLP, "--liger"], "apply to PyTorch models");
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--strategy",
            "fsdp",
            "--world-size",
            "1",
        ],
        "world size (--world-size) 1 is out of range (2..=65536; 1..=65536 under ZeRO)",
    );
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--strategy",
            "ddp",
            "--world-size",
            "2",
            "--data-parallel",
            "2",
        ],
        "a job is data_parallel (--data-parallel) or has a strategy (--strategy), not both",
    );
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--optimizer-in-backward",
            "--grad-accum",
            "4",
        ],
        "optimizer_in_backward (--optimizer-in-backward) cannot go with gradient accumulation",
    );
    bad_input(
        &["estimate", "hf:gpt2", "--chunked-ce", "0"],
        "chunked_ce (--chunked-ce) 0 is out of range (1..=1024)",
    );
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--strategy",
            "hsdp",
            "--world-size",
            "8",
        ],
        "--strategy hsdp needs --nodes",
    );
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--strategy",
            "ddp",
            "--world-size",
            "4",
            "--tp",
            "2",
        ],
        "--tp, --pp and --cp compose with --strategy fsdp or hsdp, not ddp",
    );
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--strategy",
            "fsdp",
            "--world-size",
            "8",
            "--tp",
            "3",
        ],
        "--world-size 8 is not a multiple of --tp 3 × --pp 1",
    );
    bad_input(
        &["estimate", "hf:gpt2", "--world-size", "8", "--tp", "2"],
        "--tp, --pp or --cp with --world-size needs --strategy fsdp or hsdp",
    );
    bad_input(
        &["estimate", "hf:gpt2", "--tp", "2", "--fsdp-cpu-offload"],
        "strategy.cpu_offload is FSDP's, and this mesh has no ranks to shard over",
    );
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--strategy",
            "hsdp",
            "--world-size",
            "8",
            "--nodes",
            "3",
        ],
        "HSDP's replicas (--nodes) 3 must divide the world size (--world-size) 8 into groups of at least 2 ranks",
    );
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--strategy",
            "fsdp",
            "--world-size",
            "8",
            "--nodes",
            "2",
        ],
        "--nodes is for --strategy hsdp",
    );
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--strategy",
            "zero2",
            "--world-size",
            "8",
            "--fsdp-cpu-offload",
        ],
        "--fsdp-cpu-offload is for --strategy fsdp or hsdp",
    );
    bad_input(
        &[
            "plan",
            "hf:gpt2",
            "--gpus",
            "8xh100-80gb-sxm",
            "--fsdp-param-dtype",
            "bf16",
        ],
        "--fsdp-param-dtype is for --strategy fsdp or hsdp with --world-size",
    );
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--strategy",
            "zero2",
            "--world-size",
            "8",
            "--precision",
            "amp-fp16",
        ],
        "ZeRO trains fp16 in DeepSpeed's own fp16 mode",
    );
    bad_input(
        &["estimate", MLP, "--batch", "0"],
        "--batch 0 is out of range",
    );
    bad_input(
        &["estimate", MLP, "--batch", "-4"],
        "--batch -4 is out of range",
    );
    bad_input(&["estimate", MLP, "--batch", "99999999999"], "out of range");
    bad_input(
        &["estimate", "mlp:input=10,output=2,depth=1,act=swoosh"],
        "unknown activation `swoosh`",
    );
    bad_input(
        &["estimate", MLP, "--optimizer", "lion"],
        "unknown optimizer `lion`",
    );
    bad_input(
        &["estimate", MLP, "--precision", "fp8"],
        "unknown precision `fp8`",
    );
    bad_input(
        &["estimate", MLP, "--precision", "bf16"],
        "--precision bf16 (pure low precision) applies to PyTorch models",
    );
    bad_input(
        &["estimate", MLP, "--outputs", "kept"],
        "apply to PyTorch models",
    );
    bad_input(
        &["estimate", MLP, "--attention-mask", "padded"],
        "apply to PyTorch models",
    );
    bad_input(
        &["estimate", MLP, "--estimator", "oracle"],
        "unknown estimator `oracle`",
    );
    bad_input(&["estimate", "missing.jsonl"], "no such trace file");
    bad_input(&["max-batch", "nonsense"], "has no `family:` prefix");
}

#[test]
fn a_missing_python_is_exit_3_with_a_clear_message() {
    let o = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(["estimate", "timm:resnet50", "--batch", "2"])
        .env("GPUMEM_PYTHON", "/nonexistent/python3")
        .env("GPUMEM_CACHE", tmp("cache"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(
        err.contains("cannot run the Python interpreter `/nonexistent/python3`"),
        "{err}"
    );
    bad_input(
        &["estimate", MLP, "--input", "3x224x224"],
        "apply to PyTorch models",
    );
}

#[test]
fn bad_traces_exit_2_naming_the_line() {
    let header = r#"{"format":"gpumem-trace","version":1,"model":"t","batch_size":1,"optimizer":"adam","precision":"fp32","producer":"test","iterations":0}"#;
    let alloc =
        r#"{"ev":"alloc","id":1,"bytes":1024,"category":"activation","phase":"forward","op":"x"}"#;
    let cases = [
        (
            format!("{header}\n{{\"ev\":\"free\",\"id\":9}}\n"),
            "line 2: free of unknown id 9",
        ),
        (
            format!(
                "{header}\n{alloc}\n{{\"ev\":\"free\",\"id\":1}}\n{{\"ev\":\"free\",\"id\":1}}\n"
            ),
            "line 4: double free of id 1",
        ),
        (
            format!("{header}\n{}\n", alloc.replace("1024", "-1")),
            "line 2: field bytes: negative size -1",
        ),
        (
            format!(
                "{header}\n{}\n",
                alloc.replace("1024", "18446744073709551616")
            ),
            "line 2: field bytes",
        ),
        (format!("{header}\n{{\"ev\":\"alloc\",\"id\":"), "line 2:"),
        (
            header.replace("\"version\":1", "\"version\":7"),
            "line 1: field version",
        ),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let p = write(&format!("bad{i}.jsonl"), text);
        bad_input(&["estimate", p.to_str().unwrap()], needle);
    }
}

#[test]
fn bad_csvs_exit_2_naming_the_line() {
    let p = write(
        "bad1.csv",
        "model,batch_size,measured_mib\n\"mlp:input=8,output=2,depth=1\",abc,1500\n",
    );
    bad_input(
        &["eval", p.to_str().unwrap()],
        "line 2: column batch_size: `abc` is not a whole number",
    );
    let p = write("bad2.csv", "a,b\n1,2\n");
    bad_input(
        &[
            "calibrate",
            p.to_str().unwrap(),
            "--out",
            tmp("x.toml").to_str().unwrap(),
        ],
        "line 1: expected columns",
    );
    let p = write(
        "bad3.csv",
        "model,batch_size,measured_mib\n\"mlp:input=8,output=2,depth=1\",4\n",
    );
    bad_input(&["eval", p.to_str().unwrap()], "line 2:");
    bad_input(&["eval", "/nonexistent/data.csv"], "/nonexistent/data.csv");
    let p = write(
        "bad4.csv",
        "model,batch_size,measured_mib\n\"mlp:input=8,output=2,depth=1,act=nope\",4,1500\n",
    );
    bad_input(
        &["eval", p.to_str().unwrap()],
        "line 2: column model: unknown activation `nope`",
    );
}

#[test]
fn calibrate_then_use_the_profile() {
    let data = write(
        "cal.csv",
        "model,batch_size,measured_mib\n\"mlp:input=64,output=2,depth=1\",8,900\n\"mlp:input=64,output=2,depth=2\",8,902\n\"mlp:input=2048,output=100,depth=4,arch=uniform\",512,1200\n",
    );
    let out = tmp("cal.toml");
    let o = gpumem(&[
        "calibrate",
        data.to_str().unwrap(),
        "--gpu",
        "l4",
        "--rows",
        "smallest:2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout(&o).contains("fitted l4 on 2 rows (smallest:2)"));
    let e = gpumem(&[
        "estimate",
        "mlp:input=64,output=2,depth=1",
        "--batch",
        "8",
        "--profile",
        out.to_str().unwrap(),
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&e.stdout).unwrap();
    let peak = v["peak_mib"].as_f64().unwrap();
    assert!(
        (peak - 900.0).abs() <= 1.5,
        "calibrated estimate {peak} should reproduce the 900/902 MiB rows"
    );
    bad_input(
        &[
            "calibrate",
            data.to_str().unwrap(),
            "--rows",
            "biggest:3",
            "--out",
            out.to_str().unwrap(),
        ],
        "--rows biggest:3",
    );
    let badp = write("bad.toml", "[[gpu]]\nname = 1\n");
    bad_input(
        &["estimate", MLP, "--profile", badp.to_str().unwrap()],
        "bad profile",
    );
}

#[test]
fn max_batch_is_monotone_in_memory() {
    let run = |gpu: &str| -> u64 {
        let o = gpumem(&["max-batch", MLP, "--gpu", gpu, "--json"]);
        assert!(o.status.success());
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["max_batch"].as_u64().unwrap()
    };
    assert!(run("t4") < run("a100-80gb"));
}

#[test]
fn gpus_lists_the_catalogue() {
    let s = stdout(&gpumem(&["gpus"]));
    for n in [
        "a100-40gb",
        "h100-80gb-pcie",
        "h200",
        "v100-32gb",
        "t4",
        "l4",
        "a10",
        "l40s",
        "rtx3090",
        "rtx4090",
    ] {
        assert!(s.contains(n), "{n}");
    }
}

fn seed_data() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/gpumemnet_mlp_a100_40gb.csv");
    p.exists().then_some(p)
}

/// The core acceptance: calibrate on the 10 smallest models, then score all 3,000 seed rows.
#[test]
fn seed_mlp_accuracy() {
    let Some(data) = seed_data() else {
        eprintln!("SKIPPED: ../shared/data is not beside this checkout");
        return;
    };
    let profile = tmp("a100-cal.toml");
    let o = gpumem(&[
        "calibrate",
        data.to_str().unwrap(),
        "--gpu",
        "a100-40gb",
        "--rows",
        "smallest:10",
        "--out",
        profile.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    let o = gpumem(&[
        "eval",
        data.to_str().unwrap(),
        "--profile",
        profile.to_str().unwrap(),
        "--out-dir",
        tmp("eval").to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let replay = v["estimators"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["estimator"] == "replay")
        .unwrap();
    assert_eq!(replay["rows"], 3000);
    assert!(replay["median_ape"].as_f64().unwrap() <= 1.0, "{replay}");
    assert!(replay["p95_ape"].as_f64().unwrap() <= 4.0, "{replay}");
    assert!(replay["under_3pct"].as_f64().unwrap() <= 0.01, "{replay}");
    assert!(replay["bin_accuracy"].as_f64().unwrap() >= 0.99, "{replay}");
    for f in ["rows.csv", "scatter.svg", "scatter.png"] {
        assert!(tmp("eval").join(f).metadata().unwrap().len() > 100, "{f}");
    }
}

/// The seed's Transformer runs read directly: rows rebuilt from their file names, the
/// OOM_CRASH rows counted as "did not fit" checks.
#[test]
fn eval_reads_the_seeds_transformer_runs_and_their_out_of_memory_rows() {
    let Some(csv) = common::shared_data("gpumemnet_transformer_a100_dev.csv") else {
        return;
    };
    let out = common::scratch("cli", "eval-tf");
    let o = common::gpumem(&[
        "eval",
        csv.to_str().unwrap(),
        "--gpu",
        "a100-40gb",
        "--out-dir",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (
            v["rows"].as_u64(),
            v["did_not_fit"]["rows"].as_u64(),
            v["did_not_fit"]["bound_over"].as_u64()
        ),
        (Some(75), Some(5), Some(5))
    );
    let replay = &v["estimators"][0];
    assert!(replay["median_ape"].as_f64().unwrap() < 1.0, "{replay}");
}

/// A job too large for any GPU (a tensor over 1 PiB) is a one-line error, not a panic.
#[test]
fn a_job_too_large_for_any_gpu_is_a_one_line_error() {
    common::bad_input(
        &[
            "estimate",
            "cnn:classes=10,filters=2048,depth=1,input=4096",
            "--batch",
            "16777216",
        ],
        "does not fit on any GPU",
    );
}

/// eval with no row it can model fails (exit 3) instead of reporting an empty success.
#[test]
fn eval_with_no_modelled_row_fails() {
    let csv = common::scratch("cli", "unmodelled.csv");
    std::fs::write(&csv, "model,batch_size,measured_mib\nresnet50,32,3934\n").unwrap();
    let o = common::gpumem(&[
        "eval",
        csv.to_str().unwrap(),
        "--out-dir",
        common::scratch("cli", "eval-none").to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(3), "{err}");
    assert!(err.contains("no row could be modelled (line 2: `resnet50` is neither a native spec nor a PyTorch reference)"), "{err}");
}

/// A dense CNN without pool_every is ambiguous (the seed drew its transition interval at
/// random): both networks are sized, the larger answers, the JSON says so (issue 18 part 3).
#[test]
fn an_ambiguous_dense_spec_gives_the_larger_network() {
    let spec = "cnn:classes=10,filters=32,depth=60,input=224,arch=dense";
    let json = |spec: &str| -> serde_json::Value {
        let o = gpumem(&["estimate", spec, "--batch", "16", "--json"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let v = json(spec);
    let readings = v["ambiguity"]["readings"].as_array().unwrap();
    assert_eq!(readings.len(), 2);
    let peaks: Vec<f64> = readings
        .iter()
        .map(|r| r["peak_mib"].as_f64().unwrap())
        .collect();
    assert!(
        peaks[0] != peaks[1],
        "the two intervals make different networks here: {peaks:?}"
    );
    assert_eq!(v["peak_mib"].as_f64().unwrap(), peaks[0].max(peaks[1]));
    assert!(
        readings
            .iter()
            .all(|r| r["upper_bound_mib"].as_f64() <= v["upper_bound_mib"].as_f64())
    );
    for (n, r) in [("5", &readings[0]), ("0", &readings[1])] {
        let one = json(&format!("{spec},pool_every={n}"));
        assert!(
            one.get("ambiguity").is_none() && one["peak_mib"] == r["peak_mib"],
            "pool_every={n}: {one}"
        );
    }
}

/// `gpumem ray-resources`: per GPU type, the num_gpus share and gpu_memory_mib resource of the
/// upper bound; a GPU too small says so (issue 17 part 4).
#[test]
fn ray_resources_come_from_the_upper_bound() {
    let o = gpumem(&[
        "ray-resources",
        "mlp:input=4096,output=10,depth=4",
        "--batch",
        "256",
        "--gpus",
        "a100-40gb,t4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let gpus = v["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 2);
    for g in gpus {
        let (bound, capacity) = (
            g["upper_bound_mib"].as_f64().unwrap(),
            g["capacity_mib"].as_f64().unwrap(),
        );
        let share = g["num_gpus"].as_f64().unwrap();
        assert!(
            share * capacity >= bound && (share - 0.01) * capacity < bound,
            "{g}"
        );
        assert_eq!(g["gpu_memory_mib"].as_f64().unwrap(), bound.ceil());
        let e = gpumem(&[
            "estimate",
            "mlp:input=4096,output=10,depth=4",
            "--batch",
            "256",
            "--gpu",
            g["gpu"].as_str().unwrap(),
            "--json",
        ]);
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&e.stdout).unwrap()["upper_bound_mib"]
                .as_f64(),
            Some(bound)
        );
    }
    let o = gpumem(&[
        "ray-resources",
        "cnn:classes=10,filters=32,depth=60,input=224,arch=dense",
        "--batch",
        "16",
        "--gpus",
        "t4",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        v["gpus"][0]["fits"] == false && v["gpus"][0].get("num_gpus").is_none(),
        "{v}"
    );
    bad_input(
        &[
            "ray-resources",
            "mlp:input=8,output=2,depth=1",
            "--gpus",
            "b300",
        ],
        "unknown GPU `b300`",
    );
}

/// `gpumem plan`: every setup it lists fits with its upper bound and makes up the global batch,
/// fastest first; what does not fit is listed apart; bad arguments are one-line errors.
#[test]
fn plan_lists_setups_that_fit_fastest_first() {
    let o = gpumem(&[
        "plan",
        "mlp:input=4096,output=10,depth=6,arch=uniform",
        "--gpu",
        "t4",
        "--global-batch",
        "8192",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let capacity = v["capacity_mib"].as_f64().unwrap();
    let setups = v["setups"].as_array().unwrap();
    assert!(!setups.is_empty());
    for s in setups {
        assert!(s["upper_bound_mib"].as_f64().unwrap() <= capacity, "{s}");
        assert_eq!(
            s["micro_batch"].as_u64().unwrap() * s["grad_accum"].as_u64().unwrap(),
            8192
        );
    }
    let rate = |s: &serde_json::Value| s["samples_per_s"].as_f64().unwrap();
    assert!(
        setups[1..].windows(2).all(|w| rate(&w[0]) >= rate(&w[1])),
        "fastest first after the leader"
    );
    assert!(
        rate(&setups[0]) >= rate(&setups[1]) * 0.99,
        "the leader is within 1% of the fastest"
    );
    assert_eq!(
        setups[0]["precision"], "amp-fp16",
        "a T4 has no bf16; fp16 tensor cores beat fp32"
    );
    let o = gpumem(&[
        "plan",
        "mlp:input=4096,output=10,depth=6,arch=uniform",
        "--gpu",
        "t4",
    ]);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success()
            && text.contains("best: amp-fp16")
            && text.contains("why the others lose:")
            && text.contains("does not fit"),
        "{text}"
    );
    bad_input(
        &[
            "plan",
            "mlp:input=8,output=2,depth=1",
            "--precisions",
            "fp7",
        ],
        "--precisions: unknown precision",
    );
    bad_input(
        &[
            "plan",
            "mlp:input=8,output=2,depth=1",
            "--checkpointing",
            "maybe",
        ],
        "--checkpointing `maybe`",
    );
    bad_input(
        &[
            "plan",
            "mlp:input=8,output=2,depth=1",
            "--global-batch",
            "0",
        ],
        "--global-batch 0 must be a positive multiple of the world size (1)",
    );
    bad_input(
        &[
            "plan",
            "hf:gpt2",
            "--strategy",
            "ddp",
            "--world-size",
            "4",
            "--global-batch",
            "6",
        ],
        "--global-batch 6 must be a positive multiple of the world size (4)",
    );
    bad_input(
        &[
            "plan",
            "hf:gpt2",
            "--gpus",
            "8xh100-80gb-sxm",
            "--global-batch",
            "12",
        ],
        "--global-batch 12 must be a positive multiple of the world size (8)",
    );
    bad_input(
        &[
            "plan",
            "hf:gpt2",
            "--gpus",
            "8xh100-80gb-sxm",
            "--strategies",
            "zero4",
        ],
        "--strategies: `zero4` is not ddp, fsdp, zero1, zero2 or zero3",
    );
    bad_input(
        &["plan", "hf:gpt2", "--gpus", "eight"],
        "--gpus `eight` is not COUNTxGPU",
    );
    bad_input(
        &[
            "plan",
            "hf:gpt2",
            "--gpus",
            "2xh100-80gb-sxm",
            "--bus-gbs",
            "0",
        ],
        "--bus-gbs 0 must be a positive number",
    );
    bad_input(
        &[
            "plan",
            "mlp:input=8,output=2,depth=1",
            "--gpus",
            "2xh100-80gb-sxm",
        ],
        "--gpus plans multi-GPU strategies, which apply to PyTorch models",
    );
}

/// `gpumem plan --gpus 4xGPU`: strategies are a dimension of the search; every listed setup's
/// upper bound (a rank's) is below one GPU's capacity, the micro-batches make up each rank's
/// share of the global batch, and the collectives' time is part of each setup's step.
#[test]
fn plan_searches_strategies_over_the_gpus() {
    if !common::torch("planning strategies") {
        return;
    }
    let o = gpumem(&[
        "plan",
        "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)",
        "--seq-len",
        "64",
        "--gpus",
        "4xh100-80gb-sxm",
        "--strategies",
        "ddp,zero2",
        "--precisions",
        "bf16",
        "--checkpointing",
        "off",
        "--global-batch",
        "32",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (v["world_size"].as_u64(), v["bus_gbs"].as_f64()),
        (Some(4), Some(360.0))
    );
    let capacity = v["capacity_mib"].as_f64().unwrap();
    let setups = v["setups"].as_array().unwrap();
    for name in ["ddp", "zero2"] {
        assert!(
            setups.iter().any(|s| s["strategy"] == name),
            "{name} planned: {v}"
        );
    }
    for s in setups {
        assert!(s["upper_bound_mib"].as_f64().unwrap() <= capacity, "{s}");
        assert_eq!(s["world_size"], 4);
        assert_eq!(
            s["micro_batch"].as_u64().unwrap() * s["grad_accum"].as_u64().unwrap(),
            8,
            "a rank's share of 32"
        );
        assert!(
            s["comm_s"].as_f64().unwrap() > 0.0
                && s["comm_s"].as_f64().unwrap() < s["step_s"].as_f64().unwrap(),
            "{s}"
        );
    }
}

/// `plan --gpus` searches FSDP over meshes of tensor and pipeline parallelism: each mesh's
/// setups share a rank's batch as its data-parallel ranks do, a pipeline's micro-batches are
/// whole multiples of its micro-batch count, and every setup's bound is its worst rank's (a
/// pipeline's worst stage, as `estimate` sizes it). Without listed degrees, a model that data
/// parallelism already fits traces no mesh.
#[test]
fn plan_searches_meshes_of_model_parallelism() {
    if !common::torch("planning meshes") {
        return;
    }
    let model = "hf:LlamaForCausalLM(hidden_size=256,intermediate_size=512,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=2,vocab_size=1000)";
    let plan = |more: &[&str]| {
        let mut args = vec![
            "plan",
            model,
            "--seq-len",
            "128",
            "--gpus",
            "4xh100-80gb-sxm",
            "--strategies",
            "fsdp",
            "--precisions",
            "amp-bf16",
            "--checkpointing",
            "off",
            "--global-batch",
            "16",
            "--json",
        ];
        args.extend(more);
        let o = gpumem(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let v = plan(&["--tp-degrees", "1,2", "--pp-degrees", "1,2"]);
    let capacity = v["capacity_mib"].as_f64().unwrap();
    let setups = v["setups"].as_array().unwrap();
    let mesh = |s: &serde_json::Value, dim: &str| s["mesh"][dim].as_u64().unwrap_or(1);
    for (tp, pp) in [(1, 1), (2, 1), (1, 2), (2, 2)] {
        assert!(
            setups
                .iter()
                .any(|s| mesh(s, "tensor") == tp && mesh(s, "pipeline") == pp),
            "tp {tp} × pp {pp}: {v}"
        );
    }
    for s in setups {
        assert!(s["upper_bound_mib"].as_f64().unwrap() <= capacity, "{s}");
        let share = 16 / mesh(s, "shard");
        let (micro, accum) = (
            s["micro_batch"].as_u64().unwrap(),
            s["grad_accum"].as_u64().unwrap(),
        );
        assert_eq!(micro * accum, share, "{s}");
        if mesh(s, "pipeline") == 2 {
            assert_eq!(s["pipeline"]["microbatches"], 2, "{s}");
            assert_eq!(micro % 2, 0, "{s}");
        }
    }
    // The pipeline's bound is its worst stage's, as estimate sizes the job.
    let staged = setups
        .iter()
        .find(|s| mesh(s, "pipeline") == 2 && mesh(s, "tensor") == 2)
        .unwrap();
    let batch = staged["micro_batch"].as_u64().unwrap().to_string();
    let o = gpumem(&[
        "estimate",
        model,
        "--batch",
        &batch,
        "--seq-len",
        "128",
        "--precision",
        "amp-bf16",
        "--gpu",
        "h100-80gb-sxm",
        "--tp",
        "2",
        "--pp",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let e: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(e["stages"].as_array().unwrap().len(), 2);
    assert_eq!(
        e["upper_bound_mib"], staged["upper_bound_mib"],
        "{e} {staged}"
    );
    // By default, meshes are searched only where data parallelism falls short: FSDP fits a
    // rank's whole share here, so none is traced.
    let v = plan(&[]);
    let all: Vec<&serde_json::Value> = ["setups", "too_big", "skipped"]
        .iter()
        .flat_map(|k| v[k].as_array().unwrap())
        .collect();
    assert!(
        all.iter()
            .all(|s| s["mesh"].get("tensor").is_none() && s["mesh"].get("pipeline").is_none()),
        "{v}"
    );
}

/// A pipeline fits only where each stage does: its first stage is traced alone first, and where
/// one micro-batch of it does not fit, the other stages are not traced (the setup is too big,
/// sized by that stage). 939 million fp32 parameters with AdamW's state on stage 0 of two: 15 GB,
/// over a T4, well within an H100 — where both stages are traced, twice the traces.
#[test]
fn plan_traces_a_pipelines_other_stages_only_where_its_first_fits() {
    if !common::torch("planning a pipeline") {
        return;
    }
    let traces = |gpu: &str| {
        let cache = tmp(&format!("pipeline-cache-{gpu}"));
        let _ = std::fs::remove_dir_all(&cache);
        let o = Command::new(env!("CARGO_BIN_EXE_gpumem"))
            .args([
                "plan",
                "hf:LlamaForCausalLM(hidden_size=4096,intermediate_size=11008,num_hidden_layers=8,num_attention_heads=32,num_key_value_heads=32,vocab_size=32000)",
                "--seq-len",
                "64",
                "--gpu",
                gpu,
                "--strategy",
                "fsdp",
                "--world-size",
                "2",
                "--pp",
                "2",
                "--precisions",
                "fp32",
                "--checkpointing",
                "off",
                "--global-batch",
                "2",
                "--json",
            ])
            .env("GPUMEM_CACHE", &cache)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let files = std::fs::read_dir(cache.join("traces"))
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .path()
                    .extension()
                    .is_some_and(|x| x == "jsonl")
            })
            .count();
        (v, files)
    };
    let (small, first_only) = traces("t4");
    assert!(small["setups"].as_array().unwrap().is_empty(), "{small}");
    assert_eq!(small["too_big"].as_array().unwrap().len(), 1, "{small}");
    let (large, both) = traces("h100-80gb-sxm");
    assert!(!large["setups"].as_array().unwrap().is_empty(), "{large}");
    assert!(
        first_only > 0 && both == 2 * first_only,
        "{first_only} {both}"
    );
}

/// A DDP or ZeRO-1 setup whose copy of the model states alone (DDP: parameters, gradients,
/// Adam's moments; ZeRO-1: parameters and gradients, and its partition of the fp32 master
/// weights and moments) exceeds a GPU is listed as not fitting without being traced; FSDP2 is
/// traced.
#[test]
fn plan_does_not_trace_setups_whose_model_states_cannot_fit() {
    if !common::torch("planning strategies") {
        return;
    }
    // 1.23 billion parameters on 16 GB T4s: DDP 19.7 GB, ZeRO-1 over two 17.2 GB.
    let o = gpumem(&[
        "plan",
        "hf:GPT2LMHeadModel(n_embd=2048,n_layer=24,n_head=16,vocab_size=8000)",
        "--seq-len",
        "64",
        "--gpus",
        "2xt4",
        "--strategies",
        "ddp,zero1,fsdp",
        "--precisions",
        "fp32",
        "--checkpointing",
        "on",
        "--global-batch",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    for strategy in ["ddp", "zero1"] {
        let of = |key: &str| {
            v[key]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| s["strategy"] == strategy)
                .cloned()
                .collect::<Vec<_>>()
        };
        assert!(of("setups").is_empty() && of("too_big").is_empty(), "{v}");
        let skipped = of("skipped");
        assert_eq!(skipped.len(), 1, "{v}");
        assert!(
            skipped[0]["reason"]
                .as_str()
                .unwrap()
                .contains("its model states alone do not fit: what every rank holds of the 1227."),
            "{v}"
        );
    }
    assert!(
        v["setups"]
            .as_array()
            .unwrap()
            .iter()
            .chain(v["too_big"].as_array().unwrap())
            .any(|s| s["strategy"] == "fsdp"),
        "FSDP traced and sized: {v}"
    );
}

/// `gpumem estimate --deepspeed CONFIG`: the config's ZeRO stage, bf16 and micro-batch make the
/// job (ranks from its train_batch_size), and the JSON shows DeepSpeed's own model-state
/// figure beside the estimate; a config gpumem cannot use is a one-line error naming the key.
/// `--accelerate` with a YAML naming that file is the same job.
#[test]
fn estimate_reads_a_deepspeed_config() {
    let config = common::scratch("cli", "ds_zero3.json");
    std::fs::write(
        &config,
        r#"{"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": true},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 1e5, "stage3_param_persistence_threshold": "auto"}}"#,
    )
    .unwrap();
    let config = config.to_str().unwrap();
    bad_input(
        &["estimate", "hf:gpt2", "--deepspeed", "/nonexistent/ds.json"],
        "--deepspeed /nonexistent/ds.json: ",
    );
    bad_input(
        &["estimate", "hf:gpt2", "--accelerate", "/nonexistent/a.yaml"],
        "--accelerate /nonexistent/a.yaml: ",
    );
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--deepspeed",
            config,
            "--world-size",
            "8",
        ],
        "--world-size 8 disagrees with the DeepSpeed config's train_batch_size, which makes 4 ranks",
    );
    let stage0 = common::scratch("cli", "ds_zero0.json");
    std::fs::write(&stage0, r#"{"zero_optimization": {"stage": 0}}"#).unwrap();
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--deepspeed",
            stage0.to_str().unwrap(),
            "--world-size",
            "2",
        ],
        "`zero_optimization.stage`: stage 0 is plain data parallelism",
    );
    if !common::torch("a DeepSpeed job") {
        return;
    }
    let o = gpumem(&[
        "estimate",
        "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)",
        "--seq-len",
        "16",
        "--deepspeed",
        config,
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["batch_size"], 2, "the config's micro-batch");
    let ds = &v["deepspeed"];
    assert_eq!(ds["formula"], "estimate_zero3_model_states_mem_needs");
    // 677,632 parameters, the largest layer the 512,000-element embedding, 4 ranks, no offload.
    assert_eq!(ds["gpu_bytes"], 4 * 512_000 + 18 * 677_632 / 4);
    assert!(
        v["peak_bytes"].as_u64().unwrap() > ds["gpu_bytes"].as_u64().unwrap(),
        "activations and buffers besides"
    );
    // accelerate's YAML naming the same DeepSpeed file (beside it): the same job.
    let yaml = common::scratch("cli", "accelerate.yaml");
    std::fs::write(&yaml, "compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds_zero3.json\nmixed_precision: bf16\nnum_processes: 4\n").unwrap();
    let yaml = yaml.to_str().unwrap();
    bad_input(
        &[
            "estimate",
            "hf:gpt2",
            "--accelerate",
            yaml,
            "--world-size",
            "2",
        ],
        "--world-size 2 disagrees with the accelerate config's num_processes (4)",
    );
    let o = gpumem(&[
        "estimate",
        "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=8000)",
        "--seq-len",
        "16",
        "--accelerate",
        yaml,
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let w: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        (&w["peak_bytes"], &w["deepspeed"]),
        (&v["peak_bytes"], &v["deepspeed"])
    );
}

#[test]
fn a_whole_run_reports_each_part_and_peaks_in_evaluation_when_logits_pile_up() {
    if !common::torch("sizing a whole run") {
        return;
    }
    let estimate = |extra: &[&str]| {
        let mut args = vec![
            "estimate",
            "hf:LlamaForCausalLM(hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,vocab_size=32000)",
            "--batch",
            "2",
            "--seq-len",
            "128",
            "--precision",
            "bf16",
            "--gpu",
            "a100-40gb",
            "--json",
        ];
        args.extend_from_slice(extra);
        let o = gpumem(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let part = |v: &serde_json::Value, name: &str| {
        v["phases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .cloned()
            .unwrap()
    };
    let step = estimate(&[]);
    assert!(step.get("phases").is_none(), "the step alone has no parts");
    let kept = estimate(&["--eval-batches", "12", "--eval-logits"]);
    let names: Vec<&str> = kept["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["load", "train", "evaluate"]);
    let evaluate = part(&kept, "evaluate");
    assert_eq!(evaluate["peak_bytes"], kept["peak_bytes"]);
    assert_eq!(kept["peak_at"]["run_phase"], "evaluate");
    assert!(
        part(&kept, "train")["peak_bytes"].as_u64() < evaluate["peak_bytes"].as_u64(),
        "twelve batches of 2×128×32000 bf16 logits outgrow the step"
    );
    let moved = estimate(&[
        "--eval-batches",
        "12",
        "--eval-logits",
        "--eval-accumulation-steps",
        "2",
    ]);
    assert!(
        part(&moved, "evaluate")["allocated_bytes"].as_u64() < evaluate["allocated_bytes"].as_u64()
    );
    // Resumed, the load reads AdamW's state (twice the bf16 weights) in beside the model.
    let load = |v: &serde_json::Value| part(v, "load")["allocated_bytes"].as_u64().unwrap();
    let fresh = estimate(&["--optimizer", "adamw", "--whole-run"]);
    let resumed = estimate(&["--optimizer", "adamw", "--resume"]);
    assert!(load(&resumed) >= 3 * load(&fresh) * 99 / 100, "{resumed}");
    // Generation after the steps: its own part, its key/value cache in it.
    let generated = estimate(&["--generate-tokens", "64", "--generate-batch-size", "4"]);
    assert!(part(&generated, "generate")["allocated_bytes"].as_u64() > Some(0));
    bad_input(
        &["estimate", "hf:gpt2", "--generate-tokens", "0"],
        "generation new_tokens (--generate-tokens) 0 is out of range",
    );
}

/// Tensor parallelism alone and composed with FSDP2 on one mesh (docs/parallelism.md): one
/// rank of PyTorch's own plans, traced; the JSON states the mesh; a rank of TP 2 holds less
/// than the one-GPU job, and FSDP over 2 of those less again.
#[test]
fn tensor_parallel_ranks_are_sized_on_one_mesh() {
    if !common::torch("tracing tensor-parallel ranks") {
        return;
    }
    // The weights dominate (a short sequence, a small vocabulary), so FSDP's gathered layer and
    // buffers are less than the half of a rank's states it saves.
    let model = "hf:LlamaForCausalLM(hidden_size=1024,intermediate_size=4096,num_hidden_layers=2,num_attention_heads=8,num_key_value_heads=4,vocab_size=1000)";
    let estimate = |extra: &[&str]| {
        let mut args = vec![
            "estimate",
            model,
            "--batch",
            "1",
            "--seq-len",
            "64",
            "--json",
        ];
        args.extend_from_slice(extra);
        let o = gpumem(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (v["peak_bytes"].as_u64().unwrap(), v["strategy"].clone())
    };
    let (one, none) = estimate(&[]);
    assert!(none.is_null());
    let (tp, s) = estimate(&["--tp", "2"]);
    assert_eq!(s["mesh"], serde_json::json!({"tensor": 2}));
    let (two_d, s) = estimate(&["--strategy", "fsdp", "--world-size", "4", "--tp", "2"]);
    assert_eq!(s["mesh"], serde_json::json!({"shard": 2, "tensor": 2}));
    assert!(two_d < tp && tp < one, "{two_d} {tp} {one}");
}

/// Pipeline stages (docs/parallelism.md): every stage's rank is traced and sized, the worst
/// answers; --json lists the stages worst first and states the schedule.
#[test]
fn every_pipeline_stage_is_sized_and_the_worst_answers() {
    if !common::torch("tracing pipeline stages") {
        return;
    }
    let model = "hf:LlamaForCausalLM(hidden_size=256,intermediate_size=512,num_hidden_layers=4,num_attention_heads=8,num_key_value_heads=4,vocab_size=32000)";
    let o = gpumem(&[
        "estimate",
        model,
        "--batch",
        "4",
        "--seq-len",
        "128",
        "--pp",
        "2",
        "--pp-schedule",
        "gpipe",
        "--microbatches",
        "4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let stages = v["stages"].as_array().unwrap();
    let peaks: Vec<u64> = stages
        .iter()
        .map(|s| s["peak_bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(stages.len(), 2);
    assert!(peaks[0] >= peaks[1] && v["peak_bytes"].as_u64() == Some(peaks[0]));
    // The last stage computes the 32,000-word logits: it is the worst.
    assert_eq!(stages[0]["stage"], 1);
    assert_eq!(v["strategy"]["schedule"], "gpipe");
    assert_eq!(v["strategy"]["microbatches"], 4);
    assert!(v.get("ambiguity").is_none());
    // The 3-D mesh torchtitan runs: stages of FSDP2 over tensor-parallel groups, a middle
    // stage (neither embedding nor head) among them.
    let o = gpumem(&[
        "estimate",
        model,
        "--batch",
        "4",
        "--seq-len",
        "128",
        "--strategy",
        "fsdp",
        "--world-size",
        "16",
        "--tp",
        "2",
        "--pp",
        "4",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["stages"].as_array().unwrap().len(), 4);
    assert_eq!(
        v["strategy"]["mesh"],
        serde_json::json!({"shard": 2, "tensor": 2, "pipeline": 4})
    );
    bad_input(
        &["estimate", model, "--pp", "2", "--pp-schedule", "zb"],
        "--pp-schedule `zb` is not gpipe, 1f1b, interleaved-1f1b or zero-bubble",
    );
    // max-batch: the least of the stages' largest batches, a multiple of the micro-batches.
    let on_t4 = |command: &str, batch: &[&str]| {
        let job = ["--seq-len", "128", "--pp", "2", "--microbatches", "2"];
        let mut args = vec![command, model, "--gpu", "t4", "--json"];
        args.extend(job.iter().chain(batch));
        let o = gpumem(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let best = on_t4("max-batch", &[])["max_batch"].as_u64().unwrap();
    assert!(best >= 2 && best.is_multiple_of(2), "{best}");
    let fits = |batch: u64| {
        on_t4("estimate", &["--batch", &batch.to_string()])["upper_bound_fits"]
            .as_bool()
            .unwrap()
    };
    assert!(fits(best) && !fits(best + 2), "{best}");
    bad_input(
        &[
            "estimate",
            model,
            "--pp",
            "2",
            "--tp",
            "2",
            "--pp-schedule",
            "zero-bubble",
        ],
        "with the zero-bubble schedule and tensor parallelism (--tp) is not sized yet",
    );
    bad_input(
        &["estimate", model, "--pp", "2", "--precision", "amp-fp16"],
        "pipeline parallelism (strategy.mesh.pipeline) with amp-fp16 (GradScaler) is not sized yet",
    );
}

/// `max-batch` and `plan` over a whole run: each batch tried is traced whole, so a run whose
/// evaluation keeps every batch's logits on the GPU answers a smaller batch than its step
/// alone; the answer fits with its bound and the next batch does not; `plan` lists only setups
/// whose whole run fits.
#[test]
fn max_batch_and_plan_size_the_whole_run_when_it_is_stated() {
    if !common::torch("searching a whole run's batch size") {
        return;
    }
    // A 1.5 GiB Ampere-class GPU: the search stops after a few small batches.
    let profile = write(
        "small-gpu.toml",
        "[[gpu]]\nname = \"small\"\ndisplay = \"small\"\ncompute_capability = \"8.0\"\ncapacity_mib = 1536\nsm_count = 40\ntflops = { fp32 = 8.1, tf32 = 8.1, fp16 = 65.0, bf16 = 65.0 }\nmemory_bandwidth_gbs = 320.0\npower_w = 70.0\nidle_power_w = 10.0\ncuda_context_mib = 400.0\n",
    );
    let profile = profile.to_str().unwrap();
    let model = "hf:LlamaForCausalLM(hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,vocab_size=32000)";
    let job = [
        "--seq-len",
        "128",
        "--precision",
        "bf16",
        "--profile",
        profile,
    ];
    let run = ["--eval-batches", "8", "--eval-logits"];
    let json = |args: &[&str]| {
        let o = gpumem(args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    let max_batch = |extra: &[&str]| {
        let mut args = vec!["max-batch", model, "--json"];
        args.extend_from_slice(&job);
        args.extend_from_slice(extra);
        json(&args)["max_batch"].as_u64().unwrap()
    };
    let (step, whole) = (max_batch(&[]), max_batch(&run));
    assert!(whole >= 1 && whole < step, "whole run {whole}, step {step}");
    let estimate = |batch: u64| {
        let b = batch.to_string();
        let mut args = vec!["estimate", model, "--batch", &b, "--json"];
        args.extend_from_slice(&job);
        args.extend_from_slice(&run);
        let v = json(&args);
        v["fits"].as_bool().unwrap()
            && v["upper_bound_mib"].as_f64().unwrap() <= v["capacity_mib"].as_f64().unwrap()
    };
    assert!(
        estimate(whole) && !estimate(whole + 1),
        "{whole} is the largest"
    );
    let mut args = vec![
        "plan",
        model,
        "--precisions",
        "bf16",
        "--checkpointing",
        "off",
        "--json",
    ];
    args.extend_from_slice(&job[..2]);
    args.extend_from_slice(&job[4..]);
    args.extend_from_slice(&run);
    let plan = json(&args);
    let micro: Vec<u64> = plan["setups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["micro_batch"].as_u64().unwrap())
        .collect();
    assert!(
        !micro.is_empty() && micro.iter().all(|&m| m <= whole),
        "{micro:?} against {whole}"
    );
    assert!(
        plan["too_big"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["micro_batch"].as_u64().unwrap() > whole),
        "{plan}"
    );
}

/// Images whose side varies by step (multi-scale training, `--input CxMIN..MAX`): a run of
/// square sizes drawn from the range, each a multiple of the stride, replayed through one
/// allocator, its bound covering any order of them.
#[test]
fn image_sides_that_vary_by_step_are_a_run() {
    for (input, needle) in [
        ("3x0..64", "--input `3x0..64`: the side's range is MIN..MAX"),
        (
            "3x96..64",
            "--input `3x96..64`: the side's range is MIN..MAX",
        ),
        ("x64..96", "--input `x64..96` is not CxHxW or CxMIN..MAX"),
        ("0x64..96", "--input `0x64..96` is not CxHxW or CxMIN..MAX"),
    ] {
        bad_input(
            &["estimate", "torchvision:resnet18", "--input", input],
            needle,
        );
    }
    bad_input(
        &[
            "estimate",
            "torchvision:resnet18",
            "--input",
            "3x64..96",
            "--whole-run",
        ],
        "image_sides (--input CxMIN..MAX) is not yet taken with it",
    );
    if !common::torch("an image run") {
        return;
    }
    let args = [
        "estimate",
        "torchvision:resnet18",
        "--batch",
        "4",
        "--input",
        "3x64..160",
        "--pad-to-multiple-of",
        "32",
        "--steps",
        "12",
        "--seed",
        "3",
    ];
    let o = gpumem(&[&args[..], &["--json"]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let run = &v["run"];
    assert_eq!(run["lengths"]["axis"], "image_side");
    assert_eq!(run["lengths"]["steps"], 12);
    let traced: Vec<u64> = run["traced_lengths"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_u64().unwrap())
        .collect();
    assert!(traced.len() > 1, "{traced:?}");
    assert!(
        traced
            .iter()
            .all(|&s| s % 32 == 0 && (64..=160).contains(&s)),
        "{traced:?}"
    );
    let bytes = |x: &serde_json::Value| x.as_u64().unwrap();
    assert!(bytes(&run["any_order"]["reserved_bytes"]) >= bytes(&run["reserved_bytes"]));
    assert!(bytes(&v["upper_bound_bytes"]) >= bytes(&run["any_order"]["reserved_bytes"]));
    // The largest side alone, as a fixed shape: one order of the run begins with it (its
    // first step makes the optimizer's state), which the bound covers.
    let largest = format!("3x{0}x{0}", traced[traced.len() - 1]);
    let o = gpumem(&[
        "estimate",
        "torchvision:resnet18",
        "--batch",
        "4",
        "--input",
        &largest,
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let fixed: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let reserved = bytes(&fixed["allocator"]["peak_reserved"]);
    assert!(bytes(&v["upper_bound_bytes"]) >= reserved, "{reserved}");
    let text = String::from_utf8(gpumem(&args).stdout).unwrap();
    assert!(
        text.contains("image sides  12 steps, "),
        "the text names what varies: {text}"
    );
}
