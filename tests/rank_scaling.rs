//! Rank scaling (`rank_scaling = "by_bits" | "by_kl"`) and `lorafit kl`, end to end on the CPU:
//! the per-module ranks a GGUF base with mixed tensor types gives, the adapter a short run
//! writes (its `rank_pattern` / `alpha_pattern` and tensor shapes) and its reload's logits, the
//! ranks a KL file gives and the files and resumes that are refused, and the per-layer KL of a
//! model against itself and against a quantized copy.
//!
//! The mixed-type GGUF is built here from the Llama fixture (tests/fixtures/models/llama) with
//! the project's own GGUF writer and quantizers, q/k rows permuted as llama.cpp's converter
//! does.

mod common;
use common::*;
use lorafit::config::{RankScaling, TrainConfig};
use lorafit::data::{TextTokenizer, TokenizedPair};
use lorafit::eval::kl::{check_same_architecture, layer_kl};
use lorafit::export::check;
use lorafit::export::gguf_out::{AdapterType, MergedType};
use lorafit::export::hf::HfDtype;
use lorafit::export::quantize::quantize;
use lorafit::export::{ExportPlan, Format};
use lorafit::model::gguf::{dequantize, GgmlType};
use lorafit::model::lora::peft_key;
use lorafit::model::weights::{load_weights, write_f32_safetensors, RandomSource};
use lorafit::model::{self, Lora, Model, ModelSpec, Target};
use lorafit::tensor::{DType, Device, Rng};
use lorafit::train::head::{HeadTier, DEFAULT_CHUNK};
use lorafit::train::optim::{apply_update, AdamState, OptimOptions};
use lorafit::train::rank_scaling::{self, KlFile};
use lorafit::train::step::{queue_example, PassOptions};
use lorafit::train::trainer::{train, Item, Loaded};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::str::FromStr;

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// The base weight's type of each module of the mixed GGUF, `[layer][target.index()]` (q, k,
/// v, o, gate, up, down).
const TYPES: [[GgmlType; 7]; 2] = {
    use GgmlType::*;
    [
        [Q4_0, Q8_0, F16, Q4_1, Q8_0, BF16, F32],
        [Q8_0, Q4_0, Q4_1, F16, Q4_0, Q8_0, Q4_0],
    ]
};
/// `rank × bits / 4` at rank 4 for `TYPES`, F32's 32 clamped to 4 × rank = 16.
const BY_BITS_RANKS: [[usize; 7]; 2] = [[4, 8, 16, 4, 8, 16, 16], [8, 4, 4, 16, 4, 8, 4]];

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("rank_scaling-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The Llama fixture as a GGUF whose projections are stored as `TYPES` says (embeddings and head
/// Q8_0, norms F32).
fn mixed_llama_gguf(dir: &Path) -> PathBuf {
    let path = dir.join("llama-mixed.gguf");
    common::llama_gguf::write_llama_gguf(&path, |l, t| TYPES[l][t.index()]);
    assert_eq!(
        ModelSpec::from_config_file(&fixture("models/llama/config.json"))
            .unwrap()
            .n_layers,
        TYPES.len()
    );
    path
}

/// A word-level tokenizer over `w0 … w{vocab-1}` (train() is given token ids and never calls it).
fn tiny_tokenizer(vocab: usize) -> TextTokenizer {
    let words: serde_json::Map<String, serde_json::Value> = (0..vocab)
        .map(|i| (format!("w{i}"), serde_json::Value::from(i as u64)))
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": words, "unk_token": "w0"}
    });
    let inner = tokenizers::Tokenizer::from_str(&json.to_string()).unwrap();
    TextTokenizer::new(inner, None, Some(1), false).unwrap()
}

fn loaded(path: &Path) -> Loaded {
    let model = model::load(path, &Device::Cpu).unwrap();
    let tokenizer = tiny_tokenizer(model.spec.vocab);
    Loaded {
        model,
        tokenizer,
        template: None,
        model_path: path.to_path_buf(),
    }
}

/// Token-id preference pairs: chosen from the low quarter of the vocabulary, rejected from the
/// upper half.
fn pair_items(n: usize, seed: u64, vocab: usize) -> Vec<Item> {
    let v = vocab as u64;
    let mut r = Rng(seed);
    let mut ids = |len: u64, lo: u64, hi: u64| -> Vec<u32> {
        (0..len)
            .map(|_| (lo + r.next_u64() % (hi - lo)) as u32)
            .collect()
    };
    (0..n)
        .map(|_| {
            Item::pair(TokenizedPair {
                prompt: ids(8, 0, v),
                chosen: ids(5, 0, v / 4),
                rejected: ids(5, v / 2, v),
            })
        })
        .collect()
}

fn cfg(output: &Path, steps: usize, scaling: RankScaling) -> TrainConfig {
    TrainConfig {
        output: output.display().to_string(),
        data: "in-memory".into(),
        steps,
        lr: 1e-2,
        rank: 4,
        rank_scaling: scaling,
        save_every: 0,
        eval_every: 0,
        seed: 3,
        ..Default::default()
    }
}

fn read_json(path: &Path) -> serde_json::Value {
    let text =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn logits(model: &Model, lora: &Lora, ids: &[u32]) -> Vec<f32> {
    let h = model.hidden_states(ids, Some(lora)).unwrap();
    model.logits(&h, DType::F32).unwrap().to_vec().unwrap()
}

fn write_kl_file(path: &Path, kl: &[f64]) {
    let file = KlFile {
        model: "q".into(),
        reference: "f".into(),
        rows: 1,
        tokens: 1,
        layers: kl
            .iter()
            .enumerate()
            .map(|(layer, &kl)| rank_scaling::LayerKl { layer, kl })
            .collect(),
    };
    std::fs::write(path, serde_json::to_string(&file).unwrap()).unwrap();
}

// ---------------------------------------------------------------------------------------------
// by_bits
// ---------------------------------------------------------------------------------------------

/// Each module's rank follows its base weight's type, the scale stays alpha / rank, and a short
/// run writes exactly those ranks into the adapter: config patterns, tensor shapes, plan.toml.
#[test]
fn by_bits_ranks_follow_each_base_weights_type() {
    let dir = scratch("by_bits");
    let gguf = mixed_llama_gguf(&dir);
    let l = loaded(&gguf);
    let spec = &l.model.spec;
    let c = cfg(&dir.join("run"), 3, RankScaling::ByBits);
    c.validate().unwrap();
    let lc = rank_scaling::lora_config(&c, spec, &gguf).unwrap();
    for (layer, ranks) in BY_BITS_RANKS.iter().enumerate() {
        for t in Target::ALL {
            assert_eq!(
                lc.resolve(layer, t),
                (ranks[t.index()], 2.0),
                "layer {layer} {t:?} stored as {}",
                TYPES[layer][t.index()]
            );
        }
    }

    let v = spec.vocab;
    let out = train(&c, None, &l, &pair_items(6, 1, v), &[]).unwrap();
    let config = read_json(&out.adapter_dir.join("adapter_config.json"));
    assert_eq!(config["r"], 4);
    assert_eq!(config["lora_alpha"], 8.0);
    let tensors = read_safetensors(&out.adapter_dir.join("adapter_model.safetensors"));
    let mut patterned = 0;
    for (layer, ranks) in BY_BITS_RANKS.iter().enumerate() {
        for t in Target::ALL {
            let r = ranks[t.index()];
            let name = format!("model.layers.{layer}.{}", t.path());
            if r == 4 {
                assert!(config["rank_pattern"].get(&name).is_none(), "{name}");
                assert!(config["alpha_pattern"].get(&name).is_none(), "{name}");
            } else {
                patterned += 1;
                assert_eq!(config["rank_pattern"][&name], r, "{name}");
                assert_eq!(config["alpha_pattern"][&name], 2.0 * r as f64, "{name}");
            }
            let (o, i) = t.dims(spec, layer).unwrap();
            assert_eq!(
                tensors[&peft_key(layer, t, false)].0,
                vec![r, i],
                "{name} A"
            );
            assert_eq!(tensors[&peft_key(layer, t, true)].0, vec![o, r], "{name} B");
        }
    }
    assert_eq!(config["rank_pattern"].as_object().unwrap().len(), patterned);
    let plan = std::fs::read_to_string(dir.join("run/plan.toml")).unwrap();
    assert!(
        plan.contains("# rank_scaling by_bits: LoRA rank per layer 0..1 (scale alpha / rank = 2 on every module)")
            && plan.contains("#   q_proj: 4 8\n")
            && plan.contains("#   down_proj: 16 4\n")
            && plan.contains("rank_scaling = \"by_bits\""),
        "{plan}"
    );
    // The adapter on disk reloads with the same ranks and scales.
    let back = Lora::load_peft(&out.adapter_dir, spec, &Device::Cpu).unwrap();
    for (layer, t, p) in back.pairs() {
        assert_eq!(
            (p.rank, p.scale),
            (BY_BITS_RANKS[layer][t.index()], 2.0),
            "{layer} {t:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// An adapter with by_bits ranks, trained in memory for a few steps, saved and loaded back
/// (Lora::load_peft) gives the same logits, and so do its exports; rsLoRA keeps its own scale
/// alpha / sqrt(r).
#[test]
fn by_bits_adapter_reloads_with_the_same_logits() {
    let dir = scratch("reload");
    let gguf = mixed_llama_gguf(&dir);
    let model = model::load(&gguf, &Device::Cpu).unwrap();
    let spec = &model.spec;
    for rslora in [false, true] {
        let mut c = cfg(&dir, 3, RankScaling::ByBits);
        c.rslora = rslora;
        let lc = rank_scaling::lora_config(&c, spec, &gguf).unwrap();
        assert_eq!(lc.alpha_pattern.is_empty(), rslora);
        let mut lora = Lora::new(spec, lc, &Device::Cpu).unwrap();
        let mut adam = AdamState::new(&lora).unwrap();
        let optim = OptimOptions::from_config(&c);
        let opts = PassOptions {
            segment_size: 0,
            keep_attention: false,
            keep_kv_layers: 0,
            mlp_chunk: 0,
            offload: false,
            nested: false,
            resident_layers: 0,
            full_layers: 0,
            head: HeadTier::Chunked,
            head_chunk: DEFAULT_CHUNK,
            dropout: None,
        };
        for (step, item) in pair_items(3, 2, spec.vocab).iter().enumerate() {
            let plan = item.plan(true).unwrap();
            queue_example(
                &model,
                &mut lora,
                &plan,
                &c.objective(),
                None,
                &opts,
                true,
                1.0,
            )
            .and_then(|q| q.finish())
            .unwrap();
            apply_update(&mut lora, &mut adam, 1e-2, step as u64 + 1, 1.0, &optim).unwrap();
        }
        for (layer, t, p) in lora.pairs() {
            let r = BY_BITS_RANKS[layer][t.index()];
            let scale = if rslora { 8.0 / (r as f32).sqrt() } else { 2.0 };
            assert_eq!((p.rank, p.scale), (r, scale), "{layer} {t:?}");
            assert!(max_abs(&p.b.to_vec().unwrap()) > 0.0, "B trained");
        }
        let adapter = dir.join(format!("adapter-rslora-{rslora}"));
        lora.save_peft(&adapter, "llama-mixed.gguf").unwrap();
        let back = Lora::load_peft(&adapter, spec, &Device::Cpu).unwrap();
        let ids: Vec<u32> = (0..12).map(|i| (i * 37 % 256) as u32).collect();
        let (want, got) = (logits(&model, &lora, &ids), logits(&model, &back, &ids));
        let (d, at) = max_diff(&got, &want);
        assert!(d <= 1e-6, "rslora {rslora}: max |diff| {d:.3e} at {at}");
        // The adapter moves the logits, so equal logits mean equal scales.
        let plain = {
            let h = model.hidden_states(&ids, None).unwrap();
            model.logits(&h, DType::F32).unwrap().to_vec().unwrap()
        };
        assert!(
            max_diff(&want, &plain).0 > 1e-3,
            "the adapter has an effect"
        );

        // Export applies the same per-module scales: the merged folder, the llama.cpp adapter
        // (the scale folded into B) and the merged GGUF each give the trainer's logits.
        let report = lorafit::export::run(&ExportPlan {
            model: gguf.clone(),
            adapter: adapter.clone(),
            output: dir.join(format!("export-rslora-{rslora}")),
            formats: vec![Format::Hf, Format::GgufAdapter, Format::MergedGguf],
            hf_dtype: HfDtype::F32,
            adapter_type: AdapterType::F32,
            merged_type: MergedType::F16,
            check: true,
            chat_template: None,
        })
        .unwrap();
        eprint!("{}", check::format_rows(&report.checks));
        assert_eq!(report.checks.len(), 3);
        for r in &report.checks {
            assert!(r.passed(), "{}: rel {} > {}", r.artefact, r.rel, r.bound);
            assert!(
                r.adapter_effect > 5.0 * r.max_abs,
                "{}: the adapter's effect {} is not well above the error {}",
                r.artefact,
                r.adapter_effect,
                r.max_abs
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn by_bits_needs_a_gguf_base() {
    let dir = scratch("by_bits_hf");
    let l = loaded(&fixture("models/llama"));
    let c = cfg(&dir.join("run"), 1, RankScaling::ByBits);
    let e = format!(
        "{:#}",
        train(&c, None, &l, &pair_items(2, 1, 256), &[])
            .err()
            .expect("by_bits on a safetensors base")
    );
    assert!(
        e.contains("rank_scaling = \"by_bits\"") && e.contains("needs a GGUF base"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `lorafit train` refuses a bad `rank_scaling` before training, naming the setting: an unknown
/// value (with the allowed ones), by_kl without its file, by_bits on a Hugging Face folder.
#[test]
fn train_refuses_bad_rank_scaling_settings() {
    let dir = scratch("cli");
    let m = tiny_run::model_folder(&dir);
    let data = dir.join("pairs.jsonl");
    tiny_run::data_file(&data, 4, 2);
    let cases = [
        (
            "rank_scaling=by_size",
            vec!["rank_scaling", "by_size", "`none`, `by_bits`, `by_kl`"],
        ),
        (
            "rank_scaling=by_kl",
            vec!["rank_scaling = \"by_kl\" needs rank_kl_file"],
        ),
        (
            "rank_scaling=by_bits",
            vec!["rank_scaling = \"by_bits\" needs a GGUF base"],
        ),
    ];
    for (i, (set, want)) in cases.iter().enumerate() {
        let out_dir = dir.join(format!("out{i}"));
        let out = Command::new(env!("CARGO_BIN_EXE_lorafit"))
            .args(["train", "--model"])
            .arg(&m)
            .arg("--data")
            .arg(&data)
            .arg("--output")
            .arg(&out_dir)
            .args(["--set", "steps=1", "--set", set])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{set}: {err}");
        for w in want {
            assert!(err.contains(w), "{set}: {err}");
        }
        assert!(!out_dir.join("adapter").exists(), "{set}: nothing trained");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// by_kl
// ---------------------------------------------------------------------------------------------

/// KL [0.1, 0.4] at rank 4: median 0.25, ratios 0.4 → 0.5 and 1.6, ranks 2 and 6 on every module
/// of the layer. A resume whose KL file or rank_scaling gives other ranks is refused, and so is
/// a warm start from an adapter of other ranks.
#[test]
fn by_kl_ranks_come_from_the_kl_file_and_resume_keeps_them() {
    let dir = scratch("by_kl");
    let l = loaded(&fixture("models/llama"));
    let kl = dir.join("kl.json");
    write_kl_file(&kl, &[0.1, 0.4]);
    let run = dir.join("run");
    let mut c = cfg(&run, 4, RankScaling::ByKl);
    c.rank_kl_file = Some(kl.display().to_string());
    c.save_every = 2;
    c.validate().unwrap();
    let items = pair_items(4, 5, 256);
    let out = train(&c, None, &l, &items, &[]).unwrap();
    let config = read_json(&out.adapter_dir.join("adapter_config.json"));
    let tensors = read_safetensors(&out.adapter_dir.join("adapter_model.safetensors"));
    for (layer, r) in [(0, 2usize), (1, 6)] {
        for t in Target::ALL {
            let name = format!("model.layers.{layer}.{}", t.path());
            assert_eq!(config["rank_pattern"][&name], r, "{name}");
            assert_eq!(config["alpha_pattern"][&name], 2.0 * r as f64, "{name}");
            assert_eq!(tensors[&peft_key(layer, t, false)].0[0], r, "{name}");
        }
    }
    let plan = std::fs::read_to_string(run.join("plan.toml")).unwrap();
    assert!(plan.contains("#   up_proj: 2 6\n"), "{plan}");

    // Resuming with the same file continues; with a file that gives other ranks it is refused,
    // naming the modules.
    let checkpoint = run.join("checkpoint-000002");
    // An earlier checkpoint of the folder: the run's later steps give way to the resumed ones.
    let mut c = c.clone();
    c.overwrite = true;
    train(&c, Some(&checkpoint), &l, &items, &[]).unwrap();
    write_kl_file(&kl, &[0.4, 0.1]);
    let e = format!(
        "{:#}",
        train(&c, Some(&checkpoint), &l, &items, &[])
            .err()
            .expect("other ranks on resume")
    );
    assert!(
        e.contains("per-module ranks")
            && e.contains("model.layers.0.self_attn.q_proj: adapter rank 2")
            && e.contains("settings rank 6"),
        "{e}"
    );
    // A warm start from an adapter of the plain rank is refused, naming the modules.
    let plain = dir.join("plain-adapter");
    let none_cfg = cfg(&dir, 1, RankScaling::None).lora_config().unwrap();
    Lora::new(&l.model.spec, none_cfg, &Device::Cpu)
        .unwrap()
        .save_peft(&plain, "llama")
        .unwrap();
    let mut warm = c.clone();
    warm.output = dir.join("warm").display().to_string();
    warm.warm_start = Some(plain.display().to_string());
    let e = format!(
        "{:#}",
        train(&warm, None, &l, &items, &[])
            .err()
            .expect("warm start of other ranks")
    );
    assert!(
        e.contains("warm_start")
            && e.contains(
                "model.layers.0.self_attn.q_proj: adapter rank 4 (scale 2), settings rank 6"
            ),
        "{e}"
    );
    // Another rank_scaling is refused by name.
    let mut none = c.clone();
    none.rank_scaling = RankScaling::None;
    none.rank_kl_file = None;
    let e = format!(
        "{:#}",
        train(&none, Some(&checkpoint), &l, &items, &[])
            .err()
            .expect("other rank_scaling on resume")
    );
    assert!(
        e.contains("rank_scaling: checkpoint \"by_kl\", now \"none\""),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_bad_kl_file_is_refused_naming_file_and_layer() {
    let dir = scratch("bad_kl");
    let l = loaded(&fixture("models/llama"));
    let cases = [
        (
            "three.json",
            r#"{"layers":[{"layer":0,"kl":0.1},{"layer":1,"kl":0.1},{"layer":2,"kl":0.1}]}"#,
            "layer 2 is beyond the model's 2 layers",
        ),
        (
            "one.json",
            r#"{"layers":[{"layer":0,"kl":0.1}]}"#,
            "layer 1 is missing",
        ),
        (
            "nan.json",
            r#"{"layers":[{"layer":0,"kl":null},{"layer":1,"kl":0.1}]}"#,
            "layer 0: kl is null",
        ),
        (
            "negative.json",
            r#"{"layers":[{"layer":0,"kl":0.1},{"layer":1,"kl":-1}]}"#,
            "layer 1: kl = -1 is negative",
        ),
    ];
    for (name, body, want) in cases {
        let path = dir.join(name);
        std::fs::write(&path, body).unwrap();
        let mut c = cfg(&dir.join("run"), 1, RankScaling::ByKl);
        c.rank_kl_file = Some(path.display().to_string());
        c.overwrite = true;
        c.validate().unwrap();
        let e = format!(
            "{:#}",
            train(&c, None, &l, &pair_items(2, 1, 256), &[])
                .err()
                .unwrap_or_else(|| panic!("{name} accepted"))
        );
        assert!(
            e.contains(&path.display().to_string()) && e.contains(want),
            "{name}: {e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// lorafit kl
// ---------------------------------------------------------------------------------------------

/// A copy of the model folder `src` whose layer projections are rounded through Q4_0 (stored
/// as f32 again): a quantized copy that a Hugging Face folder can hold.
fn q4_copy(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> =
        read_safetensors(&src.join("model.safetensors"))
            .into_iter()
            .map(|(name, (shape, mut data))| {
                if name.contains(".layers.") && name.ends_with("_proj.weight") {
                    let q = quantize(GgmlType::Q4_0, &data).unwrap();
                    let n = data.len();
                    dequantize(GgmlType::Q4_0, &q, n, &mut data).unwrap();
                }
                (name, shape, data)
            })
            .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    write_f32_safetensors(&dst.join("model.safetensors"), &tensors).unwrap();
}

fn lorafit_kl(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .arg("kl")
        .args(args)
        .output()
        .unwrap()
}

/// The model against itself: KL 0 in every layer. Against its Q4_0-rounded copy (read from
/// plain text lines): positive and finite in every layer, and the file is one that by_kl reads.
#[test]
fn kl_command_end_to_end() {
    let dir = scratch("kl_cli");
    let m = tiny_run::model_folder(&dir);
    let data = dir.join("pairs.jsonl");
    tiny_run::data_file(&data, 6, 4);
    let s = |p: &Path| p.display().to_string();
    let self_out = dir.join("self.json");
    let out = lorafit_kl(&[
        "--model",
        &s(&m),
        "--reference",
        &s(&m),
        "--data",
        &s(&data),
        "--output",
        &s(&self_out),
        "--max-rows",
        "4",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let f: KlFile = serde_json::from_str(&std::fs::read_to_string(&self_out).unwrap()).unwrap();
    assert_eq!((f.model.as_str(), f.rows), (s(&m).as_str(), 4));
    // Prompt (8 words) + chosen (5 words) + EOS per row.
    assert_eq!(f.tokens, 4 * 14);
    assert_eq!(f.layers.len(), 2);
    for (i, l) in f.layers.iter().enumerate() {
        assert_eq!(l.layer, i);
        assert!(l.kl.abs() <= 1e-6, "layer {i}: KL {} against itself", l.kl);
    }

    let q = dir.join("q4");
    q4_copy(&m, &q);
    let text = dir.join("calibration.txt");
    std::fs::write(
        &text,
        "w3 w17 w200 w45 w9 w9 w100 w31\n\nw250 w2 w77 w5 w5 w61\nw8 w8 w8 w140 w33\n",
    )
    .unwrap();
    let q_out = dir.join("q4.json");
    let out = lorafit_kl(&[
        "--model",
        &s(&q),
        "--reference",
        &s(&m),
        "--data",
        &s(&text),
        "--output",
        &s(&q_out),
        "--max-len",
        "6",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("layer  kl"), "{stdout}");
    let f: KlFile = serde_json::from_str(&std::fs::read_to_string(&q_out).unwrap()).unwrap();
    assert_eq!(
        (f.rows, f.tokens),
        (3, 6 + 6 + 5),
        "blank line skipped, rows cut at 6"
    );
    eprintln!("KL against the Q4_0 copy: {:?}", f.layers);
    for l in &f.layers {
        assert!(
            l.kl.is_finite() && l.kl > 0.0,
            "layer {}: KL {} against a Q4_0 copy",
            l.layer,
            l.kl
        );
    }
    assert_eq!(
        rank_scaling::read_kl_file(&q_out, 2).unwrap(),
        f.layers.iter().map(|l| l.kl).collect::<Vec<_>>()
    );

    // Two architectures: refused, naming what differs.
    let out = lorafit_kl(&[
        "--model",
        &s(&m),
        "--reference",
        &s(&fixture("models/llama")),
        "--data",
        &s(&data),
        "--output",
        &s(&dir.join("mismatch.json")),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("the models differ in family"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `--data` file that is not there is said to be missing, by its path, as `train` says it;
/// not as rows that are neither preference nor SFT rows.
#[test]
fn kl_says_a_missing_data_file_is_not_there() {
    let dir = scratch("kl_missing");
    let m = tiny_run::model_folder(&dir);
    let missing = dir.join("missing.jsonl");
    let s = |p: &Path| p.display().to_string();
    let out = lorafit_kl(&[
        "--model",
        &s(&m),
        "--reference",
        &s(&m),
        "--data",
        &s(&missing),
        "--output",
        &s(&dir.join("kl.json")),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("opening dataset {}: No such file", s(&missing))),
        "{err}"
    );
    assert!(!err.contains("neither preference nor SFT"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The library measure on a GGUF base with quantized projections against its Hugging Face
/// original: positive and finite per layer, the models unchanged afterwards; a model against
/// itself gives exactly 0; a model with another number of layers is refused by name.
#[test]
fn layer_kl_of_a_quantized_gguf_against_its_original() {
    let dir = scratch("kl_gguf");
    let gguf = mixed_llama_gguf(&dir);
    let mut q = model::load(&gguf, &Device::Cpu).unwrap();
    let mut f = model::load(&fixture("models/llama"), &Device::Cpu).unwrap();
    let rows: Vec<Vec<u32>> = (0..3)
        .map(|r| (0..10).map(|i| ((r * 31 + i * 7) % 256) as u32).collect())
        .collect();
    let before = {
        let h = f.hidden_states(&rows[0], None).unwrap();
        f.logits(&h, DType::F32).unwrap().to_vec().unwrap()
    };
    let mut ticks = 0;
    let (kl, tokens) = layer_kl(&mut q, &mut f, &rows, &mut || ticks += 1).unwrap();
    assert_eq!((tokens, ticks), (30, 3));
    eprintln!("KL of the mixed GGUF per layer: {kl:?}");
    for (l, k) in kl.iter().enumerate() {
        assert!(k.is_finite() && *k > 0.0, "layer {l}: KL {k}");
    }
    let after = {
        let h = f.hidden_states(&rows[0], None).unwrap();
        f.logits(&h, DType::F32).unwrap().to_vec().unwrap()
    };
    assert_eq!(before, after, "the reference has its own layers back");

    let mut f2 = model::load(&fixture("models/llama"), &Device::Cpu).unwrap();
    let (zero, _) = layer_kl(&mut f2, &mut f, &rows, &mut || {}).unwrap();
    assert_eq!(zero, vec![0.0, 0.0]);

    let three = ModelSpec::from_config_json(
        &std::fs::read_to_string(fixture("models/llama/config.json"))
            .unwrap()
            .replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3"),
    )
    .unwrap();
    assert_eq!(three.n_layers, 3);
    let e = check_same_architecture(&f.spec, &three)
        .unwrap_err()
        .to_string();
    assert!(e.contains("number of layers: model 2, reference 3"), "{e}");
    let weights = load_weights(
        &three,
        &RandomSource {
            spec: three.clone(),
            seed: 1,
        },
        &Device::Cpu,
    )
    .unwrap();
    let mut r3 = Model::new(three, weights, Device::Cpu);
    let e = layer_kl(&mut f, &mut r3, &rows, &mut || {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("number of layers"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
