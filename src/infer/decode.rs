//! Incremental decoding: a model, an optional adapter (unmerged, as in training) and a KV cache.
//! `Decoder::extend` appends tokens to some of the cache's sequences — a prompt's prefill, one
//! new token per sequence of a batch, or a chat turn on top of what a sequence already holds —
//! runs the layers over those tokens only, and returns the next-token logits of each sequence.
//!
//! One layer here is the op list of `Model::layer_forward` (`model/layer.rs`, the one statement
//! of each family's maths: norms, LoRA projections, biases, q/k norms, RoPE, softcap, sandwich
//! norms, residual scales) with the attention reading the cache: the flash kernel over a fresh
//! prompt, `tensor::decode_attention` over cached rows otherwise. The LoRA projections and the MLP
//! are `layer.rs`'s own functions.

use super::kv_cache::KvCache;
use crate::model::layer::{linear_fwd, stacked_lora_inputs};
use crate::model::lora::{Target, GROUP_QKV};
use crate::model::weights::Weight;
use crate::model::{Lora, Model, PassCtx};
use crate::tensor::{self as ops, AttnMask, DType, Device, RopeTable, Tensor};
use anyhow::{ensure, Context, Result};

/// A model, its adapter and a KV cache of `seqs` sequences.
pub struct Decoder<'m> {
    model: &'m Model,
    lora: Option<&'m Lora>,
    pub cache: KvCache,
    /// A pass context for `layer.rs`'s functions, which read only its (absent) dropout here.
    ctx_mask: AttnMask,
    ctx_rope: RopeTable,
}

/// The tokens one `extend` call runs: per sequence, where its new rows start and their ids.
struct Entry {
    seq: usize,
    start: usize,
    ids: Vec<u32>,
}

impl<'m> Decoder<'m> {
    /// An empty cache of `seqs` sequences with room for `capacity` tokens each (it grows).
    pub fn new(
        model: &'m Model,
        lora: Option<&'m Lora>,
        seqs: usize,
        capacity: usize,
    ) -> Result<Decoder<'m>> {
        // Gemma 4's layer features (per-layer geometry, KV sharing, v norm, k = v, per-layer
        // inputs) are not in the decode path yet: `infer::generate` falls back to the uncached
        // forward for such a model (`supports`).
        anyhow::ensure!(
            Self::supports(model),
            "the KV-cache decoder does not run Gemma 4's layers yet"
        );
        let ctx_mask = AttnMask::causal(1);
        let ctx_rope = model.rope_table(&ctx_mask.positions)?;
        Ok(Decoder {
            model,
            lora,
            cache: KvCache::new(model, seqs, capacity)?,
            ctx_mask,
            ctx_rope,
        })
    }

    /// Whether the decoder runs this model's layers (every family but Gemma 4 so far).
    pub fn supports(model: &Model) -> bool {
        let s = &model.spec;
        s.per_layer_input == 0
            && s.layers.iter().all(|l| {
                l.owns_kv()
                    && !l.v_norm
                    && !l.k_eq_v
                    && l.head_dim == s.head_dim
                    && l.n_kv_heads == s.n_kv_heads
            })
            && model.weights.layers.iter().all(|w| w.layer_scalar == 1.0)
    }

    pub fn model(&self) -> &Model {
        self.model
    }

    /// Forgets everything sequence `seq` holds.
    pub fn reset(&mut self, seq: usize) {
        self.cache.truncate(seq, 0);
    }

    /// Makes sequence `seq` hold `ids` and returns its next-token logits: the cached prefix that
    /// `ids` share is kept, the rest runs (a chat turn re-rendered from the whole conversation).
    pub fn set_sequence(&mut self, seq: usize, ids: &[u32]) -> Result<Vec<f32>> {
        ensure!(!ids.is_empty(), "a sequence needs at least one token");
        let held = self.cache.ids(seq);
        let mut common = held.iter().zip(ids).take_while(|(a, b)| a == b).count();
        // At least the last token runs, to give its logits.
        common = common.min(ids.len() - 1);
        self.cache.truncate(seq, common);
        let mut out = self.extend(&[(seq, &ids[common..])])?;
        Ok(out.remove(0))
    }

    /// Appends `ids` to each named sequence (distinct sequences, at least one id each) and
    /// returns, per entry, the f32 logits `[vocab]` after its last id.
    pub fn extend(&mut self, batch: &[(usize, &[u32])]) -> Result<Vec<Vec<f32>>> {
        ensure!(!batch.is_empty(), "extend: no sequence");
        let model = self.model;
        let spec = &model.spec;
        let mut entries = Vec::with_capacity(batch.len());
        for &(seq, ids) in batch {
            ensure!(
                seq < self.cache.seqs(),
                "extend: sequence {seq} of a cache of {}",
                self.cache.seqs()
            );
            ensure!(!ids.is_empty(), "extend: sequence {seq} gets no token");
            ensure!(
                !entries.iter().any(|e: &Entry| e.seq == seq),
                "extend: sequence {seq} named twice"
            );
            if let Some(bad) = ids.iter().find(|&&i| i as usize >= spec.vocab) {
                anyhow::bail!("token id {bad} is outside the vocabulary of {}", spec.vocab);
            }
            // The main rotary table as a pass over the whole sequence would build it (LongRoPE
            // picks its factors by the sequence's length): where that differs from the table the
            // cached rows were rotated with, the sequence runs again from its first token, so
            // that every row sees the table an uncached pass would use.
            let len = self.cache.len(seq) + ids.len();
            let inv_freq = spec.ropes[0].inv_freq(len - 1);
            let mut all = ids.to_vec();
            if !self.cache.is_empty(seq) && self.cache.inv_freq(seq) != inv_freq.as_slice() {
                all = [self.cache.ids(seq), ids].concat();
                self.cache.truncate(seq, 0);
            }
            self.cache.set_inv_freq(seq, inv_freq);
            entries.push(Entry {
                seq,
                start: self.cache.len(seq),
                ids: all,
            });
        }
        let need = entries
            .iter()
            .map(|e| e.start + e.ids.len())
            .max()
            .unwrap_or(0);
        self.cache.reserve(model, need)?;

        // Per new row: its cache row, and its position.
        let mut rows = Vec::new();
        let mut positions = Vec::new();
        for e in &entries {
            for p in e.start..e.start + e.ids.len() {
                rows.push(self.cache.row(e.seq, p));
                positions.push(p);
            }
        }
        // One fresh prompt runs the flash kernel over its own k and v.
        let fresh = entries.len() == 1 && entries[0].start == 0;
        let ids: Vec<u32> = entries.iter().flat_map(|e| e.ids.iter().copied()).collect();
        let mut x = model.embed(&ids)?;
        if x.dtype() != model.residual_dtype {
            x = x.to_dtype(model.residual_dtype)?;
        }
        if let Some(s) = model.embed_scale() {
            ops::scale(&mut x, s)?;
        }
        let ropes = self.rope_tables(&entries)?;
        let mut windows: Vec<(Option<u32>, Vec<[u32; 2]>)> = Vec::new();
        for ls in &spec.layers {
            if !windows.iter().any(|(w, _)| *w == ls.window) {
                windows.push((ls.window, self.key_ranges(&entries, ls.window)));
            }
        }
        for l in 0..spec.n_layers {
            let window = spec.layers[l].window;
            let ranges = &windows
                .iter()
                .find(|(w, _)| *w == window)
                .expect("every layer's window has ranges")
                .1;
            let attend = if fresh {
                Attend::Prompt(AttnMask::causal(ids.len()).with_window(window))
            } else {
                Attend::Cache(ranges)
            };
            x = self
                .layer(l, x, &rows, &ropes[spec.layers[l].rope], attend)
                .with_context(|| format!("decoding layer {l}"))?;
        }
        for e in &entries {
            self.cache.push_ids(e.seq, &e.ids);
        }
        // The final norm and the head over each entry's last row only.
        let mut last = Vec::with_capacity(entries.len());
        let mut end = 0;
        for e in &entries {
            end += e.ids.len();
            last.push(end as u32 - 1);
        }
        let h = ops::gather_rows(&x, &last)?;
        drop(x);
        let (h, _) = ops::rms_norm_to(
            &h,
            &model.weights.norm,
            spec.rms_eps,
            model.device.compute_dtype(),
        )?;
        let logits = model.logits(&h, DType::F32)?.to_vec()?;
        Ok(logits.chunks(spec.vocab).map(|c| c.to_vec()).collect())
    }

    /// Per rotary table of the spec, the table at the new rows' positions; each row rotates with
    /// its own sequence's factors (`KvCache::inv_freq`, main table; the other tables do not
    /// depend on the length).
    fn rope_tables(&self, entries: &[Entry]) -> Result<Vec<RopeTable>> {
        let spec = &self.model.spec;
        let mut tables = Vec::with_capacity(spec.ropes.len());
        for (kind, r) in spec.ropes.iter().enumerate() {
            let (mut cos, mut sin) = (Vec::new(), Vec::new());
            for e in entries {
                let positions: Vec<i32> =
                    (e.start..e.start + e.ids.len()).map(|p| p as i32).collect();
                let inv = match kind {
                    0 => self.cache.inv_freq(e.seq).to_vec(),
                    _ => r.inv_freq(e.start + e.ids.len() - 1),
                };
                // The table arithmetic of `RopeTable::scaled`, on the host, then one upload.
                let t = RopeTable::scaled(&positions, &inv, r.attention_factor(), &Device::Cpu)?;
                cos.extend_from_slice(t.cos.as_cpu()?);
                sin.extend_from_slice(t.sin.as_cpu()?);
            }
            let half = r.dims / 2;
            let shape = [cos.len() / half.max(1), half];
            tables.push(RopeTable {
                cos: Tensor::from_f32(&cos, &shape, DType::F32, &self.model.device)?,
                sin: Tensor::from_f32(&sin, &shape, DType::F32, &self.model.device)?,
                head_dim: r.dims,
            });
        }
        Ok(tables)
    }

    /// Per new row, the cache rows it attends to: its own sequence's tokens up to itself, within
    /// `window` (key k is visible from position p iff p − k < window).
    fn key_ranges(&self, entries: &[Entry], window: Option<u32>) -> Vec<[u32; 2]> {
        let mut ranges = Vec::new();
        for e in entries {
            for p in e.start..e.start + e.ids.len() {
                let first = match window {
                    Some(w) => (p + 1).saturating_sub(w as usize),
                    None => 0,
                };
                ranges.push([self.cache.row(e.seq, first), self.cache.row(e.seq, p) + 1]);
            }
        }
        ranges
    }

    /// One decoder layer over the new rows `x` (`(n, H)`, residual dtype): `layer_forward`'s op
    /// list, its k and v written into the cache at `rows` before the attention reads it.
    fn layer(
        &mut self,
        l: usize,
        x: Tensor,
        rows: &[u32],
        rope: &RopeTable,
        attend: Attend,
    ) -> Result<Tensor> {
        let model = self.model;
        let lora = self.lora;
        let s = &model.spec;
        let ls = &s.layers[l];
        let w = &model.weights.layers[l];
        let n = x.dim(0);
        let cdt = model.device.compute_dtype();
        let ctx = PassCtx {
            mask: &self.ctx_mask,
            rope: &self.ctx_rope,
            dropout: None,
        };
        let pair = |tg: Target| lora.and_then(|lo| lo.get(l, tg));
        let (xn, _) = ops::rms_norm_to(&x, &w.attn_norm, s.rms_eps, cdt)?;
        let mut xa = stacked_lora_inputs(&xn, lora, l, GROUP_QKV, &ctx)?;
        let mut lin = |inp: &Tensor, wt: &Weight, tg: Target| -> Result<Tensor> {
            Ok(linear_fwd(inp, wt, pair(tg), None, xa[tg.index()].take())?.0)
        };
        let mut q = lin(&xn, &w.q, Target::Q)?;
        let (Some(wk), Some(wv)) = (&w.k, &w.v) else {
            anyhow::bail!("layer {l}: the decoder needs the layer's own k and v projections");
        };
        let mut k = lin(&xn, wk, Target::K)?;
        let mut v = lin(&xn, wv, Target::V)?;
        drop(xn);
        if let (Some(qb), Some(kb), Some(vb)) = (&w.q_bias, &w.k_bias, &w.v_bias) {
            ops::add_bias(&mut q, qb)?;
            ops::add_bias(&mut k, kb)?;
            ops::add_bias(&mut v, vb)?;
        }
        if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
            let qp = q.reshape(&[n * s.n_heads, s.head_dim])?;
            let kp = k.reshape(&[n * s.n_kv_heads, s.head_dim])?;
            q = ops::rms_norm(&qp, qn, s.rms_eps)?
                .0
                .reshape(&[n, s.q_dim()])?;
            k = ops::rms_norm(&kp, kn, s.rms_eps)?
                .0
                .reshape(&[n, s.kv_dim()])?;
        }
        let q = ops::rope(&q, rope, s.n_heads, false)?;
        let k = ops::rope(&k, rope, s.n_kv_heads, false)?;
        self.cache.write(l, rows, &k, &v)?;
        let shape = model.attn_shape(l);
        let attn = match attend {
            Attend::Prompt(mask) => {
                // A layer that reads another's cache takes that layer's rows of this prompt.
                let (kc, vc) = self.cache.layer(l);
                let (first, end) = (rows[0] as usize, rows[rows.len() - 1] as usize + 1);
                let (k, v) = if crate::infer::kv_cache::cache_layer(s, l) == l {
                    (k, v)
                } else {
                    (
                        ops::slice_rows(kc, first, end)?,
                        ops::slice_rows(vc, first, end)?,
                    )
                };
                ops::attention(&q, &k, &v, &mask, shape)?.0
            }
            Attend::Cache(ranges) => {
                drop((k, v));
                let (kc, vc) = self.cache.layer(l);
                ops::decode_attention(&q, kc, vc, ranges, shape)?
            }
        };
        drop(q);
        let mut o = lin(&attn, &w.o, Target::O)?;
        drop(attn);
        if let Some(pn) = &w.post_attn_norm {
            o = ops::rms_norm(&o, pn, s.rms_eps)?.0;
        }
        if ls.residual_scale != 1.0 {
            ops::scale(&mut o, ls.residual_scale)?;
        }
        let (x1, xn2, _) = ops::add_rms_norm_to(&x, &o, &w.mlp_norm, s.rms_eps, cdt)?;
        drop((x, o));
        let (mlp_out, _) = model.mlp_forward(l, &xn2, lora, &ctx, true)?;
        let mut mlp_out = mlp_out.context("the MLP output was asked for")?;
        if let Some(pn) = &w.post_mlp_norm {
            mlp_out = ops::rms_norm(&mlp_out, pn, s.rms_eps)?.0;
        }
        ops::add(&x1, &mlp_out, ls.residual_scale)
    }
}

/// How a layer's attention reads keys: a fresh prompt's own (flash attention under `mask`), or
/// the cache's rows, a range per query.
enum Attend<'a> {
    Prompt(AttnMask),
    Cache(&'a [[u32; 2]]),
}
