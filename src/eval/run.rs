//! One `lorafit eval` run as a library call: [`EvalOptions`] (the command's flags, and the
//! settings of an `eval` job of `lorafit serve`) in, an [`EvalOutcome`] out. The command line and
//! the job worker both call [`run`]; neither holds a second copy of the scoring sequence.
//!
//! With `out` the run writes every example's scores as JSON; with `report` a markdown report,
//! and for a before/after comparison (`compare`) a PNG bar chart beside it (the report's path
//! with the extension `.png`, drawn by [`super::report::preference_chart`] or
//! [`super::report::ifeval_chart`]).

use super::{preference, prompts, report};
use crate::config::{Method, TrainConfig};
use crate::model::Lora;
use crate::plot::Canvas;
use crate::tensor::Device;
use crate::train::trainer;
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// What scores the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Scorer {
    /// Preference pairs through the training objective.
    Preference,
    /// Generate a reply per prompt and check its verifiable instructions.
    Ifeval,
}

/// The settings of one evaluation (the flags of `lorafit eval`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EvalOptions {
    /// A Hugging Face folder, a GGUF file or "smollm2" (None: the config's model, else smollm2).
    pub model: Option<String>,
    /// Encode the base's projections on load (None: the config's `base_quant`, else none).
    #[serde(default)]
    pub base_quant: Option<crate::model::BaseQuant>,
    /// A PEFT adapter folder scored with the model.
    pub adapter: Option<PathBuf>,
    /// Before/after: two subjects, each `base` or an adapter folder (empty: one run).
    pub compare: Vec<String>,
    /// Preference pairs (any dataset file `data::rows` reads), or for the ifeval scorer a prompt
    /// file (None there: the bundled prompts).
    pub data: Option<String>,
    pub scorer: Scorer,
    pub device: Option<String>,
    /// A TOML config (e.g. a run's plan.toml): the objective, its settings and length limits.
    pub config: Option<PathBuf>,
    pub method: Option<Method>,
    /// A Jinja chat template file (or a tokenizer_config.json) instead of the config's or the
    /// model's.
    #[serde(default)]
    pub chat_template: Option<String>,
    /// Most new tokens per reply (ifeval).
    pub max_new: usize,
    /// Score only the first N pairs or prompts (0: all).
    pub limit: usize,
    /// Where every example's scores go as JSON.
    pub out: Option<PathBuf>,
    /// Where the markdown report goes (a comparison's chart beside it as `.png`).
    pub report: Option<PathBuf>,
}

impl Default for EvalOptions {
    fn default() -> EvalOptions {
        EvalOptions {
            model: None,
            base_quant: None,
            adapter: None,
            compare: vec![],
            data: None,
            scorer: Scorer::Preference,
            device: None,
            config: None,
            chat_template: None,
            method: None,
            max_new: 256,
            limit: 0,
            out: None,
            report: None,
        }
    }
}

/// A setting that cannot work, named as the job API and the settings struct name it.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldError {
    pub field: &'static str,
    pub message: String,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

impl std::error::Error for FieldError {}

fn field_error(field: &'static str, message: impl Into<String>) -> FieldError {
    FieldError {
        field,
        message: message.into(),
    }
}

impl EvalOptions {
    /// Checks what can be checked without loading anything.
    pub fn validate(&self) -> Result<(), FieldError> {
        if !self.compare.is_empty() && self.compare.len() != 2 {
            return Err(field_error(
                "compare",
                format!(
                    "two subjects (BEFORE AFTER, each `base` or an adapter folder), not {}",
                    self.compare.len()
                ),
            ));
        }
        if self.adapter.is_some() && !self.compare.is_empty() {
            return Err(field_error(
                "adapter",
                "give an adapter or a comparison (compare), not both",
            ));
        }
        if self.scorer == Scorer::Preference && self.data.is_none() {
            return Err(field_error(
                "data",
                "the preference scorer needs the preference pairs to score (--data)",
            ));
        }
        if self.scorer == Scorer::Ifeval && self.max_new == 0 {
            return Err(field_error("max_new", "must be at least 1"));
        }
        if self.scorer == Scorer::Preference && self.method == Some(Method::Sft) {
            return Err(field_error(
                "method",
                "preference scoring needs a preference objective (orpo, dpo, simpo), not sft",
            ));
        }
        if let Some(d) = &self.device {
            Device::check(d).map_err(|e| field_error("device", format!("{e:#}")))?;
        }
        Ok(())
    }

    /// The subjects scored, in order: None is the base model.
    pub fn subjects(&self) -> Vec<Option<PathBuf>> {
        let parse = |s: &str| (s != "base").then(|| PathBuf::from(s));
        if !self.compare.is_empty() {
            self.compare.iter().map(|s| parse(s)).collect()
        } else {
            vec![self.adapter.clone()]
        }
    }

    /// The training settings the pairs are scored with: the config file's, then the model,
    /// device and method given here.
    pub fn train_config(&self) -> Result<TrainConfig> {
        let mut cfg = match &self.config {
            // The method given here decides what the file's TRL `beta` is.
            Some(p) => TrainConfig::from_toml_file_for(
                p,
                self.method
                    .and_then(|m| toml::Value::try_from(m).ok())
                    .as_ref()
                    .and_then(|v| v.as_str()),
            )?,
            None => TrainConfig {
                model: "smollm2".into(),
                ..TrainConfig::default()
            },
        };
        if let Some(m) = &self.model {
            cfg.model = m.clone();
        }
        if let Some(d) = &self.device {
            cfg.device = d.clone();
        }
        if let Some(q) = self.base_quant {
            cfg.base_quant = q;
        }
        if let Some(m) = self.method {
            cfg.method = m;
        }
        if let Some(t) = &self.chat_template {
            cfg.chat_template = Some(t.clone());
        }
        Ok(cfg)
    }
}

/// Progress of a run: `done` of `total` examples over all subjects, `subject` the one scoring.
#[derive(Debug, Clone)]
pub struct EvalProgress<'a> {
    pub subject: &'a str,
    pub done: usize,
    pub total: usize,
}

/// What a run produced.
#[derive(Debug, Clone)]
pub struct EvalOutcome {
    /// What the terminal shows: the tables (and, for ifeval, each run's markdown).
    pub text: String,
    /// Every example's scores (what `out` receives).
    pub json: serde_json::Value,
    /// The markdown report (what `report` receives).
    pub markdown: String,
    /// The before/after chart of a comparison.
    pub chart: Option<Canvas>,
    /// One line: the headline numbers.
    pub summary: String,
}

/// Width and height of the before/after chart, in pixels.
pub const CHART_SIZE: (usize, usize) = (960, 480);

/// The chart's file for a report file: the same path with the extension `.png`.
pub fn chart_path(report: &Path) -> PathBuf {
    report.with_extension("png")
}

fn subject_name(p: &Option<PathBuf>) -> String {
    p.as_ref()
        .map_or("base".to_string(), |p| p.display().to_string())
}

fn write_output(path: &Option<PathBuf>, text: &str) -> Result<()> {
    if let Some(p) = path {
        std::fs::write(p, text).with_context(|| format!("writing {}", p.display()))?;
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

/// Scores the model as `opts` says, calling `progress` after every example (an error from it,
/// such as a stop request, ends the run), and writes `out`, `report` and the chart.
pub fn run(
    opts: &EvalOptions,
    progress: &mut dyn FnMut(&EvalProgress<'_>) -> Result<()>,
) -> Result<EvalOutcome> {
    opts.validate()?;
    refuse_clashing_paths(opts)?;
    // Where the results go is checked before the scoring, not after it.
    if let Some(p) = &opts.out {
        crate::atomic_file::check_writable(p, "--out")?;
    }
    if let Some(p) = &opts.report {
        crate::atomic_file::check_writable(p, "--report")?;
        if !opts.compare.is_empty() {
            crate::atomic_file::check_writable(&chart_path(p), "the report's chart")?;
        }
    }
    let cfg = opts.train_config()?;
    let device = Device::parse(&cfg.device)?;
    let loaded = trainer::load_configured(&cfg, &device)?;
    let mut adapters = Vec::new();
    for s in opts.subjects() {
        let lora = match &s {
            Some(p) => Some(
                Lora::load_peft(p, &loaded.model.spec, &device)
                    .with_context(|| format!("loading the adapter {}", p.display()))?,
            ),
            None => None,
        };
        adapters.push((subject_name(&s), lora));
    }
    let take = |n: usize| if opts.limit > 0 { opts.limit.min(n) } else { n };
    let subjects = adapters.len();
    let outcome = match opts.scorer {
        Scorer::Preference => {
            let data = opts.data.as_deref().context("data: the preference pairs")?;
            let pairs = preference::load_pairs(data, &loaded, &cfg)?;
            let n = take(pairs.len());
            let mut runs = Vec::new();
            for (i, (name, lora)) in adapters.iter_mut().enumerate() {
                let mut tick = |done: usize| {
                    progress(&EvalProgress {
                        subject: name,
                        done: i * n + done,
                        total: subjects * n,
                    })
                };
                runs.push(preference::score_pairs_with(
                    &loaded.model,
                    lora.as_mut(),
                    &pairs[..n],
                    &cfg,
                    name,
                    &mut tick,
                )?);
            }
            preference_outcome(runs)?
        }
        Scorer::Ifeval => {
            let prompts = match &opts.data {
                Some(p) => prompts::load_prompts(Path::new(p))?,
                None => prompts::parse_prompts(prompts::BUNDLED, prompts::BUNDLED_NAME)?,
            };
            let prompts = &prompts[..take(prompts.len())];
            let n = prompts.len();
            let mut runs = Vec::new();
            for (i, (name, lora)) in adapters.iter().enumerate() {
                let mut tick = |done: usize| {
                    progress(&EvalProgress {
                        subject: name,
                        done: i * n + done,
                        total: subjects * n,
                    })
                };
                runs.push(super::run_ifeval_with(
                    &loaded,
                    lora.as_ref(),
                    prompts,
                    opts.max_new,
                    name,
                    &mut tick,
                )?);
            }
            ifeval_outcome(runs)?
        }
    };
    write_output(&opts.out, &serde_json::to_string_pretty(&outcome.json)?)?;
    write_output(&opts.report, &outcome.markdown)?;
    if let (Some(report), Some(chart)) = (&opts.report, &outcome.chart) {
        let path = chart_path(report);
        crate::plot::write_png(&path, chart)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(outcome)
}

/// The files a run reads that an output could name: the data (each shard), the config, the
/// chat template, the model file and the adapters' files.
fn input_files(opts: &EvalOptions) -> Vec<(String, PathBuf)> {
    let mut inputs = Vec::new();
    if let Some(d) = &opts.data {
        let files = crate::data::rows::dataset_files(d).unwrap_or_else(|_| vec![PathBuf::from(d)]);
        inputs.extend(files.into_iter().map(|f| ("--data".to_string(), f)));
    }
    for (flag, p) in [
        ("--config", &opts.config),
        ("--model", &opts.model.as_ref().map(PathBuf::from)),
    ] {
        if let Some(p) = p {
            inputs.push((flag.to_string(), p.clone()));
        }
    }
    if let Some(t) = &opts.chat_template {
        inputs.push(("--chat-template".to_string(), PathBuf::from(t)));
    }
    for dir in opts.subjects().into_iter().flatten() {
        for name in ["adapter_config.json", "adapter_model.safetensors"] {
            inputs.push((format!("the adapter {}", dir.display()), dir.join(name)));
        }
    }
    inputs
}

/// `out`, `report` and a comparison's chart are three files, none of them an input.
fn refuse_clashing_paths(opts: &EvalOptions) -> Result<()> {
    let mut outputs = Vec::new();
    if let Some(p) = &opts.out {
        outputs.push(("--out".to_string(), p.clone()));
    }
    if let Some(p) = &opts.report {
        outputs.push(("--report".to_string(), p.clone()));
        if !opts.compare.is_empty() {
            outputs.push((
                "the report's chart (--report with .png)".to_string(),
                chart_path(p),
            ));
        }
    }
    super::refuse_clashing_paths(&outputs, &input_files(opts))
}

fn headline(overall: &std::collections::BTreeMap<String, f64>, key: &str) -> String {
    overall
        .get(key)
        .map_or("-".to_string(), |v| format!("{v:.4}"))
}

fn preference_outcome(runs: Vec<preference::PreferenceRun>) -> Result<EvalOutcome> {
    let mut runs = runs.into_iter();
    let first = runs.next().context("nothing to score")?;
    Ok(match runs.next() {
        None => EvalOutcome {
            text: report::preference_table(&first),
            markdown: report::preference_markdown(&first),
            summary: format!(
                "{} pairs, {}: accuracy {}, margin {}",
                first.examples.len(),
                first.subject,
                headline(&first.overall, "accuracy"),
                headline(&first.overall, "margin")
            ),
            json: serde_json::to_value(&first)?,
            chart: None,
        },
        Some(second) => {
            let c = preference::compare(first, second)?;
            EvalOutcome {
                text: report::preference_comparison_table(&c),
                markdown: report::preference_comparison_markdown(&c),
                summary: format!(
                    "{} pairs: accuracy {} -> {}, margin {} -> {}",
                    c.per_example.len(),
                    headline(&c.before.overall, "accuracy"),
                    headline(&c.after.overall, "accuracy"),
                    headline(&c.before.overall, "margin"),
                    headline(&c.after.overall, "margin")
                ),
                chart: Some(report::preference_chart(&c, CHART_SIZE)),
                json: serde_json::to_value(&c)?,
            }
        }
    })
}

fn ifeval_outcome(runs: Vec<super::IfevalRun>) -> Result<EvalOutcome> {
    let mut text = String::new();
    for run in &runs {
        text.push_str(&report::ifeval_markdown(
            &format!("IFEval-style scores: {}", run.subject),
            &run.scores,
        ));
    }
    let pct = |x: f64| format!("{:.1}%", 100.0 * x);
    let (markdown, chart, summary) = match runs.as_slice() {
        [b, f] => {
            let md = report::ifeval_comparison_markdown(
                "Verifiable-instruction following, before and after",
                &b.subject,
                &f.subject,
                &b.scores,
                &f.scores,
            );
            text.push('\n');
            text.push_str(&md);
            let chart =
                report::ifeval_chart(&b.subject, &f.subject, &b.scores, &f.scores, CHART_SIZE);
            let summary = format!(
                "{} prompts: prompt-level strict {} -> {}, loose {} -> {}",
                f.scores.prompts,
                pct(b.scores.prompt_strict),
                pct(f.scores.prompt_strict),
                pct(b.scores.prompt_loose),
                pct(f.scores.prompt_loose)
            );
            (md, Some(chart), summary)
        }
        [one] => (
            report::ifeval_markdown(
                &format!("IFEval-style scores: {}", one.subject),
                &one.scores,
            ),
            None,
            format!(
                "{} prompts, {}: prompt-level strict {}, loose {}",
                one.scores.prompts,
                one.subject,
                pct(one.scores.prompt_strict),
                pct(one.scores.prompt_loose)
            ),
        ),
        _ => (String::new(), None, String::new()),
    };
    Ok(EvalOutcome {
        text,
        json: serde_json::to_value(&runs)?,
        markdown,
        chart,
        summary,
    })
}
