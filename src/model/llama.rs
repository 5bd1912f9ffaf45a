//! The Llama family: Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM and MiniCPM5 (a plain
//! `LlamaForCausalLM` with an explicit head_dim). Every layer is the plain pre-norm block with a
//! SiLU gate and one rotary table; the members differ in flags: Qwen2's q/k/v biases, Qwen3's
//! per-head q/k norms, Mistral's sliding window (on every layer), Qwen2/3's (on the layers from
//! `max_window_layers` on, or as `layer_types` says, with `use_sliding_window`).

use super::config::{Family, HfConfig, ModelSpec};
use anyhow::{bail, Result};

/// `config.json` of a Llama-family model, as a `ModelSpec`.
pub fn spec_from_hf(c: &HfConfig, family: Family) -> Result<ModelSpec> {
    c.require_silu(family)?;
    let mut spec = c.llama_spec(family)?;
    // As transformers: Qwen2's q, k and v always have biases and Mistral's never, whatever
    // attention_bias says.
    spec.qkv_bias = match family {
        Family::Qwen2 => true,
        Family::Mistral => false,
        _ => c.attention_bias.unwrap_or(false),
    };
    spec.qk_norm = family == Family::Qwen3;
    let n = spec.n_layers;
    let windows = match family {
        // MistralConfig's sliding_window is 4096 when absent.
        Family::Mistral => vec![c.window_or(Some(4096))?; n],
        Family::Qwen2 | Family::Qwen3 => qwen_windows(c, n)?,
        _ => vec![None; n],
    };
    spec.sliding_window = windows.iter().flatten().next().copied();
    for (layer, w) in spec.layers.iter_mut().zip(windows) {
        layer.window = w.map(|w| w as u32);
    }
    Ok(spec)
}

/// Each layer's window in a Qwen2/3 model, as transformers' configuration sets them: there is a
/// window only with `use_sliding_window` (`sliding_window`, 4096 when absent), and it applies to
/// the layers `layer_types` marks `sliding_attention`; without `layer_types`, to the layers from
/// `max_window_layers` (28 when absent) on.
fn qwen_windows(c: &HfConfig, n: usize) -> Result<Vec<Option<usize>>> {
    let window = if c.use_sliding_window == Some(true) {
        c.window_or(Some(4096))?
    } else {
        None
    };
    let sliding: Vec<bool> = match &c.layer_types {
        Some(types) => super::gemma::sliding_layers(types, n)?,
        None => {
            let from = c.max_window_layers.unwrap_or(28);
            (0..n).map(|l| window.is_some() && l >= from).collect()
        }
    };
    if let (Some(l), None) = (sliding.iter().position(|&s| s), window) {
        bail!(
            "layer_types[{l}] is sliding_attention, but the model has no window: \
             use_sliding_window is not true, or sliding_window is null"
        );
    }
    Ok(sliding
        .into_iter()
        .map(|s| if s { window } else { None })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::super::config::ModelSpec;

    fn windows(extra: &str) -> Vec<Option<u32>> {
        let text = format!(
            r#"{{"architectures":["Qwen2ForCausalLM"],"hidden_size":64,"intermediate_size":96,
            "num_hidden_layers":6,"num_attention_heads":4,"num_key_value_heads":2,
            "vocab_size":200{extra}}}"#
        );
        let spec = ModelSpec::from_config_json(&text).unwrap();
        spec.layers.iter().map(|l| l.window).collect()
    }

    /// A value of the wrong type names the field as written; a missing field is named by serde.
    #[test]
    fn a_mistyped_or_missing_field_is_named() {
        let err = |text: &str| format!("{:#}", ModelSpec::from_config_json(text).unwrap_err());
        let e = err(r#"{"architectures":["LlamaForCausalLM"],"hidden_size":"64",
            "intermediate_size":96,"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":200}"#);
        assert!(e.contains(r#"at "hidden_size": "64""#), "{e}");
        let e = err(r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,
            "intermediate_size":96,"num_hidden_layers":2,"num_attention_heads":4,
            "rms_norm_eps":"1e-5","vocab_size":200}"#);
        assert!(e.contains(r#"at "rms_norm_eps": "1e-5""#), "{e}");
        let e = err(
            r#"{"architectures":["LlamaForCausalLM"],"intermediate_size":96,
            "num_hidden_layers":2,"num_attention_heads":4,"vocab_size":200}"#,
        );
        assert!(e.contains("missing field `hidden_size`"), "{e}");
    }

    /// A head geometry left out of config.json takes the family's transformers default, which
    /// is not always the one derived from the other keys; a default that cannot hold is refused
    /// with the key to add.
    #[test]
    fn absent_head_keys_take_the_family_default() {
        let spec = |arch: &str, heads: usize| {
            ModelSpec::from_config_json(&format!(
                r#"{{"architectures":["{arch}"],"hidden_size":2048,"intermediate_size":96,
                "num_hidden_layers":2,"num_attention_heads":{heads},"vocab_size":200}}"#
            ))
        };
        let geometry = |arch: &str, heads: usize| {
            let s = spec(arch, heads).unwrap();
            (s.n_kv_heads, s.head_dim)
        };
        assert_eq!(geometry("LlamaForCausalLM", 32), (32, 64));
        assert_eq!(geometry("MistralForCausalLM", 32), (8, 64));
        assert_eq!(geometry("Qwen2ForCausalLM", 32), (32, 64));
        assert_eq!(geometry("Qwen3ForCausalLM", 32), (32, 128));
        let e = format!("{:#}", spec("Qwen2ForCausalLM", 12).unwrap_err());
        assert!(
            e.contains("no num_key_value_heads") && e.contains("default of 32"),
            "{e}"
        );
    }

    /// As transformers' Qwen2 configuration: the window slides only with use_sliding_window, on
    /// the layers from max_window_layers on (28 by default), and an explicit layer_types list
    /// decides instead; sliding_window defaults to 4096 when it is not given.
    #[test]
    fn qwen2_windows_follow_max_window_layers_and_layer_types() {
        let w = Some(8);
        assert_eq!(windows(r#","sliding_window":8"#), vec![None; 6]);
        assert_eq!(
            windows(r#","sliding_window":8,"use_sliding_window":false,"max_window_layers":2"#),
            vec![None; 6]
        );
        assert_eq!(
            windows(r#","sliding_window":8,"use_sliding_window":true,"max_window_layers":2"#),
            vec![None, None, w, w, w, w]
        );
        assert_eq!(
            windows(r#","sliding_window":8,"use_sliding_window":true,"max_window_layers":0"#),
            vec![w; 6]
        );
        // max_window_layers' default (28) is past the 6 layers: none slides.
        assert_eq!(
            windows(r#","sliding_window":8,"use_sliding_window":true"#),
            vec![None; 6]
        );
        assert_eq!(
            windows(r#","use_sliding_window":true,"max_window_layers":5"#),
            vec![None, None, None, None, None, Some(4096)]
        );
        assert_eq!(
            windows(r#","sliding_window":null,"use_sliding_window":true,"max_window_layers":0"#),
            vec![None; 6]
        );
        let types = r#","layer_types":["full_attention","sliding_attention","full_attention",
            "sliding_attention","sliding_attention","full_attention"]"#;
        assert_eq!(
            windows(&format!(
                r#","sliding_window":8,"use_sliding_window":true,"max_window_layers":4{types}"#
            )),
            vec![None, w, None, w, w, None]
        );
    }

    /// Qwen3's configuration sets its windows the same way.
    #[test]
    fn qwen3_windows_follow_max_window_layers() {
        let text = r#"{"architectures":["Qwen3ForCausalLM"],"hidden_size":64,
            "intermediate_size":96,"num_hidden_layers":3,"num_attention_heads":4,
            "num_key_value_heads":2,"head_dim":16,"vocab_size":200,"sliding_window":8,
            "use_sliding_window":true,"max_window_layers":1}"#;
        let spec = ModelSpec::from_config_json(text).unwrap();
        let w: Vec<_> = spec.layers.iter().map(|l| l.window).collect();
        assert_eq!(w, vec![None, Some(8), Some(8)]);
    }

    /// layer_types naming a sliding layer where there is no window is refused.
    #[test]
    fn sliding_layer_types_without_a_window_are_refused() {
        let text = r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":64,
            "intermediate_size":96,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"vocab_size":200,"sliding_window":8,
            "use_sliding_window":false,"layer_types":["full_attention","sliding_attention"]}"#;
        let e = format!("{:#}", ModelSpec::from_config_json(text).unwrap_err());
        assert!(
            e.contains("layer_types[1]") && e.contains("use_sliding_window"),
            "{e}"
        );
    }
}
