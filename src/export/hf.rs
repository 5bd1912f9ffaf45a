//! The merged model as a Hugging Face folder: every base tensor, with each adapted projection
//! replaced by `W + scale·B A`, written as safetensors in one float dtype (bf16 by default),
//! beside the base's `config.json` and tokenizer files, so that `transformers` loads it with
//! `from_pretrained` and lorafit with `model::load`.
//!
//! From a Hugging Face base every tensor of the folder is carried over (a multimodal
//! checkpoint keeps its vision tower) and every non-weight file is copied. From a GGUF base
//! the folder is built from the file: `config.json` from its metadata (the same
//! `gguf_model::config_from_gguf` the loader reads), the tensors under Hugging Face's names in
//! Hugging Face's layout (q/k rows put back, Gemma's stored `1 + w` norms back to `w`), and
//! `tokenizer.json` / `tokenizer_config.json` from the embedded tokenizer and chat template.

use super::merge::{add_delta, lora_delta};
use crate::model::gguf_model::{config_from_gguf, GgufArch, GgufSource};
use crate::model::weights::{
    norm_names, resolve_prefixes, view_to_f32, SafetensorsFolder, TensorSource,
};
use crate::model::{Lora, ModelSpec, Target};
use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// The float type the merged folder stores.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum HfDtype {
    Bf16,
    F16,
    F32,
}

impl HfDtype {
    fn safetensors(self) -> safetensors::Dtype {
        match self {
            HfDtype::Bf16 => safetensors::Dtype::BF16,
            HfDtype::F16 => safetensors::Dtype::F16,
            HfDtype::F32 => safetensors::Dtype::F32,
        }
    }
    /// transformers' name (`config.json`'s `dtype` / `torch_dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            HfDtype::Bf16 => "bfloat16",
            HfDtype::F16 => "float16",
            HfDtype::F32 => "float32",
        }
    }
    fn encode(self, x: &[f32]) -> Vec<u8> {
        match self {
            HfDtype::Bf16 => x
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect(),
            HfDtype::F16 => x
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            HfDtype::F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// Shards stay below this size (transformers' default is 5 GB); it also bounds the memory a
/// shard takes while it is assembled.
const SHARD_BYTES: usize = 4 << 30;

/// One tensor of the output: its bytes in the output dtype (or as stored, for non-float
/// tensors) and its shape.
struct OutTensor {
    name: String,
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// What a merged folder holds: the tensors that received a delta, and how many were written.
pub struct HfSummary {
    pub merged: Vec<String>,
    pub tensors: usize,
    pub dir: PathBuf,
}

/// The Hugging Face tensor name of each adapted projection, with its delta.
fn deltas(spec: &ModelSpec, lora: &Lora) -> Result<HashMap<String, (usize, Target)>> {
    let mut names = HashMap::new();
    for (l, t, _) in lora.pairs() {
        names.insert(
            spec.layer_tensor(l, &format!("{}.weight", t.path())),
            (l, t),
        );
    }
    Ok(names)
}

/// Writes `tensors` (in order) as one `model.safetensors` or shards with an index.
fn write_shards(dir: &Path, tensors: Vec<OutTensor>) -> Result<usize> {
    let mut shards: Vec<Vec<OutTensor>> = vec![Vec::new()];
    let mut size = 0usize;
    for t in tensors {
        if size > 0 && size + t.data.len() > SHARD_BYTES {
            shards.push(Vec::new());
            size = 0;
        }
        size += t.data.len();
        shards.last_mut().expect("one shard at least").push(t);
    }
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut total = 0usize;
    let mut count = 0usize;
    for (i, shard) in shards.iter().enumerate() {
        let file = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        };
        let views = shard
            .iter()
            .map(|t| {
                let view = safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.data)
                    .with_context(|| format!("tensor {}", t.name))?;
                Ok((t.name.clone(), view))
            })
            .collect::<Result<Vec<_>>>()?;
        let mut meta = HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let path = dir.join(&file);
        crate::atomic_file::write_with(&path, |tmp| {
            safetensors::serialize_to_file(views, Some(meta), tmp)
                .map_err(crate::model::weights::safetensors_error)
                .with_context(|| format!("writing {}", tmp.display()))
        })?;
        for t in shard {
            weight_map.insert(t.name.clone(), file.clone());
            total += t.data.len();
            count += 1;
        }
    }
    if n > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)?,
        )?;
    }
    Ok(count)
}

/// Whether a file of a base folder is weights (not copied: the merged weights replace it).
fn is_weight_file(name: &str) -> bool {
    name.ends_with(".safetensors")
        || name == "model.safetensors.index.json"
        || name.ends_with(".bin")
        || name.ends_with(".pt")
        || name.ends_with(".pth")
        || name.ends_with(".gguf")
        || name.ends_with(".bin.index.json")
}

/// The names of every tensor in a Hugging Face folder's safetensors, in file order.
fn folder_tensor_names(dir: &Path) -> Result<Vec<(PathBuf, Vec<String>)>> {
    let files = crate::model::weights::safetensors_files(dir)?;
    let mut out = Vec::new();
    for path in files {
        let f =
            std::fs::File::open(&path).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: the file is opened read-only and not modified while mapped.
        let mmap = unsafe { memmap2::Mmap::map(&f) }
            .with_context(|| format!("mapping {}", path.display()))?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&mmap)
            .with_context(|| format!("{}: not a valid safetensors file", path.display()))?;
        let mut names: Vec<(usize, String)> = meta
            .tensors()
            .iter()
            .map(|(n, info)| (info.data_offsets.0, n.to_string()))
            .collect();
        names.sort();
        out.push((path, names.into_iter().map(|(_, n)| n).collect()));
    }
    Ok(out)
}

/// Sets `dtype` (transformers ≥ 5) or `torch_dtype` to the stored type.
fn set_config_dtype(config: &mut Value, dtype: HfDtype) {
    if let Some(obj) = config.as_object_mut() {
        let key = if obj.contains_key("dtype") || !obj.contains_key("torch_dtype") {
            "dtype"
        } else {
            "torch_dtype"
        };
        obj.insert(key.into(), json!(dtype.torch_name()));
        if let Some(text) = obj.get_mut("text_config").and_then(|t| t.as_object_mut()) {
            if text.contains_key("dtype") {
                text.insert("dtype".into(), json!(dtype.torch_name()));
            }
        }
    }
}

/// Merged folder from a Hugging Face base folder.
pub fn merged_from_hf(
    base: &Path,
    spec: &ModelSpec,
    lora: &Lora,
    out: &Path,
    dtype: HfDtype,
) -> Result<HfSummary> {
    ensure!(
        out != base,
        "the output folder {} is the base model's folder",
        out.display()
    );
    let src = SafetensorsFolder::open(base)?;
    let spec = resolve_prefixes(spec, &src);
    let targets = deltas(&spec, lora)?;
    let mut tensors = Vec::new();
    let mut merged = Vec::new();
    for (path, names) in folder_tensor_names(base)? {
        let f = std::fs::File::open(&path)?;
        // SAFETY: as above, read-only.
        let mmap = unsafe { memmap2::Mmap::map(&f) }?;
        let st = safetensors::SafeTensors::deserialize(&mmap)
            .with_context(|| format!("parsing {}", path.display()))?;
        for name in names {
            let view = st
                .tensor(&name)
                .with_context(|| format!("{}: tensor {name}", path.display()))?;
            let is_float = matches!(
                view.dtype(),
                safetensors::Dtype::F32 | safetensors::Dtype::F16 | safetensors::Dtype::BF16
            );
            if !is_float {
                ensure!(
                    !targets.contains_key(&name),
                    "{}: tensor {name} is {:?}, not a float weight the adapter can merge into",
                    path.display(),
                    view.dtype()
                );
                tensors.push(OutTensor {
                    name,
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    data: view.data().to_vec(),
                });
                continue;
            }
            let mut data =
                view_to_f32(&view).with_context(|| format!("{}: tensor {name}", path.display()))?;
            if let Some(&(l, t)) = targets.get(&name) {
                let pair = lora.get(l, t).expect("named from the adapter's pairs");
                add_delta(&mut data, &lora_delta(pair)?, &name)?;
                merged.push(name.clone());
            }
            tensors.push(OutTensor {
                name,
                dtype: dtype.safetensors(),
                shape: view.shape().to_vec(),
                data: dtype.encode(&data),
            });
        }
    }
    for name in targets.keys() {
        ensure!(
            merged.contains(name),
            "{}: the adapter targets {name}, which the folder does not hold",
            base.display()
        );
    }
    // Created once nothing above can fail, so that a refused export leaves no folder behind.
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let count = write_shards(out, tensors)?;
    for entry in std::fs::read_dir(base).with_context(|| format!("reading {}", base.display()))? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().to_string();
        if entry.file_type()?.is_file() && !is_weight_file(&name) && name != "config.json" {
            std::fs::copy(entry.path(), out.join(&name))
                .with_context(|| format!("copying {name}"))?;
        }
    }
    if !out.join("tokenizer.json").exists() && !out.join("tokenizer.model").exists() {
        eprintln!(
            "note: {} has no tokenizer (tokenizer.json or tokenizer.model), so the merged folder \
             has none either: copy the base model's tokenizer files into {} to load it with one",
            base.display(),
            out.display()
        );
    }
    let config_path = base.join("config.json");
    let mut config: Value = serde_json::from_str(
        &std::fs::read_to_string(&config_path)
            .with_context(|| format!("reading {}", config_path.display()))?,
    )
    .with_context(|| format!("parsing {}", config_path.display()))?;
    set_config_dtype(&mut config, dtype);
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    merged.sort();
    Ok(HfSummary {
        merged,
        tensors: count,
        dir: out.to_path_buf(),
    })
}

/// Hugging Face `architectures` / `model_type` of a GGUF architecture.
fn hf_names(arch: GgufArch) -> (&'static str, &'static str) {
    match arch {
        GgufArch::Llama => ("LlamaForCausalLM", "llama"),
        GgufArch::Gemma2 => ("Gemma2ForCausalLM", "gemma2"),
        GgufArch::Gemma3 => ("Gemma3ForCausalLM", "gemma3_text"),
        GgufArch::Gemma4 => ("Gemma4ForCausalLM", "gemma4_text"),
        GgufArch::MiniCpm => ("MiniCPMForCausalLM", "minicpm"),
    }
}

/// The Hugging Face names of every tensor a model of `spec` has.
fn hf_tensor_names(spec: &ModelSpec) -> Vec<String> {
    let mut names = vec![spec.model_tensor("embed_tokens.weight")];
    for (l, ls) in spec.layers.iter().enumerate() {
        for leaf in norm_names(ls.sandwich_norms).into_iter().flatten() {
            names.push(spec.layer_tensor(l, leaf));
        }
        for t in Target::ALL {
            names.push(spec.layer_tensor(l, &format!("{}.weight", t.path())));
        }
        if spec.qkv_bias {
            for p in ["q", "k", "v"] {
                names.push(spec.layer_tensor(l, &format!("self_attn.{p}_proj.bias")));
            }
        }
        if spec.qk_norm {
            names.push(spec.layer_tensor(l, "self_attn.q_norm.weight"));
            names.push(spec.layer_tensor(l, "self_attn.k_norm.weight"));
        }
    }
    names.push(spec.model_tensor("norm.weight"));
    if !spec.tie_embeddings {
        names.push(spec.head_tensor());
    }
    names
}

/// Merged folder from a GGUF base.
pub fn merged_from_gguf(base: &Path, lora: &Lora, out: &Path, dtype: HfDtype) -> Result<HfSummary> {
    let src = GgufSource::open(base)?;
    let spec = &src.spec;
    let (arch, mut config) = config_from_gguf(&src.file)?;
    // The tensor list below has no per-layer inputs, layer scalars or KV-sharing layers.
    ensure!(
        arch != GgufArch::Gemma4,
        "{}: a merged Hugging Face folder from a gemma4 GGUF is not written (--format \
         merged-gguf writes the merged GGUF)",
        base.display()
    );
    let (architecture, model_type) = hf_names(arch);
    let obj = config
        .as_object_mut()
        .expect("config_from_gguf returns an object");
    obj.insert("architectures".into(), json!([architecture]));
    obj.insert("model_type".into(), json!(model_type));
    if matches!(arch, GgufArch::Llama | GgufArch::MiniCpm) {
        obj.insert("hidden_act".into(), json!("silu"));
    }
    // A score scale written into the metadata (`{arch}.attention.scale`) reaches
    // transformers' Gemma as `query_pre_attn_scalar = scale⁻²`; the other architectures have
    // no such setting.
    let scale_key = format!("{}.attention.scale", arch.name());
    if src.file.get(&scale_key).is_some() {
        let scale = src.file.get_f32(&scale_key)? as f64;
        match arch {
            GgufArch::Gemma2 | GgufArch::Gemma3 => {
                obj.insert("query_pre_attn_scalar".into(), json!(1.0 / (scale * scale)));
            }
            _ => {
                let default = 1.0 / (spec.head_dim as f64).sqrt();
                ensure!(
                    (scale - default).abs() <= 1e-6 * default,
                    "{}: {scale_key} = {scale} is not head_dim^-1/2, which a Hugging Face \
                     {architecture} config cannot express",
                    base.display()
                );
            }
        }
    }
    set_config_dtype(&mut config, dtype);
    let targets = deltas(spec, lora)?;
    let tokenizer = gguf_tokenizer_files(&src)?;
    let mut tensors = Vec::new();
    let mut merged = Vec::new();
    for name in hf_tensor_names(spec) {
        let (shape, mut data) = src.get(&name)?;
        // The converter stored Gemma's norms as 1 + w; Hugging Face keeps w.
        let is_norm = name.ends_with("norm.weight") || name.ends_with("layernorm.weight");
        if is_norm && matches!(arch, GgufArch::Gemma2 | GgufArch::Gemma3) {
            data.iter_mut().for_each(|x| *x -= 1.0);
        }
        if let Some(&(l, t)) = targets.get(&name) {
            let pair = lora.get(l, t).expect("named from the adapter's pairs");
            add_delta(&mut data, &lora_delta(pair)?, &name)?;
            merged.push(name.clone());
        }
        tensors.push(OutTensor {
            name,
            dtype: dtype.safetensors(),
            shape,
            data: dtype.encode(&data),
        });
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let count = write_shards(out, tensors)?;
    std::fs::write(
        out.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    match tokenizer {
        Some((tokenizer, config)) => {
            std::fs::write(
                out.join("tokenizer.json"),
                serde_json::to_string(&tokenizer)?,
            )?;
            std::fs::write(
                out.join("tokenizer_config.json"),
                serde_json::to_string_pretty(&config)?,
            )?;
        }
        None => eprintln!(
            "{}: no embedded tokenizer; the merged folder has none either",
            base.display()
        ),
    }
    merged.sort();
    Ok(HfSummary {
        merged,
        tensors: count,
        dir: out.to_path_buf(),
    })
}

/// Sets `chat_template` in the merged folder's `tokenizer_config.json` (written with that key
/// alone when the base had none), the template a run trained with in place of the base's.
pub fn set_chat_template(dir: &Path, template: &str) -> Result<()> {
    let path = dir.join("tokenizer_config.json");
    let mut config: Value = match std::fs::read_to_string(&path) {
        Ok(text) => {
            serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))?
        }
        Err(_) => json!({}),
    };
    let Some(obj) = config.as_object_mut() else {
        bail!("{}: not a JSON object", path.display());
    };
    obj.insert("chat_template".into(), json!(template));
    std::fs::write(&path, serde_json::to_string_pretty(&config)?)
        .with_context(|| format!("writing {}", path.display()))?;
    // transformers reads a `chat_template.jinja` beside the config in place of the config's
    // template: a base's copy there would be the one a merged model runs with.
    let file = dir.join("chat_template.jinja");
    if file.exists() {
        std::fs::write(&file, template).with_context(|| format!("writing {}", file.display()))?;
    }
    Ok(())
}

/// The `tokenizer.json` and `tokenizer_config.json` (special tokens, BOS policy, chat template)
/// of a merged folder from a GGUF base, built from its embedded tokenizer; `None` where it has
/// none. Built before anything is written, since a tokenizer that does not convert would stop
/// the export after the tensors.
pub fn gguf_tokenizer_files(src: &GgufSource) -> Result<Option<(Value, Value)>> {
    use crate::data::gguf_tokenizer::{tokenizer_info_from_gguf, tokenizer_json_from_gguf};
    let g = &src.file;
    if g.get("tokenizer.ggml.model").is_none() {
        return Ok(None);
    }
    let tokenizer = tokenizer_json_from_gguf(g)?;
    let info = tokenizer_info_from_gguf(g)?;
    let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
    let token = |id: Option<u32>, what: &str| -> Result<Value> {
        match id {
            None => Ok(Value::Null),
            Some(i) => match tokens.get(i as usize) {
                Some(t) => Ok(json!(t)),
                None => bail!(
                    "{}: {what} id {i} is past the vocabulary ({} tokens)",
                    g.path().display(),
                    tokens.len()
                ),
            },
        }
    };
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token(info.bos_id, "bos")?,
        "eos_token": token(info.eos_id, "eos")?,
        "add_bos_token": info.add_bos,
        "add_eos_token": info.add_eos,
        "model_max_length": src.spec.max_position_embeddings,
    });
    if let Some(pad) = info.pad_id {
        config["pad_token"] = token(Some(pad), "padding")?;
    }
    if let Some(t) = &info.chat_template {
        config["chat_template"] = json!(t);
    }
    Ok(Some((tokenizer, config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The run's template replaces the base's in both places transformers reads: the config's
    /// `chat_template` and a `chat_template.jinja` beside it (which wins there).
    #[test]
    fn the_runs_template_replaces_the_bases_file_too() {
        let dir = std::env::temp_dir().join(format!("lorafit-export-tpl-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"eos_token": "</s>"}"#,
        )
        .unwrap();
        std::fs::write(dir.join("chat_template.jinja"), "BASE").unwrap();
        set_chat_template(&dir, "MINE").unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("chat_template.jinja")).unwrap(),
            "MINE"
        );
        let t = crate::data::ChatTemplate::from_tokenizer_config(dir.join("tokenizer_config.json"))
            .unwrap()
            .unwrap();
        assert_eq!(t.source(), "MINE");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
