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
//! An `{arch}.attention.scale` key, where present, sets every layer's score scale (llama.cpp's
//! Gemma graphs do not read it; `scripts/make_gguf_family_fixtures.py` writes it when a
//! checkpoint's `query_pre_attn_scalar` is not the one llama.cpp would infer).

use super::config::{Family, HfConfig, ModelSpec};
use super::gguf::{unpermute_qk_rows, GgmlType, GgufFile, MetaValue};
use super::weights::{QuantWeight, TensorSource, Weight};
use crate::tensor::cuda::QuantKind;
use crate::tensor::Device;
use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

/// The GGUF architectures lorafit reads, for error messages.
pub const SUPPORTED_GGUF_ARCHITECTURES: &[&str] = &["llama", "gemma2", "gemma3", "minicpm"];

/// A GGUF `general.architecture` that lorafit reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufArch {
    Llama,
    Gemma2,
    Gemma3,
    MiniCpm,
}

impl GgufArch {
    pub fn from_name(name: &str) -> Option<GgufArch> {
        Some(match name {
            "llama" => GgufArch::Llama,
            "gemma2" => GgufArch::Gemma2,
            "gemma3" => GgufArch::Gemma3,
            "minicpm" => GgufArch::MiniCpm,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            GgufArch::Llama => "llama",
            GgufArch::Gemma2 => "gemma2",
            GgufArch::Gemma3 => "gemma3",
            GgufArch::MiniCpm => "minicpm",
        }
    }

    /// llama.cpp's converter permuted the q/k rows (`LlamaModel.permute`).
    pub fn permutes_qk(self) -> bool {
        matches!(self, GgufArch::Llama | GgufArch::MiniCpm)
    }

    /// Gemma's four norms per layer.
    fn sandwich_norms(self) -> bool {
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
            _ => return None,
        };
        return Some(format!("blk.{layer}.{g}"));
    }
    Some(
        match hf {
            "model.embed_tokens.weight" => "token_embd.weight",
            "model.norm.weight" => "output_norm.weight",
            "lm_head.weight" => "output.weight",
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
}

impl TensorSource for GgufSource {
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let g = self.name(name)?;
        let info = self.file.tensor_info(&g)?;
        let shape = info.torch_shape();
        let mut data = self.file.tensor_f32(&g)?;
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
        ensure!(
            shape == want,
            "{}: tensor {g} has shape {shape:?}, but the model needs {want:?}",
            self.describe()
        );
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
    let n_heads = m.usize("attention.head_count")?;
    let hidden = m.usize("embedding_length")?;
    let n_layers = m.usize("block_count")?;
    ensure!(n_heads > 0, "{path}: {arch_name}.attention.head_count is 0");
    // The embedding's rows are the model's vocab (Gemma 3 files trim it to the tokenizer).
    let embd = f.tensor_info("token_embd.weight")?.torch_shape();
    ensure!(
        embd.len() == 2 && embd[1] == hidden,
        "{path}: token_embd.weight has shape {embd:?}, expected [vocab, {hidden}]"
    );
    let vocab = embd[0];
    let head_dim = if m.has("attention.key_length") {
        m.usize("attention.key_length")?
    } else {
        m.usize_or("rope.dimension_count", hidden / n_heads)?
    };
    let max_pos = m.usize_or("context_length", 4096)?;
    let mut config = json!({
        "hidden_size": hidden,
        "intermediate_size": m.usize("feed_forward_length")?,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": m.usize_or("attention.head_count_kv", n_heads)?,
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
        GgufArch::MiniCpm => super::minicpm::spec_from_hf(&c, &config),
    }
    .with_context(|| format!("{path}: GGUF metadata"))?;
    if arch.sandwich_norms() {
        // The converter stored every Gemma norm as 1 + w.
        spec.norm_offset = 0.0;
    }
    let m = Meta {
        f,
        arch: arch.name(),
    };
    if let Some(scale) = m.f64_opt("attention.scale")? {
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
