//! Packing short examples into one sequence (`train::plan::pack`, `train::step::queue_packed`)
//! must not change the numbers: for every family with its own attention (Qwen2; Gemma 2's
//! sliding windows and softcaps; Gemma 3's q/k norms and local rotary table; Gemma 4's KV
//! sharing and per-layer inputs), each member's loss and the summed LoRA gradients of a pack
//! equal those of the examples run one by one, within f32 rounding (the same maths; sums over
//! one longer sequence in another order). ORPO, DPO (each member with its own reference), SimPO
//! and SFT; packs of every example and of two; segments, with and without offloaded boundaries.

mod common;
use common::family_configs::{GEMMA2, GEMMA3, GEMMA4, MINICPM, QWEN2};
use lorafit::data::TokenizedPair;
use lorafit::model::{Lora, Model};
use lorafit::train::device_loss::ExampleScale;
use lorafit::train::head::HeadTier;
use lorafit::train::objectives::{DpoLossType, SftScope};
use lorafit::train::plan::Plan;
use lorafit::train::step::{
    queue_example_scaled, queue_packed, reference_logps, Objective, PackMember, PassOptions,
};

fn model_and_lora(config: &str) -> (Model, Lora) {
    common::family_configs::random_model_and_lora(config, 5, 17)
}

/// Short pairs of different lengths (prompts 3–9 tokens, responses 1–6), so blocks of a pack
/// differ in size and a sliding window of 6 cuts inside some of them.
fn pairs(vocab: u32) -> Vec<TokenizedPair> {
    let ids = |n: usize, off: u32| -> Vec<u32> {
        (0..n as u32).map(|i| (i * 29 + off) % vocab).collect()
    };
    [(9, 4, 6), (3, 1, 2), (7, 6, 1), (5, 3, 5)]
        .iter()
        .enumerate()
        .map(|(i, &(p, c, r))| TokenizedPair {
            prompt: ids(p, 1 + i as u32),
            chosen: ids(c, 50 + i as u32),
            rejected: ids(r, 120 + i as u32),
        })
        .collect()
}

fn options(segment_size: usize, offload: bool) -> PassOptions {
    PassOptions {
        segment_size,
        keep_attention: false,
        keep_kv_layers: 0,
        mlp_chunk: 0,
        offload,
        nested: false,
        resident_layers: 0,
        full_layers: 0,
        head: HeadTier::Chunked,
        head_chunk: 4,
        dropout: None,
    }
}

fn grads(lora: &Lora) -> Vec<Vec<f32>> {
    lora.pairs()
        .flat_map(|(_, _, p)| [p.grad_a.to_vec().unwrap(), p.grad_b.to_vec().unwrap()])
        .collect()
}

/// Member losses and summed gradients of `plans`, one by one or in packs of `pack` examples.
fn run(
    model: &Model,
    lora: &mut Lora,
    plans: &[Plan],
    objective: &Objective,
    opts: &PassOptions,
    pack: Option<usize>,
) -> (Vec<f64>, Vec<Vec<f32>>) {
    lora.zero_grads().unwrap();
    let dpo = matches!(objective, Objective::Dpo { .. });
    let refs: Vec<_> = plans
        .iter()
        .map(|p| dpo.then(|| reference_logps(model, p, opts).unwrap()))
        .collect();
    // Weights other than 1, so that a member's scale is shown to stay its own.
    let scale = |i: usize| ExampleScale {
        weight: 0.5 + 0.25 * i as f64,
        clip: None,
    };
    let mut losses = Vec::new();
    match pack {
        None => {
            for (i, p) in plans.iter().enumerate() {
                let q = queue_example_scaled(
                    model,
                    lora,
                    p,
                    objective,
                    refs[i].as_ref(),
                    opts,
                    true,
                    1.0,
                    scale(i),
                )
                .unwrap();
                losses.push(q.finish().unwrap().loss);
            }
        }
        Some(n) => {
            let members: Vec<PackMember> = plans
                .iter()
                .enumerate()
                .map(|(i, p)| PackMember {
                    plan: p,
                    reference: refs[i].as_ref(),
                    scale: scale(i),
                })
                .collect();
            for chunk in members.chunks(n) {
                for q in queue_packed(model, lora, chunk, objective, opts, true, 1.0).unwrap() {
                    losses.push(q.finish().unwrap().loss);
                }
            }
        }
    }
    (losses, grads(lora))
}

fn packed_runs_match_unpacked(config: &str) {
    let (model, mut lora) = model_and_lora(config);
    let vocab = model.spec.vocab as u32;
    let pairs = pairs(vocab);
    let pair_plans: Vec<Plan> = pairs.iter().map(|p| Plan::pair(p, true).unwrap()).collect();
    let sft_plans: Vec<Plan> = pairs
        .iter()
        .map(|p| Plan::sft(&p.prompt, &p.chosen).unwrap())
        .collect();
    let objectives = [
        (
            "orpo",
            Objective::Orpo {
                lambda: 0.1,
                scope: SftScope::Full,
            },
        ),
        (
            "dpo",
            Objective::Dpo {
                beta: 0.1,
                label_smoothing: 0.0,
                loss_type: DpoLossType::Sigmoid,
            },
        ),
        (
            "simpo",
            Objective::Simpo {
                beta: 2.0,
                gamma: 0.5,
            },
        ),
        ("sft", Objective::Sft { all_tokens: false }),
    ];
    for (name, objective) in &objectives {
        let plans = if *name == "sft" {
            &sft_plans
        } else {
            &pair_plans
        };
        for (seg, offload) in [(0, false), (1, false), (2, true)] {
            let opts = options(seg, offload);
            let (want_losses, want_grads) = run(&model, &mut lora, plans, objective, &opts, None);
            assert!(
                want_grads.iter().all(|g| g.iter().any(|x| *x != 0.0)),
                "{name}: every LoRA matrix must get a gradient"
            );
            for pack in [plans.len(), 2] {
                let what =
                    format!("{config:.40}… {name} seg {seg} offload {offload} packs of {pack}");
                let (losses, got) = run(&model, &mut lora, plans, objective, &opts, Some(pack));
                assert_eq!(losses.len(), want_losses.len(), "{what}");
                for (i, (a, b)) in losses.iter().zip(&want_losses).enumerate() {
                    assert!(
                        ((a - b) / b).abs() < 1e-5,
                        "{what}: member {i} loss {a} packed vs {b} alone"
                    );
                }
                for (i, (g, w)) in got.iter().zip(&want_grads).enumerate() {
                    common::assert_close(&format!("{what} grad {i}"), g, w, 1e-4);
                }
            }
        }
    }
}

#[test]
fn packed_qwen2_matches_unpacked() {
    packed_runs_match_unpacked(QWEN2);
}

#[test]
fn packed_gemma2_matches_unpacked() {
    packed_runs_match_unpacked(GEMMA2);
}

#[test]
fn packed_gemma3_matches_unpacked() {
    packed_runs_match_unpacked(GEMMA3);
}

#[test]
fn packed_gemma4_matches_unpacked() {
    packed_runs_match_unpacked(GEMMA4);
}

/// A pack's blocks see nothing of one another: the mask of block 2 starts at its own offset, its
/// positions restart at 0, and two-sequence plans (pairs without prefix sharing) are refused.
#[test]
fn the_pack_mask_is_block_diagonal() {
    let pairs = pairs(200);
    let plans: Vec<Plan> = pairs.iter().map(|p| Plan::pair(p, true).unwrap()).collect();
    let refs: Vec<&Plan> = plans.iter().collect();
    let packed = lorafit::train::plan::pack(&refs).unwrap();
    let total: usize = plans.iter().map(|p| p.tokens()).sum();
    assert_eq!(packed.seq.ids.len(), total);
    assert_eq!(packed.seq.mask.len(), total);
    for (b, (p, &o)) in plans.iter().zip(&packed.offsets).enumerate() {
        let n = p.tokens();
        for q in 0..n {
            assert_eq!(
                packed.seq.mask.positions[o + q],
                p.seqs[0].mask.positions[q],
                "block {b} row {q}"
            );
            for k in 0..total {
                let alone = k >= o && k < o + n && p.seqs[0].mask.visible(q, k - o);
                assert_eq!(
                    packed.seq.mask.visible(o + q, k),
                    alone,
                    "block {b}: row {q} and key {k}"
                );
            }
        }
    }
    let two = Plan::pair(&pairs[0], false).unwrap();
    let err = lorafit::train::plan::pack(&[&plans[0], &two])
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("example 1") && err.contains("prefix_shared"),
        "{err}"
    );
}

/// LongRoPE picks its factors by the example's largest position, which a pack would change:
/// packing such a model is an error that says so.
#[test]
fn packing_a_longrope_model_is_refused() {
    let (model, mut lora) = model_and_lora(MINICPM);
    let plans: Vec<Plan> = pairs(200)
        .iter()
        .map(|p| Plan::pair(p, true).unwrap())
        .collect();
    let members: Vec<PackMember> = plans
        .iter()
        .map(|p| PackMember {
            plan: p,
            reference: None,
            scale: ExampleScale::default(),
        })
        .collect();
    let objective = Objective::Orpo {
        lambda: 0.1,
        scope: SftScope::Full,
    };
    let err = queue_packed(
        &model,
        &mut lora,
        &members,
        &objective,
        &options(0, false),
        true,
        1.0,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("LongRoPE"), "{err}");
}
