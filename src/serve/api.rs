//! The HTTP routes of `lorafit serve` (axum), their authentication and limits, and the web page.
//!
//! Every `/jobs` route needs `Authorization: Bearer <token>` when the server has a token. A
//! request that changes something (POST, DELETE) must say `Content-Type: application/json`: a
//! cross-site HTML form cannot send that, and a cross-site script cannot without a CORS
//! preflight this server never grants, so a page elsewhere cannot drive a server on localhost.
//! Bodies are limited to `MAX_BODY` bytes. Database work runs on tokio's blocking pool.

use super::db::{EventRow, JobRow, JobState};
use super::paths::PathRefused;
use super::App;
use crate::config::TrainConfig;
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The largest request body accepted (a TrainConfig is well under 4 KiB).
pub const MAX_BODY: usize = 64 * 1024;

const PAGE_HTML: &str = include_str!("page.html");
const PAGE_JS: &str = include_str!("page.js");

/// An error as the API answers it: a status and `{"error": message}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
        }
    }
    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, message)
    }
    fn not_found(id: i64) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, format!("no job {id}"))
    }
    fn conflict(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, message)
    }
}

impl From<anyhow::Error> for ApiError {
    fn from(e: anyhow::Error) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}"))
    }
}

impl From<PathRefused> for ApiError {
    fn from(e: PathRefused) -> ApiError {
        let status = if e.forbidden {
            StatusCode::FORBIDDEN
        } else {
            StatusCode::BAD_REQUEST
        };
        ApiError::new(status, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(json!({"error": self.message}))).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// Runs `f` with the app on the blocking pool (SQLite and file work).
async fn blocking<T, F>(app: &Arc<App>, f: F) -> ApiResult<T>
where
    T: Send + 'static,
    F: FnOnce(&App) -> ApiResult<T> + Send + 'static,
{
    let app = app.clone();
    tokio::task::spawn_blocking(move || f(&app))
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("request handler: {e}"),
            )
        })?
}

pub fn router(app: Arc<App>) -> Router {
    let jobs = Router::new()
        .route("/jobs", get(list_jobs).post(submit))
        .route("/jobs/{id}", get(job_status).delete(delete_job))
        .route("/jobs/{id}/metrics", get(job_metrics))
        .route("/jobs/{id}/events", get(job_events))
        .route("/jobs/{id}/cancel", post(cancel))
        .route("/jobs/{id}/resume", post(resume))
        .route("/jobs/{id}/adapter", get(adapter))
        .layer(axum::middleware::from_fn_with_state(app.clone(), guard));
    Router::new()
        .route(
            "/",
            get(|| async { page(PAGE_HTML, "text/html; charset=utf-8") }),
        )
        .route(
            "/page.js",
            get(|| async { page(PAGE_JS, "text/javascript; charset=utf-8") }),
        )
        .merge(jobs)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(app)
}

fn page(body: &'static str, content_type: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-store"),
        ],
        body,
    )
        .into_response()
}

/// Equal-time comparison, so that the answer time does not tell how much of a guess was right.
fn same_token(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Whether a `Host` header names this machine's loopback ("localhost", 127.x.x.x, [::1]).
fn loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Authentication (bearer token), the Host check of a token-less server, and the JSON content
/// type on changing requests.
async fn guard(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if app.token.is_none() {
        // Without a token the server listens on loopback only, and answers only requests that
        // were sent to a loopback name: a page whose own host name was re-pointed at 127.0.0.1
        // (DNS rebinding) sends its own name in Host and is refused.
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if !loopback_host(host) {
            return ApiError::new(
                StatusCode::FORBIDDEN,
                format!("Host {host:?} is not a loopback name; a server without a token answers only to localhost"),
            )
            .into_response();
        }
    }
    if let Some(token) = &app.token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if !given.is_some_and(|g| same_token(g.trim().as_bytes(), token.as_bytes())) {
            let mut r = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "this server needs `Authorization: Bearer <token>` (the token in its --token-file)",
            )
            .into_response();
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            return r;
        }
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        let json_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/json"));
        if !json_type {
            return ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                    "{} needs `Content-Type: application/json` (an empty body is fine)",
                    req.method()
                ),
            )
            .into_response();
        }
    }
    next.run(req).await
}

// ---------------------------------------------------------------------------------------------
// Config: JSON → the same TOML table the CLI builds → TrainConfig
// ---------------------------------------------------------------------------------------------

/// A JSON value as TOML; `null` means "unset" (the default) and yields None.
fn json_to_toml(key: &str, v: &Value) -> Result<Option<toml::Value>, String> {
    Ok(Some(match v {
        Value::Null => return Ok(None),
        Value::Bool(b) => toml::Value::Boolean(*b),
        Value::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => toml::Value::Integer(i),
            (None, Some(_)) if n.is_u64() => {
                return Err(format!("setting `{key}`: {n} is too large"))
            }
            (None, Some(f)) => toml::Value::Float(f),
            (None, None) => return Err(format!("setting `{key}`: {n} is not a number TOML holds")),
        },
        Value::String(s) => toml::Value::String(s.clone()),
        Value::Array(items) => toml::Value::Array(
            items
                .iter()
                .map(|item| {
                    json_to_toml(key, item)?
                        .ok_or_else(|| format!("setting `{key}`: null inside a list"))
                })
                .collect::<Result<_, _>>()?,
        ),
        Value::Object(map) => {
            let mut t = toml::Table::new();
            for (k, item) in map {
                if let Some(v) = json_to_toml(&format!("{key}.{k}"), item)? {
                    t.insert(k.clone(), v);
                }
            }
            toml::Value::Table(t)
        }
    }))
}

/// A submitted config as the CLI reads a settings file: TRL's names normalised, unknown names
/// refused with the nearest one, types checked, then `TrainConfig::validate`. Returns the config
/// and whether the request named an output folder.
pub fn parse_config(body: &Value) -> ApiResult<(TrainConfig, bool)> {
    let Value::Object(map) = body else {
        return Err(ApiError::bad_request(
            "the body must be a JSON object of TrainConfig settings",
        ));
    };
    let mut table = toml::Table::new();
    for (k, v) in map {
        if let Some(v) = json_to_toml(k, v).map_err(ApiError::bad_request)? {
            table.insert(k.clone(), v);
        }
    }
    let table =
        TrainConfig::normalize(table).map_err(|e| ApiError::bad_request(format!("{e:#}")))?;
    let named_output = table.contains_key("output");
    let cfg: TrainConfig = table
        .try_into()
        .map_err(|e: toml::de::Error| ApiError::bad_request(format!("invalid config: {e}")))?;
    cfg.validate()
        .map_err(|e| ApiError::bad_request(format!("{e:#}")))?;
    Ok((cfg, named_output))
}

/// Confines every path the config names to the roots and makes it canonical.
fn confine(app: &App, cfg: &mut TrainConfig, named_output: bool) -> ApiResult<()> {
    let roots = &app.roots;
    if cfg.model != "smollm2" {
        cfg.model = roots.existing("model", &cfg.model)?.display().to_string();
    }
    cfg.data = roots.existing("data", &cfg.data)?.display().to_string();
    if let Some(v) = &cfg.valid {
        cfg.valid = Some(roots.existing("valid", v)?.display().to_string());
    }
    if let Some(w) = &cfg.warm_start {
        cfg.warm_start = Some(roots.existing("warm_start", w)?.display().to_string());
    }
    if named_output {
        cfg.output = roots.writable("output", &cfg.output)?.display().to_string();
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Jobs
// ---------------------------------------------------------------------------------------------

fn parse_json(s: Option<&str>) -> Value {
    s.and_then(|s| serde_json::from_str(s).ok())
        .unwrap_or(Value::Null)
}

fn summary(job: &JobRow) -> Value {
    let cfg = parse_json(Some(&job.config));
    json!({
        "id": job.id, "state": job.state.as_str(), "step": job.step,
        "total_steps": job.total_steps, "method": cfg["method"], "model": cfg["model"],
        "data": cfg["data"], "output": job.output, "message": job.error,
        "created": job.created, "updated": job.updated,
    })
}

fn detail(app: &App, job: &JobRow) -> ApiResult<Value> {
    let db = app.db();
    let mut v = summary(job);
    v["config"] = parse_json(Some(&job.config));
    v["plan"] = parse_json(job.plan.as_deref());
    v["latest"] = json!({
        "train": parse_json(db.latest_metrics(job.id, "train")?.as_deref()),
        "valid": parse_json(db.latest_metrics(job.id, "valid")?.as_deref()),
    });
    v["checkpoint"] = match db.last_checkpoint(job.id)? {
        Some((step, path)) => json!({"step": step, "path": path}),
        None => Value::Null,
    };
    v["resume_from"] = json!(job.resume_from);
    Ok(v)
}

fn load_job(app: &App, id: i64) -> ApiResult<JobRow> {
    app.db().job(id)?.ok_or(ApiError::not_found(id))
}

async fn submit(
    State(app): State<Arc<App>>,
    body: Result<Json<Value>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let Json(body) = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    let (mut cfg, named_output) = parse_config(&body)?;
    blocking(&app, move |app| {
        confine(app, &mut cfg, named_output)?;
        let config = serde_json::to_string(&cfg).map_err(anyhow::Error::from)?;
        let id = {
            let db = app.db();
            if named_output {
                if let Some(other) = db.output_in_use(&cfg.output, None)? {
                    return Err(ApiError::conflict(format!(
                        "output: {} is the output folder of job {other}; name another",
                        cfg.output
                    )));
                }
            }
            let id = db.insert_job(&config, &cfg.output)?;
            if !named_output {
                // The default output is the job's own folder under the first root.
                let dir = app
                    .roots
                    .writable("output", &format!("runs/job-{id}"))
                    .inspect_err(|_| {
                        let _ = db.delete_job(id);
                    })?;
                cfg.output = dir.display().to_string();
                let config = serde_json::to_string(&cfg).map_err(anyhow::Error::from)?;
                db.set_config(id, &config, &cfg.output)?;
            }
            id
        };
        app.emit(
            id,
            "state",
            None,
            json!({"state": "queued", "message": format!("queued: {:?} on {}", cfg.method, cfg.model)}),
        )?;
        app.wake_worker();
        let job = load_job(app, id)?;
        Ok((StatusCode::CREATED, Json(detail(app, &job)?)))
    })
    .await
}

async fn list_jobs(State(app): State<Arc<App>>) -> ApiResult<Json<Value>> {
    blocking(&app, |app| {
        let jobs = app.db().jobs()?;
        Ok(Json(
            json!({"jobs": jobs.iter().map(summary).collect::<Vec<_>>()}),
        ))
    })
    .await
}

async fn job_status(State(app): State<Arc<App>>, Path(id): Path<i64>) -> ApiResult<Json<Value>> {
    blocking(&app, move |app| Ok(Json(detail(app, &load_job(app, id)?)?))).await
}

async fn job_metrics(State(app): State<Arc<App>>, Path(id): Path<i64>) -> ApiResult<Json<Value>> {
    blocking(&app, move |app| {
        load_job(app, id)?;
        let rows = app.db().metrics(id)?;
        let rows: Vec<Value> = rows.iter().map(|(_, _, r)| parse_json(Some(r))).collect();
        Ok(Json(json!({"id": id, "rows": rows})))
    })
    .await
}

async fn cancel(State(app): State<Arc<App>>, Path(id): Path<i64>) -> ApiResult<Json<Value>> {
    blocking(&app, move |app| {
        let job = load_job(app, id)?;
        match job.state {
            JobState::Queued => {
                if app
                    .db()
                    .transition(id, &[JobState::Queued], JobState::Cancelled)?
                {
                    app.set_state(id, JobState::Cancelled, "cancelled before it started")?;
                    app.emit(
                        id,
                        "cancelled",
                        None,
                        json!({"step": job.step, "message": "cancelled before it started"}),
                    )?;
                }
            }
            JobState::Running | JobState::Cancelling => {
                let flag = app
                    .running
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&id)
                    .cloned();
                if let Some(flag) = flag {
                    flag.store(true, Ordering::SeqCst);
                    if app
                        .db()
                        .transition(id, &[JobState::Running], JobState::Cancelling)?
                    {
                        app.set_state(
                            id,
                            JobState::Cancelling,
                            "cancelling: the job stops after checkpointing its current step",
                        )?;
                    }
                }
            }
            state => {
                return Err(ApiError::conflict(format!(
                    "job {id} is {}; only a queued or running job can be cancelled",
                    state.as_str()
                )))
            }
        }
        Ok(Json(detail(app, &load_job(app, id)?)?))
    })
    .await
}

async fn resume(State(app): State<Arc<App>>, Path(id): Path<i64>) -> ApiResult<Json<Value>> {
    blocking(&app, move |app| {
        let job = load_job(app, id)?;
        if !matches!(job.state, JobState::Cancelled | JobState::Failed) {
            return Err(ApiError::conflict(format!(
                "job {id} is {}; only a cancelled or failed job can be resumed",
                job.state.as_str()
            )));
        }
        let message = {
            let db = app.db();
            match db.last_checkpoint(id)? {
                Some((step, path)) => {
                    db.rewind_to(id, step)?;
                    db.set_resume_from(id, Some(&path))?;
                    format!("queued: resumes from the checkpoint of step {step}")
                }
                None => {
                    db.rewind_to(id, 0)?;
                    db.set_resume_from(id, None)?;
                    "queued: no checkpoint, so it starts over".to_string()
                }
            }
        };
        if !app.db().transition(id, &[job.state], JobState::Queued)? {
            return Err(ApiError::conflict(format!(
                "job {id} changed state; try again"
            )));
        }
        app.set_state(id, JobState::Queued, &message)?;
        app.wake_worker();
        Ok(Json(detail(app, &load_job(app, id)?)?))
    })
    .await
}

async fn delete_job(State(app): State<Arc<App>>, Path(id): Path<i64>) -> ApiResult<Json<Value>> {
    blocking(&app, move |app| {
        let job = load_job(app, id)?;
        if !job.state.is_terminal() {
            return Err(ApiError::conflict(format!(
                "job {id} is {}; cancel it first (only done, failed or cancelled jobs are deleted)",
                job.state.as_str()
            )));
        }
        app.db().delete_job(id)?;
        Ok(Json(json!({"deleted": id, "output": job.output,
                       "note": "the job's record is gone; its output folder is left on disk"})))
    })
    .await
}

async fn adapter(State(app): State<Arc<App>>, Path(id): Path<i64>) -> ApiResult<Response> {
    blocking(&app, move |app| {
        let job = load_job(app, id)?;
        if job.state != JobState::Done {
            return Err(ApiError::conflict(format!(
                "job {id} is {}; its adapter is ready when it is done",
                job.state.as_str()
            )));
        }
        let dir = std::path::Path::new(&job.output).join("adapter");
        let prefix = format!("job-{id}-adapter");
        let bytes = super::tar::tar_folder(&dir, &prefix)?;
        Ok((
            [
                (header::CONTENT_TYPE, "application/x-tar".to_string()),
                (
                    header::CONTENT_DISPOSITION,
                    format!("attachment; filename=\"{prefix}.tar\""),
                ),
            ],
            bytes,
        )
            .into_response())
    })
    .await
}

// ---------------------------------------------------------------------------------------------
// Server-sent events
// ---------------------------------------------------------------------------------------------

/// Kinds after which a job does nothing more unless it is resumed.
fn is_terminal_kind(kind: &str) -> bool {
    matches!(kind, "done" | "failed" | "cancelled")
}

struct EventStream {
    app: Arc<App>,
    id: i64,
    last_seq: i64,
    backlog: VecDeque<EventRow>,
    rx: tokio::sync::broadcast::Receiver<Arc<EventRow>>,
    /// Read the database before waiting on the channel (at the start and after a lag).
    reread: bool,
    ended: bool,
}

fn to_sse(ev: &EventRow) -> Event {
    Event::default()
        .id(ev.seq.to_string())
        .event(&ev.kind)
        .data(&ev.data)
}

impl EventStream {
    /// Whether the job is in a terminal state and every event of it has been sent.
    async fn finished(&self) -> bool {
        let (app, id, seq) = (self.app.clone(), self.id, self.last_seq);
        blocking(&app, move |app| {
            let done = match app.db().job(id)? {
                Some(j) => j.state.is_terminal(),
                None => true,
            };
            Ok(done && app.db().events_after(id, seq)?.is_empty())
        })
        .await
        .unwrap_or(true)
    }

    async fn next(mut self) -> Option<(Result<Event, Infallible>, EventStream)> {
        loop {
            if self.ended {
                return None;
            }
            if let Some(ev) = self.backlog.pop_front() {
                self.last_seq = ev.seq;
                if is_terminal_kind(&ev.kind) && self.backlog.is_empty() && self.finished().await {
                    self.ended = true;
                }
                let event = to_sse(&ev);
                return Some((Ok(event), self));
            }
            if self.reread {
                self.reread = false;
                let (app, id, seq) = (self.app.clone(), self.id, self.last_seq);
                let rows = blocking(&app, move |app| Ok(app.db().events_after(id, seq)?)).await;
                match rows {
                    Ok(rows) => self.backlog.extend(rows),
                    Err(_) => return None,
                }
                if self.backlog.is_empty() && self.finished().await {
                    return None;
                }
                continue;
            }
            match self.rx.recv().await {
                Ok(ev) if ev.job_id == self.id && ev.seq > self.last_seq => {
                    self.backlog.push_back((*ev).clone())
                }
                Ok(_) => {}
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => self.reread = true,
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            }
        }
    }
}

/// The job's events from the start (or after `Last-Event-ID`), then live ones; the stream ends
/// after `done`, `failed` or `cancelled` once the job is in that state.
async fn job_events(
    State(app): State<Arc<App>>,
    Path(id): Path<i64>,
    headers: HeaderMap,
) -> ApiResult<Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>>> {
    // Subscribe before reading the database, so that nothing falls between the two.
    let rx = app.events.subscribe();
    blocking(&app, move |app| load_job(app, id).map(|_| ())).await?;
    let last_seq = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<i64>().ok())
        .unwrap_or(0);
    let state = EventStream {
        app,
        id,
        last_seq,
        backlog: VecDeque::new(),
        rx,
        reread: true,
        ended: false,
    };
    let stream = futures_util::stream::unfold(state, |s| s.next());
    Ok(Sse::new(stream).keep_alive(KeepAlive::default()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configs_are_read_as_the_cli_reads_them() {
        let (cfg, named) = parse_config(&json!({
            "data": "train.jsonl", "learning_rate": 2e-4, "max_steps": 7, "lora_r": 4,
            "beta": 0.25, "valid": null, "targets": ["q", "v"]
        }))
        .unwrap();
        assert!(!named);
        assert_eq!((cfg.lr, cfg.steps, cfg.rank), (2e-4, 7, 4));
        assert_eq!(cfg.orpo_lambda, 0.25);
        assert_eq!(cfg.valid, None);
        assert_eq!(cfg.targets, ["q", "v"]);

        let err = |body: Value| parse_config(&body).unwrap_err();
        let e = err(json!({"data": "d", "lerning_rate": 1e-4}));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(
            e.message.contains("lerning_rate") && e.message.contains("learning_rate"),
            "{}",
            e.message
        );
        let e = err(json!({"data": "d", "lr": -1.0}));
        assert!(e.message.contains("lr = -1"), "{}", e.message);
        let e = err(json!({"data": "d", "steps": "ten"}));
        assert!(e.message.contains("steps"), "{}", e.message);
        let e = err(json!({"data": "d", "max_steps": 3, "steps": 4}));
        assert!(e.message.contains("given twice"), "{}", e.message);
        let e = err(json!(["data"]));
        assert!(e.message.contains("JSON object"), "{}", e.message);
        let e = err(json!({"data": "d", "steps": 18446744073709551615u64}));
        assert!(
            e.message.contains("steps") && e.message.contains("too large"),
            "{}",
            e.message
        );
        let e = err(json!({}));
        assert!(e.message.contains("data"), "{}", e.message);
    }

    #[test]
    fn only_loopback_host_names_pass() {
        for ok in [
            "localhost",
            "localhost:8420",
            "127.0.0.1:1",
            "127.3.4.5",
            "[::1]:80",
            "[::1]",
        ] {
            assert!(loopback_host(ok), "{ok}");
        }
        for bad in [
            "",
            "evil.example",
            "evil.example:8420",
            "10.0.0.1:80",
            "[::2]:80",
            "localhost.evil",
        ] {
            assert!(!loopback_host(bad), "{bad}");
        }
    }

    #[test]
    fn tokens_compare_whole() {
        assert!(same_token(b"abcdef0123456789", b"abcdef0123456789"));
        assert!(!same_token(b"abcdef0123456789", b"abcdef012345678"));
        assert!(!same_token(b"abcdef0123456789", b"abcdef0123456780"));
    }
}
