//! Every native family, optimizer and precision produces a valid trace whose replay behaves as
//! PyTorch's memory semantics say it must.

use gpumem_core::estimate::{Estimator, LiveTensors, Replay};
use gpumem_core::families::{JobOptions, ModelSpec};
use gpumem_core::job::Optimizer;
use gpumem_core::job::Precision;
use gpumem_core::profile::{CUBLAS_WORKSPACE_BYTES, CUBLAS_WORKSPACE_HOPPER_BYTES, builtin};
use gpumem_core::trace::{Category, Event, Trace};

const MODELS: [&str; 6] = [
    "mlp:input=512,output=10,depth=3,arch=pyramid,act=gelu,dropout=0.2,batchnorm=true",
    "mlp:input=64,output=1,depth=2,arch=gradual,act=prelu,head=sigmoid,samples=1000",
    "cnn:classes=10,filters=16,depth=6,input=32,arch=residual,act=relu,batchnorm=true,dropout=0.1",
    "cnn:classes=10,filters=16,depth=8,input=32,arch=dense,act=swish",
    "transformer:vocab=1000,embed=64,layers=2,heads=4,ff=128,seq=32,classes=5,arch=hybrid",
    "transformer:vocab=1000,embed=64,layers=2,heads=4,ff=128,seq=32,classes=5,arch=decoder_only",
];

fn trace(spec: &str, batch: u64, opt: Optimizer, prec: Precision) -> Trace {
    let mut job = JobOptions::new(batch);
    job.optimizer = opt;
    job.precision = prec;
    ModelSpec::parse(spec).unwrap().trace(&job).unwrap()
}

#[test]
fn every_family_optimizer_and_precision_traces_and_round_trips() {
    let p = builtin("a100-40gb").unwrap();
    for spec in MODELS {
        for opt in [
            Optimizer::ADAM,
            Optimizer::ADAMW,
            Optimizer::SGD,
            Optimizer::SGD_MOMENTUM,
            Optimizer::parse("adamw8bit").unwrap(),
            Optimizer::parse("adam-fused").unwrap(),
            Optimizer::parse("adamw-for-loop").unwrap(),
            Optimizer::parse("paged-lion32bit").unwrap(),
            Optimizer::parse("torchao-adamw4bit").unwrap(),
        ] {
            for prec in [Precision::Fp32, Precision::AmpFp16, Precision::AmpBf16] {
                let t = trace(spec, 8, opt, prec);
                assert!(t.header.iterations >= 3, "{spec}");
                let mut bytes = Vec::new();
                t.write(&mut bytes).unwrap();
                assert_eq!(Trace::read(bytes.as_slice()).unwrap(), t);
                let r = Replay::default().estimate(&t, &p).unwrap();
                let l = LiveTensors.estimate(&t, &p).unwrap();
                assert!(
                    r.peak_bytes > l.peak_bytes,
                    "{spec}: the replay adds context and caching"
                );
                assert!(r.fits);
            }
        }
    }
}

fn category_bytes(t: &Trace, c: Category) -> u64 {
    t.events()
        .iter()
        .map(|e| match *e {
            Event::Alloc {
                bytes, category, ..
            } if category == c => bytes,
            _ => 0,
        })
        .sum()
}

#[test]
fn optimizer_state_matches_the_optimizer() {
    let spec = MODELS[0];
    let params: u64 = ModelSpec::parse(spec)
        .unwrap()
        .graph(8, Precision::Fp32)
        .parameter_count();
    assert_eq!(
        category_bytes(
            &trace(spec, 8, Optimizer::ADAM, Precision::Fp32),
            Category::OptimizerState
        ),
        2 * 4 * params
    );
    assert_eq!(
        category_bytes(
            &trace(spec, 8, Optimizer::SGD_MOMENTUM, Precision::Fp32),
            Category::OptimizerState
        ),
        4 * params
    );
    assert_eq!(
        category_bytes(
            &trace(spec, 8, Optimizer::SGD, Precision::Fp32),
            Category::OptimizerState
        ),
        0
    );
    // bitsandbytes' 8-bit AdamW: a byte per element and an fp32 scale per 256 (fp32 state below
    // 4096 elements), plus its two 256-entry maps.
    let g = ModelSpec::parse(spec).unwrap().graph(8, Precision::Fp32);
    let bnb: u64 = 2 * gpumem_core::step::BNB_QMAP_BYTES
        + g.params
            .iter()
            .flat_map(|&t| gpumem_core::step::bnb_8bit_state(g.t(t).numel))
            .map(|(b, _)| b)
            .sum::<u64>();
    // Paged, the states of 100,000 elements and more are host-backed (managed memory).
    for opt in ["adamw8bit", "paged-adamw8bit"] {
        let t = trace(spec, 8, Optimizer::parse(opt).unwrap(), Precision::Fp32);
        assert_eq!(
            category_bytes(&t, Category::OptimizerState) + category_bytes(&t, Category::HostBacked),
            bnb,
            "{opt}"
        );
    }
    assert!(bnb < 2 * 4 * params / 3, "about a quarter of Adam's");
    assert_eq!(
        gpumem_core::step::bnb_8bit_state(4095),
        vec![(4 * 4095, "state1"), (4 * 4095, "state2")]
    );
    assert_eq!(
        gpumem_core::step::bnb_8bit_state(4097),
        vec![
            (4097, "state1"),
            (4097, "state2"),
            (4 * 17, "absmax1"),
            (4 * 17, "absmax2")
        ]
    );
}

fn op_bytes(t: &Trace, name: &str) -> u64 {
    let Some(op) = t.op_names().iter().position(|o| o == name) else {
        return 0;
    };
    t.events()
        .iter()
        .map(|e| match *e {
            Event::Alloc { bytes, op: o, .. } if o as usize == op => bytes,
            _ => 0,
        })
        .sum()
}

#[test]
fn autocast_halves_matmul_outputs_and_adds_weight_copies() {
    let spec = "mlp:input=2048,output=10,depth=4,arch=uniform,act=relu";
    let fp32 = trace(spec, 512, Optimizer::ADAM, Precision::Fp32);
    let amp = trace(spec, 512, Optimizer::ADAM, Precision::AmpBf16);
    // Forward outputs halve; backward gradients of the low-precision tensors halve too.
    assert_eq!(2 * op_bytes(&amp, "addmm"), op_bytes(&fp32, "addmm"));
    assert_eq!(op_bytes(&fp32, "to_copy"), 0);
    let params = ModelSpec::parse(spec)
        .unwrap()
        .graph(512, Precision::Fp32)
        .parameter_count();
    let iters = amp.header.iterations as u64;
    // Per iteration: a bf16 copy of every weight and bias (forward), an fp32 gradient of each
    // (the cast's backward), the bf16 copy of the input batch for the first layer, and the fp32
    // copy of the bf16 logits that softmax makes (plus its bf16 gradient).
    assert_eq!(
        op_bytes(&amp, "to_copy"),
        iters * (2 * params + 4 * params + 2 * 512 * 2048 + (4 + 2) * 512 * 10)
    );
}

#[test]
fn gradients_are_freed_by_zero_grad_and_recreated() {
    let t = trace(MODELS[0], 16, Optimizer::ADAM, Precision::Fp32);
    let params = ModelSpec::parse(MODELS[0])
        .unwrap()
        .graph(16, Precision::Fp32)
        .params
        .len() as u64;
    let grads = t
        .events()
        .iter()
        .filter(|e| {
            matches!(
                e,
                Event::Alloc {
                    category: Category::Gradient,
                    ..
                }
            )
        })
        .count() as u64;
    assert_eq!(
        grads,
        params * t.header.iterations as u64,
        "one gradient per parameter per iteration"
    );
}

#[test]
fn peak_grows_with_batch() {
    let p = builtin("a100-40gb").unwrap();
    for spec in MODELS {
        let small = Replay::default()
            .estimate(&trace(spec, 4, Optimizer::ADAM, Precision::Fp32), &p)
            .unwrap();
        let large = Replay::default()
            .estimate(&trace(spec, 256, Optimizer::ADAM, Precision::Fp32), &p)
            .unwrap();
        assert!(large.peak_bytes >= small.peak_bytes, "{spec}");
    }
}

#[test]
fn hopper_profiles_use_the_larger_cublas_workspace() {
    let t = trace(MODELS[0], 8, Optimizer::ADAM, Precision::Fp32);
    let a100 = Replay::default()
        .estimate(&t, &builtin("a100-80gb").unwrap())
        .unwrap();
    let h100 = Replay::default()
        .estimate(&t, &builtin("h100-80gb-sxm").unwrap())
        .unwrap();
    assert_eq!(a100.breakdown.workspace, 2 * CUBLAS_WORKSPACE_BYTES);
    assert_eq!(h100.breakdown.workspace, 2 * CUBLAS_WORKSPACE_HOPPER_BYTES);
}

#[test]
fn paged_state_is_host_backed_beside_the_peak() {
    // A 4096×4096 layer: its states are paged (100,000 elements and more), its bias's are not.
    let spec = "mlp:input=4096,output=4096,depth=1,arch=uniform,act=relu";
    let p = builtin("a100-40gb").unwrap();
    let est = |name: &str| {
        Replay::default()
            .estimate(
                &trace(spec, 8, Optimizer::parse(name).unwrap(), Precision::Fp32),
                &p,
            )
            .unwrap()
    };
    let (resident, paged) = (est("adamw32bit"), est("paged-adamw32bit"));
    let t = trace(
        spec,
        8,
        Optimizer::parse("paged-adamw32bit").unwrap(),
        Precision::Fp32,
    );
    let host = category_bytes(&t, Category::HostBacked);
    assert!(host >= 2 * 4 * 4096 * 4096, "{host}");
    assert_eq!(paged.host_backed_bytes, host);
    assert_eq!(resident.host_backed_bytes, 0);
    assert!(paged.peak_bytes + host / 2 < resident.peak_bytes);
    assert_eq!(
        LiveTensors.estimate(&t, &p).unwrap().host_backed_bytes,
        host
    );
}

#[test]
fn native_models_refuse_what_needs_parameter_shapes() {
    let mut job = JobOptions::new(8);
    job.optimizer = Optimizer::parse("muon").unwrap();
    let e = ModelSpec::parse(MODELS[0])
        .unwrap()
        .trace(&job)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        "optimizer muon applies to PyTorch models here: it takes only the 2-D parameters, and the native graphs hold parameter sizes, not shapes (the native families model adam, adamw, sgd and sgd-momentum in every implementation, transformers' AdamW, bitsandbytes' and torchao's optimizers)"
    );
}
