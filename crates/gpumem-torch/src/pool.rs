//! One tracer process per gpumem process and interpreter (python/gpumem_trace/pool.py): it
//! imports torch and each model library once and forks a copy of itself for every trace, so
//! that the traces of a plan, run side by side, do not each pay the imports (seconds each).
//!
//! Each trace is a request line `{"id", "request", "log"}` on the pool's stdin (`request`: the
//! tracer's [`crate::TracerRequest`]); the answer line `{"id", "code"}` comes back on its stdout
//! when the fork ends (its output is in `log`, its answer in the request's `result` file). A
//! fork that outlives its deadline is killed with all it forked (`{"kill": id}`). The pool ends
//! at the end of its stdin: when this process exits, killed or not. Where the pool
//! cannot be used (not Linux, a path that is not UTF-8, a pool that died), the caller runs the
//! tracer as a process of its own.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a killed fork's answer is waited for.
const KILL_GRACE: Duration = Duration::from_secs(5);

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

    fn send(&self, line: serde_json::Value) -> Result<(), ()> {
        let mut stdin = self.stdin.lock().unwrap_or_else(|e| e.into_inner());
        stdin
            .0
            .write_all(format!("{line}\n").as_bytes())
            .and_then(|()| stdin.0.flush())
            .map_err(|_| ())
    }

    /// Runs the tracer's `request` in a fork, its output into `log`: its exit code (`None`: a
    /// signal ended it), `Ok(None)` where it outlived `deadline` and was killed, or `Err` where
    /// the pool could not run it (the caller runs the tracer itself).
    pub(crate) fn run(
        &self,
        request: &serde_json::Value,
        log: &Path,
        deadline: Duration,
    ) -> Result<Option<Option<i32>>, ()> {
        let log = log.to_str().ok_or(())?;
        let id = {
            let mut stdin = self.stdin.lock().unwrap_or_else(|e| e.into_inner());
            stdin.1 += 1;
            stdin.1
        };
        self.send(serde_json::json!({"id": id, "request": request, "log": log}))?;
        // Past the deadline the fork is killed (with all it forked); the pool answers once it is
        // gone. Once killed, the run is over whatever the pool does: never run it again.
        let end = Instant::now() + deadline;
        let mut killed: Option<Instant> = None;
        let (lock, answered) = &*self.answers;
        let mut answers = lock.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(code) = answers.codes.remove(&id) {
                return Ok(if killed.is_some() { None } else { Some(code) });
            }
            let now = Instant::now();
            match killed {
                Some(_) if answers.closed => return Ok(None),
                None if answers.closed => return Err(()),
                // The pool did not answer the kill in time: the trace is given up all the same.
                Some(given_up) if now >= given_up => return Ok(None),
                None if now >= end => {
                    drop(answers);
                    killed = Some(now + KILL_GRACE);
                    let _ = self.send(serde_json::json!({"kill": id}));
                    answers = lock.lock().unwrap_or_else(|e| e.into_inner());
                    continue;
                }
                _ => {}
            }
            let until = killed.unwrap_or(end);
            answers = answered
                .wait_timeout(answers, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}
