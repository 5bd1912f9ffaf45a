//! Training data rows: parsing and validating preference rows (ORPO/DPO) and
//! SFT rows into typed [`Example`]s.
//!
//! This module exists so that every malformed row is caught once, up front, with
//! a message that names the file, the 1-based line and the offending field —
//! instead of surfacing later as a confusing tokenizer or template failure, or
//! worse, being dropped silently. It understands the row layouts TRL accepts:
//!
//! * preference, plain text: `{"prompt": str, "chosen": str, "rejected": str}`
//! * preference, conversational: `prompt` is a list of `{role, content}`
//!   messages and `chosen`/`rejected` are lists of messages (usually one
//!   assistant message)
//! * preference, implicit prompt: no `prompt`; `chosen`/`rejected` are whole
//!   conversations and the prompt is their longest common prefix of messages,
//!   or whole texts (Anthropic HH) split where TRL's `extract_prompt` splits them
//! * SFT: `{prompt, completion}` (strings or messages), `{messages}` (the final
//!   assistant message is the completion, everything before it the prompt) or
//!   `{text}` (plain text, every token trained)
//!
//! * the H4 UltraFeedback layout: `prompt` a string, `chosen`/`rejected`
//!   whole conversations that start with it (extra columns such as
//!   `prompt_id`, `messages`, `score_chosen` are ignored)
//! * ShareGPT: `conversations` of `{from, value}` (roles `human`, `gpt`,
//!   `system`); for preference rows `chosen`/`rejected` are the next reply
//!   (a message, a list of messages or a string)
//! * Alpaca (SFT): `instruction`, optional `input` and `system`, `output`,
//!   as a user turn and the assistant's reply
//!
//! Messages are text turns: a message's `tool_calls` or per-message `weight`, and a row's
//! `tools`, are row errors naming the field, since dropping them would train on what the row does
//! not say (an empty assistant turn where the call was).
//!
//! Rows come from any file [`super::rows`] reads (JSONL, a JSON array, CSV /
//! TSV, local Parquet files as the Hugging Face Hub serves them; gzip or zstd
//! compressed), with the same layouts.
//!
//! Text rows and chat rows are kept apart in the types ([`PreferenceData`],
//! [`SftData`]) because they are turned into token sequences differently: chat
//! rows go through the model's chat template, text rows are used as-is.

use std::fmt;
use std::io::BufRead;
use std::path::Path;

use super::rows::{dataset_files, row_location, Rows};

use anyhow::{bail, Result};
use serde::Serialize;
use serde_json::{Map, Value};

/// How many skip reasons [`LoadReport`] keeps for the log.
pub const MAX_SKIP_REASONS: usize = 5;

/// Which kind of rows a file is expected to hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DatasetKind {
    /// `{prompt, chosen, rejected}` rows (ORPO, DPO).
    Preference,
    /// `{prompt, completion}`, `{messages}` or `{text}` rows.
    Sft,
}

impl fmt::Display for DatasetKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DatasetKind::Preference => f.write_str("preference"),
            DatasetKind::Sft => f.write_str("SFT"),
        }
    }
}

/// The speaker of a chat message. Any other role in a data file is an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    /// The role name as chat templates expect it (`"user"`, ...).
    pub fn as_str(&self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }

    /// Parses a role name, ShareGPT's (`human`, `gpt`, `function_call`,
    /// `observation`) included; `None` for anything else.
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "system" => Some(Role::System),
            "user" | "human" => Some(Role::User),
            "assistant" | "gpt" | "function_call" => Some(Role::Assistant),
            "tool" | "observation" => Some(Role::Tool),
            _ => None,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One chat message. Serialises as `{"role": ..., "content": ...}`, which is
/// what chat templates receive.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct Message {
    pub role: Role,
    pub content: String,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }
}

/// A preference example, either plain text or chat.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PreferenceData {
    /// Plain strings: the prompt is used as-is and each response is appended
    /// to it as-is (no template).
    Text {
        prompt: String,
        chosen: String,
        rejected: String,
    },
    /// Chat messages rendered with the model's chat template. `chosen` and
    /// `rejected` are the messages that follow `prompt` (usually one
    /// assistant message each).
    Chat {
        prompt: Vec<Message>,
        chosen: Vec<Message>,
        rejected: Vec<Message>,
    },
}

/// An SFT example, either plain text or chat. Only completion tokens are
/// trained.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SftData {
    /// Plain strings. A `{text}` row becomes `prompt: ""`, `completion: text`,
    /// so that all of its tokens are trained.
    Text { prompt: String, completion: String },
    /// Chat messages rendered with the model's chat template; `completion`
    /// is the messages that follow `prompt` (a `{messages}` row's final
    /// assistant message).
    Chat {
        prompt: Vec<Message>,
        completion: Vec<Message>,
    },
}

/// A row's `weight`: a finite number >= 0 (default 1) that scales the example's loss
/// and gradient in training (`train::device_loss::ExampleScale`). Compared by value bits.
#[derive(Debug, Clone, Copy)]
pub struct RowWeight(pub f64);

impl Default for RowWeight {
    fn default() -> Self {
        RowWeight(1.0)
    }
}

impl PartialEq for RowWeight {
    fn eq(&self, other: &Self) -> bool {
        self.0.to_bits() == other.0.to_bits()
    }
}

impl Eq for RowWeight {}

/// One validated training row. `line` is the 1-based line of the source file
/// (the 1-based row of a Parquet file; 0 for examples built in code) so later
/// stages can point back at it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Example {
    Preference {
        line: usize,
        data: PreferenceData,
        /// The row's `weight` field (1 when absent).
        weight: RowWeight,
    },
    Sft {
        line: usize,
        data: SftData,
        /// The row's `weight` field (1 when absent).
        weight: RowWeight,
    },
}

impl Example {
    /// The 1-based source line (0 when not loaded from a file).
    pub fn line(&self) -> usize {
        match self {
            Example::Preference { line, .. } | Example::Sft { line, .. } => *line,
        }
    }

    /// The row's weight in training (its `weight` field; 1 when absent).
    pub fn weight(&self) -> f64 {
        match self {
            Example::Preference { weight, .. } | Example::Sft { weight, .. } => weight.0,
        }
    }

    /// Whether the example is in chat (message) form.
    pub fn is_chat(&self) -> bool {
        matches!(
            self,
            Example::Preference {
                data: PreferenceData::Chat { .. },
                ..
            } | Example::Sft {
                data: SftData::Chat { .. },
                ..
            }
        )
    }

    pub fn kind(&self) -> DatasetKind {
        match self {
            Example::Preference { .. } => DatasetKind::Preference,
            Example::Sft { .. } => DatasetKind::Sft,
        }
    }
}

/// What [`load_dataset`] did, for the log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// The dataset setting as given: a file, or a pattern naming shards.
    pub path: String,
    /// Rows turned into examples.
    pub loaded: usize,
    /// Malformed rows skipped (only with `skip_bad = true`).
    pub skipped: usize,
    /// Blank (whitespace-only) lines ignored.
    pub blank_lines: usize,
    /// The files read, in order (one unless the setting was a pattern), each with the index of
    /// its first example.
    pub files: Vec<LoadedFile>,
    /// Rows in text form / chat form among `loaded`.
    pub text_rows: usize,
    pub chat_rows: usize,
    /// Every skip reason, each `file:line: ...` (the log shows the first
    /// [`MAX_SKIP_REASONS`]).
    pub skip_reasons: Vec<String>,
}

/// One file of a dataset, for naming where its rows sit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadedFile {
    pub name: String,
    /// Rows are numbered as rows (Parquet, a JSON array: messages say `row N`), not as lines.
    pub numbered_rows: bool,
    /// The index of the file's first example among all the dataset's examples.
    pub first_example: usize,
}

impl LoadReport {
    /// Where example `index` (of all the dataset's examples, in order), at line or row `n` of
    /// its file, sits: `file:N` or `file: row N`.
    pub fn location(&self, index: usize, n: usize) -> String {
        let file = self.files.partition_point(|f| f.first_example <= index);
        match self.files.get(file.saturating_sub(1)) {
            Some(f) => row_location(&f.name, f.numbered_rows, n),
            None => row_location(&self.path, false, n),
        }
    }

    /// Adds one file's report, whose examples start at `first_example`.
    fn add(&mut self, file: LoadReport, first_example: usize) {
        self.loaded += file.loaded;
        self.skipped += file.skipped;
        self.blank_lines += file.blank_lines;
        self.text_rows += file.text_rows;
        self.chat_rows += file.chat_rows;
        self.skip_reasons.extend(file.skip_reasons);
        self.files
            .extend(file.files.into_iter().map(|f| LoadedFile {
                first_example: f.first_example + first_example,
                ..f
            }));
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} examples ({} chat, {} text)",
            self.path, self.loaded, self.chat_rows, self.text_rows
        )?;
        if self.skipped > 0 {
            write!(f, ", {} malformed rows skipped", self.skipped)?;
            for r in self.skip_reasons.iter().take(MAX_SKIP_REASONS) {
                write!(f, "\n  skipped {r}")?;
            }
            if self.skipped > MAX_SKIP_REASONS {
                write!(f, "\n  ... and {} more", self.skipped - MAX_SKIP_REASONS)?;
            }
        }
        Ok(())
    }
}

/// Why one row is malformed: the field (dotted path such as `chosen[0].role`,
/// or none for row-level problems) and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowError {
    pub field: Option<String>,
    pub message: String,
}

impl RowError {
    fn field(field: impl Into<String>, message: impl Into<String>) -> Self {
        RowError {
            field: Some(field.into()),
            message: message.into(),
        }
    }
    fn row(message: impl Into<String>) -> Self {
        RowError {
            field: None,
            message: message.into(),
        }
    }
}

impl fmt::Display for RowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.field {
            Some(field) => write!(f, "field \"{field}\": {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for RowError {}

/// Reads a dataset of `kind` rows: a file in any format [`Rows::open`] reads (JSONL, a JSON
/// array, CSV / TSV, Parquet; compressed with gzip or zstd), or the files a pattern names
/// ([`dataset_files`]: the shards of one split), read in name order as one dataset.
///
/// A malformed row is an error naming `file:line: field "...": ...` (`file: row N` where rows
/// are numbered); with `skip_bad` it is skipped instead and counted in the report, which keeps
/// the reasons. A file that yields no example at all is an error either way.
pub fn load_dataset(
    path: impl AsRef<Path>,
    kind: DatasetKind,
    skip_bad: bool,
) -> Result<(Vec<Example>, LoadReport)> {
    let name = path.as_ref().display().to_string();
    let mut examples = Vec::new();
    let mut report = LoadReport {
        path: name.clone(),
        ..Default::default()
    };
    for file in dataset_files(&name)? {
        let rows = Rows::open(&file)?;
        let first_example = examples.len();
        let (more, one) = collect_rows(rows, kind, skip_bad)?;
        examples.extend(more);
        report.add(one, first_example);
    }
    ensure_some(&name, kind, &examples, &report)?;
    Ok((examples, report))
}

fn ensure_some(
    name: &str,
    kind: DatasetKind,
    examples: &[Example],
    report: &LoadReport,
) -> Result<()> {
    if examples.is_empty() {
        let counts = format!(
            "{name}: no {kind} examples found ({} malformed rows, {} blank lines)",
            report.skipped, report.blank_lines
        );
        return Err(NoUsableRows::new(counts, &report.skip_reasons, report.skipped).into());
    }
    Ok(())
}

/// A dataset none of whose rows can be used: the counts and the first reasons, each
/// `file:line: ...`, so that the error says what to mend and not only how much failed.
/// Commands that report on rows (`lint`) tell it apart from a file that cannot be read.
#[derive(Debug)]
pub struct NoUsableRows(String);

impl NoUsableRows {
    /// `summary` and the first [`MAX_SKIP_REASONS`] of `reasons` (of `total` in all).
    pub fn new(summary: String, reasons: &[String], total: usize) -> NoUsableRows {
        let mut text = summary;
        for r in reasons.iter().take(MAX_SKIP_REASONS) {
            text.push_str("\n  ");
            text.push_str(r);
        }
        if total > MAX_SKIP_REASONS {
            text.push_str(&format!("\n  ... and {} more", total - MAX_SKIP_REASONS));
        }
        NoUsableRows(text)
    }
}

impl fmt::Display for NoUsableRows {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NoUsableRows {}

/// Parses every row of `rows` into examples, or fails on the first bad one (`skip_bad`:
/// skips and counts it).
fn collect_rows(
    mut rows: Rows<'_>,
    kind: DatasetKind,
    skip_bad: bool,
) -> Result<(Vec<Example>, LoadReport)> {
    let mut report = LoadReport {
        path: rows.name().to_string(),
        files: vec![LoadedFile {
            name: rows.name().to_string(),
            numbered_rows: rows.numbered(),
            first_example: 0,
        }],
        ..Default::default()
    };
    let mut examples = Vec::new();
    while let Some(row) = rows.next() {
        let row = row?;
        let parsed = row
            .value
            .map_err(RowError::row)
            .and_then(|v| parse_row(&v, kind, row.n));
        match parsed {
            Ok(ex) => {
                if ex.is_chat() {
                    report.chat_rows += 1;
                } else {
                    report.text_rows += 1;
                }
                report.loaded += 1;
                examples.push(ex);
            }
            Err(err) => {
                let msg = format!("{}: {err}", rows.location(row.n));
                if !skip_bad {
                    bail!(msg);
                }
                report.skipped += 1;
                report.skip_reasons.push(msg);
            }
        }
    }
    report.blank_lines = rows.blank_lines();
    Ok((examples, report))
}

/// [`load_dataset`] over a JSONL stream; `name` is used in messages. Unlike `load_dataset` an
/// empty input is not an error here.
pub fn read_jsonl(
    reader: impl BufRead,
    name: &str,
    kind: DatasetKind,
    skip_bad: bool,
) -> Result<(Vec<Example>, LoadReport)> {
    collect_rows(Rows::jsonl(reader, name), kind, skip_bad)
}

/// Parses one non-blank JSONL line into an example. `line` is recorded in the
/// example.
pub fn parse_line(text: &str, kind: DatasetKind, line: usize) -> Result<Example, RowError> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| RowError::row(format!("invalid JSON: {e}")))?;
    parse_row(&value, kind, line)
}

/// Validates one already-parsed JSON row.
pub fn parse_row(value: &Value, kind: DatasetKind, line: usize) -> Result<Example, RowError> {
    let obj = value.as_object().ok_or_else(|| {
        RowError::row(format!(
            "expected a JSON object, found {}",
            json_type(value)
        ))
    })?;
    if obj.get("tools").is_some_and(is_set) {
        return Err(RowError::field(
            "tools",
            "tool definitions are not read (lorafit trains on text turns, rendered without \
             them): render them into the system message or drop the field",
        ));
    }
    // A row of the other kind: the method, not the row, is what to change.
    let has = |k: &str| obj.contains_key(k);
    let sft_fields = ["completion", "text", "output"]
        .into_iter()
        .find(|&k| has(k));
    match kind {
        DatasetKind::Preference if !has("chosen") && !has("rejected") => {
            let sft_layout =
                sft_fields.or(["messages", "conversations"].into_iter().find(|&k| has(k)));
            if let Some(field) = sft_layout {
                return Err(RowError::row(format!(
                    "an SFT row (it has \"{field}\" and no \"chosen\"/\"rejected\"), where a \
                     preference method (orpo, dpo, simpo) needs chosen and rejected; to train on \
                     SFT rows pass --method sft"
                )));
            }
        }
        DatasetKind::Sft if has("chosen") && has("rejected") && sft_fields.is_none() => {
            return Err(RowError::row(
                "a preference row (\"chosen\" and \"rejected\"), where SFT needs a completion, \
                 messages or text; to train on preference pairs pass --method orpo (or dpo, simpo)"
                    .to_string(),
            ));
        }
        _ => {}
    }
    match kind {
        DatasetKind::Preference => Ok(Example::Preference {
            line,
            data: parse_preference(obj)?,
            weight: parse_weight(obj)?,
        }),
        DatasetKind::Sft => Ok(Example::Sft {
            line,
            data: parse_sft(obj)?,
            weight: parse_weight(obj)?,
        }),
    }
}

/// The largest row weight: weights are relative, and one times a loss must stay finite in f32
/// (a weight of 1e308 passed the load and ended the run at its step with an infinite loss).
pub const MAX_WEIGHT: f64 = 1e6;

/// A row's optional `weight`: a number in [0, `MAX_WEIGHT`]; absent (or null) is 1.
fn parse_weight(obj: &Map<String, Value>) -> Result<RowWeight, RowError> {
    match obj.get("weight") {
        None | Some(Value::Null) => Ok(RowWeight::default()),
        Some(Value::Number(n)) => match n.as_f64() {
            Some(w) if w.is_finite() && (0.0..=MAX_WEIGHT).contains(&w) => Ok(RowWeight(w)),
            _ => Err(RowError::field(
                "weight",
                format!("{n}: expected a number in [0, {MAX_WEIGHT:e}]"),
            )),
        },
        Some(other) => Err(RowError::field(
            "weight",
            format!(
                "expected a number in [0, {MAX_WEIGHT:e}], found {}",
                json_type(other)
            ),
        )),
    }
}

/// A field value that is either a string or a list of messages.
enum Field {
    Text(String),
    Chat(Vec<Message>),
}

/// Whether an optional field holds something: not null, and not an empty list or object (as
/// Parquet files with one schema for every row write an unused field).
fn is_set(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        _ => true,
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

fn get_field<'a>(obj: &'a Map<String, Value>, name: &str) -> Result<&'a Value, RowError> {
    match obj.get(name) {
        Some(v) => Ok(v),
        None => Err(RowError::field(name, "missing")),
    }
}

fn parse_field(obj: &Map<String, Value>, name: &str) -> Result<Field, RowError> {
    let v = get_field(obj, name)?;
    match v {
        Value::String(s) => Ok(Field::Text(s.clone())),
        Value::Array(items) => Ok(Field::Chat(parse_messages(items, name)?)),
        other => Err(RowError::field(
            name,
            format!(
                "expected a string or a list of messages, found {}",
                json_type(other)
            ),
        )),
    }
}

fn parse_messages(items: &[Value], field: &str) -> Result<Vec<Message>, RowError> {
    items
        .iter()
        .enumerate()
        .map(|(i, item)| parse_message(item, &format!("{field}[{i}]")))
        .collect()
}

fn parse_message(item: &Value, field: &str) -> Result<Message, RowError> {
    let obj = item.as_object().ok_or_else(|| {
        RowError::field(
            field,
            format!(
                "expected a message object {{\"role\", \"content\"}}, found {}",
                json_type(item)
            ),
        )
    })?;
    // What a message may carry that a text turn cannot: refused rather than dropped.
    if obj.get("tool_calls").is_some_and(is_set) || obj.get("function_call").is_some_and(is_set) {
        let key = if obj.get("tool_calls").is_some_and(is_set) {
            "tool_calls"
        } else {
            "function_call"
        };
        return Err(RowError::field(
            format!("{field}.{key}"),
            "tool calls are not read (lorafit trains on text turns): render them into \
             \"content\" or drop the row",
        ));
    }
    if obj.get("weight").is_some_and(|w| !w.is_null()) {
        return Err(RowError::field(
            format!("{field}.weight"),
            "per-message weights are not read (lorafit trains the final response and weighs \
             whole rows): drop it, or give the row a top-level \"weight\"",
        ));
    }
    // OpenAI/TRL messages are {role, content}; ShareGPT's are {from, value}.
    let (role_key, content_key) = if obj.contains_key("from") && !obj.contains_key("role") {
        ("from", "value")
    } else {
        ("role", "content")
    };
    let role = match obj.get(role_key) {
        Some(Value::String(r)) => Role::parse(r).ok_or_else(|| {
            RowError::field(
                format!("{field}.{role_key}"),
                format!("unknown role \"{r}\" (expected system, user, assistant or tool; ShareGPT's human, gpt)"),
            )
        })?,
        Some(other) => {
            return Err(RowError::field(
                format!("{field}.{role_key}"),
                format!("expected a string, found {}", json_type(other)),
            ));
        }
        None => return Err(RowError::field(format!("{field}.{role_key}"), "missing")),
    };
    let content = match obj.get(content_key) {
        Some(Value::String(c)) => c.clone(),
        Some(other) => {
            return Err(RowError::field(
                format!("{field}.{content_key}"),
                format!("expected a string, found {}", json_type(other)),
            ));
        }
        None => return Err(RowError::field(format!("{field}.{content_key}"), "missing")),
    };
    Ok(Message { role, content })
}

fn check_text_response(field: &str, s: &str) -> Result<(), RowError> {
    if s.trim().is_empty() {
        return Err(RowError::field(field, "empty response"));
    }
    Ok(())
}

/// A response (the messages after the prompt) must be non-empty, end with an
/// assistant message, and not be all blank.
fn check_chat_response(field: &str, msgs: &[Message]) -> Result<(), RowError> {
    let Some(last) = msgs.last() else {
        return Err(RowError::field(field, "empty response (no messages)"));
    };
    if last.role != Role::Assistant {
        return Err(RowError::field(
            field,
            format!(
                "the response must end with an assistant message, found role \"{}\"",
                last.role
            ),
        ));
    }
    if msgs.iter().all(|m| m.content.trim().is_empty()) {
        return Err(RowError::field(field, "empty response"));
    }
    Ok(())
}

/// A ShareGPT `conversations` list (or any message list) under `field`.
fn parse_conversation(obj: &Map<String, Value>, field: &str) -> Result<Vec<Message>, RowError> {
    match get_field(obj, field)? {
        Value::Array(items) => parse_messages(items, field),
        other => Err(RowError::field(
            field,
            format!("expected a list of messages, found {}", json_type(other)),
        )),
    }
}

/// A ShareGPT preference response: one message object, a list of messages,
/// or a string (the assistant's reply).
fn parse_sharegpt_response(
    obj: &Map<String, Value>,
    field: &str,
) -> Result<Vec<Message>, RowError> {
    let msgs = match get_field(obj, field)? {
        message @ Value::Object(_) => vec![parse_message(message, field)?],
        Value::Array(items) => parse_messages(items, field)?,
        Value::String(text) => vec![Message::assistant(text.clone())],
        other => {
            return Err(RowError::field(
                field,
                format!(
                    "expected a message, a list of messages or a string, found {}",
                    json_type(other)
                ),
            ))
        }
    };
    check_chat_response(field, &msgs)?;
    Ok(msgs)
}

/// Splits two whole conversations into their shared leading messages (the
/// prompt) and what follows.
fn implicit_prompt(
    chosen: Vec<Message>,
    rejected: Vec<Message>,
) -> Result<PreferenceData, RowError> {
    let mut common = chosen
        .iter()
        .zip(rejected.iter())
        .take_while(|(a, b)| a == b)
        .count();
    if chosen == rejected {
        // A tie: the last message is each response, counted as chosen == rejected.
        common = common.saturating_sub(1);
    }
    if common == 0 {
        return Err(RowError::field(
            "prompt",
            "missing, and \"chosen\" and \"rejected\" share no leading messages to use as an implicit prompt",
        ));
    }
    let prompt = chosen[..common].to_vec();
    let chosen = chosen[common..].to_vec();
    let rejected = rejected[common..].to_vec();
    check_chat_response("chosen", &chosen)?;
    check_chat_response("rejected", &rejected)?;
    Ok(PreferenceData::Chat {
        prompt,
        chosen,
        rejected,
    })
}

fn check_text_prompt(prompt: &str) -> Result<(), RowError> {
    if prompt.trim().is_empty() {
        return Err(RowError::field("prompt", "empty prompt"));
    }
    Ok(())
}

fn parse_preference(obj: &Map<String, Value>) -> Result<PreferenceData, RowError> {
    if obj.contains_key("conversations") && !obj.contains_key("prompt") {
        // ShareGPT preference rows: the conversation so far, then one chosen
        // and one rejected reply.
        let prompt = parse_conversation(obj, "conversations")?;
        if prompt.is_empty() {
            return Err(RowError::field("conversations", "empty list of messages"));
        }
        return Ok(PreferenceData::Chat {
            prompt,
            chosen: parse_sharegpt_response(obj, "chosen")?,
            rejected: parse_sharegpt_response(obj, "rejected")?,
        });
    }
    let chosen = parse_field(obj, "chosen")?;
    let rejected = parse_field(obj, "rejected")?;
    if obj.contains_key("prompt") {
        let prompt = parse_field(obj, "prompt")?;
        return match (prompt, chosen, rejected) {
            (Field::Text(prompt), Field::Chat(chosen), Field::Chat(rejected)) => {
                // The H4 UltraFeedback layout: `prompt` is the question as a
                // string and chosen/rejected are whole conversations that
                // start with it.
                check_text_prompt(&prompt)?;
                let data = implicit_prompt(chosen, rejected).map_err(|e| {
                    if e.field.as_deref() == Some("prompt") {
                        RowError::field(
                            "prompt",
                            "a string while \"chosen\" and \"rejected\" are whole \
                             conversations, and those share no leading messages (their first \
                             turns differ; the H4 layout repeats the prompt as the first user \
                             turn of both)",
                        )
                    } else {
                        e
                    }
                })?;
                if let PreferenceData::Chat { prompt: shared, .. } = &data {
                    let found = shared
                        .iter()
                        .any(|m| m.role == Role::User && m.content.trim() == prompt.trim());
                    if !found {
                        return Err(RowError::field(
                            "prompt",
                            "a string while \"chosen\" and \"rejected\" are whole conversations, and no user turn they share has this text (the H4 layout repeats the prompt as the first user turn)",
                        ));
                    }
                }
                Ok(data)
            }
            (Field::Text(prompt), Field::Text(chosen), Field::Text(rejected)) => {
                check_text_prompt(&prompt)?;
                check_text_response("chosen", &chosen)?;
                check_text_response("rejected", &rejected)?;
                Ok(PreferenceData::Text {
                    prompt,
                    chosen,
                    rejected,
                })
            }
            (Field::Chat(prompt), Field::Chat(chosen), Field::Chat(rejected)) => {
                if prompt.is_empty() {
                    return Err(RowError::field("prompt", "empty list of messages"));
                }
                check_chat_response("chosen", &chosen)?;
                check_chat_response("rejected", &rejected)?;
                Ok(PreferenceData::Chat {
                    prompt,
                    chosen,
                    rejected,
                })
            }
            (Field::Text(_), c, r) => {
                let bad = if matches!(c, Field::Chat(_)) {
                    "chosen"
                } else {
                    debug_assert!(matches!(r, Field::Chat(_)));
                    "rejected"
                };
                Err(RowError::field(
                    bad,
                    "expected a string, like \"prompt\" (text and message lists cannot be mixed)",
                ))
            }
            (Field::Chat(_), c, _) => {
                let bad = if matches!(c, Field::Text(_)) {
                    "chosen"
                } else {
                    "rejected"
                };
                Err(RowError::field(
                    bad,
                    "expected a list of messages, like \"prompt\" (text and message lists cannot be mixed)",
                ))
            }
        };
    }
    // Implicit prompt: chosen and rejected are whole conversations, or whole texts (the
    // Anthropic HH layout, "\n\nHuman: ...\n\nAssistant: ...").
    match (chosen, rejected) {
        (Field::Chat(chosen), Field::Chat(rejected)) => implicit_prompt(chosen, rejected),
        (Field::Text(chosen), Field::Text(rejected)) => implicit_text_prompt(&chosen, &rejected),
        _ => Err(RowError::field(
            "prompt",
            "missing, and \"chosen\" and \"rejected\" are not both texts or both lists of \
             messages (an implicit prompt is their shared beginning)",
        )),
    }
}

/// The implicit prompt of two whole texts, as TRL's `extract_prompt` splits them (so that
/// `tokenization = "trl"` gives TRL's ids): the text up to the first character where they
/// differ, less a space just before it (which goes to the responses). Texts that never differ
/// (equal, or one the beginning of the other) have no such point and are refused: TRL would cut
/// them one character before the shorter one's end.
fn implicit_text_prompt(chosen: &str, rejected: &str) -> Result<PreferenceData, RowError> {
    let differ = chosen
        .char_indices()
        .zip(rejected.chars())
        .find(|((_, a), b)| a != b)
        .map(|((at, _), _)| at);
    let Some(mut at) = differ else {
        return Err(RowError::field(
            "prompt",
            "missing, and \"chosen\" and \"rejected\" never differ (equal, or one begins the \
             other), so there is no point to split an implicit prompt at",
        ));
    };
    if at > 0 && chosen[..at].ends_with(' ') {
        at -= 1;
    }
    let prompt = &chosen[..at];
    if prompt.trim().is_empty() {
        return Err(RowError::field(
            "prompt",
            "missing, and \"chosen\" and \"rejected\" share no leading text to use as an \
             implicit prompt",
        ));
    }
    let (chosen, rejected) = (&chosen[at..], &rejected[at..]);
    check_text_response("chosen", chosen)?;
    check_text_response("rejected", rejected)?;
    Ok(PreferenceData::Text {
        prompt: prompt.to_string(),
        chosen: chosen.to_string(),
        rejected: rejected.to_string(),
    })
}

/// A conversation whose last message is the assistant's completion.
fn split_conversation(field: &str, mut msgs: Vec<Message>) -> Result<SftData, RowError> {
    let Some(last) = msgs.last() else {
        return Err(RowError::field(field, "empty list of messages"));
    };
    if last.role != Role::Assistant {
        return Err(RowError::field(
            field,
            format!(
                "the conversation must end with an assistant message (the completion), found role \"{}\"",
                last.role
            ),
        ));
    }
    if msgs.len() < 2 {
        return Err(RowError::field(
            field,
            "needs at least one message before the final assistant message",
        ));
    }
    let completion: Vec<Message> = msgs.split_off(msgs.len() - 1);
    check_chat_response(&format!("{field}[{}]", msgs.len()), &completion)?;
    Ok(SftData::Chat {
        prompt: msgs,
        completion,
    })
}

/// An optional string field: absent or null is empty.
fn opt_string(obj: &Map<String, Value>, name: &str) -> Result<String, RowError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Err(RowError::field(
            name,
            format!("expected a string, found {}", json_type(other)),
        )),
    }
}

/// An Alpaca row: `instruction` (and `input`, joined to it by a blank line)
/// is the user's turn, `output` the assistant's, `system` an optional system
/// turn.
fn parse_alpaca(obj: &Map<String, Value>) -> Result<SftData, RowError> {
    let instruction = match get_field(obj, "instruction")? {
        Value::String(s) => s.clone(),
        other => {
            return Err(RowError::field(
                "instruction",
                format!("expected a string, found {}", json_type(other)),
            ))
        }
    };
    let input = opt_string(obj, "input")?;
    let system = opt_string(obj, "system")?;
    let output = match get_field(obj, "output")? {
        Value::String(s) => s.clone(),
        other => {
            return Err(RowError::field(
                "output",
                format!("expected a string, found {}", json_type(other)),
            ))
        }
    };
    if instruction.trim().is_empty() && input.trim().is_empty() {
        return Err(RowError::field(
            "instruction",
            "empty instruction (and no input)",
        ));
    }
    check_text_response("output", &output)?;
    let user = match (instruction.trim().is_empty(), input.trim().is_empty()) {
        (false, false) => format!("{instruction}\n\n{input}"),
        (false, true) => instruction,
        (true, _) => input,
    };
    let mut prompt = Vec::with_capacity(2);
    if !system.trim().is_empty() {
        prompt.push(Message::system(system));
    }
    prompt.push(Message::user(user));
    Ok(SftData::Chat {
        prompt,
        completion: vec![Message::assistant(output)],
    })
}

fn parse_sft(obj: &Map<String, Value>) -> Result<SftData, RowError> {
    if obj.contains_key("completion") {
        let prompt = parse_field(obj, "prompt")?;
        let completion = parse_field(obj, "completion")?;
        return match (prompt, completion) {
            (Field::Text(prompt), Field::Text(completion)) => {
                check_text_response("completion", &completion)?;
                Ok(SftData::Text { prompt, completion })
            }
            (Field::Chat(prompt), Field::Chat(completion)) => {
                if prompt.is_empty() {
                    return Err(RowError::field("prompt", "empty list of messages"));
                }
                check_chat_response("completion", &completion)?;
                Ok(SftData::Chat { prompt, completion })
            }
            (Field::Text(_), Field::Chat(_)) => Err(RowError::field(
                "completion",
                "expected a string, like \"prompt\" (text and message lists cannot be mixed)",
            )),
            (Field::Chat(_), Field::Text(_)) => Err(RowError::field(
                "completion",
                "expected a list of messages, like \"prompt\" (text and message lists cannot be mixed)",
            )),
        };
    }
    for field in ["messages", "conversations"] {
        if obj.contains_key(field) {
            return split_conversation(field, parse_conversation(obj, field)?);
        }
    }
    if obj.contains_key("instruction") || obj.contains_key("output") {
        return parse_alpaca(obj);
    }
    if let Some(v) = obj.get("text") {
        let Value::String(text) = v else {
            return Err(RowError::field(
                "text",
                format!("expected a string, found {}", json_type(v)),
            ));
        };
        if text.trim().is_empty() {
            return Err(RowError::field("text", "empty text"));
        }
        return Ok(SftData::Text {
            prompt: String::new(),
            completion: text.clone(),
        });
    }
    if obj.contains_key("prompt") {
        return Err(RowError::field("completion", "missing"));
    }
    Err(RowError::row(
        "expected an SFT row: {\"prompt\", \"completion\"}, {\"messages\"}, {\"conversations\"} (ShareGPT), {\"instruction\", \"input\", \"output\"} (Alpaca) or {\"text\"}",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn read(kind: DatasetKind, skip: bool, text: &str) -> Result<(Vec<Example>, LoadReport)> {
        read_jsonl(Cursor::new(text.as_bytes()), "data/train.jsonl", kind, skip)
    }

    fn err(kind: DatasetKind, text: &str) -> String {
        read(kind, false, text).unwrap_err().to_string()
    }

    #[test]
    fn text_preference_rows() {
        let (ex, rep) = read(
            DatasetKind::Preference,
            false,
            "{\"prompt\":\"Q: 1+1?\",\"chosen\":\" 2\",\"rejected\":\" 3\",\"id\":7}\n\n",
        )
        .unwrap();
        assert_eq!(rep.loaded, 1);
        assert_eq!(rep.blank_lines, 1);
        assert_eq!(rep.text_rows, 1);
        assert_eq!(
            ex[0],
            Example::Preference {
                line: 1,
                data: PreferenceData::Text {
                    prompt: "Q: 1+1?".into(),
                    chosen: " 2".into(),
                    rejected: " 3".into()
                },
                weight: RowWeight::default(),
            }
        );
    }

    #[test]
    fn chat_preference_rows() {
        let row = r#"{"prompt":[{"role":"system","content":"Be nice."},{"role":"user","content":"Hi"}],"chosen":[{"role":"assistant","content":"Hello!"}],"rejected":[{"role":"assistant","content":"Go away."}]}"#;
        let (ex, rep) = read(DatasetKind::Preference, false, row).unwrap();
        assert_eq!(rep.chat_rows, 1);
        let Example::Preference {
            data:
                PreferenceData::Chat {
                    prompt,
                    chosen,
                    rejected,
                },
            ..
        } = &ex[0]
        else {
            panic!("expected chat")
        };
        assert_eq!(prompt.len(), 2);
        assert_eq!(chosen, &vec![Message::assistant("Hello!")]);
        assert_eq!(rejected, &vec![Message::assistant("Go away.")]);
    }

    #[test]
    fn implicit_prompt_is_longest_common_prefix() {
        let row = r#"{"chosen":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"},{"role":"user","content":"2+2?"},{"role":"assistant","content":"4"}],
                     "rejected":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"},{"role":"user","content":"2+2?"},{"role":"assistant","content":"5"}]}"#
            .replace('\n', " ");
        let (ex, _) = read(DatasetKind::Preference, false, &row).unwrap();
        let Example::Preference {
            data:
                PreferenceData::Chat {
                    prompt,
                    chosen,
                    rejected,
                },
            ..
        } = &ex[0]
        else {
            panic!("expected chat")
        };
        assert_eq!(
            prompt,
            &vec![
                Message::user("Hi"),
                Message::assistant("Hello"),
                Message::user("2+2?")
            ]
        );
        assert_eq!(chosen, &vec![Message::assistant("4")]);
        assert_eq!(rejected, &vec![Message::assistant("5")]);
    }

    #[test]
    fn implicit_prompt_errors() {
        // One response is a prefix of the other: empty chosen response.
        let row = r#"{"chosen":[{"role":"user","content":"Hi"},{"role":"assistant","content":"A"}],"rejected":[{"role":"user","content":"Hi"},{"role":"assistant","content":"A"},{"role":"user","content":"x"},{"role":"assistant","content":"B"}]}"#;
        assert_eq!(
            err(DatasetKind::Preference, row),
            "data/train.jsonl:1: field \"chosen\": empty response (no messages)"
        );
        let row = r#"{"chosen":[{"role":"user","content":"Hi"},{"role":"assistant","content":"A"}],"rejected":[{"role":"user","content":"Yo"},{"role":"assistant","content":"B"}]}"#;
        assert!(err(DatasetKind::Preference, row)
            .starts_with("data/train.jsonl:1: field \"prompt\": missing, and"));
        let row = r#"{"chosen":"a","rejected":"b"}"#;
        assert!(err(DatasetKind::Preference, row)
            .starts_with("data/train.jsonl:1: field \"prompt\": missing, and \"chosen\" and \"rejected\" share no leading text"));
        for row in [
            r#"{"chosen":"Q: x A: y","rejected":"Q: x A: y"}"#,
            r#"{"chosen":"Q: x A: y","rejected":"Q: x A: yz"}"#,
        ] {
            assert!(
                err(DatasetKind::Preference, row).contains("never differ"),
                "{row}"
            );
        }
        let row = r#"{"chosen":"Q: x","rejected":[{"role":"assistant","content":"b"}]}"#;
        assert!(err(DatasetKind::Preference, row).contains("not both texts"));
    }

    /// Whole texts without a prompt split as TRL's `extract_prompt` splits them: at the first
    /// character where they differ, a space before it going to the responses; the split may
    /// fall inside the answers when they begin alike.
    #[test]
    fn implicit_text_prompt_splits_as_trl_does() {
        let split = |c: &str, r: &str| {
            let row = serde_json::json!({"chosen": c, "rejected": r}).to_string();
            match read(DatasetKind::Preference, false, &row)
                .unwrap()
                .0
                .remove(0)
            {
                Example::Preference {
                    data:
                        PreferenceData::Text {
                            prompt,
                            chosen,
                            rejected,
                        },
                    ..
                } => (prompt, chosen, rejected),
                other => panic!("{other:?}"),
            }
        };
        let own = |s: [&str; 3]| (s[0].to_string(), s[1].to_string(), s[2].to_string());
        assert_eq!(
            split(
                "\n\nHuman: Hi\n\nAssistant: Hello!",
                "\n\nHuman: Hi\n\nAssistant: Go away."
            ),
            own(["\n\nHuman: Hi\n\nAssistant:", " Hello!", " Go away."])
        );
        assert_eq!(
            split(
                "\n\nHuman: Hi\n\nAssistant: I think so",
                "\n\nHuman: Hi\n\nAssistant: I don't"
            ),
            own(["\n\nHuman: Hi\n\nAssistant: I", " think so", " don't"])
        );
        // No space before the first difference: the split is right there.
        assert_eq!(split("ab1", "ab2"), own(["ab", "1", "2"]));
        // Characters, not bytes.
        assert_eq!(split("héé x", "héé y"), own(["héé", " x", " y"]));
    }

    #[test]
    fn error_messages_name_file_line_and_field() {
        let good = r#"{"prompt":"p","chosen":"a","rejected":"b"}"#;
        let text =
            format!("{good}\n\n{good}\n{{\"prompt\":\"p\",\"chosen\":5,\"rejected\":\"b\"}}\n");
        assert_eq!(
            err(DatasetKind::Preference, &text),
            "data/train.jsonl:4: field \"chosen\": expected a string or a list of messages, found a number"
        );
        assert_eq!(
            err(DatasetKind::Preference, r#"{"prompt":"p","chosen":"a"}"#),
            "data/train.jsonl:1: field \"rejected\": missing"
        );
        assert!(err(DatasetKind::Preference, "{\"prompt\": ")
            .starts_with("data/train.jsonl:1: invalid JSON:"));
        assert_eq!(
            err(DatasetKind::Preference, "[1,2]"),
            "data/train.jsonl:1: expected a JSON object, found a list"
        );
        assert_eq!(
            err(
                DatasetKind::Preference,
                r#"{"prompt":"p","chosen":"  ","rejected":"b"}"#
            ),
            "data/train.jsonl:1: field \"chosen\": empty response"
        );
        assert_eq!(
            err(
                DatasetKind::Preference,
                r#"{"prompt":[{"role":"user","content":"x"}],"chosen":[{"role":"bot","content":"a"}],"rejected":[{"role":"assistant","content":"b"}]}"#
            ),
            "data/train.jsonl:1: field \"chosen[0].role\": unknown role \"bot\" (expected system, user, assistant or tool; ShareGPT's human, gpt)"
        );
        assert_eq!(
            err(
                DatasetKind::Preference,
                r#"{"prompt":[{"role":"user"}],"chosen":[{"role":"assistant","content":"a"}],"rejected":[{"role":"assistant","content":"b"}]}"#
            ),
            "data/train.jsonl:1: field \"prompt[0].content\": missing"
        );
        assert_eq!(
            err(
                DatasetKind::Preference,
                r#"{"prompt":"p","chosen":[{"role":"assistant","content":"a"}],"rejected":"b"}"#
            ),
            "data/train.jsonl:1: field \"chosen\": expected a string, like \"prompt\" (text and message lists cannot be mixed)"
        );
        assert_eq!(
            err(
                DatasetKind::Preference,
                r#"{"prompt":[{"role":"user","content":"x"}],"chosen":[{"role":"user","content":"a"}],"rejected":[{"role":"assistant","content":"b"}]}"#
            ),
            "data/train.jsonl:1: field \"chosen\": the response must end with an assistant message, found role \"user\""
        );
    }

    #[test]
    fn skip_bad_counts_and_keeps_reasons() {
        let good = r#"{"prompt":"p","chosen":"a","rejected":"b"}"#;
        let mut text = String::new();
        for i in 0..10 {
            if i % 2 == 0 {
                text.push_str(good);
            } else {
                text.push_str("not json");
            }
            text.push('\n');
        }
        text.push_str("   \n");
        let (ex, rep) = read(DatasetKind::Preference, true, &text).unwrap();
        assert_eq!(ex.len(), 5);
        assert_eq!(rep.loaded, 5);
        assert_eq!(rep.skipped, 5);
        assert_eq!(rep.blank_lines, 1);
        assert_eq!(rep.skip_reasons.len(), MAX_SKIP_REASONS);
        assert!(rep.skip_reasons[0].starts_with("data/train.jsonl:2: invalid JSON"));
        assert_eq!(ex[1].line(), 3);
        let shown = rep.to_string();
        assert!(shown.contains("5 malformed rows skipped"), "{shown}");
        // Without skip_bad the first bad row is fatal.
        assert!(read(DatasetKind::Preference, false, &text).is_err());
    }

    #[test]
    fn sft_forms() {
        let text = [
            r#"{"prompt":"Q: hi","completion":" A: hello"}"#,
            r#"{"messages":[{"role":"system","content":"S"},{"role":"user","content":"U"},{"role":"assistant","content":"A"}]}"#,
            r#"{"text":"Once upon a time."}"#,
            r#"{"prompt":[{"role":"user","content":"U"}],"completion":[{"role":"assistant","content":"A"}]}"#,
        ]
        .join("\n");
        let (ex, rep) = read(DatasetKind::Sft, false, &text).unwrap();
        assert_eq!((rep.loaded, rep.chat_rows, rep.text_rows), (4, 2, 2));
        assert_eq!(
            ex[0],
            Example::Sft {
                line: 1,
                weight: RowWeight::default(),
                data: SftData::Text {
                    prompt: "Q: hi".into(),
                    completion: " A: hello".into()
                }
            }
        );
        assert_eq!(
            ex[1],
            Example::Sft {
                line: 2,
                weight: RowWeight::default(),
                data: SftData::Chat {
                    prompt: vec![Message::system("S"), Message::user("U")],
                    completion: vec![Message::assistant("A")]
                }
            }
        );
        assert_eq!(
            ex[2],
            Example::Sft {
                line: 3,
                weight: RowWeight::default(),
                data: SftData::Text {
                    prompt: String::new(),
                    completion: "Once upon a time.".into()
                }
            }
        );
        assert!(ex[3].is_chat());
    }

    #[test]
    fn sft_errors() {
        assert_eq!(
            err(
                DatasetKind::Sft,
                r#"{"messages":[{"role":"user","content":"U"}]}"#
            ),
            "data/train.jsonl:1: field \"messages\": the conversation must end with an assistant message (the completion), found role \"user\""
        );
        assert_eq!(
            err(DatasetKind::Sft, r#"{"prompt":"x"}"#),
            "data/train.jsonl:1: field \"completion\": missing"
        );
        assert_eq!(
            err(DatasetKind::Sft, r#"{"text":3}"#),
            "data/train.jsonl:1: field \"text\": expected a string, found a number"
        );
        assert_eq!(
            err(DatasetKind::Sft, r#"{"foo":"bar"}"#),
            "data/train.jsonl:1: expected an SFT row: {\"prompt\", \"completion\"}, {\"messages\"}, {\"conversations\"} (ShareGPT), {\"instruction\", \"input\", \"output\"} (Alpaca) or {\"text\"}"
        );
        assert_eq!(
            err(DatasetKind::Sft, r#"{"prompt":"x","completion":""}"#),
            "data/train.jsonl:1: field \"completion\": empty response"
        );
    }

    #[test]
    fn load_dataset_reports_path_and_empty_file() {
        let dir = std::env::temp_dir().join(format!("lorafit-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.jsonl");
        std::fs::write(&p, "\u{feff}{\"text\":\"hello\"}\r\n").unwrap();
        let (ex, rep) = load_dataset(&p, DatasetKind::Sft, false).unwrap();
        assert_eq!(ex.len(), 1);
        assert_eq!(rep.path, p.display().to_string());
        std::fs::write(&p, "\n\n").unwrap();
        let e = load_dataset(&p, DatasetKind::Sft, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no SFT examples found"), "{e}");
        let e = load_dataset(dir.join("missing.jsonl"), DatasetKind::Sft, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing.jsonl"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
