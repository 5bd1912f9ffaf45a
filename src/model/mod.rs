//! Models: configuration, the family files that describe each architecture's layers, frozen
//! weights, LoRA adapters, the layer maths and the runner that executes any family's layers.

pub mod config;
pub mod gemma;
pub mod gemma4;
pub mod layer;
pub mod llama;
pub mod lora;
pub mod minicpm;
pub mod quantize_on_load;
pub mod runner;
pub mod weights;

pub use config::{Family, ModelSpec};
pub use lora::{Lora, LoraConfig, Target};
pub use quantize_on_load::BaseQuant;
pub use runner::{ForwardPlan, Model, PassCtx};
pub mod gguf;
pub mod gguf_model;
pub mod smollm2;

use anyhow::{bail, Context, Result};
use std::path::Path;

/// Loads a model from a Hugging Face folder (config.json + safetensors) or a GGUF file.
pub fn load(path: &Path, device: &crate::tensor::Device) -> Result<Model> {
    load_quantized(path, device, BaseQuant::None)
}

/// [`load`], with the seven projections of every layer encoded as `quant` on the way
/// (`quantize_on_load`).
pub fn load_quantized(
    path: &Path,
    device: &crate::tensor::Device,
    quant: BaseQuant,
) -> Result<Model> {
    let build = |spec: ModelSpec, src: &dyn weights::TensorSource| -> Result<Model> {
        let src = quantize_on_load::QuantizingSource { inner: src, quant };
        let w = weights::load_weights(&spec, &src, device)?;
        Ok(Model::new(spec, w, device.clone()))
    };
    if path.is_dir() {
        let spec = ModelSpec::from_config_file(&path.join("config.json"))?;
        let src = weights::SafetensorsFolder::open(path)?;
        src.check_tensors(&spec)?;
        let model = build(spec, &src)?;
        if let Some(note) = src.unread_note(&model.spec) {
            eprintln!("note: {note}");
        }
        Ok(model)
    } else if path.extension().is_some_and(|e| e == "gguf") {
        let src = gguf_model::GgufSource::open(path)?;
        build(src.spec.clone(), &src)
    } else if !path.exists() {
        bail!("model path {} does not exist", path.display())
    } else {
        Err(anyhow::anyhow!(
            "expected a Hugging Face model folder or a .gguf file"
        ))
        .with_context(|| format!("{}", path.display()))
    }
}
