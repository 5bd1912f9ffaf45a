//! Choosing what a step keeps for its backward: estimate the bytes it keeps live for each choice
//! and take the fastest plan that fits the device.
//!
//! The estimates read the model's layer descriptions (`model::config::LayerSpec`: each layer's
//! MLP width and sandwich norms), so they hold for every family.
//!
//! - Segment size 0 (no recomputation) when it fits.
//! - Otherwise a recomputation of about one forward. Two things make it cheaper, each at a
//!   memory cost: segment size 1 (the recomputation skips the MLP down projection of each
//!   segment's last layer, whose output nothing reads: every layer at size 1), and kept
//!   attention outputs (about `T·(nh·hd)` values per layer, sparing the recomputation's attention
//!   kernels, the larger saving). In order of preference: size 1 with kept attention, the
//!   smallest-footprint size with kept attention, size 1, the smallest-footprint size.
//! - Then, with segments, k and v of as many of the lowest layers as still fit
//!   (`keep_kv_layers`; none for models with q/k norms), sparing their projections in the
//!   recomputation.

use crate::model::ModelSpec;

/// Estimated peak bytes of activations for one step over `tokens` tokens (on top of weights).
///
/// Per token and layer a layer's forward keeps: the residual input and its post-attention sum
/// (f32), the two normed inputs, q, k, v, the attention output (compute dtype), the MLP's gate,
/// up and product (unless the MLP runs in token chunks), and small per-row statistics. The
/// backward of one layer needs about as much again in transients. The head adds one chunk of f32
/// logits with their softmax coefficients (compute dtype), and keeps `d h / d logp` of every row
/// (compute dtype) from the forward to the backward. `keep_attention` (with segments) adds every
/// layer's attention output and lse.
pub fn estimate_bytes(
    spec: &ModelSpec,
    tokens: usize,
    segment_size: usize,
    keep_attention: bool,
    mlp_chunked: bool,
    dtype_bytes: usize,
    head_chunk_rows: usize,
) -> usize {
    let h = spec.hidden;
    let c = dtype_bytes;
    let p = spec.per_layer_input;
    // Bytes per token that layer `ls` keeps (its MLP width; sandwich norms keep the attention and
    // MLP outputs before their norms; a KV-sharing layer keeps no k and v of its own; the
    // per-layer input branch keeps its gate, input slice and projection).
    let per_token = |ls: &crate::model::config::LayerSpec| {
        let q = spec.n_heads * ls.head_dim;
        let kv = if ls.owns_kv() {
            ls.n_kv_heads * ls.head_dim
        } else {
            0
        };
        let mlp = if mlp_chunked {
            0
        } else {
            3 * ls.intermediate * c
        };
        let sandwich = if ls.sandwich_norms { 2 * c * h + 8 } else { 0 };
        let per_layer = if p > 0 { c * (2 * p + h) + 4 } else { 0 };
        2 * 4 * h
            + 2 * c * h
            + c * (2 * q + 2 * kv)
            + mlp
            + 4 * (spec.n_heads + 2)
            + sandwich
            + per_layer
    };
    // Kept for the whole pass: the per-layer inputs and the KV donors' k and v.
    let pass_constants = tokens * spec.n_layers * p * c
        + spec
            .kv_donors()
            .iter()
            .map(|&d| tokens * 2 * spec.kv_dim_of(d) * c)
            .sum::<usize>();
    let widest = spec.layers.iter().map(per_token).max().unwrap_or(0);
    let layer = tokens * widest;
    let all_layers: usize = spec.layers.iter().map(|ls| tokens * per_token(ls)).sum();
    let l = spec.n_layers;
    let kept = if segment_size == 0 {
        all_layers
    } else {
        let boundaries = l.div_ceil(segment_size) * tokens * h * 4;
        let attention = if keep_attention {
            (0..l)
                .map(|i| tokens * (c * spec.q_dim_of(i) + 4 * spec.n_heads))
                .sum()
        } else {
            0
        };
        boundaries + attention + segment_size.min(l) * layer
    };
    let transients = layer + tokens * h * 4 * 2;
    let head = head_chunk_rows * spec.vocab * (4 + c) + tokens * h * c;
    kept + transients + head + pass_constants
}

/// With segments, whether the top layer keeps its MLP intermediates (`3·T·I` values) from the
/// forward instead of recomputing them. They are then live during the head; that adds nothing to
/// the step's peak when the head's transient bytes are at most the `(T, I)` gradient the top
/// layer's backward holds at that peak, and saves one gate/up recomputation.
pub fn keep_top_mlp(
    spec: &ModelSpec,
    tokens: usize,
    head_transient_bytes: usize,
    dtype_bytes: usize,
) -> bool {
    let top = spec
        .layers
        .last()
        .map_or(spec.intermediate, |l| l.intermediate);
    head_transient_bytes <= tokens * top * dtype_bytes
}

/// What a step keeps for its backward: the segment size and, with segments, whether the
/// attention outputs are kept too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeepPlan {
    pub segment_size: usize,
    pub keep_attention: bool,
    /// With segments: layers whose k and v stay from the forward (`ForwardPlan::keep_kv_layers`).
    pub keep_kv_layers: usize,
}

/// Bytes of one layer's kept k and v.
fn kv_bytes(spec: &ModelSpec, tokens: usize, dtype_bytes: usize) -> usize {
    tokens * 2 * spec.kv_dim() * dtype_bytes
}

/// One step's workload as the estimates see it.
#[derive(Clone, Copy)]
pub struct StepShape<'a> {
    pub spec: &'a ModelSpec,
    pub tokens: usize,
    pub mlp_chunked: bool,
    pub dtype_bytes: usize,
    pub head_chunk_rows: usize,
}

impl StepShape<'_> {
    /// `estimate_bytes` at this segment size and kept-attention choice.
    fn bytes(&self, segment_size: usize, keep_attention: bool) -> usize {
        estimate_bytes(
            self.spec,
            self.tokens,
            segment_size,
            keep_attention,
            self.mlp_chunked,
            self.dtype_bytes,
            self.head_chunk_rows,
        )
    }
}

/// Segment size 0 when its estimate fits in `budget` bytes; otherwise the first plan of the
/// module's order of preference that fits, or the smallest footprint when none does.
pub fn auto_plan(shape: StepShape, budget: usize) -> KeepPlan {
    let est = |s, keep| shape.bytes(s, keep);
    let plan = |segment_size, keep_attention| KeepPlan {
        segment_size,
        keep_attention,
        keep_kv_layers: 0,
    };
    if est(0, false) <= budget {
        return plan(0, false);
    }
    let smallest = (1..=shape.spec.n_layers)
        .min_by_key(|&s| est(s, false))
        .unwrap_or(1);
    [(1, true), (smallest, true), (1, false)]
        .into_iter()
        .find(|&(s, keep)| est(s, keep) <= budget)
        .map_or(plan(smallest, false), |(s, keep)| plan(s, keep))
}

/// The plan of one step: the user's segment size, kept-attention and kept-k/v choices where
/// given, the rest from the budget (`auto_plan` when the segment size is unset; with a given
/// size, attention outputs are kept when they fit; then k and v of as many layers as still fit).
/// Nothing is kept without segments.
pub fn resolve_plan(
    shape: StepShape,
    segment_size: Option<usize>,
    keep_attention: Option<bool>,
    keep_kv_layers: Option<usize>,
    budget: usize,
) -> KeepPlan {
    let (segment_size, fits) = match segment_size {
        None => {
            let p = auto_plan(shape, budget);
            (p.segment_size, p.keep_attention)
        }
        Some(s) => (s, shape.bytes(s, true) <= budget),
    };
    let keep_attention = segment_size > 0 && keep_attention.unwrap_or(fits);
    let keep_kv_layers = if segment_size == 0 {
        0
    } else {
        keep_kv_layers.unwrap_or_else(|| {
            let spare = budget.saturating_sub(shape.bytes(segment_size, keep_attention));
            (spare / kv_bytes(shape.spec, shape.tokens, shape.dtype_bytes).max(1))
                .min(shape.spec.n_layers.saturating_sub(1))
        })
    };
    KeepPlan {
        segment_size,
        keep_attention,
        keep_kv_layers,
    }
}

/// Bytes a step may use for activations: 90% of the device's free memory now (weights and
/// adapters already placed); on the CPU a fixed 8 GiB.
pub fn budget(device: &crate::tensor::Device) -> anyhow::Result<usize> {
    Ok(match device {
        crate::tensor::Device::Cpu => 8 << 30,
        crate::tensor::Device::Cuda(c) => c.mem_info()?.0 / 10 * 9,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bf16 workload with 512-row head chunks.
    fn shape(spec: &ModelSpec, tokens: usize, mlp_chunked: bool) -> StepShape<'_> {
        StepShape {
            spec,
            tokens,
            mlp_chunked,
            dtype_bytes: 2,
            head_chunk_rows: 512,
        }
    }

    #[test]
    fn small_plans_keep_everything_and_large_ones_segment() {
        let spec = ModelSpec::from_config_json(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256}"#,
        )
        .unwrap();
        let gib = 1usize << 30;
        assert_eq!(
            auto_plan(shape(&spec, 4608, false), 100 * gib).segment_size,
            0
        );
        let est = |s, keep| estimate_bytes(&spec, 147_456, s, keep, true, 2, 512);
        let smallest = (1..=32).min_by_key(|&s| est(s, false)).unwrap();
        assert_eq!(smallest, 3);
        // Segmenting saves memory at long context; kept attention outputs (32 layers x 147456
        // tokens x 4096 bf16, plus lse) cost 36 GiB on top.
        assert!(est(smallest, false) < est(0, false) / 4);
        assert!(est(smallest, true) - est(smallest, false) >= 36 * gib);
        // Estimates here: size 1 + keep 133.7 GiB, 3 + keep 105.6, 1 alone 97.2, 3 alone 69.1.
        // Each budget gets the fastest plan that fits; the smallest footprint when none does.
        let plan = |budget_gib: usize| {
            let p = auto_plan(shape(&spec, 147_456, true), budget_gib * gib);
            (p.segment_size, p.keep_attention)
        };
        assert_eq!(plan(140), (1, true));
        assert_eq!(plan(110), (3, true));
        assert_eq!(plan(100), (1, false));
        assert_eq!(plan(80), (3, false));
        assert_eq!(plan(50), (3, false));
    }

    #[test]
    fn the_top_layer_keeps_its_mlp_when_the_head_holds_less() {
        let spec = ModelSpec::from_config_json(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256}"#,
        )
        .unwrap();
        // A 512-row chunk of f32 logits with bf16 coefficients: 394 MB.
        let head = 512 * 128_256 * 6;
        // Its (T, I) gradient is 528 MB at 18432 tokens, 132 MB at 4608.
        assert!(keep_top_mlp(&spec, 18_432, head, 2));
        assert!(!keep_top_mlp(&spec, 4_608, head, 2));
    }

    #[test]
    fn user_choices_override_the_budget_and_nothing_is_kept_without_segments() {
        let spec = ModelSpec::from_config_json(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256}"#,
        )
        .unwrap();
        let gib = 1usize << 30;
        let plan = |seg, keep, budget| {
            let p = resolve_plan(shape(&spec, 147_456, true), seg, keep, Some(0), budget);
            (p.segment_size, p.keep_attention)
        };
        // A given size keeps attention outputs when they fit (size 2 + keep: about 110 GiB).
        assert_eq!(plan(Some(2), None, 200 * gib), (2, true));
        assert_eq!(plan(Some(2), None, 80 * gib), (2, false));
        assert_eq!(plan(Some(2), Some(true), 80 * gib), (2, true));
        assert_eq!(plan(Some(2), Some(false), 200 * gib), (2, false));
        assert_eq!(plan(Some(0), Some(true), 200 * gib), (0, false));
        // Unset size: the automatic plan, with the user's keep choice on top.
        assert_eq!(plan(None, None, 140 * gib), (1, true));
        assert_eq!(plan(None, Some(false), 140 * gib), (1, false));
        // k and v (147456 tokens x 2 x 1024 bf16: 0.5625 GiB a layer) of as many layers as fit
        // above the plan's estimate, at most all but the top one; as given when given.
        let kv = |seg, budget| {
            resolve_plan(shape(&spec, 147_456, true), seg, Some(true), None, budget).keep_kv_layers
        };
        let est1 = estimate_bytes(&spec, 147_456, 1, true, true, 2, 512);
        let per_layer = 147_456 * 2 * 1024 * 2;
        assert_eq!(kv(Some(1), est1 + 5 * per_layer + 1), 5);
        assert_eq!(kv(Some(1), est1 - 1), 0);
        assert_eq!(kv(Some(1), 1000 * gib), 31);
        assert_eq!(kv(Some(0), 1000 * gib), 0);
        let given = resolve_plan(shape(&spec, 147_456, true), Some(1), Some(true), Some(7), 0);
        assert_eq!(given.keep_kv_layers, 7);
    }
}
