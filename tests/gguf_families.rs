//! GGUF files of the Gemma 2, Gemma 3, Gemma 4 and MiniCPM fixture models (written by
//! scripts/make_gguf_family_fixtures.py from tests/fixtures/models/*) against their Hugging Face
//! folders: the same ModelSpec, the same weights once renamed, un-permuted and un-shifted, the
//! same logits on the CPU, and PyTorch's logits on the fixture's ids; for Gemma 4 also the same
//! LoRA gradients. Plus llama.cpp's conventions for metadata the converter leaves out
//! (synthetic files), the errors for inconsistent Gemma 4 per-layer metadata and for an
//! unsupported architecture, and the SentencePiece tokenizer on vocabularies trained by
//! sentencepiece.

mod common;

use std::path::{Path, PathBuf};
use std::str::FromStr;

use common::{fixture, max_abs, max_diff, rand_vec, rel_norm};
use lorafit::data::gguf_tokenizer::{tokenizer_from_gguf, tokenizer_info_from_gguf};
use lorafit::model::config::{Activation, Family, RopeScaling};
use lorafit::model::gguf::GgufFile;
use lorafit::model::gguf_model::spec_from_gguf;
use lorafit::model::weights::{load_weights, SafetensorsFolder, TensorSource};
use lorafit::model::{Lora, Model, ModelSpec, PassCtx};
use lorafit::tensor::{DType, Device, Tensor};

fn load(path: &Path) -> Model {
    lorafit::model::load(path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("loading {}: {e:#}", path.display()))
}

fn values(t: &Tensor) -> Vec<f32> {
    t.to_vec().unwrap()
}

/// LongRoPE's factors at f32 precision (GGUF stores them as f32 tensors and the attention
/// factor as an f32 key; config.json as decimal numbers).
fn f32_rope(scaling: &mut RopeScaling) {
    if let RopeScaling::LongRope {
        short,
        long,
        attention_factor,
        ..
    } = scaling
    {
        for x in short.iter_mut().chain(long.iter_mut()) {
            *x = *x as f32 as f64;
        }
        *attention_factor = *attention_factor as f32 as f64;
    }
}

/// The spec as text, with the fields a GGUF file legitimately changes set to the HF folder's:
/// the norm offset (GGUF Gemma norms hold 1 + w), the tensor prefixes, the special ids (the
/// GGUF carries its tokenizer's, the fixture folders none) and the vocab (Gemma 3's trimmed
/// token_embd); LongRoPE numbers at f32 precision on both sides.
fn comparable(spec: &ModelSpec, like: &ModelSpec) -> String {
    let mut s = spec.clone();
    s.norm_offset = like.norm_offset;
    s.tensor_prefix = like.tensor_prefix.clone();
    s.head_prefix = like.head_prefix.clone();
    s.bos_token_id = like.bos_token_id;
    s.eos_token_id = like.eos_token_id;
    s.vocab = like.vocab;
    rounded(s)
}

fn rounded(mut s: ModelSpec) -> String {
    f32_rope(&mut s.rope_scaling);
    for r in &mut s.ropes {
        f32_rope(&mut r.scaling);
    }
    format!("{s:#?}")
}

fn ids(n: usize, vocab: usize, seed: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 37 + seed * 11 + 5) % vocab) as u32)
        .collect()
}

/// `(rows, cols)` of `t` and its first `rows` rows.
fn first_rows(t: &[f32], cols: usize, rows: usize) -> &[f32] {
    &t[..rows * cols]
}

/// Every weight of `g` equals `h`'s (the embedding's first `g` rows); `tol` relative to each
/// tensor's largest value (0 for f32 files).
fn compare_weights(name: &str, g: &Model, h: &Model, tol: f64) {
    let close = |what: &str, got: &[f32], want: &[f32]| {
        let (d, i) = max_diff(got, want);
        let scale = max_abs(want).max(1e-30);
        assert!(
            d <= tol * scale,
            "{name}: {what}: max |diff| {d:.3e} at {i} (got {} want {}), tolerance {:.1e}",
            got[i],
            want[i],
            tol * scale
        );
    };
    let hidden = h.spec.hidden;
    let gv = g.spec.vocab;
    let ge = values(&g.weights.embed.dense().unwrap());
    let he = values(&h.weights.embed.dense().unwrap());
    close("embed_tokens", &ge, first_rows(&he, hidden, gv));
    close("norm", &values(&g.weights.norm), &values(&h.weights.norm));
    match (&g.weights.lm_head, &h.weights.lm_head) {
        (None, None) => {}
        (Some(a), Some(b)) => close(
            "lm_head",
            &values(&a.dense().unwrap()),
            &values(&b.dense().unwrap()),
        ),
        _ => panic!("{name}: one model is tied, the other is not"),
    }
    match (&g.weights.per_layer_inputs, &h.weights.per_layer_inputs) {
        (None, None) => {}
        (Some(a), Some(b)) => {
            let w = |x: &lorafit::model::weights::Weight| values(&x.dense().unwrap());
            close("embed_tokens_per_layer", &w(&a.embed), &w(&b.embed));
            close(
                "per_layer_model_projection",
                &w(&a.projection),
                &w(&b.projection),
            );
            close(
                "per_layer_projection_norm",
                &values(&a.norm),
                &values(&b.norm),
            );
        }
        _ => panic!("{name}: per-layer inputs in one model only"),
    }
    for (l, (a, b)) in g.weights.layers.iter().zip(&h.weights.layers).enumerate() {
        let t = |x: &Tensor| values(x);
        let w = |x: &lorafit::model::weights::Weight| values(&x.dense().unwrap());
        let opt = |what: &str, x: &Option<Tensor>, y: &Option<Tensor>| match (x, y) {
            (None, None) => {}
            (Some(x), Some(y)) => close(&format!("layer {l} {what}"), &t(x), &t(y)),
            _ => panic!("{name}: layer {l} {what} present in one model only"),
        };
        close(
            &format!("layer {l} attn_norm"),
            &t(&a.attn_norm),
            &t(&b.attn_norm),
        );
        close(
            &format!("layer {l} mlp_norm"),
            &t(&a.mlp_norm),
            &t(&b.mlp_norm),
        );
        opt("post_attn_norm", &a.post_attn_norm, &b.post_attn_norm);
        opt("post_mlp_norm", &a.post_mlp_norm, &b.post_mlp_norm);
        opt("q_norm", &a.q_norm, &b.q_norm);
        opt("k_norm", &a.k_norm, &b.k_norm);
        // KV-sharing layers have no k and v, k_eq_v layers no v (Gemma 4).
        for (what, x, y) in [("k", &a.k, &b.k), ("v", &a.v, &b.v)] {
            match (x, y) {
                (None, None) => {}
                (Some(x), Some(y)) => close(&format!("layer {l} {what}"), &w(x), &w(y)),
                _ => panic!("{name}: layer {l} {what} present in one model only"),
            }
        }
        assert_eq!(
            a.layer_scalar, b.layer_scalar,
            "{name}: layer {l} layer_scalar"
        );
        match (&a.per_layer, &b.per_layer) {
            (None, None) => {}
            (Some(x), Some(y)) => {
                close(
                    &format!("layer {l} per_layer gate"),
                    &w(&x.gate),
                    &w(&y.gate),
                );
                close(
                    &format!("layer {l} per_layer proj"),
                    &w(&x.proj),
                    &w(&y.proj),
                );
                close(
                    &format!("layer {l} per_layer norm"),
                    &t(&x.norm),
                    &t(&y.norm),
                );
            }
            _ => panic!("{name}: layer {l} per-layer branch in one model only"),
        }
        for (what, x, y) in [
            ("q", &a.q, &b.q),
            ("o", &a.o, &b.o),
            ("gate", &a.gate, &b.gate),
            ("up", &a.up, &b.up),
            ("down", &a.down, &b.down),
        ] {
            close(&format!("layer {l} {what}"), &w(x), &w(y));
        }
    }
}

/// Hidden states and logits of both models on the same ids; `None` (with the reason printed)
/// while an op the family needs is not available on this branch.
fn forward(name: &str, m: &Model, ids: &[u32]) -> Option<(Vec<f32>, Vec<f32>)> {
    let h = match m.hidden_states(ids, None) {
        Ok(h) => h,
        Err(e) if format!("{e:#}").contains("not yet available") => {
            eprintln!("note: {name}: skipping the forward comparison: {e:#}");
            return None;
        }
        Err(e) => panic!("{name}: forward: {e:#}"),
    };
    let z = match m.logits(&h, DType::F32) {
        Ok(z) => z,
        Err(e) if format!("{e:#}").contains("not yet available") => {
            eprintln!("note: {name}: comparing hidden states only: {e:#}");
            return Some((values(&h), Vec::new()));
        }
        Err(e) => panic!("{name}: logits: {e:#}"),
    };
    Some((values(&h), values(&z)))
}

/// The GGUF's logits equal the HF folder's within `tol`·max|logit| (and the hidden states
/// within `tol`·max|h|), on every sequence length in `lens`.
fn compare_forward(name: &str, g: &Model, h: &Model, lens: &[usize], tol: f64) {
    for (seed, &t) in lens.iter().enumerate() {
        let ids = ids(t, g.spec.vocab, seed);
        let Some((gh, gz)) = forward(name, g, &ids) else {
            return;
        };
        let (hh, hz) = forward(name, h, &ids).expect("the GGUF ran, so the folder runs");
        let (d, i) = max_diff(&gh, &hh);
        assert!(
            d <= tol * max_abs(&hh),
            "{name} (T={t}): hidden states differ by {d:.3e} at {i} (max |h| {:.3e})",
            max_abs(&hh)
        );
        if gz.is_empty() || hz.is_empty() {
            continue;
        }
        // Gemma 3's GGUF has fewer logits (its trimmed vocab): compare the common columns.
        let (gv, hv) = (g.spec.vocab, h.spec.vocab);
        let hz: Vec<f32> = hz
            .chunks(hv)
            .flat_map(|row| row[..gv].iter().copied())
            .collect();
        let (d, i) = max_diff(&gz, &hz);
        let scale = max_abs(&hz);
        assert!(
            d <= tol * scale,
            "{name} (T={t}): logits differ by {d:.3e} at {i} (got {} want {}; max |logit| {scale:.3e})",
            gz[i],
            hz[i]
        );
        eprintln!(
            "{name} (T={t}): max |logit diff| {d:.2e} (max |logit| {scale:.2e}, tolerance {:.1e})",
            tol * scale
        );
    }
}

/// Loads `tests/fixtures/gguf/<name>.gguf` and `tests/fixtures/models/<name>/` and compares
/// spec, weights and forward.
fn check_family(name: &str, weight_tol: f64, logit_tol: f64, lens: &[usize]) -> (Model, Model) {
    let gguf = fixture(&format!("gguf/{name}.gguf"));
    let hf = fixture(&format!("models/{name}"));
    let g = load(&gguf);
    let h = load(&hf);
    assert_eq!(
        comparable(&g.spec, &h.spec),
        rounded(h.spec.clone()),
        "{name}: the GGUF's spec differs from the HF folder's"
    );
    compare_weights(name, &g, &h, weight_tol);
    compare_forward(name, &g, &h, lens, logit_tol);
    compare_pytorch(name, &g, logit_tol.max(1e-4));
    (g, h)
}

/// The GGUF's logits on the fixture's ids against PyTorch's base-model logits
/// (`reference.safetensors`, made by scripts/make_model_fixtures.py), on the GGUF's vocab.
fn compare_pytorch(name: &str, g: &Model, tol: f64) {
    let r = common::read_safetensors(&fixture(&format!("models/{name}/reference.safetensors")));
    let ids: Vec<u32> = r["input_ids"].1.iter().map(|&x| x as u32).collect();
    let (shape, want) = &r["base_logits"];
    let Some((_, got)) = forward(name, g, &ids) else {
        return;
    };
    let gv = g.spec.vocab;
    let want: Vec<f32> = want
        .chunks(shape[1])
        .flat_map(|row| row[..gv].iter().copied())
        .collect();
    let (d, i) = max_diff(&got, &want);
    let scale = max_abs(&want);
    assert!(
        d <= tol * scale,
        "{name}: logits vs PyTorch differ by {d:.3e} at {i} (got {} want {}; max |logit| {scale:.3e})",
        got[i],
        want[i]
    );
    eprintln!("{name}: vs PyTorch max |logit diff| {d:.2e} (max |logit| {scale:.2e})");
}

#[test]
fn gemma2_gguf_matches_hf_folder() {
    let (g, h) = check_family("gemma2", 0.0, 1e-5, &[16]);
    assert_eq!(g.spec.family, Family::Gemma2);
    assert_eq!((g.spec.norm_offset, h.spec.norm_offset), (0.0, 1.0));
    assert_eq!(g.spec.final_logit_softcap, Some(2.0));
    let windows: Vec<_> = g.spec.layers.iter().map(|l| l.window).collect();
    assert_eq!(windows, [Some(6), None, Some(6)]);
    for l in &g.spec.layers {
        assert_eq!(l.attn_softcap, Some(1.0));
        assert_eq!(l.attn_scale, (1.0 / 24f64.sqrt()) as f32);
        assert_eq!(l.activation, Activation::GeluTanh);
        assert!(l.sandwich_norms);
    }
    assert!(g.spec.tie_embeddings && g.weights.lm_head.is_none());
}

#[test]
fn gemma3_gguf_matches_hf_folder() {
    let (g, h) = check_family("gemma3", 0.0, 1e-5, &[16]);
    assert_eq!(g.spec.family, Family::Gemma3);
    assert_eq!(g.spec.norm_offset, 0.0);
    // token_embd trimmed to the tokenizer's 250 tokens.
    assert_eq!((g.spec.vocab, h.spec.vocab), (250, 256));
    let layers: Vec<_> = g.spec.layers.iter().map(|l| (l.window, l.rope)).collect();
    assert_eq!(layers, [(Some(6), 1), (Some(6), 1), (None, 0)]);
    assert_eq!(g.spec.ropes.len(), 2);
    assert_eq!(g.spec.ropes[0].theta, 1e6);
    assert_eq!(g.spec.ropes[0].scaling, RopeScaling::Linear { factor: 8.0 });
    assert_eq!(g.spec.ropes[1].theta, 1e4);
    assert_eq!(g.spec.ropes[1].scaling, RopeScaling::None);
    assert!(g.spec.qk_norm && g.spec.final_logit_softcap.is_none());
    assert!(g.spec.layers.iter().all(|l| l.attn_softcap.is_none()));
}

#[test]
fn minicpm_gguf_matches_hf_folder() {
    // T = 16 runs past the original context of 8 (long factors), T = 6 does not (short).
    let (g, _) = check_family("minicpm", 0.0, 1e-5, &[16, 6]);
    assert_eq!(g.spec.family, Family::MiniCpm);
    assert_eq!(g.spec.embed_scale, Some(12.0));
    let residual = (0.7 / 2f64.sqrt()) as f32;
    assert!(g.spec.layers.iter().all(|l| l.residual_scale == residual));
    assert_eq!(g.spec.head_input_scale, Some(0.25));
    match &g.spec.ropes[0].scaling {
        RopeScaling::LongRope {
            short,
            long,
            original_max_position_embeddings,
            attention_factor,
        } => {
            assert_eq!(*original_max_position_embeddings, 8);
            assert!((attention_factor - 1.2909944).abs() < 1e-6);
            assert_eq!((short.len(), long.len()), (8, 8));
        }
        other => panic!("minicpm: expected LongRoPE, got {other:?}"),
    }
    assert!(g.spec.tie_embeddings && g.weights.lm_head.is_none());
}

#[test]
fn minicpm_untied_f16_gguf_matches_hf_folder() {
    // F16 matrices: the weights and logits agree to f16 rounding.
    let (g, _) = check_family("minicpm_untied", 1e-3, 5e-3, &[16]);
    assert!(!g.spec.tie_embeddings && g.weights.lm_head.is_some());
    assert_eq!(g.spec.ropes[0].scaling, RopeScaling::None);
    let f = GgufFile::open(&fixture("gguf/minicpm_untied.gguf")).unwrap();
    let t = f.tensor_info("blk.0.attn_q.weight").unwrap();
    assert_eq!(t.ggml_type, lorafit::model::gguf::GgmlType::F16);
}

/// The LoRA gradients (the fixture's adapter, every pair) of the GGUF model equal the HF
/// folder's within relative-norm error `tol`, from one d(logits) on the fixture's ids; the
/// logits with the adapter on within `tol`·max|logit|.
fn compare_lora_grads(name: &str, g: &Model, h: &Model, tol: f64) {
    assert_eq!(
        g.spec.vocab, h.spec.vocab,
        "{name}: gradients need one vocab"
    );
    let dir = fixture(&format!("models/{name}/adapter"));
    let r = common::read_safetensors(&fixture(&format!("models/{name}/reference.safetensors")));
    let ids: Vec<u32> = r["input_ids"].1.iter().map(|&x| x as u32).collect();
    let t = ids.len();
    let d_logits = rand_vec(t * g.spec.vocab, 7);
    let run = |m: &Model| -> (Vec<f32>, Vec<Vec<f32>>) {
        let mut lora = Lora::load_peft(&dir, &m.spec, &Device::Cpu)
            .unwrap_or_else(|e| panic!("{name}: adapter: {e:#}"));
        let mask = m.causal_mask(t);
        let rope = m.rope_table(&mask.positions).unwrap();
        let ctx = PassCtx {
            mask: &mask,
            rope: &rope,
            dropout: None,
        };
        lora.zero_grads().unwrap();
        let (hidden, state) = m.forward(&ids, Some(&lora), &ctx, 0).unwrap();
        let logits = m.logits(&hidden, DType::F32).unwrap();
        let dz = Tensor::cpu(d_logits.clone(), &[t, m.spec.vocab]).unwrap();
        let dh = m.logits_bwd_capped(&dz, &logits).unwrap();
        m.backward(dh, state, Some(&mut lora), &ctx).unwrap();
        let grads = lora
            .pairs()
            .flat_map(|(_, _, p)| [p.grad_a.to_vec().unwrap(), p.grad_b.to_vec().unwrap()])
            .collect();
        (values(&logits), grads)
    };
    let (gz, gg) = run(g);
    let (hz, hg) = run(h);
    let (d, i) = max_diff(&gz, &hz);
    assert!(
        d <= tol * max_abs(&hz),
        "{name}: logits with the adapter differ by {d:.3e} at {i}"
    );
    assert_eq!(gg.len(), hg.len(), "{name}: adapter pairs");
    assert!(!gg.is_empty(), "{name}: no adapter pairs");
    let mut worst = 0f64;
    for (i, (a, b)) in gg.iter().zip(&hg).enumerate() {
        assert!(
            b.iter().any(|&x| x != 0.0),
            "{name}: gradient {i} is all zero"
        );
        let e = rel_norm(a, b);
        assert!(
            e <= tol,
            "{name}: LoRA gradient {i} differs by relative norm {e:.3e} (tolerance {tol:.1e})"
        );
        worst = worst.max(e);
    }
    eprintln!(
        "{name}: {} LoRA gradients, worst relative-norm difference {worst:.2e}",
        gg.len()
    );
}

#[test]
fn gemma4_gguf_matches_hf_folder() {
    // F32: per-layer MLP widths (double-wide on the KV-sharing layers), one kv-head count,
    // rope_freqs as proportional RoPE, KV sharing from layer 5, per-layer inputs.
    let (g, h) = check_family("gemma4", 0.0, 1e-5, &[16, 9]);
    compare_lora_grads("gemma4", &g, &h, 1e-5);
    assert_eq!(g.spec.family, Family::Gemma4);
    assert_eq!((g.spec.norm_offset, h.spec.norm_offset), (0.0, 0.0));
    assert_eq!(g.spec.per_layer_input, 8);
    assert_eq!(g.spec.final_logit_softcap, Some(2.0));
    let widths: Vec<_> = g.spec.layers.iter().map(|l| l.intermediate).collect();
    assert_eq!(widths, [48, 48, 48, 48, 48, 96, 96, 96]);
    let donors: Vec<_> = g.spec.layers.iter().map(|l| l.kv_source).collect();
    assert_eq!(
        donors,
        [None, None, None, None, None, Some(3), Some(3), Some(4)]
    );
    assert_eq!(
        g.spec.ropes[1].scaling,
        RopeScaling::Proportional {
            rotated_pairs: 4,
            factor: 1.0
        }
    );
    assert!(g
        .spec
        .layers
        .iter()
        .all(|l| l.attn_scale == 1.0 && !l.k_eq_v));
    let f = GgufFile::open(&fixture("gguf/gemma4.gguf")).unwrap();
    assert_eq!(
        f.tensor_info("blk.0.attn_q.weight").unwrap().ggml_type,
        lorafit::model::gguf::GgmlType::F32
    );
}

/// The Hugging Face folder `models/<name>` with every matrix rounded to f16 as gguf-py's
/// `astype(float16)` rounds it (to nearest, ties to even): the weights an F16 GGUF holds.
fn hf_rounded_to_f16(name: &str) -> Model {
    struct Rounded(SafetensorsFolder);
    impl TensorSource for Rounded {
        fn get(&self, name: &str) -> anyhow::Result<(Vec<usize>, Vec<f32>)> {
            let (shape, mut data) = self.0.get(name)?;
            if shape.len() >= 2 {
                for x in &mut data {
                    *x = half::f16::from_f32(*x).to_f32();
                }
            }
            Ok((shape, data))
        }
        fn contains(&self, name: &str) -> bool {
            self.0.contains(name)
        }
        fn describe(&self) -> String {
            self.0.describe()
        }
    }
    let dir = fixture(&format!("models/{name}"));
    let spec = ModelSpec::from_config_file(&dir.join("config.json")).unwrap();
    let src = Rounded(SafetensorsFolder::open(&dir).unwrap());
    let weights = load_weights(&spec, &src, &Device::Cpu).unwrap();
    Model::new(spec, weights, Device::Cpu)
}

#[test]
fn gemma4_k_eq_v_f16_gguf_matches_hf_folder() {
    // F16 matrices; per-layer head_count_kv (2 sliding, 1 full) and full layers without attn_v
    // (v from the k projection). Against the folder with its matrices rounded to f16 (what the
    // file stores): the f32 bounds. Against the folder itself the f16 rounding of eight layers
    // of random weights moves the hidden states by ~1% of their largest value, so there the
    // bound is 2e-2.
    let name = "gemma4_keqv";
    let g = load(&fixture(&format!("gguf/{name}.gguf")));
    let h = load(&fixture(&format!("models/{name}")));
    let h16 = hf_rounded_to_f16(name);
    assert_eq!(
        comparable(&g.spec, &h.spec),
        rounded(h.spec.clone()),
        "{name}: the GGUF's spec differs from the HF folder's"
    );
    compare_weights(name, &g, &h16, 0.0);
    compare_forward(name, &g, &h16, &[16, 9], 1e-5);
    compare_lora_grads(name, &g, &h16, 1e-5);
    compare_weights(name, &g, &h, 1e-3);
    compare_forward(name, &g, &h, &[16], 2e-2);
    compare_pytorch(name, &g, 2e-2);

    let kv: Vec<_> = g.spec.layers.iter().map(|l| l.n_kv_heads).collect();
    assert_eq!(kv, [2, 2, 1, 2, 1, 2, 2, 1]);
    let k_eq_v: Vec<_> = g.spec.layers.iter().map(|l| l.k_eq_v).collect();
    let want: Vec<_> = h.spec.layers.iter().map(|l| l.k_eq_v).collect();
    assert_eq!(k_eq_v, want);
    assert!(k_eq_v[2] && k_eq_v[4] && !k_eq_v[0]);
    let f = GgufFile::open(&fixture("gguf/gemma4_keqv.gguf")).unwrap();
    assert_eq!(
        f.tensor_info("blk.0.attn_q.weight").unwrap().ggml_type,
        lorafit::model::gguf::GgmlType::F16
    );
    assert!(f.tensor_info("blk.2.attn_v.weight").is_err());
}

// --- llama.cpp's conventions, on synthetic files ------------------------------------------

enum Val {
    U32(u32),
    F32(f32),
    Str(&'static str),
    U32s(Vec<u32>),
    Bools(Vec<bool>),
}

/// A GGUF v3 file with the given metadata and one F32 `token_embd.weight` [vocab, hidden]
/// (zeros).
fn write_gguf(tag: &str, meta: &[(&str, Val)], vocab: usize, hidden: usize) -> PathBuf {
    let zeros = vec![0f32; vocab * hidden];
    write_gguf_tensors(
        tag,
        meta,
        &[("token_embd.weight", &[hidden, vocab], &zeros)],
    )
}

/// A GGUF v3 file with the given metadata and F32 tensors `(name, ggml dims, values)`.
fn write_gguf_tensors(
    tag: &str,
    meta: &[(&str, Val)],
    tensors: &[(&str, &[usize], &[f32])],
) -> PathBuf {
    fn s(v: &mut Vec<u8>, x: &str) {
        v.extend((x.len() as u64).to_le_bytes());
        v.extend(x.as_bytes());
    }
    let mut v = b"GGUF".to_vec();
    v.extend(3u32.to_le_bytes());
    v.extend((tensors.len() as u64).to_le_bytes());
    v.extend((meta.len() as u64).to_le_bytes());
    for (k, val) in meta {
        s(&mut v, k);
        match val {
            Val::U32(x) => {
                v.extend(4u32.to_le_bytes());
                v.extend(x.to_le_bytes());
            }
            Val::F32(x) => {
                v.extend(6u32.to_le_bytes());
                v.extend(x.to_le_bytes());
            }
            Val::Str(x) => {
                v.extend(8u32.to_le_bytes());
                s(&mut v, x);
            }
            Val::U32s(xs) => {
                v.extend(9u32.to_le_bytes());
                v.extend(4u32.to_le_bytes());
                v.extend((xs.len() as u64).to_le_bytes());
                for x in xs {
                    v.extend(x.to_le_bytes());
                }
            }
            Val::Bools(xs) => {
                v.extend(9u32.to_le_bytes());
                v.extend(7u32.to_le_bytes());
                v.extend((xs.len() as u64).to_le_bytes());
                v.extend(xs.iter().map(|&b| b as u8));
            }
        }
    }
    let mut offset = 0usize;
    let mut offsets = Vec::new();
    for (name, dims, data) in tensors {
        s(&mut v, name);
        v.extend((dims.len() as u32).to_le_bytes());
        for &d in dims.iter() {
            v.extend((d as u64).to_le_bytes());
        }
        v.extend(0u32.to_le_bytes());
        v.extend((offset as u64).to_le_bytes());
        offsets.push(offset);
        offset += (data.len() * 4).div_ceil(32) * 32;
    }
    while !v.len().is_multiple_of(32) {
        v.push(0);
    }
    let start = v.len();
    for ((_, _, data), off) in tensors.iter().zip(offsets) {
        v.resize(start + off, 0);
        v.extend(data.iter().flat_map(|x| x.to_le_bytes()));
    }
    let p = std::env::temp_dir().join(format!(
        "lorafit-gguf-families-{}-{tag}.gguf",
        std::process::id()
    ));
    std::fs::write(&p, v).unwrap();
    p
}

fn geometry(arch: &'static str, layers: u32) -> Vec<(String, Val)> {
    let k = |s: &str| format!("{arch}.{s}");
    vec![
        ("general.architecture".into(), Val::Str(arch)),
        (k("block_count"), Val::U32(layers)),
        (k("embedding_length"), Val::U32(64)),
        (k("feed_forward_length"), Val::U32(96)),
        (k("attention.head_count"), Val::U32(4)),
        (k("attention.head_count_kv"), Val::U32(2)),
    ]
}

fn spec_of(tag: &str, meta: Vec<(String, Val)>) -> ModelSpec {
    let meta: Vec<(&str, Val)> = meta.iter().map(|(k, v)| (k.as_str(), clone(v))).collect();
    let p = write_gguf(tag, &meta, 8, 64);
    let spec =
        spec_from_gguf(&GgufFile::open(&p).unwrap()).unwrap_or_else(|e| panic!("{tag}: {e:#}"));
    let _ = std::fs::remove_file(&p);
    spec
}

fn clone(v: &Val) -> Val {
    match v {
        Val::U32(x) => Val::U32(*x),
        Val::F32(x) => Val::F32(*x),
        Val::Str(x) => Val::Str(x),
        Val::U32s(x) => Val::U32s(x.clone()),
        Val::Bools(x) => Val::Bools(x.clone()),
    }
}

#[test]
fn gemma_metadata_follows_llama_cpp_conventions() {
    // Gemma 2 without softcap or window keys: llama.cpp's defaults 50 / 30 / 4096, even
    // layers sliding, head_dim^-½ scores (key_length 32 here, hidden/heads 16).
    let mut m = geometry("gemma2", 4);
    m.push(("gemma2.attention.key_length".into(), Val::U32(32)));
    let s = spec_of("gemma2-defaults", m);
    assert_eq!(s.norm_offset, 0.0);
    assert_eq!(s.head_dim, 32);
    assert_eq!(s.final_logit_softcap, Some(30.0));
    let w: Vec<_> = s.layers.iter().map(|l| l.window).collect();
    assert_eq!(w, [Some(4096), None, Some(4096), None]);
    assert!(s.layers.iter().all(|l| l.attn_softcap == Some(50.0)));
    assert!(s
        .layers
        .iter()
        .all(|l| l.attn_scale == (1.0 / 32f64.sqrt()) as f32));
    assert_eq!(s.ropes[0].theta, 1e4);

    // The 27B (46 layers) scales by (hidden/heads)^-½.
    let mut m = geometry("gemma2", 46);
    m.push(("gemma2.attention.key_length".into(), Val::U32(32)));
    let s = spec_of("gemma2-27b", m);
    assert!(s.layers.iter().all(|l| l.attn_scale == 0.25));

    // Gemma 3 with a window but no pattern: 5 sliding, 1 global; local base 1e4 unscaled,
    // global base 1e6.
    let mut m = geometry("gemma3", 12);
    m.push(("gemma3.attention.key_length".into(), Val::U32(16)));
    m.push(("gemma3.attention.sliding_window".into(), Val::U32(512)));
    let s = spec_of("gemma3-pattern", m);
    let slides: Vec<bool> = s.layers.iter().map(|l| l.window.is_some()).collect();
    let want: Vec<bool> = (0..12).map(|l| l % 6 != 5).collect();
    assert_eq!(slides, want);
    assert!(s
        .layers
        .iter()
        .all(|l| l.rope == usize::from(l.window.is_some())));
    assert_eq!((s.ropes[0].theta, s.ropes[1].theta), (1e6, 1e4));
    assert!(s.final_logit_softcap.is_none() && s.qk_norm);
    assert!(s.layers.iter().all(|l| l.attn_scale == 0.25));

    // A period as the pattern key; without a window every layer is global.
    let mut m = geometry("gemma3", 4);
    m.push(("gemma3.attention.sliding_window".into(), Val::U32(8)));
    m.push((
        "gemma3.attention.sliding_window_pattern".into(),
        Val::U32(2),
    ));
    let s = spec_of("gemma3-period", m);
    let w: Vec<_> = s.layers.iter().map(|l| l.window).collect();
    assert_eq!(w, [Some(8), None, Some(8), None]);
    let s = spec_of("gemma3-global", geometry("gemma3", 4));
    assert!(s.layers.iter().all(|l| l.window.is_none() && l.rope == 0));
}

/// A four-layer gemma4 file's keys as llama.cpp's converter writes them (three sliding layers,
/// then a full one; key_length 32, key_length_swa 16), with `over` replacing or adding keys
/// (a `None` value removes one).
fn gemma4_meta(over: Vec<(&str, Option<Val>)>) -> Vec<(String, Val)> {
    let mut m = geometry("gemma4", 4);
    let k = |s: &str| format!("gemma4.{s}");
    m.extend([
        (k("attention.key_length"), Val::U32(32)),
        (k("attention.value_length"), Val::U32(32)),
        (k("attention.key_length_swa"), Val::U32(16)),
        (k("attention.value_length_swa"), Val::U32(16)),
        (k("attention.sliding_window"), Val::U32(8)),
        (
            k("attention.sliding_window_pattern"),
            Val::Bools(vec![true, true, true, false]),
        ),
        (k("embedding_length_per_layer_input"), Val::U32(0)),
        (k("attention.shared_kv_layers"), Val::U32(0)),
        (k("rope.freq_base"), Val::F32(1e6)),
        (k("rope.freq_base_swa"), Val::F32(1e4)),
        (k("rope.dimension_count"), Val::U32(32)),
        (k("rope.dimension_count_swa"), Val::U32(16)),
    ]);
    for (key, val) in over {
        let key = k(key);
        m.retain(|(name, _)| *name != key);
        if let Some(val) = val {
            m.push((key, val));
        }
    }
    m
}

/// The spec of a gemma4 file with `meta` and `rope_freqs` (if given), or its error message
/// (which must name the file).
fn gemma4_spec(
    tag: &str,
    meta: Vec<(String, Val)>,
    rope_freqs: Option<&[f32]>,
) -> Result<ModelSpec, String> {
    let meta: Vec<(&str, Val)> = meta.iter().map(|(k, v)| (k.as_str(), clone(v))).collect();
    let embd = vec![0f32; 8 * 64];
    let mut tensors: Vec<(&str, &[usize], &[f32])> = vec![("token_embd.weight", &[64, 8], &embd)];
    let dims = [rope_freqs.map_or(0, |r| r.len())];
    if let Some(r) = rope_freqs {
        tensors.push(("rope_freqs.weight", &dims, r));
    }
    let p = write_gguf_tensors(tag, &meta, &tensors);
    let r = std::panic::catch_unwind(|| spec_from_gguf(&GgufFile::open(&p).unwrap()))
        .unwrap_or_else(|_| panic!("{tag}: reading the metadata panicked"));
    let _ = std::fs::remove_file(&p);
    r.map_err(|e| {
        let e = format!("{e:#}");
        assert!(
            e.contains(p.file_name().unwrap().to_str().unwrap()),
            "{tag}: {e}"
        );
        e
    })
}

#[test]
fn gemma4_metadata_follows_llama_cpp() {
    // Per-layer kv heads and MLP widths; every dim rotated without rope_freqs.
    let s = gemma4_spec(
        "gemma4-arrays",
        gemma4_meta(vec![
            ("attention.head_count_kv", Some(Val::U32s(vec![2, 2, 2, 1]))),
            (
                "feed_forward_length",
                Some(Val::U32s(vec![96, 96, 64, 128])),
            ),
        ]),
        None,
    )
    .unwrap();
    assert_eq!(s.family, Family::Gemma4);
    let l: Vec<_> = s
        .layers
        .iter()
        .map(|l| (l.window, l.head_dim, l.n_kv_heads, l.intermediate, l.rope))
        .collect();
    assert_eq!(
        l,
        [
            (Some(8), 16, 2, 96, 0),
            (Some(8), 16, 2, 96, 0),
            (Some(8), 16, 2, 64, 0),
            (None, 32, 1, 128, 1)
        ]
    );
    assert_eq!(s.intermediate, 128);
    assert_eq!((s.ropes[0].theta, s.ropes[1].theta), (1e4, 1e6));
    assert_eq!(s.ropes[1].scaling, RopeScaling::None);
    assert!(s.layers.iter().all(|l| l.attn_scale == 1.0 && l.v_norm));
    assert_eq!(s.norm_offset, 0.0);

    // rope_freqs: 1 for the rotated pairs, 1e30 for the others (a common factor ≠ 1 divides
    // the rotated frequencies).
    let mut freqs = vec![1e30f32; 16];
    freqs[..4].fill(1.0);
    let s = gemma4_spec("gemma4-ropefreqs", gemma4_meta(vec![]), Some(&freqs)).unwrap();
    assert_eq!(
        s.ropes[1].scaling,
        RopeScaling::Proportional {
            rotated_pairs: 4,
            factor: 1.0
        }
    );
    freqs[..4].fill(8.0);
    let s = gemma4_spec("gemma4-ropefactor", gemma4_meta(vec![]), Some(&freqs)).unwrap();
    assert_eq!(
        s.ropes[1].scaling,
        RopeScaling::Proportional {
            rotated_pairs: 4,
            factor: 8.0
        }
    );

    // KV sharing: layers 2 and 3 read layers 0 (sliding, n_kv − 2) and 1 (full, n_kv − 1).
    let s = gemma4_spec(
        "gemma4-shared",
        gemma4_meta(vec![
            (
                "attention.sliding_window_pattern",
                Some(Val::Bools(vec![true, false, true, false])),
            ),
            ("attention.shared_kv_layers", Some(Val::U32(2))),
        ]),
        None,
    )
    .unwrap();
    let donors: Vec<_> = s.layers.iter().map(|l| l.kv_source).collect();
    assert_eq!(donors, [None, None, Some(0), Some(1)]);
}

#[test]
fn gemma4_inconsistent_metadata_is_refused_by_key() {
    let kv = "gemma4.attention.head_count_kv";
    let ff = "gemma4.feed_forward_length";
    let heads = "gemma4.attention.head_count";
    let swa = "gemma4.attention.sliding_window_pattern";
    // (tag, keys replaced or removed, rope_freqs, what the error must name)
    type Case<'a> = (
        &'a str,
        Vec<(&'a str, Option<Val>)>,
        Option<Vec<f32>>,
        Vec<&'a str>,
    );
    let cases: Vec<Case> = vec![
        (
            "kv-length",
            vec![("attention.head_count_kv", Some(Val::U32s(vec![2, 2, 1])))],
            None,
            vec![kv, "3 entries", "block_count is 4"],
        ),
        (
            "kv-zero",
            vec![("attention.head_count_kv", Some(Val::U32s(vec![2, 0, 2, 1])))],
            None,
            vec![kv, "[1] is 0"],
        ),
        (
            "kv-not-dividing",
            vec![("attention.head_count_kv", Some(Val::U32s(vec![2, 2, 2, 3])))],
            None,
            vec!["layer 3", "3 key/value heads"],
        ),
        (
            "ff-length",
            vec![("feed_forward_length", Some(Val::U32s(vec![96; 5])))],
            None,
            vec![ff, "5 entries"],
        ),
        (
            "ff-zero",
            vec![("feed_forward_length", Some(Val::U32s(vec![96, 96, 96, 0])))],
            None,
            vec![ff, "[3] is 0"],
        ),
        (
            "heads-zero",
            vec![("attention.head_count", Some(Val::U32s(vec![4, 4, 0, 4])))],
            None,
            vec![heads, "[2] is 0"],
        ),
        (
            "heads-differ",
            vec![("attention.head_count", Some(Val::U32s(vec![4, 4, 8, 4])))],
            None,
            vec![heads, "differs between layers"],
        ),
        (
            "swa-period",
            vec![("attention.sliding_window_pattern", Some(Val::U32(6)))],
            None,
            vec![swa, "one flag per layer"],
        ),
        (
            "swa-length",
            vec![(
                "attention.sliding_window_pattern",
                Some(Val::Bools(vec![true, false])),
            )],
            None,
            vec![swa, "2 entries"],
        ),
        (
            "swa-missing",
            vec![("attention.sliding_window_pattern", None)],
            None,
            vec![swa, "missing"],
        ),
        (
            "swa-last-sliding",
            vec![(
                "attention.sliding_window_pattern",
                Some(Val::Bools(vec![false, true, true, true])),
            )],
            None,
            vec![swa, "last layer"],
        ),
        (
            "swa-key-length-missing",
            vec![("attention.key_length_swa", None)],
            None,
            vec!["gemma4.attention.key_length_swa", "missing"],
        ),
        (
            "value-length",
            vec![("attention.value_length_swa", Some(Val::U32(32)))],
            None,
            vec!["gemma4.attention.value_length_swa"],
        ),
        (
            "shared-all",
            vec![("attention.shared_kv_layers", Some(Val::U32(4)))],
            None,
            vec!["gemma4.attention.shared_kv_layers"],
        ),
        (
            // Layers 2 and 3 share; llama.cpp's sliding donor is layer 0, but the last sliding
            // layer that computes k/v is layer 1.
            "shared-donor",
            vec![
                (
                    "attention.sliding_window_pattern",
                    Some(Val::Bools(vec![false, true, true, false])),
                ),
                ("attention.shared_kv_layers", Some(Val::U32(2))),
            ],
            None,
            vec!["layer 2", "llama.cpp reads it from layer 0"],
        ),
        (
            "partial-rotation",
            vec![("rope.dimension_count", Some(Val::U32(8)))],
            None,
            vec!["gemma4.rope.dimension_count", "partial NeoX"],
        ),
        (
            "rope-freqs-length",
            vec![],
            Some(vec![1.0; 8]),
            vec!["rope_freqs.weight", "8 factors"],
        ),
        (
            "rope-freqs-pattern",
            vec![],
            Some([vec![1.0, 1e30, 1.0], vec![1e30; 13]].concat()),
            vec!["rope_freqs.weight", "not proportional RoPE"],
        ),
        (
            "rope-scaling",
            vec![("rope.scaling.type", Some(Val::Str("linear")))],
            None,
            vec!["gemma4.rope.scaling.type"],
        ),
    ];
    for (tag, over, freqs, want) in cases {
        let tag = format!("gemma4-bad-{tag}");
        let e = match gemma4_spec(&tag, gemma4_meta(over), freqs.as_deref()) {
            Ok(_) => panic!("{tag}: accepted"),
            Err(e) => e,
        };
        for w in want {
            assert!(e.contains(w), "{tag}: {e:?} does not mention {w:?}");
        }
    }
}

#[test]
fn minicpm_metadata_defaults_are_minicpm_2b() {
    let s = spec_of("minicpm-defaults", geometry("minicpm", 4));
    assert_eq!(s.family, Family::MiniCpm);
    assert_eq!(s.embed_scale, Some(12.0));
    assert!(s
        .layers
        .iter()
        .all(|l| (l.residual_scale - 0.7).abs() < 1e-6));
    assert_eq!(s.head_input_scale, Some(4.0));
    let mut m = geometry("minicpm", 4);
    m.push(("minicpm.embedding_scale".into(), Val::F32(10.0)));
    m.push(("minicpm.residual_scale".into(), Val::F32(0.5)));
    m.push(("minicpm.logit_scale".into(), Val::F32(8.0)));
    let s = spec_of("minicpm-keys", m);
    assert_eq!(s.embed_scale, Some(10.0));
    assert!(s
        .layers
        .iter()
        .all(|l| (l.residual_scale - 0.5).abs() < 1e-6));
    assert_eq!(s.head_input_scale, Some(0.125));
}

#[test]
fn unsupported_architecture_lists_the_supported_ones() {
    let mut m = geometry("qwen2", 2);
    m[0].1 = Val::Str("qwen2");
    let meta: Vec<(&str, Val)> = m.iter().map(|(k, v)| (k.as_str(), clone(v))).collect();
    let p = write_gguf("unsupported", &meta, 8, 64);
    let e = match lorafit::model::load(&p, &Device::Cpu) {
        Ok(_) => panic!("a qwen2 GGUF loaded"),
        Err(e) => format!("{e:#}"),
    };
    let _ = std::fs::remove_file(&p);
    assert!(
        e.contains("\"qwen2\"") && e.contains("not supported"),
        "{e}"
    );
    for arch in ["llama", "gemma2", "gemma3", "gemma4", "minicpm"] {
        assert!(e.contains(arch), "{e}");
    }
    assert!(e.contains(p.file_name().unwrap().to_str().unwrap()), "{e}");
}

// --- SentencePiece tokenizer ----------------------------------------------------------------

#[test]
fn spm_tokenizer_matches_sentencepiece() {
    let refs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("gguf/spm_ref.json")).unwrap())
            .unwrap();
    for (tag, prefix) in [("spm_prefix", true), ("spm_noprefix", false)] {
        let r = &refs["vocabs"][tag];
        assert_eq!(r["add_space_prefix"].as_bool(), Some(prefix));
        let f = GgufFile::open(&fixture(&format!("gguf/{tag}.gguf"))).unwrap();
        let tok = tokenizer_from_gguf(&f).unwrap_or_else(|e| panic!("{tag}: {e:#}"));
        let info = tokenizer_info_from_gguf(&f).unwrap();
        assert!(info.add_bos, "{tag}");
        assert_eq!(info.bos_id, r["bos_id"].as_u64().map(|x| x as u32));
        assert_eq!(
            tok.get_vocab_size(true) as u64,
            r["n_tokens"].as_u64().unwrap()
        );
        let cases = r["cases"].as_array().unwrap();
        assert!(cases.len() >= 10);
        for c in cases {
            let text = c["text"].as_str().unwrap();
            let want: Vec<u32> = c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect();
            let got = tok.encode(text, false).unwrap();
            assert_eq!(got.get_ids(), want.as_slice(), "{tag}: text {text:?}");
            assert_eq!(
                tok.decode(&want, false).unwrap(),
                text,
                "{tag}: decode {text:?}"
            );
        }
        // A control token in the text is one token; the text after it is a new fragment (with
        // its own prefix space where the vocab adds one), as llama.cpp splits it.
        let ctrl = r["ctrl_id"].as_u64().unwrap() as u32;
        let enc = |s: &str| tok.encode(s, false).unwrap().get_ids().to_vec();
        let mut want = enc("Hello");
        want.push(ctrl);
        want.extend(enc("world"));
        assert_eq!(enc("Hello<ctrl>world"), want, "{tag}");
        assert_eq!(
            tok.decode(&want, true).unwrap(),
            if prefix { "Hello world" } else { "Helloworld" },
            "{tag}"
        );
        // The JSON form (for saving next to an adapter) is the same tokenizer.
        let doc = lorafit::data::gguf_tokenizer::tokenizer_json_from_gguf(&f).unwrap();
        let again = tokenizers::Tokenizer::from_str(&doc.to_string()).unwrap();
        for c in cases {
            let text = c["text"].as_str().unwrap();
            assert_eq!(
                again.encode(text, false).unwrap().get_ids(),
                tok.encode(text, false).unwrap().get_ids(),
                "{tag}: JSON round trip, text {text:?}"
            );
        }
    }
}

#[test]
fn model_fixtures_carry_a_usable_vocab() {
    for name in [
        "gemma2",
        "gemma3",
        "gemma4",
        "gemma4_keqv",
        "minicpm",
        "minicpm_untied",
    ] {
        let f = GgufFile::open(&fixture(&format!("gguf/{name}.gguf"))).unwrap();
        let tok = tokenizer_from_gguf(&f).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let spec = spec_from_gguf(&f).unwrap();
        assert_eq!(tok.get_vocab_size(true), spec.vocab, "{name}");
        let ids = tok.encode("the cat sat on it", false).unwrap();
        assert!(ids.get_ids().iter().all(|&i| (i as usize) < spec.vocab));
        let text = tok.decode(ids.get_ids(), false).unwrap();
        assert_eq!(text, "the cat sat on it", "{name}");
        let info = tokenizer_info_from_gguf(&f).unwrap();
        assert!(info.add_bos, "{name}");
    }
}
