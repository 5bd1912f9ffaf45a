//! `lorafit curate`: UltraFeedback-style ratings → preference JSONL that `lorafit train`
//! reads, with the filters a preference set needs and a count of what each one removed.
//!
//! Input rows, in any dataset file `lorafit train` reads (JSONL, a JSON array, CSV, Parquet;
//! compressed or not; `data::rows`):
//! * binarized: `{prompt, chosen, rejected, score_chosen, score_rejected}`, with `chosen` and
//!   `rejected` as strings or as message lists, read as `lorafit train` reads them
//!   (`data::dataset::parse_row`): in HuggingFaceH4/ultrafeedback_binarized's layout, a string
//!   prompt and whole conversations, the leading messages both conversations share are the
//!   prompt and what follows in each its response. Two equal conversations have no response
//!   to split off and are counted as identical responses. A missing, null or empty (a blank
//!   CSV cell) score is refused unless `min_score_gap` is 0;
//! * raw: `{instruction, completions: [{response, overall_score, annotations, ...}]}` as in
//!   openbmb/UltraFeedback. The completion with the highest score becomes `chosen` and the one
//!   with the lowest `rejected` (the first of equals), so the pair has the largest gap the row
//!   offers. The score is `--score-field` of each completion (`overall_score` by default;
//!   `fine-grained_score`; or `annotations`, the mean of the numeric `Rating` of each aspect).
//!
//! Filters, in this order (each row is counted by the first that removes it): fewer than two
//! completions, a score gap below `min_score_gap`, identical responses, a prompt already seen
//! (whitespace- and case-normalised; the first row is kept), more than `max_tokens` tokens for
//! prompt + longer response under the model's tokenizer and chat template (as training
//! tokenises them, without truncation), and a chosen/rejected token-length ratio above
//! `max_length_ratio`. The survivors are split into train and validation rows by a seeded
//! permutation; both files keep the input order. An output row is the pair as `lorafit train`
//! reads it, with the scores the input gave and its `weight` (the one other field train reads
//! from a preference row). A malformed row is an error naming file, line and field (with
//! `skip_bad_rows` it is counted instead).

use crate::atomic_file::same_file;
use crate::data::rows::Rows;
use crate::data::{
    self, tokenize_pair, ChatTemplate, DatasetKind, Example, Message, PreferenceData,
    TextTokenizer, TokenizeOptions, TokenizeReport,
};
use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};
use std::collections::HashSet;
use std::fmt;
use std::io::{BufRead, Write};
use std::path::Path;

/// The filters' settings.
#[derive(Clone, Debug)]
pub struct CurateOptions {
    /// Least `score_chosen − score_rejected` a pair keeps (0: scores are optional).
    pub min_score_gap: f64,
    /// Largest ratio of the longer response's tokens to the shorter's.
    pub max_length_ratio: f64,
    /// Most tokens of prompt + longer response.
    pub max_tokens: usize,
    /// Whether a prompt seen before removes the row.
    pub dedupe: bool,
    /// Share of the kept rows held out for validation (0 when there is no validation file).
    pub valid_fraction: f64,
    pub seed: u64,
    /// Score of a raw row's completions: a numeric field, or `annotations`.
    pub score_field: String,
    pub skip_bad_rows: bool,
    /// A Jinja chat template file (or a tokenizer_config.json) instead of the model's, for
    /// message rows on a model without one (`chat_template` of `lorafit train`).
    pub chat_template: Option<String>,
}

impl Default for CurateOptions {
    fn default() -> Self {
        CurateOptions {
            min_score_gap: 1.0,
            max_length_ratio: 3.0,
            max_tokens: 2048,
            dedupe: true,
            valid_fraction: 0.0,
            seed: 0,
            score_field: "overall_score".into(),
            skip_bad_rows: false,
            chat_template: None,
        }
    }
}

/// How many rows each step removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CurateReport {
    pub rows: usize,
    pub blank_lines: usize,
    pub bad_rows: usize,
    pub too_few_completions: usize,
    pub small_gap: usize,
    pub identical: usize,
    pub duplicate_prompt: usize,
    pub too_long: usize,
    pub length_ratio: usize,
    pub train: usize,
    pub valid: usize,
}

impl fmt::Display for CurateReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{:<33} {:>8}", "rows read", self.rows)?;
        for (what, n) in [
            ("malformed (skipped)", self.bad_rows),
            ("fewer than 2 completions", self.too_few_completions),
            ("score gap too small", self.small_gap),
            ("identical responses", self.identical),
            ("duplicate prompt", self.duplicate_prompt),
            ("over the token cap", self.too_long),
            ("length ratio too large", self.length_ratio),
        ] {
            writeln!(f, "{:<33} {n:>8}", format!("removed: {what}"))?;
        }
        write!(
            f,
            "{:<33} {:>8} (train {}, validation {})",
            "kept",
            self.train + self.valid,
            self.train,
            self.valid
        )
    }
}

/// A row's `(score_chosen, score_rejected)`, each absent where the row has none.
type Scores = (Option<f64>, Option<f64>);

/// A row that survived parsing: the pair, its scores and its `weight` (`None` when the row has
/// none, so that the output row has none either).
struct Candidate {
    data: PreferenceData,
    scores: Scores,
    weight: Option<f64>,
}

/// What a well-formed row is.
enum Parsed {
    Pair(Candidate),
    /// A raw row with fewer than two completions.
    TooFewCompletions,
    /// `chosen` and `rejected` are one conversation: no response follows their shared
    /// messages, so it is an identical pair rather than a malformed row.
    SameConversation(Scores),
}

/// Why a row is malformed: field and message (the caller adds file and line).
struct Bad(Option<String>, String);

impl Bad {
    fn field(f: impl Into<String>, m: impl Into<String>) -> Bad {
        Bad(Some(f.into()), m.into())
    }
}

fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// The score of completion `i` of a raw row.
fn completion_score(c: &Map<String, Value>, i: usize, field: &str) -> Result<f64, Bad> {
    let at = format!("completions[{i}].{field}");
    if field == "annotations" {
        let ann = c
            .get("annotations")
            .and_then(|a| a.as_object())
            .ok_or_else(|| Bad::field(&at, "missing or not an object"))?;
        let ratings: Vec<f64> = ann
            .values()
            .filter_map(|aspect| aspect.get("Rating").and_then(number))
            .collect();
        if ratings.is_empty() {
            return Err(Bad::field(&at, "no aspect has a numeric \"Rating\""));
        }
        return Ok(ratings.iter().sum::<f64>() / ratings.len() as f64);
    }
    match c.get(field) {
        None => Err(Bad::field(at, "missing")),
        Some(v) => number(v)
            .filter(|x| x.is_finite())
            .ok_or_else(|| Bad::field(at, format!("expected a number, found {v}"))),
    }
}

/// A pair row in binarized form with its (chosen, rejected) scores.
type ScoredRow = (Value, (f64, f64));

/// A raw row → `Ok(None)` when it has fewer than two completions.
fn from_raw(obj: &Map<String, Value>, field: &str) -> Result<Option<ScoredRow>, Bad> {
    let prompt_key = if obj.contains_key("instruction") {
        "instruction"
    } else {
        "prompt"
    };
    let prompt = match obj.get(prompt_key) {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(Bad::field(prompt_key, "expected a string")),
        None => return Err(Bad::field("instruction", "missing")),
    };
    let completions = obj
        .get("completions")
        .and_then(|c| c.as_array())
        .ok_or_else(|| Bad::field("completions", "expected a list"))?;
    let mut scored = Vec::with_capacity(completions.len());
    for (i, c) in completions.iter().enumerate() {
        let c = c
            .as_object()
            .ok_or_else(|| Bad::field(format!("completions[{i}]"), "expected an object"))?;
        let response = match c.get("response") {
            Some(Value::String(s)) => s.clone(),
            _ => {
                return Err(Bad::field(
                    format!("completions[{i}].response"),
                    "missing or not a string",
                ))
            }
        };
        scored.push((response, completion_score(c, i, field)?));
    }
    if scored.len() < 2 {
        return Ok(None);
    }
    let (mut best, mut worst) = (0, 0);
    for (i, (_, s)) in scored.iter().enumerate() {
        if *s > scored[best].1 {
            best = i;
        }
        if *s < scored[worst].1 {
            worst = i;
        }
    }
    if best == worst {
        // All scores equal: any two completions, a zero gap.
        worst = usize::from(best == 0);
    }
    let mut row = json!({
        "prompt": prompt,
        "chosen": scored[best].0,
        "rejected": scored[worst].0,
    });
    if let Some(w) = obj.get("weight") {
        row["weight"] = w.clone();
    }
    Ok(Some((row, (scored[best].1, scored[worst].1))))
}

/// The scores of a binarized row. Without `required` a score may be missing, null or a blank
/// string (an empty CSV cell: the CSV reader gives every cell but a `weight` as a string).
fn scores(obj: &Map<String, Value>, required: bool) -> Result<Scores, Bad> {
    let get = |k: &str| -> Result<Option<f64>, Bad> {
        let absent = match obj.get(k) {
            None => "missing",
            Some(Value::Null) => "null",
            Some(Value::String(s)) if s.trim().is_empty() => "empty",
            Some(v) => {
                return number(v)
                    .filter(|x| x.is_finite())
                    .map(Some)
                    .ok_or_else(|| Bad::field(k, format!("expected a number, found {v}")))
            }
        };
        if required {
            Err(Bad::field(
                k,
                format!(
                    "{absent} (the score gap filter needs it; --min-score-gap 0 makes scores \
                     optional)"
                ),
            ))
        } else {
            Ok(None)
        }
    };
    Ok((get("score_chosen")?, get("score_rejected")?))
}

/// Whether `chosen` and `rejected` are one list.
fn same_list(obj: &Map<String, Value>) -> bool {
    match (obj.get("chosen"), obj.get("rejected")) {
        (Some(c @ Value::Array(_)), Some(r)) => c == r,
        _ => false,
    }
}

/// One input row, read as `lorafit train` reads it (a raw row is first made its best/worst
/// pair).
fn parse_candidate(
    value: Result<Value, String>,
    line: usize,
    opts: &CurateOptions,
) -> Result<Parsed, Bad> {
    let value = value.map_err(|e| Bad(None, e))?;
    let obj = value
        .as_object()
        .ok_or_else(|| Bad(None, "expected a JSON object".into()))?;
    let raw;
    let (row, scores) = if obj.contains_key("completions") {
        match from_raw(obj, &opts.score_field)? {
            Some((row, (sc, sr))) => {
                raw = row;
                (&raw, (Some(sc), Some(sr)))
            }
            None => return Ok(Parsed::TooFewCompletions),
        }
    } else {
        (&value, scores(obj, opts.min_score_gap > 0.0)?)
    };
    match data::dataset::parse_row(row, DatasetKind::Preference, line) {
        Ok(Example::Preference { data, weight, .. }) => Ok(Parsed::Pair(Candidate {
            data,
            scores,
            weight: row
                .get("weight")
                .is_some_and(|w| !w.is_null())
                .then_some(weight.0),
        })),
        Ok(Example::Sft { .. }) => Err(Bad(
            None,
            "read as an SFT row where a preference row was asked for".into(),
        )),
        // Two equal conversations split into a prompt and an empty `chosen`, which `parse_row`
        // refuses naming `chosen` (a malformed message is named by its index, `chosen[i]...`).
        Err(e) if e.field.as_deref() == Some("chosen") && same_list(obj) => {
            Ok(Parsed::SameConversation(scores))
        }
        Err(e) => Err(Bad(e.field, e.message)),
    }
}

/// The dedupe key of a prompt: its text (every message's role and content) with whitespace
/// runs collapsed and letters lower-cased.
fn prompt_key(data: &PreferenceData) -> String {
    let raw = match data {
        PreferenceData::Text { prompt, .. } => prompt.clone(),
        PreferenceData::Chat { prompt, .. } => prompt
            .iter()
            .map(|m| format!("{}: {}", m.role, m.content))
            .collect::<Vec<_>>()
            .join("\n"),
    };
    raw.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

fn responses_identical(data: &PreferenceData) -> bool {
    match data {
        PreferenceData::Text {
            chosen, rejected, ..
        } => chosen.trim() == rejected.trim(),
        PreferenceData::Chat {
            chosen, rejected, ..
        } => chosen == rejected,
    }
}

fn messages_json(m: &[Message]) -> Value {
    Value::Array(
        m.iter()
            .map(|m| json!({"role": m.role.as_str(), "content": m.content}))
            .collect(),
    )
}

/// The output row: what `lorafit train` reads (the pair and its weight), with the scores kept
/// beside it.
fn output_row(c: &Candidate) -> Value {
    let mut row = match &c.data {
        PreferenceData::Text {
            prompt,
            chosen,
            rejected,
        } => json!({"prompt": prompt, "chosen": chosen, "rejected": rejected}),
        PreferenceData::Chat {
            prompt,
            chosen,
            rejected,
        } => json!({
            "prompt": messages_json(prompt),
            "chosen": messages_json(chosen),
            "rejected": messages_json(rejected),
        }),
    };
    if let Some(sc) = c.scores.0 {
        row["score_chosen"] = json!(sc);
    }
    if let Some(sr) = c.scores.1 {
        row["score_rejected"] = json!(sr);
    }
    if let Some(w) = c.weight {
        row["weight"] = json!(w);
    }
    row
}

/// The tokenizer and chat template of a model folder or GGUF file, without its weights (a
/// folder's `config.json` is read only for an EOS token its tokenizer lacks).
pub fn load_text_tokenizer(model: &Path) -> Result<(TextTokenizer, Option<ChatTemplate>)> {
    data::model_files::load_tokenizer(model, || {
        Ok(crate::model::ModelSpec::from_config_file(&model.join("config.json"))?.eos_token_id)
    })
}

/// Reads `input`, filters, splits, and returns `(train rows, validation rows, report)`.
pub fn curate_reader(
    input: impl BufRead,
    name: &str,
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    opts: &CurateOptions,
) -> Result<(Vec<Value>, Vec<Value>, CurateReport)> {
    curate_rows(vec![Rows::jsonl(input, name)], tok, template, opts)
}

/// A row after the filters that need no tokens: a candidate and its place, or (without
/// `skip_bad_rows`) the malformed row that ends the run, once every row before it is through
/// the token filters.
enum Pending {
    Row(String, Candidate),
    Bad(String),
}

/// [`curate_reader`] over the rows of dataset files ([`Rows`]), one after the other (the shards
/// of a split); prompts already seen in an earlier file count as duplicates.
pub fn curate_rows(
    sources: Vec<Rows<'_>>,
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    opts: &CurateOptions,
) -> Result<(Vec<Value>, Vec<Value>, CurateReport)> {
    if !(0.0..1.0).contains(&opts.valid_fraction) {
        bail!("--valid-fraction {} must be in [0, 1)", opts.valid_fraction);
    }
    if opts.max_length_ratio < 1.0 || opts.max_length_ratio.is_nan() {
        bail!(
            "--max-length-ratio {} must be at least 1",
            opts.max_length_ratio
        );
    }
    if opts.min_score_gap < 0.0 || opts.min_score_gap.is_nan() {
        bail!(
            "--min-score-gap {} must not be negative",
            opts.min_score_gap
        );
    }
    let mut report = CurateReport::default();
    let mut seen = HashSet::new();
    // The rows that pass the filters before tokenisation, in order.
    let mut pending = Vec::new();
    'files: for mut rows in sources {
        while let Some(row) = rows.next() {
            let row = row?;
            let at = rows.location(row.n);
            report.rows += 1;
            let (cand, scores) = match parse_candidate(row.value, row.n, opts) {
                Ok(Parsed::Pair(c)) => {
                    let scores = c.scores;
                    (Some(c), scores)
                }
                Ok(Parsed::SameConversation(scores)) => (None, scores),
                Ok(Parsed::TooFewCompletions) => {
                    report.too_few_completions += 1;
                    continue;
                }
                Err(Bad(field, msg)) => {
                    let at = match field {
                        Some(f) => format!("{at}: field \"{f}\": {msg}"),
                        None => format!("{at}: {msg}"),
                    };
                    if opts.skip_bad_rows {
                        report.bad_rows += 1;
                        eprintln!("skipped {at}");
                        continue;
                    }
                    pending.push(Pending::Bad(at));
                    break 'files;
                }
            };
            if let (Some(sc), Some(sr)) = scores {
                if sc - sr < opts.min_score_gap {
                    report.small_gap += 1;
                    continue;
                }
            }
            let Some(cand) = cand.filter(|c| !responses_identical(&c.data)) else {
                report.identical += 1;
                continue;
            };
            if opts.dedupe && !seen.insert(prompt_key(&cand.data)) {
                report.duplicate_prompt += 1;
                continue;
            }
            pending.push(Pending::Row(at, cand));
        }
        report.blank_lines += rows.blank_lines();
    }
    // The token filters: rows tokenised on every core and taken in file order, so the first row
    // that fails (to tokenise, or to parse) is the error, as in a pass in order. No truncation:
    // the cap is applied to the whole pair, as training would see it before cutting.
    let no_cut = TokenizeOptions::new(usize::MAX, usize::MAX - 1);
    let lengths = |p: &Pending| match p {
        Pending::Row(at, cand) => {
            let mut counts = TokenizeReport::default();
            let pair = tokenize_pair(&cand.data, tok, template, &no_cut, &mut counts)
                .with_context(|| format!("{at}: tokenizing"))?;
            Ok((pair.max_len(), pair.chosen.len(), pair.rejected.len()))
        }
        Pending::Bad(_) => Ok((0, 0, 0)),
    };
    let mut kept = Vec::new();
    data::in_order_parallel(pending, lengths, |p, lengths: Result<_>| {
        let cand = match p {
            Pending::Row(_, cand) => cand,
            Pending::Bad(at) => bail!("{at}"),
        };
        let (longest, chosen, rejected) = lengths?;
        let (c, r) = (chosen.max(1), rejected.max(1));
        if longest > opts.max_tokens {
            report.too_long += 1;
        } else if c.max(r) as f64 / c.min(r) as f64 > opts.max_length_ratio {
            report.length_ratio += 1;
        } else {
            kept.push(cand);
        }
        Ok(())
    })?;
    let n_valid = if opts.valid_fraction > 0.0 && kept.len() >= 2 {
        ((kept.len() as f64 * opts.valid_fraction).round() as usize).clamp(1, kept.len() - 1)
    } else {
        0
    };
    let is_valid = crate::tensor::Rng(opts.seed ^ 0xC0_2A7E).choose(kept.len(), n_valid);
    let (mut train, mut valid) = (Vec::new(), Vec::new());
    for (c, v) in kept.iter().zip(is_valid) {
        if v {
            valid.push(output_row(c));
        } else {
            train.push(output_row(c));
        }
    }
    report.train = train.len();
    report.valid = valid.len();
    Ok((train, valid, report))
}

fn write_jsonl(path: &Path, rows: &[Value]) -> Result<()> {
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    for r in rows {
        serde_json::to_writer(&mut f, r)?;
        f.write_all(b"\n")?;
    }
    f.flush()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// The `curate` command: reads `input`, writes `output` (and `valid_output`), returns the
/// report.
pub fn curate_file(
    input: &Path,
    output: &Path,
    valid_output: Option<&Path>,
    model: &Path,
    opts: &CurateOptions,
) -> Result<CurateReport> {
    if let Some(v) = valid_output {
        if same_file(output, v) {
            bail!(
                "--output and --valid-output both name {}: the validation rows would replace \
                 the training rows; name two files",
                output.display()
            );
        }
    }
    let (tok, template) = load_text_tokenizer(model)
        .with_context(|| format!("loading the tokenizer of {}", model.display()))?;
    let template = data::model_files::run_template(opts.chat_template.as_deref(), template, &tok)?;
    let mut opts = opts.clone();
    if valid_output.is_none() {
        opts.valid_fraction = 0.0;
    }
    let name = input.display().to_string();
    let files = crate::data::rows::dataset_files(&name)?;
    for out in std::iter::once(output).chain(valid_output) {
        if let Some(f) = files.iter().find(|f| same_file(f, out)) {
            bail!(
                "{} is both read (--input) and written: the output would replace the rows being \
                 curated; name another output file",
                f.display()
            );
        }
    }
    let sources = files
        .iter()
        .map(|f| Rows::open(f))
        .collect::<Result<Vec<_>>>()?;
    let (train, valid, report) = curate_rows(sources, &tok, template.as_ref(), &opts)?;
    if train.is_empty() {
        bail!("{name}: no row survived the filters\n{report}");
    }
    write_jsonl(output, &train)?;
    if let Some(v) = valid_output {
        write_jsonl(v, &valid)?;
    }
    Ok(report)
}
