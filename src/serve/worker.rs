//! The job worker: one blocking thread (training never runs on the async runtime) that takes the
//! oldest queued job and runs it by its kind, through the same library calls as the command
//! line: a `train` job loads its model and data as `lorafit train` does and runs
//! `trainer::train_with` with a listener that stores and publishes what the trainer reports; an
//! `eval` job runs `eval::run` and an `export` job `export::run_with`, their progress stored and
//! published the same way. One job runs at a time: one device. A job that fails (bad data, out of
//! memory, a panic) is marked failed with its reason and the queue goes on. A cancel or a
//! shutdown stops a training run after checkpointing its step, and an eval or export after its
//! current example or artefact (they have no checkpoints: they rerun from the start).

use super::db::{JobKind, JobRow, JobState};
use super::App;
use crate::config::TrainConfig;
use crate::tensor::Device;
use crate::train::events::{TrainEvent, TrainEvents};
use crate::train::trainer;
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

/// Runs queued jobs until the server shuts down.
pub fn run_queue(app: &App, wake: mpsc::Receiver<()>) {
    while !app.shutdown.load(Ordering::SeqCst) {
        let next = app.db().next_queued();
        match next {
            Ok(Some(job)) => run_job(app, job),
            Ok(None) => {
                // Woken by a submit or a resume; the timeout is only a safety net.
                let _ = wake.recv_timeout(Duration::from_secs(2));
            }
            Err(e) => {
                eprintln!("job worker: reading the queue: {e:#}");
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic with no message".to_string()
    }
}

fn run_job(app: &App, job: JobRow) {
    let id = job.id;
    if let Err(e) = run_job_inner(app, job) {
        // Only the database itself failing brings us here; say so where the operator looks.
        eprintln!("job {id}: recording its outcome failed: {e:#}");
    }
}

fn run_job_inner(app: &App, job: JobRow) -> Result<()> {
    match job.kind {
        JobKind::Train => run_job_with(app, job, train_job),
        JobKind::Eval => run_job_with(app, job, eval_job),
        JobKind::Export => run_job_with(app, job, export_job),
    }
}

/// How a job's run ended.
pub(crate) enum Outcome {
    /// It finished: the data of its `done` event (with a `message`).
    Done(Value),
    /// It stopped on request (a cancel or the server shutting down), leaving this checkpoint
    /// to resume from (None: the job reruns from the start).
    Stopped { checkpoint: Option<String> },
}

/// The error an eval's or export's progress callback ends the run with on a stop request.
#[derive(Debug)]
struct StopRequested;

impl std::fmt::Display for StopRequested {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stopped on request")
    }
}

impl std::error::Error for StopRequested {}

fn stop_requested(app: &App, cancel: &AtomicBool) -> bool {
    cancel.load(Ordering::SeqCst) || app.shutdown.load(Ordering::SeqCst)
}

/// Runs `job` through `work` (the trainer, eval, export, or a stand-in in tests) and records the
/// outcome.
fn run_job_with(
    app: &App,
    job: JobRow,
    work: impl FnOnce(&App, &JobRow, &AtomicBool) -> Result<Outcome>,
) -> Result<()> {
    let id = job.id;
    if !app
        .db()
        .transition(id, &[JobState::Queued], JobState::Running)?
    {
        return Ok(()); // cancelled or deleted between the queue read and now
    }
    let cancel = Arc::new(AtomicBool::new(false));
    app.running
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id, cancel.clone());
    let message = match &job.resume_from {
        Some(dir) => format!("running (resuming from {dir})"),
        None => "running".to_string(),
    };
    app.set_state(id, JobState::Running, &message)?;

    let result =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(app, &job, &cancel)));
    app.running
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&id);

    let (step, total) = app
        .db()
        .job(id)?
        .map_or((0, None), |j| (j.step, j.total_steps));
    match result {
        Ok(Ok(Outcome::Done(data))) => {
            app.db().set_resume_from(id, None)?;
            let state_message = match job.kind {
                JobKind::Train => format!("done at step {step}"),
                _ => "done".to_string(),
            };
            app.set_state(id, JobState::Done, &state_message)?;
            app.emit(id, "done", None, data)?;
        }
        Ok(Ok(Outcome::Stopped { checkpoint })) => {
            app.db().set_resume_from(id, checkpoint.as_deref())?;
            if checkpoint.is_none() {
                // Nothing to resume from: the next run starts over, its record with it.
                app.db().rewind_to(id, 0)?;
            }
            if cancel.load(Ordering::SeqCst) {
                let state_message = cancelled_message(job.kind, step, total);
                let message = match &checkpoint {
                    Some(c) => format!("{state_message}; checkpoint in {c}"),
                    None => state_message.clone(),
                };
                app.set_state(id, JobState::Cancelled, &state_message)?;
                app.emit(
                    id,
                    "cancelled",
                    None,
                    json!({"step": step, "total_steps": total, "checkpoint": checkpoint,
                           "message": message}),
                )?;
            } else {
                // The server is shutting down: the job goes back into the queue.
                let message = match &checkpoint {
                    Some(c) => format!("server stopped at step {step}; resumes from {c}"),
                    None => "server stopped; the job reruns from the start".to_string(),
                };
                app.set_state(id, JobState::Queued, &message)?;
            }
        }
        Ok(Err(e)) => fail(app, id, step, &format!("{e:#}"))?,
        Err(payload) => fail(
            app,
            id,
            step,
            &format!(
                "panic inside {}: {}",
                match job.kind {
                    JobKind::Train => "training",
                    JobKind::Eval => "the evaluation",
                    JobKind::Export => "the export",
                },
                panic_message(payload.as_ref())
            ),
        )?,
    }
    Ok(())
}

/// What a cancelled job had done: a training run's step, an eval's examples scored, an
/// export's artefacts written and checked (the last two rerun from the start).
fn cancelled_message(kind: JobKind, step: i64, total: Option<i64>) -> String {
    let total = total.map_or("?".to_string(), |t| t.to_string());
    match kind {
        JobKind::Train => format!("cancelled at step {step}"),
        JobKind::Eval if step == 0 => {
            "cancelled before its first example was scored; resuming reruns it from the start"
                .to_string()
        }
        JobKind::Eval => format!(
            "cancelled after scoring {step} of {total} examples; resuming reruns it from the start"
        ),
        JobKind::Export if step == 0 => {
            "cancelled before its first artefact was written; resuming reruns it from the start"
                .to_string()
        }
        JobKind::Export => format!(
            "cancelled after {step} of {total} export steps (each artefact written, then \
             checked); resuming reruns it from the start"
        ),
    }
}

fn fail(app: &App, id: i64, step: i64, reason: &str) -> Result<()> {
    let reason = &super::wording::api_wording(reason);
    // A failed job resumes, if asked, from its last complete checkpoint.
    let checkpoint = app.db().last_checkpoint(id)?;
    app.db()
        .set_resume_from(id, checkpoint.as_ref().map(|c| c.1.as_str()))?;
    eprintln!("job {id}: failed at step {step}: {reason}");
    app.db().set_state(id, JobState::Failed, Some(reason))?;
    app.emit(
        id,
        "state",
        None,
        json!({"state": "failed", "message": format!("failed: {reason}")}),
    )?;
    app.emit(
        id,
        "failed",
        None,
        json!({"step": step, "reason": reason, "message": format!("failed at step {step}: {reason}")}),
    )
}

/// Loads the job's model and data as `lorafit train` does and trains.
fn train_job(app: &App, job: &JobRow, cancel: &AtomicBool) -> Result<Outcome> {
    super::api::paths_still_confined(app, job)?;
    let mut cfg: TrainConfig =
        serde_json::from_str(&job.config).context("the job's stored config")?;
    let resume = job.resume_from.as_ref().map(PathBuf::from);
    if resume.is_none() && app.db().times_started(job.id)? > 1 {
        // Starting over (no checkpoint to resume from) after an earlier attempt: what that
        // attempt wrote is replaced. The folder held no run when the job was submitted
        // (`check_output`) and no other job writes there, so the run in it is this job's own.
        cfg.overwrite = true;
    }
    let device = Device::parse(&cfg.device)?;
    let loaded = trainer::load_configured(&cfg, &device)?;
    let (train_items, valid_items) = trainer::load_train_and_valid(&loaded, &cfg)?;
    let mut listener = JobListener {
        app,
        id: job.id,
        cancel,
    };
    let outcome = trainer::train_with(
        &cfg,
        resume.as_deref(),
        &loaded,
        &train_items,
        &valid_items,
        &mut listener,
    )?;
    let adapter = outcome.adapter_dir.display().to_string();
    if outcome.stopped {
        return Ok(Outcome::Stopped {
            checkpoint: Some(adapter),
        });
    }
    let step = app.db().job(job.id)?.map(|j| j.step).unwrap_or(0);
    Ok(Outcome::Done(json!({
        "step": step, "adapter": adapter,
        "message": format!("done: {step} steps; adapter in {adapter}"),
    })))
}

/// Stores and publishes the progress of an eval or export (`done` of `total`): the job's step
/// every time, a `progress` event about a hundred times a run; a stop request ends the run.
fn report_progress(
    app: &App,
    id: i64,
    cancel: &AtomicBool,
    done: usize,
    total: usize,
    message: String,
) -> Result<()> {
    // What was done is recorded before a stop request ends the run, so a cancel says it.
    app.db().set_progress(id, done as i64, total as i64)?;
    let every = total.div_ceil(100).max(1);
    if done.is_multiple_of(every) || done == total {
        app.emit(
            id,
            "progress",
            Some(done as i64),
            json!({"step": done, "total_steps": total, "message": message}),
        )?;
    }
    if stop_requested(app, cancel) {
        return Err(StopRequested.into());
    }
    Ok(())
}

/// A stop request ends an eval or export as `Stopped` (no checkpoint); anything else is an error.
fn stopped_or(e: anyhow::Error) -> Result<Outcome> {
    if e.downcast_ref::<StopRequested>().is_some() {
        Ok(Outcome::Stopped { checkpoint: None })
    } else {
        Err(e)
    }
}

/// Runs `lorafit eval` with the job's settings; its files go into the job's output folder.
fn eval_job(app: &App, job: &JobRow, cancel: &AtomicBool) -> Result<Outcome> {
    super::api::paths_still_confined(app, job)?;
    let opts: crate::eval::EvalOptions =
        serde_json::from_str(&job.config).context("the job's stored settings")?;
    std::fs::create_dir_all(&job.output).with_context(|| format!("creating {}", job.output))?;
    let subjects: Vec<String> = opts
        .subjects()
        .iter()
        .map(|s| {
            s.as_ref()
                .map_or("base".into(), |p| p.display().to_string())
        })
        .collect();
    app.emit(
        job.id,
        "started",
        None,
        json!({"kind": "eval", "scorer": opts.scorer, "model": opts.model, "data": opts.data,
               "subjects": subjects,
               "message": format!("eval: {} scorer on {}", json!(opts.scorer).as_str().unwrap_or(""),
                                  subjects.join(" vs "))}),
    )?;
    let outcome = crate::eval::run(&opts, &mut |p| {
        report_progress(
            app,
            job.id,
            cancel,
            p.done,
            p.total,
            format!("{}/{} scored ({})", p.done, p.total, p.subject),
        )
    });
    let outcome = match outcome {
        Ok(o) => o,
        Err(e) => return stopped_or(e),
    };
    Ok(Outcome::Done(json!({
        "result": job.output, "summary": outcome.summary, "chart": outcome.chart.is_some(),
        "message": format!("done: {}; results in {}", outcome.summary, job.output),
    })))
}

/// Runs `lorafit export` with the job's plan; a check outside its bound fails the job.
fn export_job(app: &App, job: &JobRow, cancel: &AtomicBool) -> Result<Outcome> {
    super::api::paths_still_confined(app, job)?;
    let mut plan: crate::export::ExportPlan =
        serde_json::from_str(&job.config).context("the job's stored settings")?;
    plan.model = trainer::resolve_model_path(&plan.model.display().to_string())?;
    if app.db().times_started(job.id)? <= 1 {
        // The folder was new or empty when the job was submitted (`check_output`), so an
        // export's artefacts in it on the first start were written by something else while the
        // job waited: they are not the job's to delete. A rerun deletes its own earlier ones.
        let names = crate::export::earlier_artefact_names(&plan.output);
        if !names.is_empty() {
            anyhow::bail!(
                "output {} was empty when the job was submitted but now holds an export ({}), \
                 written while the job waited; it is left as it is: submit the export again \
                 with another output",
                plan.output.display(),
                names.join(", ")
            );
        }
    }
    let formats = plan.resolved_formats()?;
    app.db()
        .set_progress(job.id, 0, plan.total_steps()? as i64)?;
    app.emit(
        job.id,
        "started",
        None,
        json!({"kind": "export", "formats": formats, "check": plan.check,
               "message": format!("export: {} of {} with {}{}",
                   formats.iter().map(|f| json!(f).as_str().unwrap_or("").to_string())
                       .collect::<Vec<_>>().join(", "),
                   plan.model.display(), plan.adapter.display(),
                   if plan.check { ", checked" } else { "" })}),
    )?;
    let report = crate::export::run_with(&plan, &mut |p| {
        report_progress(app, job.id, cancel, p.done, p.total, p.what.clone())
    });
    let report = match report {
        Ok(r) => r,
        Err(e) => return stopped_or(e),
    };
    report.check_passed()?;
    let written: Vec<Value> = report
        .written
        .iter()
        .map(|(f, p)| json!({"format": f, "path": p.display().to_string()}))
        .collect();
    let checks: Vec<Value> = report
        .checks
        .iter()
        .map(crate::export::check::row_json)
        .collect();
    Ok(Outcome::Done(json!({
        "result": job.output, "written": written, "checks": checks,
        "message": format!("done: {} artefact(s) in {}", written.len(), job.output),
    })))
}

/// Stores what the trainer reports (events, metric rows, checkpoints, progress) and publishes
/// it; asks the trainer to stop when the job is cancelled or the server shuts down.
struct JobListener<'a> {
    app: &'a App,
    id: i64,
    cancel: &'a AtomicBool,
}

fn finite(v: f64) -> serde_json::Value {
    // JSON has no NaN or infinity: a non-finite value is sent as null, not dropped.
    if v.is_finite() {
        json!(v)
    } else {
        serde_json::Value::Null
    }
}

fn metrics_json(m: &std::collections::BTreeMap<String, f64>) -> serde_json::Value {
    serde_json::Value::Object(m.iter().map(|(k, v)| (k.clone(), finite(*v))).collect())
}

impl TrainEvents for JobListener<'_> {
    fn event(&mut self, event: &TrainEvent<'_>) -> Result<()> {
        let (app, id) = (self.app, self.id);
        match event {
            TrainEvent::Started(r) => {
                let plan = json!({
                    "method": r.method, "device": r.device,
                    "train_examples": r.train_examples, "valid_examples": r.valid_examples,
                    "total_steps": r.total_steps, "start_step": r.start_step,
                    "grad_accum": r.grad_accum, "peak_lr": r.peak_lr,
                    "warmup_steps": r.warmup_steps, "lora_rank": r.lora_rank,
                    "lora_alpha": r.lora_alpha, "lora_params": r.lora_params,
                    "output": r.output, "resumed_from": r.resumed_from,
                    "segment_size": r.segment_size, "keep_attention": r.keep_attention,
                    "keep_kv_layers": r.keep_kv_layers, "offload": r.offload,
                    "pack_tokens": r.pack_tokens, "head": r.head,
                    "prefix_shared": r.prefix_shared,
                });
                app.db()
                    .set_plan(id, &plan.to_string(), r.total_steps as i64)?;
                let mut data = plan;
                data["message"] = json!(format!(
                    "plan: {} on {} | {} train / {} valid examples | {} steps from step {} | lr {:.2e} | LoRA r{} on {} params",
                    r.method, r.device, r.train_examples, r.valid_examples, r.total_steps,
                    r.start_step, r.peak_lr, r.lora_rank, r.lora_params
                ));
                app.emit(id, "started", None, data)?;
            }
            TrainEvent::Step(s) => {
                let row = json!({
                    "step": s.step, "total_steps": s.total_steps, "split": "train",
                    "loss": finite(s.loss), "lr": s.learning_rate, "grad_norm": finite(s.grad_norm),
                    "tokens": s.tokens, "tokens_per_s": s.tokens_per_second(),
                    "step_s": s.step_seconds, "peak_bytes": s.peak_bytes,
                    "metrics": metrics_json(&s.metrics),
                });
                app.db().add_step(id, s.step as i64, &row.to_string())?;
                let mut data = row;
                // The objective's metrics carry the loss; a step without them still shows it.
                let metrics = match trainer::fmt_metrics(&s.metrics) {
                    m if s.metrics.contains_key("loss") => m,
                    m => format!("loss {:.4} | {m}", s.loss),
                };
                data["message"] = json!(format!("step {}/{} | {metrics}", s.step, s.total_steps));
                app.emit(id, "step", Some(s.step as i64), data)?;
            }
            TrainEvent::Valid { step, metrics } => {
                let row = json!({"step": step, "split": "valid", "metrics": metrics_json(metrics)});
                app.db().add_valid(id, *step as i64, &row.to_string())?;
                let mut data = row;
                data["message"] =
                    json!(format!("valid @{step}: {}", trainer::fmt_metrics(metrics)));
                app.emit(id, "valid", Some(*step as i64), data)?;
            }
            TrainEvent::Checkpoint { step, path, best } => {
                let path = path.display().to_string();
                app.db().add_checkpoint(id, *step as i64, &path, *best)?;
                app.emit(
                    id,
                    "checkpoint",
                    Some(*step as i64),
                    json!({"step": step, "path": path, "best": best,
                           "message": format!("checkpoint of step {step}{} in {path}",
                                              if *best { " (best margin)" } else { "" })}),
                )?;
            }
            // The worker reports the outcome once `train_with` returns.
            TrainEvent::Stopped { .. } | TrainEvent::Finished { .. } => {}
        }
        Ok(())
    }

    fn stop_requested(&self) -> bool {
        stop_requested(self.app, self.cancel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve::db::Db;
    use crate::serve::paths::Roots;

    fn app(name: &str) -> std::sync::Arc<App> {
        let dir =
            std::env::temp_dir().join(format!("lorafit-worker-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let db = Db::open(&dir.join("jobs.sqlite")).unwrap();
        App::new(db, Roots::new(&[dir]).unwrap(), None).0
    }

    fn outcome_of(app: &App, id: i64) -> (JobState, String, Vec<String>) {
        let job = app.db().job(id).unwrap().unwrap();
        let kinds = app
            .db()
            .events_after(id, 0)
            .unwrap()
            .into_iter()
            .map(|e| e.kind)
            .collect();
        (job.state, job.error.unwrap_or_default(), kinds)
    }

    #[test]
    fn a_panic_or_an_error_inside_training_fails_the_job_and_nothing_else() {
        let app = app("panic");
        let a = app.db().insert_job(JobKind::Train, "{}", "/out/a").unwrap();
        let b = app.db().insert_job(JobKind::Eval, "{}", "/out/b").unwrap();
        let job = app.db().next_queued().unwrap().unwrap();
        assert_eq!(job.id, a);
        run_job_with(&app, job, |_, _, _| panic!("boom at step 3")).unwrap();
        let (state, reason, kinds) = outcome_of(&app, a);
        assert_eq!(state, JobState::Failed);
        assert_eq!(reason, "panic inside training: boom at step 3");
        assert_eq!(kinds, ["state", "state", "failed"]);
        // The running table is left empty and the next job runs.
        assert!(app.running.lock().unwrap().is_empty());
        let job = app.db().next_queued().unwrap().unwrap();
        assert_eq!(job.id, b);
        run_job_with(&app, job, |_, _, _| {
            Err(anyhow::anyhow!("out of memory").context("training example 4"))
        })
        .unwrap();
        let (state, reason, _) = outcome_of(&app, b);
        assert_eq!(state, JobState::Failed);
        assert_eq!(reason, "training example 4: out of memory");
        assert!(app.db().next_queued().unwrap().is_none());
    }

    #[test]
    fn a_cancelled_eval_or_export_says_what_it_had_done() {
        let app = app("cancelmsg");
        let cancelled = |kind: JobKind, work: &dyn Fn(&App, i64, &AtomicBool)| {
            let id = app.db().insert_job(kind, "{}", "/out/x").unwrap();
            let job = app.db().next_queued().unwrap().unwrap();
            run_job_with(&app, job, |app, job, cancel| {
                work(app, job.id, cancel);
                cancel.store(true, Ordering::SeqCst);
                stopped_or(StopRequested.into())
            })
            .unwrap();
            let (state, message, _) = outcome_of(&app, id);
            assert_eq!(state, JobState::Cancelled);
            let event = app.db().events_after(id, 0).unwrap().pop().unwrap();
            assert_eq!(event.kind, "cancelled");
            let data: Value = serde_json::from_str(&event.data).unwrap();
            (message, data)
        };
        // An export knows its steps from the start (export_job records 0 of them).
        let (message, data) = cancelled(JobKind::Export, &|app, id, _| {
            app.db().set_progress(id, 0, 4).unwrap();
        });
        assert!(
            message.starts_with("cancelled before its first artefact was written"),
            "{message}"
        );
        assert_eq!(
            (data["step"].as_i64(), data["total_steps"].as_i64()),
            (Some(0), Some(4))
        );
        let (message, data) = cancelled(JobKind::Export, &|app, id, cancel| {
            app.db().set_progress(id, 0, 4).unwrap();
            report_progress(app, id, cancel, 1, 4, "wrote adapter.gguf".into()).unwrap();
            // The artefact in hand when the cancel came is finished and counted.
            cancel.store(true, Ordering::SeqCst);
            assert!(report_progress(app, id, cancel, 2, 4, "checked".into()).is_err());
        });
        assert!(
            message.starts_with("cancelled after 2 of 4 export steps"),
            "{message}"
        );
        assert_eq!(data["message"], message.as_str());
        let (message, _) = cancelled(JobKind::Eval, &|_, _, _| {});
        assert!(
            message.starts_with("cancelled before its first example was scored"),
            "{message}"
        );
        let (message, _) = cancelled(JobKind::Eval, &|app, id, cancel| {
            report_progress(app, id, cancel, 3, 12, "3/12 scored".into()).unwrap();
        });
        assert!(
            message.starts_with("cancelled after scoring 3 of 12 examples"),
            "{message}"
        );
        assert!(!message.contains("step"), "{message}");
    }

    #[test]
    fn a_stopped_eval_is_cancelled_or_requeued_to_rerun_from_the_start() {
        let app = app("stopped");
        let a = app.db().insert_job(JobKind::Eval, "{}", "/out/a").unwrap();
        app.db().add_event(a, "progress", Some(3), "{}").unwrap();
        let job = app.db().next_queued().unwrap().unwrap();
        run_job_with(&app, job, |_, _, cancel| {
            cancel.store(true, Ordering::SeqCst);
            stopped_or(StopRequested.into())
        })
        .unwrap();
        let (state, _, kinds) = outcome_of(&app, a);
        assert_eq!(state, JobState::Cancelled);
        assert_eq!(kinds.last().map(String::as_str), Some("cancelled"));
        assert!(!kinds.contains(&"progress".to_string()), "{kinds:?}");

        let b = app
            .db()
            .insert_job(JobKind::Export, "{}", "/out/b")
            .unwrap();
        let job = app.db().next_queued().unwrap().unwrap();
        app.shutdown.store(true, Ordering::SeqCst);
        run_job_with(&app, job, |app, _, cancel| {
            assert!(stop_requested(app, cancel));
            stopped_or(StopRequested.into())
        })
        .unwrap();
        let (state, message, _) = outcome_of(&app, b);
        assert_eq!(state, JobState::Queued);
        assert!(message.contains("reruns from the start"), "{message}");
        assert_eq!(app.db().job(b).unwrap().unwrap().resume_from, None);
        // Any other error fails the job.
        let err = stopped_or(anyhow::anyhow!("disk full")).err().unwrap();
        assert_eq!(err.to_string(), "disk full");
    }
}
