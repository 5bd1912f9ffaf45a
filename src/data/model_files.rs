//! A model's tokenizer, chat template and vocabulary size, read from its files without loading
//! its weights: what `lorafit lint` needs to check a dataset against a model in seconds, however
//! large the model, and how training (`train::trainer::load_model_and_tokenizer`) and `curate`
//! read the tokenizer too, so that all three follow one rule: a Hugging Face folder's
//! `tokenizer.json` + `tokenizer_config.json` (EOS from `config.json` when the tokenizer names
//! none), or a GGUF file's embedded tokenizer and template.

use std::path::Path;

use anyhow::{Context, Result};

use super::template::ChatTemplate;
use super::tokenize::TextTokenizer;
use crate::model::config::ModelSpec;
use crate::model::gguf::GgufFile;

/// What a dataset is checked against.
pub struct ModelTokens {
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    /// Rows of the model's token embedding: every id must be below it.
    pub vocab: usize,
}

/// Reads the tokenizer, template and vocabulary size of the model at `path`.
pub fn load_model_tokens(path: &Path) -> Result<ModelTokens> {
    if path.is_dir() {
        let spec = ModelSpec::from_config_file(&path.join("config.json"))
            .with_context(|| format!("reading {}", path.join("config.json").display()))?;
        let (tokenizer, template) = load_tokenizer(path, || Ok(spec.eos_token_id))?;
        return Ok(ModelTokens {
            tokenizer,
            template,
            vocab: spec.vocab,
        });
    }
    let (tokenizer, template) = load_tokenizer(path, || Ok(None))?;
    // A GGUF's embedded vocabulary is its embedding's: one row per token.
    let vocab = tokenizer.vocab_size();
    Ok(ModelTokens {
        tokenizer,
        template,
        vocab,
    })
}

/// The tokenizer and chat template of the model folder or GGUF file at `path`, without its
/// weights. A folder's tokenizer without an EOS token takes `folder_eos()` (its `config.json`'s
/// `eos_token_id`, asked for only then); a GGUF's template gets the strings of its BOS and EOS.
pub fn load_tokenizer(
    path: &Path,
    folder_eos: impl FnOnce() -> Result<Option<u32>>,
) -> Result<(TextTokenizer, Option<ChatTemplate>)> {
    if path.is_dir() {
        let tok = TextTokenizer::from_file(path.join("tokenizer.json"))?;
        let tok = match tok.eos_id() {
            None => tok.with_eos_id(folder_eos()?),
            Some(_) => tok,
        };
        let template = ChatTemplate::from_tokenizer_config(path.join("tokenizer_config.json"))?;
        return Ok((tok, template));
    }
    let g = GgufFile::open(path)?;
    let (tok, info) = super::gguf_tokenizer::load_gguf_tokenizer(&g)?;
    let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).unwrap_or_default();
    let template = match &info.chat_template {
        Some(t) => Some(ChatTemplate::new(
            t.clone(),
            name(info.bos_id),
            name(info.eos_id),
        )?),
        None => None,
    };
    Ok((
        TextTokenizer::new(tok, info.bos_id, info.eos_id, info.add_bos)?,
        template,
    ))
}

/// The template a run renders with: the `chat_template` setting's when it is set (with the
/// tokenizer's BOS/EOS strings), else the model's own.
pub fn run_template(
    setting: Option<&str>,
    model_template: Option<ChatTemplate>,
    tok: &TextTokenizer,
) -> Result<Option<ChatTemplate>> {
    match setting {
        Some(t) => Ok(Some(template_from_setting(t, tok)?)),
        None => Ok(model_template),
    }
}

/// The `chat_template` setting's template, with the tokenizer's BOS/EOS strings.
pub fn template_from_setting(path: &str, tok: &TextTokenizer) -> Result<ChatTemplate> {
    let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).unwrap_or_default();
    ChatTemplate::from_file(path, &name(tok.bos_id()), &name(tok.eos_id()))
        .with_context(|| format!("chat_template = {path:?}"))
}
