//! Training data for lorafit: reading dataset files as rows ([`rows`]) and
//! validating them as examples ([`dataset`]), rendering chat
//! rows with the model's chat template ([`template`]) and turning examples into
//! truncated token sequences by the configured rules ([`tokenize`]), and the
//! pre-flight checks of every row that `lint` and `train` share ([`check`]).
//!
//! This is its own module so that everything between "a file on disk" and
//! "token ids ready for batching" is validated, counted and reported in one
//! place, independent of the model and trainer code.

pub mod check;
pub mod dataset;
pub mod model_files;
pub mod rows;
pub mod template;
pub mod tokenize;

pub use check::{load_and_check, CheckOptions, CheckReport, CheckedRow, Finding, RowTokens};
pub use dataset::{
    load_dataset, read_jsonl, DatasetKind, Example, LoadReport, Message, NoUsableRows,
    PreferenceData, Role, RowError, SftData,
};
pub use template::ChatTemplate;
pub use tokenize::{
    render_preference, render_sft, tokenize_pair, tokenize_preferences, tokenize_sft,
    tokenize_sft_example, RenderedPair, RenderedSft, TextTokenizer, TokenRules, TokenizeOptions,
    TokenizeReport, TokenizedPair, TokenizedSft,
};
pub mod gguf_tokenizer;

/// Rows a call of [`in_order_parallel`] works on at once.
const IN_ORDER_CHUNK: usize = 2048;

/// `work` over `items` on every core, [`IN_ORDER_CHUNK`] items at a time, each item and its result
/// handed to `take` in order. An error from `take` ends the run before the rest is worked on, so
/// a strict check stops near its first bad row, as a pass in order would, and what `take` sees
/// (counts, duplicates, the first error) is that pass's.
pub fn in_order_parallel<T: Sync, R: Send>(
    items: Vec<T>,
    work: impl Fn(&T) -> R + Sync,
    mut take: impl FnMut(T, R) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    use rayon::prelude::*;
    let mut rest = items.into_iter();
    loop {
        let chunk: Vec<T> = rest.by_ref().take(IN_ORDER_CHUNK).collect();
        if chunk.is_empty() {
            return Ok(());
        }
        let results: Vec<R> = chunk.par_iter().map(&work).collect();
        for (item, result) in chunk.into_iter().zip(results) {
            take(item, result)?;
        }
    }
}
