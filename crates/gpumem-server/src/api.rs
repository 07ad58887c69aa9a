//! The HTTP API (axum): JSON in and out, one-line errors, a body limit, bearer tokens.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;

use gpumem_workload::Workload;

use crate::daemon::{CancelError, Daemon, Sized, estimate};
use crate::wire::{ApiError, JobRequest, JobState};

/// Request bodies above this are refused (413).
pub const MAX_BODY: usize = 64 * 1024;

fn error(status: StatusCode, msg: impl std::fmt::Display) -> Response {
    (status, axum::Json(ApiError { error: msg.to_string().replace('\n', " ") })).into_response()
}

/// Why the daemon could not serve.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("refusing to listen on {addr} without a token: anyone who can reach it could run commands (set --token or GPUMEM_TOKEN)")]
    NoToken { addr: SocketAddr },
    /// The async runtime could not be built.
    #[error("{0}")]
    Runtime(std::io::Error),
    #[error("{addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    /// The bound socket's address could not be read.
    #[error("{0}")]
    LocalAddr(std::io::Error),
}

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
    token: Option<String>,
    /// Submissions being sized (traced) at once: `max_traces`.
    traces: tokio::sync::Semaphore,
}

/// The routes.
pub fn router(daemon: Arc<Daemon>, token: Option<String>) -> Router {
    let traces = tokio::sync::Semaphore::new(daemon.config.max_traces as usize);
    let app = Arc::new(App { daemon, token, traces });
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
    let json = res.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if json || !(status.is_client_error() || status.is_server_error()) {
        return res;
    }
    let body = axum::body::to_bytes(res.into_body(), 4096).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&body).trim().to_string();
    let reason = status.canonical_reason().unwrap_or("error").to_ascii_lowercase();
    error(status, if text.is_empty() { reason } else { text })
}

async fn auth(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(token) = &app.token {
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        // Constant-time comparison: the token must not leak through timing.
        let ok = given.is_some_and(|g| g.len() == token.len() && g.bytes().zip(token.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0);
        if !ok {
            return error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token");
        }
    }
    next.run(req).await
}

async fn submit(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let req: JobRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("bad job: {e}")),
    };
    let d = app.daemon.clone();
    if let Err(e) = req.validate(d.gpu_count()) {
        return error(StatusCode::BAD_REQUEST, e);
    }
    /// A size the submitter stated (or none), or gpumem's estimate of the model.
    enum Size {
        Stated(Option<(u64, u64)>),
        Estimated(Sized),
    }
    let size = match (&req.model, req.batch, req.mem_mib) {
        (_, _, Some(mib)) => Size::Stated(Some((mib * gpumem_place::MIB, mib * gpumem_place::MIB))),
        (Some(model), Some(batch), None) => {
            if model.trim_start().starts_with("py:") && !d.config.allow_py_models {
                return error(StatusCode::BAD_REQUEST, "model: py: models run their file's code inside the daemon; this daemon does not accept them (allow_py_models)");
            }
            let workload = match Workload::parse(model, batch, req.options.clone()) {
                Ok(w) => w,
                Err(e) => return error(StatusCode::BAD_REQUEST, format!("model: {e}")),
            };
            // Tracing runs Python: a few at a time, the rest wait their turn.
            let Ok(_turn) = app.traces.acquire().await else { return error(StatusCode::SERVICE_UNAVAILABLE, "shutting down") };
            let (config, profile) = (d.config.clone(), d.profile());
            match tokio::task::spawn_blocking(move || estimate(&config, &profile, &workload)).await {
                Ok(Ok(sized)) => Size::Estimated(sized),
                Ok(Err(e)) => return error(StatusCode::BAD_REQUEST, format!("model: {e}")),
                Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            }
        }
        _ => Size::Stated(None),
    };
    let stored = tokio::task::spawn_blocking(move || match size {
        Size::Estimated(sized) => d.submit_sized(req, sized),
        Size::Stated(stated) => d.submit(req, stated),
    });
    match stored.await {
        Ok(Ok(s)) => (StatusCode::CREATED, axum::Json(s)).into_response(),
        Ok(Err(e)) => error(StatusCode::INTERNAL_SERVER_ERROR, e),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}

#[derive(Deserialize)]
struct ListQuery {
    state: Option<String>,
}

async fn list(State(app): State<Arc<App>>, Query(q): Query<ListQuery>) -> Response {
    let state = match q.state.as_deref().map(|s| JobState::parse(s).ok_or(s)) {
        None => None,
        Some(Ok(s)) => Some(s),
        Some(Err(s)) => return error(StatusCode::BAD_REQUEST, format!("unknown state `{s}`")),
    };
    axum::Json(app.daemon.jobs(state)).into_response()
}

fn bad_id(id: &str) -> Response {
    error(StatusCode::BAD_REQUEST, format!("`{id}` is not a job id"))
}

async fn one(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<u64>() else { return bad_id(&id) };
    match app.daemon.job(id) {
        Some(j) => axum::Json(j).into_response(),
        None => error(StatusCode::NOT_FOUND, format!("no job {id}")),
    }
}

async fn cancel(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<u64>() else { return bad_id(&id) };
    match app.daemon.cancel(id) {
        Ok(j) => axum::Json(j).into_response(),
        Err(e) => error(cancel_status(&e), e),
    }
}

#[derive(Deserialize)]
struct LogQuery {
    bytes: Option<u64>,
}

async fn log(State(app): State<Arc<App>>, Path(id): Path<String>, Query(q): Query<LogQuery>) -> Response {
    let Ok(id) = id.parse::<u64>() else { return bad_id(&id) };
    match app.daemon.log_tail(id, q.bytes.unwrap_or(16 * 1024).min(1 << 20)) {
        Some(text) => ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response(),
        None => error(StatusCode::NOT_FOUND, format!("no job {id}")),
    }
}

async fn gpus(State(app): State<Arc<App>>) -> Response {
    axum::Json(app.daemon.gpus()).into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], app.daemon.metrics()).into_response()
}

/// Refuses a non-loopback address without a token: anyone who could reach it could run commands.
pub fn check_bind(addr: SocketAddr, token: Option<&str>) -> Result<(), ServeError> {
    if !addr.ip().is_loopback() && token.is_none_or(str::is_empty) {
        return Err(ServeError::NoToken { addr });
    }
    Ok(())
}

/// Serves until SIGINT or SIGTERM, scheduling every `tick` (after [`check_bind`]).
pub fn serve(daemon: Arc<Daemon>, addr: SocketAddr, token: Option<String>) -> Result<(), ServeError> {
    check_bind(addr, token.as_deref())?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(ServeError::Runtime)?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|source| ServeError::Bind { addr, source })?;
        eprintln!("gpumem serve: listening on http://{}", listener.local_addr().map_err(ServeError::LocalAddr)?);
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
            let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("signal handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        };
        accept(listener, router(daemon, token), shutdown).await;
        stop.store(true, Ordering::Relaxed);
        let _ = scheduler.join();
        Ok(())
    })
}

/// How long a connection may take to send a request's headers: a client that opens
/// connections and sends nothing (or a byte at a time) cannot hold the daemon's sockets.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves HTTP/1 connections until `shutdown`, each with the header-read timeout (axum's own
/// `serve` sets none); then gives requests in flight a moment to finish.
async fn accept(listener: tokio::net::TcpListener, app: Router, shutdown: impl std::future::Future<Output = ()>) {
    use hyper_util::rt::{TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    let mut connections = tokio::task::JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else {
                    // Out of file descriptors, say: wait rather than spin.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                let service = TowerToHyperService::new(app.clone());
                connections.spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .timer(TokioTimer::new())
                        .header_read_timeout(HEADER_READ_TIMEOUT)
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(2), async { while connections.join_next().await.is_some() {} }).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_refusal_has_its_status() {
        assert_eq!(cancel_status(&CancelError::NoJob(7)), StatusCode::NOT_FOUND);
        assert_eq!(cancel_status(&CancelError::Ended { id: 7, state: JobState::Finished }), StatusCode::CONFLICT);
        let store = CancelError::Store(crate::store::StoreError::Sql(rusqlite::Error::QueryReturnedNoRows));
        assert_eq!(cancel_status(&store), StatusCode::INTERNAL_SERVER_ERROR);
        let addr: SocketAddr = "0.0.0.0:0".parse().unwrap();
        assert!(matches!(check_bind(addr, None), Err(ServeError::NoToken { .. })));
        assert!(check_bind(addr, Some("t")).is_ok() && check_bind("127.0.0.1:0".parse().unwrap(), None).is_ok());
    }
}
