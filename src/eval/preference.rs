//! Preference scoring of a model (with or without an adapter) on held-out pairs: per example and
//! overall accuracy, margin, lw, lr, nll and loss, and before/after comparisons with per-example
//! deltas.
//!
//! The numbers are the trainer's own: the pairs are read and checked by the trainer's loader
//! (`train::trainer::load_items`: the run's tokenization rules, chat template and length limits)
//! and each goes through `train::trainer::score_example`, as validation does, so the overall
//! means here equal the validation metrics a training run logs. This module only keeps the
//! per-example values the trainer averages away.
//!
//! The base model is scored through a fresh LoRA whose B matrices are zero (rank 1 on one
//! projection): its update is exactly zero, so the logits are the base model's.

use crate::config::TrainConfig;
use crate::model::lora::{LoraConfig, Target};
use crate::model::{Lora, Model};
use crate::train::step::Objective;
use crate::train::trainer::{load_items, pass_options, score_example, Item, Loaded};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use std::collections::BTreeMap;

/// The metrics every summary and table shows first, in this order.
pub const HEADLINE: [&str; 6] = ["accuracy", "margin", "lw", "lr", "nll", "loss"];

/// One pair's metrics: the objective's (TRL's names and ours, see `Metrics::pairs`) plus `nll`.
///
/// `nll` is the objective's own NLL term where it has one (ORPO's `nll_loss`, SFT's `nll`);
/// DPO and SimPO have none, and `nll` is then `-lw`, the chosen response's mean NLL per token.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExampleScore {
    /// 0-based position among the scored examples.
    pub index: usize,
    /// The row it was read from (`file:line`, or `file: row N`), when the pairs came from a file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
    pub metrics: BTreeMap<String, f64>,
}

/// Every example's scores and their means.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PreferenceRun {
    /// What was scored: "base" or the adapter's folder.
    pub subject: String,
    pub examples: Vec<ExampleScore>,
    /// Mean of each metric over the examples.
    pub overall: BTreeMap<String, f64>,
}

/// Reads, checks and tokenises the preference pairs at `path` as the trainer reads its data (any
/// dataset format; the run's tokenization rules, template and length limits; ids checked against
/// the model's vocabulary). A bad row is an error naming its file, line and field; nothing is
/// skipped, whatever `skip_bad_rows` says.
pub fn load_pairs(path: &str, loaded: &Loaded, cfg: &TrainConfig) -> Result<Vec<Item>> {
    preference_objective(cfg)?;
    let strict = TrainConfig {
        skip_bad_rows: false,
        ..cfg.clone()
    };
    let items = load_items(path, None, cfg.method, loaded, &strict)?;
    if items.is_empty() {
        bail!("{path}: no preference pairs");
    }
    Ok(items)
}

/// A LoRA that leaves the model unchanged (B = 0), for scoring the base model.
pub fn identity_lora(model: &Model) -> Result<Lora> {
    let config = LoraConfig {
        rank: 1,
        alpha: 1.0,
        targets: vec![Target::Q],
        ..LoraConfig::default()
    };
    Lora::new(&model.spec, config, &model.device)
}

/// Scores every item with `lora` (None: the base model). `subject` names what was scored in the
/// output; each example keeps its row (`Item::at`).
pub fn score_pairs(
    model: &Model,
    lora: Option<&mut Lora>,
    items: &[Item],
    cfg: &TrainConfig,
    subject: &str,
) -> Result<PreferenceRun> {
    score_pairs_with(model, lora, items, cfg, subject, &mut |_| Ok(()))
}

/// [`score_pairs`], calling `tick` with the number of items scored after each one (an error from
/// it ends the run).
pub fn score_pairs_with(
    model: &Model,
    lora: Option<&mut Lora>,
    items: &[Item],
    cfg: &TrainConfig,
    subject: &str,
    tick: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<PreferenceRun> {
    let objective = preference_objective(cfg)?;
    let mut base;
    let lora = match lora {
        Some(l) => l,
        None => {
            base = identity_lora(model)?;
            &mut base
        }
    };
    // The same options as `trainer::evaluate`: no backward, so no memory plan is needed.
    let opts = pass_options(cfg, model, 0, usize::MAX, None);
    let bar = indicatif::ProgressBar::new(items.len() as u64);
    let mut examples = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let mut metrics: BTreeMap<String, f64> =
            score_example(model, lora, item, &objective, cfg, &opts)
                .with_context(|| item.describe_as("scored", index, "the pairs"))?
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect();
        let nll = metrics
            .get("nll_loss")
            .or(metrics.get("nll"))
            .copied()
            .or(metrics.get("lw").map(|lw| -lw));
        if let Some(nll) = nll {
            metrics.insert("nll".into(), nll);
        }
        examples.push(ExampleScore {
            index,
            at: (!item.at.is_empty()).then(|| item.at.clone()),
            metrics,
        });
        bar.inc(1);
        tick(examples.len())?;
    }
    bar.finish_and_clear();
    Ok(PreferenceRun {
        subject: subject.to_string(),
        overall: mean_metrics(&examples),
        examples,
    })
}

/// The run's objective, which must compare a chosen and a rejected response.
fn preference_objective(cfg: &TrainConfig) -> Result<Objective> {
    let objective = cfg.objective();
    if !objective.is_preference() {
        bail!(
            "preference scoring needs a preference objective (ORPO, DPO, SimPO), not {:?}",
            cfg.method
        );
    }
    Ok(objective)
}

fn mean_metrics(examples: &[ExampleScore]) -> BTreeMap<String, f64> {
    let mut sums: BTreeMap<String, f64> = BTreeMap::new();
    for e in examples {
        for (k, v) in &e.metrics {
            *sums.entry(k.clone()).or_default() += v;
        }
    }
    if !examples.is_empty() {
        sums.values_mut().for_each(|v| *v /= examples.len() as f64);
    }
    sums
}

/// One example before and after, with `after - before` per metric.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExampleDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub at: Option<String>,
    pub before: BTreeMap<String, f64>,
    pub after: BTreeMap<String, f64>,
    pub delta: BTreeMap<String, f64>,
}

/// Two runs over the same pairs.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PreferenceComparison {
    pub before: PreferenceRun,
    pub after: PreferenceRun,
    /// `after.overall - before.overall` per metric.
    pub delta: BTreeMap<String, f64>,
    pub per_example: Vec<ExampleDelta>,
}

fn delta(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    before
        .iter()
        .filter_map(|(k, b)| after.get(k).map(|a| (k.clone(), a - b)))
        .collect()
}

/// Pairs the examples of two runs over the same items.
pub fn compare(before: PreferenceRun, after: PreferenceRun) -> Result<PreferenceComparison> {
    if before.examples.len() != after.examples.len() {
        bail!(
            "comparing runs over different data: {} and {} examples",
            before.examples.len(),
            after.examples.len()
        );
    }
    let per_example = before
        .examples
        .iter()
        .zip(&after.examples)
        .map(|(b, a)| ExampleDelta {
            index: b.index,
            at: b.at.clone(),
            before: b.metrics.clone(),
            after: a.metrics.clone(),
            delta: delta(&b.metrics, &a.metrics),
        })
        .collect();
    Ok(PreferenceComparison {
        delta: delta(&before.overall, &after.overall),
        before,
        after,
        per_example,
    })
}
