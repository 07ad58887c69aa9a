//! Starting, watching and stopping job processes.
//!
//! Each run goes through a supervisor — the `gpumem` binary itself (`gpumem _supervise DIR --
//! ARGV`) — in a new process group. The supervisor writes its pid to `DIR/pid`, runs the job
//! with stdout and stderr appended to `DIR/log`, and writes the exit status to `DIR/exit` when
//! it ends. So the status survives a restart of the daemon: a re-started daemon re-attaches to
//! a live supervisor and learns the outcome from the file. No shell is involved unless the job
//! asks for one.

use std::collections::BTreeMap;
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

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
    /// Where a job on a fake GPU reports the memory it "uses" (bytes, decimal).
    pub fn fake_memory(&self) -> PathBuf {
        self.0.join("fake_memory")
    }

    /// The supervisor's pid, once it has written it.
    pub fn pid(&self) -> Option<u32> {
        fs::read_to_string(self.pid_file()).ok()?.trim().parse().ok()
    }

    /// The run's exit status, once it has ended.
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
        let Ok(mut f) = fs::File::open(self.log()) else { return String::new() };
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        let _ = f.seek(SeekFrom::Start(len.saturating_sub(bytes)));
        let mut buf = Vec::new();
        let _ = f.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// Whether the last attempt's output (its last 64 KiB) says it ran out of GPU memory.
    pub fn ran_out_of_memory(&self) -> bool {
        let start: u64 = fs::read_to_string(self.attempt_start_file()).ok().and_then(|t| t.trim().parse().ok()).unwrap_or(0);
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
}

/// Why a run could not be started.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The job's directory could not be created.
    #[error("{dir}: {source}")]
    JobDir { dir: String, source: std::io::Error },
    #[error("cannot start the supervisor {supervisor}: {source}")]
    Supervisor { supervisor: String, source: std::io::Error },
}

/// Starts a run under a supervisor in its own process group. Clears the previous run's pid and
/// exit files first.
pub fn launch(supervisor: &Path, l: &Launch) -> Result<Child, LaunchError> {
    fs::create_dir_all(&l.dir.0).map_err(|source| LaunchError::JobDir { dir: l.dir.0.display().to_string(), source })?;
    for f in [l.dir.pid_file(), l.dir.exit_file(), l.dir.fake_memory()] {
        let _ = fs::remove_file(f);
    }
    let argv: Vec<String> = if l.request.shell { vec!["/bin/sh".into(), "-c".into(), l.request.command[0].clone()] } else { l.request.command.clone() };
    let mut cmd = Command::new(supervisor);
    cmd.arg("_supervise").arg(&l.dir.0).arg("--").args(&argv);
    let visible: Vec<String> = l.gpus.iter().map(u32::to_string).collect();
    let mut env: BTreeMap<String, String> = l.request.env.clone();
    env.insert("CUDA_VISIBLE_DEVICES".into(), visible.join(","));
    env.insert("GPUMEM_JOB_ID".into(), l.job_id.to_string());
    env.insert("GPUMEM_JOB_ATTEMPT".into(), l.attempt.to_string());
    if l.fake {
        env.insert("GPUMEM_FAKE_MEMORY_FILE".into(), l.dir.fake_memory().display().to_string());
    }
    cmd.envs(env);
    if let Some(cwd) = &l.request.cwd {
        cmd.current_dir(cwd);
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).process_group(0);
    cmd.spawn().map_err(|source| LaunchError::Supervisor { supervisor: supervisor.display().to_string(), source })
}

/// The supervisor's body: run `argv`, log its output, record its exit. Returns the exit code to
/// leave with.
pub fn supervise(dir: &Path, argv: &[String]) -> i32 {
    let dir = JobDir(dir.to_path_buf());
    // The job's files are private to the daemon's user (0600), as its store is.
    let private = || {
        use std::os::unix::fs::OpenOptionsExt;
        let mut o = fs::OpenOptions::new();
        o.create(true).mode(0o600);
        o
    };
    let write = |path: PathBuf, text: String| {
        // Written then renamed: a reader never sees half a file.
        let tmp = path.with_extension("tmp");
        private().write(true).truncate(true).open(&tmp).and_then(|mut f| std::io::Write::write_all(&mut f, text.as_bytes())).and_then(|_| fs::rename(&tmp, &path))
    };
    if write(dir.pid_file(), std::process::id().to_string()).is_err() {
        return 125;
    }
    let log = match private().append(true).open(dir.log()) {
        Ok(f) => f,
        Err(_) => return 125,
    };
    let start = log.metadata().map(|m| m.len()).unwrap_or(0);
    if write(dir.attempt_start_file(), start.to_string()).is_err() {
        return 125;
    }
    let Some((program, args)) = argv.split_first() else { return 125 };
    let status = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map(Stdio::from).unwrap_or(Stdio::null()))
        .stderr(Stdio::from(log))
        .status();
    let (exit, code) = match status {
        Ok(s) => match (s.code(), s.signal()) {
            (Some(c), _) => (format!("code {c}"), c),
            (None, Some(sig)) => (format!("signal {sig}"), 128 + sig),
            _ => ("code 125".into(), 125),
        },
        Err(e) => {
            let _ = fs::OpenOptions::new().append(true).open(dir.log()).map(|mut f| {
                use std::io::Write;
                let _ = writeln!(f, "gpumem: cannot start `{program}`: {e}");
            });
            ("code 127".into(), 127)
        }
    };
    let _ = write(dir.exit_file(), exit);
    code
}

/// Sends `signal` to the process group led by `pid`.
pub fn signal_group(pid: u32, signal: i32) {
    // SAFETY: kill(2) with a negative pid addresses a process group; no memory is involved.
    unsafe {
        libc::kill(-(pid as i32), signal);
    }
}

/// Whether `pid` is still one of gpumem's supervisors (zombies included; reap children before
/// asking). Where /proc exists the command line must name `_supervise`, so a pid the system has
/// since given to another program does not keep a finished job "running".
pub fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence and permission.
    if unsafe { libc::kill(pid as i32, 0) } != 0 {
        return false;
    }
    match fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(cmd) => cmd.split(|&b| b == 0).any(|arg| arg == b"_supervise"),
        Err(_) => !Path::new("/proc/self").exists(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> JobDir {
        let d = std::env::temp_dir().join(format!("gpumem-launch-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        JobDir(d)
    }

    #[test]
    fn supervise_records_output_and_exit() {
        let d = dir("ok");
        let code = supervise(&d.0, &["/bin/sh".into(), "-c".into(), "echo hello; echo CUDA out of memory >&2; exit 3".into()]);
        assert_eq!(code, 3);
        assert_eq!(d.exit(), Some(Exit::Code(3)));
        assert_eq!(d.pid(), Some(std::process::id()));
        assert!(d.log_tail(1000).contains("hello") && d.ran_out_of_memory());
        let d = dir("missing");
        assert_eq!(supervise(&d.0, &["/nonexistent/program".into()]), 127);
        assert!(d.log_tail(1000).contains("cannot start"));
    }

    #[test]
    fn each_attempt_is_judged_by_its_own_output() {
        let d = dir("attempts");
        let run = |script: &str| supervise(&d.0, &["/bin/sh".into(), "-c".into(), script.into()]);
        assert_eq!(run("echo 'torch.OutOfMemoryError: CUDA out of memory.' >&2; exit 1"), 1);
        assert!(d.ran_out_of_memory());
        // Attempt 2 fails otherwise: the OOM of attempt 1 still in the log does not make it one.
        assert_eq!(run("echo 'ValueError: bad label' >&2; exit 1"), 1);
        assert!(!d.ran_out_of_memory());
        assert!(d.log_tail(10_000).contains("CUDA out of memory"), "the log keeps every attempt");
        // A host allocation failure is not the GPU's.
        assert_eq!(run("echo 'MemoryError: out of memory' >&2; exit 1"), 1);
        assert!(!d.ran_out_of_memory());
        assert_eq!(run("echo 'RuntimeError: CUDA error: out of memory' >&2; exit 1"), 1);
        assert!(d.ran_out_of_memory());
    }

    #[test]
    fn only_supervisors_count_as_alive() {
        assert!(!alive(std::process::id()), "the test runner is not a supervisor");
        assert!(!alive(u32::MAX / 2), "no such process");
    }

    #[test]
    fn arguments_are_not_shell_words() {
        let d = dir("noshell");
        // `;` and `$HOME` reach the program verbatim: no shell in between.
        supervise(&d.0, &["/bin/echo".into(), "a;".into(), "$HOME".into()]);
        assert_eq!(d.log_tail(100).trim(), "a; $HOME");
    }
}
