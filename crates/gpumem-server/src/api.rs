//! The HTTP API (axum): JSON in and out, one-line errors, a body limit; on a Unix socket whose
//! callers are known by their peer credentials, or on TCP behind a bearer token.

use std::net::SocketAddr;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Extension, Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;

use gpumem_workload::train_config::{self, TrainerKind};
use gpumem_workload::{Options, Workload};

use crate::daemon::{CancelError, Daemon};
use crate::identity::User;
use crate::sizing::JobSize;
use crate::wire::{ApiError, JobRequest, JobState};

/// Request bodies above this are refused (413).
pub const MAX_BODY: usize = 64 * 1024;

fn error(status: StatusCode, msg: impl std::fmt::Display) -> Response {
    (
        status,
        axum::Json(ApiError {
            error: msg.to_string().replace('\n', " "),
        }),
    )
        .into_response()
}

/// Why the daemon could not listen (or serve at all).
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    #[error(
        "refusing to listen on {addr} without a token: anyone who can reach it could run commands (--token-file FILE or GPUMEM_TOKEN)"
    )]
    NoToken { addr: SocketAddr },
    /// The async runtime could not be built.
    #[error("{0}")]
    Runtime(std::io::Error),
    #[error("{addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    /// Another daemon answers on the socket.
    #[error("{0} is in use by another gpumem serve")]
    SocketInUse(String),
    /// The bound socket's address could not be read.
    #[error("{0}")]
    LocalAddr(std::io::Error),
}

/// A bearer token: at least [`Token::MIN_BYTES`] printable bytes without spaces, read from a
/// file or the environment (never a command line, which every user can read in /proc).
#[derive(Clone)]
pub struct Token(String);

/// Why a token is refused.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("{file}: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    /// `source_name`: the file or GPUMEM_TOKEN.
    #[error("{source_name}: a token must be at least 16 printable characters without spaces")]
    Weak { source_name: String },
}

impl Token {
    pub const MIN_BYTES: usize = 16;

    /// The token in `text` (one trailing newline allowed, as a file has); `source_name` names
    /// where it came from for the error.
    pub fn new(text: &str, source_name: &str) -> Result<Token, TokenError> {
        let t = text.strip_suffix('\n').unwrap_or(text);
        let t = t.strip_suffix('\r').unwrap_or(t);
        if t.len() < Self::MIN_BYTES || !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::Weak {
                source_name: source_name.to_string(),
            });
        }
        Ok(Token(t.to_string()))
    }

    /// The token in `file`, else in GPUMEM_TOKEN; `None` where neither is given.
    pub fn from_file_or_env(file: Option<&FsPath>) -> Result<Option<Token>, TokenError> {
        match file {
            Some(f) => {
                let text = std::fs::read_to_string(f).map_err(|source| TokenError::Read {
                    file: f.display().to_string(),
                    source,
                })?;
                Token::new(&text, &f.display().to_string()).map(Some)
            }
            None => std::env::var("GPUMEM_TOKEN")
                .ok()
                .map(|t| Token::new(&t, "GPUMEM_TOKEN"))
                .transpose(),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Where the daemon listens.
pub enum Listen {
    /// A Unix socket (mode 0666): each caller is who its peer credentials say.
    Unix(PathBuf),
    /// TCP (opt-in): every request needs the token, whose holder acts as the daemon's user.
    Tcp { addr: SocketAddr, token: Token },
}

/// The daemon's socket when none is named: `/run/gpumem.sock` for a daemon run by root (the
/// machine's), else `$XDG_RUNTIME_DIR/gpumem.sock`, else `/tmp/gpumem-UID.sock`.
pub fn default_socket(user: User) -> PathBuf {
    if user.is_root() {
        return PathBuf::from(MACHINE_SOCKET);
    }
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir).join("gpumem.sock"),
        None => PathBuf::from(format!("/tmp/gpumem-{}.sock", user.uid)),
    }
}

/// The socket of a daemon run by root, which every user of the machine talks to.
pub const MACHINE_SOCKET: &str = "/run/gpumem.sock";

/// The status a failed cancellation answers with.
fn cancel_status(e: &CancelError) -> StatusCode {
    match e {
        CancelError::NoJob(_) => StatusCode::NOT_FOUND,
        CancelError::Ended { .. } => StatusCode::CONFLICT,
        CancelError::Store(_) => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

struct App {
    daemon: Arc<Daemon>,
    token: Option<Token>,
    /// Submissions being sized (traced) at once: `max_traces`.
    traces: tokio::sync::Semaphore,
}

/// The routes.
pub fn router(daemon: Arc<Daemon>, token: Option<Token>) -> Router {
    let traces = tokio::sync::Semaphore::new(daemon.config.max_traces as usize);
    let app = Arc::new(App {
        daemon,
        token,
        traces,
    });
    Router::new()
        .route("/jobs", post(submit).get(list))
        .route("/jobs/{id}", get(one))
        .route("/jobs/{id}/cancel", post(cancel))
        .route("/jobs/{id}/log", get(log))
        .route("/gpus", get(gpus))
        .route("/metrics", get(metrics))
        .layer(middleware::from_fn_with_state(app.clone(), auth))
        .route("/health", get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn(json_errors))
        .with_state(app)
}

/// Every error answer is the documented `{"error": …}`: axum's own refusals (an unknown path's
/// 404, a wrong method's 405, a body over the limit's 413, a query string it cannot read) come
/// as plain text or nothing, and are rewritten here.
async fn json_errors(req: Request, next: Next) -> Response {
    let res = next.run(req).await;
    let status = res.status();
    let json = res
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if json || !(status.is_client_error() || status.is_server_error()) {
        return res;
    }
    let body = axum::body::to_bytes(res.into_body(), 4096)
        .await
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&body).trim().to_string();
    let reason = status
        .canonical_reason()
        .unwrap_or("error")
        .to_ascii_lowercase();
    error(status, if text.is_empty() { reason } else { text })
}

async fn auth(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(token) = &app.token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Constant-time comparison: the token must not leak through timing.
        let token = token.as_str();
        let ok = given.is_some_and(|g| {
            g.len() == token.len()
                && g.bytes()
                    .zip(token.bytes())
                    .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                    == 0
        });
        if !ok {
            return error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
        }
    }
    next.run(req).await
}

/// Runs `f` — a call into the daemon, which takes its ledger's lock — on tokio's blocking pool,
/// never on the async threads; a panic in it answers 500.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Response> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}

/// Who sent a request: set on each connection by [`accept`].
#[derive(Clone, Copy)]
struct Caller(User);

async fn submit(
    State(app): State<Arc<App>>,
    Extension(Caller(caller)): Extension<Caller>,
    body: Bytes,
) -> Response {
    let req: JobRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("bad job: {e}")),
    };
    let d = app.daemon.clone();
    if let Err(e) = d.can_run_as(caller) {
        return error(StatusCode::FORBIDDEN, e);
    }
    if let Err(e) = req.validate(d.gpu_count()) {
        return error(StatusCode::BAD_REQUEST, e);
    }
    /// A size the submitter stated (or none), or gpumem's estimate of the model.
    enum Size {
        Stated(Option<(u64, u64)>),
        Estimated(Box<JobSize>),
    }
    let stated = match stated_by_config(&req, d.config.allow_py_models) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, e),
    };
    let (model, batch, options) = match &stated {
        Some((m, b, o)) => (m.clone(), *b, o.clone()),
        None => (req.model.clone(), req.batch, req.options.clone()),
    };
    let size = match (&model, batch, req.mem_mib) {
        (_, _, Some(mib)) => Size::Stated(Some((mib * gpumem_place::MIB, mib * gpumem_place::MIB))),
        (Some(model), Some(batch), None) => {
            if model.trim_start().starts_with("py:") && !d.config.allow_py_models {
                return error(
                    StatusCode::BAD_REQUEST,
                    "model: py: models run their file's code inside the daemon; this daemon does not accept them (allow_py_models)",
                );
            }
            let workload = match Workload::parse(model, batch, options) {
                Ok(w) => w,
                Err(e) => return error(StatusCode::BAD_REQUEST, format!("model: {e}")),
            };
            // Tracing runs Python: a few at a time, the rest wait their turn.
            let Ok(_turn) = app.traces.acquire().await else {
                return error(StatusCode::SERVICE_UNAVAILABLE, "shutting down");
            };
            let sizer = d.clone();
            match tokio::task::spawn_blocking(move || sizer.size(&workload)).await {
                Ok(Ok(sized)) => Size::Estimated(Box::new(sized)),
                Ok(Err(e)) => return error(StatusCode::BAD_REQUEST, format!("model: {e}")),
                Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            }
        }
        _ => Size::Stated(None),
    };
    let stored = tokio::task::spawn_blocking(move || match size {
        Size::Estimated(sized) => d.submit_sized(caller, req, *sized),
        Size::Stated(stated) => d.submit(caller, req, stated),
    });
    match stored.await {
        Ok(Ok(s)) => (StatusCode::CREATED, axum::Json(s)).into_response(),
        Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, e),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

/// A job's model and batch (each where stated) and its options.
type Stated = (Option<String>, Option<u64>, Options);

/// A job's model, batch and options as its `train_config` states them (the request's own
/// `model` and `batch` first, its `options` beneath what the config states); `None` without one.
fn stated_by_config(req: &JobRequest, allow_py_models: bool) -> Result<Option<Stated>, String> {
    let Some(doc) = &req.train_config else {
        return Ok(None);
    };
    let kind = doc
        .kind
        .as_deref()
        .map(TrainerKind::parse)
        .transpose()
        .map_err(|e| format!("train_config.kind: {e}"))?;
    let dir = std::path::PathBuf::from(req.cwd.as_deref().unwrap_or("."));
    let config = train_config::read_text(&doc.file, &doc.text, &dir, kind)
        .map_err(|e| format!("train_config: {e}"))?;
    let (model, batch, options) = config
        .job(
            req.model.clone(),
            req.batch,
            req.options.values(),
            Some(req.gpus),
        )
        .map_err(|e| format!("train_config: {e}"))?;
    if model
        .as_deref()
        .is_some_and(|m| m.trim_start().starts_with("py:"))
        && !allow_py_models
    {
        return Err("model: py: models run their file's code inside the daemon; this daemon does not accept them (allow_py_models)".into());
    }
    Ok(Some((model, batch, options)))
}

#[derive(Deserialize)]
struct ListQuery {
    state: Option<String>,
}

async fn list(
    State(app): State<Arc<App>>,
    Extension(Caller(caller)): Extension<Caller>,
    Query(q): Query<ListQuery>,
) -> Response {
    let state = match q.state.as_deref().map(|s| JobState::parse(s).ok_or(s)) {
        None => None,
        Some(Ok(s)) => Some(s),
        Some(Err(s)) => return error(StatusCode::BAD_REQUEST, format!("unknown state `{s}`")),
    };
    let d = app.daemon.clone();
    match blocking(move || d.jobs(caller, state)).await {
        Ok(jobs) => axum::Json(jobs).into_response(),
        Err(e) => e,
    }
}

fn bad_id(id: &str) -> Response {
    error(StatusCode::BAD_REQUEST, format!("`{id}` is not a job id"))
}

async fn one(
    State(app): State<Arc<App>>,
    Extension(Caller(caller)): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    let Ok(id) = id.parse::<u64>() else {
        return bad_id(&id);
    };
    let d = app.daemon.clone();
    match blocking(move || d.job(caller, id)).await {
        Ok(Some(j)) => axum::Json(j).into_response(),
        Ok(None) => error(StatusCode::NOT_FOUND, format!("no job {id}")),
        Err(e) => e,
    }
}

async fn cancel(
    State(app): State<Arc<App>>,
    Extension(Caller(caller)): Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    let Ok(id) = id.parse::<u64>() else {
        return bad_id(&id);
    };
    let d = app.daemon.clone();
    match blocking(move || d.cancel(caller, id)).await {
        Ok(Ok(j)) => axum::Json(j).into_response(),
        Ok(Err(e)) => error(cancel_status(&e), e),
        Err(e) => e,
    }
}

#[derive(Deserialize)]
struct LogQuery {
    bytes: Option<u64>,
}

async fn log(
    State(app): State<Arc<App>>,
    Extension(Caller(caller)): Extension<Caller>,
    Path(id): Path<String>,
    Query(q): Query<LogQuery>,
) -> Response {
    let Ok(id) = id.parse::<u64>() else {
        return bad_id(&id);
    };
    let d = app.daemon.clone();
    let bytes = q.bytes.unwrap_or(16 * 1024).min(1 << 20);
    match blocking(move || d.log_tail(caller, id, bytes)).await {
        Ok(Some(text)) => {
            ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response()
        }
        Ok(None) => error(StatusCode::NOT_FOUND, format!("no job {id}")),
        Err(e) => e,
    }
}

async fn gpus(State(app): State<Arc<App>>) -> Response {
    let d = app.daemon.clone();
    match blocking(move || d.gpus()).await {
        Ok(gpus) => axum::Json(gpus).into_response(),
        Err(e) => e,
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let d = app.daemon.clone();
    match blocking(move || d.metrics()).await {
        Ok(text) => ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response(),
        Err(e) => e,
    }
}

/// The bound listener.
enum Listener {
    Unix(tokio::net::UnixListener, PathBuf),
    /// TCP callers act as the daemon's user (they hold its token).
    Tcp(tokio::net::TcpListener, User),
}

/// Binds a Unix socket at `path` (mode 0666: who may do what is decided per caller). A socket
/// file no daemon answers on is a stale one and replaced; one a daemon answers on is refused.
fn bind_unix(path: &FsPath) -> Result<tokio::net::UnixListener, ListenError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let bind = |source| ListenError::Bind {
        addr: path.display().to_string(),
        source,
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(bind(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "exists and is not a socket",
            )));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(ListenError::SocketInUse(path.display().to_string()));
        }
        std::fs::remove_file(path).map_err(bind)?;
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(bind)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666)).map_err(bind)?;
    Ok(listener)
}

/// Serves until SIGINT or SIGTERM, scheduling every `tick`.
pub fn serve(daemon: Arc<Daemon>, listen: Listen) -> Result<(), ListenError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(ListenError::Runtime)?;
    rt.block_on(async move {
        let (listener, token) = match listen {
            Listen::Unix(path) => {
                let l = bind_unix(&path)?;
                eprintln!("gpumem serve: listening on unix:{}", path.display());
                (Listener::Unix(l, path), None)
            }
            Listen::Tcp { addr, token } => {
                let l = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|source| ListenError::Bind {
                        addr: addr.to_string(),
                        source,
                    })?;
                eprintln!(
                    "gpumem serve: listening on http://{}",
                    l.local_addr().map_err(ListenError::LocalAddr)?
                );
                (Listener::Tcp(l, User::current()), Some(token))
            }
        };
        let stop = Arc::new(AtomicBool::new(false));
        let (d, s) = (daemon.clone(), stop.clone());
        let tick = Duration::from_millis(daemon.config.tick_ms);
        let scheduler = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Err(e) = d.tick() {
                    eprintln!("gpumem serve: {e}");
                }
                std::thread::sleep(tick);
            }
        });
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("signal handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        };
        let socket = match &listener {
            Listener::Unix(_, path) => Some(path.clone()),
            Listener::Tcp(..) => None,
        };
        accept(listener, router(daemon, token), shutdown).await;
        if let Some(path) = socket {
            let _ = std::fs::remove_file(path);
        }
        stop.store(true, Ordering::Relaxed);
        let _ = scheduler.join();
        Ok(())
    })
}

/// How long a connection may take to send a request's headers: a client that opens
/// connections and sends nothing (or a byte at a time) cannot hold the daemon's sockets.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves HTTP/1 connections until `shutdown`, each with the header-read timeout (axum's own
/// `serve` sets none) and its caller in every request; then gives requests in flight a moment
/// to finish.
async fn accept(listener: Listener, app: Router, shutdown: impl std::future::Future<Output = ()>) {
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = async {
                match &listener {
                    // The kernel says who is on the other end of a Unix socket.
                    Listener::Unix(l, _) => l.accept().await.and_then(|(s, _)| {
                        let cred = s.peer_cred()?;
                        Ok((Either::Unix(s), User { uid: cred.uid(), gid: cred.gid() }))
                    }),
                    Listener::Tcp(l, daemon_user) => l.accept().await.map(|(s, _)| (Either::Tcp(s), *daemon_user)),
                }
            } => {
                let Ok((stream, caller)) = accepted else {
                    // Out of file descriptors, say: wait rather than spin.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let service = tower::ServiceExt::map_request(app.clone(), move |mut req: Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(Caller(caller));
                    req
                });
                match stream {
                    Either::Unix(s) => connections.spawn(serve_connection(s, service)),
                    Either::Tcp(s) => connections.spawn(serve_connection(s, service)),
                };
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while connections.join_next().await.is_some() {}
    })
    .await;
}

enum Either {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
}

async fn serve_connection<S, T>(stream: S, service: T)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    T: tower::Service<
            Request<hyper::body::Incoming>,
            Response = Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    T::Future: Send + 'static,
{
    use hyper_util::rt::{TokioIo, TokioTimer};
    let _ = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(
            TokioIo::new(stream),
            hyper_util::service::TowerToHyperService::new(service),
        )
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_refusal_has_its_status() {
        assert_eq!(cancel_status(&CancelError::NoJob(7)), StatusCode::NOT_FOUND);
        assert_eq!(
            cancel_status(&CancelError::Ended {
                id: 7,
                state: JobState::Finished
            }),
            StatusCode::CONFLICT
        );
        let store = CancelError::Store(crate::store::StoreError::Sql(
            rusqlite::Error::QueryReturnedNoRows,
        ));
        assert_eq!(cancel_status(&store), StatusCode::INTERNAL_SERVER_ERROR);
    }

    #[test]
    fn a_token_is_long_and_printable() {
        assert_eq!(
            Token::new("0123456789abcdef\n", "f").unwrap().as_str(),
            "0123456789abcdef"
        );
        for bad in [
            "",
            " ",
            "                ",
            "short",
            "0123456789abcde f",
            "0123456789abcdef\n\n",
        ] {
            assert_eq!(
                Token::new(bad, "GPUMEM_TOKEN").err().unwrap().to_string(),
                "GPUMEM_TOKEN: a token must be at least 16 printable characters without spaces",
                "{bad:?}"
            );
        }
    }
}
