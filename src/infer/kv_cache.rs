//! The KV cache of incremental decoding: per cache layer, the rotated keys and the values of
//! every token a sequence holds, so that each new token runs the layers over itself alone.
//!
//! Layout: one `[seqs * capacity, kv_dim]` tensor for k and one for v per cache layer (`kv_dim`
//! that layer's own: Gemma 4's full layers are wider than its sliding ones), sequence `b`'s token
//! at position `p` in row `b * capacity + p`. A decoding step's attention then reads, per query,
//! one contiguous range of rows (`tensor::decode_attention`), a sliding window being a shorter
//! range. Layer `l` reads the cache of layer `cache_layer(spec, l)`: itself, or for a KV-sharing
//! layer (Gemma 4's last `num_kv_shared_layers`) its donor, whose rotated k and normed v it
//! attends over in the uncached forward too. Only a layer that is its own cache layer writes, and
//! a sharer keeps no slot.

use crate::model::{Model, ModelSpec};
use crate::tensor::{self as ops, Tensor};
use anyhow::{ensure, Result};

/// The layer whose cache layer `layer` reads (and writes when it is `layer` itself): its KV
/// donor (`LayerSpec::kv_source`), else itself.
pub fn cache_layer(spec: &ModelSpec, layer: usize) -> usize {
    spec.layers[layer].kv_source.unwrap_or(layer)
}

/// The cached keys and values of a batch of sequences, with what each sequence holds.
pub struct KvCache {
    /// Per cache slot: k (rotated) and v rows `[seqs * capacity, kv_dim]`, compute dtype.
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Per cache slot: its k and v width (its layer's `kv_dim_of`).
    widths: Vec<usize>,
    /// Per layer: index into `k` / `v`.
    slot_of: Vec<usize>,
    /// Per layer: whether it writes its slot (it is its own cache layer).
    writes: Vec<bool>,
    capacity: usize,
    /// Per sequence: the token ids whose k and v the cache holds, in order.
    ids: Vec<Vec<u32>>,
    /// Per sequence: the main rotary table's inverse frequencies its rows were rotated with
    /// (LongRoPE changes them with the sequence's length; see `Decoder::extend`).
    inv_freq: Vec<Vec<f32>>,
}

impl KvCache {
    /// An empty cache for `seqs` sequences of up to `capacity` tokens each (it grows on demand).
    pub fn new(model: &Model, seqs: usize, capacity: usize) -> Result<KvCache> {
        ensure!(seqs > 0, "a KV cache needs at least one sequence");
        let spec = &model.spec;
        let mut slot_of = Vec::with_capacity(spec.n_layers);
        let mut writes = Vec::with_capacity(spec.n_layers);
        let mut owners: Vec<usize> = Vec::new();
        for l in 0..spec.n_layers {
            let c = cache_layer(spec, l);
            ensure!(
                c <= l,
                "layer {l} reads the cache of layer {c}, which runs after it"
            );
            let slot = match owners.iter().position(|&o| o == c) {
                Some(s) => s,
                None => {
                    ensure!(
                        c == l,
                        "layer {l} reads the cache of layer {c}, which keeps none"
                    );
                    owners.push(c);
                    owners.len() - 1
                }
            };
            slot_of.push(slot);
            writes.push(c == l);
        }
        let capacity = capacity.max(1);
        let widths: Vec<usize> = owners.iter().map(|&o| spec.kv_dim_of(o)).collect();
        let (k, v) = alloc_slots(model, &widths, seqs * capacity)?;
        Ok(KvCache {
            k,
            v,
            widths,
            slot_of,
            writes,
            capacity,
            ids: vec![Vec::new(); seqs],
            inv_freq: vec![Vec::new(); seqs],
        })
    }

    pub fn seqs(&self) -> usize {
        self.ids.len()
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Tokens sequence `seq` holds.
    pub fn len(&self, seq: usize) -> usize {
        self.ids[seq].len()
    }
    pub fn is_empty(&self, seq: usize) -> bool {
        self.ids[seq].is_empty()
    }
    /// The ids sequence `seq` holds.
    pub fn ids(&self, seq: usize) -> &[u32] {
        &self.ids[seq]
    }
    /// Forgets every token of `seq` from `len` on (its rows are overwritten by the next ones).
    pub fn truncate(&mut self, seq: usize, len: usize) {
        self.ids[seq].truncate(len);
        if self.ids[seq].is_empty() {
            self.inv_freq[seq].clear();
        }
    }
    /// The row of sequence `seq`'s token at `pos`.
    pub fn row(&self, seq: usize, pos: usize) -> u32 {
        (seq * self.capacity + pos) as u32
    }

    pub(crate) fn inv_freq(&self, seq: usize) -> &[f32] {
        &self.inv_freq[seq]
    }
    pub(crate) fn set_inv_freq(&mut self, seq: usize, f: Vec<f32>) {
        self.inv_freq[seq] = f;
    }
    pub(crate) fn push_ids(&mut self, seq: usize, ids: &[u32]) {
        self.ids[seq].extend_from_slice(ids);
    }

    /// Layer `l`'s cached k and v (its cache layer's).
    pub(crate) fn layer(&self, l: usize) -> (&Tensor, &Tensor) {
        let s = self.slot_of[l];
        (&self.k[s], &self.v[s])
    }
    /// Writes layer `l`'s new k and v rows at `rows`; nothing for a layer that reads another's.
    pub(crate) fn write(&mut self, l: usize, rows: &[u32], k: &Tensor, v: &Tensor) -> Result<()> {
        if !self.writes[l] {
            return Ok(());
        }
        let s = self.slot_of[l];
        ops::copy_rows_into(&mut self.k[s], rows, k)?;
        ops::copy_rows_into(&mut self.v[s], rows, v)
    }

    /// Makes room for `need` tokens per sequence, moving the held rows into a larger layout
    /// (capacity doubles, at least to `need`).
    pub fn reserve(&mut self, model: &Model, need: usize) -> Result<()> {
        if need <= self.capacity {
            return Ok(());
        }
        let new_cap = need.max(2 * self.capacity);
        let seqs = self.seqs();
        let (mut k, mut v) = alloc_slots(model, &self.widths, seqs * new_cap)?;
        let (src, dst): (Vec<u32>, Vec<u32>) = (0..seqs)
            .flat_map(|b| {
                let old = self.capacity;
                (0..self.len(b)).map(move |p| ((b * old + p) as u32, (b * new_cap + p) as u32))
            })
            .unzip();
        if !src.is_empty() {
            for s in 0..self.k.len() {
                ops::copy_rows_into(&mut k[s], &dst, &ops::gather_rows(&self.k[s], &src)?)?;
                ops::copy_rows_into(&mut v[s], &dst, &ops::gather_rows(&self.v[s], &src)?)?;
            }
        }
        self.k = k;
        self.v = v;
        self.capacity = new_cap;
        Ok(())
    }

    /// Bytes the cache's tensors hold.
    pub fn bytes(&self) -> usize {
        self.k
            .iter()
            .chain(&self.v)
            .map(|t| t.numel() * t.dtype().size())
            .sum()
    }
}

/// Zeroed k and v tensors of `rows` rows, one pair per slot of the given widths.
fn alloc_slots(model: &Model, widths: &[usize], rows: usize) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    let (dt, dev) = (model.device.compute_dtype(), &model.device);
    let mut k = Vec::with_capacity(widths.len());
    let mut v = Vec::with_capacity(widths.len());
    for &w in widths {
        k.push(Tensor::zeros(&[rows, w], dt, dev)?);
        v.push(Tensor::zeros(&[rows, w], dt, dev)?);
    }
    Ok((k, v))
}
