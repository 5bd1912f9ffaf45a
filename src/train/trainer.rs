//! The training loop: data → tokenised examples → micro-steps with gradient accumulation →
//! AdamW on schedule, with a progress bar, metrics.jsonl, validation, atomic checkpoints (the best
//! by validation margin kept) and exact resume.

use super::device_loss::ExampleScale;
use super::device_loss::Reference;
use super::events::{Fanout, PassRecord, RunStart, StepRecord, TrainEvent, TrainEvents};
use super::lambda_controller::{check_adaptive, LambdaController, LambdaParams};
use super::listeners::{Console, MetricsFile, Plots, TensorBoard};
use super::optim::{apply_update, AdamState, OptimOptions};
use super::plan::Plan;
use super::run_folder::{self, Cycle, CycleSchedule};
use super::step::{
    queue_example, queue_example_scaled, queue_packed, reference_logps, Objective, PackMember,
    PassOptions,
};
use crate::config::{LambdaSchedule, Method, TrainConfig};
use crate::data::{self, ChatTemplate, DatasetKind, TextTokenizer, TokenRules, TokenizeOptions};
use crate::model::{self, Lora, LoraConfig, Model};
use crate::tensor::Rng;
use crate::tensor::{DType, Device, Tensor};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A tokenised training or validation example, with its weight and where its row sits.
pub struct Item {
    pub tokens: ItemTokens,
    /// The example's weight in the training loss: 1 unless its (preference) row sets a `weight`,
    /// which scales its loss and gradient.
    pub weight: f64,
    /// Its row's place, `file:line` or `file: row N` (empty for examples made in code), so that a
    /// step that fails names the row a user can open.
    pub at: String,
}

/// The token ids of an `Item`.
#[derive(PartialEq, Eq, Hash)]
pub enum ItemTokens {
    Pair(data::TokenizedPair),
    Sft(data::TokenizedSft),
}

impl Item {
    /// A preference pair of weight 1 made in code (no row to name).
    pub fn pair(p: data::TokenizedPair) -> Item {
        Item {
            tokens: ItemTokens::Pair(p),
            weight: 1.0,
            at: String::new(),
        }
    }

    /// An SFT example made in code (no row to name).
    pub fn sft(s: data::TokenizedSft) -> Item {
        Item {
            tokens: ItemTokens::Sft(s),
            weight: 1.0,
            at: String::new(),
        }
    }

    /// The pair's ids, for a preference example.
    pub fn as_pair(&self) -> Option<&data::TokenizedPair> {
        match &self.tokens {
            ItemTokens::Pair(p) => Some(p),
            ItemTokens::Sft(_) => None,
        }
    }

    pub fn plan(&self, prefix_shared: bool) -> Result<Plan> {
        match &self.tokens {
            ItemTokens::Pair(p) => Plan::pair(p, prefix_shared),
            ItemTokens::Sft(s) => Plan::sft(&s.prompt, &s.completion),
        }
    }

    /// How an error names this training example: its row's place, else its index among
    /// `data`'s examples.
    pub fn describe(&self, idx: usize, data: &str) -> String {
        self.describe_as("training", idx, data)
    }

    /// [`Item::describe`] for an example of another role (`validation`, `scored`).
    pub fn describe_as(&self, role: &str, idx: usize, data: &str) -> String {
        if self.at.is_empty() {
            format!("{role} example {idx} of {data} (0-based)")
        } else {
            format!("the {role} example at {}", self.at)
        }
    }
}

/// Model, tokenizer and chat template, loaded once.
pub struct Loaded {
    pub model: Model,
    pub tokenizer: TextTokenizer,
    pub template: Option<ChatTemplate>,
    pub model_path: PathBuf,
}

/// Whether `model` is the name of a model lorafit knows (`smollm2`), not a path.
pub fn builtin_model(model: &str) -> bool {
    model == "smollm2"
}

/// The Hub id of the built-in `smollm2`, as PEFT names its base.
const SMOLLM2_HUB_ID: &str = "HuggingFaceTB/SmolLM2-135M-Instruct";

/// What an adapter's `base_model_name_or_path` says for a run of model `given` (the setting)
/// loaded from `path`: the Hub id for the built-in model and for one given as a Hub id, a Hugging
/// Face folder's absolute path, and any other file (a GGUF, which PEFT cannot load) as its path.
pub fn peft_base_name(given: &str, path: &Path) -> String {
    if builtin_model(given) {
        return SMOLLM2_HUB_ID.to_string();
    }
    if !Path::new(given).exists() && crate::hub_cache::hub_id(given).is_some() {
        return given.to_string();
    }
    if path.is_dir() {
        if let Ok(absolute) = path.canonicalize() {
            return absolute.display().to_string();
        }
    }
    path.display().to_string()
}

/// Resolves "smollm2" to the cached GGUF (fetching it once), a Hub id that is no local path
/// (`org/name`) to its snapshot in the Hugging Face cache (`crate::hub_cache`), else the given
/// path.
pub fn resolve_model_path(s: &str) -> Result<PathBuf> {
    if builtin_model(s) {
        return model::smollm2::locate_or_fetch();
    }
    let path = PathBuf::from(s);
    if path.exists() || crate::hub_cache::hub_id(s).is_none() {
        return Ok(path);
    }
    let cache = crate::hub_cache::root();
    match crate::hub_cache::model_snapshot(s, cache.as_deref())? {
        Some(snapshot) => {
            eprintln!(
                "model {s}: the Hugging Face cache's snapshot {}",
                snapshot.display()
            );
            Ok(snapshot)
        }
        None => bail!(
            "model {s}: no such path, and the Hugging Face cache ({}) does not hold it; lorafit \
             downloads nothing: download it first (for example `huggingface-cli download {s}`) \
             or name a local folder or .gguf file",
            cache.map_or("not found".to_string(), |c| c.display().to_string())
        ),
    }
}

/// What a run of `cfg` reads its data and trains with: its model and base encoding, the model's
/// tokenizer, and its chat template or the `chat_template` setting's. Training (the command and
/// the job server's jobs) and `lorafit eval` load through here, so that a run's `plan.toml`
/// gives eval the template it trained with.
pub fn load_configured(cfg: &TrainConfig, device: &Device) -> Result<Loaded> {
    load_with_template(
        &cfg.model,
        device,
        cfg.base_quant,
        cfg.chat_template.as_deref(),
    )
}

/// [`load_model_and_tokenizer`] with `chat_template` (a Jinja file or a tokenizer_config.json),
/// when given, in place of the model's template (`generate` and `chat` take the training run's).
pub fn load_with_template(
    model_arg: &str,
    device: &Device,
    quant: model::BaseQuant,
    chat_template: Option<&str>,
) -> Result<Loaded> {
    let mut loaded = load_model_and_tokenizer(model_arg, device, quant)?;
    loaded.template =
        data::model_files::run_template(chat_template, loaded.template, &loaded.tokenizer)?;
    Ok(loaded)
}

/// The model (its projections encoded as `quant` on load) and its tokenizer and template.
pub fn load_model_and_tokenizer(
    model_arg: &str,
    device: &Device,
    quant: model::BaseQuant,
) -> Result<Loaded> {
    let path = resolve_model_path(model_arg)?;
    let model = model::load_quantized(&path, device, quant)
        .map_err(|e| crate::data::model_files::explain_model_error(&path, e))?;
    let (tokenizer, template) =
        data::model_files::load_tokenizer(&path, || Ok(model.spec.eos_token_id))?;
    Ok(Loaded {
        model,
        tokenizer,
        template,
        model_path: path,
    })
}

/// The run's training and validation examples: `cfg.data`, and `cfg.valid` or, with
/// `valid_fraction`, that fraction of the training rows held out by a permutation seeded with
/// `cfg.seed` (each side keeps the file's order). What was held out is said on stderr.
pub fn load_train_and_valid(loaded: &Loaded, cfg: &TrainConfig) -> Result<(Vec<Item>, Vec<Item>)> {
    let train = load_items(&cfg.data, None, cfg.method, loaded, cfg)?;
    let (train, valid) = if let Some(v) = &cfg.valid {
        (train, load_items(v, None, cfg.method, loaded, cfg)?)
    } else if cfg.valid_fraction == 0.0 {
        eprintln!(
            "no validation: no valid file and valid_fraction = 0 (pass --valid FILE, or \
             --set valid_fraction=0.05 to hold out a share of the training rows)"
        );
        (train, Vec::new())
    } else {
        let (train, valid) = hold_out(train, cfg.valid_fraction, cfg.seed)?;
        eprintln!(
            "valid_fraction = {}: {} of {} training rows held out for validation (seed {})",
            cfg.valid_fraction,
            valid.len(),
            train.len() + valid.len(),
            cfg.seed
        );
        (train, valid)
    };
    // Past the model's context (its max_position_embeddings) lie positions the base never
    // trained on; generation refuses them, training says so.
    let context = crate::infer::context_length(&loaded.model);
    let longest = train
        .iter()
        .chain(&valid)
        .map(|i| match &i.tokens {
            ItemTokens::Pair(p) => p.max_len(),
            ItemTokens::Sft(s) => s.len(),
        })
        .max()
        .unwrap_or(0);
    if longest > context {
        eprintln!(
            "note: the longest sequence has {longest} tokens, more than the model's context of \
             {context} positions (max_position_embeddings): past it the base was never trained; \
             --set max_seq_len={context} keeps every row within it"
        );
    }
    // Validation on rows the run trains on measures memory, not generalisation: said.
    if cfg.valid.is_some() && !valid.is_empty() {
        let trained: std::collections::HashSet<&ItemTokens> =
            train.iter().map(|i| &i.tokens).collect();
        let shared = valid.iter().filter(|i| trained.contains(&i.tokens)).count();
        if shared > 0 {
            eprintln!(
                "note: {shared} of the {} validation rows ({}) are also training rows (the same \
                 tokens): validation on them measures what the run memorised",
                valid.len(),
                cfg.valid.as_deref().unwrap_or_default()
            );
        }
    }
    // Weight 0 is allowed per row, but a run of nothing else has a zero loss and gradient at
    // every step: the adapter would leave as it came.
    if !train.is_empty() && train.iter().all(|i| i.weight == 0.0) {
        bail!(
            "{}: every training example has weight 0, so every step's loss and gradient are \
             zero and the adapter cannot change; give the rows to train on a weight above 0",
            cfg.data
        );
    }
    Ok((train, valid))
}

/// Splits `items` into (train, held out): `round(n·fraction)` rows (at least 1, at most n − 1)
/// chosen by a permutation seeded with `seed`, each side in the original order.
pub fn hold_out<T>(items: Vec<T>, fraction: f64, seed: u64) -> Result<(Vec<T>, Vec<T>)> {
    let n = items.len();
    if n < 2 {
        bail!("valid_fraction = {fraction}: {n} training row(s), and holding out rows needs at least 2");
    }
    let n_valid = ((n as f64 * fraction).round() as usize).clamp(1, n - 1);
    let held = crate::tensor::Rng(seed ^ 0x7A11_D05E).choose(n, n_valid);
    let (mut train, mut valid) = (Vec::with_capacity(n - n_valid), Vec::with_capacity(n_valid));
    for (item, h) in items.into_iter().zip(held) {
        if h {
            valid.push(item);
        } else {
            train.push(item);
        }
    }
    Ok((train, valid))
}

/// Reads, tokenises and checks a dataset (any file `data::rows` reads, or the shards a pattern
/// names) for `method` (`data::check`: the same checks as `lorafit lint`), printing their
/// summary. A bad row fails here, naming file, line and field, or with `skip_bad_rows` is
/// skipped and counted, before the first step.
pub fn load_items(
    path: &str,
    text: Option<&str>,
    method: Method,
    loaded: &Loaded,
    cfg: &TrainConfig,
) -> Result<Vec<Item>> {
    let opts = check_options(cfg, method, loaded.model.spec.vocab);
    let (rows, report) = data::load_and_check(
        path,
        text,
        &loaded.tokenizer,
        loaded.template.as_ref(),
        &opts,
    )?;
    log_tokenize(&report);
    Ok(rows
        .into_iter()
        .map(|r| Item {
            tokens: match r.tokens {
                data::RowTokens::Pair(p) => ItemTokens::Pair(p),
                data::RowTokens::Sft(s) => ItemTokens::Sft(s),
            },
            weight: r.weight,
            at: r.at,
        })
        .collect())
}

/// How a run of `cfg` reads and checks rows of `method` against a model of `model_vocab` tokens:
/// the rows' kind, `skip_bad_rows`, the length limits and tokenization rules (`load_items`;
/// `lorafit lint` adds the other tokenization to compare).
pub fn check_options(cfg: &TrainConfig, method: Method, model_vocab: usize) -> data::CheckOptions {
    let rules = TokenRules::resolve(cfg.tokenization, method);
    data::CheckOptions {
        kind: if method == Method::Sft {
            DatasetKind::Sft
        } else {
            DatasetKind::Preference
        },
        skip_bad: cfg.skip_bad_rows,
        tokenize: TokenizeOptions::new(cfg.max_seq_len, cfg.max_prompt_len).with_rules(rules),
        compare: None,
        model_vocab,
    }
}

fn log_tokenize(report: &data::CheckReport) {
    eprintln!("{report}");
}

/// Optimiser and data position saved with each checkpoint.
#[derive(Serialize, Deserialize, Clone, Debug)]
pub struct TrainerState {
    pub step: usize,
    /// Examples consumed so far (the data order is a pure function of seed and position).
    pub position: usize,
    pub best_margin: Option<f64>,
    pub total_steps: usize,
    /// `run_folder::items_hash` of the training examples (absent in older checkpoints).
    #[serde(default)]
    pub data_hash: Option<String>,
    /// The schedule's cycles: one, plus one per continuation past the planned end (absent in
    /// older checkpoints: one cycle of `total_steps`).
    #[serde(default)]
    pub cycles: Vec<Cycle>,
    /// `run_folder::base_fingerprint` of the base model's files (absent in older checkpoints):
    /// a resume on another base is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_hash: Option<String>,
    /// The ORPO λ controller (`orpo_lambda_schedule = "adaptive"` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub orpo_lambda: Option<LambdaController>,
}

/// Example index at data position `pos`: a fresh seeded permutation per epoch.
pub fn example_index(pos: usize, n: usize, seed: u64) -> usize {
    DataOrder::new(n, seed).index(pos)
}

/// The data order over `n` examples (`example_index`), keeping the permutation of the epoch last
/// asked for: the train loop asks at every micro-step, and drawing the permutation each time
/// cost `n` draws and an allocation per micro-step.
pub struct DataOrder {
    n: usize,
    seed: u64,
    epoch: Option<(usize, Vec<usize>)>,
}

impl DataOrder {
    pub fn new(n: usize, seed: u64) -> DataOrder {
        DataOrder {
            n,
            seed,
            epoch: None,
        }
    }

    pub fn index(&mut self, pos: usize) -> usize {
        let epoch = pos / self.n;
        let seed = self.seed;
        let perm = match &mut self.epoch {
            Some((e, perm)) if *e == epoch => perm,
            slot => {
                let perm = Rng(seed ^ 0xDA7A_0000 ^ (epoch as u64).wrapping_mul(0x9E37_79B9))
                    .permutation(self.n);
                &mut slot.insert((epoch, perm)).1
            }
        };
        perm[pos % self.n]
    }
}

/// The error of a run whose final adapter was written whole and whose final checkpoint (or the
/// pruning after it) failed: the adapter is the run's result; only extending the run needs the
/// checkpoint.
#[derive(Debug)]
pub struct FinalCheckpointFailed {
    pub adapter_dir: PathBuf,
    pub step: usize,
    /// Why the checkpoint failed (a full disk, say).
    pub cause: String,
}

impl std::fmt::Display for FinalCheckpointFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the run's adapter in {} is complete (step {}), but its final checkpoint could not \
             be written ({}); the adapter is the run's result, kept as it is (--overwrite \
             (overwrite = true) of this folder would delete it; to train further, start a run in another folder with \
             --warm-start {})",
            self.adapter_dir.display(),
            self.step,
            self.cause,
            self.adapter_dir.display()
        )
    }
}

impl std::error::Error for FinalCheckpointFailed {}

pub struct TrainOutcome {
    pub final_valid: Option<BTreeMap<String, f64>>,
    pub first_valid: Option<BTreeMap<String, f64>>,
    pub losses: Vec<f64>,
    /// The final adapter, or for a stopped run the adapter of its last checkpoint.
    pub adapter_dir: PathBuf,
    /// A listener asked the run to stop before its last step.
    pub stopped: bool,
}

/// The step's examples (`micros`, in order) as runs of consecutive examples: one each without
/// packing (`pack_tokens` 0), else as many as fit `pack_tokens` tokens together (an example
/// longer than that runs alone).
fn pack_groups(micros: &[(usize, usize, Plan)], pack_tokens: usize) -> Vec<std::ops::Range<usize>> {
    let mut groups: Vec<std::ops::Range<usize>> = Vec::new();
    let mut tokens = 0;
    for (i, (_, _, plan)) in micros.iter().enumerate() {
        let t = plan.tokens();
        match groups.last_mut() {
            Some(g) if pack_tokens > 0 && tokens + t <= pack_tokens => {
                g.end = i + 1;
                tokens += t;
            }
            _ => {
                groups.push(i..i + 1);
                tokens = t;
            }
        }
    }
    groups
}

/// Pass options for one example of `tokens` tokens; an unset segment size is chosen against
/// `budget` bytes of free device memory.
pub fn pass_options(
    cfg: &TrainConfig,
    model: &Model,
    tokens: usize,
    budget: usize,
    dropout: Option<(f32, u64)>,
) -> PassOptions {
    pass_options_for(cfg, step_shape(cfg, model, tokens), budget, dropout)
}

/// [`pass_options`] for a pass as the planner sees it (`step_shape_of`), with no model loaded.
pub fn pass_options_for(
    cfg: &TrainConfig,
    shape: super::memory::StepShape,
    budget: usize,
    dropout: Option<(f32, u64)>,
) -> PassOptions {
    let plan = super::memory::resolve_plan(
        shape,
        cfg.segment_size,
        cfg.keep_attention,
        cfg.keep_kv_layers,
        cfg.mlp_chunk,
        cfg.offload,
        budget,
    );
    PassOptions {
        segment_size: plan.segment_size,
        keep_attention: plan.keep_attention,
        keep_kv_layers: plan.keep_kv_layers,
        mlp_chunk: plan.mlp_chunk,
        offload: plan.offload,
        nested: plan.nested,
        resident_layers: plan.resident_layers,
        full_layers: plan.full_layers,
        head: cfg.head,
        head_chunk: shape.head_chunk_rows,
        dropout,
    }
}

/// One pass over `tokens` tokens as the memory planner sees it (the MLP chunk as the user set it).
pub fn step_shape<'a>(
    cfg: &TrainConfig,
    model: &'a Model,
    tokens: usize,
) -> super::memory::StepShape<'a> {
    let mut shape = step_shape_of(
        cfg,
        &model.spec,
        model.device.compute_dtype().size(),
        tokens,
        super::memory::host_budget(&model.device, cfg.offload),
    );
    shape.dequantized = dequantized_bytes(model);
    shape
}

/// `StepShape::dequantized` of `model`: its largest quantized weight, dense in the compute dtype.
fn dequantized_bytes(model: &Model) -> usize {
    model.weights.largest_quantized() * model.device.compute_dtype().size()
}

/// [`step_shape`] of a model of `spec` computing in a dtype of `dtype_bytes`, with
/// `host_budget` bytes of host memory for offload (and a dense base: `dequantized` 0).
pub fn step_shape_of<'a>(
    cfg: &TrainConfig,
    spec: &'a crate::model::ModelSpec,
    dtype_bytes: usize,
    tokens: usize,
    host_budget: usize,
) -> super::memory::StepShape<'a> {
    super::memory::StepShape {
        spec,
        tokens,
        mlp_chunked: cfg.mlp_chunk.is_some_and(|c| c > 0),
        dtype_bytes,
        head_chunk_rows: crate::config::resolve_head_chunk(cfg.head_chunk, spec.vocab),
        offload: false,
        host_budget,
        nested: false,
        resident: 0,
        dequantized: 0,
        full: 0,
    }
}

/// `memory::estimate` of one pass over `tokens` tokens run with `opts`: the activation bytes its
/// plan keeps.
pub fn pass_estimate_bytes(model: &Model, tokens: usize, opts: &PassOptions) -> usize {
    pass_estimate(model, tokens, opts).total()
}

/// [`pass_estimate_bytes`], term by term.
pub fn pass_estimate(model: &Model, tokens: usize, opts: &PassOptions) -> super::memory::Estimate {
    let shape = super::memory::StepShape {
        spec: &model.spec,
        tokens,
        mlp_chunked: opts.mlp_chunk > 0,
        dtype_bytes: model.device.compute_dtype().size(),
        head_chunk_rows: opts.head_chunk,
        offload: opts.offload,
        host_budget: 0,
        nested: opts.nested,
        resident: opts.resident_layers,
        dequantized: dequantized_bytes(model),
        full: opts.full_layers,
    };
    super::memory::estimate(shape, &keep_plan(opts))
}

/// The memory plan of `opts`.
pub fn keep_plan(opts: &PassOptions) -> super::memory::KeepPlan {
    super::memory::KeepPlan {
        segment_size: opts.segment_size,
        keep_attention: opts.keep_attention,
        keep_kv_layers: opts.keep_kv_layers,
        mlp_chunk: opts.mlp_chunk,
        offload: opts.offload,
        nested: opts.nested,
        resident_layers: opts.resident_layers,
        full_layers: opts.full_layers,
    }
}

/// A budget under which the planner picks a plan of a smaller estimate than `opts`' for a pass
/// of `tokens` tokens (three quarters of that estimate, lowered until the plan changes); `None`
/// when `opts` is already the smallest plan the settings allow.
fn smaller_plan_budget(
    cfg: &TrainConfig,
    model: &Model,
    tokens: usize,
    opts: &PassOptions,
) -> Option<usize> {
    let failed = pass_estimate_bytes(model, tokens, opts);
    let mut budget = failed / 4 * 3;
    loop {
        let next = pass_options(cfg, model, tokens, budget, None);
        let bytes = pass_estimate_bytes(model, tokens, &next);
        if bytes < failed {
            return Some(budget.max(bytes));
        }
        if budget == 0 {
            return None;
        }
        budget /= 2;
    }
}

/// Refuses, before the first step, a run whose longest training example does not fit `budget`
/// bytes of activations on the plan it would get: naming the example, the plan, the largest
/// terms of its estimate and the longest pass that would fit. On the CPU only with
/// `memory_limit` set (the CPU's planning budget is a fixed figure, not the machine's memory).
pub fn refuse_unless_longest_fits(
    cfg: &TrainConfig,
    model: &Model,
    items: &[Item],
    budget: usize,
) -> Result<()> {
    if !model.device.is_cuda() && cfg.memory_limit.is_none() {
        return Ok(());
    }
    // The pass lengths without building every plan: a shared prompt runs once.
    let length = |it: &Item| match &it.tokens {
        ItemTokens::Pair(p) => {
            let prompt = if cfg.prefix_shared { 1 } else { 2 };
            prompt * p.prompt.len() + p.chosen.len() + p.rejected.len()
        }
        ItemTokens::Sft(s) => s.prompt.len() + s.completion.len(),
    };
    let Some((idx, item)) = items.iter().enumerate().max_by_key(|(_, it)| length(it)) else {
        return Ok(());
    };
    // A pack runs up to `pack_tokens` tokens in one pass.
    let tokens = item.plan(cfg.prefix_shared)?.tokens().max(cfg.pack_tokens);
    let opts = pass_options(cfg, model, tokens, budget, None);
    let estimate = pass_estimate(model, tokens, &opts);
    if estimate.total() <= budget {
        return Ok(());
    }
    let size = super::memory::size_text;
    let held = model.device.memory().live_bytes;
    if let Some(m) = super::memory::model_over_limit(held, cfg.memory_limit) {
        bail!("{m}");
    }
    let shape = step_shape(cfg, model, tokens);
    let available = match cfg.memory_limit {
        Some(g) if model.device.is_cuda() => format!(
            "{} are left for them under memory_limit = {g} (weights, adapter and optimiser \
             state hold {})",
            size(budget),
            size(held)
        ),
        Some(g) => format!(
            "{} are left for them under memory_limit = {g} (on the CPU the limit is for the \
             step's activations alone)",
            size(budget)
        ),
        None => format!(
            "{} of the device's free memory are left for them (less a margin)",
            size(budget)
        ),
    };
    let fixed = cfg.segment_size.is_some()
        || cfg.keep_attention == Some(true)
        || cfg.keep_kv_layers.is_some_and(|k| k > 0)
        || cfg.mlp_chunk == Some(0);
    let (_, smallest) = shape.smallest(cfg.mlp_chunk, cfg.offload);
    let advice = if fixed && smallest.total() <= budget {
        format!(
            "The planner's smallest plan needs {}: unset segment_size, keep_attention, \
             keep_kv_layers and mlp_chunk to let it choose",
            size(smallest.total())
        )
    } else {
        let longest = super::memory::longest_that_fits(shape, cfg.mlp_chunk, cfg.offload, budget);
        let more = if cfg.memory_limit.is_some() {
            "raise memory_limit"
        } else {
            "train on a device with more free memory"
        };
        format!(
            "The longest pass that fits is about {longest} tokens: lower max_seq_len and \
             max_prompt_len, drop the longest rows, or {more}"
        )
    };
    let what = if tokens > item.plan(cfg.prefix_shared)?.tokens() {
        format!("a pack of pack_tokens = {}", cfg.pack_tokens)
    } else {
        format!("{}, the longest,", item.describe(idx, &cfg.data))
    };
    bail!(
        "{what} runs {tokens} tokens in one pass; its plan ({}) needs an estimated {} of \
         activations and {available}. Largest terms: {}. {advice}",
        super::memory::describe_plan(&keep_plan(&opts)),
        size(estimate.total()),
        estimate.largest(3)
    )
}

/// Mean metrics over `items` without gradients.
pub fn evaluate(
    model: &Model,
    lora: &mut Lora,
    items: &[Item],
    cfg: &TrainConfig,
) -> Result<BTreeMap<String, f64>> {
    evaluate_objective(model, lora, items, cfg, cfg.objective())
}

/// [`evaluate`] under `objective` (an adaptive ORPO run's λ of the moment).
pub fn evaluate_objective(
    model: &Model,
    lora: &mut Lora,
    items: &[Item],
    cfg: &TrainConfig,
    objective: Objective,
) -> Result<BTreeMap<String, f64>> {
    let opts = pass_options(cfg, model, 0, usize::MAX, None);
    let n = if cfg.eval_limit > 0 {
        cfg.eval_limit.min(items.len())
    } else {
        items.len()
    };
    let mut sums: BTreeMap<String, f64> = BTreeMap::new();
    for (i, item) in items[..n].iter().enumerate() {
        let metrics = score_example(model, lora, item, &objective, cfg, &opts)
            .with_context(|| item.describe_as("validation", i, "the validation data"))?;
        for (k, v) in metrics {
            *sums.entry(k.to_string()).or_default() += v;
        }
    }
    sums.values_mut().for_each(|v| *v /= n as f64);
    Ok(sums)
}

/// One example's objective metrics without gradients (DPO's reference logps included), as
/// validation and `lorafit eval` compute them: `opts` are `pass_options` with no memory plan.
pub fn score_example(
    model: &Model,
    lora: &mut Lora,
    item: &Item,
    objective: &Objective,
    cfg: &TrainConfig,
    opts: &PassOptions,
) -> Result<Vec<(&'static str, f64)>> {
    let plan = item.plan(cfg.prefix_shared)?;
    let reference = match objective {
        Objective::Dpo { .. } => Some(reference_logps(model, &plan, opts)?),
        _ => None,
    };
    let out = queue_example(
        model,
        lora,
        &plan,
        objective,
        reference.as_ref(),
        opts,
        false,
        1.0,
    )?
    .finish()?;
    Ok(out.metrics)
}

/// Runs training as configured, reporting to the console. `resume` continues from a checkpoint
/// folder.
pub fn train(
    cfg: &TrainConfig,
    resume: Option<&Path>,
    loaded: &Loaded,
    train_items: &[Item],
    valid_items: &[Item],
) -> Result<TrainOutcome> {
    let mut console = Console::new(loaded.model.device.is_cuda());
    train_with(cfg, resume, loaded, train_items, valid_items, &mut console)
}

/// Runs training as configured; every record goes to metrics.jsonl and to `listener`.
pub fn train_with(
    cfg: &TrainConfig,
    resume: Option<&Path>,
    loaded: &Loaded,
    train_items: &[Item],
    valid_items: &[Item],
    listener: &mut dyn TrainEvents,
) -> Result<TrainOutcome> {
    check_adaptive(cfg, valid_items.len())?;
    let model = &loaded.model;
    let device = model.device.clone();
    // The adapter's settings with the per-module ranks of `rank_scaling` resolved on this base
    // (before the output folder is touched: a bad KL file or base leaves it as it was).
    let lora_config = super::rank_scaling::lora_config(cfg, &model.spec, &loaded.model_path)?;
    let out_dir = PathBuf::from(&cfg.output);
    let checkpoint = resume.map(run_folder::find_checkpoint).transpose()?;
    // Read before the folder is prepared: a checkpoint that cannot be read is refused before
    // --overwrite deletes anything.
    let mut from_checkpoint = (checkpoint.as_ref())
        .map(|dir| load_checkpoint(dir, model, &device))
        .transpose()?;
    // Held until the run returns: no other process writes this folder meanwhile.
    let _lock = run_folder::prepare(&out_dir, checkpoint.as_deref(), cfg.overwrite)?;
    let base_name = peft_base_name(&cfg.model, &loaded.model_path);

    let n = train_items.len();
    let mut order = DataOrder::new(n, cfg.seed);
    let planned_steps = if cfg.steps > 0 {
        cfg.steps
    } else {
        ((cfg.epochs * n as f64) / cfg.grad_accum as f64)
            .ceil()
            .max(1.0) as usize
    };
    // As `validate` refuses it against `steps`, now that the epochs' steps are known.
    if let Some(w) = cfg
        .warmup_steps
        .filter(|&w| cfg.steps == 0 && checkpoint.is_none() && w > planned_steps)
    {
        bail!(
            "warmup_steps = {w}: expected at most the run's {planned_steps} steps (epochs = {} \
             of {n} examples, grad_accum = {})",
            cfg.epochs,
            cfg.grad_accum
        );
    }
    if cfg.grad_accum > n {
        eprintln!(
            "note: grad_accum = {} is more than the {n} training examples: each step takes \
             examples of more than one pass over the data",
            cfg.grad_accum
        );
    } else if cfg.steps == 0 {
        // Every step takes grad_accum examples: where they do not divide the epochs' examples,
        // the last step takes the rest from the next pass's order (transformers would run a
        // shorter last step).
        let wanted = (cfg.epochs * n as f64).round() as usize;
        let taken = planned_steps * cfg.grad_accum;
        if taken > wanted {
            eprintln!(
                "note: {planned_steps} steps of grad_accum = {} take {taken} examples, {} more \
                 than {} epoch(s) of {n}: the last step takes them from the next pass's order",
                cfg.grad_accum,
                taken - wanted,
                cfg.epochs
            );
        }
    }
    let data_hash = run_folder::items_hash(train_items);
    let base_hash = run_folder::base_fingerprint(&loaded.model_path)?;
    let optim = OptimOptions::from_config(cfg);

    // A resume takes the weights from its checkpoint: the warm start its settings name (which
    // may have moved since) is not read.
    let warm_start = cfg.warm_start.as_ref().filter(|_| checkpoint.is_none());
    let mut lora = match warm_start {
        Some(p) => {
            let mut l = Lora::load_peft(Path::new(p), &model.spec, &device)
                .with_context(|| format!("warm start from {p}"))?;
            check_warm_start_shape(p, &l.config, &lora_config, &model.spec)?;
            check_finite_adapter(&l, p)?;
            l.config.dropout = cfg.lora_dropout;
            l
        }
        None => Lora::new(&model.spec, lora_config.clone(), &device)?,
    };
    let mut adam = AdamState::new(&lora)?;
    let mut state = TrainerState {
        step: 0,
        position: 0,
        best_margin: None,
        total_steps: planned_steps,
        data_hash: Some(data_hash.clone()),
        base_hash: base_hash.clone(),
        cycles: vec![Cycle {
            end: planned_steps,
            warmup: cfg.resolved_warmup(planned_steps),
        }],
        orpo_lambda: None,
    };
    if let (Some(dir), Some((l, a, saved))) = (&checkpoint, from_checkpoint.take()) {
        check_finite_adapter(&l, &dir.display().to_string())?;
        (lora, adam) = (l, a);
        lora.config.dropout = cfg.lora_dropout;
        if let (Some(was), Some(now)) = (&saved.base_hash, &base_hash) {
            if was != now {
                bail!(
                    "--resume {}: the base model {} is not the one the checkpoint was trained on \
                     (its files differ: fingerprint {now}, checkpoint {was}); resume on the \
                     checkpoint's base, or start a new run on this one with --warm-start {}",
                    dir.display(),
                    loaded.model_path.display(),
                    dir.display()
                );
            }
        }
        state = resumed_state(dir, saved, cfg, planned_steps, &data_hash)?;
        if state.base_hash.is_none() {
            state.base_hash = base_hash;
        }
        let diffs =
            super::rank_scaling::module_differences(&lora.config, &lora_config, &model.spec, 5);
        if !diffs.is_empty() {
            bail!(
                "--resume {}: the checkpoint's adapter has other per-module ranks than the settings give (rank_scaling = \"{}\"):\n  {}\n(resume with the settings and files the checkpoint was trained with)",
                dir.display(),
                cfg.rank_scaling.name(),
                diffs.join("\n  ")
            );
        }
    }
    let lambda_params = LambdaParams::from_config(cfg, planned_steps);
    state.orpo_lambda = match cfg.orpo_lambda_schedule {
        LambdaSchedule::Static => None,
        // A checkpoint of a static run continued adaptively starts the controller afresh.
        LambdaSchedule::Adaptive => Some(
            state
                .orpo_lambda
                .take()
                .unwrap_or_else(|| LambdaController::new(&lambda_params)),
        ),
    };
    let schedule = CycleSchedule {
        peak_lr: cfg.learning_rate(),
        decay: cfg.lr_decay()?,
        cycles: state.cycles.clone(),
    };
    let total_steps = schedule.total_steps();
    let first_warmup = state.cycles.first().map_or(0, |c| c.warmup);
    let run_settings = cfg.resolved(total_steps, first_warmup);
    // A checkpoint's settings keep `warmup_steps` as given (unset: from `warmup_ratio`), so
    // that a resume extending the run warms its new cycle up for the ratio of the added steps.
    let mut checkpoint_settings = run_settings.clone();
    checkpoint_settings.warmup_steps = cfg.warmup_steps;
    std::fs::write(
        out_dir.join("plan.toml"),
        plan_toml(
            &run_settings,
            &state.cycles,
            &super::rank_scaling::summary(cfg, &lora.config, &model.spec),
        )?,
    )
    .with_context(|| format!("writing {}", out_dir.join("plan.toml").display()))?;
    for log in run_folder::LINE_LOGS {
        let path = out_dir.join(log);
        if state.step == 0 && path.exists() {
            // A run resumed at step 0 (stopped before its first step) logs its step-0
            // validation again: nothing of the earlier start is kept.
            std::fs::write(&path, b"").with_context(|| format!("emptying {}", path.display()))?;
        } else {
            run_folder::truncate_lines_after(&path, state.step)?;
        }
    }

    let base_objective = cfg.objective();
    device.set_numerics(cfg.deterministic_attention, cfg.gemm_tuning)?;
    super::head::set_filter_eps(cfg.cce_filter_eps);
    // The limit holds for the allocator too: a step past it fails as out of memory and runs
    // again on a smaller plan.
    device.set_memory_limit(cfg.memory_limit);
    let mut memory_budget = super::memory::budget(&device, cfg.memory_limit)?;
    if cfg.pack_tokens > 0 && model.spec.ropes[0].depends_on_length() {
        bail!(
            "pack_tokens = {}: this model's rotary factors depend on each example's length \
             (LongRoPE), which a pack would change; train it with pack_tokens = 0",
            cfg.pack_tokens
        );
    }
    refuse_unless_longest_fits(cfg, model, train_items, memory_budget)?;
    let mut ref_cache: Vec<Option<Reference>> = vec![None; n];
    let mut metrics_file = MetricsFile::append(&out_dir)?;
    let mut batches = if cfg.record_batches {
        Some(run_folder::LineLog::append(&out_dir.join("batches.jsonl"))?)
    } else {
        None
    };
    let mut plots = Plots::new(&out_dir);
    let mut tensorboard = if cfg.tensorboard {
        Some(TensorBoard::create(&out_dir, state.step)?)
    } else {
        None
    };
    let mut listeners: Vec<&mut dyn TrainEvents> = vec![&mut metrics_file, &mut plots];
    if let Some(tb) = tensorboard.as_mut() {
        listeners.push(tb);
    }
    listeners.push(listener);
    let mut events = Fanout(listeners);

    if let Some(k) = cfg.keep_kv_layers.filter(|&k| k > 0) {
        let kept = model.kv_layers_kept(k);
        if kept < k {
            eprintln!(
                "note: keep_kv_layers = {k}: this model keeps the k/v of {kept} of those layers \
                 (not the top layer's, one that shares another's, or one with k/v norms, which \
                 are recomputed)"
            );
        }
    }
    let auto = |v: Option<String>| v.unwrap_or_else(|| "auto".to_string());
    events.event(&TrainEvent::Started(&RunStart {
        method: format!("{:?}", cfg.method),
        device: device.name(),
        train_examples: n,
        valid_examples: valid_items.len(),
        total_steps,
        start_step: state.step,
        grad_accum: cfg.grad_accum,
        peak_lr: schedule.peak_lr,
        warmup_steps: first_warmup,
        lora_rank: lora.config.rank,
        lora_alpha: lora.config.alpha,
        lora_params: lora.num_params(),
        output: out_dir.clone(),
        resumed_from: checkpoint.clone(),
        segment_size: auto(cfg.segment_size.map(|s| s.to_string())),
        keep_attention: auto(cfg.keep_attention.map(|k| k.to_string())),
        keep_kv_layers: auto(cfg.keep_kv_layers.map(|k| k.to_string())),
        offload: auto(cfg.offload.map(|o| o.to_string())),
        pack_tokens: cfg.pack_tokens,
        head: format!("{:?}", cfg.head),
        prefix_shared: cfg.prefix_shared,
        log_every: cfg.log_every,
    }))?;

    let mut first_valid = None;
    if !valid_items.is_empty() && state.step == 0 {
        let mut m = evaluate_objective(
            model,
            &mut lora,
            valid_items,
            cfg,
            objective_now(base_objective, &state),
        )?;
        observe_lambda(&mut state, &mut m, &lambda_params);
        events.event(&TrainEvent::Valid {
            step: 0,
            metrics: &m,
        })?;
        first_valid = Some(m);
    }

    let settings_toml = checkpoint_settings.to_toml()?;
    let save = |dir: &Path, lora: &Lora, adam: &AdamState, state: &TrainerState| {
        let extra = [(run_folder::RUN_SETTINGS, settings_toml.as_str())];
        save_checkpoint(dir, lora, adam, state, &base_name, &extra)
    };
    // The newest whole checkpoint on disk, named when a step fails.
    let mut last_checkpoint = checkpoint.clone();
    let start_step = state.step;
    let mut losses = Vec::new();
    let mut final_valid = None;
    let started = Instant::now();
    while state.step < total_steps {
        if events.stop_requested() {
            let in_out_dir = |c: &Path| {
                let parent = c.parent().and_then(|p| p.canonicalize().ok());
                parent.is_some() && parent == out_dir.canonicalize().ok()
            };
            let dir = match &checkpoint {
                // Stopped before a step since the resume: its checkpoint holds this state (one
                // of another folder is saved here, so that this run's folder continues it).
                Some(c) if state.step == start_step && in_out_dir(c) => c.clone(),
                _ => {
                    let dir = out_dir.join(run_folder::checkpoint_name(state.step));
                    save(&dir, &lora, &adam, &state)?;
                    run_folder::prune_checkpoints(&out_dir, cfg.save_total_limit)?;
                    dir
                }
            };
            events.event(&TrainEvent::Checkpoint {
                step: state.step,
                path: &dir,
                best: false,
            })?;
            events.event(&TrainEvent::Stopped {
                step: state.step,
                checkpoint: &dir,
            })?;
            return Ok(TrainOutcome {
                final_valid,
                first_valid,
                losses,
                adapter_dir: dir.clone(),
                stopped: true,
            });
        }
        // A step that fails names itself, the example, and the checkpoint left whole on disk.
        let step_no = state.step + 1;
        let failed = |what: String| -> String {
            let kept = match &last_checkpoint {
                Some(c) => format!("the last checkpoint, {}, is intact", c.display()),
                None => "no checkpoint was written yet".to_string(),
            };
            format!("step {step_no}: {what}; the run stopped and {kept}")
        };
        let example = |idx: usize| train_items[idx].describe(idx, &cfg.data);
        let objective = objective_now(base_objective, &state);
        let t0 = Instant::now();
        device.reset_peak();
        let mut sums: BTreeMap<String, f64> = BTreeMap::new();
        let mut tokens = 0;
        let mut loss = 0.0;
        // The step's micro-steps, queued; a step the device runs out of memory for is queued
        // again from its first micro-step on the next smaller plan (nothing of it has reached the
        // adapter yet: only its gradients, which are zeroed).
        let position_before = state.position;
        let mut queued_examples = Vec::with_capacity(cfg.grad_accum);
        // The step's largest pass: its estimated bytes, tokens and options (timing.jsonl).
        let mut widest: Option<(usize, usize, PassOptions)> = None;
        let mut records = Vec::new();
        loop {
            // The pass being queued when a micro-step fails: its tokens and options.
            let mut current: Option<(usize, PassOptions)> = None;
            let attempt = (|| -> Result<()> {
                // The step's examples in order, then run one by one or, with `pack_tokens`, in
                // packs of consecutive examples up to that many tokens.
                let mut micros = Vec::with_capacity(cfg.grad_accum);
                for micro in 0..cfg.grad_accum {
                    let idx = order.index(state.position);
                    state.position += 1;
                    let plan = train_items[idx].plan(cfg.prefix_shared)?;
                    if batches.is_some() {
                        records.push(batch_record(step_no, micro, idx, &train_items[idx]));
                    }
                    micros.push((micro, idx, plan));
                }
                for pack in pack_groups(&micros, cfg.pack_tokens) {
                    let (micro, first, _) = &micros[pack.start];
                    let tokens: usize = micros[pack.clone()].iter().map(|m| m.2.tokens()).sum();
                    let dropout_seed = cfg.seed
                        ^ ((state.step * cfg.grad_accum + micro) as u64)
                            .wrapping_mul(0x2545_F491_4F6C_DD1D);
                    let opts = pass_options(
                        cfg,
                        model,
                        tokens,
                        memory_budget,
                        (cfg.lora_dropout > 0.0).then_some((cfg.lora_dropout, dropout_seed)),
                    );
                    current = Some((tokens, opts));
                    let estimate = pass_estimate_bytes(model, tokens, &opts);
                    if widest.is_none_or(|(e, _, _)| estimate > e) {
                        widest = Some((estimate, tokens, opts));
                    }
                    for (_, idx, plan) in &micros[pack.clone()] {
                        if matches!(objective, Objective::Dpo { .. }) && ref_cache[*idx].is_none() {
                            let alone =
                                pass_options(cfg, model, plan.tokens(), memory_budget, None);
                            ref_cache[*idx] = Some(reference_logps(model, plan, &alone)?);
                        }
                    }
                    let reference = |idx: usize| match objective {
                        Objective::Dpo { .. } => ref_cache[idx].as_ref(),
                        _ => None,
                    };
                    // The row's weight and the loss clip (validation stays unweighted and
                    // unclipped).
                    let scale = |idx: usize| ExampleScale {
                        weight: train_items[idx].weight,
                        clip: cfg.loss_clip,
                    };
                    if cfg.pack_tokens == 0 {
                        let (_, idx, plan) = &micros[pack.start];
                        let queued = queue_example_scaled(
                            model,
                            &mut lora,
                            plan,
                            &objective,
                            reference(*idx),
                            &opts,
                            true,
                            1.0,
                            scale(*idx),
                        )
                        .with_context(|| failed(example(*idx)))?;
                        queued_examples.push((*idx, queued));
                        continue;
                    }
                    let members: Vec<PackMember> = micros[pack.clone()]
                        .iter()
                        .map(|(_, idx, plan)| PackMember {
                            plan,
                            reference: reference(*idx),
                            scale: scale(*idx),
                        })
                        .collect();
                    let queued =
                        queue_packed(model, &mut lora, &members, &objective, &opts, true, 1.0)
                            .with_context(|| {
                                failed(format!(
                                    "the pack of {} examples from {}",
                                    members.len(),
                                    example(*first)
                                ))
                            })?;
                    for ((_, idx, _), q) in micros[pack.clone()].iter().zip(queued) {
                        queued_examples.push((*idx, q));
                    }
                }
                Ok(())
            })();
            let Err(e) = attempt else { break };
            let (Some((tokens, opts)), true) = (current, crate::tensor::is_out_of_memory(&e))
            else {
                return Err(e);
            };
            queued_examples.clear();
            records.clear();
            widest = None;
            device.synchronize()?;
            lora.zero_grads()?;
            state.position = position_before;
            memory_budget = smaller_plan_budget(cfg, model, tokens, &opts).ok_or_else(|| {
                e.context(failed(format!(
                    "out of device memory on the smallest plan there is ({}) for a pass of \
                     {tokens} tokens",
                    super::memory::describe_plan(&keep_plan(&opts))
                )))
            })?;
            let next = pass_options(cfg, model, tokens, memory_budget, None);
            eprintln!(
                "step {step_no}: out of device memory on the plan ({}) for a pass of {tokens} \
                 tokens; the step runs again on ({}), and the planner keeps to {:.2} GiB of \
                 activations from here on",
                super::memory::describe_plan(&keep_plan(&opts)),
                super::memory::describe_plan(&keep_plan(&next)),
                memory_budget as f64 / (1u64 << 30) as f64
            );
        }
        if let Some(log) = batches.as_mut() {
            for r in &records {
                log.write(r)?;
            }
        }
        let lr = schedule.lr(state.step);
        let grad_norm = apply_update(
            &mut lora,
            &mut adam,
            lr,
            state.step as u64 + 1,
            1.0 / cfg.grad_accum as f64,
            &optim,
        )?;
        // The step is queued whole; its losses and norm are read back once it has run.
        for (idx, queued) in queued_examples.drain(..) {
            let out = queued.finish().with_context(|| failed(example(idx)))?;
            if !out.loss.is_finite() {
                bail!(failed(format!(
                    "{} gave a non-finite loss ({})",
                    example(idx),
                    out.loss
                )));
            }
            loss += out.loss / cfg.grad_accum as f64;
            tokens += out.tokens;
            for (k, v) in out.metrics {
                *sums.entry(k.to_string()).or_default() += v / cfg.grad_accum as f64;
            }
        }
        if let (Some(c), Objective::Orpo { .. }) = (&state.orpo_lambda, objective) {
            sums.insert("orpo_lambda".to_string(), c.lambda);
        }
        let grad_norm = grad_norm.get()?;
        if !grad_norm.is_finite() {
            bail!(failed(format!(
                "the gradient norm is not finite ({grad_norm})"
            )));
        }
        device.synchronize()?;
        state.step += 1;
        losses.push(loss);
        let mem = device.memory();
        let (estimated_bytes, pass_tokens, pass) = widest.context("a step with no micro-steps")?;
        let elapsed = started.elapsed().as_secs_f64();
        let done = state.step - start_step;
        events.event(&TrainEvent::Step(&StepRecord {
            step: state.step,
            total_steps,
            loss,
            learning_rate: lr,
            grad_norm,
            tokens,
            step_seconds: t0.elapsed().as_secs_f64(),
            elapsed_seconds: elapsed,
            live_bytes: mem.live_bytes,
            peak_bytes: mem.peak_bytes,
            metrics: sums,
            pass: PassRecord {
                tokens: pass_tokens,
                segment_size: pass.segment_size,
                keep_attention: pass.keep_attention,
                keep_kv_layers: pass.keep_kv_layers,
                mlp_chunk: pass.mlp_chunk,
                offload: pass.offload,
                nested: pass.nested,
                resident_layers: pass.resident_layers,
                full_layers: pass.full_layers,
                estimated_bytes,
            },
            eta_seconds: elapsed / done as f64 * (total_steps - state.step) as f64,
        }))?;

        let last = state.step == total_steps;
        if !valid_items.is_empty()
            && (last || (cfg.eval_every > 0 && state.step.is_multiple_of(cfg.eval_every)))
        {
            let mut m = evaluate_objective(model, &mut lora, valid_items, cfg, objective)?;
            observe_lambda(&mut state, &mut m, &lambda_params);
            events.event(&TrainEvent::Valid {
                step: state.step,
                metrics: &m,
            })?;
            if let Some(&mg) = m.get("margin") {
                if state.best_margin.is_none_or(|b| mg > b) {
                    state.best_margin = Some(mg);
                    let dir = out_dir.join("best");
                    save(&dir, &lora, &adam, &state)?;
                    events.event(&TrainEvent::Checkpoint {
                        step: state.step,
                        path: &dir,
                        best: true,
                    })?;
                }
            }
            final_valid = Some(m);
        }
        if cfg.save_every > 0 && state.step.is_multiple_of(cfg.save_every) && !last {
            let dir = out_dir.join(run_folder::checkpoint_name(state.step));
            save(&dir, &lora, &adam, &state)?;
            run_folder::prune_checkpoints(&out_dir, cfg.save_total_limit)?;
            events.event(&TrainEvent::Checkpoint {
                step: state.step,
                path: &dir,
                best: false,
            })?;
            last_checkpoint = Some(dir);
        }
    }
    let adapter_dir = out_dir.join("adapter");
    lora.save_peft(&adapter_dir, &base_name)?;
    let dir = out_dir.join(run_folder::checkpoint_name(state.step));
    save(&dir, &lora, &adam, &state)
        .and_then(|()| run_folder::prune_checkpoints(&out_dir, cfg.save_total_limit))
        .map_err(|e| {
            anyhow::Error::new(FinalCheckpointFailed {
                adapter_dir: adapter_dir.clone(),
                step: state.step,
                cause: format!("{e:#}"),
            })
        })?;
    events.event(&TrainEvent::Checkpoint {
        step: state.step,
        path: &dir,
        best: false,
    })?;
    events.event(&TrainEvent::Finished {
        step: state.step,
        seconds: started.elapsed().as_secs_f64(),
        adapter_dir: &adapter_dir,
    })?;
    Ok(TrainOutcome {
        final_valid,
        first_valid,
        losses,
        adapter_dir,
        stopped: false,
    })
}

/// One line of batches.jsonl: the example a micro-step trained on, as token ids.
fn batch_record(step: usize, micro: usize, example: usize, item: &Item) -> serde_json::Value {
    let mut v = serde_json::json!({"step": step, "micro": micro, "example": example});
    if !item.at.is_empty() {
        v["at"] = serde_json::json!(item.at);
    }
    match &item.tokens {
        ItemTokens::Pair(p) => {
            v["prompt"] = serde_json::json!(p.prompt);
            v["chosen"] = serde_json::json!(p.chosen);
            v["rejected"] = serde_json::json!(p.rejected);
        }
        ItemTokens::Sft(s) => {
            v["prompt"] = serde_json::json!(s.prompt);
            v["completion"] = serde_json::json!(s.completion);
        }
    }
    if item.weight != 1.0 {
        v["weight"] = serde_json::json!(item.weight);
    }
    v
}

/// The objective of the coming steps: `base` with an adaptive run's λ of the moment.
fn objective_now(base: Objective, state: &TrainerState) -> Objective {
    match (base, &state.orpo_lambda) {
        (Objective::Orpo { scope, .. }, Some(c)) => Objective::Orpo {
            lambda: c.lambda,
            scope,
        },
        _ => base,
    }
}

/// An adaptive run's controller reads validation metrics `m` (its `lw` and `lr`); `m` gains the
/// λ set for the steps that follow (`orpo_lambda`) and the phase (`orpo_lambda_phase`:
/// `lambda_controller::Phase::code`).
fn observe_lambda(state: &mut TrainerState, m: &mut BTreeMap<String, f64>, p: &LambdaParams) {
    let Some(c) = state.orpo_lambda.as_mut() else {
        return;
    };
    if let (Some(&lw), Some(&lr)) = (m.get("lw"), m.get("lr")) {
        c.observe(lw, lr, state.step, p);
    }
    m.insert("orpo_lambda".to_string(), c.lambda);
    m.insert("orpo_lambda_phase".to_string(), c.phase.code());
}

/// The trainer state to continue from checkpoint `dir`: its settings must keep the adapter
/// shape and data (`run_folder::check_resume`), and `planned_steps` may only extend the run
/// (past its end, a new schedule cycle).
fn resumed_state(
    dir: &Path,
    mut saved: TrainerState,
    cfg: &TrainConfig,
    planned_steps: usize,
    data_hash: &str,
) -> Result<TrainerState> {
    if saved.cycles.is_empty() {
        // A checkpoint from before schedule cycles were recorded: one cycle as it was planned.
        saved.cycles = vec![Cycle {
            end: saved.total_steps,
            warmup: cfg.resolved_warmup(saved.total_steps),
        }];
    }
    let settings_path = dir.join(run_folder::RUN_SETTINGS);
    if settings_path.is_file() {
        let saved_cfg = TrainConfig::from_toml_file(&settings_path)?;
        let now = cfg.resolved(planned_steps, cfg.resolved_warmup(planned_steps));
        run_folder::check_resume(dir, &saved_cfg, saved.data_hash.as_deref(), &now, data_hash)?;
        for change in run_folder::changed_settings(&saved_cfg, &now)? {
            eprintln!("note: resumed with {change}");
        }
        if saved_cfg.data != cfg.data {
            eprintln!(
                "note: the training data moved ({} -> {}); its examples are the same",
                saved_cfg.data, cfg.data
            );
        }
    }
    let end = saved.cycles.last().map_or(saved.total_steps, |c| c.end);
    if planned_steps < end {
        bail!(
            "--resume {}: the run is planned to {end} steps, the settings ask for {planned_steps}; a resumed run keeps its plan or extends it (steps > {end})",
            dir.display()
        );
    }
    if planned_steps == end && saved.step >= end {
        bail!(
            "--resume {}: the run finished at step {end}; set steps to more than {end} to train further (the new steps get a schedule cycle of their own: warm-up, then the decay)",
            dir.display()
        );
    }
    if planned_steps > end {
        let added = planned_steps - end;
        saved.cycles.push(Cycle {
            end: planned_steps,
            warmup: cfg.resolved_warmup(added),
        });
    }
    saved.total_steps = planned_steps;
    if saved.data_hash.is_none() {
        saved.data_hash = Some(data_hash.to_string());
    }
    Ok(saved)
}

/// A warm start keeps the adapter's shape: settings that ask for another one are refused rather
/// than silently ignored.
fn check_warm_start_shape(
    path: &str,
    adapter: &LoraConfig,
    asked: &LoraConfig,
    spec: &model::ModelSpec,
) -> Result<()> {
    let mut diffs = Vec::new();
    if adapter.rank != asked.rank {
        diffs.push(format!(
            "rank: adapter {}, settings {}",
            adapter.rank, asked.rank
        ));
    }
    if adapter.alpha != asked.alpha {
        diffs.push(format!(
            "alpha: adapter {}, settings {}",
            adapter.alpha, asked.alpha
        ));
    }
    if adapter.targets != asked.targets {
        let names = |t: &[crate::model::Target]| {
            t.iter().map(|t| t.module()).collect::<Vec<_>>().join(", ")
        };
        diffs.push(format!(
            "targets: adapter [{}], settings [{}]",
            names(&adapter.targets),
            names(&asked.targets)
        ));
    }
    if adapter.rslora != asked.rslora {
        diffs.push(format!(
            "rslora: adapter {}, settings {}",
            adapter.rslora, asked.rslora
        ));
    }
    if diffs.is_empty() {
        // Per-module ranks and scales (rank_pattern, rank_scaling).
        diffs = super::rank_scaling::module_differences(adapter, asked, spec, 5);
    }
    if !diffs.is_empty() {
        bail!(
            "warm_start {path}: the adapter's shape differs from the settings:\n  {}\n(a warm start continues the adapter as it is: set these to the adapter's values)",
            diffs.join("\n  ")
        );
    }
    Ok(())
}

/// Every LoRA matrix of `lora` is finite, or an error naming the first tensor that is not.
pub fn check_finite_adapter(lora: &Lora, source: &str) -> Result<()> {
    for (l, t, p) in lora.pairs() {
        for (is_b, tensor) in [(false, &p.a), (true, &p.b)] {
            let values = tensor.to_vec()?;
            if let Some(bad) = values.iter().find(|v| !v.is_finite()) {
                bail!(
                    "{source}: tensor {} holds a non-finite value ({bad})",
                    crate::model::lora::peft_key(l, t, is_b)
                );
            }
        }
    }
    Ok(())
}

/// plan.toml: the resolved settings (readable back with `--config`), headed by the schedule's
/// cycles, the memory plan and the per-module ranks of `rank_scaling` (`ranks`) as comments.
fn plan_toml(settings: &TrainConfig, cycles: &[Cycle], ranks: &[String]) -> Result<String> {
    let mut head = String::from(if cycles.len() > 1 {
        "# The run as resolved, continued past its planned end: `lorafit train --config \
         plan.toml` trains these settings with one schedule over all the steps, not the \
         cycles below (resume a checkpoint of this run with --steps to extend it again).\n"
    } else {
        "# The run as resolved; `lorafit train --config plan.toml` trains it again.\n"
    });
    let mut start = 0;
    for (i, c) in cycles.iter().enumerate() {
        head.push_str(&format!(
            "# schedule cycle {}: steps {}..{} (warm-up {}), peak learning rate {:e}, {}\n",
            i + 1,
            start + 1,
            c.end,
            c.warmup,
            settings.lr,
            settings.schedule
        ));
        start = c.end;
    }
    let auto =
        |v: Option<String>| v.unwrap_or_else(|| "chosen per example from free memory".into());
    head.push_str(&format!(
        "# memory plan: segment_size {}, keep_attention {}, keep_kv_layers {}, head {:?}\n",
        auto(settings.segment_size.map(|s| s.to_string())),
        auto(settings.keep_attention.map(|s| s.to_string())),
        auto(settings.keep_kv_layers.map(|s| s.to_string())),
        settings.head
    ));
    for line in ranks {
        head.push_str(&format!("# {line}\n"));
    }
    head.push('\n');
    Ok(head + &settings.to_toml()?)
}

pub fn fmt_metrics(m: &BTreeMap<String, f64>) -> String {
    [
        "loss",
        "nll",
        "nll_loss",
        "or",
        "accuracy",
        "margin",
        "logps/chosen",
        "logps/rejected",
    ]
    .iter()
    .filter_map(|k| m.get(*k).map(|v| format!("{k} {v:.4}")))
    .chain(m.get("orpo_lambda").map(|l| {
        let phase = m
            .get("orpo_lambda_phase")
            .and_then(|&c| super::lambda_controller::Phase::from_code(c))
            .map_or("", |p| p.name());
        format!("orpo_lambda {l:.4} ({phase})")
    }))
    .collect::<Vec<_>>()
    .join(" | ")
}

/// Writes adapter + optimiser + trainer state, and `extra` files `(name, text)`, into `dir`
/// atomically (a temporary folder renamed into place): a kill leaves the whole checkpoint or
/// none of it.
pub fn save_checkpoint(
    dir: &Path,
    lora: &Lora,
    adam: &AdamState,
    state: &TrainerState,
    base_name: &str,
    extra: &[(&str, &str)],
) -> Result<()> {
    let parent = dir.parent().unwrap_or(Path::new("."));
    let tmp = parent.join(format!(
        ".tmp-{}",
        dir.file_name().unwrap().to_string_lossy()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    let write_all = || -> Result<()> {
        lora.save_peft(&tmp, base_name)?;
        let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
        for (i, (m, v)) in adam.m.iter().zip(&adam.v).enumerate() {
            tensors.push((format!("m.{i}"), m.shape().to_vec(), m.to_vec()?));
            tensors.push((format!("v.{i}"), v.shape().to_vec(), v.to_vec()?));
        }
        crate::model::weights::write_f32_safetensors(&tmp.join("optimizer.safetensors"), &tensors)?;
        let state_path = tmp.join("trainer_state.json");
        std::fs::write(&state_path, serde_json::to_string_pretty(state)?)
            .with_context(|| format!("writing {}", state_path.display()))?;
        for (name, text) in extra {
            std::fs::write(tmp.join(name), text)
                .with_context(|| format!("writing {}", tmp.join(name).display()))?;
        }
        Ok(())
    };
    if let Err(e) = write_all() {
        // A part-written checkpoint is no checkpoint: its space is given back (a full disk is
        // the usual cause), and the earlier checkpoints stay as they were.
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e.context(format!("writing checkpoint {}", dir.display())));
    }
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&tmp, dir)
        .with_context(|| format!("moving checkpoint into {}", dir.display()))?;
    Ok(())
}

pub fn load_checkpoint(
    dir: &Path,
    model: &Model,
    device: &Device,
) -> Result<(Lora, AdamState, TrainerState)> {
    let lora = Lora::load_peft(dir, &model.spec, device)?;
    let st_path = dir.join("trainer_state.json");
    let state: TrainerState = serde_json::from_str(
        &std::fs::read_to_string(&st_path)
            .with_context(|| format!("reading {}", st_path.display()))?,
    )
    .with_context(|| format!("parsing {}", st_path.display()))?;
    let opt_path = dir.join("optimizer.safetensors");
    let bytes =
        std::fs::read(&opt_path).with_context(|| format!("reading {}", opt_path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .with_context(|| format!("reading {}", opt_path.display()))?;
    let mut adam = AdamState::new(&lora)?;
    for i in 0..adam.m.len() {
        for (name, slot) in [
            (format!("m.{i}"), &mut adam.m[i]),
            (format!("v.{i}"), &mut adam.v[i]),
        ] {
            let view = st
                .tensor(&name)
                .with_context(|| format!("{}: tensor {name} missing", opt_path.display()))?;
            let data = crate::model::weights::view_to_f32(&view)
                .with_context(|| format!("{}: tensor {name}", opt_path.display()))?;
            if data.len() != slot.shape().iter().product::<usize>() {
                bail!(
                    "{}: tensor {name} has {} values, the adapter's moments {:?}",
                    opt_path.display(),
                    data.len(),
                    slot.shape()
                );
            }
            *slot = Tensor::from_f32(&data, slot.shape(), DType::F32, device)?;
        }
    }
    Ok((lora, adam, state))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint whose writing fails leaves no part-written folder behind (its space is
    /// given back), and the error names the checkpoint and the file.
    #[test]
    fn a_failed_checkpoint_write_leaves_no_temporary_folder() {
        let spec = crate::model::ModelSpec::from_config_json(
            &std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("tests/fixtures/models/llama/config.json"),
            )
            .unwrap(),
        )
        .unwrap();
        let lora = Lora::new(&spec, LoraConfig::default(), &Device::Cpu).unwrap();
        let adam = AdamState::new(&lora).unwrap();
        let state = TrainerState {
            step: 3,
            position: 3,
            best_margin: None,
            total_steps: 3,
            data_hash: None,
            base_hash: None,
            cycles: vec![],
            orpo_lambda: None,
        };
        let root = std::env::temp_dir().join(format!("lorafit-ckpt-fail-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let dir = root.join("checkpoint-000003");
        // An extra file in a folder that does not exist fails after the adapter and optimiser
        // are written, as a disk that fills up part-way does.
        let e = save_checkpoint(
            &dir,
            &lora,
            &adam,
            &state,
            "base",
            &[("no/such/run.toml", "x")],
        )
        .unwrap_err();
        let msg = format!("{e:#}");
        assert!(
            msg.contains("writing checkpoint") && msg.contains("run.toml"),
            "{msg}"
        );
        let left: Vec<_> = std::fs::read_dir(&root).unwrap().collect();
        assert!(left.is_empty(), "left behind: {left:?}");
        save_checkpoint(&dir, &lora, &adam, &state, "base", &[("run.toml", "x")]).unwrap();
        assert!(dir.join("trainer_state.json").is_file());
        let _ = std::fs::remove_dir_all(&root);
    }

    /// An adapter names its base as PEFT loads it: the built-in model by its Hub id, a Hub id
    /// as given, a folder by its absolute path, another file by its path.
    #[test]
    fn adapters_name_their_base_as_peft_loads_it() {
        let fixture = Path::new("tests/fixtures/models/llama");
        assert_eq!(
            peft_base_name("smollm2", Path::new("/cache/x.gguf")),
            "HuggingFaceTB/SmolLM2-135M-Instruct"
        );
        assert_eq!(
            peft_base_name("Org/Model", Path::new("/hf/snapshots/abc")),
            "Org/Model"
        );
        let folder = peft_base_name("tests/fixtures/models/llama", fixture);
        assert!(Path::new(&folder).is_absolute(), "{folder}");
        assert_eq!(Path::new(&folder), fixture.canonicalize().unwrap());
        assert_eq!(
            peft_base_name("m/model.gguf", Path::new("m/model.gguf")),
            "m/model.gguf"
        );
    }

    /// The kept epoch's permutation answers as a fresh draw at every position, across epochs
    /// and back (a step retried after running out of memory goes back to its first position),
    /// and each epoch visits every example once.
    #[test]
    fn the_data_order_keeps_its_epoch_and_visits_each_example_once_an_epoch() {
        let (n, seed) = (7, 11);
        let mut order = DataOrder::new(n, seed);
        let fresh = |pos: usize| DataOrder::new(n, seed).index(pos);
        for pos in (0..3 * n).chain([2, 3 * n - 1, n]) {
            assert_eq!(order.index(pos), fresh(pos), "position {pos}");
        }
        for epoch in 0..3 {
            let mut seen: Vec<usize> = (0..n).map(|i| order.index(epoch * n + i)).collect();
            seen.sort();
            assert_eq!(seen, (0..n).collect::<Vec<_>>(), "epoch {epoch}");
        }
        let first: Vec<usize> = (0..n).map(|i| order.index(i)).collect();
        let second: Vec<usize> = (0..n).map(|i| order.index(n + i)).collect();
        assert_ne!(first, second, "each epoch draws its own order");
    }
}
