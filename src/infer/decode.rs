//! Incremental decoding: a model, an optional adapter (unmerged, as in training) and a KV cache.
//! `Decoder::extend` appends tokens to some of the cache's sequences — a prompt's prefill, one
//! new token per sequence of a batch, or a chat turn on top of what a sequence already holds —
//! runs the layers over those tokens only, and returns the next-token logits of each sequence.
//!
//! One layer here is the op list of `Model::layer_forward` (`model/layer.rs`, the one statement
//! of each family's maths: norms, LoRA projections, biases, q/k/v norms, RoPE, softcap, sandwich
//! norms, residual scales) with the attention reading the cache: the flash kernel over a fresh
//! prompt, `tensor::decode_attention` over cached rows otherwise. q, k and v
//! (`Model::qkv_forward`), the LoRA projections, the MLP and the end of the layer's output (Gemma
//! 4's per-layer input branch and `layer_scalar`, `Model::layer_output_tail`) are `layer.rs`'s
//! own functions.
//!
//! Gemma 4: each layer has its own head_dim and kv heads (cache slots sized per layer), a
//! KV-sharing layer projects q alone and attends over its donor's cached rows
//! (`kv_cache::cache_layer`), and the per-layer inputs (`Model::per_layer_inputs`, a function of
//! each token's id and embedding alone) are computed for the new tokens of each call.

use super::kv_cache::{cache_layer, KvCache};
use crate::model::layer::{linear_fwd, Qkv};
use crate::model::lora::Target;
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
        // Gemma 4's per-layer inputs of the new tokens (each row depends on its own id and
        // embedding alone), one `(n, P)` tensor per layer; none for the other families.
        let mut per_layer: Vec<Option<Tensor>> = model
            .per_layer_inputs(&ids, &x)?
            .into_iter()
            .map(Some)
            .collect();
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
            let input = per_layer.get_mut(l).and_then(Option::take);
            x = self
                .layer(l, x, input, &rows, &ropes[spec.layers[l].rope], attend)
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

    /// One decoder layer over the new rows `x` (`(n, H)`, residual dtype; `per_layer_input`
    /// their per-layer input, Gemma 4): `layer_forward`'s op list, its k and v written into the
    /// cache at `rows` before the attention reads it (a KV-sharing layer writes nothing and reads
    /// its donor's rows).
    fn layer(
        &mut self,
        l: usize,
        x: Tensor,
        per_layer_input: Option<Tensor>,
        rows: &[u32],
        rope: &RopeTable,
        attend: Attend,
    ) -> Result<Tensor> {
        let model = self.model;
        let lora = self.lora;
        let s = &model.spec;
        let ls = &s.layers[l];
        let w = &model.weights.layers[l];
        let cdt = model.device.compute_dtype();
        let ctx = PassCtx {
            mask: &self.ctx_mask,
            rope: &self.ctx_rope,
            dropout: None,
        };
        let pair = |tg: Target| lora.and_then(|lo| lo.get(l, tg));
        let (xn, _) = ops::rms_norm_to(&x, &w.attn_norm, s.rms_eps, cdt)?;
        // The LoRA inputs `qkv_forward` keeps for a backward are not needed here.
        let mut saved = Default::default();
        let shared = !ls.owns_kv();
        let Qkv { q, k, v, .. } =
            model.qkv_forward(l, &xn, lora, &ctx, rope, shared, None, &mut saved)?;
        drop((xn, saved));
        if let (Some(k), Some(v)) = (&k, &v) {
            self.cache.write(l, rows, k, v)?;
        }
        let shape = model.attn_shape(l);
        let attn = match attend {
            Attend::Prompt(mask) => {
                let (k, v) = match (k, v) {
                    (Some(k), Some(v)) if cache_layer(s, l) == l => (k, v),
                    // A layer that reads another's cache takes that layer's rows of this prompt
                    // (written by the donor, an earlier layer, in this call).
                    _ => {
                        let (kc, vc) = self.cache.layer(l);
                        let (first, end) = (rows[0] as usize, rows[rows.len() - 1] as usize + 1);
                        (
                            ops::slice_rows(kc, first, end)?,
                            ops::slice_rows(vc, first, end)?,
                        )
                    }
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
        let o_dt = model.branch_dtype(w.post_attn_norm.is_some(), x.dtype());
        let mut o = linear_fwd(&attn, &w.o, pair(Target::O), None, None, o_dt, None, None)?.0;
        drop(attn);
        if let Some(pn) = &w.post_attn_norm {
            o = ops::rms_norm(&o, pn, s.rms_eps)?.0;
        }
        if ls.residual_scale != 1.0 {
            ops::scale(&mut o, ls.residual_scale)?;
        }
        let (x1, xn2, _) = ops::add_rms_norm_to(&x, &o, &w.mlp_norm, s.rms_eps, cdt)?;
        drop((x, o));
        let mlp_dt = model.branch_dtype(w.post_mlp_norm.is_some(), x1.dtype());
        let (mlp_out, _) = model.mlp_forward(l, &xn2, lora, &ctx, true, mlp_dt, None)?;
        drop(xn2);
        let mut mlp_out = mlp_out.context("the MLP output was asked for")?;
        if let Some(pn) = &w.post_mlp_norm {
            mlp_out = ops::rms_norm(&mlp_out, pn, s.rms_eps)?.0;
        }
        let mut h = ops::add(&x1, &mlp_out, ls.residual_scale)?;
        drop((x1, mlp_out));
        model.layer_output_tail(l, &mut h, per_layer_input)?;
        Ok(h)
    }
}

/// How a layer's attention reads keys: a fresh prompt's own (flash attention under `mask`), or
/// the cache's rows, a range per query.
enum Attend<'a> {
    Prompt(AttnMask),
    Cache(&'a [[u32; 2]]),
}
