//! GGUF files of the Gemma 2, Gemma 3 and MiniCPM fixture models (written by
//! scripts/make_gguf_family_fixtures.py from tests/fixtures/models/*) against their Hugging Face
//! folders: the same ModelSpec, the same weights once renamed, un-permuted and un-shifted, the
//! same logits on the CPU, and PyTorch's logits on the fixture's ids. Plus llama.cpp's conventions for metadata the converter leaves
//! out (synthetic files), the error for an unsupported architecture, and the SentencePiece
//! tokenizer on vocabularies trained by sentencepiece.

mod common;

use std::path::{Path, PathBuf};
use std::str::FromStr;

use common::{fixture, max_abs, max_diff};
use lorafit::data::gguf_tokenizer::{tokenizer_from_gguf, tokenizer_info_from_gguf};
use lorafit::model::config::{Activation, Family, RopeScaling};
use lorafit::model::gguf::GgufFile;
use lorafit::model::gguf_model::spec_from_gguf;
use lorafit::model::{Model, ModelSpec};
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
        for (what, x, y) in [
            ("q", &a.q, &b.q),
            ("k", a.k.as_ref().expect("k"), b.k.as_ref().expect("k")),
            ("v", a.v.as_ref().expect("v"), b.v.as_ref().expect("v")),
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

// --- llama.cpp's conventions, on synthetic files ------------------------------------------

enum Val {
    U32(u32),
    F32(f32),
    Str(&'static str),
}

/// A GGUF v3 file with the given metadata and one F32 `token_embd.weight` [vocab, hidden]
/// (zeros).
fn write_gguf(tag: &str, meta: &[(&str, Val)], vocab: usize, hidden: usize) -> PathBuf {
    fn s(v: &mut Vec<u8>, x: &str) {
        v.extend((x.len() as u64).to_le_bytes());
        v.extend(x.as_bytes());
    }
    let mut v = b"GGUF".to_vec();
    v.extend(3u32.to_le_bytes());
    v.extend(1u64.to_le_bytes());
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
        }
    }
    s(&mut v, "token_embd.weight");
    v.extend(2u32.to_le_bytes());
    v.extend((hidden as u64).to_le_bytes());
    v.extend((vocab as u64).to_le_bytes());
    v.extend(0u32.to_le_bytes());
    v.extend(0u64.to_le_bytes());
    while !v.len().is_multiple_of(32) {
        v.push(0);
    }
    v.extend(vec![0u8; vocab * hidden * 4]);
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
    for arch in ["llama", "gemma2", "gemma3", "minicpm"] {
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
    for name in ["gemma2", "gemma3", "minicpm", "minicpm_untied"] {
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
