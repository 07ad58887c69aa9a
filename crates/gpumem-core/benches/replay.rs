//! Benchmarks: allocator replay throughput on a ~100k-event trace, end-to-end estimates, and
//! max-batch searches. Run with `cargo bench -p gpumem-core`.

use divan::{Bencher, black_box, counter::ItemsCount};
use gpumem_core::estimate::{Estimator, Replay};
use gpumem_core::families::{JobOptions, ModelSpec};
use gpumem_core::profile::builtin;
use gpumem_core::search::max_batch;
use gpumem_core::trace::Trace;

fn main() {
    divan::main();
}

/// A transformer whose training-step trace has at least 100k events.
fn big_trace() -> Trace {
    let m = ModelSpec::parse("transformer:vocab=8000,embed=256,layers=240,heads=8,ff=1024,seq=128,classes=10,arch=hybrid").unwrap();
    let t = m.trace(&JobOptions::new(16)).unwrap();
    assert!(t.events().len() >= 100_000, "{} events", t.events().len());
    t
}

#[divan::bench]
fn replay_100k_events(bencher: Bencher) {
    let trace = big_trace();
    let profile = builtin("h200").unwrap();
    let n = trace.events().len();
    bencher.counter(ItemsCount::new(n)).bench(|| {
        Replay::default()
            .estimate(black_box(&trace), &profile)
            .unwrap()
    });
}

#[divan::bench(args = ["mlp:input=4096,output=1000,depth=10,arch=uniform", "cnn:classes=1000,filters=64,depth=30,input=224,arch=dense,batchnorm=true", "transformer:vocab=30000,embed=768,layers=12,heads=12,ff=3072,seq=512,classes=2"])]
fn trace_and_estimate(spec: &str) {
    let m = ModelSpec::parse(spec).unwrap();
    let p = builtin("a100-40gb").unwrap();
    let t = m.trace(&JobOptions::new(32)).unwrap();
    black_box(Replay::default().estimate(&t, &p).unwrap());
}

#[divan::bench(args = ["mlp:input=4096,output=1000,depth=10,arch=uniform", "cnn:classes=1000,filters=64,depth=30,input=224,arch=dense,batchnorm=true", "transformer:vocab=30000,embed=768,layers=12,heads=12,ff=3072,seq=512,classes=2"])]
fn max_batch_search(spec: &str) {
    let m = ModelSpec::parse(spec).unwrap();
    let p = builtin("a100-40gb").unwrap();
    black_box(max_batch(&m, &JobOptions::new(1), &p, &Replay::default()).unwrap());
}
