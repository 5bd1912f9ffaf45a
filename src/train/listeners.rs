//! The run's own listeners: the console (a progress bar on a terminal, plain lines without one),
//! metrics.jsonl and timing.jsonl, PNG plots and TensorBoard event files. All read the records
//! the loop hands to every listener (`events`), so none computes anything of its own.
//!
//! metrics.jsonl holds what a run computes (losses, metrics, learning rate, gradient norm,
//! tokens): on a deterministic device it is the same, byte for byte, however often the run was
//! killed and resumed. timing.jsonl holds what the machine decides (seconds, throughput, memory,
//! the memory plan chosen from free memory), one line per step with the same `step`.

use super::events::{StepRecord, TrainEvent, TrainEvents};
use super::run_folder::LineLog;
use super::trainer::fmt_metrics;
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

/// The plan line, per-step progress and validation lines, on stderr: a progress bar when stderr
/// is a terminal, else one plain line every `log_every` steps (and at the last step).
#[derive(Default)]
pub struct Console {
    bar: Option<indicatif::ProgressBar>,
    cuda: bool,
    log_every: usize,
    start_step: usize,
    /// Forces plain lines whatever stderr is (tests, job servers that capture stderr).
    plain: bool,
}

impl Console {
    pub fn new(cuda: bool) -> Self {
        Console {
            cuda,
            plain: !std::io::stderr().is_terminal(),
            ..Default::default()
        }
    }

    fn line(&self, s: String) {
        match &self.bar {
            Some(bar) => bar.println(s),
            None => eprintln!("{s}"),
        }
    }

    fn peak(&self, s: &StepRecord) -> String {
        if self.cuda {
            format!(
                " | peak {:.2} GiB",
                s.peak_bytes as f64 / (1u64 << 30) as f64
            )
        } else {
            String::new()
        }
    }
}

/// Set by the first Ctrl-C or SIGTERM after [`stop_on_interrupt`]: the console asks the run to
/// stop after its current step.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The exit status of a run stopped by a signal: 128 + its number (130 for Ctrl-C, 143 for
/// SIGTERM), as a shell reports a process the signal ended.
static STOP_STATUS: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(130);

/// The exit status for a run that [`stop_on_interrupt`]'s signal stopped.
pub fn stop_status() -> i32 {
    STOP_STATUS.load(std::sync::atomic::Ordering::SeqCst)
}

/// From now on, a first Ctrl-C (SIGINT) or SIGTERM (what a job scheduler, `docker stop` or
/// Kubernetes sends before killing) ends the run after its current step with a checkpoint (the
/// console's `stop_requested`), so that a resume takes up where it stopped; a second one quits
/// at once (status 130 or 143).
pub fn stop_on_interrupt() -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .context("starting the Ctrl-C handler")?;
    // Registered here, before training starts, not when the thread gets to it.
    let (mut int, mut term) = runtime
        .block_on(async {
            Ok::<_, std::io::Error>((
                signal(SignalKind::interrupt())?,
                signal(SignalKind::terminate())?,
            ))
        })
        .context("listening for Ctrl-C and SIGTERM")?;
    std::thread::spawn(move || {
        runtime.block_on(async {
            // The signal's name and exit status.
            macro_rules! next {
                () => {
                    tokio::select! {
                        _ = int.recv() => ("interrupted", 130),
                        _ = term.recv() => ("terminated (SIGTERM)", 143),
                    }
                };
            }
            let (what, status) = next!();
            STOP_STATUS.store(status, std::sync::atomic::Ordering::SeqCst);
            INTERRUPTED.store(true, std::sync::atomic::Ordering::SeqCst);
            let again = if status == 130 {
                " (Ctrl-C again to quit now)"
            } else {
                ""
            };
            eprintln!("\n{what}: stopping after this step with a checkpoint{again}");
            let (what, status) = next!();
            eprintln!("\n{what} again: quitting without a checkpoint of this step");
            std::process::exit(status);
        });
    });
    Ok(())
}

/// `s` as a shell word: as it is when only safe characters make it, else in single quotes.
pub fn shell_quote(s: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c);
    if !s.is_empty() && s.chars().all(safe) {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// `h:mm:ss`.
fn clock(seconds: f64) -> String {
    let s = if seconds.is_finite() {
        seconds.max(0.0).round() as u64
    } else {
        0
    };
    format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// One plain log line for step `s`.
pub fn step_line(s: &StepRecord, peak: &str) -> String {
    let metric = |k: &str, f: &dyn Fn(f64) -> String| {
        s.metrics
            .get(k)
            .map(|v| format!(" | {k} {}", f(*v)))
            .unwrap_or_default()
    };
    format!(
        "step {}/{} | loss {:.4}{}{} | learning_rate {:.3e} | grad_norm {:.4} | {:.0} tok/s{} | ETA {}",
        s.step,
        s.total_steps,
        s.loss,
        metric("margin", &|v| format!("{v:+.4}")),
        metric("accuracy", &|v| format!("{v:.3}")),
        s.learning_rate,
        s.grad_norm,
        s.tokens_per_second(),
        peak,
        clock(s.eta_seconds)
    )
}

impl TrainEvents for Console {
    fn stop_requested(&self) -> bool {
        INTERRUPTED.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn event(&mut self, event: &TrainEvent<'_>) -> Result<()> {
        match event {
            TrainEvent::Started(r) => {
                if let Some(dir) = &r.resumed_from {
                    eprintln!("resumed from {} at step {}", dir.display(), r.start_step);
                }
                let packing = match r.pack_tokens {
                    0 => String::new(),
                    n => format!(" | packs of up to {n} tokens"),
                };
                eprintln!(
                    "plan: {} on {} | {} train / {} valid examples | {} steps × {} micro-steps | learning_rate {:.2e} (warm-up {}) | LoRA r{} α{} on {} params | segment {} (keep attention {}, k/v of {} layers, offload {}) | head {} | prefix-shared {}{packing}",
                    r.method, r.device, r.train_examples, r.valid_examples, r.total_steps,
                    r.grad_accum, r.peak_lr, r.warmup_steps, r.lora_rank, r.lora_alpha,
                    r.lora_params, r.segment_size, r.keep_attention, r.keep_kv_layers, r.offload,
                    r.head, r.prefix_shared
                );
                self.log_every = r.log_every.max(1);
                self.start_step = r.start_step;
                if !self.plain {
                    let bar = indicatif::ProgressBar::new(r.total_steps as u64);
                    bar.set_style(
                        indicatif::ProgressStyle::with_template(
                            "{bar:30} {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
                        )
                        .context("progress bar template")?,
                    );
                    bar.set_position(r.start_step as u64);
                    self.bar = Some(bar);
                }
            }
            TrainEvent::Step(s) => match &self.bar {
                Some(bar) => {
                    let margin = s.metrics.get("margin").copied();
                    bar.set_message(format!(
                        "loss {:.4}{} | {:.0} tok/s{}",
                        s.loss,
                        margin
                            .map(|m| format!(" margin {m:+.3}"))
                            .unwrap_or_default(),
                        s.tokens_per_second(),
                        self.peak(s)
                    ));
                    bar.set_position(s.step as u64);
                }
                None => {
                    if s.step.is_multiple_of(self.log_every)
                        || s.step == s.total_steps
                        || s.step == self.start_step + 1
                    {
                        eprintln!("{}", step_line(s, &self.peak(s)));
                    }
                }
            },
            TrainEvent::Valid { step, metrics } => {
                self.line(format!("valid @{step}: {}", fmt_metrics(metrics)))
            }
            TrainEvent::Checkpoint { .. } => {}
            TrainEvent::Stopped { step, checkpoint } => {
                if let Some(bar) = self.bar.take() {
                    bar.abandon();
                }
                // The checkpoint is in the run's own folder, which a resume continues.
                let run = checkpoint
                    .parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .unwrap_or(Path::new("."));
                eprintln!(
                    "stopped at step {step}; checkpoint in {} (continue with `lorafit train \
                     --resume {}`)",
                    checkpoint.display(),
                    shell_quote(&run.display().to_string())
                );
            }
            TrainEvent::Finished {
                step,
                seconds,
                adapter_dir,
            } => {
                if let Some(bar) = self.bar.take() {
                    bar.finish();
                }
                let steps = step - self.start_step;
                let plural = if steps == 1 { "" } else { "s" };
                eprintln!(
                    "trained {steps} step{plural} (to step {step}) in {seconds:.1}s; adapter in {}",
                    adapter_dir.display()
                );
            }
        }
        Ok(())
    }
}

/// metrics.jsonl (one line per optimiser step and per validation: what the run computed) and
/// timing.jsonl (one line per step: how long it took and what memory it used).
pub struct MetricsFile {
    metrics: LineLog,
    timing: LineLog,
}

impl MetricsFile {
    /// Appends to the two files in `out_dir`.
    pub fn append(out_dir: &Path) -> Result<Self> {
        Ok(MetricsFile {
            metrics: LineLog::append(&out_dir.join("metrics.jsonl"))?,
            timing: LineLog::append(&out_dir.join("timing.jsonl"))?,
        })
    }
}

impl TrainEvents for MetricsFile {
    fn event(&mut self, event: &TrainEvent<'_>) -> Result<()> {
        match event {
            TrainEvent::Step(s) => {
                self.metrics.write(&serde_json::json!({
                    "step": s.step, "split": "train", "loss": s.loss,
                    "learning_rate": s.learning_rate, "grad_norm": s.grad_norm,
                    "tokens": s.tokens, "metrics": s.metrics,
                }))?;
                self.timing.write(&serde_json::json!({
                    "step": s.step, "step_s": s.step_seconds, "elapsed_s": s.elapsed_seconds,
                    "tokens_per_s": s.tokens_per_second(), "live_bytes": s.live_bytes,
                    "peak_bytes": s.peak_bytes,
                    "pass": {
                        "tokens": s.pass.tokens, "segment_size": s.pass.segment_size,
                        "keep_attention": s.pass.keep_attention,
                        "keep_kv_layers": s.pass.keep_kv_layers, "mlp_chunk": s.pass.mlp_chunk,
                        "offload": s.pass.offload, "nested": s.pass.nested,
                        "resident_layers": s.pass.resident_layers,
                        "full_layers": s.pass.full_layers,
                        "estimated_bytes": s.pass.estimated_bytes,
                    },
                }))
            }
            TrainEvent::Valid { step, metrics } => self
                .metrics
                .write(&serde_json::json!({"step": step, "split": "valid", "metrics": metrics})),
            _ => Ok(()),
        }
    }
}

/// The series the plots draw, read back from metrics.jsonl: `(name, split) → [(step, value)]`.
pub type Series = BTreeMap<(String, String), Vec<(f64, f64)>>;

/// Reads metrics.jsonl into series: `loss` and every metric, for the train and valid splits.
pub fn read_series(path: &Path) -> Result<Series> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut series = Series::new();
    for (i, line) in text.lines().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        let (Some(step), Some(split)) = (
            v.get("step").and_then(|s| s.as_f64()),
            v.get("split").and_then(|s| s.as_str()),
        ) else {
            continue;
        };
        let mut push = |name: &str, value: Option<f64>| {
            if let Some(x) = value.filter(|x| x.is_finite()) {
                series
                    .entry((name.to_string(), split.to_string()))
                    .or_default()
                    .push((step, x));
            }
        };
        push("loss", v.get("loss").and_then(|x| x.as_f64()));
        if let Some(m) = v.get("metrics").and_then(|m| m.as_object()) {
            for (k, x) in m {
                push(k, x.as_f64());
            }
        }
    }
    Ok(series)
}

/// One plot a run writes: `(file, title, y label, [(metric, legend label)])`.
type PlotSpec = (
    &'static str,
    &'static str,
    &'static str,
    &'static [(&'static str, &'static str)],
);

/// The files of the plots a run writes in `plots/` (what `--overwrite` deletes there).
pub fn plot_files() -> impl Iterator<Item = &'static str> {
    PLOTS.iter().map(|p| p.0)
}

/// The plots a run writes.
const PLOTS: &[PlotSpec] = &[
    ("loss.png", "Loss", "loss", &[("loss", "loss")]),
    (
        "margin.png",
        "Margin",
        "logps/chosen - logps/rejected (DPO: rewards/margins)",
        &[("margin", "margin")],
    ),
    (
        "accuracy.png",
        "Preference accuracy",
        "accuracy",
        &[("accuracy", "accuracy")],
    ),
    (
        "logps.png",
        "Log-probabilities",
        "logp (TRL: mean per token for ORPO/SimPO, sum for DPO)",
        &[
            ("logps/chosen", "logps/chosen"),
            ("logps/rejected", "logps/rejected"),
        ],
    ),
];

/// Writes the plots of `metrics` (a metrics.jsonl) into `dir`: one PNG per plot in `PLOTS` that
/// has data, train and valid series of each metric. Returns the files written.
pub fn write_plots(metrics: &Path, dir: &Path) -> Result<Vec<PathBuf>> {
    let series = read_series(metrics)?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut written = Vec::new();
    for (file, title, y_label, metrics) in PLOTS {
        let mut chart = crate::plot::LineChart::new(title, "step", y_label);
        for (metric, label) in metrics.iter() {
            for split in ["train", "valid"] {
                if let Some(points) = series.get(&(metric.to_string(), split.to_string())) {
                    chart.series(&format!("{label} ({split})"), points.clone());
                }
            }
        }
        if chart.is_empty() {
            continue;
        }
        let path = dir.join(file);
        crate::plot::write_png(&path, &chart.render(800, 480))?;
        written.push(path);
    }
    Ok(written)
}

/// PNG plots beside metrics.jsonl (in `plots/`), redrawn from the file at every validation and
/// at the end, so that they are a function of metrics.jsonl alone (a resumed run draws the
/// steps before the resume too).
pub struct Plots {
    metrics: PathBuf,
    dir: PathBuf,
}

impl Plots {
    pub fn new(out_dir: &Path) -> Plots {
        Plots {
            metrics: out_dir.join("metrics.jsonl"),
            dir: out_dir.join("plots"),
        }
    }
}

impl TrainEvents for Plots {
    fn event(&mut self, event: &TrainEvent<'_>) -> Result<()> {
        match event {
            TrainEvent::Valid { .. } | TrainEvent::Finished { .. } | TrainEvent::Stopped { .. } => {
                // A plot that cannot be drawn is no reason to lose a run.
                if let Err(e) = write_plots(&self.metrics, &self.dir) {
                    eprintln!("warning: plots in {}: {e:#}", self.dir.display());
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// TensorBoard event files (`tensorboard = true`): every metrics.jsonl number as a scalar
/// summary, tagged `train/…` or `valid/…`.
pub struct TensorBoard {
    writer: super::tfevents::EventWriter,
}

impl TensorBoard {
    /// A new event file in `out_dir` for a run starting at `start_step`; a resumed run's file
    /// begins with TensorBoard's session-start mark at that step, which makes TensorBoard drop
    /// the earlier files' events from later steps (the steps this run redoes).
    pub fn create(out_dir: &Path, start_step: usize) -> Result<TensorBoard> {
        let mut writer = super::tfevents::EventWriter::create(out_dir, start_step)?;
        if start_step > 0 {
            writer.session_start(start_step as i64)?;
        }
        Ok(TensorBoard { writer })
    }
}

impl TrainEvents for TensorBoard {
    fn event(&mut self, event: &TrainEvent<'_>) -> Result<()> {
        match event {
            TrainEvent::Step(s) => {
                let mut values = vec![
                    ("train/loss".to_string(), s.loss),
                    ("train/learning_rate".to_string(), s.learning_rate),
                    ("train/grad_norm".to_string(), s.grad_norm),
                    ("train/tokens_per_s".to_string(), s.tokens_per_second()),
                ];
                values.extend(s.metrics.iter().map(|(k, v)| (format!("train/{k}"), *v)));
                self.writer.scalars(s.step as i64, &values)
            }
            TrainEvent::Valid { step, metrics } => {
                let values: Vec<(String, f64)> = metrics
                    .iter()
                    .map(|(k, v)| (format!("valid/{k}"), *v))
                    .collect();
                self.writer.scalars(*step as i64, &values)
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::shell_quote;

    #[test]
    fn hints_quote_paths_as_a_shell_reads_them() {
        assert_eq!(shell_quote("runs/a-1"), "runs/a-1");
        assert_eq!(shell_quote("my run"), "'my run'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("$HOME"), "'$HOME'");
    }
}
