//! The logp engine: per-token log p(target) from final hidden states and the LM head, and the
//! gradient back to the hidden states, without keeping `[tokens, vocab]` logits beyond one chunk.
//!
//! Tiers: `Full` materialises the logits of every selected row at once (the reference);
//! `Chunked(c)` runs `c` rows at a time and recomputes each chunk's logits in the backward;
//! `Fused` is the fused linear cross-entropy (`tensor::cce`): no logits are ever stored, the
//! backward recomputes them block by block from the forward's lse (`HeadSaved`).
//! Only rows that have a target are ever projected: callers gather those rows first.

use crate::model::Model;
use crate::tensor::cce::{self, DEFAULT_FILTER_EPS};
use crate::tensor::{self as ops, DType, Tensor};
use anyhow::Result;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HeadTier {
    Full,
    Chunked,
    Fused,
}

/// The fused tier's coefficient filter: `DEFAULT_FILTER_EPS` unless `LORAFIT_CCE_FILTER_EPS` is
/// set (`0` turns the filter off; for measurements).
pub fn filter_eps() -> f32 {
    std::env::var("LORAFIT_CCE_FILTER_EPS")
        .ok()
        .and_then(|s| s.parse::<f32>().ok())
        .filter(|e| *e >= 0.0)
        .unwrap_or(DEFAULT_FILTER_EPS)
}

/// Rows per chunk for the chunked tier.
pub const DEFAULT_CHUNK: usize = 1024;

fn chunks(rows: usize, tier: HeadTier, chunk: usize) -> Vec<(usize, usize)> {
    let c = match tier {
        HeadTier::Full | HeadTier::Fused => rows.max(1),
        HeadTier::Chunked => chunk.max(1),
    };
    (0..rows)
        .step_by(c)
        .map(|s| (s, (s + c).min(rows)))
        .collect()
}

/// What the forward keeps for the backward: the fused tier's per-row lse (the other tiers
/// recompute each chunk's logits, and their lse with them).
#[derive(Default)]
pub struct HeadSaved {
    lse: Option<Tensor>,
}

/// log p(targets[i] | h[i]) for every row of `h` `(N, H)`.
pub fn logp_forward(
    model: &Model,
    h: &Tensor,
    targets: &[u32],
    tier: HeadTier,
    chunk: usize,
) -> Result<Vec<f32>> {
    Ok(logp_forward_saved(model, h, targets, tier, chunk)?.0)
}

/// `logp_forward`, also returning what `logp_backward_saved` reuses.
pub fn logp_forward_saved(
    model: &Model,
    h: &Tensor,
    targets: &[u32],
    tier: HeadTier,
    chunk: usize,
) -> Result<(Vec<f32>, HeadSaved)> {
    if tier == HeadTier::Fused {
        // A quantized head is dequantized once per call.
        let w = model.weights.head().dense()?;
        let (logp, lse) = cce::cce_forward(h, &w, targets, None)?;
        return Ok((logp.to_vec()?, HeadSaved { lse: Some(lse) }));
    }
    let mut parts = Vec::new();
    for (s, e) in chunks(targets.len(), tier, chunk) {
        let hc = if s == 0 && e == targets.len() {
            h.try_clone()?
        } else {
            ops::slice_rows(h, s, e)?
        };
        let logits = model.logits(&hc, DType::F32)?;
        let (logp, _) = ops::logsoftmax_gather(&logits, &targets[s..e])?;
        parts.push(logp);
    }
    // Downloads after all chunks are queued: the device runs them without waiting on the host.
    let mut out = Vec::with_capacity(targets.len());
    for p in parts {
        out.extend(p.to_vec()?);
    }
    Ok((out, HeadSaved::default()))
}

/// d loss / d h `(N, H)` from d loss / d logp, recomputing each chunk's logits.
pub fn logp_backward(
    model: &Model,
    h: &Tensor,
    targets: &[u32],
    dlogp: &[f32],
    tier: HeadTier,
    chunk: usize,
) -> Result<Tensor> {
    logp_backward_saved(model, h, targets, dlogp, tier, chunk, &HeadSaved::default())
}

/// `logp_backward` reusing the forward's `saved` state (the fused tier's lse; recomputed when
/// absent).
pub fn logp_backward_saved(
    model: &Model,
    h: &Tensor,
    targets: &[u32],
    dlogp: &[f32],
    tier: HeadTier,
    chunk: usize,
    saved: &HeadSaved,
) -> Result<Tensor> {
    let (n, hid) = h.rows_cols();
    let dev = h.device().clone();
    if tier == HeadTier::Fused {
        let w = model.weights.head().dense()?;
        let recomputed;
        let lse = match &saved.lse {
            Some(l) => l,
            None => {
                recomputed = cce::cce_forward(h, &w, targets, None)?.1;
                &recomputed
            }
        };
        let g = Tensor::from_f32(dlogp, &[n], DType::F32, &dev)?;
        return cce::cce_backward(h, &w, targets, &g, lse, None, filter_eps());
    }
    let mut dh = Tensor::zeros(&[n, hid], h.dtype(), &dev)?;
    for (s, e) in chunks(n, tier, chunk) {
        let hc = ops::slice_rows(h, s, e)?;
        let logits = model.logits(&hc, DType::F32)?;
        let (_, lse) = ops::logsoftmax_gather(&logits, &targets[s..e])?;
        let g = Tensor::from_f32(&dlogp[s..e], &[e - s], DType::F32, &dev)?;
        let dlogits = ops::logsoftmax_gather_bwd(&g, &logits, &lse, &targets[s..e])?;
        drop(logits);
        let dhc = model.logits_bwd(&dlogits)?;
        let idx: Vec<u32> = (s as u32..e as u32).collect();
        ops::scatter_add_rows(&mut dh, &idx, &dhc)?;
    }
    Ok(dh)
}
