//! The daemon's clients: `submit`, `jobs`, `job`, `cancel`, `gpus --server` and `load-test`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use gpumem_server::wire::{GpuView, JobRequest, JobView, Submitted};
use gpumem_workload::Options;
use serde::Deserialize;

use crate::args::WorkloadArgs;
use crate::{CliError, CliResult};

/// How to reach the daemon.
#[derive(Args, Clone)]
pub struct ServerArgs {
    /// The daemon: unix:PATH (its socket) or http://HOST:PORT (default: GPUMEM_SERVER, else
    /// /run/gpumem.sock where a daemon run by root listens, else your own daemon's socket).
    #[arg(long, env = "GPUMEM_SERVER")]
    server: Option<String>,
    /// A file holding the bearer token of a daemon on TCP (default: GPUMEM_TOKEN).
    #[arg(long)]
    token_file: Option<PathBuf>,
}

#[derive(Deserialize)]
struct ErrorBody {
    error: String,
}

/// Where a daemon listens.
enum Endpoint {
    Unix(PathBuf),
    /// HOST:PORT
    Tcp(String),
}

impl ServerArgs {
    pub fn new(server: Option<String>, token_file: Option<PathBuf>) -> ServerArgs {
        ServerArgs { server, token_file }
    }

    /// The daemon's address as given, or the default one.
    fn server(&self) -> String {
        self.server
            .clone()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| {
                let machine = std::path::Path::new(gpumem_server::api::MACHINE_SOCKET);
                let socket = if machine.exists() {
                    machine.to_path_buf()
                } else {
                    gpumem_server::api::default_socket(gpumem_server::identity::User::current())
                };
                format!("unix:{}", socket.display())
            })
    }

    fn endpoint(&self) -> CliResult<Endpoint> {
        let server = self.server();
        if let Some(path) = server.strip_prefix("unix:") {
            return Ok(Endpoint::Unix(path.into()));
        }
        if server.starts_with('/') {
            return Ok(Endpoint::Unix(server.into()));
        }
        match server
            .strip_prefix("http://")
            .map(|h| h.trim_end_matches('/'))
        {
            Some(host) if !host.is_empty() && !host.contains('/') => {
                Ok(Endpoint::Tcp(host.to_string()))
            }
            _ => Err(CliError::input(format!(
                "--server `{server}` is neither unix:PATH nor http://HOST:PORT"
            ))),
        }
    }

    /// Sends a request; a non-2xx answer becomes a one-line error (4xx: bad input, exit 2).
    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&impl serde::Serialize>,
    ) -> CliResult<String> {
        use hyper::header;
        let server = self.server();
        let endpoint = self.endpoint()?;
        if let Endpoint::Unix(path) = &endpoint {
            trusted_socket(path)?;
        }
        let mut req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, "localhost");
        if let Some(t) = gpumem_server::api::Token::from_file_or_env(self.token_file.as_deref())
            .map_err(CliError::input)?
        {
            req = req.header(header::AUTHORIZATION, format!("Bearer {}", t.as_str()));
        }
        let body = match body {
            Some(b) => {
                req = req.header(header::CONTENT_TYPE, "application/json");
                serde_json::to_vec(b).map_err(CliError::other)?
            }
            None => Vec::new(),
        };
        let req = req
            .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
            .map_err(|e| CliError::input(format!("{path}: {e}")))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(CliError::other)?;
        let answer = rt.block_on(async {
            let exchange = async {
                match endpoint {
                    Endpoint::Unix(p) => {
                        exchange(tokio::net::UnixStream::connect(p).await?, req).await
                    }
                    Endpoint::Tcp(host) => {
                        exchange(tokio::net::TcpStream::connect(host).await?, req).await
                    }
                }
            };
            tokio::time::timeout(Duration::from_secs(60), exchange)
                .await
                .unwrap_or_else(|_| Err("no answer within 60 s".into()))
        });
        let (status, text) = answer
            .map_err(|e| CliError::other(format!("{server}: {e} (is `gpumem serve` running?)")))?;
        if (200..300).contains(&status) {
            return Ok(text);
        }
        let msg = serde_json::from_str::<ErrorBody>(&text)
            .map(|e| e.error)
            .unwrap_or(text);
        if (400..500).contains(&status) {
            Err(CliError::input(format!("{status}: {msg}")))
        } else {
            Err(CliError::other(format!("{status}: {msg}")))
        }
    }

    fn get<T: for<'de> Deserialize<'de>>(&self, path: &str) -> CliResult<(T, String)> {
        let text = self.call("GET", path, None::<&()>)?;
        let v = serde_json::from_str(&text)
            .map_err(|e| CliError::other(format!("{}: unexpected answer: {e}", self.server())))?;
        Ok((v, text))
    }
}

/// Refuses a socket that neither root nor the caller owns: in a shared directory such as /tmp
/// another user could have put it there to receive jobs, with their commands and environments.
fn trusted_socket(path: &std::path::Path) -> CliResult<()> {
    use std::os::unix::fs::MetadataExt;
    let me = gpumem_server::identity::User::current().uid;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.uid() != 0 && m.uid() != me => Err(CliError::input(format!(
            "{}: the socket belongs to uid {}, neither root nor you; not sending it a job",
            path.display(),
            m.uid()
        ))),
        _ => Ok(()),
    }
}

/// One HTTP/1 request over `stream`: the answer's status and body.
async fn exchange<S>(
    stream: S,
    req: hyper::Request<http_body_util::Full<hyper::body::Bytes>>,
) -> Result<(u16, String), Box<dyn std::error::Error + Send + Sync>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use http_body_util::BodyExt;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(connection);
    let res = sender.send_request(req).await?;
    let status = res.status().as_u16();
    let body = res.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

#[derive(Args)]
pub struct SubmitArgs {
    /// A job file (TOML with the fields of the API: command = ["python", "train.py"], gpus,
    /// model, batch, mem_mib, env, cwd, priority, expected_s, name, shell).
    file: Option<PathBuf>,
    /// The command to run, after `--` (no shell): `gpumem submit --gpus 1 -- python train.py`.
    #[arg(last = true)]
    cmd: Vec<String>,
    /// Run this string through /bin/sh instead.
    #[arg(long, conflicts_with = "cmd")]
    shell: Option<String>,
    #[arg(long)]
    gpus: Option<u32>,
    #[arg(long)]
    mem_mib: Option<u64>,
    /// Model spec or reference for the estimate (with --batch); the loop options below then
    /// describe its training (a job file's `[options]` table otherwise).
    #[arg(long)]
    model: Option<String>,
    #[arg(long)]
    batch: Option<u64>,
    #[command(flatten)]
    workload: WorkloadArgs,
    #[arg(long)]
    priority: Option<i32>,
    /// Expected run time in seconds (what a backfilling daemon goes by).
    #[arg(long)]
    expected_s: Option<f64>,
    #[arg(long)]
    name: Option<String>,
    #[command(flatten)]
    server: ServerArgs,
    #[arg(long)]
    json: bool,
}

pub fn submit(a: SubmitArgs) -> CliResult {
    let mut req: JobRequest = match &a.file {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| CliError::input(format!("{}: {e}", p.display())))?;
            toml::from_str(&text).map_err(|e| {
                CliError::input(format!(
                    "{}: {}",
                    p.display(),
                    e.to_string().replace('\n', " ")
                ))
            })?
        }
        None => JobRequest {
            command: Vec::new(),
            shell: false,
            name: None,
            cwd: std::env::current_dir()
                .ok()
                .map(|d| d.display().to_string()),
            env: Default::default(),
            gpus: 1,
            model: None,
            batch: None,
            options: Options::default(),
            train_config: None,
            mem_mib: None,
            priority: 0,
            expected_s: None,
        },
    };
    if let Some(s) = &a.shell {
        req.command = vec![s.clone()];
        req.shell = true;
    } else if !a.cmd.is_empty() {
        req.command = a.cmd.clone();
        req.shell = false;
    }
    if req.command.is_empty() {
        return Err(CliError::input(
            "no command: give a job file, `-- PROGRAM ARGS…` or --shell",
        ));
    }
    req.gpus = a.gpus.unwrap_or(req.gpus);
    req.mem_mib = a.mem_mib.or(req.mem_mib);
    if a.model.is_some() {
        req.options = a.workload.options()?;
    }
    if a.gpus.is_none()
        && let Some(s) = req.options.strategy
    {
        // A multi-GPU job's ranks are its GPUs.
        req.gpus = s.world_size();
    }
    req.model = a.model.clone().or(req.model);
    req.batch = a.batch.or(req.batch);
    req.priority = a.priority.unwrap_or(req.priority);
    req.expected_s = a.expected_s.or(req.expected_s);
    req.name = a.name.clone().or(req.name);
    let text = a.server.call("POST", "/jobs", Some(&req))?;
    if a.json {
        println!("{text}");
        return Ok(());
    }
    let s: Submitted = serde_json::from_str(&text).map_err(|e| CliError::other(e.to_string()))?;
    match s.estimate_mib {
        Some(e) => println!(
            "job {} {} (estimate {e:.0} MiB, bound {:.0} MiB)",
            s.id,
            s.state.name(),
            s.bound_mib.unwrap_or(e)
        ),
        None => println!("job {} {}", s.id, s.state.name()),
    }
    Ok(())
}

#[derive(Args)]
pub struct JobsArgs {
    /// Only jobs in this state.
    #[arg(long)]
    state: Option<String>,
    #[command(flatten)]
    server: ServerArgs,
    #[arg(long)]
    json: bool,
}

pub fn jobs(a: JobsArgs) -> CliResult {
    let path = match &a.state {
        Some(s) => format!("/jobs?state={s}"),
        None => "/jobs".into(),
    };
    let (jobs, text): (Vec<JobView>, _) = a.server.get(&path)?;
    if a.json {
        println!("{text}");
        return Ok(());
    }
    println!(
        "{:>6}  {:<15} {:<9} {:>10} {:>10}  command",
        "id", "state", "gpus", "est MiB", "peak MiB"
    );
    for j in jobs {
        let gpus = j
            .assigned
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let cmd = j.request.command.join(" ");
        let f = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.0}"));
        println!(
            "{:>6}  {:<15} {:<9} {:>10} {:>10}  {}",
            j.id,
            j.state.name(),
            gpus,
            f(j.estimate_mib),
            f(j.peak_mib),
            printable(&cmd.chars().take(60).collect::<String>())
        );
    }
    Ok(())
}

#[derive(Args)]
pub struct JobShowArgs {
    id: u64,
    #[command(flatten)]
    server: ServerArgs,
    #[arg(long)]
    json: bool,
    /// Print the last bytes of its log instead.
    #[arg(long)]
    log: bool,
}

pub fn job(a: JobShowArgs) -> CliResult {
    if a.log {
        print!(
            "{}",
            a.server
                .call("GET", &format!("/jobs/{}/log", a.id), None::<&()>)?
        );
        return Ok(());
    }
    let (j, text): (JobView, _) = a.server.get(&format!("/jobs/{}", a.id))?;
    if a.json {
        println!("{text}");
        return Ok(());
    }
    println!(
        "job {} ({})",
        j.id,
        printable(j.request.name.as_deref().unwrap_or("-"))
    );
    println!("  state      {}", j.state.name());
    println!(
        "  command    {}{}",
        printable(&j.request.command.join(" ")),
        if j.request.shell { "  (shell)" } else { "" }
    );
    println!(
        "  gpus       {} requested, on {:?}",
        j.request.gpus, j.assigned
    );
    println!(
        "  memory     estimate {}, bound {}, peak {}",
        mib(j.estimate_mib),
        mib(j.bound_mib),
        mib(j.peak_mib)
    );
    println!("  retries    {}", j.retries);
    if let Some(c) = j.exit_code {
        println!("  exit code  {c}");
    }
    if let Some(e) = &j.error {
        println!("  note       {}", printable(e));
    }
    Ok(())
}

fn mib(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.0} MiB"))
}

#[derive(Args)]
pub struct CancelArgs {
    id: u64,
    #[command(flatten)]
    server: ServerArgs,
}

pub fn cancel(a: CancelArgs) -> CliResult {
    let text = a
        .server
        .call("POST", &format!("/jobs/{}/cancel", a.id), None::<&()>)?;
    let j: JobView = serde_json::from_str(&text).map_err(|e| CliError::other(e.to_string()))?;
    println!(
        "job {}: {}",
        j.id,
        if j.state.is_final() {
            j.state.name()
        } else {
            "cancelling"
        }
    );
    Ok(())
}

/// `gpumem gpus --server`: the daemon's live view.
pub fn live_gpus(server: &ServerArgs, json: bool) -> CliResult {
    let (gpus, text): (Vec<GpuView>, _) = server.get("/gpus")?;
    if json {
        println!("{text}");
        return Ok(());
    }
    for g in gpus {
        println!(
            "gpu {}  {:<26} {:>8.0} / {:>6.0} MiB  util {:>3.0}%  SMACT {}  jobs {:?}",
            g.index,
            g.name,
            g.used_mib,
            g.total_mib,
            g.util * 100.0,
            g.smact.map_or("-".into(), |s| format!("{s:.2}")),
            g.jobs
        );
    }
    Ok(())
}

#[derive(Args)]
pub struct LoadTestArgs {
    /// Submissions to send.
    #[arg(long, default_value_t = 5000)]
    jobs: usize,
    /// Concurrent connections.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Stop sending after this many seconds.
    #[arg(long, default_value_t = 30.0)]
    seconds: f64,
    /// Append each acknowledged job id to FILE as it is answered, and keep going while the
    /// daemon is away (for checking that a killed daemon loses no acknowledged job).
    #[arg(long)]
    acked: Option<PathBuf>,
    #[command(flatten)]
    server: ServerArgs,
}

/// Submits jobs as fast as the daemon takes them; reports the rate and latency percentiles, then
/// checks that every accepted job is stored.
pub fn load_test(a: LoadTestArgs) -> CliResult {
    let acked = match &a.acked {
        Some(p) => Some(std::sync::Mutex::new(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| CliError::input(format!("{}: {e}", p.display())))?,
        )),
        None => None,
    };
    let before = if acked.is_some() {
        0
    } else {
        a.server.get::<Vec<JobView>>("/jobs")?.0.len()
    };
    let started = Instant::now();
    let per = a.jobs.div_ceil(a.concurrency.max(1));
    let results: Vec<(Vec<f64>, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..a.concurrency.max(1))
            .map(|_| {
                s.spawn(|| {
                    let (mut lat, mut failed) = (Vec::with_capacity(per), 0);
                    let req = serde_json::json!({"command": ["true"], "gpus": 1, "mem_mib": 100, "name": "load-test"});
                    for _ in 0..per {
                        if started.elapsed().as_secs_f64() > a.seconds {
                            break;
                        }
                        let t = Instant::now();
                        match a.server.call("POST", "/jobs", Some(&req)) {
                            Ok(text) => {
                                lat.push(t.elapsed().as_secs_f64() * 1e3);
                                if let (Some(file), Ok(s)) = (&acked, serde_json::from_str::<Submitted>(&text)) {
                                    use std::io::Write;
                                    let mut f = file.lock().unwrap_or_else(|p| p.into_inner());
                                    let _ = writeln!(f, "{}", s.id);
                                }
                            }
                            Err(_) => failed += 1,
                        }
                    }
                    (lat, failed)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let elapsed = started.elapsed().as_secs_f64();
    let mut lat: Vec<f64> = results.iter().flat_map(|r| r.0.iter().copied()).collect();
    let failed: usize = results.iter().map(|r| r.1).sum();
    lat.sort_by(f64::total_cmp);
    let pct = |q: f64| {
        lat.get(((q * lat.len() as f64).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0.0)
    };
    if acked.is_some() {
        println!(
            "{} submissions acknowledged in {elapsed:.2} s over {} connections; {failed} failed (the daemon away)",
            lat.len(),
            a.concurrency
        );
        return Ok(());
    }
    let stored = a.server.get::<Vec<JobView>>("/jobs")?.0.len() - before;
    println!(
        "{} submissions accepted in {elapsed:.2} s = {:.0}/s over {} connections; latency p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms; {failed} failed; {stored} stored",
        lat.len(),
        lat.len() as f64 / elapsed,
        a.concurrency,
        pct(0.5),
        pct(0.99),
        lat.last().copied().unwrap_or(0.0)
    );
    if stored != lat.len() {
        return Err(CliError::other(format!(
            "{} submissions were accepted but {stored} are stored",
            lat.len()
        )));
    }
    Ok(())
}

/// Text another user chose (a job's name, command, error), as a terminal shows it safely:
/// control characters (escape sequences that would move the cursor, recolour or retitle the
/// terminal) are written escaped.
fn printable(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(
            super::printable("ok \u{1b}]0;pwned\u{7}name\n"),
            "ok \\u{1b}]0;pwned\\u{7}name\\n"
        );
        assert_eq!(super::printable("plain name"), "plain name");
    }
}
