//! One example through the model: forward every sequence of its plan, read per-token logps of each
//! branch through the logp engine, apply the objective, and (when training) send d logp back
//! through the head and the layers into the LoRA gradients.

use super::head::{logp_backward, logp_forward, HeadTier};
use super::objectives::{self, BranchLogps, ObjectiveOut, SftScope};
use super::plan::{Plan, Rows};
use crate::model::{Lora, Model, PassCtx};
use crate::tensor::{self as ops, Tensor};
use anyhow::{anyhow, Result};

/// The training objective and its hyperparameters.
#[derive(Clone, Copy, Debug)]
pub enum Objective {
    Orpo { lambda: f64, scope: SftScope },
    Sft { all_tokens: bool },
    Dpo { beta: f64, label_smoothing: f64 },
    Simpo { beta: f64, gamma: f64 },
}

impl Objective {
    pub fn is_preference(&self) -> bool {
        !matches!(self, Objective::Sft { .. })
    }
    /// Whether the prompt tokens' logps enter the loss.
    fn needs_prompt(&self) -> bool {
        matches!(
            self,
            Objective::Orpo {
                scope: SftScope::Full,
                ..
            } | Objective::Sft { all_tokens: true }
        )
    }
}

#[derive(Clone, Copy, Debug)]
pub struct PassOptions {
    pub segment_size: usize,
    pub head: HeadTier,
    pub head_chunk: usize,
    pub dropout: Option<(f32, u64)>,
}

pub struct ExampleOut {
    pub loss: f64,
    pub metrics: Vec<(&'static str, f64)>,
    pub tokens: usize,
}

/// Sums of response logps under the base model (adapter off): DPO's reference, computed once per
/// example without gradients.
pub fn reference_sums(model: &Model, plan: &Plan, opts: &PassOptions) -> Result<(f64, f64)> {
    let hidden = forward_all(model, plan, None, opts, false)?;
    let sum = |r: &Rows| -> Result<f64> {
        let h = ops::gather_rows(&hidden[r.seq].0, &r.rows)?;
        Ok(
            logp_forward(model, &h, &r.targets, opts.head, opts.head_chunk)?
                .iter()
                .map(|&x| x as f64)
                .sum(),
        )
    };
    let rej = plan
        .rejected
        .as_ref()
        .ok_or_else(|| anyhow!("DPO needs a preference example"))?;
    Ok((sum(&plan.chosen.response)?, sum(&rej.response)?))
}

type Forwarded = (Tensor, Option<crate::model::llama::ForwardState>);

fn forward_all(
    model: &Model,
    plan: &Plan,
    lora: Option<&Lora>,
    opts: &PassOptions,
    keep: bool,
) -> Result<Vec<Forwarded>> {
    plan.seqs
        .iter()
        .map(|s| {
            let rope = model.rope_table(&s.mask.positions)?;
            let ctx = PassCtx {
                mask: &s.mask,
                rope: &rope,
                dropout: opts.dropout,
            };
            // Without a backward, keep only the first boundary: no activations stay live.
            let seg = if keep {
                opts.segment_size
            } else {
                model.spec.n_layers
            };
            let (h, st) = model.forward(&s.ids, lora, &ctx, seg)?;
            Ok((h, keep.then_some(st)))
        })
        .collect()
}

/// Runs one example; with `train`, accumulates its LoRA gradients (scaled by `grad_weight`).
pub fn run_example(
    model: &Model,
    lora: &mut Lora,
    plan: &Plan,
    objective: &Objective,
    reference: Option<(f64, f64)>,
    opts: &PassOptions,
    train: bool,
    grad_weight: f32,
) -> Result<ExampleOut> {
    let mut fwd = forward_all(model, plan, Some(lora), opts, train)?;
    let head = |r: &Rows, fwd: &[Forwarded]| -> Result<(Tensor, Vec<f32>)> {
        let h = ops::gather_rows(&fwd[r.seq].0, &r.rows)?;
        let lp = logp_forward(model, &h, &r.targets, opts.head, opts.head_chunk)?;
        Ok((h, lp))
    };
    let empty = Rows::default();
    let chosen_prompt = if objective.needs_prompt() {
        &plan.chosen.prompt
    } else {
        &empty
    };
    let (hcp, lcp) = if chosen_prompt.rows.is_empty() {
        (None, vec![])
    } else {
        let (h, l) = head(chosen_prompt, &fwd)?;
        (Some(h), l)
    };
    let (hcr, lcr) = head(&plan.chosen.response, &fwd)?;
    let rej = match &plan.rejected {
        Some(b) => Some(head(&b.response, &fwd)?),
        None => None,
    };

    let chosen = BranchLogps::new(&lcp, &lcr);
    let out: ObjectiveOut = match (*objective, &rej) {
        (Objective::Orpo { lambda, scope }, Some((_, lr))) => {
            objectives::orpo(chosen, BranchLogps::response_only(lr), lambda, scope)
        }
        (Objective::Sft { all_tokens }, _) => objectives::sft(chosen, all_tokens),
        (
            Objective::Dpo {
                beta,
                label_smoothing,
            },
            Some((_, lr)),
        ) => {
            let (rc, rr) = reference.ok_or_else(|| anyhow!("DPO needs reference logps"))?;
            objectives::dpo(
                chosen,
                BranchLogps::response_only(lr),
                rc,
                rr,
                beta,
                label_smoothing,
            )
        }
        (Objective::Simpo { beta, gamma }, Some((_, lr))) => {
            objectives::simpo(chosen, BranchLogps::response_only(lr), beta, gamma)
        }
        _ => {
            return Err(anyhow!(
                "objective {objective:?} needs a preference example"
            ))
        }
    }
    .map_err(|e| anyhow!("objective: {e}"))?;

    if train {
        // Gradients into each sequence's hidden states, then back through the layers.
        let mut dh: Vec<Option<Tensor>> = (0..plan.seqs.len()).map(|_| None).collect();
        let mut send = |r: &Rows, h: &Tensor, d: &[f32]| -> Result<()> {
            if r.rows.is_empty() {
                return Ok(());
            }
            let scaled: Vec<f32> = d.iter().map(|x| x * grad_weight).collect();
            let dhc = logp_backward(model, h, &r.targets, &scaled, opts.head, opts.head_chunk)?;
            let full = &fwd[r.seq].0;
            let slot = &mut dh[r.seq];
            if slot.is_none() {
                *slot = Some(Tensor::zeros(full.shape(), full.dtype(), full.device())?);
            }
            ops::scatter_add_rows(slot.as_mut().unwrap(), &r.rows, &dhc)
        };
        if let Some(h) = &hcp {
            send(chosen_prompt, h, &out.d_chosen.prompt)?;
        }
        send(&plan.chosen.response, &hcr, &out.d_chosen.response)?;
        if let (Some(b), Some((h, _))) = (&plan.rejected, &rej) {
            send(&b.response, h, &out.d_rejected.response)?;
        }
        for (i, s) in plan.seqs.iter().enumerate().rev() {
            let (Some(d), Some(state)) = (dh[i].take(), fwd[i].1.take()) else {
                continue;
            };
            let rope = model.rope_table(&s.mask.positions)?;
            let ctx = PassCtx {
                mask: &s.mask,
                rope: &rope,
                dropout: opts.dropout,
            };
            model.backward(&d, state, Some(lora), &ctx)?;
        }
    }
    Ok(ExampleOut {
        loss: out.loss,
        metrics: out.metrics.pairs(),
        tokens: plan.tokens(),
    })
}
