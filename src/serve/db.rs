//! The job server's memory: one SQLite file (rusqlite, with SQLite compiled in) holding jobs
//! (their kind, `train`, `eval` or `export`, and resolved settings) and their states, every event a job reported (the SSE stream and the log are replays of it),
//! metric rows and checkpoints. Everything the server knows about a job survives a crash or a
//! restart here; nothing lives only in memory except which job is running right now.
//!
//! The file runs in WAL mode with `synchronous = NORMAL`: a killed process loses nothing that
//! was committed (only a power cut can lose the last transactions).

use anyhow::{bail, Context, Result};
use rusqlite::{params, Connection, OptionalExtension};
use std::path::Path;

/// Where a job is in its life. Terminal states (`Done`, `Failed`, `Cancelled`) may be deleted;
/// `Cancelled` and `Failed` may be resumed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobState {
    Queued,
    Running,
    /// A cancel was asked of a running job; it stops after checkpointing its current step.
    Cancelling,
    Cancelled,
    Done,
    Failed,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Cancelling => "cancelling",
            JobState::Cancelled => "cancelled",
            JobState::Done => "done",
            JobState::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Result<JobState> {
        Ok(match s {
            "queued" => JobState::Queued,
            "running" => JobState::Running,
            "cancelling" => JobState::Cancelling,
            "cancelled" => JobState::Cancelled,
            "done" => JobState::Done,
            "failed" => JobState::Failed,
            other => bail!("unknown job state {other:?} in the database"),
        })
    }

    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Done | JobState::Failed | JobState::Cancelled
        )
    }
}

/// What a job does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum JobKind {
    /// A training run (`TrainConfig`), resumable from its checkpoints.
    Train,
    /// `lorafit eval` (`eval::EvalOptions`); rerun from the start when interrupted.
    Eval,
    /// `lorafit export` (`export::ExportPlan`); rerun from the start when interrupted.
    Export,
}

impl JobKind {
    pub const ALL: [JobKind; 3] = [JobKind::Train, JobKind::Eval, JobKind::Export];

    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::Train => "train",
            JobKind::Eval => "eval",
            JobKind::Export => "export",
        }
    }

    pub fn parse(s: &str) -> Option<JobKind> {
        JobKind::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

/// One row of `jobs`.
#[derive(Clone, Debug)]
pub struct JobRow {
    pub id: i64,
    pub kind: JobKind,
    pub state: JobState,
    /// The resolved settings as JSON (paths canonical, defaults filled in): a `TrainConfig`, an
    /// `EvalOptions` or an `ExportPlan`, by `kind`.
    pub config: String,
    pub output: String,
    /// The run as the trainer resolved it (`RunStart` as JSON), once it has started.
    pub plan: Option<String>,
    pub step: i64,
    pub total_steps: Option<i64>,
    /// Why it failed, or what happened last to it.
    pub error: Option<String>,
    /// The checkpoint folder the next run of this job resumes from.
    pub resume_from: Option<String>,
    pub created: f64,
    pub updated: f64,
}

/// One row of `events`: what a job reported, in order (`seq` is global and increasing).
#[derive(Clone, Debug)]
pub struct EventRow {
    pub seq: i64,
    pub job_id: i64,
    pub kind: String,
    /// JSON object.
    pub data: String,
}

pub struct Db {
    conn: Connection,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL DEFAULT 'train',
    state TEXT NOT NULL,
    config TEXT NOT NULL,
    output TEXT NOT NULL,
    plan TEXT,
    step INTEGER NOT NULL DEFAULT 0,
    total_steps INTEGER,
    error TEXT,
    resume_from TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
    kind TEXT NOT NULL,
    step INTEGER,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id, seq);
CREATE TABLE IF NOT EXISTS metrics (
    job_id INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
    step INTEGER NOT NULL,
    split TEXT NOT NULL,
    row TEXT NOT NULL,
    PRIMARY KEY (job_id, split, step)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    job_id INTEGER NOT NULL REFERENCES jobs(id) ON DELETE CASCADE,
    step INTEGER NOT NULL,
    path TEXT NOT NULL,
    best INTEGER NOT NULL,
    PRIMARY KEY (job_id, path)
);
";

pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

const JOB_COLUMNS: &str =
    "id, state, config, output, plan, step, total_steps, error, resume_from, created, updated, kind";

fn job_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<(JobRow, String)> {
    let state: String = r.get(1)?;
    let kind: String = r.get(11)?;
    Ok((
        JobRow {
            id: r.get(0)?,
            // An unknown kind (a newer server's) is not run as training: it fails on start.
            kind: JobKind::parse(&kind).unwrap_or(JobKind::Eval),
            state: JobState::Queued,
            config: r.get(2)?,
            output: r.get(3)?,
            plan: r.get(4)?,
            step: r.get(5)?,
            total_steps: r.get(6)?,
            error: r.get(7)?,
            resume_from: r.get(8)?,
            created: r.get(9)?,
            updated: r.get(10)?,
        },
        state,
    ))
}

fn with_state((mut job, state): (JobRow, String)) -> Result<JobRow> {
    job.state = JobState::parse(&state)?;
    Ok(job)
}

impl Db {
    pub fn open(path: &Path) -> Result<Db> {
        Db::open_file(path).with_context(|| format!("opening the job database {}", path.display()))
    }

    fn open_file(path: &Path) -> Result<Db> {
        let conn = Connection::open(path)?;
        // journal_mode answers with the mode now in force; WAL is what we asked for.
        conn.pragma_update_and_check(None, "journal_mode", "WAL", |_| Ok(()))?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        conn.execute_batch(SCHEMA).context("creating its tables")?;
        // A database from before job kinds: every job in it was a training run.
        let has_kind = conn
            .prepare("SELECT 1 FROM pragma_table_info('jobs') WHERE name = 'kind'")?
            .exists([])?;
        if !has_kind {
            conn.execute_batch("ALTER TABLE jobs ADD COLUMN kind TEXT NOT NULL DEFAULT 'train'")
                .context("adding job kinds")?;
        }
        Ok(Db { conn })
    }

    pub fn insert_job(&self, kind: JobKind, config: &str, output: &str) -> Result<i64> {
        let t = now();
        self.conn.execute(
            "INSERT INTO jobs (kind, state, config, output, created, updated) VALUES (?1, ?2, ?3, ?4, ?5, ?5)",
            params![kind.as_str(), JobState::Queued.as_str(), config, output, t],
        )?;
        Ok(self.conn.last_insert_rowid())
    }

    /// Records how far a job without training steps (eval, export) got: `step` of `total`.
    pub fn set_progress(&self, id: i64, step: i64, total: i64) -> Result<()> {
        self.conn.execute(
            "UPDATE jobs SET step = ?2, total_steps = ?3, updated = ?4 WHERE id = ?1",
            params![id, step, total, now()],
        )?;
        Ok(())
    }

    pub fn set_config(&self, id: i64, config: &str, output: &str) -> Result<()> {
        self.conn.execute(
            "UPDATE jobs SET config = ?2, output = ?3, updated = ?4 WHERE id = ?1",
            params![id, config, output, now()],
        )?;
        Ok(())
    }

    pub fn job(&self, id: i64) -> Result<Option<JobRow>> {
        let row = self
            .conn
            .query_row(
                &format!("SELECT {JOB_COLUMNS} FROM jobs WHERE id = ?1"),
                [id],
                job_from_row,
            )
            .optional()?;
        row.map(with_state).transpose()
    }

    pub fn jobs(&self) -> Result<Vec<JobRow>> {
        let mut stmt = self
            .conn
            .prepare(&format!("SELECT {JOB_COLUMNS} FROM jobs ORDER BY id"))?;
        let rows = stmt.query_map([], job_from_row)?;
        rows.map(|r| with_state(r?)).collect()
    }

    /// The oldest queued job.
    pub fn next_queued(&self) -> Result<Option<JobRow>> {
        let row = self
            .conn
            .query_row(
                &format!(
                    "SELECT {JOB_COLUMNS} FROM jobs WHERE state = 'queued' ORDER BY id LIMIT 1"
                ),
                [],
                job_from_row,
            )
            .optional()?;
        row.map(with_state).transpose()
    }

    pub fn jobs_in_state(&self, state: JobState) -> Result<Vec<JobRow>> {
        Ok(self
            .jobs()?
            .into_iter()
            .filter(|j| j.state == state)
            .collect())
    }

    /// A job other than `except`, still in the database, whose output folder is `output`, lies
    /// inside it or holds it (a job's download is its whole folder: one inside another's would
    /// put one job's files in the other's result).
    pub fn output_in_use(&self, output: &str, except: Option<i64>) -> Result<Option<i64>> {
        let mut stmt = self
            .conn
            .prepare("SELECT id, output FROM jobs WHERE id != ?1 AND output != '' ORDER BY id")?;
        let rows = stmt.query_map(params![except.unwrap_or(-1)], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?))
        })?;
        let mine = std::path::Path::new(output);
        for row in rows {
            let (id, theirs) = row?;
            let theirs = std::path::Path::new(&theirs);
            if mine.starts_with(theirs) || theirs.starts_with(mine) {
                return Ok(Some(id));
            }
        }
        Ok(None)
    }

    pub fn set_state(&self, id: i64, state: JobState, error: Option<&str>) -> Result<()> {
        self.conn.execute(
            "UPDATE jobs SET state = ?2, error = ?3, updated = ?4 WHERE id = ?1",
            params![id, state.as_str(), error, now()],
        )?;
        Ok(())
    }

    /// Moves `id` from `from` to `to` only if it is in `from`; whether it did.
    pub fn transition(&self, id: i64, from: &[JobState], to: JobState) -> Result<bool> {
        let tx = self.conn.unchecked_transaction()?;
        let current: Option<String> = tx
            .query_row("SELECT state FROM jobs WHERE id = ?1", [id], |r| r.get(0))
            .optional()?;
        let ok = match current {
            Some(s) => from.contains(&JobState::parse(&s)?),
            None => false,
        };
        if ok {
            tx.execute(
                "UPDATE jobs SET state = ?2, updated = ?3 WHERE id = ?1",
                params![id, to.as_str(), now()],
            )?;
        }
        tx.commit()?;
        Ok(ok)
    }

    pub fn set_resume_from(&self, id: i64, resume_from: Option<&str>) -> Result<()> {
        self.conn.execute(
            "UPDATE jobs SET resume_from = ?2 WHERE id = ?1",
            params![id, resume_from],
        )?;
        Ok(())
    }

    pub fn set_plan(&self, id: i64, plan: &str, total_steps: i64) -> Result<()> {
        self.conn.execute(
            "UPDATE jobs SET plan = ?2, total_steps = ?3, updated = ?4 WHERE id = ?1",
            params![id, plan, total_steps, now()],
        )?;
        Ok(())
    }

    /// Records a step's metrics row and advances the job's step, in one transaction.
    pub fn add_step(&self, id: i64, step: i64, row: &str) -> Result<()> {
        let tx = self.conn.unchecked_transaction()?;
        tx.execute(
            "INSERT OR REPLACE INTO metrics (job_id, step, split, row) VALUES (?1, ?2, 'train', ?3)",
            params![id, step, row],
        )?;
        tx.execute(
            "UPDATE jobs SET step = ?2, updated = ?3 WHERE id = ?1",
            params![id, step, now()],
        )?;
        tx.commit()?;
        Ok(())
    }

    pub fn add_valid(&self, id: i64, step: i64, row: &str) -> Result<()> {
        self.conn.execute(
            "INSERT OR REPLACE INTO metrics (job_id, step, split, row) VALUES (?1, ?2, 'valid', ?3)",
            params![id, step, row],
        )?;
        Ok(())
    }

    /// Metric rows of a job as (step, split, row JSON), by step (validation before training at
    /// step 0, after it otherwise).
    pub fn metrics(&self, id: i64) -> Result<Vec<(i64, String, String)>> {
        let mut stmt = self.conn.prepare(
            "SELECT step, split, row FROM metrics WHERE job_id = ?1 ORDER BY step, split",
        )?;
        let rows = stmt.query_map([id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The latest metrics row of `split`.
    pub fn latest_metrics(&self, id: i64, split: &str) -> Result<Option<String>> {
        Ok(self
            .conn
            .query_row(
                "SELECT row FROM metrics WHERE job_id = ?1 AND split = ?2 ORDER BY step DESC LIMIT 1",
                params![id, split],
                |r| r.get(0),
            )
            .optional()?)
    }

    pub fn add_checkpoint(&self, id: i64, step: i64, path: &str, best: bool) -> Result<()> {
        self.conn.execute(
            "INSERT OR REPLACE INTO checkpoints (job_id, step, path, best) VALUES (?1, ?2, ?3, ?4)",
            params![id, step, path, best as i64],
        )?;
        Ok(())
    }

    /// The latest step checkpoint (not the best-margin copy, which is rewritten in place) whose
    /// folder still holds a trainer state: (step, path).
    pub fn last_checkpoint(&self, id: i64) -> Result<Option<(i64, String)>> {
        let mut stmt = self.conn.prepare(
            "SELECT step, path FROM checkpoints WHERE job_id = ?1 AND best = 0 ORDER BY step DESC",
        )?;
        let rows = stmt.query_map([id], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))?;
        for row in rows {
            let (step, path) = row?;
            if Path::new(&path).join("trainer_state.json").is_file() {
                return Ok(Some((step, path)));
            }
        }
        Ok(None)
    }

    /// Forgets everything a job reported after `step` (metrics, step events, checkpoints), so
    /// that a run resumed from the checkpoint of `step` continues the record without repeats.
    pub fn rewind_to(&self, id: i64, step: i64) -> Result<()> {
        let tx = self.conn.unchecked_transaction()?;
        tx.execute(
            "DELETE FROM metrics WHERE job_id = ?1 AND step > ?2",
            params![id, step],
        )?;
        tx.execute(
            "DELETE FROM events WHERE job_id = ?1 AND step IS NOT NULL AND step > ?2",
            params![id, step],
        )?;
        tx.execute(
            "DELETE FROM checkpoints WHERE job_id = ?1 AND step > ?2",
            params![id, step],
        )?;
        tx.execute(
            "UPDATE jobs SET step = ?2, updated = ?3 WHERE id = ?1",
            params![id, step, now()],
        )?;
        tx.commit()?;
        Ok(())
    }

    pub fn add_event(&self, id: i64, kind: &str, step: Option<i64>, data: &str) -> Result<i64> {
        self.conn.execute(
            "INSERT INTO events (job_id, kind, step, data) VALUES (?1, ?2, ?3, ?4)",
            params![id, kind, step, data],
        )?;
        Ok(self.conn.last_insert_rowid())
    }

    /// How many times job `id` has been started (its `running` state events; a rewind keeps
    /// them).
    pub fn times_started(&self, id: i64) -> Result<i64> {
        Ok(self.conn.query_row(
            "SELECT COUNT(*) FROM events WHERE job_id = ?1 AND kind = 'state' \
             AND json_extract(data, '$.state') = 'running'",
            [id],
            |r| r.get(0),
        )?)
    }

    /// A job's events after `seq`, oldest first.
    pub fn events_after(&self, id: i64, seq: i64) -> Result<Vec<EventRow>> {
        let mut stmt = self.conn.prepare(
            "SELECT seq, job_id, kind, data FROM events WHERE job_id = ?1 AND seq > ?2 ORDER BY seq",
        )?;
        let rows = stmt.query_map(params![id, seq], |r| {
            Ok(EventRow {
                seq: r.get(0)?,
                job_id: r.get(1)?,
                kind: r.get(2)?,
                data: r.get(3)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Removes a job and everything recorded about it (not its files).
    pub fn delete_job(&self, id: i64) -> Result<()> {
        self.conn.execute("DELETE FROM jobs WHERE id = ?1", [id])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("lorafit-db-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn jobs_states_metrics_and_rewind_persist_across_reopen() {
        let dir = scratch("persist");
        let path = dir.join("jobs.sqlite");
        let ckpt = dir.join("checkpoint-000002");
        std::fs::create_dir_all(&ckpt).unwrap();
        std::fs::write(ckpt.join("trainer_state.json"), "{}").unwrap();
        {
            let db = Db::open(&path).unwrap();
            let id = db
                .insert_job(JobKind::Train, "{\"steps\":4}", "/out/a")
                .unwrap();
            assert_eq!(id, 1);
            assert!(db
                .transition(id, &[JobState::Queued], JobState::Running)
                .unwrap());
            assert!(!db
                .transition(id, &[JobState::Queued], JobState::Done)
                .unwrap());
            for step in 1..=3 {
                db.add_step(id, step, &format!("{{\"step\":{step}}}"))
                    .unwrap();
                db.add_event(id, "step", Some(step), "{}").unwrap();
            }
            db.add_checkpoint(id, 2, ckpt.to_str().unwrap(), false)
                .unwrap();
            db.add_checkpoint(id, 3, "/nowhere/checkpoint-000003", false)
                .unwrap();
            db.add_event(id, "state", None, "{}").unwrap();
            db.add_event(id, "state", None, r#"{"state": "running"}"#)
                .unwrap();
            db.add_event(id, "state", None, r#"{"state": "queued"}"#)
                .unwrap();
        }
        let db = Db::open(&path).unwrap();
        let job = db.job(1).unwrap().unwrap();
        assert_eq!(job.kind, JobKind::Train);
        assert_eq!(job.state, JobState::Running);
        assert_eq!(job.step, 3);
        assert_eq!(job.output, "/out/a");
        assert_eq!(db.output_in_use("/out/a", None).unwrap(), Some(1));
        assert_eq!(db.output_in_use("/out/a", Some(1)).unwrap(), None);
        // Inside it or holding it is in use too; a sibling whose name starts alike is not.
        assert_eq!(db.output_in_use("/out/a/adapter", None).unwrap(), Some(1));
        assert_eq!(db.output_in_use("/out", None).unwrap(), Some(1));
        assert_eq!(db.output_in_use("/out/ab", None).unwrap(), None);
        // The step-3 checkpoint's folder is gone: the step-2 one is the latest usable.
        let (step, path) = db.last_checkpoint(1).unwrap().unwrap();
        assert_eq!((step, path.as_str()), (2, ckpt.to_str().unwrap()));
        db.rewind_to(1, step).unwrap();
        let steps: Vec<i64> = db.metrics(1).unwrap().iter().map(|m| m.0).collect();
        assert_eq!(steps, vec![1, 2]);
        assert_eq!(db.job(1).unwrap().unwrap().step, 2);
        // Step events after 2 are gone; the step-less state event stays.
        let kinds: Vec<String> = db
            .events_after(1, 0)
            .unwrap()
            .into_iter()
            .map(|e| e.kind)
            .collect();
        assert_eq!(kinds, vec!["step", "step", "state", "state", "state"]);
        assert_eq!(db.times_started(1).unwrap(), 1);
        assert_eq!(
            db.latest_metrics(1, "train").unwrap().as_deref(),
            Some("{\"step\":2}")
        );
        db.delete_job(1).unwrap();
        assert!(db.job(1).unwrap().is_none());
        assert!(db.events_after(1, 0).unwrap().is_empty());
        assert!(db.metrics(1).unwrap().is_empty());
    }

    #[test]
    fn a_database_from_before_job_kinds_reads_its_jobs_as_training() {
        let dir = scratch("kinds");
        let path = dir.join("jobs.sqlite");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(
                "CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, state TEXT NOT NULL,
                 config TEXT NOT NULL, output TEXT NOT NULL, plan TEXT,
                 step INTEGER NOT NULL DEFAULT 0, total_steps INTEGER, error TEXT,
                 resume_from TEXT, created REAL NOT NULL, updated REAL NOT NULL);
                 INSERT INTO jobs (state, config, output, created, updated)
                 VALUES ('done', '{}', '/out/old', 1, 1);",
            )
            .unwrap();
        }
        let db = Db::open(&path).unwrap();
        assert_eq!(db.job(1).unwrap().unwrap().kind, JobKind::Train);
        let id = db.insert_job(JobKind::Export, "{}", "/out/new").unwrap();
        db.set_progress(id, 2, 4).unwrap();
        let job = db.job(id).unwrap().unwrap();
        assert_eq!(
            (job.kind, job.step, job.total_steps),
            (JobKind::Export, 2, Some(4))
        );
        drop(db);
        // Opening again leaves the column as it is.
        assert_eq!(Db::open(&path).unwrap().jobs().unwrap().len(), 2);
    }
}
