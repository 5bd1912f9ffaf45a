//! Text generation with or without an adapter: greedy decoding, used by the demo's before/after
//! comparison and `lorafit generate`. Each new token re-runs the forward over the whole sequence
//! (no KV cache yet), which is fine for the short completions the demo needs.

use crate::data::{ChatTemplate, Message, TextTokenizer};
use crate::model::{Lora, Model};
use crate::tensor::{self as ops, DType};
use anyhow::{bail, ensure, Result};

/// Greedy continuation of `prompt_ids`, stopping at `eos` or after `max_new` tokens.
pub fn generate_ids(
    model: &Model,
    lora: Option<&Lora>,
    prompt_ids: &[u32],
    max_new: usize,
    eos: Option<u32>,
) -> Result<Vec<u32>> {
    ensure!(!prompt_ids.is_empty(), "generate: the prompt has no tokens");
    let mut ids = prompt_ids.to_vec();
    let mut out = Vec::new();
    for step in 0..max_new {
        let h = model.hidden_states(&ids, lora)?;
        let last = ops::slice_rows(&h, ids.len() - 1, ids.len())?;
        let logits = model.logits(&last, DType::F32)?.to_vec()?;
        if let Some((i, v)) = logits.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            bail!(
                "generate: token {step}: logit {i} is {v}; the base weights or the adapter hold non-finite values"
            );
        }
        let next = logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |b, (i, &v)| {
                if v > b.1 {
                    (i, v)
                } else {
                    b
                }
            })
            .0 as u32;
        if Some(next) == eos {
            break;
        }
        ids.push(next);
        out.push(next);
    }
    Ok(out)
}

/// Renders a user message with the chat template (or uses it raw) and decodes the reply.
pub fn chat(
    model: &Model,
    lora: Option<&Lora>,
    tok: &TextTokenizer,
    template: Option<&ChatTemplate>,
    user: &str,
    max_new: usize,
) -> Result<String> {
    let text = match template {
        Some(t) => t.render(&[Message::user(user)], true)?,
        None => user.to_string(),
    };
    let mut ids = Vec::new();
    if tok.add_bos() {
        ids.extend(tok.bos_id());
    }
    ids.extend(tok.encode(&text)?);
    let out = generate_ids(model, lora, &ids, max_new, tok.eos_id())?;
    tok.decode(&out)
}
