//! Quantize on load (`base_quant`): the seven projections of every layer are encoded as ggml
//! blocks while the model loads, so that a base of bf16 or f16 safetensors takes a quarter (Q4_0,
//! Q4_K) or a half (Q8_0) of its dense bytes on the GPU, and a 70B-parameter model trains on one
//! card. The blocks stay on the device and are dequantized to bf16 for each use, as a GGUF base's
//! are (`Weight::Quant`); the embedding, the head, norms and Gemma 4's per-layer branch stay dense.
//!
//! On the CPU the encoded blocks are decoded back to f32 at once and kept dense: the CPU then
//! computes with exactly the values the GPU dequantizes, so the CPU reference holds for a
//! quantized base too. The encoders are `export::quantize`'s (ggml's reference rounding), so a
//! base quantized here carries the same kind of error `llama-quantize` would give it.
//!
//! A GGUF base's projections are widened to f32 and encoded again: the new type's rounding adds to
//! the file's own (this is how the accuracy cost is measured, `scripts/quant_accuracy.sh`).

use super::gguf::GgmlType;
use super::weights::{check_finite, QuantWeight, TensorSource, Weight};
use crate::tensor::cuda::QuantKind;
use crate::tensor::{DType, Device, Tensor};
use anyhow::{bail, ensure, Result};
use serde::{Deserialize, Serialize};

/// The frozen base's storage for the seven projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum BaseQuant {
    /// As the model files hold them (bf16 on the GPU from a safetensors folder; a GGUF's own
    /// types).
    #[default]
    None,
    /// 8-bit blocks of 32 with an f16 scale (8.5 bits per weight).
    #[value(name = "q8_0")]
    #[serde(rename = "q8_0")]
    Q8_0,
    /// 4-bit blocks of 32 with an f16 scale (4.5 bits per weight).
    #[value(name = "q4_0")]
    #[serde(rename = "q4_0")]
    Q4_0,
    /// 4-bit blocks of 32 with an f16 scale and minimum (5 bits per weight).
    #[value(name = "q4_1")]
    #[serde(rename = "q4_1")]
    Q4_1,
    /// 4-bit super-blocks of 256 with 6-bit sub-block scales and minimums (4.5 bits per weight;
    /// needs input widths that are multiples of 256).
    #[value(name = "q4_k")]
    #[serde(rename = "q4_k")]
    Q4K,
}

impl BaseQuant {
    /// The setting's value as written in a config.
    pub fn name(self) -> &'static str {
        match self {
            BaseQuant::None => "none",
            BaseQuant::Q8_0 => "q8_0",
            BaseQuant::Q4_0 => "q4_0",
            BaseQuant::Q4_1 => "q4_1",
            BaseQuant::Q4K => "q4_k",
        }
    }

    /// The ggml type it encodes to (`None` for no quantization).
    pub fn ggml(self) -> Option<GgmlType> {
        match self {
            BaseQuant::None => None,
            BaseQuant::Q8_0 => Some(GgmlType::Q8_0),
            BaseQuant::Q4_0 => Some(GgmlType::Q4_0),
            BaseQuant::Q4_1 => Some(GgmlType::Q4_1),
            BaseQuant::Q4K => Some(GgmlType::Q4_K),
        }
    }

    pub fn kind(self) -> Option<QuantKind> {
        match self {
            BaseQuant::None => None,
            BaseQuant::Q8_0 => Some(QuantKind::Q8_0),
            BaseQuant::Q4_0 => Some(QuantKind::Q4_0),
            BaseQuant::Q4_1 => Some(QuantKind::Q4_1),
            BaseQuant::Q4K => Some(QuantKind::Q4_K),
        }
    }
}

/// Whether `name` is one of the seven LoRA-targetable projections of a layer.
pub fn is_projection(name: &str) -> bool {
    const LEAVES: [&str; 7] = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ];
    name.contains("layers.") && LEAVES.iter().any(|l| name.ends_with(l))
}

/// A tensor source whose projections are encoded as `quant` on load; everything else is read from
/// `inner` unchanged.
pub struct QuantizingSource<'a> {
    pub inner: &'a dyn TensorSource,
    pub quant: BaseQuant,
}

impl TensorSource for QuantizingSource<'_> {
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        self.inner.get(name)
    }
    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn weight(&self, name: &str, want: [usize; 2], device: &Device) -> Result<Weight> {
        let (Some(ty), Some(kind)) = (self.quant.ggml(), self.quant.kind()) else {
            return self.inner.weight(name, want, device);
        };
        if !is_projection(name) {
            return self.inner.weight(name, want, device);
        }
        let (shape, data) = self.inner.get(name)?;
        ensure!(
            shape == want,
            "{}: tensor {name} has shape {shape:?}, but config.json implies {want:?}",
            self.describe()
        );
        check_finite(&data, name, &self.describe())?;
        let [rows, cols] = want;
        let block = ty.block_size();
        if !cols.is_multiple_of(block) {
            bail!(
                "{}: tensor {name} is {rows}x{cols}; base_quant = \"{}\" encodes rows in blocks of \
                 {block}, and {cols} is not a multiple of {block} (q8_0, q4_0 and q4_1 take blocks of 32)",
                self.describe(),
                self.quant.name()
            );
        }
        let bytes = encode_rows(ty, &data, cols)?;
        match device {
            Device::Cuda(backend) => Ok(Weight::Quant(QuantWeight {
                backend: backend.clone(),
                bytes: backend.upload_bytes(&bytes)?,
                kind,
                rows,
                cols,
            })),
            Device::Cpu => {
                let mut values = vec![0f32; rows * cols];
                super::gguf::dequantize(ty, &bytes, rows * cols, &mut values)?;
                Ok(Weight::Dense(Tensor::from_f32(
                    &values,
                    &want,
                    DType::F32,
                    device,
                )?))
            }
        }
    }
}

/// `x` (`[rows, cols]` row-major, `cols` a whole number of blocks) encoded as `ty`, rows in
/// parallel; the bytes are those of one flat encoding of `x`.
pub fn encode_rows(ty: GgmlType, x: &[f32], cols: usize) -> Result<Vec<u8>> {
    use rayon::prelude::*;
    // About 1 Mi values per task: enough to spread a large matrix over every core.
    let rows_per_task = ((1 << 20) / cols.max(1)).max(1);
    let parts = x
        .par_chunks(rows_per_task * cols)
        .map(|rows| crate::export::quantize::quantize(ty, rows))
        .collect::<Result<Vec<_>>>()?;
    Ok(parts.concat())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_seven_projections_are_quantized() {
        assert!(is_projection("model.layers.3.self_attn.q_proj.weight"));
        assert!(is_projection(
            "model.language_model.layers.0.mlp.down_proj.weight"
        ));
        assert!(!is_projection("model.embed_tokens.weight"));
        assert!(!is_projection("lm_head.weight"));
        assert!(!is_projection("model.layers.0.self_attn.q_proj.bias"));
        assert!(!is_projection("model.layers.0.per_layer_projection.weight"));
        assert!(!is_projection("model.layers.0.input_layernorm.weight"));
    }

    #[test]
    fn parallel_rows_encode_as_one_flat_run() {
        let cols = 512;
        let x = crate::model::weights::random_normal(2100 * cols, 7, 0.02);
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_K] {
            let flat = crate::export::quantize::quantize(ty, &x).unwrap();
            assert_eq!(encode_rows(ty, &x, cols).unwrap(), flat, "{ty}");
        }
    }
}
