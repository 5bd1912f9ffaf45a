//! One example through the model: forward every sequence of its plan, read per-token logps of each
//! branch through the logp engine, apply the objective, and (when training) send d logp back
//! through the head and the layers into the LoRA gradients.

use super::head::{logp_backward_saved, logp_forward, logp_forward_saved, HeadTier};
use super::objectives::{self, BranchLogps, ObjectiveOut, SftScope};
use super::plan::{Plan, Rows};
use crate::model::{Lora, Model, PassCtx};
use crate::tensor::{self as ops, RopeTable, Tensor};
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
    /// With segments: keep each layer's attention output from the forward instead of
    /// recomputing it (`Model::forward_keeping`).
    pub keep_attention: bool,
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
        let h = ops::gather_rows(&hidden[r.seq].hidden, &r.rows)?;
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

/// Rows of one sequence read by the head, with where each branch's part lies in them.
struct HeadGroup {
    seq: usize,
    rows: Vec<u32>,
    targets: Vec<u32>,
    /// `(part index, start, len)`.
    spans: Vec<(usize, usize, usize)>,
}

fn head_groups(n_seqs: usize, parts: &[&Rows]) -> Vec<HeadGroup> {
    let mut groups = Vec::new();
    for seq in 0..n_seqs {
        let mut g = HeadGroup {
            seq,
            rows: Vec::new(),
            targets: Vec::new(),
            spans: Vec::new(),
        };
        for (i, r) in parts.iter().enumerate() {
            if r.seq == seq && !r.rows.is_empty() {
                g.spans.push((i, g.rows.len(), r.rows.len()));
                g.rows.extend(&r.rows);
                g.targets.extend(&r.targets);
            }
        }
        if !g.rows.is_empty() {
            groups.push(g);
        }
    }
    groups
}

/// One sequence after the forward: final hidden states, what the backward needs (when kept),
/// and the RoPE table, built once and reused by the backward.
struct Forwarded {
    hidden: Tensor,
    state: Option<crate::model::llama::ForwardState>,
    rope: RopeTable,
}

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
            let (hidden, st) =
                model.forward_keeping(&s.ids, lora, &ctx, seg, keep && opts.keep_attention)?;
            Ok(Forwarded {
                hidden,
                state: keep.then_some(st),
                rope,
            })
        })
        .collect()
}

/// Runs one example; with `train`, accumulates its LoRA gradients (scaled by `grad_weight`).
#[allow(clippy::too_many_arguments)]
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
    let empty = Rows::default();
    let chosen_prompt = if objective.needs_prompt() {
        &plan.chosen.prompt
    } else {
        &empty
    };
    // The branches' rows: chosen prompt (full-scope NLL), chosen response, rejected response.
    let parts: Vec<&Rows> = [
        Some(chosen_prompt),
        Some(&plan.chosen.response),
        plan.rejected.as_ref().map(|b| &b.response),
    ]
    .into_iter()
    .flatten()
    .collect();
    // The head runs once per sequence over every row any branch reads from it: one gather, one
    // pass through the logp engine and one download per sequence.
    let groups = head_groups(plan.seqs.len(), &parts);
    let mut logps: Vec<Vec<f32>> = vec![Vec::new(); parts.len()];
    let mut group_h = Vec::with_capacity(groups.len());
    for g in &groups {
        let h = ops::gather_rows(&fwd[g.seq].hidden, &g.rows)?;
        let (lp, saved) =
            logp_forward_saved(model, &h, &g.targets, opts.head, opts.head_chunk, train)?;
        for &(part, start, len) in &g.spans {
            logps[part] = lp[start..start + len].to_vec();
        }
        group_h.push((h, saved));
    }
    let (lcp, lcr) = (&logps[0], &logps[1]);
    let rej: Option<((), &Vec<f32>)> = plan.rejected.as_ref().map(|_| ((), &logps[2]));

    let chosen = BranchLogps::new(lcp, lcr);
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
        let grads: Vec<&[f32]> = [
            Some(&out.d_chosen.prompt[..]),
            Some(&out.d_chosen.response[..]),
            plan.rejected.as_ref().map(|_| &out.d_rejected.response[..]),
        ]
        .into_iter()
        .flatten()
        .collect();
        let mut dh: Vec<Option<Tensor>> = (0..plan.seqs.len()).map(|_| None).collect();
        for (g, (h, saved)) in groups.iter().zip(group_h) {
            let mut d = vec![0f32; g.rows.len()];
            for &(part, start, len) in &g.spans {
                for (x, y) in d[start..start + len].iter_mut().zip(grads[part]) {
                    *x = y * grad_weight;
                }
            }
            let dhc =
                logp_backward_saved(model, &h, &g.targets, &d, opts.head, opts.head_chunk, saved)?;
            let full = &fwd[g.seq].hidden;
            let mut slot = Tensor::zeros(full.shape(), full.dtype(), full.device())?;
            ops::scatter_add_rows(&mut slot, &g.rows, &dhc)?;
            dh[g.seq] = Some(slot);
        }
        for (i, s) in plan.seqs.iter().enumerate().rev() {
            let (Some(d), Some(state)) = (dh[i].take(), fwd[i].state.take()) else {
                continue;
            };
            let ctx = PassCtx {
                mask: &s.mask,
                rope: &fwd[i].rope,
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
