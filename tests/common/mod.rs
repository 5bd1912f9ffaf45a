//! Helpers shared by the integration tests: reading reference tensors and comparing numbers with
//! errors that name the worst index.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel)
}

/// All tensors of a safetensors file as f32 (ints widened), with shapes.
pub fn read_safetensors(path: &Path) -> HashMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, v)| {
            let data: Vec<f32> = match v.dtype() {
                safetensors::Dtype::I64 => v
                    .data()
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f32)
                    .collect(),
                safetensors::Dtype::I32 => v
                    .data()
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as f32)
                    .collect(),
                _ => lorafit::model::weights::view_to_f32(&v).unwrap(),
            };
            (name, (v.shape().to_vec(), data))
        })
        .collect()
}

/// `||a - b|| / ||b||`.
pub fn rel_norm(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let num: f64 = a
        .iter()
        .zip(b)
        .map(|(x, y)| ((*x - *y) as f64).powi(2))
        .sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

/// `(max |a - b|, index of it)`.
pub fn max_diff(a: &[f32], b: &[f32]) -> (f64, usize) {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .enumerate()
        .map(|(i, (x, y))| (((*x - *y) as f64).abs(), i))
        .fold((0.0, 0), |m, x| if x.0 > m.0 { x } else { m })
}

pub fn max_abs(a: &[f32]) -> f64 {
    a.iter().fold(0.0f64, |m, x| m.max((*x as f64).abs()))
}

/// Asserts relative-norm agreement, reporting the worst element.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f64) {
    let rn = rel_norm(got, want);
    let (md, i) = max_diff(got, want);
    assert!(
        rn <= tol,
        "{what}: rel-norm error {rn:.3e} > {tol:.1e} (max |diff| {md:.3e} at {i}: got {} want {})",
        got[i],
        want[i]
    );
}

/// Deterministic pseudo-random floats in [-1, 1).
pub fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut r = lorafit::tensor::Rng(seed);
    (0..n).map(|_| (r.uniform() * 2.0 - 1.0) as f32).collect()
}
