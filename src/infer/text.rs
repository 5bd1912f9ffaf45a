//! Generated tokens as text while they arrive: each sequence's text decoded from all its tokens so
//! far, stop strings looked for in it, and the part that is safe to show (no half-decoded UTF-8
//! character, nothing that may yet turn out to be the start of a stop string) handed out as a
//! delta for streaming.

use crate::data::TextTokenizer;
use anyhow::Result;

/// One sequence's text so far.
#[derive(Default)]
pub struct TextState {
    /// Bytes of the decoded text already handed out.
    shown: usize,
    /// The text up to its first stop string, once one appeared.
    pub stopped_at: Option<(String, String)>,
}

impl TextState {
    /// Decodes `tokens` (the sequence's generated tokens so far) and returns the new text that
    /// may be shown, and whether a stop string appeared (the text then ends before it).
    pub fn update(
        &mut self,
        tok: &TextTokenizer,
        tokens: &[u32],
        stops: &[String],
        finished: bool,
    ) -> Result<(String, bool)> {
        let full = tok.decode(tokens)?;
        let hit = stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| full.find(s.as_str()).map(|i| (i, s)))
            .min_by_key(|(i, _)| *i);
        let end = match hit {
            Some((i, s)) => {
                self.stopped_at = Some((full[..i].to_string(), s.clone()));
                i
            }
            None if finished => full.len(),
            None => safe_end(&full, stops),
        };
        let delta = match full.get(self.shown..end) {
            Some(d) if end > self.shown => d.to_string(),
            _ => String::new(),
        };
        self.shown = self.shown.max(end);
        Ok((delta, hit.is_some()))
    }
}

/// How much of `text` can be shown now: not a trailing replacement character (a token that ends
/// inside a UTF-8 character), nor a tail that is the beginning of a stop string.
fn safe_end(text: &str, stops: &[String]) -> usize {
    let mut end = text.trim_end_matches('\u{FFFD}').len();
    for s in stops {
        // The longest proper prefix of `s` that `text[..end]` ends with.
        let prefixes: Vec<usize> = s.char_indices().skip(1).map(|(i, _)| i).collect();
        for &i in prefixes.iter().rev() {
            if text[..end].ends_with(&s[..i]) {
                end = end.min(text[..end].len() - i);
                break;
            }
        }
    }
    // Back to a character boundary.
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    end
}

#[cfg(test)]
mod tests {
    use super::safe_end;

    #[test]
    fn held_back_tail() {
        let stops = vec!["</answer>".to_string()];
        assert_eq!(safe_end("the answer is 4</an", &stops), 15);
        assert_eq!(safe_end("the answer is 4<", &stops), 15);
        assert_eq!(safe_end("the answer is 4", &stops), 15);
        assert_eq!(safe_end("caf\u{FFFD}", &[]), 3);
    }
}
