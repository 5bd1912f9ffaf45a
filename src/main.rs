//! The `lorafit` command line: `train`, `demo`, `generate`, `chat`, `bench` and `selftest`. Every
//! subcommand resolves its flags into library types and calls the library; nothing here computes.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use lorafit::config::{Method, TrainConfig};
use lorafit::tensor::Device;
use lorafit::train::trainer;
use std::path::PathBuf;

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
    /// ORPO on SmolLM2-135M-Instruct with the bundled preference set; before/after accuracy,
    /// margin and generations.
    Demo(DemoArgs),
    /// Generation from a model, optionally with an adapter: the prompt rendered with the model's
    /// chat template (or `--raw`), decoded with a KV cache, streamed, tokens/s on stderr.
    Generate(GenerateArgs),
    /// Interactive chat with a model, optionally with an adapter; `/reset` forgets the
    /// conversation, `/system TEXT` sets the system message, `/quit` ends.
    Chat(ChatArgs),
    /// ORPO training steps on a random-weight model of a named shape; one JSON line per run.
    Bench(lorafit::bench::BenchArgs),
    /// CUDA-vs-CPU parity of every op on this machine's GPU.
    Selftest {
        #[arg(long, default_value = "cuda")]
        device: String,
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
}

#[derive(clap::Args)]
struct TrainArgs {
    /// TOML file with TrainConfig fields; flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    #[arg(long)]
    model: Option<String>,
    #[arg(long)]
    data: Option<String>,
    #[arg(long)]
    valid: Option<String>,
    #[arg(long)]
    output: Option<String>,
    #[arg(long, value_enum)]
    method: Option<Method>,
    #[arg(long)]
    device: Option<String>,
    #[arg(long)]
    steps: Option<usize>,
    #[arg(long)]
    epochs: Option<f64>,
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long)]
    rank: Option<usize>,
    #[arg(long)]
    alpha: Option<f64>,
    #[arg(long)]
    grad_accum: Option<usize>,
    #[arg(long)]
    segment_size: Option<usize>,
    #[arg(long)]
    seed: Option<u64>,
    /// Continue a run from a checkpoint folder (adapter, optimiser, step, data position).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Any TrainConfig field as KEY=VALUE (VALUE in TOML syntax), e.g. --set orpo_lambda=0.2.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
}

/// Model, adapter, device and decoding flags shared by `generate` and `chat`.
#[derive(clap::Args)]
struct DecodeArgs {
    /// Hugging Face folder, .gguf file, or "smollm2".
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// A PEFT adapter folder, applied unmerged.
    #[arg(long)]
    adapter: Option<PathBuf>,
    #[arg(long, default_value = "cpu")]
    device: String,
    /// The most tokens generated per reply.
    #[arg(long, alias = "max-new", default_value_t = 256)]
    max_new_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Keep the most likely tokens whose probabilities sum to p (1: off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep the tokens at least this fraction as likely as the most likely one (0: off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Penalty on tokens already in the sequence (1: off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0)]
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
        let device = Device::parse(&self.device)?;
        let loaded = trainer::load_model_and_tokenizer(&self.model, &device)?;
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
    /// Use the prompt as raw text (no chat template).
    #[arg(long)]
    raw: bool,
    /// The user message (or, with --raw, the text to continue).
    prompt: String,
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
    use std::io::Write;
    let (loaded, lora) = a.decode.load()?;
    let tok = &loaded.tokenizer;
    let ids = if a.raw {
        lorafit::infer::chat_prompt_ids(tok, None, &[Message::user(a.prompt.as_str())])?
    } else {
        let mut messages: Vec<Message> = a.system.iter().map(Message::system).collect();
        messages.push(Message::user(a.prompt.as_str()));
        lorafit::infer::chat_prompt_ids(tok, loaded.template.as_ref(), &messages)?
    };
    let stops = lorafit::infer::default_stop_tokens(tok, loaded.template.as_ref(), &loaded.model);
    let opts = a.decode.options(stops);
    let mut stdout = std::io::stdout();
    let report = lorafit::infer::generate_stream(
        &loaded.model,
        lora.as_ref(),
        &[ids],
        &opts,
        Some(tok),
        &mut |_, delta| {
            let _ = write!(stdout, "{delta}");
            let _ = stdout.flush();
        },
    )?;
    println!();
    eprintln!("{}", report.stats.summary());
    Ok(())
}

fn run_chat(a: ChatArgs) -> Result<()> {
    use std::io::{BufRead, Write};
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
    let mut stdout = std::io::stdout();
    loop {
        print!("> ");
        stdout.flush()?;
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
            _ => {}
        }
        let (_, stats) = session.reply(line, &mut |delta| {
            let _ = write!(stdout, "{delta}");
            let _ = stdout.flush();
        })?;
        println!();
        eprintln!("[{}]", stats.summary());
    }
    Ok(())
}

#[derive(clap::Args)]
struct DemoArgs {
    /// Model (default: SmolLM2-135M-Instruct Q4_1, fetched with pip and cached).
    #[arg(long, default_value = "smollm2")]
    model: String,
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long, default_value_t = 120)]
    steps: usize,
    #[arg(long, default_value = "runs/demo")]
    output: String,
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
    if !a.set.is_empty() {
        let mut table: toml::Table = toml::from_str(&cfg.to_toml()?)?;
        for kv in &a.set {
            let (k, v) = kv
                .split_once('=')
                .with_context(|| format!("--set {kv}: expected KEY=VALUE"))?;
            let value: toml::Value = toml::from_str::<toml::Table>(&format!("x = {v}"))
                .map(|mut t| t.remove("x").unwrap())
                .unwrap_or_else(|_| toml::Value::String(v.to_string()));
            let method = table
                .get("method")
                .and_then(|m| m.as_str())
                .unwrap_or("orpo")
                .to_string();
            let name = TrainConfig::setting_name(k.trim(), &method)
                .with_context(|| format!("--set {kv}"))?;
            table.insert(name, value);
        }
        cfg = toml::from_str(&toml::to_string(&table)?).context("--set")?;
    }
    Ok(cfg)
}

fn run_train(a: TrainArgs) -> Result<()> {
    let base = match &a.config {
        Some(p) => TrainConfig::from_toml_file(p)?,
        None => TrainConfig::default(),
    };
    let cfg = apply_overrides(base, &a)?;
    cfg.validate()?;
    let device = Device::parse(&cfg.device)?;
    let loaded = trainer::load_model_and_tokenizer(&cfg.model, &device)?;
    let train_items = trainer::load_items(&cfg.data, None, cfg.method, &loaded, &cfg)?;
    let valid_items = match &cfg.valid {
        Some(v) => trainer::load_items(v, None, cfg.method, &loaded, &cfg)?,
        None => vec![],
    };
    eprintln!("{}", cfg.to_toml()?);
    trainer::train(
        &cfg,
        a.resume.as_deref(),
        &loaded,
        &train_items,
        &valid_items,
    )?;
    Ok(())
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
        ..TrainConfig::default()
    };
    let loaded = trainer::load_model_and_tokenizer(&cfg.model, &device)?;
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
    let out = trainer::train(&cfg, None, &loaded, &train_items, &valid_items)?;
    let lora = lorafit::model::Lora::load_peft(&out.adapter_dir, &loaded.model.spec, &device)?;
    let after = gen(Some(&lora))?;
    let (b, f) = (
        out.first_valid.unwrap_or_default(),
        out.final_valid.unwrap_or_default(),
    );
    println!("\nheld-out preference pairs ({}):", valid_items.len());
    println!("  {:<10} {:>10} {:>10}", "", "before", "after");
    for k in ["accuracy", "margin", "lw", "lr", "loss"] {
        println!(
            "  {:<10} {:>10.4} {:>10.4}",
            k,
            b.get(k).copied().unwrap_or(f64::NAN),
            f.get(k).copied().unwrap_or(f64::NAN)
        );
    }
    for (i, p) in DEMO_PROMPTS.iter().enumerate() {
        println!(
            "\nuser: {p}\n  before: {}\n  after:  {}",
            before[i].trim(),
            after[i].trim()
        );
    }
    println!("\nadapter (PEFT format): {}", out.adapter_dir.display());
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Train(a) => run_train(a),
        Cmd::Demo(a) => run_demo(a),
        Cmd::Generate(a) => run_generate(a),
        Cmd::Chat(a) => run_chat(a),
        Cmd::Bench(a) => lorafit::bench::run(a),
        Cmd::Selftest { device, seed } => {
            (|| {
                let device = Device::parse(&device)?;
                if !device.is_cuda() {
                    bail!("selftest compares a CUDA device against the CPU reference: pass --device cuda");
                }
                lorafit::selftest(&device, seed)
            })()
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(2);
    }
}
