//! Fuzzing every parser of user input (issue 14 part 6): the daemon's HTTP API (raw requests to a
//! real `gpumem serve` over its socket), model specs, traces, measurement CSVs, GPU profiles,
//! daemon configs, and Slurm submissions and cluster files. Each gets `FUZZ_CASES` inputs (default 10,000): valid seeds with bytes
//! replaced, inserted and removed and numbers swapped for extreme ones, and arbitrary text.
//! None may panic; none may hang (a watchdog aborts, naming the input, after 30 s on one).
//! What parses is used as gpumem uses it: a profile, trace or spec is estimated too.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Mutex, Once};
use std::time::{Duration, Instant};

use gpumem_core::profile::{self, GpuProfile};
use gpumem_core::trace::Trace;
use gpumem_workload::{Options, Workload};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

fn cases() -> u32 {
    std::env::var("FUZZ_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(10_000)
}

/// Numbers that have broken parsers: overflow, sign, NaN, infinity.
const EXTREME: [&str; 9] = [
    "0",
    "-1",
    "4294967296",
    "18446744073709551615",
    "18446744073709551616",
    "1e308",
    "nan",
    "inf",
    "-0.0",
];

/// A seed with up to 8 edits: a byte replaced, inserted or removed, or an extreme number put in.
fn mutated(seeds: Vec<String>) -> impl Strategy<Value = String> {
    let edits = prop::collection::vec((0u8..4, any::<prop::sample::Index>(), any::<u8>()), 0..8);
    (0..seeds.len(), edits).prop_map(move |(i, edits)| {
        let mut b = seeds[i].clone().into_bytes();
        for (op, at, byte) in edits {
            let k = at.index(b.len() + 1);
            match op {
                0 => b.insert(k, byte),
                1 if k < b.len() => b[k] = byte,
                2 if k < b.len() => {
                    b.remove(k);
                }
                _ => {
                    let n = EXTREME[byte as usize % EXTREME.len()].as_bytes();
                    b.splice(k..k, n.iter().copied());
                }
            }
        }
        String::from_utf8_lossy(&b).into_owned()
    })
}

/// Mutated seeds mostly, arbitrary text sometimes.
fn inputs(seeds: Vec<String>) -> impl Strategy<Value = String> {
    prop_oneof![6 => mutated(seeds), 1 => any::<String>(), 1 => "[ -~\n]{0,300}"]
}

/// What each test thread is working on, and since when (for the watchdog).
static WORKING: Mutex<Option<HashMap<std::thread::ThreadId, (Instant, String)>>> = Mutex::new(None);

/// Runs `f` on `input`; a watchdog aborts the process naming the input if it takes over 30 s.
fn guarded<T>(what: &str, input: &str, f: impl FnOnce() -> T) -> T {
    static WATCHDOG: Once = Once::new();
    WATCHDOG.call_once(|| {
        std::thread::spawn(|| {
            loop {
                std::thread::sleep(Duration::from_secs(1));
                let w = WORKING.lock().unwrap_or_else(|p| p.into_inner());
                if let Some((t, input)) = w
                    .iter()
                    .flat_map(|m| m.values())
                    .find(|(t, _)| t.elapsed() > Duration::from_secs(30))
                {
                    eprintln!("HANG: {:.0} s on {input:?}", t.elapsed().as_secs_f64());
                    std::process::abort();
                }
            }
        });
    });
    let id = std::thread::current().id();
    WORKING
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .insert(id, (Instant::now(), format!("{what}: {input}")));
    let out = f();
    WORKING
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .remove(&id);
    out
}

/// Runs `check` on `FUZZ_CASES` inputs from `strategy`; a panic fails the test with the input.
fn fuzz(what: &str, strategy: impl Strategy<Value = String>, check: impl Fn(&str)) {
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    let seen = std::cell::Cell::new(0u32);
    runner
        .run(&strategy, |input| {
            seen.set(seen.get() + 1);
            guarded(what, &input, || check(&input));
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    eprintln!("{what}: {} inputs, no panic, no hang", seen.get());
}

/// Small models of each native family.
const SPECS: [&str; 5] = [
    "mlp:input=4096,output=10,depth=4,arch=uniform",
    "mlp:input=64,output=2,depth=1",
    "cnn:classes=10,filters=16,depth=3,input=32,arch=residual,batchnorm=true,dropout=0.1",
    "transformer:vocab=1000,embed=64,layers=2,heads=4,ff=128,seq=32,classes=2",
    "cnn:classes=10,filters=8,depth=4,input=32,arch=dense,act=swish",
];

fn a100() -> GpuProfile {
    profile::builtin("a100-40gb").unwrap()
}

/// Traces and estimates a native workload as `gpumem estimate` would (errors are fine).
fn estimate(w: &Workload, p: &GpuProfile) {
    if let Ok(trace) = w.trace(p) {
        let _ = gpumem_core::estimate::by_name("replay")
            .unwrap()
            .estimate(&trace, p);
    }
}

#[test]
fn model_specs() {
    let specs: Vec<String> = SPECS.iter().map(|s| s.to_string()).collect();
    let p = a100();
    let batch = prop_oneof![
        Just(1u64),
        Just(8),
        1u64..4096,
        Just(1 << 24),
        Just(u64::MAX)
    ];
    let strategy = (inputs(specs), batch).prop_map(|(spec, batch)| format!("{batch} {spec}"));
    fuzz("model spec", strategy, |input| {
        let (batch, spec) = input.split_once(' ').unwrap();
        // PyTorch references would run Python: parsed only (the tracer has its own tests).
        if let Ok(w) = Workload::parse(spec, batch.parse().unwrap(), Options::default())
            && w.request(&p).is_none()
        {
            estimate(&w, &p);
        }
    });
}

#[test]
fn traces() {
    let p = a100();
    let seeds: Vec<String> = SPECS[..4]
        .iter()
        .map(|s| {
            let mut out = Vec::new();
            Workload::parse(s, 2, Options::default())
                .unwrap()
                .trace(&p)
                .unwrap()
                .write(&mut out)
                .unwrap();
            String::from_utf8(out).unwrap()
        })
        .collect();
    let replay = gpumem_core::estimate::by_name("replay").unwrap();
    fuzz("trace", inputs(seeds), |input| {
        if let Ok(t) = Trace::read(input.as_bytes()) {
            let _ = replay.estimate(&t, &p);
        }
    });
}

#[test]
fn measurement_csvs() {
    let seeds = vec![
        "model,batch_size,measured_mib\n\"mlp:input=8,output=2,depth=1\",4,1500\n\"cnn:classes=10,filters=16,depth=3,input=32\",8,2100.5\n".to_string(),
        "model,batch_size,measured_mib,precision,optimizer,outputs\ntorchvision:resnet18,32,5000,amp-bf16,adamw,kept\nmlp:input=8,4,oom,,,\n".to_string(),
        "Filename,Batch Size,Max GPU Memory (MiB)\nmlp_in4096_out10_d4_w512_relu_bn0_do0.csv,64,1200\n".to_string(),
    ];
    fuzz("measurement CSV", inputs(seeds), |input| {
        let _ = gpumem_core::dataset::read_rows("fuzz.csv", input.as_bytes());
    });
}

#[test]
fn gpu_profiles() {
    let seeds: Vec<String> = profile::catalogue()
        .iter()
        .map(GpuProfile::to_toml)
        .collect();
    let w = Workload::parse(SPECS[2], 4, Options::default()).unwrap();
    fuzz("GPU profile", inputs(seeds), |input| {
        if let Ok(p) = GpuProfile::from_toml(input) {
            estimate(&w, &p);
        }
    });
}

#[test]
fn daemon_configs() {
    let seeds = vec![
        "policy = \"safe-pack\"\nheadroom_mib = 2048\nwarmup_s = 30\nmax_retries = 3\nbackfill = false\ngrace_s = 10\ntick_ms = 200\non_lost = \"requeue\"\nestimator = \"replay\"\nprobe_s = 0\nmax_traces = 2\ncgroups = true\n".to_string(),
        "policy = \"first-fit+carma\"\nbackfill = true\n".to_string(),
    ];
    fuzz("daemon config", inputs(seeds), |input| {
        let _ = gpumem_server::Config::from_toml(input);
    });
}

/// A Slurm job's script and comment (split at a `%%` line), decided as the controller does (no
/// tracer: a PyTorch model is refused or taken from the comment).
#[test]
fn slurm_submissions() {
    let cluster = gpumem_slurm::SlurmConfig::parse("[[gpu]]\nprofile = \"h200\"\nshards = 16\nfeature = \"h200\"\n[[gpu]]\nprofile = \"a100-40gb\"\nshards = 8\nfeature = \"a100\"\n", std::path::Path::new(".")).unwrap();
    let seeds = vec![
        format!("#!/bin/bash\n#SBATCH --time=5\n#GPUMEM model={} batch=64 precision=amp-bf16\n#GPUMEM optimizer=adamw gpu=h200\npython train.py\n%%\nrun 7", SPECS[0]),
        format!("#!/bin/sh\n#GPUMEM model={} batch=8\n%%\ngpumem: batch=4096 precision=fp16", SPECS[2]),
        "#!/bin/sh\n#GPUMEM model=torchvision:resnet18 batch=2\n%%\ngpumem: model=torchvision:resnet18 batch=2 sized_on=h200 estimate_mib=20000 bound_mib=20500 shards=3".to_string(),
        "#!/bin/sh\n#GPUMEM train_config=args.json world_size=2\n%%\ngpumem: train_config_kind=hf".to_string(),
    ];
    fuzz("Slurm submission", inputs(seeds), |input| {
        let (script, comment) = input.split_once("\n%%\n").unwrap_or((input, ""));
        let sub = gpumem_slurm::Submission {
            script: Some(script),
            comment: Some(comment),
            gres: Some("gres:gpu:1,gres:nic:1"),
            constraint: Some("ib"),
            workdir: None,
        };
        let _ = gpumem_slurm::decide(&sub, &cluster, false);
    });
}

#[test]
fn slurm_cluster_files() {
    let seeds = vec!["[[gpu]]\nprofile = \"h200\"\nshards = 16\nfeature = \"h200\"\n[[gpu]]\nprofile = \"t4\"\nshards = 4\nfeature = \"t4\"\n".to_string()];
    fuzz("Slurm cluster file", inputs(seeds), |input| {
        let _ = gpumem_slurm::SlurmConfig::parse(input, std::path::Path::new("/nonexistent"));
    });
}

/// Raw HTTP requests to a real daemon on its Unix socket. Its jobs' programs do not exist (a
/// mutation cannot reach a real one), so whatever is accepted fails to start.
#[test]
fn http_api() {
    let dir = std::env::temp_dir().join(format!("gpumem-fuzz-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let socket: PathBuf = dir.join("sock");
    std::fs::write(dir.join("daemon.toml"), "tick_ms = 50\n").unwrap();
    let stderr = std::fs::File::create(dir.join("stderr")).unwrap();
    let mut daemon = Command::new(env!("CARGO_BIN_EXE_gpumem"))
        .args([
            "serve",
            "--fake-gpus",
            "2xa100-40gb",
            "--state",
            dir.join("state").to_str().unwrap(),
            "--socket",
            socket.to_str().unwrap(),
            "--config",
            dir.join("daemon.toml").to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the daemon did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let job = |body: &str| {
        format!(
            "POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let seeds = vec![
        job(
            r#"{"command": ["/nonexistent/gpumem-fuzz", "a"], "mem_mib": 100, "priority": 3, "name": "f"}"#,
        ),
        job(
            r#"{"command": ["/nonexistent/gpumem-fuzz"], "gpus": 2, "model": "mlp:input=64,output=2,depth=1", "batch": 8, "options": {"optimizer": "adamw", "precision": "amp-bf16"}}"#,
        ),
        job(
            r#"{"command": ["/nonexistent/gpumem-fuzz"], "model": "cnn:classes=10,filters=16,depth=3,input=32", "batch": 4, "expected_s": 60, "cwd": "/tmp", "env": {"A": "1"}}"#,
        ),
        get("/jobs?state=queued"),
        get("/jobs/1"),
        get("/jobs/1/log?bytes=100"),
        "POST /jobs/1/cancel HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            .to_string(),
        get("/gpus"),
        get("/metrics"),
    ];
    fuzz("HTTP request", inputs(seeds), |request| {
        let mut c =
            std::os::unix::net::UnixStream::connect(&socket).expect("the daemon still answers");
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let _ = c.write_all(request.as_bytes());
        // Whatever a request lacks, the daemon answers or closes (within its 10 s header limit).
        let _ = c.shutdown(std::net::Shutdown::Write);
        let mut answer = Vec::new();
        let read = c.read_to_end(&mut answer);
        assert!(
            !matches!(&read, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
            "no answer within 20 s"
        );
        if answer.starts_with(b"HTTP/1.1 5") {
            panic!("a server error: {}", String::from_utf8_lossy(&answer));
        }
    });
    let alive = daemon.try_wait().unwrap().is_none();
    let _ = daemon.kill();
    let _ = daemon.wait();
    let log = std::fs::read_to_string(dir.join("stderr")).unwrap();
    assert!(
        alive && !log.contains("panicked"),
        "the daemon died or panicked: {log}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
