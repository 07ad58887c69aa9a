//! One tracer process per gpumem process and interpreter (python/gpumem_trace/pool.py): it
//! imports torch and each model library once and forks a copy of itself for every trace, so
//! that the traces of a plan, run side by side, do not each pay the imports (seconds each).
//!
//! Each trace is a request line `{"id", "argv", "log"}` on the pool's stdin; the answer line
//! `{"id", "code"}` comes back on its stdout when the fork ends (its output is in `log`). The
//! pool ends at the end of its stdin: when this process exits, killed or not. Where the pool
//! cannot be used (not Linux, a path that is not UTF-8, a pool that died), the caller runs the
//! tracer as a process of its own.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

/// A running pool: requests are written under `stdin`'s lock; a reader thread files each
/// answer under its id and wakes the waiting callers.
pub(crate) struct Pool {
    stdin: Mutex<(ChildStdin, u64)>,
    answers: Arc<(Mutex<Answers>, Condvar)>,
    _child: Child,
}

#[derive(Default)]
struct Answers {
    /// Request id → the fork's exit code (`None`: ended by a signal).
    codes: HashMap<u64, Option<i32>>,
    /// The pool's stdout ended: it died, and unanswered requests never will be.
    closed: bool,
}

#[derive(serde::Deserialize)]
struct Answer {
    id: u64,
    code: i32,
}

impl Pool {
    /// The pool started with `cmd` (`python -m gpumem_trace.pool`), shared by every caller with
    /// the same `key` (interpreter and package); `None` where it cannot start.
    pub(crate) fn shared(key: String, cmd: impl FnOnce() -> Option<Command>) -> Option<Arc<Pool>> {
        if !cfg!(target_os = "linux") {
            return None;
        }
        static POOLS: OnceLock<Mutex<HashMap<String, Arc<Pool>>>> = OnceLock::new();
        let mut pools = POOLS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pools.get(&key)
            && !p.answers.0.lock().unwrap_or_else(|e| e.into_inner()).closed
        {
            return Some(p.clone());
        }
        let pool = Arc::new(Pool::start(cmd()?)?);
        pools.insert(key, pool.clone());
        Some(pool)
    }

    fn start(mut cmd: Command) -> Option<Pool> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let stdin = child.stdin.take()?;
        let stdout = child.stdout.take()?;
        let answers: Arc<(Mutex<Answers>, Condvar)> = Arc::default();
        let filed = answers.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Ok(a) = serde_json::from_str::<Answer>(&line) {
                    filed
                        .0
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .codes
                        .insert(a.id, (a.code >= 0).then_some(a.code));
                    filed.1.notify_all();
                }
            }
            filed.0.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
            filed.1.notify_all();
        });
        Some(Pool {
            stdin: Mutex::new((stdin, 0)),
            answers,
            _child: child,
        })
    }

    /// Runs the tracer with `argv` in a fork, its output into `log`; its exit code (`None`: a
    /// signal ended it), or `Err` where the pool could not run it (the caller runs the tracer
    /// itself).
    pub(crate) fn run(&self, argv: &[String], log: &Path) -> Result<Option<i32>, ()> {
        let log = log.to_str().ok_or(())?;
        let id = {
            let mut stdin = self.stdin.lock().unwrap_or_else(|e| e.into_inner());
            stdin.1 += 1;
            let id = stdin.1;
            let line = serde_json::json!({"id": id, "argv": argv, "log": log}).to_string();
            stdin
                .0
                .write_all(format!("{line}\n").as_bytes())
                .and_then(|()| stdin.0.flush())
                .map_err(|_| ())?;
            id
        };
        let (lock, answered) = &*self.answers;
        let mut answers = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(code) = answers.codes.remove(&id) {
                return Ok(code);
            }
            if answers.closed {
                return Err(());
            }
            answers = answered.wait(answers).unwrap_or_else(|e| e.into_inner());
        }
    }
}
