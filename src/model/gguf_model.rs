//! GGUF files as a model source: the geometry from GGUF metadata, written out as the
//! `config.json` each family file reads, and the tensors renamed to Hugging Face's names.
//!
//! Architectures (`general.architecture`) and what llama.cpp's converter did to them:
//! * `llama`: q/k rows permuted for ggml's interleaved RoPE (put back here).
//! * `minicpm`: Llama layers, q/k permuted like Llama. μP scales in the metadata as
//!   `embedding_scale` (= `scale_emb`), `residual_scale` (= `scale_depth/√L`) and `logit_scale`
//!   (= `hidden/dim_model_base`, the logits are divided by it); LongRoPE factors as the tensors
//!   `rope_factors_long.weight` / `rope_factors_short.weight`.
//! * `gemma2`, `gemma3`: sandwich norms (`post_attention_norm`, `ffn_norm` = the pre-MLP norm,
//!   `post_ffw_norm`), every norm weight stored as `1 + w` (so the spec's `norm_offset` is 0),
//!   no q/k permutation (ggml rotates Gemma NeoX-style), tied embeddings. The score scale is
//!   not in the metadata: llama.cpp uses `head_dim^-½`, except for the 27B models (46 layers
//!   for Gemma 2, 62 for Gemma 3), which use `(hidden/heads)^-½`. Gemma 3's local layers
//!   rotate with base `rope.freq_base_swa` (10⁴ when absent), unscaled; its sliding pattern is
//!   `attention.sliding_window_pattern` (a period or one flag per layer; 6 when absent) and
//!   its `token_embd` may hold fewer rows than the checkpoint's vocab (trimmed to the
//!   tokenizer), so the vocab is read from the tensor.
//!
//! * `gemma4` (`Gemma4Model` in the converter, `llama_model_gemma4` in llama.cpp): plain `w`
//!   norms (the converter's norm shift is 0, as in Hugging Face's checkpoints), no q/k
//!   permutation, tied embeddings, score scale 1 (`attention.scale` is not read). Full layers
//!   have `attention.key_length` (= value_length), sliding ones `attention.key_length_swa`;
//!   `attention.head_count_kv` and `feed_forward_length` are a scalar or one entry per layer
//!   (`head_count` too, but lorafit needs one value); `attention.sliding_window_pattern` is one
//!   flag per layer (no period), the last layer full. The last `attention.shared_kv_layers`
//!   layers have no k/v and read those of layer `n_kv − 2` (sliding) or `n_kv − 1` (full),
//!   `n_kv` = block_count − shared_kv_layers; the file is refused where that is not the last
//!   earlier layer of the same type (lorafit's and transformers' donor). Full layers without
//!   `attn_v` take v from the k projection (`attention_k_eq_v`). Per-layer inputs of width
//!   `embedding_length_per_layer_input`: `per_layer_token_embd`, `per_layer_model_proj`,
//!   `per_layer_proj_norm`, and per layer `inp_gate`, `proj`, `post_norm`; the layer scalar is
//!   `layer_output_scale`. RoPE: base `rope.freq_base` for full layers, `rope.freq_base_swa`
//!   for sliding ones, every dim rotated NeoX-style (`rope.dimension_count[_swa]` must equal
//!   the head size); proportional RoPE is the tensor `rope_freqs.weight`, per-pair frequency
//!   divisors of the full layers: a run of one factor (1 from the converter) for the first
//!   `partial_rotary_factor·key_length/2` pairs, 1e30 for the rest, read as
//!   `RopeScaling::Proportional`; any other pattern is refused. `final_logit_softcapping` as
//!   for Gemma 3.
//!
//! An `{arch}.attention.scale` key, where present, sets every layer's score scale for the
//! other architectures (llama.cpp's Gemma graphs do not read it;
//! `scripts/make_gguf_family_fixtures.py` writes it when a checkpoint's `query_pre_attn_scalar`
//! is not the one llama.cpp would infer).

use super::config::{Family, HfConfig, ModelSpec, RopeScaling};
use super::gguf::{unpermute_qk_rows, GgmlType, GgufFile, MetaValue};
use super::weights::{check_finite, QuantWeight, RandomSource, TensorSource, Weight};
use crate::tensor::cuda::QuantKind;
use crate::tensor::Device;
use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

/// The GGUF architectures lorafit reads, for error messages.
pub const SUPPORTED_GGUF_ARCHITECTURES: &[&str] =
    &["llama", "gemma2", "gemma3", "gemma4", "minicpm"];

/// A GGUF `general.architecture` that lorafit reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufArch {
    Llama,
    Gemma2,
    Gemma3,
    Gemma4,
    MiniCpm,
}

impl GgufArch {
    pub fn from_name(name: &str) -> Option<GgufArch> {
        Some(match name {
            "llama" => GgufArch::Llama,
            "gemma2" => GgufArch::Gemma2,
            "gemma3" => GgufArch::Gemma3,
            "gemma4" => GgufArch::Gemma4,
            "minicpm" => GgufArch::MiniCpm,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            GgufArch::Llama => "llama",
            GgufArch::Gemma2 => "gemma2",
            GgufArch::Gemma3 => "gemma3",
            GgufArch::Gemma4 => "gemma4",
            GgufArch::MiniCpm => "minicpm",
        }
    }

    /// llama.cpp's converter permuted the q/k rows (`LlamaModel.permute`).
    pub fn permutes_qk(self) -> bool {
        matches!(self, GgufArch::Llama | GgufArch::MiniCpm)
    }

    /// Gemma's four norms per layer.
    fn sandwich_norms(self) -> bool {
        matches!(self, GgufArch::Gemma2 | GgufArch::Gemma3 | GgufArch::Gemma4)
    }

    /// The converter stored every norm weight as `1 + w` (Gemma 2 and 3; Gemma 4's norms are
    /// plain `w` in both forms).
    pub fn shifted_norms(self) -> bool {
        matches!(self, GgufArch::Gemma2 | GgufArch::Gemma3)
    }
}

/// GGUF tensor name for a Hugging Face name.
pub fn gguf_name(arch: GgufArch, hf: &str) -> Option<String> {
    if let Some(rest) = hf.strip_prefix("model.layers.") {
        let (layer, leaf) = rest.split_once('.')?;
        let sandwich = arch.sandwich_norms();
        let g = match leaf {
            "input_layernorm.weight" => "attn_norm.weight",
            // Gemma's post_attention_layernorm is the attention-output norm; Llama's is the
            // pre-MLP norm.
            "post_attention_layernorm.weight" if sandwich => "post_attention_norm.weight",
            "post_attention_layernorm.weight" => "ffn_norm.weight",
            "pre_feedforward_layernorm.weight" if sandwich => "ffn_norm.weight",
            "post_feedforward_layernorm.weight" if sandwich => "post_ffw_norm.weight",
            "self_attn.q_proj.weight" => "attn_q.weight",
            "self_attn.k_proj.weight" => "attn_k.weight",
            "self_attn.v_proj.weight" => "attn_v.weight",
            "self_attn.o_proj.weight" => "attn_output.weight",
            "self_attn.q_proj.bias" => "attn_q.bias",
            "self_attn.k_proj.bias" => "attn_k.bias",
            "self_attn.v_proj.bias" => "attn_v.bias",
            "self_attn.q_norm.weight" => "attn_q_norm.weight",
            "self_attn.k_norm.weight" => "attn_k_norm.weight",
            "mlp.gate_proj.weight" => "ffn_gate.weight",
            "mlp.up_proj.weight" => "ffn_up.weight",
            "mlp.down_proj.weight" => "ffn_down.weight",
            // Gemma 4's per-layer input branch and output scale.
            "per_layer_input_gate.weight" => "inp_gate.weight",
            "per_layer_projection.weight" => "proj.weight",
            "post_per_layer_input_norm.weight" => "post_norm.weight",
            "layer_scalar" => "layer_output_scale.weight",
            _ => return None,
        };
        return Some(format!("blk.{layer}.{g}"));
    }
    Some(
        match hf {
            "model.embed_tokens.weight" => "token_embd.weight",
            "model.norm.weight" => "output_norm.weight",
            "lm_head.weight" => "output.weight",
            "model.embed_tokens_per_layer.weight" => "per_layer_token_embd.weight",
            "model.per_layer_model_projection.weight" => "per_layer_model_proj.weight",
            "model.per_layer_projection_norm.weight" => "per_layer_proj_norm.weight",
            _ => return None,
        }
        .to_string(),
    )
}

/// A GGUF file read as Hugging Face-named f32 tensors.
pub struct GgufSource {
    pub file: GgufFile,
    pub arch: GgufArch,
    pub spec: ModelSpec,
}

impl GgufSource {
    pub fn open(path: &std::path::Path) -> Result<GgufSource> {
        let file = GgufFile::open(path)?;
        let spec = spec_from_gguf(&file)?;
        let arch = GgufArch::from_name(file.arch()?).expect("checked by spec_from_gguf");
        Ok(GgufSource { file, arch, spec })
    }

    fn name(&self, hf: &str) -> Result<String> {
        gguf_name(self.arch, hf).with_context(|| {
            format!(
                "{}: no GGUF tensor of architecture {} corresponds to {hf}",
                self.describe(),
                self.arch.name()
            )
        })
    }

    /// The head count whose q/k row permutation tensor `g` carries, if any.
    fn permuted_heads(&self, g: &str) -> Option<usize> {
        if !self.arch.permutes_qk() {
            None
        } else if g.ends_with("attn_q.weight") {
            Some(self.spec.n_heads)
        } else if g.ends_with("attn_k.weight") {
            Some(self.spec.n_kv_heads)
        } else {
            None
        }
    }

    /// Refuses a tensor whose shape is not the one the metadata implies, naming the GGUF
    /// tensor and the keys (checked here, before the loader's check, so that errors speak of
    /// the GGUF's names rather than config.json's).
    fn check_shape(&self, hf: &str, g: &str, shape: &[usize], want: &[usize]) -> Result<()> {
        if shape == want {
            return Ok(());
        }
        let dims: Vec<usize> = shape.iter().rev().copied().collect();
        bail!(
            "{}: tensor {g} ({hf}) has shape {shape:?} (GGUF dims {dims:?}), but the GGUF's \
             metadata ({}) implies {want:?}",
            self.describe(),
            self.shape_keys(hf)
        )
    }

    /// The metadata keys (with their values) behind the shape the model expects of `hf`.
    fn shape_keys(&self, hf: &str) -> String {
        let a = self.arch.name();
        let key = |k: &str| {
            let k = format!("{a}.{k}");
            match self.file.get(&k) {
                Some(v) if v.as_array().is_none() => format!("{k} = {}", short_value(v)),
                _ => k,
            }
        };
        let head = if self.arch == GgufArch::Gemma4 {
            format!("{a}.attention.key_length / key_length_swa")
        } else if self
            .file
            .get(&format!("{a}.attention.key_length"))
            .is_some()
        {
            key("attention.key_length")
        } else {
            format!("head size = {a}.embedding_length / {a}.attention.head_count")
        };
        let hidden = key("embedding_length");
        let vocab = "the rows of token_embd.weight".to_string();
        let leaf = hf
            .rsplit_once("layers.")
            .and_then(|(_, rest)| rest.split_once('.'))
            .map_or(hf, |(_, leaf)| leaf);
        let keys = match leaf {
            "self_attn.q_proj.weight" | "self_attn.o_proj.weight" => {
                vec![key("attention.head_count"), head, hidden]
            }
            "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => {
                vec![key("attention.head_count_kv"), head, hidden]
            }
            "self_attn.q_proj.bias" => vec![key("attention.head_count"), head],
            "self_attn.k_proj.bias" | "self_attn.v_proj.bias" => {
                vec![key("attention.head_count_kv"), head]
            }
            "self_attn.q_norm.weight" | "self_attn.k_norm.weight" => vec![head],
            "mlp.gate_proj.weight" | "mlp.up_proj.weight" | "mlp.down_proj.weight" => {
                vec![key("feed_forward_length"), hidden]
            }
            "per_layer_input_gate.weight" | "per_layer_projection.weight" => {
                vec![key("embedding_length_per_layer_input"), hidden]
            }
            "model.embed_tokens.weight" | "lm_head.weight" => vec![vocab, hidden],
            "model.embed_tokens_per_layer.weight" => vec![
                vocab,
                key("block_count"),
                key("embedding_length_per_layer_input"),
            ],
            "model.per_layer_model_projection.weight" => vec![
                key("block_count"),
                key("embedding_length_per_layer_input"),
                hidden,
            ],
            "model.per_layer_projection_norm.weight" => {
                vec![key("embedding_length_per_layer_input")]
            }
            _ => vec![hidden],
        };
        keys.join(", ")
    }
}

fn short_value(v: &MetaValue) -> String {
    match v {
        MetaValue::String(s) => format!("{s:?}"),
        MetaValue::F32(x) => x.to_string(),
        MetaValue::F64(x) => x.to_string(),
        MetaValue::Bool(b) => b.to_string(),
        v => v
            .as_i64()
            .map_or_else(|| format!("{v:?}"), |x| x.to_string()),
    }
}

impl TensorSource for GgufSource {
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let g = self.name(name)?;
        let info = self.file.tensor_info(&g)?;
        let shape = info.torch_shape();
        // The loader's own shape for each tensor (RandomSource knows it by name); the layer
        // scalar is checked by its element count there.
        let want = RandomSource {
            spec: self.spec.clone(),
            seed: 0,
        }
        .shape_of(name)
        .filter(|_| !name.ends_with("layer_scalar"));
        if let Some(want) = want {
            self.check_shape(name, &g, &shape, &want)?;
        }
        let mut data = self.file.tensor_f32(&g)?;
        check_finite(&data, &format!("{g} ({name})"), &self.describe())?;
        // llama.cpp's converter permutes q and k rows (per head: [2, hd/2] -> [hd/2, 2]).
        if let Some(n_head) = self.permuted_heads(&g) {
            ensure!(
                shape.len() == 2,
                "{}: tensor {g} has shape {shape:?}, expected a matrix",
                self.describe()
            );
            unpermute_qk_rows(&mut data, shape[0], shape[1], n_head)
                .with_context(|| format!("{}: tensor {g}", self.describe()))?;
        }
        Ok((shape, data))
    }
    /// On CUDA, quantized projections stay quantized (rows of q/k reordered block-wise); on the
    /// CPU they are widened to f32 once.
    fn weight(&self, name: &str, want: [usize; 2], device: &Device) -> Result<Weight> {
        let Device::Cuda(backend) = device else {
            return Ok(Weight::Dense(self.tensor(name, &want, device)?));
        };
        let g = self.name(name)?;
        let info = self.file.tensor_info(&g)?;
        let kind = match info.ggml_type {
            GgmlType::Q8_0 => QuantKind::Q8_0,
            GgmlType::Q4_0 => QuantKind::Q4_0,
            GgmlType::Q4_1 => QuantKind::Q4_1,
            GgmlType::Q4_K => QuantKind::Q4_K,
            GgmlType::Q6_K => QuantKind::Q6_K,
            _ => return Ok(Weight::Dense(self.tensor(name, &want, device)?)),
        };
        let shape = info.torch_shape();
        self.check_shape(name, &g, &shape, &want)?;
        let (rows, cols) = (shape[0], shape[1]);
        let raw = self.file.tensor_bytes(&g)?;
        let row_bytes = raw.len() / rows;
        let bytes = match self.permuted_heads(&g) {
            // Whole rows are whole blocks, so the row permutation moves byte rows.
            Some(n_head) => {
                let mut order: Vec<f32> = (0..rows).map(|r| r as f32).collect();
                unpermute_qk_rows(&mut order, rows, 1, n_head)?;
                order
                    .iter()
                    .flat_map(|&r| {
                        raw[r as usize * row_bytes..(r as usize + 1) * row_bytes]
                            .iter()
                            .copied()
                    })
                    .collect::<Vec<u8>>()
            }
            None => raw.to_vec(),
        };
        Ok(Weight::Quant(QuantWeight {
            backend: backend.clone(),
            bytes: backend.upload_bytes(&bytes)?,
            kind,
            rows,
            cols,
        }))
    }
    fn contains(&self, name: &str) -> bool {
        gguf_name(self.arch, name).is_some_and(|g| self.file.tensor_info(&g).is_ok())
    }
    fn describe(&self) -> String {
        self.file.path().display().to_string()
    }
}

/// Metadata of one architecture (`{arch}.key`), with the file named in errors.
struct Meta<'a> {
    f: &'a GgufFile,
    arch: &'a str,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    fn has(&self, k: &str) -> bool {
        self.f.get(&self.key(k)).is_some()
    }
    fn usize(&self, k: &str) -> Result<usize> {
        self.f.get_usize(&self.key(k))
    }
    fn usize_or(&self, k: &str, default: usize) -> Result<usize> {
        if self.has(k) {
            self.usize(k)
        } else {
            Ok(default)
        }
    }
    fn f64_opt(&self, k: &str) -> Result<Option<f64>> {
        if self.has(k) {
            Ok(Some(self.f.get_f32(&self.key(k))? as f64))
        } else {
            Ok(None)
        }
    }
    fn f64_or(&self, k: &str, default: f64) -> Result<f64> {
        Ok(self.f64_opt(k)?.unwrap_or(default))
    }
    fn str_opt(&self, k: &str) -> Result<Option<&str>> {
        if self.has(k) {
            Ok(Some(self.f.get_str(&self.key(k))?))
        } else {
            Ok(None)
        }
    }
    /// A count llama.cpp reads with `get_key_or_arr`: one value for every layer, or an array
    /// of one value per layer (`n_layers` entries). `None` when absent.
    fn per_layer(&self, k: &str, n_layers: usize) -> Result<Option<PerLayer>> {
        let key = self.key(k);
        let path = self.f.path().display();
        Ok(match self.f.get(&key) {
            None => None,
            Some(MetaValue::Array(a)) => {
                ensure!(
                    a.len() == n_layers,
                    "{path}: {key} has {} entries, block_count is {n_layers}",
                    a.len()
                );
                let v = a
                    .iter()
                    .enumerate()
                    .map(|(l, v)| {
                        v.as_usize().with_context(|| {
                            format!(
                                "{path}: {key}[{l}] is {} (expected an unsigned integer)",
                                v.type_name()
                            )
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Some(PerLayer { key, v, one: None })
            }
            Some(_) => {
                let x = self.usize(k)?;
                Some(PerLayer {
                    v: vec![x; n_layers],
                    key,
                    one: Some(x),
                })
            }
        })
    }
}

/// One count per layer, from a scalar key or a per-layer array (`Meta::per_layer`).
struct PerLayer {
    key: String,
    v: Vec<usize>,
    /// The scalar, where the key is one.
    one: Option<usize>,
}

impl PerLayer {
    /// Refuses a zero entry, naming the key and the layer.
    fn positive(self, path: &str) -> Result<PerLayer> {
        if self.one == Some(0) {
            bail!("{path}: {} is 0", self.key);
        }
        if let Some(l) = self.v.iter().position(|&x| x == 0) {
            bail!("{path}: {}[{l}] is 0 (layer {l})", self.key);
        }
        Ok(self)
    }
    /// The one value every layer has; an error naming the key when the layers differ.
    fn uniform(&self, path: &str, arch: &str) -> Result<usize> {
        if let Some(x) = self.one {
            return Ok(x);
        }
        let first = self.v.first().copied().unwrap_or(0);
        if let Some(l) = self.v.iter().position(|&x| x != first) {
            bail!(
                "{path}: {} differs between layers (layer 0: {first}, layer {l}: {}): not \
                 supported for architecture {arch}",
                self.key,
                self.v[l]
            );
        }
        Ok(first)
    }
}

fn token_id(f: &GgufFile, key: &str) -> Result<Option<u32>> {
    match f.get(key) {
        Some(_) => f.get_u32(key).map(Some),
        None => Ok(None),
    }
}

/// `rope.scaling.type` / `rope.scaling.factor` as a config.json `rope_scaling` (linear only;
/// LongRoPE is read separately for MiniCPM).
fn rope_scaling(m: &Meta, path: &str) -> Result<Value> {
    Ok(
        match (
            m.str_opt("rope.scaling.type")?,
            m.f64_opt("rope.scaling.factor")?,
        ) {
            (Some("linear"), Some(factor)) if factor != 1.0 => {
                json!({"rope_type": "linear", "factor": factor})
            }
            (None | Some("none") | Some("linear"), _) => Value::Null,
            (Some(other), _) => {
                bail!("{path}: rope scaling {other:?} is not supported here (supported: linear)")
            }
        },
    )
}

/// Which layers slide under llama.cpp's `set_swa_pattern(period)`: layer `l` slides iff
/// `l % period < period − 1` (the last layer of each period is global).
fn swa_pattern(n_layers: usize, period: usize) -> Vec<bool> {
    (0..n_layers)
        .map(|l| period == 0 || l % period < period - 1)
        .collect()
}

/// `{arch}.attention.sliding_window_pattern`: a period (u32) or one flag per layer; `default`
/// period when absent.
fn sliding_layers(m: &Meta, n_layers: usize, default: usize, path: &str) -> Result<Vec<bool>> {
    let key = m.key("attention.sliding_window_pattern");
    Ok(match m.f.get(&key) {
        None => swa_pattern(n_layers, default),
        Some(MetaValue::Array(a)) => {
            let flags: Option<Vec<bool>> = a
                .iter()
                .map(|v| v.as_bool().or_else(|| v.as_u64().map(|x| x != 0)))
                .collect();
            let flags = flags.with_context(|| format!("{path}: {key} is not an array of flags"))?;
            ensure!(
                flags.len() == n_layers,
                "{path}: {key} has {} entries, block_count is {n_layers}",
                flags.len()
            );
            flags
        }
        Some(v) => {
            let period = v
                .as_usize()
                .with_context(|| format!("{path}: {key} is neither a period nor flags"))?;
            swa_pattern(n_layers, period)
        }
    })
}

fn layer_types(sliding: &[bool]) -> Value {
    Value::Array(
        sliding
            .iter()
            .map(|&s| {
                json!(if s {
                    "sliding_attention"
                } else {
                    "full_attention"
                })
            })
            .collect(),
    )
}

/// Factors of the full layers' frequency pairs at or above this switch a pair off (its angle
/// is 0 at every position a model reaches); llama.cpp's converter writes 1e30.
const ROPE_PAIR_OFF: f32 = 1e20;

/// Gemma 4's proportional RoPE as llama.cpp expresses it: the full layers rotate all
/// `key_length` dims NeoX-style with per-pair frequency divisors `rope_freqs.weight`, 1 for the
/// first `partial_rotary_factor·key_length/2` pairs and 1e30 for the rest. As
/// `(rotated_pairs, factor)`: a run of equal finite divisors, then only switched-off pairs.
/// `None` without the tensor (every pair rotates).
fn proportional_rope(f: &GgufFile, path: &str, dims: usize) -> Result<Option<(usize, f64)>> {
    const NAME: &str = "rope_freqs.weight";
    if f.tensor_info(NAME).is_err() {
        return Ok(None);
    }
    let v = f.tensor_f32(NAME)?;
    ensure!(
        v.len() == dims / 2,
        "{path}: {NAME} has {} factors; the full layers' key_length {dims} has {} frequency pairs",
        v.len(),
        dims / 2
    );
    let rotated = v.iter().take_while(|&&x| x < ROPE_PAIR_OFF).count();
    let factor = v.first().copied().unwrap_or(1.0);
    let consistent = v[..rotated]
        .iter()
        .all(|&x| x == factor && x > 0.0 && x.is_finite())
        && v[rotated..].iter().all(|&x| x >= ROPE_PAIR_OFF);
    ensure!(
        consistent,
        "{path}: {NAME} {v:?} is not proportional RoPE (a run of one positive factor for the \
         rotated pairs, then factors ≥ {ROPE_PAIR_OFF:e} for the pairs that do not rotate): \
         other per-pair factors are not supported for gemma4"
    );
    Ok(Some((
        rotated,
        if rotated > 0 { factor as f64 } else { 1.0 },
    )))
}

/// The Gemma 4 fields of the config.json of a `gemma4` GGUF (llama.cpp's `Gemma4Model`
/// converter and its loader, `llama_model_gemma4::load_arch_hparams`).
fn gemma4_config(
    m: &Meta,
    path: &str,
    n_layers: usize,
    kv: &PerLayer,
    ff: &PerLayer,
) -> Result<Vec<(&'static str, Value)>> {
    let f = m.f;
    let arch = m.arch;
    // One flag per layer: llama.cpp's gemma4 reads no period here.
    let key = m.key("attention.sliding_window_pattern");
    let sliding = match f.get(&key) {
        Some(MetaValue::Array(_)) => sliding_layers(m, n_layers, 0, path)?,
        Some(v) => bail!(
            "{path}: {key} is a {}; llama.cpp's gemma4 reads it as one flag per layer",
            v.type_name()
        ),
        None => bail!("GGUF {path}: metadata key '{key}' is missing (one flag per layer)"),
    };
    if sliding.last() == Some(&true) {
        bail!("{path}: {key} makes the last layer sliding; Gemma 4's last layer is full attention");
    }
    let window = m.usize("attention.sliding_window")?;
    ensure!(window > 0, "{path}: {arch}.attention.sliding_window is 0");
    let full_dim = m.usize("attention.key_length")?;
    let swa_dim = m.usize("attention.key_length_swa")?;
    for (k, d) in [
        ("attention.key_length", full_dim),
        ("attention.key_length_swa", swa_dim),
    ] {
        ensure!(
            d > 0 && d % 2 == 0,
            "{path}: {arch}.{k} {d} must be positive and even"
        );
    }
    for (k, d) in [
        ("attention.value_length", full_dim),
        ("attention.value_length_swa", swa_dim),
    ] {
        if m.has(k) {
            let x = m.usize(k)?;
            ensure!(
                x == d,
                "{path}: {arch}.{k} {x} differs from the key length {d} (Gemma 4's v and k \
                 heads have one size)"
            );
        }
    }

    // RoPE: the full layers' theta, the sliding layers' (the full one's when absent, as
    // llama.cpp), every dim rotated NeoX-style, proportional RoPE as rope_freqs.weight.
    match m.str_opt("rope.scaling.type")? {
        None | Some("none") => {}
        Some(other) => bail!(
            "{path}: {arch}.rope.scaling.type {other:?} is not supported for gemma4 (its \
             converter writes none)"
        ),
    }
    for (k, d) in [
        ("rope.dimension_count", full_dim),
        ("rope.dimension_count_swa", swa_dim),
    ] {
        if m.has(k) {
            let n = m.usize(k)?;
            ensure!(
                n == d,
                "{path}: {arch}.{k} {n} is not the head size {d}: a partial NeoX rotation is not \
                 supported (Gemma 4's proportional RoPE is the rope_freqs.weight factors)"
            );
        }
    }
    let theta = m.f64_or("rope.freq_base", 10000.0)?;
    let theta_swa = m.f64_or("rope.freq_base_swa", theta)?;
    let full_rope = match proportional_rope(f, path, full_dim)? {
        Some((pairs, factor)) => json!({
            "rope_type": "proportional",
            "partial_rotary_factor": 2.0 * pairs as f64 / full_dim as f64,
            "factor": factor,
            "rope_theta": theta,
        }),
        None => json!({"rope_type": "default", "rope_theta": theta}),
    };

    // KV sharing from layer n − shared_kv_layers on.
    let shared = m.usize_or("attention.shared_kv_layers", 0)?;
    ensure!(
        shared < n_layers,
        "{path}: {arch}.attention.shared_kv_layers {shared} leaves no layer to compute k and v \
         (block_count {n_layers})"
    );
    let first_shared = n_layers - shared;
    // attention_k_eq_v: the full layers that compute k and v have no attn_v (llama.cpp uses
    // the k projection's output as v when attn_v is absent).
    let has_v = |l: usize| f.tensor_info(&format!("blk.{l}.attn_v.weight")).is_ok();
    let full_owners: Vec<usize> = (0..first_shared).filter(|&l| !sliding[l]).collect();
    let k_eq_v = full_owners.iter().any(|&l| !has_v(l));
    if k_eq_v {
        if let Some(l) = full_owners.iter().find(|&&l| has_v(l)) {
            let without = full_owners.iter().find(|&&l| !has_v(l)).expect("k_eq_v");
            bail!(
                "{path}: full-attention layer {without} has no blk.{without}.attn_v.weight (v from \
                 the k projection) but layer {l} has one: lorafit needs one choice for every full \
                 layer"
            );
        }
    }
    let per_layer_config: serde_json::Map<String, Value> = (0..n_layers)
        .map(|l| {
            let d = if sliding[l] { swa_dim } else { full_dim };
            (
                l.to_string(),
                json!({"head_dim": d, "num_key_value_heads": kv.v[l]}),
            )
        })
        .collect();
    let kv_of = |slides: bool| {
        (0..n_layers)
            .find(|&l| sliding[l] == slides)
            .map(|l| kv.v[l])
    };
    // The MLP widths are set per layer from the array (spec_from_gguf); the flag says whether
    // they are Gemma 4's double-wide pattern.
    let base_ff = ff.v.first().copied().unwrap_or(0);
    let double_wide = shared > 0
        && ff.v.iter().enumerate().all(|(l, &x)| {
            x == if l < first_shared {
                base_ff
            } else {
                2 * base_ff
            }
        });
    let per_layer_input = m.usize("embedding_length_per_layer_input")?;
    let per_layer_vocab = f
        .tensor_info("per_layer_token_embd.weight")
        .ok()
        .and_then(|t| t.torch_shape().first().copied());
    // llama.cpp loads the per-layer tensors only with a width, and refuses a file with tensors
    // it did not load.
    ensure!(
        per_layer_input > 0 || per_layer_vocab.is_none(),
        "{path}: {arch}.embedding_length_per_layer_input is 0, but the file has the per-layer \
         input tensors (per_layer_token_embd.weight)"
    );
    let moe = m.usize_or("expert_count", 0)? > 0
        || (0..n_layers).any(|l| {
            f.tensor_info(&format!("blk.{l}.ffn_gate_inp.weight"))
                .is_ok()
        });
    let mut out = vec![
        ("hidden_activation", json!("gelu_pytorch_tanh")),
        ("head_dim", json!(swa_dim)),
        ("global_head_dim", json!(full_dim)),
        (
            "num_key_value_heads",
            json!(kv_of(true).or(kv_of(false)).unwrap_or(1)),
        ),
        ("layer_types", layer_types(&sliding)),
        ("sliding_window", json!(window)),
        ("per_layer_config", Value::Object(per_layer_config)),
        ("attention_k_eq_v", json!(k_eq_v)),
        ("num_kv_shared_layers", json!(shared)),
        ("use_double_wide_mlp", json!(double_wide)),
        ("hidden_size_per_layer_input", json!(per_layer_input)),
        (
            "final_logit_softcapping",
            json!(m.f64_opt("final_logit_softcapping")?),
        ),
        ("enable_moe_block", json!(moe)),
        (
            "rope_parameters",
            json!({
                "full_attention": full_rope,
                "sliding_attention": {"rope_type": "default", "rope_theta": theta_swa},
            }),
        ),
    ];
    if k_eq_v {
        out.push(("num_global_key_value_heads", json!(kv_of(false))));
    }
    if let Some(v) = per_layer_vocab {
        out.push(("vocab_size_per_layer_input", json!(v)));
    }
    Ok(out)
}

/// The metadata of a GGUF file as the `config.json` its family file reads (Hugging Face key
/// names, values as llama.cpp's converter derived them).
pub fn config_from_gguf(f: &GgufFile) -> Result<(GgufArch, Value)> {
    let path = f.path().display().to_string();
    let arch_name = f.arch()?;
    let Some(arch) = GgufArch::from_name(arch_name) else {
        bail!(
            "{path}: GGUF architecture {arch_name:?} is not supported (supported: {})",
            SUPPORTED_GGUF_ARCHITECTURES.join(", ")
        );
    };
    let m = Meta { f, arch: arch_name };
    let hidden = m.usize("embedding_length")?;
    let n_layers = m.usize("block_count")?;
    let required = |k: &str| format!("GGUF {path}: metadata key '{arch_name}.{k}' is missing");
    // Scalars or per-layer arrays (llama.cpp reads all three with get_key_or_arr). lorafit has
    // one head count for every layer; Gemma 4's kv heads and MLP widths may vary by layer.
    let n_heads = m
        .per_layer("attention.head_count", n_layers)?
        .with_context(|| required("attention.head_count"))?
        .positive(&path)?
        .uniform(&path, arch_name)?;
    ensure!(n_heads > 0, "{path}: {arch_name}.attention.head_count is 0");
    let kv_heads = match m.per_layer("attention.head_count_kv", n_layers)? {
        Some(kv) => kv.positive(&path)?,
        None => PerLayer {
            key: m.key("attention.head_count_kv"),
            v: vec![n_heads; n_layers],
            one: Some(n_heads),
        },
    };
    // Checked here so that the error names the GGUF key, not the config field it becomes.
    for (l, &kv) in kv_heads.v.iter().enumerate() {
        ensure!(
            n_heads % kv == 0,
            "{path}: {}: layer {l}: num_attention_heads {n_heads} is not a multiple of its {kv} key/value heads",
            kv_heads.key
        );
    }
    let ff = m
        .per_layer("feed_forward_length", n_layers)?
        .with_context(|| required("feed_forward_length"))?
        .positive(&path)?;
    let (n_kv_heads, intermediate) = if arch == GgufArch::Gemma4 {
        (
            kv_heads.v.first().copied().unwrap_or(n_heads),
            ff.v.first().copied().unwrap_or(0),
        )
    } else {
        (
            kv_heads.uniform(&path, arch_name)?,
            ff.uniform(&path, arch_name)?,
        )
    };
    // The embedding's rows are the model's vocab (Gemma 3 files trim it to the tokenizer).
    let embd = f.tensor_info("token_embd.weight")?.torch_shape();
    ensure!(
        embd.len() == 2 && embd[1] == hidden,
        "{path}: token_embd.weight has shape {embd:?}, expected [vocab, {hidden}]"
    );
    let vocab = embd[0];
    // llama.cpp sizes token_embd by the vocabulary and refuses any other row count.
    if let Some(tokens) = f.get("tokenizer.ggml.tokens").and_then(MetaValue::as_array) {
        ensure!(
            tokens.len() == vocab,
            "{path}: token_embd.weight has {vocab} rows (GGUF dims {:?}), but the vocabulary \
             (tokenizer.ggml.tokens) has {} tokens",
            embd.iter().rev().collect::<Vec<_>>(),
            tokens.len()
        );
    }
    // As llama.cpp: the head size is key_length, else embedding_length / head_count;
    // rope.dimension_count is the number of rotated dims.
    let (head_dim, head_dim_from) = if m.has("attention.key_length") {
        (
            m.usize("attention.key_length")?,
            m.key("attention.key_length"),
        )
    } else {
        (
            hidden / n_heads,
            format!(
                "{} {hidden} / {} {n_heads}",
                m.key("embedding_length"),
                m.key("attention.head_count")
            ),
        )
    };
    // Gemma 4 checks its two rotary dims itself.
    if arch != GgufArch::Gemma4 && m.has("rope.dimension_count") {
        let rotated = m.usize("rope.dimension_count")?;
        ensure!(
            rotated == head_dim,
            "{path}: {} is {rotated}, but the head size is {head_dim} ({head_dim_from}): \
             rotating only part of each head (partial RoPE) is not supported for architecture \
             {arch_name}{}",
            m.key("rope.dimension_count"),
            if arch == GgufArch::Llama {
                " (llama.cpp refuses it too)"
            } else {
                ""
            }
        );
    }
    let max_pos = m.usize_or("context_length", 4096)?;
    let mut config = json!({
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": m.f64_or("attention.layer_norm_rms_epsilon", 1e-5)?,
        "tie_word_embeddings": f.tensor_info("output.weight").is_err(),
        "attention_bias": f.tensor_info("blk.0.attn_q.bias").is_ok(),
        "max_position_embeddings": max_pos,
        "bos_token_id": token_id(f, "tokenizer.ggml.bos_token_id")?,
        "eos_token_id": token_id(f, "tokenizer.ggml.eos_token_id")?,
    });
    let obj = config.as_object_mut().expect("an object");
    let mut set = |k: &str, v: Value| {
        obj.insert(k.to_string(), v);
    };
    match arch {
        GgufArch::Llama => {
            set("rope_theta", json!(m.f64_or("rope.freq_base", 10000.0)?));
            set("rope_scaling", rope_scaling(&m, &path)?);
        }
        GgufArch::Gemma2 | GgufArch::Gemma3 => {
            let gemma3 = arch == GgufArch::Gemma3;
            set("hidden_activation", json!("gelu_pytorch_tanh"));
            // llama.cpp: head_dim^-½, except the 27B models' (hidden/heads)^-½.
            let is_27b = n_layers == if gemma3 { 62 } else { 46 };
            let scalar = if is_27b { hidden / n_heads } else { head_dim };
            set("query_pre_attn_scalar", json!(scalar));
            let (window, sliding) = if gemma3 {
                // No window (or 0): every layer global.
                match m.usize_or("attention.sliding_window", 0)? {
                    0 => (None, vec![false; n_layers]),
                    w => (Some(w), sliding_layers(&m, n_layers, 6, &path)?),
                }
            } else {
                (
                    Some(m.usize_or("attention.sliding_window", 4096)?),
                    sliding_layers(&m, n_layers, 2, &path)?,
                )
            };
            set("sliding_window", json!(window));
            set("layer_types", layer_types(&sliding));
            if gemma3 {
                set(
                    "attn_logit_softcapping",
                    json!(m.f64_opt("attn_logit_softcapping")?),
                );
                set(
                    "final_logit_softcapping",
                    json!(m.f64_opt("final_logit_softcapping")?),
                );
                let mut global = rope_scaling(&m, &path)?;
                if global.is_null() {
                    global = json!({"rope_type": "default"});
                }
                global["rope_theta"] = json!(m.f64_or("rope.freq_base", 1e6)?);
                set(
                    "rope_parameters",
                    json!({
                        "full_attention": global,
                        "sliding_attention": {
                            "rope_type": "default",
                            "rope_theta": m.f64_or("rope.freq_base_swa", 10000.0)?,
                        },
                    }),
                );
            } else {
                // llama.cpp's defaults when the converter wrote none.
                set(
                    "attn_logit_softcapping",
                    json!(m.f64_or("attn_logit_softcapping", 50.0)?),
                );
                set(
                    "final_logit_softcapping",
                    json!(m.f64_or("final_logit_softcapping", 30.0)?),
                );
                set("rope_theta", json!(m.f64_or("rope.freq_base", 10000.0)?));
                set("rope_scaling", rope_scaling(&m, &path)?);
            }
        }
        GgufArch::Gemma4 => {
            for (k, v) in gemma4_config(&m, &path, n_layers, &kv_heads, &ff)? {
                set(k, v);
            }
        }
        GgufArch::MiniCpm => {
            // Without the keys, MiniCPM-1B/2B's values (scale_emb 12, scale_depth 1.4,
            // dim_model_base 256).
            set("scale_emb", json!(m.f64_or("embedding_scale", 12.0)?));
            let sqrt_l = (n_layers as f64).sqrt();
            let residual = m.f64_or("residual_scale", 1.4 / sqrt_l)?;
            set("scale_depth", json!(residual * sqrt_l));
            let logit_scale = m.f64_or("logit_scale", hidden as f64 / 256.0)?;
            ensure!(
                logit_scale > 0.0,
                "{path}: {arch_name}.logit_scale must be positive"
            );
            set("dim_model_base", json!(hidden as f64 / logit_scale));
            set("rope_theta", json!(m.f64_or("rope.freq_base", 10000.0)?));
            let long = f.tensor_info("rope_factors_long.weight").is_ok();
            let short = f.tensor_info("rope_factors_short.weight").is_ok();
            let kind = m.str_opt("rope.scaling.type")?;
            let scaling = if long || short || kind == Some("longrope") {
                ensure!(
                    long && short,
                    "{path}: LongRoPE needs both rope_factors_long.weight and \
                     rope_factors_short.weight"
                );
                let factors = |name: &str| -> Result<Vec<f64>> {
                    Ok(f.tensor_f32(name)?.into_iter().map(|x| x as f64).collect())
                };
                // The short factors hold up to the original context (the converter writes
                // none for MiniCPM: then the whole context), cos/sin × the attention factor
                // (computed from the two lengths when not given).
                let mut s = json!({
                    "rope_type": "longrope",
                    "long_factor": factors("rope_factors_long.weight")?,
                    "short_factor": factors("rope_factors_short.weight")?,
                    "original_max_position_embeddings":
                        m.usize_or("rope.scaling.original_context_length", max_pos)?,
                });
                if let Some(a) = m.f64_opt("rope.scaling.attn_factor")? {
                    s["attention_factor"] = json!(a);
                }
                s
            } else {
                rope_scaling(&m, &path)?
            };
            set("rope_scaling", scaling);
        }
    }
    Ok((arch, config))
}

/// What a `gemma4` GGUF says beyond its config.json form: each layer's MLP width (the
/// `feed_forward_length` array), the exact rotated pairs of `rope_freqs.weight`, and the k/v
/// donors of the KV-sharing layers, which must be llama.cpp's (`n_kv − 2` for sliding layers,
/// `n_kv − 1` for full ones, `n_kv` = block_count − shared_kv_layers). The score scale is 1
/// (llama.cpp's gemma4 reads no `attention.scale`).
fn gemma4_spec(m: &Meta, path: &str, spec: &mut ModelSpec) -> Result<()> {
    let n = spec.n_layers;
    let ff = m
        .per_layer("feed_forward_length", n)?
        .context("feed_forward_length was read before")?;
    for (layer, &w) in spec.layers.iter_mut().zip(&ff.v) {
        layer.intermediate = w;
    }
    spec.intermediate = ff.v.iter().copied().max().unwrap_or(0);
    if let Some(full) = spec
        .layers
        .iter()
        .find(|l| l.window.is_none())
        .map(|l| l.rope)
    {
        let dims = spec.ropes[full].dims;
        if let Some((rotated_pairs, factor)) = proportional_rope(m.f, path, dims)? {
            spec.ropes[full].scaling = RopeScaling::Proportional {
                rotated_pairs,
                factor,
            };
        }
    }
    let first_shared = spec
        .layers
        .iter()
        .position(|l| l.kv_source.is_some())
        .unwrap_or(n);
    for (l, layer) in spec.layers.iter().enumerate() {
        let Some(donor) = layer.kv_source else {
            continue;
        };
        let slides = layer.window.is_some();
        let llama_cpp = first_shared.checked_sub(if slides { 2 } else { 1 });
        ensure!(
            llama_cpp == Some(donor),
            "{path}: layer {l} ({}) shares the k/v of layer {donor}, the last {} layer that \
             computes its own, but llama.cpp reads it from layer {} ({}.attention.shared_kv_layers \
             with this sliding pattern): not supported",
            if slides { "sliding" } else { "full" },
            if slides { "sliding" } else { "full" },
            llama_cpp.map_or("none".to_string(), |d| d.to_string()),
            m.arch
        );
    }
    Ok(())
}

/// Model geometry from the metadata of a GGUF file.
pub fn spec_from_gguf(f: &GgufFile) -> Result<ModelSpec> {
    let path = f.path().display().to_string();
    let (arch, config) = config_from_gguf(f)?;
    let c: HfConfig =
        serde_json::from_value(config.clone()).with_context(|| format!("{path}: GGUF metadata"))?;
    let mut spec = match arch {
        GgufArch::Llama => super::llama::spec_from_hf(&c, Family::Llama),
        GgufArch::Gemma2 => super::gemma::spec_from_hf(&c, &config, Family::Gemma2),
        GgufArch::Gemma3 => super::gemma::spec_from_hf(&c, &config, Family::Gemma3),
        GgufArch::Gemma4 => super::gemma4::spec_from_hf(&config),
        GgufArch::MiniCpm => super::minicpm::spec_from_hf(&c, &config),
    }
    .with_context(|| format!("{path}: GGUF metadata"))?;
    if arch.shifted_norms() {
        // The converter stored every Gemma 2/3 norm as 1 + w.
        spec.norm_offset = 0.0;
    }
    let m = Meta {
        f,
        arch: arch.name(),
    };
    if arch == GgufArch::Gemma4 {
        gemma4_spec(&m, &path, &mut spec)?;
    } else if let Some(scale) = m.f64_opt("attention.scale")? {
        ensure!(
            scale > 0.0,
            "{path}: {}.attention.scale must be positive",
            arch.name()
        );
        for layer in &mut spec.layers {
            layer.attn_scale = scale as f32;
        }
    }
    spec.validate().with_context(|| path.clone())?;
    Ok(spec)
}
