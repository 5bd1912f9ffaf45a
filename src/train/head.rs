//! The logp engine: per-token log p(target) from final hidden states and the LM head, and the
//! gradient back to the hidden states, without keeping `[tokens, vocab]` logits beyond one chunk.
//!
//! Tiers: `Full` materialises the logits of every selected row at once (the reference);
//! `Chunked(c)` runs `c` rows at a time; for training, each chunk's forward also contracts its
//! softmax coefficients into `d h / d logp` (see `HeadSaved`), so the backward never recomputes
//! logits;
//! `Fused` is the fused linear cross-entropy (`tensor::cce`): no logits are ever stored, the
//! backward recomputes them block by block from the forward's lse (`HeadSaved`).
//! Only rows that have a target are ever projected: callers gather those rows first.
//!
//! Every tier applies the model's final logit softcap (`ModelSpec::final_logit_softcap`, Gemma 2:
//! `z → c·tanh(z/c)`) to the raw head logits before the softmax, and its derivative
//! `1 − (y/c)²` in the coefficients, from `Model::raw_logits`.

use crate::model::Model;
use crate::tensor::cce::{self, DEFAULT_FILTER_EPS};
use crate::tensor::{self as ops, DType, Tensor};
use anyhow::Result;

pub use crate::config::HeadTier;

/// The fused tier's coefficient filter (`TrainConfig::cce_filter_eps`), as bits of an f32.
static FILTER_EPS: std::sync::atomic::AtomicU32 =
    std::sync::atomic::AtomicU32::new(DEFAULT_FILTER_EPS.to_bits());

/// Sets the fused tier's coefficient filter for this process (`0` keeps every term).
pub fn set_filter_eps(eps: f32) {
    FILTER_EPS.store(eps.max(0.0).to_bits(), std::sync::atomic::Ordering::Relaxed);
}

/// The fused tier's coefficient filter: `DEFAULT_FILTER_EPS` unless `set_filter_eps` changed it.
pub fn filter_eps() -> f32 {
    f32::from_bits(FILTER_EPS.load(std::sync::atomic::Ordering::Relaxed))
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

/// What the forward keeps for the backward: the fused tier's per-row lse, or, for the other
/// tiers, `d h / d logp` of every row.
///
/// Every objective is a function of the per-token logps, so `d loss / d logits[t] =
/// dlogp[t] · (onehot(target[t]) - softmax(logits[t]))` and `d h[t] = dlogp[t] · u[t]` with
/// `u[t] = (onehot - softmax) W`: one `(rows, H)` matrix, formed while the forward's logits chunk
/// is still live. The backward then scales rows instead of projecting every chunk onto the
/// vocabulary a second time.
#[derive(Default)]
pub struct HeadSaved {
    lse: Option<Tensor>,
    dh_per_logp: Option<Tensor>,
}

/// f32 logits of the rows `h`, softcapped in place when the model has a final logit softcap.
fn capped_logits(model: &Model, h: &Tensor) -> Result<Tensor> {
    let mut logits = model.raw_logits(h, DType::F32)?;
    if let Some(c) = model.spec.final_logit_softcap {
        ops::softcap(&mut logits, c)?;
    }
    Ok(logits)
}

/// log p(targets[i] | h[i]) for every row of `h` `(N, H)`, on the host.
pub fn logp_forward(
    model: &Model,
    h: &Tensor,
    targets: &[u32],
    tier: HeadTier,
    chunk: usize,
) -> Result<Vec<f32>> {
    logp_forward_saved(model, h, targets, tier, chunk, false)?
        .0
        .to_vec()
}

/// Vectors `[n_i]` end to end, `[sum n_i]`, on their device.
pub fn concat_vectors(xs: Vec<Tensor>) -> Result<Tensor> {
    if xs.len() == 1 {
        return Ok(xs.into_iter().next().unwrap());
    }
    let cols: Vec<Tensor> = xs
        .into_iter()
        .map(|x| {
            let n = x.numel();
            x.reshape(&[n, 1])
        })
        .collect::<Result<_>>()?;
    let all = ops::concat_rows(&cols.iter().collect::<Vec<_>>())?;
    let n = all.numel();
    all.reshape(&[n])
}

/// Elements `start..end` of the vector `x`, copied.
pub fn slice_vector(x: &Tensor, start: usize, end: usize) -> Result<Tensor> {
    if start == 0 && end == x.numel() {
        return x.try_clone();
    }
    // A vector is one row: its elements are columns.
    ops::slice_cols(x, start, end)?.reshape(&[end - start])
}

/// `logp_forward` on the device (`[N]` f32, nothing downloaded), also returning what
/// `logp_backward_saved` reuses (with `for_backward`; a forward that is not followed by a
/// backward passes false and keeps nothing).
pub fn logp_forward_saved(
    model: &Model,
    h: &Tensor,
    targets: &[u32],
    tier: HeadTier,
    chunk: usize,
    for_backward: bool,
) -> Result<(Tensor, HeadSaved)> {
    if tier == HeadTier::Fused {
        // A quantized head is dequantized once per call.
        let w = model.weights.head().dense()?;
        let (logp, lse) = cce::cce_forward(h, &w, targets, model.spec.final_logit_softcap)?;
        let saved = HeadSaved {
            lse: Some(lse),
            dh_per_logp: None,
        };
        return Ok((logp, saved));
    }
    let n = targets.len();
    let spans = chunks(n, tier, chunk);
    let mut parts = Vec::new();
    let mut dh_per_logp = None;
    if for_backward && spans.len() > 1 {
        let (_, hid) = h.rows_cols();
        dh_per_logp = Some(Tensor::zeros(
            &[n, hid],
            model.device.compute_dtype(),
            h.device(),
        )?);
    }
    for &(s, e) in &spans {
        let hc = if s == 0 && e == n {
            h.try_clone()?
        } else {
            ops::slice_rows(h, s, e)?
        };
        let logits = capped_logits(model, &hc)?;
        let (logp, lse) = ops::logsoftmax_gather(&logits, &targets[s..e])?;
        parts.push(logp);
        if for_backward {
            let ones = Tensor::from_f32(&vec![1.0; e - s], &[e - s], DType::F32, h.device())?;
            let coeff = ops::logsoftmax_gather_softcap_bwd_to(
                &ones,
                &logits,
                &lse,
                &targets[s..e],
                model.spec.final_logit_softcap,
                model.device.compute_dtype(),
            )?;
            drop(logits);
            let u = model.raw_logits_bwd(&coeff)?;
            match &mut dh_per_logp {
                Some(all) => {
                    let idx: Vec<u32> = (s as u32..e as u32).collect();
                    ops::scatter_add_rows(all, &idx, &u)?;
                }
                None => dh_per_logp = Some(u),
            }
        }
    }
    Ok((
        concat_vectors(parts)?,
        HeadSaved {
            lse: None,
            dh_per_logp,
        },
    ))
}

/// d loss / d h `(N, H)` from d loss / d logp (on the host), recomputing each chunk's logits
/// (without a saved forward).
pub fn logp_backward(
    model: &Model,
    h: &Tensor,
    targets: &[u32],
    dlogp: &[f32],
    tier: HeadTier,
    chunk: usize,
) -> Result<Tensor> {
    let g = Tensor::from_f32(dlogp, &[dlogp.len()], DType::F32, h.device())?;
    logp_backward_saved(model, h, targets, &g, tier, chunk, HeadSaved::default())
}

/// `logp_backward` with d loss / d logp on the device (`[N]` f32), consuming the forward's
/// `saved` state (the fused tier's lse, the other tiers' `d h / d logp`, whose rows are scaled in
/// place; recomputed when absent).
pub fn logp_backward_saved(
    model: &Model,
    h: &Tensor,
    targets: &[u32],
    dlogp: &Tensor,
    tier: HeadTier,
    chunk: usize,
    saved: HeadSaved,
) -> Result<Tensor> {
    let (n, hid) = h.rows_cols();
    anyhow::ensure!(
        dlogp.numel() == n && targets.len() == n,
        "logp backward: {n} rows, {} targets, {} gradients",
        targets.len(),
        dlogp.numel()
    );
    let dev = h.device().clone();
    let cap = model.spec.final_logit_softcap;
    if tier == HeadTier::Fused {
        let w = model.weights.head().dense()?;
        let recomputed;
        let lse = match &saved.lse {
            Some(l) => l,
            None => {
                recomputed = cce::cce_forward(h, &w, targets, cap)?.1;
                &recomputed
            }
        };
        return cce::cce_backward(h, &w, targets, dlogp, lse, cap, filter_eps());
    }
    if let Some(mut dh) = saved.dh_per_logp {
        ops::scale_rows(&mut dh, dlogp)?;
        return Ok(dh);
    }
    let mut dh = Tensor::zeros(&[n, hid], h.dtype(), &dev)?;
    for (s, e) in chunks(n, tier, chunk) {
        let hc = ops::slice_rows(h, s, e)?;
        let logits = capped_logits(model, &hc)?;
        let (_, lse) = ops::logsoftmax_gather(&logits, &targets[s..e])?;
        let g = slice_vector(dlogp, s, e)?;
        let dlogits = ops::logsoftmax_gather_softcap_bwd_to(
            &g,
            &logits,
            &lse,
            &targets[s..e],
            cap,
            DType::F32,
        )?;
        drop(logits);
        let dhc = model.raw_logits_bwd(&dlogits)?;
        let idx: Vec<u32> = (s as u32..e as u32).collect();
        ops::scatter_add_rows(&mut dh, &idx, &dhc)?;
    }
    Ok(dh)
}
