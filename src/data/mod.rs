//! Training data for lorafit: loading JSONL rows ([`dataset`]), rendering chat
//! rows with the model's chat template ([`template`]) and turning examples into
//! truncated token sequences with an exact prompt/response boundary
//! ([`tokenize`]).
//!
//! This is its own module so that everything between "a file on disk" and
//! "token ids ready for batching" is validated, counted and reported in one
//! place, independent of the model and trainer code.

pub mod dataset;
pub mod template;
pub mod tokenize;

pub use dataset::{
    load_jsonl, read_jsonl, DatasetKind, Example, LoadReport, Message, PreferenceData, Role,
    RowError, SftData,
};
pub use template::ChatTemplate;
pub use tokenize::{
    render_preference, render_sft, tokenize_pair, tokenize_preferences, tokenize_sft,
    tokenize_sft_example, RenderedPair, RenderedSft, TextTokenizer, TokenizeOptions,
    TokenizeReport, TokenizedPair, TokenizedSft,
};
pub mod gguf_tokenizer;
