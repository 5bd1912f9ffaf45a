//! MiniCPM 1/2/4 (`MiniCPMForCausalLM`): Llama layers with μP scales. Embeddings × `scale_emb`,
//! each residual branch × `scale_depth/√L`, the head reading `h / (hidden/dim_model_base)`
//! (folded into the final norm's weight at load), and LongRoPE (`rope_scaling` longrope: short
//! and long per-frequency factors and a factor on cos/sin). Tied or untied heads.

use super::config::{Family, HfConfig, ModelSpec};
use anyhow::{Context, Result};
use serde::Deserialize;

/// The μP fields of MiniCPM's `config.json`.
#[derive(Deserialize)]
struct MiniCpmConfig {
    scale_emb: Option<f64>,
    scale_depth: Option<f64>,
    dim_model_base: Option<f64>,
}

/// `config.json` of a MiniCPM model, as a `ModelSpec`.
pub fn spec_from_hf(c: &HfConfig, raw: &serde_json::Value) -> Result<ModelSpec> {
    let m: MiniCpmConfig =
        serde_json::from_value(raw.clone()).context("config.json: MiniCPM fields")?;
    c.require_silu(Family::MiniCpm)?;
    let mut spec = c.llama_spec(Family::MiniCpm)?;
    // MiniCPM's configuration class ties the head unless told otherwise.
    spec.tie_embeddings = c.tie_word_embeddings.unwrap_or(true);
    spec.embed_scale = m.scale_emb.map(|s| s as f32);
    if let Some(base) = m.dim_model_base {
        anyhow::ensure!(base > 0.0, "dim_model_base must be positive");
        spec.head_input_scale = Some((base / spec.hidden as f64) as f32);
    }
    let residual = m
        .scale_depth
        .map_or(1.0, |d| d / (spec.n_layers as f64).sqrt()) as f32;
    for layer in &mut spec.layers {
        layer.residual_scale = residual;
    }
    Ok(spec)
}
