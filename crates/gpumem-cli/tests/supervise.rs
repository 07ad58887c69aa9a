//! The job supervisor (`gpumem _supervise`) as the daemon runs it: a real process per run, its
//! log, exit record and process tracking, with and without a cgroup of its own.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use gpumem_server::launcher::{Exit, JobDir};

fn dir(name: &str) -> JobDir {
    let d = std::env::temp_dir().join(format!("gpumem-supervise-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    JobDir(d)
}

fn supervisor(d: &JobDir, cgroup: bool, argv: &[&str]) -> Child {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpumem"));
    c.arg("_supervise").arg(&d.0);
    if !cgroup {
        c.arg("--no-cgroup");
    }
    c.arg("--").args(argv).process_group(0);
    use std::os::unix::process::CommandExt;
    c.spawn().unwrap()
}

/// Runs `argv` under a supervisor to its end; its exit code.
fn supervise(d: &JobDir, argv: &[&str]) -> i32 {
    supervisor(d, true, argv).wait().unwrap().code().unwrap()
}

fn sh(script: &str) -> Vec<&str> {
    vec!["/bin/sh", "-c", script]
}

fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| !s.rsplit_once(')').unwrap().1.trim_start().starts_with('Z'))
}

fn wait_until(mut f: impl FnMut() -> bool, what: &str) {
    let t = Instant::now();
    while !f() {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "timed out waiting: {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn supervise_records_output_and_exit() {
    let d = dir("ok");
    assert_eq!(
        supervise(&d, &sh("echo hello; echo CUDA out of memory >&2; exit 3")),
        3
    );
    assert_eq!(d.exit(), Some(Exit::Code(3)));
    assert!(d.log_tail(1000).contains("hello") && d.ran_out_of_memory());
    let procs = d.procs().expect("the run's processes are recorded");
    assert!(procs.leader.is_some() && !procs.alive());
    let d = dir("missing");
    assert_eq!(supervise(&d, &["/nonexistent/program"]), 127);
    assert!(d.log_tail(1000).contains("cannot start"));
}

#[test]
fn each_attempt_is_judged_by_its_own_output() {
    let d = dir("attempts");
    let run = |script: &str| supervise(&d, &sh(script));
    assert_eq!(
        run("echo 'torch.OutOfMemoryError: CUDA out of memory.' >&2; exit 1"),
        1
    );
    assert!(d.ran_out_of_memory());
    // Attempt 2 fails otherwise: the OOM of attempt 1 still in the log does not make it one.
    assert_eq!(run("echo 'ValueError: bad label' >&2; exit 1"), 1);
    assert!(!d.ran_out_of_memory());
    assert!(
        d.log_tail(10_000).contains("CUDA out of memory"),
        "the log keeps every attempt"
    );
    // A host allocation failure is not the GPU's.
    assert_eq!(run("echo 'MemoryError: out of memory' >&2; exit 1"), 1);
    assert!(!d.ran_out_of_memory());
    assert_eq!(
        run("echo 'RuntimeError: CUDA error: out of memory' >&2; exit 1"),
        1
    );
    assert!(d.ran_out_of_memory());
}

#[test]
fn arguments_are_not_shell_words() {
    let d = dir("noshell");
    // `;` and `$HOME` reach the program verbatim: no shell in between.
    supervise(&d, &["/bin/echo", "a;", "$HOME"]);
    assert_eq!(d.log_tail(100).trim(), "a; $HOME");
}

/// A finished job's background children, even one that left its process group (setsid), are
/// killed before its end is recorded (issue 14 item 4), cgroup or not.
#[test]
fn leftover_children_are_killed_at_the_end() {
    for cgroup in [true, false] {
        let d = dir(&format!("leftovers-{cgroup}"));
        let pids: PathBuf = d.0.join("pids");
        let script = format!(
            "sleep 30 & echo $! > {p}; setsid sleep 30 & echo $! >> {p}; exit 0",
            p = pids.display()
        );
        let t = Instant::now();
        assert_eq!(
            supervisor(&d, cgroup, &sh(&script)).wait().unwrap().code(),
            Some(0)
        );
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the supervisor waited for its leftovers to end by themselves"
        );
        assert_eq!(d.exit(), Some(Exit::Code(0)));
        for pid in std::fs::read_to_string(&pids).unwrap().split_whitespace() {
            assert!(
                !running(pid.parse().unwrap()),
                "cgroup {cgroup}: leftover {pid} still runs"
            );
        }
    }
}

/// Signals go to the run, not the supervisor: a job that traps SIGTERM runs on (its
/// supervisor with it, no exit recorded) until SIGKILL; a killed supervisor leaves the run
/// tracked by its record (issue 14 item 4).
#[test]
fn the_run_is_tracked_apart_from_its_supervisor() {
    for cgroup in [true, false] {
        let d = dir(&format!("trap-{cgroup}"));
        let mut sup = supervisor(&d, cgroup, &sh("trap '' TERM; sleep 30 & wait; wait"));
        wait_until(
            || d.procs().is_some_and(|p| p.leader.is_some()),
            "the leader is recorded",
        );
        let procs = d.procs().unwrap();
        if !cgroup {
            assert_eq!(procs.cgroup, None, "no cgroup asked for");
        }
        wait_until(|| procs.pids().len() >= 2, "the job and its sleep");
        procs.signal(libc::SIGTERM);
        unsafe { libc::kill(sup.id() as i32, libc::SIGTERM) };
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            sup.try_wait().unwrap().is_none() && d.exit().is_none() && procs.leader_running(),
            "SIGTERM ended the run"
        );
        // Supervisor killed outright: the run goes on, known by its record.
        sup.kill().unwrap();
        sup.wait().unwrap();
        assert!(procs.leader_running() && procs.alive());
        procs.signal(libc::SIGKILL);
        wait_until(|| !procs.alive(), "SIGKILL ends every process of the run");
        assert!(d.exit().is_none(), "nobody recorded an exit");
        procs.remove_cgroup();
    }
}
