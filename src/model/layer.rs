//! One decoder layer of any family, forward and hand-written backward, from its `LayerSpec`:
//! attention (q/k/v biases and norms, RoPE, softcap, window) and a gated MLP, each pre-normed,
//! with the optional sandwich norms and residual scale. The runner (`runner.rs`) decides what
//! each call keeps and recomputes; this file is the maths.
//!
//! Read `layer_forward` and `layer_backward` side by side: the backward is the forward's op list
//! in reverse. Frozen weights get no gradient; the backward yields d(input) and accumulates the
//! LoRA gradients dA, dB into the adapters. Shapes: T tokens, H hidden, I intermediate,
//! nh/nkv heads of hd dims.

use super::config::Activation;
use super::lora::{stacked_columns, Lora, LoraPair, Target, GROUP_GATE_UP, GROUP_QKV};
use super::runner::{Model, PassCtx};
use super::weights::Weight;
use crate::tensor::{self as ops, AttnMask, AttnShape, DType, RopeTable, Tensor, TensorRef};
use anyhow::Result;
use std::sync::Arc;

/// What a LoRA-carrying projection keeps for its backward: `xa = dropout(x) Aᵀ`, `(T, r)`: a
/// tensor of its own, or columns `cols` of the product its shared-input group computed at once
/// (`stacked_lora_inputs`), which the group's projections share instead of each copying theirs.
pub struct LoraSaved {
    xa: Arc<Tensor>,
    cols: std::ops::Range<usize>,
}

impl LoraSaved {
    fn own(xa: Tensor) -> LoraSaved {
        let cols = 0..xa.rows_cols().1;
        LoraSaved {
            xa: Arc::new(xa),
            cols,
        }
    }
    fn xa(&self) -> ops::Cols<'_> {
        ops::Cols {
            t: &self.xa,
            start: self.cols.start,
            end: self.cols.end,
        }
    }
}

/// What one layer's forward keeps for its backward.
pub struct LayerActs {
    x: Tensor,              // (T, H) layer input
    xn: Tensor,             // (T, H) after the attention norm
    rstd1: Tensor,          // (T)
    q_pre: Option<Tensor>,  // (T*nh, hd) q before its per-head norm (Qwen3, Gemma 3)
    q_rstd: Option<Tensor>, // (T*nh)
    k_pre: Option<Tensor>,  // (T*nkv, hd)
    k_rstd: Option<Tensor>, // (T*nkv)
    v_pre: Option<Tensor>,  // (T*nkv, hd) v before its norm (Gemma 4)
    v_rstd: Option<Tensor>, // (T*nkv)
    /// After RoPE: q (T, nh*hd), k (T, nkv*hd); and v (T, nkv*hd). A KV-sharing layer holds
    /// no k and v (they are its donor's, in `LayerEnv::shared_kv`).
    pub q: Tensor,
    pub k: Option<Tensor>,
    pub v: Option<Tensor>,
    /// The attention output (T, nh*hd) and its lse (nh, T) f32.
    pub attn: Tensor,
    pub lse: Tensor,
    /// First row of the o projection and the MLP (the runner's read rows; 0: every row). The
    /// tensors below hold rows `[from, T)`.
    from: usize,
    /// Sandwich norms: the o projection's output before its norm, and that norm's rstd.
    o_post: Option<(Tensor, Tensor)>,
    x1: Tensor,    // (T - from, H) after the attention residual
    xn2: Tensor,   // (T - from, H) after the MLP norm
    rstd2: Tensor, // (T - from)
    /// The MLP's intermediates; `None` when the MLP runs in token chunks and is recomputed chunk
    /// by chunk in the backward.
    mlp: Option<MlpActs>,
    /// Sandwich norms: the MLP's output before its norm, and that norm's rstd.
    mlp_post: Option<(Tensor, Tensor)>,
    /// The per-layer input branch's intermediates (Gemma 4).
    per_layer: Option<PerLayerActs>,
    lora: [Option<LoraSaved>; 7],
}

/// One layer's q, k and v as its attention reads them (`Model::qkv_forward`), with what their
/// norms' backward needs: q, k and v before their per-head norms, and the norms' rstd.
pub(crate) struct Qkv {
    /// q `(T, nh·hd)` and k `(T, nkv·hd)` rotated; v `(T, nkv·hd)`. No k and v for a KV-sharing
    /// layer.
    pub q: Tensor,
    pub k: Option<Tensor>,
    pub v: Option<Tensor>,
    q_pre: Option<Tensor>,
    q_rstd: Option<Tensor>,
    k_pre: Option<Tensor>,
    k_rstd: Option<Tensor>,
    v_pre: Option<Tensor>,
    v_rstd: Option<Tensor>,
}

/// What the per-layer input branch `h + norm(proj(gelu(gate(h)) · input))` keeps: the gate's
/// output `(T - from, P)`, the layer's input slice for those rows, and the projection's output
/// before its norm with the norm's rstd.
pub(crate) struct PerLayerActs {
    gate: Tensor,
    input: Tensor,
    proj: Tensor,
    rstd: Tensor,
}

/// A KV donor's dK (rotated) and dV summed over its sharing layers, in f32: the sharers' backward
/// adds into it and the donor's backward takes it (`Model::layer_backward`).
pub struct KvGrad {
    pub dk: Tensor,
    pub dv: Tensor,
}

/// What the gated MLP keeps for its backward.
pub struct MlpActs {
    gate: Tensor, // (T, I)
    up: Tensor,   // (T, I)
    /// (T, I) act(gate) * up; None where a recomputation left it unwritten for a backward
    /// that takes it from gate and up (`mlp_grads_fused`).
    act: Option<Tensor>,
    /// LoRA inputs of gate, up, down.
    lora: [Option<LoraSaved>; 3],
}

/// The attention mask and rotary table one layer reads (its kind's, from the runner).
#[derive(Clone, Copy)]
pub struct LayerEnv<'a> {
    pub mask: &'a AttnMask,
    pub rope: &'a RopeTable,
    /// First row of the o projection and the MLP (0: every row; see `runner::ReadRows`).
    pub from: usize,
    /// MLP token chunk (0: all rows at once; see `runner::ForwardPlan`).
    pub mlp_chunk: usize,
    /// A KV-sharing layer's donor k (rotated) and v (normed), from the donor's forward.
    pub shared_kv: Option<(&'a Tensor, &'a Tensor)>,
    /// This layer's per-layer input `(T, P)` (Gemma 4; `Model::per_layer_inputs`).
    pub per_layer_input: Option<&'a Tensor>,
}

/// How one layer's forward runs (`Model::layer_forward`).
pub struct LayerRun<'a> {
    pub env: LayerEnv<'a>,
    /// Compute the layer output (a recomputation of a segment's last layer does not need it,
    /// which spares the MLP's down projection).
    pub want_output: bool,
    /// The layer's attention output and lse kept from the forward (spares the attention kernel).
    pub attention: Option<(Tensor, Tensor)>,
    /// The layer's k (rotated) and v kept from the forward (spares their projections).
    pub kept_kv: Option<(Tensor, Tensor)>,
    /// Keep the MLP intermediates (otherwise the backward recomputes them).
    pub keep_mlp: bool,
}

/// A layer's gated activation `act(gate) * up` as the tensor layer names it.
fn gated(act: Activation) -> ops::GatedAct {
    match act {
        Activation::Silu => ops::GatedAct::Silu,
        Activation::GeluTanh => ops::GatedAct::GeluTanh,
    }
}

/// `s · x`, borrowing `x` when `s` is 1.
fn scaled(x: &Tensor, s: f32) -> Result<TensorRef<'_>> {
    if s == 1.0 {
        return Ok(TensorRef::Borrowed(x));
    }
    let mut y = x.try_clone()?;
    ops::scale(&mut y, s)?;
    Ok(TensorRef::Owned(y))
}

/// Rows `[from, T)` of `x` (borrowed when that is all of it).
fn rows_from(x: &Tensor, from: usize) -> Result<TensorRef<'_>> {
    Ok(if from == 0 {
        TensorRef::Borrowed(x)
    } else {
        TensorRef::Owned(ops::slice_rows(x, from, x.dim(0))?)
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

/// `y = x Wᵀ (+ scale · dropout(x) Aᵀ Bᵀ)` stored in `out_dtype`; `xa`, when given, is
/// `dropout(x) Aᵀ` already computed (by `stacked_lora_inputs`).
///
/// With an adapter, both products accumulate into one f32 sum that is rounded once. A young
/// LoRA term is far below half a bf16 ulp of the base output; rounding the base product first
/// and adding the term after (PEFT's order in bf16, and cuBLASLt's bf16 epilogue, which rounds
/// the product before it adds C: selftest group `gemm_epilogue`) rounds it away, and the forward
/// then sees a fraction of each update (`scripts/numerics_harness.py` on SmolLM2). A projection
/// that feeds the f32 residual stream (o and down, without a sandwich norm) asks for f32 and
/// keeps the sum as it is; the others round it to bf16. `ops::lora_linear_rounded` holds at most
/// `ROUND_ONCE_BYTES` of f32 sum at once, or on a GPU folds the adapter into the base product
/// where that moves fewer bytes (not for a dequantized base, which would be copied again).
/// A weight stored with its adapter's columns (`weights::ExtendedWeight`) folds it with no copy
/// of W, reading `packed`, its shared-input group's input, where given (`group_input`). `bias`
/// is added to y: inside that product's f32 sum where the weight holds it, else to the rounded
/// output.
#[allow(clippy::too_many_arguments)]
pub(crate) fn linear_fwd(
    x: &Tensor,
    w: &Weight,
    lora: Option<&LoraPair>,
    dropout: Option<(f32, u64)>,
    xa: Option<LoraSaved>,
    out_dtype: DType,
    packed: Option<&GroupInput>,
    bias: Option<&Tensor>,
) -> Result<(Tensor, Option<LoraSaved>)> {
    let dt = out_dtype;
    let Some(p) = lora else {
        let mut y = base_product(x, w, dt)?;
        if let Some(b) = bias {
            ops::add_bias(&mut y, b)?;
        }
        return Ok((y, None));
    };
    let saved = match xa {
        Some(xa) => xa,
        None => lora_input(x, p, dropout)?,
    };
    let block = round_once_rows(w.rows_cols().0);
    let extended = match w {
        Weight::Extended(e) if p.b().dtype() == DType::BF16 => Some(e),
        _ => None,
    };
    let mut bias_added = false;
    let mut y = match (extended, packed) {
        // The group's packed input holds this adapter's xa at its columns of the stacked
        // product; the weight holds `scale · B` at the same columns, and its bias where the
        // input holds 1.
        (Some(e), Some(gi)) if gi.x.rows_cols().1 == e.ext.rows_cols().1 => {
            e.hold_adapter(p.b(), p.scale, p.generation(), saved.cols.start)?;
            bias_added = gi.one_at.is_some() && gi.one_at == e.bias_at.map(|c| e.k + c);
            ops::matmul(&gi.x, false, &e.ext, true, 1.0, dt)?
        }
        // `scale · B` in the weight's own columns: only x's rows and xa are copied.
        (Some(e), _) if p.rank <= e.pad() => {
            e.hold_adapter(p.b(), p.scale, p.generation(), 0)?;
            ops::lora_linear_extended(x, &e.ext, saved.xa(), dt, block)?
        }
        // A dense weight, a rank past the adapter columns, or a quantized base: the adapter
        // folds through a copy of W made for the call, or its product is summed in f32 (W
        // read in place, a quantized one dequantized first).
        _ => match w.base() {
            Some(wc) => {
                ops::lora_linear_rounded(x, wc, saved.xa(), p.b(), p.scale, dt, block, true)?
            }
            None => {
                let w = w.dense()?;
                let (wc, xa) = (ops::Cols::all(&w), saved.xa());
                ops::lora_linear_rounded(x, wc, xa, p.b(), p.scale, dt, block, false)?
            }
        },
    };
    if let (Some(b), false) = (bias, bias_added) {
        ops::add_bias(&mut y, b)?;
    }
    Ok((y, Some(saved)))
}

/// The input every projection of a shared-input group reads in one product each:
/// `[x | x Aᵀ of every adapter of the group | 0]`, with 1 in column `one_at` where the group's
/// weights hold their biases (`weights::ExtendedWeight::bias_at`).
pub(crate) struct GroupInput {
    x: Tensor,
    one_at: Option<usize>,
}

/// The group's `GroupInput` (`ops::pack_input`) where `group_layout` admits `members` and the
/// group's stacked product (`stacked_lora_inputs`). `None` otherwise, and where it would take
/// more than `ROUND_ONCE_BYTES` (each projection then packs its input in row blocks).
fn group_input(
    x: &Tensor,
    xa: &[Option<LoraSaved>; 7],
    members: &[&Weight],
) -> Result<Option<GroupInput>> {
    let Some(stack) = xa.iter().flatten().next().map(|s| s.xa.clone()) else {
        return Ok(None);
    };
    match packed_layout(members, stack.rows_cols().1, x.dim(0)) {
        Some((kd, one_at)) if stack.dtype() == DType::BF16 => {
            let x = ops::pack_input(x, ops::Cols::all(&stack), kd, one_at)?;
            Ok(Some(GroupInput { x, one_at }))
        }
        _ => Ok(None),
    }
}

/// The projections of one shared-input group (or one alone) and their targets.
type Members<'a> = Vec<(&'a Weight, Target)>;

impl Model {
    /// Makes every extended weight of the model hold its adapter where the next pass of `t`
    /// tokens will read it (`packed_layout`: at its place in the group's stacked product, or
    /// at 0), in one launch after an optimiser step instead of one
    /// at each weight's first use. `linear_fwd` still checks each weight and rewrites what this
    /// did not foresee (an MLP chunk or row range of another size).
    pub fn hold_adapters(&self, lora: &Lora, t: usize, ctx: &PassCtx) -> Result<()> {
        let mut items = Vec::new();
        for (l, w) in self.weights.layers.iter().enumerate() {
            let groups: [(Option<usize>, Members); 4] = [
                (
                    Some(GROUP_QKV),
                    [
                        (Some(&w.q), Target::Q),
                        (w.k.as_ref(), Target::K),
                        (w.v.as_ref(), Target::V),
                    ]
                    .into_iter()
                    .filter_map(|(w, tg)| w.map(|w| (w, tg)))
                    .collect(),
                ),
                (
                    Some(GROUP_GATE_UP),
                    vec![(&w.gate, Target::Gate), (&w.up, Target::Up)],
                ),
                (None, vec![(&w.o, Target::O)]),
                (None, vec![(&w.down, Target::Down)]),
            ];
            for (group, members) in groups {
                let stacked = group
                    .and_then(|g| lora.stacked(l, g))
                    .filter(|st| ctx.dropout_for(l, st.members[0].0).is_none());
                let weights: Vec<&Weight> = members.iter().map(|&(w, _)| w).collect();
                let packed = stacked.filter(|st| {
                    let width = st.members.iter().map(|&(_, r)| r).sum();
                    packed_layout(&weights, width, t).is_some()
                });
                for (w, tg) in members {
                    let (Weight::Extended(e), Some(p)) = (w, lora.get(l, tg)) else {
                        continue;
                    };
                    if p.b().dtype() != DType::BF16 {
                        continue;
                    }
                    let at = match packed {
                        Some(st) => match stacked_columns(&st.members).find(|&(m, _)| m == tg) {
                            Some((_, cols)) => cols.start,
                            None => continue,
                        },
                        None if p.rank <= e.pad() => 0,
                        None => continue,
                    };
                    items.push((e, p.b(), p.scale, p.generation(), at));
                }
            }
        }
        super::weights::hold_adapters(&items)
    }
}

/// `group_layout` where the packed input of `rows` rows stays within `ROUND_ONCE_BYTES`: the
/// layout a group's forward packs its input in (`group_input`), and so the columns its
/// adapters are held at (`Model::hold_adapters`).
fn packed_layout(members: &[&Weight], width: usize, rows: usize) -> Option<(usize, Option<usize>)> {
    group_layout(members, width).filter(|&(kd, _)| rows * kd * 2 <= ROUND_ONCE_BYTES)
}

/// The width `K + pad` and bias column shared by `members` where all of them are stored with
/// the same adapter columns (`weights::ExtendedWeight`) and those fit a stacked product `width`
/// wide: the layout both `group_input` and `extended_group_width` need. `None` otherwise.
fn group_layout(members: &[&Weight], width: usize) -> Option<(usize, Option<usize>)> {
    let mut layout = None;
    for w in members {
        let Weight::Extended(e) = w else {
            return None;
        };
        let this = (e.ext.rows_cols().1, e.bias_at.map(|c| e.k + c));
        if layout.is_some_and(|l| l != this) || e.pad() < width {
            return None;
        }
        layout = Some(this);
    }
    layout
}

/// `x Wᵀ` into `dt` with no adapter, W read in place (an extended weight's first columns).
fn base_product(x: &Tensor, w: &Weight, dt: DType) -> Result<Tensor> {
    let Weight::Extended(e) = w else {
        return ops::matmul(x, false, &*w.dense()?, true, 1.0, dt);
    };
    let out = w.rows_cols().0;
    let mut y = ops::scratch(&[x.dim(0), out], dt, x.device())?;
    ops::matmul_acc_cols(
        &mut y,
        0..out,
        ops::Cols::all(x),
        false,
        e.base(),
        true,
        1.0,
        0.0,
    )?;
    Ok(y)
}

/// `into + dy W`, or `dy W` alone: a projection's input gradient through its frozen weight,
/// accumulated onto what `into` holds (the LoRA term, other projections of the same input),
/// W read in place (an extended weight's first columns).
fn dx_through(into: Option<Tensor>, dy: &Tensor, w: &Weight) -> Result<Tensor> {
    if let Weight::Extended(e) = w {
        let k = e.k;
        let (mut acc, beta) = match into {
            Some(acc) => (acc, 1.0),
            None => (ops::scratch(&[dy.dim(0), k], dy.dtype(), dy.device())?, 0.0),
        };
        ops::matmul_acc_cols(
            &mut acc,
            0..k,
            ops::Cols::all(dy),
            false,
            e.base(),
            false,
            1.0,
            beta,
        )?;
        return Ok(acc);
    }
    match into {
        Some(mut acc) => {
            ops::matmul_acc(&mut acc, dy, false, &*w.dense()?, false, 1.0, 1.0)?;
            Ok(acc)
        }
        None => ops::matmul(dy, false, &*w.dense()?, false, 1.0, dy.dtype()),
    }
}

/// The largest f32 sum `linear_fwd` holds at once (`ops::lora_linear_rounded`'s row blocks), and
/// the bytes a folded product's operand copies may take.
const ROUND_ONCE_BYTES: usize = 256 << 20;

/// The rows of a projection with `out` outputs whose f32 sum fits `ROUND_ONCE_BYTES` (at least
/// 256): the `block` of `ops::lora_linear_rounded` and `ops::lora_linear_onto`.
fn round_once_rows(out: usize) -> usize {
    (ROUND_ONCE_BYTES / (4 * out.max(1))).max(256)
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
    Ok(LoraSaved::own(xa))
}

/// `x Aᵢᵀ` of every adapter of shared-input group `group` (`lora::SHARED_INPUT`) from one GEMM
/// with the layer's stacked A, by target index, each its columns of that one product; all None
/// when the layer has no stacked A for the group or LoRA dropout is on (each projection then
/// draws its own mask).
pub(crate) fn stacked_lora_inputs(
    x: &Tensor,
    lora: Option<&Lora>,
    l: usize,
    group: usize,
    ctx: &PassCtx,
) -> Result<[Option<LoraSaved>; 7]> {
    let mut out: [Option<LoraSaved>; 7] = Default::default();
    let Some(st) = lora.and_then(|lo| lo.stacked(l, group)) else {
        return Ok(out);
    };
    if ctx.dropout_for(l, st.members[0].0).is_some() {
        return Ok(out);
    }
    let xa = Arc::new(ops::matmul(x, false, &st.a, true, 1.0, x.dtype())?);
    for (t, cols) in stacked_columns(&st.members) {
        out[t.index()] = Some(LoraSaved {
            xa: xa.clone(),
            cols,
        });
    }
    Ok(out)
}

/// The LoRA part of a projection's backward without dropout: accumulates `dB += s · dyᵀ xa` and
/// `dA += dxaᵀ x`, returns `dxa = s · dy B`.
fn lora_bwd(dy: &Tensor, x: &Tensor, p: &mut LoraPair, saved: &LoraSaved) -> Result<Tensor> {
    let dxa = lora_bwd_b(dy, p, saved)?;
    ops::matmul_acc(&mut p.grad_a, &dxa, true, x, false, 1.0, 1.0)?;
    Ok(dxa)
}

/// `lora_bwd` without `dA` (for a caller that takes it elsewhere): accumulates `dB += s · dyᵀ xa`,
/// returns `dxa = s · dy B`.
fn lora_bwd_b(dy: &Tensor, p: &mut LoraPair, saved: &LoraSaved) -> Result<Tensor> {
    grad_b_acc(dy, p, saved)?;
    ops::matmul(dy, false, p.b(), false, p.scale, dy.dtype())
}

/// `dB += s · dyᵀ xa`, xa read where its forward left it.
fn grad_b_acc(dy: &Tensor, p: &mut LoraPair, saved: &LoraSaved) -> Result<()> {
    let n = p.grad_b.rows_cols().1;
    let dy = ops::Cols::all(dy);
    ops::matmul_acc_cols(
        &mut p.grad_b,
        0..n,
        dy,
        true,
        saved.xa(),
        false,
        p.scale,
        1.0,
    )
}

/// `LORAFIT_FUSED_MLP_GRADS=1`: the training step takes the MLP backward of `mlp_grads_fused`.
/// Off by default until its kernels (`kernels/mlp_grads.cu`) have passed the CUDA parity
/// rows (`gated_mul_bwd_lora_grads` in `selftest --device cuda`, group `elementwise`) and the
/// training rows with it on (groups `model`, `train`); those op rows run it whatever this says.
fn fused_mlp_grads_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("LORAFIT_FUSED_MLP_GRADS").is_ok_and(|v| v == "1"))
}

/// Whether layer `l`'s MLP backward sums its three LoRA gradients that read the `(T, I)` tensors
/// inside the activation's backward (`ops::gated_mul_bwd_lora_grads`): on a GPU where
/// `fused_mlp_grads_enabled`, with adapters on gate and up (stacked) and on down, and no dropout
/// on them. Its recomputation then writes no h.
pub(crate) fn mlp_grads_fused(
    l: usize,
    lora: Option<&Lora>,
    ctx: &PassCtx,
    dev: &crate::tensor::Device,
) -> bool {
    let targets = [Target::Gate, Target::Up, Target::Down];
    dev.is_cuda()
        && fused_mlp_grads_enabled()
        && lora.is_some_and(|lo| {
            lo.stacked(l, GROUP_GATE_UP).is_some()
                && targets
                    .iter()
                    .all(|&tg| lo.get(l, tg).is_some() && ctx.dropout_for(l, tg).is_none())
        })
}

/// One projection of a shared-input group in `shared_input_bwd`: its output gradient, weight,
/// target and what its forward saved.
struct MemberBwd<'a> {
    dy: Tensor,
    w: &'a Weight,
    target: Target,
    saved: Option<&'a LoraSaved>,
    /// Its `dB` was already accumulated (inside the MLP activation's backward,
    /// `ops::gated_mul_bwd_lora_grads`).
    grad_b_done: bool,
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
    if let Some(kd) = extended_group_width(&members, x, lo, l, &stacked)? {
        return extended_group_bwd(members, x, lo, l, group, &stacked, kd);
    }
    // Every adapter's dxa = s · dy B is written into its columns of one (T, Σr) matrix, which
    // the dA products read in place and the dx product takes whole: nothing is copied.
    let width = stacked.iter().map(|&(_, r)| r).sum();
    let mut dxa = ops::scratch(&[x.dim(0), width], x.dtype(), x.device())?;
    stacked_adapter_grads(&members, x, lo, l, &stacked, &mut dxa, 0, true)?;
    let st = lo.stacked(l, group).expect("checked above");
    // The rank-r product first, the base GEMMs accumulate onto it (bf16 C). Unlike the forward's
    // sum this is not rounded once: cuBLASLt rounds each base product before it adds C, so a LoRA
    // share of dx below half a bf16 ulp is dropped. Only the lower layers' gradients read that
    // share (numerics harness: grad norms within 0.6% of f32 on SmolLM2 at lr 1e-4).
    let mut dx = ops::matmul(&dxa, false, &st.a, false, 1.0, x.dtype())?;
    drop(dxa);
    for m in members {
        dx = dx_through(Some(dx), &m.dy, m.w)?;
    }
    Ok(dx)
}

/// The width `K + pad` of the group's weights where `extended_group_bwd` applies: every
/// projection of the group carries an adapter of the stacked A and is stored with the group's
/// adapter columns (`weights::ExtendedWeight`), all bf16. Each weight's columns are then made to
/// hold its `scale · B` where its xa sits in the stacked product (the forward's packed input
/// left them so; a forward that packed per projection, in a long pass, left them at 0).
fn extended_group_width(
    members: &[MemberBwd],
    x: &Tensor,
    lo: &Lora,
    l: usize,
    stacked: &[(Target, usize)],
) -> Result<Option<usize>> {
    let width: usize = stacked.iter().map(|&(_, r)| r).sum();
    let same_set = members.len() == stacked.len()
        && members
            .iter()
            .all(|m| stacked.iter().any(|&(tg, _)| tg == m.target));
    if !same_set || x.dtype() != DType::BF16 {
        return Ok(None);
    }
    let weights: Vec<&Weight> = members.iter().map(|m| m.w).collect();
    let Some((kd, _)) = group_layout(&weights, width) else {
        return Ok(None);
    };
    let bf16 = |m: &MemberBwd| {
        let p = lo.get(l, m.target);
        m.dy.dtype() == DType::BF16 && p.is_some_and(|p| p.b().dtype() == DType::BF16)
    };
    if !members.iter().all(bf16) {
        return Ok(None);
    }
    for (tg, cols) in stacked_columns(stacked) {
        let m = members.iter().find(|m| m.target == tg);
        if let (
            Some(MemberBwd {
                w: Weight::Extended(e),
                ..
            }),
            Some(p),
        ) = (m, lo.get(l, tg))
        {
            e.hold_adapter(p.b(), p.scale, p.generation(), cols.start)?;
        }
    }
    Ok(Some(kd))
}

/// `shared_input_bwd` for a group that `extended_group_width` admits: one product a
/// projection, `dy [W | 0 | scale · B | 0]`, summed over the group into one `(T, kd)` matrix,
/// gives the base gradient in its first K columns and every adapter's `dxa = scale · dy B` at
/// its place after them, where the dA products read it. The separate `dy B` product of each
/// adapter (a pass over its dy) is gone. The output gradients are freed before dx is made.
fn extended_group_bwd(
    members: Vec<MemberBwd>,
    x: &Tensor,
    lo: &mut Lora,
    l: usize,
    group: usize,
    stacked: &[(Target, usize)],
    kd: usize,
) -> Result<Tensor> {
    let (t, k) = x.rows_cols();
    let mut both = ops::scratch(&[t, kd], x.dtype(), x.device())?;
    for (i, m) in members.iter().enumerate() {
        let Weight::Extended(e) = m.w else {
            anyhow::bail!("layer {l} {:?}: not stored with adapter columns", m.target);
        };
        let beta = if i == 0 { 0.0 } else { 1.0 };
        let (dy, w) = (ops::Cols::all(&m.dy), ops::Cols::all(&e.ext));
        ops::matmul_acc_cols(&mut both, 0..kd, dy, false, w, false, 1.0, beta)?;
    }
    stacked_adapter_grads(&members, x, lo, l, stacked, &mut both, k, false)?;
    drop(members);
    // dx = the base gradients' sum + dxa A (as in `shared_input_bwd`: bf16 C, not rounded once).
    let st = lo
        .stacked(l, group)
        .ok_or_else(|| anyhow::anyhow!("layer {l}: no stacked A for group {group}"))?;
    // The base gradients' columns are the product's C, read in place, and dx its new output.
    let width = stacked.iter().map(|&(_, r)| r).sum::<usize>();
    let base = ops::Cols {
        t: &both,
        start: 0,
        end: k,
    };
    let dxa = ops::Cols {
        t: &both,
        start: k,
        end: k + width,
    };
    ops::matmul_onto(base, dxa, false, ops::Cols::all(&st.a), false, 1.0, 1.0)
}

/// The LoRA gradients of a stacked group's adapters, in the stacked order: `dB += s · dyᵀ xa`,
/// then (with `write`) `dxa = s · dy B` into its columns of `dxa`, from column `col0` on, and
/// `dA += dxaᵀ x` read in place there (where `extended_group_bwd`'s product already put dxa,
/// `write` is off).
#[allow(clippy::too_many_arguments)]
fn stacked_adapter_grads(
    members: &[MemberBwd],
    x: &Tensor,
    lo: &mut Lora,
    l: usize,
    stacked: &[(Target, usize)],
    dxa: &mut Tensor,
    col0: usize,
    write: bool,
) -> Result<()> {
    let k = x.rows_cols().1;
    let mut c0 = col0;
    for &(tg, r) in stacked {
        let m = members.iter().find(|m| m.target == tg);
        let (Some(m), Some(p)) = (m, lo.get_mut(l, tg)) else {
            anyhow::bail!("layer {l}: stacked adapter {tg:?} has no projection backward");
        };
        let saved = m
            .saved
            .ok_or_else(|| anyhow::anyhow!("layer {l} {tg:?}: no saved LoRA input"))?;
        if !m.grad_b_done {
            grad_b_acc(&m.dy, p, saved)?;
        }
        if write {
            let (dy, b) = (ops::Cols::all(&m.dy), ops::Cols::all(p.b()));
            ops::matmul_acc_cols(dxa, c0..c0 + r, dy, false, b, false, p.scale, 0.0)?;
        }
        let window = ops::Cols {
            t: dxa,
            start: c0,
            end: c0 + r,
        };
        ops::matmul_acc_cols(
            &mut p.grad_a,
            0..k,
            window,
            true,
            ops::Cols::all(x),
            false,
            1.0,
            1.0,
        )?;
        c0 += r;
    }
    Ok(())
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
    let base = |into: Option<Tensor>| dx_through(into, dy, w);
    let (Some(p), Some(saved)) = (lora, saved) else {
        return base(into);
    };
    match dropout {
        Some((prob, seed)) => {
            grad_b_acc(dy, p, saved)?;
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
            // The rank-r product first, the base GEMM accumulates onto it (as in
            // `shared_input_bwd`: bf16 C, not rounded once).
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
    /// The attention geometry of layer `l`.
    pub fn attn_shape(&self, l: usize) -> AttnShape {
        let s = &self.spec;
        let ls = &s.layers[l];
        AttnShape {
            n_heads: s.n_heads,
            n_kv_heads: ls.n_kv_heads,
            head_dim: ls.head_dim,
            scale: ls.attn_scale,
            softcap: ls.attn_softcap,
        }
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
            env,
            want_output,
            attention,
            kept_kv,
            keep_mlp,
        } = run;
        let s = &self.spec;
        let ls = &s.layers[l];
        let w = &self.weights.layers[l];
        let t = x.dim(0);
        let pair = |tg: Target| lora.and_then(|lo| lo.get(l, tg));
        let mut saved: [Option<LoraSaved>; 7] = Default::default();
        let cdt = self.device.compute_dtype();
        let (xn, rstd1) = ops::rms_norm_to(&x, &w.attn_norm, s.rms_eps, cdt)?;
        let shared = env.shared_kv.is_some();
        let Qkv {
            q,
            k,
            v,
            q_pre,
            q_rstd,
            k_pre,
            k_rstd,
            v_pre,
            v_rstd,
        } = self.qkv_forward(l, &xn, lora, ctx, env.rope, shared, kept_kv, &mut saved)?;
        let (k_att, v_att) = match (&k, &v, env.shared_kv) {
            (Some(k), Some(v), _) => (k, v),
            (_, _, Some((k, v))) => (k, v),
            _ => anyhow::bail!("layer {l}: no k and v to attend over"),
        };
        // A recomputation may bring this layer's attention output and lse from the forward.
        let (attn, lse) = match attention {
            Some(kept) => kept,
            None => ops::attention(&q, k_att, v_att, env.mask, self.attn_shape(l))?,
        };
        let from = env.from;
        let (mut o, o_saved) = linear_fwd(
            &*rows_from(&attn, from)?,
            &w.o,
            pair(Target::O),
            ctx.dropout_for(l, Target::O),
            None,
            self.branch_dtype(w.post_attn_norm.is_some(), x.dtype()),
            None,
            None,
        )?;
        saved[Target::O.index()] = o_saved;
        let mut o_post = None;
        if let Some(pn) = &w.post_attn_norm {
            let (y, r) = ops::rms_norm(&o, pn, s.rms_eps)?;
            o_post = Some((std::mem::replace(&mut o, y), r));
        }
        if ls.residual_scale != 1.0 {
            ops::scale(&mut o, ls.residual_scale)?;
        }
        let (x1, xn2, rstd2) =
            ops::add_rms_norm_to(&*rows_from(&x, from)?, &o, &w.mlp_norm, s.rms_eps, cdt)?;
        drop(o);

        let rows = t - from;
        let mlp_dt = self.branch_dtype(w.post_mlp_norm.is_some(), x1.dtype());
        let chunked = env.mlp_chunk > 0 && rows > env.mlp_chunk;
        // The MLP's output is needed for the layer's output, and for its post norm's backward.
        // And for the per-layer input branch, which reads the layer's output before it.
        let need_out = want_output || w.post_mlp_norm.is_some() || w.per_layer.is_some();
        // Whether the MLP's output already holds the residual.
        let mut joined = false;
        let (mlp_out, mlp) = if (chunked || !keep_mlp) && !need_out {
            // The backward recomputes the MLP; nothing reads its output now.
            (None, None)
        } else if chunked {
            // Token chunks: the (T, I) intermediates never exist for all tokens at once.
            let mut out = Tensor::zeros(x1.shape(), mlp_dt, x1.device())?;
            for (a, b) in token_chunks(rows, env.mlp_chunk) {
                let xc = ops::slice_rows(&xn2, a, b)?;
                let (o, _) = self.mlp_forward(l, &xc, lora, ctx, true, mlp_dt, None)?;
                let o = o.expect("the MLP output was asked for");
                ops::scatter_add_rows(&mut out, &(a as u32..b as u32).collect::<Vec<_>>(), &o)?;
            }
            (Some(out), None)
        } else {
            // Without a post norm the layer's output is the residual plus the MLP's: the down
            // projection adds it (`mlp_forward`'s `residual`).
            let residual = w
                .post_mlp_norm
                .is_none()
                .then_some((&x1, ls.residual_scale));
            let (out, m) = self.mlp_forward(l, &xn2, lora, ctx, need_out, mlp_dt, residual)?;
            joined = residual.is_some();
            (out, keep_mlp.then_some(m))
        };
        let mut mlp_post = None;
        let mlp_out = match (mlp_out, &w.post_mlp_norm) {
            (Some(m), Some(pn)) => {
                let (y, r) = ops::rms_norm(&m, pn, s.rms_eps)?;
                mlp_post = Some((m, r));
                Some(y)
            }
            (m, _) => m,
        };
        let mut out = match mlp_out.filter(|_| need_out) {
            Some(h) if joined => Some(h),
            Some(mlp_out) => Some(ops::add(&x1, &mlp_out, ls.residual_scale)?),
            None => None,
        };
        let mut per_layer = None;
        if let Some(h) = &mut out {
            let input = match (&w.per_layer, env.per_layer_input) {
                (Some(_), Some(input)) => Some(rows_from(input, from)?.try_clone()?),
                _ => None,
            };
            per_layer = self.layer_output_tail(l, h, input)?;
        }
        let out = out.filter(|_| want_output);
        let acts = LayerActs {
            x,
            xn,
            rstd1,
            q_pre,
            q_rstd,
            k_pre,
            k_rstd,
            v_pre,
            v_rstd,
            q,
            k,
            v,
            attn,
            lse,
            from,
            o_post,
            x1,
            xn2,
            rstd2,
            mlp,
            mlp_post,
            per_layer,
            lora: saved,
        };
        Ok((out, acts))
    }

    /// Layer `l`'s q, k and v as its attention reads them, from the normed layer input `xn`
    /// `(T, H)`: the projections (LoRA, biases), the per-head q, k and v norms, and RoPE (`rope`,
    /// the layer kind's table) on q and k. A KV-sharing layer (`shared`: it reads its donor's k
    /// and v) projects q alone; k (rotated) and v kept from the forward (`kept_kv`) come back as
    /// they are, with only their LoRA inputs rebuilt. The LoRA inputs go to `saved`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn qkv_forward(
        &self,
        l: usize,
        xn: &Tensor,
        lora: Option<&Lora>,
        ctx: &PassCtx,
        rope: &RopeTable,
        shared: bool,
        kept_kv: Option<(Tensor, Tensor)>,
        saved: &mut [Option<LoraSaved>; 7],
    ) -> Result<Qkv> {
        let s = &self.spec;
        let ls = &s.layers[l];
        let w = &self.weights.layers[l];
        let t = xn.dim(0);
        let pair = |tg: Target| lora.and_then(|lo| lo.get(l, tg));
        let mut xa = stacked_lora_inputs(xn, lora, l, GROUP_QKV, ctx)?;
        let group: Vec<&Weight> = [Some(&w.q), w.k.as_ref(), w.v.as_ref()]
            .into_iter()
            .flatten()
            .collect();
        let packed = group_input(xn, &xa, &group)?;
        anyhow::ensure!(
            kept_kv.is_none() || w.k_norm.is_none(),
            "layer {l}: k and v are kept only without a k norm"
        );
        // k (rotated) and v kept from the forward: only their LoRA inputs are rebuilt.
        let kv_kept = kept_kv.is_some();
        if kv_kept {
            for tg in [Target::K, Target::V] {
                saved[tg.index()] = match (xa[tg.index()].take(), pair(tg)) {
                    (Some(xa), _) => Some(xa),
                    (None, Some(p)) => Some(lora_input(xn, p, ctx.dropout_for(l, tg))?),
                    (None, None) => None,
                };
            }
        }
        let mut lin = |wt: &Weight, tg: Target, bias: Option<&Tensor>| -> Result<Tensor> {
            let pre = xa[tg.index()].take();
            let (y, sv) = linear_fwd(
                xn,
                wt,
                pair(tg),
                ctx.dropout_for(l, tg),
                pre,
                xn.dtype(),
                packed.as_ref(),
                bias,
            )?;
            saved[tg.index()] = sv;
            Ok(y)
        };

        let (nh, nkv, hd) = (s.n_heads, ls.n_kv_heads, ls.head_dim);
        let mut q = lin(&w.q, Target::Q, w.q_bias.as_ref())?;
        // k and v: the donor's (a KV-sharing layer), kept from the forward, or projected here.
        anyhow::ensure!(
            shared != ls.owns_kv(),
            "layer {l}: a KV-sharing layer needs its donor's k and v, and only it takes them"
        );
        let (mut k, mut v) = match kept_kv {
            Some((k, v)) => (Some(k), Some(v)),
            None if shared => (None, None),
            None => {
                let (Some(wk), wv) = (&w.k, &w.v) else {
                    anyhow::bail!("layer {l}: no k projection");
                };
                // k and v take their biases when both have one.
                let (kb, vb) = match (&w.k_bias, &w.v_bias) {
                    (Some(kb), Some(vb)) => (Some(kb), Some(vb)),
                    _ => (None, None),
                };
                match wv {
                    Some(wv) => (Some(lin(wk, Target::K, kb)?), Some(lin(wv, Target::V, vb)?)),
                    // attention_k_eq_v: v is the k projection's output before k's bias and norm.
                    None => {
                        let mut k = lin(wk, Target::K, None)?;
                        let mut v = k.try_clone()?;
                        if let (Some(kb), Some(vb)) = (kb, vb) {
                            ops::add_bias(&mut k, kb)?;
                            ops::add_bias(&mut v, vb)?;
                        }
                        (Some(k), Some(v))
                    }
                }
            }
        };
        // The group's packed input goes before the norms and rotations allocate.
        drop(packed);
        let (mut q_pre, mut q_rstd, mut k_pre, mut k_rstd) = (None, None, None, None);
        if let Some(qn) = &w.q_norm {
            let qp = q.reshape(&[t * nh, hd])?;
            let (qy, qr) = ops::rms_norm(&qp, qn, s.rms_eps)?;
            q = qy.reshape(&[t, nh * hd])?;
            (q_pre, q_rstd) = (Some(qp), Some(qr));
        }
        if let (Some(kn), false) = (&w.k_norm, kv_kept) {
            if let Some(kt) = k.take() {
                let kp = kt.reshape(&[t * nkv, hd])?;
                let (ky, kr) = ops::rms_norm(&kp, kn, s.rms_eps)?;
                k = Some(ky.reshape(&[t, nkv * hd])?);
                (k_pre, k_rstd) = (Some(kp), Some(kr));
            }
        }
        let (mut v_pre, mut v_rstd) = (None, None);
        if let (Some(vn), false) = (&w.v_norm, kv_kept) {
            if let Some(vt) = v.take() {
                let vp = vt.reshape(&[t * nkv, hd])?;
                let (vy, vr) = ops::rms_norm(&vp, vn, s.rms_eps)?;
                v = Some(vy.reshape(&[t, nkv * hd])?);
                (v_pre, v_rstd) = (Some(vp), Some(vr));
            }
        }
        // (Shadowing would keep the unrotated q and k alive to the end of the layer.)
        let q = {
            let rotated = ops::rope(&q, rope, nh, false)?;
            drop(q);
            rotated
        };
        let k = match k {
            Some(k) if !kv_kept => {
                let rotated = ops::rope(&k, rope, nkv, false)?;
                drop(k);
                Some(rotated)
            }
            k => k,
        };
        Ok(Qkv {
            q,
            k,
            v,
            q_pre,
            q_rstd,
            k_pre,
            k_rstd,
            v_pre,
            v_rstd,
        })
    }

    /// The end of layer `l`'s output `h` (after the MLP's residual add): Gemma 4's per-layer
    /// input branch `h + norm(proj(gelu(gate(h)) · input))`, `input` being the layer's per-layer
    /// input for `h`'s rows, then `h` × the layer's `layer_scalar`. Returns the branch's
    /// intermediates for the backward (None without the branch).
    pub(crate) fn layer_output_tail(
        &self,
        l: usize,
        h: &mut Tensor,
        input: Option<Tensor>,
    ) -> Result<Option<PerLayerActs>> {
        let w = &self.weights.layers[l];
        let cdt = self.device.compute_dtype();
        let mut per_layer = None;
        if let Some(br) = &w.per_layer {
            let input = input.ok_or_else(|| anyhow::anyhow!("layer {l}: no per-layer input"))?;
            let gate = ops::matmul(
                &*self.compute(h)?,
                false,
                &*br.gate.dense()?,
                true,
                1.0,
                cdt,
            )?;
            let act = ops::gelu_tanh_mul(&gate, &input)?;
            let proj = ops::matmul(&act, false, &*br.proj.dense()?, true, 1.0, cdt)?;
            drop(act);
            let (normed, rstd) = ops::rms_norm(&proj, &br.norm, self.spec.rms_eps)?;
            ops::add_assign(h, &normed, 1.0)?;
            per_layer = Some(PerLayerActs {
                gate,
                input,
                proj,
                rstd,
            });
        }
        if w.layer_scalar != 1.0 {
            ops::scale(h, w.layer_scalar)?;
        }
        Ok(per_layer)
    }

    /// The dtype of a residual branch's last projection (o, down): the residual stream's own
    /// (f32) where the branch adds straight into it, the compute dtype where a sandwich norm
    /// reads it first (its saved input and its backward stay in the compute dtype).
    pub(crate) fn branch_dtype(&self, post_norm: bool, residual: DType) -> DType {
        if post_norm {
            self.device.compute_dtype()
        } else {
            residual
        }
    }

    /// The gated MLP on normed inputs `xn2` (any token range); its output (in `out_dtype`) only
    /// with `want_output`, and with `residual = (r, s)` that output is `r + s · mlp` (the layer's
    /// output; a plain down weight adds r inside its products, `ops::lora_linear_onto`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mlp_forward(
        &self,
        l: usize,
        xn2: &Tensor,
        lora: Option<&Lora>,
        ctx: &PassCtx,
        want_output: bool,
        out_dtype: DType,
        residual: Option<(&Tensor, f32)>,
    ) -> Result<(Option<Tensor>, MlpActs)> {
        let w = &self.weights.layers[l];
        let pair = |tg: Target| lora.and_then(|lo| lo.get(l, tg));
        let mut xa = stacked_lora_inputs(xn2, lora, l, GROUP_GATE_UP, ctx)?;
        let packed = group_input(xn2, &xa, &[&w.gate, &w.up])?;
        let (gate, sg) = linear_fwd(
            xn2,
            &w.gate,
            pair(Target::Gate),
            ctx.dropout_for(l, Target::Gate),
            xa[Target::Gate.index()].take(),
            xn2.dtype(),
            packed.as_ref(),
            None,
        )?;
        let (up, su) = linear_fwd(
            xn2,
            &w.up,
            pair(Target::Up),
            ctx.dropout_for(l, Target::Up),
            xa[Target::Up.index()].take(),
            xn2.dtype(),
            packed.as_ref(),
            None,
        )?;
        drop(packed);
        let kind = gated(self.spec.layers[l].activation);
        let down_dropout = ctx.dropout_for(l, Target::Down);
        // A recomputation that wants no output does not write h where the backward takes it from
        // gate and up (`mlp_grads_fused`).
        let fused = mlp_grads_fused(l, lora, ctx, xn2.device());
        if let (false, true, Some(p)) = (want_output, fused, pair(Target::Down)) {
            let xa = ops::gated_mul_xa_only(kind, &gate, &up, p.a())?;
            let lora = [sg, su, Some(LoraSaved::own(xa))];
            let acts = MlpActs {
                gate,
                up,
                act: None,
                lora,
            };
            return Ok((None, acts));
        }
        // The down adapter's input comes with the activation (one pass over the (T, I)
        // tensors on a GPU); under dropout it reads a masked copy, made by `lora_input`.
        let (act, down_xa) = match pair(Target::Down) {
            Some(p) if down_dropout.is_none() => {
                let (act, xa) = ops::gated_mul_xa(kind, &gate, &up, p.a())?;
                (act, Some(LoraSaved::own(xa)))
            }
            _ => (ops::gated_mul(kind, &gate, &up)?, None),
        };
        let (out, sd) = if want_output {
            let (y, sd) = match (residual, &w.down, pair(Target::Down), down_xa) {
                // A plain weight's adapter sum (`linear_fwd`'s `lora_linear_rounded`) with the
                // residual added inside its products.
                (Some((res, rs)), Weight::Dense(wd), Some(p), Some(xa))
                    if down_dropout.is_none() && res.dtype() == out_dtype =>
                {
                    let block = round_once_rows(wd.rows_cols().0);
                    let (wc, b) = (ops::Cols::all(wd), p.b());
                    let y = ops::lora_linear_onto(res, rs, &act, wc, xa.xa(), b, p.scale, block)?;
                    (y, Some(xa))
                }
                (residual, _, _, down_xa) => {
                    let (y, sd) = linear_fwd(
                        &act,
                        &w.down,
                        pair(Target::Down),
                        down_dropout,
                        down_xa,
                        out_dtype,
                        None,
                        None,
                    )?;
                    match residual {
                        Some((res, rs)) => (ops::add(res, &y, rs)?, sd),
                        None => (y, sd),
                    }
                }
            };
            (Some(y), sd)
        } else {
            let sd = match down_xa {
                Some(xa) => Some(xa),
                None => pair(Target::Down)
                    .map(|p| lora_input(&act, p, down_dropout))
                    .transpose()?,
            };
            (None, sd)
        };
        // Kept even where the backward would take h from gate and up: the memory planner counts
        // three (T, I) tensors a kept layer (`memory::StepShape::terms`).
        let act = Some(act);
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
        let kind = gated(self.spec.layers[l].activation);
        // On a GPU, with adapters on gate, up (stacked) and down and no dropout: the three LoRA
        // gradients that read the (T, I) tensors (dA_down from h, dB_gate and dB_up from the
        // gradients written over gate and up) are summed inside the activation's backward.
        let fused = mlp_grads_fused(l, lora.as_deref(), ctx, d_out.device());
        if let (true, Some(lo), [Some(sg), Some(su), Some(sd)]) =
            (fused, lora.as_deref_mut(), &saved)
        {
            // Gate's, up's and down's adapters, each borrowed mutably at once.
            let slots = [Target::Gate, Target::Up, Target::Down].map(|t| t.index());
            if let Ok([Some(pg), Some(pu), Some(pd)]) = lo.layers[l].get_disjoint_mut(slots) {
                drop(act);
                let dxa = lora_bwd_b(d_out, pd, sd)?;
                let mut d_base = dx_through(None, d_out, &w.down)?;
                let (a_down, grad_a_down) = pd.a_with_grad();
                let grads = ops::GatedLoraGrads {
                    xa_gate: sg.xa(),
                    scale_gate: pg.scale,
                    grad_b_gate: &mut pg.grad_b,
                    xa_up: su.xa(),
                    scale_up: pu.scale,
                    grad_b_up: &mut pu.grad_b,
                    grad_a_down,
                };
                ops::gated_mul_bwd_lora_grads(
                    kind,
                    &mut d_base,
                    &dxa,
                    a_down,
                    &mut gate,
                    &mut up,
                    grads,
                )?;
                drop((d_base, dxa));
                return self.gate_up_backward(l, gate, up, xn2, &saved, lora, ctx, true);
            }
        }
        // h as the forward made it (made again where that forward expected the fused backward).
        let act = match act {
            Some(act) => act,
            None => ops::gated_mul(kind, &gate, &up)?,
        };
        let d_act = match (
            lora.as_deref_mut()
                .and_then(|lo| lo.get_mut(l, Target::Down)),
            saved[2].as_ref(),
        ) {
            (Some(p), Some(sv)) if down_dropout.is_none() && d_out.device().is_cuda() => {
                // On a GPU the adapter's `dxa A` joins d(act) inside the activation's backward
                // (one pass over the (T, I) tensors fewer); `act` is freed first, as below.
                let dxa = lora_bwd(d_out, &act, p, sv)?;
                drop(act);
                let mut d_base = dx_through(None, d_out, &w.down)?;
                ops::gated_mul_bwd_lora_in_place(
                    kind,
                    &mut d_base,
                    &dxa,
                    p.a(),
                    &mut gate,
                    &mut up,
                )?;
                drop(d_base);
                return self.gate_up_backward(l, gate, up, xn2, &saved, lora, ctx, false);
            }
            (Some(p), Some(sv)) if down_dropout.is_none() => {
                // The LoRA terms are the only reader of `act`: it is freed before the (T, I)
                // gradient is allocated, which lowers the step's peak by one (T, I) tensor.
                let dxa = lora_bwd(d_out, &act, p, sv)?;
                drop(act);
                let d_act = ops::matmul(&dxa, false, p.a(), false, 1.0, d_out.dtype())?;
                dx_through(Some(d_act), d_out, &w.down)?
            }
            (pair, sv) => {
                let d_act = linear_bwd(None, d_out, &act, &w.down, pair, sv, down_dropout)?;
                drop(act);
                d_act
            }
        };
        ops::gated_mul_bwd_in_place(kind, &d_act, &mut gate, &mut up)?;
        drop(d_act);
        self.gate_up_backward(l, gate, up, xn2, &saved, lora, ctx, false)
    }

    /// d(xn2) from d(gate) and d(up), with their LoRA gradients (their `dB` already taken where
    /// `grad_b_done`): the tail of `mlp_backward`.
    #[allow(clippy::too_many_arguments)]
    fn gate_up_backward(
        &self,
        l: usize,
        gate: Tensor,
        up: Tensor,
        xn2: &Tensor,
        saved: &[Option<LoraSaved>; 3],
        lora: Option<&mut Lora>,
        ctx: &PassCtx,
        grad_b_done: bool,
    ) -> Result<Tensor> {
        let w = &self.weights.layers[l];
        let members = vec![
            MemberBwd {
                dy: gate,
                w: &w.gate,
                target: Target::Gate,
                saved: saved[0].as_ref(),
                grad_b_done,
            },
            MemberBwd {
                dy: up,
                w: &w.up,
                target: Target::Up,
                saved: saved[1].as_ref(),
                grad_b_done,
            },
        ];
        shared_input_bwd(members, xn2, lora, l, GROUP_GATE_UP, ctx)
    }
    /// Backward of `layer_forward`: d(layer input) from d(layer output); LoRA grads accumulate.
    /// Consumes the activations, freeing each after its last use. `d_out_c` is d(layer output)
    /// in the compute dtype when the residual stream is wider (None: cast here); the result
    /// carries the same copy of d(layer input) for the layer below. `env` is the one
    /// `layer_forward` ran with: `d_out` then holds rows `[env.from, T)`.
    #[allow(clippy::too_many_arguments)]
    pub fn layer_backward(
        &self,
        l: usize,
        d_out: &Tensor,
        d_out_c: Option<Tensor>,
        mut a: LayerActs,
        mut lora: Option<&mut Lora>,
        ctx: &PassCtx,
        env: LayerEnv,
        kv_grads: &mut [Option<KvGrad>],
    ) -> Result<(Tensor, Option<Tensor>)> {
        let s = &self.spec;
        let ls = &s.layers[l];
        let w = &self.weights.layers[l];
        let (nh, nkv, hd) = (s.n_heads, ls.n_kv_heads, ls.head_dim);
        // Rows of d_out (all T unless the top layer is trimmed to the rows read).
        let t = d_out.dim(0);
        let t_full = a.x.dim(0);
        // out = scalar · (h + norm(proj(gelu(gate(h)) · input))), h the MLP residual's output:
        // d(h) replaces d(out) below.
        let d_h;
        let (d_out, d_out_c) = if w.layer_scalar != 1.0 || a.per_layer.is_some() {
            let mut d = d_out.try_clone()?;
            if w.layer_scalar != 1.0 {
                ops::scale(&mut d, w.layer_scalar)?;
            }
            if let (Some(pa), Some(br)) = (a.per_layer.take(), &w.per_layer) {
                let PerLayerActs {
                    mut gate,
                    mut input,
                    proj,
                    rstd,
                } = pa;
                let d_proj = ops::rms_norm_bwd(&*self.compute(&d)?, &proj, &br.norm, &rstd)?;
                drop(proj);
                let d_act = ops::matmul(
                    &d_proj,
                    false,
                    &*br.proj.dense()?,
                    false,
                    1.0,
                    d_proj.dtype(),
                )?;
                drop(d_proj);
                ops::gelu_tanh_mul_bwd_in_place(&d_act, &mut gate, &mut input)?;
                drop((d_act, input));
                let d_gate_in =
                    ops::matmul(&gate, false, &*br.gate.dense()?, false, 1.0, gate.dtype())?;
                ops::add_assign(&mut d, &d_gate_in, 1.0)?;
            }
            d_h = d;
            (&d_h, None)
        } else {
            (d_out, d_out_c)
        };
        // MLP: out = x1 + s·post(down(act(gate(xn2)) * up(xn2)))
        let d_out_c = match d_out_c {
            Some(c) => TensorRef::Owned(c),
            None => self.compute(d_out)?,
        };
        let d_branch = scaled(&d_out_c, ls.residual_scale)?;
        let d_mlp = match (&a.mlp_post, &w.post_mlp_norm) {
            (Some((m, r)), Some(pn)) => {
                let d = ops::rms_norm_bwd(&d_branch, m, pn, r)?;
                drop(d_branch);
                TensorRef::Owned(d)
            }
            _ => d_branch,
        };
        drop(a.mlp_post);
        let d_xn2 = match a.mlp {
            Some(m) => self.mlp_backward(l, &d_mlp, &a.xn2, m, lora.as_deref_mut(), ctx)?,
            // Recomputed all at once (the forward did not keep it).
            None if env.mlp_chunk == 0 || t <= env.mlp_chunk => {
                let (_, m) =
                    self.mlp_forward(l, &a.xn2, lora.as_deref(), ctx, false, a.xn2.dtype(), None)?;
                self.mlp_backward(l, &d_mlp, &a.xn2, m, lora.as_deref_mut(), ctx)?
            }
            // Recomputed chunk by chunk.
            None => {
                let mut d = Tensor::zeros(a.xn2.shape(), a.xn2.dtype(), a.xn2.device())?;
                for (c0, c1) in token_chunks(t, env.mlp_chunk) {
                    let xc = ops::slice_rows(&a.xn2, c0, c1)?;
                    let (_, m) =
                        self.mlp_forward(l, &xc, lora.as_deref(), ctx, false, xc.dtype(), None)?;
                    let dc = self.mlp_backward(
                        l,
                        &ops::slice_rows(&d_mlp, c0, c1)?,
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
        drop(d_mlp);
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

        // Attention: x1 = x + s·post(o(attention(rope(q), rope(k), v)))
        let d_o = {
            let d_x1_cd = d_x1_c.as_ref().unwrap_or(&d_x1);
            let d_branch = scaled(d_x1_cd, ls.residual_scale)?;
            match (&a.o_post, &w.post_attn_norm) {
                (Some((o, r)), Some(pn)) => {
                    let d = ops::rms_norm_bwd(&*self.compute(&d_branch)?, o, pn, r)?;
                    drop(d_branch);
                    TensorRef::Owned(d)
                }
                _ => d_branch,
            }
        };
        let d_attn = lin_bwd(None, &d_o, &*rows_from(&a.attn, a.from)?, &w.o, Target::O)?;
        drop(d_o);
        drop((d_x1_c, a.o_post));
        // The rows before `a.from` get no gradient from above; they still have one through k, v.
        let d_attn = rows_into_full(d_attn, a.from, t_full)?;
        let d_x1 = rows_into_full(d_x1, a.from, t_full)?;
        let (k_att, v_att) = match (&a.k, &a.v, env.shared_kv) {
            (Some(k), Some(v), _) => (k, v),
            (_, _, Some((k, v))) => (k, v),
            _ => anyhow::bail!("layer {l}: no k and v for the attention backward"),
        };
        let (dq_rot, mut dk_rot, mut dv) = ops::attention_bwd(
            &d_attn,
            &a.q,
            k_att,
            v_att,
            &a.attn,
            &a.lse,
            env.mask,
            self.attn_shape(l),
        )?;
        drop((d_attn, a.k, a.v, a.attn, a.lse));
        let mut dq = ops::rope(&dq_rot, env.rope, nh, true)?;
        drop(dq_rot);
        drop(a.q);
        if let (Some(qn), Some(qp), Some(qr)) = (&w.q_norm, &a.q_pre, &a.q_rstd) {
            let dqp = dq.reshape(&[t_full * nh, hd])?;
            dq = ops::rms_norm_bwd(&dqp, qp, qn, qr)?.reshape(&[t_full, nh * hd])?;
        }
        let q_member = MemberBwd {
            dy: dq,
            w: &w.q,
            target: Target::Q,
            saved: a.lora[Target::Q.index()].as_ref(),
            grad_b_done: false,
        };
        if let Some(donor) = ls.kv_source {
            // A sharer: its dK and dV belong to the donor, whose backward comes later.
            let slot = kv_grads
                .get_mut(donor)
                .ok_or_else(|| anyhow::anyhow!("layer {l}: no gradient slot for donor {donor}"))?;
            match slot {
                Some(g) => {
                    ops::add_assign(&mut g.dk, &dk_rot, 1.0)?;
                    ops::add_assign(&mut g.dv, &dv, 1.0)?;
                }
                None => {
                    *slot = Some(KvGrad {
                        dk: dk_rot.to_dtype(crate::tensor::DType::F32)?,
                        dv: dv.to_dtype(crate::tensor::DType::F32)?,
                    })
                }
            }
            drop((dk_rot, dv));
            let d_xn = shared_input_bwd(vec![q_member], &a.xn, lora, l, GROUP_QKV, ctx)?;
            return ops::rms_norm_bwd_add_copy(&d_xn, &a.x, &w.attn_norm, &a.rstd1, &d_x1, cdt);
        }
        // A donor: its sharers' dK and dV join its own.
        if let Some(g) = kv_grads.get_mut(l).and_then(Option::take) {
            let mut dk = g.dk;
            ops::add_assign(&mut dk, &dk_rot, 1.0)?;
            dk_rot = dk.to_dtype(dk_rot.dtype())?;
            let mut dvs = g.dv;
            ops::add_assign(&mut dvs, &dv, 1.0)?;
            dv = dvs.to_dtype(dv.dtype())?;
        }
        let mut dk = ops::rope(&dk_rot, env.rope, nkv, true)?;
        drop(dk_rot);
        if let (Some(kn), Some(kp), Some(kr)) = (&w.k_norm, &a.k_pre, &a.k_rstd) {
            let dkp = dk.reshape(&[t_full * nkv, hd])?;
            dk = ops::rms_norm_bwd(&dkp, kp, kn, kr)?.reshape(&[t_full, nkv * hd])?;
        }
        if let (Some(vn), Some(vp), Some(vr)) = (&w.v_norm, &a.v_pre, &a.v_rstd) {
            let dvp = dv.reshape(&[t_full * nkv, hd])?;
            dv = ops::rms_norm_bwd(&dvp, vp, vn, vr)?.reshape(&[t_full, nkv * hd])?;
        }
        let (Some(wk), wv) = (&w.k, &w.v) else {
            anyhow::bail!("layer {l}: no k projection");
        };
        let mut members = vec![q_member];
        match wv {
            Some(wv) => {
                members.push(MemberBwd {
                    dy: dk,
                    w: wk,
                    target: Target::K,
                    saved: a.lora[Target::K.index()].as_ref(),
                    grad_b_done: false,
                });
                members.push(MemberBwd {
                    dy: dv,
                    w: wv,
                    target: Target::V,
                    saved: a.lora[Target::V.index()].as_ref(),
                    grad_b_done: false,
                });
            }
            // attention_k_eq_v: v was the k projection's output.
            None => {
                ops::add_assign(&mut dk, &dv, 1.0)?;
                drop(dv);
                members.push(MemberBwd {
                    dy: dk,
                    w: wk,
                    target: Target::K,
                    saved: a.lora[Target::K.index()].as_ref(),
                    grad_b_done: false,
                });
            }
        }
        let d_xn = shared_input_bwd(members, &a.xn, lora, l, GROUP_QKV, ctx)?;
        ops::rms_norm_bwd_add_copy(&d_xn, &a.x, &w.attn_norm, &a.rstd1, &d_x1, cdt)
    }
}
