//! lorafit: LoRA fine-tuning (ORPO, SFT, DPO, SimPO) of decoder language models (the Llama family,
//! Gemma 2, 3 and 4, MiniCPM) on one NVIDIA GPU or the CPU.
//!
//! Data flows one way: config → data → model → train → outputs. `tensor` is the engine under all
//! of it: a CPU reference backend and a CUDA backend with the same ops. A model family is one file
//! in `model` that describes its layers; `model::runner` executes any family's layers.

pub mod atomic_file;
pub mod bench;
pub mod config;
pub mod curate;
pub mod data;
pub mod eval;
pub mod export;
pub mod hub_cache;
pub mod infer;
pub mod model;
pub mod plot;
pub mod recipe_file;
pub mod serve;
pub mod tensor;
pub mod train;

pub mod selftest;

#[cfg(test)]
#[path = "../tests/common/skip.rs"]
mod skip;
#[cfg(test)]
pub(crate) use skip::skip_note;

/// CUDA-vs-CPU parity of every op and of whole models (the `selftest` command).
pub fn selftest(device: &tensor::Device, seed: u64) -> anyhow::Result<()> {
    selftest::run(device, seed)
}
