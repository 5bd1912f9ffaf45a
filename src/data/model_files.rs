//! A model's tokenizer, chat template and vocabulary size, read from its files without loading
//! its weights: what `lorafit lint` needs to check a dataset against a model in seconds, however
//! large the model, and how training (`train::trainer::load_model_and_tokenizer`) and `curate`
//! read the tokenizer too, so that all three follow one rule: a Hugging Face folder's
//! `tokenizer.json` + `tokenizer_config.json` (EOS from `config.json` when the tokenizer names
//! none, further stop ids from `generation_config.json`), or a GGUF file's embedded tokenizer
//! and template.
//!
//! Where a path does not load as a model, [`model_path_problem`] reads what its files say
//! instead: an adapter given as the model, weights lorafit does not read, a download that did not
//! finish.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};

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
    read_model_tokens(path).map_err(|e| match adapter_given_as_model(path) {
        Some(problem) => anyhow!(problem),
        None => e,
    })
}

fn read_model_tokens(path: &Path) -> Result<ModelTokens> {
    if path.is_dir() {
        // Its errors name the file.
        let spec = ModelSpec::from_config_file(&path.join("config.json"))?;
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
/// `eos_token_id`, asked for only then) and its `generation_config.json`'s `eos_token_id`s as
/// further stop ids; a GGUF's template gets the strings of its BOS and EOS. A model template
/// that does not compile is kept, failing where it is used (`run_template` without a template
/// setting), so that a template given in its place can be.
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
        let (ids, warning) = read_generation_eos(path);
        let tok = tok.with_generation_eos(ids, warning);
        let template = ChatTemplate::from_model_folder(path)?;
        return Ok((tok, template));
    }
    let g = GgufFile::open(path)?;
    let (tok, info) = super::gguf_tokenizer::load_gguf_tokenizer(&g)?;
    let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).unwrap_or_default();
    let template = info.chat_template.as_ref().map(|t| {
        ChatTemplate::from_gguf_metadata(path, t.clone(), name(info.bos_id), name(info.eos_id))
    });
    Ok((
        TextTokenizer::new(tok, info.bos_id, info.eos_id, info.add_bos)?,
        template,
    ))
}

/// The `eos_token_id` of the `generation_config.json` in `dir`, a token id or a list of them
/// (what transformers' `generate` stops on), and a warning naming the file where it is there but
/// cannot be read (generation then stops on the other eos tokens).
pub fn read_generation_eos(dir: &Path) -> (Vec<u32>, Option<String>) {
    let path = dir.join("generation_config.json");
    // symlink_metadata: a dangling link is a file that cannot be read, not an absent one.
    if path.symlink_metadata().is_err() {
        return (Vec::new(), None);
    }
    let read = || -> Result<Vec<u32>> {
        let text = std::fs::read_to_string(&path)?;
        let v: serde_json::Value = serde_json::from_str(&text).context("not valid JSON")?;
        if !v.is_object() {
            bail!("not a JSON object");
        }
        let id = |x: &serde_json::Value| x.as_u64().and_then(|i| u32::try_from(i).ok());
        let wrong = |x: &serde_json::Value| {
            anyhow!("eos_token_id is {x}, where a token id or a list of token ids is expected")
        };
        match v.get("eos_token_id") {
            None | Some(serde_json::Value::Null) => Ok(Vec::new()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .map(|x| id(x).ok_or_else(|| wrong(&v["eos_token_id"])))
                .collect(),
            Some(x) => Ok(vec![id(x).ok_or_else(|| wrong(x))?]),
        }
    };
    match read() {
        Ok(ids) => (ids, None),
        Err(e) => (
            Vec::new(),
            Some(format!(
                "{}: {e:#}; generation does not stop on its eos_token_id",
                path.display()
            )),
        ),
    }
}

/// The template a run renders with: the `chat_template` setting's when it is set (with the
/// tokenizer's BOS/EOS strings), else the model's own, which must then compile.
pub fn run_template(
    setting: Option<&str>,
    model_template: Option<ChatTemplate>,
    tok: &TextTokenizer,
) -> Result<Option<ChatTemplate>> {
    match setting {
        Some(t) => Ok(Some(template_from_setting(t, tok)?)),
        None => {
            if let Some(t) = &model_template {
                t.check_compiles()?;
            }
            Ok(model_template)
        }
    }
}

/// The `chat_template` setting's template, with the tokenizer's BOS/EOS strings.
pub fn template_from_setting(path: &str, tok: &TextTokenizer) -> Result<ChatTemplate> {
    let name = |id: Option<u32>| id.and_then(|i| tok.id_to_token(i)).unwrap_or_default();
    ChatTemplate::from_file(path, &name(tok.bos_id()), &name(tok.eos_id()))
        .with_context(|| format!("chat_template = {path:?}"))
}

/// Why the model folder or file at `path` does not load, where its files say more than the
/// loader's error: a LoRA adapter given as the model (a PEFT folder, a GGUF adapter), weights
/// lorafit does not read (PyTorch's, safetensors under other names, a GGUF inside the folder),
/// or a download that did not finish (a link to a file that is not there). `None` where they
/// do not.
pub fn model_path_problem(path: &Path) -> Option<String> {
    adapter_given_as_model(path).or_else(|| weights_problem(path))
}

/// `err`, the loader's error for the model at `path`, or in its place what
/// [`model_path_problem`] finds.
pub fn explain_model_error(path: &Path, err: anyhow::Error) -> anyhow::Error {
    match model_path_problem(path) {
        Some(problem) => anyhow!(problem),
        None => err,
    }
}

/// What to say where `path` is a LoRA adapter rather than a model.
fn adapter_given_as_model(path: &Path) -> Option<String> {
    if path.is_dir() {
        let adapter_config = path.join("adapter_config.json");
        if path.join("config.json").exists() || !adapter_config.is_file() {
            return None;
        }
        let base = std::fs::read_to_string(&adapter_config)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| Some(v.get("base_model_name_or_path")?.as_str()?.to_string()))
            .filter(|b| !b.trim().is_empty());
        let model = match base {
            Some(b) => format!("--model {b} (its adapter_config.json's base_model_name_or_path)"),
            None => "--model (its adapter_config.json names no base_model_name_or_path: the \
                     model it was trained on)"
                .to_string(),
        };
        return Some(format!(
            "{0} is a LoRA adapter folder (adapter_config.json, no config.json), not a model: \
             pass it as --adapter {0}, with its base model as {model}",
            path.display()
        ));
    }
    if !path.is_file() || path.extension().is_none_or(|e| e != "gguf") {
        return None;
    }
    let g = GgufFile::open(path).ok()?;
    if g.get_str("general.type").ok()? != "adapter" {
        return None;
    }
    let arch = g.get_str("general.architecture").unwrap_or("unknown");
    let named = ["general.base_model.0.repo_url", "general.base_model.0.name"]
        .iter()
        .find_map(|k| g.get_str(k).ok())
        .map(|b| format!(", {b}"))
        .unwrap_or_default();
    Some(format!(
        "{} is a LoRA adapter in GGUF form (general.type = adapter, for llama.cpp's --lora, as \
         `lorafit export` writes it), not a model: pass its base model ({arch}{named}) as \
         --model, and as --adapter the PEFT adapter folder it was exported from (a run's \
         adapter/); lorafit does not read GGUF adapters",
        path.display()
    ))
}

/// What to say where a model folder holds no weights lorafit reads, or links to files that are
/// not there.
fn weights_problem(path: &Path) -> Option<String> {
    if let Some(problem) = dangling_link(path) {
        return Some(problem);
    }
    if !path.is_dir() {
        return None;
    }
    let single = path.join("model.safetensors");
    let index = path.join("model.safetensors.index.json");
    if let Some(problem) = dangling_link(&single).or_else(|| dangling_link(&index)) {
        return Some(problem);
    }
    if index.is_file() {
        let shards: Vec<String> = std::fs::read_to_string(&index)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| {
                let map = v.get("weight_map")?.as_object()?;
                Some(
                    map.values()
                        .filter_map(|f| f.as_str())
                        .map(String::from)
                        .collect(),
                )
            })
            .unwrap_or_default();
        for shard in shards {
            let file = path.join(&shard);
            if let Some(problem) = dangling_link(&file) {
                return Some(problem);
            }
            if !file.exists() {
                return Some(format!(
                    "{} names the shard {shard}, which is not in {}: the download is incomplete; \
                     download the model again",
                    index.display(),
                    path.display()
                ));
            }
        }
        return None;
    }
    if single.exists() {
        return None;
    }
    let mut names: Vec<String> = std::fs::read_dir(path)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let with = |end: &str| -> Vec<&str> {
        names
            .iter()
            .filter(|n| n.ends_with(end))
            .map(String::as_str)
            .collect()
    };
    let dir = path.display();
    let torch: Vec<&str> = names
        .iter()
        .filter(|n| n.starts_with("pytorch_model") && (n.ends_with(".bin") || n.ends_with(".json")))
        .map(String::as_str)
        .collect();
    if !torch.is_empty() {
        return Some(format!(
            "{dir} holds PyTorch weights ({}), and lorafit reads safetensors only: convert them \
             with transformers, `AutoModelForCausalLM.from_pretrained(\"{dir}\").save_pretrained(\
             \"OUT\", safe_serialization=True)` and `AutoTokenizer.from_pretrained(\"{dir}\")\
             .save_pretrained(\"OUT\")`, and pass OUT as --model",
            torch.join(", ")
        ));
    }
    let safetensors = with(".safetensors");
    if !safetensors.is_empty() {
        return Some(format!(
            "{dir} has no model.safetensors or model.safetensors.index.json, which is how lorafit \
             finds a model's weights; its safetensors files are {} (one file is read as \
             model.safetensors, shards through the model.safetensors.index.json that lists them)",
            safetensors.join(", ")
        ));
    }
    let ggufs = with(".gguf");
    if let Some(first) = ggufs.first() {
        return Some(format!(
            "{dir} holds no safetensors weights but {} ({}): pass the .gguf file itself, \
             --model {}",
            if ggufs.len() == 1 {
                "a GGUF file"
            } else {
                "GGUF files"
            },
            ggufs.join(", "),
            path.join(first).display()
        ));
    }
    None
}

/// What to say where `path` is a link to a file that is not there: a download that did not
/// finish (the Hugging Face cache's files are links into its `blobs/`).
fn dangling_link(path: &Path) -> Option<String> {
    let target = std::fs::read_link(path).ok()?;
    if path.exists() {
        return None;
    }
    let resolved = path.parent().unwrap_or(Path::new("")).join(&target);
    let mut partial = resolved.clone().into_os_string();
    partial.push(".incomplete");
    let partial = Path::new(&partial);
    Some(format!(
        "{} is a link to {}, which is not there: the download is incomplete{}; download the \
         model again",
        path.display(),
        target.display(),
        if partial.exists() {
            format!(
                " ({} is what an interrupted download left)",
                partial.display()
            )
        } else {
            String::new()
        }
    ))
}
