//! The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM): one decoder layer's forward and
//! its hand-written backward, and the whole-model passes built from them.
//!
//! Read `layer_forward` and `layer_backward` side by side: the backward is the forward's op list
//! in reverse. Frozen weights get no gradient; the backward yields d(input) and accumulates the
//! LoRA gradients dA, dB into the adapters. Shapes: T tokens, H hidden, I intermediate,
//! nh/nkv heads of hd dims.

use super::config::ModelSpec;
use super::lora::{Lora, LoraPair, Target, GROUP_GATE_UP, GROUP_QKV};
use super::weights::{Dense, ModelWeights, Weight};
use crate::tensor::{self as ops, AttnMask, AttnShape, DType, Device, RopeTable, Tensor};
use anyhow::Result;

/// Per-pass context shared by every layer.
pub struct PassCtx<'a> {
    pub mask: &'a AttnMask,
    pub rope: &'a RopeTable,
    /// LoRA-input dropout `(p, step seed)`; the mask is keyed by (step seed, layer, target) so a
    /// recomputation replays it.
    pub dropout: Option<(f32, u64)>,
}

impl PassCtx<'_> {
    fn dropout_for(&self, layer: usize, t: Target) -> Option<(f32, u64)> {
        self.dropout.filter(|(p, _)| *p > 0.0).map(|(p, seed)| {
            let key = (layer as u64) * 8 + t.index() as u64;
            (p, seed ^ key.wrapping_mul(0xD6E8_FEB8_6659_FD93))
        })
    }
}

/// The rows `[from, T)` of a pass's final hidden states, the only ones anything reads (the head's
/// rows of a preference pair start at the prompt's last token). The top layer runs its o
/// projection and MLP for these rows only, and its other rows attend to themselves alone
/// (`mask`): nothing reads their outputs, while their k and v still feed the rows that are read.
/// Their gradients are exactly zero either way, so the result is the same as the full layer's.
pub struct ReadRows {
    from: usize,
    mask: AttnMask,
}

impl ReadRows {
    /// `None` when every row is read (`from == 0`).
    pub fn new(mask: &AttnMask, from: usize) -> Option<ReadRows> {
        if from == 0 {
            return None;
        }
        let mut mask = mask.clone();
        for (q, r) in mask.ranges.iter_mut().enumerate().take(from) {
            *r = [q as u32, q as u32 + 1, 0, 0];
        }
        Some(ReadRows { from, mask })
    }
}

/// What a LoRA-carrying projection keeps for its backward: `xa = dropout(x) Aᵀ`, `(T, r)`.
pub struct LoraSaved {
    xa: Tensor,
}

/// What one layer's forward keeps for its backward.
pub struct LayerActs {
    x: Tensor,              // (T, H) layer input
    xn: Tensor,             // (T, H) after the attention norm
    rstd1: Tensor,          // (T)
    q_pre: Option<Tensor>,  // (T*nh, hd) q before its per-head norm (Qwen3)
    q_rstd: Option<Tensor>, // (T*nh)
    k_pre: Option<Tensor>,  // (T*nkv, hd)
    k_rstd: Option<Tensor>, // (T*nkv)
    q: Tensor,              // (T, nh*hd) after RoPE
    k: Tensor,              // (T, nkv*hd) after RoPE
    v: Tensor,              // (T, nkv*hd)
    attn: Tensor,           // (T, nh*hd) attention output
    lse: Tensor,            // (nh, T) f32
    /// First row of the o projection and the MLP (`ReadRows`; 0: every row). The tensors below
    /// hold rows `[from, T)`.
    from: usize,
    x1: Tensor,    // (T - from, H) after the attention residual
    xn2: Tensor,   // (T - from, H) after the MLP norm
    rstd2: Tensor, // (T - from)
    /// The MLP's intermediates; `None` when the MLP runs in token chunks and is recomputed chunk
    /// by chunk in the backward.
    mlp: Option<MlpActs>,
    lora: [Option<LoraSaved>; 7],
}

/// What the gated MLP keeps for its backward.
pub struct MlpActs {
    gate: Tensor, // (T, I)
    up: Tensor,   // (T, I)
    act: Tensor,  // (T, I) silu(gate) * up
    /// LoRA inputs of gate, up, down.
    lora: [Option<LoraSaved>; 3],
}

/// How one layer's forward runs (`Model::layer_forward`).
pub struct LayerRun<'a> {
    /// Compute the layer output (a recomputation of a segment's last layer does not need it,
    /// which spares the MLP's down projection).
    pub want_output: bool,
    /// The layer's attention output and lse kept from the forward (spares the attention kernel).
    pub attention: Option<(Tensor, Tensor)>,
    /// The layer's k (rotated) and v kept from the forward (spares their projections).
    pub kept_kv: Option<(Tensor, Tensor)>,
    /// The top layer's rows (`ReadRows`): the output holds rows `[read.from, T)` only.
    pub read: Option<&'a ReadRows>,
    /// Keep the MLP intermediates (otherwise the backward recomputes them).
    pub keep_mlp: bool,
}

/// What a forward keeps for its backward, and which rows of its final hidden states it computes
/// (`Model::forward_keeping`).
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardPlan {
    /// 0 keeps every layer's activations; s > 0 keeps the input of every s-th layer below the
    /// top one and the top layer's activations, and recomputes a segment at a time.
    pub segment_size: usize,
    /// With segments: also keep every layer's attention output and lse (`(T, nh·hd)` + `(nh, T)`
    /// per layer), so that the recomputation runs no attention kernel.
    pub keep_attention: bool,
    /// With segments: the top layer keeps its MLP intermediates too (otherwise its backward
    /// recomputes them; see `train::memory::keep_top_mlp`).
    pub keep_top_mlp: bool,
    /// Compute the final hidden states of rows `[read_from, T)` only (`ReadRows`).
    pub read_from: usize,
    /// With segments: also keep k (rotated) and v of the lowest this many layers below the top
    /// one (`T·2·kv_dim` values each), sparing their projections in the recomputation. Not for
    /// models with q/k norms (their backward needs the unnormed k as well).
    pub keep_kv_layers: usize,
}

/// A loaded model: spec, frozen weights, and its device.
pub struct Model {
    pub spec: ModelSpec,
    pub weights: ModelWeights,
    pub device: Device,
    pub inv_freq: Vec<f32>,
    /// Run the MLP in token chunks of this size (0: all tokens at once); the backward recomputes
    /// each chunk's intermediates, trading one extra gate/up projection for (T, I) memory.
    pub mlp_chunk: usize,
    /// Dtype of the residual stream and its gradient between layers: f32 on every device, so
    /// that the sums of many bf16 sublayer outputs do not round at each layer (projections and
    /// attention still read the compute dtype).
    pub residual_dtype: DType,
}

/// Rows `[from, T)` of `x` (borrowed when that is all of it).
fn rows_from(x: &Tensor, from: usize) -> Result<Dense<'_>> {
    Ok(if from == 0 {
        Dense::Borrowed(x)
    } else {
        Dense::Owned(ops::slice_rows(x, from, x.dim(0))?)
    })
}

/// `x` with `(T - from)` rows as rows `[from, T)` of a zero `(T, ·)` tensor.
fn rows_into_full(x: Tensor, from: usize, t: usize) -> Result<Tensor> {
    if from == 0 {
        return Ok(x);
    }
    let mut full = Tensor::zeros(&[t, x.dim(1)], x.dtype(), x.device())?;
    ops::scatter_add_rows(&mut full, &(from as u32..t as u32).collect::<Vec<_>>(), &x)?;
    Ok(full)
}

fn token_chunks(t: usize, c: usize) -> Vec<(usize, usize)> {
    (0..t)
        .step_by(c.max(1))
        .map(|a| (a, (a + c).min(t)))
        .collect()
}

/// `y = x Wᵀ (+ scale · dropout(x) Aᵀ Bᵀ)`; `xa`, when given, is `dropout(x) Aᵀ` already
/// computed (by `stacked_lora_inputs`).
fn linear_fwd(
    x: &Tensor,
    w: &Weight,
    lora: Option<&LoraPair>,
    dropout: Option<(f32, u64)>,
    xa: Option<Tensor>,
) -> Result<(Tensor, Option<LoraSaved>)> {
    let dt = x.dtype();
    let Some(p) = lora else {
        return Ok((ops::matmul(x, false, &*w.dense()?, true, 1.0, dt)?, None));
    };
    let saved = match xa {
        Some(xa) => LoraSaved { xa },
        None => lora_input(x, p, dropout)?,
    };
    // The rank-r product writes y first and the base GEMM accumulates onto it: the base GEMM
    // reads y in its epilogue almost for free, where the skinny product would read and write the
    // whole (T, out) output a second time.
    let mut y = ops::matmul(&saved.xa, false, p.b(), true, p.scale, dt)?;
    ops::matmul_acc(&mut y, x, false, &*w.dense()?, true, 1.0, 1.0)?;
    Ok((y, Some(saved)))
}

/// What `linear_fwd` keeps for the backward, without the projection itself (a recomputed layer
/// whose output is not needed).
fn lora_input(x: &Tensor, p: &LoraPair, dropout: Option<(f32, u64)>) -> Result<LoraSaved> {
    let dt = x.dtype();
    let xa = match dropout {
        Some((prob, seed)) => {
            ops::matmul(&ops::dropout(x, prob, seed)?, false, p.a(), true, 1.0, dt)?
        }
        None => ops::matmul(x, false, p.a(), true, 1.0, dt)?,
    };
    Ok(LoraSaved { xa })
}

/// `x Aᵢᵀ` of every adapter of shared-input group `group` (`lora::SHARED_INPUT`) from one GEMM
/// with the layer's stacked A, by target index; all None when the layer has no stacked A for the
/// group or LoRA dropout is on (each projection then draws its own mask).
fn stacked_lora_inputs(
    x: &Tensor,
    lora: Option<&Lora>,
    l: usize,
    group: usize,
    ctx: &PassCtx,
) -> Result<[Option<Tensor>; 7]> {
    let mut out: [Option<Tensor>; 7] = Default::default();
    let Some(st) = lora.and_then(|lo| lo.stacked(l, group)) else {
        return Ok(out);
    };
    if ctx.dropout_for(l, st.members[0].0).is_some() {
        return Ok(out);
    }
    let xa = ops::matmul(x, false, &st.a, true, 1.0, x.dtype())?;
    let mut c0 = 0;
    for &(t, r) in &st.members {
        out[t.index()] = Some(ops::slice_cols(&xa, c0, c0 + r)?);
        c0 += r;
    }
    Ok(out)
}

/// The LoRA part of a projection's backward without dropout: accumulates `dB += s · dyᵀ xa` and
/// `dA += dxaᵀ x`, returns `dxa = s · dy B`.
fn lora_bwd(dy: &Tensor, x: &Tensor, p: &mut LoraPair, saved: &LoraSaved) -> Result<Tensor> {
    ops::matmul_acc(&mut p.grad_b, dy, true, &saved.xa, false, p.scale, 1.0)?;
    let dxa = ops::matmul(dy, false, p.b(), false, p.scale, dy.dtype())?;
    ops::matmul_acc(&mut p.grad_a, &dxa, true, x, false, 1.0, 1.0)?;
    Ok(dxa)
}

/// One projection of a shared-input group in `shared_input_bwd`: its output gradient, weight,
/// target and what its forward saved.
struct MemberBwd<'a> {
    dy: Tensor,
    w: &'a Weight,
    target: Target,
    saved: Option<&'a LoraSaved>,
}

/// Backward of the projections of `lora::SHARED_INPUT[group]` that read the same `x`: d(x), with
/// every LoRA gradient accumulated. With the layer's stacked A (no dropout) the adapters' `dxa A`
/// terms run as one GEMM over the concatenated dxa; otherwise projection by projection. Each
/// output gradient is freed after its last use.
fn shared_input_bwd(
    members: Vec<MemberBwd>,
    x: &Tensor,
    mut lora: Option<&mut Lora>,
    l: usize,
    group: usize,
    ctx: &PassCtx,
) -> Result<Tensor> {
    let stacked: Option<Vec<(Target, usize)>> = lora
        .as_deref()
        .and_then(|lo| lo.stacked(l, group))
        .filter(|st| ctx.dropout_for(l, st.members[0].0).is_none())
        .map(|st| st.members.clone());
    let Some(stacked) = stacked else {
        let mut dx = None;
        for m in members {
            let pair = lora.as_deref_mut().and_then(|lo| lo.get_mut(l, m.target));
            dx = Some(linear_bwd(
                dx,
                &m.dy,
                x,
                m.w,
                pair,
                m.saved,
                ctx.dropout_for(l, m.target),
            )?);
        }
        return dx.ok_or_else(|| anyhow::anyhow!("shared_input_bwd: no projection"));
    };
    let lo = lora.expect("a stacked A comes from an adapter");
    let mut dxa = Vec::with_capacity(stacked.len());
    for &(t, _) in &stacked {
        let m = members.iter().find(|m| m.target == t);
        let (Some(m), Some(p)) = (m, lo.get_mut(l, t)) else {
            anyhow::bail!("layer {l}: stacked adapter {t:?} has no projection backward");
        };
        let saved = m
            .saved
            .ok_or_else(|| anyhow::anyhow!("layer {l} {t:?}: no saved LoRA input"))?;
        dxa.push(lora_bwd(&m.dy, x, p, saved)?);
    }
    let dxa = ops::concat_cols(&dxa.iter().collect::<Vec<_>>())?;
    let st = lo.stacked(l, group).expect("checked above");
    // As in the forward: the rank-r product first, the base GEMMs accumulate onto it.
    let mut dx = ops::matmul(&dxa, false, &st.a, false, 1.0, x.dtype())?;
    drop(dxa);
    for m in members {
        ops::matmul_acc(&mut dx, &m.dy, false, &*m.w.dense()?, false, 1.0, 1.0)?;
    }
    Ok(dx)
}

/// Backward of `linear_fwd`: returns dx and accumulates dA, dB.
///   dB += s · dyᵀ xa        dxa = s · dy B
///   dA += dxaᵀ dropout(x)   dx  = dy W + dropout(dxa A)
fn linear_bwd(
    into: Option<Tensor>,
    dy: &Tensor,
    x: &Tensor,
    w: &Weight,
    lora: Option<&mut LoraPair>,
    saved: Option<&LoraSaved>,
    dropout: Option<(f32, u64)>,
) -> Result<Tensor> {
    let dt = dy.dtype();
    // dx accumulates in place when the projection shares its input with others (q, k, v).
    let base = |into: Option<Tensor>| -> Result<Tensor> {
        Ok(match into {
            Some(mut acc) => {
                ops::matmul_acc(&mut acc, dy, false, &*w.dense()?, false, 1.0, 1.0)?;
                acc
            }
            None => ops::matmul(dy, false, &*w.dense()?, false, 1.0, dt)?,
        })
    };
    let (Some(p), Some(saved)) = (lora, saved) else {
        return base(into);
    };
    match dropout {
        Some((prob, seed)) => {
            ops::matmul_acc(&mut p.grad_b, dy, true, &saved.xa, false, p.scale, 1.0)?;
            let dxa = ops::matmul(dy, false, p.b(), false, p.scale, dt)?;
            let dx_lora = ops::matmul(&dxa, false, p.a(), false, 1.0, dt)?;
            ops::matmul_acc(
                &mut p.grad_a,
                &dxa,
                true,
                &ops::dropout(x, prob, seed)?,
                false,
                1.0,
                1.0,
            )?;
            let mut dx = base(into)?;
            ops::add_assign(&mut dx, &ops::dropout(&dx_lora, prob, seed)?, 1.0)?;
            Ok(dx)
        }
        None => {
            let dxa = lora_bwd(dy, x, p, saved)?;
            // As in the forward: the rank-r product first, the base GEMM accumulates onto it.
            let dx = match into {
                Some(mut acc) => {
                    ops::matmul_acc(&mut acc, &dxa, false, p.a(), false, 1.0, 1.0)?;
                    acc
                }
                None => ops::matmul(&dxa, false, p.a(), false, 1.0, dt)?,
            };
            base(Some(dx))
        }
    }
}

impl Model {
    pub fn new(spec: ModelSpec, weights: ModelWeights, device: Device) -> Model {
        let inv_freq = spec.inv_freq();
        Model {
            spec,
            weights,
            device,
            inv_freq,
            mlp_chunk: 0,
            residual_dtype: DType::F32,
        }
    }

    fn attn_shape(&self) -> AttnShape {
        let s = &self.spec;
        AttnShape {
            n_heads: s.n_heads,
            n_kv_heads: s.n_kv_heads,
            head_dim: s.head_dim,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            softcap: None,
        }
    }

    /// The attention mask of a plain causal sequence with this model's sliding window.
    pub fn causal_mask(&self, t: usize) -> AttnMask {
        AttnMask::causal(t).with_window(self.spec.sliding_window.map(|w| w as u32))
    }

    /// Final hidden states of one plain causal sequence, keeping nothing for a backward
    /// (generation and evaluation).
    pub fn hidden_states(&self, ids: &[u32], lora: Option<&Lora>) -> Result<Tensor> {
        let mask = self.causal_mask(ids.len());
        let rope = self.rope_table(&mask.positions)?;
        let ctx = PassCtx {
            mask: &mask,
            rope: &rope,
            dropout: None,
        };
        Ok(self.forward(ids, lora, &ctx, self.spec.n_layers)?.0)
    }

    pub fn rope_table(&self, positions: &[i32]) -> Result<RopeTable> {
        RopeTable::new(positions, &self.inv_freq, &self.device)
    }

    /// `t` in the compute dtype (borrowed when it already is).
    fn compute<'a>(&self, t: &'a Tensor) -> Result<Dense<'a>> {
        let dt = self.device.compute_dtype();
        Ok(if t.dtype() == dt {
            Dense::Borrowed(t)
        } else {
            Dense::Owned(t.to_dtype(dt)?)
        })
    }

    /// Token embeddings `(T, H)` in the compute dtype.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        ops::embedding(&*self.weights.embed.dense()?, ids)
    }

    /// One decoder layer: returns the layer output (with `run.want_output`) and what its
    /// backward needs.
    pub fn layer_forward(
        &self,
        l: usize,
        x: Tensor,
        lora: Option<&Lora>,
        ctx: &PassCtx,
        run: LayerRun,
    ) -> Result<(Option<Tensor>, LayerActs)> {
        let LayerRun {
            want_output,
            attention,
            kept_kv,
            read,
            keep_mlp,
        } = run;
        let s = &self.spec;
        let w = &self.weights.layers[l];
        let t = x.dim(0);
        let pair = |tg: Target| lora.and_then(|lo| lo.get(l, tg));
        let mut saved: [Option<LoraSaved>; 7] = Default::default();
        let cdt = self.device.compute_dtype();
        let (xn, rstd1) = ops::rms_norm_to(&x, &w.attn_norm, s.rms_eps, cdt)?;
        let mut xa = stacked_lora_inputs(&xn, lora, l, GROUP_QKV, ctx)?;
        anyhow::ensure!(
            kept_kv.is_none() || w.k_norm.is_none(),
            "layer {l}: k and v are kept only without a k norm"
        );
        // k (rotated) and v kept from the forward: only their LoRA inputs are rebuilt.
        let kv_kept = kept_kv.is_some();
        if kv_kept {
            for tg in [Target::K, Target::V] {
                saved[tg.index()] = match (xa[tg.index()].take(), pair(tg)) {
                    (Some(xa), _) => Some(LoraSaved { xa }),
                    (None, Some(p)) => Some(lora_input(&xn, p, ctx.dropout_for(l, tg))?),
                    (None, None) => None,
                };
            }
        }
        let mut lin = |inp: &Tensor, wt: &Weight, tg: Target| -> Result<Tensor> {
            let pre = xa[tg.index()].take();
            let (y, sv) = linear_fwd(inp, wt, pair(tg), ctx.dropout_for(l, tg), pre)?;
            saved[tg.index()] = sv;
            Ok(y)
        };

        let mut q = lin(&xn, &w.q, Target::Q)?;
        let (mut k, mut v) = match kept_kv {
            Some(kv) => kv,
            None => (lin(&xn, &w.k, Target::K)?, lin(&xn, &w.v, Target::V)?),
        };
        if let (Some(qb), Some(kb), Some(vb)) = (&w.q_bias, &w.k_bias, &w.v_bias) {
            ops::add_bias(&mut q, qb)?;
            if !kv_kept {
                ops::add_bias(&mut k, kb)?;
                ops::add_bias(&mut v, vb)?;
            }
        }
        let (mut q_pre, mut q_rstd, mut k_pre, mut k_rstd) = (None, None, None, None);
        if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
            let qp = q.reshape(&[t * s.n_heads, s.head_dim])?;
            let kp = k.reshape(&[t * s.n_kv_heads, s.head_dim])?;
            let (qy, qr) = ops::rms_norm(&qp, qn, s.rms_eps)?;
            let (ky, kr) = ops::rms_norm(&kp, kn, s.rms_eps)?;
            q = qy.reshape(&[t, s.q_dim()])?;
            k = ky.reshape(&[t, s.kv_dim()])?;
            (q_pre, q_rstd, k_pre, k_rstd) = (Some(qp), Some(qr), Some(kp), Some(kr));
        }
        // (Shadowing would keep the unrotated q and k alive to the end of the layer.)
        let q = {
            let rotated = ops::rope(&q, ctx.rope, s.n_heads, false)?;
            drop(q);
            rotated
        };
        let k = if kv_kept {
            k
        } else {
            let rotated = ops::rope(&k, ctx.rope, s.n_kv_heads, false)?;
            drop(k);
            rotated
        };
        // A recomputation may bring this layer's attention output and lse from the forward.
        let (attn, lse) = match attention {
            Some(kept) => kept,
            None => ops::attention(
                &q,
                &k,
                &v,
                read.map_or(ctx.mask, |r| &r.mask),
                self.attn_shape(),
            )?,
        };
        let from = read.map_or(0, |r| r.from);
        let o = lin(&*rows_from(&attn, from)?, &w.o, Target::O)?;
        let (x1, xn2, rstd2) =
            ops::add_rms_norm_to(&*rows_from(&x, from)?, &o, &w.mlp_norm, s.rms_eps, cdt)?;
        drop(o);

        let rows = t - from;
        let chunked = self.mlp_chunk > 0 && rows > self.mlp_chunk;
        let (mlp_out, mlp) = if (chunked || !keep_mlp) && !want_output {
            // The backward recomputes the MLP; nothing reads its output now.
            (None, None)
        } else if chunked {
            // Token chunks: the (T, I) intermediates never exist for all tokens at once.
            let mut out = Tensor::zeros(x1.shape(), cdt, x1.device())?;
            for (a, b) in token_chunks(rows, self.mlp_chunk) {
                let (o, _) = self.mlp_forward(l, &ops::slice_rows(&xn2, a, b)?, lora, ctx, true)?;
                let o = o.expect("the MLP output was asked for");
                ops::scatter_add_rows(&mut out, &(a as u32..b as u32).collect::<Vec<_>>(), &o)?;
            }
            (Some(out), None)
        } else {
            let (out, m) = self.mlp_forward(l, &xn2, lora, ctx, want_output)?;
            (out, keep_mlp.then_some(m))
        };
        let out = match mlp_out.filter(|_| want_output) {
            Some(mlp_out) => Some(ops::add(&x1, &mlp_out, 1.0)?),
            None => None,
        };
        let acts = LayerActs {
            x,
            xn,
            rstd1,
            q_pre,
            q_rstd,
            k_pre,
            k_rstd,
            q,
            k,
            v,
            attn,
            lse,
            from,
            x1,
            xn2,
            rstd2,
            mlp,
            lora: saved,
        };
        Ok((out, acts))
    }

    /// The gated MLP on normed inputs `xn2` (any token range); its output only with `want_output`.
    fn mlp_forward(
        &self,
        l: usize,
        xn2: &Tensor,
        lora: Option<&Lora>,
        ctx: &PassCtx,
        want_output: bool,
    ) -> Result<(Option<Tensor>, MlpActs)> {
        let w = &self.weights.layers[l];
        let pair = |tg: Target| lora.and_then(|lo| lo.get(l, tg));
        let mut xa = stacked_lora_inputs(xn2, lora, l, GROUP_GATE_UP, ctx)?;
        let (gate, sg) = linear_fwd(
            xn2,
            &w.gate,
            pair(Target::Gate),
            ctx.dropout_for(l, Target::Gate),
            xa[Target::Gate.index()].take(),
        )?;
        let (up, su) = linear_fwd(
            xn2,
            &w.up,
            pair(Target::Up),
            ctx.dropout_for(l, Target::Up),
            xa[Target::Up.index()].take(),
        )?;
        let act = ops::silu_mul(&gate, &up)?;
        let down_dropout = ctx.dropout_for(l, Target::Down);
        let (out, sd) = if want_output {
            let (y, sd) = linear_fwd(&act, &w.down, pair(Target::Down), down_dropout, None)?;
            (Some(y), sd)
        } else {
            let sd = pair(Target::Down)
                .map(|p| lora_input(&act, p, down_dropout))
                .transpose()?;
            (None, sd)
        };
        Ok((
            out,
            MlpActs {
                gate,
                up,
                act,
                lora: [sg, su, sd],
            },
        ))
    }

    /// Backward of `mlp_forward`: d(xn2) from d(out). Consumes the intermediates, each freed at
    /// its last use (the gradients of gate and up overwrite them), which lowers the step's peak.
    fn mlp_backward(
        &self,
        l: usize,
        d_out: &Tensor,
        xn2: &Tensor,
        m: MlpActs,
        mut lora: Option<&mut Lora>,
        ctx: &PassCtx,
    ) -> Result<Tensor> {
        let MlpActs {
            mut gate,
            mut up,
            act,
            lora: saved,
        } = m;
        let w = &self.weights.layers[l];
        let down_dropout = ctx.dropout_for(l, Target::Down);
        let d_act = match (
            lora.as_deref_mut()
                .and_then(|lo| lo.get_mut(l, Target::Down)),
            saved[2].as_ref(),
        ) {
            (Some(p), Some(sv)) if down_dropout.is_none() => {
                // The LoRA terms are the only reader of `act`: it is freed before the (T, I)
                // gradient is allocated, which lowers the step's peak by one (T, I) tensor.
                let dxa = lora_bwd(d_out, &act, p, sv)?;
                drop(act);
                let mut d_act = ops::matmul(&dxa, false, p.a(), false, 1.0, d_out.dtype())?;
                ops::matmul_acc(&mut d_act, d_out, false, &*w.down.dense()?, false, 1.0, 1.0)?;
                d_act
            }
            (pair, sv) => {
                let d_act = linear_bwd(None, d_out, &act, &w.down, pair, sv, down_dropout)?;
                drop(act);
                d_act
            }
        };
        ops::silu_mul_bwd_in_place(&d_act, &mut gate, &mut up)?;
        drop(d_act);
        let members = vec![
            MemberBwd {
                dy: gate,
                w: &w.gate,
                target: Target::Gate,
                saved: saved[0].as_ref(),
            },
            MemberBwd {
                dy: up,
                w: &w.up,
                target: Target::Up,
                saved: saved[1].as_ref(),
            },
        ];
        shared_input_bwd(members, xn2, lora, l, GROUP_GATE_UP, ctx)
    }

    /// Backward of `layer_forward`: d(layer input) from d(layer output); LoRA grads accumulate.
    /// Consumes the activations, freeing each after its last use. `d_out_c` is d(layer output)
    /// in the compute dtype when the residual stream is wider (None: cast here); the result
    /// carries the same copy of d(layer input) for the layer below.
    /// `read` is the one `layer_forward` ran with: `d_out` then holds rows `[read.from, T)`.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_backward(
        &self,
        l: usize,
        d_out: &Tensor,
        d_out_c: Option<Tensor>,
        a: LayerActs,
        mut lora: Option<&mut Lora>,
        ctx: &PassCtx,
        read: Option<&ReadRows>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let s = &self.spec;
        let w = &self.weights.layers[l];
        // Rows of d_out (all T unless `read` trims the top layer).
        let t = d_out.dim(0);
        let t_full = a.x.dim(0);
        // MLP: out = x1 + down(silu(gate(xn2)) * up(xn2))
        let d_out_c = match d_out_c {
            Some(c) => Dense::Owned(c),
            None => self.compute(d_out)?,
        };
        let d_xn2 = match a.mlp {
            Some(m) => self.mlp_backward(l, &d_out_c, &a.xn2, m, lora.as_deref_mut(), ctx)?,
            // Recomputed all at once (the forward did not keep it).
            None if self.mlp_chunk == 0 || t <= self.mlp_chunk => {
                let (_, m) = self.mlp_forward(l, &a.xn2, lora.as_deref(), ctx, false)?;
                self.mlp_backward(l, &d_out_c, &a.xn2, m, lora.as_deref_mut(), ctx)?
            }
            // Recomputed chunk by chunk.
            None => {
                let mut d = Tensor::zeros(a.xn2.shape(), a.xn2.dtype(), a.xn2.device())?;
                for (c0, c1) in token_chunks(t, self.mlp_chunk) {
                    let xc = ops::slice_rows(&a.xn2, c0, c1)?;
                    let (_, m) = self.mlp_forward(l, &xc, lora.as_deref(), ctx, false)?;
                    let dc = self.mlp_backward(
                        l,
                        &ops::slice_rows(&d_out_c, c0, c1)?,
                        &xc,
                        m,
                        lora.as_deref_mut(),
                        ctx,
                    )?;
                    ops::scatter_add_rows(
                        &mut d,
                        &(c0 as u32..c1 as u32).collect::<Vec<_>>(),
                        &dc,
                    )?;
                }
                d
            }
        };
        let cdt = self.device.compute_dtype();
        let (d_x1, d_x1_c) =
            ops::rms_norm_bwd_add_copy(&d_xn2, &a.x1, &w.mlp_norm, &a.rstd2, d_out, cdt)?;
        drop((d_xn2, d_out_c, a.x1, a.xn2));

        let mut lin_bwd = |into: Option<Tensor>,
                           dy: &Tensor,
                           inp: &Tensor,
                           wt: &Weight,
                           tg: Target|
         -> Result<Tensor> {
            let pair = lora.as_deref_mut().and_then(|lo| lo.get_mut(l, tg));
            linear_bwd(
                into,
                dy,
                inp,
                wt,
                pair,
                a.lora[tg.index()].as_ref(),
                ctx.dropout_for(l, tg),
            )
        };

        // Attention: x1 = x + o(attention(rope(q), rope(k), v))
        let d_attn = lin_bwd(
            None,
            d_x1_c.as_ref().unwrap_or(&d_x1),
            &*rows_from(&a.attn, a.from)?,
            &w.o,
            Target::O,
        )?;
        drop(d_x1_c);
        // The rows before `a.from` get no gradient from above; they still have one through k, v.
        let d_attn = rows_into_full(d_attn, a.from, t_full)?;
        let d_x1 = rows_into_full(d_x1, a.from, t_full)?;
        let (dq_rot, dk_rot, dv) = ops::attention_bwd(
            &d_attn,
            &a.q,
            &a.k,
            &a.v,
            &a.attn,
            &a.lse,
            read.map_or(ctx.mask, |r| &r.mask),
            self.attn_shape(),
        )?;
        drop((d_attn, a.q, a.k, a.v, a.attn, a.lse));
        let mut dq = ops::rope(&dq_rot, ctx.rope, s.n_heads, true)?;
        drop(dq_rot);
        let mut dk = ops::rope(&dk_rot, ctx.rope, s.n_kv_heads, true)?;
        drop(dk_rot);
        if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
            let dqp = dq.reshape(&[t_full * s.n_heads, s.head_dim])?;
            let dkp = dk.reshape(&[t_full * s.n_kv_heads, s.head_dim])?;
            dq = ops::rms_norm_bwd(
                &dqp,
                a.q_pre.as_ref().unwrap(),
                qn,
                a.q_rstd.as_ref().unwrap(),
            )?
            .reshape(&[t_full, s.q_dim()])?;
            dk = ops::rms_norm_bwd(
                &dkp,
                a.k_pre.as_ref().unwrap(),
                kn,
                a.k_rstd.as_ref().unwrap(),
            )?
            .reshape(&[t_full, s.kv_dim()])?;
        }
        let members = [
            (dq, &w.q, Target::Q),
            (dk, &w.k, Target::K),
            (dv, &w.v, Target::V),
        ]
        .map(|(dy, w, target)| MemberBwd {
            dy,
            w,
            target,
            saved: a.lora[target.index()].as_ref(),
        });
        let d_xn = shared_input_bwd(members.into(), &a.xn, lora, l, GROUP_QKV, ctx)?;
        ops::rms_norm_bwd_add_copy(&d_xn, &a.x, &w.attn_norm, &a.rstd1, &d_x1, cdt)
    }

    /// Forward through all layers and the final norm, keeping what the backward needs according
    /// to `segment_size` (see `ForwardPlan`).
    pub fn forward(
        &self,
        ids: &[u32],
        lora: Option<&Lora>,
        ctx: &PassCtx,
        segment_size: usize,
    ) -> Result<(Tensor, ForwardState)> {
        let plan = ForwardPlan {
            segment_size,
            keep_top_mlp: true,
            ..Default::default()
        };
        self.forward_keeping(ids, lora, ctx, plan)
    }

    /// `forward` keeping what `plan` says. Same numbers whatever it keeps: the kept tensors are
    /// the ones a recomputation would make. Returns the final hidden states of rows
    /// `[plan.read_from, T)`.
    pub fn forward_keeping(
        &self,
        ids: &[u32],
        lora: Option<&Lora>,
        ctx: &PassCtx,
        plan: ForwardPlan,
    ) -> Result<(Tensor, ForwardState)> {
        let ForwardPlan {
            segment_size,
            keep_attention,
            keep_top_mlp,
            read_from,
            keep_kv_layers,
        } = plan;
        let keep_kv = |l: usize| {
            segment_size > 0
                && l < keep_kv_layers
                && l + 1 < self.spec.n_layers
                && self.weights.layers[l].k_norm.is_none()
        };
        let mut kept_kv = Vec::new();
        let read = ReadRows::new(ctx.mask, read_from);
        let n = self.spec.n_layers;
        let read_at = |l: usize| read.as_ref().filter(|_| l + 1 == n);
        let mut x = self.embed(ids)?;
        if x.dtype() != self.residual_dtype {
            x = x.to_dtype(self.residual_dtype)?;
        }
        let mut acts = Vec::new();
        let mut boundaries = Vec::new();
        let mut kept_attention = Vec::new();
        for l in 0..n {
            // With segments, the top layer keeps its activations from the forward: the backward
            // starts there, so a recomputation would rebuild them at once, and they are live at
            // the step's peak either way.
            let top = l + 1 == n;
            if segment_size > 0 && l % segment_size == 0 && !top {
                boundaries.push((l, x.try_clone()?));
            }
            let run = LayerRun {
                want_output: true,
                attention: None,
                kept_kv: None,
                read: read_at(l),
                keep_mlp: segment_size == 0 || keep_top_mlp,
            };
            let (y, a) = self.layer_forward(l, x, lora, ctx, run)?;
            if segment_size == 0 || top {
                acts.push(a);
            } else {
                kept_kv.push(keep_kv(l).then_some((a.k, a.v)));
                if keep_attention {
                    kept_attention.push(Some((a.attn, a.lse)));
                }
            }
            self.device.memtrace(|| format!("forward layer {l}"));
            x = y.expect("the layer output was asked for");
        }
        let (h, rstd) = ops::rms_norm_to(
            &x,
            &self.weights.norm,
            self.spec.rms_eps,
            self.device.compute_dtype(),
        )?;
        Ok((
            h,
            ForwardState {
                acts,
                boundaries,
                kept_attention,
                kept_kv,
                last: x,
                rstd,
                segment_size,
                read,
            },
        ))
    }

    /// Backward from d(final hidden) to every LoRA gradient. Returns d(embeddings) for tests.
    /// Takes d(final hidden) to free it after its first use.
    pub fn backward(
        &self,
        d_hidden: Tensor,
        state: ForwardState,
        mut lora: Option<&mut Lora>,
        ctx: &PassCtx,
    ) -> Result<Tensor> {
        let mut d = ops::rms_norm_bwd(&d_hidden, &state.last, &self.weights.norm, &state.rstd)?;
        drop(d_hidden);
        // The compute-dtype copy of d, where the residual stream is wider: written with it by
        // each layer's last kernel, for the next layer's first projection.
        let mut dc = None;
        drop(state.last);
        let n = self.spec.n_layers;
        let read = state.read.as_ref();
        let read_at = |l: usize| read.filter(|_| l + 1 == n);
        if state.segment_size == 0 {
            for (l, a) in state.acts.into_iter().enumerate().rev() {
                (d, dc) =
                    self.layer_backward(l, &d, dc, a, lora.as_deref_mut(), ctx, read_at(l))?;
            }
            return Ok(d);
        }
        // With segments `acts` holds the top layer's, kept from the forward.
        for a in state.acts {
            (d, dc) =
                self.layer_backward(n - 1, &d, dc, a, lora.as_deref_mut(), ctx, read_at(n - 1))?;
            self.device.memtrace(|| format!("backward layer {}", n - 1));
        }
        let mut kept_attention = state.kept_attention;
        let mut kept_kv = state.kept_kv;
        for (start, x) in state.boundaries.into_iter().rev() {
            let end = (start + state.segment_size).min(n - 1);
            // Recompute this segment's activations from its boundary; only one segment is live.
            let mut seg = Vec::with_capacity(end - start);
            let mut x = Some(x);
            for l in start..end {
                let input = x.take().expect("each recomputed layer's input");
                let kept = kept_attention.get_mut(l).and_then(Option::take);
                let run = LayerRun {
                    want_output: l + 1 < end,
                    attention: kept,
                    kept_kv: kept_kv.get_mut(l).and_then(Option::take),
                    read: read_at(l),
                    keep_mlp: true,
                };
                let (y, a) = self.layer_forward(l, input, lora.as_deref(), ctx, run)?;
                seg.push(a);
                x = y;
            }
            for (i, a) in seg.into_iter().enumerate().rev() {
                let l = start + i;
                self.device.memtrace(|| format!("recomputed layer {l}"));
                (d, dc) =
                    self.layer_backward(l, &d, dc, a, lora.as_deref_mut(), ctx, read_at(l))?;
                self.device.memtrace(|| format!("backward layer {l}"));
            }
        }
        Ok(d)
    }

    /// Logits `(T, V)` from final hidden states.
    pub fn logits(&self, hidden: &Tensor, out_dtype: DType) -> Result<Tensor> {
        ops::matmul(
            hidden,
            false,
            &*self.weights.head().dense()?,
            true,
            1.0,
            out_dtype,
        )
    }

    /// d(hidden) from d(logits): `dH = dLogits · W_head`.
    pub fn logits_bwd(&self, d_logits: &Tensor) -> Result<Tensor> {
        let dt = self.device.compute_dtype();
        let d = self.compute(d_logits)?;
        ops::matmul(&d, false, &*self.weights.head().dense()?, false, 1.0, dt)
    }
}

/// What `Model::forward` keeps for `Model::backward`.
pub struct ForwardState {
    /// Every layer's activations without segments; the top layer's alone with them.
    acts: Vec<LayerActs>,
    /// With segments: `(first layer, its input)` of each segment below the top layer.
    boundaries: Vec<(usize, Tensor)>,
    /// Per layer, with segments and `keep_attention`: the forward's attention output and lse,
    /// taken by the layer's recomputation.
    kept_attention: Vec<Option<(Tensor, Tensor)>>,
    /// Per layer, with segments: k and v kept from the forward (`ForwardPlan::keep_kv_layers`).
    kept_kv: Vec<Option<(Tensor, Tensor)>>,
    last: Tensor,
    rstd: Tensor,
    segment_size: usize,
    /// The rows the forward's top layer computed (`None`: all).
    read: Option<ReadRows>,
}
