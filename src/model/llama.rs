//! The Llama family: Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM and MiniCPM5 (a plain
//! `LlamaForCausalLM` with an explicit head_dim). Every layer is the plain pre-norm block with a
//! SiLU gate and one rotary table; the members differ in flags: Qwen2's q/k/v biases, Qwen3's
//! per-head q/k norms, Mistral's sliding window (on every layer).

use super::config::{Family, HfConfig, ModelSpec};
use anyhow::Result;

/// `config.json` of a Llama-family model, as a `ModelSpec`.
pub fn spec_from_hf(c: &HfConfig, family: Family) -> Result<ModelSpec> {
    let mut spec = c.llama_spec(family)?;
    spec.qkv_bias = family == Family::Qwen2 || c.attention_bias.unwrap_or(false);
    spec.qk_norm = family == Family::Qwen3;
    spec.sliding_window = match family {
        Family::Mistral => c.sliding_window(),
        // Qwen2/3 configs carry a window but only apply it with use_sliding_window.
        Family::Qwen2 | Family::Qwen3 if c.use_sliding_window == Some(true) => c.sliding_window(),
        _ => None,
    };
    for layer in &mut spec.layers {
        layer.window = spec.sliding_window.map(|w| w as u32);
    }
    Ok(spec)
}
