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
    load_dataset, read_jsonl, DatasetKind, Example, LoadReport, Message, PreferenceData, Role,
    RowError, SftData,
};
pub use template::ChatTemplate;
pub use tokenize::{
    render_preference, render_sft, tokenize_pair, tokenize_preferences, tokenize_sft,
    tokenize_sft_example, RenderedPair, RenderedSft, TextTokenizer, TokenRules, TokenizeOptions,
    TokenizeReport, TokenizedPair, TokenizedSft,
};
pub mod gguf_tokenizer;
