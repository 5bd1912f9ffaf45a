//! Builds a Hugging Face `tokenizers::Tokenizer` from the tokenizer stored in
//! a GGUF file's metadata, so lorafit can train from a single `.gguf` without
//! a separate `tokenizer.json` (and without any hub download).
//!
//! Supported `tokenizer.ggml.model`s:
//!
//! **`gpt2`** (byte-level BPE) with the `tokenizer.ggml.pre` pre-tokenizers
//! listed in [`SUPPORTED_PRE`]. The tokenizer is assembled as the equivalent
//! `tokenizer.json` document and loaded through `tokenizers`' own
//! deserializer, so it behaves exactly like the HF tokenizer.json of the same
//! model:
//! * vocab = `tokenizer.ggml.tokens` (index = id), merges =
//!   `tokenizer.ggml.merges` ("a b" strings),
//! * tokens with `token_type == 3` (control) become special added tokens (so
//!   "<|im_start|>" in text is one token), `token_type == 4` (user-defined)
//!   become non-special added tokens,
//! * byte-level decoder, byte-level post-processor.
//!
//! **`llama`** (SentencePiece-style, as Gemma, MiniCPM and Llama 2 GGUFs carry
//! it): tokens, `tokenizer.ggml.scores`, `tokenizer.ggml.token_type`. llama.cpp
//! tokenizes such a vocab by repeatedly merging the adjacent pair of symbols
//! (starting from single characters) whose concatenation is the token with the
//! highest score, leftmost first among equals; characters that no token covers
//! become `<0xNN>` byte tokens (else the unknown token). That is a BPE whose
//! merge ranks are the scores: for every token `t` of normal, user-defined or
//! unused type and every split `t = a + b` with `a` and `b` tokens, one merge
//! `(a, b)`, ranked by `score(t)` (highest first; equal scores by token id).
//! The normalizer replaces " " by "▁" and, when
//! `tokenizer.ggml.add_space_prefix` (default true; Gemma's converter writes
//! false) says so, prepends "▁" to the text and to every text piece that
//! follows a special token, as llama.cpp does. Control and unknown tokens are
//! special added tokens, user-defined ones non-special added tokens (matched
//! after the whitespace escape when they contain "▁"). The decoder undoes "▁",
//! the byte tokens and the prefix space.
//!
//! Where the two can differ: a merge between two pairs of equal score at
//! different places in a text is made leftmost-first by llama.cpp and in token
//! id order here (real SentencePiece vocabularies have distinct scores for
//! their normal pieces); a character missing from the vocabulary is turned into
//! byte tokens here before any merge, while llama.cpp keeps it as a symbol that
//! could still merge with a neighbour (only when a token contains a character
//! that is not itself a token). Neither tokenizer normalizes Unicode.
//!
//! **`gemma4`** (Gemma 4's BPE as llama.cpp's converter writes it): tokens and
//! `tokenizer.ggml.merges` like `gpt2`, but over raw UTF-8 pieces, not the
//! byte-level alphabet: the normalizer replaces " " by "▁", the merges run over
//! the whole text (no pre-tokenizer split, no prefix space), characters no
//! piece covers become `<0xNN>` byte tokens (byte fallback), and the decoder
//! undoes "▁" and the byte tokens. Control and unknown tokens are special added
//! tokens.
//!
//! BOS/EOS are NOT inserted by the built tokenizer; see
//! [`GgufTokenizerInfo::add_bos`] (default true for `llama` and `gemma4`, false
//! for `gpt2`, as in llama.cpp). Other tokenizer models are rejected with a
//! clear error.

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

/// `tokenizer.ggml.model` values this module builds.
pub const SUPPORTED_MODELS: &[&str] = &["gpt2", "llama", "gemma4"];

const TOKEN_TYPE_UNKNOWN: i32 = 2;
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;
const TOKEN_TYPE_BYTE: i32 = 6;

/// SentencePiece's whitespace mark.
const SPACE_MARK: &str = "\u{2581}";

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
    /// `tokenizer.ggml.add_bos_token` (default: true for `llama` and `gemma4`
    /// vocabularies, false otherwise, as in llama.cpp): whether
    /// the model expects BOS to be prepended. The built tokenizer never adds
    /// it itself.
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

fn opt_bool(g: &GgufFile, key: &str, default: bool) -> Result<bool> {
    match g.get(key) {
        None => Ok(default),
        Some(_) => g.get_bool(key),
    }
}

fn is_spm(g: &GgufFile) -> bool {
    g.get("tokenizer.ggml.model")
        .and_then(|v| v.as_str())
        .is_some_and(|m| m == "llama")
}

/// Whether the model expects BOS when the file does not say (`tokenizer.ggml.add_bos_token`):
/// SentencePiece vocabularies and Gemma 4's do, byte-level BPE ones do not, as in llama.cpp.
fn adds_bos_by_default(g: &GgufFile) -> bool {
    g.get("tokenizer.ggml.model")
        .and_then(|v| v.as_str())
        .is_some_and(|m| m == "llama" || m == "gemma4")
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
        add_bos: opt_bool(g, "tokenizer.ggml.add_bos_token", adds_bos_by_default(g))?,
        add_eos: opt_bool(g, "tokenizer.ggml.add_eos_token", false)?,
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
    match model {
        "gpt2" | "gemma4" => {}
        "llama" => {
            return serde_json::to_value(spm_tokenizer(g)?).map_err(|e| {
                anyhow!("GGUF {path}: cannot write the SentencePiece tokenizer as JSON: {e}")
            })
        }
        _ => bail!(
            "GGUF {path}: tokenizer model '{model}' is not supported (supported: {})",
            SUPPORTED_MODELS.join(", ")
        ),
    }
    let gemma4 = model == "gemma4";
    // (pre-tokenizer, normalizer, ignore_merges, post-processor, decoder, byte fallback)
    let (pre_tokenizer, normalizer, ignore_merges, post_processor, decoder, byte_fallback) =
        if gemma4 {
            // Raw UTF-8 pieces over the whole text (no byte-level alphabet, no pre-split),
            // spaces as "▁", characters outside the vocabulary as <0xNN> byte tokens.
            (
                Value::Null,
                json!({"type": "Replace", "pattern": {"String": " "}, "content": SPACE_MARK}),
                false,
                Value::Null,
                json!({"type": "Sequence", "decoders": [
                    {"type": "Replace", "pattern": {"String": SPACE_MARK}, "content": " "},
                    {"type": "ByteFallback"},
                    {"type": "Fuse"},
                ]}),
                true,
            )
        } else {
            let pre = match g.get("tokenizer.ggml.pre") {
                None => "gpt-2",
                Some(_) => g.get_str("tokenizer.ggml.pre")?,
            };
            let (pre_tokenizer, normalizer, ignore_merges) =
                pre_tokenizer_for(pre).ok_or_else(|| {
                    anyhow!(
                        "GGUF {path}: tokenizer pre-tokenizer '{pre}' is not supported (supported: {})",
                        SUPPORTED_PRE.join(", ")
                    )
                })?;
            (
                pre_tokenizer,
                normalizer,
                ignore_merges,
                json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false,
                       "use_regex": true}),
                json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                       "use_regex": true}),
                false,
            )
        };

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
        let special = ty == TOKEN_TYPE_CONTROL || (gemma4 && ty == TOKEN_TYPE_UNKNOWN);
        if special || ty == TOKEN_TYPE_USER_DEFINED {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special,
            }));
        }
    }
    // Gemma 4's unknown token, for characters that neither a piece nor the byte tokens cover.
    let unk_token = match (gemma4, opt_u32(g, "tokenizer.ggml.unknown_token_id")?) {
        (false, _) => Value::Null,
        (true, Some(id)) => json!(tokens.get(id as usize).ok_or_else(|| anyhow!(
            "GGUF {path}: tokenizer.ggml.unknown_token_id {id} is outside the vocabulary"
        ))?),
        (true, None) => types
            .iter()
            .position(|&t| t == TOKEN_TYPE_UNKNOWN)
            .map_or(Value::Null, |i| json!(tokens[i])),
    };
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
        "post_processor": post_processor,
        "decoder": decoder,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": unk_token,
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": byte_fallback, "byte_fallback": byte_fallback, "ignore_merges": ignore_merges,
            "vocab": vocab, "merges": merge_pairs,
        },
    }))
}

/// Builds the tokenizer described by the GGUF metadata.
pub fn tokenizer_from_gguf(g: &GgufFile) -> Result<Tokenizer> {
    if is_spm(g) {
        return spm_tokenizer(g);
    }
    let doc = tokenizer_json_from_gguf(g)?;
    Tokenizer::from_str(&doc.to_string()).map_err(|e| {
        anyhow!(
            "GGUF {}: cannot build tokenizer from metadata: {e}",
            g.path().display()
        )
    })
}

/// Token types (`tokenizer.ggml.token_type`, all normal when absent), checked
/// against the token count.
fn token_types(g: &GgufFile, n: usize) -> Result<Vec<i32>> {
    let types = match g.get("tokenizer.ggml.token_type") {
        None => vec![1; n],
        Some(_) => g.get_i32_array("tokenizer.ggml.token_type")?,
    };
    if types.len() != n {
        bail!(
            "GGUF {}: tokenizer.ggml.token_type has {} entries but tokenizer.ggml.tokens has {n}",
            g.path().display(),
            types.len()
        );
    }
    Ok(types)
}

/// The merges that reproduce llama.cpp's score-driven SentencePiece merging:
/// `(a, b)` for every split of every mergeable token into two tokens, ordered
/// by the merged token's score (highest first, then by id). `vocab` maps each
/// string to its first id.
fn spm_merges(
    tokens: &[&str],
    scores: &[f32],
    types: &[i32],
    vocab: &tokenizers::models::bpe::Vocab,
) -> Vec<(String, String)> {
    // (score, token id, split byte offset): the strings are made once, in rank order.
    let mut found: Vec<(f32, u32, u32)> = Vec::new();
    for (id, (&tok, &ty)) in tokens.iter().zip(types).enumerate() {
        let mergeable = !matches!(
            ty,
            TOKEN_TYPE_UNKNOWN | TOKEN_TYPE_CONTROL | TOKEN_TYPE_BYTE
        );
        if !mergeable || vocab.get(tok) != Some(&(id as u32)) {
            continue;
        }
        for (i, _) in tok.char_indices().skip(1) {
            let (a, b) = tok.split_at(i);
            if vocab.contains_key(a) && vocab.contains_key(b) {
                found.push((scores[id], id as u32, i as u32));
            }
        }
    }
    // Stable: the splits of one token keep their order.
    found.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)));
    found
        .into_iter()
        .map(|(_, id, i)| {
            let (a, b) = tokens[id as usize].split_at(i as usize);
            (a.to_owned(), b.to_owned())
        })
        .collect()
}

/// The SentencePiece-style (`tokenizer.ggml.model == "llama"`) tokenizer.
fn spm_tokenizer(g: &GgufFile) -> Result<Tokenizer> {
    use tokenizers::decoders::byte_fallback::ByteFallback;
    use tokenizers::decoders::fuse::Fuse;
    use tokenizers::decoders::strip::Strip;
    use tokenizers::decoders::DecoderWrapper;
    use tokenizers::models::bpe::BPE;
    use tokenizers::normalizers::{NormalizerWrapper, Prepend, Replace};
    use tokenizers::AddedToken;

    let path = g.path().display().to_string();
    let bad = |e: tokenizers::Error| {
        anyhow!("GGUF {path}: cannot build the SentencePiece tokenizer: {e}")
    };
    let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
    let n = tokens.len();
    let types = token_types(g, n)?;
    let scores = match g.get("tokenizer.ggml.scores") {
        None => vec![0.0; n],
        Some(_) => g.get_f32_array("tokenizer.ggml.scores")?,
    };
    if scores.len() != n {
        bail!(
            "GGUF {path}: tokenizer.ggml.scores has {} entries but tokenizer.ggml.tokens has {n}",
            scores.len()
        );
    }
    let add_space_prefix = opt_bool(g, "tokenizer.ggml.add_space_prefix", true)?;

    let mut vocab = tokenizers::models::bpe::Vocab::default();
    vocab.reserve(n);
    for (id, &tok) in tokens.iter().enumerate() {
        // First occurrence wins for (rare) duplicate token strings.
        vocab.entry(tok.to_owned()).or_insert(id as u32);
    }
    let unk = match opt_u32(g, "tokenizer.ggml.unknown_token_id")? {
        Some(id) => Some(id as usize),
        None => types.iter().position(|&t| t == TOKEN_TYPE_UNKNOWN),
    };
    let merges = spm_merges(&tokens, &scores, &types, &vocab);
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(u) = unk {
        let name = tokens.get(u).ok_or_else(|| {
            anyhow!("GGUF {path}: unknown token id {u} is outside the vocabulary")
        })?;
        bpe = bpe.unk_token((*name).to_owned());
    }
    let mut tok = Tokenizer::new(bpe.build().map_err(bad)?);

    let escape = NormalizerWrapper::Replace(Replace::new(" ", SPACE_MARK).map_err(bad)?);
    let normalizer = if add_space_prefix {
        NormalizerWrapper::Sequence(tokenizers::normalizers::Sequence::new(vec![
            NormalizerWrapper::Prepend(Prepend::new(SPACE_MARK.to_owned())),
            escape,
        ]))
    } else {
        escape
    };
    tok.with_normalizer(Some(normalizer));
    let mut decoders = vec![
        DecoderWrapper::Replace(Replace::new(SPACE_MARK, " ").map_err(bad)?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if add_space_prefix {
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    tok.with_decoder(Some(DecoderWrapper::Sequence(
        tokenizers::decoders::sequence::Sequence::new(decoders),
    )));

    let mut special = Vec::new();
    let mut user = Vec::new();
    for (&t, &ty) in tokens.iter().zip(&types) {
        match ty {
            TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN => {
                special.push(AddedToken::from(t, true).normalized(false))
            }
            TOKEN_TYPE_USER_DEFINED => {
                user.push(AddedToken::from(t, false).normalized(t.contains(SPACE_MARK)))
            }
            _ => {}
        }
    }
    tok.add_special_tokens(&special);
    tok.add_tokens(&user);
    Ok(tok)
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
