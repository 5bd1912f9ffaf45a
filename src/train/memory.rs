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

/// Estimated peak bytes of activations for one step over `tokens` tokens (on top of weights,
/// adapter and optimiser state), with no k/v kept (`estimate` with a `KeepPlan` counts those).
pub fn estimate_bytes(
    spec: &ModelSpec,
    tokens: usize,
    segment_size: usize,
    keep_attention: bool,
    mlp_chunked: bool,
    dtype_bytes: usize,
    head_chunk_rows: usize,
) -> usize {
    let shape = StepShape {
        spec,
        tokens,
        mlp_chunked,
        dtype_bytes,
        head_chunk_rows,
    };
    shape.terms(segment_size, keep_attention, 0).total()
}

/// An estimate of a step's activation bytes, term by term (`estimate_bytes` is their sum), so
/// that a refusal can name what takes the memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Estimate {
    pub terms: Vec<(&'static str, usize)>,
}

impl Estimate {
    pub fn total(&self) -> usize {
        self.terms.iter().map(|(_, b)| b).sum()
    }

    /// The `n` largest terms, largest first, as `name GiB` text.
    pub fn largest(&self, n: usize) -> String {
        let mut t: Vec<_> = self.terms.iter().filter(|(_, b)| *b > 0).collect();
        t.sort_by_key(|(_, b)| std::cmp::Reverse(*b));
        t.iter()
            .take(n)
            .map(|(name, b)| format!("{name} {:.2} GiB", *b as f64 / GIB))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// The share of one layer's activations that a layer's backward holds on top of what it reads
/// (gradients of its inputs and the MLP's, less what it frees as it goes), in hundredths. Fitted
/// to the CUDA allocator's peaks (H200, `scripts/memory_bench.sh`): 0.202–0.213 over qwen1.5b and
/// llama8b at 4.6K–37K tokens with every activation kept. At segment size 1 the recomputation
/// skips the layer's down projection and frees as the backward allocates: there the fit is 0
/// (residuals below 0.02 of a layer on five rows).
const BACKWARD_SHARE_PERCENT: usize = 21;

/// Estimated activation bytes of a step, term by term, for a workload and plan (see
/// `StepShape::terms` for what each term counts).
pub fn estimate(shape: StepShape, plan: &KeepPlan) -> Estimate {
    shape.chunked(plan.mlp_chunk > 0).terms(
        plan.segment_size,
        plan.keep_attention,
        plan.keep_kv_layers,
    )
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
    /// The MLP's token chunk (0: all tokens at once).
    pub mlp_chunk: usize,
}

/// The MLP token chunk the planner turns to when no plan with whole-sequence MLPs fits: it bounds
/// the `(T, I)` intermediates at one chunk's for one more gate/up projection in the backward.
pub const AUTO_MLP_CHUNK: usize = 4096;

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
        self.terms(segment_size, keep_attention, 0).total()
    }
}

impl StepShape<'_> {
    /// The segment size of the smallest footprint (nothing kept).
    pub fn smallest_segment(&self) -> usize {
        (1..=self.spec.n_layers)
            .min_by_key(|&s| self.bytes(s, false))
            .unwrap_or(1)
    }

    /// This workload with the MLP chunked or not.
    fn chunked(&self, mlp_chunked: bool) -> Self {
        StepShape {
            mlp_chunked,
            ..*self
        }
    }

    /// This workload over `tokens` tokens.
    pub fn with_tokens(&self, tokens: usize) -> Self {
        StepShape { tokens, ..*self }
    }

    /// The estimate of the smallest footprint the planner has: the smallest segment size, nothing
    /// kept, the MLP chunked (unless the user fixed it whole).
    pub fn smallest(&self, mlp_chunk: Option<usize>) -> (KeepPlan, Estimate) {
        let chunk = mlp_chunk.unwrap_or(AUTO_MLP_CHUNK);
        let shape = self.chunked(chunk > 0);
        let s = shape.smallest_segment();
        let plan = KeepPlan {
            segment_size: s,
            keep_attention: false,
            keep_kv_layers: 0,
            mlp_chunk: chunk,
        };
        (plan, shape.terms(s, false, 0))
    }

    /// Activation bytes at this segment size, kept-attention choice and number of layers whose k
    /// and v are kept.
    ///
    /// Per token and layer a layer's forward keeps: the residual input and its post-attention sum
    /// (f32), the two normed inputs, q, k, v, the attention output (compute dtype), the MLP's
    /// gate, up and product (unless the MLP runs in token chunks), and small per-row statistics.
    /// Without segments every layer keeps that and the backward of one layer adds
    /// `BACKWARD_SHARE_PERCENT` of it. With segments the step keeps every s-th layer's input (f32),
    /// kept attention outputs and lse, kept k/v, and one segment's recomputed activations. The
    /// head adds one chunk of f32 logits with their softmax coefficients (compute dtype; a chunk is
    /// at most the pass's rows), and keeps `d h / d logp` of every row (compute dtype) from the
    /// forward to the backward.
    pub fn terms(
        &self,
        segment_size: usize,
        keep_attention: bool,
        keep_kv_layers: usize,
    ) -> Estimate {
        let spec = self.spec;
        let tokens = self.tokens;
        let h = spec.hidden;
        let c = self.dtype_bytes;
        let p = spec.per_layer_input;
        // Bytes per token that layer `ls` keeps (its MLP width; sandwich norms keep the attention
        // and MLP outputs before their norms; a KV-sharing layer keeps no k and v of its own; the
        // per-layer input branch keeps its gate, input slice and projection).
        let per_token = |ls: &crate::model::config::LayerSpec| {
            let q = spec.n_heads * ls.head_dim;
            let kv = if ls.owns_kv() {
                ls.n_kv_heads * ls.head_dim
            } else {
                0
            };
            let mlp = if self.mlp_chunked {
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
        let layer = tokens * spec.layers.iter().map(per_token).max().unwrap_or(0);
        let backward = layer * BACKWARD_SHARE_PERCENT / 100;
        let l = spec.n_layers;
        let mut terms = if segment_size == 0 {
            let all: usize = spec.layers.iter().map(|ls| tokens * per_token(ls)).sum();
            vec![
                ("every layer's activations", all),
                ("a layer's backward", backward),
            ]
        } else {
            let attention = if keep_attention {
                (0..l)
                    .map(|i| tokens * (c * spec.q_dim_of(i) + 4 * spec.n_heads))
                    .sum()
            } else {
                0
            };
            vec![
                (
                    "layer boundaries",
                    l.div_ceil(segment_size) * tokens * h * 4,
                ),
                ("kept attention outputs", attention),
                ("kept k and v", keep_kv_layers * kv_bytes(spec, tokens, c)),
                ("one segment's activations", segment_size.min(l) * layer),
                (
                    "a layer's backward",
                    if segment_size > 1 { backward } else { 0 },
                ),
            ]
        };
        terms.push((
            "the head",
            self.head_chunk_rows.min(tokens) * spec.vocab * (4 + c) + tokens * h * c,
        ));
        terms.push(("per-layer inputs and shared k/v", pass_constants));
        Estimate { terms }
    }
}

/// The longest pass (in tokens, at most `tokens`) whose smallest footprint fits `budget` bytes;
/// 0 when not even one token does.
pub fn longest_that_fits(shape: StepShape, mlp_chunk: Option<usize>, budget: usize) -> usize {
    let fits = |t: usize| shape.with_tokens(t).smallest(mlp_chunk).1.total() <= budget;
    let (mut lo, mut hi) = (0, shape.tokens);
    if fits(hi) {
        return hi;
    }
    // fits(lo) holds (or lo = 0), fits(hi) does not.
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Segment size 0 when its estimate fits in `budget` bytes; otherwise the first plan of the
/// module's order of preference that fits, or the smallest footprint when none does.
pub fn auto_plan(shape: StepShape, budget: usize) -> KeepPlan {
    let est = |s, keep| shape.bytes(s, keep);
    let plan = |segment_size, keep_attention| KeepPlan {
        segment_size,
        keep_attention,
        keep_kv_layers: 0,
        mlp_chunk: 0,
    };
    if est(0, false) <= budget {
        return plan(0, false);
    }
    let smallest = shape.smallest_segment();
    [(1, true), (smallest, true), (1, false)]
        .into_iter()
        .find(|&(s, keep)| est(s, keep) <= budget)
        .map_or(plan(smallest, false), |(s, keep)| plan(s, keep))
}

/// The plan of one step: the user's segment size, kept-attention, kept-k/v and MLP-chunk choices
/// where given, the rest from the budget (`auto_plan` when the segment size is unset; with a given
/// size, attention outputs are kept when they fit; then k and v of as many layers as still fit).
/// Nothing is kept without segments. An unset MLP chunk is 0 (whole sequences) unless no such plan
/// fits, then `AUTO_MLP_CHUNK`, planned again.
pub fn resolve_plan(
    shape: StepShape,
    segment_size: Option<usize>,
    keep_attention: Option<bool>,
    keep_kv_layers: Option<usize>,
    mlp_chunk: Option<usize>,
    budget: usize,
) -> KeepPlan {
    let with_chunk = |chunk: usize| {
        let shape = shape.chunked(chunk > 0);
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
        let plan = KeepPlan {
            segment_size,
            keep_attention,
            keep_kv_layers,
            mlp_chunk: chunk,
        };
        (plan, shape.bytes(segment_size, keep_attention) <= budget)
    };
    match mlp_chunk {
        Some(chunk) => with_chunk(chunk).0,
        None => match with_chunk(0) {
            (plan, true) => plan,
            _ => with_chunk(AUTO_MLP_CHUNK).0,
        },
    }
}

/// The plan as a user would write it: `segment 2, attention kept, k/v of 5 layers kept, MLP chunk
/// 4096`.
pub fn describe_plan(plan: &KeepPlan) -> String {
    let mut parts = vec![match plan.segment_size {
        0 => "every activation kept".to_string(),
        s => format!("segment {s}"),
    }];
    if plan.keep_attention {
        parts.push("attention kept".into());
    }
    if plan.keep_kv_layers > 0 {
        parts.push(format!("k/v of {} layers kept", plan.keep_kv_layers));
    }
    if plan.mlp_chunk > 0 {
        parts.push(format!("MLP chunk {}", plan.mlp_chunk));
    }
    parts.join(", ")
}

/// Bytes a step may use for activations: the device's free memory now (weights and adapters
/// already placed) less a margin for the pool's fragmentation and the libraries' workspaces
/// (`free_margin`); on the CPU a fixed 8 GiB. With `memory_limit` (GiB, the whole process's device
/// memory) at most the limit less what is held now.
pub fn budget(device: &crate::tensor::Device, memory_limit: Option<f64>) -> anyhow::Result<usize> {
    let free = match device {
        crate::tensor::Device::Cpu => 8 << 30,
        crate::tensor::Device::Cuda(c) => {
            let free = c.mem_info()?.0;
            free.saturating_sub(free_margin(free))
        }
    };
    Ok(match memory_limit {
        Some(g) => {
            let limit = (g * GIB) as usize;
            let held = device.memory().live_bytes;
            let under_limit = limit.saturating_sub(held);
            match device {
                crate::tensor::Device::Cpu => under_limit,
                crate::tensor::Device::Cuda(_) => under_limit.min(free),
            }
        }
        None => free,
    })
}

/// The part of `free` device bytes the planner leaves unplanned: 5%, at least 4 GiB (the
/// estimates are within 5% of the allocator's peaks; what the pool cannot hand out in one piece,
/// cuBLAS's workspaces and other processes' growth take the rest).
pub fn free_margin(free: usize) -> usize {
    (free / 20).max(4 << 30)
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
        // Estimates here: size 1 + keep 119.6 GiB, 3 + keep 93.6, 1 alone 83.1, 3 alone 57.0.
        // Each budget gets the fastest plan that fits; the smallest footprint when none does.
        let plan = |budget_gib: usize| {
            let p = auto_plan(shape(&spec, 147_456, true), budget_gib * gib);
            (p.segment_size, p.keep_attention)
        };
        assert_eq!(plan(125), (1, true));
        assert_eq!(plan(100), (3, true));
        assert_eq!(plan(90), (1, false));
        assert_eq!(plan(70), (3, false));
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
            let p = resolve_plan(
                shape(&spec, 147_456, true),
                seg,
                keep,
                Some(0),
                Some(4096),
                budget,
            );
            (p.segment_size, p.keep_attention)
        };
        // A given size keeps attention outputs when they fit (size 2 + keep: about 95 GiB).
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
            resolve_plan(
                shape(&spec, 147_456, true),
                seg,
                Some(true),
                None,
                Some(4096),
                budget,
            )
            .keep_kv_layers
        };
        let est1 = estimate_bytes(&spec, 147_456, 1, true, true, 2, 512);
        let per_layer = 147_456 * 2 * 1024 * 2;
        assert_eq!(kv(Some(1), est1 + 5 * per_layer + 1), 5);
        assert_eq!(kv(Some(1), est1 - 1), 0);
        assert_eq!(kv(Some(1), 1000 * gib), 31);
        assert_eq!(kv(Some(0), 1000 * gib), 0);
        let given = resolve_plan(
            shape(&spec, 147_456, true),
            Some(1),
            Some(true),
            Some(7),
            Some(4096),
            0,
        );
        assert_eq!(given.keep_kv_layers, 7);
    }

    #[test]
    fn an_unset_mlp_chunk_chunks_only_when_no_whole_mlp_plan_fits() {
        let spec = ModelSpec::from_config_json(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256}"#,
        )
        .unwrap();
        let gib = 1usize << 30;
        let whole = shape(&spec, 294_912, false);
        let chunk = |budget| resolve_plan(whole, None, None, None, None, budget).mlp_chunk;
        // 256K tokens a branch (T = 294912): the smallest whole-MLP plan is segment 2 at about
        // 158 GiB; chunked, segment 3 needs about 113 GiB.
        let smallest_whole = (1..=32).map(|s| whole.bytes(s, false)).min().unwrap();
        assert!(smallest_whole > 150 * gib);
        assert_eq!(chunk(1000 * gib), 0);
        assert_eq!(chunk(smallest_whole), 0);
        assert_eq!(chunk(smallest_whole - 1), AUTO_MLP_CHUNK);
        let (plan, est) = whole.smallest(None);
        assert_eq!((plan.segment_size, plan.mlp_chunk), (3, AUTO_MLP_CHUNK));
        assert!(
            est.total() < 115 * gib && est.total() > 110 * gib,
            "{est:?}"
        );
        // A chunk the user set stays, even 0.
        assert_eq!(
            resolve_plan(whole, None, None, None, Some(0), gib).mlp_chunk,
            0
        );
        // The longest pass whose smallest plan fits a budget.
        let fits = longest_that_fits(whole, None, 60 * gib);
        assert!(whole.with_tokens(fits).smallest(None).1.total() <= 60 * gib);
        assert!(whole.with_tokens(fits + 1).smallest(None).1.total() > 60 * gib);
        assert_eq!(longest_that_fits(whole, None, 1000 * gib), 294_912);
        assert_eq!(longest_that_fits(whole, None, 0), 0);
    }

    #[test]
    fn the_margin_is_five_percent_and_at_least_four_gib() {
        let gib = 1usize << 30;
        assert_eq!(free_margin(124 * gib), 124 * gib / 20);
        assert_eq!(free_margin(40 * gib), 4 * gib);
        // A limit on the CPU is the whole budget (nothing is held on a device there).
        let cpu = crate::tensor::Device::Cpu;
        assert_eq!(budget(&cpu, Some(2.5)).unwrap(), 5 * gib / 2);
        assert_eq!(budget(&cpu, None).unwrap(), 8 * gib);
    }
}
