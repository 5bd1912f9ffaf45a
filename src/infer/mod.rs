//! Text generation with or without an adapter: a prefill of each prompt into a KV cache, then one
//! token per sequence per step reading the cache (`decode`, `kv_cache`), greedy or sampled
//! (`sample`), with stop tokens, stop strings, a token limit, batched prompts and streamed text
//! (`text`); the chat path renders the model's own template (`chat`).
//!
//! The public calls: `generate` (token ids in, tokens out), `generate_stream` (with a tokenizer:
//! stop strings, text, a callback per text delta, timings), `chat_prompt_ids` and
//! `chat::ChatSession`. `generate_ids` and `chat` are the earlier greedy calls, now cached;
//! `generate_ids_uncached` re-runs the whole forward per token and is the reference the cache is
//! tested against.
//!
//! Every path keeps to the model's context (`context_length`): a prompt longer than it is refused
//! (`PromptTooLong`), and a sequence stops when the prompt and its reply fill it
//! (`StopReason::Context`), since past it the model decodes positions it was never trained on.

pub mod chat;
pub mod decode;
pub mod kv_cache;
pub mod sample;
pub mod text;

pub use chat::ChatSession;
pub use decode::Decoder;
pub use sample::Sampling;

use crate::data::{ChatTemplate, Message, TextTokenizer};
use crate::model::{Lora, Model};
use crate::tensor::{self as ops, DType};
use anyhow::{bail, ensure, Result};
use std::time::Instant;

/// What to generate and when to stop.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOptions {
    /// The most tokens generated per sequence.
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    /// Tokens that end a sequence (eos, end of turn); not part of its output.
    pub stop_tokens: Vec<u32>,
    /// Strings that end a sequence once its text holds one; the text ends before it (needs a
    /// tokenizer: `generate_stream`).
    pub stop_strings: Vec<String>,
}

impl GenerateOptions {
    /// Greedy decoding of up to `max_new_tokens`, stopping at `eos`.
    pub fn greedy(max_new_tokens: usize, eos: Option<u32>) -> GenerateOptions {
        GenerateOptions {
            max_new_tokens,
            sampling: Sampling::default(),
            stop_tokens: eos.into_iter().collect(),
            stop_strings: Vec::new(),
        }
    }
}

/// Why a sequence ended.
#[derive(Clone, Debug, PartialEq)]
pub enum StopReason {
    StopToken(u32),
    StopString(String),
    MaxTokens,
    /// The prompt and the reply filled the model's context (`context_length`).
    Context,
}

/// The positions a model was trained for: its config's `max_position_embeddings` (a GGUF's
/// `context_length`). A sequence holds at most this many tokens, prompt and reply together.
pub fn context_length(model: &Model) -> usize {
    model.spec.max_position_embeddings
}

/// A prompt with more tokens than the model's context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PromptTooLong {
    pub tokens: usize,
    pub context: usize,
}

impl std::fmt::Display for PromptTooLong {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the prompt is {} tokens, more than the model's context of {} tokens (its \
             max_position_embeddings); past it the model decodes positions it was never trained on",
            self.tokens, self.context
        )
    }
}

impl std::error::Error for PromptTooLong {}

/// The most tokens a reply to a prompt of `prompt_tokens` can have before the two fill the
/// model's context (0 when the prompt fills it alone); an error for a prompt longer than it.
pub fn reply_room(model: &Model, prompt_tokens: usize) -> Result<usize, PromptTooLong> {
    let context = context_length(model);
    if prompt_tokens > context {
        return Err(PromptTooLong {
            tokens: prompt_tokens,
            context,
        });
    }
    Ok(context - prompt_tokens)
}

/// One sequence's output.
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    /// The generated ids, without the stop token (with a stop string: up to the token that
    /// completed it).
    pub tokens: Vec<u32>,
    /// With a tokenizer: the decoded text, ending before a stop string.
    pub text: Option<String>,
    pub stop: StopReason,
}

/// Counts and timings of one `generate_stream` call.
#[derive(Clone, Debug, Default)]
pub struct GenerateStats {
    pub sequences: usize,
    pub prompt_tokens: usize,
    /// Tokens generated (stop tokens included).
    pub new_tokens: usize,
    pub prefill_s: f64,
    /// Tokens the decode steps ran (every generated token but the last of each sequence) and
    /// their time.
    pub decode_tokens: usize,
    pub decode_s: f64,
}

impl GenerateStats {
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_s.max(1e-12)
    }
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_s.max(1e-12)
    }
    /// One line for people: prompt and generated tokens with their rates.
    pub fn summary(&self) -> String {
        format!(
            "{} sequence(s): prefill {} tokens in {:.2}s ({:.1} tok/s), decode {} tokens in {:.2}s ({:.1} tok/s)",
            self.sequences,
            self.prompt_tokens,
            self.prefill_s,
            self.prefill_tokens_per_s(),
            self.decode_tokens,
            self.decode_s,
            self.decode_tokens_per_s()
        )
    }
}

/// The outputs of a `generate_stream` call, in prompt order, and its timings.
pub struct GenerateReport {
    pub outputs: Vec<Generated>,
    pub stats: GenerateStats,
}

/// Generates a continuation of each prompt (token ids, a batch decoded together) with the KV
/// cache. Stop strings need `generate_stream`, which has the tokenizer.
pub fn generate(
    model: &Model,
    lora: Option<&Lora>,
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
) -> Result<Vec<Generated>> {
    Ok(generate_stream(model, lora, prompts, opts, None, &mut |_, _| {})?.outputs)
}

/// `generate` with a tokenizer: each sequence's text, stop strings, and `on_text(sequence, delta)`
/// called with each new piece of text that is safe to show.
pub fn generate_stream(
    model: &Model,
    lora: Option<&Lora>,
    prompts: &[Vec<u32>],
    opts: &GenerateOptions,
    tok: Option<&TextTokenizer>,
    on_text: &mut dyn FnMut(usize, &str),
) -> Result<GenerateReport> {
    ensure!(!prompts.is_empty(), "generate: no prompt");
    for (i, p) in prompts.iter().enumerate() {
        ensure!(!p.is_empty(), "generate: prompt {i} has no tokens");
        if let Err(e) = reply_room(model, p.len()) {
            let e = anyhow::Error::new(e);
            return Err(if prompts.len() > 1 {
                e.context(format!("generate: prompt {i}"))
            } else {
                e
            });
        }
    }
    check_options(opts, tok)?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    // No sequence grows past the context, whatever `max_new_tokens` asks for.
    let capacity = longest
        .saturating_add(opts.max_new_tokens)
        .min(context_length(model));
    let mut dec = Decoder::new(model, lora, prompts.len(), capacity)?;
    let mut sampler = sample::Sampler::new(&opts.sampling, prompts.len())?;
    let t0 = Instant::now();
    let mut logits = Vec::with_capacity(prompts.len());
    for (b, p) in prompts.iter().enumerate() {
        logits.push(dec.extend(&[(b, p)])?.remove(0));
    }
    let prefill_s = t0.elapsed().as_secs_f64();
    let seqs: Vec<usize> = (0..prompts.len()).collect();
    let (outputs, mut stats) =
        decode_loop(&mut dec, &mut sampler, &seqs, logits, opts, tok, on_text)?;
    stats.prompt_tokens = prompts.iter().map(Vec::len).sum();
    stats.prefill_s = prefill_s;
    Ok(GenerateReport { outputs, stats })
}

fn check_options(opts: &GenerateOptions, tok: Option<&TextTokenizer>) -> Result<()> {
    opts.sampling.validate()?;
    if tok.is_none() && !opts.stop_strings.is_empty() {
        bail!("generate: stop strings need a tokenizer (generate_stream)");
    }
    if opts.stop_strings.iter().any(String::is_empty) {
        bail!("generate: an empty stop string");
    }
    Ok(())
}

/// The decoding loop over sequences `seqs` of `dec`, whose next-token logits are `logits` (one
/// per sequence): draw, stop or feed each token, until every sequence has stopped.
pub(crate) fn decode_loop(
    dec: &mut Decoder,
    sampler: &mut sample::Sampler,
    seqs: &[usize],
    mut logits: Vec<Vec<f32>>,
    opts: &GenerateOptions,
    tok: Option<&TextTokenizer>,
    on_text: &mut dyn FnMut(usize, &str),
) -> Result<(Vec<Generated>, GenerateStats)> {
    let n = seqs.len();
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut texts: Vec<text::TextState> = (0..n).map(|_| Default::default()).collect();
    let mut stop: Vec<Option<StopReason>> = vec![None; n];
    let mut stats = GenerateStats {
        sequences: n,
        ..Default::default()
    };
    if opts.max_new_tokens == 0 {
        stop.fill(Some(StopReason::MaxTokens));
    }
    let context = context_length(dec.model());
    for (i, &seq) in seqs.iter().enumerate() {
        if stop[i].is_none() && dec.cache.ids(seq).len() >= context {
            stop[i] = Some(StopReason::Context);
        }
    }
    let t0 = Instant::now();
    loop {
        let mut feed = Vec::new();
        for i in 0..n {
            if stop[i].is_some() {
                continue;
            }
            let seq = seqs[i];
            let id = sampler
                .next(seq, &mut logits[i], dec.cache.ids(seq))
                .map_err(|e| {
                    anyhow::anyhow!("generate: sequence {i}, token {}: {e}", tokens[i].len())
                })?;
            stats.new_tokens += 1;
            if opts.stop_tokens.contains(&id) {
                stop[i] = Some(StopReason::StopToken(id));
                continue;
            }
            tokens[i].push(id);
            if let Some(tok) = tok {
                let (delta, hit) = texts[i].update(tok, &tokens[i], &opts.stop_strings, false)?;
                if !delta.is_empty() {
                    on_text(i, &delta);
                }
                if hit {
                    let s = texts[i].stopped_at.as_ref().map(|x| x.1.clone());
                    stop[i] = Some(StopReason::StopString(s.unwrap_or_default()));
                    continue;
                }
            }
            if tokens[i].len() >= opts.max_new_tokens {
                stop[i] = Some(StopReason::MaxTokens);
                continue;
            }
            // The cache holds the prompt and every token but this one: with it the sequence
            // fills the context.
            if dec.cache.ids(seq).len() + 1 >= context {
                stop[i] = Some(StopReason::Context);
                continue;
            }
            feed.push(i);
        }
        if feed.is_empty() {
            break;
        }
        let batch: Vec<(usize, &[u32])> = feed
            .iter()
            .map(|&i| (seqs[i], &tokens[i][tokens[i].len() - 1..]))
            .collect();
        let out = dec.extend(&batch)?;
        stats.decode_tokens += batch.len();
        for (&i, l) in feed.iter().zip(out) {
            logits[i] = l;
        }
    }
    stats.decode_s = t0.elapsed().as_secs_f64();
    let mut outputs = Vec::with_capacity(n);
    for i in 0..n {
        let text = match tok {
            Some(tok) => {
                let (delta, _) = texts[i].update(tok, &tokens[i], &opts.stop_strings, true)?;
                if !delta.is_empty() {
                    on_text(i, &delta);
                }
                Some(match &texts[i].stopped_at {
                    Some((t, _)) => t.clone(),
                    None => tok.decode(&tokens[i])?,
                })
            }
            None => None,
        };
        outputs.push(Generated {
            tokens: std::mem::take(&mut tokens[i]),
            text,
            stop: stop[i].take().unwrap_or(StopReason::MaxTokens),
        });
    }
    Ok((outputs, stats))
}

/// Greedy continuation of `prompt_ids` with the KV cache, stopping at `eos` or after `max_new`
/// tokens (the stop token is not returned).
pub fn generate_ids(
    model: &Model,
    lora: Option<&Lora>,
    prompt_ids: &[u32],
    max_new: usize,
    eos: Option<u32>,
) -> Result<Vec<u32>> {
    ensure!(!prompt_ids.is_empty(), "generate: the prompt has no tokens");
    let opts = GenerateOptions::greedy(max_new, eos);
    let mut out = generate(model, lora, &[prompt_ids.to_vec()], &opts)?;
    Ok(out.remove(0).tokens)
}

/// `generate_ids` without a cache: every token re-runs the forward over the whole sequence. The
/// reference the cached path is tested against (tests/generation.rs, the selftest); it keeps to
/// the context as the cached path does.
pub fn generate_ids_uncached(
    model: &Model,
    lora: Option<&Lora>,
    prompt_ids: &[u32],
    max_new: usize,
    eos: Option<u32>,
) -> Result<Vec<u32>> {
    ensure!(!prompt_ids.is_empty(), "generate: the prompt has no tokens");
    let room = reply_room(model, prompt_ids.len())?;
    let mut ids = prompt_ids.to_vec();
    let mut out = Vec::new();
    for step in 0..max_new.min(room) {
        let h = model.hidden_states(&ids, lora)?;
        let last = ops::slice_rows(&h, ids.len() - 1, ids.len())?;
        let logits = model.logits(&last, DType::F32)?.to_vec()?;
        if let Some((i, v)) = logits.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            bail!(
                "generate: token {step}: logit {i} is {v}; the base weights or the adapter hold non-finite values"
            );
        }
        let next = sample::argmax(&logits);
        if Some(next) == eos {
            break;
        }
        ids.push(next);
        out.push(next);
    }
    Ok(out)
}

/// The prompt ids of a conversation as the model's own template renders it, with the generation
/// prompt: the rendered text tokenised with one bos (the template's, or the tokenizer's when the
/// template writes none and the tokenizer adds one), exactly as training tokenises prompts.
/// Without a template the messages' contents are joined by newlines. A template that never
/// shows the messages, or renders nothing for these, is refused
/// (`ChatTemplate::generation_prompt`).
pub fn chat_prompt_ids(
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    messages: &[Message],
) -> Result<Vec<u32>> {
    let text = match template {
        Some(t) => t.generation_prompt(messages)?,
        None => messages
            .iter()
            .map(|m| m.content.as_str())
            .collect::<Vec<_>>()
            .join("\n"),
    };
    crate::data::tokenize::encode_prompt(tok, &text)
}

/// The tokens that end a reply: the tokenizer's eos, the model config's, the template's eos
/// token (an end-of-turn token such as `<|im_end|>` or `<end_of_turn>` where the template names
/// one) and the model folder's generation_config.json `eos_token_id`s. A generation_config.json
/// that could not be read is a warning on stderr.
pub fn default_stop_tokens(
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    model: &Model,
) -> Vec<u32> {
    if let Some(w) = tok.generation_config_warning() {
        eprintln!("warning: {w}");
    }
    stop_tokens(tok, template, model)
}

/// `default_stop_tokens` without its warning (`chat`, called once a prompt by eval).
fn stop_tokens(tok: &TextTokenizer, template: Option<&ChatTemplate>, model: &Model) -> Vec<u32> {
    let mut stops: Vec<u32> = Vec::new();
    let from_template = template
        .map(|t| t.eos_token())
        .filter(|s| !s.is_empty())
        .and_then(|s| tok.token_to_id(s));
    let ids = [tok.eos_id(), model.spec.eos_token_id, from_template]
        .into_iter()
        .flatten()
        .chain(tok.generation_eos_ids().iter().copied());
    for id in ids {
        if !stops.contains(&id) {
            stops.push(id);
        }
    }
    stops
}

/// Renders a user message with the chat template (or uses it raw) and decodes the greedy reply,
/// which ends at any of `default_stop_tokens` (as `generate` and `chat` end theirs).
pub fn chat(
    model: &Model,
    lora: Option<&Lora>,
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    user: &str,
    max_new: usize,
) -> Result<String> {
    let ids = chat_prompt_ids(tok, template, &[Message::user(user)])?;
    let opts = GenerateOptions {
        stop_tokens: stop_tokens(tok, template, model),
        ..GenerateOptions::greedy(max_new, None)
    };
    let mut out = generate(model, lora, &[ids], &opts)?;
    tok.decode(&out.remove(0).tokens)
}
