//! `lorafit export`: what a trained adapter becomes outside lorafit.
//!
//! * a merged Hugging Face folder (`hf`): base + adapter merged into bf16 safetensors, with
//!   config and tokenizer files, from a Hugging Face or a GGUF base;
//! * a GGUF LoRA adapter in llama.cpp's format (`gguf_out::write_adapter`);
//! * for a GGUF base, a merged GGUF (`gguf_out::write_merged_gguf`): the adapted tensors
//!   dequantized, merged and requantized to their type, or written as f16;
//! * `--check` (`check`): each artefact read back through lorafit's loaders, its logits on a
//!   fixed prompt set against the trainer's own, within a bound derived from its storage type.
//!
//! The merge maths live in `merge`, the GGUF container in `gguf_writer`, the ggml encoders in
//! `quantize`. Everything runs on the CPU reference backend in f32.
//!
//! An output folder holds one export: `run` deletes an earlier export's artefacts
//! (`ARTEFACTS`) before writing, so that none is left beside the new ones (a `check.json`
//! reporting another adapter); `refuse_earlier_export` is the question to ask first where they
//! must not be deleted unasked (`lorafit export` without `--overwrite`).

pub mod check;
pub mod gguf_out;
pub mod gguf_writer;
pub mod hf;
pub mod merge;
pub mod quantize;

use crate::data::TextTokenizer;
use crate::model::gguf::{GgmlType, GgufFile};
use crate::model::{self, Lora, Model};
use crate::tensor::Device;
use anyhow::{ensure, Context, Result};
use check::CheckRow;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// An artefact `lorafit export` can write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// Merged Hugging Face folder (`OUTPUT/merged-hf/`).
    #[value(alias = "merged")]
    Hf,
    /// llama.cpp LoRA adapter (`OUTPUT/adapter.gguf`).
    GgufAdapter,
    /// Merged GGUF of a GGUF base (`OUTPUT/merged.gguf`).
    #[value(alias = "gguf-merged")]
    MergedGguf,
}

impl Format {
    /// The name `--format` takes.
    pub fn name(self) -> &'static str {
        match self {
            Format::Hf => "hf",
            Format::GgufAdapter => "gguf-adapter",
            Format::MergedGguf => "merged-gguf",
        }
    }
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A resolved export request: the flags of `lorafit export`, and the settings of an `export`
/// job of `lorafit serve`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExportPlan {
    pub model: PathBuf,
    pub adapter: PathBuf,
    pub output: PathBuf,
    /// Empty: the merged folder and the GGUF adapter, plus the merged GGUF for a GGUF base.
    pub formats: Vec<Format>,
    pub hf_dtype: hf::HfDtype,
    pub adapter_type: gguf_out::AdapterType,
    pub merged_type: gguf_out::MergedType,
    pub check: bool,
    /// A Jinja chat template file (or a tokenizer_config.json): the training run's
    /// `chat_template`, written into the merged folder's `tokenizer_config.json` and the merged
    /// GGUF's `tokenizer.chat_template` in place of the base's.
    #[serde(default)]
    pub chat_template: Option<String>,
}

/// Where each artefact went, and the check's rows when asked for.
pub struct ExportReport {
    pub written: Vec<(Format, PathBuf)>,
    pub checks: Vec<CheckRow>,
    /// What the export could write but the user should know (also printed on stderr), such as
    /// a merged GGUF whose requantization erased the adapter's deltas.
    pub warnings: Vec<String>,
}

impl ExportReport {
    /// What the terminal shows: each artefact's path, then the check's table.
    pub fn text(&self, plan: &ExportPlan) -> String {
        let mut out = String::new();
        for (f, path) in &self.written {
            out.push_str(&format!("{f}: {}\n", path.display()));
        }
        if plan.check {
            out.push_str(&check::format_rows(&self.checks));
        }
        out
    }

    /// An error naming every artefact outside its bound (none checked: Ok).
    pub fn check_passed(&self) -> Result<()> {
        let failed: Vec<&str> = self
            .checks
            .iter()
            .filter(|r| !r.passed())
            .map(|r| r.artefact.as_str())
            .collect();
        ensure!(
            failed.is_empty(),
            "export check: outside the bound: {}",
            failed.join(", ")
        );
        Ok(())
    }
}

/// Progress of an export: `done` of `total` steps (each artefact written, each one checked).
#[derive(Debug, Clone)]
pub struct ExportProgress {
    pub done: usize,
    pub total: usize,
    /// What was just finished, e.g. `wrote OUTPUT/adapter.gguf`.
    pub what: String,
}

impl ExportPlan {
    /// The artefacts to write: the ones asked for, or the defaults for the base; an error for
    /// one the base cannot give.
    pub fn resolved_formats(&self) -> Result<Vec<Format>> {
        let base_is_gguf = is_gguf(&self.model);
        let mut formats = self.formats.clone();
        if formats.is_empty() {
            formats = vec![Format::Hf, Format::GgufAdapter];
            if base_is_gguf {
                formats.push(Format::MergedGguf);
            }
        }
        formats.dedup();
        ensure!(
            base_is_gguf || !formats.contains(&Format::MergedGguf),
            "--format merged-gguf needs a GGUF base; {} is a Hugging Face folder (its merged \
             model is --format hf)",
            self.model.display()
        );
        Ok(formats)
    }

    /// How many steps [`run_with`] reports: each artefact written and, with `check`, each one
    /// checked.
    pub fn total_steps(&self) -> Result<usize> {
        Ok(self.resolved_formats()?.len() * if self.check { 2 } else { 1 })
    }
}

/// Every name `run` writes into its output folder: the artefacts, the check's files, and the
/// temporaries a GGUF is written through (left behind by a killed export).
pub const ARTEFACTS: [&str; 7] = [
    "merged-hf",
    "adapter.gguf",
    "merged.gguf",
    "check.json",
    "check.safetensors",
    "adapter.gguf.tmp",
    "merged.gguf.tmp",
];

/// The entries of `output` that an export writes (none where the folder does not exist).
pub fn earlier_artefacts(output: &Path) -> Vec<PathBuf> {
    ARTEFACTS
        .iter()
        .map(|name| output.join(name))
        // symlink_metadata: a dangling link is an entry too.
        .filter(|path| path.symlink_metadata().is_ok())
        .collect()
}

/// The file names of `earlier_artefacts`.
pub fn earlier_artefact_names(output: &Path) -> Vec<String> {
    earlier_artefacts(output)
        .iter()
        .filter_map(|p| p.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .collect()
}

/// An error naming the artefacts of an earlier export in `output`, where it holds any: an
/// export beside them would leave those it does not write mixed with its own.
pub fn refuse_earlier_export(output: &Path) -> Result<()> {
    let names = earlier_artefact_names(output);
    if names.is_empty() {
        return Ok(());
    }
    anyhow::bail!(
        "output {} already holds an export ({}); pass --overwrite to delete those and export \
         again, or name another folder",
        output.display(),
        names.join(", ")
    )
}

/// An error where the base model or the adapter lies in (or is) an artefact path of `output`:
/// `--overwrite` would delete it, or the export would write over it. Asked before anything is
/// deleted or written.
pub fn refuse_inputs_in_artefacts(plan: &ExportPlan) -> Result<()> {
    let inputs = [
        ("--model", "the base model", &plan.model),
        ("--adapter", "the adapter", &plan.adapter),
    ];
    for name in ARTEFACTS {
        let artefact = plan.output.join(name);
        for (flag, what, input) in inputs {
            if path_within(input, &artefact) {
                anyhow::bail!(
                    "{flag} {} lies in {}, which this export deletes and writes again: {what} \
                     would be lost; move it out of --output {} or name another output folder",
                    input.display(),
                    artefact.display(),
                    plan.output.display()
                );
            }
        }
    }
    Ok(())
}

/// Whether `inner` is `outer` or lies inside it, by their paths as given (made absolute,
/// `.` and `..` removed) and by the files they resolve to (links followed).
fn path_within(inner: &Path, outer: &Path) -> bool {
    let lexical = |p: &Path| -> Option<PathBuf> {
        let abs = std::path::absolute(p).ok()?;
        let mut out = PathBuf::new();
        for c in abs.components() {
            match c {
                std::path::Component::CurDir => {}
                std::path::Component::ParentDir => {
                    out.pop();
                }
                other => out.push(other),
            }
        }
        Some(out)
    };
    if let (Some(i), Some(o)) = (lexical(inner), lexical(outer)) {
        if i.starts_with(&o) {
            return true;
        }
    }
    // A link named like an artefact is deleted as a link, leaving what it points to: only a
    // real entry's resolved path counts.
    let is_link = outer
        .symlink_metadata()
        .is_ok_and(|m| m.file_type().is_symlink());
    match (inner.canonicalize(), outer.canonicalize()) {
        (Ok(i), Ok(o)) if !is_link => i.starts_with(o),
        _ => false,
    }
}

/// Deletes the artefacts of an earlier export in `output` (`ARTEFACTS`, nothing else).
fn remove_earlier_artefacts(output: &Path) -> Result<()> {
    for path in earlier_artefacts(output) {
        let is_dir = path.symlink_metadata().is_ok_and(|m| m.is_dir());
        let removed = if is_dir {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        removed.with_context(|| format!("removing the earlier {}", path.display()))?;
    }
    Ok(())
}

fn is_gguf(path: &Path) -> bool {
    path.is_file() && path.extension().is_some_and(|e| e == "gguf")
}

/// The tokenizer of a model folder or GGUF file, when it has one (the check's text prompts).
fn load_tokenizer(path: &Path) -> Result<Option<TextTokenizer>> {
    if path.is_dir() {
        let file = path.join("tokenizer.json");
        if !file.is_file() {
            return Ok(None);
        }
        return TextTokenizer::from_file(file).map(Some);
    }
    let g = GgufFile::open(path)?;
    if g.get("tokenizer.ggml.model").is_none() {
        return Ok(None);
    }
    let (tok, info) = crate::data::gguf_tokenizer::load_gguf_tokenizer(&g)?;
    TextTokenizer::new(tok, info.bos_id, info.eos_id, info.add_bos).map(Some)
}

fn hf_ggml(d: hf::HfDtype) -> GgmlType {
    match d {
        hf::HfDtype::Bf16 => GgmlType::BF16,
        hf::HfDtype::F16 => GgmlType::F16,
        hf::HfDtype::F32 => GgmlType::F32,
    }
}

/// Writes the requested artefacts and, with `check`, compares each against the trainer. An
/// earlier export's artefacts in the output folder are deleted first, once the base and the
/// adapter have loaded (`refuse_earlier_export` asks before).
pub fn run(plan: &ExportPlan) -> Result<ExportReport> {
    run_with(plan, &mut |_| Ok(()))
}

/// [`run`], calling `progress` after each artefact written and each one checked (an error from
/// it, such as a stop request, ends the export). Deleting the earlier artefacts is what lets a
/// stopped export run again into its own folder from the start.
pub fn run_with(
    plan: &ExportPlan,
    progress: &mut dyn FnMut(&ExportProgress) -> Result<()>,
) -> Result<ExportReport> {
    let device = Device::Cpu;
    refuse_inputs_in_artefacts(plan)?;
    let base_is_gguf = is_gguf(&plan.model);
    let formats = plan.resolved_formats()?;
    let total = plan.total_steps()?;
    let mut done = 0;
    let mut step = |what: String| {
        done += 1;
        progress(&ExportProgress { done, total, what })
    };
    // Read (and compiled) before anything is written, so that a bad file stops the export.
    let template = match &plan.chat_template {
        Some(t) => Some(
            crate::data::ChatTemplate::from_file(t, "", "")
                .with_context(|| format!("chat_template = {t:?}"))?
                .source()
                .to_string(),
        ),
        None => None,
    };
    let base = model::load(&plan.model, &device)
        .map_err(|e| crate::data::model_files::explain_model_error(&plan.model, e))?;
    let lora = Lora::load_peft(&plan.adapter, &base.spec, &device)
        .with_context(|| format!("adapter {}", plan.adapter.display()))?;
    let (arch, permutes) = if base_is_gguf {
        let src = model::gguf_model::GgufSource::open(&plan.model)?;
        // As for a Hugging Face Gemma 4 base (gguf_out::llama_cpp_arch).
        ensure!(
            !(formats.contains(&Format::GgufAdapter)
                && src.arch == model::gguf_model::GgufArch::Gemma4),
            "a GGUF adapter for the gemma4 base {} is not written: its llama.cpp layout is not \
             checked here (--format merged-gguf writes the merged GGUF)",
            plan.model.display()
        );
        (src.arch.name(), src.arch.permutes_qk())
    } else if formats.contains(&Format::GgufAdapter) {
        gguf_out::llama_cpp_arch(&base.spec)?
    } else {
        // Only the GGUF adapter needs llama.cpp's architecture.
        ("", false)
    };
    let mut warnings = preflight(plan, &formats)?;
    // The check's prompts and the trainer's logits: a tokenizer that does not load stops the
    // export here, not after the artefacts are written.
    let reference = if plan.check {
        let tok = load_tokenizer(&plan.model)?;
        let prompts = check::check_prompts(tok.as_ref(), base.spec.vocab)?;
        let want = check::logits(&base, Some(&lora), &prompts)?;
        let plain = check::logits(&base, None, &prompts)?;
        Some((prompts, want, plain))
    } else {
        None
    };
    // Everything that can refuse the export has; what an earlier one wrote goes now, once the
    // folder is known to take new files (a folder that refuses them would be left half
    // emptied).
    crate::atomic_file::check_writable(&plan.output.join(".lorafit-write-check"), "--output")?;
    remove_earlier_artefacts(&plan.output)?;

    let mut written = Vec::new();
    let mut stored = Vec::new();
    for &f in &formats {
        match f {
            Format::Hf => {
                let dir = plan.output.join("merged-hf");
                let s = if base_is_gguf {
                    hf::merged_from_gguf(&plan.model, &lora, &dir, plan.hf_dtype)?
                } else {
                    hf::merged_from_hf(&plan.model, &base.spec, &lora, &dir, plan.hf_dtype)?
                };
                if let Some(t) = &template {
                    hf::set_chat_template(&dir, t)?;
                }
                eprintln!(
                    "merged folder {}: {} tensors, {} with the adapter merged, {}",
                    dir.display(),
                    s.tensors,
                    s.merged.len(),
                    plan.hf_dtype.torch_name()
                );
                stored.push((hf_ggml(plan.hf_dtype), s.tensors));
                step(format!("wrote {}", dir.display()))?;
                written.push((f, dir));
            }
            Format::GgufAdapter => {
                let path = plan.output.join("adapter.gguf");
                let n = gguf_out::write_adapter(
                    &lora,
                    &base.spec,
                    arch,
                    permutes,
                    plan.adapter_type,
                    &path,
                )?;
                eprintln!(
                    "GGUF adapter {}: {n} LoRA pairs for architecture {arch}{}",
                    path.display(),
                    if permutes {
                        " (q/k rows in llama.cpp's order)"
                    } else {
                        ""
                    }
                );
                let ty = match plan.adapter_type {
                    gguf_out::AdapterType::F32 => GgmlType::F32,
                    gguf_out::AdapterType::F16 => GgmlType::F16,
                };
                stored.push((ty, 2 * n));
                step(format!("wrote {}", path.display()))?;
                written.push((f, path));
            }
            Format::MergedGguf => {
                let path = plan.output.join("merged.gguf");
                let s = gguf_out::write_merged_gguf(
                    &plan.model,
                    &lora,
                    plan.merged_type,
                    template.as_deref(),
                    &path,
                )?;
                let coarsest = s
                    .merged
                    .iter()
                    .map(|m| m.1)
                    .max_by(|a, b| check::unit_error(*a).total_cmp(&check::unit_error(*b)))
                    .unwrap_or(GgmlType::F32);
                let worst = s.merged.iter().map(|m| m.2).fold(0f64, f64::max);
                eprintln!(
                    "merged GGUF {}: {} tensors, {} merged, {} of them changed by the merge \
                     (coarsest {coarsest}, largest relative RMS encoding error {worst:.3e})",
                    path.display(),
                    s.tensors,
                    s.merged.len(),
                    s.changed
                );
                if let Some(w) = lost_deltas_warning(&path, s.merged.len(), s.changed, coarsest) {
                    eprintln!("warning: {w}");
                    warnings.push(w);
                }
                stored.push((coarsest, s.merged.len()));
                step(format!("wrote {}", path.display()))?;
                written.push((f, path));
            }
        }
    }

    let mut checks = Vec::new();
    if let Some((prompts, want, plain)) = &reference {
        check::write_reference(
            &plan.output.join("check.safetensors"),
            prompts,
            want,
            base.spec.vocab,
        )?;
        for ((f, path), &(ty, rounded)) in written.iter().zip(&stored) {
            let got = artefact_logits(*f, path, &base, permutes, prompts)?;
            let row = check::compare(
                &path.display().to_string(),
                ty,
                rounded,
                want,
                &got,
                plain,
                base.spec.vocab,
            );
            step(format!(
                "checked {}: {}",
                path.display(),
                if row.passed() {
                    "within its bound"
                } else {
                    "OUTSIDE its bound"
                }
            ))?;
            checks.push(row);
        }
    }
    if plan.check {
        let rows: Vec<serde_json::Value> = checks.iter().map(check::row_json).collect();
        std::fs::write(
            plan.output.join("check.json"),
            serde_json::to_string_pretty(&rows)?,
        )?;
    }
    Ok(ExportReport {
        written,
        checks,
        warnings,
    })
}

/// What would otherwise fail once some artefact is written, asked before anything is: the files
/// the merged folder takes from the base (a GGUF's embedded tokenizer, a tokenizer_config.json
/// the run's template goes into). Returns the warnings for what the export writes all the same
/// (a tokenizer.json lorafit cannot read, copied as it is).
fn preflight(plan: &ExportPlan, formats: &[Format]) -> Result<Vec<String>> {
    let mut warnings = Vec::new();
    let base_is_gguf = is_gguf(&plan.model);
    if formats.contains(&Format::Hf) && base_is_gguf {
        hf::gguf_tokenizer_files(&model::gguf_model::GgufSource::open(&plan.model)?)?;
    }
    if formats.contains(&Format::Hf) && !base_is_gguf {
        let config = plan.model.join("tokenizer_config.json");
        if plan.chat_template.is_some() && config.is_file() {
            let text = std::fs::read_to_string(&config)
                .with_context(|| format!("reading {}", config.display()))?;
            let value: serde_json::Value = serde_json::from_str(&text).with_context(|| {
                format!(
                    "{}: not valid JSON, so the run's chat template cannot be written into the \
                     merged folder's copy",
                    config.display()
                )
            })?;
            ensure!(
                value.is_object(),
                "{}: not a JSON object, so the run's chat template cannot be written into the \
                 merged folder's copy",
                config.display()
            );
        }
        // Without --check the tokenizer is only copied; one that does not load is said.
        if !plan.check {
            if let Err(e) = load_tokenizer(&plan.model) {
                let w = format!("{e:#}; the merged folder gets a copy of it as it is");
                eprintln!("warning: {w}");
                warnings.push(w);
            }
        }
    }
    Ok(warnings)
}

/// The warning for a merged GGUF where requantizing gave some adapted tensors back their base
/// bytes: the adapter's deltas there were below the type's step, so the file carries less of
/// the adapter (none, where no tensor changed) than the export was asked for.
fn lost_deltas_warning(
    path: &Path,
    merged: usize,
    changed: usize,
    coarsest: GgmlType,
) -> Option<String> {
    if changed == merged {
        return None;
    }
    let fix = if coarsest == GgmlType::F16 {
        "the adapter's deltas are below f16's precision there".to_string()
    } else {
        format!(
            "the adapter's deltas are below the {coarsest} step; use --merged-type f16 to keep them"
        )
    };
    Some(if changed == 0 {
        format!(
            "{}: 0 of {merged} adapted tensors changed by the merge, the file is the base's \
             weights: {fix}",
            path.display()
        )
    } else {
        format!(
            "{}: only {changed} of {merged} adapted tensors changed by the merge, the others \
             kept their base bytes: {fix}",
            path.display()
        )
    })
}

/// An artefact's logits on `prompts`, read back through lorafit's loaders.
fn artefact_logits(
    f: Format,
    path: &Path,
    base: &Model,
    permutes: bool,
    prompts: &[Vec<u32>],
) -> Result<Vec<f32>> {
    match f {
        Format::Hf | Format::MergedGguf => {
            let merged = model::load(path, &Device::Cpu)?;
            ensure!(
                merged.spec.vocab == base.spec.vocab && merged.spec.n_layers == base.spec.n_layers,
                "{}: read back with a different geometry than the base",
                path.display()
            );
            check::logits(&merged, None, prompts)
        }
        Format::GgufAdapter => {
            let lora = gguf_out::read_adapter(path, &base.spec, permutes)?;
            check::logits(base, Some(&lora), prompts)
        }
    }
}
