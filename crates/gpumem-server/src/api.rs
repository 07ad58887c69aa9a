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

use crate::daemon::{Daemon, estimate};
use crate::wire::{ApiError, JobRequest, JobState};

/// Request bodies above this are refused (413).
pub const MAX_BODY: usize = 64 * 1024;

fn error(status: StatusCode, msg: impl Into<String>) -> Response {
    let msg: String = msg.into();
    (status, axum::Json(ApiError { error: msg.replace('\n', " ") })).into_response()
}

struct App {
    daemon: Arc<Daemon>,
    token: Option<String>,
}

/// The routes.
pub fn router(daemon: Arc<Daemon>, token: Option<String>) -> Router {
    let app = Arc::new(App { daemon, token });
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
        .with_state(app)
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
    let est = match (&req.model, req.batch, req.mem_mib) {
        (_, _, Some(mib)) => Some((mib * gpumem_place::MIB, mib * gpumem_place::MIB)),
        (Some(model), Some(batch), None) => {
            let workload = match Workload::parse(model, batch, req.options.clone()) {
                Ok(w) => w,
                Err(e) => return error(StatusCode::BAD_REQUEST, format!("model: {e}")),
            };
            let (config, profile) = (d.config.clone(), d.profile.clone());
            match tokio::task::spawn_blocking(move || estimate(&config, &profile, &workload)).await {
                Ok(Ok(e)) => Some(e),
                Ok(Err(e)) => return error(StatusCode::BAD_REQUEST, format!("model: {e}")),
                Err(e) => return error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
            }
        }
        _ => None,
    };
    match tokio::task::spawn_blocking(move || d.submit(req, est)).await {
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
        Err((code, msg)) => error(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR), msg),
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
pub fn check_bind(addr: SocketAddr, token: Option<&str>) -> Result<(), String> {
    if !addr.ip().is_loopback() && token.is_none_or(str::is_empty) {
        return Err(format!("refusing to listen on {addr} without a token: anyone who can reach it could run commands (set --token or GPUMEM_TOKEN)"));
    }
    Ok(())
}

/// Serves until SIGINT or SIGTERM, scheduling every `tick` (after [`check_bind`]).
pub fn serve(daemon: Arc<Daemon>, addr: SocketAddr, token: Option<String>) -> Result<(), String> {
    check_bind(addr, token.as_deref())?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("{addr}: {e}"))?;
        eprintln!("gpumem serve: listening on http://{}", listener.local_addr().map_err(|e| e.to_string())?);
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
        axum::serve(listener, router(daemon, token)).with_graceful_shutdown(shutdown).await.map_err(|e| e.to_string())?;
        stop.store(true, Ordering::Relaxed);
        let _ = scheduler.join();
        Ok(())
    })
}
