//! Scoring a model, with or without an adapter, and comparing it before and after training:
//! preference accuracy and margins on held-out pairs ([`preference`], the trainer's own
//! objective code), and judge-free verifiable-instruction following ([`ifeval`] checkers over
//! [`prompts`] files, answered by the model through [`reply`]). [`report`] turns the numbers
//! into tables, a markdown before/after report and its bar chart. [`run`] is one whole
//! evaluation from its settings, what `lorafit eval` and the job server's `eval` jobs call.
//! [`kl`] scores a quantized model layer by layer against its reference (`lorafit kl`).

pub mod ifeval;
pub mod kl;
pub mod language;
pub mod preference;
pub mod prompts;
pub mod report;
pub mod run;

pub use run::{run, EvalOptions, EvalOutcome, EvalProgress, Scorer};

use crate::atomic_file::same_file;
use crate::model::Lora;
use crate::train::trainer::Loaded;
use anyhow::{Context, Result};
use serde::Serialize;
use std::path::PathBuf;

/// An error where an output file is one of the inputs, or two outputs are one file: the later
/// write would replace the other file. Each path comes with what names it (`--out`).
pub(crate) fn refuse_clashing_paths(
    outputs: &[(String, PathBuf)],
    inputs: &[(String, PathBuf)],
) -> Result<()> {
    for (i, (what, out)) in outputs.iter().enumerate() {
        if let Some((input, _)) = inputs.iter().find(|(_, p)| same_file(p, out)) {
            anyhow::bail!(
                "{what} {} is also read ({input}): writing it would replace the input; name \
                 another file",
                out.display()
            );
        }
        if let Some((other, _)) = outputs[..i].iter().find(|(_, p)| same_file(p, out)) {
            anyhow::bail!(
                "{other} and {what} are both {}: one would replace the other; name two files",
                out.display()
            );
        }
    }
    Ok(())
}

/// The model's reply to one user message, greedy, at most `max_new` tokens. Every generation
/// the evaluation makes goes through here, so a change of generation API is one line.
pub fn reply(loaded: &Loaded, lora: Option<&Lora>, user: &str, max_new: usize) -> Result<String> {
    crate::infer::chat(
        &loaded.model,
        lora,
        &loaded.tokenizer,
        loaded.template.as_ref(),
        user,
        max_new,
    )
}

/// One prompt's response and verdicts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptResult {
    pub key: i64,
    pub line: usize,
    pub prompt: String,
    pub response: String,
    pub instruction_ids: Vec<String>,
    pub strict: Vec<bool>,
    pub loose: Vec<bool>,
}

/// A verifiable-instruction run: every prompt's result and the aggregate scores.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IfevalRun {
    pub subject: String,
    pub max_new_tokens: usize,
    pub scores: report::IfevalScores,
    pub results: Vec<PromptResult>,
}

/// Scores given responses (one per prompt, in order) without a model.
pub fn score_responses(
    prompts: &[prompts::InstructionPrompt],
    responses: Vec<String>,
    subject: &str,
    max_new_tokens: usize,
) -> IfevalRun {
    let results: Vec<PromptResult> = prompts
        .iter()
        .zip(responses)
        .map(|(p, response)| {
            let v = ifeval::score(&p.instructions, &response);
            PromptResult {
                key: p.key,
                line: p.line,
                prompt: p.prompt.clone(),
                response,
                instruction_ids: p.instructions.iter().map(|i| i.id.clone()).collect(),
                strict: v.strict,
                loose: v.loose,
            }
        })
        .collect();
    let ids: Vec<Vec<String>> = results.iter().map(|r| r.instruction_ids.clone()).collect();
    let verdicts: Vec<ifeval::Verdicts> = results
        .iter()
        .map(|r| ifeval::Verdicts {
            strict: r.strict.clone(),
            loose: r.loose.clone(),
        })
        .collect();
    IfevalRun {
        subject: subject.to_string(),
        max_new_tokens,
        scores: report::aggregate(&ids, &verdicts),
        results,
    }
}

/// Generates a reply to every prompt with `lora` (None: the base model) and scores it.
pub fn run_ifeval(
    loaded: &Loaded,
    lora: Option<&Lora>,
    prompts: &[prompts::InstructionPrompt],
    max_new: usize,
    subject: &str,
) -> Result<IfevalRun> {
    run_ifeval_with(loaded, lora, prompts, max_new, subject, &mut |_| Ok(()))
}

/// [`run_ifeval`], calling `tick` with the number of prompts answered after each one (an error
/// from it ends the run).
pub fn run_ifeval_with(
    loaded: &Loaded,
    lora: Option<&Lora>,
    prompts: &[prompts::InstructionPrompt],
    max_new: usize,
    subject: &str,
    tick: &mut dyn FnMut(usize) -> Result<()>,
) -> Result<IfevalRun> {
    if loaded.template.is_none() {
        eprintln!(
            "note: {} has no chat template: each instruction is given as plain text, not as a \
             user turn (pass --chat-template FILE to score it as a chat model)",
            loaded.model_path.display()
        );
    }
    let bar = indicatif::ProgressBar::new(prompts.len() as u64);
    let mut responses = Vec::with_capacity(prompts.len());
    for p in prompts {
        let r = reply(loaded, lora, &p.prompt, max_new)
            .with_context(|| format!("generating for the prompt on line {}", p.line))?;
        responses.push(r);
        bar.inc(1);
        tick(responses.len())?;
    }
    bar.finish_and_clear();
    Ok(score_responses(prompts, responses, subject, max_new))
}
