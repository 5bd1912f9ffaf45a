//! The HTTP routes of `lorafit serve` (axum), their authentication and limits, and the web page.
//!
//! `POST /jobs` takes a job of one of three kinds, named by `"kind"`: `train` (the default: the
//! body is a `TrainConfig`), `eval` (the settings of `lorafit eval`, `eval::EvalOptions`) or
//! `export` (those of `lorafit export`, `export::ExportPlan`). Each is checked by the library's
//! own validation, its paths confined to the roots, and queued; `GET /jobs/{id}/result` serves
//! what a done job made (the adapter, the eval report, the export's folder).
//!
//! Every `/jobs` route needs `Authorization: Bearer <token>` when the server has a token. A
//! request that changes something (POST, DELETE) must say `Content-Type: application/json`: a
//! cross-site HTML form cannot send that, and a cross-site script cannot without a CORS
//! preflight this server never grants, so a page elsewhere cannot drive a server on localhost.
//! Bodies are limited to `MAX_BODY` bytes. Database work runs on tokio's blocking pool.

use super::db::{Db, EventRow, JobKind, JobRow, JobState};
use super::paths::PathRefused;
use super::App;
use crate::config::TrainConfig;
use crate::eval::{EvalOptions, Scorer};
use crate::export::ExportPlan;
use axum::body::{Body, Bytes};
use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Path, RawQuery, Request, State};
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
        let message = super::wording::api_wording(&self.message);
        (self.status, Json(json!({"error": message}))).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// The `{id}` of a `/jobs/{id}` route; one that is not a job id is a 400 in the API's JSON
/// (axum's own answer is plain text).
struct JobId(i64);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for JobId {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<JobId, ApiError> {
        let Path(raw) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError::new(e.status(), e.body_text()))?;
        raw.parse().map(JobId).map_err(|_| {
            ApiError::bad_request(format!(
                "id: {raw:?} is not a job id (a whole number, as in /jobs/1)"
            ))
        })
    }
}

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
        .route("/jobs/{id}/result", get(result))
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
        .fallback(|uri: axum::http::Uri| async move {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "no such endpoint: {} (see the README's API table)",
                    uri.path()
                ),
            )
        })
        .method_not_allowed_fallback(|method: Method, uri: axum::http::Uri| async move {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("{method} is not a method of {}", uri.path()),
            )
        })
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
            // The scheme's name is case-insensitive (RFC 7235).
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token);
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
    // Only POST carries a body; another method the route lacks is its 405.
    if req.method() == Method::POST {
        // Media types compare without regard to case (RFC 9110).
        let json_type = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| {
                v.trim_start()
                    .to_ascii_lowercase()
                    .starts_with("application/json")
            });
        if !json_type {
            let body = if req.uri().path() == "/jobs" {
                "the body is the job, a JSON object"
            } else {
                "an empty body is fine"
            };
            return ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                    "{} {} needs `Content-Type: application/json` ({body})",
                    req.method(),
                    req.uri().path()
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

/// A submitted config as the CLI reads a settings file: TRL's names normalised, unknown names
/// refused with the nearest one, types checked. `TrainConfig::validate` runs once the config's
/// paths are confined (`Submission::confine`, `validated`), since they name files in the roots,
/// not in the server's working folder. Returns the config and whether the request named an
/// output folder.
pub fn parse_config(body: &Value) -> ApiResult<(TrainConfig, bool)> {
    let Value::Object(map) = body else {
        return Err(ApiError::bad_request(
            "the body must be a JSON object of TrainConfig settings",
        ));
    };
    let mut table = toml::Table::new();
    for (k, v) in map {
        if let Some(v) = crate::recipe_file::json_to_toml(k, v).map_err(ApiError::bad_request)? {
            table.insert(k.clone(), v);
        }
    }
    let table =
        TrainConfig::normalize(table).map_err(|e| ApiError::bad_request(format!("{e:#}")))?;
    let named_output = table.contains_key("output");
    let cfg: TrainConfig = table
        .try_into()
        .map_err(|e: toml::de::Error| ApiError::bad_request(format!("invalid config: {e}")))?;
    Ok((cfg, named_output))
}

/// `TrainConfig::validate` as a 400.
fn validated(cfg: &TrainConfig) -> ApiResult<()> {
    cfg.validate()
        .map_err(|e| ApiError::bad_request(format!("{e:#}")))
}

/// Confines every path the config reads to the roots and makes it canonical.
fn confine(app: &App, cfg: &mut TrainConfig) -> ApiResult<()> {
    let roots = &app.roots;
    if cfg.model != "smollm2" {
        roots.confine("model", &mut cfg.model)?;
    }
    roots.confine("data", &mut cfg.data)?;
    roots.confine_opt("valid", &mut cfg.valid)?;
    roots.confine_opt("warm_start", &mut cfg.warm_start)?;
    roots.confine_opt("chat_template", &mut cfg.chat_template)?;
    roots.confine_opt("rank_kl_file", &mut cfg.rank_kl_file)?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Eval and export jobs: JSON → the library's options, field by field
// ---------------------------------------------------------------------------------------------

/// The files an eval job writes into its output folder: every example's scores, the markdown
/// report, and for a comparison the chart (`report.png`, beside the report).
pub const EVAL_JSON: &str = "eval.json";
pub const EVAL_REPORT: &str = "report.md";

const EVAL_FIELDS: &str =
    "kind, model, adapter, compare, data, scorer, device, config, method, chat_template, \
     base_quant, max_new, limit, output";
const EXPORT_FIELDS: &str =
    "kind, model, adapter, output, format, dtype, adapter_type, merged_type, check, chat_template";

fn want_str(field: &str, v: &Value) -> ApiResult<String> {
    match v {
        Value::String(s) if !s.trim().is_empty() => Ok(s.clone()),
        Value::String(_) => Err(ApiError::bad_request(format!("{field}: empty"))),
        other => Err(ApiError::bad_request(format!(
            "{field}: expected a string, got {other}"
        ))),
    }
}

fn want_usize(field: &str, v: &Value) -> ApiResult<usize> {
    v.as_u64()
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| {
            ApiError::bad_request(format!("{field}: expected a whole number >= 0, got {v}"))
        })
}

fn want_bool(field: &str, v: &Value) -> ApiResult<bool> {
    v.as_bool()
        .ok_or_else(|| ApiError::bad_request(format!("{field}: expected true or false, got {v}")))
}

/// A value of one of the command line's choices (the same names as its flag takes).
fn want_choice<T: clap::ValueEnum>(field: &str, v: &Value) -> ApiResult<T> {
    let s = want_str(field, v)?;
    T::from_str(&s, true).map_err(|_| {
        let names: Vec<String> = T::value_variants()
            .iter()
            .filter_map(|x| x.to_possible_value())
            .map(|p| p.get_name().to_string())
            .collect();
        ApiError::bad_request(format!("{field}: {s:?} is not one of {}", names.join(", ")))
    })
}

fn unknown_field(kind: &str, field: &str, fields: &str) -> ApiError {
    ApiError::bad_request(format!(
        "{field}: not a setting of an {kind} job (they take {fields})"
    ))
}

/// An eval job's settings, and the output folder it names.
fn parse_eval(map: &serde_json::Map<String, Value>) -> ApiResult<(EvalOptions, Option<String>)> {
    let mut o = EvalOptions::default();
    let mut output = None;
    for (k, v) in map {
        if v.is_null() {
            continue;
        }
        match k.as_str() {
            "kind" => {}
            "model" => o.model = Some(want_str(k, v)?),
            "adapter" => o.adapter = Some(want_str(k, v)?.into()),
            "compare" => {
                let items = v.as_array().ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "compare: expected a list of two subjects (`base` or an adapter folder), got {v}"
                    ))
                })?;
                o.compare = items
                    .iter()
                    .map(|s| want_str("compare", s))
                    .collect::<ApiResult<_>>()?;
            }
            "data" => o.data = Some(want_str(k, v)?),
            "scorer" => o.scorer = want_choice::<Scorer>(k, v)?,
            "device" => o.device = Some(want_str(k, v)?),
            "config" => o.config = Some(want_str(k, v)?.into()),
            "method" => o.method = Some(want_choice::<crate::config::Method>(k, v)?),
            "chat_template" => o.chat_template = Some(want_str(k, v)?),
            "base_quant" => o.base_quant = Some(want_choice::<crate::model::BaseQuant>(k, v)?),
            "max_new" => o.max_new = want_usize(k, v)?,
            "limit" => o.limit = want_usize(k, v)?,
            "output" => output = Some(want_str(k, v)?),
            _ => return Err(unknown_field("eval", k, EVAL_FIELDS)),
        }
    }
    o.validate()
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok((o, output))
}

/// An export job's plan (its output resolved later), and the output folder it names.
fn parse_export(map: &serde_json::Map<String, Value>) -> ApiResult<(ExportPlan, Option<String>)> {
    let mut plan = ExportPlan {
        model: Default::default(),
        adapter: Default::default(),
        output: Default::default(),
        formats: vec![],
        hf_dtype: crate::export::hf::HfDtype::Bf16,
        adapter_type: crate::export::gguf_out::AdapterType::F32,
        merged_type: crate::export::gguf_out::MergedType::Keep,
        check: false,
        chat_template: None,
    };
    let mut output = None;
    for (k, v) in map {
        if v.is_null() {
            continue;
        }
        match k.as_str() {
            "kind" => {}
            "model" => plan.model = want_str(k, v)?.into(),
            "adapter" => plan.adapter = want_str(k, v)?.into(),
            "output" => output = Some(want_str(k, v)?),
            "format" | "formats" => {
                plan.formats = match v {
                    Value::Array(items) => items
                        .iter()
                        .map(|f| want_choice(k, f))
                        .collect::<ApiResult<_>>()?,
                    one => vec![want_choice(k, one)?],
                }
            }
            "dtype" => plan.hf_dtype = want_choice(k, v)?,
            "adapter_type" => plan.adapter_type = want_choice(k, v)?,
            "merged_type" => plan.merged_type = want_choice(k, v)?,
            "check" => plan.check = want_bool(k, v)?,
            "chat_template" => plan.chat_template = Some(want_str(k, v)?),
            _ => return Err(unknown_field("export", k, EXPORT_FIELDS)),
        }
    }
    if plan.model.as_os_str().is_empty() {
        return Err(ApiError::bad_request(
            "model: an export job needs the base model (a folder, a .gguf file or smollm2)",
        ));
    }
    if plan.adapter.as_os_str().is_empty() {
        return Err(ApiError::bad_request(
            "adapter: an export job needs the PEFT adapter folder to export",
        ));
    }
    Ok((plan, output))
}

/// A submitted job, parsed and validated.
enum Submission {
    Train(Box<TrainConfig>),
    Eval(EvalOptions),
    Export(ExportPlan),
}

impl Submission {
    fn kind(&self) -> JobKind {
        match self {
            Submission::Train(_) => JobKind::Train,
            Submission::Eval(_) => JobKind::Eval,
            Submission::Export(_) => JobKind::Export,
        }
    }

    /// The body as a job of its kind (`"kind"`, default `train`), and the output it names.
    fn parse(body: &Value) -> ApiResult<(Submission, Option<String>)> {
        let Value::Object(map) = body else {
            return Err(ApiError::bad_request(
                "the body must be a JSON object: a TrainConfig, or an eval or export job",
            ));
        };
        let kind = match map.get("kind") {
            None | Some(Value::Null) => JobKind::Train,
            Some(Value::String(s)) => JobKind::parse(s).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "kind: {s:?} is not a job kind (train, eval, export)"
                ))
            })?,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "kind: expected a string (train, eval, export), got {other}"
                )))
            }
        };
        Ok(match kind {
            JobKind::Train => {
                let mut map = map.clone();
                map.remove("kind");
                let (cfg, named) = parse_config(&Value::Object(map))?;
                let output = named.then(|| cfg.output.clone());
                (Submission::Train(Box::new(cfg)), output)
            }
            JobKind::Eval => {
                let (o, output) = parse_eval(map)?;
                (Submission::Eval(o), output)
            }
            JobKind::Export => {
                let (p, output) = parse_export(map)?;
                (Submission::Export(p), output)
            }
        })
    }

    /// Confines every path the job reads to the roots and makes it canonical (the output is
    /// confined by the caller).
    fn confine(&mut self, app: &App) -> ApiResult<()> {
        let roots = &app.roots;
        let model = |m: &str| -> ApiResult<String> {
            Ok(if m == "smollm2" {
                m.to_string()
            } else {
                roots.existing("model", m)?.display().to_string()
            })
        };
        match self {
            Submission::Train(cfg) => {
                confine(app, cfg)?;
                validated(cfg)?;
                crate::tensor::Device::check(&cfg.device)
                    .map_err(|e| ApiError::bad_request(format!("device: {e:#}")))
            }
            Submission::Eval(o) => {
                if let Some(c) = &o.config {
                    let c = roots.existing("config", &c.display().to_string())?;
                    // The config file's model and chat template are as confined as ones named
                    // here; the template is passed on by its confined path.
                    let cfg = TrainConfig::from_toml_file(&c)
                        .map_err(|e| ApiError::bad_request(format!("config: {e:#}")))?;
                    o.model = o.model.take().or(Some(cfg.model));
                    o.chat_template = o.chat_template.take().or(cfg.chat_template);
                    o.config = Some(c);
                }
                roots.confine_opt("chat_template", &mut o.chat_template)?;
                o.model = Some(model(o.model.as_deref().unwrap_or("smollm2"))?);
                if let Some(a) = &o.adapter {
                    o.adapter = Some(roots.existing("adapter", &a.display().to_string())?);
                }
                for s in o.compare.iter_mut() {
                    if s != "base" {
                        roots.confine("compare", s)?;
                    }
                }
                roots.confine_opt("data", &mut o.data)?;
                Ok(())
            }
            Submission::Export(p) => {
                p.model = model(&p.model.display().to_string())?.into();
                p.adapter = roots.existing("adapter", &p.adapter.display().to_string())?;
                roots.confine_opt("chat_template", &mut p.chat_template)?;
                if p.model.as_os_str() != "smollm2" {
                    p.resolved_formats()
                        .map_err(|e| ApiError::bad_request(format!("format: {e:#}")))?;
                }
                Ok(())
            }
        }
    }

    /// Refuses a named output folder the job would spoil or that would spoil its result: a
    /// train job's that holds a run (unless `overwrite`), an export job's that is not new or
    /// empty (its result is the whole folder).
    fn check_output(&self, dir: &std::path::Path) -> ApiResult<()> {
        // A job writing into a folder that holds what it reads would mix its outputs into its
        // inputs (a run's files inside the base model, then exported with it).
        if let Some((field, path)) = self.inputs().into_iter().find(|(_, p)| p.starts_with(dir)) {
            return Err(ApiError::conflict(format!(
                "output: {} is or holds the job's {field} ({}); name a folder of its own",
                dir.display(),
                path.display()
            )));
        }
        match self {
            Submission::Eval(_) => {
                let held: Vec<&str> = [EVAL_JSON, EVAL_REPORT, "report.png"]
                    .into_iter()
                    .filter(|name| dir.join(name).symlink_metadata().is_ok())
                    .collect();
                if !held.is_empty() {
                    return Err(ApiError::conflict(format!(
                        "output: {} already holds {}, which an eval job writes; name another \
                         folder",
                        dir.display(),
                        held.join(", ")
                    )));
                }
            }
            Submission::Train(cfg) if !cfg.overwrite => {
                let held = crate::train::run_folder::run_outputs(dir)?;
                if !held.is_empty() {
                    return Err(ApiError::conflict(format!(
                        "output: {} already holds a run ({}); name another folder, or set \
                         `\"overwrite\": true` to delete that run's outputs and start again",
                        dir.display(),
                        held.join(", ")
                    )));
                }
            }
            Submission::Export(_) if !is_empty_or_missing(dir)? => {
                return Err(ApiError::conflict(format!(
                    "output: {} is not empty; an export job writes into a new or empty folder \
                     (its result is that whole folder), so name another",
                    dir.display()
                )));
            }
            _ => {}
        }
        Ok(())
    }

    /// The files and folders the job reads, by field (canonical once `confine` has run; a
    /// built-in model's name is no path and is left out).
    fn inputs(&self) -> Vec<(&'static str, std::path::PathBuf)> {
        let mut out: Vec<(&'static str, Option<String>)> = Vec::new();
        match self {
            Submission::Train(cfg) => {
                out.push(("model", Some(cfg.model.clone())));
                out.push(("data", Some(cfg.data.clone())));
                out.push(("valid", cfg.valid.clone()));
                out.push(("warm_start", cfg.warm_start.clone()));
                out.push(("chat_template", cfg.chat_template.clone()));
            }
            Submission::Eval(o) => {
                out.push(("model", o.model.clone()));
                out.push(("data", o.data.clone()));
                out.push((
                    "adapter",
                    o.adapter.as_ref().map(|p| p.display().to_string()),
                ));
                out.push(("config", o.config.as_ref().map(|p| p.display().to_string())));
                out.push(("chat_template", o.chat_template.clone()));
                for c in o.compare.iter().filter(|c| *c != "base") {
                    out.push(("compare", Some(c.clone())));
                }
            }
            Submission::Export(p) => {
                out.push(("model", Some(p.model.display().to_string())));
                out.push(("adapter", Some(p.adapter.display().to_string())));
                out.push(("chat_template", p.chat_template.clone()));
            }
        }
        out.into_iter()
            .filter_map(|(field, p)| Some((field, std::path::PathBuf::from(p?))))
            .filter(|(_, p)| p.is_absolute())
            .collect()
    }

    /// Points the job's outputs into `dir`.
    fn set_output(&mut self, dir: &std::path::Path) {
        match self {
            Submission::Train(cfg) => cfg.output = dir.display().to_string(),
            Submission::Eval(o) => {
                o.out = Some(dir.join(EVAL_JSON));
                o.report = Some(dir.join(EVAL_REPORT));
            }
            Submission::Export(p) => p.output = dir.to_path_buf(),
        }
    }

    fn to_json(&self) -> ApiResult<String> {
        Ok(match self {
            Submission::Train(cfg) => serde_json::to_string(cfg),
            Submission::Eval(o) => serde_json::to_string(o),
            Submission::Export(p) => serde_json::to_string(p),
        }
        .map_err(anyhow::Error::from)?)
    }

    fn queued_message(&self) -> String {
        match self {
            Submission::Train(cfg) => format!("queued: {:?} on {}", cfg.method, cfg.model),
            Submission::Eval(o) => format!(
                "queued: eval ({}) on {}",
                json!(o.scorer).as_str().unwrap_or(""),
                o.model.as_deref().unwrap_or("smollm2")
            ),
            Submission::Export(p) => format!(
                "queued: export of {} onto {}",
                p.adapter.display(),
                p.model.display()
            ),
        }
    }
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
        "id": job.id, "kind": job.kind.as_str(), "state": job.state.as_str(), "step": job.step,
        "total_steps": job.total_steps, "method": cfg["method"], "scorer": cfg["scorer"],
        "model": cfg["model"], "data": cfg["data"], "adapter": cfg["adapter"],
        "output": job.output, "message": job.error,
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

/// Whether `dir` does not exist or is an empty folder.
fn is_empty_or_missing(dir: &std::path::Path) -> anyhow::Result<bool> {
    match std::fs::read_dir(dir) {
        Ok(mut entries) => Ok(entries.next().is_none()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(anyhow::anyhow!("reading {}: {e}", dir.display())),
    }
}

/// The folder of job `id` when it names none: `runs/job-N` under the first root, or the first
/// free one of `runs/job-N-2`, `runs/job-N-3`… when that one is taken (by an earlier job, or by
/// a run of another database over the same root). A free folder is missing or empty, and no
/// other job records it.
fn default_output(app: &App, db: &Db, id: i64) -> ApiResult<std::path::PathBuf> {
    let mut n = 1;
    loop {
        let name = match n {
            1 => format!("runs/job-{id}"),
            n => format!("runs/job-{id}-{n}"),
        };
        let dir = app.roots.writable("output", &name)?;
        if is_empty_or_missing(&dir)?
            && db
                .output_in_use(&dir.display().to_string(), Some(id))?
                .is_none()
        {
            return Ok(dir);
        }
        n += 1;
    }
}

async fn submit(
    State(app): State<Arc<App>>,
    body: Result<Json<Value>, JsonRejection>,
) -> ApiResult<(StatusCode, Json<Value>)> {
    let Json(body) = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    let (mut sub, named_output) = Submission::parse(&body)?;
    blocking(&app, move |app| {
        sub.confine(app)?;
        let named_output = named_output
            .map(|o| app.roots.writable("output", &o))
            .transpose()?;
        let id = {
            let db = app.db();
            if let Some(dir) = &named_output {
                if let Some(other) = db.output_in_use(&dir.display().to_string(), None)? {
                    return Err(ApiError::conflict(format!(
                        "output: {} is, holds or lies inside the output folder of job {other} \
                         (a job's result is its whole folder); name another",
                        dir.display()
                    )));
                }
                // The default outputs' folder holds every unnamed job's output.
                let defaults = app.roots.writable("output", "runs")?;
                if defaults.starts_with(dir) {
                    return Err(ApiError::conflict(format!(
                        "output: {} holds {}, where jobs without a named output write; name \
                         a folder inside it or beside it",
                        dir.display(),
                        defaults.display()
                    )));
                }
                sub.check_output(dir)?;
                sub.set_output(dir);
            }
            let output = named_output.as_ref().map(|d| d.display().to_string());
            let id = db.insert_job(sub.kind(), &sub.to_json()?, output.as_deref().unwrap_or(""))?;
            if named_output.is_none() {
                let dir = default_output(app, &db, id).inspect_err(|_| {
                    let _ = db.delete_job(id);
                })?;
                sub.set_output(&dir);
                db.set_config(id, &sub.to_json()?, &dir.display().to_string())?;
            }
            id
        };
        app.emit(
            id,
            "state",
            None,
            json!({"state": "queued", "message": sub.queued_message()}),
        )?;
        app.wake_worker();
        let job = load_job(app, id)?;
        Ok((StatusCode::CREATED, Json(detail(app, &job)?)))
    })
    .await
}

/// A stored job's paths checked again, as the roots and the file system are now, before it
/// runs: a symbolic link made since it was submitted, or a server restarted with other roots,
/// must not lead it out. Its paths were stored canonical, so one that resolves anywhere else now
/// is refused as well.
pub(crate) fn paths_still_confined(app: &App, job: &JobRow) -> anyhow::Result<()> {
    let stored = match job.kind {
        JobKind::Train => Submission::Train(Box::new(serde_json::from_str(&job.config)?)),
        JobKind::Eval => Submission::Eval(serde_json::from_str(&job.config)?),
        JobKind::Export => Submission::Export(serde_json::from_str(&job.config)?),
    };
    let refused = |e: ApiError| anyhow::anyhow!("refused to run: {}", e.message);
    for (field, path) in stored.inputs() {
        let now = app.roots.existing(field, &path.display().to_string());
        let now = now.map_err(|e| refused(e.into()))?;
        anyhow::ensure!(
            now == path,
            "refused to run: {field} {} now resolves to {} (a symbolic link made since the job \
             was submitted?)",
            path.display(),
            now.display()
        );
    }
    let output = app
        .roots
        .writable("output", &job.output)
        .map_err(|e| refused(e.into()))?;
    anyhow::ensure!(
        output == std::path::Path::new(&job.output),
        "refused to run: output {} now resolves to {} (a symbolic link made since the job was \
         submitted?)",
        job.output,
        output.display()
    );
    Ok(())
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

async fn job_status(State(app): State<Arc<App>>, JobId(id): JobId) -> ApiResult<Json<Value>> {
    blocking(&app, move |app| Ok(Json(detail(app, &load_job(app, id)?)?))).await
}

async fn job_metrics(State(app): State<Arc<App>>, JobId(id): JobId) -> ApiResult<Json<Value>> {
    blocking(&app, move |app| {
        load_job(app, id)?;
        let rows = app.db().metrics(id)?;
        let rows: Vec<Value> = rows.iter().map(|(_, _, r)| parse_json(Some(r))).collect();
        Ok(Json(json!({"id": id, "rows": rows})))
    })
    .await
}

async fn cancel(State(app): State<Arc<App>>, JobId(id): JobId) -> ApiResult<Json<Value>> {
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
                        let how = match job.kind {
                            JobKind::Train => "after checkpointing its current step",
                            JobKind::Eval => "after its current example",
                            JobKind::Export => "after its current artefact",
                        };
                        app.set_state(
                            id,
                            JobState::Cancelling,
                            &format!("cancelling: the job stops {how}"),
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

async fn resume(State(app): State<Arc<App>>, JobId(id): JobId) -> ApiResult<Json<Value>> {
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

async fn delete_job(State(app): State<Arc<App>>, JobId(id): JobId) -> ApiResult<Json<Value>> {
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

fn done_job(app: &App, id: i64, what: &str) -> ApiResult<JobRow> {
    let job = load_job(app, id)?;
    if job.state != JobState::Done {
        return Err(ApiError::conflict(format!(
            "job {id} is {}; its {what} is ready when it is done",
            job.state.as_str()
        )));
    }
    Ok(job)
}

fn download(content_type: &str, filename: &str, bytes: Vec<u8>) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type.to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{filename}\""),
            ),
        ],
        bytes,
    )
        .into_response()
}

/// How much of an archive is read ahead of the connection: a few chunks, whatever its size.
const ARCHIVE_CHUNK: usize = 256 * 1024;
const ARCHIVE_CHUNKS_AHEAD: usize = 4;

/// Hands what the archive writer writes to the response body in chunks; a closed connection
/// ends the writing.
struct ChunkSender {
    tx: tokio::sync::mpsc::Sender<std::io::Result<Bytes>>,
    chunk: Vec<u8>,
}

impl std::io::Write for ChunkSender {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = buf.len().min(ARCHIVE_CHUNK - self.chunk.len());
        self.chunk.extend_from_slice(&buf[..n]);
        if self.chunk.len() == ARCHIVE_CHUNK {
            self.flush()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.chunk.is_empty() {
            return Ok(());
        }
        let chunk = std::mem::replace(&mut self.chunk, Vec::with_capacity(ARCHIVE_CHUNK));
        self.tx
            .blocking_send(Ok(Bytes::from(chunk)))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the client left"))
    }
}

/// A tar archive as a download, streamed: its members are listed here (an unreadable folder is
/// an error answer), then written on the blocking pool as the client reads. A file that fails
/// mid-way ends the connection early, which the client sees as a short download of the
/// announced length.
fn tar_download(archive: super::tar::Archive, filename: &str) -> Response {
    let (tx, mut rx) = tokio::sync::mpsc::channel(ARCHIVE_CHUNKS_AHEAD);
    let len = archive.len();
    tokio::task::spawn_blocking(move || {
        let mut sender = ChunkSender {
            tx: tx.clone(),
            chunk: Vec::with_capacity(ARCHIVE_CHUNK),
        };
        if let Err(e) = archive.write_to(&mut sender) {
            let _ = tx.blocking_send(Err(std::io::Error::other(format!("{e:#}"))));
        }
    });
    let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
    (
        [
            (header::CONTENT_TYPE, "application/x-tar".to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{filename}\""),
            ),
            (header::CONTENT_LENGTH, len.to_string()),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

/// A 410 for a finished job whose result folder is gone from the disk (deleted or moved since),
/// rather than the read's error.
fn result_gone(job: &JobRow, dir: &std::path::Path) -> ApiResult<()> {
    if dir.symlink_metadata().is_err() {
        return Err(ApiError::new(
            StatusCode::GONE,
            format!(
                "job {}'s result {} is no longer on the disk (deleted or moved since the job \
                 ended)",
                job.id,
                dir.display()
            ),
        ));
    }
    Ok(())
}

fn adapter_tar(job: &JobRow) -> ApiResult<Response> {
    let dir = std::path::Path::new(&job.output).join("adapter");
    result_gone(job, &dir)?;
    let prefix = format!("job-{}-adapter", job.id);
    let archive = super::tar::Archive::folder(&dir, &prefix)?;
    Ok(tar_download(archive, &format!("{prefix}.tar")))
}

async fn adapter(State(app): State<Arc<App>>, JobId(id): JobId) -> ApiResult<Response> {
    blocking(&app, move |app| {
        let job = done_job(app, id, "adapter")?;
        if job.kind != JobKind::Train {
            return Err(ApiError::conflict(format!(
                "job {id} is an {} job and has no adapter; its result is GET /jobs/{id}/result",
                job.kind.as_str()
            )));
        }
        adapter_tar(&job)
    })
    .await
}

/// `format=VALUE` of a query string, if any.
fn query_format(query: Option<&str>) -> Option<String> {
    query?
        .split('&')
        .find_map(|kv| kv.strip_prefix("format="))
        .map(|v| v.to_string())
}

/// What a done job made: a training run's adapter (tar), an eval's scores (JSON; with
/// `?format=markdown` the report, `?format=png` a comparison's chart), an export's folder (tar).
async fn result(
    State(app): State<Arc<App>>,
    JobId(id): JobId,
    RawQuery(query): RawQuery,
) -> ApiResult<Response> {
    blocking(&app, move |app| {
        let job = done_job(app, id, "result")?;
        let out = std::path::Path::new(&job.output);
        // A train or export job's result is one tar: any other format asked for is refused,
        // not answered with the tar.
        if job.kind != JobKind::Eval {
            if let Some(f) = query_format(query.as_deref()).filter(|f| f != "tar") {
                return Err(ApiError::bad_request(format!(
                    "format: {f:?}: a {} job's result is a tar (format=tar, or none)",
                    job.kind.as_str()
                )));
            }
        }
        match job.kind {
            JobKind::Train => adapter_tar(&job),
            JobKind::Export => {
                let prefix = format!("job-{id}-export");
                result_gone(&job, out)?;
                let archive = super::tar::Archive::tree(out, &prefix)?;
                Ok(tar_download(archive, &format!("{prefix}.tar")))
            }
            JobKind::Eval => {
                let format = query_format(query.as_deref()).unwrap_or_else(|| "json".into());
                let report = out.join(EVAL_REPORT);
                let (path, content_type) = match format.as_str() {
                    "json" => (out.join(EVAL_JSON), "application/json"),
                    "markdown" | "md" => (report, "text/markdown; charset=utf-8"),
                    "png" => (crate::eval::run::chart_path(&report), "image/png"),
                    other => {
                        return Err(ApiError::bad_request(format!(
                            "format: {other:?} is not one of json, markdown, png"
                        )))
                    }
                };
                if !path.is_file() {
                    return Err(ApiError::new(
                        StatusCode::NOT_FOUND,
                        format!(
                            "job {id} has no {}{}",
                            path.display(),
                            if format == "png" {
                                " (a chart is drawn for a before/after comparison)"
                            } else {
                                ""
                            }
                        ),
                    ));
                }
                let bytes = std::fs::read(&path)
                    .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
                let name = path
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or("result");
                Ok(download(content_type, &format!("job-{id}-{name}"), bytes))
            }
        }
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
    JobId(id): JobId,
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

        let err = |body: Value| {
            parse_config(&body)
                .and_then(|(cfg, _)| validated(&cfg))
                .unwrap_err()
        };
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
