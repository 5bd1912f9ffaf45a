//! Model geometry: Hugging Face `config.json` (or GGUF metadata) resolved into one `ModelSpec`
//! that the rest of the code reads, with one `LayerSpec` per decoder layer. The family files
//! (`llama.rs`, `gemma.rs`, `minicpm.rs`) turn their configs into these descriptions; the runner
//! (`runner.rs`, `layer.rs`) executes any list of them. Unknown architectures and inconsistent
//! fields are errors here, before any weight is read.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use std::path::Path;

/// The model families lorafit runs. Each is one file that builds a `ModelSpec`; the layers
/// they describe run through one implementation (`model::layer`, `model::runner`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Gemma2,
    Gemma3,
    Gemma4,
    MiniCpm,
}

impl Family {
    /// The Hugging Face architecture name of the family, for messages.
    pub fn hf_name(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Mistral => "MistralForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Gemma2 => "Gemma2ForCausalLM",
            Family::Gemma3 => "Gemma3ForCausalLM",
            Family::Gemma4 => "Gemma4ForCausalLM",
            Family::MiniCpm => "MiniCPMForCausalLM",
        }
    }

    /// Whether transformers' class for the family reads config key `key` (`attention_bias`,
    /// `mlp_bias`): Mistral has no biases and Qwen2 always the same ones (q, k, v), whatever
    /// `attention_bias` says; only Llama's MLP has biases, with `mlp_bias`.
    pub fn reads_bias_key(self, key: &str) -> bool {
        match key {
            "attention_bias" => !matches!(self, Family::Mistral | Family::Qwen2),
            "mlp_bias" => self == Family::Llama,
            _ => false,
        }
    }

    /// transformers' value for `num_key_value_heads` and `head_dim` when `config.json` leaves
    /// them out, as the family's config class sets them; `None` is that class's derived value
    /// (`num_attention_heads`; `hidden_size / num_attention_heads`). They are not all the same:
    /// Mistral's class defaults to 8 kv heads, Qwen2's and Qwen3's to 32 (and Qwen3's head
    /// to 128), Gemma 2's and 3's to 4 kv heads of 256. Gemma 4 reads its own (`gemma4.rs`).
    pub fn absent_head_defaults(self) -> (Option<usize>, Option<usize>) {
        match self {
            Family::Llama | Family::MiniCpm | Family::Gemma4 => (None, None),
            Family::Mistral => (Some(8), None),
            Family::Qwen2 => (Some(32), None),
            Family::Qwen3 => (Some(32), Some(128)),
            Family::Gemma2 | Family::Gemma3 => (Some(4), Some(256)),
        }
    }
}

/// The architectures `from_config_json` accepts, for error messages.
pub const SUPPORTED_ARCHITECTURES: &str = "LlamaForCausalLM (also MiniCPM5), MistralForCausalLM, \
Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM (and the text model of \
Gemma3ForConditionalGeneration), Gemma4ForCausalLM (and the text model of \
Gemma4ForConditionalGeneration), MiniCPMForCausalLM";

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
    /// LongRoPE (MiniCPM, Phi-3): per-frequency divisors, `long` once a sequence reaches past
    /// `original_max_position_embeddings`, else `short`; cos and sin scaled by
    /// `attention_factor`.
    LongRope {
        short: Vec<f64>,
        long: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
    /// Gemma 4's proportional RoPE: the first `rotated_pairs` frequency pairs rotate with the
    /// default frequencies `θ^(-2i/dims)` (divided by `factor`); the others do not rotate
    /// (frequency 0: cos 1, sin 0).
    Proportional {
        rotated_pairs: usize,
        factor: f64,
    },
}

/// One rotary table: a layer names it by index into `ModelSpec::ropes`.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    pub theta: f64,
    pub scaling: RopeScaling,
    /// Dimensions per head the table covers (the head dim of the layers that read it).
    pub dims: usize,
}

impl RopeSpec {
    /// Whether the table's factors depend on the example's largest position (LongRoPE).
    pub fn depends_on_length(&self) -> bool {
        matches!(self.scaling, RopeScaling::LongRope { .. })
    }

    /// Inverse frequencies (`dims/2` of them) for a sequence whose largest position is
    /// `max_pos`, after the scaling, as Hugging Face computes them.
    pub fn inv_freq(&self, max_pos: usize) -> Vec<f32> {
        let half = self.dims / 2;
        let base: Vec<f64> = (0..half)
            .map(|i| 1.0 / self.theta.powf(2.0 * i as f64 / self.dims as f64))
            .collect();
        let scaled: Vec<f64> = match &self.scaling {
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
            RopeScaling::LongRope {
                short,
                long,
                original_max_position_embeddings,
                ..
            } => {
                let ext = if max_pos + 1 > *original_max_position_embeddings {
                    long
                } else {
                    short
                };
                base.iter().zip(ext).map(|(f, e)| f / e).collect()
            }
            RopeScaling::Proportional {
                rotated_pairs,
                factor,
            } => base
                .iter()
                .enumerate()
                .map(|(i, f)| if i < *rotated_pairs { f / factor } else { 0.0 })
                .collect(),
        };
        scaled.into_iter().map(|f| f as f32).collect()
    }

    /// The factor on cos and sin (1 except for LongRoPE).
    pub fn attention_factor(&self) -> f32 {
        match &self.scaling {
            RopeScaling::LongRope {
                attention_factor, ..
            } => *attention_factor as f32,
            _ => 1.0,
        }
    }
}

/// The MLP's gate activation: `down(act(gate(x)) * up(x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// `gelu_pytorch_tanh` (Gemma).
    GeluTanh,
}

/// One decoder layer as the runner executes it. Every layer is pre-norm:
/// `x1 = x + s·post_attn(attn(norm(x)))`, `out = x1 + s·post_mlp(mlp(norm(x1)))`, where the
/// post norms exist only with `sandwich_norms` and `s` is `residual_scale`.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSpec {
    /// Sliding-window span (key k visible to query q iff `pos[q] − pos[k] < window`).
    pub window: Option<u32>,
    /// Index into `ModelSpec::ropes`.
    pub rope: usize,
    /// Score scale (`head_dim^-½`, Gemma `query_pre_attn_scalar^-½`).
    pub attn_scale: f32,
    /// Attention logit softcap `c·tanh(s/c)` (Gemma 2).
    pub attn_softcap: Option<f32>,
    pub activation: Activation,
    pub intermediate: usize,
    /// Gemma's extra norms on the attention and MLP outputs, before their residual adds.
    pub sandwich_norms: bool,
    /// Factor on both residual branches (MiniCPM's `scale_depth/√L`).
    pub residual_scale: f32,
    /// Attention geometry of this layer (Gemma 4's full layers are wider than its sliding ones).
    pub head_dim: usize,
    pub n_kv_heads: usize,
    /// KV sharing (Gemma 4): this layer has no k/v projections and attends over the rotated k
    /// and normed v of the donor layer named here; the donor's dK and dV sum over its sharers.
    pub kv_source: Option<usize>,
    /// An unscaled per-head RMSNorm on v (Gemma 4).
    pub v_norm: bool,
    /// v is the k projection's output (before the k norm): Gemma 4's `attention_k_eq_v`.
    pub k_eq_v: bool,
}

impl LayerSpec {
    /// Whether this layer projects its own k and v (not a KV-sharing layer).
    pub fn owns_kv(&self) -> bool {
        self.kv_source.is_none()
    }
}

#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub family: Family,
    pub hidden: usize,
    /// The widest layer's MLP (every layer's, in the families so far).
    pub intermediate: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    /// The main rotary table (`ropes[0]`): theta and scaling.
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_embeddings: bool,
    /// Bias on the q, k and v projections (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// The sliding layers' window in tokens (every layer's for Mistral; Gemma's local layers';
    /// Qwen2/3's from `max_window_layers` on).
    pub sliding_window: Option<usize>,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    /// Final logit softcap `c`: logits `z` become `c·tanh(z/c)` (Gemma 2). `None`: no cap.
    pub final_logit_softcap: Option<f32>,
    /// One description per decoder layer.
    pub layers: Vec<LayerSpec>,
    /// The rotary tables the layers name (`ropes[0]` is the main one).
    pub ropes: Vec<RopeSpec>,
    /// Factor on the token embeddings (Gemma `√hidden`, MiniCPM `scale_emb`).
    pub embed_scale: Option<f32>,
    /// Round `embed_scale` to the compute dtype before it multiplies (transformers' Gemma casts
    /// √hidden to the embeddings' dtype: 55.4256 becomes 55.5 in bf16).
    pub embed_scale_in_weight_dtype: bool,
    /// Added to every RMSNorm weight at load: 1 for Gemma's `(1 + w)` norms in Hugging Face
    /// checkpoints (GGUF files store the sum already).
    pub norm_offset: f32,
    /// Factor on the final hidden states before the head (MiniCPM `dim_model_base/hidden`),
    /// folded into the final norm's weight at load.
    pub head_input_scale: Option<f32>,
    /// Prefix of the decoder's tensor names (`model.`; `model.language_model.` or
    /// `language_model.model.` inside multimodal Gemma 3 checkpoints) and of the head's.
    pub tensor_prefix: String,
    pub head_prefix: String,
    /// Gemma 4's per-layer inputs: width per layer (0: none). See `gemma4.rs`.
    pub per_layer_input: usize,
}

/// The fields of `config.json` that every family reads.
#[derive(Deserialize)]
pub struct HfConfig {
    pub architectures: Option<Vec<String>>,
    pub model_type: Option<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<serde_json::Value>,
    /// transformers ≥ 5 keeps rope_theta and the scaling here (Gemma 3: one entry per layer
    /// type).
    pub rope_parameters: Option<serde_json::Value>,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    pub hidden_act: Option<String>,
    /// Present and `null` is `Some(Value::Null)`, absent is `None` (Qwen2/3 then default to 4096).
    #[serde(default, deserialize_with = "present")]
    pub sliding_window: Option<serde_json::Value>,
    pub use_sliding_window: Option<bool>,
    /// Qwen2/3 without `layer_types`: the layers from this one on slide.
    pub max_window_layers: Option<usize>,
    pub layer_types: Option<Vec<String>>,
    pub max_position_embeddings: Option<usize>,
    pub bos_token_id: Option<serde_json::Value>,
    pub eos_token_id: Option<serde_json::Value>,
}

impl HfConfig {
    /// `raw` read as an `HfConfig`; where a value has the wrong type (`"hidden_size": "64"`) or
    /// a field is missing, an error that says so and quotes the field as written. `what` names
    /// the object (`config.json`, its `text_config`).
    pub fn from_raw(raw: &serde_json::Value, what: &str) -> Result<HfConfig> {
        serde_json::from_value(raw.clone()).or_else(|e| {
            // serde names the type it wanted, not the field: the same read from the object
            // printed one field a line gives the line, which holds the field.
            let pretty = serde_json::to_string_pretty(raw).unwrap_or_default();
            let line = serde_json::from_str::<HfConfig>(&pretty)
                .err()
                .and_then(|e| pretty.lines().nth(e.line().saturating_sub(1)))
                .map(|l| l.trim().trim_end_matches(','))
                .filter(|l| l.contains(':'));
            match line {
                Some(l) => bail!("{what} is not a valid model config: {e}, at {l}"),
                None => bail!("{what} is not a valid model config: {e}"),
            }
        })
    }
}

/// A field's value as written, `null` included (serde reads a present `null` as an absent field).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

/// `v` when it is a positive finite number, else an error naming `key`.
pub(super) fn positive(key: &str, v: f64) -> Result<f64> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        bail!("{key} is {v}; it must be a positive number")
    }
}

fn first_id(v: &Option<serde_json::Value>) -> Option<u32> {
    match v {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|x| x as u32),
        Some(serde_json::Value::Array(a)) => a.first().and_then(|x| x.as_u64()).map(|x| x as u32),
        _ => None,
    }
}

impl HfConfig {
    pub fn sliding_window(&self) -> Option<usize> {
        self.sliding_window
            .as_ref()
            .and_then(|v| v.as_u64())
            .map(|w| w as usize)
    }

    /// rope_theta, from the top level or `rope_parameters`.
    pub fn rope_theta(&self) -> Option<f64> {
        self.rope_theta.or_else(|| {
            self.rope_parameters
                .as_ref()
                .and_then(|p| p.get("rope_theta"))
                .and_then(|v| v.as_f64())
        })
    }

    /// Refuses sizes of 0 and numbers with which every forward would be NaN, naming the key.
    fn check_numbers(&self) -> Result<()> {
        let sizes = [
            ("hidden_size", Some(self.hidden_size)),
            ("num_hidden_layers", Some(self.num_hidden_layers)),
            ("num_attention_heads", Some(self.num_attention_heads)),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", Some(self.vocab_size)),
            ("max_position_embeddings", self.max_position_embeddings),
            ("intermediate_size", Some(self.intermediate_size)),
        ];
        for (key, v) in sizes {
            if v == Some(0) {
                bail!("{key} = 0: it must be positive");
            }
        }
        if let Some(theta) = self.rope_theta() {
            let key = match self.rope_theta {
                Some(_) => "rope_theta",
                None => "rope_parameters.rope_theta",
            };
            positive(key, theta)?;
        }
        if let Some(eps) = self.rms_norm_eps {
            if !(eps.is_finite() && eps >= 0.0) {
                bail!("rms_norm_eps is {eps}; it must be a number >= 0");
            }
        }
        Ok(())
    }

    /// `sliding_window` in tokens: `default` when the key is absent, `None` when it is `null`; 0
    /// or anything but a whole number is an error.
    pub fn window_or(&self, default: Option<usize>) -> Result<Option<usize>> {
        match &self.sliding_window {
            None => Ok(default),
            Some(serde_json::Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(0) | None => {
                    bail!("sliding_window is {v}; it must be a positive whole number or null")
                }
                Some(w) => Ok(Some(w as usize)),
            },
        }
    }

    /// The MLP activation of a SiLU family (Llama, Mistral, Qwen2/3, MiniCPM): `hidden_act`
    /// `silu` or its alias `swish` (transformers' default `silu` when absent); any other value is
    /// refused, since lorafit would run SiLU in its place.
    pub fn require_silu(&self, family: Family) -> Result<()> {
        match self.hidden_act.as_deref() {
            None | Some("silu") | Some("swish") => Ok(()),
            Some(other) => bail!(
                "hidden_act {other:?} is not supported for {}: lorafit runs its MLP with SiLU \
                 (hidden_act \"silu\" or \"swish\")",
                family.hf_name()
            ),
        }
    }

    /// A `ModelSpec` with this config's geometry and every layer a plain Llama layer (pre-norm,
    /// SiLU gate, one rotary table, `head_dim^-½` scores); families adjust what they change.
    pub fn llama_spec(&self, family: Family) -> Result<ModelSpec> {
        self.check_numbers()?;
        let (kv_default, head_default) = family.absent_head_defaults();
        if let (None, Some(kv)) = (self.num_key_value_heads, kv_default) {
            if !self.num_attention_heads.is_multiple_of(kv) {
                bail!(
                    "config.json has no num_key_value_heads, and {}'s default of {kv} does not \
                     divide num_attention_heads {}: add num_key_value_heads to config.json",
                    family.hf_name(),
                    self.num_attention_heads
                );
            }
        }
        let n_kv_heads = self
            .num_key_value_heads
            .or(kv_default)
            .unwrap_or(self.num_attention_heads);
        let head_dim = self
            .head_dim
            .or(head_default)
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1));
        let (rope_key, rope_value) = match &self.rope_scaling {
            Some(v) if !v.is_null() => ("rope_scaling", Some(v)),
            _ => ("rope_parameters", self.rope_parameters.as_ref()),
        };
        let rope_scaling =
            parse_rope_scaling(rope_key, rope_value, head_dim, self.max_position_embeddings)?;
        let rope_theta = self.rope_theta().unwrap_or(10000.0);
        let layer = LayerSpec {
            window: None,
            rope: 0,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            attn_softcap: None,
            activation: Activation::Silu,
            intermediate: self.intermediate_size,
            sandwich_norms: false,
            residual_scale: 1.0,
            head_dim,
            n_kv_heads,
            kv_source: None,
            v_norm: false,
            k_eq_v: false,
        };
        Ok(ModelSpec {
            family,
            hidden: self.hidden_size,
            intermediate: self.intermediate_size,
            n_layers: self.num_hidden_layers,
            n_heads: self.num_attention_heads,
            n_kv_heads,
            head_dim,
            vocab: self.vocab_size,
            rms_eps: self.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling: rope_scaling.clone(),
            tie_embeddings: self.tie_word_embeddings.unwrap_or(false),
            qkv_bias: self.attention_bias.unwrap_or(false),
            qk_norm: false,
            sliding_window: None,
            max_position_embeddings: self.max_position_embeddings.unwrap_or(4096),
            bos_token_id: first_id(&self.bos_token_id),
            eos_token_id: first_id(&self.eos_token_id),
            final_logit_softcap: None,
            layers: vec![layer; self.num_hidden_layers],
            ropes: vec![RopeSpec {
                theta: rope_theta,
                scaling: rope_scaling,
                dims: head_dim,
            }],
            embed_scale: None,
            embed_scale_in_weight_dtype: false,
            norm_offset: 0.0,
            head_input_scale: None,
            tensor_prefix: "model.".into(),
            head_prefix: String::new(),
            per_layer_input: 0,
        })
    }
}

impl ModelSpec {
    pub fn from_config_file(path: &Path) -> Result<ModelSpec> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        ModelSpec::from_config_json(&text).with_context(|| format!("in {}", path.display()))
    }

    pub fn from_config_json(text: &str) -> Result<ModelSpec> {
        let raw: serde_json::Value =
            serde_json::from_str(text).context("config.json is not valid JSON")?;
        if !raw.is_object() {
            let what = match &raw {
                serde_json::Value::Array(_) => "an array",
                serde_json::Value::String(_) => "a string",
                serde_json::Value::Number(_) => "a number",
                serde_json::Value::Bool(_) => "a boolean",
                _ => "null",
            };
            bail!(
                "config.json holds {what}, not a JSON object of model settings \
                 (\"architectures\", \"hidden_size\", …)"
            );
        }
        let arch = raw
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(|a| a.as_str())
            .unwrap_or_default()
            .to_string();
        let model_type = raw
            .get("model_type")
            .and_then(|m| m.as_str())
            .map(String::from);
        // Multimodal Gemma 3 checkpoints keep the language model's config under text_config.
        if arch == "Gemma3ForConditionalGeneration" || model_type.as_deref() == Some("gemma3") {
            if let Some(text) = raw.get("text_config") {
                refuse_unapplied_bias_flags(text, Family::Gemma3)?;
            }
            return super::gemma::spec_from_multimodal(&raw);
        }
        if arch == "Gemma4ForConditionalGeneration" || model_type.as_deref() == Some("gemma4") {
            if let Some(text) = raw.get("text_config") {
                refuse_unapplied_bias_flags(text, Family::Gemma4)?;
            }
            return super::gemma4::spec_from_multimodal(&raw);
        }
        if arch == "Gemma4ForCausalLM" || model_type.as_deref() == Some("gemma4_text") {
            refuse_unapplied_bias_flags(&raw, Family::Gemma4)?;
            let spec = super::gemma4::spec_from_hf(&raw)?;
            spec.validate()?;
            return Ok(spec);
        }
        let family = match (arch.as_str(), model_type.as_deref()) {
            ("LlamaForCausalLM", _) | (_, Some("llama")) => Family::Llama,
            ("MistralForCausalLM", _) | (_, Some("mistral")) => Family::Mistral,
            ("Qwen2ForCausalLM", _) | (_, Some("qwen2")) => Family::Qwen2,
            ("Qwen3ForCausalLM", _) | (_, Some("qwen3")) => Family::Qwen3,
            ("Gemma2ForCausalLM", _) | (_, Some("gemma2")) => Family::Gemma2,
            ("Gemma3ForCausalLM", _) | (_, Some("gemma3_text")) => Family::Gemma3,
            ("MiniCPMForCausalLM", _) | (_, Some("minicpm")) => Family::MiniCpm,
            _ => {
                let named = match (arch.is_empty(), model_type.as_deref()) {
                    (true, None) => "config.json names no architecture (it has neither \
                                     \"architectures\" nor \"model_type\")"
                        .to_string(),
                    (true, Some(t)) => format!(
                        "config.json names model_type {t}, with no \"architectures\", which \
                         lorafit does not run"
                    ),
                    (false, None) => {
                        format!("config.json names architecture {arch}, which lorafit does not run")
                    }
                    (false, Some(t)) => format!(
                        "config.json names architecture {arch} (model_type {t}), which lorafit \
                         does not run"
                    ),
                };
                bail!("{named}; lorafit runs {SUPPORTED_ARCHITECTURES}");
            }
        };
        refuse_unapplied_bias_flags(&raw, family)?;
        let c = HfConfig::from_raw(&raw, "config.json")?;
        let spec = match family {
            Family::Gemma2 | Family::Gemma3 => super::gemma::spec_from_hf(&c, &raw, family)?,
            Family::MiniCpm => super::minicpm::spec_from_hf(&c, &raw)?,
            _ => super::llama::spec_from_hf(&c, family)?,
        };
        spec.validate()?;
        Ok(spec)
    }

    pub fn validate(&self) -> Result<()> {
        if self.n_heads == 0 || self.head_dim == 0 {
            bail!(
                "num_attention_heads ({}) and head_dim ({}) must be positive",
                self.n_heads,
                self.head_dim
            );
        }
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
        if self.layers.len() != self.n_layers {
            bail!(
                "{} layer descriptions for num_hidden_layers {}",
                self.layers.len(),
                self.n_layers
            );
        }
        for (l, ls) in self.layers.iter().enumerate() {
            if ls.rope >= self.ropes.len() {
                bail!("layer {l}: rotary table {} does not exist", ls.rope);
            }
            if ls.window == Some(0) {
                bail!("layer {l}: sliding window 0");
            }
            if ls.head_dim == 0 || !ls.head_dim.is_multiple_of(2) {
                bail!(
                    "layer {l}: head_dim {} must be positive and even",
                    ls.head_dim
                );
            }
            if ls.n_kv_heads == 0 || !self.n_heads.is_multiple_of(ls.n_kv_heads) {
                bail!(
                    "layer {l}: num_attention_heads {} is not a multiple of its {} key/value heads",
                    self.n_heads,
                    ls.n_kv_heads
                );
            }
            if self.ropes[ls.rope].dims != ls.head_dim {
                bail!(
                    "layer {l}: rotary table {} covers {} dims, the layer's head_dim is {}",
                    ls.rope,
                    self.ropes[ls.rope].dims,
                    ls.head_dim
                );
            }
            if let Some(d) = ls.kv_source {
                let donor = &self.layers[d.min(self.layers.len() - 1)];
                if d >= l || !donor.owns_kv() {
                    bail!(
                        "layer {l}: its k/v donor {d} is not an earlier layer with k/v of its own"
                    );
                }
                if donor.head_dim != ls.head_dim
                    || donor.n_kv_heads != ls.n_kv_heads
                    || donor.window != ls.window
                {
                    bail!("layer {l}: its k/v donor {d} has another attention geometry");
                }
            }
        }
        for (i, r) in self.ropes.iter().enumerate() {
            if matches!(r.scaling, RopeScaling::LongRope { .. }) && i > 0 {
                // A pass brings its example's largest position for the main table only.
                bail!("LongRoPE is supported on the main rotary table only");
            }
            if let RopeScaling::LongRope { short, long, .. } = &r.scaling {
                if short.len() != r.dims / 2 || long.len() != r.dims / 2 {
                    bail!(
                        "rope_scaling: longrope factors have {} and {} entries, head_dim/2 is {}",
                        short.len(),
                        long.len(),
                        r.dims / 2
                    );
                }
            }
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
    /// Width of layer `l`'s q (and of its attention output).
    pub fn q_dim_of(&self, l: usize) -> usize {
        self.n_heads * self.layers[l].head_dim
    }
    /// Width of layer `l`'s k and v.
    pub fn kv_dim_of(&self, l: usize) -> usize {
        self.layers[l].n_kv_heads * self.layers[l].head_dim
    }
    /// The layers whose k and v other layers read (KV-sharing donors), ascending.
    pub fn kv_donors(&self) -> Vec<usize> {
        let mut d: Vec<usize> = self.layers.iter().filter_map(|l| l.kv_source).collect();
        d.sort_unstable();
        d.dedup();
        d
    }

    /// The main rotary table's inverse frequencies (`head_dim/2` of them) for short sequences.
    pub fn inv_freq(&self) -> Vec<f32> {
        self.ropes[0].inv_freq(0)
    }

    /// Name of a decoder tensor of layer `l` (`leaf` as in Hugging Face's Llama, e.g.
    /// `self_attn.q_proj.weight`).
    pub fn layer_tensor(&self, l: usize, leaf: &str) -> String {
        format!("{}layers.{l}.{leaf}", self.tensor_prefix)
    }
    /// Name of a model-level tensor (`embed_tokens.weight`, `norm.weight`).
    pub fn model_tensor(&self, leaf: &str) -> String {
        format!("{}{leaf}", self.tensor_prefix)
    }
    /// Name of the untied LM head.
    pub fn head_tensor(&self) -> String {
        format!("{}lm_head.weight", self.head_prefix)
    }
}

/// Refuses `attention_bias` or `mlp_bias` set true where transformers' class for `family` would
/// then add biases that lorafit does not apply: with `attention_bias` every family that reads it
/// puts one on o_proj too, and no family's MLP here has biases.
fn refuse_unapplied_bias_flags(cfg: &serde_json::Value, family: Family) -> Result<()> {
    for (key, which) in [
        ("attention_bias", "q_proj, k_proj, v_proj and o_proj"),
        ("mlp_bias", "gate_proj, up_proj and down_proj"),
    ] {
        if cfg.get(key).and_then(|v| v.as_bool()) == Some(true) && family.reads_bias_key(key) {
            bail!(
                "{key} is true: {} then has biases on {which}, and lorafit does not apply {}. \
                 If the checkpoint holds no such biases, set {key} to false in config.json; \
                 otherwise lorafit cannot train this model",
                family.hf_name(),
                if key == "mlp_bias" {
                    "them"
                } else {
                    "o_proj's"
                }
            );
        }
    }
    Ok(())
}

/// A positive number `key.k` of a rope table.
fn num(v: &serde_json::Value, key: &str, k: &str) -> Result<f64> {
    let x = v
        .get(k)
        .and_then(|x| x.as_f64())
        .with_context(|| format!("{key}.{k} is missing"))?;
    positive(&format!("{key}.{k}"), x)
}

/// `rope_scaling` (or transformers 5's `rope_parameters`) of one rotary table; `key` names it in
/// messages.
pub fn parse_rope_scaling(
    key: &str,
    v: Option<&serde_json::Value>,
    head_dim: usize,
    max_position_embeddings: Option<usize>,
) -> Result<RopeScaling> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let kind = v
        .get("rope_type")
        .or_else(|| v.get("type"))
        .and_then(|x| x.as_str())
        .unwrap_or("default");
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num(v, key, "factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num(v, key, "factor")?,
            low_freq_factor: num(v, key, "low_freq_factor")?,
            high_freq_factor: num(v, key, "high_freq_factor")?,
            original_max_position_embeddings: num(v, key, "original_max_position_embeddings")?,
        },
        "longrope" => {
            let factors = |k: &str| -> Result<Vec<f64>> {
                let a = v
                    .get(k)
                    .and_then(|x| x.as_array())
                    .with_context(|| format!("{key}.{k} is missing"))?;
                let f: Vec<f64> = a.iter().filter_map(|x| x.as_f64()).collect();
                anyhow::ensure!(
                    f.len() == a.len() && f.len() == head_dim / 2,
                    "{key}.{k} has {} numbers, head_dim/2 is {}",
                    f.len(),
                    head_dim / 2
                );
                for (i, &x) in f.iter().enumerate() {
                    positive(&format!("{key}.{k}[{i}]"), x)?;
                }
                Ok(f)
            };
            let original = v
                .get("original_max_position_embeddings")
                .and_then(|x| x.as_u64())
                .map(|x| x as usize)
                .or(max_position_embeddings)
                .with_context(|| format!("{key}.original_max_position_embeddings is missing"))?;
            anyhow::ensure!(
                original > 0,
                "{key}.original_max_position_embeddings is 0; it must be positive"
            );
            // As transformers: the given attention_factor, else sqrt(1 + ln(s) / ln(original))
            // with s = max_position_embeddings / original (1 when s <= 1).
            let attention_factor = match v.get("attention_factor").and_then(|x| x.as_f64()) {
                Some(f) => positive(&format!("{key}.attention_factor"), f)?,
                None => {
                    let s = max_position_embeddings.unwrap_or(original) as f64 / original as f64;
                    if s <= 1.0 {
                        1.0
                    } else {
                        (1.0 + s.ln() / (original as f64).ln()).sqrt()
                    }
                }
            };
            RopeScaling::LongRope {
                short: factors("short_factor")?,
                long: factors("long_factor")?,
                original_max_position_embeddings: original,
                attention_factor,
            }
        }
        other => bail!(
            "{key}: rope type {other:?} is not supported (supported: linear, llama3, longrope)"
        ),
    })
}
