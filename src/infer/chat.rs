//! A conversation with a model (`lorafit chat`): the messages so far, an optional system message,
//! and one KV cache kept across turns. Each turn renders the whole conversation with the model's
//! template; the tokens it shares with what the cache holds are not run again. A turn whose
//! conversation is longer than the model's context is refused (`PromptTooLong`), the
//! conversation left as it was.

use super::decode::Decoder;
use super::sample::Sampler;
use super::{chat_prompt_ids, decode_loop, reply_room, GenerateOptions, GenerateStats, Generated};
use crate::data::{ChatTemplate, Message, TextTokenizer};
use crate::model::{Lora, Model};
use anyhow::Result;
use std::time::Instant;

pub struct ChatSession<'m> {
    decoder: Decoder<'m>,
    sampler: Sampler,
    tok: &'m TextTokenizer,
    template: Option<&'m ChatTemplate>,
    system: Option<String>,
    messages: Vec<Message>,
    opts: GenerateOptions,
}

impl<'m> ChatSession<'m> {
    pub fn new(
        model: &'m Model,
        lora: Option<&'m Lora>,
        tok: &'m TextTokenizer,
        template: Option<&'m ChatTemplate>,
        opts: GenerateOptions,
    ) -> Result<ChatSession<'m>> {
        // Before the first message: a template that would drop every message ends the chat now.
        if let Some(t) = template {
            t.check_for_generation()?;
        }
        Ok(ChatSession {
            decoder: Decoder::new(model, lora, 1, 512)?,
            sampler: Sampler::new(&opts.sampling, 1)?,
            tok,
            template,
            system: None,
            messages: Vec::new(),
            opts,
        })
    }

    /// Forgets the conversation (the system message stays).
    pub fn reset(&mut self) {
        self.messages.clear();
        self.decoder.reset(0);
    }

    /// Sets (or with `None` removes) the system message; the conversation starts again.
    pub fn set_system(&mut self, system: Option<String>) {
        self.system = system.filter(|s| !s.trim().is_empty());
        self.reset();
    }

    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// The conversation as the template renders it with `user` as the next message.
    fn prompt_ids(&self, user: &str) -> Result<Vec<u32>> {
        let mut all: Vec<Message> = self.system.iter().map(Message::system).collect();
        all.extend(self.messages.iter().cloned());
        all.push(Message::user(user));
        chat_prompt_ids(self.tok, self.template, &all)
    }

    /// Answers `user`, streaming the reply's text to `on_text`; the reply joins the conversation.
    /// A conversation that no longer fits the model's context is a `PromptTooLong` error, and
    /// `user` does not join it.
    pub fn reply(
        &mut self,
        user: &str,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<(Generated, GenerateStats)> {
        let ids = self.prompt_ids(user)?;
        reply_room(self.decoder.model(), ids.len())?;
        let reused = {
            let held = self.decoder.cache.ids(0);
            held.iter().zip(&ids).take_while(|(a, b)| a == b).count()
        };
        let t0 = Instant::now();
        let logits = self.decoder.set_sequence(0, &ids)?;
        let prefill_s = t0.elapsed().as_secs_f64();
        let (mut out, mut stats) = decode_loop(
            &mut self.decoder,
            &mut self.sampler,
            &[0],
            vec![logits],
            &self.opts,
            Some(self.tok),
            &mut |_, d| on_text(d),
        )?;
        stats.prompt_tokens = ids.len() - reused.min(ids.len() - 1);
        stats.prefill_s = prefill_s;
        let g = out.remove(0);
        self.messages.push(Message::user(user));
        self.messages
            .push(Message::assistant(g.text.clone().unwrap_or_default()));
        Ok((g, stats))
    }
}
