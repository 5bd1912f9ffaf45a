//! Llama-architecture GGUF files as a model source: the geometry from GGUF metadata, tensors
//! renamed to Hugging Face's names, and the q/k rows that llama.cpp's converter permuted for its
//! RoPE layout put back in Hugging Face's order.

use super::config::{Family, HfConfig, ModelSpec};
use super::gguf::{unpermute_qk_rows, GgmlType, GgufFile};
use super::weights::{QuantWeight, TensorSource, Weight};
use crate::tensor::cuda::QuantKind;
use crate::tensor::Device;
use anyhow::{bail, ensure, Context, Result};

/// GGUF tensor name for a Hugging Face name (llama architecture).
fn gguf_name(hf: &str) -> Option<String> {
    if let Some(rest) = hf.strip_prefix("model.layers.") {
        let (layer, leaf) = rest.split_once('.')?;
        let g = match leaf {
            "input_layernorm.weight" => "attn_norm.weight",
            "post_attention_layernorm.weight" => "ffn_norm.weight",
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
    pub spec: ModelSpec,
}

impl GgufSource {
    pub fn open(path: &std::path::Path) -> Result<GgufSource> {
        let file = GgufFile::open(path)?;
        let spec = spec_from_gguf(&file)?;
        Ok(GgufSource { file, spec })
    }
}

impl TensorSource for GgufSource {
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let g = gguf_name(name).with_context(|| {
            format!("{}: no GGUF tensor corresponds to {name}", self.describe())
        })?;
        let info = self.file.tensor_info(&g)?;
        let shape = info.torch_shape();
        let mut data = self.file.tensor_f32(&g)?;
        // llama.cpp's converter permutes q and k rows (per head: [2, hd/2] -> [hd/2, 2]).
        let heads = if g.ends_with("attn_q.weight") {
            Some(self.spec.n_heads)
        } else if g.ends_with("attn_k.weight") {
            Some(self.spec.n_kv_heads)
        } else {
            None
        };
        if let Some(n_head) = heads {
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
        let g = gguf_name(name).with_context(|| {
            format!("{}: no GGUF tensor corresponds to {name}", self.describe())
        })?;
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
        let heads = if g.ends_with("attn_q.weight") {
            Some(self.spec.n_heads)
        } else if g.ends_with("attn_k.weight") {
            Some(self.spec.n_kv_heads)
        } else {
            None
        };
        let bytes = match heads {
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
        gguf_name(name).is_some_and(|g| self.file.tensor_info(&g).is_ok())
    }
    fn describe(&self) -> String {
        self.file.path().display().to_string()
    }
}

/// Model geometry from the metadata of a llama-architecture GGUF file.
pub fn spec_from_gguf(f: &GgufFile) -> Result<ModelSpec> {
    let arch = f.arch()?;
    if arch != "llama" {
        bail!(
            "{}: GGUF architecture {arch:?} is not supported (supported: llama)",
            f.path().display()
        );
    }
    let k = |s: &str| format!("{arch}.{s}");
    let n_heads = f.get_usize(&k("attention.head_count"))?;
    let hidden = f.get_usize(&k("embedding_length"))?;
    let vocab = match f.get_usize(&k("vocab_size")) {
        Ok(v) => v,
        Err(_) => f.get_str_array("tokenizer.ggml.tokens")?.len(),
    };
    let head_dim = f
        .get_usize(&k("rope.dimension_count"))
        .unwrap_or(hidden / n_heads);
    let rope_scaling = match (
        f.get_str(&k("rope.scaling.type")).ok(),
        f.get_f32(&k("rope.scaling.factor")).ok(),
    ) {
        (Some("linear"), Some(factor)) => {
            serde_json::json!({"rope_type": "linear", "factor": factor as f64})
        }
        (None | Some("none"), _) => serde_json::Value::Null,
        (Some(other), _) => bail!(
            "{}: rope scaling {other:?} is not supported",
            f.path().display()
        ),
    };
    // The metadata as the config.json the family file reads.
    let config = serde_json::json!({
        "hidden_size": hidden,
        "intermediate_size": f.get_usize(&k("feed_forward_length"))?,
        "num_hidden_layers": f.get_usize(&k("block_count"))?,
        "num_attention_heads": n_heads,
        "num_key_value_heads": f.get_usize(&k("attention.head_count_kv")).unwrap_or(n_heads),
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": f.get_f32(&k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5) as f64,
        "rope_theta": f.get_f32(&k("rope.freq_base")).unwrap_or(10000.0) as f64,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": f.tensor_info("output.weight").is_err(),
        "attention_bias": f.tensor_info("blk.0.attn_q.bias").is_ok(),
        "max_position_embeddings": f.get_usize(&k("context_length")).unwrap_or(4096),
        "bos_token_id": f.get_u32("tokenizer.ggml.bos_token_id").ok(),
        "eos_token_id": f.get_u32("tokenizer.ggml.eos_token_id").ok(),
    });
    let c: HfConfig = serde_json::from_value(config)
        .with_context(|| format!("{}: GGUF metadata", f.path().display()))?;
    let spec = super::llama::spec_from_hf(&c, Family::Llama)?;
    spec.validate()
        .with_context(|| format!("{}", f.path().display()))?;
    Ok(spec)
}
