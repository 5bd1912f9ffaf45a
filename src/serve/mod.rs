//! `lorafit serve`: a job runner over HTTP. People submit training runs (a `TrainConfig` as
//! JSON, validated by the same code as the CLI), evaluations (`lorafit eval`'s settings) and
//! exports (`lorafit export`'s) and watch them from a script or the embedded web page; the
//! server keeps every job in SQLite and, when it starts again, resumes an interrupted training
//! run from its last checkpoint and reruns an interrupted eval or export.
//!
//! Roles:
//! - `api`: the HTTP routes (axum on tokio), authentication, request limits, the page.
//! - `worker`: the one blocking thread that runs jobs from the queue, one at a time (one
//!   device), through the trainer's events interface (`train::events`).
//! - `db`: the SQLite file: jobs, states, events, metric rows, checkpoints.
//! - `paths`: confinement of every path a job names to the `--root` folders.
//! - `tar`: the downloads' archive format, written as the client reads.
//! - `lock`: one server per database (a lock file beside it, held for the server's life).
//! - `wording`: the library's command-line advice in a failing job's messages, in the API's
//!   words.
//!
//! Data flows one way: a request writes a queued job into the database and wakes the worker;
//! the worker's listener writes what the trainer reports into the database and publishes each
//! stored event on a broadcast channel, from which the SSE streams read.

pub mod api;
pub mod db;
pub mod lock;
pub mod paths;
pub mod tar;
pub mod wording;
pub mod worker;

use anyhow::{bail, Context, Result};
use db::{Db, EventRow, JobState};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};

/// The `serve` command's settings.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    pub db: PathBuf,
    /// The bearer token every API request must carry (required off loopback).
    pub token: Option<String>,
    pub roots: Vec<PathBuf>,
}

/// Reads a token file: its first line, trimmed; an empty one is an error.
pub fn read_token_file(path: &std::path::Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the token file {}", path.display()))?;
    let token = text.lines().next().unwrap_or("").trim().to_string();
    if token.len() < 16 {
        bail!(
            "{}: the token must be at least 16 characters on the first line",
            path.display()
        );
    }
    Ok(token)
}

/// What the routes and the worker share.
pub struct App {
    db: Mutex<Db>,
    pub roots: paths::Roots,
    pub token: Option<String>,
    /// Every stored event, as it is stored (the SSE streams filter by job).
    pub events: tokio::sync::broadcast::Sender<Arc<EventRow>>,
    /// The cancel flag of the running job, by job id.
    pub running: Mutex<HashMap<i64, Arc<AtomicBool>>>,
    /// Set when the server shuts down: the running job checkpoints and is requeued.
    pub shutdown: AtomicBool,
    wake: Mutex<mpsc::Sender<()>>,
}

impl App {
    /// The shared state over an open database, and the receiver that wakes the worker.
    pub fn new(
        db: Db,
        roots: paths::Roots,
        token: Option<String>,
    ) -> (Arc<App>, mpsc::Receiver<()>) {
        let (wake_tx, wake_rx) = mpsc::channel();
        let (events, _) = tokio::sync::broadcast::channel(1024);
        let app = Arc::new(App {
            db: Mutex::new(db),
            roots,
            token,
            events,
            running: Mutex::new(HashMap::new()),
            shutdown: AtomicBool::new(false),
            wake: Mutex::new(wake_tx),
        });
        (app, wake_rx)
    }

    /// The database; a poisoned lock (a panic while it was held) is taken over, since every
    /// write is a single statement or a transaction and leaves the file consistent.
    pub fn db(&self) -> MutexGuard<'_, Db> {
        self.db.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores an event of job `id` and publishes it to the SSE streams.
    pub fn emit(
        &self,
        id: i64,
        kind: &str,
        step: Option<i64>,
        data: serde_json::Value,
    ) -> Result<()> {
        let data = data.to_string();
        let seq = self.db().add_event(id, kind, step, &data)?;
        // No receiver is not an error: nobody is watching.
        let _ = self.events.send(Arc::new(EventRow {
            seq,
            job_id: id,
            kind: kind.to_string(),
            data,
        }));
        Ok(())
    }

    /// Sets a job's state and records it as a `state` event.
    pub fn set_state(&self, id: i64, state: JobState, message: &str) -> Result<()> {
        self.db().set_state(id, state, Some(message))?;
        self.emit(
            id,
            "state",
            None,
            serde_json::json!({"state": state.as_str(), "message": message}),
        )
    }

    /// Tells the worker to look at the queue.
    pub fn wake_worker(&self) {
        let _ = self.wake.lock().unwrap_or_else(|p| p.into_inner()).send(());
    }
}

/// Puts back into the queue every job that was running when the server last stopped (a crash,
/// a kill), to resume from its last checkpoint with its record rewound to that step (an eval or
/// export has none and reruns); a job whose cancel was pending is cancelled.
fn recover(app: &App) -> Result<()> {
    // (Each list is read into a variable first: a guard in a `for` head lives for the loop.)
    let cancelling = app.db().jobs_in_state(JobState::Cancelling)?;
    for job in cancelling {
        app.db().set_state(
            job.id,
            JobState::Cancelled,
            Some("cancelled (the server stopped before the job did)"),
        )?;
    }
    let interrupted = app.db().jobs_in_state(JobState::Running)?;
    for job in interrupted {
        let checkpoint = app.db().last_checkpoint(job.id)?;
        let message = match &checkpoint {
            Some((step, path)) => {
                app.db().rewind_to(job.id, *step)?;
                app.db().set_resume_from(job.id, Some(path))?;
                format!(
                    "interrupted at step {}; resuming from the checkpoint of step {step}",
                    job.step
                )
            }
            None => {
                app.db().rewind_to(job.id, 0)?;
                app.db().set_resume_from(job.id, None)?;
                match job.kind {
                    db::JobKind::Train => format!(
                        "interrupted at step {} before any checkpoint; starting over",
                        job.step
                    ),
                    kind => format!(
                        "interrupted at {} of {}; an {} job reruns from the start",
                        job.step,
                        job.total_steps.unwrap_or(0),
                        kind.as_str()
                    ),
                }
            }
        };
        eprintln!("job {}: {message}", job.id);
        app.set_state(job.id, JobState::Queued, &message)?;
    }
    Ok(())
}

/// Runs the server until SIGINT or SIGTERM; a running job then checkpoints and is requeued.
///
/// The order matters: the database's lock is taken before anything reads it (a second server
/// on one database stops there), and the address is bound before any job is recovered (a
/// server that cannot listen stops having changed nothing).
pub fn run(opts: ServeOptions) -> Result<()> {
    if !opts.listen.ip().is_loopback() && opts.token.is_none() {
        bail!(
            "--listen {}: not a loopback address, so a bearer token is required (--token-file FILE)",
            opts.listen
        );
    }
    let roots = paths::Roots::new(&opts.roots)?;
    if let Some(parent) = opts.db.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    let mut lock = lock::DbLock::acquire(&opts.db)?;

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind(opts.listen))
        .with_context(|| format!("listening on {}", opts.listen))?;
    let addr = listener.local_addr()?;
    lock.record_address(addr)?;

    let db = Db::open(&opts.db)?;
    let (app, wake_rx) = App::new(db, roots, opts.token.clone());
    recover(&app)?;

    let worker = {
        let app = app.clone();
        std::thread::Builder::new()
            .name("lorafit-job-worker".into())
            .spawn(move || worker::run_queue(&app, wake_rx))
            .context("starting the job worker thread")?
    };

    // The first line on stdout: scripts and tests read the port from it.
    println!("listening on http://{addr}");
    eprintln!(
        "lorafit serve: http://{addr} | database {} | roots {} | token {}",
        opts.db.display(),
        app.roots
            .dirs()
            .iter()
            .map(|r| r.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        if app.token.is_some() {
            "required"
        } else {
            "not required (loopback)"
        }
    );
    let served: Result<()> = runtime.block_on(async {
        // On a signal the server stops at once rather than draining connections: SSE streams
        // would hold a graceful shutdown open for as long as their clients stay.
        tokio::select! {
            served = std::future::IntoFuture::into_future(axum::serve(listener, api::router(app.clone()))) => {
                served.context("serving HTTP")
            }
            _ = shutdown_signal() => Ok(()),
        }
    });
    eprintln!("lorafit serve: shutting down; a running job checkpoints and is requeued");
    app.shutdown.store(true, Ordering::SeqCst);
    app.wake_worker();
    let _ = worker.join();
    drop(lock);
    served
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
