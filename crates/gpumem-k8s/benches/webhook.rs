//! The webhook's answer to one AdmissionReview with its estimate cached (issue 17: 1,000 in
//! under 1 s): parse, patch, serialize.

use gpumem_k8s::{Sharing, Webhook};

fn main() {
    divan::main();
}

#[divan::bench(args = ["hami", "volcano", "kai"])]
fn review_cached(bencher: divan::Bencher, sharing: &str) {
    let hook = Webhook::new(Sharing::parse(sharing).unwrap(), "a100-40gb").unwrap();
    let body = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/deployment-pod.json"
    ))
    .unwrap();
    hook.review(&body).unwrap(); // sized once
    bencher.bench(|| hook.review(divan::black_box(&body)).unwrap());
}
