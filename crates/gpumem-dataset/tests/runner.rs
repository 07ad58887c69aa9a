//! The real Python workload runner driven by the collector (on the CPU, with a fake monitor).
//! Needs GPUMEM_PYTHON with torch; skipped without it unless GPUMEM_TEST_REQUIRE_TORCH=1.

use gpumem_core::units::GIB;
use gpumem_dataset::SyntheticJob;
use gpumem_dataset::collect::{CollectConfig, PythonRunner, collect};
use gpumem_monitor::FakeMonitor;
use gpumem_torch::TorchTracer;

#[test]
fn the_python_runner_trains_and_reports() {
    if std::env::var_os("GPUMEM_PYTHON").is_none() {
        assert!(
            std::env::var("GPUMEM_TEST_REQUIRE_TORCH").as_deref() != Ok("1"),
            "torch is required"
        );
        eprintln!("SKIPPED: set GPUMEM_PYTHON to run the workload runner");
        return;
    }
    let jobs = vec![
        SyntheticJob {
            id: "m1".into(),
            family: "mlp".into(),
            model: "mlp:input=16,output=4,depth=2,samples=64,summary=true".into(),
            batch: 8,
        },
        SyntheticJob {
            id: "bad".into(),
            family: "cnn".into(),
            model: "cnn:classes=10,filters=4,depth=2,input=8,arch=dense".into(),
            batch: 2,
        },
    ];
    let out = std::env::temp_dir().join(format!("gpumem-runner-{}.csv", std::process::id()));
    let _ = std::fs::remove_file(&out);
    let mut runner = PythonRunner {
        tracer: TorchTracer::from_env(),
        seconds: 0.5,
        device: "cpu".into(),
    };
    let mut monitor = FakeMonitor::new(1, "fake", GIB);
    let cfg = CollectConfig {
        gpu: 0,
        out: out.clone(),
        timeout_s: 120.0,
        sample_hz: 10.0,
    };
    let s = collect(&jobs, &mut runner, &mut monitor, &cfg, |_, _, _, _| {}).unwrap();
    assert_eq!(s.ran, 2);
    let text = std::fs::read_to_string(&out).unwrap();
    let rows: Vec<&str> = text.lines().collect();
    assert_eq!(rows.len(), 3, "{text}");
    assert!(
        rows[1].contains(",m1,") && rows[1].contains(",ok,") && rows[1].ends_with(",false"),
        "{}",
        rows[1]
    );
    // A dense CNN of depth 2 has no dense units: whatever PyTorch says, the row records it.
    assert!(rows[2].contains(",bad,"), "{}", rows[2]);
    std::fs::remove_file(&out).ok();
}
