//! The bridge against a real PyTorch: set GPUMEM_PYTHON to an interpreter with torch.
//! Without it these tests report a skip, unless GPUMEM_TEST_REQUIRE_TORCH=1 (CI sets it once it
//! has installed torch), in which case a missing torch fails them.

use std::path::PathBuf;

use gpumem_core::estimate::{Estimator, Replay};
use gpumem_core::families::{JobOptions, ModelSpec};
use gpumem_core::job::{InputShape, OptionValues, StepAxis};
use gpumem_core::profile::builtin;
use gpumem_core::symbolic::SymbolicTrace;
use gpumem_torch::{TorchTracer, TraceRequest};

fn tracer() -> Option<TorchTracer> {
    match std::env::var("GPUMEM_PYTHON") {
        Ok(p) if !p.is_empty() => Some(TorchTracer {
            python: p,
            cache_dir: PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("gpumem-cache"),
            cache_max_bytes: gpumem_torch::cache::DEFAULT_MAX_BYTES,
            timeout_s: 600,
        }),
        _ => {
            assert!(
                std::env::var("GPUMEM_TEST_REQUIRE_TORCH").as_deref() != Ok("1"),
                "GPUMEM_PYTHON is not set but torch is required"
            );
            eprintln!(
                "SKIPPED: set GPUMEM_PYTHON to an interpreter with torch to run the bridge tests"
            );
            None
        }
    }
}

/// A trace taken by the tracer itself, never evaluated from a cached symbolic trace: its own
/// cache directory holds no symbolic traces.
fn direct(t: &TorchTracer, req: &TraceRequest) -> gpumem_core::trace::Trace {
    let fresh = TorchTracer {
        cache_dir: t.cache_dir.join("direct"),
        ..t.clone()
    };
    fresh.trace(req).unwrap()
}

fn seed_models() -> String {
    format!(
        "{}/../../python/tests/seed_models.py",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn a_symbolic_trace_equals_a_direct_trace_at_an_untraced_batch() {
    let Some(t) = tracer() else { return };
    for model in [
        format!(
            "py:{}:mlp(input=64,output=10,depth=3,act=gelu,dropout=0.2,batchnorm=true)",
            seed_models()
        ),
        "torchvision:resnet18(num_classes=10)".to_string(),
    ] {
        let mut req = TraceRequest::new(model.clone(), 4);
        if model.starts_with("torchvision") {
            req.options = OptionValues {
                input: InputShape::parse("3x32x32"),
                ..OptionValues::default()
            }
            .check()
            .unwrap();
        }
        let sym = t.symbolic(&req).unwrap();
        for b in [3, 12] {
            let direct = direct(
                &t,
                &TraceRequest {
                    batch: b,
                    ..req.clone()
                },
            );
            assert_eq!(
                sym.at(b).unwrap().events(),
                direct.events(),
                "{model} at batch {b}"
            );
        }
    }
}

/// DataParallel over two GPUs: the symbolic trace (fitted at 8, 12 and 16) equals a direct trace
/// at a multiple of two it did not see; GPU 0's peak sits above a single GPU's at its chunk
/// (gathered outputs, replica gradients held until the reduce).
#[test]
fn a_data_parallel_symbolic_trace_equals_a_direct_trace() {
    let Some(t) = tracer() else { return };
    let mut req = TraceRequest::new("torchvision:resnet18(num_classes=10)", 4);
    req.options = OptionValues {
        input: InputShape::parse("3x32x32"),
        data_parallel: 2,
        ..OptionValues::default()
    }
    .check()
    .unwrap();
    let sym = t.symbolic(&req).unwrap();
    assert_eq!(sym.traced_at, vec![8, 12, 16]);
    let direct = direct(
        &t,
        &TraceRequest {
            batch: 20,
            ..req.clone()
        },
    );
    assert_eq!(direct.header.options.data_parallel, 2);
    assert_eq!(sym.at(20).unwrap().events(), direct.events());
    let single = t
        .trace(&TraceRequest {
            batch: 10,
            options: OptionValues {
                data_parallel: 1,
                ..req.options.values()
            }
            .check()
            .unwrap(),
            ..req.clone()
        })
        .unwrap();
    let profile = builtin("a100-40gb").unwrap();
    let peak = |tr| Replay::default().estimate(tr, &profile).unwrap().peak_bytes;
    assert!(
        peak(&direct) > peak(&single),
        "GPU 0 of two at batch 20 holds more than one GPU at batch 10"
    );
}

/// The trace cache keeps to its budget: entries unused for longer than the grace window go,
/// least recently used first, once new traces are written; a hit renews an entry.
#[test]
fn the_trace_cache_evicts_what_was_used_least_recently() {
    let Some(t) = tracer() else { return };
    let t = TorchTracer {
        cache_dir: t.cache_dir.join("evict"),
        cache_max_bytes: 1,
        ..t
    };
    let _ = std::fs::remove_dir_all(&t.cache_dir);
    let dir = t.cache_dir.join("traces");
    let mlp = |input: u32| {
        TraceRequest::new(
            format!("py:{}:mlp(input={input},output=4,depth=2)", seed_models()),
            8,
        )
    };
    let entries = || {
        let mut v: Vec<(String, std::time::SystemTime)> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let m = e.metadata().unwrap().modified().unwrap();
                (e.file_name().to_string_lossy().into_owned(), m)
            })
            .collect();
        v.sort();
        v
    };
    let (a, b) = (mlp(32), mlp(48));
    t.trace(&a).unwrap();
    let only_a = entries();
    t.trace(&b).unwrap();
    // Both are fresh: over a one-byte budget, yet kept.
    assert_eq!(entries().len(), 2 * only_a.len());
    // Both unused for two grace windows; then `a` is used again.
    let long_ago = std::time::SystemTime::now() - 2 * gpumem_torch::cache::GRACE;
    for (name, _) in entries() {
        let f = std::fs::File::options()
            .append(true)
            .open(dir.join(name))
            .unwrap();
        f.set_modified(long_ago).unwrap();
    }
    t.trace(&a).unwrap();
    t.trace(&mlp(64)).unwrap();
    let left: Vec<String> = entries().into_iter().map(|(n, _)| n).collect();
    for (name, _) in &only_a {
        assert!(left.contains(name), "{name}, used again, was evicted");
    }
    assert_eq!(left.len(), 2 * only_a.len(), "b's traces evicted: {left:?}");
}

/// The first estimate of a model traces it at its batch size and two more, in one tracer run;
/// an estimate at another batch size is then evaluated from the cached symbolic trace — no new
/// tracer run (nothing new in the trace cache) — and equals a trace taken directly.
#[test]
fn a_second_batch_size_reuses_the_symbolic_trace() {
    let Some(t) = tracer() else { return };
    let t = TorchTracer {
        cache_dir: t.cache_dir.join("reestimate"),
        ..t
    };
    let _ = std::fs::remove_dir_all(&t.cache_dir);
    let model = "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=1000)";
    let mut req = TraceRequest::new(model, 10);
    req.options = OptionValues {
        seq_len: Some(64),
        ..OptionValues::default()
    }
    .check()
    .unwrap();
    let first = t.trace_for_reestimates(&req).unwrap();
    assert_eq!(first.header.batch_size, 10);
    let files = || {
        std::fs::read_dir(t.cache_dir.join("traces"))
            .unwrap()
            .count()
    };
    let before = files();
    assert_eq!(before, 4, "three traces and one symbolic trace");
    let second = t
        .trace(&TraceRequest {
            batch: 14,
            ..req.clone()
        })
        .unwrap();
    assert_eq!(files(), before, "no tracer run for the second batch size");
    assert_eq!(
        second.events(),
        direct(
            &t,
            &TraceRequest {
                batch: 14,
                ..req.clone()
            }
        )
        .events()
    );
    let profile = builtin("h200").unwrap();
    assert!(
        Replay::default()
            .estimate(&second, &profile)
            .unwrap()
            .peak_bytes
            > Replay::default()
                .estimate(&first, &profile)
                .unwrap()
                .peak_bytes
    );
}

/// A small deterministic generator for the random configurations.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, lo: u64, hi: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        lo + (self.0 >> 33) % (hi - lo + 1)
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.next(0, xs.len() as u64 - 1) as usize]
    }
}

/// Random native configurations: (family, keys, batch).
fn configs(n: usize, seed: u64) -> Vec<(&'static str, String, u64)> {
    let mut r = Lcg(seed);
    let acts = [
        "relu",
        "leaky_relu",
        "prelu",
        "elu",
        "selu",
        "tanh",
        "softplus",
        "swish",
        "mish",
        "gelu",
    ];
    (0..n)
        .map(|i| match i % 3 {
            0 => {
                let input = r.next(8, 2048);
                let output = r.next(2, (input / 4).max(2));
                let keys = format!(
                    "input={input},output={output},depth={},arch={},act={},dropout={},batchnorm={}",
                    r.next(1, 6),
                    r.pick(&["pyramid", "uniform", "bottleneck", "gradual"]),
                    r.pick(&acts),
                    ["0.0", "0.2", "0.4"][r.next(0, 2) as usize],
                    r.next(0, 1) == 1
                );
                ("mlp", keys, r.next(1, 64) * 4)
            }
            1 => {
                let keys = format!(
                    "classes={},filters={},depth={},input={},arch={},act={},dropout={},batchnorm={},pool_every={}",
                    r.next(2, 100),
                    r.next(1, 8) * 8,
                    r.next(2, 10),
                    r.next(8, 32) * 2,
                    r.pick(&["pyramid", "reverse_pyramid", "uniform", "bottleneck", "gradual", "hourglass", "residual", "dense"]),
                    r.pick(&acts),
                    ["0.0", "0.2"][r.next(0, 1) as usize],
                    r.next(0, 1) == 1,
                    r.next(2, 5)
                );
                ("cnn", keys, r.next(1, 8) * 2)
            }
            _ => {
                let heads = [1, 2, 4, 8][r.next(0, 3) as usize];
                let keys = format!(
                    "vocab={},embed={},layers={},heads={heads},ff={},seq={},classes={},dropout=0.1,arch={}",
                    r.next(100, 5000),
                    heads * 8 * r.next(1, 8),
                    r.next(1, 4),
                    r.next(1, 8) * 64,
                    r.next(1, 8) * 16,
                    r.next(2, 20),
                    r.pick(&["standard", "decoder_only", "hybrid"])
                );
                let keys = if keys.ends_with("hybrid") && keys.contains("layers=1,") { keys.replace("layers=1,", "layers=2,") } else { keys };
                ("transformer", keys, r.next(1, 8) * 2)
            }
        })
        .collect()
}

/// Native Rust families against the same networks traced through real PyTorch: the replay peaks
/// agree within 1%. CI checks GPUMEM_CONSISTENCY_N configurations (default 12).
#[test]
fn native_families_match_pytorch() {
    let Some(t) = tracer() else { return };
    let n = std::env::var("GPUMEM_CONSISTENCY_N")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12);
    let profile = builtin("a100-40gb").unwrap();
    let mut worst: f64 = 0.0;
    let mut report = Vec::new();
    for (family, keys, batch) in configs(n, 2026) {
        let native = ModelSpec::parse(&format!("{family}:{keys}"))
            .unwrap()
            .trace(&JobOptions::new(batch))
            .unwrap();
        let torch = t
            .trace(&TraceRequest::new(
                format!("py:{}:{family}({keys})", seed_models()),
                batch,
            ))
            .unwrap();
        let (a, b) = (
            Replay::default()
                .estimate(&native, &profile)
                .unwrap()
                .peak_bytes,
            Replay::default()
                .estimate(&torch, &profile)
                .unwrap()
                .peak_bytes,
        );
        let err = (a as f64 - b as f64) / b as f64 * 100.0;
        worst = worst.max(err.abs());
        report.push(format!(
            "{err:+.3}% native {a} torch {b} {family}:{keys} batch {batch}"
        ));
    }
    eprintln!("{}", report.join("\n"));
    assert!(
        worst <= 1.0,
        "worst disagreement {worst:.3}% > 1%:\n{}",
        report.join("\n")
    );
}

#[test]
fn a_symbolic_fit_rejects_what_does_not_align() {
    let a = ModelSpec::parse("mlp:input=8,output=2,depth=1").unwrap();
    let traces: Vec<_> = [4u64, 6, 8]
        .iter()
        .map(|&b| a.trace(&JobOptions::new(b)).unwrap())
        .collect();
    assert!(
        SymbolicTrace::fit(&traces[..2]).is_err(),
        "two traces are not enough"
    );
}

/// LoRA through the bridge (issue 16 part 2): the frozen weights carry no gradient and no
/// optimizer state on the event stream — gradients are the adapters' bytes each iteration,
/// Adam's state twice them once — and the step needs less than full fine-tuning.
#[test]
fn lora_trains_only_its_adapters() {
    use gpumem_core::job::Lora;
    use gpumem_core::trace::{Category, Event};
    let Some(t) = tracer() else { return };
    let model = "hf:LlamaForCausalLM(hidden_size=128,intermediate_size=256,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,vocab_size=1000)";
    let lora = Lora::parse("r=8,alpha=16,targets=q_proj,v_proj").unwrap();
    let full = TraceRequest {
        options: OptionValues {
            seq_len: Some(32),
            ..OptionValues::default()
        }
        .check()
        .unwrap(),
        ..TraceRequest::new(model, 2)
    };
    let tuned = TraceRequest {
        options: OptionValues {
            lora: Some(lora),
            ..full.options.values()
        }
        .check()
        .unwrap(),
        ..full.clone()
    };
    let bytes = |tr: &gpumem_core::trace::Trace, cat: Category| {
        tr.events()
            .iter()
            .map(|e| {
                if let Event::Alloc {
                    bytes, category, ..
                } = *e
                    && category == cat
                {
                    bytes
                } else {
                    0
                }
            })
            .sum::<u64>()
    };
    let (full_trace, tuned_trace) = (t.trace(&full).unwrap(), t.trace(&tuned).unwrap());
    // Per layer: q_proj 128→128 and v_proj 128→64 (two KV heads), each A (8 × in) and B (out × 8).
    let adapters = 2 * (8 * (128 + 128) + 8 * (128 + 64));
    assert_eq!(tuned_trace.header.parameters, Some(adapters));
    let iterations = u64::from(tuned_trace.header.iterations);
    assert_eq!(
        bytes(&tuned_trace, Category::Gradient),
        iterations * adapters * 4
    );
    assert_eq!(
        bytes(&tuned_trace, Category::OptimizerState),
        2 * adapters * 4
    );
    let a100 = builtin("a100-40gb").unwrap();
    let peak = |tr| Replay::default().estimate(tr, &a100).unwrap().peak_bytes;
    assert!(peak(&tuned_trace) < peak(&full_trace));
}

/// DistributedDataParallel through the bridge (issue 16 part 1): the rank's trace is PyTorch's
/// own wrapper on a fake process group — its gradient buckets cost a rank more than a single
/// GPU holds, less again with gradient_as_bucket_view.
#[test]
fn a_ddp_rank_carries_its_buckets() {
    use gpumem_core::job::Strategy;
    let Some(t) = tracer() else { return };
    let model = "hf:GPT2LMHeadModel(n_embd=256,n_layer=4,n_head=4,vocab_size=8000)";
    let single = TraceRequest {
        options: OptionValues {
            seq_len: Some(128),
            ..OptionValues::default()
        }
        .check()
        .unwrap(),
        ..TraceRequest::new(model, 4)
    };
    let ddp = |bucket_view| TraceRequest {
        options: OptionValues {
            strategy: Some(Strategy::ddp(4, 25, bucket_view).unwrap()),
            ..single.options.values()
        }
        .check()
        .unwrap(),
        ..single.clone()
    };
    let a100 = builtin("a100-40gb").unwrap();
    let peak = |r: &TraceRequest| {
        Replay::default()
            .estimate(&t.trace(r).unwrap(), &a100)
            .unwrap()
            .peak_bytes
    };
    let (one, rank, viewed) = (peak(&single), peak(&ddp(false)), peak(&ddp(true)));
    assert!(
        one < rank && viewed < rank,
        "single {one}, ddp {rank}, bucket view {viewed}"
    );
}

/// A model of many identical blocks is traced cut to three depths and rebuilt at its whole
/// depth: event for event the trace the tracer takes of the whole model, with and without
/// FSDP2 and checkpointing, and over a mesh with tensor parallelism (whose DTensors learn their
/// outputs' shapes on fake tensors, once per shape and process: no kernel).
#[test]
fn a_deep_model_rebuilt_from_cut_traces_is_its_whole_trace() {
    use gpumem_core::depth;
    use gpumem_core::job::Precision;
    use gpumem_core::job::{Checkpointing, Mesh, MeshDim, Strategy};
    use gpumem_core::trace::Trace;
    let Some(t) = tracer() else { return };
    let model = "hf:LlamaForCausalLM(hidden_size=64,intermediate_size=128,num_hidden_layers=16,num_attention_heads=4,num_key_value_heads=2,vocab_size=256)";
    let plain = OptionValues {
        seq_len: Some(32),
        ..OptionValues::default()
    }
    .check()
    .unwrap();
    let fsdp_values = OptionValues {
        strategy: Some(Strategy::fsdp(4, 1, true, None, false).unwrap()),
        precision: Precision::Bf16,
        checkpointing: Checkpointing::Full,
        ..plain.values()
    };
    let fsdp = fsdp_values.clone().check().unwrap();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("depth-test");
    std::fs::create_dir_all(&dir).unwrap();
    let text = |t: &Trace| {
        let mut out = Vec::new();
        t.write(&mut out).unwrap();
        String::from_utf8(out)
            .unwrap()
            .split_once('\n')
            .unwrap()
            .1
            .to_string()
    };
    let mesh = Mesh::new(&[(MeshDim::Shard, 2), (MeshDim::Tensor, 2)]).unwrap();
    let tp = OptionValues {
        strategy: Some(Strategy::new(mesh, fsdp_values.strategy.unwrap().engine()).unwrap()),
        ..fsdp_values
    }
    .check()
    .unwrap();
    for (name, options) in [("plain", plain), ("fsdp", fsdp), ("tp", tp)] {
        let req = TraceRequest {
            options,
            ..TraceRequest::new(model, 2)
        };
        let traced = |out: &std::path::Path, cut: bool| {
            let file = dir.join(format!("{name}-request.json"));
            let request = t.request(&req, &[2], &[out], cut, &dir.join("answer"));
            std::fs::write(&file, serde_json::to_string(&request).unwrap()).unwrap();
            let ok = t
                .module_command("gpumem_trace")
                .unwrap()
                .arg("--request")
                .arg(&file)
                .status()
                .unwrap()
                .success();
            assert!(ok, "{name}: the tracer failed");
        };
        let read = |p: PathBuf| {
            Trace::read(std::io::BufReader::new(std::fs::File::open(&p).unwrap())).unwrap()
        };
        let (whole, cut) = (
            dir.join(format!("{name}.jsonl")),
            dir.join(format!("{name}-cut.jsonl")),
        );
        traced(&whole, false);
        traced(&cut, true);
        assert!(!cut.exists(), "{name}: sixteen blocks are cut");
        let cut = depth::DEPTHS.map(|d| read(dir.join(format!("{name}-cut.jsonl.depth{d}"))));
        assert_eq!(cut[0].header.blocks, Some(16));
        let whole = read(whole);
        assert_eq!(
            text(&depth::extrapolate(&cut, 16).unwrap()),
            text(&whole),
            "{name}"
        );
        // The bridge takes that route, and caches what it rebuilt.
        let fresh = TorchTracer {
            cache_dir: dir.join(format!("{name}-cache")),
            ..t.clone()
        };
        let _ = std::fs::remove_dir_all(&fresh.cache_dir);
        assert_eq!(
            text(&fresh.trace(&req).unwrap()),
            text(&whole),
            "{name}: through the bridge"
        );
    }
}

/// A deep model's batch-symbolic trace as the bridge makes it — whole (or rebuilt from cut
/// traces) at one batch size, cut to two blocks at three, what the batch does carried over
/// ([`SymbolicTrace::transfer`]) — is the one fitted from whole traces at three batch sizes:
/// ZeRO-3 with windows small enough that its buckets, prefetch, reuse and persistence all act,
/// and DDP with small buckets, rebuilt in the second step (their buffers span blocks: traced
/// whole), and FSDP2 (rebuilt from its cut traces).
#[test]
fn a_deep_models_batch_is_carried_over_from_cut_traces() {
    use gpumem_core::job::Precision;
    use gpumem_core::job::{Checkpointing, Strategy, Zero, ZeroStage};
    use gpumem_core::trace::Trace;
    let Some(t) = tracer() else { return };
    let model = "hf:LlamaForCausalLM(hidden_size=48,intermediate_size=136,num_hidden_layers=16,num_attention_heads=4,num_key_value_heads=2,vocab_size=250)";
    let zero = Zero {
        reduce_bucket_size: 30_000,
        prefetch_bucket_size: 10_000,
        max_live_parameters: 40_000,
        max_reuse_distance: 30_000,
        param_persistence_threshold: 1000,
        ..Zero::default()
    };
    let fsdp = Strategy::fsdp(4, 1, true, None, false).unwrap();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("carry-test");
    std::fs::create_dir_all(&dir).unwrap();
    let read = |p: PathBuf| {
        Trace::read(std::io::BufReader::new(std::fs::File::open(&p).unwrap())).unwrap()
    };
    let ddp = Strategy::ddp(4, 1, false).unwrap();
    for (name, strategy) in [
        ("zero3", Strategy::zero(ZeroStage::Three, 4, zero).unwrap()),
        ("fsdp", fsdp),
        ("ddp", ddp),
    ] {
        let options = OptionValues {
            seq_len: Some(20),
            precision: Precision::Bf16,
            checkpointing: Checkpointing::Full,
            strategy: Some(strategy),
            ..OptionValues::default()
        }
        .check()
        .unwrap();
        let req = TraceRequest {
            options,
            ..TraceRequest::new(model, 4)
        };
        let traced = |outs: &[PathBuf], cut: bool| {
            let outs: Vec<&std::path::Path> = outs.iter().map(PathBuf::as_path).collect();
            let file = dir.join(format!("{name}-request.json"));
            let request = t.request(
                &req,
                &SymbolicTrace::FIT_BATCHES,
                &outs,
                cut,
                &dir.join("answer"),
            );
            std::fs::write(&file, serde_json::to_string(&request).unwrap()).unwrap();
            let ok = t
                .module_command("gpumem_trace")
                .unwrap()
                .arg("--request")
                .arg(&file)
                .status()
                .unwrap()
                .success();
            assert!(ok, "{name}: the tracer failed");
        };
        let outs = |kind: &str| {
            SymbolicTrace::FIT_BATCHES
                .map(|b| dir.join(format!("{name}-{kind}{b}.jsonl")))
                .to_vec()
        };
        traced(&outs("whole"), false);
        let whole: Vec<Trace> = outs("whole").into_iter().map(read).collect();
        let fitted = SymbolicTrace::fit(&whole).unwrap();
        traced(&outs("cut"), true);
        let cut: Vec<Trace> = outs("cut")
            .iter()
            .map(|o| read(PathBuf::from(format!("{}.depth2", o.display()))))
            .collect();
        assert!(
            cut.iter().all(|c| c.header.depth == Some(2)),
            "{name}: cut to two blocks at every batch size"
        );
        let carried = SymbolicTrace::transfer(&whole[0], &cut).unwrap();
        let fresh = TorchTracer {
            cache_dir: dir.join(format!("{name}-cache")),
            ..t.clone()
        };
        let _ = std::fs::remove_dir_all(&fresh.cache_dir);
        let bridged = fresh.symbolic(&req).unwrap();
        for b in [1, 3, 5, 8, 13] {
            let want = fitted.at(b).unwrap();
            assert_eq!(
                carried.at(b).unwrap().events(),
                want.events(),
                "{name} at batch {b}"
            );
            assert_eq!(
                bridged.at(b).unwrap().events(),
                want.events(),
                "{name} at batch {b}: through the bridge"
            );
        }
    }
}

/// The user models of the tracer's tests.
fn fixture(name: &str) -> String {
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../python/tests/fixtures/user_models.py")
        .canonicalize()
        .unwrap();
    format!("py:{}:{name}", file.display())
}

/// A trace that turns its alarm off and never ends is killed at gpumem's own deadline, with
/// whatever it forked (the pool's fork and its forks per batch size), and reported as a
/// timeout.
#[test]
fn a_tracer_that_ignores_its_alarm_is_killed_on_time() {
    use gpumem_torch::BridgeError;
    use std::time::{Duration, Instant};
    let Some(t) = tracer() else { return };
    let deadline = 20;
    let t = TorchTracer {
        timeout_s: deadline,
        cache_dir: PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("deadline-test"),
        ..t
    };
    // The three batch sizes of a re-estimate are traced side by side, each in a fork.
    let req = TraceRequest::new(fixture("ignores_its_alarm"), 2);
    let start = Instant::now();
    let e = t.trace_for_reestimates(&req).unwrap_err();
    let took = start.elapsed();
    assert!(matches!(e, BridgeError::Timeout { .. }), "{e}");
    assert!(
        e.to_string()
            .contains(&format!("timed out after {deadline} s")),
        "{e}"
    );
    assert!(
        took >= Duration::from_secs(deadline) && took < Duration::from_secs(deadline + 15),
        "returned after {took:?}"
    );
}

/// A model that fails at every batch size is reported once, with where it failed.
#[test]
fn a_failing_trace_says_so_once() {
    let Some(t) = tracer() else { return };
    let t = TorchTracer {
        cache_dir: PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("once-test"),
        ..t
    };
    let e = t
        .trace_for_reestimates(&TraceRequest::new(fixture("raises"), 2))
        .unwrap_err()
        .to_string();
    assert_eq!(e.matches("boom").count(), 1, "{e}");
    assert!(
        e.starts_with("tracer failed: py:") && e.contains("failed while tracing: ValueError: boom"),
        "{e}"
    );
    assert!(e.contains("user_models.py:"), "where it failed: {e}");
}

/// A trace's allocation sequence, by what it allocates and what each free frees (the index of
/// its allocation): what the caching allocator sees, independent of the producer's ids.
fn allocation_sequence(t: &gpumem_core::trace::Trace) -> Vec<String> {
    use gpumem_core::trace::Event;
    let mut index_of_slot = std::collections::HashMap::new();
    let mut allocs = 0usize;
    t.events()
        .iter()
        .filter_map(|ev| match *ev {
            Event::Alloc {
                slot,
                bytes,
                category,
                phase,
                op,
                module,
                stream,
            } => {
                index_of_slot.insert(slot, allocs);
                allocs += 1;
                Some(format!(
                    "alloc {bytes} {} {} {} {:?} {stream}",
                    category.name(),
                    phase.name(),
                    t.op_name(op),
                    t.module(module)
                ))
            }
            Event::Free { slot } => Some(format!("free {}", index_of_slot[&slot])),
            Event::Workspace { conv, n, pass, .. } => {
                Some(format!("workspace {} {n} {}", t.op_name(conv), pass.name()))
            }
            Event::Iteration { index } => Some(format!("iteration {index}")),
            Event::RunPhase { phase } => Some(format!("run phase {}", phase.name())),
            Event::EmptyCache => Some("empty cache".into()),
            Event::Op { .. } => None,
        })
        .collect()
}

/// Issue 33's acceptance for lengths that vary by step: a run of lengths drawn from a range,
/// spliced from one trace per length, is the loop traced on meta with those lengths in that
/// order, allocation for allocation; its reserved memory creeps above its longest single
/// step's, and the bound over any order covers it (and every order tried).
#[test]
fn a_run_spliced_from_its_lengths_is_the_run_traced_in_order() {
    use gpumem_core::job::{LengthSchedule, LengthSource};
    use gpumem_core::run::{StepSequence, size_run, traced_lengths};
    use gpumem_core::trace::Trace;
    let Some(t) = tracer() else { return };
    let profile = builtin("a100-40gb").unwrap();
    let model = "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=1000)";
    let schedule =
        LengthSchedule::new(LengthSource::Range { min: 32, max: 512 }, 1, 10, 33).unwrap();
    let lengths = schedule.draw();
    let (traced, order, rounded) = traced_lengths(&lengths);
    assert!(!rounded);
    let options = OptionValues {
        seq_lens: Some(schedule.clone()),
        ..OptionValues::default()
    }
    .check()
    .unwrap();
    let shapes: Vec<Trace> = traced
        .iter()
        .map(|&l| {
            t.trace(&TraceRequest {
                options: options.at_step(StepAxis::SeqLen, l),
                ..TraceRequest::new(model, 8)
            })
            .unwrap()
        })
        .collect();
    let refs: Vec<&Trace> = shapes.iter().collect();
    let seq = StepSequence::new(&refs, order.clone()).unwrap();
    let header = shapes[0].header.clone();
    let (spliced, est, report) = size_run(
        &seq,
        header.clone(),
        &profile,
        &Replay::default(),
        schedule.summary(&lengths, StepAxis::SeqLen),
        traced.clone(),
        rounded,
    )
    .unwrap();
    // The same job traced on meta, its steps at those lengths in that order.
    let in_order = t
        .trace(&TraceRequest {
            options: options.at_step(StepAxis::SeqLen, lengths[0]),
            iterations: lengths.len() as u32,
            seq_lens: lengths.clone(),
            ..TraceRequest::new(model, 8)
        })
        .unwrap();
    assert_eq!(in_order.header.iterations, lengths.len() as u32);
    let (a, b) = (
        allocation_sequence(&spliced),
        allocation_sequence(&in_order),
    );
    assert_eq!(a.len(), b.len());
    assert!(
        a == b,
        "first difference at {:?}",
        a.iter().zip(&b).position(|(x, y)| x != y)
    );
    let reserved = |t: &Trace| {
        Replay::default()
            .estimate(t, &profile)
            .unwrap()
            .allocator
            .unwrap()
            .peak_reserved
    };
    assert_eq!(report.reserved_bytes, reserved(&in_order));
    // The creep, and the bound over any order: as drawn, ascending, descending, shuffled.
    let mut ascending = order.clone();
    ascending.sort_unstable();
    let mut orders = vec![
        order.clone(),
        ascending.clone(),
        ascending.iter().rev().copied().collect(),
    ];
    let mut rng = gpumem_core::rng::SplitMix64(5);
    for _ in 0..20 {
        let mut o = order.clone();
        rng.shuffle(&mut o);
        orders.push(o);
    }
    let mut most = 0;
    let mut ascending_reserved = 0;
    for o in &orders {
        let r = reserved(
            &StepSequence::new(&refs, o.clone())
                .unwrap()
                .splice(header.clone())
                .unwrap(),
        );
        if *o == ascending {
            ascending_reserved = r;
        }
        assert!(
            r <= report.any_order.reserved_bytes,
            "{r} over the bound {:?} in order {o:?}",
            report.any_order
        );
        most = most.max(r);
    }
    eprintln!(
        "lengths {lengths:?}: run reserved {} (most over {} orders {most}, ascending {ascending_reserved}), longest step alone {}, any-order bound {}; estimate peak {} upper {}",
        report.reserved_bytes,
        orders.len(),
        report.longest_step_reserved_bytes,
        report.any_order.reserved_bytes,
        est.peak_bytes,
        est.upper_bound_bytes
    );
    // The creep: some order of these steps reserves more than the longest step alone (here
    // not ascending, whose first step, the one that makes the optimizer's state, is its
    // shortest; the longest step alone is its first).
    assert!(
        most > report.longest_step_reserved_bytes,
        "no order reserves more than the longest step alone {} (ascending {ascending_reserved})",
        report.longest_step_reserved_bytes
    );
    assert!(est.upper_bound_bytes >= est.peak_bytes);
}
