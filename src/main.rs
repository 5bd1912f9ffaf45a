//! The `lorafit` command line: `train`, `lint`, `demo`, `generate`, `chat`, `eval`, `kl`, `curate`,
//! `export`, `serve`, `bench` and `selftest`. Every
//! subcommand resolves its flags into library types and calls the library; nothing here computes.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use lorafit::config::{Method, Tokenization, TrainConfig};
use lorafit::data;
use lorafit::eval;
use lorafit::tensor::Device;
use lorafit::train::trainer;
use std::path::PathBuf;

/// A write to standard output that failed. A closed pipe (`lorafit generate ... | head -c 5`)
/// ends the command quietly with status 141, as a tool killed by SIGPIPE ends (Rust ignores
/// the signal, so the write reports it instead); any other failure (`> /dev/full`) is an
/// error, status 2.
#[derive(Debug)]
struct StdoutError(std::io::Error);

impl std::fmt::Display for StdoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("writing to standard output")
    }
}

impl std::error::Error for StdoutError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.0)
    }
}

/// The status of a command whose reader closed its standard output: 128 + SIGPIPE.
const EXIT_BROKEN_PIPE: i32 = 141;

/// Writes `text` to standard output and flushes it, or returns a [`StdoutError`]
/// (`println!` would panic instead).
fn write_stdout(text: &str) -> Result<(), StdoutError> {
    use std::io::Write;
    let mut o = std::io::stdout().lock();
    o.write_all(text.as_bytes())
        .and_then(|()| o.flush())
        .map_err(StdoutError)
}

/// Ends the process for a failed write to standard output (see [`StdoutError`]).
fn exit_on_stdout_error(e: &StdoutError) -> ! {
    if e.0.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(EXIT_BROKEN_PIPE);
    }
    eprintln!("error: {e}: {}", e.0);
    std::process::exit(2);
}

/// `print!` through [`write_stdout`]: an error to return rather than a panic.
macro_rules! out {
    ($($arg:tt)*) => {
        write_stdout(&format!($($arg)*))
    };
}

/// `println!` through [`write_stdout`].
macro_rules! outln {
    () => {
        write_stdout("\n")
    };
    ($($arg:tt)*) => {
        write_stdout(&format!("{}\n", format_args!($($arg)*)))
    };
}

#[derive(Parser)]
#[command(
    name = "lorafit",
    version,
    about = "LoRA preference training (ORPO, SFT, DPO, SimPO) on CUDA and CPU"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Train a LoRA adapter from a TOML config and/or flags.
    Train(TrainArgs),
    /// Check a dataset against a model before training: per row and in sum, BOS/EOS, merges
    /// across the prompt/response boundary, where the tokenization modes differ, template
    /// problems, truncation, length ratios, duplicates. Exit status 1 when a row is unusable.
    Lint(LintArgs),
    /// ORPO on SmolLM2-135M-Instruct with the bundled preference set; before/after accuracy,
    /// margin and generations.
    Demo(DemoArgs),
    /// Generation from a model, optionally with an adapter: the prompt rendered with the model's
    /// chat template (or `--raw`), decoded with a KV cache, streamed, tokens/s on stderr.
    Generate(GenerateArgs),
    /// Interactive chat with a model, optionally with an adapter; `/reset` forgets the
    /// conversation, `/system TEXT` sets the system message, `/quit` ends.
    Chat(ChatArgs),
    /// Score a model (optionally with an adapter, or two side by side with --compare):
    /// preference pairs (accuracy, margin, lw, lr, nll, loss) or, with --scorer ifeval,
    /// verifiable-instruction following of its generations.
    Eval(EvalArgs),
    /// Per-layer KL of a quantized model against its reference on calibration text (each layer
    /// quantized alone); the JSON it writes is `rank_kl_file` for `rank_scaling = "by_kl"`.
    Kl(KlArgs),
    /// ORPO training steps on a random-weight model of a named shape; one JSON line per run.
    Bench(lorafit::bench::BenchArgs),
    /// CUDA-vs-CPU parity of every op on this machine's GPU.
    Selftest {
        #[arg(long, default_value = "cuda")]
        device: String,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// UltraFeedback-style ratings (binarized or raw) -> preference JSONL: score gap, length
    /// ratio, prompt dedupe, token cap, seeded validation split; prints what each filter removed.
    Curate(CurateArgs),
    /// A trained adapter as a merged Hugging Face folder, a llama.cpp GGUF adapter and (for a
    /// GGUF base) a merged GGUF; --check compares each against the trainer's logits.
    Export(ExportArgs),
    /// The job runner: an HTTP API and web page that queue, run and report training, eval and
    /// export jobs.
    Serve(ServeArgs),
}

#[derive(clap::Args)]
struct CurateArgs {
    /// Input rows (binarized {prompt, chosen, rejected, score_chosen, score_rejected} or raw
    /// {instruction, completions[...]}) in any dataset format `train` reads.
    #[arg(long)]
    input: PathBuf,
    /// Preference JSONL to write (the training rows).
    #[arg(long)]
    output: PathBuf,
    /// Preference JSONL of the held-out validation rows.
    #[arg(long)]
    valid_output: Option<PathBuf>,
    /// Model whose tokenizer and chat template measure the token cap and length ratio.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// A Jinja chat template file (or a tokenizer_config.json) to use instead of the model's.
    #[arg(long)]
    chat_template: Option<String>,
    /// Least score_chosen - score_rejected a pair keeps (0: scores optional).
    #[arg(long, default_value_t = 1.0)]
    min_score_gap: f64,
    /// Largest ratio between the two responses' token counts.
    #[arg(long, default_value_t = 3.0)]
    max_length_ratio: f64,
    /// Most tokens of prompt + longer response.
    #[arg(long, default_value_t = 2048)]
    max_tokens: usize,
    /// Keep rows whose prompt was seen before.
    #[arg(long)]
    keep_duplicates: bool,
    /// Share of the kept rows held out (with --valid-output).
    #[arg(long, default_value_t = 0.05)]
    valid_fraction: f64,
    /// Seed of the validation split's permutation.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// A raw row's completion score: a numeric field (overall_score, fine-grained_score) or
    /// `annotations` (the mean of each aspect's Rating).
    #[arg(long, default_value = "overall_score")]
    score_field: String,
    /// Skip and count malformed rows instead of stopping at the first.
    #[arg(long)]
    skip_bad_rows: bool,
}

#[derive(clap::Args)]
struct ExportArgs {
    /// Base model: Hugging Face folder, GGUF file, "smollm2", or a Hub id in the Hugging Face
    /// cache.
    #[arg(long)]
    model: String,
    /// PEFT adapter folder (a run's adapter/, best/ or checkpoint).
    #[arg(long)]
    adapter: PathBuf,
    /// Folder for the artefacts: merged-hf/, adapter.gguf, merged.gguf (and check.json,
    /// check.safetensors). A folder holding an earlier export is refused unless --overwrite.
    #[arg(long)]
    output: PathBuf,
    /// Delete an earlier export's artefacts in --output (those names alone) before writing.
    #[arg(long)]
    overwrite: bool,
    /// What to write (repeatable); default: hf and gguf-adapter, and merged-gguf for a GGUF base.
    #[arg(long = "format", value_enum)]
    formats: Vec<lorafit::export::Format>,
    /// Float type of the merged folder's safetensors.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: lorafit::export::hf::HfDtype,
    /// Element type of the GGUF adapter's tensors.
    #[arg(long, value_enum, default_value = "f32")]
    adapter_type: lorafit::export::gguf_out::AdapterType,
    /// The merged GGUF's adapted tensors: requantized to their own type, or f16.
    #[arg(long, value_enum, default_value = "keep")]
    merged_type: lorafit::export::gguf_out::MergedType,
    /// Read each artefact back and compare its logits on a fixed prompt set with the
    /// trainer's (base + adapter); fails when one is outside its bound.
    #[arg(long)]
    check: bool,
    /// A Jinja chat template file (or a tokenizer_config.json), the training run's
    /// `chat_template`: written into the merged folder's tokenizer_config.json and the merged
    /// GGUF in place of the base's.
    #[arg(long)]
    chat_template: Option<String>,
}

fn run_curate(a: CurateArgs) -> Result<()> {
    let model = trainer::resolve_model_path(&a.model)?;
    let opts = lorafit::curate::CurateOptions {
        min_score_gap: a.min_score_gap,
        max_length_ratio: a.max_length_ratio,
        max_tokens: a.max_tokens,
        dedupe: !a.keep_duplicates,
        valid_fraction: a.valid_fraction,
        seed: a.seed,
        score_field: a.score_field,
        skip_bad_rows: a.skip_bad_rows,
        chat_template: a.chat_template,
    };
    let report = lorafit::curate::curate_file(
        &a.input,
        &a.output,
        a.valid_output.as_deref(),
        &model,
        &opts,
    )?;
    outln!("{report}")?;
    Ok(())
}

fn run_export(a: ExportArgs) -> Result<()> {
    if a.output.exists() && !a.output.is_dir() {
        bail!(
            "--output {}: a file is there; the output is a folder (name another)",
            a.output.display()
        );
    }
    let plan = lorafit::export::ExportPlan {
        model: trainer::resolve_model_path(&a.model)?,
        adapter: a.adapter,
        output: a.output,
        formats: a.formats,
        hf_dtype: a.dtype,
        adapter_type: a.adapter_type,
        merged_type: a.merged_type,
        check: a.check,
        chat_template: a.chat_template,
    };
    // Before the earlier export is named: --overwrite would not help here.
    lorafit::export::refuse_inputs_in_artefacts(&plan)?;
    if !a.overwrite {
        lorafit::export::refuse_earlier_export(&plan.output)?;
    }
    let report = lorafit::export::run(&plan)?;
    out!("{}", report.text(&plan))?;
    report.check_passed()
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Address to listen on (port 0 picks a free port; the first stdout line names it). A
    /// non-loopback address needs --token-file.
    #[arg(long, default_value = "127.0.0.1:8420", value_parser = parse_listen)]
    listen: std::net::SocketAddr,
    /// The SQLite file holding jobs, events, metrics and checkpoints.
    #[arg(long, default_value = "lorafit-jobs.sqlite")]
    db: PathBuf,
    /// A file whose first line is the bearer token every API request must carry.
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// A folder that jobs may read models and data from and write outputs into (repeatable;
    /// relative paths in a job resolve against the first). Default: the current folder.
    #[arg(long = "root")]
    roots: Vec<PathBuf>,
}

fn run_serve(a: ServeArgs) -> Result<()> {
    let token = a
        .token_file
        .as_deref()
        .map(lorafit::serve::read_token_file)
        .transpose()?;
    let roots = if a.roots.is_empty() {
        vec![std::env::current_dir()?]
    } else {
        a.roots
    };
    lorafit::serve::run(lorafit::serve::ServeOptions {
        listen: a.listen,
        db: a.db,
        token,
        roots,
    })
}

#[derive(clap::Args)]
struct TrainArgs {
    /// TOML file with TrainConfig fields; flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Hugging Face folder, .gguf file, "smollm2", or a Hub id in the Hugging Face cache
    /// (default: smollm2).
    #[arg(long)]
    model: Option<String>,
    /// Training rows: JSONL, a JSON array, CSV / TSV or Parquet (gzip or zstd compressed or
    /// not), or a pattern naming the shards of one split ('data/train-*.parquet').
    #[arg(long)]
    data: Option<String>,
    /// Validation rows (same formats); without it there is no validation unless the setting
    /// `valid_fraction` (default 0: none; e.g. 0.05) holds out a share of the training rows.
    #[arg(long)]
    valid: Option<String>,
    /// The run's folder: checkpoints, adapter, metrics, plan.toml (default: runs/lorafit).
    #[arg(long)]
    output: Option<String>,
    /// The objective (default: orpo).
    #[arg(long, value_enum)]
    method: Option<Method>,
    /// cpu, cuda or cuda:N (default: cpu).
    #[arg(long)]
    device: Option<String>,
    /// Optimiser steps (default, or 0: from --epochs).
    #[arg(long, allow_negative_numbers = true)]
    steps: Option<usize>,
    /// Passes over the training rows, when --steps is not given (default: 1).
    #[arg(long, allow_negative_numbers = true)]
    epochs: Option<f64>,
    /// Peak learning rate (default, or 0: by method: 1e-5 ORPO, 2e-4 SFT, 5e-6 DPO, 1e-6 SimPO; TRL's
    /// learning_rate).
    #[arg(long, allow_negative_numbers = true)]
    lr: Option<f64>,
    /// LoRA rank (default: 16).
    #[arg(long, allow_negative_numbers = true)]
    rank: Option<usize>,
    /// LoRA alpha (default: 2 × rank, a scale of 2).
    #[arg(long, allow_negative_numbers = true)]
    alpha: Option<f64>,
    /// Examples per optimiser step (default: 1; TRL's gradient_accumulation_steps).
    #[arg(long, allow_negative_numbers = true)]
    grad_accum: Option<usize>,
    /// Layers per recomputed segment: 0 keeps every activation (default: chosen by the memory
    /// planner).
    #[arg(long, allow_negative_numbers = true)]
    segment_size: Option<usize>,
    /// Seed of the adapter's initialisation, the data order, LoRA dropout and the held-out split
    /// (default: 0).
    #[arg(long, allow_negative_numbers = true)]
    seed: Option<u64>,
    /// How rows become token ids: separate (prompt and responses encoded apart) or trl (TRL
    /// 1.16's ids for the method).
    #[arg(long, value_enum)]
    tokenization: Option<Tokenization>,
    /// A Jinja chat template file (or a tokenizer_config.json) to use instead of the model's.
    #[arg(long)]
    chat_template: Option<String>,
    /// Continue a run: a checkpoint folder, or a run folder (its latest checkpoint). The
    /// settings must keep the checkpoint's adapter shape and data; without --output the run
    /// continues in the checkpoint's run folder.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Start again in an output folder that holds a run, deleting that run's outputs first.
    #[arg(long)]
    overwrite: bool,
    /// Start from this PEFT adapter's weights (fresh optimiser and schedule; its shape is kept).
    #[arg(long)]
    warm_start: Option<String>,
    /// Without a terminal, one plain log line every this many steps.
    #[arg(long, allow_negative_numbers = true)]
    log_every: Option<usize>,
    /// Also write TensorBoard event files beside metrics.jsonl.
    #[arg(long)]
    tensorboard: bool,
    /// Any TrainConfig field as KEY=VALUE (VALUE in TOML syntax), e.g. --set orpo_lambda=0.2.
    /// Any other flag is read as one, by lorafit's name or TRL's (--max_steps 10,
    /// --learning_rate=2e-4, --use_rslora).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// The `--set` entries `settings_as_flags` made of other flags, each with the flag as it was
    /// given, so that a refusal names what the user wrote.
    #[arg(skip)]
    flags_as_settings: Vec<(String, String)>,
}

/// Model, adapter, device and decoding flags shared by `generate` and `chat`.
#[derive(clap::Args, Clone)]
struct DecodeArgs {
    /// Hugging Face folder, .gguf file, "smollm2", or a Hub id in the Hugging Face cache.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Encode the base's projections on load, as the adapter's training run did (its plan.toml's
    /// `base_quant`).
    #[arg(long, value_enum, default_value = "none")]
    base_quant: lorafit::model::BaseQuant,
    /// A PEFT adapter folder, applied unmerged.
    #[arg(long)]
    adapter: Option<PathBuf>,
    /// A Jinja chat template file (or a tokenizer_config.json) to use instead of the model's:
    /// the adapter's training run's `chat_template`, for a model without one.
    #[arg(long)]
    chat_template: Option<String>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The most tokens generated per reply.
    #[arg(
        long,
        allow_negative_numbers = true,
        alias = "max-new",
        default_value_t = 256
    )]
    max_new_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k most likely tokens (0: off).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    top_k: usize,
    /// Keep the most likely tokens whose probabilities sum to p (1: off).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    top_p: f32,
    /// Keep the tokens at least this fraction as likely as the most likely one (0: off).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0.0)]
    min_p: f32,
    /// Penalty on tokens already in the sequence (1: off).
    #[arg(long, allow_negative_numbers = true, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Seed of the sampler (with a temperature above 0).
    #[arg(long, allow_negative_numbers = true, default_value_t = 0)]
    seed: u64,
    /// A string that ends the reply (repeatable); the reply ends before it.
    #[arg(long = "stop")]
    stop: Vec<String>,
}

impl DecodeArgs {
    fn options(&self, stop_tokens: Vec<u32>) -> lorafit::infer::GenerateOptions {
        lorafit::infer::GenerateOptions {
            max_new_tokens: self.max_new_tokens,
            sampling: lorafit::infer::Sampling {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                repetition_penalty: self.repetition_penalty,
                seed: self.seed,
            },
            stop_tokens,
            stop_strings: self.stop.clone(),
        }
    }

    fn load(&self) -> Result<(trainer::Loaded, Option<lorafit::model::Lora>)> {
        if self.stop.iter().any(String::is_empty) {
            bail!(
                "--stop \"\": an empty stop string would end every reply before its first \
                 character; give the text that ends a reply"
            );
        }
        let device = Device::parse(&self.device)?;
        let loaded = trainer::load_with_template(
            &self.model,
            &device,
            self.base_quant,
            self.chat_template.as_deref(),
        )?;
        let lora = match &self.adapter {
            Some(p) => Some(lorafit::model::Lora::load_peft(
                p,
                &loaded.model.spec,
                &device,
            )?),
            None => None,
        };
        Ok((loaded, lora))
    }
}

#[derive(clap::Args)]
struct GenerateArgs {
    #[command(flatten)]
    decode: DecodeArgs,
    /// A system message before the prompt.
    #[arg(long)]
    system: Option<String>,
    /// Use the prompt as raw text (no chat template, so neither --system nor --chat-template).
    #[arg(long, conflicts_with_all = ["system", "chat_template"])]
    raw: bool,
    /// Check the KV cache on this device: along the greedy path of the whole-sequence forward,
    /// each step's cached next-token logits against the uncached ones (relative norm within
    /// 1e-4 on the CPU; on CUDA within 1e-2, or the cached logits no further from the model's
    /// f32 logits on the CPU than 1.5× the uncached ones) and its greedy token (equal unless the
    /// top two are a near tie); then free-running greedy generation both ways, printed.
    #[arg(long)]
    check_uncached: bool,
    /// With --check-uncached on a device: skip the f32 reference on the CPU (it loads a second,
    /// f32 copy of the model into host memory and runs the whole-sequence forward there at
    /// every step, slow for a large model); the check is then the 1e-2 bound alone.
    #[arg(long, requires = "check_uncached")]
    no_f32_reference: bool,
    /// The user message (or, with --raw, the text to continue); `-` reads it from standard
    /// input, all of it, less its trailing line breaks.
    prompt: String,
}

/// `generate`'s prompt: the argument, or for `-` standard input to its end, its trailing line
/// breaks dropped as a shell's `"$(cat file)"` drops them (`echo text |` adds one).
fn generate_prompt(arg: &str) -> Result<String> {
    if arg != "-" {
        return Ok(arg.to_string());
    }
    let text = std::io::read_to_string(std::io::stdin())
        .context("generate -: reading the prompt from standard input")?;
    Ok(text.trim_end_matches(['\n', '\r']).to_string())
}

/// `generate --check-uncached`: the KV cache against the whole-sequence forward on one prompt.
fn check_uncached(
    a: &DecodeArgs,
    f32_reference: bool,
    loaded: &trainer::Loaded,
    lora: Option<&lorafit::model::Lora>,
    ids: &[u32],
    stops: &[u32],
) -> Result<()> {
    let (model, tok) = (&loaded.model, &loaded.tokenizer);
    let max_new = a.max_new_tokens;
    let bound = if model.device.is_cuda() { 1e-2 } else { 1e-4 };
    // On a device, the same model and adapter in f32 on the CPU as a third opinion: how far
    // each bf16 path is from f32 (two paths each b from f32 may be up to 2b apart).
    let cpu = if model.device.is_cuda() && f32_reference {
        let cpu_args = DecodeArgs {
            device: "cpu".into(),
            ..a.clone()
        };
        Some(cpu_args.load()?)
    } else {
        None
    };
    let cpu_logits = |ids: &[u32]| -> Result<Vec<f32>> {
        let (l, lora) = cpu.as_ref().expect("only called with a CPU copy");
        let h = l.model.hidden_states(ids, lora.as_ref())?;
        let last = lorafit::tensor::slice_rows(&h, ids.len() - 1, ids.len())?;
        l.model.logits(&last, lorafit::tensor::DType::F32)?.to_vec()
    };
    let reference: Option<lorafit::selftest::ReferenceLogits> = cpu
        .as_ref()
        .map(|_| &cpu_logits as lorafit::selftest::ReferenceLogits);
    let check = lorafit::selftest::decode_check(model, lora, ids, max_new, reference)?;
    let eos = stops.first().copied();
    let cached = lorafit::infer::generate_ids(model, lora, ids, max_new, eos)?;
    let uncached = lorafit::infer::generate_ids_uncached(model, lora, ids, max_new, eos)?;
    let same = cached
        .iter()
        .zip(&uncached)
        .take_while(|(a, b)| a == b)
        .count();
    outln!("cached:   {:?}", tok.decode(&cached)?)?;
    outln!("uncached: {:?}", tok.decode(&uncached)?)?;
    outln!(
        "free-running greedy: cached {} / uncached {} tokens, equal for the first {same}",
        cached.len(),
        uncached.len()
    )?;
    // On a real model two bf16 paths can be further apart than the fixtures' 1e-2 (SmolLM2:
    // 3.6–5.7e-2) while each is as far from f32 as the other. With the f32 reference the check
    // is then that the cache adds no error of its own: its distance from f32 within 1.5× the
    // uncached path's (measured 0.9–1.2×; a cache that read a wrong position or layer is far
    // from f32 while the uncached path is not).
    let cache_adds_nothing = check.vs_reference.is_some_and(|(c, u)| c <= 1.5 * u);
    let ok = (check.worst_rel <= bound || cache_adds_nothing) && check.bad_flips == 0;
    let against_f32 = match check.vs_reference {
        Some((c, u)) => format!(
            "; against the CPU's f32: cached {c:.3e}, uncached {u:.3e} (ratio {:.2}, bound 1.5)",
            c / u
        ),
        None => String::new(),
    };
    outln!(
        "teacher-forced, {max_new} steps: cached vs uncached logits worst rel-norm {:.3e} (step {}) bound {bound:.0e}; greedy tokens differ at {} steps ({} not near ties){against_f32}  {}",
        check.worst_rel,
        check.worst_step,
        check.flips,
        check.bad_flips,
        if ok { "ok" } else { "FAIL" }
    )?;
    if !ok {
        bail!("the KV cache's logits are outside the bound or its greedy tokens disagree");
    }
    Ok(())
}

#[derive(clap::Args)]
struct ChatArgs {
    #[command(flatten)]
    decode: DecodeArgs,
    /// The system message to start with (`/system` changes it).
    #[arg(long)]
    system: Option<String>,
}

fn run_generate(a: GenerateArgs) -> Result<()> {
    use lorafit::data::Message;
    if a.decode.max_new_tokens == 0 {
        bail!("--max-new-tokens 0: nothing would be generated; give at least 1");
    }
    if a.check_uncached && a.decode.temperature > 0.0 {
        bail!(
            "--check-uncached compares greedy decoding with and without the KV cache: leave \
             --temperature at 0"
        );
    }
    let prompt = generate_prompt(&a.prompt)?;
    if a.raw && prompt.is_empty() {
        let given = match a.prompt.as_str() {
            "-" => "-: standard input is empty",
            _ => "\"\": the prompt is empty",
        };
        bail!("--raw {given}, so there is no text to continue; give the text");
    }
    let (loaded, lora) = a.decode.load()?;
    let tok = &loaded.tokenizer;
    if loaded.template.is_none() && !a.raw {
        eprintln!("note: the model has no chat template; the prompt is given as plain text");
    }
    let ids = if a.raw {
        lorafit::infer::chat_prompt_ids(tok, None, &[Message::user(prompt.as_str())])?
    } else {
        let mut messages: Vec<Message> = a.system.iter().map(Message::system).collect();
        messages.push(Message::user(prompt.as_str()));
        lorafit::infer::chat_prompt_ids(tok, loaded.template.as_ref(), &messages)?
    };
    let stops = lorafit::infer::default_stop_tokens(tok, loaded.template.as_ref(), &loaded.model);
    let room = lorafit::infer::reply_room(&loaded.model, ids.len())?;
    let context = lorafit::infer::context_length(&loaded.model);
    if a.check_uncached {
        anyhow::ensure!(
            room > 0,
            "the prompt's {} tokens fill the model's context of {context}: no token is left to check",
            ids.len()
        );
        if a.decode.max_new_tokens > room {
            eprintln!(
                "checking {room} steps, not {}: the prompt's {} tokens and {room} more fill the \
                 model's context of {context}",
                a.decode.max_new_tokens,
                ids.len()
            );
        }
        let steps = DecodeArgs {
            max_new_tokens: a.decode.max_new_tokens.min(room),
            ..a.decode.clone()
        };
        return check_uncached(
            &steps,
            !a.no_f32_reference,
            &loaded,
            lora.as_ref(),
            &ids,
            &stops,
        );
    }
    let opts = a.decode.options(stops);
    // The callback cannot return an error: a failed write ends the process from there, so
    // that a closed pipe does not keep the model generating for no reader.
    let report = lorafit::infer::generate_stream(
        &loaded.model,
        lora.as_ref(),
        &[ids],
        &opts,
        Some(tok),
        &mut |_, delta| {
            if let Err(e) = write_stdout(delta) {
                exit_on_stdout_error(&e);
            }
        },
    )?;
    outln!()?;
    let out = &report.outputs[0];
    if out.stop == lorafit::infer::StopReason::Context {
        eprintln!(
            "(stopped at the model's context: the prompt's {} tokens and the reply's {} fill its {context})",
            report.stats.prompt_tokens,
            out.tokens.len()
        );
    }
    eprintln!("{}", report.stats.summary());
    Ok(())
}

fn run_chat(a: ChatArgs) -> Result<()> {
    if a.decode.max_new_tokens == 0 {
        bail!("--max-new-tokens 0: every reply would be empty; give at least 1");
    }
    use std::io::BufRead;
    let (loaded, lora) = a.decode.load()?;
    let tok = &loaded.tokenizer;
    let stops = lorafit::infer::default_stop_tokens(tok, loaded.template.as_ref(), &loaded.model);
    if loaded.template.is_none() {
        eprintln!("note: the model has no chat template; messages are joined as plain text");
    }
    let mut session = lorafit::infer::ChatSession::new(
        &loaded.model,
        lora.as_ref(),
        tok,
        loaded.template.as_ref(),
        a.decode.options(stops),
    )?;
    session.set_system(a.system.clone());
    eprintln!("chat with {} (/reset, /system TEXT, /quit)", a.decode.model);
    let stdin = std::io::stdin();
    loop {
        out!("> ")?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/quit" | "/exit" => break,
            "/reset" => {
                session.reset();
                eprintln!("(conversation cleared)");
                continue;
            }
            l if l == "/system" || l.starts_with("/system ") => {
                let text = l.strip_prefix("/system").unwrap_or("").trim().to_string();
                eprintln!(
                    "{}",
                    if text.is_empty() {
                        "(system message removed; conversation cleared)"
                    } else {
                        "(system message set; conversation cleared)"
                    }
                );
                session.set_system(Some(text));
                continue;
            }
            // A word after a slash is a mistyped command; a message that starts with a slash
            // and a space, or a path ("/usr/bin ..."), goes to the model. `//text` sends "/text".
            l if l.starts_with('/')
                && !l.starts_with("//")
                && l[1..]
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_alphabetic())
                && !l[1..].split_whitespace().next().unwrap_or("").contains('/') =>
            {
                eprintln!(
                    "(unknown command {}: the commands are /reset, /system TEXT, /quit; \
                     start with // to send a message that begins with a slash)",
                    l.split_whitespace().next().unwrap_or(l)
                );
                continue;
            }
            _ => {}
        }
        // `//text` is the message "/text".
        let line = line
            .strip_prefix('/')
            .filter(|l| l.starts_with('/'))
            .unwrap_or(line);
        let replied = session.reply(line, &mut |delta| {
            if let Err(e) = write_stdout(delta) {
                exit_on_stdout_error(&e);
            }
        });
        let (reply, stats) = match replied {
            Err(e) if e.is::<lorafit::infer::PromptTooLong>() => {
                eprintln!("(the conversation with this message: {e}; /reset starts a new one)");
                continue;
            }
            other => other?,
        };
        outln!()?;
        if reply.stop == lorafit::infer::StopReason::Context {
            eprintln!(
                "(stopped at the model's context of {} tokens; /reset starts a new conversation)",
                lorafit::infer::context_length(&loaded.model)
            );
        }
        eprintln!("[{}]", stats.summary());
    }
    Ok(())
}

#[derive(clap::Args)]
struct LintArgs {
    /// A training config (or a run's plan.toml): the model, data, method, tokenization, chat
    /// template and length limits to check with, each unless its flag is given.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Hugging Face model folder, GGUF file, "smollm2", or a Hub id in the Hugging Face cache;
    /// only its tokenizer, chat template and vocabulary size are read (default: the config's,
    /// else smollm2).
    #[arg(long)]
    model: Option<String>,
    /// The dataset: JSONL, a JSON array, CSV / TSV or Parquet (gzip or zstd compressed or not)
    /// (default: the config's `data`).
    #[arg(long)]
    data: Option<String>,
    /// Which rows to expect and which TRL trainer's rules `trl` means (default: the config's,
    /// else orpo).
    #[arg(long, value_enum)]
    method: Option<Method>,
    /// The tokenization to check; the other one is compared with it (default: the config's,
    /// else separate).
    #[arg(long, value_enum)]
    tokenization: Option<Tokenization>,
    /// A Jinja chat template file (or a tokenizer_config.json) to use instead of the model's
    /// (default: the config's `chat_template`).
    #[arg(long)]
    chat_template: Option<String>,
    /// Default: the config's, else 2048.
    #[arg(long)]
    max_seq_len: Option<usize>,
    /// Default: the config's, else 1024.
    #[arg(long)]
    max_prompt_len: Option<usize>,
    /// Print the summary only, not one line per row with findings.
    #[arg(long)]
    quiet: bool,
}

#[derive(clap::Args)]
struct DemoArgs {
    /// Model (default: SmolLM2-135M-Instruct Q4_1, fetched with pip and cached).
    #[arg(long, default_value = "smollm2")]
    model: String,
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Optimiser steps of the demo's run (at least 1).
    #[arg(long, default_value_t = 120, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    steps: usize,
    #[arg(long, default_value = "runs/demo")]
    output: String,
}

#[derive(clap::Args)]
struct EvalArgs {
    /// A Hugging Face folder, a GGUF file, "smollm2", or a Hub id in the Hugging Face cache
    /// (default: the config's model, else smollm2).
    #[arg(long)]
    model: Option<String>,
    /// A PEFT adapter folder to score with the model.
    #[arg(long, conflicts_with = "compare")]
    adapter: Option<PathBuf>,
    /// Encode the base's projections on load (default: the config's `base_quant`, else none).
    #[arg(long, value_enum)]
    base_quant: Option<lorafit::model::BaseQuant>,
    /// Before/after: two adapter folders, or `base` and an adapter folder.
    #[arg(long, num_args = 2, value_names = ["BEFORE", "AFTER"])]
    compare: Vec<String>,
    /// Preference pairs (any dataset format `train` reads), or with --scorer ifeval a prompt file in IFEval's format
    /// (default there: the bundled data/ifeval_prompts.jsonl).
    #[arg(long)]
    data: Option<String>,
    #[arg(long, value_enum, default_value = "preference")]
    scorer: eval::Scorer,
    /// cpu, cuda or cuda:N (default: the config's, else cpu).
    #[arg(long)]
    device: Option<String>,
    /// A TOML config (e.g. a run's plan.toml): the objective, its settings and the length
    /// limits the pairs are scored with.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The objective the pairs are scored with (default: the config's, else orpo).
    #[arg(long, value_enum)]
    method: Option<Method>,
    /// A Jinja chat template file (or a tokenizer_config.json) to use instead of the config's
    /// or the model's.
    #[arg(long)]
    chat_template: Option<String>,
    /// Most new tokens per reply (--scorer ifeval).
    #[arg(long, default_value_t = 256)]
    max_new: usize,
    /// Score only the first N pairs or prompts (0: all).
    #[arg(long, default_value_t = 0)]
    limit: usize,
    /// Write every example's scores (and replies) as JSON here.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Write a markdown report here; with --compare also the before/after bar chart beside it,
    /// as the same path with the extension .png (FILE.md -> FILE.png).
    #[arg(long)]
    report: Option<PathBuf>,
}

#[derive(clap::Args)]
struct KlArgs {
    /// The quantized model (GGUF file, Hugging Face folder, "smollm2", or a Hub id in the Hugging
    /// Face cache); its tokenizer reads the data.
    #[arg(long)]
    model: String,
    /// The reference model of the same architecture (e.g. the f16/bf16 original).
    #[arg(long)]
    reference: String,
    /// Calibration rows: preference or SFT data (any dataset format `train` reads), or a .txt
    /// file of lines.
    #[arg(long)]
    data: PathBuf,
    /// The per-layer KL JSON to write.
    #[arg(long, default_value = "kl.json")]
    output: PathBuf,
    /// Use the first N rows (0: all).
    #[arg(long, default_value_t = 32)]
    max_rows: usize,
    /// Use the first T tokens of each row.
    #[arg(long, default_value_t = 256)]
    max_len: usize,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// A Jinja chat template file (or a tokenizer_config.json) to use instead of the model's.
    #[arg(long)]
    chat_template: Option<String>,
}

fn run_kl(a: KlArgs) -> Result<()> {
    let opts = eval::kl::KlOptions {
        model: a.model,
        reference: a.reference,
        data: a.data,
        output: a.output,
        max_rows: a.max_rows,
        max_len: a.max_len,
        device: a.device,
        chat_template: a.chat_template,
    };
    let file = eval::kl::run(&opts)?;
    out!("{}", eval::kl::format_table(&file))?;
    eprintln!("wrote {}", opts.output.display());
    Ok(())
}

fn apply_overrides(mut cfg: TrainConfig, a: &TrainArgs) -> Result<TrainConfig> {
    macro_rules! set {
        ($($f:ident),*) => { $( if let Some(v) = &a.$f { cfg.$f = v.clone().into(); } )* };
    }
    set!(
        model,
        data,
        output,
        device,
        steps,
        epochs,
        lr,
        rank,
        alpha,
        grad_accum,
        segment_size,
        seed
    );
    if let Some(v) = &a.valid {
        cfg.valid = Some(v.clone());
    }
    if let Some(m) = a.method {
        cfg.method = m;
    }
    if let Some(t) = a.tokenization {
        cfg.tokenization = t;
    }
    if let Some(t) = &a.chat_template {
        cfg.chat_template = Some(t.clone());
    }
    if let Some(w) = &a.warm_start {
        cfg.warm_start = Some(w.clone());
    }
    if let Some(n) = a.log_every {
        cfg.log_every = n;
    }
    cfg.overwrite |= a.overwrite;
    cfg.tensorboard |= a.tensorboard;
    if !a.set.is_empty() {
        let mut table: toml::Table = toml::from_str(&cfg.to_toml()?)?;
        // TRL's `beta` is the β of the method the run ends with, whichever `--set` names it.
        let method = run_method(a)?.unwrap_or_else(|| cfg_method_name(&cfg));
        // Every setting that cannot be taken is answered at once (a TRL command line brought
        // over may hold several).
        let mut refused = Vec::new();
        for kv in &a.set {
            let taken = (|| -> Result<(String, toml::Value)> {
                let (k, v) = kv.split_once('=').context("expected KEY=VALUE")?;
                let name = TrainConfig::setting_name(k.trim(), &method)?;
                let value = TrainConfig::trl_value(k.trim(), &name, set_value(v))?;
                TrainConfig::check_type(k.trim(), &name, &value)?;
                Ok((name, value))
            })();
            match taken {
                Ok((name, value)) => {
                    table.insert(name, value);
                }
                Err(e) => refused.push(format!("{}: {e:#}", set_given(a, kv))),
            }
        }
        lorafit::config::refuse_at_once(&refused, "settings cannot be taken")?;
        // Deserialised from the table itself: an error names the field and the value given,
        // not a line of the merged settings the user never wrote.
        cfg = table.try_into().context("--set")?;
    }
    Ok(cfg)
}

/// `--listen`'s address: `IP:PORT`, or a host name and port (`localhost:0`) resolved to its
/// first address.
fn parse_listen(s: &str) -> std::result::Result<std::net::SocketAddr, String> {
    use std::net::ToSocketAddrs;
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    s.to_socket_addrs()
        .map_err(|e| format!("{s}: not an address (IP:PORT or HOST:PORT): {e}"))?
        .next()
        .ok_or_else(|| format!("{s}: the name has no address"))
}

/// A `--set` value: TOML, or else the text as a string (`--set method=dpo`).
fn set_value(v: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("x = {v}"))
        .map(|mut t| t.remove("x").unwrap())
        .unwrap_or_else(|_| toml::Value::String(v.to_string()))
}

fn cfg_method_name(cfg: &TrainConfig) -> String {
    cfg_method_name_of(cfg.method).unwrap_or_else(|_| "orpo".into())
}

/// A method's name as settings write it (`dpo`).
fn cfg_method_name_of(m: Method) -> Result<String> {
    Ok(toml::Value::try_from(m)?
        .as_str()
        .context("a method's name")?
        .to_string())
}

/// The method the flags give the run (the last `--set method=`, else `--method`), if they do.
fn run_method(a: &TrainArgs) -> Result<Option<String>> {
    let set = a.set.iter().rev().find_map(|kv| {
        kv.split_once('=')
            .filter(|(k, _)| k.trim() == "method")
            .map(|(_, v)| set_value(v))
    });
    Ok(match (set, a.method) {
        (Some(v), _) => v.as_str().map(str::to_string),
        (None, Some(m)) => Some(cfg_method_name_of(m)?),
        (None, None) => None,
    })
}

/// Whether the output folder was named (flag, `--set`, or the config file), as opposed to left
/// at its default.
fn output_named(a: &TrainArgs) -> Result<bool> {
    if a.output.is_some() {
        return Ok(true);
    }
    let set_names_output = a.set.iter().any(|kv| {
        kv.split_once('=')
            .is_some_and(|(k, _)| matches!(k.trim(), "output" | "output_dir"))
    });
    let file_names_output = match &a.config {
        Some(p) => TrainConfig::settings_table(p)
            .ok()
            .is_some_and(|t| t.contains_key("output") || t.contains_key("output_dir")),
        None => false,
    };
    Ok(set_names_output || file_names_output)
}

fn run_train(a: TrainArgs) -> Result<()> {
    if let (Some(r), Some(w)) = (&a.resume, &a.warm_start) {
        bail!(
            "--resume {} and --warm-start {w}: a resume continues a checkpoint (its adapter, \
             optimiser and schedule), a warm start begins a new run from an adapter; give one",
            r.display()
        );
    }
    // The checkpoint's run.toml, where a resume without a config reads its settings.
    let mut run_settings = None;
    let base = match (&a.config, &a.resume) {
        (Some(p), _) => TrainConfig::from_toml_file_for(p, run_method(&a)?.as_deref())?,
        // A resume without a config continues with the checkpoint's own settings.
        (None, Some(r)) => {
            let checkpoint = lorafit::train::run_folder::find_checkpoint(r)?;
            let settings = checkpoint.join(lorafit::train::run_folder::RUN_SETTINGS);
            if settings.is_file() {
                eprintln!("settings from {} (flags over them)", settings.display());
                let cfg = TrainConfig::from_toml_file(&settings)?;
                run_settings = Some(settings);
                cfg
            } else {
                eprintln!(
                    "note: {} has no {} (an older checkpoint): the settings are the flags and \
                     the defaults",
                    checkpoint.display(),
                    lorafit::train::run_folder::RUN_SETTINGS
                );
                TrainConfig::default()
            }
        }
        (None, None) => TrainConfig::default(),
    };
    let mut cfg = apply_overrides(base, &a)?;
    if let Some(settings) = &run_settings {
        // run.toml holds the steps its epochs gave; new epochs count again unless steps are given.
        let steps_set = a.set.iter().any(|kv| {
            kv.split_once('=')
                .is_some_and(|(k, _)| matches!(k.trim(), "steps" | "max_steps"))
        });
        if a.epochs.is_some() && a.steps.is_none() && !steps_set {
            cfg.steps = 0;
        }
        // Its paths are as the run was given them, relative to the folder it started in.
        lorafit::train::run_folder::check_stored_paths(&cfg, settings)?;
    }
    if let Some(r) = &a.resume {
        // Resuming without naming an output continues in the checkpoint's own run folder.
        if !output_named(&a)? {
            let checkpoint = lorafit::train::run_folder::find_checkpoint(r)?;
            let run_dir = checkpoint.parent().unwrap_or(std::path::Path::new("."));
            cfg.output = run_dir.display().to_string();
        }
    }
    validate_settings(
        &cfg,
        a.config.as_deref().or(run_settings.as_deref()),
        &a.set,
        lorafit::config::SetHint::Set,
    )?;
    if cfg.steps > 0 && cfg.epochs != TrainConfig::default().epochs && run_settings.is_none() {
        eprintln!(
            "note: steps = {} sets the run's length: epochs = {} is not used",
            cfg.steps, cfg.epochs
        );
    }
    let unused = cfg.other_methods_settings()?;
    if !unused.is_empty() {
        eprintln!(
            "note: settings of another method than {:?}, taken and not used: {}",
            cfg.method,
            unused.join(", ")
        );
    }
    // The output folder's problems before the model and data load (the run checks again).
    let checkpoint = (a.resume.as_deref())
        .map(lorafit::train::run_folder::find_checkpoint)
        .transpose()?;
    lorafit::train::run_folder::preflight(
        std::path::Path::new(&cfg.output),
        checkpoint.as_deref(),
        cfg.overwrite,
        cfg.steps,
    )?;
    let device = Device::parse(&cfg.device)?;
    let loaded = trainer::load_configured(&cfg, &device)?;
    let (train_items, valid_items) = trainer::load_train_and_valid(&loaded, &cfg)?;
    eprintln!("{}", cfg.to_toml()?);
    lorafit::train::listeners::stop_on_interrupt()?;
    let outcome = trainer::train(
        &cfg,
        a.resume.as_deref(),
        &loaded,
        &train_items,
        &valid_items,
    )?;
    if outcome.stopped {
        // Interrupted (Ctrl-C or SIGTERM): a checkpoint was written, and the status says the run
        // is not done.
        std::process::exit(lorafit::train::listeners::stop_status());
    }
    Ok(())
}

/// `TrainConfig::validate`, its error naming where the settings came from (a file, a resumed
/// run's settings, and the flags, or the flags alone).
fn validate_settings(
    cfg: &TrainConfig,
    config: Option<&std::path::Path>,
    sets: &[String],
    hint: lorafit::config::SetHint,
) -> Result<()> {
    // The key each setting was written under, the file's then the `--set`s', later over earlier.
    let method = cfg_method_name(cfg);
    let file_keys = config
        .and_then(|p| std::fs::read_to_string(p).ok())
        .and_then(|t| toml::from_str::<toml::Table>(&t).ok())
        .map(|t| t.keys().cloned().collect::<Vec<_>>())
        .unwrap_or_default();
    let set_keys = sets
        .iter()
        .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.trim().to_string()));
    let given_as = file_keys
        .into_iter()
        .chain(set_keys)
        .filter_map(|k| Some((TrainConfig::setting_name(&k, &method).ok()?, k)))
        .collect();
    cfg.validate_as(&given_as, hint)
        .with_context(|| match config {
            Some(p) => format!("settings ({} and flags)", p.display()),
            None => "settings (flags)".to_string(),
        })
}

/// `lorafit lint`: every row checked as `train` would (`data::check`), findings per row, the
/// summary, and exit status 1 when a row is unusable.
fn run_lint(a: LintArgs) -> Result<bool> {
    // The flags over the config's settings over the defaults: the run's settings as train
    // reads them.
    let method = a.method.map(cfg_method_name_of).transpose()?;
    let mut cfg = match &a.config {
        Some(p) => TrainConfig::from_toml_file_for(p, method.as_deref())?,
        None => TrainConfig::default(),
    };
    if let Some(m) = a.model {
        cfg.model = m;
    }
    if let Some(d) = a.data {
        cfg.data = d;
    }
    if let Some(m) = a.method {
        cfg.method = m;
    }
    if let Some(t) = a.tokenization {
        cfg.tokenization = t;
    }
    if let Some(t) = a.chat_template {
        cfg.chat_template = Some(t);
    }
    if let Some(n) = a.max_seq_len {
        cfg.max_seq_len = n;
    }
    if let Some(n) = a.max_prompt_len {
        cfg.max_prompt_len = n;
    }
    if cfg.data.trim().is_empty() {
        match &a.config {
            Some(p) => bail!(
                "--data: {} names no data; name the file to check",
                p.display()
            ),
            None => bail!("--data: name the file to check (or --config, a run's settings)"),
        }
    }
    // Settings train would refuse are refused here too, before any row is read.
    validate_settings(
        &cfg,
        a.config.as_deref(),
        &[],
        lorafit::config::SetHint::Flags,
    )?;
    let path = trainer::resolve_model_path(&cfg.model)?;
    let mut m = data::model_files::load_model_tokens(&path)?;
    m.template =
        data::model_files::run_template(cfg.chat_template.as_deref(), m.template, &m.tokenizer)?;
    let other = match cfg.tokenization {
        Tokenization::Separate => Tokenization::Trl,
        Tokenization::Trl => Tokenization::Separate,
    };
    let opts = data::CheckOptions {
        // Every row is checked and reported: an unusable one is a finding, not the end.
        skip_bad: true,
        compare: Some(data::TokenRules::resolve(other, cfg.method)),
        ..trainer::check_options(&cfg, cfg.method, m.vocab)
    };
    let (rows, report) =
        match data::load_and_check(&cfg.data, None, &m.tokenizer, m.template.as_ref(), &opts) {
            Ok(checked) => checked,
            // The file was read and every row is unusable: the rows' errors, and status 1.
            Err(e) if e.downcast_ref::<data::NoUsableRows>().is_some() => {
                outln!("error: {e:#}")?;
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
    if !a.quiet {
        for r in report.load.skip_reasons.iter().chain(&report.bad_rows) {
            outln!("error: {r}")?;
        }
        for row in rows.iter().filter(|r| !r.findings.is_empty()) {
            let notes: Vec<String> = row.findings.iter().map(|f| f.to_string()).collect();
            outln!("{}: {}", row.at, notes.join("; "))?;
        }
    }
    outln!("{report}")?;
    // What train refuses in sum, not by row.
    if !rows.is_empty() && rows.iter().all(|r| r.weight == 0.0) {
        outln!(
            "error: {}: every row has weight 0; training on it is refused (every step's loss and \
             gradient would be zero)",
            cfg.data
        )?;
        return Ok(false);
    }
    Ok(report.errors() == 0)
}

const DEMO_TRAIN: &str = include_str!("../demo/train.jsonl");
const DEMO_VALID: &str = include_str!("../demo/valid.jsonl");
const DEMO_PROMPTS: [&str; 2] = ["What is 7 plus 8?", "What is the capital of Italy?"];

fn run_demo(a: DemoArgs) -> Result<()> {
    let device = Device::parse(&a.device)?;
    let cfg = TrainConfig {
        model: a.model.clone(),
        data: "demo/train.jsonl".into(),
        valid: Some("demo/valid.jsonl".into()),
        output: a.output.clone(),
        device: a.device.clone(),
        method: Method::Orpo,
        steps: a.steps,
        lr: 2e-4,
        warmup_ratio: 0.05,
        rank: 16,
        max_seq_len: 256,
        max_prompt_len: 128,
        eval_every: 40,
        save_every: 0,
        // The demo is one fixed run: running it again replaces the last one.
        overwrite: true,
        ..TrainConfig::default()
    };
    let loaded = trainer::load_model_and_tokenizer(&cfg.model, &device, cfg.base_quant)?;
    let train_items = trainer::load_items(
        "demo/train.jsonl",
        Some(DEMO_TRAIN),
        cfg.method,
        &loaded,
        &cfg,
    )?;
    let valid_items = trainer::load_items(
        "demo/valid.jsonl",
        Some(DEMO_VALID),
        cfg.method,
        &loaded,
        &cfg,
    )?;
    let gen = |lora: Option<&lorafit::model::Lora>| -> Result<Vec<String>> {
        DEMO_PROMPTS
            .iter()
            .map(|p| {
                lorafit::infer::chat(
                    &loaded.model,
                    lora,
                    &loaded.tokenizer,
                    loaded.template.as_ref(),
                    p,
                    32,
                )
            })
            .collect()
    };
    let before = gen(None)?;
    let base_scores =
        eval::preference::score_pairs(&loaded.model, None, &valid_items, &cfg, "base")?;
    let out = trainer::train(&cfg, None, &loaded, &train_items, &valid_items)?;
    let mut lora = lorafit::model::Lora::load_peft(&out.adapter_dir, &loaded.model.spec, &device)?;
    let after = gen(Some(&lora))?;
    let adapter_name = out.adapter_dir.display().to_string();
    let trained_scores = eval::preference::score_pairs(
        &loaded.model,
        Some(&mut lora),
        &valid_items,
        &cfg,
        &adapter_name,
    )?;
    let comparison = eval::preference::compare(base_scores, trained_scores)?;
    outln!(
        "\nheld-out preference pairs (demo/valid.jsonl):\n{}",
        eval::report::preference_comparison_table(&comparison)
    )?;
    for (i, p) in DEMO_PROMPTS.iter().enumerate() {
        outln!(
            "\nuser: {p}\n  before: {}\n  after:  {}",
            before[i].trim(),
            after[i].trim()
        )?;
    }
    outln!("\nadapter (PEFT format): {}", out.adapter_dir.display())?;
    Ok(())
}

fn run_eval(a: EvalArgs) -> Result<()> {
    let opts = eval::EvalOptions {
        model: a.model,
        base_quant: a.base_quant,
        adapter: a.adapter,
        compare: a.compare,
        data: a.data,
        scorer: a.scorer,
        device: a.device,
        config: a.config,
        method: a.method,
        chat_template: a.chat_template,
        max_new: a.max_new,
        limit: a.limit,
        out: a.out,
        report: a.report,
    };
    // The options' fields are the job server's names; here they are flags.
    opts.validate()
        .map_err(|e| anyhow::anyhow!("--{}: {}", e.field.replace('_', "-"), e.message))?;
    let outcome = eval::run(&opts, &mut |_| Ok(()))?;
    out!("{}", outcome.text)?;
    Ok(())
}

/// `lorafit train`'s arguments with every flag that is not one of its own rewritten as
/// `--set NAME=VALUE` (dashes read as underscores): a setting by lorafit's name or by TRL's as
/// its scripts pass them (`--max_steps 10`, `--learning-rate=2e-4`) takes TRL's meaning of the
/// value (`--max_steps -1`: from the epochs); a TRL setting lorafit has no counterpart for is
/// refused with what it does instead, and any other name with the nearest setting
/// (`TrainConfig::setting_name`). A flag with no value after it (`--use_rslora`, followed by
/// another flag or nothing) is `true`, as transformers' parser reads it. Other commands'
/// arguments are left to the parser.
/// Returns the arguments and, for each `--set` made, the flag as given.
fn settings_as_flags(
    args: Vec<std::ffi::OsString>,
) -> (Vec<std::ffi::OsString>, Vec<(String, String)>) {
    use clap::CommandFactory;
    let mut made = Vec::new();
    if args.get(1).and_then(|a| a.to_str()) != Some("train") {
        return (args, made);
    }
    let cmd = Cli::command();
    let own: Vec<String> = cmd
        .find_subcommand("train")
        .map(|t| {
            t.get_arguments()
                .filter_map(|a| a.get_long().map(str::to_string))
                .chain(["help".to_string()])
                .collect()
        })
        .unwrap_or_default();
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.into_iter().peekable();
    while let Some(arg) = it.next() {
        let Some(flag) = arg.to_str().and_then(|a| a.strip_prefix("--")) else {
            out.push(arg);
            continue;
        };
        if flag.is_empty() {
            // `--`: what follows is not a flag.
            out.push(arg);
            out.extend(it);
            break;
        }
        let (name, inline) = match flag.split_once('=') {
            Some((n, v)) => (n, Some(v.to_string())),
            None => (flag, None),
        };
        let key = name.replace('-', "_");
        if own.iter().any(|o| o == name) {
            out.push(arg);
            continue;
        }
        let (value, given) = match inline {
            Some(v) => (v, format!("--{flag}")),
            None => match it.peek().and_then(|n| n.to_str()) {
                Some(n) if !n.starts_with("--") => {
                    let v = n.to_string();
                    it.next();
                    let given = format!("--{name} {v}");
                    (v, given)
                }
                _ => ("true".to_string(), format!("--{name}")),
            },
        };
        // transformers' parser turns off a flag that is on by default with `--no_NAME`.
        let (key, value) = match key.strip_prefix("no_") {
            Some(rest) if value == "true" && !given.contains(' ') && !given.contains('=') => {
                (rest.to_string(), "false".to_string())
            }
            _ => (key, value),
        };
        let set = format!("{key}={value}");
        made.push((set.clone(), given));
        out.push("--set".into());
        out.push(set.into());
    }
    (out, made)
}

/// How a `--set` entry was given: `--set KEY=VALUE`, or the flag `settings_as_flags` read as it.
fn set_given(a: &TrainArgs, kv: &str) -> String {
    a.flags_as_settings
        .iter()
        .find(|(set, _)| set == kv)
        .map_or_else(|| format!("--set {kv}"), |(_, given)| given.clone())
}

fn main() {
    let (args, flags_as_settings) = settings_as_flags(std::env::args_os().collect());
    let cli = Cli::parse_from(args);
    let result = match cli.cmd {
        Cmd::Train(mut a) => {
            a.flags_as_settings = flags_as_settings;
            run_train(a)
        }
        Cmd::Lint(a) => match run_lint(a) {
            Ok(true) => Ok(()),
            Ok(false) => std::process::exit(1),
            Err(e) => Err(e),
        },
        Cmd::Demo(a) => run_demo(a),
        Cmd::Generate(a) => run_generate(a),
        Cmd::Chat(a) => run_chat(a),
        Cmd::Eval(a) => run_eval(a),
        Cmd::Kl(a) => run_kl(a),
        Cmd::Bench(a) => lorafit::bench::run(a),
        Cmd::Curate(a) => run_curate(a),
        Cmd::Export(a) => run_export(a),
        Cmd::Serve(a) => run_serve(a),
        Cmd::Selftest { device, seed } => {
            (|| {
                if device == "cpu" {
                    bail!("selftest compares a CUDA device against the CPU reference: pass --device cuda (or cuda:N)");
                }
                // Without a GPU there is nothing to compare: the device error's own advice
                // (run on the CPU) does not apply here.
                let device = Device::parse(&device).map_err(|e| {
                    anyhow::anyhow!(
                        "{}; selftest needs a GPU, since it compares one against the CPU reference",
                        format!("{e:#}").replace(", or run on the CPU (--device cpu)", "")
                    )
                })?;
                lorafit::selftest(&device, seed)
            })()
        }
    };
    if let Err(e) = result {
        if let Some(s) = e.chain().find_map(|c| c.downcast_ref::<StdoutError>()) {
            exit_on_stdout_error(s);
        }
        eprintln!("error: {e:#}");
        if disk_full(&e) {
            eprintln!(
                "the disk is full: free space there and run the command again (a training run \
                 resumes from its last checkpoint with --resume)"
            );
        }
        std::process::exit(2);
    }
}

/// Whether an error comes from a write that found no space left.
fn disk_full(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::StorageFull)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--listen` takes an address or a host name with a port.
    #[test]
    fn listen_takes_names_and_addresses() {
        assert_eq!(
            parse_listen("127.0.0.1:0").unwrap(),
            "127.0.0.1:0".parse().unwrap()
        );
        assert!(parse_listen("localhost:0").unwrap().ip().is_loopback());
        assert!(parse_listen("localhost")
            .unwrap_err()
            .contains("not an address"));
    }
}
