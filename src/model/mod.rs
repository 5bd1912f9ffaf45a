//! Models: configuration, frozen weights, LoRA adapters, and the Llama-family layer passes.

pub mod config;
pub mod llama;
pub mod lora;
pub mod weights;

pub use config::{Family, ModelSpec};
pub use llama::{Model, PassCtx};
pub use lora::{Lora, LoraConfig, Target};
