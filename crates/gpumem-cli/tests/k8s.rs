//! `gpumem k8s webhook` over real HTTPS: a self-signed certificate (openssl), the API server's
//! AdmissionReview POSTed with curl, the patch answered; a bad key file refused in one line.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

mod common;
use common::{bad_input, scratch};

fn fixture(name: &str) -> String {
    format!(
        "{}/../gpumem-k8s/tests/data/{name}",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn the_webhook_answers_over_https() {
    let (cert, key) = (scratch("k8s", "tls.crt"), scratch("k8s", "tls.key"));
    let o = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=gpumem-webhook.gpumem.svc",
            "-keyout",
            key.to_str().unwrap(),
            "-out",
            cert.to_str().unwrap(),
        ])
        .output()
        .expect("openssl makes the test's certificate");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut hook = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args([
            "k8s",
            "webhook",
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--addr",
            "127.0.0.1:0",
            "--sharing",
            "volcano",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let first = BufReader::new(hook.stderr.take().unwrap())
        .lines()
        .next()
        .and_then(Result::ok)
        .unwrap_or_default();
    let url = first
        .rsplit(' ')
        .next()
        .filter(|u| u.starts_with("https://"))
        .unwrap_or_else(|| panic!("no address announced: `{first}`"))
        .to_string();
    let o = Command::new("curl")
        .args([
            "-sSk",
            "--max-time",
            "20",
            "-H",
            "Content-Type: application/json",
            "--data-binary",
            &format!("@{}", fixture("job-pod.json")),
            &format!("{url}/mutate"),
        ])
        .output()
        .expect("curl posts the review");
    let health = Command::new("curl")
        .args(["-sSk", &format!("{url}/healthz")])
        .output()
        .unwrap();
    let _ = hook.kill();
    let _ = hook.wait();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let answer: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(answer["kind"], "AdmissionReview");
    assert_eq!(answer["response"]["allowed"], true);
    assert_eq!(answer["response"]["patchType"], "JSONPatch");
    let patch: Vec<u8> = answer["response"]["patch"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap() as u8)
        .collect();
    let patch = String::from_utf8(patch).unwrap();
    assert!(
        patch.contains("/spec/containers/1/resources/limits/volcano.sh~1vgpu-memory"),
        "{patch}"
    );
    assert_eq!(String::from_utf8_lossy(&health.stdout), "ok");
}

#[test]
fn bad_tls_files_are_one_line_errors() {
    let empty = scratch("k8s", "empty.pem");
    std::fs::write(&empty, "").unwrap();
    bad_input(
        &[
            "k8s",
            "webhook",
            "--tls-cert",
            empty.to_str().unwrap(),
            "--tls-key",
            empty.to_str().unwrap(),
            "--addr",
            "127.0.0.1:0",
        ],
        "empty.pem",
    );
    bad_input(
        &[
            "k8s",
            "webhook",
            "--tls-cert",
            "/nonexistent.crt",
            "--tls-key",
            "/nonexistent.key",
        ],
        "/nonexistent.crt",
    );
    bad_input(
        &[
            "k8s",
            "webhook",
            "--tls-cert",
            "a",
            "--tls-key",
            "b",
            "--sharing",
            "slurm",
        ],
        "unknown sharing system `slurm`",
    );
}
