//! A run's output folder and what may happen to it: a new run refuses a folder that already
//! holds one (unless told to overwrite it) or that another process is training into (a lock
//! held for the run's life), a resumed run checks that its settings keep the
//! checkpoint's adapter shape and data, and cuts its line logs back to the checkpoint's step so
//! that a run killed at any moment and resumed writes the same bytes as one never interrupted.
//! The learning-rate schedule of a run continued past its planned end lives here too
//! (`CycleSchedule`), since only resuming can create it.

use super::optim::Schedule;
use super::trainer::{Item, ItemTokens};
use crate::config::{LrDecay, TrainConfig};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The resolved settings saved in every checkpoint (`TrainConfig::resolved`).
pub const RUN_SETTINGS: &str = "run.toml";
/// The trainer state saved in every checkpoint.
pub const TRAINER_STATE: &str = "trainer_state.json";
/// Line logs of a run, cut back to the checkpoint's step on resume.
pub const LINE_LOGS: [&str; 3] = ["metrics.jsonl", "timing.jsonl", "batches.jsonl"];

/// `checkpoint-NNNNNN` folder name of step `step`.
pub fn checkpoint_name(step: usize) -> String {
    format!("checkpoint-{step:06}")
}

/// Whether `dir` holds a trainer state that another tool wrote: Hugging Face's Trainer (TRL's
/// too) also names its folders `checkpoint-N` with a `trainer_state.json`, without lorafit's
/// `position` and `total_steps`. A folder without a readable state is not judged foreign.
fn foreign_checkpoint(dir: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(dir.join(TRAINER_STATE)) else {
        return false;
    };
    match serde_json::from_str::<serde_json::Value>(&text) {
        Ok(state) => state.get("position").is_none() || state.get("total_steps").is_none(),
        Err(_) => false,
    }
}

/// Says what a foreign checkpoint is.
fn foreign_note(name: &str) -> String {
    format!(
        "{name} was not written by lorafit (its {TRAINER_STATE} lacks lorafit's `position` and \
         `total_steps`, as Hugging Face's Trainer writes it)"
    )
}

/// The step of a folder named as lorafit names its checkpoints (`checkpoint-` and digits only).
fn checkpoint_name_step(name: &str) -> Option<usize> {
    let digits = name.strip_prefix("checkpoint-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Whether `dir`, named `checkpoint-NNNNNN`, is a whole lorafit checkpoint: its trainer state
/// is there and is not another tool's.
fn own_checkpoint(dir: &Path) -> bool {
    dir.join(TRAINER_STATE).is_file() && !foreign_checkpoint(dir)
}

/// The checkpoint `path` names: a checkpoint folder itself, or a run folder, whose latest whole
/// checkpoint (the highest step with a trainer state) is taken. A bare name
/// (`checkpoint-000006`) is a folder of the current one, so that the checkpoint's run folder
/// (its parent) is `.`.
pub fn find_checkpoint(path: &Path) -> Result<PathBuf> {
    if path.is_file() {
        bail!(
            "--resume {}: a file, not a run folder or checkpoint (give the run's output folder, \
             or one of its checkpoint-NNNNNN folders)",
            path.display()
        );
    }
    let mut parts = path.components();
    let path = match (parts.next(), parts.next()) {
        (Some(std::path::Component::Normal(_)), None) => Path::new(".").join(path),
        _ => path.to_path_buf(),
    };
    let path = path.as_path();
    if path.join(TRAINER_STATE).is_file() {
        if foreign_checkpoint(path) {
            bail!(
                "--resume {}: {}; lorafit resumes only its own checkpoints",
                path.display(),
                foreign_note("this checkpoint")
            );
        }
        return Ok(path.to_path_buf());
    }
    if !path.is_dir() {
        bail!(
            "--resume {}: no such checkpoint or run folder",
            path.display()
        );
    }
    let mut best: Option<(usize, PathBuf)> = None;
    let mut foreign = Vec::new();
    for entry in std::fs::read_dir(path).with_context(|| format!("reading {}", path.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().to_string();
        let Some(step) = checkpoint_name_step(&name) else {
            continue;
        };
        if foreign_checkpoint(&entry.path()) {
            foreign.push(name);
            continue;
        }
        if entry.path().join(TRAINER_STATE).is_file() && best.as_ref().is_none_or(|b| step > b.0) {
            best = Some((step, entry.path()));
        }
    }
    if let Some(name) = foreign.first() {
        bail!(
            "--resume {}: {}; lorafit resumes only its own checkpoints, and does not mix its \
             own with another tool's in one folder",
            path.display(),
            foreign_note(name)
        );
    }
    match best {
        Some((_, p)) => Ok(p),
        // A run whose final checkpoint could not be written keeps its finished adapter, which
        // --overwrite would delete.
        None if path.join("adapter").join("adapter_model.safetensors").is_file() => bail!(
            "--resume {}: no checkpoint in this folder (no checkpoint-NNNNNN/{TRAINER_STATE}), \
             but its adapter/ is a finished run's: use that adapter as it is, or start a new \
             run in another folder (--output), from its weights with --warm-start {}; \
             --overwrite (overwrite = true) would delete it",
            path.display(),
            path.join("adapter").display()
        ),
        None => bail!(
            "--resume {}: no checkpoint in this folder (no checkpoint-NNNNNN/{TRAINER_STATE}); start it again with --overwrite",
            path.display()
        ),
    }
}

/// Whether `name`, an entry of an output folder at `path`, is something a run writes there: a
/// folder named as lorafit names checkpoints counts only with a trainer state in it (another
/// tool's too, which `prepare` refuses), so a user's `checkpoint-notes/` is not a run's.
fn is_run_output(name: &str, path: &Path) -> bool {
    if name.starts_with("checkpoint-") {
        return checkpoint_name_step(name).is_some() && path.join(TRAINER_STATE).is_file();
    }
    matches!(
        name,
        "adapter"
            | "best"
            | "plan.toml"
            | "metrics.jsonl"
            | "timing.jsonl"
            | "batches.jsonl"
            | "plots"
    ) || name.starts_with(".tmp-")
        || name.starts_with("events.out.tfevents.")
}

/// The entries of `out_dir` that a run writes there (leftovers of an interrupted write
/// included), by name.
fn outputs_in(out_dir: &Path) -> Result<Vec<(String, PathBuf)>> {
    let mut outputs = Vec::new();
    for entry in
        std::fs::read_dir(out_dir).with_context(|| format!("reading {}", out_dir.display()))?
    {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().to_string();
        if is_run_output(&name, &entry.path()) {
            outputs.push((name, entry.path()));
        }
    }
    outputs.sort();
    Ok(outputs)
}

/// What a run left in `out_dir` (adapter, checkpoints, logs...), by name: empty when the folder
/// holds no run or does not exist.
pub fn run_outputs(out_dir: &Path) -> Result<Vec<String>> {
    if !out_dir.exists() {
        return Ok(Vec::new());
    }
    Ok(outputs_in(out_dir)?
        .into_iter()
        .map(|(name, _)| name)
        .filter(|name| !name.starts_with(".tmp-"))
        .collect())
}

/// The lock file a run holds in its output folder for its life (`RunLock`); not a run output.
pub const LOCK_FILE: &str = ".lorafit-lock";

/// An exclusive lock on a run folder (`flock` on its `LOCK_FILE`, which holds the holder's pid),
/// held for the run's life so that two processes never write one run. The kernel releases it
/// when the process ends, `kill -9` included; the file stays (removing it could let one process
/// lock the old file and another a new one).
#[derive(Debug)]
pub struct RunLock {
    _file: std::fs::File,
}

impl RunLock {
    /// Takes the lock of `out_dir` (an existing folder), or says which process holds it.
    pub fn acquire(out_dir: &Path) -> Result<RunLock> {
        use std::io::Seek;
        let path = out_dir.join(LOCK_FILE);
        let mut file = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| {
                format!(
                    "output {}: cannot write there (creating {})",
                    out_dir.display(),
                    path.display()
                )
            })?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                let holder = std::fs::read_to_string(&path).unwrap_or_default();
                let holder = match holder.trim() {
                    "" => String::new(),
                    pid => format!(" (pid {pid})"),
                };
                bail!(
                    "output {}: another lorafit process{holder} is training into this folder; \
                     wait for it to end (or stop it), or name another folder (--output)",
                    out_dir.display()
                );
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(e).with_context(|| format!("locking {}", path.display()))
            }
        }
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| writeln!(file, "{}", std::process::id()))
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(RunLock { _file: file })
    }
}

/// What `prepare` deletes in an output folder.
enum Deletion {
    /// A file or folder, whole.
    Path(PathBuf),
    /// The plots a run draws in this `plots/` folder (a user's own files there stay), and the
    /// folder if that empties it.
    Plots(PathBuf),
}

/// Checks that `out_dir` may take the run and says what `prepare` deletes there: the checks of
/// [`prepare`], with nothing changed.
fn plan_prepare(out_dir: &Path, resume: Option<&Path>, overwrite: bool) -> Result<Vec<Deletion>> {
    let outputs = outputs_in(out_dir)?;
    // Another tool's checkpoints are neither taken for this run's nor deleted with it.
    if let Some((name, _)) = (outputs.iter())
        .find(|(n, p)| (n.starts_with("checkpoint-") || n == "best") && foreign_checkpoint(p))
    {
        bail!(
            "output {}: {}; lorafit writes (and --overwrite deletes) only its own outputs: name \
             another folder (--output)",
            out_dir.display(),
            foreign_note(name)
        );
    }
    let holds_run = outputs.iter().any(|(n, _)| !n.starts_with(".tmp-"));
    let own_checkpoint = resume.is_some_and(|c| {
        let folder = c.parent().and_then(|p| p.canonicalize().ok());
        folder.is_some() && folder == out_dir.canonicalize().ok()
    });
    if holds_run && !own_checkpoint && !overwrite {
        let continue_it = match resume {
            Some(c) => format!(
                "resume {} into another folder (--output), or pass --overwrite (overwrite = \
                 true) to delete the run that is there",
                c.display()
            ),
            None => format!(
                "pass --resume {} to continue it, or --overwrite (overwrite = true) to delete it \
                 and start again",
                out_dir.display()
            ),
        };
        let names: Vec<&str> = (outputs.iter())
            .map(|(n, _)| n.as_str())
            .filter(|n| !n.starts_with('.'))
            .collect();
        let mut listed = names.iter().take(8).copied().collect::<Vec<_>>().join(", ");
        if names.len() > 8 {
            listed.push_str(&format!(" and {} more", names.len() - 8));
        }
        bail!(
            "output {} already holds a run ({listed}); {continue_it}",
            out_dir.display()
        );
    }
    // What the folder's run wrote after the checkpoint it resumes from.
    let mut abandoned = Vec::new();
    if let Some(c) = resume.filter(|_| own_checkpoint) {
        let from = checkpoint_step(c)?;
        for (name, path) in &outputs {
            if checkpoint_name_step(name).is_some_and(|n| n > from) {
                abandoned.push((name.clone(), path.clone()));
            }
        }
        // A `best` saved after the checkpoint is what a kill leaves (the resumed steps save it
        // again); beside later checkpoints it and the final adapter belong to the old steps.
        if !abandoned.is_empty() {
            for (name, path) in &outputs {
                let old_best = name == "best" && checkpoint_step(path).is_ok_and(|n| n > from);
                if old_best || name == "adapter" {
                    abandoned.push((name.clone(), path.clone()));
                }
            }
            if !overwrite {
                bail!(
                    "--resume {}: the folder's run went on past step {from} ({}); resumed here, \
                     the new steps would sit beside those, and a later --resume of the folder \
                     would take up the old ones. Pass --overwrite (overwrite = true) to delete \
                     them, or resume into another folder (--output)",
                    c.display(),
                    abandoned
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
        }
    }
    let mut doomed = Vec::new();
    // A plot whose write a kill interrupted leaves `plots/NAME.png.tmp` (`plot::write_png`).
    if let Ok(plots) = std::fs::read_dir(out_dir.join("plots")) {
        for entry in plots.flatten() {
            if entry.file_name().to_string_lossy().ends_with(".tmp") {
                doomed.push(Deletion::Path(entry.path()));
            }
        }
    }
    let fresh = overwrite && !own_checkpoint;
    for (name, path) in outputs {
        if fresh && name == "plots" && path.is_dir() {
            doomed.push(Deletion::Plots(path));
        } else if fresh || name.starts_with(".tmp-") || abandoned.iter().any(|(n, _)| *n == name) {
            doomed.push(Deletion::Path(path));
        }
    }
    // The checkpoint a resume reads from is never deleted, whatever names it (a bare name, a
    // link, a leftover `.tmp-` folder).
    if let Some(source) = resume.and_then(|c| c.canonicalize().ok()) {
        for d in &doomed {
            let Deletion::Path(path) = d else { continue };
            if path.canonicalize().is_ok_and(|p| source.starts_with(&p)) {
                bail!(
                    "--resume {}: making {} ready for the run would delete {}, which holds \
                     the checkpoint being resumed from; nothing was deleted. Resume from one of \
                     the run's checkpoint-NNNNNN folders, or into another folder (--output) \
                     without --overwrite (overwrite = true)",
                    resume.unwrap_or(Path::new("")).display(),
                    out_dir.display(),
                    path.display()
                );
            }
        }
    }
    Ok(doomed)
}

/// Checks, before the model and data load, what [`prepare`] would refuse and what would fail
/// later: a file in the way, a folder that cannot be written or that another process is
/// training into, one that already holds a run, and paths longer than the system takes (the
/// longest a run of `steps` steps writes). Nothing is deleted, and a folder that did not exist
/// is not left behind.
pub fn preflight(
    out_dir: &Path,
    resume: Option<&Path>,
    overwrite: bool,
    steps: usize,
) -> Result<()> {
    check_path_lengths(out_dir, steps)?;
    if out_dir.exists() && !out_dir.is_dir() {
        bail!(
            "output {}: a file is there; the output is a folder (name another)",
            out_dir.display()
        );
    }
    if out_dir.is_dir() {
        let _lock = RunLock::acquire(out_dir)?;
        plan_prepare(out_dir, resume, overwrite)?;
        return Ok(());
    }
    // The folders a run would create, created and removed again: the first that cannot be
    // is the error (a file among its parents, a read-only parent).
    let mut created = Vec::new();
    let mut at = Some(out_dir);
    while let Some(dir) = at.filter(|d| !d.as_os_str().is_empty() && !d.exists()) {
        created.push(dir.to_path_buf());
        at = dir.parent();
    }
    let made = std::fs::create_dir_all(out_dir)
        .with_context(|| format!("output {}: cannot create it", out_dir.display()));
    for dir in &created {
        let _ = std::fs::remove_dir(dir);
    }
    made
}

/// The longest path a run writes under its output folder, relative to it: a checkpoint of step
/// `steps` (at least 6 digits) being deleted by `prune_checkpoints`.
fn longest_output_path(steps: usize) -> String {
    format!(
        ".tmp-deleting-{}/adapter_model.safetensors.tmp",
        checkpoint_name(steps.max(999_999))
    )
}

/// Refuses an output folder whose run would write a path longer than Linux takes (4095 bytes,
/// 255 a name), naming the path, rather than failing at the first checkpoint.
fn check_path_lengths(out_dir: &Path, steps: usize) -> Result<()> {
    const PATH_MAX: usize = 4095;
    const NAME_MAX: usize = 255;
    if let Some(long) = out_dir
        .components()
        .map(|c| c.as_os_str().len())
        .find(|&n| n > NAME_MAX)
    {
        bail!(
            "output {}: a name in it is {long} bytes long, more than the {NAME_MAX} a file \
             system takes",
            out_dir.display()
        );
    }
    let longest = out_dir.join(longest_output_path(steps));
    let len = longest.as_os_str().len();
    if len > PATH_MAX {
        bail!(
            "output {}: the run would write paths of up to {len} bytes ({}), more than the \
             {PATH_MAX} the system takes; name a shorter output folder",
            out_dir.display(),
            longest_output_path(steps)
        );
    }
    Ok(())
}

/// Makes `out_dir` ready for a run and locks it for the run's life (the lock is taken before
/// anything there is deleted or written, and held until the returned guard drops). A folder that
/// already holds a run is refused unless the run resumes into it from one of its own checkpoints
/// or `overwrite` is set, in which case that run's outputs (and only those) are deleted first;
/// the checkpoint being resumed from is never among them. A resume from an earlier checkpoint
/// of the folder's run, with later ones beside it, is refused too (a later `--resume` of the
/// folder would take up the abandoned steps), unless `overwrite` deletes what the run wrote
/// after that checkpoint. Leftovers of a write that a kill interrupted (`.tmp-*`,
/// `plots/*.tmp`) are removed.
pub fn prepare(out_dir: &Path, resume: Option<&Path>, overwrite: bool) -> Result<RunLock> {
    if out_dir.exists() && !out_dir.is_dir() {
        bail!(
            "output {}: a file is there; the output is a folder (name another)",
            out_dir.display()
        );
    }
    std::fs::create_dir_all(out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let lock = RunLock::acquire(out_dir)?;
    for deletion in plan_prepare(out_dir, resume, overwrite)? {
        match deletion {
            Deletion::Plots(path) => {
                for file in super::listeners::plot_files() {
                    let plot = path.join(file);
                    if plot.is_file() {
                        std::fs::remove_file(&plot)
                            .with_context(|| format!("removing {}", plot.display()))?;
                    }
                }
                let _ = std::fs::remove_dir(&path);
            }
            Deletion::Path(path) => {
                let removed = if path.is_dir() {
                    std::fs::remove_dir_all(&path)
                } else {
                    std::fs::remove_file(&path)
                };
                removed.with_context(|| format!("removing {}", path.display()))?;
            }
        }
    }
    Ok(lock)
}

/// Refuses a resume whose saved settings (`settings`, a checkpoint's run.toml) name the model,
/// data or validation file by a path relative to the folder the run was started in that is not
/// found from here. A built-in model name (`smollm2`) and a Hub id are names, not paths.
pub fn check_stored_paths(cfg: &TrainConfig, settings: &Path) -> Result<()> {
    let paths = [
        ("model", Some(&cfg.model)),
        ("data", Some(&cfg.data)),
        ("valid", cfg.valid.as_ref()),
    ];
    for (name, path) in paths {
        let Some(path) = path else { continue };
        let p = Path::new(path);
        let named = name == "model"
            && (super::trainer::builtin_model(path) || crate::hub_cache::hub_id(path).is_some());
        if p.is_relative() && !p.exists() && !named {
            bail!(
                "{name} = {path:?} (from {}) is relative to the folder the run was started in, \
                 and is not found from here: run from that folder, or pass --{name}",
                settings.display()
            );
        }
    }
    Ok(())
}

/// Deletes the oldest step checkpoints of `out_dir` beyond the newest `keep` (0: none
/// deleted). Each is renamed to a `.tmp-` name first, so a kill midway leaves a whole
/// checkpoint or a leftover that the next `prepare` removes, never a checkpoint a resume could
/// take that lacks part of itself.
pub fn prune_checkpoints(out_dir: &Path, keep: usize) -> Result<()> {
    if keep == 0 {
        return Ok(());
    }
    let mut steps: Vec<(usize, PathBuf)> = std::fs::read_dir(out_dir)
        .with_context(|| format!("reading {}", out_dir.display()))?
        .flatten()
        .filter_map(|e| {
            let step = checkpoint_name_step(&e.file_name().to_string_lossy())?;
            own_checkpoint(&e.path()).then(|| (step, e.path()))
        })
        .collect();
    steps.sort();
    let old = steps.len().saturating_sub(keep);
    for (step, path) in steps.into_iter().take(old) {
        let doomed = out_dir.join(format!(".tmp-deleting-{}", checkpoint_name(step)));
        std::fs::rename(&path, &doomed)
            .with_context(|| format!("moving {} aside to delete it", path.display()))?;
        std::fs::remove_dir_all(&doomed)
            .with_context(|| format!("deleting {}", doomed.display()))?;
    }
    Ok(())
}

/// The step a checkpoint folder (or `best`) was saved at, from its trainer state.
pub fn checkpoint_step(dir: &Path) -> Result<usize> {
    let path = dir.join(TRAINER_STATE);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let state: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?;
    state["step"]
        .as_u64()
        .map(|s| s as usize)
        .with_context(|| format!("{}: no step", path.display()))
}

/// Cuts a line log back to the lines of steps up to `step`: later lines (the steps a resumed run
/// redoes) and a last line that a kill left without its newline are dropped. A missing file is
/// left missing.
pub fn truncate_lines_after(path: &Path, step: usize) -> Result<()> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let mut keep = 0;
    for line in text.split_inclusive(|&b| b == b'\n') {
        if line.last() != Some(&b'\n') {
            break;
        }
        let value: serde_json::Value = match serde_json::from_slice(line) {
            Ok(v) => v,
            Err(_) => break,
        };
        match value.get("step").and_then(|s| s.as_u64()) {
            Some(s) if s as usize <= step => keep += line.len(),
            _ => break,
        }
    }
    if keep < text.len() {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        file.set_len(keep as u64)
            .with_context(|| format!("truncating {}", path.display()))?;
    }
    Ok(())
}

/// An append-only JSON-lines file in which every line reaches the file with one write, so a kill
/// can cut at most the last line short (and `truncate_lines_after` drops that line).
pub struct LineLog {
    file: std::fs::File,
    path: PathBuf,
}

impl LineLog {
    pub fn append(path: &Path) -> Result<LineLog> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(LineLog {
            file,
            path: path.to_path_buf(),
        })
    }

    pub fn write(&mut self, v: &serde_json::Value) -> Result<()> {
        let mut line = v.to_string();
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// FNV-1a over the token ids of every example, in order: the identity of a run's data as
/// trained (file content, row format and tokenization together).
pub fn items_hash(items: &[Item]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for item in items {
        let parts: Vec<&[u32]> = match &item.tokens {
            ItemTokens::Pair(p) => vec![&p.prompt, &p.chosen, &p.rejected],
            ItemTokens::Sft(s) => vec![&s.prompt, &s.completion],
        };
        // A row's weight joins the hash only when it is not 1 (earlier runs' hashes stand); the
        // row's place does not (moving the file keeps the run's data).
        if item.weight != 1.0 {
            eat(item.weight.to_bits());
        }
        eat(parts.len() as u64);
        for part in parts {
            eat(part.len() as u64);
            part.iter().for_each(|&t| eat(t as u64));
        }
    }
    format!("{h:016x}")
}

/// The identity of a base model's weights, cheaply: for each weight file (a GGUF file, or a
/// folder's `.safetensors`, `.gguf` and `.bin` files; not `config.json`, whose formatting and
/// version fields change with the tool that wrote it) its name, length and 16 samples of 4 KiB
/// spread over it, FNV-1a hashed. Two bases of one shape (a model and its instruct variant,
/// different in every tensor) differ in it; a base moved or copied does not. A change confined
/// to bytes between the samples is not seen. `None` for a model that
/// was built in memory (no such path).
pub fn base_fingerprint(model_path: &Path) -> Result<Option<String>> {
    use std::io::{Read, Seek, SeekFrom};
    if !model_path.exists() {
        return Ok(None);
    }
    let mut files = Vec::new();
    if model_path.is_dir() {
        for entry in std::fs::read_dir(model_path)
            .with_context(|| format!("reading {}", model_path.display()))?
        {
            let path = entry?.path();
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            let weights = [".safetensors", ".gguf", ".bin"]
                .iter()
                .any(|e| name.ends_with(e));
            if weights {
                files.push(path);
            }
        }
        files.sort();
    } else {
        files.push(model_path.to_path_buf());
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
    };
    const SAMPLES: u64 = 16;
    const SAMPLE: u64 = 4096;
    let mut buf = vec![0u8; SAMPLE as usize];
    for path in files {
        let mut file =
            std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        let len = file.metadata()?.len();
        eat(path.file_name().unwrap_or_default().as_encoded_bytes());
        eat(&len.to_le_bytes());
        let span = len.saturating_sub(SAMPLE);
        for i in 0..SAMPLES {
            let at = span / (SAMPLES - 1) * i;
            file.seek(SeekFrom::Start(at))?;
            let n = (SAMPLE.min(len - at)) as usize;
            file.read_exact(&mut buf[..n])
                .with_context(|| format!("reading {}", path.display()))?;
            eat(&buf[..n]);
        }
    }
    Ok(Some(format!("{h:016x}")))
}

/// Settings that fix the adapter's shape: a resumed run must keep them (the per-module ranks
/// `rank_scaling` resolves, from the base model and `rank_kl_file`, are compared module by module
/// with the checkpoint's adapter by the trainer).
const SHAPE_SETTINGS: &[&str] = &[
    "rank",
    "alpha",
    "targets",
    "rslora",
    "rank_pattern",
    "rank_scaling",
];
/// Settings that fix which tokens the run reads and in which order.
const DATA_SETTINGS: &[&str] = &[
    "method",
    "max_seq_len",
    "max_prompt_len",
    "tokenization",
    "chat_template",
    "skip_bad_rows",
    "valid_fraction",
    "seed",
    "grad_accum",
];

/// Settings that fix the base weights the adapter is trained on (a quantized base's rounding).
const BASE_SETTINGS: &[&str] = &["base_quant"];

/// Refuses a resume whose settings change the checkpoint's adapter shape, base or data, naming
/// every difference. `saved` and `now` are resolved settings (`TrainConfig::resolved`); the
/// hashes are `items_hash` of the training examples.
pub fn check_resume(
    checkpoint: &Path,
    saved: &TrainConfig,
    saved_hash: Option<&str>,
    now: &TrainConfig,
    now_hash: &str,
) -> Result<()> {
    let table = |c: &TrainConfig| -> Result<toml::Table> { Ok(toml::from_str(&c.to_toml()?)?) };
    let (a, b) = (table(saved)?, table(now)?);
    let show = |v: Option<&toml::Value>| v.map_or("unset".to_string(), |v| v.to_string());
    let mut diffs = Vec::new();
    for key in SHAPE_SETTINGS
        .iter()
        .chain(BASE_SETTINGS)
        .chain(DATA_SETTINGS)
    {
        if a.get(*key) != b.get(*key) {
            diffs.push(format!(
                "{key}: checkpoint {}, now {}",
                show(a.get(*key)),
                show(b.get(*key))
            ));
        }
    }
    if let Some(h) = saved_hash.filter(|h| *h != now_hash) {
        diffs.push(format!(
            "data: the training examples differ (checkpoint {:?}, token hash {h}; now {:?}, token hash {now_hash})",
            saved.data, now.data
        ));
    }
    if !diffs.is_empty() {
        bail!(
            "--resume {}: the settings change the checkpoint's adapter, base or data:\n  {}\n(resume with the checkpoint's settings, in {}/{RUN_SETTINGS}, or start a new run with --warm-start {} for a new optimiser and schedule)",
            checkpoint.display(),
            diffs.join("\n  "),
            checkpoint.display(),
            checkpoint.display()
        );
    }
    Ok(())
}

/// The settings a resume changes besides those `check_resume` refuses to change, each
/// `name: checkpoint X, now Y` (where the run writes, what it is planned to, and overwriting are
/// not changes of the training). Said on resuming, so a learning rate or a schedule that came
/// from other flags than the run's is not a surprise.
pub fn changed_settings(saved: &TrainConfig, now: &TrainConfig) -> Result<Vec<String>> {
    let table = |c: &TrainConfig| -> Result<toml::Table> { Ok(toml::from_str(&c.to_toml()?)?) };
    let (a, b) = (table(saved)?, table(now)?);
    let quiet = [
        "output",
        "steps",
        "epochs",
        "warmup_steps",
        "overwrite",
        "data",
    ];
    let show = |v: Option<&toml::Value>| v.map_or("unset".to_string(), |v| v.to_string());
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    keys.sort();
    keys.dedup();
    Ok(keys
        .into_iter()
        .filter(|k| !quiet.contains(&k.as_str()))
        .filter(|k| {
            ![SHAPE_SETTINGS, BASE_SETTINGS, DATA_SETTINGS]
                .iter()
                .any(|list| list.contains(&k.as_str()))
        })
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| format!("{k}: checkpoint {}, now {}", show(a.get(k)), show(b.get(k))))
        .collect())
}

/// One warm-up + decay cycle of the schedule, ending at step `end` (exclusive, 0-based steps).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq)]
pub struct Cycle {
    pub end: usize,
    pub warmup: usize,
}

/// The learning rate over a run's cycles. A run has one cycle; continuing a run past its planned
/// end appends a second cycle from the old end to the new one (warm-up again, then the same
/// decay), so the steps already planned keep their rates and the new ones have a schedule of
/// their own (a warm restart) rather than the flat end of a finished cosine.
pub struct CycleSchedule {
    pub peak_lr: f64,
    pub decay: LrDecay,
    pub cycles: Vec<Cycle>,
}

impl CycleSchedule {
    pub fn total_steps(&self) -> usize {
        self.cycles.last().map_or(0, |c| c.end)
    }

    /// Learning rate of optimiser step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        let mut start = 0;
        for c in &self.cycles {
            if step < c.end || c.end == self.total_steps() {
                let s = Schedule {
                    peak_lr: self.peak_lr,
                    warmup_steps: c.warmup,
                    total_steps: c.end.saturating_sub(start),
                    decay: self.decay,
                };
                return s.lr(step.saturating_sub(start));
            }
            start = c.end;
        }
        self.peak_lr
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_cycle_restarts_the_schedule_at_the_old_end() {
        let one = CycleSchedule {
            peak_lr: 1.0,
            decay: LrDecay::Cosine,
            cycles: vec![Cycle { end: 10, warmup: 2 }],
        };
        let two = CycleSchedule {
            peak_lr: 1.0,
            decay: LrDecay::Cosine,
            cycles: vec![Cycle { end: 10, warmup: 2 }, Cycle { end: 20, warmup: 2 }],
        };
        for s in 0..10 {
            assert_eq!(one.lr(s).to_bits(), two.lr(s).to_bits(), "step {s}");
        }
        // Warm-up of the second cycle: 1/2 then the peak, then the cosine down to step 19.
        assert_eq!(two.lr(10), 0.5);
        assert_eq!(two.lr(11), 1.0);
        assert_eq!(two.lr(12), 1.0);
        let expect = 0.5 * (1.0 + (std::f64::consts::PI * 7.0 / 8.0).cos());
        assert!((two.lr(19) - expect).abs() < 1e-15, "{}", two.lr(19));
    }

    /// `linear` falls on a straight line from the peak after warm-up to zero at the cycle's end
    /// (Hugging Face's `get_linear_schedule_with_warmup` on the same 0-based step), and
    /// `constant_with_warmup` is `constant`.
    #[test]
    fn linear_decay_reaches_zero_at_the_end() {
        let s = |decay| CycleSchedule {
            peak_lr: 2.0,
            decay,
            cycles: vec![Cycle { end: 12, warmup: 2 }],
        };
        let linear = s(LrDecay::Linear);
        assert_eq!((linear.lr(0), linear.lr(1), linear.lr(2)), (1.0, 2.0, 2.0));
        for step in 2..12 {
            let hf = 2.0 * (12 - step) as f64 / 10.0;
            assert!((linear.lr(step) - hf).abs() < 1e-15, "step {step}");
        }
        assert_eq!(
            LrDecay::parse("constant_with_warmup"),
            Some(LrDecay::Constant)
        );
        assert_eq!(LrDecay::parse("cosine_with_restarts"), None);
        assert_eq!(s(LrDecay::Constant).lr(11), 2.0);
    }

    /// A folder holding Hugging Face Trainer checkpoints is not taken for a run: a new run and
    /// `--overwrite` refuse it (nothing deleted), and `--resume` names the foreign checkpoint
    /// instead of failing on its state. `--overwrite` of a lorafit run deletes the plots it drew
    /// and keeps a user's own file in `plots/`.
    #[test]
    fn another_tools_checkpoints_are_neither_taken_nor_deleted() {
        let d = std::env::temp_dir().join(format!("lorafit-foreign-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let trl = d.join("trl");
        std::fs::create_dir_all(trl.join("checkpoint-500")).unwrap();
        std::fs::write(
            trl.join("checkpoint-500").join(TRAINER_STATE),
            r#"{"global_step": 500, "log_history": []}"#,
        )
        .unwrap();
        for overwrite in [false, true] {
            let e = prepare(&trl, None, overwrite).unwrap_err().to_string();
            assert!(
                e.contains("checkpoint-500 was not written by lorafit"),
                "{e}"
            );
        }
        assert!(trl.join("checkpoint-500").join(TRAINER_STATE).is_file());
        let e = find_checkpoint(&trl).unwrap_err().to_string();
        assert!(
            e.contains("checkpoint-500 was not written by lorafit"),
            "{e}"
        );
        let e = find_checkpoint(&trl.join("checkpoint-500"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("only its own checkpoints"), "{e}");

        let run = d.join("run");
        std::fs::create_dir_all(run.join("plots")).unwrap();
        std::fs::create_dir_all(run.join(checkpoint_name(2))).unwrap();
        std::fs::write(
            run.join(checkpoint_name(2)).join(TRAINER_STATE),
            r#"{"step": 2, "position": 2, "total_steps": 2}"#,
        )
        .unwrap();
        std::fs::write(run.join("plots/loss.png"), b"png").unwrap();
        std::fs::write(run.join("plots/mine.png"), b"png").unwrap();
        assert_eq!(find_checkpoint(&run).unwrap(), run.join(checkpoint_name(2)));
        prepare(&run, None, true).unwrap();
        assert!(!run.join(checkpoint_name(2)).exists());
        assert!(!run.join("plots/loss.png").exists());
        assert!(run.join("plots/mine.png").is_file());
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A lorafit checkpoint folder (`checkpoint-NNNNNN` with its trainer state) of `step`.
    fn fake_checkpoint(dir: &Path, step: usize) -> PathBuf {
        let c = dir.join(checkpoint_name(step));
        std::fs::create_dir_all(&c).unwrap();
        std::fs::write(
            c.join(TRAINER_STATE),
            format!(r#"{{"step": {step}, "position": {step}, "total_steps": 9}}"#),
        )
        .unwrap();
        c
    }

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lorafit-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A bare checkpoint name is a folder of the current one (its run folder `.`), and a file
    /// is said to be one; the checkpoint a resume reads is never deleted by --overwrite, which
    /// refuses the combination before deleting anything.
    #[test]
    fn overwrite_never_deletes_the_checkpoint_being_resumed() {
        let d = scratch("resume-source");
        let bare = find_checkpoint(Path::new("checkpoint-000006"));
        assert!(
            bare.unwrap_err()
                .to_string()
                .contains("./checkpoint-000006"),
            "a bare name is under ."
        );
        std::fs::write(d.join("data.jsonl"), "{}").unwrap();
        let e = find_checkpoint(&d.join("data.jsonl"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("a file, not a run folder or checkpoint"), "{e}");

        let run = d.join("run");
        fake_checkpoint(&run, 2);
        std::fs::write(run.join("metrics.jsonl"), "").unwrap();
        // A checkpoint left under a temporary name (which `prepare` otherwise clears away).
        let tmp = run.join(".tmp-checkpoint-000004");
        std::fs::rename(fake_checkpoint(&run, 4), &tmp).unwrap();
        for overwrite in [false, true] {
            let e = prepare(&run, Some(&tmp), overwrite).err().unwrap();
            let e = e.to_string();
            assert!(e.contains("checkpoint being resumed from"), "{e}");
            assert!(tmp.join(TRAINER_STATE).is_file());
        }
        assert!(run.join(checkpoint_name(2)).join(TRAINER_STATE).is_file());
        assert!(run.join("metrics.jsonl").is_file(), "nothing was deleted");
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Only folders named and made as lorafit's checkpoints are a run's: --overwrite keeps a
    /// user's `checkpoint-notes/` and a `checkpoint-000009/` without a trainer state, and
    /// pruning does not count them.
    #[test]
    fn overwrite_deletes_only_lorafits_checkpoints() {
        let d = scratch("own-checkpoints");
        fake_checkpoint(&d, 1);
        fake_checkpoint(&d, 2);
        for mine in ["checkpoint-notes", "checkpoint-000009", "checkpoint-+3"] {
            std::fs::create_dir_all(d.join(mine)).unwrap();
            std::fs::write(d.join(mine).join("x.txt"), "mine").unwrap();
        }
        assert_eq!(
            run_outputs(&d).unwrap(),
            [checkpoint_name(1), checkpoint_name(2)]
        );
        prune_checkpoints(&d, 1).unwrap();
        assert!(!d.join(checkpoint_name(1)).exists());
        assert!(d.join(checkpoint_name(2)).exists());
        prepare(&d, None, true).unwrap();
        assert!(!d.join(checkpoint_name(2)).exists());
        for mine in ["checkpoint-notes", "checkpoint-000009", "checkpoint-+3"] {
            assert!(d.join(mine).join("x.txt").is_file(), "{mine} deleted");
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A second lock of a locked run folder is refused naming the folder and the holder's pid;
    /// the lock file is no run output; the lock goes with its holder.
    #[test]
    fn a_locked_run_folder_refuses_a_second_run() {
        let d = scratch("lock");
        let held = prepare(&d, None, false).unwrap();
        let e = prepare(&d, None, true).err().unwrap().to_string();
        let pid = std::process::id().to_string();
        assert!(
            e.contains(&d.display().to_string()) && e.contains(&format!("pid {pid}")),
            "{e}"
        );
        let e = preflight(&d, None, false, 10).unwrap_err().to_string();
        assert!(e.contains("another lorafit process"), "{e}");
        assert!(run_outputs(&d).unwrap().is_empty());
        drop(held);
        prepare(&d, None, false).unwrap();
        let _ = std::fs::remove_dir_all(&d);
    }

    /// The output folder's problems are found by `preflight`, which leaves no folder it created.
    #[test]
    fn preflight_finds_the_output_folders_problems() {
        let d = scratch("preflight");
        std::fs::write(d.join("afile"), "x").unwrap();
        let e = preflight(&d.join("afile"), None, false, 10).unwrap_err();
        assert!(e.to_string().contains("a file is there"), "{e}");
        let e = preflight(&d.join("afile/sub"), None, false, 10).unwrap_err();
        assert!(format!("{e:#}").contains("cannot create it"), "{e:#}");
        let long = d.join("x".repeat(200)).join("y".repeat(200));
        let mut deep = long.clone();
        while deep.as_os_str().len() < 4075 {
            deep = deep.join("z".repeat(100));
        }
        let e = preflight(&deep, None, false, 10).unwrap_err().to_string();
        assert!(e.contains("name a shorter output folder"), "{e}");
        let e = preflight(&d.join("n".repeat(300)), None, false, 10).unwrap_err();
        assert!(e.to_string().contains("more than the 255"), "{e}");
        preflight(&d.join("new/run"), None, false, 10).unwrap();
        assert!(!d.join("new").exists(), "a created folder is left");
        fake_checkpoint(&d.join("run"), 1);
        let e = preflight(&d.join("run"), None, false, 10).unwrap_err();
        assert!(e.to_string().contains("already holds a run"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A resume that changes the base's encoding (`base_quant`) is refused as one that changes
    /// the adapter or data; a stored relative path is checked, a built-in model name is not.
    #[test]
    fn a_resume_keeps_the_base_encoding_and_built_in_names_are_no_paths() {
        let saved = TrainConfig::default();
        let now = TrainConfig {
            base_quant: crate::model::BaseQuant::Q8_0,
            ..TrainConfig::default()
        };
        let e = check_resume(Path::new("ck"), &saved, None, &now, "h")
            .unwrap_err()
            .to_string();
        assert!(e.contains("base_quant: checkpoint"), "{e}");
        assert!(changed_settings(&saved, &now).unwrap().is_empty());

        let settings = Path::new("run/checkpoint-000003/run.toml");
        let mut cfg = TrainConfig {
            model: "smollm2".into(),
            data: "Cargo.toml".into(),
            ..TrainConfig::default()
        };
        check_stored_paths(&cfg, settings).unwrap();
        cfg.model = "HuggingFaceTB/SmolLM2-135M-Instruct".into();
        check_stored_paths(&cfg, settings).unwrap();
        cfg.model = "no-such-model-folder".into();
        let e = check_stored_paths(&cfg, settings).unwrap_err().to_string();
        assert!(e.contains("model = \"no-such-model-folder\""), "{e}");
    }

    #[test]
    fn truncation_drops_later_steps_and_a_partial_line() {
        let d = std::env::temp_dir().join(format!("lorafit-trunc-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("metrics.jsonl");
        let kept = "{\"step\":0,\"split\":\"valid\"}\n{\"step\":1}\n{\"step\":2}\n";
        std::fs::write(&p, format!("{kept}{{\"step\":3}}\n{{\"step\":4,\"lo")).unwrap();
        truncate_lines_after(&p, 2).unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), kept);
        std::fs::write(&p, format!("{kept}{{\"step\":3,")).unwrap();
        truncate_lines_after(&p, 9).unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), kept);
        let _ = std::fs::remove_dir_all(&d);
    }
}
