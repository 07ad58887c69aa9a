//! Inference latency per estimate (GPUMemNet's published: 2.25–10.7 ms; target well below 1 ms),
//! on models trained in the setup on 300 synthetic MLP jobs.

use gpumem_core::families::{JobOptions, ModelSpec};
use gpumem_core::profile::builtin;
use gpumem_core::rng::SplitMix64;
use gpumem_learn::features::trace_summary;
use gpumem_learn::{Kind, LearnedModel, Sample, Spec, Target};

fn main() {
    // As the gpumem binary does: one thread per matmul for these tiny networks.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // SAFETY: before any thread exists.
        unsafe { std::env::set_var("RAYON_NUM_THREADS", "1") };
    }
    divan::main();
}

fn sample(spec: &str, batch: u64) -> Sample {
    let profile = builtin("a100-40gb").unwrap();
    let m = ModelSpec::parse(spec).unwrap();
    let trace = m.trace(&JobOptions::new(batch)).unwrap();
    Sample::new(
        0,
        spec.into(),
        spec.into(),
        m.facts(batch),
        trace_summary(&trace, &profile).unwrap(),
    )
}

fn samples() -> Vec<Sample> {
    let mut rng = SplitMix64(3);
    (0..300)
        .map(|_| {
            let input = 16 + (rng.unit() * 4000.0) as u64;
            let depth = 1 + (rng.unit() * 8.0) as u64;
            let batch = 8 + (rng.unit() * 1000.0) as u64;
            let mut s = sample(
                &format!("mlp:input={input},output=10,depth={depth},act=relu"),
                batch,
            );
            let noisy = |x: f64, r: &mut SplitMix64| x * (0.98 + 0.04 * r.unit());
            let peak = s.physical(Target::Memory);
            let smact = s.physical(Target::Smact);
            s.set_target(Target::Memory, noisy(peak, &mut rng));
            s.set_target(Target::Smact, noisy(smact, &mut rng).min(1.0));
            s
        })
        .collect()
}

fn model(target: Target, kind: Kind) -> LearnedModel {
    let rows = samples();
    let refs: Vec<&Sample> = rows.iter().collect();
    let mut spec = Spec::new(target, kind);
    spec.net.epochs = 5;
    gpumem_learn::model::train(&refs, &spec, "a100-40gb", &mut |_| {}).unwrap()
}

#[divan::bench(args = ["gpumemnet-mlp-x3", "gpumemnet-transformer", "hybrid-gbt", "smact-gbt"])]
fn predict_one(bencher: divan::Bencher, which: &str) {
    let m = match which {
        "gpumemnet-mlp-x3" => model(Target::Memory, Kind::Mlp),
        "gpumemnet-transformer" => model(Target::Memory, Kind::Transformer),
        "hybrid-gbt" => model(Target::Memory, Kind::Gbt),
        _ => model(Target::Smact, Kind::Gbt),
    };
    let s = sample(
        "mlp:input=2346,output=197,depth=2,act=relu,dropout=0.3,batchnorm=true",
        996,
    );
    bencher.bench(|| m.predict(&[divan::black_box(&s)]).unwrap());
}

/// Features of a job from scratch: native trace, replay, physical utilization.
#[divan::bench]
fn features_from_spec() -> Sample {
    sample(
        divan::black_box("mlp:input=2346,output=197,depth=2,act=relu,dropout=0.3,batchnorm=true"),
        996,
    )
}
