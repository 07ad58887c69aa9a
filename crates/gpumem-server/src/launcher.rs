//! Starting, watching and stopping job processes.
//!
//! Each run goes through a supervisor — the `gpumem` binary itself (`gpumem _supervise DIR
//! [--no-cgroup] -- ARGV`) — in a process group of its own. The supervisor
//! 1. writes its pid to `DIR/pid`;
//! 2. makes the run a cgroup v2 directory of its own where the machine lets it (else the run is
//!    known by its process group alone) and records it in `DIR/procs` *before* the program can
//!    run, so a run whose supervisor is killed is never taken for one that never started;
//! 3. starts the program as the leader of a new process group (inside that cgroup), its output
//!    appended to `DIR/log`, and records the leader (pid and start time) in `DIR/procs`;
//! 4. when the leader ends, kills what the run left behind — its cgroup, its group, and every
//!    descendant (the supervisor is their subreaper, so none escapes by double-forking) — and
//!    waits until none is left;
//! 5. only then writes the exit status to `DIR/exit`.
//!
//! So `DIR/exit` means "over, every process gone", and a daemon that restarts re-attaches to a
//! run whose processes live, whether or not its supervisor does (`DIR/procs` says which they
//! are). Signals for a run go to its processes, never to the supervisor, which ignores
//! SIGTERM, SIGINT and SIGHUP: the end of a run is its to record. No shell is involved unless
//! the job asks for one.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crate::identity::User;
use crate::wire::JobRequest;

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }
    pub fn code(self) -> i32 {
        match self {
            Exit::Code(c) => c,
            Exit::Signal(s) => 128 + s,
        }
    }
}

/// Log lines that mean the job ran out of GPU memory: CUDA's and PyTorch's own messages only (a
/// host `MemoryError: ... out of memory` is not the GPU's, and re-running alone would not help).
pub const OOM_PATTERNS: [&str; 6] = [
    "CUDA out of memory",
    "CUDA error: out of memory",
    "OutOfMemoryError",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "cudaErrorMemoryAllocation",
];

/// The files of one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobDir(pub PathBuf);

impl JobDir {
    pub fn new(state: &Path, id: u64) -> JobDir {
        JobDir(state.join("jobs").join(id.to_string()))
    }
    pub fn log(&self) -> PathBuf {
        self.0.join("log")
    }
    pub fn pid_file(&self) -> PathBuf {
        self.0.join("pid")
    }
    pub fn exit_file(&self) -> PathBuf {
        self.0.join("exit")
    }
    /// Where the current attempt's output starts in the log (a byte offset): the log keeps every
    /// attempt, but each run is judged by its own output.
    pub fn attempt_start_file(&self) -> PathBuf {
        self.0.join("attempt_start")
    }
    /// The run's processes (`JobProcs` as TOML): written before the program can run.
    pub fn procs_file(&self) -> PathBuf {
        self.0.join("procs")
    }
    /// Where a job on a fake GPU reports the memory it "uses" (bytes, decimal).
    pub fn fake_memory(&self) -> PathBuf {
        self.0.join("fake_memory")
    }

    /// The supervisor's pid, once it has written it.
    pub fn pid(&self) -> Option<u32> {
        fs::read_to_string(self.pid_file())
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Whether `pid` is still this run's supervisor (zombies included; reap children before
    /// asking). Where /proc exists its command line must be `… _supervise DIR …`, so a pid the
    /// system has since given to another program, or to another job's supervisor, does not
    /// keep a finished run "supervised".
    pub fn supervised_by(&self, pid: u32) -> bool {
        // SAFETY: signal 0 only checks for existence and permission.
        if unsafe { libc::kill(pid as i32, 0) } != 0 {
            return false;
        }
        match fs::read(format!("/proc/{pid}/cmdline")) {
            Ok(cmd) => {
                let args: Vec<&[u8]> = cmd.split(|&b| b == 0).collect();
                args.windows(2)
                    .any(|w| w[0] == b"_supervise" && w[1] == self.0.as_os_str().as_encoded_bytes())
            }
            Err(_) => !Path::new("/proc/self").exists(),
        }
    }

    /// The run's processes, once its supervisor is about to start the program.
    pub fn procs(&self) -> Option<JobProcs> {
        toml::from_str(&fs::read_to_string(self.procs_file()).ok()?).ok()
    }

    /// The run's exit status, once it has ended and every process of it is gone.
    pub fn exit(&self) -> Option<Exit> {
        let text = fs::read_to_string(self.exit_file()).ok()?;
        let (kind, n) = text.trim().split_once(' ')?;
        let n: i32 = n.parse().ok()?;
        match kind {
            "code" => Some(Exit::Code(n)),
            "signal" => Some(Exit::Signal(n)),
            _ => None,
        }
    }

    /// The last `bytes` of the log.
    pub fn log_tail(&self, bytes: u64) -> String {
        let Ok(mut f) = fs::File::open(self.log()) else {
            return String::new();
        };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(bytes)));
        let mut buf = Vec::new();
        let _ = f.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// Whether the last attempt's output (its last 64 KiB) says it ran out of GPU memory.
    pub fn ran_out_of_memory(&self) -> bool {
        let start: u64 = fs::read_to_string(self.attempt_start_file())
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        let len = fs::metadata(self.log()).map(|m| m.len()).unwrap_or(0);
        let tail = self.log_tail(len.saturating_sub(start).min(64 * 1024));
        OOM_PATTERNS.iter().any(|p| tail.contains(p))
    }
}

/// What to launch.
pub struct Launch<'a> {
    pub request: &'a JobRequest,
    pub dir: &'a JobDir,
    pub gpus: &'a [u32],
    pub job_id: u64,
    pub attempt: u32,
    /// Set `GPUMEM_FAKE_MEMORY_FILE` (fake GPUs).
    pub fake: bool,
    /// How the supervisor runs the program (a daemon running as root runs it as its owner).
    pub how: Supervision,
}

/// How a supervisor runs its program (`gpumem _supervise`'s options).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Supervision {
    /// Give the run a cgroup v2 directory of its own where the machine allows it.
    pub cgroup: bool,
    /// Switch to this user (its groups too) before the program starts.
    pub run_as: Option<User>,
    /// Start the program in this directory, entered as that user.
    pub cwd: Option<PathBuf>,
}

impl Supervision {
    /// The options as `gpumem _supervise` takes them (before `--`).
    fn args(&self) -> Vec<std::ffi::OsString> {
        let mut a: Vec<std::ffi::OsString> = Vec::new();
        if !self.cgroup {
            a.push("--no-cgroup".into());
        }
        if let Some(u) = self.run_as {
            a.extend([
                "--uid".into(),
                u.uid.to_string().into(),
                "--gid".into(),
                u.gid.to_string().into(),
            ]);
        }
        if let Some(cwd) = &self.cwd {
            a.extend(["--cwd".into(), cwd.clone().into_os_string()]);
        }
        a
    }
}

/// Why a run could not be started.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The job's directory could not be created.
    #[error("{dir}: {source}")]
    JobDir { dir: String, source: std::io::Error },
    #[error("cannot start the supervisor {supervisor}: {source}")]
    Supervisor {
        supervisor: String,
        source: std::io::Error,
    },
}

/// Starts a run under a supervisor in its own process group. Clears the previous run's pid and
/// exit files first.
pub fn launch(supervisor: &Path, l: &Launch) -> Result<Child, LaunchError> {
    fs::create_dir_all(&l.dir.0).map_err(|source| LaunchError::JobDir {
        dir: l.dir.0.display().to_string(),
        source,
    })?;
    for f in [
        l.dir.pid_file(),
        l.dir.procs_file(),
        l.dir.exit_file(),
        l.dir.fake_memory(),
    ] {
        let _ = fs::remove_file(f);
    }
    let argv: Vec<String> = if l.request.shell {
        vec!["/bin/sh".into(), "-c".into(), l.request.command[0].clone()]
    } else {
        l.request.command.clone()
    };
    let mut cmd = Command::new(supervisor);
    cmd.arg("_supervise")
        .arg(&l.dir.0)
        .args(l.how.args())
        .arg("--")
        .args(&argv);
    let visible: Vec<String> = l.gpus.iter().map(u32::to_string).collect();
    let mut env: BTreeMap<String, String> = l.request.env.clone();
    if let Some(u) = l.how.run_as {
        // The owner's own, unless the job sets them: not the daemon's.
        for (key, value) in u.login_env() {
            env.entry(key.into()).or_insert(value);
        }
    }
    env.insert("CUDA_VISIBLE_DEVICES".into(), visible.join(","));
    env.insert("GPUMEM_JOB_ID".into(), l.job_id.to_string());
    env.insert("GPUMEM_JOB_ATTEMPT".into(), l.attempt.to_string());
    if l.fake {
        env.insert(
            "GPUMEM_FAKE_MEMORY_FILE".into(),
            l.dir.fake_memory().display().to_string(),
        );
    }
    cmd.envs(env);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
    cmd.spawn().map_err(|source| LaunchError::Supervisor {
        supervisor: supervisor.display().to_string(),
        source,
    })
}

/// The supervisor's body: run `argv`, log its output, kill what it leaves behind, record its
/// exit. Returns the exit code to leave with.
pub fn supervise(dir: &Path, argv: &[String], how: &Supervision) -> i32 {
    let dir = JobDir(dir.to_path_buf());
    // SAFETY: setting dispositions and a process attribute of this single-threaded process.
    unsafe {
        // Cancelling signals the run's processes; the supervisor stays to record the end.
        for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::signal(sig, libc::SIG_IGN);
        }
        // Orphans of the run become the supervisor's children, so none outlives it unseen.
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    }
    if write_private(&dir.pid_file(), &std::process::id().to_string()).is_err() {
        return 125;
    }
    let log = match private_file().append(true).open(dir.log()) {
        Ok(f) => f,
        Err(_) => return 125,
    };
    let start = log.metadata().map(|m| m.len()).unwrap_or(0);
    if write_private(&dir.attempt_start_file(), &start.to_string()).is_err() {
        return 125;
    }
    let Some((program, args)) = argv.split_first() else {
        return 125;
    };
    // What the program's process needs after the fork, prepared before it.
    let groups: Vec<libc::gid_t> = how.run_as.map(|u| u.groups()).unwrap_or_default();
    let Ok(cwd) = how
        .cwd
        .as_ref()
        .map(|c| std::ffi::CString::new(c.as_os_str().as_encoded_bytes()))
        .transpose()
    else {
        return 125;
    };
    let run_as = how.run_as;
    let mut procs = JobProcs {
        cgroup: how.cgroup.then(new_cgroup).flatten(),
        ..JobProcs::default()
    };
    // Recorded before the program can run: from here on the run may have started.
    if write_private(&dir.procs_file(), &procs.to_toml()).is_err() {
        return 125;
    }
    let join = procs.cgroup.as_ref().and_then(|c| {
        fs::OpenOptions::new()
            .write(true)
            .open(c.join("cgroup.procs"))
            .ok()
    });
    let join_fd = join.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map(Stdio::from).unwrap_or(Stdio::null()))
        .stderr(Stdio::from(log))
        .process_group(0);
    // SAFETY: between fork and exec only async-signal-safe calls (signal, write, setgroups,
    // setgid, setuid, chdir) on values prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
                libc::signal(sig, libc::SIG_DFL);
            }
            if let Some(fd) = join_fd {
                // Into the run's cgroup ("0": the writing process) while still privileged.
                // Should it fail, the process group still tracks the run.
                libc::write(fd, b"0".as_ptr().cast(), 1);
            }
            if let Some(u) = run_as {
                // Groups, then group, then user: each step needs the privilege the next drops.
                let check = |rc: libc::c_int| {
                    if rc == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                };
                check(libc::setgroups(groups.len(), groups.as_ptr()))?;
                check(libc::setgid(u.gid))?;
                check(libc::setuid(u.uid))?;
            }
            if let Some(dir) = &cwd
                && libc::chdir(dir.as_ptr()) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let (exit, code) = match cmd.spawn() {
        Ok(mut child) => {
            procs.leader = Some(child.id());
            procs.leader_start = proc_stat(child.id()).map(|s| s.start);
            let _ = write_private(&dir.procs_file(), &procs.to_toml());
            drop(join);
            match child.wait() {
                Ok(s) => match (s.code(), s.signal()) {
                    (Some(c), _) => (format!("code {c}"), c),
                    (None, Some(sig)) => (format!("signal {sig}"), 128 + sig),
                    _ => ("code 125".into(), 125),
                },
                Err(_) => ("code 125".into(), 125),
            }
        }
        Err(e) => {
            let _ = fs::OpenOptions::new()
                .append(true)
                .open(dir.log())
                .map(|mut f| {
                    use std::io::Write;
                    let _ = writeln!(f, "gpumem: cannot start `{program}`: {e}");
                });
            ("code 127".into(), 127)
        }
    };
    procs.kill_all();
    let _ = write_private(&dir.exit_file(), &exit);
    code
}

/// The job's files are private to the daemon's user (0600), as its store is.
fn private_file() -> fs::OpenOptions {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = fs::OpenOptions::new();
    o.create(true).mode(0o600);
    o
}

/// Written then renamed: a reader never sees half a file.
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    private_file()
        .write(true)
        .truncate(true)
        .open(&tmp)
        .and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes()))?;
    fs::rename(&tmp, path)
}

/// The processes of one run: its leader (the job's first process, which leads a process group
/// of its own) and, where the machine allowed one, the cgroup v2 directory it was started in.
/// Written by the supervisor; read by the daemon, which needs it when the supervisor is gone.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JobProcs {
    /// The leader's pid (absent until the program has been started).
    pub leader: Option<u32>,
    /// The leader's start time (clock ticks after boot): a pid the system has since given to
    /// another process is not the run's.
    pub leader_start: Option<u64>,
    /// The run's cgroup v2 directory (every process the program starts stays in it).
    pub cgroup: Option<PathBuf>,
}

impl JobProcs {
    fn to_toml(&self) -> String {
        toml::to_string(self).expect("plain fields serialize")
    }

    /// The leader's process group, while it can still have members: a pid in use as a group id
    /// is never given to a new process, so a leader pid that now names a process started at
    /// another time means the group has ended.
    fn group(&self) -> Option<u32> {
        let leader = self.leader?;
        match proc_stat(leader) {
            Some(s) if Some(s.start) != self.leader_start => None,
            _ => Some(leader),
        }
    }

    /// Whether the leader still runs (not a zombie).
    pub fn leader_running(&self) -> bool {
        self.leader
            .and_then(proc_stat)
            .is_some_and(|s| Some(s.start) == self.leader_start && s.state != 'Z')
    }

    /// Every live process of the run (zombies are over): the cgroup's and the group's.
    pub fn pids(&self) -> Vec<u32> {
        let stats = all_proc_stats();
        let in_cgroup: Vec<u32> = self
            .cgroup
            .as_ref()
            .and_then(|c| fs::read_to_string(c.join("cgroup.procs")).ok())
            .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
            .unwrap_or_default();
        let group = self.group();
        stats
            .iter()
            .filter(|(pid, s)| s.state != 'Z' && (group == Some(s.pgrp) || in_cgroup.contains(pid)))
            .map(|(pid, _)| *pid)
            .collect()
    }

    /// Whether any process of the run is left.
    pub fn alive(&self) -> bool {
        !self.pids().is_empty()
    }

    /// Sends `signal` to every process of the run.
    pub fn signal(&self, signal: i32) {
        if signal == libc::SIGKILL
            && let Some(c) = &self.cgroup
        {
            // All at once where the kernel has it (5.14): nothing forks past it.
            let _ = fs::write(c.join("cgroup.kill"), "1");
        }
        for pid in self.pids() {
            // SAFETY: kill(2) on a pid; no memory is involved.
            unsafe { libc::kill(pid as i32, signal) };
        }
    }

    /// Kills every process of the run and every descendant of the calling process (a
    /// supervisor is their subreaper), reaps them, returns once none is left, and removes the
    /// run's cgroup.
    pub fn kill_all(&self) {
        let me = std::process::id();
        loop {
            self.signal(libc::SIGKILL);
            let descendants = descendants(me);
            for &pid in &descendants {
                // SAFETY: kill(2) on a pid; no memory is involved.
                unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            }
            // SAFETY: reaps this process's own exited children into a local status.
            unsafe {
                let mut status = 0;
                while libc::waitpid(-1, &mut status, libc::WNOHANG) > 0 {}
            }
            if descendants.is_empty() && !self.alive() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        self.remove_cgroup();
    }

    /// Removes the run's cgroup directory (it must be empty: a cgroup goes with rmdir).
    pub fn remove_cgroup(&self) {
        if let Some(c) = &self.cgroup {
            let _ = fs::remove_dir(c);
        }
    }
}

/// What /proc/PID/stat says of a process.
struct ProcStat {
    state: char,
    ppid: u32,
    pgrp: u32,
    /// Clock ticks after boot.
    start: u64,
}

fn proc_stat(pid: u32) -> Option<ProcStat> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the parenthesised command name: state ppid pgrp session tty tpgid flags minflt
    // cminflt majflt cmajflt utime stime cutime cstime priority nice threads itreal starttime.
    let f: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    Some(ProcStat {
        state: f.first()?.chars().next()?,
        ppid: f.get(1)?.parse().ok()?,
        pgrp: f.get(2)?.parse().ok()?,
        start: f.get(19)?.parse().ok()?,
    })
}

fn all_proc_stats() -> Vec<(u32, ProcStat)> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, proc_stat(pid)?)))
        .collect()
}

/// The live descendants of `root`.
fn descendants(root: u32) -> Vec<u32> {
    let stats = all_proc_stats();
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        let children: Vec<u32> = stats
            .iter()
            .filter(|(pid, s)| s.ppid == parent && !found.contains(pid))
            .map(|(pid, _)| *pid)
            .collect();
        found.extend(children);
        i += 1;
    }
    stats
        .iter()
        .filter(|(pid, s)| *pid != root && s.state != 'Z' && found.contains(pid))
        .map(|(pid, _)| *pid)
        .collect()
}

/// A new cgroup v2 directory for a run, under the calling process's own cgroup, where the
/// machine has cgroup v2 mounted and lets this user make one (else `None`: the process group
/// and the subreaper track the run).
fn new_cgroup() -> Option<PathBuf> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
    // Fields: id parent major:minor root mount-point options … - fstype source options.
    let mount = mountinfo.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        if right.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        left.split_whitespace().nth(4).map(PathBuf::from)
    })?;
    let own = fs::read_to_string("/proc/self/cgroup")
        .ok()?
        .lines()
        .find_map(|l| {
            l.strip_prefix("0::")
                .map(|p| p.trim_start_matches('/').to_string())
        })?;
    let dir = mount
        .join(own)
        .join(format!("gpumem-run-{}", std::process::id()));
    fs::create_dir(&dir).ok()?;
    Some(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The supervisor itself is tested through the binary (crates/gpumem-cli/tests/supervise.rs):
    // it makes its process a subreaper and kills its descendants, which a test runner must not.

    #[test]
    fn only_the_runs_supervisor_counts() {
        let dir = JobDir(PathBuf::from("/nonexistent/jobs/1"));
        assert!(
            !dir.supervised_by(std::process::id()),
            "the test runner is not a supervisor"
        );
        assert!(!dir.supervised_by(u32::MAX / 2), "no such process");
    }

    #[test]
    fn a_reused_leader_pid_is_not_the_run() {
        let me = std::process::id();
        let start = proc_stat(me).unwrap().start;
        let mine = JobProcs {
            leader: Some(me),
            leader_start: Some(start),
            cgroup: None,
        };
        assert!(mine.leader_running());
        let other = JobProcs {
            leader_start: Some(start + 1),
            ..mine
        };
        assert!(!other.leader_running() && other.group().is_none() && other.pids().is_empty());
    }
}
