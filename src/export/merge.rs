//! The merge maths: a LoRA pair's weight delta `ΔW = scale · B A` (`[out, in]`), added to a
//! frozen projection, and the same delta in llama.cpp's row order for q and k.
//!
//! A trained adapter computes `W x + scale · B (A x)`; the merged projection `(W + scale·B A) x`
//! is the same function up to float rounding, so the merged model needs no adapter at run
//! time. The delta is one GEMM on the CPU reference backend (f32 in, f32 out).

use crate::model::gguf::permute_qk_rows;
use crate::model::lora::LoraPair;
use crate::model::{ModelSpec, Target};
use crate::tensor::{self as ops, DType, Device, Tensor};
use anyhow::{ensure, Context, Result};

/// `scale · B A` as a row-major `[out, in]` f32 matrix.
pub fn lora_delta(pair: &LoraPair) -> Result<Vec<f32>> {
    let a = on_cpu(&pair.a)?;
    let b = on_cpu(&pair.b)?;
    ensure!(
        a.shape().len() == 2 && b.shape().len() == 2 && b.shape()[1] == a.shape()[0],
        "LoRA pair shapes A {:?} and B {:?} do not chain",
        a.shape(),
        b.shape()
    );
    ops::matmul(&b, false, &a, false, pair.scale, DType::F32)?.to_vec()
}

fn on_cpu(t: &Tensor) -> Result<Tensor> {
    let (data, shape) = (t.to_vec()?, t.shape().to_vec());
    Tensor::from_f32(&data, &shape, DType::F32, &Device::Cpu)
}

/// Adds `delta` to `weight` in place (both row-major `[out, in]`).
pub fn add_delta(weight: &mut [f32], delta: &[f32], name: &str) -> Result<()> {
    ensure!(
        weight.len() == delta.len(),
        "{name}: the adapter's delta has {} values, the weight {}",
        delta.len(),
        weight.len()
    );
    for (w, d) in weight.iter_mut().zip(delta) {
        *w += d;
    }
    Ok(())
}

/// The head count whose q/k row permutation llama.cpp's converter applies to `target`'s
/// weight for an architecture that permutes (`None` for v, o and the MLP).
pub fn permuted_heads(spec: &ModelSpec, target: Target) -> Option<usize> {
    match target {
        Target::Q => Some(spec.n_heads),
        Target::K => Some(spec.n_kv_heads),
        _ => None,
    }
}

/// The delta in a GGUF file's row order: q/k rows permuted as llama.cpp's converter permutes
/// the base weight (`LlamaModel.permute`), when `permutes` is set.
pub fn gguf_delta(
    pair: &LoraPair,
    spec: &ModelSpec,
    target: Target,
    permutes: bool,
) -> Result<Vec<f32>> {
    let mut delta = lora_delta(pair)?;
    if let (true, Some(n_head)) = (permutes, permuted_heads(spec, target)) {
        let (rows, cols) = (pair.b.shape()[0], pair.a.shape()[1]);
        permute_qk_rows(&mut delta, rows, cols, n_head)
            .with_context(|| format!("permuting the {} delta", target.module()))?;
    }
    Ok(delta)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `scale · B A` against an f64 triple loop on an uneven shape.
    #[test]
    fn delta_is_scale_b_a() {
        let (out, r, inp) = (5, 3, 7);
        let a: Vec<f32> = (0..r * inp)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.1)
            .collect();
        let b: Vec<f32> = (0..out * r)
            .map(|i| ((i * 5 % 13) as f32 - 6.0) * 0.05)
            .collect();
        let pair = LoraPair::from_host(&a, &b, r, out, inp, 1.75, &Device::Cpu).unwrap();
        let got = lora_delta(&pair).unwrap();
        for o in 0..out {
            for i in 0..inp {
                let want: f64 = (0..r)
                    .map(|k| b[o * r + k] as f64 * a[k * inp + i] as f64)
                    .sum::<f64>()
                    * 1.75;
                let g = got[o * inp + i] as f64;
                assert!(
                    (g - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "[{o},{i}] {g} vs {want}"
                );
            }
        }
        let mut w = vec![1.0f32; out * inp];
        add_delta(&mut w, &got, "w").unwrap();
        assert_eq!(w[3], 1.0 + got[3]);
        assert!(add_delta(&mut w[1..], &got, "w").is_err());
    }
}
