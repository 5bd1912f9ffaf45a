//! Quantize on load (`base_quant`): the seven projections hold exactly the encoded-then-decoded
//! values of the files' weights and nothing else changes; a width the type cannot encode is
//! refused by tensor name; a run trains on the quantized base from the command line and records
//! the setting in its plan.toml.

mod common;

use common::{fixture, tiny_run};
use lorafit::model::gguf::{dequantize, GgmlType};
use lorafit::model::quantize_on_load::{encode_rows, QuantizingSource};
use lorafit::model::weights::{
    load_weights, ModelWeights, RandomSource, SafetensorsFolder, Weight,
};
use lorafit::model::{BaseQuant, ModelSpec};
use lorafit::tensor::Device;

fn dense(w: &Weight) -> Vec<f32> {
    match w {
        Weight::Dense(t) => t.to_vec().unwrap(),
        Weight::Quant(_) | Weight::Extended(_) => panic!("the CPU keeps every weight dense"),
    }
}

fn projections(w: &ModelWeights) -> Vec<(String, Vec<f32>, usize)> {
    let mut out = Vec::new();
    for (l, lw) in w.layers.iter().enumerate() {
        let named = [
            ("q", Some(&lw.q)),
            ("k", lw.k.as_ref()),
            ("v", lw.v.as_ref()),
            ("o", Some(&lw.o)),
            ("gate", Some(&lw.gate)),
            ("up", Some(&lw.up)),
            ("down", Some(&lw.down)),
        ];
        for (n, w) in named {
            if let Some(w) = w {
                out.push((format!("{l}.{n}"), dense(w), w.rows_cols().1));
            }
        }
    }
    out
}

/// Each projection equals the decode of the type's encoding of the dense weight; the embedding,
/// head and norms are the dense model's own; the encoding changes the weights (it is not a
/// no-op) by about the type's step.
fn check_quantized_matches_encoding(
    spec: &ModelSpec,
    src: &dyn lorafit::model::weights::TensorSource,
    quant: BaseQuant,
) {
    let ty = quant.ggml().unwrap();
    let plain = load_weights(spec, src, &Device::Cpu).unwrap();
    let q = load_weights(spec, &QuantizingSource { inner: src, quant }, &Device::Cpu).unwrap();
    let (pp, qp) = (projections(&plain), projections(&q));
    assert_eq!(pp.len(), qp.len());
    let mut worst_rel = 0f64;
    for ((name, want, cols), (_, got, _)) in pp.iter().zip(&qp) {
        let bytes = encode_rows(ty, want, *cols).unwrap();
        let mut decoded = vec![0f32; want.len()];
        dequantize(ty, &bytes, want.len(), &mut decoded).unwrap();
        assert_eq!(got, &decoded, "{name}: {ty}");
        assert_ne!(got, want, "{name}: {ty} changed nothing");
        worst_rel = worst_rel.max(common::rel_norm(got, want));
    }
    // Relative error of round-to-nearest blocks on normal weights: ~0.4% (8-bit), ~10% (4-bit).
    let bound = if ty == GgmlType::Q8_0 { 0.01 } else { 0.2 };
    assert!(worst_rel < bound, "{ty}: relative error {worst_rel}");
    assert_eq!(dense(&plain.embed), dense(&q.embed));
    assert_eq!(
        plain.norm.to_vec().unwrap(),
        q.norm.to_vec().unwrap(),
        "norms stay dense"
    );
    match (&plain.lm_head, &q.lm_head) {
        (Some(a), Some(b)) => assert_eq!(dense(a), dense(b), "the head stays dense"),
        (None, None) => {}
        _ => panic!("the head's presence changed"),
    }
}

#[test]
fn projections_hold_the_decoded_blocks_and_nothing_else_changes() {
    let dir = fixture("models/llama");
    let spec = ModelSpec::from_config_file(&dir.join("config.json")).unwrap();
    let src = SafetensorsFolder::open(&dir).unwrap();
    for quant in [BaseQuant::Q8_0, BaseQuant::Q4_0] {
        check_quantized_matches_encoding(&spec, &src, quant);
    }
    // Q4_K's super-blocks of 256 need wider rows than the fixtures have.
    let wide = ModelSpec::from_config_json(
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":64}"#,
    )
    .unwrap();
    let random = RandomSource {
        spec: wide.clone(),
        seed: 3,
    };
    check_quantized_matches_encoding(&wide, &random, BaseQuant::Q4K);
}

#[test]
fn a_width_the_type_cannot_encode_is_refused_by_name() {
    let dir = fixture("models/llama");
    let e = match lorafit::model::load_quantized(&dir, &Device::Cpu, BaseQuant::Q4K) {
        Ok(_) => panic!("a 64-wide projection in blocks of 256"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains("model.layers.0.self_attn.q_proj.weight")
            && e.contains("64 is not a multiple of 256")
            && e.contains("q4_0"),
        "{e}"
    );
}

/// `lorafit train --set base_quant="q4_0"` trains (losses finite, the adapter written), its
/// plan.toml keeps the setting, and its first loss differs from the dense base's; an unknown
/// type is refused naming the field and the choices.
#[test]
fn a_run_trains_on_a_quantized_base_and_records_it() {
    let root = std::env::temp_dir().join(format!("lorafit-qload-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let model = tiny_run::model_folder(&root);
    let data = root.join("train.jsonl");
    tiny_run::data_file(&data, 6, 1);
    let train = |out: &str, extra: &[&str]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"));
        cmd.args(["train", "--model", model.to_str().unwrap()])
            .args(["--data", data.to_str().unwrap()])
            .args(["--output", root.join(out).to_str().unwrap()])
            .args(["--steps", "3", "--device", "cpu"])
            .args(extra);
        cmd.output().unwrap()
    };
    let first_loss = |out: &str| -> f64 {
        let text = std::fs::read_to_string(root.join(out).join("metrics.jsonl")).unwrap();
        let line = text
            .lines()
            .find(|l| l.contains("\"loss\""))
            .expect("a step line");
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        v["loss"].as_f64().unwrap()
    };
    let q = train("q", &["--set", "base_quant=\"q4_0\""]);
    assert!(q.status.success(), "{}", String::from_utf8_lossy(&q.stderr));
    let plan = std::fs::read_to_string(root.join("q/plan.toml")).unwrap();
    assert!(plan.contains("base_quant = \"q4_0\""), "{plan}");
    assert!(root.join("q/adapter/adapter_model.safetensors").is_file());
    let d = train("d", &[]);
    assert!(d.status.success(), "{}", String::from_utf8_lossy(&d.stderr));
    let (lq, ld) = (first_loss("q"), first_loss("d"));
    assert!(lq.is_finite() && lq != ld, "q4_0 {lq} vs dense {ld}");

    let bad = train("bad", &["--set", "base_quant=\"q3\""]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && err.contains("base_quant") && err.contains("q4_0"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&root);
}
