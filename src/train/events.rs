//! What a training run reports, and to whom: one interface through which the loop tells the
//! console, metrics.jsonl and any other listener (a job server, a log file) what happened. The
//! loop computes each record once and hands the same record to every listener, so the progress
//! bar, the metrics file and a remote watcher can never disagree.

use anyhow::Result;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The run as resolved before the first step.
#[derive(Clone, Debug)]
pub struct RunStart {
    pub method: String,
    pub device: String,
    pub train_examples: usize,
    pub valid_examples: usize,
    pub total_steps: usize,
    /// The step the run starts from (0, or a resumed checkpoint's step).
    pub start_step: usize,
    pub grad_accum: usize,
    pub peak_lr: f64,
    pub warmup_steps: usize,
    pub lora_rank: usize,
    pub lora_alpha: f64,
    pub lora_params: usize,
    /// Where the run writes its outputs.
    pub output: PathBuf,
    /// Where it resumed from, if it did.
    pub resumed_from: Option<PathBuf>,
    /// The memory plan as configured ("auto" where the planner decides per pass).
    pub segment_size: String,
    pub keep_attention: String,
    pub keep_kv_layers: String,
    /// Layer boundaries in host memory: "true", "false" or "auto".
    pub offload: String,
    /// Tokens a pack of examples may hold (0: no packing).
    pub pack_tokens: usize,
    pub head: String,
    pub prefix_shared: bool,
    /// Steps between plain log lines when no terminal shows the progress bar.
    pub log_every: usize,
}

/// The largest pass of a step as it ran.
#[derive(Clone, Debug)]
pub struct PassRecord {
    pub tokens: usize,
    pub segment_size: usize,
    pub keep_attention: bool,
    pub keep_kv_layers: usize,
    pub mlp_chunk: usize,
    /// The layer boundaries were in host memory.
    pub offload: bool,
    /// Each segment was recomputed layer by layer.
    pub nested: bool,
    /// Offloaded: the top layers whose boundaries and kept tensors stayed on the device.
    pub resident_layers: usize,
    /// The layers below the top that kept all their activations (`ForwardPlan::full_layers`).
    pub full_layers: usize,
    /// `train::memory`'s estimate of the pass's activation bytes.
    pub estimated_bytes: usize,
}

/// One optimiser step.
#[derive(Clone, Debug)]
pub struct StepRecord {
    /// 1-based: the number of optimiser steps taken once this one is done.
    pub step: usize,
    pub total_steps: usize,
    pub loss: f64,
    pub learning_rate: f64,
    pub grad_norm: f64,
    pub tokens: usize,
    pub step_seconds: f64,
    /// Seconds since this process started the run (not counting earlier runs before a resume).
    pub elapsed_seconds: f64,
    pub live_bytes: usize,
    pub peak_bytes: usize,
    /// The objective's metrics, averaged over the step's micro-steps.
    pub metrics: BTreeMap<String, f64>,
    pub pass: PassRecord,
    /// Seconds to the last step at this process's mean step time so far.
    pub eta_seconds: f64,
}

impl StepRecord {
    pub fn tokens_per_second(&self) -> f64 {
        if self.step_seconds > 0.0 {
            self.tokens as f64 / self.step_seconds
        } else {
            0.0
        }
    }
}

/// What happened, in the order it happened.
#[derive(Clone, Debug)]
pub enum TrainEvent<'a> {
    Started(&'a RunStart),
    Step(&'a StepRecord),
    /// Validation after `step` optimiser steps (0: before the first).
    Valid {
        step: usize,
        metrics: &'a BTreeMap<String, f64>,
    },
    /// A checkpoint written whole (atomically) at `path`; `best` for the best-margin one.
    Checkpoint {
        step: usize,
        path: &'a Path,
        best: bool,
    },
    /// The run stopped because a listener asked it to; a checkpoint of `step` was written first.
    Stopped {
        step: usize,
        checkpoint: &'a Path,
    },
    /// The run reached its last step; the adapter is in `adapter_dir`.
    Finished {
        step: usize,
        seconds: f64,
        adapter_dir: &'a Path,
    },
}

/// A listener. Errors from `event` stop the run (a metrics file that cannot be written is as
/// fatal as a failed step); a listener that must not stop it handles its own errors.
pub trait TrainEvents {
    fn event(&mut self, event: &TrainEvent<'_>) -> Result<()>;

    /// Asked between optimiser steps; `true` ends the run after a checkpoint of the current step
    /// (a job server's cancel).
    fn stop_requested(&self) -> bool {
        false
    }
}

/// A listener that ignores everything (library callers that want only the outcome).
pub struct NoEvents;

impl TrainEvents for NoEvents {
    fn event(&mut self, _: &TrainEvent<'_>) -> Result<()> {
        Ok(())
    }
}

/// Several listeners as one, called in order.
pub struct Fanout<'a>(pub Vec<&'a mut dyn TrainEvents>);

impl TrainEvents for Fanout<'_> {
    fn event(&mut self, event: &TrainEvent<'_>) -> Result<()> {
        for listener in self.0.iter_mut() {
            listener.event(event)?;
        }
        Ok(())
    }

    fn stop_requested(&self) -> bool {
        self.0.iter().any(|l| l.stop_requested())
    }
}
