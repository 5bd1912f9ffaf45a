//! Frozen base weights: reading Hugging Face safetensors (single file or sharded with an index),
//! checking every tensor against the model spec, and placing it on the device. A checkpoint's
//! tensors that the model would not read are refused where they change what transformers
//! computes (layers past `num_hidden_layers`, biases) and noted otherwise. A `Weight` is a
//! projection matrix `[out, in]`, dense or kept quantized and dequantized per use.

use super::config::ModelSpec;
use crate::tensor::{DType, Device, Tensor, TensorRef};
use anyhow::{bail, ensure, Context, Result};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// A frozen projection matrix `[out, in]`.
pub enum Weight {
    Dense(Tensor),
    /// Quantized ggml blocks kept on the GPU, dequantized to bf16 for each use.
    Quant(QuantWeight),
    /// A bf16 matrix on a GPU stored with room for a LoRA adapter's columns.
    Extended(ExtendedWeight),
}

/// A quantized frozen matrix on a CUDA device.
pub struct QuantWeight {
    pub backend: std::sync::Arc<crate::tensor::cuda::CudaBackend>,
    pub bytes: crate::tensor::cuda::DeviceBytes,
    pub kind: crate::tensor::cuda::QuantKind,
    pub rows: usize,
    pub cols: usize,
}

/// A frozen `[out, in]` matrix stored as `[W | adapter columns]`, `[out, in + pad]`: the
/// projection's adapter joins the base product's K dimension as `scale · B` in those columns,
/// so that no call copies W (that copy cost an H100 about 3.6 ms of qwen1.5b's 126 ms step at
/// 4.20 GiB). The projections of a shared-input group (q, k, v; gate, up) have one width of
/// adapter columns, `ADAPTER_COLS` a member, so that one packed input
/// `[x | x Aᵀ of every member]` serves them all (`ops::pack_input`), each weight holding its B
/// where its own `x Aᵀ` sits
/// and zeros elsewhere; the backward then reads `dy [W | scale · B]` as the base gradient and
/// the adapter's `scale · dy B` in one product (`model::layer::extended_group_bwd`).
/// The columns hold the adapter last written (`hold_adapter` rewrites them when the adapter,
/// its place or its values changed); everything else reads W as the first `k` columns, in place.
pub struct ExtendedWeight {
    pub ext: Tensor,
    pub k: usize,
    /// The column after `k` that holds the projection's bias (Qwen2's q, k and v), which a
    /// product then adds in its f32 sum where its input has 1 there (`ops::pack_input`); the
    /// adapter columns end before it.
    pub bias_at: Option<usize>,
    /// What the adapter columns hold: the adapter's generation, B's address, its scale and its
    /// first column (`None`: zeros).
    held: Mutex<Option<(u64, u64, u32, usize)>>,
}

/// `ExtendedWeight::hold_adapter` for every `(weight, b, scale, generation, at)`, the columns
/// that hold something else written in one launch (`ops::write_adapter_cols_multi`).
pub fn hold_adapters(items: &[(&ExtendedWeight, &Tensor, f32, u64, usize)]) -> Result<()> {
    let mut stale = Vec::new();
    let mut writes = Vec::new();
    for &(e, b, scale, generation, at) in items {
        let want = (generation, crate::tensor::address(b), scale.to_bits(), at);
        let mut held = e.held.lock().unwrap_or_else(|p| p.into_inner());
        if *held != Some(want) {
            // Marked unheld first: a failed write leaves columns nobody may trust.
            *held = None;
            stale.push((e, want));
            writes.push(crate::tensor::AdapterCols {
                w_ext: &e.ext,
                cols: e.k..e.k + e.pad(),
                at,
                b,
                scale,
            });
        }
    }
    match writes.as_slice() {
        [one] => crate::tensor::write_adapter_cols(
            one.w_ext,
            one.cols.clone(),
            one.at,
            one.b,
            one.scale,
        )?,
        many => crate::tensor::write_adapter_cols_multi(many)?,
    }
    for (e, want) in stale {
        *e.held.lock().unwrap_or_else(|p| p.into_inner()) = Some(want);
    }
    Ok(())
}

/// Adapter columns an `ExtendedWeight` keeps for each projection that reads the same input:
/// ranks up to 16 (PEFT's default rank is 8, lorafit's 16) fold without a copy of W; a higher
/// rank reads W as a copy, as before.
pub const ADAPTER_COLS: usize = 16;

impl ExtendedWeight {
    /// W `[out, in]` with `pad` zero columns after it, and `bias` `[out]` in the last 8 of them
    /// (`bias_at`) where given; `None` unless W is bf16 on a GPU.
    pub fn of(w: &Tensor, pad: usize, bias: Option<&Tensor>) -> Result<Option<ExtendedWeight>> {
        if !w.device().is_cuda() || w.dtype() != DType::BF16 {
            return Ok(None);
        }
        let (out, k) = w.rows_cols();
        let ext = crate::tensor::extend_cols(w, pad)?;
        let bias_at = match bias {
            Some(b) if pad >= 8 && b.numel() == out && b.dtype() == w.dtype() => {
                let at = pad - 8;
                let column = b.try_clone()?.reshape(&[out, 1])?;
                crate::tensor::write_adapter_cols(&ext, k + at..k + at + 1, 0, &column, 1.0)?;
                Some(at)
            }
            _ => None,
        };
        Ok(Some(ExtendedWeight {
            ext,
            k,
            bias_at,
            held: Mutex::new(None),
        }))
    }

    /// Adapter columns after W (those before the bias's).
    pub fn pad(&self) -> usize {
        self.bias_at.unwrap_or(self.ext.rows_cols().1 - self.k)
    }

    /// The columns past W hold `scale · b` of the adapter `generation`
    /// (`LoraPair::generation`) from their column `at` on, zeros elsewhere: written here unless
    /// they already do.
    pub fn hold_adapter(&self, b: &Tensor, scale: f32, generation: u64, at: usize) -> Result<()> {
        hold_adapters(&[(self, b, scale, generation, at)])
    }

    /// W itself: the first `k` columns, read in place.
    pub fn base(&self) -> crate::tensor::Cols<'_> {
        crate::tensor::Cols {
            t: &self.ext,
            start: 0,
            end: self.k,
        }
    }
}

impl Weight {
    /// `(out, in)`.
    pub fn rows_cols(&self) -> (usize, usize) {
        match self {
            Weight::Dense(t) => t.rows_cols(),
            Weight::Quant(q) => (q.rows, q.cols),
            Weight::Extended(e) => (e.ext.rows_cols().0, e.k),
        }
    }
    /// The dense matrix: borrowed, or freshly dequantized, or copied out of an extended
    /// weight's columns (the training paths read those in place, through `base`).
    pub fn dense(&self) -> Result<TensorRef<'_>> {
        match self {
            Weight::Dense(t) => Ok(TensorRef::Borrowed(t)),
            Weight::Quant(q) => Ok(TensorRef::Owned(
                q.backend.dequantize(&q.bytes, q.kind, q.rows, q.cols)?,
            )),
            Weight::Extended(e) => Ok(TensorRef::Owned(crate::tensor::slice_cols(&e.ext, 0, e.k)?)),
        }
    }
    /// The matrix as a window that a product reads in place: W's columns of an extended weight,
    /// the whole of a dense one; `None` for a quantized one (`dense` dequantizes it).
    pub fn base(&self) -> Option<crate::tensor::Cols<'_>> {
        match self {
            Weight::Dense(t) => Some(crate::tensor::Cols::all(t)),
            Weight::Extended(e) => Some(e.base()),
            Weight::Quant(_) => None,
        }
    }
    /// Stores this weight with `pad` adapter columns (`ExtendedWeight::of`). The extended copy
    /// is made before W is let go, so a device without room for it keeps W dense (the adapter
    /// then folds through a copy of W per call, as it did before).
    fn extend(&mut self, pad: usize, bias: Option<&Tensor>) {
        if let Weight::Dense(t) = self {
            if let Ok(Some(e)) = ExtendedWeight::of(t, pad, bias) {
                *self = Weight::Extended(e);
            }
        }
    }
}

/// Weights of one decoder layer.
pub struct LayerWeights {
    /// The norm before attention and the one before the MLP.
    pub attn_norm: Tensor,
    pub mlp_norm: Tensor,
    /// Sandwich norms (Gemma): on the attention output and on the MLP output.
    pub post_attn_norm: Option<Tensor>,
    pub post_mlp_norm: Option<Tensor>,
    pub q: Weight,
    /// `None` on a KV-sharing layer (Gemma 4), which reads its donor's k and v.
    pub k: Option<Weight>,
    /// `None` on a KV-sharing layer, and where v is the k projection (`LayerSpec::k_eq_v`).
    pub v: Option<Weight>,
    pub o: Weight,
    pub gate: Weight,
    pub up: Weight,
    pub down: Weight,
    pub q_bias: Option<Tensor>,
    pub k_bias: Option<Tensor>,
    pub v_bias: Option<Tensor>,
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    /// Gemma 4's unscaled v norm, as a weight of ones `[head_dim]` (f32).
    pub v_norm: Option<Tensor>,
    /// Gemma 4's per-layer input branch: gate `[P, H]`, projection `[H, P]`, its norm `[H]`.
    pub per_layer: Option<PerLayerBranch>,
    /// Factor on the layer's output (Gemma 4's `layer_scalar`; 1 elsewhere).
    pub layer_scalar: f32,
}

/// The frozen weights of a layer's per-layer input branch (Gemma 4):
/// `h + norm(proj(gelu(gate(h)) · input_l))`.
pub struct PerLayerBranch {
    pub gate: Weight,
    pub proj: Weight,
    pub norm: Tensor,
}

/// The model-level weights that make Gemma 4's per-layer inputs (`Model::per_layer_inputs`):
/// the per-layer token table `[V, L·P]`, the projection of the embeddings `[L·P, H]`, and the
/// norm on each layer's `P`-wide slice of that projection.
pub struct PerLayerInputs {
    pub embed: Weight,
    pub projection: Weight,
    pub norm: Tensor,
}

/// Hugging Face leaf names of a layer's norms: (before attention, before the MLP, after
/// attention, after the MLP). With sandwich norms (Gemma) `post_attention_layernorm` is the norm
/// on the attention output and `pre_feedforward_layernorm` the one before the MLP.
pub fn norm_names(sandwich: bool) -> [Option<&'static str>; 4] {
    if sandwich {
        [
            Some("input_layernorm.weight"),
            Some("pre_feedforward_layernorm.weight"),
            Some("post_attention_layernorm.weight"),
            Some("post_feedforward_layernorm.weight"),
        ]
    } else {
        [
            Some("input_layernorm.weight"),
            Some("post_attention_layernorm.weight"),
            None,
            None,
        ]
    }
}

pub struct ModelWeights {
    pub embed: Weight,
    pub layers: Vec<LayerWeights>,
    pub norm: Tensor,
    /// `None` when the head is tied to the embedding.
    pub lm_head: Option<Weight>,
    pub per_layer_inputs: Option<PerLayerInputs>,
}

impl ModelWeights {
    /// Elements of the largest quantized weight (0 with none): a product dequantizes one weight
    /// at a time into a dense temporary of this size (`Weight::dense`).
    pub fn largest_quantized(&self) -> usize {
        let layer_weights = self.layers.iter().flat_map(|l| {
            [Some(&l.q), l.k.as_ref(), l.v.as_ref(), Some(&l.o)]
                .into_iter()
                .chain([Some(&l.gate), Some(&l.up), Some(&l.down)])
                .chain(
                    l.per_layer
                        .iter()
                        .flat_map(|b| [Some(&b.gate), Some(&b.proj)]),
                )
                .flatten()
        });
        [Some(&self.embed), self.lm_head.as_ref()]
            .into_iter()
            .flatten()
            .chain(layer_weights)
            .filter(|w| matches!(w, Weight::Quant(_)))
            .map(|w| {
                let (r, c) = w.rows_cols();
                r * c
            })
            .max()
            .unwrap_or(0)
    }

    /// The adapter-carrying projections stored with room for their adapters' columns where
    /// folding the adapter into the base product pays at any row count
    /// (`extended_fold_pays`, weighed for a shared-input group as a whole: one copy of its
    /// input serves every member): q, k, v, o, gate and up of the usual shapes, not down
    /// (a wide input). q, k and v's biases, where they have them, take 8 columns more, so that
    /// their product adds them (`ExtendedWeight::bias_at`). Only bf16 weights on a GPU.
    pub fn extend_projections(&mut self) {
        use crate::tensor::cuda::gemm::extended_fold_pays;
        for l in &mut self.layers {
            let LayerWeights {
                q,
                k,
                v,
                o,
                gate,
                up,
                down,
                q_bias,
                k_bias,
                v_bias,
                ..
            } = l;
            let qkv = [
                (Some(q), q_bias),
                (k.as_mut(), k_bias),
                (v.as_mut(), v_bias),
            ];
            let groups: [Vec<(&mut Weight, Option<&Tensor>)>; 4] = [
                qkv.into_iter()
                    .filter_map(|(w, b)| w.map(|w| (w, b.as_ref())))
                    .collect(),
                vec![(gate, None), (up, None)],
                vec![(o, None)],
                vec![(down, None)],
            ];
            for group in groups {
                let biased = group.iter().any(|(_, b)| b.is_some());
                let pad = ADAPTER_COLS * group.len() + if biased { 8 } else { 0 };
                let inputs = group[0].0.rows_cols().1;
                let outputs: usize = group.iter().map(|(w, _)| w.rows_cols().0).sum();
                if extended_fold_pays(inputs, outputs, pad) {
                    for (w, bias) in group {
                        w.extend(pad, bias);
                    }
                }
            }
        }
    }

    pub fn head(&self) -> &Weight {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }
}

/// Converts a safetensors view (f32, f16 or bf16) to f32.
pub fn view_to_f32(view: &safetensors::tensor::TensorView) -> Result<Vec<f32>> {
    let b = view.data();
    Ok(match view.dtype() {
        safetensors::Dtype::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        safetensors::Dtype::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        safetensors::Dtype::BF16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => bail!("unsupported dtype {other:?} (expected F32, F16 or BF16)"),
    })
}

/// Writes named f32 host tensors `(name, shape, data)` as one safetensors file.
pub fn write_f32_safetensors(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
) -> Result<()> {
    let bytes: Vec<&[u8]> = tensors
        .iter()
        .map(|(_, _, d)| bytemuck::cast_slice(d))
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((k, s, _), b)| {
            Ok((
                k.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)?,
            ))
        })
        .collect::<Result<_>>()?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(safetensors_error)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// A safetensors error as one cause: its I/O variant's message already holds the OS error that
/// it also gives as its source, so a chained report (`{:#}`) would say it twice ("No space left
/// on device (os error 28): No space left on device (os error 28)").
pub fn safetensors_error(e: safetensors::SafeTensorError) -> anyhow::Error {
    match e {
        safetensors::SafeTensorError::IoError(io) => io.into(),
        other => other.into(),
    }
}

/// Every value of tensor `name` (from `source`) is finite, or an error naming the tensor, the
/// first bad value and its index.
pub fn check_finite(data: &[f32], name: &str, source: &str) -> Result<()> {
    match data.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(i) => bail!(
            "{source}: tensor {name} holds a non-finite value ({} at index {i})",
            data[i]
        ),
    }
}

/// Anything that hands out named host tensors in f32: safetensors folders, GGUF files, random
/// initialisers.
pub trait TensorSource {
    /// `(shape, data)` of tensor `name` in PyTorch's `[out, in]` order; errors name the file.
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)>;
    fn contains(&self, name: &str) -> bool;
    /// A projection weight, dense or kept quantized on the device (the default reads it dense).
    fn weight(&self, name: &str, want: [usize; 2], device: &Device) -> Result<Weight> {
        Ok(Weight::Dense(self.tensor(name, &want, device)?))
    }
    /// A tensor checked against the expected shape and placed on `device`.
    fn tensor(&self, name: &str, want: &[usize], device: &Device) -> Result<Tensor> {
        let (shape, data) = self.get(name)?;
        ensure!(
            shape == want,
            "{}: tensor {name} has shape {shape:?}, but config.json implies {want:?}",
            self.describe()
        );
        check_finite(&data, name, &self.describe())?;
        Tensor::from_f32(&data, &shape, device.compute_dtype(), device)
    }
    fn describe(&self) -> String;
}

/// A Hugging Face model folder's safetensors, memory-mapped.
pub struct SafetensorsFolder {
    files: Vec<(PathBuf, memmap2::Mmap)>,
    /// tensor name -> index into `files`
    index: HashMap<String, usize>,
    dir: PathBuf,
    /// The tensors `get` has handed out, for `unread_note`.
    read: Mutex<HashSet<String>>,
}

/// The safetensors files of a Hugging Face folder: its one `model.safetensors`, else the shards
/// its `model.safetensors.index.json` names (sorted, each once). transformers too takes the single
/// file where both are present.
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index_path = dir.join("model.safetensors.index.json");
    if dir.join("model.safetensors").exists() {
        Ok(vec![dir.join("model.safetensors")])
    } else if index_path.exists() {
        let text = std::fs::read_to_string(&index_path)
            .with_context(|| format!("reading {}", index_path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("parsing {}", index_path.display()))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{}: no weight_map", index_path.display()))?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(String::from))
            .collect();
        files.sort();
        files.dedup();
        Ok(files.into_iter().map(|f| dir.join(f)).collect())
    } else {
        bail!(
            "{}: no model.safetensors or model.safetensors.index.json",
            dir.display()
        );
    }
}

impl SafetensorsFolder {
    pub fn open(dir: &Path) -> Result<SafetensorsFolder> {
        let names = safetensors_files(dir)?;
        if dir.join("model.safetensors.index.json").exists() && names.len() == 1 {
            eprintln!(
                "note: {} holds both model.safetensors and model.safetensors.index.json; \
                 loading model.safetensors, as transformers does (the shards the index names \
                 are not read)",
                dir.display()
            );
        }
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for path in names {
            let f = std::fs::File::open(&path)
                .with_context(|| format!("opening {}", path.display()))?;
            // SAFETY: the file is opened read-only and not modified while mapped.
            let mmap = unsafe { memmap2::Mmap::map(&f) }
                .with_context(|| format!("mapping {}", path.display()))?;
            let (_, meta) = safetensors::SafeTensors::read_metadata(&mmap).with_context(|| {
                format!(
                    "{}: not a valid safetensors file (truncated?)",
                    path.display()
                )
            })?;
            let data_len =
                mmap.len() - 8 - u64::from_le_bytes(mmap[..8].try_into().unwrap()) as usize;
            for (name, info) in meta.tensors() {
                ensure!(
                    info.data_offsets.1 <= data_len,
                    "{}: tensor {name} extends past the end of the file (truncated?)",
                    path.display()
                );
                index.insert(name.to_string(), files.len());
            }
            files.push((path, mmap));
        }
        Ok(SafetensorsFolder {
            files,
            index,
            dir: dir.to_path_buf(),
            read: Mutex::new(HashSet::new()),
        })
    }

    /// The file that holds tensor `name` (one of the folder's).
    fn file_of(&self, name: &str) -> &Path {
        &self.files[self.index[name]].0
    }

    /// The names of the checkpoint's tensors that belong to the language model `spec` describes,
    /// sorted: all of them, except in a multimodal checkpoint, whose vision and audio towers are
    /// not loaded (as the family's note says).
    fn model_tensor_names(&self, spec: &ModelSpec) -> Vec<&str> {
        let spec = resolve_prefixes(spec, self);
        let whole = spec.tensor_prefix == "model.";
        let head = spec.head_tensor();
        let mut names: Vec<&str> = self
            .index
            .keys()
            .map(String::as_str)
            .filter(|n| whole || n.starts_with(&spec.tensor_prefix) || *n == head)
            .collect();
        names.sort_unstable();
        names
    }

    /// Refuses a checkpoint whose tensors the model would drop although transformers would run
    /// them: layers at or past `num_hidden_layers`, and biases the model does not apply. Reads
    /// names only, so it runs before any weight is loaded.
    pub fn check_tensors(&self, spec: &ModelSpec) -> Result<()> {
        let resolved = resolve_prefixes(spec, self);
        let names = self.model_tensor_names(spec);
        let layer_of = |name: &str| -> Option<usize> {
            let rest = name
                .strip_prefix(resolved.tensor_prefix.as_str())?
                .strip_prefix("layers.")?;
            rest.split_once('.')?.0.parse().ok()
        };
        let past = names
            .iter()
            .filter_map(|&n| layer_of(n).map(|l| (l, n)))
            .filter(|&(l, _)| l >= spec.n_layers)
            .min();
        if let Some((_, first)) = past {
            let have = names.iter().filter_map(|&n| layer_of(n)).max().unwrap_or(0) + 1;
            let (m, prefix) = (spec.n_layers, &resolved.tensor_prefix);
            bail!(
                "{}: the checkpoint has {have} layers ({prefix}layers.0 to {prefix}layers.{}), but \
                 config.json says num_hidden_layers = {m}: tensor {first} and the rest from layer \
                 {m} on would be dropped silently, and the model would run cut short. Set \
                 num_hidden_layers to {have} in config.json (or, to train only the first {m}, \
                 remove the later layers' tensors from the checkpoint)",
                self.file_of(first).display(),
                have - 1,
            );
        }
        let mut applied = HashSet::new();
        if resolved.qkv_bias {
            for (l, ls) in resolved.layers.iter().enumerate() {
                applied.insert(resolved.layer_tensor(l, "self_attn.q_proj.bias"));
                if ls.owns_kv() {
                    applied.insert(resolved.layer_tensor(l, "self_attn.k_proj.bias"));
                    applied.insert(resolved.layer_tensor(l, "self_attn.v_proj.bias"));
                }
            }
        }
        let bias = names
            .iter()
            .find(|n| n.ends_with(".bias") && !applied.contains(**n));
        if let Some(&name) = bias {
            bail!(
                "{}: tensor {name} is a bias that the model would not apply, so loading would drop \
                 it silently and train another model than the checkpoint's: {}",
                self.file_of(name).display(),
                unapplied_bias(spec, name)
            );
        }
        Ok(())
    }

    /// After a load: a line naming the checkpoint's tensors that the model never read (up to
    /// five, and their count), or `None` when it read them all.
    pub fn unread_note(&self, spec: &ModelSpec) -> Option<String> {
        let read = self.read.lock().unwrap_or_else(|e| e.into_inner());
        let unread: Vec<&str> = self
            .model_tensor_names(spec)
            .into_iter()
            .filter(|n| !read.contains(*n))
            .collect();
        if unread.is_empty() {
            return None;
        }
        let shown = unread[..unread.len().min(5)].join(", ");
        let more = match unread.len() {
            n if n > 5 => format!(" and {} more", n - 5),
            _ => String::new(),
        };
        Some(format!(
            "{}: {} tensor{} of the checkpoint {} not part of the model and not loaded: \
             {shown}{more}",
            self.dir.display(),
            unread.len(),
            if unread.len() == 1 { "" } else { "s" },
            if unread.len() == 1 { "is" } else { "are" },
        ))
    }
}

/// Why the model `spec` describes does not apply bias tensor `name`, naming the config key, and
/// what to do.
fn unapplied_bias(spec: &ModelSpec, name: &str) -> String {
    let arch = spec.family.hf_name();
    let check = "check that \"architectures\" and \"model_type\" in config.json name the \
                 checkpoint's architecture";
    let qkv = ["q_proj.bias", "k_proj.bias", "v_proj.bias"]
        .iter()
        .any(|leaf| name.ends_with(leaf));
    let key = if name.contains(".self_attn.") {
        "attention_bias"
    } else if name.contains(".mlp.") {
        "mlp_bias"
    } else {
        return format!("{arch} has no such bias; {check}");
    };
    let reads = spec.family.reads_bias_key(key);
    if qkv {
        let state = if reads {
            format!(
                "{arch} applies q, k and v biases only with attention_bias: true in config.json, \
                 and then an o_proj bias too, which lorafit does not apply"
            )
        } else {
            format!("{arch} has no such bias, whatever attention_bias says in config.json")
        };
        format!(
            "{state}. q, k and v biases without an o_proj bias are Qwen2's: if this is a Qwen2 \
             checkpoint, set \"architectures\" to [\"Qwen2ForCausalLM\"] and \"model_type\" to \
             \"qwen2\" in config.json"
        )
    } else if reads {
        let which = if key == "mlp_bias" { "MLP" } else { "o_proj" };
        format!(
            "{arch} applies it only with {key}: true in config.json, which lorafit does not \
             support (it applies no {which} biases); {check}"
        )
    } else {
        format!("{arch} has no such bias, whatever {key} says in config.json; {check}")
    }
}

impl TensorSource for SafetensorsFolder {
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let &i = self
            .index
            .get(name)
            .with_context(|| format!("{}: tensor {name} is missing", self.dir.display()))?;
        self.read
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string());
        let (path, mmap) = &self.files[i];
        let st = safetensors::SafeTensors::deserialize(mmap)
            .with_context(|| format!("parsing {}", path.display()))?;
        let view = st
            .tensor(name)
            .with_context(|| format!("{}: tensor {name}", path.display()))?;
        let data =
            view_to_f32(&view).with_context(|| format!("{}: tensor {name}", path.display()))?;
        Ok((view.shape().to_vec(), data))
    }
    fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }
    fn describe(&self) -> String {
        self.dir.display().to_string()
    }
}

/// The tensor-name prefixes under which `src` holds the model: the spec's, or for a multimodal
/// Gemma 3 checkpoint whichever of its two layouts the files use.
pub fn resolve_prefixes(spec: &ModelSpec, src: &dyn TensorSource) -> ModelSpec {
    let mut spec = spec.clone();
    if !src.contains(&spec.model_tensor("embed_tokens.weight"))
        && spec.tensor_prefix == "language_model.model."
        && src.contains("model.language_model.embed_tokens.weight")
    {
        spec.tensor_prefix = "model.language_model.".into();
        spec.head_prefix = String::new();
    }
    spec
}

/// Loads every base weight of `spec` from `src` (Hugging Face names).
pub fn load_weights(
    spec: &ModelSpec,
    src: &dyn TensorSource,
    device: &Device,
) -> Result<ModelWeights> {
    let spec = &resolve_prefixes(spec, src);
    let (h, v) = (spec.hidden, spec.vocab);
    // A norm weight with the family's offset added (Gemma's `1 + w`), times `scale`. With an
    // offset it is kept in f32 on every device, as transformers computes `1 + w` in f32.
    let norm = |name: &str, want: &[usize], scale: f32| -> Result<Tensor> {
        if spec.norm_offset == 0.0 && scale == 1.0 {
            return src.tensor(name, want, device);
        }
        let (shape, mut data) = src.get(name)?;
        ensure!(
            shape == want,
            "{}: tensor {name} has shape {shape:?}, but config.json implies {want:?}",
            src.describe()
        );
        check_finite(&data, name, &src.describe())?;
        for x in &mut data {
            *x = (*x + spec.norm_offset) * scale;
        }
        let dtype = if spec.norm_offset != 0.0 {
            DType::F32
        } else {
            device.compute_dtype()
        };
        Tensor::from_f32(&data, &shape, dtype, device)
    };
    let mut layers = Vec::with_capacity(spec.n_layers);
    for (l, ls) in spec.layers.iter().enumerate() {
        let i = ls.intermediate;
        let (q, kv) = (spec.q_dim_of(l), spec.kv_dim_of(l));
        let p = |s: &str| spec.layer_tensor(l, s);
        let opt = |name: String, want: &[usize], on: bool| -> Result<Option<Tensor>> {
            if on {
                Ok(Some(src.tensor(&name, want, device)?))
            } else {
                Ok(None)
            }
        };
        let opt_norm = |leaf: Option<&str>, want: &[usize]| -> Result<Option<Tensor>> {
            leaf.map(|leaf| norm(&p(leaf), want, 1.0)).transpose()
        };
        let [attn_norm, mlp_norm, post_attn, post_mlp] = norm_names(ls.sandwich_norms);
        let hd = [ls.head_dim];
        let owns_kv = ls.owns_kv();
        let per_layer = if spec.per_layer_input > 0 {
            let pl = spec.per_layer_input;
            Some(PerLayerBranch {
                gate: src.weight(&p("per_layer_input_gate.weight"), [pl, h], device)?,
                proj: src.weight(&p("per_layer_projection.weight"), [h, pl], device)?,
                norm: norm(&p("post_per_layer_input_norm.weight"), &[h], 1.0)?,
            })
        } else {
            None
        };
        // A scalar buffer; checkpoints that leave it out mean 1.
        let layer_scalar = if src.contains(&p("layer_scalar")) {
            let (shape, data) = src.get(&p("layer_scalar"))?;
            ensure!(
                data.len() == 1,
                "{}: tensor {} has shape {shape:?}, expected one value",
                src.describe(),
                p("layer_scalar")
            );
            data[0]
        } else {
            1.0
        };
        layers.push(LayerWeights {
            attn_norm: norm(&p(attn_norm.expect("always named")), &[h], 1.0)?,
            mlp_norm: norm(&p(mlp_norm.expect("always named")), &[h], 1.0)?,
            post_attn_norm: opt_norm(post_attn, &[h])?,
            post_mlp_norm: opt_norm(post_mlp, &[h])?,
            q: src.weight(&p("self_attn.q_proj.weight"), [q, h], device)?,
            k: owns_kv
                .then(|| src.weight(&p("self_attn.k_proj.weight"), [kv, h], device))
                .transpose()?,
            v: (owns_kv && !ls.k_eq_v)
                .then(|| src.weight(&p("self_attn.v_proj.weight"), [kv, h], device))
                .transpose()?,
            o: src.weight(&p("self_attn.o_proj.weight"), [h, q], device)?,
            gate: src.weight(&p("mlp.gate_proj.weight"), [i, h], device)?,
            up: src.weight(&p("mlp.up_proj.weight"), [i, h], device)?,
            down: src.weight(&p("mlp.down_proj.weight"), [h, i], device)?,
            q_bias: opt(p("self_attn.q_proj.bias"), &[q], spec.qkv_bias)?,
            k_bias: opt(p("self_attn.k_proj.bias"), &[kv], spec.qkv_bias && owns_kv)?,
            v_bias: opt(p("self_attn.v_proj.bias"), &[kv], spec.qkv_bias && owns_kv)?,
            q_norm: opt_norm(spec.qk_norm.then_some("self_attn.q_norm.weight"), &hd)?,
            k_norm: opt_norm(
                (spec.qk_norm && owns_kv).then_some("self_attn.k_norm.weight"),
                &hd,
            )?,
            v_norm: (ls.v_norm && owns_kv)
                .then(|| Tensor::from_f32(&vec![1.0; ls.head_dim], &hd, DType::F32, device))
                .transpose()?,
            per_layer,
            layer_scalar,
        });
    }
    let per_layer_inputs = if spec.per_layer_input > 0 {
        let lp = spec.n_layers * spec.per_layer_input;
        Some(PerLayerInputs {
            embed: src.weight(
                &spec.model_tensor("embed_tokens_per_layer.weight"),
                [v, lp],
                device,
            )?,
            projection: src.weight(
                &spec.model_tensor("per_layer_model_projection.weight"),
                [lp, h],
                device,
            )?,
            norm: norm(
                &spec.model_tensor("per_layer_projection_norm.weight"),
                &[spec.per_layer_input],
                1.0,
            )?,
        })
    } else {
        None
    };
    let embed = src.weight(&spec.model_tensor("embed_tokens.weight"), [v, h], device)?;
    let head_name = spec.head_tensor();
    let lm_head = if spec.tie_embeddings || !src.contains(&head_name) {
        ensure!(
            spec.tie_embeddings,
            "{}: {head_name} is missing and tie_word_embeddings is false",
            src.describe()
        );
        None
    } else {
        Some(src.weight(&head_name, [v, h], device)?)
    };
    // MiniCPM's head reads h·(dim_model_base/hidden): the factor folds into the final norm.
    let head_scale = spec.head_input_scale.unwrap_or(1.0);
    Ok(ModelWeights {
        embed,
        layers,
        norm: norm(&spec.model_tensor("norm.weight"), &[h], head_scale)?,
        lm_head,
        per_layer_inputs,
    })
}

/// Random weights of a given shape (benchmarks and tests), deterministic in `seed`: projections
/// ~ N(0, 0.02), norms = 1.
pub struct RandomSource {
    pub spec: ModelSpec,
    pub seed: u64,
}

/// The spread of a random model's projections, embeddings and head.
pub const RANDOM_STD: f32 = 0.02;

impl RandomSource {
    /// The shape of tensor `name` in this model, if it has one.
    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        random_shape(&self.spec, name)
    }

    /// Whether tensor `name` is drawn from N(0, `RANDOM_STD`) (`get`'s other tensors are fixed
    /// values: norms, Gemma 4's q/k norms among them, and layer scalars).
    pub fn is_normal(&self, name: &str) -> bool {
        !(name.ends_with("layer_scalar") || name.ends_with("norm.weight"))
    }

    /// The seed of `random_normal` for tensor `name`: the model's seed hashed with the name
    /// (FNV-1a), so every tensor has its own draws.
    pub fn normal_seed(&self, name: &str) -> u64 {
        let mut h = 0xcbf29ce484222325u64 ^ self.seed;
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
        h
    }
}

impl TensorSource for RandomSource {
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let s = &self.spec;
        let shape =
            random_shape(s, name).with_context(|| format!("random model: no tensor {name}"))?;
        let n: usize = shape.iter().product();
        let data = if self.is_normal(name) {
            random_normal(n, self.normal_seed(name), RANDOM_STD)
        } else if name.ends_with("layer_scalar") {
            // Gemma 4's per-layer output factor: away from 1, so that it is exercised.
            vec![0.8]
        } else if s.family == super::config::Family::Gemma4
            && (name.ends_with("q_norm.weight") || name.ends_with("k_norm.weight"))
        {
            // Gemma 4 scores with scale 1: trained q/k norm weights carry the score
            // scale. Unit weights would give a random model's head_dim-wide softmax scores of
            // ±head_dim, sharper than any trained model's; hd^-¼ on each makes them a standard
            // `q·k/√hd` attention.
            let hd = shape.iter().product::<usize>() as f32;
            vec![hd.powf(-0.25); n]
        } else {
            // Unit norms once the family's offset is added at load.
            vec![1.0 - s.norm_offset; n]
        };
        Ok((shape, data))
    }
    fn contains(&self, name: &str) -> bool {
        random_shape(&self.spec, name).is_some()
    }
    fn describe(&self) -> String {
        "random model".into()
    }
}

fn random_shape(s: &ModelSpec, name: &str) -> Option<Vec<usize>> {
    let (h, v) = (s.hidden, s.vocab);
    // Layer tensors: `…layers.{l}.{leaf}`; model-level ones keep their whole name.
    let (layer, leaf) = match name.rsplit_once("layers.") {
        Some((_, r)) => {
            let (l, leaf) = r.split_once('.')?;
            (
                Some(l.parse::<usize>().ok().filter(|&l| l < s.n_layers)?),
                leaf,
            )
        }
        None => (None, name),
    };
    let Some(l) = layer else {
        let lp = s.n_layers * s.per_layer_input;
        return Some(match leaf {
            "model.embed_tokens.weight" => vec![v, h],
            "lm_head.weight" if !s.tie_embeddings => vec![v, h],
            "model.norm.weight" => vec![h],
            "model.embed_tokens_per_layer.weight" if lp > 0 => vec![v, lp],
            "model.per_layer_model_projection.weight" if lp > 0 => vec![lp, h],
            "model.per_layer_projection_norm.weight" if lp > 0 => vec![s.per_layer_input],
            _ => return None,
        });
    };
    let ls = &s.layers[l];
    let (q, kv, i) = (s.q_dim_of(l), s.kv_dim_of(l), ls.intermediate);
    let own = ls.owns_kv();
    let pl = s.per_layer_input;
    Some(match leaf {
        "input_layernorm.weight" | "post_attention_layernorm.weight" => vec![h],
        "pre_feedforward_layernorm.weight" | "post_feedforward_layernorm.weight"
            if ls.sandwich_norms =>
        {
            vec![h]
        }
        "self_attn.q_proj.weight" => vec![q, h],
        "self_attn.k_proj.weight" if own => vec![kv, h],
        "self_attn.v_proj.weight" if own && !ls.k_eq_v => vec![kv, h],
        "self_attn.o_proj.weight" => vec![h, q],
        "mlp.gate_proj.weight" | "mlp.up_proj.weight" => vec![i, h],
        "mlp.down_proj.weight" => vec![h, i],
        "self_attn.q_proj.bias" if s.qkv_bias => vec![q],
        "self_attn.k_proj.bias" | "self_attn.v_proj.bias" if s.qkv_bias && own => vec![kv],
        "self_attn.q_norm.weight" if s.qk_norm => vec![ls.head_dim],
        "self_attn.k_norm.weight" if s.qk_norm && own => vec![ls.head_dim],
        "per_layer_input_gate.weight" if pl > 0 => vec![pl, h],
        "per_layer_projection.weight" if pl > 0 => vec![h, pl],
        "post_per_layer_input_norm.weight" if pl > 0 => vec![h],
        "layer_scalar" if s.family == super::config::Family::Gemma4 => vec![1],
        _ => return None,
    })
}

/// `n` normal samples with standard deviation `std`, generated in parallel chunks from `seed`.
pub fn random_normal(n: usize, seed: u64, std: f32) -> Vec<f32> {
    use rayon::prelude::*;
    let mut out = vec![0f32; n];
    out.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut rng = crate::tensor::Rng(seed ^ (c as u64).wrapping_mul(0xA24B_AED4_963E_E407));
            for x in chunk.iter_mut() {
                *x = rng.normal() as f32 * std;
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The llama_linear fixture (tied head) in a fresh folder, with `extra` tensors beside its
    /// own, and its spec.
    fn fixture_with(name: &str, extra: &[&str]) -> (PathBuf, ModelSpec) {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/llama_linear");
        let dir =
            std::env::temp_dir().join(format!("lorafit-unread-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
        let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (n, v.shape().to_vec(), view_to_f32(&v).unwrap()))
            .collect();
        for n in extra {
            tensors.push((n.to_string(), vec![4], vec![1.0; 4]));
        }
        write_f32_safetensors(&dir.join("model.safetensors"), &tensors).unwrap();
        let spec = ModelSpec::from_config_file(&dir.join("config.json")).unwrap();
        (dir, spec)
    }

    /// After a load, the note names the tensors the model never read: up to five, and a count.
    #[test]
    fn unread_tensors_are_noted_with_a_count() {
        let (dir, spec) = fixture_with("none", &[]);
        let folder = SafetensorsFolder::open(&dir).unwrap();
        folder.check_tensors(&spec).unwrap();
        load_weights(&spec, &folder, &Device::Cpu).unwrap();
        assert_eq!(folder.unread_note(&spec), None);
        let _ = std::fs::remove_dir_all(&dir);

        let extra: Vec<String> = (0..2)
            .map(|l| format!("model.layers.{l}.self_attn.rotary_emb.inv_freq"))
            .chain((0..5).map(|i| format!("model.extra_{i}.weight")))
            .collect();
        let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
        let (dir, spec) = fixture_with("seven", &extra);
        let folder = SafetensorsFolder::open(&dir).unwrap();
        folder.check_tensors(&spec).unwrap();
        load_weights(&spec, &folder, &Device::Cpu).unwrap();
        let note = folder.unread_note(&spec).unwrap();
        assert!(
            note.contains("7 tensors") && note.contains("and 2 more"),
            "{note}"
        );
        assert!(note.contains("model.extra_0.weight"), "{note}");
        assert_eq!(note.matches(", ").count(), 4, "{note}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A write that finds no space names the OS error once (`/dev/full` answers every write
    /// with ENOSPC).
    #[test]
    fn a_full_disk_is_said_once() {
        let full = Path::new("/dev/full");
        if !full.exists() {
            eprintln!("SKIPPED a_full_disk_is_said_once: this system has no /dev/full");
            return;
        }
        let tensors = vec![("x".to_string(), vec![4096], vec![1.0f32; 4096])];
        let e = write_f32_safetensors(full, &tensors).unwrap_err();
        let msg = format!("{e:#}");
        assert_eq!(msg.matches("os error 28").count(), 1, "{msg}");
        assert!(e.chain().any(|c| c
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::StorageFull)));
    }
}
