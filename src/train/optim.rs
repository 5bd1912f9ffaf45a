//! The optimiser side of a step: AdamW state for every LoRA matrix, the learning-rate schedule
//! (linear warmup, then a cosine, a line or a constant), global-norm clipping and LoRA+.

use crate::config::{LrDecay, TrainConfig};
use crate::model::Lora;
use crate::tensor::{self as ops, AdamW, AdamWItem, DType, DeviceValues, NormClip, Tensor};
use anyhow::{Context, Result};

/// First and second moments per LoRA matrix, in `Lora::pairs` order (A then B).
pub struct AdamState {
    pub m: Vec<Tensor>,
    pub v: Vec<Tensor>,
}

impl AdamState {
    pub fn new(lora: &Lora) -> Result<AdamState> {
        let mut m = Vec::new();
        let mut v = Vec::new();
        for (_, _, p) in lora.pairs() {
            for t in [&p.a, &p.b] {
                m.push(Tensor::zeros(t.shape(), DType::F32, t.device())?);
                v.push(Tensor::zeros(t.shape(), DType::F32, t.device())?);
            }
        }
        Ok(AdamState { m, v })
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Schedule {
    pub peak_lr: f64,
    pub warmup_steps: usize,
    pub total_steps: usize,
    pub decay: LrDecay,
}

impl Schedule {
    /// Learning rate of optimiser step `step` (0-based).
    pub fn lr(&self, step: usize) -> f64 {
        if step < self.warmup_steps {
            return self.peak_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        let span = (self.total_steps - self.warmup_steps).max(1) as f64;
        let progress = ((step - self.warmup_steps) as f64 / span).min(1.0);
        match self.decay {
            LrDecay::Constant => self.peak_lr,
            LrDecay::Cosine => self.peak_lr * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
            LrDecay::Linear => self.peak_lr * (1.0 - progress),
        }
    }
}

pub struct OptimOptions {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub grad_clip: f64,
    pub lora_plus_ratio: f64,
}

impl OptimOptions {
    pub fn from_config(cfg: &TrainConfig) -> OptimOptions {
        OptimOptions {
            beta1: cfg.adam_beta1,
            beta2: cfg.adam_beta2,
            eps: cfg.adam_eps,
            weight_decay: cfg.weight_decay,
            grad_clip: cfg.grad_clip,
            lora_plus_ratio: cfg.lora_plus_ratio,
        }
    }
}

/// The training defaults of `TrainConfig`: plain AdamW (0.9, 0.999, 1e-8), no weight decay,
/// clipping at norm 1, no LoRA+.
impl Default for OptimOptions {
    fn default() -> OptimOptions {
        OptimOptions::from_config(&TrainConfig::default())
    }
}

/// The gradient norm of an update, left on the device; `get` reads it back.
pub struct GradNorm {
    sum_sq: DeviceValues,
    average: f64,
}

impl GradNorm {
    /// The global gradient norm before clipping (a sync point on CUDA).
    pub fn get(&self) -> Result<f64> {
        Ok(self.sum_sq.to_host()?[0].sqrt() * self.average)
    }
}

/// Queues one AdamW update of every LoRA matrix from the accumulated gradients; returns the
/// gradient norm before clipping, on the device. `grad_scale` averages accumulated micro-steps.
///
/// Multi-tensor ops over all matrices at once: on CUDA one launch for the squared norm, and one
/// for AdamW, which derives the clip factor from that norm on the device, also writes the bf16
/// compute copies and zeroes the gradients; then the stacked A of each shared-input group is
/// rebuilt from those copies. Nothing waits for the host.
pub fn apply_update(
    lora: &mut Lora,
    state: &mut AdamState,
    lr: f64,
    step: u64,
    grad_scale: f64,
    o: &OptimOptions,
) -> Result<GradNorm> {
    let sum_sq = {
        let grads: Vec<&Tensor> = lora
            .pairs()
            .flat_map(|(_, _, p)| [&p.grad_a, &p.grad_b])
            .collect();
        ops::sum_sq_multi(&grads)?
    };
    let h = AdamW {
        lr: lr as f32,
        beta1: o.beta1 as f32,
        beta2: o.beta2 as f32,
        eps: o.eps as f32,
        weight_decay: o.weight_decay as f32,
        step,
        grad_scale: grad_scale as f32,
    };
    let mut items = Vec::with_capacity(state.m.len());
    let mut moments = state.m.iter_mut().zip(state.v.iter_mut());
    for (_, _, p) in lora.pairs_mut() {
        for (k, (param, grad, compute)) in p.update_parts().into_iter().enumerate() {
            let is_b = k == 1;
            let (m, v) = moments
                .next()
                .context("optimiser state holds fewer matrices than the adapter")?;
            let lr_here = if is_b { lr * o.lora_plus_ratio } else { lr };
            items.push(AdamWItem {
                param,
                grad,
                m,
                v,
                compute,
                lr: lr_here as f32,
            });
        }
    }
    let clip = NormClip {
        sum_sq: &sum_sq,
        average: grad_scale,
        max_norm: o.grad_clip,
    };
    ops::adamw_multi(&mut items, h, Some(clip))?;
    lora.refresh_stacked()?;
    Ok(GradNorm {
        sum_sq,
        average: grad_scale,
    })
}
