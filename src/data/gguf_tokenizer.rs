//! Builds a Hugging Face `tokenizers::Tokenizer` from the tokenizer stored in
//! a GGUF file's metadata, so lorafit can train from a single `.gguf` without
//! a separate `tokenizer.json` (and without any hub download).
//!
//! Supported: `tokenizer.ggml.model == "gpt2"` (byte-level BPE) with the
//! `tokenizer.ggml.pre` pre-tokenizers listed in [`SUPPORTED_PRE`]. The
//! tokenizer is assembled as the equivalent `tokenizer.json` document and
//! loaded through `tokenizers`' own deserializer, so it behaves exactly like
//! the HF tokenizer.json of the same model:
//! * vocab = `tokenizer.ggml.tokens` (index = id), merges =
//!   `tokenizer.ggml.merges` ("a b" strings),
//! * tokens with `token_type == 3` (control) become special added tokens (so
//!   "<|im_start|>" in text is one token), `token_type == 4` (user-defined)
//!   become non-special added tokens,
//! * byte-level decoder, byte-level post-processor; BOS/EOS are NOT inserted
//!   automatically, see [`GgufTokenizerInfo::add_bos`].
//!
//! SentencePiece GGUF tokenizers (`"llama"`) and others are rejected with a
//! clear error.

// In the main crate this becomes `use crate::model::gguf::GgufFile;`.
use crate::model::gguf::GgufFile;

use std::str::FromStr;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

/// `tokenizer.ggml.pre` values this module knows how to reproduce.
/// Verified against reference ids: "smollm" (SmolLM2) and plain gpt-2 style
/// byte-level BPE (synthetic test). "llama-bpe"/"llama3" and "qwen2" use the
/// pre-tokenizer regexes of the published HF tokenizer.json files but are
/// NOT verified here against a reference tokenizer.
pub const SUPPORTED_PRE: &[&str] = &[
    "smollm",
    "starcoder",
    "refact",
    "gpt-2",
    "gpt2",
    "phi-2",
    "llama-bpe",
    "llama3",
    "qwen2",
];

const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// Special-token ids and chat template read from GGUF metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufTokenizerInfo {
    /// `tokenizer.ggml.bos_token_id`
    pub bos_id: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`
    pub eos_id: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`
    pub pad_id: Option<u32>,
    /// `tokenizer.chat_template` (Jinja source)
    pub chat_template: Option<String>,
    /// `tokenizer.ggml.add_bos_token` (default false): whether the model
    /// expects BOS to be prepended. The built tokenizer never adds it itself.
    pub add_bos: bool,
    /// `tokenizer.ggml.add_eos_token` (default false).
    pub add_eos: bool,
}

fn opt_u32(g: &GgufFile, key: &str) -> Result<Option<u32>> {
    match g.get(key) {
        None => Ok(None),
        Some(_) => g.get_u32(key).map(Some),
    }
}

fn opt_bool(g: &GgufFile, key: &str) -> Result<bool> {
    match g.get(key) {
        None => Ok(false),
        Some(_) => g.get_bool(key),
    }
}

/// Reads BOS/EOS/PAD ids and the chat template.
pub fn tokenizer_info_from_gguf(g: &GgufFile) -> Result<GgufTokenizerInfo> {
    Ok(GgufTokenizerInfo {
        bos_id: opt_u32(g, "tokenizer.ggml.bos_token_id")?,
        eos_id: opt_u32(g, "tokenizer.ggml.eos_token_id")?,
        pad_id: opt_u32(g, "tokenizer.ggml.padding_token_id")?,
        chat_template: match g.get("tokenizer.chat_template") {
            None => None,
            Some(_) => Some(g.get_str("tokenizer.chat_template")?.to_owned()),
        },
        add_bos: opt_bool(g, "tokenizer.ggml.add_bos_token")?,
        add_eos: opt_bool(g, "tokenizer.ggml.add_eos_token")?,
    })
}

/// The `pre_tokenizer` (and optional normalizer, `ignore_merges`) of the HF
/// tokenizer.json corresponding to llama.cpp's `tokenizer.ggml.pre`.
fn pre_tokenizer_for(pre: &str) -> Option<(Value, Value, bool)> {
    let byte_level = |use_regex: bool| {
        json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
               "use_regex": use_regex})
    };
    let split = |pattern: &str| {
        json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
               "invert": false})
    };
    Some(match pre {
        // llama.cpp: regex "\p{N}" then the GPT-2 regex == HF
        // Sequence[Digits(individual), ByteLevel(use_regex)].
        "smollm" | "starcoder" | "refact" => (
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            Value::Null,
            false,
        ),
        "gpt-2" | "gpt2" | "phi-2" => (byte_level(true), Value::Null, false),
        "llama-bpe" | "llama3" => (
            json!({"type": "Sequence", "pretokenizers": [
                split("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
                byte_level(false)]}),
            Value::Null,
            true,
        ),
        "qwen2" => (
            json!({"type": "Sequence", "pretokenizers": [
                split("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"),
                byte_level(false)]}),
            json!({"type": "NFC"}),
            false,
        ),
        _ => return None,
    })
}

/// The HF `tokenizer.json` document equivalent to the GGUF tokenizer (handy
/// for saving next to a trained adapter).
pub fn tokenizer_json_from_gguf(g: &GgufFile) -> Result<Value> {
    let path = g.path().display().to_string();
    let model = g.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        bail!(
            "GGUF {path}: tokenizer model '{model}' is not supported (only 'gpt2' byte-level BPE; \
             SentencePiece 'llama' tokenizers need a tokenizer.json)"
        );
    }
    let pre = match g.get("tokenizer.ggml.pre") {
        None => "gpt-2",
        Some(_) => g.get_str("tokenizer.ggml.pre")?,
    };
    let (pre_tokenizer, normalizer, ignore_merges) = pre_tokenizer_for(pre).ok_or_else(|| {
        anyhow!(
            "GGUF {path}: tokenizer pre-tokenizer '{pre}' is not supported (supported: {})",
            SUPPORTED_PRE.join(", ")
        )
    })?;

    let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
    let merges = match g.get("tokenizer.ggml.merges") {
        None => Vec::new(),
        Some(_) => g.get_str_array("tokenizer.ggml.merges")?,
    };
    let types = match g.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(_) => g.get_i32_array("tokenizer.ggml.token_type")?,
    };
    if types.len() != tokens.len() {
        bail!(
            "GGUF {path}: tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {}",
            types.len(),
            tokens.len()
        );
    }

    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        // First occurrence wins for (rare) duplicate token strings.
        if !vocab.contains_key(tok) {
            vocab.insert(tok.to_owned(), json!(id));
        }
        if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == TOKEN_TYPE_CONTROL,
            }));
        }
    }
    let mut merge_pairs = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        let (a, b) = m.split_once(' ').ok_or_else(|| {
            anyhow!("GGUF {path}: tokenizer.ggml.merges[{i}] = {m:?} is not of the form 'a b'")
        })?;
        merge_pairs.push(json!([a, b]));
    }

    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
                           "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
            "vocab": vocab, "merges": merge_pairs,
        },
    }))
}

/// Builds the tokenizer described by the GGUF metadata.
pub fn tokenizer_from_gguf(g: &GgufFile) -> Result<Tokenizer> {
    let doc = tokenizer_json_from_gguf(g)?;
    Tokenizer::from_str(&doc.to_string()).map_err(|e| {
        anyhow!(
            "GGUF {}: cannot build tokenizer from metadata: {e}",
            g.path().display()
        )
    })
}

/// Tokenizer plus its special ids / chat template.
pub fn load_gguf_tokenizer(g: &GgufFile) -> Result<(Tokenizer, GgufTokenizerInfo)> {
    let tok = tokenizer_from_gguf(g)?;
    let info = tokenizer_info_from_gguf(g)
        .with_context(|| format!("GGUF {}: reading tokenizer ids", g.path().display()))?;
    let vocab = tok.get_vocab_size(true) as u32;
    for (what, id) in [
        ("bos", info.bos_id),
        ("eos", info.eos_id),
        ("pad", info.pad_id),
    ] {
        if let Some(id) = id {
            if id >= vocab {
                bail!(
                    "GGUF {}: {what} token id {id} is outside the vocabulary ({vocab} tokens)",
                    g.path().display()
                );
            }
        }
    }
    Ok((tok, info))
}
