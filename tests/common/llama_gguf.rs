//! The Llama fixture (tests/fixtures/models/llama) written as a GGUF file with the project's own
//! writer, each projection stored in the type a test asks for: the quantized and mixed-type
//! bases that the export and rank-scaling tests need and that no committed fixture holds.

use lorafit::export::gguf_writer::{GgufTensor, GgufWriter};
use lorafit::export::quantize::quantize;
use lorafit::model::gguf::{permute_qk_rows, GgmlType, MetaValue};
use lorafit::model::{ModelSpec, Target};
use std::path::Path;

/// Writes the Llama fixture to `path`: embeddings and head Q8_0, norms F32, and layer `l`'s
/// projection `t` as `projection_type(l, t)`; q and k rows permuted as llama.cpp's converter
/// permutes them.
pub fn write_llama_gguf(path: &Path, projection_type: impl Fn(usize, Target) -> GgmlType) {
    let base = super::fixture("models/llama");
    let spec = ModelSpec::from_config_file(&base.join("config.json")).unwrap();
    let st = super::read_safetensors(&base.join("model.safetensors"));
    let mut w = GgufWriter::new();
    w.set_str("general.architecture", "llama");
    let u32v = |v: usize| MetaValue::U32(v as u32);
    w.set("llama.block_count", u32v(spec.n_layers));
    w.set("llama.context_length", u32v(64));
    w.set("llama.embedding_length", u32v(spec.hidden));
    w.set("llama.feed_forward_length", u32v(spec.intermediate));
    w.set("llama.attention.head_count", u32v(spec.n_heads));
    w.set("llama.attention.head_count_kv", u32v(spec.n_kv_heads));
    w.set(
        "llama.attention.layer_norm_rms_epsilon",
        MetaValue::F32(1e-5),
    );
    w.set("llama.rope.freq_base", MetaValue::F32(10000.0));
    w.set("llama.attention.key_length", u32v(spec.head_dim));
    let mut add = |name: &str, hf: &str, ty: GgmlType, perm: Option<usize>| {
        let (shape, mut data) = st[hf].clone();
        if let Some(n_head) = perm {
            permute_qk_rows(&mut data, shape[0], shape[1], n_head).unwrap();
        }
        w.add_tensor(GgufTensor {
            name: name.into(),
            dims: shape.iter().rev().copied().collect(),
            ggml_type: ty,
            data: quantize(ty, &data).unwrap(),
        })
        .unwrap();
    };
    use GgmlType::{F32, Q8_0};
    add("token_embd.weight", "model.embed_tokens.weight", Q8_0, None);
    add("output_norm.weight", "model.norm.weight", F32, None);
    add("output.weight", "lm_head.weight", Q8_0, None);
    for l in 0..spec.n_layers {
        let hf = |leaf: &str| format!("model.layers.{l}.{leaf}");
        let g = |leaf: &str| format!("blk.{l}.{leaf}");
        add(
            &g("attn_norm.weight"),
            &hf("input_layernorm.weight"),
            F32,
            None,
        );
        add(
            &g("ffn_norm.weight"),
            &hf("post_attention_layernorm.weight"),
            F32,
            None,
        );
        let projections = [
            ("attn_q", Target::Q, Some(spec.n_heads)),
            ("attn_k", Target::K, Some(spec.n_kv_heads)),
            ("attn_v", Target::V, None),
            ("attn_output", Target::O, None),
            ("ffn_gate", Target::Gate, None),
            ("ffn_up", Target::Up, None),
            ("ffn_down", Target::Down, None),
        ];
        for (leaf, t, perm) in projections {
            add(
                &g(&format!("{leaf}.weight")),
                &hf(&format!("{}.weight", t.path())),
                projection_type(l, t),
                perm,
            );
        }
    }
    w.write(path).unwrap();
}
