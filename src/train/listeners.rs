//! The run's own listeners: the console (progress bar and plain lines) and metrics.jsonl. Both
//! read the records the loop hands to every listener (`events`), so neither computes anything.

use super::events::{TrainEvent, TrainEvents};
use super::trainer::fmt_metrics;
use anyhow::{Context, Result};
use std::io::Write;
use std::path::Path;

/// The progress bar, the plan line and validation lines, on stderr.
#[derive(Default)]
pub struct Console {
    bar: Option<indicatif::ProgressBar>,
    cuda: bool,
}

impl Console {
    pub fn new(cuda: bool) -> Self {
        Console { bar: None, cuda }
    }

    fn line(&self, s: String) {
        match &self.bar {
            Some(bar) => bar.println(s),
            None => eprintln!("{s}"),
        }
    }
}

impl TrainEvents for Console {
    fn event(&mut self, event: &TrainEvent<'_>) -> Result<()> {
        match event {
            TrainEvent::Started(r) => {
                if let Some(dir) = &r.resumed_from {
                    eprintln!("resumed from {} at step {}", dir.display(), r.start_step);
                }
                eprintln!(
                    "plan: {} on {} | {} train / {} valid examples | {} steps × {} micro-steps | lr {:.2e} (warmup {}) | LoRA r{} α{} on {} params | segment {} (keep attention {}, k/v of {} layers) | head {} | prefix-shared {}",
                    r.method, r.device, r.train_examples, r.valid_examples, r.total_steps,
                    r.grad_accum, r.peak_lr, r.warmup_steps, r.lora_rank, r.lora_alpha,
                    r.lora_params, r.segment_size, r.keep_attention, r.keep_kv_layers, r.head,
                    r.prefix_shared
                );
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
            TrainEvent::Step(s) => {
                if let Some(bar) = &self.bar {
                    let margin = s.metrics.get("margin").copied();
                    bar.set_message(format!(
                        "loss {:.4}{} | {:.0} tok/s{}",
                        s.loss,
                        margin
                            .map(|m| format!(" margin {m:+.3}"))
                            .unwrap_or_default(),
                        s.tokens_per_second(),
                        if self.cuda {
                            format!(" | peak {:.2} GiB", s.peak_bytes as f64 / (1u64 << 30) as f64)
                        } else {
                            String::new()
                        }
                    ));
                    bar.set_position(s.step as u64);
                }
            }
            TrainEvent::Valid { step, metrics } => {
                self.line(format!("valid @{step}: {}", fmt_metrics(metrics)))
            }
            TrainEvent::Checkpoint { .. } => {}
            TrainEvent::Stopped { step, checkpoint } => {
                if let Some(bar) = self.bar.take() {
                    bar.abandon();
                }
                eprintln!(
                    "stopped at step {step}; checkpoint in {}",
                    checkpoint.display()
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
                eprintln!(
                    "trained {step} steps in {seconds:.1}s; adapter in {}",
                    adapter_dir.display()
                );
            }
        }
        Ok(())
    }
}

/// metrics.jsonl: one JSON line per optimiser step and per validation.
pub struct MetricsFile {
    file: std::fs::File,
}

impl MetricsFile {
    pub fn append(path: &Path) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(MetricsFile { file })
    }

    fn write(&mut self, v: &serde_json::Value) -> Result<()> {
        writeln!(self.file, "{v}")?;
        self.file.flush()?;
        Ok(())
    }
}

impl TrainEvents for MetricsFile {
    fn event(&mut self, event: &TrainEvent<'_>) -> Result<()> {
        match event {
            TrainEvent::Step(s) => self.write(&serde_json::json!({
                "step": s.step, "split": "train", "loss": s.loss, "lr": s.learning_rate,
                "grad_norm": s.grad_norm, "tokens": s.tokens,
                "tokens_per_s": s.tokens_per_second(), "step_s": s.step_seconds,
                "live_bytes": s.live_bytes, "peak_bytes": s.peak_bytes, "metrics": s.metrics,
                "pass": {
                    "tokens": s.pass.tokens, "segment_size": s.pass.segment_size,
                    "keep_attention": s.pass.keep_attention,
                    "keep_kv_layers": s.pass.keep_kv_layers, "mlp_chunk": s.pass.mlp_chunk,
                    "estimated_bytes": s.pass.estimated_bytes,
                },
            })),
            TrainEvent::Valid { step, metrics } => {
                self.write(&serde_json::json!({"step": step, "split": "valid", "metrics": metrics}))
            }
            _ => Ok(()),
        }
    }
}
