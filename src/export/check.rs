//! `lorafit export --check`: an exported artefact's logits on a fixed prompt set against the
//! trainer's own (the base as lorafit loads it, plus the adapter as lorafit applies it), with
//! the artefact read back through lorafit's own loaders (`model::load` for a merged folder or
//! GGUF, the GGUF reader for the adapter).
//!
//! The bound. Each exported weight carries at most one rounding: the merged value `W + ΔW`
//! (or the adapter's A and B) is stored in the artefact's type, with a relative error of at
//! most `u` per weight: 2⁻²⁴ for f32, 2⁻¹¹ for f16, 2⁻⁹ for bf16 (round to nearest: half the
//! spacing of the type's significand), and for a requantized tensor half a quantization step
//! of its block's range, `1/(2·levels)` of the block's largest magnitude (Q8_0 1/254, Q6_K
//! 1/64, Q4_0/Q4_1/Q4_K 1/16; the f16 block scales add less than that). A matrix whose entries
//! carry independent, unbiased errors of relative size `u` moves its output by at most about
//! `u` relative to the output's scale, and the `n` rounded tensors of an artefact perturb the
//! logits independently, so their effects add in quadrature: `√n·u`. The nonlinear parts
//! (normalisation, softmax, softcaps) can amplify a perturbation by a small factor; the check
//! allows 4:
//!
//! `max |Δlogit| ≤ max(4·√n·u, 10⁻⁵) · max |logit|`
//!
//! over the prompts, where 10⁻⁵ covers f32's reassociation of `W x + B A x` into
//! `(W + B A) x`. On the fixture models (2–3 layers, 20–40 rounded tensors) the bf16 folders
//! land at 0.3–0.4 of the bound. The report also gives the adapter's own effect,
//! `max |logits(base + adapter) − logits(base)|`, so a reader sees that the artefact carries
//! the adapter rather than only the base.

use crate::data::TextTokenizer;
use crate::model::gguf::GgmlType;
use crate::model::{Lora, Model};
use crate::tensor::DType;
use anyhow::Result;

/// The fixed prompts: short texts when a tokenizer is at hand, and id sequences drawn from a
/// fixed generator over the vocabulary (so that models without a tokenizer, such as the test
/// fixtures, are checked the same way).
pub const CHECK_TEXTS: [&str; 4] = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Translate to German: The weather is nice today.",
    "Q: What is 17 times 23?\nA:",
];

pub fn check_prompts(tok: Option<&TextTokenizer>, vocab: usize) -> Result<Vec<Vec<u32>>> {
    let mut prompts = Vec::new();
    if let Some(tok) = tok {
        for text in CHECK_TEXTS {
            let mut ids = Vec::new();
            if tok.add_bos() {
                ids.extend(tok.bos_id());
            }
            ids.extend(tok.encode(text)?);
            prompts.push(ids);
        }
    }
    let mut rng = crate::tensor::Rng(0xC4EC_0000_0000_0019);
    for len in [7usize, 16, 29] {
        prompts.push(
            (0..len)
                .map(|_| (rng.next_u64() % vocab.max(1) as u64) as u32)
                .collect(),
        );
    }
    Ok(prompts)
}

/// Every position's logits of every prompt, concatenated.
pub fn logits(model: &Model, lora: Option<&Lora>, prompts: &[Vec<u32>]) -> Result<Vec<f32>> {
    let mut out = Vec::new();
    for ids in prompts {
        let h = model.hidden_states(ids, lora)?;
        out.extend(model.logits(&h, DType::F32)?.to_vec()?);
    }
    Ok(out)
}

/// The per-weight relative rounding `u` of a stored type (see the module doc).
pub fn unit_error(ty: GgmlType) -> f64 {
    match ty {
        GgmlType::F32 => 2f64.powi(-24),
        GgmlType::F16 => 2f64.powi(-11),
        GgmlType::BF16 => 2f64.powi(-9),
        GgmlType::Q8_0 => 1.0 / 254.0,
        GgmlType::Q6_K => 1.0 / 64.0,
        _ => 1.0 / 16.0,
    }
}

/// The bound on `max |Δlogit| / max |logit|` for an artefact with `rounded` tensors stored
/// in (at coarsest) `ty`.
pub fn bound(ty: GgmlType, rounded: usize) -> f64 {
    (4.0 * (rounded.max(1) as f64).sqrt() * unit_error(ty)).max(1e-5)
}

/// One artefact's comparison.
#[derive(Debug, Clone)]
pub struct CheckRow {
    pub artefact: String,
    /// The coarsest type its changed weights are stored in.
    pub stored: GgmlType,
    /// How many tensors were rounded to it.
    pub rounded: usize,
    pub positions: usize,
    pub max_abs: f64,
    pub max_ref: f64,
    pub rel: f64,
    pub bound: f64,
    /// `max |trainer − base|`: how much the adapter itself moves the logits.
    pub adapter_effect: f64,
}

impl CheckRow {
    pub fn passed(&self) -> bool {
        self.rel.is_finite() && self.rel <= self.bound
    }

    /// Whether the artefact's own error is as large as the adapter's effect: within the bound,
    /// and yet it may carry little of the update (a young adapter merged into bf16 weights,
    /// whose rounding is coarser than the update).
    pub fn rounding_hides_adapter(&self) -> bool {
        self.adapter_effect > 0.0 && self.max_abs >= self.adapter_effect
    }
}

/// Compares `got` with the trainer's `want` (same prompts), given the base's logits.
pub fn compare(
    artefact: &str,
    stored: GgmlType,
    rounded: usize,
    want: &[f32],
    got: &[f32],
    base: &[f32],
    vocab: usize,
) -> CheckRow {
    let len_ok = want.len() == got.len() && want.len() == base.len();
    let max_abs = if len_ok {
        want.iter()
            .zip(got)
            .map(|(a, b)| (*a as f64 - *b as f64).abs())
            .fold(0.0, |m, v| if v.is_nan() { f64::NAN } else { m.max(v) })
    } else {
        f64::INFINITY
    };
    let max_ref = want.iter().fold(0f64, |m, v| m.max((*v as f64).abs()));
    let adapter_effect = want
        .iter()
        .zip(base)
        .fold(0f64, |m, (a, b)| m.max((*a as f64 - *b as f64).abs()));
    CheckRow {
        artefact: artefact.to_string(),
        stored,
        rounded,
        positions: want.len() / vocab.max(1),
        max_abs,
        max_ref,
        rel: max_abs / max_ref.max(f64::MIN_POSITIVE),
        bound: bound(stored, rounded),
        adapter_effect,
    }
}

/// The prompts and the trainer's logits as `check.safetensors` (`prompt.N.ids` as f32, exact
/// below 2²⁴, and `prompt.N.logits` `[T, V]`), so that other tools (scripts/check_export.py)
/// compare against the same numbers.
pub fn write_reference(
    path: &std::path::Path,
    prompts: &[Vec<u32>],
    logits: &[f32],
    vocab: usize,
) -> Result<()> {
    let mut tensors = Vec::new();
    let mut at = 0;
    for (i, ids) in prompts.iter().enumerate() {
        let n = ids.len() * vocab;
        let rows = logits
            .get(at..at + n)
            .ok_or_else(|| anyhow::anyhow!("check logits are shorter than the prompts"))?;
        tensors.push((
            format!("prompt.{i}.ids"),
            vec![ids.len()],
            ids.iter().map(|&t| t as f32).collect(),
        ));
        tensors.push((
            format!("prompt.{i}.logits"),
            vec![ids.len(), vocab],
            rows.to_vec(),
        ));
        at += n;
    }
    crate::model::weights::write_f32_safetensors(path, &tensors)
}

/// One row as JSON (`check.json`).
pub fn row_json(r: &CheckRow) -> serde_json::Value {
    serde_json::json!({
        "artefact": r.artefact,
        "stored": r.stored.to_string(),
        "rounded_tensors": r.rounded,
        "positions": r.positions,
        "max_abs": r.max_abs,
        "max_ref": r.max_ref,
        "rel": r.rel,
        "bound": r.bound,
        "adapter_effect": r.adapter_effect,
        "rounding_hides_adapter": r.rounding_hides_adapter(),
        "passed": r.passed(),
    })
}

/// The report as a table.
pub fn format_rows(rows: &[CheckRow]) -> String {
    let mut s = format!(
        "{:<34} {:>6} {:>7} {:>9} {:>11} {:>11} {:>10} {:>10} {:>11}  verdict\n",
        "artefact",
        "type",
        "tensors",
        "positions",
        "max|Δ|",
        "max|logit|",
        "rel",
        "bound",
        "adapter Δ"
    );
    for r in rows {
        s.push_str(&format!(
            "{:<34} {:>6} {:>7} {:>9} {:>11.3e} {:>11.3e} {:>10.3e} {:>10.3e} {:>11.3e}  {}\n",
            r.artefact,
            r.stored.to_string(),
            r.rounded,
            r.positions,
            r.max_abs,
            r.max_ref,
            r.rel,
            r.bound,
            r.adapter_effect,
            if r.passed() { "ok" } else { "FAILED" }
        ));
    }
    for r in rows.iter().filter(|r| r.rounding_hides_adapter()) {
        s.push_str(&format!(
            "note: {}: its rounding moves the logits by up to {:.3e}, at least as much as the adapter \
             itself ({:.3e}), so it may carry little of the update; a finer type \
             (--dtype f32 for a merged folder, --merged-type f16 for a merged GGUF) or the \
             adapter unmerged keeps it\n",
            r.artefact, r.max_abs, r.adapter_effect
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An artefact whose error is at least the adapter's effect is flagged (in the table and
    /// in check.json) though it passes its bound; one that carries the adapter well is not.
    #[test]
    fn an_artefact_whose_rounding_is_as_large_as_the_adapter_is_noted() {
        let base = [1.0f32, -2.0, 3.0, 0.5];
        let want = [1.001f32, -2.0, 3.0, 0.5];
        let coarse = [1.0f32, -2.004, 3.0, 0.5];
        let fine = [1.001f32, -2.0, 3.0, 0.50001];
        let hidden = compare("merged-hf", GgmlType::BF16, 20, &want, &coarse, &base, 2);
        let kept = compare("adapter.gguf", GgmlType::F32, 20, &want, &fine, &base, 2);
        assert!(hidden.passed() && kept.passed());
        assert!(hidden.rounding_hides_adapter() && !kept.rounding_hides_adapter());
        let table = format_rows(&[hidden.clone(), kept]);
        assert_eq!(table.matches("note: ").count(), 1, "{table}");
        assert!(table.contains("note: merged-hf: its rounding"), "{table}");
        assert_eq!(row_json(&hidden)["rounding_hides_adapter"], true);
    }
}
