//! The memory machinery must not change the numbers: every combination of segment size
//! {0, 1, 2, all layers} × head tier (full, chunked, fused) × prefix sharing on/off × MLP token
//! chunking gives the loss
//! and every LoRA gradient of the plain path (all activations kept, full logits, two forwards,
//! whole-sequence MLP). Bit-identical where the arithmetic is the same (segment sizes: the same
//! ops on the same rows); within stated f32 bounds where it is not. For Qwen2 and for each family
//! whose layers differ from Llama's: Gemma 2 (sandwich norms, GELU gate, softcaps that bite,
//! sliding and global layers), Gemma 3 (q/k norms, local and global rotary tables) and MiniCPM
//! (μP scales, LongRoPE), Gemma 4 (KV sharing across segment cuts, per-layer inputs).

mod common;
use lorafit::data::TokenizedPair;
use lorafit::model::weights::{load_weights, RandomSource};
use lorafit::model::{Model, ModelSpec};
use lorafit::tensor::Device;
use lorafit::train::head::HeadTier;
use lorafit::train::objectives::SftScope;
use lorafit::train::plan::Plan;
use lorafit::train::step::{queue_example, Objective, PassOptions};

use common::family_configs::{GEMMA2, GEMMA3, GEMMA4, MINICPM, QWEN2 as CONFIG};

struct Run {
    loss: f64,
    grads: Vec<Vec<f32>>,
}

fn run(
    config: &str,
    seg: usize,
    head: HeadTier,
    chunk: usize,
    prefix: bool,
    mlp_chunk: usize,
) -> Run {
    let (model, mut lora) = common::family_configs::random_model_and_lora(config, 3, 9);
    let ids =
        |n: usize, off: u32| -> Vec<u32> { (0..n as u32).map(|i| (i * 37 + off) % 200).collect() };
    let pair = TokenizedPair {
        prompt: ids(11, 1),
        chosen: ids(5, 50),
        rejected: ids(7, 90),
    };
    let plan = Plan::pair(&pair, prefix).unwrap();
    let opts = PassOptions {
        segment_size: seg,
        keep_attention: false,
        // k and v of the lowest `seg` layers kept (with segments).
        keep_kv_layers: seg,
        mlp_chunk,
        // The boundaries of segment size 1 in the host-side store (host offload's CPU path).
        offload: seg == 1,
        // Segments of 2 recomputed layer by layer.
        nested: seg == 2,
        resident_layers: 0,
        full_layers: 0,
        head,
        head_chunk: chunk,
        dropout: None,
    };
    let obj = Objective::Orpo {
        lambda: 0.1,
        scope: SftScope::Full,
    };
    let out = queue_example(&model, &mut lora, &plan, &obj, None, &opts, true, 1.0)
        .and_then(|q| q.finish())
        .unwrap();
    let grads = lora
        .pairs()
        .flat_map(|(_, _, p)| [p.grad_a.to_vec().unwrap(), p.grad_b.to_vec().unwrap()])
        .collect();
    Run {
        loss: out.loss,
        grads,
    }
}

fn every_mode_matches_the_plain_path(config: &str) {
    let plain = run(config, 0, HeadTier::Full, 0, false, 0);
    assert!(
        plain.grads.iter().all(|g| g.iter().any(|x| *x != 0.0)),
        "every LoRA matrix must get a gradient"
    );
    let mut checked = 0;
    for seg in [0, 1, 2, 3] {
        for (head, chunk) in [
            (HeadTier::Full, 0),
            (HeadTier::Chunked, 4),
            (HeadTier::Fused, 0),
        ] {
            for prefix in [false, true] {
                for mlp_chunk in [0, 5] {
                    let r = run(config, seg, head, chunk, prefix, mlp_chunk);
                    let what =
                        format!("seg {seg} head {head:?} prefix {prefix} mlp_chunk {mlp_chunk}");
                    if !prefix && head == HeadTier::Full && mlp_chunk == 0 {
                        // The same ops on the same rows, in the same order: bit-identical.
                        assert_eq!(
                            r.loss.to_bits(),
                            plain.loss.to_bits(),
                            "{what}: loss {} vs {}",
                            r.loss,
                            plain.loss
                        );
                        for (g, p) in r.grads.iter().zip(&plain.grads) {
                            assert!(
                                g.iter().zip(p).all(|(a, b)| a.to_bits() == b.to_bits()),
                                "{what}: gradients differ"
                            );
                        }
                    } else {
                        // Different summation orders (one sequence of P+Rc+Rr instead of two;
                        // logits in row chunks or vocabulary blocks; LoRA gradient reductions split over
                        // MLP token chunks): f32
                        // rounding only, well below 1e-5 relative.
                        assert!(
                            ((r.loss - plain.loss) / plain.loss).abs() < 1e-5,
                            "{what}: loss {} vs {}",
                            r.loss,
                            plain.loss
                        );
                        for (i, (g, p)) in r.grads.iter().zip(&plain.grads).enumerate() {
                            common::assert_close(&format!("{what} grad {i}"), g, p, 1e-4);
                        }
                    }
                    checked += 1;
                }
            }
        }
    }
    assert_eq!(checked, 48);
}

#[test]
fn every_mode_matches_the_plain_path_qwen2() {
    every_mode_matches_the_plain_path(CONFIG);
}

#[test]
fn every_mode_matches_the_plain_path_gemma2() {
    every_mode_matches_the_plain_path(GEMMA2);
}

#[test]
fn every_mode_matches_the_plain_path_gemma3() {
    every_mode_matches_the_plain_path(GEMMA3);
}

#[test]
fn every_mode_matches_the_plain_path_gemma4() {
    every_mode_matches_the_plain_path(GEMMA4);
}

#[test]
fn every_mode_matches_the_plain_path_minicpm() {
    every_mode_matches_the_plain_path(MINICPM);
}

#[test]
fn prefix_shared_logps_equal_two_forward_logps() {
    prefix_shared_logps_equal_two_forward_logps_for(CONFIG);
}

#[test]
fn prefix_shared_logps_equal_two_forward_logps_gemma4() {
    // The window (6) is shorter than the prompt (7) + response: the rejected branch's window is
    // cut by logical positions, as in its own forward.
    prefix_shared_logps_equal_two_forward_logps_for(GEMMA4);
}

fn prefix_shared_logps_equal_two_forward_logps_for(config: &str) {
    // The prefix-shared forward's per-token logps of both branches equal the two-forward ones.
    let spec = ModelSpec::from_config_json(config).unwrap();
    let dev = Device::Cpu;
    let model = Model::new(
        spec.clone(),
        load_weights(
            &spec,
            &RandomSource {
                spec: spec.clone(),
                seed: 4,
            },
            &dev,
        )
        .unwrap(),
        dev,
    );
    let pair = TokenizedPair {
        prompt: vec![5, 9, 13, 2, 7, 100, 42],
        chosen: vec![3, 4, 5, 6],
        rejected: vec![8, 9, 10],
    };
    let logps = |prefix: bool| -> Vec<f32> {
        let plan = Plan::pair(&pair, prefix).unwrap();
        let mut out = Vec::new();
        let hidden: Vec<_> = plan
            .seqs
            .iter()
            .map(|s| {
                let rope = model.rope_table(&s.mask.positions).unwrap();
                let ctx = lorafit::model::PassCtx {
                    mask: &s.mask,
                    rope: &rope,
                    dropout: None,
                };
                model.forward(&s.ids, None, &ctx, 0).unwrap().0
            })
            .collect();
        for r in [
            &plan.chosen.response,
            &plan.rejected.as_ref().unwrap().response,
        ] {
            let h = lorafit::tensor::gather_rows(&hidden[r.seq], &r.rows).unwrap();
            out.extend(
                lorafit::train::head::logp_forward(&model, &h, &r.targets, HeadTier::Full, 0)
                    .unwrap(),
            );
        }
        out
    };
    let (a, b) = (logps(true), logps(false));
    assert_eq!(a.len(), 7);
    common::assert_close("prefix-shared logps", &a, &b, 1e-5);
}

#[test]
fn visible_count_matches_visible() {
    use lorafit::tensor::AttnMask;
    for mask in [
        AttnMask::causal(23),
        AttnMask::prefix_shared(9, 5, 7),
        AttnMask::prefix_shared(9, 5, 7).with_window(Some(4)),
        AttnMask::causal(30).with_window(Some(6)),
    ] {
        for q in 0..mask.len() {
            let brute = (0..mask.len()).filter(|&k| mask.visible(q, k)).count();
            assert_eq!(mask.visible_count(q), brute, "query {q} of {mask:?}");
        }
    }
}
