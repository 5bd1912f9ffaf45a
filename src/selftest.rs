//! `lorafit selftest`: the CUDA backend checked against the CPU reference on this machine — every
//! op (forward and backward), then whole models (logits and every LoRA gradient) of the supported
//! families at small random shapes.

use crate::model::weights::{load_weights, RandomSource};
use crate::model::{Lora, LoraConfig, Model, ModelSpec, PassCtx};
use crate::tensor::{parity, DType, Device, Tensor};
use anyhow::{bail, Result};

fn rel_norm(a: &[f32], b: &[f32]) -> (f64, f64, usize) {
    let mut num = 0.0;
    let mut den = 0.0;
    let (mut md, mut mi) = (0.0f64, 0usize);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let d = (*x as f64 - *y as f64).abs();
        num += d * d;
        den += (*y as f64).powi(2);
        if d > md {
            (md, mi) = (d, i);
        }
    }
    ((num / den.max(1e-300)).sqrt(), md, mi)
}

/// A tensor source whose values are rounded to bf16.
struct Bf16Rounded<'a>(&'a RandomSource);

impl crate::model::weights::TensorSource for Bf16Rounded<'_> {
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let (shape, mut data) = self.0.get(name)?;
        data.iter_mut()
            .for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
        Ok((shape, data))
    }
    fn contains(&self, name: &str) -> bool {
        self.0.contains(name)
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
}

const FAMILIES: [(&str, &str); 3] = [
    (
        "llama",
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":1024,"tie_word_embeddings":false,"rope_theta":500000.0}"#,
    ),
    (
        "qwen2",
        r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":1024,"tie_word_embeddings":true}"#,
    ),
    (
        "qwen3",
        r#"{"architectures":["Qwen3ForCausalLM"],"hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,"vocab_size":1024,"tie_word_embeddings":false}"#,
    ),
];

/// Whole-model CUDA-vs-CPU rows: logits and LoRA gradients (bf16 bounds 1e-2 / 2e-2).
pub fn model_parity(device: &Device) -> Result<usize> {
    let mut failed = 0;
    for (name, json) in FAMILIES {
        let spec = ModelSpec::from_config_json(json)?;
        let src = RandomSource {
            spec: spec.clone(),
            seed: 7,
        };
        // The CPU reference runs on the same bf16-rounded weights the GPU holds, so the rows
        // measure the device's arithmetic, not the rounding of its inputs.
        let cpu = Model::new(
            spec.clone(),
            load_weights(&spec, &Bf16Rounded(&src), &Device::Cpu)?,
            Device::Cpu,
        );
        let mut gpu = Model::new(
            spec.clone(),
            load_weights(&spec, &src, device)?,
            device.clone(),
        );
        let cfg = LoraConfig {
            rank: 8,
            alpha: 16.0,
            ..Default::default()
        };
        let mut lc = Lora::new(&spec, cfg.clone(), &Device::Cpu)?;
        // Non-zero B so that dA is exercised too.
        // A and B are rounded to bf16 like the weights: the GPU computes with bf16 copies of the
        // f32 masters, and the rows should measure its arithmetic, not that rounding.
        let mut rng = crate::model::lora::Rng(3);
        let round = |x: f32| half::bf16::from_f32(x).to_f32();
        for (_, _, p) in lc.pairs_mut() {
            for x in p.b.as_cpu_mut()? {
                *x = round((rng.normal() * 0.05) as f32);
            }
            for x in p.a.as_cpu_mut()? {
                *x = round(*x);
            }
        }
        lc.refresh_compute_copies()?;
        let dir = std::env::temp_dir().join(format!("lorafit-selftest-{name}"));
        lc.save_peft(&dir, "random")?;
        let mut lg = Lora::load_peft(&dir, &spec, device)?;
        let t = 200;
        let ids: Vec<u32> = (0..t)
            .map(|i| ((i * 7919 + 13) % spec.vocab) as u32)
            .collect();
        let dl: Vec<f32> = (0..t * spec.vocab)
            .map(|i| (((i * 2654435761usize) % 1000) as f32 / 1000.0 - 0.5) * 0.01)
            .collect();
        let run = |m: &Model, l: &mut Lora| -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
            let mask = m.causal_mask(t);
            let rope = m.rope_table(&mask.positions)?;
            let ctx = PassCtx {
                mask: &mask,
                rope: &rope,
                dropout: None,
            };
            let (h, st) = m.forward(&ids, Some(l), &ctx, 0)?;
            let logits = m.logits(&h, DType::F32)?.to_vec()?;
            let d = Tensor::from_f32(&dl, &[t, spec.vocab], DType::F32, &m.device)?;
            let dh = m.logits_bwd(&d)?;
            m.backward(&dh, st, Some(l), &ctx)?;
            let grads = l
                .pairs()
                .flat_map(|(_, _, p)| [p.grad_a.to_vec(), p.grad_b.to_vec()])
                .collect::<Result<Vec<_>>>()?;
            Ok((logits, grads))
        };
        let (lc_logits, lc_grads) = run(&cpu, &mut lc)?;
        // For information: the same model with a bf16 residual stream (not the default).
        gpu.residual_dtype = DType::BF16;
        let mut lb = Lora::load_peft(&dir, &spec, device)?;
        let (lb_logits, lb_grads) = run(&gpu, &mut lb)?;
        let worst_b = lb_grads
            .iter()
            .zip(&lc_grads)
            .map(|(g, c)| rel_norm(g, c).0)
            .fold(0.0, f64::max);
        println!(
            "model {name:<6} (bf16 residual, info) logits rel-norm {:.3e}, worst LoRA grad rel-norm {worst_b:.3e}",
            rel_norm(&lb_logits, &lc_logits).0
        );
        gpu.residual_dtype = DType::F32;
        let (lg_logits, lg_grads) = run(&gpu, &mut lg)?;
        let (rn, md, mi) = rel_norm(&lg_logits, &lc_logits);
        let ok = rn <= 1e-2;
        failed += !ok as usize;
        println!("model {name:<6} logits            rel-norm {rn:.3e} max|diff| {md:.3e} @{mi}  bound 1e-2  {}", if ok { "ok" } else { "FAIL" });
        let mut worst = (0.0, 0);
        for (i, (g, c)) in lg_grads.iter().zip(&lc_grads).enumerate() {
            let (rn, _, _) = rel_norm(g, c);
            if rn > worst.0 {
                worst = (rn, i);
            }
        }
        let ok = worst.0 <= 2e-2;
        failed += !ok as usize;
        println!(
            "model {name:<6} {} LoRA grads   worst rel-norm {:.3e} (matrix {})  bound 2e-2  {}",
            lc_grads.len(),
            worst.0,
            worst.1,
            if ok { "ok" } else { "FAIL" }
        );
    }
    Ok(failed)
}

pub fn run(device: &Device, seed: u64) -> Result<()> {
    let rows = parity::run_op_parity(device, seed)?;
    parity::print_parity(&rows);
    let op_failed = rows.iter().filter(|r| !r.pass).count();
    let model_failed = model_parity(device)? + (!train_parity(device)?) as usize;
    println!(
        "selftest: {} op rows ({op_failed} failed), model rows ({model_failed} failed)",
        rows.len()
    );
    if op_failed + model_failed > 0 {
        bail!("{} parity checks failed", op_failed + model_failed);
    }
    Ok(())
}

/// Twenty ORPO steps (forward, head, backward, AdamW) on a Qwen2-shaped random model with random
/// pairs, on the CPU and on `device` from the same initial adapter: the per-step losses must agree
/// within bf16 tolerance (relative difference ≤ 2e-2).
pub fn train_parity(device: &Device) -> Result<bool> {
    use crate::train::head::HeadTier;
    use crate::train::objectives::SftScope;
    use crate::train::optim::{apply_update, AdamState, OptimOptions};
    use crate::train::plan::Plan;
    use crate::train::step::{run_example, Objective, PassOptions};
    let spec = ModelSpec::from_config_json(
        r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":256,"intermediate_size":512,"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":2048,"tie_word_embeddings":true}"#,
    )?;
    let src = RandomSource {
        spec: spec.clone(),
        seed: 11,
    };
    let mut rng = crate::model::lora::Rng(5);
    let mut tok = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| (rng.next_u64() % spec.vocab as u64) as u32)
            .collect()
    };
    let pairs: Vec<crate::data::TokenizedPair> = (0..20)
        .map(|i| crate::data::TokenizedPair {
            prompt: tok(40 + i),
            chosen: tok(12 + i % 5),
            rejected: tok(9 + i % 7),
        })
        .collect();
    let run = |dev: &Device| -> Result<Vec<f64>> {
        let model = Model::new(spec.clone(), load_weights(&spec, &src, dev)?, dev.clone());
        let mut lora = Lora::new(
            &spec,
            LoraConfig {
                rank: 8,
                alpha: 16.0,
                ..Default::default()
            },
            dev,
        )?;
        let mut adam = AdamState::new(&lora)?;
        let o = OptimOptions {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            grad_clip: 1.0,
            lora_plus_ratio: 1.0,
        };
        let opts = PassOptions {
            segment_size: 2,
            head: HeadTier::Chunked,
            head_chunk: 16,
            dropout: None,
        };
        let obj = Objective::Orpo {
            lambda: 0.1,
            scope: SftScope::Full,
        };
        let mut losses = Vec::new();
        for (i, p) in pairs.iter().enumerate() {
            let plan = Plan::pair(p, true, None)?;
            losses.push(run_example(&model, &mut lora, &plan, &obj, None, &opts, true, 1.0)?.loss);
            apply_update(&mut lora, &mut adam, 5e-3, i as u64 + 1, 1.0, &o)?;
        }
        Ok(losses)
    };
    let cpu = run(&Device::Cpu)?;
    let gpu = run(device)?;
    let worst = cpu
        .iter()
        .zip(&gpu)
        .map(|(c, g)| ((c - g) / c).abs())
        .fold(0.0, f64::max);
    println!(
        "train 20 ORPO steps, Qwen2-shaped random model (segment 2, chunked head, prefix-shared):"
    );
    println!(
        "  cpu  losses: {}",
        cpu.iter()
            .map(|x| format!("{x:.4}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "  cuda losses: {}",
        gpu.iter()
            .map(|x| format!("{x:.4}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let ok = worst <= 2e-2;
    println!(
        "  worst relative loss difference {worst:.3e}  bound 2e-2  {}",
        if ok { "ok" } else { "FAIL" }
    );
    Ok(ok)
}
