//! Choosing the segment size: estimate the bytes a training step keeps live for each choice and
//! take no recomputation (segment size 0) whenever that fits the device, else the segment size
//! with the smallest footprint. Every s > 0 costs about one extra forward, less the MLP down
//! projection of each segment's last layer (whose output the recomputation does not need), so
//! ties go to the smaller size.

use crate::model::ModelSpec;

/// Estimated peak bytes of activations for one step over `tokens` tokens (on top of weights).
///
/// Per token and layer a layer's forward keeps: the residual input and its post-attention sum
/// (f32), the two normed inputs, q, k, v, the attention output (compute dtype), the MLP's gate,
/// up and product (unless the MLP runs in token chunks), and small per-row statistics. The
/// backward of one layer needs about as much again in transients. The head adds one chunk of f32
/// logits with their softmax coefficients (compute dtype), and keeps `d h / d logp` of every row
/// (compute dtype) from the forward to the backward.
pub fn estimate_bytes(
    spec: &ModelSpec,
    tokens: usize,
    segment_size: usize,
    mlp_chunked: bool,
    dtype_bytes: usize,
    head_chunk_rows: usize,
) -> usize {
    let (h, q, kv, i) = (spec.hidden, spec.q_dim(), spec.kv_dim(), spec.intermediate);
    let c = dtype_bytes;
    let mlp = if mlp_chunked { 0 } else { 3 * i * c };
    let per_token_layer =
        2 * 4 * h + 2 * c * h + c * (2 * q + 2 * kv) + mlp + 4 * (spec.n_heads + 2);
    let layer = tokens * per_token_layer;
    let l = spec.n_layers;
    let kept = if segment_size == 0 {
        l * layer
    } else {
        let boundaries = l.div_ceil(segment_size) * tokens * h * 4;
        boundaries + segment_size.min(l) * layer
    };
    let transients = layer + tokens * h * 4 * 2;
    let head = head_chunk_rows * spec.vocab * (4 + c) + tokens * h * c;
    kept + transients + head
}

/// Segment size 0 when its estimate fits in `budget` bytes; otherwise the segment size with the
/// smallest estimate.
pub fn auto_segment_size(
    spec: &ModelSpec,
    tokens: usize,
    mlp_chunked: bool,
    dtype_bytes: usize,
    head_chunk_rows: usize,
    budget: usize,
) -> usize {
    let est = |s| estimate_bytes(spec, tokens, s, mlp_chunked, dtype_bytes, head_chunk_rows);
    if est(0) <= budget {
        return 0;
    }
    (1..=spec.n_layers).min_by_key(|&s| est(s)).unwrap_or(1)
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

    #[test]
    fn small_plans_keep_everything_and_large_ones_segment() {
        let spec = ModelSpec::from_config_json(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256}"#,
        )
        .unwrap();
        let gib = 1usize << 30;
        assert_eq!(auto_segment_size(&spec, 4608, false, 2, 512, 100 * gib), 0);
        let s = auto_segment_size(&spec, 147_456, true, 2, 512, 100 * gib);
        assert!(s > 0);
        // The chosen size is the minimum of the estimate over all sizes.
        let best = estimate_bytes(&spec, 147_456, s, true, 2, 512);
        assert!((1..=32).all(|k| estimate_bytes(&spec, 147_456, k, true, 2, 512) >= best));
        // Segmenting saves memory at long context.
        assert!(best < estimate_bytes(&spec, 147_456, 0, true, 2, 512) / 4);
    }
}
