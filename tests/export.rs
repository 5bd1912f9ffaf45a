//! `lorafit export`: the GGUF writer read back by the project's reader, the adapter's llama.cpp
//! names, shapes and q/k row order, and every artefact's logits against the trainer's own on
//! the PyTorch fixture models and on quantized GGUF bases built here; an output folder holding
//! an earlier export refused, or replaced with `--overwrite`.

mod common;

use common::fixture;
use lorafit::export::check::{self, CheckRow};
use lorafit::export::gguf_out::{self, AdapterType, MergedType};
use lorafit::export::gguf_writer::{GgufTensor, GgufWriter};
use lorafit::export::hf::HfDtype;
use lorafit::export::quantize::quantize;
use lorafit::export::{run, ExportPlan, Format};
use lorafit::model::gguf::{GgmlType, GgufFile, MetaValue};
use lorafit::model::lora::peft_key;
use lorafit::model::{self, Lora, LoraConfig, Target};
use lorafit::tensor::{Device, Tensor};
use std::path::{Path, PathBuf};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lorafit-export-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn plan(model: &Path, adapter: &Path, out: &Path, formats: Vec<Format>) -> ExportPlan {
    ExportPlan {
        model: model.to_path_buf(),
        adapter: adapter.to_path_buf(),
        output: out.to_path_buf(),
        formats,
        hf_dtype: HfDtype::Bf16,
        adapter_type: AdapterType::F32,
        merged_type: MergedType::Keep,
        check: true,
        chat_template: None,
    }
}

/// Every row passed, and the adapter moves the logits far more than the artefact's error (so a
/// missing or misplaced delta could not pass). A 4-bit requantized GGUF is the exception: on
/// these tiny random models its requantization moves the logits by a third of the adapter's
/// effect (relative RMS error of the merged weights about 9%), so there the f16 merged GGUF of
/// the same base, checked beside it, is what shows the delta in the right place.
fn assert_rows(rows: &[CheckRow]) {
    assert!(!rows.is_empty());
    eprint!("{}", check::format_rows(rows));
    for r in rows {
        assert!(
            r.passed(),
            "{}: rel {} > bound {}",
            r.artefact,
            r.rel,
            r.bound
        );
        if check::unit_error(r.stored) > 1.0 / 64.0 {
            continue;
        }
        assert!(
            r.adapter_effect > 5.0 * r.max_abs,
            "{}: the adapter's effect {} is not well above the error {}",
            r.artefact,
            r.adapter_effect,
            r.max_abs
        );
    }
}

#[test]
fn gguf_writer_round_trips_through_the_reader() {
    let mut w = GgufWriter::new();
    w.set_str("general.architecture", "llama");
    w.set("general.alignment", MetaValue::U32(64));
    let values = [
        ("t.u8", MetaValue::U8(7)),
        ("t.i8", MetaValue::I8(-7)),
        ("t.u16", MetaValue::U16(65000)),
        ("t.i16", MetaValue::I16(-30000)),
        ("t.u32", MetaValue::U32(4_000_000_000)),
        ("t.i32", MetaValue::I32(-2_000_000_000)),
        ("t.f32", MetaValue::F32(1.5)),
        ("t.bool", MetaValue::Bool(true)),
        ("t.u64", MetaValue::U64(1 << 40)),
        ("t.i64", MetaValue::I64(-(1 << 40))),
        ("t.f64", MetaValue::F64(-2.25)),
        ("t.str", MetaValue::String("héllo".into())),
        (
            "t.arr",
            MetaValue::Array(vec![
                MetaValue::String("a".into()),
                MetaValue::String("bc".into()),
            ]),
        ),
        (
            "t.nested",
            MetaValue::Array(vec![MetaValue::Array(vec![
                MetaValue::I32(1),
                MetaValue::I32(2),
            ])]),
        ),
    ];
    for (k, v) in &values {
        w.set(k, v.clone());
    }
    // A later set of the same key replaces it in place.
    w.set("t.u8", MetaValue::U8(9));
    let x: Vec<f32> = (0..2 * 64).map(|i| (i as f32 * 0.37).sin()).collect();
    let types = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_1,
    ];
    for ty in types {
        w.add_tensor(GgufTensor {
            name: format!("w.{ty}"),
            dims: vec![64, 2],
            ggml_type: ty,
            data: quantize(ty, &x).unwrap(),
        })
        .unwrap();
    }
    w.add_tensor(GgufTensor::f32("odd", &[3], &[1.0, -2.0, 3.5]))
        .unwrap();
    assert!(
        w.add_tensor(GgufTensor::f32("odd", &[1], &[0.0])).is_err(),
        "a duplicate name is refused"
    );
    assert!(
        w.add_tensor(GgufTensor {
            name: "short".into(),
            dims: vec![32],
            ggml_type: GgmlType::Q8_0,
            data: vec![0; 33],
        })
        .is_err(),
        "a byte length that does not match is refused"
    );
    let dir = tmp("writer");
    let path = dir.join("t.gguf");
    w.write(&path).unwrap();
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.alignment(), 64);
    assert_eq!(g.get("t.u8"), Some(&MetaValue::U8(9)));
    for (k, v) in &values[1..] {
        assert_eq!(g.get(k), Some(v), "{k}");
    }
    assert_eq!(g.metadata()[2].0, "t.u8", "metadata keeps its order");
    for ty in types {
        let info = g.tensor_info(&format!("w.{ty}")).unwrap();
        assert_eq!(info.shape, vec![64, 2]);
        assert_eq!(info.ggml_type, ty);
        assert_eq!(info.offset % 64, 0);
        let mut want = vec![0f32; x.len()];
        lorafit::model::gguf::dequantize(ty, &quantize(ty, &x).unwrap(), x.len(), &mut want)
            .unwrap();
        assert_eq!(g.tensor_f32(&format!("w.{ty}")).unwrap(), want, "{ty}");
    }
    assert_eq!(g.tensor_f32("odd").unwrap(), vec![1.0, -2.0, 3.5]);
}

/// numpy's `w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2)` by index arithmetic.
fn numpy_permute(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let half = rows / n_head / 2;
    let mut out = Vec::with_capacity(w.len());
    for h in 0..n_head {
        for j in 0..half {
            for i in 0..2 {
                let r = (h * 2 + i) * half + j;
                out.extend_from_slice(&w[r * cols..(r + 1) * cols]);
            }
        }
    }
    out
}

/// The adapter file of the Llama fixture: llama.cpp's keys, names and dims, A as PEFT stores
/// it, B with q/k rows permuted per head (n_heads for q, n_kv_heads for k), the rest as is.
#[test]
fn gguf_adapter_names_shapes_and_permutation() {
    let base = fixture("models/llama");
    let spec = model::ModelSpec::from_config_file(&base.join("config.json")).unwrap();
    let lora = Lora::load_peft(&base.join("adapter"), &spec, &Device::Cpu).unwrap();
    let dir = tmp("adapter-names");
    let path = dir.join("adapter.gguf");
    let n = gguf_out::write_adapter(&lora, &spec, "llama", true, AdapterType::F32, &path).unwrap();
    assert_eq!(n, spec.n_layers * 7);
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.get_str("general.type").unwrap(), "adapter");
    assert_eq!(g.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(g.get_str("adapter.type").unwrap(), "lora");
    assert_eq!(g.get("adapter.lora.alpha"), Some(&MetaValue::F32(8.0)));
    let st = common::read_safetensors(&base.join("adapter/adapter_model.safetensors"));
    let leaf = |t: Target| match t {
        Target::Q => "attn_q",
        Target::K => "attn_k",
        Target::V => "attn_v",
        Target::O => "attn_output",
        Target::Gate => "ffn_gate",
        Target::Up => "ffn_up",
        Target::Down => "ffn_down",
    };
    for l in 0..spec.n_layers {
        for t in Target::ALL {
            let (out, inp) = t.dims(&spec, l).unwrap();
            let name = format!("blk.{l}.{}.weight", leaf(t));
            let a = g.tensor_info(&format!("{name}.lora_a")).unwrap();
            let b = g.tensor_info(&format!("{name}.lora_b")).unwrap();
            // llama-adapter.cpp: a.ne[0] == W.ne[0] (in), b.ne[1] == W.ne[1] (out),
            // a.ne[1] == b.ne[0] (rank).
            assert_eq!(a.shape, vec![inp, 4], "{name}");
            assert_eq!(b.shape, vec![4, out], "{name}");
            let (_, pa) = &st[&peft_key(l, t, false)];
            let (_, pb) = &st[&peft_key(l, t, true)];
            assert_eq!(
                &g.tensor_f32(&format!("{name}.lora_a")).unwrap(),
                pa,
                "{name} A"
            );
            let want_b = match t {
                Target::Q => numpy_permute(pb, out, 4, spec.n_heads),
                Target::K => numpy_permute(pb, out, 4, spec.n_kv_heads),
                _ => pb.clone(),
            };
            assert_eq!(
                g.tensor_f32(&format!("{name}.lora_b")).unwrap(),
                want_b,
                "{name} B"
            );
            if matches!(t, Target::Q | Target::K) {
                assert_ne!(&want_b, pb, "{name}: the permutation moves rows");
            }
        }
    }
    // Read back with llama.cpp's semantics: the same adapter.
    let back = gguf_out::read_adapter(&path, &spec, true).unwrap();
    for (l, t, p) in lora.pairs() {
        let q = back.get(l, t).unwrap();
        assert_eq!(q.scale, p.scale);
        assert_eq!(q.a.to_vec().unwrap(), p.a.to_vec().unwrap());
        assert_eq!(q.b.to_vec().unwrap(), p.b.to_vec().unwrap());
    }
}

/// rsLoRA with a rank pattern (the Qwen2 fixture): llama.cpp scales by alpha / r, so the
/// trained scale's ratio to it is folded into B; Qwen2 is not permuted.
#[test]
fn gguf_adapter_folds_rslora_scale_into_b() {
    let base = fixture("models/qwen2");
    let spec = model::ModelSpec::from_config_file(&base.join("config.json")).unwrap();
    let lora = Lora::load_peft(&base.join("adapter"), &spec, &Device::Cpu).unwrap();
    assert!(lora.config.rslora);
    let (arch, permutes) = gguf_out::llama_cpp_arch(&spec).unwrap();
    assert_eq!((arch, permutes), ("qwen2", false));
    let path = tmp("adapter-rslora").join("adapter.gguf");
    gguf_out::write_adapter(&lora, &spec, arch, permutes, AdapterType::F32, &path).unwrap();
    let g = GgufFile::open(&path).unwrap();
    let alpha = lora.config.alpha as f32;
    let mut ranks = std::collections::BTreeSet::new();
    for (l, t, p) in lora.pairs() {
        let name = format!("{}.lora_b", gguf_out::projection_name(l, t));
        let got = g.tensor_f32(&name).unwrap();
        let ratio = p.scale / (alpha / p.rank as f32);
        assert!(
            (ratio - 1.0).abs() > 1e-3,
            "rsLoRA's scale differs from alpha / r"
        );
        let want: Vec<f32> = p.b.to_vec().unwrap().iter().map(|x| x * ratio).collect();
        assert_eq!(got, want, "{name}");
        ranks.insert(p.rank);
    }
    assert!(
        ranks.len() > 1,
        "the fixture's rank pattern gives several ranks"
    );
}

/// Every Hugging Face fixture family: merged folder (f32 and bf16) and GGUF adapter (f32, f16)
/// through `export::run` with the check.
#[test]
fn hf_fixtures_export_within_bounds() {
    for name in [
        "llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "minicpm",
    ] {
        let base = fixture(&format!("models/{name}"));
        let out = tmp(&format!("hf-{name}"));
        let mut p = plan(&base, &base.join("adapter"), &out, vec![]);
        let bf16 = run(&p).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!(
            bf16.written.len(),
            2,
            "{name}: merged folder and adapter by default"
        );
        assert_rows(&bf16.checks);
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("merged-hf/config.json")).unwrap(),
        )
        .unwrap();
        let dtype = cfg.get("dtype").or(cfg.get("torch_dtype"));
        assert_eq!(dtype, Some(&serde_json::json!("bfloat16")), "{name}");
        let st = common::read_safetensors(&out.join("merged-hf/model.safetensors"));
        let src = common::read_safetensors(&base.join("model.safetensors"));
        assert_eq!(
            st.keys().collect::<std::collections::BTreeSet<_>>(),
            src.keys().collect::<std::collections::BTreeSet<_>>(),
            "{name}: every base tensor is written, none added"
        );
        p.hf_dtype = HfDtype::F32;
        p.adapter_type = AdapterType::F16;
        let exact = run(&p).unwrap();
        assert_rows(&exact.checks);
        // f32 storage: the merge is exact up to reassociation.
        assert!(
            exact.checks[0].rel < 1e-5,
            "{name}: {}",
            exact.checks[0].rel
        );
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// Gemma 4 (KV-sharing layers without k/v, per-layer inputs): the merged folder is checked; the
/// GGUF adapter is refused with a message naming the merged folder instead. The f32 folder shows
/// that the delta is merged in the right place: its error is ~1e-5 of the logits' scale (f32
/// reassociation through eight layers; the check's floor is 1e-5, so it is asserted at 1e-4
/// here) while the adapter moves them by far more. The bf16 folder's check is printed, not
/// asserted: these 8-layer random fixtures (unit attention scale over q/k-normed heads) are
/// chaotic under bf16 rounding — the base alone, no adapter, every weight rounded to bf16, moves
/// their logits by 0.16–0.24 of their scale (measured 2026-12-02) — so the check rightly reports
/// the bf16 folder (rel 0.38) outside its bound of 0.09; the merge is not what moves them.
#[test]
fn gemma4_merged_folder_within_bounds() {
    for name in ["gemma4", "gemma4_keqv"] {
        let base = fixture(&format!("models/{name}"));
        let out = tmp(&format!("hf-{name}"));
        let r = run(&plan(&base, &base.join("adapter"), &out, vec![Format::Hf]))
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        eprint!(
            "bf16 (printed, see above):\n{}",
            check::format_rows(&r.checks)
        );

        let mut f32_plan = plan(&base, &base.join("adapter"), &out, vec![Format::Hf]);
        f32_plan.hf_dtype = HfDtype::F32;
        let r = run(&f32_plan).unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let row = &r.checks[0];
        eprint!("{}", check::format_rows(&r.checks));
        assert!(row.rel < 1e-4, "{name}: f32 rel {}", row.rel);
        assert!(
            row.adapter_effect > 1e3 * row.max_abs,
            "{name}: the adapter's effect {} is not well above the error {}",
            row.adapter_effect,
            row.max_abs
        );

        let e = run(&plan(
            &base,
            &base.join("adapter"),
            &out,
            vec![Format::GgufAdapter],
        ))
        .err()
        .expect("no GGUF adapter for Gemma 4");
        assert!(e.to_string().contains("--format hf"), "{e}");
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// A Llama GGUF base with quantized projections, built from the Llama fixture with the
/// project's writer (q/k permuted as llama.cpp's converter does), and a non-zero adapter for it.
fn quantized_llama_gguf(dir: &Path, ty: GgmlType) -> PathBuf {
    let path = dir.join(format!("llama-{ty}.gguf"));
    common::llama_gguf::write_llama_gguf(&path, |_, t| {
        if t == Target::Down {
            GgmlType::Q8_0
        } else {
            ty
        }
    });
    path
}

/// A PEFT adapter with non-zero B (a trained adapter's shape), saved for `spec`'s model.
fn random_adapter(spec: &model::ModelSpec, dir: &Path, std: f32) -> PathBuf {
    let config = LoraConfig {
        rank: 4,
        alpha: 8.0,
        ..LoraConfig::default()
    };
    let mut lora = Lora::new(spec, config, &Device::Cpu).unwrap();
    let mut seed = 11;
    for (_, _, p) in lora.pairs_mut() {
        let shape = p.b.shape().to_vec();
        let n = shape.iter().product();
        seed += 1;
        let b = lorafit::model::weights::random_normal(n, seed, std);
        p.b = Tensor::from_f32(&b, &shape, lorafit::tensor::DType::F32, &Device::Cpu).unwrap();
    }
    lora.refresh_compute_copies().unwrap();
    let out = dir.join("adapter");
    lora.save_peft(&out, "test").unwrap();
    out
}

/// GGUF bases (Q8_0, Q4_0, Q4_1 projections, permuted q/k): the merged GGUF requantized and in
/// f16, the merged Hugging Face folder built from the GGUF, and the adapter, all checked.
#[test]
fn quantized_gguf_base_exports_within_bounds() {
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
        let dir = tmp(&format!("gguf-{ty}"));
        let base = quantized_llama_gguf(&dir, ty);
        let spec = model::gguf_model::GgufSource::open(&base).unwrap().spec;
        let adapter = random_adapter(&spec, &dir, 0.2);
        let out = dir.join("out");
        let mut p = plan(&base, &adapter, &out, vec![]);
        let r = run(&p).unwrap_or_else(|e| panic!("{ty}: {e:#}"));
        assert_eq!(r.written.len(), 3, "merged folder, adapter and merged GGUF");
        assert_rows(&r.checks);
        let merged = &r.checks[2];
        assert_eq!(merged.stored, ty, "requantized to the base's type");
        let g = GgufFile::open(&out.join("merged.gguf")).unwrap();
        assert_eq!(g.tensor_info("blk.0.attn_q.weight").unwrap().ggml_type, ty);
        assert_eq!(
            g.tensor_info("blk.0.ffn_down.weight").unwrap().ggml_type,
            GgmlType::Q8_0
        );
        let src = GgufFile::open(&base).unwrap();
        assert_eq!(
            g.tensor_bytes("token_embd.weight").unwrap(),
            src.tensor_bytes("token_embd.weight").unwrap(),
            "untouched tensors are copied byte for byte"
        );
        assert_eq!(g.metadata(), src.metadata());
        p.merged_type = MergedType::F16;
        p.formats = vec![Format::MergedGguf];
        let f16 = run(&p).unwrap();
        assert_rows(&f16.checks);
        assert_eq!(f16.checks[0].stored, GgmlType::F16);
        let g = GgufFile::open(&out.join("merged.gguf")).unwrap();
        assert_eq!(
            g.tensor_info("blk.1.attn_k.weight").unwrap().ggml_type,
            GgmlType::F16
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The Gemma and MiniCPM GGUF fixtures (norms stored as 1 + w, Gemma 3's trimmed vocab,
/// MiniCPM's permuted q/k and LongRoPE): every artefact, including the folder written from the
/// GGUF's metadata, reproduces the trainer's logits.
#[test]
fn gguf_family_fixtures_export_within_bounds() {
    for name in ["gemma2", "gemma3", "minicpm", "minicpm_untied"] {
        let base = fixture(&format!("gguf/{name}.gguf"));
        let dir = tmp(&format!("family-{name}"));
        let spec = model::gguf_model::GgufSource::open(&base).unwrap().spec;
        let adapter = random_adapter(&spec, &dir, 0.2);
        let r = run(&plan(&base, &adapter, &dir.join("out"), vec![]))
            .unwrap_or_else(|e| panic!("{name}: {e:#}"));
        assert_eq!(r.written.len(), 3);
        assert_rows(&r.checks);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// A fresh adapter (B = 0) changes nothing: the merged GGUF keeps every tensor's bytes.
#[test]
fn zero_adapter_leaves_merged_gguf_bytes_alone() {
    let dir = tmp("zero");
    let base = quantized_llama_gguf(&dir, GgmlType::Q4_0);
    let spec = model::gguf_model::GgufSource::open(&base).unwrap().spec;
    let adapter = random_adapter(&spec, &dir, 0.0);
    let out = dir.join("out");
    let mut p = plan(&base, &adapter, &out, vec![Format::MergedGguf]);
    p.check = false;
    run(&p).unwrap();
    let (a, b) = (
        GgufFile::open(&base).unwrap(),
        GgufFile::open(&out.join("merged.gguf")).unwrap(),
    );
    for info in a.tensor_infos() {
        assert_eq!(
            a.tensor_bytes(&info.name).unwrap(),
            b.tensor_bytes(&info.name).unwrap()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn export_refuses_bad_requests() {
    let base = fixture("models/llama");
    let out = tmp("refuse");
    let e = run(&plan(
        &base,
        &base.join("adapter"),
        &out,
        vec![Format::MergedGguf],
    ))
    .err()
    .expect("a merged GGUF needs a GGUF base");
    assert!(e.to_string().contains("needs a GGUF base"), "{e}");
    let e = run(&plan(&base, &out.join("nope"), &out, vec![]))
        .err()
        .unwrap();
    assert!(format!("{e:#}").contains("adapter_config.json"), "{e:#}");
    // An adapter file of another kind is refused by the reader with its file named.
    let not_adapter = fixture("gguf/minicpm.gguf");
    let spec = model::gguf_model::GgufSource::open(&not_adapter)
        .unwrap()
        .spec;
    let e = gguf_out::read_adapter(&not_adapter, &spec, true)
        .err()
        .unwrap();
    assert!(format!("{e:#}").contains("general.type"), "{e:#}");
    let _ = std::fs::remove_dir_all(&out);
}

/// `--chat-template`: the training run's template goes into the merged folder's
/// tokenizer_config.json and the merged GGUF's `tokenizer.chat_template`, every other metadata
/// key of the GGUF as the base's; a template file that does not compile stops the export before
/// anything is written.
#[test]
fn the_runs_chat_template_goes_into_the_merged_artefacts() {
    let dir = tmp("template");
    let base = quantized_llama_gguf(&dir, GgmlType::Q8_0);
    let spec = model::gguf_model::GgufSource::open(&base).unwrap().spec;
    let adapter = random_adapter(&spec, &dir, 0.2);
    let template = dir.join("run.jinja");
    let source = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}";
    std::fs::write(&template, source).unwrap();
    let out = dir.join("out");
    let mut p = plan(&base, &adapter, &out, vec![Format::Hf, Format::MergedGguf]);
    p.check = false;
    p.chat_template = Some(template.display().to_string());
    run(&p).unwrap();
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("merged-hf/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(config["chat_template"], source);
    let g = GgufFile::open(&out.join("merged.gguf")).unwrap();
    assert_eq!(g.get_str("tokenizer.chat_template").unwrap(), source);
    let src = GgufFile::open(&base).unwrap();
    let others = |f: &GgufFile| -> Vec<String> {
        f.metadata()
            .iter()
            .filter(|(k, _)| k != "tokenizer.chat_template")
            .map(|(k, v)| format!("{k}={v:?}"))
            .collect()
    };
    assert_eq!(others(&g), others(&src));

    std::fs::write(&template, "{% for m in messages %}").unwrap();
    p.output = dir.join("out-bad");
    let e = run(&p).err().expect("a template that does not compile");
    assert!(format!("{e:#}").contains("chat_template"), "{e:#}");
    assert!(!p.output.exists(), "nothing is written");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A folder holding an earlier export: `lorafit export` refuses it before writing anything,
/// naming the earlier artefacts; with `--overwrite` (and through `export::run`) those artefacts
/// are deleted first, so the folder holds the new export alone (no stale check.json reporting
/// the earlier one) and keeps what else it held.
#[test]
fn an_output_folder_holding_an_export_is_refused_or_replaced() {
    let base = fixture("models/llama");
    let adapter = base.join("adapter");
    let out = tmp("earlier");
    std::fs::write(out.join("notes.txt"), "mine").unwrap();
    let export = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
            .args(["export", "--model"])
            .arg(&base)
            .arg("--adapter")
            .arg(&adapter)
            .arg("--output")
            .arg(&out)
            .args(extra)
            .output()
            .unwrap()
    };
    let first = export(&["--check"]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let earlier = [
        "adapter.gguf",
        "check.json",
        "check.safetensors",
        "merged-hf",
    ];
    for name in earlier {
        assert!(out.join(name).exists(), "{name}");
    }
    let check_json = std::fs::read(out.join("check.json")).unwrap();

    let refused = export(&["--format", "hf"]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{err}");
    assert!(
        err.contains("already holds an export") && err.contains("--overwrite"),
        "{err}"
    );
    for name in earlier {
        assert!(err.contains(name), "{name} is named: {err}");
    }
    assert_eq!(
        std::fs::read(out.join("check.json")).unwrap(),
        check_json,
        "nothing is written"
    );
    assert!(out.join("adapter.gguf").exists());

    let replaced = export(&["--format", "hf", "--overwrite"]);
    assert!(
        replaced.status.success(),
        "{}",
        String::from_utf8_lossy(&replaced.stderr)
    );
    let mut left: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["merged-hf", "notes.txt"]);

    // The library call replaces as `--overwrite` does, and `refuse_earlier_export` names what
    // it would replace.
    let e = lorafit::export::refuse_earlier_export(&out).unwrap_err();
    assert!(e.to_string().contains("merged-hf"), "{e}");
    let mut p = plan(&base, &adapter, &out, vec![Format::GgufAdapter]);
    p.check = false;
    run(&p).unwrap();
    assert!(!out.join("merged-hf").exists() && out.join("adapter.gguf").exists());
    assert!(lorafit::export::earlier_artefacts(&tmp("earlier-empty")).is_empty());
    let _ = std::fs::remove_dir_all(&out);
}

/// A base model or an adapter inside an artefact of the output folder (an earlier export's
/// `merged-hf/` or `merged.gguf` used as the base) is refused before anything is deleted, with
/// or without `--overwrite`: the export would delete it, then fail reading it.
#[test]
fn inputs_inside_the_artefacts_are_refused_before_anything_is_deleted() {
    let dir = tmp("inputs-inside");
    let fixture = fixture("models/llama");
    let copy_dir = |from: &Path, to: &Path| {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let p = e.unwrap().path();
            if p.is_file() {
                std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
            }
        }
    };
    let export = |model: &Path, adapter: &Path, out: &Path, extra: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
            .arg("export")
            .arg("--model")
            .arg(model)
            .arg("--adapter")
            .arg(adapter)
            .arg("--output")
            .arg(out)
            .args(extra)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    // A Hugging Face base in OUTPUT/merged-hf.
    let out = dir.join("ex-self");
    let base = out.join("merged-hf");
    copy_dir(&fixture, &base);
    copy_dir(&fixture.join("adapter"), &base.join("adapter"));
    let weights = std::fs::read(base.join("model.safetensors")).unwrap();
    for extra in [&["--overwrite"][..], &[]] {
        let (ok, err) = export(&base, &fixture.join("adapter"), &out, extra);
        assert!(!ok, "{extra:?}");
        assert!(
            err.contains("--model") && err.contains("the base model would be lost"),
            "{err}"
        );
    }
    // The adapter inside the artefact, the base elsewhere; the output named another way.
    let (ok, err) = export(
        &fixture,
        &base.join("adapter"),
        &dir.join("ex-self/../ex-self/."),
        &["--overwrite"],
    );
    assert!(
        !ok && err.contains("--adapter") && err.contains("the adapter would be lost"),
        "{err}"
    );
    let mut p = plan(&base, &fixture.join("adapter"), &out, vec![Format::Hf]);
    p.check = false;
    let e = run(&p).err().expect("a base inside merged-hf/ is exported");
    assert!(e.to_string().contains("would be lost"), "{e}");
    assert_eq!(
        std::fs::read(base.join("model.safetensors")).unwrap(),
        weights
    );
    assert!(base.join("adapter/adapter_config.json").is_file());

    // A GGUF base at OUTPUT/merged.gguf.
    let out = dir.join("ex-gg");
    std::fs::create_dir_all(&out).unwrap();
    let gguf = out.join("merged.gguf");
    std::fs::copy(quantized_llama_gguf(&dir, GgmlType::Q8_0), &gguf).unwrap();
    let bytes = std::fs::read(&gguf).unwrap();
    let spec = model::gguf_model::GgufSource::open(&gguf).unwrap().spec;
    let adapter = random_adapter(&spec, &dir, 0.2);
    let (ok, err) = export(&gguf, &adapter, &out, &["--overwrite"]);
    assert!(!ok && err.contains("the base model would be lost"), "{err}");
    let mut p = plan(&gguf, &adapter, &out, vec![Format::MergedGguf]);
    p.check = false;
    assert!(run(&p).is_err());
    assert_eq!(std::fs::read(&gguf).unwrap(), bytes, "the base is intact");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A merged GGUF counts the tensors whose bytes the merge changed: an adapter whose deltas are
/// below the quantization step leaves every tensor as the base's, which the export says as a
/// warning; deltas above it change them all, and no warning is given. With `--merged-type
/// f16` the file's `general.file_type` says f16. The summary names formats as `--format` does.
#[test]
fn a_merged_gguf_says_when_requantizing_lost_the_adapter() {
    let dir = tmp("lost-deltas");
    let base = quantized_llama_gguf(&dir, GgmlType::Q4_0);
    let spec = model::gguf_model::GgufSource::open(&base).unwrap().spec;

    let tiny = random_adapter(&spec, &dir.join("tiny"), 1e-6);
    let mut p = plan(
        &base,
        &tiny,
        &dir.join("out-tiny"),
        vec![Format::MergedGguf],
    );
    p.check = false;
    let report = run(&p).unwrap();
    assert_eq!(report.warnings.len(), 1, "{:?}", report.warnings);
    let w = &report.warnings[0];
    assert!(
        w.contains("0 of ") && w.contains("below the Q4_0 step") && w.contains("--merged-type f16"),
        "{w}"
    );
    assert!(
        report.text(&p).starts_with("merged-gguf: "),
        "{}",
        report.text(&p)
    );

    let big = random_adapter(&spec, &dir.join("big"), 0.2);
    let mut p = plan(&base, &big, &dir.join("out-big"), vec![Format::MergedGguf]);
    p.check = false;
    let report = run(&p).unwrap();
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);

    p.output = dir.join("out-f16");
    p.merged_type = MergedType::F16;
    p.formats = vec![Format::MergedGguf, Format::GgufAdapter];
    let report = run(&p).unwrap();
    assert!(report.warnings.is_empty(), "{:?}", report.warnings);
    let text = report.text(&p);
    assert!(
        text.contains("merged-gguf: ") && text.contains("gguf-adapter: "),
        "{text}"
    );
    let g = GgufFile::open(&p.output.join("merged.gguf")).unwrap();
    assert!(
        matches!(
            g.get("general.file_type"),
            Some(MetaValue::U32(1) | MetaValue::I32(1))
        ),
        "{:?}",
        g.get("general.file_type")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tokenizer.json that does not load stops an export with `--check` before anything is
/// written, so that once it is mended the export runs into the same folder without
/// `--overwrite`; without `--check` (it is only copied) the export warns and writes.
#[test]
fn a_tokenizer_that_does_not_load_stops_the_export_before_anything_is_written() {
    let dir = tmp("bad-tokenizer");
    let model = common::tiny_run::model_folder(&dir);
    let adapter = fixture("models/qwen2/adapter");
    let good = std::fs::read_to_string(model.join("tokenizer.json")).unwrap();
    std::fs::write(
        model.join("tokenizer.json"),
        "{\"version\": \"1.0\", \"model\": {",
    )
    .unwrap();
    let out = dir.join("out");
    let e = run(&plan(&model, &adapter, &out, vec![]))
        .err()
        .expect("a tokenizer that does not load");
    assert!(format!("{e:#}").contains("tokenizer.json"), "{e:#}");
    assert!(
        lorafit::export::earlier_artefacts(&out).is_empty(),
        "written before the tokenizer was read: {:?}",
        lorafit::export::earlier_artefacts(&out)
    );
    let mut unchecked = plan(&model, &adapter, &dir.join("unchecked"), vec![]);
    unchecked.check = false;
    let report = run(&unchecked).unwrap();
    assert!(
        report.warnings.iter().any(|w| w.contains("tokenizer.json")),
        "{:?}",
        report.warnings
    );
    std::fs::write(model.join("tokenizer.json"), good).unwrap();
    lorafit::export::refuse_earlier_export(&out).unwrap();
    let report = run(&plan(&model, &adapter, &out, vec![])).unwrap();
    assert_rows(&report.checks);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--model` given something other than a model lorafit reads: the error says what it is and
/// what to pass instead — an adapter folder (its base named), a GGUF adapter, PyTorch weights,
/// safetensors under other names, a GGUF inside the folder, a link into an unfinished download.
#[test]
fn a_model_path_that_is_no_model_says_what_it_holds() {
    let dir = tmp("not-a-model");
    let model = common::tiny_run::model_folder(&dir);
    let adapter = fixture("models/qwen2/adapter");
    let refused = |base: &Path| -> String {
        let mut p = plan(base, &adapter, &dir.join("out"), vec![]);
        p.check = false;
        let e = run(&p).err().expect("not a model");
        format!("{e:#}")
    };

    let peft = dir.join("peft");
    std::fs::create_dir_all(&peft).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    config["base_model_name_or_path"] = "Qwen/Qwen2-0.5B".into();
    std::fs::write(peft.join("adapter_config.json"), config.to_string()).unwrap();
    let e = refused(&peft);
    assert!(
        e.contains("LoRA adapter folder")
            && e.contains("--adapter")
            && e.contains("--model Qwen/Qwen2-0.5B"),
        "{e}"
    );

    let mut p = plan(
        &model,
        &adapter,
        &dir.join("gguf-adapter"),
        vec![Format::GgufAdapter],
    );
    p.check = false;
    run(&p).unwrap();
    let gguf_adapter = dir.join("gguf-adapter/adapter.gguf");
    let e = refused(&gguf_adapter);
    assert!(
        e.contains("LoRA adapter in GGUF form") && e.contains("qwen2") && e.contains("--adapter"),
        "{e}"
    );
    let lint = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .args(["lint", "--data", "none.jsonl", "--model"])
        .arg(&gguf_adapter)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&lint.stderr);
    assert!(err.contains("LoRA adapter in GGUF form"), "{err}");

    let weights = |setup: &dyn Fn(&Path)| -> String {
        let folder = dir.join("weights");
        let _ = std::fs::remove_dir_all(&folder);
        std::fs::create_dir_all(&folder).unwrap();
        for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(model.join(f), folder.join(f)).unwrap();
        }
        setup(&folder);
        refused(&folder)
    };
    let e = weights(&|f| std::fs::write(f.join("pytorch_model.bin"), b"").unwrap());
    assert!(
        e.contains("pytorch_model.bin")
            && e.contains("safetensors only")
            && e.contains("safe_serialization=True"),
        "{e}"
    );
    let e = weights(&|f| {
        std::fs::copy(
            model.join("model.safetensors"),
            f.join("weights.safetensors"),
        )
        .unwrap();
    });
    assert!(e.contains("weights.safetensors"), "{e}");
    let e = weights(&|f| std::fs::write(f.join("model-q4.gguf"), b"").unwrap());
    assert!(
        e.contains("model-q4.gguf") && e.contains("pass the .gguf file itself"),
        "{e}"
    );
    #[cfg(unix)]
    {
        let e = weights(&|f| {
            std::os::unix::fs::symlink("../blobs/0123abcd", f.join("model.safetensors")).unwrap()
        });
        assert!(
            e.contains("model.safetensors") && e.contains("download is incomplete"),
            "{e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The other files a merged folder takes from its base are read before anything is written: a
/// GGUF's embedded tokenizer that does not convert, a base tokenizer_config.json the run's
/// chat template cannot be written into.
#[test]
fn base_files_the_merged_folder_takes_are_read_before_anything_is_written() {
    let dir = tmp("late-files");
    let src = GgufFile::open(&fixture("gguf/minicpm.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        w.set(k, v.clone());
    }
    w.set_str("tokenizer.ggml.model", "no-such-tokenizer");
    for info in src.tensor_infos() {
        w.add_tensor(GgufTensor {
            name: info.name.clone(),
            dims: info.shape.clone(),
            ggml_type: info.ggml_type,
            data: src.tensor_bytes(&info.name).unwrap().to_vec(),
        })
        .unwrap();
    }
    let base = dir.join("odd-tokenizer.gguf");
    w.write(&base).unwrap();
    let spec = model::gguf_model::GgufSource::open(&base).unwrap().spec;
    let adapter = random_adapter(&spec, &dir, 0.2);
    let mut p = plan(&base, &adapter, &dir.join("out"), vec![Format::Hf]);
    p.check = false;
    let e = run(&p).err().expect("a tokenizer that does not convert");
    assert!(format!("{e:#}").contains("no-such-tokenizer"), "{e:#}");
    assert!(lorafit::export::earlier_artefacts(&p.output).is_empty());

    let model = common::tiny_run::model_folder(&dir);
    std::fs::write(model.join("tokenizer_config.json"), "{\"eos_token\": ").unwrap();
    let template = dir.join("run.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    .unwrap();
    let mut p = plan(
        &model,
        &fixture("models/qwen2/adapter"),
        &dir.join("out2"),
        vec![],
    );
    p.check = false;
    p.chat_template = Some(template.display().to_string());
    let e = run(&p)
        .err()
        .expect("a tokenizer_config.json that is not JSON");
    assert!(format!("{e:#}").contains("tokenizer_config.json"), "{e:#}");
    assert!(lorafit::export::earlier_artefacts(&p.output).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A base whose tensor holds a non-finite value is refused by export, naming the tensor (the
/// base is loaded, with every check training makes, before anything is merged), and nothing is
/// written.
#[test]
fn a_base_tensor_that_is_not_finite_stops_the_export() {
    let dir = tmp("nan-base");
    let model = common::tiny_run::model_folder(&dir);
    let file = model.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let name = "model.layers.0.self_attn.q_proj.weight";
    let mut tensors = Vec::new();
    for (key, view) in st.tensors() {
        let mut data = lorafit::model::weights::view_to_f32(&view).unwrap();
        if key == name {
            data[5] = f32::NAN;
        }
        tensors.push((key, view.shape().to_vec(), data));
    }
    lorafit::model::weights::write_f32_safetensors(&file, &tensors).unwrap();
    let mut p = plan(
        &model,
        &fixture("models/qwen2/adapter"),
        &dir.join("out"),
        vec![Format::Hf],
    );
    p.check = false;
    let e = format!("{:#}", run(&p).err().expect("a NaN in the base"));
    assert!(e.contains(name) && e.contains("non-finite"), "{e}");
    assert!(lorafit::export::earlier_artefacts(&p.output).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
