//! The daemon end to end: a real `gpumem serve` on loopback with four fake A100s, real child
//! processes, the real SQLite store; restart after SIGKILL; security; a short load run.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_gpumem")
}

mod common;
use common::gpumem;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gpumem-serve-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Spawns `gpumem ARGS` (a `serve`) and returns it with the address it announces. Without
/// --addr it listens on the socket STATE.sock beside its --state.
fn spawn_daemon(args: &[&str]) -> (Child, String) {
    use std::io::{BufRead, BufReader};
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    if !args.iter().any(|a| a == "--addr" || a == "--socket") {
        let state = args
            .iter()
            .position(|a| a == "--state")
            .map(|i| args[i + 1].clone())
            .expect("a --state");
        args.extend(["--socket".to_string(), format!("{state}.sock")]);
    }
    let mut child = Command::new(bin())
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    let url = first
        .rsplit(' ')
        .next()
        .filter(|u| u.starts_with("http://") || u.starts_with("unix:"))
        .unwrap_or_else(|| panic!("no address announced: `{first}`"))
        .to_string();
    // Keep draining stderr so the daemon never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
    (child, url)
}

struct Server {
    child: Child,
    url: String,
}

impl Server {
    /// Starts a daemon on an ephemeral loopback port (chosen by the daemon itself, so parallel
    /// tests never race for one) and learns its address from its first line on stderr.
    fn start(state: &Path) -> Server {
        Server::start_with(state, "")
    }

    /// Like [`Server::start`], with `extra` lines of daemon.toml.
    fn start_with(state: &Path, extra: &str) -> Server {
        let cfg = state.join("daemon.toml");
        std::fs::write(&cfg, format!("policy = \"first-fit\"\nwarmup_s = 1\ntick_ms = 50\ngrace_s = 1\nmax_retries = 2\n{extra}")).unwrap();
        let dir = state.join("state");
        let args = [
            "serve",
            "--fake-gpus",
            "4xa100-40gb",
            "--state",
            dir.to_str().unwrap(),
            "--config",
            cfg.to_str().unwrap(),
        ];
        let (child, url) = spawn_daemon(&args);
        Server { child, url }
    }

    fn run(&self, args: &[&str]) -> String {
        // The server flag goes right after the subcommand: anything after `--` is the job's.
        let mut full: Vec<&str> = vec![args[0], "--server", &self.url];
        full.extend(&args[1..]);
        let o = gpumem(&full);
        assert!(
            o.status.success(),
            "{full:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn submit(&self, args: &[&str]) -> u64 {
        let mut full = vec!["submit", "--json"];
        full.extend(args);
        let v: serde_json::Value = serde_json::from_str(&self.run(&full)).unwrap();
        v["id"].as_u64().unwrap()
    }

    fn job(&self, id: u64) -> serde_json::Value {
        serde_json::from_str(&self.run(&["job", &id.to_string(), "--json"])).unwrap()
    }

    fn state(&self, id: u64) -> String {
        self.job(id)["state"].as_str().unwrap().to_string()
    }

    fn wait_until(&self, mut f: impl FnMut() -> bool, what: &str) {
        let t = Instant::now();
        while !f() {
            assert!(
                t.elapsed() < Duration::from_secs(60),
                "timed out waiting until {what}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `gpumem serve` on one fake A100 with state `state` on the socket STATE.sock, then `extra`.
fn serve_args(state: &Path, extra: &[&str]) -> Vec<String> {
    let socket = format!("{}.sock", state.display());
    let mut args = vec![
        "serve",
        "--fake-gpus",
        "1xa100-40gb",
        "--state",
        state.to_str().unwrap(),
        "--socket",
        &socket,
    ];
    args.extend(extra);
    args.iter().map(|a| a.to_string()).collect()
}

/// A connection to the daemon at `url` (unix:PATH or http://HOST:PORT).
fn connect(url: &str) -> Box<dyn ReadWrite> {
    match url.strip_prefix("unix:") {
        Some(path) => Box::new(std::os::unix::net::UnixStream::connect(path).unwrap()),
        None => Box::new(std::net::TcpStream::connect(url.trim_start_matches("http://")).unwrap()),
    }
}

trait ReadWrite: std::io::Read + std::io::Write {}
impl<T: std::io::Read + std::io::Write> ReadWrite for T {}

/// `request` sent as is over a socket to `url`, and whatever comes back.
fn raw_request(url: &str, request: &str) -> String {
    let mut c = connect(url);
    // A refusal (413) is answered before the body is read and the connection
    // closed, so writing the rest may meet a broken pipe; the answer is queued.
    let _ = c.write_all(request.as_bytes());
    let mut out = Vec::new();
    let _ = c.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// A plain GET over a socket (the test needs no HTTP client of its own).
fn http_get(url: &str, path: &str) -> String {
    raw_request(
        url,
        &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    )
}

/// A shell job that reports `mib` of fake GPU memory, then runs `rest`.
fn fake_job(mib: u64, rest: &str) -> String {
    format!("echo $(({mib}*1048576)) > \"$GPUMEM_FAKE_MEMORY_FILE\"; {rest}")
}

#[test]
fn jobs_queue_collocate_crash_recover_and_finish() {
    let d = dir("e2e");
    let s = Server::start(&d);
    let a = s.submit(&["--mem-mib", "30000", "--shell", &fake_job(30000, "sleep 3")]);
    s.wait_until(
        || s.job(a)["peak_mib"].as_f64() == Some(30000.0),
        "A's memory shows up",
    );
    // Fits beside A (30000 + 6000 + 2048 headroom <= 40960): first-fit collocates it on A's GPU.
    let b = s.submit(&["--mem-mib", "6000", "--shell", &fake_job(6000, "sleep 1")]);
    // Runs out of memory on its first attempt only; then runs alone.
    let c = s.submit(&["--mem-mib", "2000", "--shell", "if [ \"$GPUMEM_JOB_ATTEMPT\" = 1 ]; then echo 'torch.OutOfMemoryError: CUDA out of memory.'; exit 1; fi; echo recovered"]);
    let dd = s.submit(&["--mem-mib", "1000", "--", "/bin/sleep", "60"]);
    let e = s.submit(&[
        "--mem-mib",
        "1000",
        "--gpus",
        "2",
        "--",
        "/bin/sh",
        "-c",
        "echo two GPUs: $CUDA_VISIBLE_DEVICES",
    ]);
    let f = s.submit(&[
        "--mem-mib",
        "1000",
        "--",
        "/bin/sh",
        "-c",
        "echo broken; exit 3",
    ]);
    s.wait_until(|| s.state(dd) == "running", "D runs");
    s.run(&["cancel", &dd.to_string()]);
    s.wait_until(
        || {
            [a, b, c, dd, e, f]
                .iter()
                .all(|&j| ["finished", "failed", "cancelled"].contains(&s.state(j).as_str()))
        },
        "every job ends",
    );
    let (ja, jb, jc, jd, je, jf) = (s.job(a), s.job(b), s.job(c), s.job(dd), s.job(e), s.job(f));
    assert_eq!(ja["state"], "finished");
    assert_eq!(jb["state"], "finished");
    assert_eq!(jb["assigned"], ja["assigned"], "B collocated with A");
    assert_eq!(
        (jc["state"].as_str(), jc["retries"].as_u64()),
        (Some("finished"), Some(1)),
        "C crashed once and recovered: {jc}"
    );
    assert_eq!(jd["state"], "cancelled");
    assert_eq!(
        (
            je["state"].as_str(),
            je["assigned"].as_array().unwrap().len()
        ),
        (Some("finished"), 2)
    );
    assert_eq!(jf["state"], "failed");
    assert!(
        jf["error"]
            .as_str()
            .unwrap()
            .contains("exit code 3: broken"),
        "{jf}"
    );
    let log = s.run(&["job", &c.to_string(), "--log"]);
    assert_eq!(
        (
            log.matches("CUDA out of memory").count(),
            log.matches("recovered").count()
        ),
        (1, 1),
        "{log}"
    );
    let metrics = http_get(&s.url, "/metrics");
    assert!(
        metrics.contains("gpumem_oom_crashes_total 1") && metrics.contains("gpumem_queue_length 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("gpumem_gpu_memory_total_bytes{gpu=\"3\"}"),
        "{metrics}"
    );
    let list: Vec<serde_json::Value> = serde_json::from_str(&s.run(&["jobs", "--json"])).unwrap();
    assert_eq!(list.len(), 6);
    assert!(
        list.iter()
            .all(|j| j.get("id").is_some() && j.get("state").is_some())
    );
}

#[test]
fn the_daemon_sizes_a_job_with_every_workload_option() {
    const MLP: &str = "mlp:input=4096,output=100,depth=4";
    let d = dir("options");
    let s = Server::start(&d);
    let submitted = |opts: &[&str]| -> serde_json::Value {
        let mut args = vec!["submit", "--json", "--model", MLP, "--batch", "512"];
        args.extend(opts);
        args.extend(["--", "/bin/true"]);
        serde_json::from_str(&s.run(&args)).unwrap()
    };
    let estimated = |opts: &[&str]| -> f64 {
        let mut args = vec!["estimate", MLP, "--batch", "512", "--json"];
        args.extend(opts);
        let o = gpumem(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["peak_mib"]
            .as_f64()
            .unwrap()
    };
    let (adam, sgd) = (
        submitted(&[])["estimate_mib"].as_f64().unwrap(),
        submitted(&["--optimizer", "sgd", "--precision", "amp-bf16"])["estimate_mib"]
            .as_f64()
            .unwrap(),
    );
    assert!(
        sgd < adam,
        "SGD without state and bf16 activations take less: {sgd} vs {adam}"
    );
    assert!(
        (adam - estimated(&[])).abs() < 0.1
            && (sgd - estimated(&["--optimizer", "sgd", "--precision", "amp-bf16"])).abs() < 0.1,
        "the daemon sizes a job as `gpumem estimate` does"
    );
    // A job file's [options] table is the API's `options` object.
    let file = d.join("job.toml");
    std::fs::write(&file, format!("command = [\"/bin/true\"]\nmodel = \"{MLP}\"\nbatch = 512\n[options]\noptimizer = \"sgd\"\nprecision = \"amp-bf16\"\n")).unwrap();
    let from_file: serde_json::Value =
        serde_json::from_str(&s.run(&["submit", "--json", file.to_str().unwrap()])).unwrap();
    assert_eq!(from_file["estimate_mib"].as_f64(), Some(sgd));
    // A py: model would run its file's code inside the daemon: refused unless allowed.
    let o = gpumem(&[
        "submit",
        "--server",
        &s.url,
        "--model",
        "py:/tmp/anything.py:build",
        "--batch",
        "2",
        "--",
        "/bin/true",
    ]);
    assert!(
        !o.status.success() && String::from_utf8_lossy(&o.stderr).contains("allow_py_models"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // What a native model cannot take is refused with the CLI's reason.
    let o = gpumem(&[
        "submit",
        "--server",
        &s.url,
        "--model",
        MLP,
        "--batch",
        "8",
        "--checkpointing",
        "--",
        "/bin/true",
    ]);
    assert!(
        !o.status.success()
            && String::from_utf8_lossy(&o.stderr).contains("apply to PyTorch models"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn the_daemon_reads_a_trainer_config_as_the_cli_does() {
    if !common::torch("the daemon's trainer-config test") {
        return;
    }
    // Hugging Face's run_clm arguments: micro-batch 8, bf16, adamw_torch, gradient checkpointing,
    // block_size 512; the model is a small GPT-2 given by the job (the config names the Hub's).
    const MODEL: &str = "hf:GPT2LMHeadModel(n_embd=64,n_layer=2,n_head=2,vocab_size=1000)";
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs/examples/train-configs/hf-trainer-run_clm.json");
    let d = dir("train-config");
    let s = Server::start(&d);
    let file = d.join("job.toml");
    let job_file = |model: Option<&str>, name: &str, text: &str| {
        let mut doc = toml::Table::new();
        doc.insert(
            "command".into(),
            toml::Value::Array(vec!["/bin/true".into()]),
        );
        if let Some(m) = model {
            doc.insert("model".into(), m.into());
        }
        let mut tc = toml::Table::new();
        tc.insert("file".into(), name.into());
        tc.insert("text".into(), text.into());
        doc.insert("train_config".into(), toml::Value::Table(tc));
        std::fs::write(&file, toml::to_string(&doc).unwrap()).unwrap();
    };
    job_file(
        Some(MODEL),
        "run_clm.json",
        &std::fs::read_to_string(&config).unwrap(),
    );
    let job: serde_json::Value =
        serde_json::from_str(&s.run(&["submit", "--json", file.to_str().unwrap()])).unwrap();
    let o = gpumem(&[
        "estimate",
        MODEL,
        "--train-config",
        config.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cli: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        cli["batch_size"].as_u64(),
        Some(8),
        "the config's micro-batch"
    );
    assert!(
        (job["estimate_mib"].as_f64().unwrap() - cli["peak_mib"].as_f64().unwrap()).abs() < 0.1,
        "daemon {job} vs CLI {cli}"
    );
    // A config the daemon cannot read is refused with its reason.
    job_file(
        Some(MODEL),
        "bad.json",
        "{\"per_device_train_batch_size\": [}",
    );
    let o = gpumem(&["submit", "--server", &s.url, file.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("train_config"), "{err}");
}

#[test]
fn a_killed_daemon_loses_and_repeats_nothing() {
    let d = dir("restart");
    let mut s = Server::start(&d);
    let marks = d.join("marks");
    std::fs::create_dir_all(&marks).unwrap();
    // Six jobs that each need a whole GPU: four run, two wait.
    let ids: Vec<u64> = (0..6)
        .map(|i| {
            s.submit(&[
                "--mem-mib",
                "35000",
                "--shell",
                &fake_job(
                    35000,
                    &format!("sleep 2; echo run >> {}/{i}", marks.display()),
                ),
            ])
        })
        .collect();
    s.wait_until(
        || ids.iter().filter(|&&j| s.state(j) == "running").count() == 4,
        "four run",
    );
    s.kill(); // SIGKILL: no chance to clean up
    std::thread::sleep(Duration::from_millis(300));
    let s = Server::start(&d);
    s.wait_until(
        || ids.iter().all(|&j| s.state(j) == "finished"),
        "all six finish after the restart",
    );
    for i in 0..6 {
        let runs = std::fs::read_to_string(marks.join(i.to_string())).unwrap();
        assert_eq!(
            runs.lines().count(),
            1,
            "job {i} ran {} times",
            runs.lines().count()
        );
    }
}

/// A crash while its GPU's memory is at the limit is out-of-memory even when the log says
/// nothing of it (a native abort, a killed process); one below the limit is a plain failure
/// (issue 14 part 5's NVML signal).
#[test]
fn a_crash_at_the_memory_limit_is_out_of_memory() {
    let d = dir("at-limit");
    let s = Server::start(&d);
    let full = s.submit(&[
        "--mem-mib",
        "30000",
        "--shell",
        &fake_job(40960, "sleep 0.5; exit 1"),
    ]);
    let half = s.submit(&[
        "--mem-mib",
        "1000",
        "--shell",
        &fake_job(20000, "sleep 0.5; exit 1"),
    ]);
    s.wait_until(
        || s.job(full)["retries"].as_u64() >= Some(1),
        "the full job is taken for out-of-memory",
    );
    s.wait_until(|| s.state(half) == "failed", "the other fails");
    assert_eq!(s.job(half)["retries"].as_u64(), Some(0), "{}", s.job(half));
    assert!(
        s.job(half)["error"]
            .as_str()
            .unwrap()
            .starts_with("exit code 1")
    );
}

/// Whether `pid` runs (a zombie has ended).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| !s.rsplit_once(')').unwrap().1.trim_start().starts_with('Z'))
}

/// Issue 14 items 2 and 4: a job whose daemon and supervisor are both killed is re-attached,
/// never run again; a killed supervisor does not free the job's GPU while the job runs; a
/// cancelled job that traps SIGTERM gets SIGKILL after grace_s and is recorded cancelled only
/// once its processes are gone; a finished job's background children are killed.
#[test]
fn each_run_is_controlled_exactly_once() {
    use gpumem_server::launcher::JobDir;
    let d = dir("exactly-once");
    let state = d.join("state");
    let marks = d.join("marks");
    std::fs::create_dir_all(&marks).unwrap();
    let mut s = Server::start(&d);
    let procs = |id| {
        JobDir::new(&state, id)
            .procs()
            .filter(|p| p.leader.is_some())
    };
    let sigkill = |pid: u32| unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    // Item 2: daemon and supervisor killed; the restarted daemon re-attaches.
    let a = s.submit(&[
        "--mem-mib",
        "1000",
        "--shell",
        &fake_job(
            1000,
            &format!("echo $GPUMEM_JOB_ATTEMPT >> {}/a; sleep 4", marks.display()),
        ),
    ]);
    s.wait_until(|| procs(a).is_some(), "A starts");
    s.kill();
    sigkill(JobDir::new(&state, a).pid().unwrap());
    let s = Server::start(&d);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(s.state(a), "running", "re-attached, not requeued");
    // Item 4: a supervisor killed under a live daemon; the GPU stays the job's.
    let b = s.submit(&["--mem-mib", "1000", "--shell", &fake_job(1000, "sleep 3")]);
    s.wait_until(|| procs(b).is_some(), "B starts");
    sigkill(JobDir::new(&state, b).pid().unwrap());
    std::thread::sleep(Duration::from_millis(500));
    let gpus: serde_json::Value = serde_json::from_str(&s.run(&["gpus", "--json"])).unwrap();
    let shown = gpus.as_array().unwrap().iter().any(|g| {
        g["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|j| j.as_u64() == Some(b))
    });
    assert!(
        s.state(b) == "running" && shown,
        "B still runs on its GPU: {gpus}"
    );
    for id in [a, b] {
        s.wait_until(
            || s.state(id) == "failed",
            "the job ends without its supervisor",
        );
        assert!(
            s.job(id)["error"]
                .as_str()
                .unwrap()
                .contains("exit status is unknown"),
            "{}",
            s.job(id)
        );
    }
    assert_eq!(
        std::fs::read_to_string(marks.join("a")).unwrap(),
        "1\n",
        "A started once"
    );
    // Item 4: cancelling a job that traps SIGTERM.
    let c = s.submit(&[
        "--mem-mib",
        "1000",
        "--shell",
        &fake_job(1000, "trap '' TERM; sleep 30"),
    ]);
    s.wait_until(
        || procs(c).is_some_and(|p| p.pids().len() == 2),
        "C and its sleep start",
    );
    let leader = procs(c).unwrap();
    s.run(&["cancel", &c.to_string()]);
    std::thread::sleep(Duration::from_millis(400));
    assert!(
        leader.leader_running() && s.state(c) == "running",
        "SIGTERM is trapped: not cancelled yet"
    );
    s.wait_until(|| s.state(c) == "cancelled", "SIGKILL after grace_s (1 s)");
    assert!(
        !leader.alive(),
        "recorded cancelled only once its processes are gone"
    );
    // Item 4: a finished job's background children.
    let e = s.submit(&[
        "--mem-mib",
        "1000",
        "--shell",
        &fake_job(
            1000,
            &format!("sleep 25 & echo $! > {}/e; exit 0", marks.display()),
        ),
    ]);
    s.wait_until(|| s.state(e) == "finished", "E finishes");
    let child: u32 = std::fs::read_to_string(marks.join("e"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        !running(child),
        "E's background sleep was killed at its end"
    );
}

/// TCP is opt-in and always behind a token of at least 16 characters from a file or the
/// environment, never the command line (issue 14 item 1).
#[test]
fn security() {
    let d = dir("sec");
    let state = |name: &str| d.join(name).display().to_string();
    let serve = |extra: &[&str]| {
        let mut a = vec!["serve", "--fake-gpus", "1xa100-40gb"];
        a.extend(extra);
        gpumem(&a)
    };
    for addr in ["0.0.0.0:0", "127.0.0.1:0"] {
        let o = serve(&["--addr", addr, "--state", &state("st")]);
        assert_eq!(o.status.code(), Some(2));
        assert!(
            String::from_utf8_lossy(&o.stderr)
                .contains(&format!("refusing to listen on {addr} without a token")),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
    let o = serve(&[
        "--addr",
        "127.0.0.1:0",
        "--token",
        "0123456789abcdef",
        "--state",
        &state("st"),
    ]);
    assert_eq!(o.status.code(), Some(2), "no token on the command line");
    let (weak, token) = (d.join("weak"), d.join("token"));
    std::fs::write(&weak, " \n").unwrap();
    std::fs::write(&token, "s3cret-s3cret-s3cret\n").unwrap();
    let o = serve(&[
        "--addr",
        "0.0.0.0:0",
        "--token-file",
        weak.to_str().unwrap(),
        "--state",
        &state("st"),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr)
            .contains("a token must be at least 16 printable characters")
    );
    // With a token, requests without it are refused.
    let (mut child, url) = spawn_daemon(&[
        "serve",
        "--fake-gpus",
        "1xa100-40gb",
        "--addr",
        "127.0.0.1:0",
        "--state",
        &state("st2"),
        "--token-file",
        token.to_str().unwrap(),
    ]);
    let o = gpumem(&["jobs", "--server", &url]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("401: missing or wrong bearer token"));
    let o = gpumem(&[
        "jobs",
        "--server",
        &url,
        "--token-file",
        token.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    // Oversized and malformed bodies, through a raw socket.
    let raw = |body: &str| -> String {
        raw_request(
            &url,
            &format!(
                "POST /jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret-s3cret-s3cret\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            ),
        )
    };
    assert!(raw(&"x".repeat(100_000)).starts_with("HTTP/1.1 413"));
    let bad = raw("{\"command\": [\"true\"], \"surprise\": 1}");
    assert!(
        bad.starts_with("HTTP/1.1 400") && bad.contains("unknown field `surprise`"),
        "{bad}"
    );
    assert!(raw("not json").starts_with("HTTP/1.1 400"));
    // No shell unless asked: `;` and `$HOME` reach the program verbatim.
    let o = gpumem(&[
        "submit",
        "--server",
        &url,
        "--token-file",
        token.to_str().unwrap(),
        "--json",
        "--",
        "/bin/echo",
        "a;",
        "$HOME",
    ]);
    let id = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["id"]
        .as_u64()
        .unwrap();
    let t = Instant::now();
    loop {
        let o = gpumem(&[
            "job",
            &id.to_string(),
            "--log",
            "--server",
            &url,
            "--token-file",
            token.to_str().unwrap(),
        ]);
        if String::from_utf8_lossy(&o.stdout).contains("a; $HOME") {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the job's output never appeared"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn one_daemon_per_state_directory_and_its_files_are_private() {
    use std::os::unix::fs::PermissionsExt;
    let d = dir("lock");
    let s = Server::start(&d);
    let state = d.join("state");
    // A second daemon on the same state would run its queued jobs again: refused, naming the holder.
    let o = gpumem(
        &serve_args(&state, &[])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("is in use by another gpumem serve (pid ") && err.lines().count() == 1,
        "{err}"
    );
    let id = s.submit(&["--mem-mib", "100", "--", "/bin/echo", "secret output"]);
    s.wait_until(|| s.state(id) == "finished", "the job finishes");
    let mode = |p: &Path| {
        std::fs::metadata(p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode(&state), 0o700);
    assert_eq!(mode(&state.join("jobs")), 0o700);
    for f in ["jobs.db", "jobs.db-wal", "lock"] {
        assert_eq!(mode(&state.join(f)), 0o600, "{f}");
    }
    let job_dir = state.join("jobs").join(id.to_string());
    for f in ["log", "pid", "exit"] {
        assert_eq!(mode(&job_dir.join(f)), 0o600, "jobs/{id}/{f}");
    }
}

#[test]
fn a_lost_store_is_refused_not_silently_reset() {
    let d = dir("lost");
    let mut s = Server::start(&d);
    let old = s.submit(&[
        "--mem-mib",
        "100",
        "--",
        "/bin/echo",
        "the old job's output",
    ]);
    s.wait_until(|| s.state(old) == "finished", "the old job finishes");
    s.kill();
    // The store emptied while the daemon was down (its job directories remain).
    let state = d.join("state");
    std::fs::write(state.join("jobs.db"), "").unwrap();
    for f in ["jobs.db-wal", "jobs.db-shm"] {
        let _ = std::fs::remove_file(state.join(f));
    }
    let serve = |extra: &[&str]| serve_args(&state, extra);
    let o = gpumem(&serve(&[]).iter().map(String::as_str).collect::<Vec<_>>());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("the job store was lost or damaged; start with --recover")
            && err.lines().count() == 1,
        "{err}"
    );
    // --recover sets the old directories aside; a new job gets a new id and its own log.
    let (child, url) = spawn_daemon(
        &serve(&["--recover"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let s = Server { child, url };
    let new = s.submit(&[
        "--mem-mib",
        "100",
        "--",
        "/bin/echo",
        "the new job's output",
    ]);
    assert!(
        new > old,
        "ids are never given again, not even by a new store"
    );
    s.wait_until(|| s.state(new) == "finished", "the new job finishes");
    let log = s.run(&["job", &new.to_string(), "--log"]);
    assert!(
        log.contains("the new job's output") && !log.contains("the old job's output"),
        "{log}"
    );
    let aside: Vec<_> = std::fs::read_dir(&state)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("jobs.lost-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert!(
        std::fs::read_to_string(state.join(&aside[0]).join(old.to_string()).join("log"))
            .unwrap()
            .contains("the old job's output")
    );
}

#[test]
fn load_nothing_lost() {
    let d = dir("load");
    let s = Server::start(&d);
    let out = s.run(&[
        "load-test",
        "--jobs",
        "1000",
        "--concurrency",
        "4",
        "--seconds",
        "60",
    ]);
    assert!(
        out.contains("1000 submissions accepted")
            && out.contains("0 failed")
            && out.contains("1000 stored"),
        "{out}"
    );
}

#[test]
fn the_daemons_history_calibrates_a_profile() {
    let d = dir("history");
    let s = Server::start(&d);
    let spec = "mlp:input=2048,output=10,depth=3,act=relu";
    let est: serde_json::Value =
        serde_json::from_slice(&gpumem(&["estimate", spec, "--batch", "128", "--json"]).stdout)
            .unwrap();
    // The "GPU" shows 500 MiB more than gpumem predicts: a heavier CUDA context.
    let shown = est["peak_mib"].as_f64().unwrap().round() as u64 + 500;
    let ids: Vec<u64> = (0..2)
        .map(|_| {
            s.submit(&[
                "--model",
                spec,
                "--batch",
                "128",
                "--shell",
                &fake_job(shown, "sleep 0.5"),
            ])
        })
        .collect();
    s.wait_until(
        || ids.iter().all(|&j| s.state(j) == "finished"),
        "both finish",
    );
    let out = d.join("cal.toml");
    let o = gpumem(&[
        "calibrate",
        "--from-history",
        d.join("state").to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout);
    let fitted: f64 = text
        .lines()
        .find(|l| l.contains("cuda_context_mib"))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        (fitted - 1929.0).abs() <= 1.0,
        "context 1429 + 500 expected: {text}"
    );
}

/// A job whose convolutions the profile has not probed waits, sized by its upper bound, while
/// the daemon probes exactly those on an idle GPU (here a fake probe: 100 MiB per pass, the
/// only fake part); then it is sized again and placed, and the table is kept in the state
/// directory, so the same job later is sized at once. Needs torch to trace the model.
#[test]
fn the_daemon_probes_convolutions_it_has_not_seen() {
    if !common::torch("the probing daemon") {
        return;
    }
    let d = dir("probe");
    let cfg = d.join("daemon.toml");
    std::fs::write(
        &cfg,
        "policy = \"first-fit\"\nwarmup_s = 1\ntick_ms = 50\nprobe_s = 60\n",
    )
    .unwrap();
    let state = d.join("state");
    let args = [
        "serve",
        "--fake-gpus",
        "2xh200",
        "--fake-probe",
        "104857600",
        "--state",
        state.to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
    ];
    let (child, url) = spawn_daemon(&args);
    let s = Server { child, url };
    let model = [
        "--model",
        "torchvision:resnet18",
        "--batch",
        "4",
        "--input",
        "3x32x32",
    ];
    let submit = || -> serde_json::Value {
        let mut a = vec!["submit", "--json"];
        a.extend(model);
        a.extend(["--", "/bin/true"]);
        serde_json::from_str(&s.run(&a)).unwrap()
    };
    let first = submit();
    assert_eq!(
        first["estimate_mib"], first["bound_mib"],
        "sized by its bound while it waits: {first}"
    );
    let id = first["id"].as_u64().unwrap();
    s.wait_until(|| s.state(id) == "finished", "the probed job runs");
    let job = s.job(id);
    let (estimate, bound) = (
        job["estimate_mib"].as_f64().unwrap(),
        job["bound_mib"].as_f64().unwrap(),
    );
    assert!(
        estimate < bound && job["error"].is_null(),
        "sized again after the probe: {job}"
    );
    // 100 MiB per pass in the table: more than the same job without workspaces.
    let o = gpumem(&[
        "estimate",
        "torchvision:resnet18",
        "--batch",
        "4",
        "--input",
        "3x32x32",
        "--gpu",
        "h200",
        "--json",
    ]);
    let plain = serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["peak_mib"]
        .as_f64()
        .unwrap();
    assert!(
        estimate > plain + 50.0,
        "{estimate} vs {plain} without workspaces"
    );
    let table = std::fs::read_to_string(state.join("profile.toml")).unwrap();
    assert!(
        table.matches("[[gpu.conv_workspace]]").count() >= 10,
        "the probed table is kept"
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(state.join("profile.toml"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    let again = submit();
    assert_eq!(
        again["estimate_mib"].as_f64(),
        Some(estimate),
        "probed already: sized at once"
    );
}

/// `--addr localhost:PORT` resolves the host name (issue 14 item 9).
#[test]
fn a_host_name_address_is_resolved() {
    let d = dir("localhost");
    let token = d.join("token");
    std::fs::write(&token, "0123456789abcdef").unwrap();
    let token = token.to_str().unwrap();
    let (mut child, url) = spawn_daemon(&[
        "serve",
        "--fake-gpus",
        "1xa100-40gb",
        "--addr",
        "localhost:0",
        "--token-file",
        token,
        "--state",
        d.join("st").to_str().unwrap(),
    ]);
    let o = gpumem(&["jobs", "--server", &url, "--token-file", token]);
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        o.status.success(),
        "{url}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Every refusal is the documented `{"error": …}` JSON, axum's own ones too (issue 14 item 9).
#[test]
fn every_error_answer_is_json() {
    let d = dir("json-errors");
    let (mut child, url) = spawn_daemon(&[
        "serve",
        "--fake-gpus",
        "1xa100-40gb",
        "--state",
        d.join("st").to_str().unwrap(),
    ]);
    let big = "x".repeat(2 << 20);
    for (request, status) in [
        (
            "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_string(),
            "404",
        ),
        (
            "DELETE /gpus HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_string(),
            "405",
        ),
        (
            "GET /jobs?state=%ZZ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_string(),
            "400",
        ),
        (
            format!(
                "POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{big}",
                big.len()
            ),
            "413",
        ),
    ] {
        let answer = raw_request(&url, &request);
        let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
        assert!(head.starts_with(&format!("HTTP/1.1 {status}")), "{head}");
        assert!(
            head.to_ascii_lowercase()
                .contains("content-type: application/json"),
            "{head}"
        );
        let v: serde_json::Value =
            serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("{status}: `{body}`: {e}"));
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// A connection that never finishes its request headers is closed (after
/// HEADER_READ_TIMEOUT, 10 s), not held open for ever (issue 14 item 9).
#[test]
fn a_silent_connection_is_closed() {
    use std::io::{Read, Write};
    let d = dir("silent");
    let (mut child, url) = spawn_daemon(&[
        "serve",
        "--fake-gpus",
        "1xa100-40gb",
        "--state",
        d.join("st").to_str().unwrap(),
    ]);
    let mut c = std::os::unix::net::UnixStream::connect(url.trim_start_matches("unix:")).unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").unwrap(); // and never the blank line
    c.set_read_timeout(Some(Duration::from_secs(40))).unwrap();
    let mut buf = Vec::new();
    let read = c.read_to_end(&mut buf);
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        read.is_ok(),
        "the daemon kept the half-open connection: {read:?}"
    );
}

/// A damaged store is refused (exit 2, one line) and `--recover` sets it aside whole; a lost
/// WAL loses no job older than a second (the daemon checkpoints every second) - issue 14 item 5.
#[test]
fn a_damaged_store_is_refused_and_a_lost_wal_loses_nothing_old() {
    let d = dir("damaged");
    let mut s = Server::start(&d);
    let ids: Vec<u64> = (0..20)
        .map(|_| s.submit(&["--mem-mib", "100", "--", "/bin/true"]))
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    s.kill(); // SIGKILL: the WAL is left as it was
    let state = d.join("state");
    for f in ["jobs.db-wal", "jobs.db-shm"] {
        let _ = std::fs::remove_file(state.join(f));
    }
    let (child, url) = spawn_daemon(&[
        "serve",
        "--fake-gpus",
        "1xa100-40gb",
        "--state",
        state.to_str().unwrap(),
    ]);
    let mut s = Server { child, url };
    let listed: serde_json::Value = serde_json::from_str(&s.run(&["jobs", "--json"])).unwrap();
    assert_eq!(
        listed.as_array().unwrap().len(),
        ids.len(),
        "every job older than a second is in the database file"
    );
    s.kill();
    std::fs::write(state.join("jobs.db"), vec![0x5a; 8192]).unwrap();
    let serve = |extra: &[&str]| serve_args(&state, extra);
    let o = gpumem(&serve(&[]).iter().map(String::as_str).collect::<Vec<_>>());
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("is damaged")
            && err.contains("--recover")
            && err.trim_end().lines().count() == 1,
        "{err}"
    );
    let (child, url) = spawn_daemon(
        &serve(&["--recover"])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    let s = Server { child, url };
    assert_eq!(s.run(&["jobs", "--json"]).trim(), "[]");
    let names: Vec<String> = std::fs::read_dir(&state)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    assert!(
        names.iter().any(|n| n.starts_with("jobs.db.damaged-"))
            && names.iter().any(|n| n.starts_with("jobs.lost-")),
        "{names:?}"
    );
}

/// A throwaway user of this machine, removed when dropped.
struct ThrowawayUser {
    name: String,
    uid: u32,
    gid: u32,
}

/// A throwaway group of this machine, removed when dropped.
struct ThrowawayGroup(String);

impl ThrowawayGroup {
    fn new(name: &str) -> ThrowawayGroup {
        let _ = Command::new("groupdel").arg(name).output();
        let o = Command::new("groupadd").arg(name).output().unwrap();
        assert!(
            o.status.success(),
            "groupadd {name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        ThrowawayGroup(name.to_string())
    }
}

impl Drop for ThrowawayGroup {
    fn drop(&mut self) {
        let _ = Command::new("groupdel").arg(&self.0).output();
    }
}

impl ThrowawayUser {
    /// A new user in its own group and in `also` (a supplementary group).
    fn new(name: &str, also: Option<&ThrowawayGroup>) -> ThrowawayUser {
        let _ = Command::new("userdel").arg(name).output();
        let mut args = vec![
            "--no-create-home",
            "--shell",
            "/bin/sh",
            "--user-group",
            name,
        ];
        if let Some(g) = also {
            args.extend(["--groups", &g.0]);
        }
        let o = Command::new("useradd").args(&args).output().unwrap();
        assert!(
            o.status.success(),
            "useradd {name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let id = |flag: &str| {
            String::from_utf8(
                Command::new("id")
                    .args([flag, name])
                    .output()
                    .unwrap()
                    .stdout,
            )
            .unwrap()
            .trim()
            .parse()
            .unwrap()
        };
        ThrowawayUser {
            name: name.to_string(),
            uid: id("-u"),
            gid: id("-g"),
        }
    }

    /// `gpumem ARGS` run as this user in `cwd`.
    fn gpumem(&self, cwd: &Path, args: &[&str]) -> std::process::Output {
        use std::os::unix::process::CommandExt;
        Command::new(bin())
            .args(args)
            .current_dir(cwd)
            .uid(self.uid)
            .gid(self.gid)
            .env_remove("GPUMEM_TOKEN")
            .output()
            .unwrap()
    }
}

impl Drop for ThrowawayUser {
    fn drop(&mut self) {
        let _ = Command::new("userdel").arg(&self.name).output();
    }
}

/// Issue 14 item 1 on a shared machine: on the daemon's Unix socket each user is who the kernel
/// says; each job runs as its submitter; nobody sees, reads or cancels another's job; root sees
/// all; the state files are private. Needs root (to be the daemon that switches users and to
/// make the users); CI runs as root.
#[test]
fn users_see_and_run_only_their_own_jobs() {
    use std::os::unix::fs::PermissionsExt;
    // SAFETY: getuid has no preconditions.
    if unsafe { libc::getuid() } != 0 {
        assert!(
            std::env::var("GPUMEM_TEST_REQUIRE_ROOT").as_deref() != Ok("1"),
            "GPUMEM_TEST_REQUIRE_ROOT=1 but not root"
        );
        eprintln!("SKIPPED: the multi-user test needs root");
        return;
    }
    let d = dir("multi");
    let shared = d.join("shared");
    std::fs::create_dir_all(&shared).unwrap();
    for p in [&d, &shared] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let tag = std::process::id() % 100_000;
    let admins = ThrowawayGroup::new(&format!("gpmt{tag}g"));
    let (a, b) = (
        ThrowawayUser::new(&format!("gpmt{tag}a"), None),
        ThrowawayUser::new(&format!("gpmt{tag}b"), None),
    );
    // C is no owner of anything but a member of the daemon's admin group.
    let c = ThrowawayUser::new(&format!("gpmt{tag}c"), Some(&admins));
    let s = Server::start_with(&d, &format!("admin_group = \"{}\"\n", admins.0));
    let submit = |u: &ThrowawayUser| -> u64 {
        let job = shared.join(format!("{}.toml", u.name));
        std::fs::write(&job, format!("command = [\"/bin/sh\", \"-c\", \"id -u > {0}/{1}.uid; echo secret-of-{1}; sleep 30\"]\nmem_mib = 100\nenv = {{ HF_TOKEN = \"hf-{1}\" }}\n", shared.display(), u.name)).unwrap();
        let o = u.gpumem(
            &shared,
            &[
                "submit",
                job.to_str().unwrap(),
                "--server",
                &s.url,
                "--json",
            ],
        );
        assert!(
            o.status.success(),
            "{}: {}",
            u.name,
            String::from_utf8_lossy(&o.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["id"]
            .as_u64()
            .unwrap()
    };
    let (ja, jb) = (submit(&a), submit(&b));
    for (u, id) in [(&a, ja), (&b, jb)] {
        s.wait_until(
            || {
                std::fs::read_to_string(shared.join(format!("{}.uid", u.name)))
                    .is_ok_and(|t| t.ends_with('\n'))
            },
            "the job runs",
        );
        assert_eq!(
            std::fs::read_to_string(shared.join(format!("{}.uid", u.name)))
                .unwrap()
                .trim(),
            u.uid.to_string(),
            "job {id} runs as its owner"
        );
        assert_eq!(s.job(id)["owner"].as_u64(), Some(u.uid as u64));
    }
    // A sees only A's job; B's job, log and cancel are "no job" to A.
    let list = a.gpumem(&shared, &["jobs", "--server", &s.url, "--json"]);
    let ids: Vec<u64> = serde_json::from_slice::<Vec<serde_json::Value>>(&list.stdout)
        .unwrap()
        .iter()
        .map(|j| j["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, [ja]);
    assert!(!String::from_utf8_lossy(&list.stdout).contains(&format!("hf-{}", b.name)));
    for args in [
        vec!["job", &*jb.to_string(), "--json"],
        vec!["job", &*jb.to_string(), "--log"],
        vec!["cancel", &*jb.to_string()],
    ] {
        let mut full = args.clone();
        full.extend(["--server", &s.url]);
        let o = a.gpumem(&shared, &full);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(
            String::from_utf8_lossy(&o.stderr).contains(&format!("404: no job {jb}"))
                && !String::from_utf8_lossy(&o.stdout).contains("secret"),
            "{args:?}"
        );
    }
    let o = a.gpumem(
        &shared,
        &["job", &ja.to_string(), "--log", "--server", &s.url],
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).contains(&format!("secret-of-{}", a.name)),
        "A reads its own log"
    );
    assert_eq!(s.state(jb), "running", "B's job was not cancelled by A");
    // Root and the admin group see both; each owner cancels their own.
    assert_eq!(
        serde_json::from_str::<Vec<serde_json::Value>>(&s.run(&["jobs", "--json"]))
            .unwrap()
            .len(),
        2
    );
    let seen = c.gpumem(&shared, &["jobs", "--server", &s.url, "--json"]);
    assert_eq!(
        serde_json::from_slice::<Vec<serde_json::Value>>(&seen.stdout)
            .unwrap()
            .len(),
        2,
        "{}",
        String::from_utf8_lossy(&seen.stderr)
    );
    for (u, id) in [(&a, ja), (&b, jb)] {
        assert!(
            u.gpumem(&shared, &["cancel", &id.to_string(), "--server", &s.url])
                .status
                .success()
        );
        s.wait_until(|| s.state(id) == "cancelled", "the owner cancels");
    }
    // A daemon that is not root runs only its own user's jobs.
    let mut own = {
        use std::os::unix::process::CommandExt;
        let socket = shared.join("a.sock");
        let mut c = Command::new(bin());
        c.args([
            "serve",
            "--fake-gpus",
            "1xa100-40gb",
            "--state",
            shared.join("a-state").to_str().unwrap(),
            "--socket",
            socket.to_str().unwrap(),
        ]);
        c.uid(a.uid)
            .gid(a.gid)
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let url = format!("unix:{}", shared.join("a.sock").display());
    s.wait_until(
        || {
            a.gpumem(&shared, &["jobs", "--server", &url])
                .status
                .success()
        },
        "A's own daemon answers",
    );
    // B's client will not talk to a socket A owns (it could be A's trap for B's jobs) ...
    let o = b.gpumem(
        &shared,
        &[
            "submit",
            "--server",
            &url,
            "--mem-mib",
            "10",
            "--",
            "/usr/bin/id",
        ],
    );
    assert_eq!(o.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains(&format!(
            "the socket belongs to uid {}, neither root nor you",
            a.uid
        )),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // ... and A's daemon refuses B's job when B's request reaches it anyway.
    let raw = format!(
        "import socket; s = socket.socket(socket.AF_UNIX); s.connect('{}'); b = b'{{\"command\": [\"/usr/bin/id\"], \"mem_mib\": 10}}'; s.sendall(b'POST /jobs HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json\\r\\nConnection: close\\r\\nContent-Length: %d\\r\\n\\r\\n' % len(b) + b); print(s.makefile('rb').read().decode())",
        shared.join("a.sock").display()
    );
    let o = {
        use std::os::unix::process::CommandExt;
        Command::new("python3")
            .args(["-c", &raw])
            .uid(b.uid)
            .gid(b.gid)
            .output()
            .unwrap()
    };
    let _ = own.kill();
    let _ = own.wait();
    let answer = String::from_utf8_lossy(&o.stdout);
    assert!(
        answer.starts_with("HTTP/1.1 403")
            && answer.contains(&format!(
                "this daemon runs as {0} and can run jobs only as {0}, not as {1}",
                a.name, b.name
            )),
        "{answer} {}",
        String::from_utf8_lossy(&o.stderr)
    );
    // Private state: the directory 0700, its files 0600.
    let state = d.join("state");
    assert_eq!(
        std::fs::metadata(&state).unwrap().permissions().mode() & 0o777,
        0o700
    );
    for f in [
        state.join("jobs.db"),
        state.join(format!("jobs/{ja}/log")),
        state.join(format!("jobs/{ja}/procs")),
    ] {
        assert_eq!(
            std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o600,
            "{}",
            f.display()
        );
    }
}

/// An invalid job is refused alike by every way in — the command line's flags, a TOML job file,
/// JSON over the daemon's API, a trace file's header — with the same one-line message naming
/// the field (and, for files, where).
#[test]
fn an_invalid_job_is_refused_alike_by_every_entry_point() {
    let d = dir("vocabulary");
    let s = Server::start(&d);
    let mlp = "mlp:input=8,output=2,depth=1";
    // (what, flags, options as a TOML inline table, the same as JSON, the model, the message)
    type Case<'a> = (&'a str, &'a [&'a str], &'a str, &'a str, &'a str, &'a str);
    let cases: [Case; 5] = [
        (
            "a negative LoRA alpha",
            &["--lora", "r=8,alpha=-1,targets=c_attn"],
            "{ lora = { rank = 8, alpha = -1.0, targets = [\"c_attn\"] } }",
            r#"{"lora": {"rank": 8, "alpha": -1.0, "targets": ["c_attn"]}}"#,
            "hf:gpt2",
            "lora alpha -1 is not a positive finite number",
        ),
        (
            "a LoRA rank of zero",
            &["--lora", "r=0,targets=c_attn"],
            "{ lora = { rank = 0, alpha = 8.0, targets = [\"c_attn\"] } }",
            r#"{"lora": {"rank": 0, "alpha": 8.0, "targets": ["c_attn"]}}"#,
            "hf:gpt2",
            "lora rank (r) must be at least 1",
        ),
        (
            "an unknown ZeRO stage",
            &["--strategy", "zero4", "--world-size", "2"],
            "{ strategy = { kind = \"zero\", stage = 4, mesh = { shard = 2 } } }",
            r#"{"strategy": {"kind": "zero", "stage": 4, "mesh": {"shard": 2}}}"#,
            "hf:gpt2",
            "strategy.stage: ZeRO stage 4 is not 1, 2 or 3",
        ),
        (
            "a mesh dimension of degree 0",
            &["--strategy", "ddp", "--world-size", "0"],
            "{ strategy = { kind = \"ddp\", mesh = { replicate = 0 } } }",
            r#"{"strategy": {"kind": "ddp", "mesh": {"replicate": 0}}}"#,
            "hf:gpt2",
            "strategy.mesh.replicate has degree 0",
        ),
        (
            "a PyTorch-only option on a native model",
            &["--checkpointing"],
            "{ checkpointing = true }",
            r#"{"checkpointing": true}"#,
            mlp,
            "apply to PyTorch models",
        ),
    ];
    for (what, flags, toml, json, model, message) in cases {
        // The command line.
        let mut args = vec!["estimate", model, "--batch", "8"];
        args.extend(flags);
        common::bad_input(&args, message);
        // A job file, read by the simulator as by `gpumem submit`.
        let jobs = d.join("jobs.toml");
        std::fs::write(
            &jobs,
            format!(
                "[[job]]\nname = \"x\"\narrival_s = 0\nwork_s = 60\nmeasured_mib = 1000\nmodel = \"{model}\"\nbatch = 8\noptions = {toml}\n"
            ),
        )
        .unwrap();
        let o = gpumem(&[
            "simulate",
            "--jobs",
            jobs.to_str().unwrap(),
            "--gpus",
            "2xa100-40gb",
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{what}, job file: {err}");
        assert!(err.contains(message), "{what}, job file: `{err}`");
        assert_eq!(err.trim_end().lines().count(), 1, "{what}: {err}");
        // JSON over the API.
        let body = format!(
            r#"{{"command": ["true"], "gpus": 2, "model": "{model}", "batch": 8, "options": {json}}}"#
        );
        let answer = raw_request(
            &s.url,
            &format!(
                "POST /jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            ),
        );
        assert!(
            answer.starts_with("HTTP/1.1 400") && answer.contains(message),
            "{what}, API: {answer}"
        );
        // A trace file's header.
        let trace = d.join("t.jsonl");
        std::fs::write(
            &trace,
            format!(
                "{{\"format\":\"gpumem-trace\",\"version\":2,\"model\":\"{}\",\"batch_size\":8,\"options\":{json},\"producer\":\"test\",\"iterations\":1}}\n{{\"ev\":\"iteration\"}}\n",
                model.replace('"', "\\\"")
            ),
        )
        .unwrap();
        common::bad_input(&["estimate", trace.to_str().unwrap()], message);
        let o = gpumem(&["estimate", trace.to_str().unwrap()]);
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("line 1"),
            "{what}: where in the trace"
        );
    }
}
