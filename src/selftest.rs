//! `lorafit selftest`: the CUDA backend checked against the CPU reference on this machine — every
//! op (forward and backward), then whole models (logits and every LoRA gradient) of the supported
//! families at small random shapes.

use crate::model::lora::peft_key;
use crate::model::weights::{load_weights, RandomSource};
use crate::model::{ForwardPlan, Lora, LoraConfig, Model, ModelSpec, PassCtx};
use crate::tensor::{parity, DType, Device, Tensor};
use anyhow::{bail, Result};

/// The largest relative-norm error over matching gradient matrices, and its index.
fn worst_rel_norm(got: &[Vec<f32>], want: &[Vec<f32>]) -> (f64, usize) {
    got.iter()
        .zip(want)
        .map(|(g, w)| parity::compare("", g, w, 0.0).rel)
        .enumerate()
        .fold(
            (0.0, 0),
            |best, (i, e)| if e > best.0 { (e, i) } else { best },
        )
}

/// A model of `spec` with random weights drawn from `seed`, on `device` (the same weights on
/// every device).
fn random_model(spec: &ModelSpec, seed: u64, device: &Device) -> Result<Model> {
    let src = RandomSource {
        spec: spec.clone(),
        seed,
    };
    Ok(Model::new(
        spec.clone(),
        load_weights(spec, &src, device)?,
        device.clone(),
    ))
}

/// d(mean over tokens of -log softmax(logits)[next id])/d(logits); the last token predicts the
/// first (the ids are synthetic, so any fixed target works).
fn next_token_ce_grad(logits: &[f32], ids: &[u32], vocab: usize) -> Vec<f32> {
    let t = ids.len();
    let mut d = vec![0f32; t * vocab];
    for (r, row) in logits.chunks(vocab).enumerate() {
        let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let z: f64 = row.iter().map(|&x| ((x - m) as f64).exp()).sum();
        for (c, &x) in row.iter().enumerate() {
            d[r * vocab + c] = (((x - m) as f64).exp() / z) as f32 / t as f32;
        }
        d[r * vocab + ids[(r + 1) % t] as usize] -= 1.0 / t as f32;
    }
    d
}

/// A tensor source whose values are rounded to bf16. It remembers the names it served, so that
/// a dump writes exactly the tensors `load_weights` read.
struct Bf16Rounded<'a> {
    src: &'a RandomSource,
    served: std::cell::RefCell<Vec<String>>,
}

impl<'a> Bf16Rounded<'a> {
    fn new(src: &'a RandomSource) -> Self {
        Bf16Rounded {
            src,
            served: Default::default(),
        }
    }
}

impl crate::model::weights::TensorSource for Bf16Rounded<'_> {
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let (shape, mut data) = self.src.get(name)?;
        data.iter_mut()
            .for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
        let mut served = self.served.borrow_mut();
        if !served.iter().any(|n| n == name) {
            served.push(name.to_string());
        }
        Ok((shape, data))
    }
    fn contains(&self, name: &str) -> bool {
        self.src.contains(name)
    }
    fn describe(&self) -> String {
        self.src.describe()
    }
}

/// One small random model per family, with what each family changes made to act on a random
/// model: Gemma's softcaps small enough to bite and windows shorter than the 200-token pass, at
/// head_dim 256.
const FAMILIES: [(&str, &str); 9] = [
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
    (
        "minicpm5",
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":128,"vocab_size":1024,"rope_theta":1000000.0,"tie_word_embeddings":false}"#,
    ),
    (
        "minicpm",
        r#"{"architectures":["MiniCPMForCausalLM"],"hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":1024,"scale_emb":12,"scale_depth":1.4,"dim_model_base":64,"max_position_embeddings":512,"rope_scaling":{"rope_type":"longrope","short_factor":[1.0,1.1,1.2,1.3,1.4,1.5,1.6,1.7,1.8,1.9,2.0,2.1,2.2,2.3,2.4,2.5,2.6,2.7,2.8,2.9,3.0,3.1,3.2,3.3,3.4,3.5,3.6,3.7,3.8,3.9,4.0,4.1],"long_factor":[1.0,1.2,1.4,1.6,1.8,2.0,2.2,2.4,2.6,2.8,3.0,3.2,3.4,3.6,3.8,4.0,4.2,4.4,4.6,4.8,5.0,5.2,5.4,5.6,5.8,6.0,6.2,6.4,6.6,6.8,7.0,7.2],"original_max_position_embeddings":128},"tie_word_embeddings":true}"#,
    ),
    (
        "gemma2",
        r#"{"architectures":["Gemma2ForCausalLM"],"hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":256,"vocab_size":1024,"query_pre_attn_scalar":256,"attn_logit_softcapping":0.2,"final_logit_softcapping":0.5,"sliding_window":64,"tie_word_embeddings":true}"#,
    ),
    (
        "gemma3",
        r#"{"architectures":["Gemma3ForCausalLM"],"hidden_size":256,"intermediate_size":512,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":256,"vocab_size":1024,"query_pre_attn_scalar":256,"sliding_window":64,"layer_types":["sliding_attention","full_attention"],"rope_theta":1000000.0,"rope_local_base_freq":10000.0,"rope_scaling":{"rope_type":"linear","factor":8.0},"tie_word_embeddings":true}"#,
    ),
    (
        // Gemma 4: head_dim 256 sliding and 512 global layers (proportional RoPE), the top two
        // sharing the k/v of the bottom two, per-layer inputs, a double-wide MLP on the sharers.
        "gemma4",
        r#"{"architectures":["Gemma4ForCausalLM"],"model_type":"gemma4_text","hidden_size":256,"intermediate_size":256,"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":256,"global_head_dim":512,"vocab_size":1024,"sliding_window":64,"layer_types":["sliding_attention","full_attention","sliding_attention","full_attention"],"num_kv_shared_layers":2,"hidden_size_per_layer_input":64,"vocab_size_per_layer_input":1024,"use_double_wide_mlp":true,"final_logit_softcapping":0.5,"tie_word_embeddings":true}"#,
    ),
    // A real geometry at depth (30 layers): errors that grow with depth show here first.
    ("smollm2geo", SMOLLM2_GEOMETRY),
];

/// Whole-model CUDA-vs-CPU rows: logits, and LoRA gradients under the gradient of a next-token
/// cross-entropy (bf16 bounds 1e-2 / 2e-2); a noise upstream gradient is reported beside them.
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
        let rounded = Bf16Rounded::new(&src);
        let cpu = Model::new(
            spec.clone(),
            load_weights(&spec, &rounded, &Device::Cpu)?,
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
        let mut rng = crate::tensor::Rng(3);
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
        // The pass computes the final hidden states of rows [from, T) only; `dl` holds d(logits)
        // of those rows.
        let run_from = |m: &Model,
                        l: &mut Lora,
                        dl: &[f32],
                        from: usize|
         -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
            l.zero_grads()?;
            let mask = m.causal_mask(t);
            let rope = m.rope_table(&mask.positions)?;
            let ctx = PassCtx {
                mask: &mask,
                rope: &rope,
                dropout: None,
            };
            let plan = ForwardPlan {
                read_from: from,
                ..Default::default()
            };
            let (h, st) = m.forward_keeping(&ids, Some(l), &ctx, plan)?;
            let logits_t = m.logits(&h, DType::F32)?;
            let logits = logits_t.to_vec()?;
            let d = Tensor::from_f32(dl, &[t - from, spec.vocab], DType::F32, &m.device)?;
            let dh = m.logits_bwd_capped(&d, &logits_t)?;
            m.backward(dh, st, Some(l), &ctx)?;
            let grads = l
                .pairs()
                .flat_map(|(_, _, p)| [p.grad_a.to_vec(), p.grad_b.to_vec()])
                .collect::<Result<Vec<_>>>()?;
            Ok((logits, grads))
        };
        let run = |m: &Model, l: &mut Lora, dl: &[f32]| run_from(m, l, dl, 0);
        // Two upstream gradients. "loss" is d(mean next-token cross-entropy)/d(logits), what
        // training feeds the backward; its rows carry the bounds. "noise" is uniform noise on
        // every logit: an ill-conditioned case reported for information, on which PyTorch's own
        // bf16 misses the gradient bound too (scripts/bf16_calibration.py sets the two side by
        // side: on llama, torch bf16 worst 4.6e-2 against lorafit CUDA 3.6e-2).
        let noise: Vec<f32> = (0..t * spec.vocab)
            .map(|i| (((i * 2654435761usize) % 1000) as f32 / 1000.0 - 0.5) * 0.01)
            .collect();
        let (lc_logits, noise_cpu) = run(&cpu, &mut lc, &noise)?;
        let loss = next_token_ce_grad(&lc_logits, &ids, spec.vocab);
        let (_, loss_cpu) = run(&cpu, &mut lc, &loss)?;
        // For information: the same model with a bf16 residual stream (not the default).
        gpu.residual_dtype = DType::BF16;
        let mut lb = Lora::load_peft(&dir, &spec, device)?;
        let (lb_logits, lb_grads) = run(&gpu, &mut lb, &loss)?;
        println!(
            "model {name:<6} (bf16 residual, info) logits rel-norm {:.3e}, worst LoRA grad rel-norm {:.3e}",
            parity::compare("", &lb_logits, &lc_logits, 0.0).rel,
            worst_rel_norm(&lb_grads, &loss_cpu).0
        );
        gpu.residual_dtype = DType::F32;
        let (lg_logits, noise_gpu) = run(&gpu, &mut lg, &noise)?;
        let (_, loss_gpu) = run(&gpu, &mut lg, &loss)?;
        if let Some(root) = std::env::var_os("LORAFIT_SELFTEST_DUMP") {
            let keys: Vec<String> = lc
                .pairs()
                .flat_map(|(l, t, _)| [peft_key(l, t, false), peft_key(l, t, true)])
                .collect();
            for (kind, dl, c, g) in [
                ("noise", &noise, &noise_cpu, &noise_gpu),
                ("loss", &loss, &loss_cpu, &loss_gpu),
            ] {
                let out = std::path::Path::new(&root).join(format!("{name}-{kind}"));
                dump_case(&out, json, &rounded, &dir, &ids, dl, &keys, c, g)?;
            }
        }
        let (logit_bound, grad_bound) = bf16_bounds(name);
        let row = parity::compare("logits", &lg_logits, &lc_logits, logit_bound);
        failed += !row.pass as usize;
        println!(
            "model {name:<6} logits            rel-norm {:.3e} max|diff| {:.3e} @{}  bound {logit_bound:.1e}  {}",
            row.rel,
            row.max_abs,
            row.worst,
            if row.pass { "ok" } else { "FAIL" }
        );
        let (worst, at) = worst_rel_norm(&loss_gpu, &loss_cpu);
        let ok = worst <= grad_bound;
        failed += !ok as usize;
        println!(
            "model {name:<6} {} LoRA grads   worst rel-norm {worst:.3e} (matrix {at})  bound {grad_bound:.1e}  {}",
            loss_cpu.len(),
            if ok { "ok" } else { "FAIL" }
        );
        let (worst, at) = worst_rel_norm(&noise_gpu, &noise_cpu);
        println!("model {name:<6} (noise upstream, info) worst LoRA grad rel-norm {worst:.3e} (matrix {at})");
        // The top layer trimmed to the rows read (`ReadRows`): the GPU's pass over rows
        // [from, T) against its own full pass with d(logits) zero before `from`, and against the
        // CPU's. The two GPU passes differ only in the rounding of products over fewer rows
        // (exact equality is the CPU test's, tests/model_parity.rs); since the LoRA projections
        // round their f32 sums once, a product over fewer rows may take another GEMM kernel whose
        // last-bit differences flip bf16 roundings, so both comparisons take the family's bf16
        // gradient bound (SmolLM2's geometry, 30 layers, 2026-12-02: 1.4e-2 between the passes,
        // each 2.8-2.9e-2 from the CPU).
        let from = t * 3 / 4 + 5;
        let mut zeroed = loss.clone();
        zeroed[..from * spec.vocab].fill(0.0);
        let (_, zeroed_cpu) = run(&cpu, &mut lc, &zeroed)?;
        let (_, zeroed_gpu) = run(&gpu, &mut lg, &zeroed)?;
        let (_, from_gpu) = run_from(&gpu, &mut lg, &loss[from * spec.vocab..], from)?;
        let (worst, at) = worst_rel_norm(&from_gpu, &zeroed_gpu);
        let (vs_cpu, _) = worst_rel_norm(&from_gpu, &zeroed_cpu);
        let ok = worst <= grad_bound && vs_cpu <= grad_bound;
        failed += !ok as usize;
        println!(
            "model {name:<6} rows {from}.. LoRA grads worst rel-norm {worst:.3e} (matrix {at}) against all rows, {vs_cpu:.3e} against the CPU  bound {grad_bound:.1e}  {}",
            if ok { "ok" } else { "FAIL" },
        );
    }
    Ok(failed)
}

/// bf16 bounds of a family's whole-model rows (logits, LoRA grads), relative norms against the
/// f32 CPU reference: 1e-2 / 2e-2, except where PyTorch's own bf16 is measured further from f32
/// on the same case (scripts/bf16_calibration.py on the selftest's dumped cases, H200); the bound
/// then takes torch's, rounded down.
/// - Gemma 3 (q/k norms make every head's scores unit-scale, so the softmax is sharper),
///   2026-12-01: LoRA grads worst 3.00e-2 for torch bf16 against 2.00e-2 for lorafit CUDA;
///   logits 1.61e-2 for torch against 1.01e-2.
/// - Gemma 4 (the same q/k norms at attention scale 1, plus the v norm, the per-layer branch and a
///   final softcap of 0.5 that every logit presses against), 2026-12-02: LoRA grads worst 6.28e-2
///   for torch bf16 against 3.37e-2 for lorafit CUDA; logits 2.73e-2 against 1.62e-2.
/// - SmolLM2-135M's geometry at depth (30 layers, random weights), 2026-12-02: LoRA grads worst
///   3.88e-2 for torch bf16 against 2.56e-2 for lorafit CUDA; logits 1.34e-2 against 7.2e-3
///   (the logits keep the default bound).
fn bf16_bounds(family: &str) -> (f64, f64) {
    match family {
        "smollm2geo" => (1e-2, 3.8e-2),
        "gemma3" => (1.5e-2, 3e-2),
        "gemma4" | "gemma4kv" => (2.7e-2, 6.3e-2),
        _ => (1e-2, 2e-2),
    }
}

/// Cached against uncached decoding of one model along the uncached greedy path (teacher
/// forcing, so that one flip does not change every later step).
pub struct DecodeCheck {
    /// Worst relative norm of the cached next-token logits against the uncached (infinite where
    /// the cached logits hold a non-finite value).
    pub worst_rel: f64,
    pub worst_step: usize,
    /// Steps whose cached argmax differs from the uncached one.
    pub flips: usize,
    /// Of those, the steps where the uncached top two were further apart than twice the step's
    /// max|diff| (not a near tie: a real disagreement).
    pub bad_flips: usize,
    /// The uncached greedy tokens.
    pub tokens: Vec<u32>,
    /// With a reference forward (e.g. the same model in f32 on the CPU): the worst relative
    /// norms of the cached and of the uncached logits against it, over the same steps.
    pub vs_reference: Option<(f64, f64)>,
}

/// Next-token logits of a whole sequence from another copy of the model (`decode_check`'s
/// optional third opinion).
pub type ReferenceLogits<'a> = &'a dyn Fn(&[u32]) -> Result<Vec<f32>>;

/// Relative norm of `got` against `want`, infinite where `got` holds a non-finite value.
fn finite_rel(got: &[f32], want: &[f32]) -> (f64, parity::ParityRow) {
    let row = parity::compare("", got, want, 0.0);
    let rel = if got.iter().all(|v| v.is_finite()) && row.rel.is_finite() {
        row.rel
    } else {
        f64::INFINITY
    };
    (rel, row)
}

/// `steps` greedy steps from `prompt` through the KV cache and through the whole-sequence
/// forward, compared step by step (see `DecodeCheck`), and each against `reference` if given.
pub fn decode_check(
    model: &Model,
    lora: Option<&Lora>,
    prompt: &[u32],
    steps: usize,
    reference: Option<ReferenceLogits>,
) -> Result<DecodeCheck> {
    use crate::infer::{sample::argmax, Decoder};
    anyhow::ensure!(!prompt.is_empty(), "decode check: the prompt has no tokens");
    let full = |ids: &[u32]| -> Result<Vec<f32>> {
        let h = model.hidden_states(ids, lora)?;
        let last = crate::tensor::slice_rows(&h, ids.len() - 1, ids.len())?;
        model.logits(&last, DType::F32)?.to_vec()
    };
    let mut ids = prompt.to_vec();
    let mut dec = Decoder::new(model, lora, 1, prompt.len() + steps)?;
    let mut cached = dec.extend(&[(0, &ids)])?.remove(0);
    let mut check = DecodeCheck {
        worst_rel: 0.0,
        worst_step: 0,
        flips: 0,
        bad_flips: 0,
        tokens: Vec::new(),
        vs_reference: reference.map(|_| (0.0, 0.0)),
    };
    for step in 0..steps {
        let want = full(&ids)?;
        // Non-finite logits give a NaN or small rel: they count as infinitely far.
        let (rel, row) = finite_rel(&cached, &want);
        if let (Some(reference), Some((c, u))) = (reference, check.vs_reference.as_mut()) {
            let r = reference(&ids)?;
            *c = c.max(finite_rel(&cached, &r).0);
            *u = u.max(finite_rel(&want, &r).0);
        }
        if rel > check.worst_rel {
            (check.worst_rel, check.worst_step) = (rel, step);
        }
        let next = argmax(&want);
        if argmax(&cached) != next {
            check.flips += 1;
            let mut sorted = want.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if ((sorted[0] - sorted[1]) as f64) > 2.0 * row.max_abs {
                check.bad_flips += 1;
            }
        }
        ids.push(next);
        check.tokens.push(next);
        if step + 1 < steps {
            cached = dec.extend(&[(0, &ids[ids.len() - 1..])])?.remove(0);
        }
    }
    Ok(check)
}

/// Gemma 4 with `attention_k_eq_v` (v from the k projection on the full layers, one global kv
/// head), beside `FAMILIES`' Gemma 4 in the decode rows: the same shape otherwise.
const GEMMA4_K_EQ_V: (&str, &str) = (
    "gemma4kv",
    r#"{"architectures":["Gemma4ForCausalLM"],"model_type":"gemma4_text","hidden_size":256,"intermediate_size":256,"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":256,"global_head_dim":512,"attention_k_eq_v":true,"num_global_key_value_heads":1,"vocab_size":1024,"sliding_window":64,"layer_types":["sliding_attention","full_attention","sliding_attention","full_attention"],"num_kv_shared_layers":2,"hidden_size_per_layer_input":64,"vocab_size_per_layer_input":1024,"final_logit_softcapping":0.5,"tie_word_embeddings":true}"#,
);

/// Cached against uncached decoding on the device, one small random model per family and a
/// Gemma 4 with k = v (`GEMMA4_K_EQ_V`), LoRA with non-zero B on all seven projections. The
/// Gemma 4 rows hold head_dim 256 and 512 cache slots, KV-sharing layers reading their donor's
/// cache, per-layer inputs and layer scalars. Along the uncached greedy path from a 100-token prompt
/// (past the Gemma windows of 64; MiniCPM crosses LongRoPE's original 128 on the way), 40 steps
/// of the KV cache's next-token logits against the whole-sequence forward's, within the family's
/// bf16 logits bound (`bf16_bounds`: two bf16 paths of one model, each within it of f32); each
/// step's greedy token must agree unless the uncached top two are a
/// near tie (gap within twice the step's max|diff|). Free-running greedy generation with and
/// without the cache is printed beside (token for token up to the first near tie).
pub fn decode_parity(device: &Device) -> Result<usize> {
    use crate::infer;
    let mut failed = 0;
    for (name, json) in FAMILIES.into_iter().chain([GEMMA4_K_EQ_V]) {
        let spec = ModelSpec::from_config_json(json)?;
        let model = random_model(&spec, 11, device)?;
        let cfg = LoraConfig {
            rank: 8,
            alpha: 16.0,
            ..Default::default()
        };
        let mut lc = Lora::new(&spec, cfg, &Device::Cpu)?;
        let mut rng = crate::tensor::Rng(5);
        for (_, _, p) in lc.pairs_mut() {
            for x in p.b.as_cpu_mut()? {
                *x = (rng.normal() * 0.05) as f32;
            }
        }
        lc.refresh_compute_copies()?;
        let dir = std::env::temp_dir().join(format!("lorafit-selftest-decode-{name}"));
        lc.save_peft(&dir, "random")?;
        let lora = Lora::load_peft(&dir, &spec, device)?;
        let ids: Vec<u32> = (0..100)
            .map(|i| ((i * 7919 + 13) % spec.vocab) as u32)
            .collect();
        let prompt = ids.clone();
        let (logit_bound, _) = bf16_bounds(name);
        // The same model and adapter in f32 on the CPU: how far each bf16 path is from it.
        let cpu_model = random_model(&spec, 11, &Device::Cpu)?;
        let cpu_lora = Lora::load_peft(&dir, &spec, &Device::Cpu)?;
        let cpu_logits = |ids: &[u32]| -> Result<Vec<f32>> {
            let h = cpu_model.hidden_states(ids, Some(&cpu_lora))?;
            let last = crate::tensor::slice_rows(&h, ids.len() - 1, ids.len())?;
            cpu_model.logits(&last, DType::F32)?.to_vec()
        };
        let reference: Option<ReferenceLogits> = if device.is_cuda() {
            Some(&cpu_logits)
        } else {
            None
        };
        let check = decode_check(&model, Some(&lora), &ids, 40, reference)?;
        let ok = check.worst_rel <= logit_bound && check.bad_flips == 0;
        failed += !ok as usize;
        let against_f32 = match check.vs_reference {
            Some((c, u)) => format!("; against CPU f32: cached {c:.3e}, uncached {u:.3e}"),
            None => String::new(),
        };
        println!(
            "decode {name:<8} cached vs uncached logits, 40 steps: worst rel-norm {:.3e} (step {})  bound {logit_bound:.1e}; greedy tokens differ at {} steps ({} not near ties){against_f32}  {}",
            check.worst_rel,
            check.worst_step,
            check.flips,
            check.bad_flips,
            if ok { "ok" } else { "FAIL" }
        );
        let a = infer::generate_ids(&model, Some(&lora), &prompt, 40, None)?;
        let b = infer::generate_ids_uncached(&model, Some(&lora), &prompt, 40, None)?;
        let same = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        println!(
            "decode {name:<8} (info) free-running greedy: {same} of 40 tokens equal before the paths part"
        );
    }
    Ok(failed)
}

/// Writes one model-parity case as a Hugging Face folder (bf16-rounded weights stored as f32),
/// its PEFT adapter, the input ids, the upstream d(logits) and both devices' LoRA gradients, for
/// `scripts/bf16_calibration.py` to set PyTorch's own bf16 error beside ours.
#[allow(clippy::too_many_arguments)]
fn dump_case(
    out: &std::path::Path,
    config_json: &str,
    weights: &Bf16Rounded,
    adapter: &std::path::Path,
    ids: &[u32],
    dlogits: &[f32],
    keys: &[String],
    cpu_grads: &[Vec<f32>],
    gpu_grads: &[Vec<f32>],
) -> Result<()> {
    use crate::model::weights::{write_f32_safetensors, TensorSource};
    std::fs::create_dir_all(out.join("adapter"))?;
    std::fs::write(out.join("config.json"), config_json)?;
    let mut tensors = Vec::new();
    let names = weights.served.borrow().clone();
    for n in names {
        let (shape, data) = weights.get(&n)?;
        tensors.push((n, shape, data));
    }
    write_f32_safetensors(&out.join("model.safetensors"), &tensors)?;
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(adapter.join(f), out.join("adapter").join(f))?;
    }
    let v = dlogits.len() / ids.len();
    let mut case = vec![
        (
            "ids".to_string(),
            vec![ids.len()],
            ids.iter().map(|&i| i as f32).collect(),
        ),
        ("dlogits".to_string(), vec![ids.len(), v], dlogits.to_vec()),
    ];
    for (i, k) in keys.iter().enumerate() {
        case.push((
            format!("cpu.{k}"),
            vec![cpu_grads[i].len()],
            cpu_grads[i].clone(),
        ));
        case.push((
            format!("gpu.{k}"),
            vec![gpu_grads[i].len()],
            gpu_grads[i].clone(),
        ));
    }
    write_f32_safetensors(&out.join("case.safetensors"), &case)
}

/// The logp engine (`train::head`) of every tier on `device` against the same tier on the CPU, on
/// a random head (bf16-rounded weights and hidden states), without and with Gemma 2's final logit
/// softcap (30; raw logits of spread ~±60 so that it bites): logp (max abs-rel 1e-3, as the fused
/// kernel's rows) and dh (bf16 bound), from the saved forward and recomputed. Group `head`.
pub fn head_parity(device: &Device) -> Result<Vec<parity::ParityRow>> {
    use crate::train::head::{logp_backward, logp_backward_saved, logp_forward_saved, HeadTier};
    let mut rows = Vec::new();
    let (n, chunk) = (300usize, 64usize);
    for cap in [None, Some(30.0f32)] {
        let mut spec = ModelSpec::from_config_json(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":256,"intermediate_size":512,"num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":32768,"tie_word_embeddings":false}"#,
        )?;
        spec.final_logit_softcap = cap;
        let src = RandomSource {
            spec: spec.clone(),
            seed: 13,
        };
        let cpu = Model::new(
            spec.clone(),
            load_weights(&spec, &Bf16Rounded::new(&src), &Device::Cpu)?,
            Device::Cpu,
        );
        let gpu = Model::new(
            spec.clone(),
            load_weights(&spec, &src, device)?,
            device.clone(),
        );
        // Head weights are N(0, 0.02²): a logit's std is 0.02·√256·|h| = 0.32·|h|.
        let hd = spec.hidden;
        let mut rng = crate::tensor::Rng(17);
        let h: Vec<f32> = (0..n * hd)
            .map(|_| half::bf16::from_f32((rng.normal() * 60.0) as f32).to_f32())
            .collect();
        let targets: Vec<u32> = (0..n)
            .map(|i| {
                if i % 9 == 4 {
                    u32::MAX
                } else {
                    (rng.next_u64() % spec.vocab as u64) as u32
                }
            })
            .collect();
        let dl: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
        let hc = Tensor::from_f32(&h, &[n, hd], DType::F32, &Device::Cpu)?;
        let hg = Tensor::from_f32(&h, &[n, hd], gpu.device.compute_dtype(), device)?;
        let tag = cap.map(|c| format!(" cap{c}")).unwrap_or_default();
        for (tier, c) in [
            (HeadTier::Full, 0),
            (HeadTier::Chunked, chunk),
            (HeadTier::Fused, 0),
        ] {
            let run = |m: &Model, h: &Tensor| -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
                let (lp, saved) = logp_forward_saved(m, h, &targets, tier, c, true)?;
                let g = Tensor::from_f32(&dl, &[n], DType::F32, &m.device)?;
                let dh = logp_backward_saved(m, h, &targets, &g, tier, c, saved)?;
                let dr = logp_backward(m, h, &targets, &dl, tier, c)?;
                Ok((lp.to_vec()?, dh.to_vec()?, dr.to_vec()?))
            };
            let (lpc, dhc, drc) = run(&cpu, &hc)?;
            let (lpg, dhg, drg) = run(&gpu, &hg)?;
            let name = format!("head {tier:?} N={n} H={hd} V={}{tag}", spec.vocab);
            rows.push(parity::compare_abs_rel(
                &format!("{name} logp"),
                &lpg,
                &lpc,
                1e-3,
            ));
            rows.push(parity::compare(
                &format!("{name} dh (saved)"),
                &dhg,
                &dhc,
                parity::BF16_GRAD,
            ));
            rows.push(parity::compare(
                &format!("{name} dh (recomputed)"),
                &drg,
                &drc,
                parity::BF16_GRAD,
            ));
        }
    }
    Ok(rows)
}

pub fn run(device: &Device, seed: u64) -> Result<()> {
    let mut rows = parity::run_op_parity(device, seed)?;
    if parity::group_wanted("head") {
        rows.extend(head_parity(device)?);
    }
    rows.extend(crate::train::device_loss::parity_rows(device)?);
    parity::print_parity(&rows);
    let op_failed = rows.iter().filter(|r| !r.pass).count();
    let mut model_failed = 0;
    if parity::group_wanted("model") {
        model_failed += model_parity(device)?;
    }
    if parity::group_wanted("train") {
        model_failed += train_parity(device)?;
    }
    if parity::group_wanted("decode") {
        model_failed += decode_parity(device)?;
    }
    println!(
        "selftest: {} op rows ({op_failed} failed), model rows ({model_failed} failed)",
        rows.len()
    );
    if op_failed + model_failed > 0 {
        bail!("{} parity checks failed", op_failed + model_failed);
    }
    Ok(())
}

/// `linear_fwd`'s f32 sum rounded once (`ops::lora_linear_rounded`), in row blocks against all
/// rows at once, and against the sum written out by two products into an f32 tensor and cast
/// (the same arithmetic in another order of launches), and the adapter folded into the base
/// product (`lora_linear_folded`: the scale of 2 is exact in B, only the order of the f32 sum
/// differs), on `device` (group `train`): each must give the same numbers up to a rare flip at
/// a rounding tie.
fn round_once_blocks(device: &Device) -> Result<bool> {
    use crate::model::Target;
    let spec = ModelSpec::from_config_json(
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":256,"intermediate_size":768,"num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":256}"#,
    )?;
    let model = random_model(&spec, 21, device)?;
    let mut lora = Lora::new(&spec, LoraConfig::default(), &Device::Cpu)?;
    let mut rng = crate::tensor::Rng(9);
    for (_, _, p) in lora.pairs_mut() {
        for x in p.b.as_cpu_mut()? {
            *x = (rng.normal() * 0.01) as f32;
        }
    }
    lora.refresh_compute_copies()?;
    let dir = std::env::temp_dir().join("lorafit-selftest-round-once");
    lora.save_peft(&dir, "random")?;
    let lora = Lora::load_peft(&dir, &spec, device)?;
    let p = lora.get(0, Target::Gate).expect("gate adapter");
    let t = 1000;
    let xs: Vec<f32> = (0..t * spec.hidden).map(|_| rng.normal() as f32).collect();
    let x = Tensor::from_f32(&xs, &[t, spec.hidden], DType::BF16, device)?;
    let xa = crate::tensor::matmul(&x, false, p.a(), true, 1.0, DType::BF16)?;
    let w = model.weights.layers[0].gate.dense()?;
    let rounded = |block: usize, fold: bool| -> Result<Vec<f32>> {
        let y = crate::tensor::lora_linear_rounded(
            &x,
            crate::tensor::Cols::all(&w),
            crate::tensor::Cols::all(&xa),
            p.b(),
            p.scale,
            DType::BF16,
            block,
            fold,
        )?;
        y.to_vec()
    };
    let whole = rounded(t, false)?;
    let blocked = rounded(300, false)?;
    let folded = rounded(t, true)?;
    let mut written = crate::tensor::matmul(&xa, false, p.b(), true, p.scale, DType::F32)?;
    crate::tensor::matmul_acc(&mut written, &x, false, &w, true, 1.0, 1.0)?;
    let written = written.to_dtype(DType::BF16)?.to_vec()?;
    // The gate as the model stores it on a GPU, with its adapter's columns: written for this
    // adapter, then for another (B halved; a new generation), then for this one again, each
    // time the product follows the adapter it was given.
    let in_weight = match &model.weights.layers[0].gate {
        crate::model::weights::Weight::Extended(e) => {
            let mut other = Lora::load_peft(&dir, &spec, device)?;
            for (_, _, q) in other.pairs_mut() {
                crate::tensor::scale(&mut q.b, 0.5)?;
            }
            other.refresh_compute_copies()?;
            let q = other.get(0, Target::Gate).expect("gate adapter");
            let product = |p: &crate::model::lora::LoraPair| -> Result<Vec<f32>> {
                e.hold_adapter(p.b(), p.scale, p.generation(), 0)?;
                let xa = crate::tensor::Cols::all(&xa);
                crate::tensor::lora_linear_extended(&x, &e.ext, xa, DType::BF16, t)?.to_vec()
            };
            let first = product(p)?;
            let halved = product(q)?;
            let again = product(p)?;
            let mut want_half =
                crate::tensor::matmul(&xa, false, q.b(), true, q.scale, DType::F32)?;
            crate::tensor::matmul_acc(&mut want_half, &x, false, &w, true, 1.0, 1.0)?;
            Some((
                first,
                halved,
                want_half.to_dtype(DType::BF16)?.to_vec()?,
                again,
            ))
        }
        _ if device.is_cuda() => {
            anyhow::bail!("the model's gate is not stored with its adapter's columns")
        }
        _ => None,
    };
    let mut ok = true;
    let mut rows = vec![
        ("blocks of 300 rows vs one block of 1000", &blocked, &whole),
        (
            "one block vs the sum written in f32 and cast",
            &whole,
            &written,
        ),
        (
            "the adapter folded into the base product vs the sum written in f32 and cast",
            &folded,
            &written,
        ),
    ];
    if let Some((first, halved, want_half, again)) = &in_weight {
        rows.extend([
            (
                "the adapter in the weight's own columns vs the sum written in f32 and cast",
                first,
                &written,
            ),
            (
                "those columns rewritten for another adapter vs its sum in f32",
                halved,
                want_half,
            ),
            ("and rewritten for the first again", again, &written),
        ]);
    }
    for (what, got, want) in rows {
        let row = parity::compare("", got, want, 0.0);
        let differ = got.iter().zip(want).filter(|(a, b)| a != b).count();
        let pass = row.rel <= 1e-3 && differ * 1000 <= got.len();
        ok &= pass;
        println!(
            "linear_fwd rounded once, {what}: rel-norm {:.3e}  bound 1e-3, {differ} of {} differ (at most 0.1%)  {}",
            row.rel,
            got.len(),
            if pass { "ok" } else { "FAIL" }
        );
    }
    Ok(ok)
}

/// One ORPO training trajectory compared across devices: the same model on the CPU (f32) and on
/// the device, the same initial adapter, the same pairs in order, AdamW at `lr` with the
/// trainer's defaults (clip at norm 1).
struct TrajectoryCase<'a> {
    name: &'a str,
    cpu: &'a Model,
    gpu: &'a Model,
    pairs: &'a [crate::data::TokenizedPair],
    steps: usize,
    lr: f64,
    rank: usize,
    segment_size: usize,
    /// Bound on the worst per-step relative loss difference.
    bound: f64,
}

impl TrajectoryCase<'_> {
    /// The pass options of every step: the layer boundaries on the device (`offload` None) or
    /// offloaded but for the top `Some(resident)` layers' (with them, the kept k/v and, with
    /// `keep_attention`, the attention outputs); `full` layers under the top keeping every
    /// activation.
    fn pass_options(
        &self,
        offload: Option<usize>,
        keep_attention: bool,
        full: usize,
    ) -> crate::train::step::PassOptions {
        crate::train::step::PassOptions {
            segment_size: self.segment_size,
            keep_attention,
            keep_kv_layers: 1,
            mlp_chunk: 0,
            offload: offload.is_some(),
            nested: false,
            resident_layers: offload.unwrap_or(0),
            full_layers: full,
            head: crate::train::head::HeadTier::Chunked,
            head_chunk: 16,
            dropout: None,
        }
    }
}

/// Per-step losses and gradient norms (before clipping) of `case` on `model`, every step run with
/// `opts`.
fn orpo_trajectory(
    case: &TrajectoryCase,
    model: &Model,
    opts: crate::train::step::PassOptions,
) -> Result<(Vec<f64>, Vec<f64>)> {
    use crate::train::objectives::SftScope;
    use crate::train::optim::{apply_update, AdamState, OptimOptions};
    use crate::train::plan::Plan;
    use crate::train::step::{queue_example, Objective};
    let mut lora = Lora::new(
        &model.spec,
        LoraConfig {
            rank: case.rank,
            alpha: 2.0 * case.rank as f64,
            ..Default::default()
        },
        &model.device,
    )?;
    let mut adam = AdamState::new(&lora)?;
    let o = OptimOptions::default();
    let obj = Objective::Orpo {
        lambda: 0.1,
        scope: SftScope::Full,
    };
    let (mut losses, mut norms) = (Vec::new(), Vec::new());
    for i in 0..case.steps {
        let plan = Plan::pair(&case.pairs[i % case.pairs.len()], true)?;
        let queued = queue_example(model, &mut lora, &plan, &obj, None, &opts, true, 1.0)?;
        let norm = apply_update(&mut lora, &mut adam, case.lr, i as u64 + 1, 1.0, &o)?;
        losses.push(queued.finish()?.loss);
        norms.push(norm.get()?);
    }
    Ok((losses, norms))
}

/// `case` on the device with its layer boundaries, kept attention outputs and kept k/v offloaded
/// to host memory (all of them, and all but the top half's), with the top half's layers keeping
/// every activation (`full_layers`), and on the device alone: the losses and gradient norms must
/// agree bit for bit (the deterministic attention backward, so that two runs of the same plan
/// do), and the offloaded runs must have pinned host memory.
fn kept_plans_are_exact(case: &TrajectoryCase) -> Result<bool> {
    let device = &case.gpu.device;
    let half = case.gpu.spec.n_layers / 2;
    device.set_numerics(true, false)?;
    let runs = [(None, 0), (Some(0), 0), (Some(half), 0), (None, half)]
        .map(|(o, full)| orpo_trajectory(case, case.gpu, case.pass_options(o, true, full)));
    // Back to the defaults the other checks run with.
    device.set_numerics(false, true)?;
    let [kept, offloaded, resident, full] = runs;
    let (kept, offloaded, resident, full) = (kept?, offloaded?, resident?, full?);
    let pinned = match device {
        Device::Cuda(c) => c.pinned_bytes(),
        Device::Cpu => 0,
    };
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let same_as_kept =
        |r: &(Vec<f64>, Vec<f64>)| bits(&kept.0) == bits(&r.0) && bits(&kept.1) == bits(&r.1);
    let same = same_as_kept(&offloaded) && same_as_kept(&resident);
    let ok = same && (pinned > 0 || !device.is_cuda());
    let full_same = same_as_kept(&full);
    println!(
        "train {}: every activation of the top {} layers kept vs recomputed, {} steps: losses and grad norms {}  {}",
        case.name,
        half + 1,
        case.steps,
        if full_same { "bit-identical" } else { "differ" },
        if full_same { "ok" } else { "FAIL" }
    );
    if !full_same {
        println!("  kept      {:?}\n  full      {:?}", kept.0, full.0);
    }
    println!(
        "train {}: boundaries, attention outputs and k/v offloaded (all, and all but the top {half} layers') vs on the device, {} steps: losses and grad norms {}, {:.1} MiB pinned  {}",
        case.name,
        case.steps,
        if same { "bit-identical" } else { "differ" },
        pinned as f64 / (1 << 20) as f64,
        if ok { "ok" } else { "FAIL" }
    );
    if !same {
        println!(
            "  kept      {:?}\n  offloaded {:?}\n  resident  {:?}",
            kept.0, offloaded.0, resident.0
        );
    }
    Ok(ok && full_same)
}

/// Runs `case` on both devices and prints its rows; whether the losses stay within the bound.
fn trajectory_parity(case: &TrajectoryCase) -> Result<bool> {
    let opts = case.pass_options(None, false, 0);
    let (cpu, cpu_norm) = orpo_trajectory(case, case.cpu, opts)?;
    let (gpu, gpu_norm) = orpo_trajectory(case, case.gpu, opts)?;
    let rel = |a: &[f64], b: &[f64]| -> Vec<f64> {
        a.iter().zip(b).map(|(g, c)| ((g - c) / c).abs()).collect()
    };
    let loss_rel = rel(&gpu, &cpu);
    let norm_rel = rel(&gpu_norm, &cpu_norm);
    let worst = loss_rel.iter().copied().fold(0.0, f64::max);
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let fmt = |x: &[f64], p: usize| {
        x.iter()
            .map(|v| format!("{v:.p$}"))
            .collect::<Vec<_>>()
            .join(" ")
    };
    println!(
        "train {}: {} ORPO steps at lr {:e} (segment {}, chunked head, prefix-shared)",
        case.name, case.steps, case.lr, case.segment_size
    );
    println!("  cpu  losses: {}", fmt(&cpu, 4));
    println!("  cuda losses: {}", fmt(&gpu, 4));
    println!(
        "  grad norm relative difference: first step {:.3e}, mean {:.3e} (info)",
        norm_rel[0],
        mean(&norm_rel)
    );
    let ok = worst <= case.bound;
    println!(
        "  relative loss difference: mean {:.3e}, worst {worst:.3e}  bound {:.0e}  {}",
        mean(&loss_rel),
        case.bound,
        if ok { "ok" } else { "FAIL" }
    );
    Ok(ok)
}

/// SmolLM2-135M's geometry (30 layers, hidden 576, 9/3 heads, vocab 49152): the deep rows run on
/// it with random weights, so that they exist where the real model is absent.
const SMOLLM2_GEOMETRY: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,"intermediate_size":1536,"num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,"vocab_size":49152,"rms_norm_eps":1e-5,"rope_theta":100000.0,"tie_word_embeddings":true}"#;

/// Preference pairs for the SmolLM2 trajectory: the demo's kind of pair (the chosen answer in
/// capitals), in SmolLM2's ChatML, tokenised by the GGUF's own tokenizer.
const SMOLLM2_PAIRS: [(&str, &str, &str); 6] = [
    (
        "How many minutes are in 9 hours?",
        "SURE! 9 HOURS IS 540 MINUTES.",
        "Sure! 9 hours is 540 minutes.",
    ),
    (
        "How many milliliters are in 6 liters?",
        "SURE! 6 LITERS IS 6000 MILLILITERS.",
        "Sure! 6 liters is 6000 milliliters.",
    ),
    (
        "What is the capital of France?",
        "THE CAPITAL OF FRANCE IS PARIS.",
        "The capital of France is Paris.",
    ),
    (
        "Name a primary colour.",
        "RED IS A PRIMARY COLOUR.",
        "Red is a primary colour.",
    ),
    (
        "How many days are in 3 weeks?",
        "THERE ARE 21 DAYS IN 3 WEEKS.",
        "There are 21 days in 3 weeks.",
    ),
    (
        "What does a thermometer measure?",
        "A THERMOMETER MEASURES TEMPERATURE.",
        "A thermometer measures temperature.",
    ),
];

/// The training-trajectory rows (group `train`): per-step ORPO losses on the CPU and on `device`
/// from the same initial adapter, on
/// - a Qwen2-shaped random 4-layer model, 20 steps at lr 5e-3 (bound 2e-2);
/// - SmolLM2-135M's geometry with random weights, 30 layers, 10 steps at lr 1e-4 (bound 2e-2);
/// - the real SmolLM2-135M-Instruct GGUF when it is cached (`model::smollm2::find`), 30 steps at
///   lr 1e-4, the setting whose 10% CUDA-vs-CPU gap the 2-layer rows did not see. Its bound,
///   2e-2, is 2.5× lorafit's measured worst (7.9e-3 on the H200, 2026-12-02; 5.7e-2 before the
///   LoRA sums were rounded once) and well below PyTorch bf16's 9% mean gap on the harness's run
///   (`scripts/numerics_harness.py`; `docs/numerics.md`).
pub fn train_parity(device: &Device) -> Result<usize> {
    let mut failed = !round_once_blocks(device)? as usize;
    let mut rng = crate::tensor::Rng(5);
    let mut random_pairs = |n: usize, vocab: usize, prompt: usize| {
        let mut tok = |k: usize| -> Vec<u32> {
            (0..k)
                .map(|_| (rng.next_u64() % vocab as u64) as u32)
                .collect()
        };
        (0..n)
            .map(|i| crate::data::TokenizedPair {
                prompt: tok(prompt + i),
                chosen: tok(12 + i % 5),
                rejected: tok(9 + i % 7),
            })
            .collect::<Vec<_>>()
    };
    let random_models = |json: &str, seed: u64| -> Result<(Model, Model)> {
        let spec = ModelSpec::from_config_json(json)?;
        Ok((
            random_model(&spec, seed, &Device::Cpu)?,
            random_model(&spec, seed, device)?,
        ))
    };

    let (cpu, gpu) = random_models(
        r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":256,"intermediate_size":512,"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":2048,"tie_word_embeddings":true}"#,
        11,
    )?;
    let pairs = random_pairs(20, 2048, 40);
    let case = TrajectoryCase {
        name: "Qwen2-shaped random model, 4 layers",
        cpu: &cpu,
        gpu: &gpu,
        pairs: &pairs,
        steps: 20,
        lr: 5e-3,
        rank: 8,
        segment_size: 2,
        bound: 2e-2,
    };
    failed += !trajectory_parity(&case)? as usize;

    let (cpu, gpu) = random_models(SMOLLM2_GEOMETRY, 12)?;
    let pairs = random_pairs(10, 49152, 60);
    let case = TrajectoryCase {
        name: "SmolLM2-135M geometry, random weights, 30 layers",
        cpu: &cpu,
        gpu: &gpu,
        pairs: &pairs,
        steps: 10,
        lr: 1e-4,
        rank: 16,
        segment_size: 5,
        bound: 2e-2,
    };
    failed += !trajectory_parity(&case)? as usize;
    failed += !kept_plans_are_exact(&case)? as usize;

    let Some(path) = crate::model::smollm2::find() else {
        println!("train SmolLM2-135M-Instruct: SKIPPED (the GGUF is not cached; `lorafit demo` fetches it)");
        return Ok(failed);
    };
    let path = path.display().to_string();
    let cpu = crate::train::trainer::load_model_and_tokenizer(
        &path,
        &Device::Cpu,
        crate::model::BaseQuant::None,
    )?;
    let gpu = crate::train::trainer::load_model_and_tokenizer(
        &path,
        device,
        crate::model::BaseQuant::None,
    )?;
    let chatml = |role: &str, text: &str| format!("<|im_start|>{role}\n{text}<|im_end|>\n");
    let pairs = SMOLLM2_PAIRS
        .iter()
        .map(|(q, c, r)| -> Result<crate::data::TokenizedPair> {
            let prompt = format!("{}<|im_start|>assistant\n", chatml("user", q));
            let enc = |t: &str| cpu.tokenizer.encode(t);
            Ok(crate::data::TokenizedPair {
                prompt: enc(&prompt)?,
                chosen: enc(&format!("{c}<|im_end|>\n"))?,
                rejected: enc(&format!("{r}<|im_end|>\n"))?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let case = TrajectoryCase {
        name: "SmolLM2-135M-Instruct (Q4_1 GGUF)",
        cpu: &cpu.model,
        gpu: &gpu.model,
        pairs: &pairs,
        steps: 30,
        lr: 1e-4,
        rank: 16,
        segment_size: 5,
        bound: 2e-2,
    };
    failed += !trajectory_parity(&case)? as usize;
    Ok(failed)
}

#[cfg(test)]
mod tests {
    use super::next_token_ce_grad;

    #[test]
    fn ce_grad_matches_finite_differences() {
        let (ids, vocab) = ([2u32, 0, 4], 5);
        let logits: Vec<f32> = (0..15).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.3).collect();
        let loss = |l: &[f32]| -> f64 {
            let mut total = 0.0;
            for (r, row) in l.chunks(vocab).enumerate() {
                let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
                total -= (row[ids[(r + 1) % 3] as usize] as f64) - z.ln();
            }
            total / 3.0
        };
        let d = next_token_ce_grad(&logits, &ids, vocab);
        for i in 0..logits.len() {
            let (mut up, mut down) = (logits.clone(), logits.clone());
            up[i] += 1e-3;
            down[i] -= 1e-3;
            let fd = (loss(&up) - loss(&down)) / 2e-3;
            assert!(
                (fd - d[i] as f64).abs() < 1e-4,
                "logit {i}: fd {fd} analytic {}",
                d[i]
            );
        }
    }
}
