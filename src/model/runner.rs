//! The runner: a loaded model, and the whole-model passes over its list of layers with the memory
//! machinery every family shares. Segments (keep every s-th layer boundary, recompute a segment
//! at a time in the backward, or layer by layer), boundaries offloaded to host memory, kept
//! attention outputs, kept k/v, the MLP chunk size, the top layer trimmed to the rows the head
//! reads, and the per-kind masks and rotary tables (one mask per distinct sliding window, one
//! table per `RopeSpec`) built once per pass from the pass's base mask, which carries the
//! prefix-shared layout. The maths of one layer is `layer.rs`.

use super::config::ModelSpec;
use super::layer::{KvGrad, LayerActs, LayerEnv, LayerRun};
use super::lora::{Lora, Target};
use super::weights::ModelWeights;
use crate::tensor::{
    self as ops, AttnMask, DType, Device, Offloaded, Prefetched, RopeTable, Tensor, TensorRef,
};
use anyhow::Result;

/// Per-pass context shared by every layer: the pass's mask (its layout: causal or
/// prefix-shared; each layer applies its own window), the main rotary table for its positions
/// (`Model::rope_table`), and LoRA dropout.
pub struct PassCtx<'a> {
    pub mask: &'a AttnMask,
    pub rope: &'a RopeTable,
    /// LoRA-input dropout `(p, step seed)`; the mask is keyed by (step seed, layer, target) so a
    /// recomputation replays it.
    pub dropout: Option<(f32, u64)>,
}

impl PassCtx<'_> {
    pub(crate) fn dropout_for(&self, layer: usize, t: Target) -> Option<(f32, u64)> {
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

/// A pass's masks and rotary tables per layer kind, and the top layer's read rows: built once by
/// the forward and kept in `ForwardState` for the backward. A kind that is the pass's own mask
/// or main table (`None`) is read from the `PassCtx`.
struct Kinds {
    masks: Vec<Option<AttnMask>>,
    /// Per layer: index into `masks`.
    mask_of: Vec<usize>,
    /// Tables `1..` of `spec.ropes` (table 0 is the pass's).
    ropes: Vec<RopeTable>,
    read: Option<ReadRows>,
    mlp_chunk: usize,
    /// Per layer, Gemma 4's per-layer inputs `(T, P)` (`Model::per_layer_inputs`); empty
    /// without them.
    per_layer: Vec<Tensor>,
}

/// Per layer: a KV donor's rotated k and normed v from the forward, which its sharers read in the
/// forward and in any recomputation; `None` for the other layers.
type DonorKv = Vec<Option<(Tensor, Tensor)>>;

impl Kinds {
    fn env<'a>(
        &'a self,
        ctx: &'a PassCtx,
        model: &Model,
        l: usize,
        donors: &'a DonorKv,
    ) -> LayerEnv<'a> {
        let top = l + 1 == model.spec.n_layers;
        let rope = match model.spec.layers[l].rope {
            0 => ctx.rope,
            k => &self.ropes[k - 1],
        };
        let (mask, from) = match self.read.as_ref().filter(|_| top) {
            Some(r) => (&r.mask, r.from),
            None => (self.masks[self.mask_of[l]].as_ref().unwrap_or(ctx.mask), 0),
        };
        let shared_kv = model.spec.layers[l]
            .kv_source
            .and_then(|d| donors.get(d))
            .and_then(Option::as_ref)
            .map(|(k, v)| (k, v));
        LayerEnv {
            mask,
            rope,
            from,
            mlp_chunk: self.mlp_chunk,
            shared_kv,
            per_layer_input: self.per_layer.get(l),
        }
    }
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
    /// Run the MLP in token chunks of this size (0: all tokens at once); the backward recomputes
    /// each chunk's intermediates, trading one extra gate/up projection for (T, I) memory.
    pub mlp_chunk: usize,
    /// With segments: hold the layer boundaries in host memory (`tensor::offload`), each copied
    /// out while the next segment runs and brought back while the segment above it is
    /// recomputed, so at most two are on the device at a time; kept attention outputs and k/v
    /// go with them (`KeptPairs`).
    pub offload: bool,
    /// With segments: recompute each segment twice in the backward, first keeping only every
    /// layer's input (f32, `T·hidden` values each), then each layer alone from its input just
    /// before its backward, so that one layer's activations are live at a time. Segment size s
    /// then costs s layer inputs and one layer's activations, for one more forward of the
    /// segment's layers.
    pub nested: bool,
    /// With `offload`: the highest this many layers below the top keep their boundaries and kept
    /// tensors on the device. The backward reaches them first, so keeping them spares their
    /// copies out and back where the device has room (the forward's copies out can fill the
    /// host link).
    pub resident_layers: usize,
    /// With segments: the highest this many layers below the top keep all their activations
    /// from the forward, as the top one does, and are not recomputed; the segments lie below
    /// them. Where the device has room past the kept attention and k/v, each such layer spares
    /// its share of the recomputation (about a layer's forward).
    pub full_layers: usize,
}

/// A loaded model: spec, frozen weights, and its device.
pub struct Model {
    pub spec: ModelSpec,
    pub weights: ModelWeights,
    pub device: Device,
    /// The main rotary table's inverse frequencies (for sequences within the original context,
    /// where LongRoPE differs).
    pub inv_freq: Vec<f32>,
    /// Dtype of the residual stream and its gradient between layers: f32 on every device, so
    /// that the sums of many bf16 sublayer outputs do not round at each layer (projections and
    /// attention still read the compute dtype).
    pub residual_dtype: DType,
}

impl Model {
    /// The model of `spec` with `weights` on `device`. On a GPU the adapter-carrying
    /// projections are stored with room for their adapter's columns where that pays
    /// (`ModelWeights::extend_projections`).
    pub fn new(spec: ModelSpec, mut weights: ModelWeights, device: Device) -> Model {
        if device.is_cuda() {
            weights.extend_projections();
        }
        let inv_freq = spec.inv_freq();
        Model {
            spec,
            weights,
            device,
            inv_freq,
            residual_dtype: DType::F32,
        }
    }

    /// The attention mask of a plain causal sequence (each layer applies its own window).
    pub fn causal_mask(&self, t: usize) -> AttnMask {
        AttnMask::causal(t)
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

    /// The main rotary table (`spec.ropes[0]`) at `positions`.
    pub fn rope_table(&self, positions: &[i32]) -> Result<RopeTable> {
        self.rope_table_of(0, positions)
    }

    /// The main rotary table at `positions` of a pass whose example reaches `max_pos` (LongRoPE
    /// picks its factors by the example's largest position, over all its sequences).
    pub fn rope_table_at(&self, positions: &[i32], max_pos: i32) -> Result<RopeTable> {
        self.rope_table_with(0, positions, max_pos)
    }

    /// Rotary table `kind` at `positions` (LongRoPE picks its factors by the largest position).
    pub fn rope_table_of(&self, kind: usize, positions: &[i32]) -> Result<RopeTable> {
        let max_pos = positions.iter().copied().max().unwrap_or(0);
        self.rope_table_with(kind, positions, max_pos)
    }

    fn rope_table_with(&self, kind: usize, positions: &[i32], max_pos: i32) -> Result<RopeTable> {
        let r = &self.spec.ropes[kind];
        let max_pos = max_pos.max(0) as usize;
        RopeTable::scaled(
            positions,
            &r.inv_freq(max_pos),
            r.attention_factor(),
            &self.device,
        )
    }

    /// The pass's masks and tables per layer kind; `read_from` trims the top layer.
    fn kinds(&self, ctx: &PassCtx, read_from: usize, mlp_chunk: usize) -> Result<Kinds> {
        let mut windows: Vec<Option<u32>> = Vec::new();
        let mut mask_of = Vec::with_capacity(self.spec.n_layers);
        for ls in &self.spec.layers {
            let i = match windows.iter().position(|w| *w == ls.window) {
                Some(i) => i,
                None => {
                    windows.push(ls.window);
                    windows.len() - 1
                }
            };
            mask_of.push(i);
        }
        let masks: Vec<Option<AttnMask>> = windows
            .iter()
            .map(|&w| (ctx.mask.window != w).then(|| ctx.mask.clone().with_window(w)))
            .collect();
        let ropes = (1..self.spec.ropes.len())
            .map(|kind| self.rope_table_of(kind, &ctx.mask.positions))
            .collect::<Result<_>>()?;
        let top = self.spec.n_layers - 1;
        let read = ReadRows::new(masks[mask_of[top]].as_ref().unwrap_or(ctx.mask), read_from);
        Ok(Kinds {
            masks,
            mask_of,
            ropes,
            read,
            mlp_chunk,
            per_layer: Vec::new(),
        })
    }

    /// Gemma 4's per-layer inputs of one pass, per layer `(T, P)`: the per-layer token table's
    /// rows × √P plus the RMS-normed projection of the scaled embeddings `x` × hidden^-½, the sum
    /// × 2^-½. Constants of the pass (no LoRA reaches them): computed once by the forward.
    pub fn per_layer_inputs(&self, ids: &[u32], x: &Tensor) -> Result<Vec<Tensor>> {
        let (Some(pl), p) = (&self.weights.per_layer_inputs, self.spec.per_layer_input) else {
            return Ok(Vec::new());
        };
        let cdt = self.device.compute_dtype();
        let t = ids.len();
        let n = self.spec.n_layers;
        let mut tokens = ops::embedding(&*pl.embed.dense()?, ids)?;
        // transformers scales in the table's dtype (√256 = 16 is exact in bf16).
        ops::scale(&mut tokens, (p as f32).sqrt())?;
        let proj = ops::matmul(
            &*self.compute(x)?,
            false,
            &*pl.projection.dense()?,
            true,
            1.0 / (self.spec.hidden as f32).sqrt(),
            cdt,
        )?;
        let (normed, _) = ops::rms_norm(&proj.reshape(&[t * n, p])?, &pl.norm, self.spec.rms_eps)?;
        let mut sum = normed.reshape(&[t, n * p])?;
        ops::add_assign(&mut sum, &tokens, 1.0)?;
        ops::scale(&mut sum, std::f32::consts::FRAC_1_SQRT_2)?;
        (0..n)
            .map(|l| ops::slice_cols(&sum, l * p, (l + 1) * p))
            .collect()
    }

    /// `t` in the compute dtype (borrowed when it already is).
    pub(crate) fn compute<'a>(&self, t: &'a Tensor) -> Result<TensorRef<'a>> {
        let dt = self.device.compute_dtype();
        Ok(if t.dtype() == dt {
            TensorRef::Borrowed(t)
        } else {
            TensorRef::Owned(t.to_dtype(dt)?)
        })
    }

    /// Token embeddings `(T, H)` in the compute dtype (before the family's embedding scale).
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        ops::embedding(&*self.weights.embed.dense()?, ids)
    }

    /// The factor on the embeddings as this device applies it (`spec.embed_scale`, rounded to
    /// the compute dtype where the family asks).
    pub(crate) fn embed_scale(&self) -> Option<f32> {
        let s = self.spec.embed_scale?;
        Some(
            if self.spec.embed_scale_in_weight_dtype && self.device.compute_dtype() == DType::BF16 {
                half::bf16::from_f32(s).to_f32()
            } else {
                s
            },
        )
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

    /// Whether layer `l`'s k and v can be kept from the forward for its backward: not the top
    /// layer's (its backward follows at once), not a layer that borrows another's, and not one
    /// with k/v norms (their backward needs the inputs of the norm, which are recomputed).
    pub fn can_keep_kv(&self, l: usize) -> bool {
        l + 1 < self.spec.n_layers
            && self.spec.layers[l].owns_kv()
            && self.weights.layers[l].k_norm.is_none()
            && self.weights.layers[l].v_norm.is_none()
    }

    /// How many of the first `n` layers keep their k/v under `keep_kv_layers = n`.
    pub fn kv_layers_kept(&self, n: usize) -> usize {
        (0..n.min(self.spec.n_layers))
            .filter(|&l| self.can_keep_kv(l))
            .count()
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
            mlp_chunk,
            offload,
            nested,
            resident_layers,
            full_layers,
        } = plan;
        let keep_kv = |l: usize| segment_size > 0 && l < keep_kv_layers && self.can_keep_kv(l);
        // With segments, the layers from here up keep their activations (`full_layers`).
        let full_from = self.spec.n_layers - 1 - full_layers.min(self.spec.n_layers - 1);
        if let (Some(lo), true) = (lora, self.device.is_cuda()) {
            // After an optimiser step: every weight's adapter columns in one launch.
            self.hold_adapters(lo, ids.len(), ctx)?;
        }
        let mut kinds = self.kinds(ctx, read_from, mlp_chunk)?;
        let donor_layers = self.spec.kv_donors();
        let mut donor_kv: DonorKv = (0..self.spec.n_layers).map(|_| None).collect();
        let mut kept_kv = KeptPairs::default();
        let n = self.spec.n_layers;
        let mut x = self.embed(ids)?;
        if x.dtype() != self.residual_dtype {
            x = x.to_dtype(self.residual_dtype)?;
        }
        if let Some(s) = self.embed_scale() {
            ops::scale(&mut x, s)?;
        }
        kinds.per_layer = self.per_layer_inputs(ids, &x)?;
        let mut acts = Vec::new();
        let mut boundaries = Vec::new();
        let mut kept_attention = KeptPairs::default();
        for l in 0..n {
            let offload_l = offload && l + 1 + resident_layers < n;
            // With segments, the top layer keeps its activations from the forward: the backward
            // starts there, so a recomputation would rebuild them at once, and they are live at
            // the step's peak either way. So do the `full_layers` below it.
            let top = l >= full_from;
            if offload {
                // The kept tensors of two layers down have had a layer's time to reach the host.
                kept_attention.settle_below(l.saturating_sub(1))?;
                kept_kv.settle_below(l.saturating_sub(1))?;
            }
            if segment_size > 0 && l % segment_size == 0 && !top {
                let b = x.try_clone()?;
                // The previous boundary's copy has had a segment's time: its device copy goes.
                if let Some((_, Boundary::Host(prev))) = boundaries.last_mut() {
                    prev.settle()?;
                }
                let b = if offload_l {
                    Boundary::Host(b.offload()?)
                } else {
                    Boundary::Device(b)
                };
                boundaries.push((l, b));
            }
            let run = LayerRun {
                env: kinds.env(ctx, self, l, &donor_kv),
                want_output: true,
                attention: None,
                kept_kv: None,
                keep_mlp: segment_size == 0 || keep_top_mlp,
            };
            let (y, a) = self.layer_forward(l, x, lora, ctx, run)?;
            if donor_layers.contains(&l) {
                let (Some(k), Some(v)) = (&a.k, &a.v) else {
                    anyhow::bail!("layer {l}: a KV donor without k and v");
                };
                donor_kv[l] = Some((k.try_clone()?, v.try_clone()?));
            }
            if segment_size == 0 || top {
                acts.push(a);
            } else {
                let kv = match (keep_kv(l), a.k, a.v) {
                    (true, Some(k), Some(v)) => Some((k, v)),
                    _ => None,
                };
                kept_kv.push(kv, offload_l)?;
                kept_attention.push(keep_attention.then_some((a.attn, a.lse)), offload_l)?;
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
                nested,
                kinds,
                donor_kv,
                full_from,
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
        let kinds = state.kinds;
        let donor_kv = state.donor_kv;
        // Per donor: its sharers' dK and dV, summed as their backwards run (top down, so every
        // sharer's is in before the donor's own backward takes it).
        let mut kv_grads: Vec<Option<KvGrad>> = (0..self.spec.n_layers).map(|_| None).collect();
        let mut d = ops::rms_norm_bwd(&d_hidden, &state.last, &self.weights.norm, &state.rstd)?;
        drop(d_hidden);
        // The compute-dtype copy of d, where the residual stream is wider: written with it by
        // each layer's last kernel, for the next layer's first projection.
        let mut dc = None;
        drop(state.last);
        if state.segment_size == 0 {
            for (l, a) in state.acts.into_iter().enumerate().rev() {
                (d, dc) = self.layer_backward(
                    l,
                    &d,
                    dc,
                    a,
                    lora.as_deref_mut(),
                    ctx,
                    kinds.env(ctx, self, l, &donor_kv),
                    &mut kv_grads,
                )?;
            }
            return self.embed_bwd(d);
        }
        // With segments `acts` holds the layers' from `full_from` up, kept from the forward.
        let full_from = state.full_from;
        for (i, a) in state.acts.into_iter().enumerate().rev() {
            let l = full_from + i;
            (d, dc) = self.layer_backward(
                l,
                &d,
                dc,
                a,
                lora.as_deref_mut(),
                ctx,
                kinds.env(ctx, self, l, &donor_kv),
                &mut kv_grads,
            )?;
            self.device.memtrace(|| format!("backward layer {l}"));
        }
        let mut kept_attention = state.kept_attention;
        let mut kept_kv = state.kept_kv;
        let mut boundaries = state.boundaries;
        // The next boundary down, on its way back from the host while this segment runs.
        let mut coming: Option<Prefetched> = None;
        while let Some((start, b)) = boundaries.pop() {
            let end = (start + state.segment_size).min(full_from);
            let x = match b {
                Boundary::Device(x) => x,
                Boundary::Host(h) => match coming.take() {
                    Some(p) => p.wait()?,
                    // The top segment's boundary: its device copy may not have been let go.
                    None => h.into_device()?,
                },
            };
            kept_attention.ready(start..end)?;
            kept_kv.ready(start..end)?;
            // The segment below comes back from the host while this one runs.
            if let Some((below, Boundary::Host(h))) = boundaries.last_mut() {
                h.settle()?;
                coming = Some(h.prefetch()?);
                kept_attention.prefetch(*below..start)?;
                kept_kv.prefetch(*below..start)?;
            }
            // This segment recomputed from its boundary: every layer's activations at once, or
            // (nested) every layer's input, each layer's activations made just before its
            // backward. Only one segment is live.
            let recomputed: Vec<Recomputed> = if state.nested {
                self.segment_inputs(
                    x,
                    start..end,
                    lora.as_deref(),
                    ctx,
                    &kinds,
                    &donor_kv,
                    &kept_attention,
                    &kept_kv,
                )?
                .into_iter()
                .map(Recomputed::Input)
                .collect()
            } else {
                let mut seg = Vec::with_capacity(end - start);
                let mut x = Some(x);
                for l in start..end {
                    let input = x.take().expect("each recomputed layer's input");
                    let run = LayerRun {
                        env: kinds.env(ctx, self, l, &donor_kv),
                        want_output: l + 1 < end,
                        attention: kept_attention.take(l),
                        kept_kv: kept_kv.take(l),
                        keep_mlp: true,
                    };
                    let (y, a) = self.layer_forward(l, input, lora.as_deref(), ctx, run)?;
                    seg.push(Recomputed::Acts(Box::new(a)));
                    x = y;
                }
                seg
            };
            for (i, r) in recomputed.into_iter().enumerate().rev() {
                let l = start + i;
                let a = match r {
                    Recomputed::Acts(a) => *a,
                    Recomputed::Input(input) => {
                        let run = LayerRun {
                            env: kinds.env(ctx, self, l, &donor_kv),
                            want_output: false,
                            attention: kept_attention.take(l),
                            kept_kv: kept_kv.take(l),
                            keep_mlp: true,
                        };
                        self.layer_forward(l, input, lora.as_deref(), ctx, run)?.1
                    }
                };
                self.device.memtrace(|| format!("recomputed layer {l}"));
                (d, dc) = self.layer_backward(
                    l,
                    &d,
                    dc,
                    a,
                    lora.as_deref_mut(),
                    ctx,
                    kinds.env(ctx, self, l, &donor_kv),
                    &mut kv_grads,
                )?;
                self.device.memtrace(|| format!("backward layer {l}"));
            }
        }
        self.embed_bwd(d)
    }

    /// The inputs of `layers` recomputed from the first one's, `x`, keeping nothing else (each
    /// layer's activations are dropped as it finishes; kept attention outputs and k/v are read
    /// through copies, left in place for the layer's own recomputation).
    #[allow(clippy::too_many_arguments)]
    fn segment_inputs(
        &self,
        x: Tensor,
        layers: std::ops::Range<usize>,
        lora: Option<&Lora>,
        ctx: &PassCtx,
        kinds: &Kinds,
        donor_kv: &DonorKv,
        kept_attention: &KeptPairs,
        kept_kv: &KeptPairs,
    ) -> Result<Vec<Tensor>> {
        let mut inputs = Vec::with_capacity(layers.len());
        let mut x = x;
        for l in layers.clone() {
            if l + 1 == layers.end {
                inputs.push(x);
                break;
            }
            let run = LayerRun {
                env: kinds.env(ctx, self, l, donor_kv),
                want_output: true,
                attention: kept_attention.copy(l)?,
                kept_kv: kept_kv.copy(l)?,
                keep_mlp: false,
            };
            let input = x.try_clone()?;
            let (y, _) = self.layer_forward(l, x, lora, ctx, run)?;
            inputs.push(input);
            x = y.expect("the layer output was asked for");
        }
        Ok(inputs)
    }

    /// d(embeddings) from d(scaled embeddings).
    fn embed_bwd(&self, mut d: Tensor) -> Result<Tensor> {
        if let Some(s) = self.embed_scale() {
            ops::scale(&mut d, s)?;
        }
        Ok(d)
    }

    /// The head's product `h Wᵀ` `(T, V)`, before any final softcap.
    pub fn raw_logits(&self, hidden: &Tensor, out_dtype: DType) -> Result<Tensor> {
        ops::matmul(
            hidden,
            false,
            &*self.weights.head().dense()?,
            true,
            1.0,
            out_dtype,
        )
    }

    /// d(hidden) from d(raw logits): `dH = dZ · W_head`.
    pub fn raw_logits_bwd(&self, d_raw: &Tensor) -> Result<Tensor> {
        let dt = self.device.compute_dtype();
        let d = self.compute(d_raw)?;
        ops::matmul(&d, false, &*self.weights.head().dense()?, false, 1.0, dt)
    }

    /// Logits `(T, V)` from final hidden states (softcapped where the family caps them).
    pub fn logits(&self, hidden: &Tensor, out_dtype: DType) -> Result<Tensor> {
        let mut z = self.raw_logits(hidden, out_dtype)?;
        if let Some(c) = self.spec.final_logit_softcap {
            ops::softcap(&mut z, c)?;
        }
        Ok(z)
    }

    /// d(hidden) from d(logits): `dH = dLogits · W_head`. For a model with a final softcap use
    /// `logits_bwd_capped`, which needs the logits.
    pub fn logits_bwd(&self, d_logits: &Tensor) -> Result<Tensor> {
        anyhow::ensure!(
            self.spec.final_logit_softcap.is_none(),
            "logits_bwd: this model softcaps its logits; use logits_bwd_capped"
        );
        self.raw_logits_bwd(d_logits)
    }

    /// d(hidden) from d(logits) and the (softcapped) logits `logits` returned: the softcap's
    /// derivative `1 − (z/c)²` is applied on the host (tests and tools; training goes through the
    /// head, `train::head`, which never holds all logits).
    pub fn logits_bwd_capped(&self, d_logits: &Tensor, logits: &Tensor) -> Result<Tensor> {
        let Some(c) = self.spec.final_logit_softcap else {
            return self.logits_bwd(d_logits);
        };
        let z = logits.to_vec()?;
        let d: Vec<f32> = d_logits
            .to_vec()?
            .iter()
            .zip(&z)
            .map(|(d, z)| d * (1.0 - (z / c) * (z / c)))
            .collect();
        let d = Tensor::from_f32(&d, d_logits.shape(), DType::F32, &self.device)?;
        self.raw_logits_bwd(&d)
    }
}

/// What `Model::forward` keeps for `Model::backward`.
pub struct ForwardState {
    /// Every layer's activations without segments; with them, those of the layers from
    /// `full_from` up.
    acts: Vec<LayerActs>,
    /// With segments: `(first layer, its input)` of each segment below the top layer.
    boundaries: Vec<(usize, Boundary)>,
    /// Per layer, with segments and `keep_attention`: the forward's attention output and lse,
    /// taken by the layer's recomputation.
    kept_attention: KeptPairs,
    /// Per layer, with segments: k and v kept from the forward (`ForwardPlan::keep_kv_layers`).
    kept_kv: KeptPairs,
    last: Tensor,
    rstd: Tensor,
    segment_size: usize,
    /// Recompute each segment layer by layer (`ForwardPlan::nested`).
    nested: bool,
    /// The forward's masks and tables per layer kind, its read rows and MLP chunk.
    kinds: Kinds,
    /// The KV donors' k and v (`DonorKv`).
    donor_kv: DonorKv,
    /// With segments: the lowest layer whose activations `acts` holds (`ForwardPlan::full_layers`).
    full_from: usize,
}

/// One layer of a segment being recomputed: its activations, or (`ForwardPlan::nested`) its
/// input, from which they are made just before its backward.
enum Recomputed {
    Acts(Box<LayerActs>),
    Input(Tensor),
}

/// A segment's input, on the device or offloaded to host memory (`ForwardPlan::offload`).
enum Boundary {
    Device(Tensor),
    Host(Offloaded),
}

/// Per layer below the top, with segments: a pair of tensors kept from the forward for the
/// layer's recomputation (its attention output and lse, or its k and v). With
/// `ForwardPlan::offload` they go to host memory as they are made and come back with their
/// segment's boundary, so that the device holds about three layers' pairs in the forward and two
/// segments' in the backward.
#[derive(Default)]
struct KeptPairs {
    pairs: Vec<Option<Kept>>,
    /// Layers below this have been settled (`settle_below`).
    settled: usize,
}

/// One layer's kept pair, where it is.
enum Kept {
    Device(Tensor, Tensor),
    Host(Offloaded, Offloaded),
    Coming(Prefetched, Prefetched),
}

impl KeptPairs {
    /// Records the next layer's pair (layers come in order), copied to host memory with
    /// `offload`.
    fn push(&mut self, pair: Option<(Tensor, Tensor)>, offload: bool) -> Result<()> {
        self.pairs.push(match pair {
            None => None,
            Some((a, b)) if offload => Some(Kept::Host(a.offload()?, b.offload()?)),
            Some((a, b)) => Some(Kept::Device(a, b)),
        });
        Ok(())
    }

    /// Lets the device copies of the pairs of layers below `l` go (their copies to host have
    /// had time to run).
    fn settle_below(&mut self, l: usize) -> Result<()> {
        while self.settled < l.min(self.pairs.len()) {
            if let Some(Kept::Host(a, b)) = &mut self.pairs[self.settled] {
                a.settle()?;
                b.settle()?;
            }
            self.settled += 1;
        }
        Ok(())
    }

    /// Starts bringing the pairs of `layers` back to the device.
    fn prefetch(&mut self, layers: std::ops::Range<usize>) -> Result<()> {
        for l in layers {
            let Some(slot) = self.pairs.get_mut(l) else {
                continue;
            };
            *slot = match slot.take() {
                Some(Kept::Host(mut a, mut b)) => {
                    a.settle()?;
                    b.settle()?;
                    Some(Kept::Coming(a.prefetch()?, b.prefetch()?))
                }
                other => other,
            };
        }
        Ok(())
    }

    /// Puts the pairs of `layers` on the device: prefetched ones once their copies have run,
    /// host ones now (their device copies where those have not been let go).
    fn ready(&mut self, layers: std::ops::Range<usize>) -> Result<()> {
        for l in layers {
            let Some(slot) = self.pairs.get_mut(l) else {
                continue;
            };
            *slot = match slot.take() {
                Some(Kept::Coming(a, b)) => Some(Kept::Device(a.wait()?, b.wait()?)),
                Some(Kept::Host(a, b)) => Some(Kept::Device(a.into_device()?, b.into_device()?)),
                other => other,
            };
        }
        Ok(())
    }

    /// Layer `l`'s pair, taken (on the device: after `ready`).
    fn take(&mut self, l: usize) -> Option<(Tensor, Tensor)> {
        match self.pairs.get_mut(l)?.take()? {
            Kept::Device(a, b) => Some((a, b)),
            _ => panic!("layer {l}: a kept pair taken before `ready`"),
        }
    }

    /// A copy of layer `l`'s pair, left in place (on the device: after `ready`).
    fn copy(&self, l: usize) -> Result<Option<(Tensor, Tensor)>> {
        match self.pairs.get(l) {
            Some(Some(Kept::Device(a, b))) => Ok(Some((a.try_clone()?, b.try_clone()?))),
            Some(Some(_)) => anyhow::bail!("layer {l}: a kept pair read before `ready`"),
            _ => Ok(None),
        }
    }
}
