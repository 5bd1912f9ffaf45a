//! The Hugging Face hub cache, read and never written: lorafit downloads nothing, but a TRL user
//! names models and datasets by their Hub ids (`org/name`), and an earlier run of `transformers`
//! or `datasets` left their files in this cache. A model id resolves to its cached snapshot
//! folder (config, safetensors, tokenizer: the folder lorafit loads); a dataset id is answered
//! with its cached files and the pattern that names one split, since a dataset snapshot holds
//! every split and which one to train on is the user's choice.
//!
//! The layout: `ROOT/{models,datasets}--ORG--NAME/snapshots/REVISION/...`, with
//! `refs/main` holding the revision the default branch pointed at when it was downloaded. ROOT
//! is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// The hub cache's root, from the environment as `huggingface_hub` finds it.
pub fn root() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    var("HF_HUB_CACHE")
        .map(Into::into)
        .or_else(|| var("HF_HOME").map(|h| Path::new(&h).join("hub")))
        .or_else(|| var("HOME").map(|h| Path::new(&h).join(".cache/huggingface/hub")))
}

/// `(org, name)` when `spec` is shaped like a Hub id: two words of letters, digits, `-`, `_`
/// and `.`, joined by one `/`.
pub fn hub_id(spec: &str) -> Option<(&str, &str)> {
    let (org, name) = spec.split_once('/')?;
    let word = |s: &str| {
        !s.is_empty()
            && !s.starts_with('.')
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    (word(org) && word(name)).then_some((org, name))
}

/// What lorafit loads from the cached snapshot of model `spec` (a Hub id that is no local path)
/// under `cache`: the snapshot folder `refs/main` names, else the only one there is; in a
/// snapshot of GGUF files (no `config.json`), its one `.gguf` file. `None` when `spec` is not
/// shaped like an id or the cache does not hold it; an error when there are several snapshots
/// and no `refs/main`, or several GGUF files to choose from.
pub fn model_snapshot(spec: &str, cache: Option<&Path>) -> Result<Option<PathBuf>> {
    let Some(snapshot) = snapshot_folder(spec, cache)? else {
        return Ok(None);
    };
    if snapshot.join("config.json").is_file() {
        return Ok(Some(snapshot));
    }
    let mut ggufs: Vec<PathBuf> = std::fs::read_dir(&snapshot)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    ggufs.sort();
    match ggufs.as_slice() {
        [one] => Ok(Some(one.clone())),
        [] => bail!(
            "{spec}: its snapshot in the Hugging Face cache ({}) has neither config.json nor a \
             .gguf file (an incomplete download?)",
            snapshot.display()
        ),
        many => bail!(
            "{spec}: its snapshot in the Hugging Face cache holds {} GGUF files; name one: {}",
            many.len(),
            many.iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// The cache's folder of repository `org/name` of `kind` ("models" or "datasets").
fn repo_folder(cache: &Path, kind: &str, org: &str, name: &str) -> PathBuf {
    cache.join(format!("{kind}--{org}--{name}"))
}

/// The snapshot folder of model `spec` in the cache: `refs/main`'s, else the only one.
fn snapshot_folder(spec: &str, cache: Option<&Path>) -> Result<Option<PathBuf>> {
    let (Some((org, name)), Some(cache)) = (hub_id(spec), cache) else {
        return Ok(None);
    };
    let repo = repo_folder(cache, "models", org, name);
    let snapshots = repo.join("snapshots");
    let Ok(entries) = std::fs::read_dir(&snapshots) else {
        return Ok(None);
    };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    found.sort();
    let main = std::fs::read_to_string(repo.join("refs").join("main"))
        .ok()
        .map(|r| snapshots.join(r.trim()))
        .filter(|p| found.contains(p));
    match (main, found.as_slice()) {
        (Some(p), _) => Ok(Some(p)),
        (None, [one]) => Ok(Some(one.clone())),
        (None, []) => Ok(None),
        (None, many) => bail!(
            "{spec}: the Hugging Face cache holds {} snapshots of it under {} and no refs/main \
             to choose one; name the folder of the one to load",
            many.len(),
            snapshots.display()
        ),
    }
}

/// For a dataset setting shaped like a Hub id that is no file: where the cache keeps that
/// dataset's files, if it does, and the pattern naming one split's shards; else how to download
/// it. `None` when `spec` is not shaped like an id.
pub fn dataset_hint(spec: &str, cache: Option<&Path>) -> Option<String> {
    let (org, name) = hub_id(spec)?;
    let dir = cache.map(|c| repo_folder(c, "datasets", org, name).join("snapshots"));
    let mut found = Vec::new();
    if let Some(dir) = dir.as_deref().filter(|d| d.is_dir()) {
        collect_dataset_files(dir, dir, 4, &mut found);
    }
    found.sort();
    // The example pattern names a training split where there is one (sorted by name, `test`
    // comes before `train`).
    let is_train = |f: &&PathBuf| {
        f.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("train"))
    };
    let Some(first) = found.iter().find(is_train).or(found.first()) else {
        return Some(format!(
            "lorafit reads local files and does not download datasets; download {spec} first \
             (for example `huggingface-cli download {spec} --repo-type dataset --local-dir \
             {name}`) and name one split's files, as `{name}/data/train-*.parquet`"
        ));
    };
    let dir = dir.expect("files were found under it");
    let shown: Vec<String> = found
        .iter()
        .take(8)
        .map(|f| f.display().to_string())
        .collect();
    let more = found.len().saturating_sub(8);
    // The first file's shard pattern: its name up to the shard number (`train-00000-of-00002`).
    let file_name = first.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let pattern = match file_name.split_once("-0") {
        Some((split, _)) => first.with_file_name(format!("{split}-*")),
        None => first.clone(),
    };
    Some(format!(
        "lorafit reads local files and does not download datasets; the Hugging Face cache holds \
         {spec}'s files under {}: {}{}. Name one split's files, as --data '{}/{}'",
        dir.display(),
        shown.join(", "),
        if more > 0 {
            format!(" and {more} more")
        } else {
            String::new()
        },
        dir.display(),
        pattern.display()
    ))
}

/// Dataset files below `dir` (at most `depth` folders down), relative to `root`.
fn collect_dataset_files(root: &Path, dir: &Path, depth: usize, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.filter_map(|e| e.ok()) {
        let path = e.path();
        if path.is_dir() {
            if depth > 0 {
                collect_dataset_files(root, &path, depth - 1, out);
            }
        } else if crate::data::rows::is_dataset_name(&e.file_name().to_string_lossy()) {
            if let Ok(rel) = path.strip_prefix(root) {
                out.push(rel.to_path_buf());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lorafit-hub-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn touch(p: &Path) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"").unwrap();
    }

    #[test]
    fn a_model_id_resolves_to_its_cached_snapshot() {
        let cache = tmp("model");
        let repo = cache.join("models--HuggingFaceTB--SmolLM2-135M-Instruct");
        touch(&repo.join("snapshots/aaa/config.json"));
        assert_eq!(
            model_snapshot("HuggingFaceTB/SmolLM2-135M-Instruct", Some(&cache)).unwrap(),
            Some(repo.join("snapshots/aaa"))
        );
        // Two snapshots: refs/main chooses; without it, the user does.
        touch(&repo.join("snapshots/bbb/config.json"));
        let e = model_snapshot("HuggingFaceTB/SmolLM2-135M-Instruct", Some(&cache)).unwrap_err();
        assert!(e.to_string().contains("holds 2 snapshots"), "{e}");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "bbb\n").unwrap();
        assert_eq!(
            model_snapshot("HuggingFaceTB/SmolLM2-135M-Instruct", Some(&cache)).unwrap(),
            Some(repo.join("snapshots/bbb"))
        );
        // A snapshot of GGUF files: its one file, or the user names one of several.
        let gguf = cache.join("models--org--m-GGUF/snapshots/ccc");
        touch(&gguf.join("m.Q4_0.gguf"));
        assert_eq!(
            model_snapshot("org/m-GGUF", Some(&cache)).unwrap(),
            Some(gguf.join("m.Q4_0.gguf"))
        );
        touch(&gguf.join("m.Q8_0.gguf"));
        let e = model_snapshot("org/m-GGUF", Some(&cache)).unwrap_err();
        assert!(
            e.to_string().contains("holds 2 GGUF files; name one"),
            "{e}"
        );
        // Not cached, or not an id: nothing to say.
        assert_eq!(model_snapshot("org/other", Some(&cache)).unwrap(), None);
        for spec in ["model.gguf", "a/b/c", "./x", "../x", "a b/c"] {
            assert_eq!(model_snapshot(spec, Some(&cache)).unwrap(), None, "{spec}");
        }
    }

    #[test]
    fn a_dataset_id_is_answered_with_the_cache_files() {
        let cache = tmp("data");
        let root = cache.join("datasets--HuggingFaceH4--ultrafeedback_binarized/snapshots");
        for n in [
            "train_prefs-00000-of-00001.parquet",
            "test_prefs-00000-of-00001.parquet",
            "README.md",
        ] {
            touch(&root.join("abc/data").join(n));
        }
        let hint = dataset_hint("HuggingFaceH4/ultrafeedback_binarized", Some(&cache)).unwrap();
        assert!(
            hint.contains(&format!(
                "under {}: abc/data/test_prefs-00000-of-00001.parquet, \
                 abc/data/train_prefs-00000-of-00001.parquet. Name one split's files, as \
                 --data '{}/abc/data/train_prefs-*'",
                root.display(),
                root.display()
            )),
            "{hint}"
        );
        // Not in the cache: how to download it.
        let hint = dataset_hint("org/other", Some(&cache)).unwrap();
        assert!(
            hint.contains("huggingface-cli download org/other"),
            "{hint}"
        );
        // Not shaped like an id: no hint.
        for spec in ["train.jsonl", "a/b/c.jsonl", "/abs/x", "a b/c", "./x"] {
            assert_eq!(dataset_hint(spec, Some(&cache)), None, "{spec}");
        }
    }
}
