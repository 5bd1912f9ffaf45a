//! Turning validated examples into token ids: rendering (chat template or
//! plain text), encoding prompt and responses by one of two rule sets
//! ([`TokenRules`]), and truncating to the configured lengths.
//!
//! `Separate` (the default) encodes the prompt and each response apart, so the
//! prompt's ids are exactly the ids generation will see and the boundary
//! between conditioned and trained tokens is exact by construction. This is
//! lorafit's own choice, not TRL's: TRL 1.16 encodes prompt+response as one
//! string and splits the ids afterwards, so a token that merges across the
//! boundary lands in the response. The `Trl*` rules reproduce TRL 1.16's ids
//! (ORPOTrainer/CPOTrainer's `tokenize_row`; DPOTrainer's and SFTTrainer's
//! `tokenize_fn`) for users who need TRL's numbers.
//!
//! Truncation is lorafit's under every rule and never moves the boundary: an
//! over-long prompt loses its *first* tokens (the question at its end is
//! kept), an over-long response loses its *last* tokens, and every such cut is
//! counted in [`TokenizeReport`] so that a bad `max_seq_len` is visible in the
//! log rather than silently damaging the training signal.

use std::fmt;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use tokenizers::Tokenizer;

use super::dataset::{Example, Message, PreferenceData, SftData};
use super::template::ChatTemplate;
use crate::config::{Method, Tokenization};

/// A `tokenizers::Tokenizer` plus the special tokens training needs.
///
/// [`encode`](Self::encode) never runs the tokenizer's post-processor (no
/// automatic bos/eos); special tokens written in the text (e.g.
/// `<|im_start|>`) still map to their ids because they are added tokens. A
/// bos is prepended to prompts by the tokenisation functions when `add_bos`.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    add_bos: bool,
    /// Further ids that end a generated reply: a model folder's generation_config.json
    /// `eos_token_id`s (what transformers' `generate` stops on).
    generation_eos: Vec<u32>,
    /// Why that generation_config.json could not be read, for generation to say.
    generation_config_warning: Option<String>,
}

impl fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.inner.get_vocab_size(true))
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("add_bos", &self.add_bos)
            .finish()
    }
}

impl TextTokenizer {
    /// Wraps `inner`, switching off any truncation/padding stored with it.
    pub fn new(
        mut inner: Tokenizer,
        bos_id: Option<u32>,
        eos_id: Option<u32>,
        add_bos: bool,
    ) -> Result<Self> {
        inner
            .with_truncation(None)
            .map_err(|e| anyhow!("disabling tokenizer truncation: {e}"))?;
        inner.with_padding(None);
        Ok(TextTokenizer {
            inner,
            bos_id,
            eos_id,
            add_bos,
            generation_eos: Vec::new(),
            generation_config_warning: None,
        })
    }

    /// Loads a Hugging Face `tokenizer.json`. bos/eos and `add_bos_token` come
    /// from a sibling `tokenizer_config.json` when there is one; otherwise
    /// `add_bos` (and the bos id) is inferred from whether the tokenizer's
    /// post-processor prepends a token, and eos is unknown (set it with
    /// [`with_eos_id`](Self::with_eos_id)).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let inner = Tokenizer::from_file(path).map_err(|e| tokenizer_file_error(path, e))?;
        let detected_bos = post_processor_bos(&inner)?;
        let mut bos_id = detected_bos;
        let mut eos_id = None;
        let mut add_bos = detected_bos.is_some();
        let config_path = path.with_file_name("tokenizer_config.json");
        if config_path.is_file() {
            let text = std::fs::read_to_string(&config_path)
                .with_context(|| format!("reading {}", config_path.display()))?;
            let config: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{}: invalid JSON", config_path.display()))?;
            let lookup = |key: &str| -> Result<Option<u32>> {
                let name = match config.get(key) {
                    Some(serde_json::Value::String(s)) => Some(s.as_str()),
                    Some(v) => v.get("content").and_then(|c| c.as_str()),
                    None => None,
                };
                match name {
                    None => Ok(None),
                    Some(name) => inner.token_to_id(name).map(Some).ok_or_else(|| {
                        anyhow!(
                            "{}: {key} {name:?} is not in the vocabulary of {}",
                            config_path.display(),
                            path.display()
                        )
                    }),
                }
            };
            if let Some(id) = lookup("bos_token")? {
                bos_id = Some(id);
            }
            eos_id = lookup("eos_token")?;
            if let Some(b) = config.get("add_bos_token").and_then(|v| v.as_bool()) {
                add_bos = b;
            }
        }
        if add_bos && bos_id.is_none() {
            add_bos = false;
        }
        Self::new(inner, bos_id, eos_id, add_bos)
    }

    pub fn with_eos_id(mut self, id: Option<u32>) -> Self {
        self.eos_id = id;
        self
    }

    /// The tokenizer with `ids` as further ids that end a generated reply (a model folder's
    /// generation_config.json `eos_token_id`s), and `warning` where that file could not be read.
    pub fn with_generation_eos(mut self, ids: Vec<u32>, warning: Option<String>) -> Self {
        self.generation_eos = ids;
        self.generation_config_warning = warning;
        self
    }

    /// The ids of the model folder's generation_config.json `eos_token_id`.
    pub fn generation_eos_ids(&self) -> &[u32] {
        &self.generation_eos
    }

    /// Why the model folder's generation_config.json could not be read, naming it.
    pub fn generation_config_warning(&self) -> Option<&str> {
        self.generation_config_warning.as_deref()
    }

    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }
    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Token ids of `text`, without post-processing (no automatic bos/eos).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizing text: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` with the post-processor's special tokens (what
    /// transformers' `tokenizer(text)` returns: BOS where the tokenizer adds
    /// one).
    pub fn encode_with_special_tokens(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, true)
            .map_err(|e| anyhow!("tokenizing text: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The EOS token's text (e.g. `"<|im_end|>"`), if the EOS id is known.
    pub fn eos_token(&self) -> Option<String> {
        self.eos_id.and_then(|id| self.id_to_token(id))
    }

    /// Text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| anyhow!("decoding tokens: {e}"))
    }

    /// Whether `ids` end with eos, ignoring trailing whitespace-only tokens
    /// (ChatML renders `<|im_end|>\n`).
    pub fn ends_with_eos(&self, ids: &[u32]) -> Result<bool> {
        let Some(eos) = self.eos_id else {
            return Ok(false);
        };
        for &id in ids.iter().rev() {
            if id == eos {
                return Ok(true);
            }
            if !self.decode(&[id])?.trim().is_empty() {
                return Ok(false);
            }
        }
        Ok(false)
    }
}

/// The model types of `tokenizer.json` that the tokenizers library reads.
const TOKENIZER_MODEL_TYPES: [&str; 4] = ["BPE", "Unigram", "WordLevel", "WordPiece"];

/// The error for a `tokenizer.json` at `path` that the tokenizers library did not load
/// (`error`), saying why where the file shows it: it is missing beside a SentencePiece
/// `tokenizer.model`, is not JSON, or names a model type the library does not read (which it
/// reports as an untagged enum that matched no variant).
fn tokenizer_file_error(path: &Path, error: impl fmt::Display) -> anyhow::Error {
    let sentencepiece = path.with_file_name("tokenizer.model");
    if !path.exists() && sentencepiece.is_file() {
        let dir = path.parent().unwrap_or(Path::new(".")).display();
        return anyhow!(
            "{dir} has a SentencePiece tokenizer.model but no tokenizer.json, and lorafit reads \
             tokenizer.json: write it with transformers, `AutoTokenizer.from_pretrained(\"{dir}\")\
             .save_pretrained(\"{dir}\")` (the fast tokenizer it converts to is saved as \
             tokenizer.json; the conversion needs the sentencepiece package)"
        );
    }
    let general = || anyhow!("loading tokenizer {}: {error}", path.display());
    let Ok(text) = std::fs::read_to_string(path) else {
        return general();
    };
    let json: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            return anyhow!(
                "loading tokenizer {}: not valid JSON ({e}): the file is damaged or cut short \
                 (an interrupted download?)",
                path.display()
            )
        }
    };
    match json.get("model").and_then(|m| m.get("type")) {
        Some(serde_json::Value::String(t)) if !TOKENIZER_MODEL_TYPES.contains(&t.as_str()) => {
            anyhow!(
                "loading tokenizer {}: its model type (\"model\": {{\"type\": {t:?}}}) is not \
                 one the tokenizers library reads (it reads {})",
                path.display(),
                TOKENIZER_MODEL_TYPES.join(", ")
            )
        }
        _ => general(),
    }
}

/// The token the post-processor puts in front of a sequence, if any.
fn post_processor_bos(tok: &Tokenizer) -> Result<Option<u32>> {
    let plain = tok
        .encode("a", false)
        .map_err(|e| anyhow!("probing the tokenizer: {e}"))?;
    let full = tok
        .encode("a", true)
        .map_err(|e| anyhow!("probing the tokenizer: {e}"))?;
    let (plain, full) = (plain.get_ids(), full.get_ids());
    if full.len() > plain.len() && full[1..].starts_with(plain) {
        Ok(Some(full[0]))
    } else {
        Ok(None)
    }
}

/// The rules that turn rendered text into prompt and response ids: the
/// configured [`Tokenization`] resolved for the training method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenRules {
    /// Prompt and each response encoded apart (no special tokens from the
    /// post-processor); BOS prepended to the prompt when the tokenizer's
    /// `add_bos_token` asks and it is not there; EOS appended to a response
    /// that does not end with it, trailing whitespace tokens ignored (with
    /// `append_eos`).
    Separate,
    /// TRL 1.16 `ORPOTrainer.tokenize_row` (CPOTrainer, for SimPO, runs the
    /// same code). Chat rows are rendered to text first (the prompt text is the
    /// characters the prompt rendering shares with both full renderings); then
    /// per response: `P = enc(prompt)`, `F = enc(prompt + response)`, the
    /// prompt part is `F[..|P|]`, or `F[..|P|-1]` when `F` does not start with
    /// `P` (a token merged across the boundary goes to the response); BOS is
    /// prepended to a prompt whose first id is not BOS, whatever
    /// `add_bos_token` says; EOS is appended to a response whose last id is not
    /// EOS (so ChatML's `<|im_end|>\n` gets a second `<|im_end|>`).
    TrlOrpo,
    /// TRL 1.16 `DPOTrainer` / `SFTTrainer` `tokenize_fn`: text responses get
    /// the EOS *string* appended unless they end with it, and are encoded with
    /// the tokenizer's special tokens (`tokenizer(text)`: BOS only where the
    /// post-processor adds it); chat rows are the template's renderings of the
    /// prompt (with generation prompt) and of prompt+response, encoded without
    /// special tokens and without any EOS added. The prompt is the ids that the
    /// prompt encoding shares with both full encodings; the rest of each full
    /// encoding is the response.
    TrlDpo,
}

impl TokenRules {
    /// The rules `tokenization` means for `method`.
    pub fn resolve(tokenization: Tokenization, method: Method) -> TokenRules {
        match (tokenization, method) {
            (Tokenization::Separate, _) => TokenRules::Separate,
            (Tokenization::Trl, Method::Orpo | Method::Simpo) => TokenRules::TrlOrpo,
            (Tokenization::Trl, Method::Dpo | Method::Sft) => TokenRules::TrlDpo,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            TokenRules::Separate => "separate",
            TokenRules::TrlOrpo => "trl (ORPOTrainer)",
            TokenRules::TrlDpo => "trl (DPOTrainer, SFTTrainer)",
        }
    }
}

/// Length limits, the eos rule and the tokenization rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenizeOptions {
    /// Most tokens of prompt + longest response.
    pub max_seq_len: usize,
    /// Most prompt tokens (prompts are cut on the left); below `max_seq_len`.
    pub max_prompt_len: usize,
    /// Append the eos id to each response that does not already end with it
    /// (ignoring trailing whitespace tokens). Chat templates such as ChatML
    /// already close each turn with eos, so in practice this adds eos to
    /// plain-text responses. No effect when the eos id is unknown.
    pub append_eos: bool,
    /// How text becomes ids (`append_eos` applies to `Separate` only; the TRL
    /// rules add EOS as TRL does).
    pub rules: TokenRules,
}

impl TokenizeOptions {
    /// `append_eos` defaults to true, `rules` to [`TokenRules::Separate`].
    pub fn new(max_seq_len: usize, max_prompt_len: usize) -> Self {
        TokenizeOptions {
            max_seq_len,
            max_prompt_len,
            append_eos: true,
            rules: TokenRules::Separate,
        }
    }

    pub fn with_rules(self, rules: TokenRules) -> Self {
        TokenizeOptions { rules, ..self }
    }

    pub fn validate(&self) -> Result<()> {
        if self.max_prompt_len == 0 || self.max_prompt_len >= self.max_seq_len {
            bail!(
                "max_prompt_len ({}) must be at least 1 and less than max_seq_len ({})",
                self.max_prompt_len,
                self.max_seq_len
            );
        }
        Ok(())
    }
}

/// Counts from tokenising a dataset.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizeReport {
    /// Examples tokenised.
    pub rows: usize,
    /// Rows whose prompt was cut on the left to fit.
    pub prompt_truncated: usize,
    /// Rows with at least one response cut on the right (it then lacks eos).
    pub response_truncated: usize,
    /// Responses that got an eos appended.
    pub eos_appended: usize,
    /// Preference rows whose chosen and rejected tokens are identical after
    /// truncation (they carry no preference signal).
    pub identical_pairs: usize,
    /// Tokens fed to the model: prompt+chosen and prompt+rejected for a pair,
    /// prompt+completion for SFT, summed over rows (after truncation).
    pub total_tokens: usize,
    /// The longest prompt+response sequence after truncation.
    pub max_seq_tokens: usize,
    /// Rows where the TRL rules found a token merged across the prompt/response
    /// boundary and moved it (or the prompt's diverging end) into the response.
    pub boundary_merges: usize,
    /// ORPO rows whose two responses split the prompt differently: TRL gives
    /// each response its own prompt; here the prompt is their common ids and the
    /// rest of each prompt starts its response.
    pub split_prompts: usize,
}

impl TokenizeReport {
    /// Adds `other`'s counts (the longest sequence is the longer of the two).
    pub fn add(&mut self, other: &TokenizeReport) {
        self.rows += other.rows;
        self.prompt_truncated += other.prompt_truncated;
        self.response_truncated += other.response_truncated;
        self.eos_appended += other.eos_appended;
        self.identical_pairs += other.identical_pairs;
        self.total_tokens += other.total_tokens;
        self.max_seq_tokens = self.max_seq_tokens.max(other.max_seq_tokens);
        self.boundary_merges += other.boundary_merges;
        self.split_prompts += other.split_prompts;
    }
}

impl fmt::Display for TokenizeReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} rows, {} tokens (longest sequence {}), {} prompts truncated, {} rows with a truncated response",
            self.rows,
            self.total_tokens,
            self.max_seq_tokens,
            self.prompt_truncated,
            self.response_truncated
        )?;
        if self.identical_pairs > 0 {
            write!(
                f,
                ", {} pairs identical after truncation",
                self.identical_pairs
            )?;
        }
        if self.boundary_merges > 0 {
            write!(
                f,
                ", {} rows with a token merged across the prompt/response boundary",
                self.boundary_merges
            )?;
        }
        if self.split_prompts > 0 {
            write!(
                f,
                ", {} pairs whose responses split the prompt differently",
                self.split_prompts
            )?;
        }
        Ok(())
    }
}

/// A tokenised preference example. `prompt` is conditioned on; `chosen` and
/// `rejected` are the trained response tokens that follow it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TokenizedPair {
    pub prompt: Vec<u32>,
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
}

impl TokenizedPair {
    /// prompt followed by chosen.
    pub fn chosen_sequence(&self) -> Vec<u32> {
        [self.prompt.as_slice(), &self.chosen].concat()
    }
    /// prompt + longest response.
    pub fn max_len(&self) -> usize {
        self.prompt.len() + self.chosen.len().max(self.rejected.len())
    }
}

/// A tokenised SFT example. `prompt` may be empty (a `{text}` row without
/// bos): then the first completion token has nothing to be predicted from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TokenizedSft {
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
}

impl TokenizedSft {
    pub fn sequence(&self) -> Vec<u32> {
        [self.prompt.as_slice(), &self.completion].concat()
    }
    pub fn len(&self) -> usize {
        self.prompt.len() + self.completion.len()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A preference example as text: `prompt + chosen` is the chosen sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedPair {
    pub prompt: String,
    pub chosen: String,
    pub rejected: String,
}

/// An SFT example as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedSft {
    pub prompt: String,
    pub completion: String,
}

fn need_template(template: Option<&ChatTemplate>) -> Result<&ChatTemplate> {
    template.ok_or_else(|| {
        anyhow!(
            "the row is in chat (messages) form but no chat template is available \
             (the model's tokenizer config has none); set `chat_template` to a Jinja template file \
             (--chat-template FILE) or use plain-text rows"
        )
    })
}

/// Renders a preference example: chat rows through `template` (prompt with
/// the generation prompt, responses as the rest of the full rendering), text
/// rows as-is.
pub fn render_preference(
    data: &PreferenceData,
    template: Option<&ChatTemplate>,
) -> Result<RenderedPair> {
    match data {
        PreferenceData::Text {
            prompt,
            chosen,
            rejected,
        } => Ok(RenderedPair {
            prompt: prompt.clone(),
            chosen: chosen.clone(),
            rejected: rejected.clone(),
        }),
        PreferenceData::Chat {
            prompt,
            chosen,
            rejected,
        } => {
            let t = need_template(template)?;
            let prompt_text = t.render_prompt(prompt)?;
            let chosen = t
                .render_response(prompt, &prompt_text, chosen)
                .context("rendering \"chosen\"")?;
            let rejected = t
                .render_response(prompt, &prompt_text, rejected)
                .context("rendering \"rejected\"")?;
            Ok(RenderedPair {
                prompt: prompt_text,
                chosen,
                rejected,
            })
        }
    }
}

/// Renders an SFT example (see [`render_preference`]).
pub fn render_sft(data: &SftData, template: Option<&ChatTemplate>) -> Result<RenderedSft> {
    match data {
        SftData::Text { prompt, completion } => Ok(RenderedSft {
            prompt: prompt.clone(),
            completion: completion.clone(),
        }),
        SftData::Chat { prompt, completion } => {
            let t = need_template(template)?;
            let (prompt, completion) = t.split_prompt_response(prompt, completion)?;
            Ok(RenderedSft { prompt, completion })
        }
    }
}

/// Token ids of a rendered prompt: the text's own ids, with bos in front when the tokenizer adds
/// one and the text does not already begin with it (one bos whether or not the template writes
/// it). Generation's chat path (`infer::chat_prompt_ids`) tokenises through this too.
pub(crate) fn encode_prompt(tok: &TextTokenizer, text: &str) -> Result<Vec<u32>> {
    let mut ids = tok.encode(text)?;
    if let (true, Some(bos)) = (tok.add_bos, tok.bos_id) {
        if ids.first() != Some(&bos) {
            ids.insert(0, bos);
        }
    }
    Ok(ids)
}

fn encode_response(
    tok: &TextTokenizer,
    text: &str,
    opts: &TokenizeOptions,
    report: &mut TokenizeReport,
) -> Result<Vec<u32>> {
    let mut ids = tok.encode(text)?;
    if let (true, Some(eos)) = (opts.append_eos, tok.eos_id) {
        if !tok.ends_with_eos(&ids)? {
            ids.push(eos);
            report.eos_appended += 1;
        }
    }
    Ok(ids)
}

/// Keeps the last `max` prompt tokens (and a leading bos). True if cut.
fn truncate_prompt(prompt: &mut Vec<u32>, max: usize, bos: Option<u32>) -> bool {
    if prompt.len() <= max {
        return false;
    }
    let keep_bos = max >= 2 && bos.is_some() && prompt.first() == bos.as_ref();
    let tail = if keep_bos { max - 1 } else { max };
    let start = prompt.len() - tail;
    let mut out = Vec::with_capacity(max);
    if keep_bos {
        out.push(prompt[0]);
    }
    out.extend_from_slice(&prompt[start..]);
    *prompt = out;
    true
}

/// The ids of a pair before truncation, by `opts.rules`.
fn encode_pair(
    data: &PreferenceData,
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    opts: &TokenizeOptions,
    report: &mut TokenizeReport,
) -> Result<TokenizedPair> {
    match opts.rules {
        TokenRules::Separate => {
            let r = render_preference(data, template)?;
            Ok(TokenizedPair {
                prompt: encode_prompt(tok, &r.prompt)?,
                chosen: encode_response(tok, &r.chosen, opts, report)?,
                rejected: encode_response(tok, &r.rejected, opts, report)?,
            })
        }
        TokenRules::TrlOrpo => trl_orpo_pair(data, tok, template, report),
        TokenRules::TrlDpo => {
            let (prompt, mut full) = trl_dpo_encode(
                tok,
                template,
                data_prompt(data),
                &[data_chosen(data), data_rejected(data)],
            )?;
            let rejected = full.pop().unwrap_or_default();
            let chosen = full.pop().unwrap_or_default();
            let n = common_prefix_len(&prompt, &chosen).min(common_prefix_len(&prompt, &rejected));
            if n < prompt.len() {
                report.boundary_merges += 1;
            }
            Ok(TokenizedPair {
                prompt: prompt[..n].to_vec(),
                chosen: chosen[n..].to_vec(),
                rejected: rejected[n..].to_vec(),
            })
        }
    }
}

/// Tokenises one preference example, updating `report`.
pub fn tokenize_pair(
    data: &PreferenceData,
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    opts: &TokenizeOptions,
    report: &mut TokenizeReport,
) -> Result<TokenizedPair> {
    opts.validate()?;
    let TokenizedPair {
        mut prompt,
        mut chosen,
        mut rejected,
    } = encode_pair(data, tok, template, opts, report)?;
    if chosen.is_empty() || rejected.is_empty() {
        bail!(
            "field \"{}\": the response encodes to no tokens",
            if chosen.is_empty() {
                "chosen"
            } else {
                "rejected"
            }
        );
    }
    if truncate_prompt(&mut prompt, opts.max_prompt_len, tok.bos_id) {
        report.prompt_truncated += 1;
    }
    let budget = opts.max_seq_len - prompt.len();
    if chosen.len() > budget || rejected.len() > budget {
        chosen.truncate(budget);
        rejected.truncate(budget);
        report.response_truncated += 1;
    }
    if chosen == rejected {
        report.identical_pairs += 1;
    }
    let pair = TokenizedPair {
        prompt,
        chosen,
        rejected,
    };
    report.rows += 1;
    report.total_tokens += 2 * pair.prompt.len() + pair.chosen.len() + pair.rejected.len();
    report.max_seq_tokens = report.max_seq_tokens.max(pair.max_len());
    Ok(pair)
}

// ------------------------------------------------------------- TRL 1.16 rules

/// A row's prompt or response as TRL sees it: a string or a message list.
#[derive(Clone, Copy)]
enum Part<'a> {
    Text(&'a str),
    Chat(&'a [Message]),
}

fn data_prompt(d: &PreferenceData) -> Part<'_> {
    match d {
        PreferenceData::Text { prompt, .. } => Part::Text(prompt),
        PreferenceData::Chat { prompt, .. } => Part::Chat(prompt),
    }
}
fn data_chosen(d: &PreferenceData) -> Part<'_> {
    match d {
        PreferenceData::Text { chosen, .. } => Part::Text(chosen),
        PreferenceData::Chat { chosen, .. } => Part::Chat(chosen),
    }
}
fn data_rejected(d: &PreferenceData) -> Part<'_> {
    match d {
        PreferenceData::Text { rejected, .. } => Part::Text(rejected),
        PreferenceData::Chat { rejected, .. } => Part::Chat(rejected),
    }
}

/// Number of leading items `a` and `b` share (TRL's `common_prefix_length`).
pub fn common_prefix_len<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The byte length of the longest common character prefix of `a` and `b`.
fn common_char_prefix(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| a.len().min(b.len()))
}

/// `prompt + messages`, as one list.
fn join(prompt: &[Message], rest: &[Message]) -> Vec<Message> {
    [prompt, rest].concat()
}

/// DPOTrainer's / SFTTrainer's encodings: the prompt's ids and, for each
/// response, the ids of prompt+response (see [`TokenRules::TrlDpo`]).
fn trl_dpo_encode(
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    prompt: Part<'_>,
    responses: &[Part<'_>],
) -> Result<(Vec<u32>, Vec<Vec<u32>>)> {
    match prompt {
        Part::Text(prompt) => {
            let eos = tok.eos_token().ok_or_else(|| {
                anyhow!("tokenization \"trl\": the tokenizer has no EOS token, which TRL appends to text responses")
            })?;
            let mut full = Vec::with_capacity(responses.len());
            for r in responses {
                let Part::Text(r) = r else {
                    bail!("text prompt with a message-list response");
                };
                let with_eos = if r.ends_with(&eos) {
                    r.to_string()
                } else {
                    format!("{r}{eos}")
                };
                full.push(tok.encode_with_special_tokens(&format!("{prompt}{with_eos}"))?);
            }
            Ok((tok.encode_with_special_tokens(prompt)?, full))
        }
        Part::Chat(prompt) => {
            let t = need_template(template)?;
            let mut full = Vec::with_capacity(responses.len());
            for r in responses {
                let Part::Chat(r) = r else {
                    bail!("message-list prompt with a text response");
                };
                full.push(tok.encode(&t.render(&join(prompt, r), false)?)?);
            }
            Ok((tok.encode(&t.render_prompt(prompt)?)?, full))
        }
    }
}

/// ORPOTrainer's text: chat rows rendered as TRL's `apply_chat_template`
/// does, text rows as they are.
fn trl_orpo_text(
    data: &PreferenceData,
    template: Option<&ChatTemplate>,
) -> Result<(String, String, String)> {
    match data {
        PreferenceData::Text {
            prompt,
            chosen,
            rejected,
        } => Ok((prompt.clone(), chosen.clone(), rejected.clone())),
        PreferenceData::Chat {
            prompt,
            chosen,
            rejected,
        } => {
            let t = need_template(template)?;
            let mut p = t.render_prompt(prompt)?;
            let pc = t.render(&join(prompt, chosen), false)?;
            let pr = t.render(&join(prompt, rejected), false)?;
            // The prompt text is what the prompt rendering shares with both full
            // renderings (TRL's `takewhile` over characters).
            p.truncate(common_char_prefix(&p, &pc));
            p.truncate(common_char_prefix(&p, &pr));
            let c = pc[p.len()..].to_string();
            let r = pr[p.len()..].to_string();
            Ok((p, c, r))
        }
    }
}

/// ORPOTrainer's `build_tokenized_answer`: (prompt ids, response ids, whether
/// the prompt lost its last token to a merge).
fn trl_orpo_answer(
    tok: &TextTokenizer,
    prompt: &str,
    prompt_ids: &[u32],
    answer: &str,
) -> Result<(Vec<u32>, Vec<u32>, bool)> {
    let full = tok.encode(&format!("{prompt}{answer}"))?;
    if full.len() < prompt_ids.len() {
        bail!(
            "tokenization \"trl\": prompt+response encodes to fewer tokens ({}) than the prompt alone ({}); TRL's ORPOTrainer refuses such a row",
            full.len(),
            prompt_ids.len()
        );
    }
    let mut start = prompt_ids.len();
    let merged = full[..start] != *prompt_ids;
    if merged {
        start -= 1;
    }
    Ok((full[..start].to_vec(), full[start..].to_vec(), merged))
}

/// ORPOTrainer's `tokenize_row` (before its truncation), with one prompt for
/// both responses (see [`TokenizeReport::split_prompts`]).
fn trl_orpo_pair(
    data: &PreferenceData,
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    report: &mut TokenizeReport,
) -> Result<TokenizedPair> {
    let (prompt, chosen, rejected) = trl_orpo_text(data, template)?;
    let prompt_ids = tok.encode(&prompt)?;
    let (mut pc, mut ac, mc) = trl_orpo_answer(tok, &prompt, &prompt_ids, &chosen)?;
    let (mut pr, mut ar, mr) = trl_orpo_answer(tok, &prompt, &prompt_ids, &rejected)?;
    let differing = pc.iter().zip(&pr).filter(|(a, b)| a != b).count();
    if differing > 1 || pc.len().abs_diff(pr.len()) > 1 {
        bail!(
            "tokenization \"trl\": the chosen and rejected encodings split the prompt in ways that differ by more than the last token; TRL's ORPOTrainer refuses such a row"
        );
    }
    if let Some(bos) = tok.bos_id {
        for p in [&mut pc, &mut pr] {
            if p.first() != Some(&bos) {
                p.insert(0, bos);
            }
        }
    }
    let eos = tok.eos_id.ok_or_else(|| {
        anyhow!("tokenization \"trl\": the tokenizer has no EOS id, which TRL's ORPOTrainer appends to every response")
    })?;
    for a in [&mut ac, &mut ar] {
        if a.last() != Some(&eos) {
            a.push(eos);
            report.eos_appended += 1;
        }
    }
    if mc || mr {
        report.boundary_merges += 1;
    }
    if pc == pr {
        return Ok(TokenizedPair {
            prompt: pc,
            chosen: ac,
            rejected: ar,
        });
    }
    report.split_prompts += 1;
    let n = common_prefix_len(&pc, &pr);
    Ok(TokenizedPair {
        prompt: pc[..n].to_vec(),
        chosen: [&pc[n..], ac.as_slice()].concat(),
        rejected: [&pr[n..], ar.as_slice()].concat(),
    })
}

/// Tokenises one SFT example, updating `report`.
pub fn tokenize_sft_example(
    data: &SftData,
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    opts: &TokenizeOptions,
    report: &mut TokenizeReport,
) -> Result<TokenizedSft> {
    opts.validate()?;
    let (mut prompt, mut completion) = match opts.rules {
        TokenRules::Separate => {
            let r = render_sft(data, template)?;
            (
                encode_prompt(tok, &r.prompt)?,
                encode_response(tok, &r.completion, opts, report)?,
            )
        }
        // SFTTrainer's prompt-completion rule is DPOTrainer's with one response
        // (ORPO's rules never apply to SFT rows; see `TokenRules::resolve`).
        TokenRules::TrlDpo | TokenRules::TrlOrpo => {
            let (p, c) = match data {
                SftData::Text { prompt, completion } => {
                    (Part::Text(prompt), Part::Text(completion))
                }
                SftData::Chat { prompt, completion } => {
                    (Part::Chat(prompt), Part::Chat(completion))
                }
            };
            let (p, mut full) = trl_dpo_encode(tok, template, p, &[c])?;
            let full = full.pop().unwrap_or_default();
            let n = common_prefix_len(&p, &full);
            if n < p.len() {
                report.boundary_merges += 1;
            }
            (p[..n].to_vec(), full[n..].to_vec())
        }
    };
    if completion.is_empty() {
        bail!("field \"completion\": the completion encodes to no tokens");
    }
    if truncate_prompt(&mut prompt, opts.max_prompt_len, tok.bos_id) {
        report.prompt_truncated += 1;
    }
    let budget = opts.max_seq_len - prompt.len();
    if completion.len() > budget {
        completion.truncate(budget);
        report.response_truncated += 1;
    }
    let ex = TokenizedSft { prompt, completion };
    report.rows += 1;
    report.total_tokens += ex.len();
    report.max_seq_tokens = report.max_seq_tokens.max(ex.len());
    Ok(ex)
}

/// Tokenises preference examples. Errors name the example's source line; an
/// SFT example here is an error.
pub fn tokenize_preferences(
    examples: &[Example],
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    opts: &TokenizeOptions,
) -> Result<(Vec<TokenizedPair>, TokenizeReport)> {
    opts.validate()?;
    let mut report = TokenizeReport::default();
    let mut out = Vec::with_capacity(examples.len());
    for ex in examples {
        match ex {
            Example::Preference { line, data, .. } => out.push(
                tokenize_pair(data, tok, template, opts, &mut report)
                    .with_context(|| format!("line {line}"))?,
            ),
            Example::Sft { line, .. } => {
                bail!("line {line}: expected a preference example, found an SFT example")
            }
        }
    }
    Ok((out, report))
}

/// Tokenises SFT examples. Errors name the example's source line; a
/// preference example here is an error.
pub fn tokenize_sft(
    examples: &[Example],
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    opts: &TokenizeOptions,
) -> Result<(Vec<TokenizedSft>, TokenizeReport)> {
    opts.validate()?;
    let mut report = TokenizeReport::default();
    let mut out = Vec::with_capacity(examples.len());
    for ex in examples {
        match ex {
            Example::Sft { line, data, .. } => out.push(
                tokenize_sft_example(data, tok, template, opts, &mut report)
                    .with_context(|| format!("line {line}"))?,
            ),
            Example::Preference { line, .. } => {
                bail!("line {line}: expected an SFT example, found a preference example")
            }
        }
    }
    Ok((out, report))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::dataset::{read_jsonl, DatasetKind, Message};
    use std::str::FromStr;

    const SMOLLM2: &str = include_str!("../../tests/fixtures/smollm2_chat_template.jinja");

    /// A word-level tokenizer: words and punctuation split by the Whitespace
    /// pre-tokenizer (newlines vanish), ChatML special tokens as added tokens.
    fn tiny_tokenizer_json(with_bos_post_processor: bool) -> String {
        let words = [
            "[UNK]",
            "<s>",
            "</s>",
            "<|im_start|>",
            "<|im_end|>",
            "system",
            "user",
            "assistant",
            "You",
            "are",
            "a",
            "helpful",
            "AI",
            "named",
            "SmolLM",
            ",",
            "trained",
            "by",
            "Hugging",
            "Face",
            "What",
            "is",
            "2",
            "+",
            "?",
            "4",
            "5",
            "The",
            "answer",
            "Go",
            "away",
            ".",
            "one",
            "two",
            "three",
            "four",
            "five",
            "six",
            "seven",
            "eight",
            "nine",
            "ten",
            "Q",
            ":",
            "A",
        ];
        let vocab: serde_json::Map<String, serde_json::Value> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), serde_json::json!(i)))
            .collect();
        let added: Vec<serde_json::Value> = ["[UNK]", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
            .iter()
            .enumerate()
            .map(|(i, t)| {
                serde_json::json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                    "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let post = if with_bos_post_processor {
            serde_json::json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
            })
        } else {
            serde_json::Value::Null
        };
        serde_json::json!({
            "version": "1.0",
            "truncation": {"direction": "Right", "max_length": 3, "strategy": "LongestFirst", "stride": 0},
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": post,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        })
        .to_string()
    }

    fn chatml_tok() -> TextTokenizer {
        let inner = Tokenizer::from_str(&tiny_tokenizer_json(false)).unwrap();
        TextTokenizer::new(inner, Some(3), Some(4), false).unwrap()
    }

    fn text_tok() -> TextTokenizer {
        let inner = Tokenizer::from_str(&tiny_tokenizer_json(false)).unwrap();
        TextTokenizer::new(inner, Some(1), Some(2), true).unwrap()
    }

    fn words(tok: &TextTokenizer, ids: &[u32]) -> Vec<String> {
        ids.iter().map(|&i| tok.id_to_token(i).unwrap()).collect()
    }

    #[test]
    fn encode_maps_special_tokens_and_ignores_stored_truncation() {
        let tok = chatml_tok();
        // The tokenizer JSON asks for truncation to 3 tokens; it is switched off.
        let ids = tok
            .encode("<|im_start|>user\nWhat is 2+2?<|im_end|>")
            .unwrap();
        assert_eq!(
            words(&tok, &ids),
            [
                "<|im_start|>",
                "user",
                "What",
                "is",
                "2",
                "+",
                "2",
                "?",
                "<|im_end|>"
            ]
        );
        assert_eq!(tok.decode(&ids[..2]).unwrap(), "<|im_start|> user");
    }

    #[test]
    fn chat_pair_boundary_is_exact_and_no_extra_eos() {
        let tok = chatml_tok();
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        let data = PreferenceData::Chat {
            prompt: vec![Message::user("What is 2+2?")],
            chosen: vec![Message::assistant("The answer is 4.")],
            rejected: vec![Message::assistant("Go away.")],
        };
        let mut rep = TokenizeReport::default();
        let p = tokenize_pair(
            &data,
            &tok,
            Some(&t),
            &TokenizeOptions::new(64, 48),
            &mut rep,
        )
        .unwrap();
        let prompt = words(&tok, &p.prompt);
        assert_eq!(&prompt[..2], ["<|im_start|>", "system"]);
        assert_eq!(
            &prompt[prompt.len() - 4..],
            ["?", "<|im_end|>", "<|im_start|>", "assistant"]
        );
        // The response starts right after the generation prompt and ends with
        // the template's own <|im_end|> (eos): nothing appended.
        assert_eq!(
            words(&tok, &p.chosen),
            ["The", "answer", "is", "4", ".", "<|im_end|>"]
        );
        assert_eq!(words(&tok, &p.rejected), ["Go", "away", ".", "<|im_end|>"]);
        assert_eq!(rep.eos_appended, 0);
        assert_eq!(
            (rep.rows, rep.prompt_truncated, rep.response_truncated),
            (1, 0, 0)
        );
        assert_eq!(
            rep.total_tokens,
            2 * p.prompt.len() + p.chosen.len() + p.rejected.len()
        );
        // Tokenising prompt+chosen as one text gives the same ids here.
        let r = render_preference(&data, Some(&t)).unwrap();
        assert_eq!(
            tok.encode(&format!("{}{}", r.prompt, r.chosen)).unwrap(),
            p.chosen_sequence()
        );
    }

    #[test]
    fn text_pair_gets_bos_and_eos() {
        let tok = text_tok();
        let data = PreferenceData::Text {
            prompt: "Q: What is 2+2?".into(),
            chosen: " A: 4".into(),
            rejected: " A: 5".into(),
        };
        let mut rep = TokenizeReport::default();
        let opts = TokenizeOptions::new(32, 16);
        let p = tokenize_pair(&data, &tok, None, &opts, &mut rep).unwrap();
        assert_eq!(words(&tok, &p.prompt)[0], "<s>");
        assert_eq!(words(&tok, &p.chosen), ["A", ":", "4", "</s>"]);
        assert_eq!(words(&tok, &p.rejected), ["A", ":", "5", "</s>"]);
        assert_eq!(rep.eos_appended, 2);
        // Without append_eos nothing is added.
        let opts = TokenizeOptions {
            append_eos: false,
            ..opts
        };
        let p = tokenize_pair(&data, &tok, None, &opts, &mut rep).unwrap();
        assert_eq!(words(&tok, &p.chosen), ["A", ":", "4"]);
    }

    #[test]
    fn truncation_keeps_prompt_end_and_counts() {
        let tok = text_tok();
        let long_prompt = "one two three four five six seven eight nine ten";
        let data = PreferenceData::Text {
            prompt: long_prompt.into(),
            chosen: "one two three four five six".into(),
            rejected: "A".into(),
        };
        let mut rep = TokenizeReport::default();
        // prompt: <s> + 10 words; max_prompt_len 5 keeps <s> + last 4 words.
        let p = tokenize_pair(&data, &tok, None, &TokenizeOptions::new(9, 5), &mut rep).unwrap();
        assert_eq!(
            words(&tok, &p.prompt),
            ["<s>", "seven", "eight", "nine", "ten"]
        );
        // Budget 9 - 5 = 4: chosen (6 words + eos) cut on the right.
        assert_eq!(words(&tok, &p.chosen), ["one", "two", "three", "four"]);
        assert_eq!(words(&tok, &p.rejected), ["A", "</s>"]);
        assert_eq!(rep.prompt_truncated, 1);
        assert_eq!(rep.response_truncated, 1);
        assert_eq!(rep.max_seq_tokens, 9);

        // A short prompt leaves more room for the response.
        let data = PreferenceData::Text {
            prompt: "Q".into(),
            chosen: "one two three four five six".into(),
            rejected: "A".into(),
        };
        let p = tokenize_pair(&data, &tok, None, &TokenizeOptions::new(9, 5), &mut rep).unwrap();
        assert_eq!(p.prompt.len(), 2);
        assert_eq!(p.chosen.len(), 7);
        assert_eq!((rep.prompt_truncated, rep.response_truncated), (1, 1));

        // Identical after truncation is reported.
        let data = PreferenceData::Text {
            prompt: "Q".into(),
            chosen: "one two three four five".into(),
            rejected: "one two three four six".into(),
        };
        let mut rep = TokenizeReport::default();
        tokenize_pair(&data, &tok, None, &TokenizeOptions::new(6, 2), &mut rep).unwrap();
        assert_eq!(rep.identical_pairs, 1);
        assert!(rep.to_string().contains("1 pairs identical"), "{rep}");

        assert!(TokenizeOptions::new(8, 8).validate().is_err());
    }

    #[test]
    fn sft_forms_tokenize() {
        let tok = text_tok();
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        let text = [
            r#"{"text":"one two three"}"#,
            r#"{"prompt":"Q:","completion":" A"}"#,
            r#"{"messages":[{"role":"user","content":"What is 2+2?"},{"role":"assistant","content":"4"}]}"#,
        ]
        .join("\n");
        let (ex, _) = read_jsonl(text.as_bytes(), "t.jsonl", DatasetKind::Sft, false).unwrap();
        let (toks, rep) = tokenize_sft(&ex, &tok, Some(&t), &TokenizeOptions::new(64, 32)).unwrap();
        // {text}: only bos as prompt, every text token trained, eos appended.
        assert_eq!(words(&tok, &toks[0].prompt), ["<s>"]);
        assert_eq!(
            words(&tok, &toks[0].completion),
            ["one", "two", "three", "</s>"]
        );
        assert_eq!(words(&tok, &toks[1].completion), ["A", "</s>"]);
        // chat: the completion is the final assistant turn; the template does
        // not end with this tokenizer's eos (</s>), so it is appended.
        assert_eq!(
            words(&tok, &toks[2].completion),
            ["4", "<|im_end|>", "</s>"]
        );
        assert_eq!(rep.rows, 3);
        assert_eq!(rep.eos_appended, 3);
        // Kind mismatch and missing template are errors naming the line.
        let e = tokenize_preferences(&ex, &tok, Some(&t), &TokenizeOptions::new(64, 32))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "line 1: expected a preference example, found an SFT example"
        );
        let e = tokenize_sft(&ex, &tok, None, &TokenizeOptions::new(64, 32)).unwrap_err();
        assert_eq!(e.to_string(), "line 3");
        assert!(format!("{e:#}").contains("no chat template"), "{e:#}");
    }

    #[test]
    fn from_file_reads_config_and_detects_bos() {
        let dir = std::env::temp_dir().join(format!("lorafit-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, tiny_tokenizer_json(true)).unwrap();
        let tok = TextTokenizer::from_file(&path).unwrap();
        assert_eq!(
            (tok.bos_id(), tok.eos_id(), tok.add_bos()),
            (Some(1), None, true)
        );
        // encode() never adds the post-processor's bos.
        assert_eq!(words(&tok, &tok.encode("A").unwrap()), ["A"]);
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}, "add_bos_token": false}"#,
        )
        .unwrap();
        let tok = TextTokenizer::from_file(&path).unwrap();
        assert_eq!(
            (tok.bos_id(), tok.eos_id(), tok.add_bos()),
            (Some(3), Some(4), false)
        );
        std::fs::write(
            dir.join("tokenizer_config.json"),
            r#"{"eos_token": "<nope>"}"#,
        )
        .unwrap();
        let e = TextTokenizer::from_file(&path).unwrap_err().to_string();
        assert!(e.contains("not in the vocabulary"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn demo_dataset_loads_and_renders() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("demo");
        let t = ChatTemplate::new(SMOLLM2, "<|im_start|>", "<|im_end|>").unwrap();
        let mut prompts = Vec::new();
        for (name, n) in [("train.jsonl", 240), ("valid.jsonl", 48)] {
            let (ex, rep) =
                crate::data::load_dataset(root.join(name), DatasetKind::Preference, false).unwrap();
            assert_eq!((rep.loaded, rep.chat_rows, rep.skipped), (n, n, 0));
            let mut set = std::collections::HashSet::new();
            for e in &ex {
                let Example::Preference { data, .. } = e else {
                    panic!("not a preference row")
                };
                let r = render_preference(data, Some(&t)).unwrap();
                assert!(r.prompt.ends_with("<|im_start|>assistant\n"));
                assert!(r.chosen.starts_with("SURE! "), "{}", r.chosen);
                assert!(r.rejected.starts_with("Sure! "), "{}", r.rejected);
                assert_eq!(
                    r.chosen,
                    r.rejected
                        .to_uppercase()
                        .replace("<|IM_END|>", "<|im_end|>")
                );
                assert!(r.rejected.ends_with("<|im_end|>\n"));
                set.insert(r.prompt);
            }
            assert_eq!(set.len(), n, "{name}: duplicate prompts");
            prompts.push(set);
        }
        assert!(prompts[0].is_disjoint(&prompts[1]));
    }
}
