//! The Gemma family: Gemma 2 and Gemma 3 (text; also the language model of Gemma 3's multimodal
//! checkpoints). What they change from Llama, as layer descriptions: `(1 + w)` RMSNorms (the 1
//! added at load), sandwich norms around both sublayers, a GELU-tanh gate, embeddings × √hidden
//! (rounded to the weights' dtype, as transformers does), `query_pre_attn_scalar^-½` scores,
//! sliding-window and global layers, tied embeddings. Gemma 2 adds the attention and final logit
//! softcaps; Gemma 3 adds q/k norms and a second rotary table for its local layers
//! (`rope_local_base_freq`, unscaled) beside the global one (`rope_theta`, `rope_scaling`).

use super::config::{
    parse_rope_scaling, positive, Activation, Family, HfConfig, ModelSpec, RopeSpec,
};
use anyhow::{bail, Context, Result};
use serde::Deserialize;

/// The Gemma-specific fields of `config.json`.
#[derive(Deserialize, Default)]
struct GemmaConfig {
    query_pre_attn_scalar: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<usize>,
    rope_local_base_freq: Option<f64>,
    hidden_activation: Option<String>,
}

/// `config.json` of a Gemma 2 or Gemma 3 text model, as a `ModelSpec`.
pub fn spec_from_hf(c: &HfConfig, raw: &serde_json::Value, family: Family) -> Result<ModelSpec> {
    let g: GemmaConfig =
        serde_json::from_value(raw.clone()).context("config.json: Gemma fields")?;
    // transformers' Gemma 2/3 MLPs read hidden_activation only (a hidden_act beside it is
    // ignored); "gelu" there is the exact erf GELU, which lorafit does not run.
    let act = g
        .hidden_activation
        .as_deref()
        .unwrap_or("gelu_pytorch_tanh");
    if !matches!(act, "gelu_pytorch_tanh" | "gelu_tanh" | "gelu_new") {
        bail!(
            "hidden_activation {act:?} is not supported for {}: lorafit runs the tanh GELU \
             (hidden_activation \"gelu_pytorch_tanh\")",
            family.hf_name()
        );
    }
    let mut spec = c.llama_spec(family)?;
    // Gemma's configs name the head dim; tie_word_embeddings defaults to true.
    spec.tie_embeddings = c.tie_word_embeddings.unwrap_or(true);
    spec.qk_norm = family == Family::Gemma3;
    spec.norm_offset = 1.0;
    spec.embed_scale = Some((spec.hidden as f32).sqrt());
    spec.embed_scale_in_weight_dtype = true;
    spec.sliding_window = c.sliding_window();
    let cap = |v: Option<f64>| v.filter(|c| *c > 0.0).map(|c| c as f32);
    spec.final_logit_softcap = cap(g.final_logit_softcapping);
    let attn_softcap = cap(g.attn_logit_softcapping);
    let scalar = g.query_pre_attn_scalar.unwrap_or(spec.head_dim as f64);
    let n = spec.n_layers;
    // Which layers slide: explicit layer_types, else Gemma 2 alternates (even layers slide) and
    // Gemma 3 makes every `pattern`-th layer global.
    let sliding: Vec<bool> = match &g.layer_types {
        Some(types) => sliding_layers(types, n)?,
        None => match family {
            Family::Gemma2 => (0..n).map(|l| l % 2 == 0).collect(),
            _ => {
                let p = g.sliding_window_pattern.unwrap_or(6).max(1);
                (0..n).map(|l| (l + 1) % p != 0).collect()
            }
        },
    };
    if sliding.iter().any(|&s| s) && spec.sliding_window.is_none() {
        bail!("config.json has sliding layers but no sliding_window");
    }
    // Gemma 3: local layers rotate with their own base and no scaling. transformers 5 writes
    // both tables in rope_parameters, keyed by layer type.
    let local_rope = if family == Family::Gemma3 {
        let per_type = c
            .rope_parameters
            .as_ref()
            .filter(|p| p.get("full_attention").is_some() || p.get("sliding_attention").is_some());
        if let Some(p) = per_type {
            let table = |key: &str, default_theta: f64| -> Result<RopeSpec> {
                let v = p.get(key);
                let name = format!("rope_parameters.{key}");
                let theta = v
                    .and_then(|v| v.get("rope_theta"))
                    .and_then(|t| t.as_f64())
                    .unwrap_or(default_theta);
                Ok(RopeSpec {
                    theta: positive(&format!("{name}.rope_theta"), theta)?,
                    scaling: parse_rope_scaling(
                        &name,
                        v,
                        spec.head_dim,
                        c.max_position_embeddings,
                    )?,
                    dims: spec.head_dim,
                })
            };
            let global = table("full_attention", c.rope_theta.unwrap_or(1e6))?;
            spec.rope_theta = global.theta;
            spec.rope_scaling = global.scaling.clone();
            spec.ropes = vec![global];
            Some(table(
                "sliding_attention",
                g.rope_local_base_freq.unwrap_or(10000.0),
            )?)
        } else {
            Some(RopeSpec {
                theta: positive(
                    "rope_local_base_freq",
                    g.rope_local_base_freq.unwrap_or(10000.0),
                )?,
                scaling: super::config::RopeScaling::None,
                dims: spec.head_dim,
            })
        }
    } else {
        None
    };
    if let Some(local) = local_rope {
        spec.ropes.push(local);
    }
    let window = spec.sliding_window.map(|w| w as u32);
    for (layer, slides) in spec.layers.iter_mut().zip(sliding) {
        layer.window = if slides { window } else { None };
        layer.rope = if slides && family == Family::Gemma3 {
            1
        } else {
            0
        };
        layer.attn_scale = (1.0 / scalar.sqrt()) as f32;
        layer.attn_softcap = attn_softcap;
        layer.activation = Activation::GeluTanh;
        layer.sandwich_norms = true;
    }
    Ok(spec)
}

/// `layer_types` (one entry per layer) as "does layer l slide" (Gemma 2, 3 and 4).
pub(super) fn sliding_layers(types: &[String], n: usize) -> Result<Vec<bool>> {
    if types.len() != n {
        bail!(
            "layer_types has {} entries, num_hidden_layers is {n}",
            types.len()
        );
    }
    types
        .iter()
        .enumerate()
        .map(|(l, t)| match t.as_str() {
            "sliding_attention" => Ok(true),
            "full_attention" => Ok(false),
            other => bail!("layer_types[{l}] {other:?} is not sliding_attention or full_attention"),
        })
        .collect()
}

/// A `Gemma3ForConditionalGeneration` config: its `text_config` is a Gemma 3 text model whose
/// weights sit under the language model's prefix; the vision tower is not loaded.
pub fn spec_from_multimodal(raw: &serde_json::Value) -> Result<ModelSpec> {
    let text = raw
        .get("text_config")
        .context("a Gemma 3 multimodal config.json without text_config")?;
    let mut text = text.clone();
    // Fields the text config may leave to the top level.
    if let (Some(obj), Some(top)) = (text.as_object_mut(), raw.as_object()) {
        for key in ["tie_word_embeddings", "bos_token_id", "eos_token_id"] {
            if !obj.contains_key(key) {
                if let Some(v) = top.get(key) {
                    obj.insert(key.into(), v.clone());
                }
            }
        }
    }
    let c = HfConfig::from_raw(&text, "config.json text_config")?;
    let mut spec = spec_from_hf(&c, &text, Family::Gemma3)?;
    // Older checkpoints: language_model.model.*; newer: model.language_model.* (the loader
    // takes whichever the files hold).
    spec.tensor_prefix = "language_model.model.".into();
    spec.head_prefix = "language_model.".into();
    spec.validate()?;
    eprintln!("note: Gemma 3 multimodal checkpoint: training its language model; the vision tower is not loaded");
    Ok(spec)
}
