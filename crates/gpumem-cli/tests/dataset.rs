//! The data pipeline end to end without a GPU: generate → collect (fake GPU) → calibrate → eval
//! → learn, 20 jobs per family; resuming; error paths.

mod common;
use common::{bad_input, gpumem};

fn ok(args: &[&str]) -> String {
    let o = gpumem(args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn p(name: &str) -> String {
    common::scratch("dataset-test", name).display().to_string()
}

#[test]
fn generate_collect_eval_learn() {
    let mut all = String::new();
    for family in ["mlp", "cnn", "transformer"] {
        let out = p(&format!("{family}.jsonl"));
        ok(&[
            "dataset", "generate", "--family", family, "--count", "20", "--seed", "5", "--out",
            &out,
        ]);
        let text = std::fs::read_to_string(&out).unwrap();
        assert_eq!(text.lines().count(), 20);
        all += &text;
    }
    std::fs::write(p("all.jsonl"), &all).unwrap();
    let data = p("data.csv");
    let s = ok(&[
        "dataset",
        "collect",
        &p("all.jsonl"),
        "--fake-gpu",
        "a100-40gb",
        "--seconds",
        "0",
        "--out",
        &data,
    ]);
    assert!(s.contains("ran 60 jobs") && s.contains("synthetic"), "{s}");
    let csv = std::fs::read_to_string(&data).unwrap();
    assert!(csv.starts_with("Filename,Depth,Activations-Params,Activation Function,Total Activations,Total Parameters,Batch Size"));
    assert_eq!(csv.lines().count(), 61);
    // Resumable: nothing left to run.
    assert!(
        ok(&[
            "dataset",
            "collect",
            &p("all.jsonl"),
            "--fake-gpu",
            "a100-40gb",
            "--seconds",
            "0",
            "--out",
            &data
        ])
        .contains("ran 0 jobs")
    );
    // The CSV feeds calibrate, eval and learn directly.
    ok(&[
        "calibrate",
        &data,
        "--rows",
        "first:3",
        "--out",
        &p("cal.toml"),
    ]);
    let ev: serde_json::Value = serde_json::from_str(&ok(&[
        "eval",
        &data,
        "--profile",
        &p("cal.toml"),
        "--out-dir",
        &p("eval"),
        "--json",
    ]))
    .unwrap();
    let replay = ev["estimators"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["estimator"] == "replay")
        .unwrap();
    assert!(
        replay["median_ape"].as_f64().unwrap() < 2.0,
        "synthetic rows are replay ± 1%: {replay}"
    );
    let k: serde_json::Value = serde_json::from_str(&ok(&[
        "learn", "kfold", &data, "--target", "smact", "--model", "gbt", "--trees", "50", "--folds",
        "3", "--json",
    ]))
    .unwrap();
    assert_eq!(k["folds"].as_array().unwrap().len(), 3);
    ok(&[
        "learn",
        "train",
        &data,
        "--target",
        "memory",
        "--model",
        "mlp",
        "--bins",
        "8192",
        "--epochs",
        "5",
        "--members",
        "1",
        "--out",
        &p("gpumemnet.json"),
    ]);
    ok(&[
        "learn",
        "predict",
        &p("gpumemnet.json"),
        &data,
        "--out",
        &p("pred.csv"),
    ]);
}

#[test]
fn dataset_errors_are_one_line() {
    bad_input(
        &[
            "dataset",
            "generate",
            "--family",
            "rnn",
            "--count",
            "2",
            "--out",
            &p("x.jsonl"),
        ],
        "unknown family `rnn`",
    );
    bad_input(
        &[
            "dataset",
            "generate",
            "--family",
            "mlp",
            "--count",
            "0",
            "--out",
            &p("x.jsonl"),
        ],
        "--count must be at least 1",
    );
    std::fs::write(p("r.toml"), "[cnn]\ndepth = [5, 1]\n").unwrap();
    bad_input(
        &[
            "dataset",
            "generate",
            "--family",
            "cnn",
            "--count",
            "2",
            "--ranges",
            &p("r.toml"),
            "--out",
            &p("x.jsonl"),
        ],
        "cnn.depth: [5, 1]",
    );
    std::fs::write(p("bad.jsonl"), "{\"id\":\"a\",\"family\":\"mlp\",\"model\":\"mlp:input=4,output=2,depth=1\",\"batch\":4}\n{\"id\":\"b\",\"family\":\"mlp\",\"model\":\"mlp:input=4\",\"batch\":4}\n").unwrap();
    bad_input(
        &[
            "dataset",
            "collect",
            &p("bad.jsonl"),
            "--fake-gpu",
            "a100-40gb",
            "--out",
            &p("y.csv"),
        ],
        "bad.jsonl: line 2:",
    );
    std::fs::write(p("good.jsonl"), "{\"id\":\"a\",\"family\":\"mlp\",\"model\":\"mlp:input=4,output=2,depth=1\",\"batch\":4}\n").unwrap();
    bad_input(
        &[
            "dataset",
            "collect",
            &p("good.jsonl"),
            "--fake-gpu",
            "b200",
            "--out",
            &p("y.csv"),
        ],
        "unknown GPU `b200`",
    );
    bad_input(
        &[
            "dataset",
            "collect",
            &p("good.jsonl"),
            "--fake-gpu",
            "a100-40gb",
            "--sample-hz",
            "2",
            "--out",
            &p("y.csv"),
        ],
        "--sample-hz must be at least 10",
    );
    std::fs::write(p("other.csv"), "a,b\n1,2\n").unwrap();
    bad_input(
        &[
            "dataset",
            "collect",
            &p("good.jsonl"),
            "--fake-gpu",
            "a100-40gb",
            "--out",
            &p("other.csv"),
        ],
        "exists with other columns",
    );
}
