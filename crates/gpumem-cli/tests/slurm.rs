//! Issue 17 parts 1–2: gpumem's Slurm hooks (`deploy/slurm/*.lua`) in a real Slurm — munged,
//! slurmctld and slurmd from Debian's packages, started here as a throwaway one-node cluster
//! (its own directory, ports and munge socket; two fake GPUs of 16 shards each declared in
//! gres.conf). Jobs are submitted with `sbatch`, through the client-side filter and without it
//! (the controller's job_submit.lua alone), and what Slurm recorded is read back with `scontrol`.
//! Needs root and the Slurm packages; `scripts/test.sh` installs them and sets
//! GPUMEM_TEST_REQUIRE_SLURM=1, where their absence is a failure.

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

const TOOLS: [&str; 7] = [
    "munged",
    "slurmctld",
    "slurmd",
    "sbatch",
    "scontrol",
    "sinfo",
    "squeue",
];
/// Shards per fake GPU (gres.conf) and the GPU type they are sized as.
const SHARDS: u64 = 16;
const GPU: &str = "h200";

fn which(tool: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain(["/usr/sbin", "/sbin"])
        .map(|d| Path::new(d).join(tool))
        .find(|p| p.is_file())
}

/// Whether the test can run: root and every Slurm tool present.
fn can_run() -> bool {
    // SAFETY: getuid has no preconditions.
    let root = unsafe { libc::getuid() } == 0;
    let missing: Vec<&str> = TOOLS.into_iter().filter(|t| which(t).is_none()).collect();
    if root && missing.is_empty() {
        return true;
    }
    let why = if root {
        format!("missing {}", missing.join(", "))
    } else {
        "not root".to_string()
    };
    assert!(
        std::env::var("GPUMEM_TEST_REQUIRE_SLURM").as_deref() != Ok("1"),
        "GPUMEM_TEST_REQUIRE_SLURM=1 but {why}"
    );
    eprintln!("SKIPPED: the Slurm integration test needs root and the slurm-wlm packages ({why})");
    false
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The throwaway cluster; dropping it stops its daemons.
struct Slurm {
    dir: PathBuf,
    daemons: Vec<Child>,
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for child in self.daemons.iter_mut().rev() {
            // SAFETY: kill on our own child's pid.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Slurm {
    /// Writes the configuration (the hooks installed beside slurm.conf, as an admin does) and
    /// starts munged, slurmctld and slurmd; returns once the node is idle.
    fn start() -> Slurm {
        let dir = std::env::temp_dir().join(format!("gpumem-slurm-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        for sub in [
            "etc",
            "client",
            "state/ctld",
            "state/d",
            "log",
            "run",
            "dev",
        ] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        // munged refuses a socket whose directories not everyone may enter.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let key = dir.join("etc/munge.key");
        let mut bytes = vec![0u8; 1024];
        std::fs::File::open("/dev/urandom")
            .unwrap()
            .read_exact(&mut bytes)
            .unwrap();
        std::fs::write(&key, &bytes).unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o400)).unwrap();
        for gpu in ["gpu0", "gpu1"] {
            let path = std::ffi::CString::new(dir.join("dev").join(gpu).to_str().unwrap()).unwrap();
            // SAFETY: a plain mknod of a character device (the null device's numbers) as root.
            let rc =
                unsafe { libc::mknod(path.as_ptr(), libc::S_IFCHR | 0o644, libc::makedev(1, 3)) };
            assert_eq!(rc, 0, "mknod {path:?}");
        }
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        let host = host.trim().split('.').next().unwrap().to_string();
        let d = dir.display();
        let (ctld_port, d_port) = (free_port(), free_port());
        let conf = format!(
            "ClusterName=gpumemtest\nSlurmctldHost={host}(127.0.0.1)\nSlurmctldPort={ctld_port}\nSlurmdPort={d_port}\n\
             SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\nAuthInfo=socket={d}/run/munge.sock\nCredType=cred/munge\n\
             StateSaveLocation={d}/state/ctld\nSlurmdSpoolDir={d}/state/d\nSlurmctldPidFile={d}/run/slurmctld.pid\nSlurmdPidFile={d}/run/slurmd.pid\n\
             SlurmctldLogFile={d}/log/slurmctld.log\nSlurmdLogFile={d}/log/slurmd.log\n\
             ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\nJobCompType=jobcomp/none\nSwitchType=switch/none\nMpiDefault=none\n\
             SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nGresTypes=gpu,shard\nReturnToService=2\nSchedulerType=sched/builtin\n\
             JobSubmitPlugins=lua\n\
             NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=1000 Gres=gpu:{GPU}:2,shard:{} Features={GPU} State=UNKNOWN\n\
             PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n",
            2 * SHARDS
        );
        // The login nodes' slurm.conf adds the client-side filter; `client/` is one without it.
        std::fs::write(
            dir.join("etc/slurm.conf"),
            format!("{conf}CliFilterPlugins=cli_filter/lua\n"),
        )
        .unwrap();
        std::fs::write(dir.join("client/slurm.conf"), &conf).unwrap();
        std::fs::write(
            dir.join("etc/gres.conf"),
            format!("AutoDetect=off\nName=gpu Type={GPU} File={d}/dev/gpu0\nName=gpu Type={GPU} File={d}/dev/gpu1\nName=shard Count={SHARDS} File={d}/dev/gpu0\nName=shard Count={SHARDS} File={d}/dev/gpu1\n"),
        )
        .unwrap();
        let hooks = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/slurm");
        for lua in ["gpumem.lua", "cli_filter.lua", "job_submit.lua"] {
            std::fs::copy(hooks.join(lua), dir.join("etc").join(lua)).unwrap();
        }
        std::fs::write(
            dir.join("etc/gpumem.toml"),
            format!("[[gpu]]\nprofile = \"{GPU}\"\nshards = {SHARDS}\nfeature = \"{GPU}\"\n"),
        )
        .unwrap();

        let mut slurm = Slurm {
            dir: dir.clone(),
            daemons: Vec::new(),
        };
        let munge = [
            "-F".to_string(),
            format!("--socket={d}/run/munge.sock"),
            format!("--key-file={d}/etc/munge.key"),
            format!("--log-file={d}/log/munged.log"),
            format!("--pid-file={d}/run/munged.pid"),
            format!("--seed-file={d}/run/munged.seed"),
        ];
        slurm.spawn("munged", &munge);
        slurm.wait_for("munged's socket", |_| dir.join("run/munge.sock").exists());
        slurm.spawn("slurmctld", &["-D", "-c"]);
        slurm.wait_for("slurmctld answers", |s| {
            s.run("scontrol", &["ping"]).status.success()
        });
        slurm.spawn("slurmd", &["-D"]);
        slurm.wait_for("the node is idle", |s| {
            String::from_utf8_lossy(&s.run("sinfo", &["-h", "-o", "%t"]).stdout).trim() == "idle"
        });
        slurm
    }

    fn command(&self, tool: &str) -> Command {
        let mut c = Command::new(which(tool).unwrap());
        c.env("SLURM_CONF", self.dir.join("etc/slurm.conf"))
            .env("GPUMEM_BIN", env!("CARGO_BIN_EXE_gpumem"))
            .env("GPUMEM_SLURM_CONFIG", self.dir.join("etc/gpumem.toml"))
            .current_dir(&self.dir);
        c
    }

    fn spawn(&mut self, tool: &str, args: &[impl AsRef<std::ffi::OsStr>]) {
        let log = std::fs::File::create(self.dir.join("log").join(format!("{tool}.out"))).unwrap();
        let child = self
            .command(tool)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.daemons.push(child);
    }

    fn wait_for(&mut self, what: &str, ready: impl Fn(&Slurm) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !ready(self) {
            let exited = self
                .daemons
                .iter_mut()
                .any(|c| c.try_wait().ok().flatten().is_some());
            assert!(
                !exited && Instant::now() < deadline,
                "{what}: not so after {:?}{}; logs:\n{}",
                Duration::from_secs(60) - deadline.saturating_duration_since(Instant::now()),
                if exited { " (a daemon exited)" } else { "" },
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn logs(&self) -> String {
        [
            "slurmctld.log",
            "slurmd.log",
            "munged.log",
            "slurmctld.out",
            "slurmd.out",
            "munged.out",
        ]
        .iter()
        .map(|f| {
            format!(
                "== {f}\n{}",
                std::fs::read_to_string(self.dir.join("log").join(f)).unwrap_or_default()
            )
        })
        .collect()
    }

    fn run(&self, tool: &str, args: &[&str]) -> Output {
        self.command(tool).args(args).output().unwrap()
    }

    /// A batch script in the cluster's directory.
    fn script(&self, name: &str, text: &str) -> String {
        let path = self.dir.join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    }

    /// `sbatch ARGS` through the login nodes' configuration (with the filter) or the plain one.
    fn sbatch(&self, filter: bool, args: &[&str]) -> Output {
        let mut c = self.command("sbatch");
        if !filter {
            c.env("SLURM_CONF", self.dir.join("client/slurm.conf"));
        }
        c.args(args).output().unwrap()
    }

    /// The id of the job `sbatch ARGS` submitted.
    fn submitted(&self, filter: bool, args: &[&str]) -> u64 {
        let o = self.sbatch(filter, args);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            o.status.success(),
            "sbatch {args:?}: {}{out}",
            String::from_utf8_lossy(&o.stderr)
        );
        out.trim()
            .rsplit(' ')
            .next()
            .and_then(|id| id.parse().ok())
            .unwrap_or_else(|| panic!("sbatch said `{out}`"))
    }

    /// `sbatch ARGS` is refused; returns its gpumem line.
    fn refused(&self, filter: bool, args: &[&str]) -> String {
        let jobs_before = self.job_ids();
        let o = self.sbatch(filter, args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success(),
            "sbatch {args:?} was accepted: {}",
            String::from_utf8_lossy(&o.stdout)
        );
        assert_eq!(
            self.job_ids(),
            jobs_before,
            "a refused job left a job behind"
        );
        let ours: Vec<&str> = err.lines().filter(|l| l.contains("gpumem: ")).collect();
        assert_eq!(ours.len(), 1, "not one gpumem line: {err}");
        ours[0].to_string()
    }

    fn job_ids(&self) -> Vec<String> {
        let o = self.run("squeue", &["-h", "-t", "all", "-o", "%i"]);
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// A field of `scontrol show job ID` (the comment whole, others up to a space); "" if absent.
    fn field(&self, id: u64, key: &str) -> String {
        let o = self.run("scontrol", &["show", "job", &id.to_string()]);
        let text = String::from_utf8_lossy(&o.stdout);
        for token in text.lines().map(str::trim) {
            if key == "Comment"
                && let Some(v) = token.strip_prefix("Comment=")
            {
                return v.trim_end().to_string();
            }
            if let Some(v) = token
                .split(' ')
                .find_map(|t| t.strip_prefix(&format!("{key}=")))
            {
                return v.to_string();
            }
        }
        String::new()
    }
}

/// What `gpumem slurm request` decides for a script: (gres, comment).
fn decided(slurm: &Slurm, script: &str, comment: Option<&str>) -> (String, String) {
    let config = slurm.dir.join("etc/gpumem.toml");
    let mut args = vec![
        "slurm",
        "request",
        script,
        "--config",
        config.to_str().unwrap(),
    ];
    if let Some(c) = comment {
        args.extend(["--comment", c]);
    }
    let o = common::gpumem(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    let get = |k: &str| {
        out.lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")))
            .unwrap_or_default()
            .to_string()
    };
    (get("gres"), get("comment"))
}

/// The bound a gpumem comment states, and the shards it takes of one GPU.
fn shards_of(comment: &str) -> u64 {
    let bound: u64 = comment
        .split(' ')
        .find_map(|t| t.strip_prefix("bound_mib="))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no bound in `{comment}`"));
    (bound * SHARDS).div_ceil(capacity_mib())
}

/// The H200 profile's memory, MiB, as `gpumem gpus` lists it.
fn capacity_mib() -> u64 {
    let o = common::gpumem(&["gpus", "--json"]);
    let gpus: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    gpus.as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == GPU)
        .and_then(|g| g["capacity_mib"].as_u64())
        .unwrap()
}

#[test]
fn slurm_places_jobs_by_gpumem_estimate() {
    if !can_run() {
        return;
    }
    let mut slurm = Slurm::start();
    let fits = slurm.script("fits.sh", "#!/bin/sh\n#SBATCH --time=5\n#GPUMEM model=mlp:input=4096,output=10,depth=4 batch=4096 precision=amp-bf16\n#GPUMEM optimizer=adamw\nsleep 1\n");
    let (gres, comment) = decided(&slurm, &fits, None);
    let shards = shards_of(&comment);
    assert!(
        shards >= 1 && gres == format!("shard:{shards}"),
        "{gres} {comment}"
    );

    // A fitting job, through the client-side filter: the derived shards, the feature of the GPU
    // type it was sized for, and the estimate in its comment. It then runs on its shards.
    let first = slurm.submitted(true, &[&fits]);
    assert_eq!(
        slurm.field(first, "TresPerNode"),
        format!("gres:shard:{shards}")
    );
    assert_eq!(slurm.field(first, "Features"), GPU);
    assert_eq!(slurm.field(first, "Comment"), comment);
    assert!(comment.contains("model=mlp:input=4096,output=10,depth=4 batch=4096 precision=amp-bf16 optimizer=adamw sized_on=h200 estimate_mib="), "{comment}");

    // The same job from a client without the filter: the controller's hook decides the same,
    // replaces a whole-GPU request and keeps the user's own comment.
    let plain = slurm.submitted(false, &["--gres=gpu:1", "--comment=run 7", &fits]);
    assert_eq!(
        slurm.field(plain, "TresPerNode"),
        format!("gres:shard:{shards}")
    );
    assert_eq!(slurm.field(plain, "Comment"), format!("run 7 {comment}"));

    // A job without #GPUMEM is untouched, with either configuration.
    let other = slurm.script(
        "other.sh",
        "#!/bin/sh\n#SBATCH --time=5\n# GPUMEM is not a directive here\nsleep 0\n",
    );
    for filter in [true, false] {
        let id = slurm.submitted(filter, &["--gres=gpu:1", "--comment=just a note", &other]);
        assert_eq!(
            (
                slurm.field(id, "TresPerNode"),
                slurm.field(id, "Comment"),
                slurm.field(id, "Features")
            ),
            ("gres:gpu:1".into(), "just a note".into(), "(null)".into())
        );
    }

    // A job no GPU here holds is rejected with the reason; a malformed directive gets a
    // one-line error at submission and nothing is recorded. Both with and without the filter.
    let huge = slurm.script(
        "huge.sh",
        "#!/bin/sh\n#GPUMEM model=mlp:input=65536,output=10,depth=8 batch=262144\nsleep 0\n",
    );
    let bad = slurm.script(
        "bad.sh",
        "#!/bin/sh\n#GPUMEM model=mlp:input=8 batch=64 colour=red\nsleep 0\n",
    );
    for filter in [true, false] {
        let why = slurm.refused(filter, &[&huge]);
        assert!(
            why.contains("fits on no GPU of this cluster: its upper bound needs")
                && why.contains("MiB h200"),
            "{why}"
        );
        let why = slurm.refused(filter, &[&bad]);
        assert!(
            why.contains("#GPUMEM line 2: unknown key `colour`"),
            "{why}"
        );
        let why = slurm.refused(filter, &["--comment=gpumem: batch=many", &fits]);
        assert!(
            why.contains("the comment's batch: `many` is not a whole number"),
            "{why}"
        );
    }

    // A login node whose gpumem is missing refuses the job with the shell's reason, never
    // sends it half-sized.
    let o = slurm
        .command("sbatch")
        .env("GPUMEM_BIN", "/nonexistent/gpumem")
        .arg(&fits)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("gpumem: ") && err.contains("/nonexistent/gpumem"),
        "{err}"
    );

    // A PyTorch model: the controller never traces, so without the client's estimate it is
    // refused, and with it (the comment `gpumem slurm request` writes) placed by it.
    let resnet = slurm.script(
        "resnet.sh",
        "#!/bin/sh\n#GPUMEM model=torchvision:resnet18 batch=2\nsleep 0\n",
    );
    let why = slurm.refused(false, &[&resnet]);
    assert!(
        why.contains(
            "torchvision:resnet18 must be traced to be sized, which the controller does not do"
        ),
        "{why}"
    );
    let stated = "gpumem: model=torchvision:resnet18 batch=2 sized_on=h200 estimate_mib=20000 bound_mib=20500 shards=3";
    let id = slurm.submitted(false, &["--comment", stated, &resnet]);
    assert_eq!(
        slurm.field(id, "TresPerNode"),
        format!("gres:shard:{}", shards_of(stated))
    );
    if common::torch("the Slurm filter tracing a PyTorch model") {
        // The client side traces it (as the submitting user, on the login node).
        let (_, comment) = decided(&slurm, &resnet, None);
        let id = slurm.submitted(true, &[&resnet]);
        assert_eq!(
            (slurm.field(id, "Comment"), slurm.field(id, "TresPerNode")),
            (
                comment.clone(),
                format!("gres:shard:{}", shards_of(&comment))
            )
        );
    }

    // The first job ran on its shards.
    slurm.wait_for("the fitting job completed", |s| {
        s.field(first, "JobState") == "COMPLETED"
    });
}
