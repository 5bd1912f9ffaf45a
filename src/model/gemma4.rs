//! Gemma 4 (text: `Gemma4ForCausalLM`, `gemma4_text`; also the language model of
//! `Gemma4ForConditionalGeneration` checkpoints). What it changes from Gemma 3, as layer
//! descriptions:
//! - plain `x·w` RMSNorms (no `1 + w`), q/k norms and an unscaled v norm, attention scale 1;
//! - sliding layers (`head_dim`, default RoPE) and full layers (`global_head_dim`, proportional
//!   RoPE: only the first `partial_rotary_factor·head_dim/2` frequency pairs rotate), with
//!   `num_global_key_value_heads` and `attention_k_eq_v` (v from the k projection) where set;
//! - KV sharing: the last `num_kv_shared_layers` layers have no k/v projections and read the k
//!   and v of the last earlier layer of their type (`LayerSpec::kv_source`);
//! - per-layer inputs (`hidden_size_per_layer_input`): a second embedding table and a projection
//!   of the embeddings give each layer a 256-wide input that gates a residual branch after the
//!   MLP (`model::layer`); each layer's output × its `layer_scalar`;
//! - `use_double_wide_mlp`: twice the MLP width on the shared layers; final logit softcap.

use super::config::{Activation, Family, HfConfig, ModelSpec, RopeScaling, RopeSpec};
use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// The Gemma 4-specific fields of `config.json`.
#[derive(Deserialize, Default)]
struct Gemma4Config {
    final_logit_softcapping: Option<f64>,
    layer_types: Option<Vec<String>>,
    hidden_activation: Option<String>,
    global_head_dim: Option<usize>,
    num_global_key_value_heads: Option<usize>,
    attention_k_eq_v: Option<bool>,
    num_kv_shared_layers: Option<usize>,
    hidden_size_per_layer_input: Option<usize>,
    vocab_size_per_layer_input: Option<usize>,
    use_double_wide_mlp: Option<bool>,
    enable_moe_block: Option<bool>,
    use_bidirectional_attention: Option<serde_json::Value>,
    /// transformers' own form of the per-layer geometry (what `save_pretrained` writes instead of
    /// `global_head_dim`): layer index → overrides.
    per_layer_config: Option<std::collections::BTreeMap<String, LayerOverride>>,
}

#[derive(Deserialize, Default)]
struct LayerOverride {
    head_dim: Option<usize>,
    num_key_value_heads: Option<usize>,
}

/// One layer type's rotary table from `rope_parameters[kind]`.
fn rope_table(
    params: Option<&serde_json::Value>,
    kind: &str,
    dims: usize,
    default: (f64, f64),
) -> Result<RopeSpec> {
    let p = params.and_then(|p| p.get(kind));
    let theta = p
        .and_then(|v| v.get("rope_theta"))
        .and_then(|t| t.as_f64())
        .unwrap_or(default.0);
    let rope_type = p
        .and_then(|v| v.get("rope_type"))
        .and_then(|t| t.as_str())
        .unwrap_or(if kind == "full_attention" {
            "proportional"
        } else {
            "default"
        });
    let factor = p
        .and_then(|v| v.get("factor"))
        .and_then(|t| t.as_f64())
        .unwrap_or(1.0);
    let scaling = match rope_type {
        "default" => RopeScaling::None,
        "proportional" => {
            let fraction = p
                .and_then(|v| v.get("partial_rotary_factor"))
                .and_then(|t| t.as_f64())
                .unwrap_or(default.1);
            if !(0.0..=1.0).contains(&fraction) {
                bail!("rope_parameters.{kind}.partial_rotary_factor {fraction} is outside [0, 1]");
            }
            RopeScaling::Proportional {
                // As transformers: int(fraction · head_dim // 2).
                rotated_pairs: (fraction * dims as f64 / 2.0).floor() as usize,
                factor,
            }
        }
        other => bail!(
            "rope_parameters.{kind}.rope_type {other:?} is not supported for Gemma 4 (supported: default, proportional)"
        ),
    };
    Ok(RopeSpec {
        theta,
        scaling,
        dims,
    })
}

/// `config.json` of a Gemma 4 text model, as a `ModelSpec`.
pub fn spec_from_hf(raw: &serde_json::Value) -> Result<ModelSpec> {
    let c = HfConfig::from_raw(raw, "config.json")?;
    let g: Gemma4Config =
        serde_json::from_value(raw.clone()).context("config.json: Gemma 4 fields")?;
    let act = g
        .hidden_activation
        .as_deref()
        .unwrap_or("gelu_pytorch_tanh");
    if !matches!(act, "gelu_pytorch_tanh" | "gelu_tanh") {
        bail!(
            "hidden_activation {act:?} is not supported for Gemma 4 (supported: gelu_pytorch_tanh)"
        );
    }
    if g.enable_moe_block == Some(true) {
        bail!("Gemma 4 mixture-of-experts layers (enable_moe_block) are not supported");
    }
    if g.use_bidirectional_attention
        .as_ref()
        .is_some_and(|v| !v.is_null())
    {
        bail!("use_bidirectional_attention is not supported (lorafit trains causal models)");
    }
    let mut spec = c.llama_spec(Family::Gemma4)?;
    let n = spec.n_layers;
    spec.tie_embeddings = c.tie_word_embeddings.unwrap_or(true);
    spec.qk_norm = true;
    spec.embed_scale = Some((spec.hidden as f32).sqrt());
    spec.embed_scale_in_weight_dtype = true;
    spec.sliding_window = Some(c.sliding_window().unwrap_or(512));
    spec.final_logit_softcap = g
        .final_logit_softcapping
        .filter(|c| *c > 0.0)
        .map(|c| c as f32);
    // transformers' default layer pattern: five sliding layers to one full, the last full.
    let mut sliding: Vec<bool> = match &g.layer_types {
        Some(types) => super::gemma::sliding_layers(types, n)?,
        None => (0..n).map(|l| (l + 1) % 6 != 0).collect(),
    };
    // As transformers: the last layer is always full attention.
    if let Some(last) = sliding.last_mut() {
        *last = false;
    }
    let head_dim = spec.head_dim;
    let k_eq_v = g.attention_k_eq_v.unwrap_or(false);
    // Per layer (head_dim, kv heads): `per_layer_config` where the config has it, else full
    // layers take `global_head_dim` and (only with attention_k_eq_v, as transformers does)
    // `num_global_key_value_heads`.
    let geometry: Vec<(usize, usize)> = match &g.per_layer_config {
        Some(over) => {
            for key in over.keys() {
                if key.parse::<usize>().ok().is_none_or(|l| l >= n) {
                    bail!("per_layer_config: key {key:?} is not a layer index below {n}");
                }
            }
            (0..n)
                .map(|l| {
                    let o = over.get(&l.to_string());
                    (
                        o.and_then(|o| o.head_dim).unwrap_or(head_dim),
                        o.and_then(|o| o.num_key_value_heads)
                            .unwrap_or(spec.n_kv_heads),
                    )
                })
                .collect()
        }
        None => {
            let global_head_dim = g.global_head_dim.unwrap_or(512);
            let global_kv_heads = match (k_eq_v, g.num_global_key_value_heads) {
                (true, Some(h)) => h,
                _ => spec.n_kv_heads,
            };
            sliding
                .iter()
                .map(|&s| {
                    if s {
                        (head_dim, spec.n_kv_heads)
                    } else {
                        (global_head_dim, global_kv_heads)
                    }
                })
                .collect()
        }
    };
    // Where each layer's geometry comes from, for errors that name the field.
    let source = |l: usize, what: &str| -> String {
        match &g.per_layer_config {
            Some(over) if over.contains_key(&l.to_string()) => {
                format!("per_layer_config.{l}.{what}")
            }
            _ if !sliding[l] && what == "head_dim" && g.global_head_dim.is_some() => {
                "global_head_dim".into()
            }
            _ if !sliding[l] && what == "num_key_value_heads" && k_eq_v => {
                "num_global_key_value_heads".into()
            }
            _ => what.into(),
        }
    };
    for (l, &(hd, kv)) in geometry.iter().enumerate() {
        if hd == 0 || hd % 2 != 0 {
            bail!(
                "{} {hd} (layer {l}) must be a positive even number (RoPE rotates pairs)",
                source(l, "head_dim")
            );
        }
        if kv == 0 || spec.n_heads % kv != 0 {
            bail!(
                "{} {kv} (layer {l}) must be positive and divide num_attention_heads {}",
                source(l, "num_key_value_heads"),
                spec.n_heads
            );
        }
    }
    if spec.sliding_window == Some(0) {
        bail!("sliding_window 0: a sliding layer would attend to nothing");
    }
    let dims_of = |slides: bool| -> Result<usize> {
        let mut d = geometry
            .iter()
            .zip(&sliding)
            .filter(|(_, &s)| s == slides)
            .map(|(g, _)| g.0);
        let first = d.next().unwrap_or(head_dim);
        if d.any(|x| x != first) {
            bail!("Gemma 4 layers of one type with different head_dim are not supported");
        }
        Ok(first)
    };
    let global_head_dim = dims_of(false)?;
    let params = c.rope_parameters.as_ref();
    spec.ropes = vec![
        rope_table(params, "sliding_attention", dims_of(true)?, (10_000.0, 1.0))?,
        rope_table(
            params,
            "full_attention",
            global_head_dim,
            (1_000_000.0, 0.25),
        )?,
    ];
    spec.rope_theta = spec.ropes[0].theta;
    spec.rope_scaling = spec.ropes[0].scaling.clone();

    let shared = g.num_kv_shared_layers.unwrap_or(0);
    if shared >= n && shared > 0 {
        bail!("num_kv_shared_layers {shared} leaves no layer to compute k and v (num_hidden_layers {n})");
    }
    let first_shared = n - shared;
    // The donor of a shared layer: the last layer of its type below the first shared one.
    let donor = |slides: bool| -> Result<usize> {
        (0..first_shared)
            .rev()
            .find(|&l| sliding[l] == slides)
            .with_context(|| {
                format!(
                    "num_kv_shared_layers {shared}: no {} layer below layer {first_shared} to share k and v from",
                    if slides { "sliding" } else { "full" }
                )
            })
    };
    let double_wide = g.use_double_wide_mlp.unwrap_or(false);
    let window = spec.sliding_window.map(|w| w as u32);
    for (l, layer) in spec.layers.iter_mut().enumerate() {
        let slides = sliding[l];
        layer.window = if slides { window } else { None };
        layer.rope = if slides { 0 } else { 1 };
        (layer.head_dim, layer.n_kv_heads) = geometry[l];
        layer.attn_scale = 1.0;
        layer.attn_softcap = None;
        layer.activation = Activation::GeluTanh;
        layer.sandwich_norms = true;
        layer.v_norm = true;
        layer.k_eq_v = k_eq_v && !slides;
        if l >= first_shared {
            layer.kv_source = Some(donor(slides)?);
            if double_wide {
                layer.intermediate *= 2;
            }
        }
    }
    spec.intermediate = spec
        .layers
        .iter()
        .map(|l| l.intermediate)
        .max()
        .unwrap_or(0);
    spec.per_layer_input = g.hidden_size_per_layer_input.unwrap_or(0);
    if spec.per_layer_input > 0 {
        let v = g.vocab_size_per_layer_input.unwrap_or(spec.vocab);
        if v != spec.vocab {
            bail!(
                "vocab_size_per_layer_input {v} differs from vocab_size {}: not supported",
                spec.vocab
            );
        }
    }
    Ok(spec)
}

/// A `Gemma4ForConditionalGeneration` config: its `text_config` is a Gemma 4 text model whose
/// weights sit under `model.language_model.`; the vision and audio towers are not loaded.
pub fn spec_from_multimodal(raw: &serde_json::Value) -> Result<ModelSpec> {
    let mut text = raw
        .get("text_config")
        .context("a Gemma 4 multimodal config.json without text_config")?
        .clone();
    if let (Some(obj), Some(top)) = (text.as_object_mut(), raw.as_object()) {
        for key in ["tie_word_embeddings", "bos_token_id", "eos_token_id"] {
            if !obj.contains_key(key) {
                if let Some(v) = top.get(key) {
                    obj.insert(key.into(), v.clone());
                }
            }
        }
    }
    let mut spec = spec_from_hf(&text)?;
    spec.tensor_prefix = "model.language_model.".into();
    spec.head_prefix = String::new();
    spec.validate()?;
    eprintln!("note: Gemma 4 multimodal checkpoint: training its language model; the vision and audio towers are not loaded");
    Ok(spec)
}
