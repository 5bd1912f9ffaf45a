//! A tiny model folder and preference data on disk, for tests that run the `lorafit` binary:
//! the qwen2 fixture (tests/fixtures/models/qwen2) with a word-level tokenizer over
//! `w0 … w255`, and JSONL rows of those words.

use std::path::{Path, PathBuf};

/// The qwen2 fixture with a word-level tokenizer over `w0 … w255`.
pub fn model_folder(root: &Path) -> PathBuf {
    let m = root.join("model");
    std::fs::create_dir_all(&m).unwrap();
    let src = super::fixture("models/qwen2");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), m.join(f)).unwrap();
    }
    let vocab: serde_json::Map<String, serde_json::Value> = (0..256)
        .map(|i| (format!("w{i}"), serde_json::Value::from(i as u64)))
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
    });
    std::fs::write(m.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    std::fs::write(m.join("tokenizer_config.json"), r#"{"eos_token": "w1"}"#).unwrap();
    m
}

/// Preference rows whose chosen words come from the low end of the vocabulary and rejected
/// words from the high end (a learnable preference).
pub fn data_file(path: &Path, n: usize, seed: u64) {
    let mut x = seed;
    let mut next = |lo: u64, hi: u64| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        lo + (x >> 33) % (hi - lo + 1)
    };
    let mut text = String::new();
    for _ in 0..n {
        let mut words = |len: u64, lo: u64, hi: u64| {
            (0..len)
                .map(|_| format!("w{}", next(lo, hi)))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let prompt = words(8, 2, 255);
        let chosen = words(5, 2, 63);
        let rejected = words(5, 128, 255);
        text.push_str(
            &serde_json::json!({"prompt": prompt, "chosen": chosen, "rejected": rejected})
                .to_string(),
        );
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}
