//! Chat templates: rendering chat messages to text the way Hugging Face's
//! `apply_chat_template` does, and finding the exact prompt/response boundary.
//!
//! Models are trained on the text their chat template produces, so training
//! rows in message form must be rendered with the very template the model
//! ships (from `tokenizer_config.json`, a sibling `chat_template.jinja`, or
//! GGUF metadata `tokenizer.chat_template`). The templates are Jinja2 written
//! for Python, so this module sets minijinja up like transformers' sandbox
//! (`trim_blocks`, `lstrip_blocks`, `raise_exception`, a Python-style `tojson`,
//! `strftime_now`) and implements the Python string/dict methods templates
//! call (`.strip()`, `.startswith()`, `.items()`, ...) through
//! `set_unknown_method_callback`, so no extra crate is needed.
//!
//! The boundary between prompt and response is found TRL's way: the prompt
//! rendered with `add_generation_prompt=true` must be a prefix of the
//! prompt+response rendered without it; the response text is the rest.
//!
//! A template read from a file (`chat_template`, `--chat-template`) must show
//! the messages it is given (`ChatTemplate::check_shows_messages`): any text
//! file compiles as Jinja, and a dataset or a tokenizer.json named by mistake
//! would otherwise render its own text for every conversation. Generation
//! holds the model's own template to the same check
//! (`ChatTemplate::generation_prompt`), since a prompt it drops is not seen.
//!
//! A template knows where it was read from (`origin`), so that its errors name
//! that file (or GGUF key) and not the one that led to it.

use std::io;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use minijinja::value::{from_args, Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::Serialize;

use super::dataset::Message;

const TEMPLATE_NAME: &str = "chat_template";

/// The user message of the conversations a template from a file is probed with: words no
/// template writes by itself, in lower case without padding (templates `trim` contents).
const PROBE_USER: &str = "probe question 4711 for the template";
const PROBE_SYSTEM: &str = "probe system message";
const PROBE_ASSISTANT: &str = "probe answer";

/// How errors about a model's own template end: what to do instead.
const HINT: &str = "set `chat_template` to another template (--chat-template FILE: a Jinja \
                    file or a tokenizer_config.json)";

/// A compiled chat template plus the bos/eos strings it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    /// Where the template was read from (a file, a GGUF's metadata key), for errors; empty for
    /// one given as text.
    origin: String,
    /// Why a model's own template does not compile (`from_model_folder`, `from_gguf_metadata`):
    /// said where it is used, so that a template given in its place still can be.
    compile_error: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("origin", &self.origin)
            .finish()
    }
}

#[derive(Serialize)]
struct RenderContext<'a> {
    messages: &'a [Message],
    add_generation_prompt: bool,
    bos_token: &'a str,
    eos_token: &'a str,
}

/// What rendering the probe conversations showed (`ChatTemplate::probe`).
enum Probe {
    /// One rendered with the user's message in it.
    Shows,
    /// Those that rendered (the first's text here) left the user's message out.
    Hides(String),
    /// None rendered: the first error.
    Fails(anyhow::Error),
}

/// A template's parts as a tokenizer_config.json gives them: its Jinja source, bos and eos.
type ConfigParts = (String, String, String);

impl ChatTemplate {
    /// Compiles `template` (Jinja source). `bos_token`/`eos_token` are the
    /// token *strings* (e.g. `"<|im_start|>"`), empty when unknown.
    pub fn new(
        template: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self> {
        let source = template.into();
        let mut env = Environment::new();
        // transformers compiles chat templates with these settings.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", py_tojson);
        env.set_unknown_method_callback(py_method);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| anyhow!("chat template does not compile: {}", describe(&e)))?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            origin: String::new(),
            compile_error: None,
        })
    }

    /// The template, naming `origin` (the file or GGUF key it was read from) in its errors.
    pub fn with_origin(mut self, origin: impl Into<String>) -> Self {
        self.origin = origin.into();
        self
    }

    /// Where the template was read from; empty for one given as text.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// [`new`](Self::new) for a model's own template: one that does not compile is returned
    /// all the same and fails where it is used ([`check_compiles`](Self::check_compiles),
    /// [`render`](Self::render)).
    fn new_or_deferred(parts: ConfigParts, origin: String) -> Self {
        let (source, bos_token, eos_token) = parts;
        match Self::new(source.clone(), bos_token.clone(), eos_token.clone()) {
            Ok(t) => t.with_origin(origin),
            Err(e) => ChatTemplate {
                env: Environment::new(),
                source,
                bos_token,
                eos_token,
                origin,
                compile_error: Some(format!("{e:#}")),
            },
        }
    }

    /// Reads `chat_template`, `bos_token` and `eos_token` from a Hugging Face
    /// `tokenizer_config.json`. The template may be a string or a list of
    /// `{name, template}` (the one named `default` is used, else the first).
    /// A sibling `chat_template.jinja` (how newer transformers save it) wins
    /// over the config's template, as in transformers. `Ok(None)` if there
    /// is neither. Errors in the template name the file it came from.
    pub fn from_tokenizer_config(path: impl AsRef<Path>) -> Result<Option<Self>> {
        let Some((parts, origin)) = read_tokenizer_config(path.as_ref())? else {
            return Ok(None);
        };
        let (source, bos, eos) = parts;
        let template =
            Self::new(source, bos, eos).with_context(|| format!("chat template from {origin}"))?;
        Ok(Some(template.with_origin(origin)))
    }

    /// A model folder's own template: [`from_tokenizer_config`](Self::from_tokenizer_config)
    /// on its `tokenizer_config.json`, except that a template that does not compile is
    /// returned all the same and fails where it is used
    /// ([`check_compiles`](Self::check_compiles), [`render`](Self::render)), so that a
    /// template given in its place (`model_files::run_template`) can still be used.
    pub fn from_model_folder(dir: &Path) -> Result<Option<Self>> {
        Ok(read_tokenizer_config(&dir.join("tokenizer_config.json"))?
            .map(|(parts, origin)| Self::new_or_deferred(parts, origin)))
    }

    /// A GGUF file's `tokenizer.chat_template`, kept as
    /// [`from_model_folder`](Self::from_model_folder) keeps a folder's.
    pub fn from_gguf_metadata(
        path: &Path,
        template: String,
        bos_token: String,
        eos_token: String,
    ) -> Self {
        Self::new_or_deferred(
            (template, bos_token, eos_token),
            format!("{} (its tokenizer.chat_template)", path.display()),
        )
    }

    /// [`from_tokenizer_config`](Self::from_tokenizer_config) on parsed JSON;
    /// `template_file` is a `chat_template.jinja` beside it, used in place of
    /// the config's `chat_template`.
    pub fn from_tokenizer_config_value(
        config: &serde_json::Value,
        template_file: Option<&Path>,
    ) -> Result<Option<Self>> {
        match config_parts(config, template_file)? {
            Some((source, bos, eos)) => Ok(Some(Self::new(source, bos, eos)?)),
            None => Ok(None),
        }
    }

    /// A template from a file: a Jinja file, or a `tokenizer_config.json`
    /// (by its `.json` name) whose `chat_template` is used. `bos_token` and
    /// `eos_token` are the model tokenizer's token strings (a config's own
    /// ones win). Errors name the file.
    pub fn from_file(path: impl AsRef<Path>, bos_token: &str, eos_token: &str) -> Result<Self> {
        let path = path.as_ref();
        let is_json = path.extension().and_then(|e| e.to_str()) == Some("json");
        if is_json {
            let template = Self::from_tokenizer_config(path)?
                .ok_or_else(|| anyhow!("{}: has no \"chat_template\"", path.display()))?;
            template
                .check_shows_messages()
                .with_context(|| path.display().to_string())?;
            return Ok(template);
        }
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading the chat template {}", path.display()))?;
        if text.trim().is_empty() {
            bail!("{}: the chat template file is empty", path.display());
        }
        let template =
            Self::new(text, bos_token, eos_token).with_context(|| path.display().to_string())?;
        template
            .check_shows_messages()
            .with_context(|| path.display().to_string())?;
        Ok(template.with_origin(path.display().to_string()))
    }

    /// Whether the template shows the conversation it is given: probe conversations — a user
    /// message alone with the generation prompt; a system, user and assistant turn; a user and
    /// assistant turn — must, for at least one the template accepts (Gemma 2's refuses a system
    /// message), render to text holding the user's content. Every text file compiles as Jinja:
    /// a dataset or a tokenizer.json given as the template renders its own text whatever the
    /// messages, and this refuses it.
    pub fn check_shows_messages(&self) -> Result<()> {
        match self.probe() {
            Probe::Shows => Ok(()),
            Probe::Hides(text) => Err(hides_messages(&text)),
            Probe::Fails(error) => Err(error.context(
                "the chat template renders none of the probe conversations (a user message; a \
                 system, user and assistant turn; a user and assistant turn)",
            )),
        }
    }

    /// Renders the probe conversations of [`check_shows_messages`](Self::check_shows_messages).
    fn probe(&self) -> Probe {
        let probes: [(&[Message], bool); 3] = [
            (&[Message::user(PROBE_USER)], true),
            (
                &[
                    Message::system(PROBE_SYSTEM),
                    Message::user(PROBE_USER),
                    Message::assistant(PROBE_ASSISTANT),
                ],
                false,
            ),
            (
                &[
                    Message::user(PROBE_USER),
                    Message::assistant(PROBE_ASSISTANT),
                ],
                false,
            ),
        ];
        let mut rendered_without = None;
        let mut first_error = None;
        for (messages, add_generation_prompt) in probes {
            match self.render(messages, add_generation_prompt) {
                Ok(text) if text.contains(PROBE_USER) => return Probe::Shows,
                Ok(text) => {
                    rendered_without.get_or_insert(text);
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match rendered_without {
            Some(text) => Probe::Hides(text),
            None => Probe::Fails(first_error.expect("each probe either rendered or failed")),
        }
    }

    /// An error for a template that does not compile (a model's own, kept by
    /// [`from_model_folder`](Self::from_model_folder) or
    /// [`from_gguf_metadata`](Self::from_gguf_metadata)), naming where it came from.
    pub fn check_compiles(&self) -> Result<()> {
        match &self.compile_error {
            Some(e) => Err(self.with_hint(anyhow!("{e}"))),
            None => Ok(()),
        }
    }

    /// What `generate` and `chat` give the model for `messages`: their rendering with the
    /// generation prompt. Refused, naming where the template came from, where
    /// [`check_for_generation`](Self::check_for_generation) refuses the template or it renders
    /// nothing for these messages: the model would be answering a prompt it was never given.
    pub fn generation_prompt(&self, messages: &[Message]) -> Result<String> {
        self.check_for_generation()?;
        let text = self
            .render(messages, true)
            .map_err(|e| self.with_origin_context(e))?;
        if text.trim().is_empty() {
            let roles: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
            return Err(self.with_hint(anyhow!(
                "the chat template rendered nothing for this conversation (messages: {}), so \
                 the model would be given no prompt",
                roles.join(", ")
            )));
        }
        Ok(text)
    }

    /// The template checks generation makes before any conversation: it compiles, and it
    /// shows the messages it is given (the probe of
    /// [`check_shows_messages`](Self::check_shows_messages), which `train` makes of a template
    /// from a file). One that renders none of the probe conversations passes: the conversation
    /// given may still render, and its own error says why not.
    pub fn check_for_generation(&self) -> Result<()> {
        self.check_compiles()?;
        match self.probe() {
            Probe::Hides(text) => Err(self.with_hint(hides_messages(&text))),
            Probe::Shows | Probe::Fails(_) => Ok(()),
        }
    }

    /// `e` naming the template's origin, where it has one.
    fn with_origin_context(&self, e: anyhow::Error) -> anyhow::Error {
        if self.origin.is_empty() {
            e
        } else {
            e.context(format!("chat template from {}", self.origin))
        }
    }

    /// `e` naming the template's origin, and what to do instead.
    fn with_hint(&self, e: anyhow::Error) -> anyhow::Error {
        anyhow!("{:#}; {HINT}", self.with_origin_context(e))
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Renders `messages` like `apply_chat_template(messages, tokenize=False,
    /// add_generation_prompt=...)`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.check_compiles()?;
        let tpl = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| anyhow!("chat template: {}", describe(&e)))?;
        tpl.render(RenderContext {
            messages,
            add_generation_prompt,
            bos_token: &self.bos_token,
            eos_token: &self.eos_token,
        })
        .map_err(|e| anyhow!("rendering the chat template failed: {}", describe(&e)))
    }

    /// The prompt text: `prompt` rendered with `add_generation_prompt=true`.
    pub fn render_prompt(&self, prompt: &[Message]) -> Result<String> {
        self.render(prompt, true)
    }

    /// The text of `response` following `prompt`, where `prompt_text` is
    /// [`render_prompt`](Self::render_prompt)`(prompt)`: the rendering of
    /// prompt+response without generation prompt, minus `prompt_text`.
    ///
    /// Fails when that rendering does not start with `prompt_text` — the
    /// template then changes earlier text depending on what follows (e.g. it
    /// drops reasoning from earlier turns, or emits the assistant header
    /// differently), and no exact boundary exists.
    pub fn render_response(
        &self,
        prompt: &[Message],
        prompt_text: &str,
        response: &[Message],
    ) -> Result<String> {
        let mut all = Vec::with_capacity(prompt.len() + response.len());
        all.extend_from_slice(prompt);
        all.extend_from_slice(response);
        let full = self.render(&all, false)?;
        let Some(rest) = full.strip_prefix(prompt_text) else {
            let at = prompt_text
                .char_indices()
                .zip(full.chars())
                .find(|((_, a), b)| a != b)
                .map(|((i, _), _)| i)
                .unwrap_or(prompt_text.len().min(full.len()));
            bail!(
                "chat template problem: the rendering of prompt+response does not start with \
                 the rendering of the prompt with add_generation_prompt=true, so the \
                 prompt/response boundary cannot be found (they differ at byte {at}: the prompt \
                 rendering has {:?}, the full rendering has {:?}); the template must render \
                 earlier turns the same whatever follows them",
                snippet(prompt_text, at),
                snippet(&full, at)
            );
        };
        if rest.is_empty() {
            bail!(
                "chat template problem: the response renders to no text (the template ignores \
                 the final messages?)"
            );
        }
        Ok(rest.to_string())
    }

    /// `(prompt_text, response_text)` for `prompt` followed by `response`.
    pub fn split_prompt_response(
        &self,
        prompt: &[Message],
        response: &[Message],
    ) -> Result<(String, String)> {
        let prompt_text = self.render_prompt(prompt)?;
        let response_text = self.render_response(prompt, &prompt_text, response)?;
        Ok((prompt_text, response_text))
    }
}

fn snippet(s: &str, at: usize) -> String {
    let mut start = at.saturating_sub(20);
    while !s.is_char_boundary(start) {
        start -= 1;
    }
    let mut end = (at + 20).min(s.len());
    while !s.is_char_boundary(end) {
        end += 1;
    }
    format!(
        "{}{}{}",
        if start > 0 { "…" } else { "" },
        &s[start..end],
        if end < s.len() { "…" } else { "" }
    )
}

/// The template parts of the `tokenizer_config.json` at `path` (or of the `chat_template.jinja`
/// beside it, which wins, as in transformers) and the file its template came from; `None` when
/// neither has one.
fn read_tokenizer_config(path: &Path) -> Result<Option<(ConfigParts, String)>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let config: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    let sibling = path
        .parent()
        .map(|dir| dir.join("chat_template.jinja"))
        .filter(|p| p.is_file());
    let parts = config_parts(&config, sibling.as_deref())
        .with_context(|| format!("chat template from {}", path.display()))?;
    let origin = sibling.as_deref().unwrap_or(path).display().to_string();
    Ok(parts.map(|p| (p, origin)))
}

/// The template source, bos and eos strings of a parsed tokenizer_config.json, the source from
/// `template_file` when given; `None` without a template.
fn config_parts(
    config: &serde_json::Value,
    template_file: Option<&Path>,
) -> Result<Option<ConfigParts>> {
    let bos = special_token_string(config, "bos_token")?;
    let eos = special_token_string(config, "eos_token")?;
    if let Some(p) = template_file {
        let template =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        return Ok(Some((template, bos, eos)));
    }
    let template = match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => return Ok(None),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Array(list)) => {
            let named = |want: Option<&str>| {
                list.iter().find_map(|entry| {
                    let name = entry.get("name").and_then(|n| n.as_str());
                    let tpl = entry.get("template").and_then(|t| t.as_str())?;
                    match want {
                        Some(w) if name != Some(w) => None,
                        _ => Some(tpl.to_string()),
                    }
                })
            };
            named(Some("default"))
                .or_else(|| named(None))
                .ok_or_else(|| {
                    anyhow!("\"chat_template\" is a list without any {{name, template}} entry")
                })?
        }
        Some(_) => bail!("\"chat_template\" must be a string or a list of {{name, template}}"),
    };
    Ok(Some((template, bos, eos)))
}

/// The error for a template that renders the probe conversations without their messages
/// (`ChatTemplate::check_shows_messages`); `text` is one rendering.
fn hides_messages(text: &str) -> anyhow::Error {
    let start: String = text.chars().take(60).collect();
    anyhow!(
        "not a chat template: it never shows the messages it is given (a conversation whose \
         user message is {PROBE_USER:?} renders as {start:?}{}, without it); a chat template is \
         Jinja over `messages`, such as a model's chat_template.jinja or a tokenizer_config.json",
        if start.len() < text.len() { "…" } else { "" }
    )
}

/// `bos_token`/`eos_token` in tokenizer_config.json: a string, an AddedToken
/// object `{content, ...}`, null or absent (empty string).
fn special_token_string(config: &serde_json::Value, key: &str) -> Result<String> {
    match config.get(key) {
        None | Some(serde_json::Value::Null) => Ok(String::new()),
        Some(serde_json::Value::String(s)) => Ok(s.clone()),
        Some(v) => match v.get("content").and_then(|c| c.as_str()) {
            Some(s) => Ok(s.to_string()),
            None => bail!("\"{key}\" must be a string or an object with \"content\""),
        },
    }
}

fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("the template raised an exception: {msg}"),
    ))
}

// ---------------------------------------------------------------- tojson

/// Python's `json.dumps` separators without indent: `", "` and `": "`.
struct PyCompact;

impl serde_json::ser::Formatter for PyCompact {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }
    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)` (no HTML escaping).
fn py_tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    // Maps are rendered in their stored order; sort_keys is accepted for
    // compatibility.
    let _sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let mut out = Vec::new();
    let res = match indent {
        Some(n) => {
            let ind = " ".repeat(n);
            let fmt = serde_json::ser::PrettyFormatter::with_indent(ind.as_bytes());
            value.serialize(&mut serde_json::Serializer::with_formatter(&mut out, fmt))
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out, PyCompact,
        )),
    };
    res.map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e)
    })?;
    let s = String::from_utf8(out).expect("serde_json writes UTF-8");
    let s = if ensure_ascii == Some(true) {
        let mut r = String::with_capacity(s.len());
        for c in s.chars() {
            if c.is_ascii() {
                r.push(c);
            } else {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    r.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
        r
    } else {
        s
    };
    Ok(Value::from_safe_string(s))
}

// ----------------------------------------------------------- strftime_now

fn strftime_now(format: &str) -> Result<Value, Error> {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(secs, format).map(Value::from)
}

/// A small UTC `strftime` covering what chat templates use for dates.
fn strftime(unix_secs: i64, format: &str) -> Result<String, Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let (h, mi, s) = (sod / 3600, (sod % 3600) / 60, sod % 60);
    // Civil-from-days (H. Hinnant).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let d = doy_mar - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(m - 1) as usize] + d + if leap && m > 2 { 1 } else { 0 };
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let spec = chars.next().unwrap_or('%');
        let h12 = if h % 12 == 0 { 12 } else { h % 12 };
        match spec {
            'Y' => out.push_str(&y.to_string()),
            'y' => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            'm' => out.push_str(&format!("{m:02}")),
            'd' => out.push_str(&format!("{d:02}")),
            'e' => out.push_str(&format!("{d:>2}")),
            'H' => out.push_str(&format!("{h:02}")),
            'I' => out.push_str(&format!("{h12:02}")),
            'M' => out.push_str(&format!("{mi:02}")),
            'S' => out.push_str(&format!("{s:02}")),
            'p' => out.push_str(if h < 12 { "AM" } else { "PM" }),
            'j' => out.push_str(&format!("{yday:03}")),
            'B' => out.push_str(MONTHS[(m - 1) as usize]),
            'b' | 'h' => out.push_str(&MONTHS[(m - 1) as usize][..3]),
            'A' => out.push_str(DAYS[weekday]),
            'a' => out.push_str(&DAYS[weekday][..3]),
            '%' => out.push('%'),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported format %{other}"),
                ));
            }
        }
    }
    Ok(out)
}

// -------------------------------------------------------- Python methods

fn unknown(method: &str, kind: ValueKind) -> Error {
    Error::new(
        ErrorKind::UnknownMethod,
        format!("{kind} has no method named {method}"),
    )
}

/// Python methods on strings, dicts and lists that HF chat templates call.
fn py_method(state: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    match value.kind() {
        ValueKind::String => str_method(state, value, method, args),
        ValueKind::Map => match method {
            "items" => {
                let () = from_args(args)?;
                state.apply_filter("items", std::slice::from_ref(value))
            }
            "keys" => {
                let () = from_args(args)?;
                Ok(Value::from(value.try_iter()?.collect::<Vec<_>>()))
            }
            "values" => {
                let () = from_args(args)?;
                let vals = value
                    .try_iter()?
                    .map(|k| value.get_item(&k))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Value::from(vals))
            }
            "get" => {
                let (key, default): (&Value, Option<&Value>) = from_args(args)?;
                let v = value.get_item(key)?;
                if v.is_undefined() {
                    Ok(default.cloned().unwrap_or(Value::from(())))
                } else {
                    Ok(v)
                }
            }
            _ => Err(unknown(method, value.kind())),
        },
        ValueKind::Seq => match method {
            "index" => {
                let (needle,): (&Value,) = from_args(args)?;
                match value.try_iter()?.position(|v| &v == needle) {
                    Some(i) => Ok(Value::from(i)),
                    None => Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "list.index(x): x not in list",
                    )),
                }
            }
            "count" => {
                let (needle,): (&Value,) = from_args(args)?;
                Ok(Value::from(
                    value.try_iter()?.filter(|v| v == needle).count(),
                ))
            }
            _ => Err(unknown(method, value.kind())),
        },
        kind => Err(unknown(method, kind)),
    }
}

/// `startswith`/`endswith` accept a string or a tuple (list) of strings.
fn affixes(v: &Value) -> Result<Vec<String>, Error> {
    if let Some(s) = v.as_str() {
        return Ok(vec![s.to_string()]);
    }
    if matches!(v.kind(), ValueKind::Seq) {
        return v
            .try_iter()?
            .map(|x| {
                x.as_str().map(str::to_string).ok_or_else(|| {
                    Error::new(
                        ErrorKind::InvalidOperation,
                        "expected a string in the tuple",
                    )
                })
            })
            .collect();
    }
    Err(Error::new(
        ErrorKind::InvalidOperation,
        "expected a string or a tuple of strings",
    ))
}

fn str_method(state: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    let s = value.as_str().unwrap_or_default();
    let strip_set = |args: &[Value]| -> Result<Option<Vec<char>>, Error> {
        let (chars,): (Option<&Value>,) = from_args(args)?;
        Ok(match chars {
            Some(c) if !c.is_none() => Some(
                c.as_str()
                    .ok_or_else(|| {
                        Error::new(ErrorKind::InvalidOperation, "strip: expected a string")
                    })?
                    .chars()
                    .collect(),
            ),
            _ => None,
        })
    };
    let out: Value = match method {
        "strip" => match strip_set(args)? {
            Some(set) => s.trim_matches(|c| set.contains(&c)).into(),
            None => s.trim().into(),
        },
        "lstrip" => match strip_set(args)? {
            Some(set) => s.trim_start_matches(|c| set.contains(&c)).into(),
            None => s.trim_start().into(),
        },
        "rstrip" => match strip_set(args)? {
            Some(set) => s.trim_end_matches(|c| set.contains(&c)).into(),
            None => s.trim_end().into(),
        },
        "upper" => {
            let () = from_args(args)?;
            s.to_uppercase().into()
        }
        "lower" => {
            let () = from_args(args)?;
            s.to_lowercase().into()
        }
        "title" | "capitalize" => {
            let () = from_args(args)?;
            state.apply_filter(method, std::slice::from_ref(value))?
        }
        "startswith" => {
            let (p,): (&Value,) = from_args(args)?;
            affixes(p)?.iter().any(|p| s.starts_with(p.as_str())).into()
        }
        "endswith" => {
            let (p,): (&Value,) = from_args(args)?;
            affixes(p)?.iter().any(|p| s.ends_with(p.as_str())).into()
        }
        "split" | "rsplit" => {
            let (sep, maxsplit): (Option<&Value>, Option<i64>) = from_args(args)?;
            let sep = sep.filter(|v| !v.is_none()).map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| {
                    Error::new(ErrorKind::InvalidOperation, "split: expected a string")
                })
            });
            let maxsplit = maxsplit.unwrap_or(-1);
            let parts: Vec<Value> = match sep.transpose()? {
                Some(sep) if sep.is_empty() => {
                    return Err(Error::new(ErrorKind::InvalidOperation, "empty separator"));
                }
                Some(sep) => {
                    let v: Vec<&str> = if maxsplit < 0 {
                        s.split(sep.as_str()).collect()
                    } else if method == "split" {
                        s.splitn(maxsplit as usize + 1, sep.as_str()).collect()
                    } else {
                        let mut v: Vec<&str> =
                            s.rsplitn(maxsplit as usize + 1, sep.as_str()).collect();
                        v.reverse();
                        v
                    };
                    v.into_iter().map(Value::from).collect()
                }
                None => {
                    if method == "rsplit" && maxsplit >= 0 {
                        return Err(Error::new(
                            ErrorKind::InvalidOperation,
                            "rsplit with maxsplit and no separator is not supported",
                        ));
                    }
                    let mut parts = Vec::new();
                    let mut rest = s.trim_start();
                    while !rest.is_empty() {
                        if maxsplit >= 0 && parts.len() as i64 == maxsplit {
                            parts.push(Value::from(rest));
                            break;
                        }
                        match rest.find(char::is_whitespace) {
                            Some(i) => {
                                parts.push(Value::from(&rest[..i]));
                                rest = rest[i..].trim_start();
                            }
                            None => {
                                parts.push(Value::from(rest));
                                break;
                            }
                        }
                    }
                    parts
                }
            };
            Value::from(parts)
        }
        "replace" => {
            let (old, new, count): (&str, &str, Option<i64>) = from_args(args)?;
            match count {
                Some(n) if n >= 0 => s.replacen(old, new, n as usize).into(),
                _ => s.replace(old, new).into(),
            }
        }
        "find" | "rfind" | "index" => {
            let (sub,): (&str,) = from_args(args)?;
            let byte = if method == "rfind" {
                s.rfind(sub)
            } else {
                s.find(sub)
            };
            match byte {
                Some(b) => Value::from(s[..b].chars().count()),
                None if method == "index" => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "str.index: substring not found",
                    ));
                }
                None => Value::from(-1),
            }
        }
        "count" => {
            let (sub,): (&str,) = from_args(args)?;
            if sub.is_empty() {
                Value::from(s.chars().count() + 1)
            } else {
                Value::from(s.matches(sub).count())
            }
        }
        "join" => {
            let (items,): (&Value,) = from_args(args)?;
            let parts = items
                .try_iter()?
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        Error::new(ErrorKind::InvalidOperation, "join: expected strings")
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            parts.join(s).into()
        }
        "isspace" | "isdigit" | "isalpha" | "isalnum" | "isupper" | "islower" => {
            let () = from_args(args)?;
            let r = match method {
                "isspace" => !s.is_empty() && s.chars().all(char::is_whitespace),
                "isdigit" => !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()),
                "isalpha" => !s.is_empty() && s.chars().all(char::is_alphabetic),
                "isalnum" => !s.is_empty() && s.chars().all(char::is_alphanumeric),
                "isupper" => {
                    s.chars().any(char::is_uppercase) && !s.chars().any(char::is_lowercase)
                }
                _ => s.chars().any(char::is_lowercase) && !s.chars().any(char::is_uppercase),
            };
            r.into()
        }
        _ => return Err(unknown(method, ValueKind::String)),
    };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::dataset::Message;

    const SMOLLM2: &str = include_str!("../../tests/fixtures/smollm2_chat_template.jinja");
    const SYS: &str = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";

    fn smol() -> ChatTemplate {
        ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap()
    }

    #[test]
    fn smollm2_renders_chatml_with_default_system_prompt() {
        let t = smol();
        let msgs = [Message::user("Hi"), Message::assistant("Hello!")];
        assert_eq!(
            t.render(&msgs, false).unwrap(),
            format!(
                "{SYS}<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
            )
        );
        assert_eq!(
            t.render(&msgs[..1], true).unwrap(),
            format!("{SYS}<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        );
        // An explicit system message replaces the default one.
        let msgs = [Message::system("Be brief."), Message::user("Hi")];
        assert_eq!(
            t.render(&msgs, false).unwrap(),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn split_prompt_response_boundary() {
        let t = smol();
        let (p, r) = t
            .split_prompt_response(&[Message::user("2+2?")], &[Message::assistant("4")])
            .unwrap();
        assert_eq!(
            p,
            format!("{SYS}<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
        );
        assert_eq!(r, "4<|im_end|>\n");
    }

    #[test]
    fn inconsistent_template_is_a_clear_error() {
        // The generation prompt differs from how assistant turns are rendered.
        let t = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}",
            "",
            "",
        )
        .unwrap();
        let e = t
            .split_prompt_response(&[Message::user("q")], &[Message::assistant("a")])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("chat template problem:"), "{e}");
        assert!(e.contains("add_generation_prompt=true"), "{e}");
    }

    #[test]
    fn python_methods_and_helpers() {
        let src = r#"{{ bos_token }}{% for m in messages %}{{ m.content.strip() | upper }}|{{ m.content.startswith(' he') }}|{{ m.role.startswith(('us', 'x')) }}|{{ m.content.split() | join(',') }}|{{ m.content.replace('l', 'L', 1) }}|{{ m.content.rstrip(' o') }}|{{ m.content.find('lo') }}{% endfor %}|{{ {'a': 1}.get('b', 'dflt') }}|{% for k, v in {'k': 'v'}.items() %}{{ k }}={{ v }}{% endfor %}|{{ {'x': [1, 'é<']} | tojson }}|{{ ','.join(['a','b']) }}{{ eos_token }}"#;
        let t = ChatTemplate::new(src, "<s>", "</s>").unwrap();
        let out = t.render(&[Message::user(" hello wor ")], false).unwrap();
        assert_eq!(
            out,
            "<s>HELLO WOR|True|True|hello,wor| heLlo wor | hello wor|4|dflt|k=v|{\"x\": [1, \"é<\"]}|a,b</s>"
        );
    }

    #[test]
    fn raise_exception_surfaces_the_message() {
        let t = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}",
            "",
            "",
        )
        .unwrap();
        let e = t
            .render(&[Message::assistant("x")], false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("Conversation must start with user"), "{e}");
    }

    #[test]
    fn strftime_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        assert_eq!(
            strftime(1_709_211_909, "%d %b %Y %H:%M:%S %A %j %B %y %I%p %%").unwrap(),
            "29 Feb 2024 13:05:09 Thursday 060 February 24 01PM %"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %a").unwrap(), "1970-01-01 Thu");
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}", "", "").unwrap();
        assert_eq!(t.render(&[], false).unwrap().len(), 4);
    }

    #[test]
    fn tokenizer_config_forms() {
        let dir = std::env::temp_dir().join(format!("lorafit-tpl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = dir.join("tokenizer_config.json");
        let json = serde_json::json!({
            "bos_token": {"content": "<|im_start|>", "lstrip": false},
            "eos_token": "<|im_end|>",
            "chat_template": SMOLLM2,
        });
        std::fs::write(&cfg, json.to_string()).unwrap();
        let t = ChatTemplate::from_tokenizer_config(&cfg).unwrap().unwrap();
        assert_eq!(t.bos_token(), "<|im_start|>");
        assert_eq!(t.eos_token(), "<|im_end|>");
        assert_eq!(t.source(), SMOLLM2);

        let json = serde_json::json!({
            "eos_token": "</s>",
            "chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "DEFAULT"},
            ],
        });
        std::fs::write(&cfg, json.to_string()).unwrap();
        let t = ChatTemplate::from_tokenizer_config(&cfg).unwrap().unwrap();
        assert_eq!(t.source(), "DEFAULT");
        assert_eq!(t.bos_token(), "");

        std::fs::write(&cfg, r#"{"eos_token": "</s>"}"#).unwrap();
        assert!(ChatTemplate::from_tokenizer_config(&cfg).unwrap().is_none());
        std::fs::write(dir.join("chat_template.jinja"), "FROM FILE").unwrap();
        let t = ChatTemplate::from_tokenizer_config(&cfg).unwrap().unwrap();
        assert_eq!(t.source(), "FROM FILE");
        // The file wins over the config's own template, as in transformers.
        std::fs::write(
            &cfg,
            r#"{"eos_token": "</s>", "chat_template": "FROM CONFIG"}"#,
        )
        .unwrap();
        let t = ChatTemplate::from_tokenizer_config(&cfg).unwrap().unwrap();
        assert_eq!(t.source(), "FROM FILE");

        let bad = ChatTemplate::new("{% for %}", "", "")
            .unwrap_err()
            .to_string();
        assert!(bad.starts_with("chat template does not compile"), "{bad}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A template from a file must show the messages: a dataset or any other text compiles as
    /// Jinja and is refused, naming the file; one that refuses a system message is probed
    /// without one; one that renders no probe conversation is refused with its own error.
    #[test]
    fn templates_from_files_must_show_the_messages() {
        smol().check_shows_messages().unwrap();
        let no_system = ChatTemplate::new(
            "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}<{{ m['role'] }}>{{ m['content'] | trim }}{% endfor %}",
            "",
            "",
        )
        .unwrap();
        no_system.check_shows_messages().unwrap();

        let dir = std::env::temp_dir().join(format!("lorafit-tpl-probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let data = dir.join("data.jsonl");
        std::fs::write(
            &data,
            "{\"prompt\": \"What is 2+2?\", \"chosen\": \"4\", \"rejected\": \"5\"}\n",
        )
        .unwrap();
        let e = format!("{:#}", ChatTemplate::from_file(&data, "", "").unwrap_err());
        assert!(
            e.contains("data.jsonl") && e.contains("never shows the messages"),
            "{e}"
        );
        assert!(e.contains("What is 2+2?"), "the rendering is quoted: {e}");
        // A tokenizer_config.json whose template ignores the messages, the same.
        let cfg = dir.join("tokenizer_config.json");
        std::fs::write(&cfg, r#"{"chat_template": "{{ bos_token }}Hello"}"#).unwrap();
        let e = format!("{:#}", ChatTemplate::from_file(&cfg, "", "").unwrap_err());
        assert!(
            e.contains("tokenizer_config.json") && e.contains("never shows the messages"),
            "{e}"
        );
        // One that raises for every conversation: its own message, the file named.
        let raises = dir.join("raises.jinja");
        std::fs::write(&raises, "{{ raise_exception('tools are required') }}").unwrap();
        let e = format!(
            "{:#}",
            ChatTemplate::from_file(&raises, "", "").unwrap_err()
        );
        assert!(
            e.contains("raises.jinja")
                && e.contains("renders none of the probe conversations")
                && e.contains("tools are required"),
            "{e}"
        );
        let smol_file = dir.join("smol.jinja");
        std::fs::write(&smol_file, SMOLLM2).unwrap();
        ChatTemplate::from_file(&smol_file, "<|im_start|>", "<|im_end|>").unwrap();
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn llama_style_constructs() {
        // Constructs used by Llama 3.x / Qwen templates.
        let src = r#"{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- set ns = namespace(n=0) %}
{%- for message in messages %}
    {%- set ns.n = ns.n + 1 %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
[{{ system_message }}|{{ ns.n }}|{{ tools is none }}|{{ date_string | length > 6 }}|{{ {"a": {"b": 1}} | tojson(indent=2) }}]"#;
        let t = ChatTemplate::new(src, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        let out = t
            .render(&[Message::system(" S "), Message::user("hi ")], true)
            .unwrap();
        assert_eq!(
            out,
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n[S|1|True|True|{\n  \"a\": {\n    \"b\": 1\n  }\n}]"
        );
    }
}
