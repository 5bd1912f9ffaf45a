//! Tests for building a `tokenizers::Tokenizer` from GGUF metadata: a small
//! synthetic gpt2-style vocabulary (always runs) and SmolLM2's real tokenizer
//! compared with reference ids from scripts/make_gguf_fixtures.py (runs where
//! the GGUF is cached or LORAFIT_SMOLLM2_GGUF points at it).

mod common;

use std::path::{Path, PathBuf};

use lorafit::data::gguf_tokenizer::{
    load_gguf_tokenizer, tokenizer_from_gguf, tokenizer_info_from_gguf,
};
use lorafit::model::gguf::GgufFile;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/gguf")
        .join(name)
}

/// Writes a GGUF v3 file with only string / string-array / i32-array / u32 metadata.
fn write_tokenizer_gguf(
    tag: &str,
    model: &str,
    tokens: &[&str],
    types: &[i32],
    merges: &[&str],
) -> PathBuf {
    fn s(v: &mut Vec<u8>, x: &str) {
        v.extend((x.len() as u64).to_le_bytes());
        v.extend(x.as_bytes());
    }
    let mut v = b"GGUF".to_vec();
    v.extend(3u32.to_le_bytes());
    v.extend(0u64.to_le_bytes());
    v.extend(7u64.to_le_bytes());
    s(&mut v, "tokenizer.ggml.model");
    v.extend(8u32.to_le_bytes());
    s(&mut v, model);
    s(&mut v, "tokenizer.ggml.pre");
    v.extend(8u32.to_le_bytes());
    s(&mut v, "gpt-2");
    for (key, list) in [
        ("tokenizer.ggml.tokens", tokens),
        ("tokenizer.ggml.merges", merges),
    ] {
        s(&mut v, key);
        v.extend(9u32.to_le_bytes());
        v.extend(8u32.to_le_bytes());
        v.extend((list.len() as u64).to_le_bytes());
        for t in list {
            s(&mut v, t);
        }
    }
    s(&mut v, "tokenizer.ggml.token_type");
    v.extend(9u32.to_le_bytes());
    v.extend(5u32.to_le_bytes());
    v.extend((types.len() as u64).to_le_bytes());
    for t in types {
        v.extend(t.to_le_bytes());
    }
    s(&mut v, "tokenizer.ggml.eos_token_id");
    v.extend(4u32.to_le_bytes());
    v.extend(0u32.to_le_bytes());
    s(&mut v, "tokenizer.ggml.add_bos_token");
    v.extend(7u32.to_le_bytes());
    v.push(0);
    let p = std::env::temp_dir().join(format!(
        "lorafit-gguf-tok-{}-{tag}.gguf",
        std::process::id()
    ));
    std::fs::write(&p, v).unwrap();
    p
}

#[test]
fn synthetic_gpt2_tokenizer() {
    let tokens = [
        "<|end|>", "h", "e", "l", "o", "Ġ", "w", "r", "d", "he", "ll", "hell", "hello", "Ġw",
    ];
    let mut types = vec![1; tokens.len()];
    types[0] = 3;
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w"];
    let p = write_tokenizer_gguf("synthetic", "gpt2", &tokens, &types, &merges);
    let f = GgufFile::open(&p).unwrap();
    let (tok, info) = load_gguf_tokenizer(&f).unwrap();
    assert_eq!(info.eos_id, Some(0));
    assert_eq!(info.bos_id, None);
    assert_eq!(info.pad_id, None);
    assert_eq!(info.chat_template, None);
    assert!(!info.add_bos);
    let enc = tok.encode("hello world<|end|>hello", false).unwrap();
    assert_eq!(enc.get_ids(), &[12, 13, 4, 7, 3, 8, 0, 12]);
    assert_eq!(
        tok.decode(enc.get_ids(), false).unwrap(),
        "hello world<|end|>hello"
    );
    assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), "hello worldhello");
    let _ = std::fs::remove_file(&p);
}

/// Gemma 4's `gemma4` tokenizer model: BPE merges over raw UTF-8 pieces with "▁" for spaces
/// (no byte-level alphabet, no prefix space), byte fallback for characters outside the vocabulary.
#[test]
fn synthetic_gemma4_tokenizer() {
    let tokens = [
        "<eos>",
        "<unk>",
        "<bos>",
        "<0xC3>",
        "<0xA9>",
        "h",
        "e",
        "l",
        "o",
        "\u{2581}",
        "w",
        "r",
        "d",
        "he",
        "ll",
        "hell",
        "hello",
        "\u{2581}w",
        "<start_of_turn>",
    ];
    let mut types = vec![1; tokens.len()];
    types[0] = 3;
    types[1] = 2;
    types[2] = 3;
    types[3] = 6;
    types[4] = 6;
    types[18] = 3;
    let merges = ["h e", "l l", "he ll", "hell o", "\u{2581} w"];
    let p = write_tokenizer_gguf("gemma4", "gemma4", &tokens, &types, &merges);
    let f = GgufFile::open(&p).unwrap();
    let (tok, info) = load_gguf_tokenizer(&f).unwrap();
    assert_eq!(info.eos_id, Some(0));
    let text = "hello world é<start_of_turn>hello";
    let enc = tok.encode(text, false).unwrap();
    // hello ▁w o r l d ▁ <0xC3> <0xA9> <start_of_turn> hello
    assert_eq!(
        enc.get_ids(),
        &[16, 17, 8, 11, 7, 12, 9, 3, 4, 18, 16],
        "{:?}",
        enc.get_tokens()
    );
    assert_eq!(tok.decode(enc.get_ids(), false).unwrap(), text);
    assert_eq!(
        tok.decode(enc.get_ids(), true).unwrap(),
        "hello world éhello"
    );
    let _ = std::fs::remove_file(&p);
}

#[test]
fn unsupported_tokenizer_model_is_a_clear_error() {
    let p = write_tokenizer_gguf("wpm", "bert", &["[UNK]", "a"], &[2, 1], &[]);
    let f = GgufFile::open(&p).unwrap();
    let e = format!("{:#}", tokenizer_from_gguf(&f).unwrap_err());
    assert!(e.contains("bert") && e.contains("not supported"), "{e}");
    assert!(e.contains("gpt2") && e.contains("llama"), "{e}");
    assert!(e.contains(p.file_name().unwrap().to_str().unwrap()), "{e}");
    let _ = std::fs::remove_file(&p);
}

#[test]
fn smollm2_tokenizer_matches_reference() {
    let Some(path) = common::smollm2_or_skip("smollm2_tokenizer_matches_reference") else {
        return;
    };
    let f = GgufFile::open(&path).unwrap();
    let info = tokenizer_info_from_gguf(&f).unwrap();
    assert_eq!(info.bos_id, Some(1));
    assert_eq!(info.eos_id, Some(2));
    assert_eq!(info.pad_id, Some(2));
    assert!(!info.add_bos);
    let tmpl = info.chat_template.as_deref().unwrap();
    assert!(tmpl.contains("<|im_start|>"), "{tmpl}");

    let tok = tokenizer_from_gguf(&f).unwrap();
    assert_eq!(tok.get_vocab_size(true), 49152);
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));

    let refs: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("smollm2_tokenizer_ref.json")).unwrap(),
    )
    .unwrap();
    let cases = refs["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want: Vec<u32> = c["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let enc = tok.encode(text, false).unwrap();
        assert_eq!(enc.get_ids(), want.as_slice(), "text {text:?}");
        assert_eq!(
            tok.decode(&want, false).unwrap(),
            text,
            "roundtrip {text:?}"
        );
    }
    let enc = tok.encode("<|im_start|>user\nHi<|im_end|>", false).unwrap();
    assert_eq!(enc.get_ids()[0], 1);
    assert_eq!(*enc.get_ids().last().unwrap(), 2);
}
