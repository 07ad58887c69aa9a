//! Helpers shared by the CLI tests: run the binary, check one-line errors, scratch files.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::PathBuf;
use std::process::{Command, Output};

pub fn gpumem(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args(args)
        .output()
        .expect("gpumem runs")
}

/// Asserts exit code 2 and a single-line error containing `needle`.
pub fn bad_input(args: &[&str], needle: &str) {
    let o = gpumem(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{args:?}: stderr {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{args:?}: error is not one line: {err}"
    );
    assert!(err.contains(needle), "{args:?}: `{err}` lacks `{needle}`");
}

/// A file path in this test process's scratch directory `gpumem-SUITE-PID`.
pub fn scratch(suite: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gpumem-{suite}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// The shared measured data beside the repository (`../shared/data`), if present.
pub fn shared_data(file: &str) -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data")
        .join(file);
    p.exists().then_some(p)
}

/// Whether tests that trace real PyTorch models can run: GPUMEM_PYTHON names an interpreter
/// with torch. CI sets GPUMEM_TEST_REQUIRE_TORCH=1, where its absence is a failure.
pub fn torch(what: &str) -> bool {
    if std::env::var_os("GPUMEM_PYTHON").is_some() {
        return true;
    }
    assert!(
        std::env::var("GPUMEM_TEST_REQUIRE_TORCH").as_deref() != Ok("1"),
        "GPUMEM_PYTHON is not set but torch is required"
    );
    eprintln!("SKIPPED: set GPUMEM_PYTHON to an interpreter with torch to run {what}");
    false
}
