//! Model geometry: Hugging Face `config.json` (or GGUF metadata) resolved into one `ModelSpec`
//! that the rest of the code reads. Unknown architectures and inconsistent fields are errors here,
//! before any weight is read.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::Path;

/// The model families lorafit runs. They share one layer implementation (`model::llama`); the
/// differences are flags on `ModelSpec`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (all frequencies scaled by 1/factor).
    Linear {
        factor: f64,
    },
    /// Llama 3.1's piecewise frequency scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub family: Family,
    pub hidden: usize,
    pub intermediate: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_embeddings: bool,
    /// Bias on the q, k and v projections (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Sliding-window attention span in tokens, where the family applies one.
    pub sliding_window: Option<usize>,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    /// Final logit softcap `c`: logits `z` become `c·tanh(z/c)` (Gemma 2). `None`: no cap.
    pub final_logit_softcap: Option<f32>,
}

#[derive(Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    /// transformers ≥ 5 keeps rope_theta and the scaling here.
    rope_parameters: Option<serde_json::Value>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    sliding_window: Option<serde_json::Value>,
    use_sliding_window: Option<bool>,
    max_position_embeddings: Option<usize>,
    bos_token_id: Option<serde_json::Value>,
    eos_token_id: Option<serde_json::Value>,
}

fn first_id(v: &Option<serde_json::Value>) -> Option<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| x as u32),
        Some(serde_json::Value::Array(a)) => a.first().and_then(|x| x.as_u64()).map(|x| x as u32),
        _ => None,
    }
}

impl ModelSpec {
    pub fn from_config_file(path: &Path) -> Result<ModelSpec> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        ModelSpec::from_config_json(&text).with_context(|| format!("in {}", path.display()))
    }

    pub fn from_config_json(text: &str) -> Result<ModelSpec> {
        let c: HfConfig =
            serde_json::from_str(text).context("config.json is not a valid model config")?;
        let arch = c
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .unwrap_or_default();
        let family = match (arch.as_str(), c.model_type.as_deref()) {
            ("LlamaForCausalLM", _) | (_, Some("llama")) => Family::Llama,
            ("MistralForCausalLM", _) | (_, Some("mistral")) => Family::Mistral,
            ("Qwen2ForCausalLM", _) | (_, Some("qwen2")) => Family::Qwen2,
            ("Qwen3ForCausalLM", _) | (_, Some("qwen3")) => Family::Qwen3,
            _ => bail!(
                "unsupported architecture {arch:?} (model_type {:?}): lorafit runs LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM",
                c.model_type
            ),
        };
        let n_kv_heads = c.num_key_value_heads.unwrap_or(c.num_attention_heads);
        let head_dim = c.head_dim.unwrap_or(c.hidden_size / c.num_attention_heads);
        let rope_scaling =
            parse_rope_scaling(c.rope_scaling.as_ref().or(c.rope_parameters.as_ref()))?;
        let rope_theta = c.rope_theta.or_else(|| {
            c.rope_parameters
                .as_ref()
                .and_then(|p| p.get("rope_theta"))
                .and_then(|v| v.as_f64())
        });
        let window = c
            .sliding_window
            .as_ref()
            .and_then(|v| v.as_u64())
            .map(|w| w as usize);
        let sliding_window = match family {
            Family::Mistral => window,
            // Qwen2/3 configs carry a window but only apply it with use_sliding_window.
            Family::Qwen2 | Family::Qwen3 if c.use_sliding_window == Some(true) => window,
            _ => None,
        };
        let spec = ModelSpec {
            family,
            hidden: c.hidden_size,
            intermediate: c.intermediate_size,
            n_layers: c.num_hidden_layers,
            n_heads: c.num_attention_heads,
            n_kv_heads,
            head_dim,
            vocab: c.vocab_size,
            rms_eps: c.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta: rope_theta.unwrap_or(10000.0),
            rope_scaling,
            tie_embeddings: c.tie_word_embeddings.unwrap_or(false),
            qkv_bias: family == Family::Qwen2 || c.attention_bias.unwrap_or(false),
            qk_norm: family == Family::Qwen3,
            sliding_window,
            max_position_embeddings: c.max_position_embeddings.unwrap_or(4096),
            bos_token_id: first_id(&c.bos_token_id),
            eos_token_id: first_id(&c.eos_token_id),
            final_logit_softcap: None,
        };
        spec.validate()?;
        Ok(spec)
    }

    pub fn validate(&self) -> Result<()> {
        if self.n_heads == 0
            || self.n_kv_heads == 0
            || !self.n_heads.is_multiple_of(self.n_kv_heads)
        {
            bail!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.n_heads,
                self.n_kv_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!("head_dim {} must be even for RoPE", self.head_dim);
        }
        if self.hidden == 0 || self.vocab == 0 || self.n_layers == 0 {
            bail!("hidden_size, vocab_size and num_hidden_layers must be positive");
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// RoPE inverse frequencies (`head_dim/2` of them) after the configured scaling, as
    /// Hugging Face computes them.
    pub fn inv_freq(&self) -> Vec<f32> {
        let half = self.head_dim / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / self.head_dim as f64))
            .collect();
        let scaled: Vec<f64> = match &self.rope_scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let low_wavelen = original_max_position_embeddings / low_freq_factor;
                let high_wavelen = original_max_position_embeddings / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen > low_wavelen {
                            f / factor
                        } else if wavelen < high_wavelen {
                            f
                        } else {
                            let smooth = (original_max_position_embeddings / wavelen
                                - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        scaled.into_iter().map(|f| f as f32).collect()
    }

    /// Number of parameters of the base model (for FLOP estimates).
    pub fn param_count(&self) -> usize {
        let attn = self.hidden * (self.q_dim() + 2 * self.kv_dim()) + self.q_dim() * self.hidden;
        let mlp = 3 * self.hidden * self.intermediate;
        let emb = self.vocab * self.hidden * if self.tie_embeddings { 1 } else { 2 };
        self.n_layers * (attn + mlp) + emb
    }
}

fn parse_rope_scaling(v: Option<&serde_json::Value>) -> Result<RopeScaling> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|x| x.as_str())
        .unwrap_or("default");
    let num = |k: &str| -> Result<f64> {
        v.get(k)
            .and_then(|x| x.as_f64())
            .with_context(|| format!("rope_scaling.{k} is missing"))
    };
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        },
        other => bail!("rope_scaling type {other:?} is not supported (supported: linear, llama3)"),
    })
}
