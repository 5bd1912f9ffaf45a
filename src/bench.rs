//! `lorafit bench`: ORPO training steps (forward, head, backward, optimiser) on a random-weight
//! model of a named shape, timed end to end, one JSON line per run.
//!
//! Model FLOPs per step, as defined here: every projection (attention, MLP, LM head over the rows
//! that have a target) costs 2·in·out FLOPs per token forward and the same again backward (dX
//! only: the base is frozen), LoRA adds its own small matmuls (forward, dX, dA, dB), and attention
//! costs 4·hd FLOPs per visible (query, key) pair and head forward and 10·hd backward (recompute
//! of scores, dP, dS·K, dSᵀ·Q, Pᵀ·dO). MFU divides by the bf16 dense GEMM rate measured on the same
//! device at start.

use crate::config::{HeadTier, TrainConfig};
use crate::model::weights::{load_weights, RandomSource};
use crate::model::{Lora, LoraConfig, Model, ModelSpec};
use crate::tensor::{self as ops, DType, Device, Tensor};
use crate::train::memory;
use crate::train::objectives::SftScope;
use crate::train::optim::{apply_update, AdamState, OptimOptions};
use crate::train::plan::Plan;
use crate::train::step::PassOptions;
use crate::train::step::{queue_example, Objective};
use crate::train::trainer::{pass_options_for, step_shape, step_shape_of};
use anyhow::{bail, ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// qwen0.5b, qwen1.5b, llama8b, llama70b, minicpm5-1b, gemma2-2b, gemma3-4b, gemma4-e4b, tiny,
    /// or a path to a config.json.
    #[arg(long, default_value = "qwen1.5b")]
    pub shape: String,
    /// Prompt tokens P.
    #[arg(long, default_value_t = 3584)]
    pub prompt_len: usize,
    /// Tokens of each response R.
    #[arg(long, default_value_t = 512)]
    pub resp_len: usize,
    /// Timed steps per workload.
    #[arg(long, default_value_t = 6)]
    pub steps: usize,
    /// Untimed steps first (GEMM tuning and first allocations fall in them).
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Segment size (0: keep all activations); unset: chosen from free memory.
    #[arg(long)]
    pub segment_size: Option<usize>,
    /// With segments, keep attention outputs from the forward (true / false; unset: when they
    /// fit the free memory). For the first workload; `--also` gives its own as field 5.
    #[arg(long)]
    pub keep_attention: Option<bool>,
    /// With segments, keep k and v of the lowest N layers from the forward (unset: as many as
    /// fit the free memory). For the first workload.
    #[arg(long)]
    pub keep_kv_layers: Option<usize>,
    /// Training: the seven projections of every layer as random blocks of this type kept
    /// quantized on the GPU and dequantized per use (`base_quant`; none, q8_0 or q4_0).
    #[arg(long, default_value = "none", value_parser = base_quant_parser())]
    pub base_quant: crate::model::BaseQuant,
    /// Keep the residual stream in bf16 instead of f32.
    #[arg(long)]
    pub residual_bf16: bool,
    /// MLP token chunk (0: all tokens at once; unset: all at once unless no such plan fits).
    #[arg(long)]
    pub mlp_chunk: Option<usize>,
    /// The most device memory the run may hold, in GiB (`TrainConfig::memory_limit`): the plan is
    /// the fastest whose estimate fits under it.
    #[arg(long, allow_negative_numbers = true)]
    pub memory_limit: Option<f64>,

    /// Offloaded plans: keep the boundaries and kept tensors of the top N layers on the device
    /// instead of the planner's choice (as many as fit), to measure what resident layers save
    #[arg(long)]
    pub resident_layers: Option<usize>,

    /// Segmented plans on the device: keep every activation of the N layers below the top
    /// instead of the planner's choice (as many as fit), to measure what they save
    #[arg(long)]
    pub full_layers: Option<usize>,

    /// Print the plan the planner would choose for the first workload on a GPU of `--gpu-gib`
    /// GiB, with its estimated device and host memory, and run nothing (no GPU needed; the
    /// model's own bytes estimated from its shape)
    #[arg(long)]
    pub plan_only: bool,

    /// With --plan-only: the GPU's memory in GiB (an H100 80, an H200 141, a 4090 24)
    #[arg(long, allow_negative_numbers = true)]
    pub gpu_gib: Option<f64>,

    /// With --plan-only: host memory available for offload in GiB (unset: this machine's)
    #[arg(long, allow_negative_numbers = true)]
    pub host_gib: Option<f64>,
    /// With segments, hold the layer boundaries in pinned host memory (`TrainConfig::offload`:
    /// true, false; unset: when no plan fits the device otherwise). For every workload.
    #[arg(long)]
    pub offload: Option<bool>,
    /// The head tier (`TrainConfig::head`).
    #[arg(long, value_enum, default_value = "chunked")]
    pub head: HeadTier,
    /// Rows per head chunk (0: automatic, about 256 MiB of f32 logits).
    #[arg(long, default_value_t = 0)]
    pub head_chunk: usize,
    /// Share the prompt between chosen and rejected (one forward over [P; Rc; Rr]).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub prefix_shared: bool,
    /// cuda, cuda:N or cpu.
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// LoRA rank on the seven projections.
    #[arg(long, default_value_t = 16)]
    pub rank: usize,
    /// The bit-reproducible two-kernel attention backward (`TrainConfig::deterministic_attention`).
    #[arg(long)]
    pub deterministic_attention: bool,
    /// Time cuBLASLt's candidates per product shape (`TrainConfig::gemm_tuning`).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub gemm_tuning: bool,
    /// The fused head's coefficient filter (`TrainConfig::cce_filter_eps`; 0 keeps every term).
    #[arg(long, allow_negative_numbers = true, default_value_t = crate::tensor::cce::DEFAULT_FILTER_EPS)]
    pub cce_filter_eps: f32,
    /// Further workloads on the same loaded model, each
    /// `P,R[,SEG|auto[,MLP_CHUNK|auto[,KEEP_ATTENTION]]]`.
    #[arg(long)]
    pub also: Vec<String>,
    /// Pairs of mixed lengths instead of one fixed shape: `P_LO-P_HI,R_LO-R_HI` (uniform, each
    /// response drawn on its own; `200-600,100-400` is UltraFeedback-like). Reports pairs/s over
    /// the timed steps; with `--pack-tokens` each step is one pack of as many pairs as fit.
    #[arg(long)]
    pub mix: Option<String>,
    /// With `--mix`: pack consecutive pairs into one sequence of up to this many tokens
    /// (`TrainConfig::pack_tokens`; 0: one pair a step).
    #[arg(long, default_value_t = 0)]
    pub pack_tokens: usize,
    /// Decoding instead of training: tokens/s of generation with the KV cache (greedy, no stop
    /// token) at each `--batch` and `--base`, one JSON line each (`lorafit bench --decode
    /// --shape llama8b`).
    #[arg(long)]
    pub decode: bool,
    /// Decoding: prompt tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub decode_prompt_len: usize,
    /// Decoding: tokens generated per sequence.
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    /// Decoding: batch sizes (sequences decoded together).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 8])]
    pub batch: Vec<usize>,
    /// Decoding: base weights, `bf16`, `q4_0` and/or `q8_0` (the seven projections of every layer
    /// as random blocks, dequantized per use as for a GGUF base; embedding and head bf16).
    #[arg(long, value_delimiter = ',', default_values_t = ["bf16".to_string(), "q4_0".to_string()])]
    pub base: Vec<String>,
    /// Decoding: with a LoRA adapter of `--rank` on all seven projections (unmerged).
    #[arg(long)]
    pub with_adapter: bool,
}

/// `--base-quant`: the types a random base is drawn in (`random_weights`).
fn base_quant_parser() -> impl clap::builder::TypedValueParser<Value = crate::model::BaseQuant> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(["none", "q8_0", "q4_0"]).map(|s| {
        <crate::model::BaseQuant as clap::ValueEnum>::from_str(&s, false)
            .expect("each offered value is a BaseQuant")
    })
}

/// The anchor shapes (shared/anchors/torch_orpo_bench.py), as Hugging Face configs.
pub fn named_shape(name: &str) -> Result<ModelSpec> {
    let json = match name {
        // Llama-3-70B's shape.
        "llama70b" => r#"{"architectures":["LlamaForCausalLM"],"hidden_size":8192,"intermediate_size":28672,"num_hidden_layers":80,"num_attention_heads":64,"num_key_value_heads":8,"vocab_size":128256,"rope_theta":500000.0,"tie_word_embeddings":false,"rms_norm_eps":1e-5}"#.to_string(),
        "llama8b" => r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,"rope_theta":500000.0,"tie_word_embeddings":false,"rms_norm_eps":1e-5}"#.to_string(),
        "qwen1.5b" => r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":1536,"intermediate_size":8960,"num_hidden_layers":28,"num_attention_heads":12,"num_key_value_heads":2,"vocab_size":151936,"rope_theta":1000000.0,"tie_word_embeddings":true,"rms_norm_eps":1e-6}"#.to_string(),
        "qwen0.5b" => r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":896,"intermediate_size":4864,"num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,"vocab_size":151936,"rope_theta":1000000.0,"tie_word_embeddings":true,"rms_norm_eps":1e-6}"#.to_string(),
        "minicpm5-1b" => r#"{"architectures":["LlamaForCausalLM"],"hidden_size":1536,"intermediate_size":4608,"num_hidden_layers":24,"num_attention_heads":16,"num_key_value_heads":2,"head_dim":128,"vocab_size":130560,"rope_theta":1000000.0,"tie_word_embeddings":false,"rms_norm_eps":1e-5}"#.to_string(),
        "gemma2-2b" => r#"{"architectures":["Gemma2ForCausalLM"],"hidden_size":2304,"intermediate_size":9216,"num_hidden_layers":26,"num_attention_heads":8,"num_key_value_heads":4,"head_dim":256,"vocab_size":256000,"query_pre_attn_scalar":256,"attn_logit_softcapping":50.0,"final_logit_softcapping":30.0,"sliding_window":4096,"rope_theta":10000.0,"rms_norm_eps":1e-6,"tie_word_embeddings":true}"#.to_string(),
        "gemma3-4b" => r#"{"architectures":["Gemma3ForCausalLM"],"model_type":"gemma3_text","hidden_size":2560,"intermediate_size":10240,"num_hidden_layers":34,"num_attention_heads":8,"num_key_value_heads":4,"head_dim":256,"vocab_size":262208,"query_pre_attn_scalar":256,"sliding_window":1024,"sliding_window_pattern":6,"rope_theta":1000000.0,"rope_local_base_freq":10000.0,"rope_scaling":{"rope_type":"linear","factor":8.0},"rms_norm_eps":1e-6,"tie_word_embeddings":true}"#.to_string(),
        // The spec's e4b: Gemma 4 E4B's text model (42 layers, 5 sliding : 1 full, the last 18
        // sharing the k/v of layers 22 and 23, per-layer inputs of 256 over the full vocabulary).
        "gemma4-e4b" => r#"{"architectures":["Gemma4ForCausalLM"],"model_type":"gemma4_text","hidden_size":2560,"intermediate_size":10240,"num_hidden_layers":42,"num_attention_heads":8,"num_key_value_heads":2,"head_dim":256,"global_head_dim":512,"vocab_size":262144,"vocab_size_per_layer_input":262144,"hidden_size_per_layer_input":256,"num_kv_shared_layers":18,"sliding_window":512,"final_logit_softcapping":30.0,"rope_parameters":{"sliding_attention":{"rope_type":"default","rope_theta":10000.0},"full_attention":{"rope_type":"proportional","partial_rotary_factor":0.25,"rope_theta":1000000.0}},"rms_norm_eps":1e-6,"tie_word_embeddings":true}"#.to_string(),
        "tiny" => r#"{"architectures":["LlamaForCausalLM"],"hidden_size":128,"intermediate_size":256,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":512,"tie_word_embeddings":false}"#.to_string(),
        path => {
            // A model folder's shape is its config.json.
            let file = if Path::new(path).is_dir() {
                Path::new(path).join("config.json")
            } else {
                PathBuf::from(path)
            };
            let json = std::fs::read_to_string(&file).with_context(|| format!("shape {path:?} is not a known name (qwen0.5b, qwen1.5b, llama8b, llama70b, minicpm5-1b, gemma2-2b, gemma3-4b, gemma4-e4b, tiny) nor a readable config.json"))?;
            let spec = ModelSpec::from_config_json(&json)
                .with_context(|| format!("--shape {}", file.display()))?;
            return Ok(spec);
        }
    };
    ModelSpec::from_config_json(&json)
}

/// Model FLOPs of one ORPO step (see the module doc), layer by layer from the spec's layer
/// descriptions (each layer's MLP width and sliding window).
pub fn step_flops(spec: &ModelSpec, plan: &Plan, rank: usize, head_rows: usize) -> f64 {
    let h = spec.hidden as f64;
    let p = spec.per_layer_input as f64;
    let r = rank as f64;
    let mut total = 0.0;
    for s in &plan.seqs {
        let t = s.ids.len() as f64;
        // Visible (query, key) pairs per distinct window.
        let mut visible: Vec<(Option<u32>, f64)> = Vec::new();
        for (l, ls) in spec.layers.iter().enumerate() {
            let i = ls.intermediate as f64;
            let q = spec.q_dim_of(l) as f64;
            // A KV-sharing layer projects no k and v.
            let kv = if ls.owns_kv() {
                spec.kv_dim_of(l) as f64
            } else {
                0.0
            };
            // Gemma 4's per-layer input branch: gate (H→P) and projection (P→H).
            let per_layer = 2.0 * h * p;
            let per_tok_linear = 2.0 * (h * (q + 2.0 * kv) + q * h + 3.0 * h * i + per_layer);
            let kv_lora = if kv > 0.0 { (h + kv) * 2.0 } else { 0.0 };
            let lora_in_out = (h + q) + kv_lora + (q + h) + (h + i) * 2.0 + (i + h);
            let per_tok_lora = 2.0 * r * lora_in_out;
            let pairs = match visible.iter().find(|(w, _)| *w == ls.window) {
                Some((_, v)) => *v,
                None => {
                    let mask = s.mask.clone().with_window(ls.window);
                    let v: f64 = (0..mask.len())
                        .map(|qi| mask.visible_count(qi) as f64)
                        .sum();
                    visible.push((ls.window, v));
                    v
                }
            };
            let attn = pairs * spec.n_heads as f64 * ls.head_dim as f64 * (4.0 + 10.0);
            total += t * (2.0 * per_tok_linear + 4.0 * per_tok_lora) + attn;
        }
    }
    total + 4.0 * head_rows as f64 * h * spec.vocab as f64
}

/// Dense bf16 GEMM rate of the device in FLOP/s (8192³, median of 5).
pub fn measure_gemm_peak(device: &Device) -> Result<f64> {
    let n = if device.is_cuda() { 8192 } else { 512 };
    let dt = device.compute_dtype();
    let a = Tensor::from_f32(
        &crate::model::weights::random_normal(n * n, 1, 1.0),
        &[n, n],
        dt,
        device,
    )?;
    let b = Tensor::from_f32(
        &crate::model::weights::random_normal(n * n, 2, 1.0),
        &[n, n],
        dt,
        device,
    )?;
    let mut times = Vec::new();
    for _ in 0..6 {
        device.synchronize()?;
        let t = Instant::now();
        let c = ops::matmul(&a, false, &b, true, 1.0, dt)?;
        device.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
        drop(c);
    }
    times.remove(0);
    times.sort_by(|x, y| x.partial_cmp(y).unwrap());
    Ok(2.0 * (n as f64).powi(3) / times[times.len() / 2])
}

pub fn run(a: BenchArgs) -> Result<()> {
    ensure!(
        a.steps > 0 || a.plan_only || a.decode,
        "--steps 0: nothing would be timed; give at least 1 (the warm-up steps are not timed)"
    );
    check_numbers(&a)?;
    if a.decode {
        return run_decode(&a);
    }
    if a.plan_only {
        return plan_only(&a);
    }
    // The shape first: a misspelt name is said as such, also where no GPU is found.
    let spec = named_shape(&a.shape)?;
    let device = Device::parse(&a.device)?;
    let mut workloads = vec![first_workload(&a)];
    for spec_str in &a.also {
        workloads.push(Workload::parse(spec_str)?);
    }
    // Every workload's lengths before the model loads, as each names its flag.
    for (i, w) in workloads.iter().enumerate() {
        let what = |field: &str, flag: &str| match i {
            0 => flag.to_string(),
            _ => format!("--also {:?} ({field})", a.also[i - 1]),
        };
        w.check(
            &what("field 1, P", "--prompt-len"),
            &what("field 2, R", "--resp-len"),
            a.prefix_shared,
        )?;
    }
    check_model_fits(
        &a.shape,
        &spec,
        a.base_quant,
        a.rank,
        &device,
        a.memory_limit,
    )?;
    let base = base_config(&a);
    device.set_numerics(base.deterministic_attention, base.gemm_tuning)?;
    crate::train::head::set_filter_eps(base.cce_filter_eps);
    let t_load = Instant::now();
    let weights = random_weights(&spec, a.base_quant, &device)?;
    let mut model = Model::new(spec.clone(), weights, device.clone());
    if a.residual_bf16 {
        model.residual_dtype = DType::BF16;
    }
    eprintln!(
        "random {} weights ({} base) on {} in {:.1}s",
        a.shape,
        a.base_quant.name(),
        device.name(),
        t_load.elapsed().as_secs_f64()
    );
    let mut lora = Lora::new(
        &spec,
        LoraConfig {
            rank: a.rank,
            alpha: 2.0 * a.rank as f64,
            ..Default::default()
        },
        &device,
    )?;
    let mut adam = AdamState::new(&lora)?;
    let optim = OptimOptions::default();
    let peak_flops = measure_gemm_peak(&device)?;
    if let Some(mix) = &a.mix {
        let cfg = TrainConfig {
            pack_tokens: a.pack_tokens,
            ..workload_config(&a, &first_workload(&a), &base)
        };
        let mut trainee = Trainee {
            model: &model,
            lora: &mut lora,
            adam: &mut adam,
            optim: &optim,
        };
        return run_mix(&a, &cfg, &mut trainee, mix, peak_flops);
    }

    for w in &workloads {
        let mut rng = crate::tensor::Rng(1);
        let mut tok = |n: usize| -> Vec<u32> {
            (0..n)
                .map(|_| 3 + (rng.next_u64() % (spec.vocab as u64 - 3)) as u32)
                .collect()
        };
        let tokens_in_pass = w.pass_tokens(a.prefix_shared);
        let cfg = workload_config(&a, w, &base);
        let budget = memory::budget(&device, cfg.memory_limit)?;
        // The allocator refuses what would pass the limit (the trainer then retries on a smaller
        // plan; here the row fails and says so).
        device.set_memory_limit(cfg.memory_limit);
        let shape = step_shape(&cfg, &model, tokens_in_pass);
        let opts = plan_pass(&a, &cfg, shape, budget);
        note_plan_flags(&a, &opts);
        // A workload whose plan does not fit is refused, as the trainer refuses it, with one
        // RESULT line that says why.
        let estimate = crate::train::trainer::pass_estimate(&model, tokens_in_pass, &opts);
        if estimate.total() > budget {
            let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
            let reason = refusal(
                &cfg,
                shape,
                &opts,
                &estimate,
                budget,
                device.memory().live_bytes,
            );
            eprintln!("refused: {reason}");
            let line = serde_json::json!({
                "tool": "lorafit", "shape": a.shape, "P": w.prompt_len, "R": w.resp_len,
                "device": device.name(), "memory_limit_gib": a.memory_limit,
                "base_quant": a.base_quant.name(), "refused": reason,
                "predicted_peak_gib": gib(device.memory().live_bytes + estimate.total()),
            });
            println!("RESULT {line}");
            continue;
        }
        let objective = Objective::Orpo {
            lambda: 0.1,
            scope: SftScope::Full,
        };
        let mut times = Vec::new();
        let mut host_times = Vec::new();
        let mut busy = Vec::new();
        let mut launches = 0;
        // Bytes held before the first timed step (weights, adapter, gradients, optimiser state):
        // the prediction is these plus the plan's estimate.
        let mut live_before = 0;
        let mut flops = 0.0;
        let mut tokens = 0;
        for step in 0..a.warmup + a.steps {
            let pair = crate::data::TokenizedPair {
                prompt: tok(w.prompt_len),
                chosen: tok(w.resp_len),
                rejected: tok(w.resp_len),
            };
            let plan = Plan::pair(&pair, a.prefix_shared)?;
            if step == a.warmup {
                device.synchronize()?;
                device.reset_peak();
                live_before = device.memory().live_bytes;
            }
            device.synchronize()?;
            if step == a.warmup {
                // The profile counts the timed steps only: tuning and first allocations fall in
                // the warm-up.
                if let crate::tensor::Device::Cuda(c) = &device {
                    c.profile_reset();
                }
            }
            let launches0 = launch_count(&device);
            let t = Instant::now();
            let queued =
                queue_example(&model, &mut lora, &plan, &objective, None, &opts, true, 1.0)?;
            let norm = apply_update(&mut lora, &mut adam, 1e-5, step as u64 + 1, 1.0, &optim)?;
            // The whole step is queued without waiting on the device. The host stops early
            // only when it is not the bottleneck (a full launch queue also holds it back).
            let queued_s = t.elapsed().as_secs_f64();
            device.synchronize()?;
            let dt = t.elapsed().as_secs_f64();
            launches = launch_count(&device) - launches0;
            // LORAFIT_PROFILE=timeline: how much of the step's device span kernels were running.
            if let crate::tensor::Device::Cuda(c) = &device {
                if let Some(tl) = c.take_timeline()? {
                    let host: Vec<String> = tl
                        .host_ms
                        .iter()
                        .map(|(n, ms)| format!("{n} {ms:.1}"))
                        .collect();
                    eprintln!(
                        "step {step}: device busy {:.1} of {:.1} ms ({:.2}%) over {} launches; host ms in calls: {}",
                        tl.busy_ms,
                        tl.span_ms,
                        100.0 * tl.busy_ms / tl.span_ms.max(1e-9),
                        tl.launches,
                        host.join(", ")
                    );
                    if step >= a.warmup {
                        busy.push(tl.busy_ms / tl.span_ms.max(1e-9));
                    }
                }
            }
            let out = queued.finish()?;
            ensure!(
                out.loss.is_finite() && norm.get()?.is_finite(),
                "step {step}: loss {} is not finite",
                out.loss
            );
            if step >= a.warmup {
                times.push(dt);
                host_times.push(queued_s);
            }
            let head_rows = plan.chosen.prompt.rows.len() + 2 * w.resp_len;
            flops = step_flops(&spec, &plan, a.rank, head_rows);
            tokens = 2 * (w.prompt_len + w.resp_len);
            eprintln!("step {step}: {dt:.3}s (queued by the host in {queued_s:.3}s)");
        }
        times.sort_by(|x, y| x.partial_cmp(y).unwrap());
        let med = times[times.len() / 2];
        host_times.sort_by(|x, y| x.partial_cmp(y).unwrap());
        let host_med = host_times[host_times.len() / 2];
        let mem = device.memory();
        let predicted =
            live_before + crate::train::trainer::pass_estimate_bytes(&model, tokens_in_pass, &opts);
        // Host bytes the plan's offloaded tensors take by the estimate, beside `pinned_gib` (the
        // pool's buffers, each up to an eighth larger).
        let predicted_host = memory::host_bytes(
            crate::train::trainer::step_shape(&cfg, &model, tokens_in_pass),
            &crate::train::trainer::keep_plan(&opts),
        );
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let line = serde_json::json!({
            "tool": "lorafit", "shape": a.shape, "P": w.prompt_len, "R": w.resp_len, "device": device.name(), "predicted_host_gib": gib(predicted_host),
            "segment_size": opts.segment_size, "segment_auto": w.segment_size.is_none(), "keep_attention": opts.keep_attention, "keep_kv_layers": opts.keep_kv_layers, "kv_layers_kept": model.kv_layers_kept(opts.keep_kv_layers), "mlp_chunk": opts.mlp_chunk, "mlp_chunk_auto": w.mlp_chunk.is_none(), "offload": opts.offload, "nested": opts.nested, "resident_layers": opts.resident_layers, "full_layers": opts.full_layers, "pinned_gib": gib(pinned_bytes(&device)), "memory_limit_gib": a.memory_limit, "base_quant": a.base_quant.name(), "head": format!("{:?}", a.head).to_lowercase(), "prefix_shared": a.prefix_shared,
            "s_per_step": med, "host_queue_s": host_med, "launches_per_step": launches,
            "device_busy": (!busy.is_empty()).then(|| busy.iter().sum::<f64>() / busy.len() as f64), "pairs_per_s": 1.0 / med, "tokens_per_s": tokens as f64 / med,
            "model_tflops_per_step": flops / 1e12, "gemm_peak_tflops": peak_flops / 1e12, "mfu": flops / med / peak_flops,
            "peak_gib": gib(mem.peak_bytes), "predicted_peak_gib": gib(predicted), "live_before_gib": gib(live_before), "steps": a.steps,
            "estimate_terms_gib": terms_json(&estimate),
        });
        println!("RESULT {line}");
    }
    if let crate::tensor::Device::Cuda(c) = &device {
        if let Some(r) = c.profile_report() {
            eprint!("{r}");
        }
    }
    Ok(())
}

/// Kernel launches and library calls so far (0 on the CPU).
fn launch_count(device: &crate::tensor::Device) -> u64 {
    match device {
        crate::tensor::Device::Cuda(c) => c.launches(),
        crate::tensor::Device::Cpu => 0,
    }
}

/// One benchmark workload: prompt and response lengths, segment size (None: automatic) and MLP
/// token chunk.
struct Workload {
    prompt_len: usize,
    resp_len: usize,
    segment_size: Option<usize>,
    /// None: all tokens at once unless no such plan fits.
    mlp_chunk: Option<usize>,
    /// Keep attention outputs (None: `--keep-attention`, else when they fit).
    keep_attention: Option<bool>,
    /// Layers whose k and v are kept (None: as many as fit).
    keep_kv_layers: Option<usize>,
}

impl Workload {
    /// Tokens the step runs through the model, as the trainer plans them (`Plan::tokens`).
    fn pass_tokens(&self, prefix_shared: bool) -> usize {
        if prefix_shared {
            self.prompt_len + 2 * self.resp_len
        } else {
            2 * (self.prompt_len + self.resp_len)
        }
    }

    /// Refuses an empty prompt or response and a pass too long for the planner's arithmetic
    /// (`memory::MAX_PASS_TOKENS`), naming the flag or field each length came from.
    fn check(&self, prompt: &str, resp: &str, prefix_shared: bool) -> Result<()> {
        let max = memory::MAX_PASS_TOKENS;
        for (what, n) in [(prompt, self.prompt_len), (resp, self.resp_len)] {
            ensure!(
                n > 0,
                "{what} = 0: a preference pair needs at least 1 token of prompt and of each \
                 response"
            );
            ensure!(n <= max, "{what} = {n}: expected at most {max} tokens");
        }
        let tokens = self.pass_tokens(prefix_shared);
        ensure!(
            tokens <= max,
            "{prompt} = {} and {resp} = {}: {tokens} tokens in one pass, expected at most {max}",
            self.prompt_len,
            self.resp_len
        );
        Ok(())
    }

    /// `P,R[,SEG|auto[,MLP_CHUNK|auto[,KEEP_ATTENTION]]]`.
    fn parse(s: &str) -> Result<Workload> {
        let f: Vec<&str> = s.split(',').map(str::trim).collect();
        let num = |i: usize| -> Result<usize> {
            f[i].parse()
                .with_context(|| format!("--also {s:?}: field {} is not a number", i + 1))
        };
        anyhow::ensure!(
            (2..=5).contains(&f.len()),
            "--also {s:?}: expected P,R[,SEG|auto[,MLP_CHUNK|auto[,KEEP_ATTENTION]]]"
        );
        Ok(Workload {
            prompt_len: num(0)?,
            resp_len: num(1)?,
            segment_size: match f.get(2) {
                None | Some(&"auto") => None,
                Some(_) => Some(num(2)?),
            },
            mlp_chunk: match f.get(3) {
                None | Some(&"auto") => None,
                Some(_) => Some(num(3)?),
            },
            keep_attention: match f.get(4) {
                None => None,
                Some(k) => Some(k.parse().with_context(|| {
                    format!("--also {s:?}: field 5 (keep attention) is not true or false")
                })?),
            },
            keep_kv_layers: None,
        })
    }
}

/// What a training benchmark steps: the model, its adapter and optimiser.
struct Trainee<'a> {
    model: &'a Model,
    lora: &'a mut Lora,
    adam: &'a mut AdamState,
    optim: &'a OptimOptions,
}

/// `lo-hi` as an inclusive range.
fn parse_range(s: &str, what: &str) -> Result<(usize, usize)> {
    let (lo, hi) = s
        .split_once('-')
        .with_context(|| format!("--mix: {what} {s:?} is not LO-HI"))?;
    let (lo, hi): (usize, usize) = (
        lo.trim()
            .parse()
            .with_context(|| format!("--mix: {what} {s:?}"))?,
        hi.trim()
            .parse()
            .with_context(|| format!("--mix: {what} {s:?}"))?,
    );
    ensure!(
        1 <= lo && lo <= hi,
        "--mix: {what} {s:?} (expected 1 <= LO <= HI)"
    );
    Ok((lo, hi))
}

/// `--mix`: ORPO steps over a stream of pairs of random lengths, one pair a step or, with
/// `--pack-tokens`, one pack a step; one RESULT line with pairs/s and tokens/s over the timed
/// steps, the largest pass's plan and the peak.
fn run_mix(
    a: &BenchArgs,
    cfg: &TrainConfig,
    t: &mut Trainee,
    mix: &str,
    peak_flops: f64,
) -> Result<()> {
    let (p_range, r_range) = mix
        .split_once(',')
        .with_context(|| format!("--mix {mix:?}: expected P_LO-P_HI,R_LO-R_HI"))?;
    let (p_range, r_range) = (parse_range(p_range, "P")?, parse_range(r_range, "R")?);
    ensure!(
        a.prefix_shared || a.pack_tokens == 0,
        "--pack-tokens needs --prefix-shared true"
    );
    let model = t.model;
    let device = &model.device;
    let vocab = model.spec.vocab as u64;
    let mut rng = crate::tensor::Rng(1);
    let mut draw = |(lo, hi): (usize, usize)| lo + (rng.next_u64() % (hi - lo + 1) as u64) as usize;
    let mut ids_rng = crate::tensor::Rng(2);
    let mut tok = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| 3 + (ids_rng.next_u64() % (vocab - 3)) as u32)
            .collect()
    };
    let mut next_pair = || crate::data::TokenizedPair {
        prompt: tok(draw(p_range)),
        chosen: tok(draw(r_range)),
        rejected: tok(draw(r_range)),
    };
    let objective = Objective::Orpo {
        lambda: 0.1,
        scope: SftScope::Full,
    };
    let budget = memory::budget(device, cfg.memory_limit)?;
    let mut waiting = next_pair();
    let (mut pairs, mut tokens, mut seconds, mut flops) = (0usize, 0usize, 0.0, 0.0);
    let mut widest: Option<(usize, crate::train::step::PassOptions)> = None;
    for step in 0..a.warmup + a.steps {
        // This step's pairs: one, or as many as fit the pack (the first always runs).
        let mut plans = vec![Plan::pair(&waiting, a.prefix_shared)?];
        waiting = next_pair();
        let mut pass_tokens = plans[0].tokens();
        if a.pack_tokens > 0 {
            loop {
                let next = Plan::pair(&waiting, true)?;
                if pass_tokens + next.tokens() > a.pack_tokens {
                    break;
                }
                pass_tokens += next.tokens();
                plans.push(next);
                waiting = next_pair();
            }
        }
        let opts = plan_pass(a, cfg, step_shape(cfg, model, pass_tokens), budget);
        if step == a.warmup {
            device.synchronize()?;
            device.reset_peak();
        }
        device.synchronize()?;
        let t0 = Instant::now();
        let queued = if a.pack_tokens > 0 {
            let members: Vec<crate::train::step::PackMember> = plans
                .iter()
                .map(|plan| crate::train::step::PackMember {
                    plan,
                    reference: None,
                    scale: Default::default(),
                })
                .collect();
            crate::train::step::queue_packed(model, t.lora, &members, &objective, &opts, true, 1.0)?
        } else {
            vec![queue_example(
                model, t.lora, &plans[0], &objective, None, &opts, true, 1.0,
            )?]
        };
        let norm = apply_update(t.lora, t.adam, 1e-5, step as u64 + 1, 1.0, t.optim)?;
        device.synchronize()?;
        let dt = t0.elapsed().as_secs_f64();
        for q in queued {
            let out = q.finish()?;
            ensure!(
                out.loss.is_finite(),
                "step {step}: loss {} is not finite",
                out.loss
            );
        }
        ensure!(
            norm.get()?.is_finite(),
            "step {step}: the gradient norm is not finite"
        );
        eprintln!(
            "step {step}: {} pairs, {pass_tokens} tokens, {dt:.3}s",
            plans.len()
        );
        if step >= a.warmup {
            pairs += plans.len();
            tokens += pass_tokens;
            seconds += dt;
            flops += plans
                .iter()
                .map(|p| {
                    let rejected = p.rejected.as_ref().map_or(0, |b| b.response.rows.len());
                    let head_rows =
                        p.chosen.prompt.rows.len() + p.chosen.response.rows.len() + rejected;
                    step_flops(&model.spec, p, a.rank, head_rows)
                })
                .sum::<f64>();
            if widest.is_none_or(|(w, _)| pass_tokens > w) {
                widest = Some((pass_tokens, opts));
            }
        }
    }
    let (widest_tokens, opts) = widest.context("--steps 0: nothing timed")?;
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let line = serde_json::json!({
        "tool": "lorafit", "shape": a.shape, "mix": mix, "pack_tokens": a.pack_tokens,
        "device": device.name(), "prefix_shared": a.prefix_shared, "steps": a.steps,
        "pairs": pairs, "tokens": tokens, "seconds": seconds,
        "pairs_per_s": pairs as f64 / seconds, "tokens_per_s": tokens as f64 / seconds,
        "mfu": flops / seconds / peak_flops, "widest_pass_tokens": widest_tokens,
        "plan": memory::describe_plan(&crate::train::trainer::keep_plan(&opts)),
        "peak_gib": gib(device.memory().peak_bytes), "memory_limit_gib": a.memory_limit,
    });
    println!("RESULT {line}");
    Ok(())
}

/// Pinned host memory the offload lane holds (0 on the CPU).
fn pinned_bytes(device: &crate::tensor::Device) -> usize {
    match device {
        crate::tensor::Device::Cuda(c) => c.pinned_bytes(),
        crate::tensor::Device::Cpu => 0,
    }
}

/// The training knobs the benchmark shares with `lorafit train`, as a `TrainConfig`, so that
/// each workload's pass options are resolved exactly as the trainer resolves them.
/// Refuses the numbers a run would take silently wrong, as `TrainConfig::validate` refuses
/// the settings they stand for.
fn check_numbers(a: &BenchArgs) -> Result<()> {
    let eps = a.cce_filter_eps;
    ensure!(
        eps.is_finite() && (0.0..1.0).contains(&eps),
        "--cce-filter-eps {eps}: expected a number in [0, 1) (a coefficient |onehot - softmax| \
         is below 1, so 1 or more drops every term and every gradient is 0)"
    );
    if let Some(g) = a.memory_limit {
        ensure!(
            g.is_finite() && g > 0.0,
            "--memory-limit {g}: expected a number of GiB in (0, inf)"
        );
    }
    if let Some(g) = a.host_gib {
        ensure!(
            g.is_finite() && g >= 0.0,
            "--host-gib {g}: expected a number of GiB in [0, inf)"
        );
    }
    if let Some(g) = a.gpu_gib {
        ensure!(
            g.is_finite() && g > 0.0,
            "--gpu-gib {g}: expected a number of GiB in (0, inf)"
        );
    }
    Ok(())
}

/// Refuses a model whose own bytes (`memory::model_bytes`; on the CPU in f32, twice its
/// bf16 bytes) are more than the device has free, or than `--memory-limit`, before its weights
/// are drawn: an allocation that large aborts the process.
fn check_model_fits(
    shape: &str,
    spec: &ModelSpec,
    quant: crate::model::BaseQuant,
    rank: usize,
    device: &Device,
    memory_limit: Option<f64>,
) -> Result<()> {
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    let held = memory::model_bytes(spec, quant, rank);
    let (need, free, what) = match device {
        Device::Cpu => (
            held.saturating_mul(2),
            memory::host_available(),
            "host memory available",
        ),
        Device::Cuda(c) => (held, Some(c.mem_info()?.0), "free device memory"),
    };
    if let Some(free) = free.filter(|&f| need > f) {
        bail!(
            "--shape {shape}: the model needs about {:.2} GiB and {:.2} GiB of {what} are left \
             on {}",
            gib(need),
            gib(free),
            device.name()
        );
    }
    if let Some(g) = memory_limit.filter(|&g| (need as f64) > g * (1u64 << 30) as f64) {
        bail!(
            "--memory-limit {g}: the model alone needs about {:.2} GiB, more than the limit",
            gib(need)
        );
    }
    Ok(())
}

fn base_config(a: &BenchArgs) -> TrainConfig {
    TrainConfig {
        head: a.head,
        head_chunk: a.head_chunk,
        deterministic_attention: a.deterministic_attention,
        gemm_tuning: a.gemm_tuning,
        cce_filter_eps: a.cce_filter_eps,
        ..Default::default()
    }
}

/// The workload of the command line's own flags (`--also` adds more).
fn first_workload(a: &BenchArgs) -> Workload {
    Workload {
        prompt_len: a.prompt_len,
        resp_len: a.resp_len,
        segment_size: a.segment_size,
        mlp_chunk: a.mlp_chunk,
        keep_attention: a.keep_attention,
        keep_kv_layers: a.keep_kv_layers,
    }
}

/// `base` with workload `w`'s plan choices and the run's memory limit and offload.
fn workload_config(a: &BenchArgs, w: &Workload, base: &TrainConfig) -> TrainConfig {
    TrainConfig {
        segment_size: w.segment_size,
        keep_attention: w.keep_attention,
        keep_kv_layers: w.keep_kv_layers,
        mlp_chunk: w.mlp_chunk,
        memory_limit: a.memory_limit,
        offload: a.offload,
        ..base.clone()
    }
}

/// The pass options the trainer would choose for `shape` under `budget`, with an offloaded
/// plan's resident layers as `--resident-layers` sets them and a segmented plan's full layers
/// as `--full-layers` does.
fn plan_pass(
    a: &BenchArgs,
    cfg: &TrainConfig,
    shape: memory::StepShape,
    budget: usize,
) -> PassOptions {
    let mut opts = pass_options_for(cfg, shape, budget, None);
    let layers = shape.spec.n_layers;
    if let (Some(r), true) = (a.resident_layers, opts.offload) {
        opts.resident_layers = r.min(layers);
    }
    if let (Some(f), true) = (a.full_layers, opts.segment_size > 0) {
        // The top layer always keeps its activations: at most the layers below it.
        opts.full_layers = f.min(layers - 1);
    }
    opts
}

/// What `--resident-layers` and `--full-layers` did to a workload's plan, where that is
/// not what they asked: said on stderr, so that a row is not read as a plan it did not run.
fn note_plan_flags(a: &BenchArgs, opts: &PassOptions) {
    match a.resident_layers {
        Some(_) if !opts.offload => eprintln!(
            "--resident-layers has no effect: the plan holds its layer boundaries on the device \
             (it is not offloaded)"
        ),
        Some(r) if r > opts.resident_layers => eprintln!(
            "--resident-layers {r}: the model has {} layers, all resident",
            opts.resident_layers
        ),
        _ => {}
    }
    match a.full_layers {
        Some(_) if opts.segment_size == 0 => eprintln!(
            "--full-layers has no effect: the plan keeps every activation (no segments; \
             --segment-size sets them)"
        ),
        Some(f) if f > opts.full_layers => eprintln!(
            "--full-layers {f}: the model has {} layers, and all {} below the top one keep \
             their activations",
            opts.full_layers + 1,
            opts.full_layers
        ),
        _ => {}
    }
}

/// Why a pass whose plan does not fit is refused: the plan, its estimate against the budget,
/// the largest terms and the longest pass that would fit.
fn refusal(
    cfg: &TrainConfig,
    shape: memory::StepShape,
    opts: &PassOptions,
    estimate: &memory::Estimate,
    budget: usize,
    held: usize,
) -> String {
    if let Some(m) = memory::model_over_limit(held, cfg.memory_limit) {
        return m;
    }
    format!(
        "{} tokens in one pass: the plan ({}) needs an estimated {} of activations and {} are \
         left for them; largest terms: {}; the longest pass that fits is about {} tokens",
        shape.tokens,
        memory::describe_plan(&crate::train::trainer::keep_plan(opts)),
        memory::size_text(estimate.total()),
        memory::size_text(budget),
        estimate.largest(3),
        memory::longest_that_fits(shape, cfg.mlp_chunk, cfg.offload, budget)
    )
}

// ------------------------------------------------------------------------------------------------
// The plan alone (`--plan-only`)

/// Device memory the CUDA context and libraries hold outside the allocator's count (what
/// `mem_info` reports as used on an idle H200 once the context is up).
const CONTEXT_BYTES: usize = 1 << 29;

/// `--plan-only`: the planner's choice for the first workload on a GPU of `--gpu-gib` GiB, as
/// `lorafit bench` would make it there, without a device: the model's own bytes from its shape
/// (`memory::model_bytes`), the activation budget as `memory::budget` computes it from the free
/// memory left (or `--memory-limit`), the host budget from `--host-gib` or this machine. One
/// JSON line: the plan, the estimated peak (model plus activations), the host bytes, the largest
/// terms; `refused` when no plan fits, with the longest pass that would.
fn plan_only(a: &BenchArgs) -> Result<()> {
    println!("RESULT {}", plan_only_line(a)?);
    Ok(())
}

/// `plan_only`'s JSON line.
fn plan_only_line(a: &BenchArgs) -> Result<serde_json::Value> {
    let gib = (1u64 << 30) as f64;
    let gpu = a
        .gpu_gib
        .context("--plan-only needs --gpu-gib, the GPU's memory in GiB")?;
    ensure!(gpu > 0.0, "--gpu-gib must be positive, not {gpu}");
    let spec = named_shape(&a.shape)?;
    let held = memory::model_bytes(&spec, a.base_quant, a.rank);
    let free = ((gpu * gib) as usize).saturating_sub(held + CONTEXT_BYTES);
    let free = free.saturating_sub(memory::free_margin(free));
    // As `memory::budget` on a device: a limit is held to what the card has free.
    let budget = match a.memory_limit {
        Some(g) => memory::gpu_budget_under_limit(g, held, free),
        None => free,
    };
    let host_budget = match (a.offload, a.host_gib) {
        (Some(false), _) => 0,
        (_, Some(h)) => memory::host_budget_of((h * gib) as usize),
        (_, None) => memory::host_budget_of(memory::host_available().unwrap_or(0)),
    };
    let workload = first_workload(a);
    workload.check("--prompt-len", "--resp-len", a.prefix_shared)?;
    let tokens = workload.pass_tokens(a.prefix_shared);
    let cfg = workload_config(a, &workload, &base_config(a));
    // Computing in bf16, as on every CUDA device.
    let mut shape = step_shape_of(&cfg, &spec, 2, tokens, host_budget);
    if a.base_quant.kind().is_some() {
        shape.dequantized = memory::largest_projection(&spec) * 2;
    }
    let opts = plan_pass(a, &cfg, shape, budget);
    note_plan_flags(a, &opts);
    let plan = crate::train::trainer::keep_plan(&opts);
    let estimate = memory::estimate(shape, &plan);
    let g = |b: usize| (b as f64 / gib * 100.0).round() / 100.0;
    let mut line = serde_json::json!({
        "tool": "lorafit", "plan_only": true, "shape": a.shape, "P": a.prompt_len,
        "R": a.resp_len, "tokens_in_pass": tokens, "gpu_gib": gpu, "base_quant": a.base_quant.name(),
        "memory_limit_gib": a.memory_limit, "model_gib": g(held),
        "activation_budget_gib": g(budget), "host_budget_gib": g(host_budget),
        "plan": memory::describe_plan(&plan),
        "predicted_peak_gib": g(held + estimate.total()),
        "predicted_host_gib": g(memory::host_bytes(shape, &plan)),
        "largest_terms": estimate.largest(3),
        "estimate_terms_gib": terms_json(&estimate),
    });
    if estimate.total() > budget {
        line["refused"] = serde_json::json!(refusal(&cfg, shape, &opts, &estimate, budget, held));
    }
    Ok(line)
}

/// The estimate's nonzero terms in GiB (three decimals), by name: what a measured peak is
/// compared with term by term.
fn terms_json(estimate: &memory::Estimate) -> serde_json::Value {
    let gib = |b: usize| (b as f64 / (1u64 << 30) as f64 * 1000.0).round() / 1000.0;
    estimate
        .terms
        .iter()
        .filter(|(_, b)| *b > 0)
        .map(|(name, b)| (name.to_string(), serde_json::json!(gib(*b))))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

// ------------------------------------------------------------------------------------------------
// Decoding (`--decode`)

/// Random weights of `spec`: dense, or with the seven projections of every layer as random
/// blocks of `quant` kept quantized on the GPU (`RandomQuantSource`).
fn random_weights(
    spec: &ModelSpec,
    quant: crate::model::BaseQuant,
    device: &Device,
) -> Result<crate::model::weights::ModelWeights> {
    use crate::model::BaseQuant;
    let dense = RandomSource {
        spec: spec.clone(),
        seed: 0,
    };
    let kind = match quant {
        BaseQuant::None => return load_weights(spec, &DrawnOnDevice(&dense), device),
        BaseQuant::Q4_0 => crate::tensor::cuda::QuantKind::Q4_0,
        BaseQuant::Q8_0 => crate::tensor::cuda::QuantKind::Q8_0,
        BaseQuant::Q4K | BaseQuant::Q4_1 => anyhow::bail!(
            "a random {} base is not offered (its scales and minimums are not uniform bytes): \
             use q4_0 or q8_0, or quantize a real model with base_quant",
            quant.name()
        ),
    };
    ensure!(
        device.is_cuda(),
        "a quantized random base is kept on a CUDA device; on the CPU use a dense one"
    );
    load_weights(spec, &RandomQuantSource { dense, kind }, device)
}

/// A random model (`RandomSource`) whose normal tensors are drawn on the GPU, the same draws as
/// the host's (`CudaBackend::random_normal`): an 8B model is ready in seconds, where drawing it
/// on the host and uploading it took most of a minute.
struct DrawnOnDevice<'a>(&'a RandomSource);

impl crate::model::weights::TensorSource for DrawnOnDevice<'_> {
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        self.0.get(name)
    }
    fn contains(&self, name: &str) -> bool {
        self.0.contains(name)
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn tensor(&self, name: &str, want: &[usize], device: &Device) -> Result<Tensor> {
        match (device, self.0.shape_of(name)) {
            (Device::Cuda(c), Some(shape)) if self.0.is_normal(name) => {
                ensure!(
                    shape == want,
                    "random model: tensor {name} has shape {shape:?}, but {want:?} was asked for"
                );
                c.random_normal(
                    &shape,
                    device.compute_dtype(),
                    self.0.normal_seed(name),
                    crate::model::weights::RANDOM_STD,
                )
            }
            _ => self.0.tensor(name, want, device),
        }
    }
}

/// A random model (`RandomSource`) whose seven projections per layer are random Q4_0 or Q8_0
/// blocks kept quantized on the GPU (scales set so the weights have the dense model's spread,
/// ~0.02), as a quantized base's would be; embedding, norms and head stay dense. The blocks are
/// written as random bytes, not quantized from normals: a 70B model's 68 billion projection
/// weights are ready in seconds.
struct RandomQuantSource {
    dense: RandomSource,
    kind: crate::tensor::cuda::QuantKind,
}

impl crate::model::weights::TensorSource for RandomQuantSource {
    fn get(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        self.dense.get(name)
    }
    fn contains(&self, name: &str) -> bool {
        self.dense.contains(name)
    }
    fn describe(&self) -> String {
        format!("random {:?} model", self.kind)
    }
    fn tensor(&self, name: &str, want: &[usize], device: &Device) -> Result<Tensor> {
        DrawnOnDevice(&self.dense).tensor(name, want, device)
    }
    fn weight(
        &self,
        name: &str,
        want: [usize; 2],
        device: &Device,
    ) -> Result<crate::model::weights::Weight> {
        use crate::model::weights::{QuantWeight, Weight};
        use crate::tensor::cuda::QuantKind;
        use rayon::prelude::*;
        let (block_values, block_bytes) = self.kind.block();
        let projection = crate::model::quantize_on_load::is_projection(name);
        let (Device::Cuda(backend), true) =
            (device, projection && want[1].is_multiple_of(block_values))
        else {
            return Ok(Weight::Dense(self.tensor(name, &want, device)?));
        };
        let [rows, cols] = want;
        // Q4_0: an f16 scale d, then 32 4-bit values q, weight d·(q − 8); q uniform on 0..16 has
        // standard deviation 4.61. Q8_0: d, then 32 signed bytes q, weight d·q; q uniform on
        // -128..128 has standard deviation 73.9.
        let spread = match self.kind {
            QuantKind::Q4_0 => 4.61,
            QuantKind::Q8_0 => 73.9,
            other => anyhow::bail!("no random blocks of {other:?}"),
        };
        let d = half::f16::from_f32(0.02 / spread).to_bits().to_le_bytes();
        let mut h = 0xcbf29ce484222325u64 ^ self.dense.seed;
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x100000001b3);
        }
        let mut bytes = vec![0u8; rows * cols / block_values * block_bytes];
        bytes
            .par_chunks_mut(block_bytes * 1024)
            .enumerate()
            .for_each(|(c, chunk)| {
                let mut rng =
                    crate::tensor::Rng(h ^ (c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                for block in chunk.chunks_mut(block_bytes) {
                    block[..2].copy_from_slice(&d);
                    for word in block[2..].chunks_mut(8) {
                        let r = rng.next_u64().to_le_bytes();
                        word.copy_from_slice(&r[..word.len()]);
                    }
                }
            });
        Ok(Weight::Quant(QuantWeight {
            backend: backend.clone(),
            bytes: backend.upload_bytes(&bytes)?,
            kind: self.kind,
            rows,
            cols,
        }))
    }
}

/// `lorafit bench --decode`: per base format and batch size, the prefill of `decode_prompt_len`
/// random tokens per sequence and `new_tokens` greedy tokens per sequence with the KV cache
/// (after a short warm-up generation that compiles kernels and tunes each GEMM shape); one
/// `RESULT` JSON line each with decode tokens/s over the batch and per sequence.
fn run_decode(a: &BenchArgs) -> Result<()> {
    use crate::infer::{generate_stream, GenerateOptions};
    let spec = named_shape(&a.shape)?;
    ensure!(
        a.new_tokens >= 2 && a.decode_prompt_len >= 1,
        "--decode needs --new-tokens of at least 2 and a prompt"
    );
    let device = Device::parse(&a.device)?;
    device.set_numerics(false, a.gemm_tuning)?;
    // Every base is checked before the first is timed, not after the rows before it.
    let mut bases = Vec::new();
    for base in &a.base {
        let quant = match base.as_str() {
            "bf16" => crate::model::BaseQuant::None,
            "q4_0" => crate::model::BaseQuant::Q4_0,
            "q8_0" => crate::model::BaseQuant::Q8_0,
            other => anyhow::bail!("--base {other:?}: expected bf16, q4_0 or q8_0"),
        };
        ensure!(
            device.is_cuda() || quant == crate::model::BaseQuant::None,
            "--base {base}: a quantized random base is kept on a CUDA device; on the CPU pass \
             --base bf16"
        );
        bases.push((base, quant));
    }
    for (base, quant) in bases {
        let t_load = Instant::now();
        let weights = random_weights(&spec, quant, &device)?;
        let model = Model::new(spec.clone(), weights, device.clone());
        eprintln!(
            "random {} ({base}) on {} in {:.1}s",
            a.shape,
            device.name(),
            t_load.elapsed().as_secs_f64()
        );
        let lora = if a.with_adapter {
            let cfg = LoraConfig {
                rank: a.rank,
                alpha: 2.0 * a.rank as f64,
                ..Default::default()
            };
            Some(Lora::new(&spec, cfg, &device)?)
        } else {
            None
        };
        for &batch in &a.batch {
            ensure!(batch > 0, "--batch sizes must be positive");
            let mut rng = crate::tensor::Rng(1 + batch as u64);
            let prompts: Vec<Vec<u32>> = (0..batch)
                .map(|_| {
                    (0..a.decode_prompt_len)
                        .map(|_| 3 + (rng.next_u64() % (spec.vocab as u64 - 3)) as u32)
                        .collect()
                })
                .collect();
            let warm = GenerateOptions::greedy(4, None);
            generate_stream(&model, lora.as_ref(), &prompts, &warm, None, &mut |_, _| {})?;
            device.synchronize()?;
            device.reset_peak();
            let opts = GenerateOptions::greedy(a.new_tokens, None);
            let r = generate_stream(&model, lora.as_ref(), &prompts, &opts, None, &mut |_, _| {})?;
            let st = &r.stats;
            let steps = a.new_tokens - 1;
            eprintln!("batch {batch}: {}", st.summary());
            let line = serde_json::json!({
                "tool": "lorafit", "mode": "decode", "shape": a.shape, "base": base,
                "adapter": a.with_adapter, "batch": batch, "prompt_len": a.decode_prompt_len,
                "new_tokens": a.new_tokens, "device": device.name(),
                "decode_tokens_per_s": st.decode_tokens_per_s(),
                "per_sequence_tokens_per_s": st.decode_tokens_per_s() / batch as f64,
                "ms_per_step": 1e3 * st.decode_s / steps as f64,
                "prefill_s": st.prefill_s,
                "peak_gib": device.memory().peak_bytes as f64 / (1u64 << 30) as f64,
            });
            println!("RESULT {line}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn line(args: &str) -> serde_json::Value {
        let cli = Cli::parse_from(std::iter::once("bench").chain(args.split_whitespace()));
        plan_only_line(&cli.bench).unwrap()
    }

    /// Without a GPU, the plan the H200 run made and its prediction (docs/bench/
    /// unsloth-long-h200-2026-12-03-b.jsonl: llama8b 14336 / 2048 under 23.65 GiB, 6 resident
    /// layers, 22.30 GiB measured; the estimate of that day, which added the two layers coming
    /// back to the resident ones, said 22.85), the plan the planner makes there now, and a
    /// refusal that names the longest pass that fits.
    #[test]
    fn the_plan_alone_is_the_plan_the_gpu_run_made() {
        let args = "--plan-only --shape llama8b --prompt-len 14336 --resp-len 2048 \
                    --gpu-gib 140.4 --host-gib 125 --memory-limit 23.65";
        let l = line(&format!("{args} --resident-layers 6"));
        assert_eq!(
            l["plan"],
            "segment 1, attention kept, k/v of 31 layers kept, boundaries in host memory, \
             top 6 layers resident on the device"
        );
        let peak = l["predicted_peak_gib"].as_f64().unwrap();
        assert!((peak / 22.30 - 1.0).abs() < 0.01, "{l}");
        // With that estimate the budget has room for one more resident layer, within the 95%
        // of it that resident layers may fill.
        let l = line(args);
        assert_eq!(
            l["plan"],
            "segment 1, attention kept, k/v of 31 layers kept, boundaries in host memory, \
             top 7 layers resident on the device"
        );
        let peak = l["predicted_peak_gib"].as_f64().unwrap();
        let budget = l["activation_budget_gib"].as_f64().unwrap();
        assert!(
            peak <= l["model_gib"].as_f64().unwrap() + 0.95 * budget,
            "{l}"
        );
        assert!(l.get("refused").is_none(), "{l}");
        // A 24 GiB card holds llama8b's weights and little else: 128K tokens a branch are refused
        // (no host memory to offload to), with the longest pass that would fit.
        let l = line(
            "--plan-only --shape llama8b --prompt-len 114688 --resp-len 16384 --gpu-gib 24 \
             --host-gib 0",
        );
        let refused = l["refused"].as_str().unwrap();
        assert!(
            refused.contains("the longest pass that fits is about"),
            "{l}"
        );
        // The estimate's terms add up to the prediction; a short row's top layer recomputes its
        // MLP, so its head shares the peak with the top layer's backward.
        let l = line(
            "--plan-only --shape qwen1.5b --prompt-len 3584 --resp-len 512 --gpu-gib 140.4 \
             --host-gib 125 --memory-limit 4.2",
        );
        let terms = l["estimate_terms_gib"].as_object().unwrap();
        let sum: f64 = terms.values().map(|v| v.as_f64().unwrap()).sum();
        let held = l["model_gib"].as_f64().unwrap();
        let peak = l["predicted_peak_gib"].as_f64().unwrap();
        assert!((held + sum - peak).abs() < 0.02, "{l}");
        assert!(
            terms.contains_key("the head or the top layer's backward"),
            "{l}"
        );
        assert!(peak <= 4.2 && l.get("refused").is_none(), "{l}");
        // A limit above the card plans as the card does: llama8b at 14336 / 2048 on 80 GB is
        // the same plan under a 200 GiB limit as under none, within the card.
        let card = "--plan-only --shape llama8b --prompt-len 14336 --resp-len 2048 --gpu-gib 80 \
                    --host-gib 125";
        let (free, over) = (line(card), line(&format!("{card} --memory-limit 200")));
        assert_eq!(over["plan"], free["plan"], "{over}");
        assert_eq!(over["activation_budget_gib"], free["activation_budget_gib"]);
        assert!(
            over["predicted_peak_gib"].as_f64().unwrap() < 80.0,
            "{over}"
        );
        // Without the GPU's size there is nothing to plan against.
        let cli = Cli::parse_from(["bench", "--plan-only", "--shape", "llama8b"]);
        let err = plan_only_line(&cli.bench).unwrap_err().to_string();
        assert!(err.contains("--gpu-gib"), "{err}");
    }
}
