//! Helpers shared by the integration tests: reading reference tensors and comparing numbers with
//! errors that name the worst index.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub mod family_configs;
pub mod llama_gguf;
mod skip;
pub mod tiny_run;
pub use skip::skip_note;

/// The SmolLM2 GGUF (`lorafit::model::smollm2::find`: `LORAFIT_SMOLLM2_GGUF` or the cache), or
/// `None` after a visible skip note for `test`. With `LORAFIT_REQUIRE_SMOLLM2=1` (`.ci/run` sets
/// it once the model is fetched) a missing model fails the test instead of skipping it.
pub fn smollm2_or_skip(test: &str) -> Option<PathBuf> {
    use lorafit::model::smollm2;
    if let Some(p) = smollm2::find() {
        return Some(p);
    }
    let cached = smollm2::cache_dir()
        .join("smollm2")
        .join(smollm2::FILE_NAME);
    if std::env::var_os("LORAFIT_REQUIRE_SMOLLM2").is_some_and(|v| v != "0") {
        panic!(
            "{test}: LORAFIT_REQUIRE_SMOLLM2 is set, but the SmolLM2 GGUF is neither at \
             LORAFIT_SMOLLM2_GGUF nor at {}",
            cached.display()
        );
    }
    skip_note(
        test,
        &format!(
            "SmolLM2 GGUF not found at {} (run `lorafit demo` or .ci/run, or set \
             LORAFIT_SMOLLM2_GGUF)",
            cached.display()
        ),
    );
    None
}

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
