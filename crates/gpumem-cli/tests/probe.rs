//! `gpumem probe` (importing a report measured on an H200) and `gpumem diff` against PyTorch's
//! own snapshot of the same job on that GPU (data/h200, from scripts/gpu/probe-h200.sh).
//! The diff and estimate runs trace real PyTorch models: they need GPUMEM_PYTHON (CI sets it
//! and GPUMEM_TEST_REQUIRE_TORCH=1); the rest runs everywhere.

use std::path::PathBuf;

mod common;
use common::{bad_input, gpumem};

fn data(file: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/h200")
        .join(file)
        .display()
        .to_string()
}

#[test]
fn a_probe_report_goes_into_a_profile_and_a_second_adds_to_it() {
    let out = common::scratch("probe", "h200.toml");
    let _ = std::fs::remove_file(&out);
    let o = gpumem(&[
        "probe",
        "--import",
        &data("probe-grid.json"),
        "--out",
        out.to_str().unwrap(),
        "--base",
        "h200",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let first = std::fs::read_to_string(&out).unwrap();
    let count = |t: &str| t.matches("[[gpu.conv_workspace]]").count();
    assert_eq!(count(&first), 828);
    assert!(
        first.contains("cudnn = 91900") && first.contains("cublaslt_workspace_bytes = 1048576")
    );
    let o = gpumem(&[
        "probe",
        "--import",
        &data("probe-jobs.json"),
        "--out",
        out.to_str().unwrap(),
    ]);
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && said.contains("table now 1010"),
        "{said}"
    );
    assert_eq!(count(&std::fs::read_to_string(&out).unwrap()), 1010);
    bad_input(
        &[
            "probe",
            "--import",
            &data("snapshots/vgg16-b32-fp32.pickle"),
            "--out",
            out.to_str().unwrap(),
        ],
        "not a probe report",
    );
    // One table per stack: a report of another cuDNN is refused, the profile untouched.
    let other = common::scratch("probe", "other-cudnn.json");
    std::fs::write(
        &other,
        std::fs::read_to_string(data("probe-jobs.json"))
            .unwrap()
            .replacen("\"cudnn\": 91900", "\"cudnn\": 90100", 1),
    )
    .unwrap();
    bad_input(
        &[
            "probe",
            "--import",
            other.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ],
        "write it to a new profile",
    );
    assert_eq!(count(&std::fs::read_to_string(&out).unwrap()), 1010);
}

#[test]
fn a_bad_snapshot_is_a_one_line_error() {
    bad_input(
        &[
            "diff",
            "mlp:input=8,output=2,depth=1",
            "--batch",
            "2",
            "--snapshot",
            &data("probe-jobs.json"),
        ],
        "not a PyTorch memory snapshot",
    );
    bad_input(
        &[
            "diff",
            "mlp:input=8,output=2,depth=1",
            "--batch",
            "2",
            "--snapshot",
            "/nonexistent.pickle",
        ],
        "/nonexistent.pickle",
    );
}

/// resnet50 at batch 32 on the H200: every one of PyTorch's 3,159 allocation requests is
/// matched, in order, by gpumem's (cuDNN's workspaces from the probed table); the reserved
/// peaks are equal. The estimate says where its workspaces came from.
#[test]
fn diff_against_the_h200_snapshot_finds_no_divergence() {
    if !common::torch("the diff") {
        return;
    }
    let profile = data("h200-probed.toml");
    let o = gpumem(&[
        "diff",
        "torchvision:resnet50",
        "--batch",
        "32",
        "--profile",
        &profile,
        "--snapshot",
        &data("snapshots/resnet50-b32-fp32.pickle"),
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let d: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(d["first_divergence"].is_null(), "{d}");
    assert_eq!(
        (d["matched"].as_u64(), d["torch_requests"].as_u64()),
        (Some(3159), Some(3159))
    );
    assert_eq!(d["peaks"]["gpumem_reserved"], d["peaks"]["torch_reserved"]);
    // The same with the profile `gpumem probe` itself wrote on the H200 (scripts/gpu/cli-h200.sh).
    let o = gpumem(&[
        "diff",
        "torchvision:resnet18",
        "--batch",
        "8",
        "--input",
        "3x64x64",
        "--profile",
        &data("cli/resnet18-probe.toml"),
        "--snapshot",
        &data("snapshots/resnet18-b8-64px-fp32.pickle"),
        "--json",
    ]);
    let d: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        d["first_divergence"].is_null() && d["matched"].as_u64() == Some(1194),
        "{d}"
    );
    let o = gpumem(&[
        "estimate",
        "torchvision:vgg16",
        "--batch",
        "32",
        "--profile",
        &profile,
        "--json",
    ]);
    let e: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(e["workspace_source"], "probed");
    assert_eq!(
        e["allocator"]["peak_reserved"].as_u64(),
        Some(5934 << 20),
        "PyTorch's own peak on the H200"
    );
    let o = gpumem(&[
        "estimate",
        "torchvision:vgg16",
        "--batch",
        "32",
        "--gpu",
        "h200",
        "--json",
    ]);
    let e: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // No table: the built-in profile's policy (the NHWC copies) sizes them, within 10 MiB here.
    assert_eq!(e["workspace_source"], "policy");
    let reserved = e["allocator"]["peak_reserved"].as_u64().unwrap();
    assert!(reserved.abs_diff(5934 << 20) <= 10 << 20, "{reserved}");
}
