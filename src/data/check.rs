//! The pre-flight checks of a dataset: every row loaded, rendered, tokenised
//! and checked against the model before the first training step, and what a
//! person should know about each pair (`lorafit lint`; `lorafit train` prints
//! the summary).
//!
//! It exists so that a row that would fail mid-run (a template that cannot
//! render it, a prompt that encodes to nothing, an id outside the model's
//! vocabulary) fails while loading, with its file, line and field, or is
//! skipped and counted under `skip_bad_rows`; and so that the rows that train
//! without error but not as intended (chosen equal to rejected, duplicates, a
//! prompt ending in an assistant turn, a token merged across the boundary, a
//! truncation that cut the answer) are counted instead of passing in silence.
//! Loading, tokenising and checking are one pass, so `lint` and `train` see
//! the same rows and the same ids.

use std::collections::hash_map::{DefaultHasher, Entry};
use std::collections::HashMap;
use std::fmt;
use std::hash::{Hash, Hasher};

use anyhow::Result;

use super::dataset::{
    load_dataset, read_jsonl, DatasetKind, Example, LoadReport, PreferenceData, Role, SftData,
    MAX_SKIP_REASONS,
};
use super::template::ChatTemplate;
use super::tokenize::{
    render_preference, render_sft, tokenize_pair, tokenize_sft_example, TextTokenizer, TokenRules,
    TokenizeOptions, TokenizeReport, TokenizedPair, TokenizedSft,
};

/// A chosen/rejected length ratio (in response tokens) beyond this, either
/// way, is noted: the pair's preference is then mostly about length.
pub const LENGTH_RATIO_NOTE: f64 = 4.0;

/// How the rows are read and tokenised, and what they are checked against.
#[derive(Debug, Clone, Copy)]
pub struct CheckOptions {
    pub kind: DatasetKind,
    /// Skip (and count) a bad row instead of failing on it.
    pub skip_bad: bool,
    pub tokenize: TokenizeOptions,
    /// A second rule set to compare with (where the ids would differ), if any.
    pub compare: Option<TokenRules>,
    /// Rows of the model's embedding: every id must be below it.
    pub model_vocab: usize,
}

/// A row's ids for training.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowTokens {
    Pair(TokenizedPair),
    Sft(TokenizedSft),
}

/// What is worth knowing about one row that trains without error.
#[derive(Debug, Clone, PartialEq)]
pub enum Finding {
    /// The prompt does not start with the tokenizer's BOS.
    NoBos,
    /// A response (named) does not end with EOS (trailing whitespace tokens
    /// ignored).
    NoEos(&'static str),
    /// Encoding prompt+response as one string merges a token across the
    /// boundary (the response named).
    BoundaryMerge(&'static str),
    /// The compared rule set gives other ids for these parts (where each first differs).
    RulesDiffer(Vec<PartDiff>),
    /// The compared rule set cannot encode this row (why).
    OtherRulesFail(String),
    /// The prompt lost this many leading tokens to `max_prompt_len`.
    PromptCut(usize),
    /// Responses lost this many trailing tokens to `max_seq_len` (the most over
    /// chosen and rejected), and the cut text began with this.
    ResponseCut(usize, String),
    /// chosen/rejected response tokens beyond [`LENGTH_RATIO_NOTE`].
    LengthRatio(f64),
    /// chosen and rejected are the same text: no preference signal.
    IdenticalResponses,
    /// The same row as an earlier one (where that one sits).
    Duplicate(String),
    /// The prompt's last message is the assistant's.
    PromptEndsWithAssistant,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finding::NoBos => f.write_str("prompt has no BOS"),
            Finding::NoEos(field) => write!(f, "{field} does not end with EOS"),
            Finding::BoundaryMerge(field) => write!(
                f,
                "a token merges across the prompt/{field} boundary when encoded as one string"
            ),
            Finding::RulesDiffer(parts) => {
                f.write_str("the other tokenization gives other ids: ")?;
                for (i, p) in parts.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "{p}")?;
                }
                Ok(())
            }
            Finding::OtherRulesFail(why) => {
                write!(f, "the other tokenization cannot encode this row: {why}")
            }
            Finding::PromptCut(n) => write!(f, "prompt cut: its first {n} tokens dropped"),
            Finding::ResponseCut(n, text) => {
                write!(
                    f,
                    "response cut: its last {n} tokens dropped, from {text:?}"
                )
            }
            Finding::LengthRatio(r) => write!(f, "chosen/rejected length ratio {r:.2}"),
            Finding::IdenticalResponses => {
                f.write_str("chosen equals rejected (no preference signal)")
            }
            Finding::Duplicate(first) => write!(f, "duplicate of the row at {first}"),
            Finding::PromptEndsWithAssistant => {
                f.write_str("the prompt ends with an assistant turn (the response continues it)")
            }
        }
    }
}

/// Where one part's ids differ between the checked tokenization and the compared one: the first
/// differing position and the tokens from there (a few, as text) under each.
#[derive(Debug, Clone, PartialEq)]
pub struct PartDiff {
    pub part: &'static str,
    pub at: usize,
    pub ours: Vec<String>,
    pub other: Vec<String>,
}

/// Tokens shown on each side of a [`PartDiff`].
const DIFF_TOKENS: usize = 3;

impl PartDiff {
    /// `None` when the two id lists are equal.
    fn new(
        tok: &TextTokenizer,
        part: &'static str,
        ours: &[u32],
        other: &[u32],
    ) -> Option<PartDiff> {
        if ours == other {
            return None;
        }
        let at = ours.iter().zip(other).take_while(|(a, b)| a == b).count();
        let show = |ids: &[u32]| -> Vec<String> {
            ids.iter()
                .skip(at)
                .take(DIFF_TOKENS)
                .map(|&id| match tok.decode(&[id]) {
                    Ok(t) if !t.is_empty() => t,
                    _ => tok.id_to_token(id).unwrap_or_else(|| format!("<id {id}>")),
                })
                .collect()
        };
        Some(PartDiff {
            part,
            at,
            ours: show(ours),
            other: show(other),
        })
    }
}

impl fmt::Display for PartDiff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let side = |t: &[String]| {
            if t.is_empty() {
                "(its end)".to_string()
            } else {
                format!("{t:?}")
            }
        };
        write!(
            f,
            "{} from token {}: {} here, {} there",
            self.part,
            self.at,
            side(&self.ours),
            side(&self.other)
        )
    }
}

/// The finding for the compared tokenization over `(part, checked ids, compared ids)`: `None`
/// where every part gets the same ids.
fn rules_differ(tok: &TextTokenizer, parts: &[(&'static str, &[u32], &[u32])]) -> Option<Finding> {
    let diffs: Vec<PartDiff> = parts
        .iter()
        .filter_map(|&(part, ours, other)| PartDiff::new(tok, part, ours, other))
        .collect();
    (!diffs.is_empty()).then_some(Finding::RulesDiffer(diffs))
}

/// A checked row: its place, its ids and its findings.
#[derive(Debug, Clone)]
pub struct CheckedRow {
    /// Where the row sits: `file:line` or `file: row N`.
    pub at: String,
    /// The row's `weight` (1 unless a preference row sets one).
    pub weight: f64,
    pub tokens: RowTokens,
    pub findings: Vec<Finding>,
}

/// The sums over a file.
#[derive(Debug, Clone, Default)]
pub struct CheckReport {
    pub load: LoadReport,
    pub tokenize: TokenizeReport,
    /// Rows that failed a check after parsing (template, tokens, vocabulary),
    /// each `file:line: ...`; skipped with `skip_bad`.
    pub bad_rows: Vec<String>,
    pub rules: Option<TokenRules>,
    pub compare: Option<TokenRules>,
    pub no_bos: usize,
    pub no_eos: usize,
    pub boundary_merges: usize,
    pub rules_differ: usize,
    pub prompt_cut: usize,
    pub response_cut: usize,
    pub length_ratio: usize,
    pub identical_responses: usize,
    pub duplicates: usize,
    pub prompt_ends_with_assistant: usize,
}

impl CheckReport {
    /// Rows that could not be used: malformed when read, or failing a check.
    pub fn errors(&self) -> usize {
        self.load.skipped + self.bad_rows.len()
    }

    /// Counted warnings: rows that train but not as intended.
    pub fn warnings(&self) -> usize {
        self.identical_responses + self.duplicates + self.prompt_ends_with_assistant
    }

    fn count(&mut self, f: &Finding) {
        match f {
            Finding::NoBos => self.no_bos += 1,
            Finding::NoEos(_) => self.no_eos += 1,
            Finding::BoundaryMerge(_) => self.boundary_merges += 1,
            Finding::RulesDiffer(_) | Finding::OtherRulesFail(_) => self.rules_differ += 1,
            Finding::PromptCut(_) => self.prompt_cut += 1,
            Finding::ResponseCut(..) => self.response_cut += 1,
            Finding::LengthRatio(_) => self.length_ratio += 1,
            Finding::IdenticalResponses => self.identical_responses += 1,
            Finding::Duplicate(_) => self.duplicates += 1,
            Finding::PromptEndsWithAssistant => self.prompt_ends_with_assistant += 1,
        }
    }
}

impl fmt::Display for CheckReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.tokenize;
        write!(
            f,
            "{}: {} rows used ({} chat, {} text), tokenization {}; {} tokens, longest sequence {}",
            self.load.path,
            t.rows,
            self.load.chat_rows,
            self.load.text_rows,
            self.rules.map(|r| r.name()).unwrap_or("?"),
            t.total_tokens,
            t.max_seq_tokens
        )?;
        if self.load.blank_lines > 0 {
            write!(f, "; {} blank lines passed over", self.load.blank_lines)?;
        }
        write!(
            f,
            "\n  errors: {} ({} malformed rows, {} rows failing a check){}",
            self.errors(),
            self.load.skipped,
            self.bad_rows.len(),
            if self.errors() > 0 { ", skipped" } else { "" }
        )?;
        let reasons = self.load.skip_reasons.len() + self.bad_rows.len();
        for r in (self.load.skip_reasons.iter().chain(&self.bad_rows)).take(MAX_SKIP_REASONS) {
            write!(f, "\n    {r}")?;
        }
        if reasons > MAX_SKIP_REASONS {
            write!(f, "\n    ... and {} more", reasons - MAX_SKIP_REASONS)?;
        }
        write!(
            f,
            "\n  warnings: {} chosen == rejected, {} duplicate rows, {} prompts ending in an assistant turn",
            self.identical_responses, self.duplicates, self.prompt_ends_with_assistant
        )?;
        write!(
            f,
            "\n  notes: {} prompts without BOS, {} responses without EOS, {} responses with a token merged across the boundary, {} prompts cut, {} rows with a response cut, {} pairs with length ratio beyond {LENGTH_RATIO_NOTE}",
            self.no_bos, self.no_eos, self.boundary_merges, self.prompt_cut, self.response_cut, self.length_ratio
        )?;
        if let Some(c) = self.compare {
            write!(
                f,
                "\n  {} rows get other ids under tokenization {}",
                self.rules_differ,
                c.name()
            )?;
        }
        if t.split_prompts > 0 {
            write!(
                f,
                "\n  {} pairs whose responses split the prompt differently (TRL gives each its own prompt; here the prompt is their shared ids)",
                t.split_prompts
            )?;
        }
        Ok(())
    }
}

/// Reads `path` (any format `data::rows` reads; `text` is JSONL content when it is
/// already in memory), tokenises and checks every row. A bad row is an error
/// naming `file:line` (or `file: row N`) and its field, or with `skip_bad` is
/// skipped and counted.
pub fn load_and_check(
    path: &str,
    text: Option<&str>,
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    opts: &CheckOptions,
) -> Result<(Vec<CheckedRow>, CheckReport)> {
    opts.tokenize.validate()?;
    let (examples, load) = match text {
        Some(t) => read_jsonl(std::io::Cursor::new(t), path, opts.kind, opts.skip_bad)?,
        None => load_dataset(path, opts.kind, opts.skip_bad)?,
    };
    let mut report = CheckReport {
        load,
        rules: Some(opts.tokenize.rules),
        compare: opts.compare,
        ..Default::default()
    };
    let mut rows = Vec::with_capacity(examples.len());
    let mut seen: HashMap<u64, String> = HashMap::new();
    // Rows are rendered and tokenised in parallel (each alone), then taken in file order: the
    // report, the duplicates and the first failing row are those of a pass in order.
    let bar = RowsBar::new(path, examples.len());
    let work = |ex: &Example| {
        let mut row_counts = TokenizeReport::default();
        let checked = check_row(ex, tok, template, opts, &mut row_counts);
        bar.inc();
        (checked, row_counts)
    };
    let mut index = 0;
    super::in_order_parallel(examples, work, |ex, (checked, row_counts)| {
        let at = report.load.location(index, ex.line());
        index += 1;
        // The row's counts join the report only when the row is used.
        match checked {
            Ok((tokens, mut findings)) => {
                report.tokenize.add(&row_counts);
                let mut h = DefaultHasher::new();
                match &ex {
                    Example::Preference { data, .. } => data.hash(&mut h),
                    Example::Sft { data, .. } => data.hash(&mut h),
                }
                // A 64-bit hash of the row's content: a collision would only
                // report a false duplicate, never drop a row.
                let key = h.finish();
                match seen.entry(key) {
                    Entry::Occupied(first) => {
                        findings.push(Finding::Duplicate(first.get().clone()))
                    }
                    Entry::Vacant(slot) => {
                        slot.insert(at.clone());
                    }
                }
                for f in &findings {
                    report.count(f);
                }
                rows.push(CheckedRow {
                    at: at.clone(),
                    weight: ex.weight(),
                    tokens,
                    findings,
                });
            }
            Err(e) => {
                let msg = format!("{at}: {e:#}");
                if !opts.skip_bad {
                    anyhow::bail!(msg);
                }
                // The chat / text counts are of the rows used.
                if ex.is_chat() {
                    report.load.chat_rows -= 1;
                } else {
                    report.load.text_rows -= 1;
                }
                report.bad_rows.push(msg);
            }
        }
        Ok(())
    })?;
    drop(bar);
    if rows.is_empty() {
        let summary = format!(
            "{path}: no usable {} rows ({} malformed, {} failing a check)",
            opts.kind,
            report.load.skipped,
            report.bad_rows.len()
        );
        let reasons: Vec<String> = (report.load.skip_reasons.iter())
            .chain(&report.bad_rows)
            .cloned()
            .collect();
        let total = reasons.len();
        return Err(super::NoUsableRows::new(summary, &reasons, total).into());
    }
    Ok((rows, report))
}

/// A progress bar over the rows being rendered and tokenised, on a terminal and for files of at
/// least `RowsBar::MIN_ROWS` rows (a smaller file is done before a bar would be read); cleared
/// when dropped, however the loop ends.
struct RowsBar(Option<indicatif::ProgressBar>);

impl RowsBar {
    const MIN_ROWS: usize = 2000;

    fn new(path: &str, rows: usize) -> RowsBar {
        RowsBar((rows >= Self::MIN_ROWS).then(|| {
            let bar = indicatif::ProgressBar::new(rows as u64);
            if let Ok(style) = indicatif::ProgressStyle::with_template(
                "{msg} {bar:30} {pos}/{len} rows [{elapsed_precise} < {eta_precise}]",
            ) {
                bar.set_style(style);
            }
            bar.set_message(format!("tokenizing {path}"));
            bar
        }))
    }

    fn inc(&self) {
        if let Some(b) = &self.0 {
            b.inc(1);
        }
    }
}

impl Drop for RowsBar {
    fn drop(&mut self) {
        if let Some(b) = &self.0 {
            b.finish_and_clear();
        }
    }
}

/// Options with limits no row reaches: the ids before truncation.
fn untruncated(opts: &TokenizeOptions) -> TokenizeOptions {
    TokenizeOptions {
        max_seq_len: usize::MAX / 2,
        max_prompt_len: usize::MAX / 4,
        ..*opts
    }
}

fn check_ids(field: &'static str, ids: &[u32], vocab: usize) -> Result<()> {
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        anyhow::bail!(
            "field \"{field}\": token id {bad} is outside the model's vocabulary ({vocab} rows): the tokenizer does not match the model"
        );
    }
    Ok(())
}

fn prompt_ends_with_assistant(ex: &Example) -> bool {
    let last = match ex {
        Example::Preference {
            data: PreferenceData::Chat { prompt, .. },
            ..
        }
        | Example::Sft {
            data: SftData::Chat { prompt, .. },
            ..
        } => prompt.last(),
        _ => None,
    };
    last.is_some_and(|m| m.role == Role::Assistant)
}

/// Whether encoding `prompt + response` as one string gives other ids at the
/// boundary than encoding the two apart.
fn merges_across(tok: &TextTokenizer, prompt: &str, response: &str) -> Result<bool> {
    let p = tok.encode(prompt)?;
    let joint = tok.encode(&format!("{prompt}{response}"))?;
    Ok(joint.get(..p.len()) != Some(p.as_slice()))
}

/// Tokenises one row under the configured rules and checks it.
fn check_row(
    ex: &Example,
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    opts: &CheckOptions,
    report: &mut TokenizeReport,
) -> Result<(RowTokens, Vec<Finding>)> {
    let mut findings = Vec::new();
    let full = untruncated(&opts.tokenize);
    let mut scratch = TokenizeReport::default();
    let vocab = opts.model_vocab;
    if prompt_ends_with_assistant(ex) {
        findings.push(Finding::PromptEndsWithAssistant);
    }
    let tokens = match ex {
        Example::Preference { data, .. } => {
            if let PreferenceData::Text {
                chosen, rejected, ..
            } = data
            {
                if chosen == rejected {
                    findings.push(Finding::IdenticalResponses);
                }
            }
            if let PreferenceData::Chat {
                chosen, rejected, ..
            } = data
            {
                if chosen == rejected {
                    findings.push(Finding::IdenticalResponses);
                }
            }
            let whole = tokenize_pair(data, tok, template, &full, &mut scratch)?;
            let pair = tokenize_pair(data, tok, template, &opts.tokenize, report)?;
            if pair.prompt.is_empty() {
                anyhow::bail!("field \"prompt\": the prompt encodes to no tokens (and the tokenizer adds no BOS), so the first response token has nothing to be predicted from");
            }
            check_ids("prompt", &pair.prompt, vocab)?;
            check_ids("chosen", &pair.chosen, vocab)?;
            check_ids("rejected", &pair.rejected, vocab)?;
            if tok.bos_id().is_some() && pair.prompt.first() != tok.bos_id().as_ref() {
                findings.push(Finding::NoBos);
            }
            for (field, ids) in [("chosen", &whole.chosen), ("rejected", &whole.rejected)] {
                if tok.eos_id().is_some() && !tok.ends_with_eos(ids)? {
                    findings.push(Finding::NoEos(field));
                }
            }
            // The split `separate` uses; a template that renders the prompt differently alone
            // fails it, and the TRL rules (which tokenized the row above) need no such split.
            if let Ok(r) = render_preference(data, template) {
                for (field, text) in [("chosen", &r.chosen), ("rejected", &r.rejected)] {
                    if merges_across(tok, &r.prompt, text)? {
                        findings.push(Finding::BoundaryMerge(field));
                    }
                }
            }
            let other = opts
                .compare
                .map(|o| tokenize_pair(data, tok, template, &full.with_rules(o), &mut scratch));
            match other {
                None => {}
                Some(Err(e)) => findings.push(Finding::OtherRulesFail(format!("{e:#}"))),
                Some(Ok(o)) => findings.extend(rules_differ(
                    tok,
                    &[
                        ("prompt", &whole.prompt, &o.prompt),
                        ("chosen", &whole.chosen, &o.chosen),
                        ("rejected", &whole.rejected, &o.rejected),
                    ],
                )),
            }
            if pair.prompt.len() < whole.prompt.len() {
                findings.push(Finding::PromptCut(whole.prompt.len() - pair.prompt.len()));
            }
            let cut_c = whole.chosen.len() - pair.chosen.len();
            let cut_r = whole.rejected.len() - pair.rejected.len();
            if cut_c > 0 || cut_r > 0 {
                let (ids, keep) = if cut_c >= cut_r {
                    (&whole.chosen, pair.chosen.len())
                } else {
                    (&whole.rejected, pair.rejected.len())
                };
                let end = ids.len().min(keep + 8);
                let text = tok.decode(&ids[keep..end]).unwrap_or_default();
                findings.push(Finding::ResponseCut(cut_c.max(cut_r), text));
            }
            let (c, rj) = (
                whole.chosen.len().max(1) as f64,
                whole.rejected.len().max(1) as f64,
            );
            let ratio = c / rj;
            if !(1.0 / LENGTH_RATIO_NOTE..=LENGTH_RATIO_NOTE).contains(&ratio) {
                findings.push(Finding::LengthRatio(ratio));
            }
            RowTokens::Pair(pair)
        }
        Example::Sft { data, .. } => {
            let whole = tokenize_sft_example(data, tok, template, &full, &mut scratch)?;
            let sft = tokenize_sft_example(data, tok, template, &opts.tokenize, report)?;
            if sft.len() < 2 {
                anyhow::bail!(
                    "the row encodes to {} token(s); at least two are needed to train one",
                    sft.len()
                );
            }
            check_ids("prompt", &sft.prompt, vocab)?;
            check_ids("completion", &sft.completion, vocab)?;
            if tok.bos_id().is_some() && sft.sequence().first() != tok.bos_id().as_ref() {
                findings.push(Finding::NoBos);
            }
            if tok.eos_id().is_some() && !tok.ends_with_eos(&whole.completion)? {
                findings.push(Finding::NoEos("completion"));
            }
            if let Ok(r) = render_sft(data, template) {
                if !r.prompt.is_empty() && merges_across(tok, &r.prompt, &r.completion)? {
                    findings.push(Finding::BoundaryMerge("completion"));
                }
            }
            let other = opts.compare.map(|o| {
                tokenize_sft_example(data, tok, template, &full.with_rules(o), &mut scratch)
            });
            match other {
                None => {}
                Some(Err(e)) => findings.push(Finding::OtherRulesFail(format!("{e:#}"))),
                Some(Ok(o)) => findings.extend(rules_differ(
                    tok,
                    &[
                        ("prompt", &whole.prompt, &o.prompt),
                        ("completion", &whole.completion, &o.completion),
                    ],
                )),
            }
            if sft.prompt.len() < whole.prompt.len() {
                findings.push(Finding::PromptCut(whole.prompt.len() - sft.prompt.len()));
            }
            let cut = whole.completion.len() - sft.completion.len();
            if cut > 0 {
                let keep = sft.completion.len();
                let end = whole.completion.len().min(keep + 8);
                let text = tok.decode(&whole.completion[keep..end]).unwrap_or_default();
                findings.push(Finding::ResponseCut(cut, text));
            }
            RowTokens::Sft(sft)
        }
    };
    Ok((tokens, findings))
}
