//! `TrainConfig`: the one description of a training run behind the CLI flags, TOML files, the job
//! API and the saved plan (`plan.toml`), with the vocabulary it is written in (`Method`,
//! `HeadTier`, `SftScope`). Defaults follow the spec's table (ORPO: lr 1e-5, λ 0.1, rank 16,
//! scale 2.0, warmup ≈ 3%); what depends on the method (the learning rate, the objective) is
//! resolved from it. This module reads nothing from `train`: data flows config → train.

use crate::model::{LoraConfig, Target};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    Orpo,
    Sft,
    Dpo,
    Simpo,
}

/// How the LM head computes its logps (`train::head`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum HeadTier {
    Full,
    Chunked,
    Fused,
}

/// Which tokens ORPO's NLL term averages over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SftScope {
    /// TRL-faithful: token-mean cross-entropy over all chosen tokens, prompt and response.
    #[default]
    Full,
    /// Token-mean cross-entropy over the chosen response tokens only (`nll = -lw`).
    Response,
}

/// DPO's loss on the reward margin (TRL `DPOConfig.loss_type`; `train::objectives::dpo_sums`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DpoLossType {
    /// `-log_sigmoid(beta * z)`, with cDPO label smoothing.
    #[default]
    Sigmoid,
    /// IPO: `(z - 1 / (2 beta))^2` with `z` on the token-MEAN logps (as TRL computes it).
    Ipo,
    /// SLiC's hinge: `relu(1 - beta * z)`.
    Hinge,
    /// Robust DPO: the sigmoid loss de-biased for label noise `label_smoothing` (< 0.5).
    Robust,
}

impl DpoLossType {
    /// The setting's value as written in a config.
    pub fn name(&self) -> &'static str {
        match self {
            DpoLossType::Sigmoid => "sigmoid",
            DpoLossType::Ipo => "ipo",
            DpoLossType::Hinge => "hinge",
            DpoLossType::Robust => "robust",
        }
    }
}

/// How the learning rate falls after its linear warm-up (the `schedule` setting, by the names of
/// Hugging Face's `lr_scheduler_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LrDecay {
    /// The peak to the end (`constant`; `constant_with_warmup` is the same here, since every
    /// schedule warms up for `warmup_steps` or `warmup_ratio`).
    Constant,
    /// Half a cosine from the peak to zero at the cycle's end (`cosine`).
    Cosine,
    /// A straight line from the peak to zero at the cycle's end (`linear`, Hugging Face's
    /// default).
    Linear,
}

impl LrDecay {
    /// The decay a `schedule` value names, if any.
    pub fn parse(name: &str) -> Option<LrDecay> {
        match name {
            "constant" | "constant_with_warmup" => Some(LrDecay::Constant),
            "cosine" => Some(LrDecay::Cosine),
            "linear" => Some(LrDecay::Linear),
            _ => None,
        }
    }
}

/// How ORPO's λ is set over a run (`train::lambda_controller`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LambdaSchedule {
    /// `orpo_lambda` at every step.
    #[default]
    Static,
    /// Set at each evaluation from the validation `lw` and `lr`, between `orpo_lambda_min` and
    /// `orpo_lambda_max` (needs validation data and `eval_every > 0`).
    Adaptive,
}

/// How each LoRA module's rank is set from the base model (`train::rank_scaling`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RankScaling {
    /// `rank` on every module (or `rank_pattern`'s entries).
    #[default]
    None,
    /// `rank × bits / 4`, bits from the GGUF storage type of the module's base weight.
    ByBits,
    /// `rank × clip(kl / median kl, 0.5, 2)` per layer, from `rank_kl_file`.
    ByKl,
}

impl RankScaling {
    /// The setting's value as written in a config.
    pub fn name(&self) -> &'static str {
        match self {
            RankScaling::None => "none",
            RankScaling::ByBits => "by_bits",
            RankScaling::ByKl => "by_kl",
        }
    }
}

/// How a row's text becomes prompt and response token ids (`data::tokenize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Tokenization {
    /// Prompt and each response encoded apart: the prompt gets the tokenizer's BOS when
    /// `add_bos_token` asks for it, a response gets EOS unless it already ends with EOS (trailing
    /// whitespace tokens such as ChatML's `\n` after `<|im_end|>` ignored). The prompt's ids are
    /// the ones generation sees.
    #[default]
    Separate,
    /// TRL 1.16's ids for the method: ORPOTrainer's (ORPO; CPOTrainer's for SimPO, the same
    /// code) or DPOTrainer's / SFTTrainer's (DPO, SFT). See the README's "Tokenization".
    Trl,
}

/// How the command that checks the settings lets a user change one, for the hints of its
/// errors: train's `--set KEY=VALUE`, or lint's own flags (`--max-prompt-len N`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SetHint {
    Set,
    Flags,
}

impl SetHint {
    /// What to write to set `name` to `value`.
    pub fn how(self, name: &str, value: impl std::fmt::Display) -> String {
        match self {
            SetHint::Set => format!("--set {name}={value}"),
            SetHint::Flags => format!("--{} {value}", name.replace('_', "-")),
        }
    }
}

/// An f32 setting as the shortest decimal that reads back as the same f32 (`0.05`, not the
/// `0.05000000074505806` of its f64 widening).
fn shortest_f32<S: serde::Serializer>(v: &f32, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(v.to_string().parse().unwrap_or(*v as f64))
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Hugging Face model folder, GGUF file, "smollm2" (fetched and cached), or a Hub id
    /// (`org/name`) whose snapshot an earlier download left in the Hugging Face cache.
    pub model: String,
    /// Encode the seven projections of every layer on load: "none" (as the files hold them),
    /// "q8_0", "q4_0", "q4_1" or "q4_k" (`model::quantize_on_load`; a GGUF's projections are widened and
    /// encoded again). `lorafit eval --config plan.toml` and `generate --base-quant` score and
    /// generate on the same base; export merges into the files' own weights.
    pub base_quant: crate::model::BaseQuant,
    /// Training data: a dataset file (JSONL, a JSON array, CSV / TSV, Parquet; gzip or zstd
    /// compressed; `data::rows`), or a pattern naming the shards of one split.
    pub data: String,
    /// Validation data (optional), in the same forms as `data`.
    pub valid: Option<String>,
    /// Without `valid`: this fraction of the training rows (in (0, 0.5]; 0: none) held out for
    /// validation, chosen by a permutation seeded with `seed` (as `train_test_split` would), so
    /// a run has validation metrics without a file of its own. At least one row each side.
    pub valid_fraction: f64,
    /// Output folder: adapter, checkpoints, metrics.jsonl, plan.toml.
    pub output: String,
    pub method: Method,
    /// cpu, cuda or cuda:N.
    pub device: String,
    pub seed: u64,
    /// Optimiser steps; 0 derives them from `epochs`.
    pub steps: usize,
    pub epochs: f64,
    pub grad_accum: usize,
    /// Peak learning rate; 0 picks the method's default (ORPO 1e-5, SFT 2e-4, DPO 5e-6, SimPO 1e-6·…).
    pub lr: f64,
    pub warmup_ratio: f64,
    /// Warm-up steps; unset or 0 derives them from `warmup_ratio`, rounded up (TRL's
    /// `warmup_steps`, as transformers reads it). plan.toml records the number the run used.
    pub warmup_steps: Option<usize>,
    /// Learning-rate schedule after the linear warm-up: "cosine", "linear" or "constant"
    /// (`constant_with_warmup` is "constant"); `LrDecay`.
    pub schedule: String,
    pub weight_decay: f64,
    /// Global gradient-norm clip; 0 disables.
    pub grad_clip: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_eps: f64,
    pub rank: usize,
    /// LoRA alpha; 0 means `2 × rank` (scale 2.0).
    pub alpha: f64,
    pub rslora: bool,
    /// Learning-rate multiplier on B (LoRA+); 1 disables.
    pub lora_plus_ratio: f64,
    #[serde(serialize_with = "shortest_f32")]
    pub lora_dropout: f32,
    pub targets: Vec<String>,
    pub rank_pattern: BTreeMap<String, usize>,
    /// Per-module ranks from the base model: "none" (`rank` everywhere), "by_bits" (from each
    /// base weight's GGUF type) or "by_kl" (from `rank_kl_file`); see the README.
    pub rank_scaling: RankScaling,
    /// The per-layer KL JSON that `lorafit kl` writes (needed by `rank_scaling = "by_kl"`).
    pub rank_kl_file: Option<String>,
    pub orpo_lambda: f64,
    /// "static" (`orpo_lambda` throughout) or "adaptive" (the λ controller; see the README).
    pub orpo_lambda_schedule: LambdaSchedule,
    /// Adaptive: λ during the SFT warm-up, and the lowest a back-off goes.
    pub orpo_lambda_min: f64,
    /// Adaptive: the highest λ the ramp reaches.
    pub orpo_lambda_max: f64,
    /// Adaptive: λ's factor per evaluation at which validation lw holds.
    pub orpo_lambda_ramp: f64,
    /// Adaptive: λ's factor on a confirmed displacement.
    pub orpo_lambda_backoff: f64,
    /// Adaptive: evaluations in a row that must agree before the phase changes.
    pub orpo_lambda_patience: usize,
    /// Adaptive: the least change of validation lw (nats per token) counted as more than noise.
    pub orpo_lambda_noise_floor: f64,
    /// Adaptive: the largest share of the run's steps that warm-up may take; at the first
    /// evaluation at or past it the ramp starts (at `orpo_lambda`) whether or not lw plateaued.
    pub orpo_lambda_warmup_max: f64,
    pub sft_scope: SftScope,
    /// SFT: train on prompt tokens too.
    pub sft_all_tokens: bool,
    pub dpo_beta: f64,
    pub label_smoothing: f64,
    /// DPO's loss: "sigmoid" (default), "ipo", "hinge" or "robust" (TRL's `loss_type`).
    pub dpo_loss_type: DpoLossType,
    /// A per-example loss above this counts as this value with zero gradient (every objective);
    /// unset: no clip.
    pub loss_clip: Option<f64>,
    pub simpo_beta: f64,
    pub simpo_gamma: f64,
    pub max_seq_len: usize,
    pub max_prompt_len: usize,
    /// Skip (and count) malformed rows instead of failing.
    pub skip_bad_rows: bool,
    /// How rows become token ids: "separate" (prompt and responses encoded apart) or "trl"
    /// (TRL 1.16's ids for the method).
    pub tokenization: Tokenization,
    /// A Jinja chat template file, used instead of the model's own (or for a model without one).
    pub chat_template: Option<String>,
    /// Keep every `segment_size`-th layer boundary and recompute segments in the backward; 0 keeps
    /// all activations; unset chooses per example: 0 when the step fits the device's free memory,
    /// else the fastest segmented plan that fits (`train::memory::auto_plan`).
    pub segment_size: Option<usize>,
    /// With segments, keep each layer's attention output and lse from the forward so that the
    /// recomputation runs no attention kernel (about `tokens · n_heads · head_dim` values per
    /// layer); unset keeps them when they fit the device's free memory.
    pub keep_attention: Option<bool>,
    /// With segments, keep k and v of the lowest this many layers from the forward, sparing their
    /// projections in the recomputation (`tokens · 2 · kv_dim` values per layer; not for models
    /// with q/k norms); unset keeps as many as fit the device's free memory.
    pub keep_kv_layers: Option<usize>,
    /// Run the MLP in token chunks of this many tokens (0: all at once); bounds the (T, I)
    /// intermediates at the cost of recomputing gate/up in the backward. Unset: all at once
    /// unless no such plan fits, then chunks of `train::memory::AUTO_MLP_CHUNK`.
    pub mlp_chunk: Option<usize>,
    /// The most device memory the run may hold, in GiB (weights, adapter, optimiser and
    /// activations; the allocator's count). Unset: the device's free memory less a margin (5%, at
    /// least 4 GiB).
    /// A step whose smallest plan does not fit is refused before the first step.
    pub memory_limit: Option<f64>,
    /// With segments, hold the layer boundaries in pinned host memory, copied out and back on a
    /// side stream while the layers run (`tensor::offload`): true always, false never, unset when
    /// no plan fits the device otherwise and the host has the room (`train::memory::host_budget`).
    pub offload: Option<bool>,
    /// Run each step's examples in packs of consecutive examples of up to this many tokens, each
    /// pack one sequence with a block-diagonal mask (`train::plan::pack`); 0 runs them one by one.
    /// The losses and gradients are those of the unpacked run (f32 sums in another order); with
    /// `lora_dropout` the masks differ. Needs `prefix_shared` for pairs, and a model whose rotary
    /// factors do not depend on the length (not LongRoPE).
    pub pack_tokens: usize,
    pub head: HeadTier,
    /// Rows per chunk of the chunked head; 0 picks `auto_head_chunk(vocab)`.
    pub head_chunk: usize,
    /// One forward over [prompt; chosen; rejected] when a pair's prompt tokens are shared.
    pub prefix_shared: bool,
    pub eval_every: usize,
    /// Validation examples used per evaluation; 0 = all.
    pub eval_limit: usize,
    pub save_every: usize,
    /// Keep only this many step checkpoints (`checkpoint-NNNNNN`), the newest, deleting older
    /// ones as new ones are written (TRL's `save_total_limit`); 0 keeps them all. `best/` and
    /// `adapter/` are not counted.
    pub save_total_limit: usize,
    /// Start from this PEFT adapter's weights (optimiser and schedule start fresh).
    pub warm_start: Option<String>,
    /// CUDA: the two-kernel attention backward, bit-reproducible from run to run (about 2.3×
    /// slower in attention's backward on sm_90); otherwise dQ is reduced in whatever order
    /// blocks finish and gradients differ in the last bits between runs.
    pub deterministic_attention: bool,
    /// CUDA: time cuBLASLt's candidate algorithms for each product shape on its first call and
    /// keep the fastest; false takes the heuristic's first choice (reproducible across
    /// processes).
    pub gemm_tuning: bool,
    /// Fused head tier: drop softmax-gradient terms below this in the backward (0: keep all).
    #[serde(serialize_with = "shortest_f32")]
    pub cce_filter_eps: f32,
    /// Without a terminal (stderr is a file, nohup, a job server): one plain log line every this
    /// many optimiser steps (at least 1). On a terminal the progress bar shows every step.
    pub log_every: usize,
    /// Also write TensorBoard event files (`events.out.tfevents.*`) beside metrics.jsonl.
    pub tensorboard: bool,
    /// Also write batches.jsonl: per micro-step, the example index and the token ids trained on
    /// (to replay a run's steps in another framework, `scripts/numerics_harness.py`).
    pub record_batches: bool,
    /// Start the run again in an output folder that already holds one, deleting that run's
    /// outputs first (adapter, checkpoints, metrics, plots); without it such a folder is refused
    /// unless the run resumes from it.
    pub overwrite: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            model: "smollm2".into(),
            base_quant: crate::model::BaseQuant::None,
            data: String::new(),
            valid: None,
            output: "runs/lorafit".into(),
            method: Method::Orpo,
            device: "cpu".into(),
            seed: 0,
            steps: 0,
            epochs: 1.0,
            grad_accum: 1,
            lr: 0.0,
            warmup_ratio: 0.03,
            warmup_steps: None,
            schedule: "cosine".into(),
            weight_decay: 0.0,
            grad_clip: 1.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_eps: 1e-8,
            rank: 16,
            alpha: 0.0,
            rslora: false,
            lora_plus_ratio: 1.0,
            lora_dropout: 0.0,
            targets: Target::ALL.iter().map(|t| t.module().to_string()).collect(),
            rank_pattern: BTreeMap::new(),
            rank_scaling: RankScaling::None,
            rank_kl_file: None,
            orpo_lambda: 0.1,
            orpo_lambda_schedule: LambdaSchedule::Static,
            orpo_lambda_min: 0.01,
            orpo_lambda_max: 1.0,
            orpo_lambda_ramp: 1.5,
            orpo_lambda_backoff: 0.5,
            orpo_lambda_patience: 2,
            orpo_lambda_noise_floor: 0.002,
            orpo_lambda_warmup_max: 0.1,
            sft_scope: SftScope::Full,
            sft_all_tokens: false,
            dpo_beta: 0.1,
            label_smoothing: 0.0,
            dpo_loss_type: DpoLossType::Sigmoid,
            loss_clip: None,
            simpo_beta: 2.0,
            simpo_gamma: 1.0,
            max_seq_len: 2048,
            max_prompt_len: 1024,
            skip_bad_rows: false,
            tokenization: Tokenization::Separate,
            chat_template: None,
            segment_size: None,
            keep_attention: None,
            keep_kv_layers: None,
            mlp_chunk: None,
            memory_limit: None,
            offload: None,
            pack_tokens: 0,
            valid_fraction: 0.0,
            // Chunked stays the default on every device: the fused tier (`head = "fused"`) is
            // correct on CUDA (selftest cce rows) and cuts peak memory (qwen1.5b, 3584+512,
            // segment 1, H200: 4.25 vs 7.67 GiB) but its kernels (~90 TFLOP/s fwd, ~70 bwd) are
            // slower than cuBLAS, so the step is 23% slower (0.426 vs 0.346 s).
            head: HeadTier::Chunked,
            head_chunk: 0,
            prefix_shared: true,
            eval_every: 50,
            eval_limit: 0,
            save_every: 100,
            save_total_limit: 0,
            warm_start: None,
            deterministic_attention: false,
            gemm_tuning: true,
            cce_filter_eps: crate::tensor::cce::DEFAULT_FILTER_EPS,
            log_every: 10,
            tensorboard: false,
            record_batches: false,
            overwrite: false,
        }
    }
}

/// Rows per head chunk so that one chunk's f32 logits stay within 256 MiB: a multiple of 128
/// rows where that leaves at least 128 (the GEMMs' row tiles: at 523 rows, five 128-row tiles
/// would compute 640), else at least 64 rows.
pub fn auto_head_chunk(vocab: usize) -> usize {
    let rows = (256usize << 20) / (4 * vocab.max(1));
    if rows >= 128 {
        rows / 128 * 128
    } else {
        rows.max(64)
    }
}

/// `chunk`, or the automatic size when it is 0.
pub fn resolve_head_chunk(chunk: usize, vocab: usize) -> usize {
    if chunk > 0 {
        chunk
    } else {
        auto_head_chunk(vocab)
    }
}

/// TRL's names for settings (its `ORPOConfig`, `DPOConfig`, `SFTConfig` and PEFT's
/// `LoraConfig`), accepted beside lorafit's own. TRL's `beta` is ORPO's λ, DPO's β or SimPO's β by
/// method (`setting_name`).
const TRL_NAMES: &[(&str, &str)] = &[
    ("learning_rate", "lr"),
    ("max_steps", "steps"),
    ("gradient_accumulation_steps", "grad_accum"),
    ("lora_r", "rank"),
    ("lora_alpha", "alpha"),
    ("max_length", "max_seq_len"),
    ("max_prompt_length", "max_prompt_len"),
    ("num_train_epochs", "epochs"),
    ("output_dir", "output"),
    ("chat_template_path", "chat_template"),
    ("logging_steps", "log_every"),
    ("save_steps", "save_every"),
    ("eval_steps", "eval_every"),
    ("max_grad_norm", "grad_clip"),
    ("adam_epsilon", "adam_eps"),
    ("lr_scheduler_type", "schedule"),
    // PEFT's LoraConfig names, which TRL scripts pass through.
    ("target_modules", "targets"),
    ("lora_target_modules", "targets"),
    ("use_rslora", "rslora"),
    // PEFT's rank.
    ("r", "rank"),
    // TRL's DPOConfig.loss_type.
    ("loss_type", "dpo_loss_type"),
    // transformers' TrainingArguments.
    ("overwrite_output_dir", "overwrite"),
    // TRL's ModelConfig and ScriptArguments, as its scripts take them.
    ("model_name_or_path", "model"),
    ("dataset_name", "data"),
];

/// TRL and transformers settings that lorafit has no counterpart for, each with what lorafit
/// does instead: a TRL config brought over is answered with every one of them at once, not
/// silently run without them.
const TRL_NOT_TAKEN: &[(&str, &str)] = &[
    ("per_device_train_batch_size", "lorafit runs one example per micro-step (a pair's two answers share one prompt pass; pack_tokens packs short pairs into one sequence); the batch is grad_accum"),
    ("per_device_eval_batch_size", "validation runs one example at a time"),
    ("auto_find_batch_size", "the memory planner sizes each pass to the device (memory_limit)"),
    ("gradient_checkpointing", "the memory planner chooses what to keep and what to recompute (segment_size, keep_attention, offload, memory_limit)"),
    ("bf16", "on CUDA lorafit computes in bf16 with f32 sums, on the CPU in f32"),
    ("fp16", "on CUDA lorafit computes in bf16 with f32 sums, on the CPU in f32"),
    ("tf32", "lorafit's products are bf16 on CUDA and f32 on the CPU"),
    ("optim", "the optimiser is AdamW (adam_beta1, adam_beta2, adam_eps, weight_decay, lora_plus_ratio)"),
    ("report_to", "metrics.jsonl is always written; tensorboard = true adds event files"),
    ("eval_strategy", "validation runs every eval_every steps"),
    ("evaluation_strategy", "validation runs every eval_every steps"),
    ("save_strategy", "checkpoints are written every save_every steps"),
    ("logging_strategy", "a log line every log_every steps"),
    ("max_completion_length", "max_seq_len and max_prompt_len bound a pair, as TRL's max_length and max_prompt_length"),
    ("dataset_num_proc", "rows are tokenised once, before the first step"),
    ("dataloader_num_workers", "rows are tokenised once, before the first step"),
    ("remove_unused_columns", "columns a layout does not use are ignored"),
    ("push_to_hub", "lorafit writes local files only"),
    ("hub_model_id", "lorafit writes local files only"),
    ("use_liger_kernel", "lorafit runs its own fused kernels"),
    ("bias", "LoRA adapters train no bias (PEFT's bias = \"none\")"),
    ("use_dora", "lorafit trains LoRA adapters, not DoRA"),
    ("modules_to_save", "only the LoRA matrices train; no base module is trained or saved"),
    ("torch_compile", "lorafit runs its own fused kernels"),
    ("rpo_alpha", "lorafit's DPO adds no NLL term (RPO); ORPO (method = \"orpo\") has one"),
    ("cpo_alpha", "lorafit has no CPO; SimPO is method = \"simpo\" (no NLL term, TRL's cpo_alpha = 0)"),
    ("reference_free", "DPO's reference is always the frozen base (the adapter off)"),
    ("precompute_ref_log_probs", "DPO's reference log-probabilities are computed once per example and kept"),
    ("padding_value", "lorafit does not pad: each sequence is as long as its tokens"),
    ("truncation_mode", "truncation is lorafit's own: a prompt over max_prompt_len loses its first tokens, responses over what max_seq_len leaves their last (see \"Tokenization\" in the README)"),
    ("model_init_kwargs", "the base loads as its files say (bf16 on CUDA, f32 on the CPU; base_quant quantizes it)"),
    ("task_type", "lorafit trains adapters of causal language models only"),
    ("peft_config", "the LoRA settings are lorafit's own: rank, alpha, targets, lora_dropout, rslora"),
    ("resume_from_checkpoint", "a run resumes with `lorafit train --resume DIR` (a checkpoint folder, or a run folder for its latest checkpoint)"),
    ("load_best_model_at_end", "the final adapter is in adapter/, and best/ holds the adapter of the best validation margin"),
    ("metric_for_best_model", "best/ holds the adapter of the best validation margin"),
    ("greater_is_better", "best/ holds the adapter of the best (highest) validation margin"),
    ("save_safetensors", "lorafit always saves safetensors"),
    ("save_only_model", "lorafit always saves safetensors, and every checkpoint holds the adapter and the optimiser state (a resume needs both)"),
    ("eval_on_start", "lorafit validates at step 0 whenever a validation set is given (valid, or valid_fraction)"),
    ("data_seed", "seed governs the data order (and the held-out split)"),
    ("use_peft", "lorafit always trains a LoRA adapter"),
    ("logging_first_step", "a log line every log_every steps (TRL's logging_steps)"),
    ("dataset_train_split", "data takes the training split's files (a pattern such as 'data/train-*.parquet' for its shards)"),
    ("dataset_test_split", "valid takes the validation split's files (a pattern such as 'data/test-*.parquet' for its shards)"),
    ("dataset_config", "data and valid take the files of one configuration's splits"),
    ("do_train", "lorafit train always trains"),
    ("do_eval", "validation runs whenever valid or valid_fraction is given"),
    ("trust_remote_code", "lorafit runs its own implementation of each family and no code from the model's folder"),
    ("torch_dtype", "the base loads as its files say (bf16 on CUDA, f32 on the CPU; base_quant quantizes it)"),
    ("dtype", "the base loads as its files say (bf16 on CUDA, f32 on the CPU; base_quant quantizes it)"),
    ("attn_implementation", "lorafit runs its own attention kernels"),
    ("load_in_4bit", "base_quant = \"q4_k\" (or \"q4_0\", \"q4_1\") quantizes the frozen base on load"),
    ("load_in_8bit", "base_quant = \"q8_0\" quantizes the frozen base on load"),
    ("bnb_4bit_quant_type", "base_quant names the quantization (q8_0, q4_0, q4_1, q4_k)"),
    ("use_bnb_nested_quant", "base_quant names the quantization (q8_0, q4_0, q4_1, q4_k)"),
];

/// Every refusal of a set of settings at once (a config or command line brought from TRL may
/// hold several): one as it is, several under `many` with their count, the list of settings
/// that an unknown name appends printed once after all of them.
pub fn refuse_at_once(refusals: &[String], many: &str) -> Result<()> {
    match refusals {
        [] => Ok(()),
        [one] => bail!("{one}"),
        all => {
            let mut list = None;
            let lines: Vec<&str> = all
                .iter()
                .map(|e| match e.split_once(" (settings: ") {
                    Some((head, rest)) => {
                        list = Some(rest.trim_end_matches(')'));
                        head
                    }
                    None => e.as_str(),
                })
                .collect();
            let list = list.map(|l| format!("\nsettings: {l}")).unwrap_or_default();
            bail!("{} {many}:\n  {}{list}", all.len(), lines.join("\n  "))
        }
    }
}

/// Edit distance between two short names (for "did you mean").
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + (ca != cb) as usize).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

impl TrainConfig {
    /// Every setting's name, as `plan.toml` writes it.
    pub fn setting_names() -> Vec<String> {
        let table: toml::Table =
            toml::from_str(&TrainConfig::default().to_toml().unwrap_or_default())
                .unwrap_or_default();
        // Optional settings are absent from a default plan (TOML has no null): named here, as
        // the struct's `Option` fields.
        let mut names: Vec<String> = table.keys().cloned().collect();
        for extra in [
            "valid",
            "chat_template",
            "segment_size",
            "keep_attention",
            "keep_kv_layers",
            "warm_start",
            "warmup_steps",
            "loss_clip",
            "rank_kl_file",
            "mlp_chunk",
            "memory_limit",
            "offload",
        ] {
            if !names.iter().any(|n| n == extra) {
                names.push(extra.to_string());
            }
        }
        names
    }

    /// lorafit's name for setting `key` (itself, or what a TRL name means under `method`), or an
    /// error that names the nearest setting.
    pub fn setting_name(key: &str, method: &str) -> Result<String> {
        if key.is_empty() {
            bail!("the setting's name is empty: give KEY=VALUE, as in `--set rank=8`");
        }
        let names = TrainConfig::setting_names();
        if names.iter().any(|n| n == key) {
            return Ok(key.to_string());
        }
        if key == "beta" {
            return Ok(match method {
                "dpo" => "dpo_beta",
                "simpo" => "simpo_beta",
                _ => "orpo_lambda",
            }
            .to_string());
        }
        if let Some((_, ours)) = TRL_NAMES.iter().find(|(trl, _)| *trl == key) {
            return Ok(ours.to_string());
        }
        if let Some((_, instead)) = TRL_NOT_TAKEN.iter().find(|(trl, _)| *trl == key) {
            bail!("`{key}` (TRL's) is not a lorafit setting: {instead}; remove it");
        }
        let nearest = names
            .iter()
            .map(String::as_str)
            .chain(TRL_NAMES.iter().map(|(trl, _)| *trl))
            .min_by_key(|n| edit_distance(key, n))
            .unwrap_or_default()
            .to_string();
        // A few letters off, or the same name shortened or lengthened (`adam_epsilon`).
        let near = edit_distance(key, &nearest) <= 3
            || (nearest.len() >= 4 && (key.starts_with(&nearest) || nearest.starts_with(key)));
        if near {
            bail!("unknown setting `{key}` (did you mean `{nearest}`?)")
        }
        bail!("unknown setting `{key}` (settings: {})", names.join(", "))
    }

    /// The value of lorafit's setting `name` for a value written as TRL, PEFT or transformers
    /// write it: `max_steps = -1` (transformers' default, "from the epochs") is 0, PEFT's
    /// `target_modules = "all-linear"` is every target, TRL's one-element `loss_type` list is its
    /// one name; a share of the steps (transformers' `*_steps` below 1) is refused with what to
    /// give. Two values mean something lorafit names otherwise and are refused with what to
    /// write: TRL's CPOConfig names SimPO a loss type (lorafit a method, with no CPO NLL term,
    /// which TRL's default `cpo_alpha = 1` adds), and PEFT scales an adapter of `lora_alpha = 0`
    /// by 0 (lorafit's `alpha = 0` is 2 × rank). `given` is the name the value came under. Any
    /// other value is as given.
    pub fn trl_value(given: &str, name: &str, value: toml::Value) -> Result<toml::Value> {
        use toml::Value as V;
        let number = value
            .as_float()
            .or_else(|| value.as_integer().map(|i| i as f64));
        if given == "lora_alpha" && number == Some(0.0) {
            bail!(
                "`lora_alpha = 0` scales PEFT's adapter by 0, where lorafit's alpha = 0 means \
                 2 × rank: give the alpha (or leave it out for 2 × rank)"
            );
        }
        if given == "loss_type" && value.as_str() == Some("simpo") {
            bail!(
                "`loss_type = \"simpo\"` (TRL's CPOConfig) is lorafit's `method = \"simpo\"`, \
                 with simpo_beta and simpo_gamma (TRL's beta and simpo_gamma) and no CPO NLL \
                 term (TRL's cpo_alpha = 0): set the method instead"
            );
        }
        Ok(match (name, value) {
            ("steps", V::Integer(-1)) => V::Integer(0),
            ("targets", V::String(s)) if s == "all-linear" => V::Array(
                crate::model::Target::ALL
                    .iter()
                    .map(|t| V::String(t.module().to_string()))
                    .collect(),
            ),
            ("dpo_loss_type", V::Array(a)) => match a.as_slice() {
                [one @ V::String(_)] => one.clone(),
                _ => bail!(
                    "loss_type = {}: lorafit's DPO takes one loss type (sigmoid, ipo, hinge or \
                     robust), not a weighted mix",
                    V::Array(a.clone())
                ),
            },
            ("log_every" | "save_every" | "eval_every", V::Float(f)) if f > 0.0 && f < 1.0 => {
                bail!(
                    "{name} = {f}: a share of the run's steps (transformers' meaning of a value \
                     below 1) is not taken; give a number of steps"
                )
            }
            (_, V::Integer(i)) if i < 0 && TrainConfig::whole_number_setting(name) => {
                bail!("{given} = {i}: expected a whole number >= 0")
            }
            (_, v) => v,
        })
    }

    /// Refuses a value of the wrong type for setting `name`, naming the key it was written
    /// under (`given`: `max_steps` for `steps`), which an error of the whole table, in lorafit's
    /// names, would not.
    pub fn check_type(given: &str, name: &str, value: &toml::Value) -> Result<()> {
        // Every field has a default, so the one setting alone is a whole config.
        let one = toml::Table::from_iter([(name.to_string(), value.clone())]);
        if let Err(e) = one.try_into::<TrainConfig>() {
            let ours = if given == name {
                String::new()
            } else {
                format!(" (lorafit's `{name}`)")
            };
            let message = e.message().trim_end();
            let hint = if message.ends_with("expected a boolean") {
                ": write true or false"
            } else {
                ""
            };
            bail!("setting `{given}`{ours}: {message}{hint}");
        }
        Ok(())
    }

    /// Whether setting `name` takes a whole number (every such setting is unsigned).
    fn whole_number_setting(name: &str) -> bool {
        const OPTIONAL: [&str; 4] = [
            "warmup_steps",
            "segment_size",
            "keep_kv_layers",
            "mlp_chunk",
        ];
        if OPTIONAL.contains(&name) {
            return true;
        }
        let defaults: toml::Table =
            toml::from_str(&TrainConfig::default().to_toml().unwrap_or_default())
                .unwrap_or_default();
        defaults.get(name).is_some_and(|v| v.is_integer())
    }

    /// A settings table with TRL's names renamed to lorafit's; an unknown name, one given twice
    /// under two names, or a value of the wrong type (named as written) is an error.
    pub fn normalize(table: toml::Table) -> Result<toml::Table> {
        let method = table
            .get("method")
            .and_then(|m| m.as_str())
            .unwrap_or("orpo")
            .to_string();
        let mut out = toml::Table::new();
        // The name each setting was given as (`lr` for `learning_rate`, say).
        let mut given_as: std::collections::HashMap<String, String> = Default::default();
        // Every unknown name at once: a config brought from TRL may hold several.
        let mut unknown = Vec::new();
        for (k, v) in table {
            let name = match TrainConfig::setting_name(&k, &method) {
                Ok(name) => name,
                Err(e) => {
                    unknown.push(e.to_string());
                    continue;
                }
            };
            if let Some(other) = given_as.get(&name) {
                bail!("setting `{name}` is given twice (as `{other}` and as `{k}`)");
            }
            let v = match TrainConfig::trl_value(&k, &name, v) {
                Ok(v) => v,
                Err(e) => {
                    unknown.push(e.to_string());
                    continue;
                }
            };
            given_as.insert(name.clone(), k);
            out.insert(name, v);
        }
        refuse_at_once(&unknown, "settings lorafit does not take")?;
        for (name, v) in &out {
            TrainConfig::check_type(&given_as[name], name, v)?;
        }
        Ok(out)
    }

    /// A settings file as its table, before names are resolved: TOML, or a TRL recipe in YAML
    /// (`.yaml`, `.yml`) or JSON (`.json`) (`recipe_file`).
    pub fn settings_table(path: &Path) -> Result<toml::Table> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        match ext.to_ascii_lowercase().as_str() {
            "yaml" | "yml" => crate::recipe_file::table(&text)
                .with_context(|| format!("{}: not a recipe lorafit reads", path.display())),
            "json" => crate::recipe_file::json_table(&text)
                .with_context(|| format!("{}: not a recipe lorafit reads", path.display())),
            _ => toml::from_str(&text)
                .with_context(|| format!("{}: not a TOML file", path.display())),
        }
    }

    pub fn from_toml_file(path: &Path) -> Result<TrainConfig> {
        TrainConfig::from_toml_file_for(path, None)
    }

    /// [`TrainConfig::from_toml_file`] for a run whose method is `method` when it is given
    /// (a flag over the file's): TRL's `beta` then becomes that method's β (`dpo_beta`,
    /// `simpo_beta`, ORPO's λ), not the one the file's own method, or its absence, would pick.
    pub fn from_toml_file_for(path: &Path, method: Option<&str>) -> Result<TrainConfig> {
        let mut table = TrainConfig::settings_table(path)?;
        if let Some(m) = method {
            table.insert("method".into(), toml::Value::String(m.to_string()));
        }
        let table =
            TrainConfig::normalize(table).with_context(|| format!("in {}", path.display()))?;
        table
            .try_into()
            .with_context(|| format!("{}: invalid config", path.display()))
    }

    pub fn to_toml(&self) -> Result<String> {
        Ok(toml::to_string_pretty(self)?)
    }

    /// The learning rate after method defaults.
    pub fn learning_rate(&self) -> f64 {
        if self.lr > 0.0 {
            return self.lr;
        }
        match self.method {
            Method::Orpo => 1e-5,
            Method::Sft => 2e-4,
            Method::Dpo => 5e-6,
            Method::Simpo => 1e-6,
        }
    }

    /// Warm-up steps of a run of `total_steps`: `warmup_steps` if set, else `warmup_ratio` of
    /// the steps, rounded; never more than the run.
    pub fn resolved_warmup(&self, total_steps: usize) -> usize {
        // As transformers' `get_warmup_steps`: a positive `warmup_steps`, else the ratio's
        // steps rounded up (`warmup_steps = 0`, TRL's default, is "from the ratio").
        let from_ratio = (self.warmup_ratio * total_steps as f64).ceil() as usize;
        self.warmup_steps
            .filter(|&w| w > 0)
            .unwrap_or(from_ratio)
            .min(total_steps)
    }

    /// The settings as the run uses them, for plan.toml and checkpoints: the learning rate after
    /// method defaults, the step and warm-up counts, alpha after its `2 × rank` default. Read
    /// back as a config it trains the same run (`overwrite` is not recorded).
    pub fn resolved(&self, total_steps: usize, warmup_steps: usize) -> TrainConfig {
        let mut c = self.clone();
        c.lr = self.learning_rate();
        c.steps = total_steps;
        c.warmup_steps = Some(warmup_steps);
        if c.alpha == 0.0 {
            c.alpha = 2.0 * self.rank as f64;
        }
        c.overwrite = false;
        c
    }

    pub fn lora_config(&self) -> Result<LoraConfig> {
        let targets = self
            .targets
            .iter()
            .map(|t| Target::parse(t))
            .collect::<Result<Vec<_>>>()
            .context("config field \"targets\"")?;
        Ok(LoraConfig {
            rank: self.rank,
            alpha: if self.alpha > 0.0 {
                self.alpha
            } else {
                2.0 * self.rank as f64
            },
            targets,
            rslora: self.rslora,
            rank_pattern: self.rank_pattern.clone(),
            alpha_pattern: BTreeMap::new(),
            dropout: self.lora_dropout,
            seed: self.seed,
        })
    }

    /// Settings of another method than the run's that differ from their defaults: the run
    /// takes them and does not use them (a DPO `label_smoothing` under ORPO), which a user who
    /// set them should hear.
    pub fn other_methods_settings(&self) -> Result<Vec<String>> {
        const BY_METHOD: &[(Method, &[&str])] = &[
            (
                Method::Orpo,
                &[
                    "orpo_lambda",
                    "orpo_lambda_schedule",
                    "orpo_lambda_min",
                    "orpo_lambda_max",
                    "orpo_lambda_ramp",
                    "orpo_lambda_backoff",
                    "orpo_lambda_patience",
                    "orpo_lambda_noise_floor",
                    "orpo_lambda_warmup_max",
                ],
            ),
            (
                Method::Dpo,
                &["dpo_beta", "label_smoothing", "dpo_loss_type"],
            ),
            (Method::Simpo, &["simpo_beta", "simpo_gamma"]),
            (Method::Sft, &["sft_all_tokens"]),
        ];
        let table = |c: &TrainConfig| -> Result<toml::Table> { Ok(toml::from_str(&c.to_toml()?)?) };
        let (now, default) = (table(self)?, table(&TrainConfig::default())?);
        Ok(BY_METHOD
            .iter()
            .filter(|(m, _)| *m != self.method)
            .flat_map(|(_, names)| names.iter())
            .filter(|n| now.get(**n) != default.get(**n))
            .map(|n| {
                // TRL's `beta` lands on one of these by method (`setting_name`): say so, as a
                // user who wrote `beta` may not know the name.
                let given_as = match *n {
                    "orpo_lambda" => " (where `beta` goes under ORPO and SFT)",
                    "dpo_beta" => " (where `beta` goes under DPO)",
                    "simpo_beta" => " (where `beta` goes under SimPO)",
                    "dpo_loss_type" => " (TRL's `loss_type`)",
                    _ => "",
                };
                format!(
                    "{n} = {}{given_as}",
                    now.get(*n).map_or("unset".into(), |v| v.to_string())
                )
            })
            .collect())
    }

    /// The decay `schedule` names (`LrDecay`).
    pub fn lr_decay(&self) -> Result<LrDecay> {
        LrDecay::parse(&self.schedule).ok_or_else(|| {
            anyhow::anyhow!(
                "schedule {:?}: expected cosine, linear or constant (constant_with_warmup)",
                self.schedule
            )
        })
    }

    pub fn validate(&self) -> Result<()> {
        self.validate_as(&BTreeMap::new(), SetHint::Set)
    }

    /// [`TrainConfig::validate`], an error naming a setting by the key it was written under
    /// (`given_as`: lorafit's name to the key, `orpo_lambda` to TRL's `beta`), its hints
    /// written for the command that prints them (`hint`).
    pub fn validate_as(&self, given_as: &BTreeMap<String, String>, hint: SetHint) -> Result<()> {
        self.validate_inner(hint).map_err(|e| {
            let message = e.to_string();
            // Every range error begins `name = value: ...`.
            let renamed = given_as.iter().find_map(|(name, given)| {
                let rest = message.strip_prefix(name.as_str())?.strip_prefix(" = ")?;
                let (value, why) = rest.split_once(": ")?;
                (given != name).then(|| format!("{given} = {value} (lorafit's `{name}`): {why}"))
            });
            renamed.map_or(e, |m| anyhow::anyhow!(m))
        })
    }

    fn validate_inner(&self, hint: SetHint) -> Result<()> {
        const MAX_GRAD_ACCUM: usize = 1 << 16;
        const MAX_STEPS: usize = 1 << 40;
        if self.data.is_empty() {
            bail!("no training data: set `data` in the config or pass --data FILE.jsonl");
        }
        if self.grad_accum == 0 {
            bail!("grad_accum = 0: must be at least 1 (TRL's gradient_accumulation_steps)");
        }
        if self.rank == 0 {
            bail!("rank = 0: must be at least 1 (PEFT's r, TRL's lora_r)");
        }
        // Bounds far past any real run, so that a typo is an error and not an allocation of a
        // step's micro-step plans, or a step count no settings file can hold.
        if self.grad_accum > MAX_GRAD_ACCUM {
            bail!(
                "grad_accum = {}: expected at most {MAX_GRAD_ACCUM} micro-steps a step",
                self.grad_accum
            );
        }
        if self.steps > MAX_STEPS {
            bail!("steps = {}: expected at most {MAX_STEPS}", self.steps);
        }
        self.lr_decay()?;
        // Numbers a run reads: each named with its allowed range.
        let range = |name: &str, v: f64, lo: f64, hi: f64, lo_open: bool, hi_open: bool| {
            let ok = v.is_finite()
                && if lo_open { v > lo } else { v >= lo }
                && if hi_open { v < hi } else { v <= hi };
            let (l, h) = (
                if lo_open { "(" } else { "[" },
                if hi_open { ")" } else { "]" },
            );
            if ok {
                Ok(())
            } else {
                Err(anyhow::anyhow!(
                    "{name} = {v}: expected a number in {l}{lo}, {hi}{h}"
                ))
            }
        };
        let inf = f64::INFINITY;
        range(
            "lora_dropout",
            self.lora_dropout as f64,
            0.0,
            1.0,
            false,
            true,
        )?;
        if self.valid_fraction != 0.0 {
            range("valid_fraction", self.valid_fraction, 0.0, 0.5, true, false)?;
            if let Some(v) = &self.valid {
                bail!(
                    "valid = {v:?} and valid_fraction = {} both name validation rows: set one",
                    self.valid_fraction
                );
            }
        }
        range("lr", self.lr, 0.0, inf, false, true)?;
        // Checked even when `steps` overrides it: a bad value is never taken silently.
        range("epochs", self.epochs, 0.0, 1e6, true, false)?;
        range("warmup_ratio", self.warmup_ratio, 0.0, 1.0, false, false)?;
        range("weight_decay", self.weight_decay, 0.0, inf, false, true)?;
        range("grad_clip", self.grad_clip, 0.0, inf, false, true)?;
        range("adam_beta1", self.adam_beta1, 0.0, 1.0, false, true)?;
        range("adam_beta2", self.adam_beta2, 0.0, 1.0, false, true)?;
        range("adam_eps", self.adam_eps, 0.0, inf, true, true)?;
        range("alpha", self.alpha, 0.0, inf, false, true)?;
        range(
            "lora_plus_ratio",
            self.lora_plus_ratio,
            0.0,
            inf,
            true,
            true,
        )?;
        range("orpo_lambda", self.orpo_lambda, 0.0, inf, false, true)?;
        range(
            "orpo_lambda_min",
            self.orpo_lambda_min,
            0.0,
            inf,
            true,
            true,
        )?;
        range(
            "orpo_lambda_max",
            self.orpo_lambda_max,
            self.orpo_lambda_min,
            inf,
            false,
            true,
        )?;
        range(
            "orpo_lambda_ramp",
            self.orpo_lambda_ramp,
            1.0,
            inf,
            true,
            true,
        )?;
        range(
            "orpo_lambda_backoff",
            self.orpo_lambda_backoff,
            0.0,
            1.0,
            true,
            true,
        )?;
        range(
            "orpo_lambda_noise_floor",
            self.orpo_lambda_noise_floor,
            0.0,
            inf,
            true,
            true,
        )?;
        range(
            "orpo_lambda_warmup_max",
            self.orpo_lambda_warmup_max,
            0.0,
            1.0,
            false,
            false,
        )?;
        if self.orpo_lambda_patience == 0 {
            bail!("orpo_lambda_patience = 0: expected a whole number of evaluations, at least 1");
        }
        if self.orpo_lambda_schedule == LambdaSchedule::Adaptive {
            if self.method != Method::Orpo {
                bail!(
                    "orpo_lambda_schedule = \"adaptive\": expected method = \"orpo\" (method is {:?})",
                    self.method
                );
            }
            if self.eval_every == 0 {
                bail!("orpo_lambda_schedule = \"adaptive\" needs eval_every > 0 (λ is set at each evaluation)");
            }
        }
        range("dpo_beta", self.dpo_beta, 0.0, inf, true, true)?;
        range(
            "label_smoothing",
            self.label_smoothing,
            0.0,
            0.5,
            false,
            false,
        )?;
        if self.method == Method::Dpo {
            match self.dpo_loss_type {
                DpoLossType::Robust if self.label_smoothing >= 0.5 => bail!(
                    "label_smoothing = {}: expected a number in [0, 0.5) with dpo_loss_type = \"robust\" (it divides by 1 - 2·label_smoothing)",
                    self.label_smoothing
                ),
                DpoLossType::Ipo | DpoLossType::Hinge if self.label_smoothing != 0.0 => bail!(
                    "label_smoothing = {}: applies to dpo_loss_type \"sigmoid\" and \"robust\" only (expected 0 with \"{}\")",
                    self.label_smoothing,
                    self.dpo_loss_type.name()
                ),
                _ => {}
            }
        }
        if let Some(c) = self.loss_clip {
            range("loss_clip", c, 0.0, inf, true, true)?;
        }
        if let Some(g) = self.memory_limit {
            range("memory_limit", g, 0.0, inf, true, true)?;
        }
        if self.pack_tokens > 0 && !self.prefix_shared && self.method != Method::Sft {
            bail!(
                "pack_tokens = {}: packing runs each pair as one prefix-shared sequence; set \
                 prefix_shared = true (or pack_tokens = 0)",
                self.pack_tokens
            );
        }
        range("simpo_beta", self.simpo_beta, 0.0, inf, true, true)?;
        range("simpo_gamma", self.simpo_gamma, 0.0, inf, false, true)?;
        // The filter drops coefficients |(onehot - softmax)·softcap'| below it, and every such
        // coefficient is below 1: at 1 or more every term is dropped and every gradient is 0.
        range(
            "cce_filter_eps",
            self.cce_filter_eps as f64,
            0.0,
            1.0,
            false,
            true,
        )?;
        if self.log_every == 0 {
            bail!("log_every = 0: expected a whole number of steps, at least 1");
        }
        if self.steps > 0 {
            if let Some(w) = self.warmup_steps.filter(|&w| w > self.steps) {
                bail!(
                    "warmup_steps = {w}: expected at most steps ({})",
                    self.steps
                );
            }
        }
        let max_tokens = crate::train::memory::MAX_PASS_TOKENS / 2;
        if !(2..=max_tokens).contains(&self.max_seq_len) {
            bail!(
                "max_seq_len = {}: expected a whole number of tokens in [2, {max_tokens}]",
                self.max_seq_len
            );
        }
        if self.max_prompt_len == 0 {
            bail!("max_prompt_len = 0: expected a whole number of tokens, at least 1");
        }
        if self.pack_tokens > max_tokens {
            bail!(
                "pack_tokens = {}: expected at most {max_tokens} tokens",
                self.pack_tokens
            );
        }
        if let Some((k, _)) = self.rank_pattern.iter().find(|(_, &r)| r == 0) {
            bail!("rank_pattern.{k} = 0: expected a rank of at least 1");
        }
        self.validate_rank_scaling()?;
        if self.targets.is_empty() {
            bail!("targets is empty: name at least one projection (q, k, v, o, gate, up, down)");
        }
        if self.output.trim().is_empty() {
            bail!("output is empty: name the run's output folder (--output DIR)");
        }
        if let Some(t) = &self.chat_template {
            if t.trim().is_empty() {
                bail!("chat_template is empty: name a Jinja template file, or leave it unset to use the model's");
            }
            if !Path::new(t).is_file() {
                bail!("chat_template = {t:?}: no such file (expected a Jinja chat template file)");
            }
        }
        if self.max_prompt_len >= self.max_seq_len {
            // The default 1024 under a max_seq_len set alone (TRL's max_length = 1024, say) is
            // the usual cause: named, with the setting that lowers it.
            let default = if self.max_prompt_len == TrainConfig::default().max_prompt_len {
                ", its default"
            } else {
                ""
            };
            bail!(
                "max_prompt_len ({}{default}) must be below max_seq_len ({}), so that a response \
                 keeps some tokens: set max_prompt_len (TRL's max_prompt_length) lower, e.g. \
                 {}",
                self.max_prompt_len,
                self.max_seq_len,
                hint.how("max_prompt_len", (self.max_seq_len / 2).max(1))
            );
        }
        Ok(())
    }

    /// `rank_scaling` and the settings it reads or replaces. What needs the model (a GGUF base,
    /// the KL file's layers) is checked when the ranks are resolved (`train::rank_scaling`).
    fn validate_rank_scaling(&self) -> Result<()> {
        let scaling = self.rank_scaling.name();
        match (self.rank_scaling, &self.rank_kl_file) {
            (RankScaling::ByKl, None) => bail!(
                "rank_scaling = \"by_kl\" needs rank_kl_file: the per-layer KL JSON that `lorafit kl` writes"
            ),
            (RankScaling::ByKl, Some(f)) if !Path::new(f).is_file() => bail!(
                "rank_kl_file = {f:?}: no such file (expected the per-layer KL JSON that `lorafit kl` writes, for rank_scaling = \"by_kl\")"
            ),
            (RankScaling::None | RankScaling::ByBits, Some(f)) => bail!(
                "rank_kl_file = {f:?} is read only with rank_scaling = \"by_kl\" (rank_scaling is \"{scaling}\"; expected \"none\", \"by_bits\" or \"by_kl\")"
            ),
            _ => {}
        }
        if self.rank_scaling != RankScaling::None && !self.rank_pattern.is_empty() {
            bail!(
                "rank_pattern and rank_scaling = \"{scaling}\" both set per-module ranks: set one (rank_scaling = \"none\" keeps rank_pattern)"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::auto_head_chunk;
    use super::{DpoLossType, Method, RankScaling, TrainConfig};

    #[test]
    fn objective_settings_are_checked_by_name() {
        let base = TrainConfig {
            data: "train.jsonl".into(),
            output: "runs/x".into(),
            method: Method::Dpo,
            ..TrainConfig::default()
        };
        base.validate().unwrap();
        let err = |c: TrainConfig| c.validate().unwrap_err().to_string();
        let e = err(TrainConfig {
            dpo_loss_type: DpoLossType::Robust,
            label_smoothing: 0.5,
            ..base.clone()
        });
        assert!(
            e.contains("label_smoothing = 0.5") && e.contains("robust"),
            "{e}"
        );
        TrainConfig {
            dpo_loss_type: DpoLossType::Robust,
            label_smoothing: 0.3,
            ..base.clone()
        }
        .validate()
        .unwrap();
        for t in [DpoLossType::Ipo, DpoLossType::Hinge] {
            let e = err(TrainConfig {
                dpo_loss_type: t,
                label_smoothing: 0.1,
                ..base.clone()
            });
            assert!(e.contains("label_smoothing") && e.contains(t.name()), "{e}");
        }
        for clip in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = err(TrainConfig {
                loss_clip: Some(clip),
                ..base.clone()
            });
            assert!(e.contains("loss_clip"), "{e}");
        }
        TrainConfig {
            loss_clip: Some(2.0),
            ..base
        }
        .validate()
        .unwrap();
    }

    /// A plan with every optional setting set reads back as written: each name `to_toml`
    /// writes is one `setting_names` knows (an `Option` field missing from its list would make
    /// a run's own plan.toml unreadable).
    #[test]
    fn a_plan_with_every_optional_setting_reads_back() {
        let dir = std::env::temp_dir().join(format!("lorafit-plan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let full = TrainConfig {
            data: "train.jsonl".into(),
            output: "runs/x".into(),
            valid: Some("valid.jsonl".into()),
            warmup_steps: Some(3),
            rank_kl_file: Some("kl.json".into()),
            loss_clip: Some(2.0),
            chat_template: Some("{{ x }}".into()),
            segment_size: Some(2),
            keep_attention: Some(true),
            keep_kv_layers: Some(1),
            mlp_chunk: Some(4096),
            memory_limit: Some(23.5),
            offload: Some(true),
            pack_tokens: 4096,
            warm_start: Some("runs/old/adapter".into()),
            ..TrainConfig::default()
        };
        let text = full.to_toml().unwrap();
        let table: toml::Table = toml::from_str(&text).unwrap();
        let names = TrainConfig::setting_names();
        for key in table.keys() {
            assert!(
                names.contains(key),
                "plan.toml writes `{key}`, which reads as unknown"
            );
        }
        let path = dir.join("plan.toml");
        std::fs::write(&path, &text).unwrap();
        let back = TrainConfig::from_toml_file(&path).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(back.to_toml().unwrap(), text);
    }

    /// A TRL config's names: `beta` is the β of the method the run ends with (a flag's over the
    /// file's), `max_steps = -1` is "from the epochs", `warmup_steps = 0` leaves the warm-up to
    /// `warmup_ratio`, rounded up as transformers rounds it; PEFT's `r` and DPO's `loss_type`
    /// are lorafit's `rank` and `dpo_loss_type`.
    #[test]
    fn trl_settings_mean_what_they_mean_in_trl() {
        let dir = std::env::temp_dir().join(format!("lorafit-trl-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("trl.toml");
        std::fs::write(
            &path,
            "beta = 0.05\nmax_steps = -1\nwarmup_steps = 0\nwarmup_ratio = 0.1\nr = 8\n\
             loss_type = \"ipo\"\n",
        )
        .unwrap();
        let orpo = TrainConfig::from_toml_file(&path).unwrap();
        assert_eq!(orpo.orpo_lambda, 0.05);
        assert_eq!((orpo.steps, orpo.rank), (0, 8));
        assert_eq!(orpo.dpo_loss_type, DpoLossType::Ipo);
        // 0.1 × 25 = 2.5 steps: 3, as transformers' ceil; warmup_steps = 0 is "from the ratio".
        assert_eq!(orpo.resolved_warmup(25), 3);
        let explicit = TrainConfig {
            warmup_steps: Some(5),
            ..orpo.clone()
        };
        assert_eq!(explicit.resolved_warmup(25), 5);
        let dpo = TrainConfig::from_toml_file_for(&path, Some("dpo")).unwrap();
        assert_eq!((dpo.method, dpo.dpo_beta), (Method::Dpo, 0.05));
        assert_eq!(dpo.orpo_lambda, TrainConfig::default().orpo_lambda);
        let simpo = TrainConfig::from_toml_file_for(&path, Some("simpo")).unwrap();
        assert_eq!(simpo.simpo_beta, 0.05);
        // Under ORPO the DPO `loss_type` is taken and not used: said.
        assert_eq!(
            orpo.other_methods_settings().unwrap(),
            ["dpo_loss_type = \"ipo\" (TRL's `loss_type`)"]
        );
        assert!(dpo.other_methods_settings().unwrap().is_empty());
        // transformers' and PEFT's spellings of values: adam_epsilon, "all-linear", a
        // one-element loss_type list; a share of the steps is refused with what to give.
        std::fs::write(
            &path,
            "adam_epsilon = 1e-6\ntarget_modules = \"all-linear\"\nloss_type = [\"ipo\"]\n",
        )
        .unwrap();
        let c = TrainConfig::from_toml_file(&path).unwrap();
        assert_eq!(c.adam_eps, 1e-6);
        assert_eq!(c.targets, TrainConfig::default().targets);
        assert_eq!(c.dpo_loss_type, DpoLossType::Ipo);
        std::fs::write(&path, "eval_steps = 0.1\n").unwrap();
        let e = format!("{:#}", TrainConfig::from_toml_file(&path).unwrap_err());
        assert!(e.contains("give a number of steps"), "{e}");
        // Several unknown names: each said, the list of settings once.
        std::fs::write(&path, "foo_bar = 1\nbazqux = 2\nrpo_alpha = 1.0\n").unwrap();
        let e = format!("{:#}", TrainConfig::from_toml_file(&path).unwrap_err());
        assert_eq!(e.matches("settings: ").count(), 1, "{e}");
        assert!(
            e.contains("`bazqux`") && e.contains("no NLL term (RPO)"),
            "{e}"
        );
        std::fs::write(&path, "lora_alpha = 0\n").unwrap();
        let e = format!("{:#}", TrainConfig::from_toml_file(&path).unwrap_err());
        assert!(e.contains("scales PEFT's adapter by 0"), "{e}");
        std::fs::write(&path, "loss_type = \"simpo\"\n").unwrap();
        let e = format!("{:#}", TrainConfig::from_toml_file(&path).unwrap_err());
        assert!(e.contains("method = \"simpo\""), "{e}");
        let e = TrainConfig::setting_name("use_dora", "orpo")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not DoRA"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// transformers' and TRL's run life-cycle settings: `overwrite_output_dir` is `overwrite`,
    /// the others are answered with what lorafit does; an empty name and a negative whole number
    /// are said as such.
    #[test]
    fn life_cycle_settings_and_bad_names_are_answered() {
        assert_eq!(
            TrainConfig::setting_name("overwrite_output_dir", "orpo").unwrap(),
            "overwrite"
        );
        for (key, says) in [
            ("resume_from_checkpoint", "--resume DIR"),
            (
                "load_best_model_at_end",
                "best/ holds the adapter of the best validation margin",
            ),
            ("metric_for_best_model", "best validation margin"),
            ("save_safetensors", "always saves safetensors"),
            ("save_only_model", "adapter and the optimiser state"),
            ("eval_on_start", "validates at step 0"),
            ("data_seed", "seed governs the data order"),
        ] {
            let e = TrainConfig::setting_name(key, "orpo")
                .unwrap_err()
                .to_string();
            assert!(e.contains(says) && !e.contains("unknown"), "{key}: {e}");
        }
        let e = TrainConfig::setting_name("", "orpo")
            .unwrap_err()
            .to_string();
        assert!(e.contains("name is empty"), "{e}");
        for (given, name) in [("save_every", "save_every"), ("lora_r", "rank")] {
            let e = TrainConfig::trl_value(given, name, toml::Value::Integer(-1))
                .unwrap_err()
                .to_string();
            assert_eq!(e, format!("{given} = -1: expected a whole number >= 0"));
        }
        let e = TrainConfig::trl_value("segment_size", "segment_size", toml::Value::Integer(-2));
        assert!(e.is_err());
        let steps = TrainConfig::trl_value("max_steps", "steps", toml::Value::Integer(-1));
        assert_eq!(steps.unwrap(), toml::Value::Integer(0));
        let lr = TrainConfig::trl_value("lr", "lr", toml::Value::Integer(-1));
        assert_eq!(lr.unwrap(), toml::Value::Integer(-1), "validate() says it");
    }

    #[test]
    fn rank_scaling_is_checked_by_name() {
        let base = TrainConfig {
            data: "train.jsonl".into(),
            output: "runs/x".into(),
            ..TrainConfig::default()
        };
        assert_eq!(base.rank_scaling, RankScaling::None);
        let e = toml::from_str::<TrainConfig>("rank_scaling = \"by_size\"")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("rank_scaling") && e.contains("by_bits") && e.contains("by_kl"),
            "{e}"
        );
        let c: TrainConfig = toml::from_str("rank_scaling = \"by_bits\"").unwrap();
        assert_eq!(c.rank_scaling, RankScaling::ByBits);
        let err = |c: TrainConfig| c.validate().unwrap_err().to_string();
        let e = err(TrainConfig {
            rank_scaling: RankScaling::ByKl,
            ..base.clone()
        });
        assert!(e.contains("by_kl") && e.contains("rank_kl_file"), "{e}");
        let e = err(TrainConfig {
            rank_scaling: RankScaling::ByKl,
            rank_kl_file: Some("/nonexistent/kl.json".into()),
            ..base.clone()
        });
        assert!(
            e.contains("rank_kl_file") && e.contains("no such file"),
            "{e}"
        );
        let e = err(TrainConfig {
            rank_kl_file: Some("kl.json".into()),
            ..base.clone()
        });
        assert!(
            e.contains("rank_kl_file") && e.contains("rank_scaling"),
            "{e}"
        );
        let e = err(TrainConfig {
            rank_scaling: RankScaling::ByBits,
            rank_pattern: [("q_proj".to_string(), 4)].into(),
            ..base.clone()
        });
        assert!(e.contains("rank_pattern") && e.contains("by_bits"), "{e}");
        TrainConfig {
            rank_scaling: RankScaling::ByBits,
            ..base
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn head_chunks_fit_256_mib_in_whole_row_tiles() {
        // 256 MiB of f32 logits is 523 rows at Llama 3's vocabulary, 441 at Qwen2's.
        assert_eq!(auto_head_chunk(128_256), 512);
        assert_eq!(auto_head_chunk(151_936), 384);
        assert_eq!(auto_head_chunk(49_152), 1280);
        // Under 128 rows: as many as fit, at least 64.
        assert_eq!(auto_head_chunk(600_000), 111);
        assert_eq!(auto_head_chunk(1 << 20), 64);
        assert_eq!(auto_head_chunk(4 << 20), 64);
    }
}
