//! The `lorafit` command line: `train`, `demo`, `generate`, `bench` and `selftest`. Every
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
    /// Greedy generation from a model, optionally with an adapter.
    Generate {
        #[arg(long, default_value = "smollm2")]
        model: String,
        #[arg(long)]
        adapter: Option<PathBuf>,
        #[arg(long, default_value = "cpu")]
        device: String,
        #[arg(long, default_value_t = 48)]
        max_new: usize,
        /// The user message.
        prompt: String,
    },
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
    #[arg(long)]
    log_every: Option<usize>,
    /// Also write TensorBoard event files beside metrics.jsonl.
    #[arg(long)]
    tensorboard: bool,
    /// Any TrainConfig field as KEY=VALUE (VALUE in TOML syntax), e.g. --set orpo_lambda=0.2.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
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
        Some(p) => std::fs::read_to_string(p)
            .ok()
            .and_then(|t| toml::from_str::<toml::Table>(&t).ok())
            .is_some_and(|t| t.contains_key("output") || t.contains_key("output_dir")),
        None => false,
    };
    Ok(set_names_output || file_names_output)
}

fn run_train(a: TrainArgs) -> Result<()> {
    let base = match &a.config {
        Some(p) => TrainConfig::from_toml_file(p)?,
        None => TrainConfig::default(),
    };
    let mut cfg = apply_overrides(base, &a)?;
    if let Some(r) = &a.resume {
        // Resuming without naming an output continues in the checkpoint's own run folder.
        if !output_named(&a)? {
            let checkpoint = lorafit::train::run_folder::find_checkpoint(r)?;
            let run_dir = checkpoint.parent().unwrap_or(std::path::Path::new("."));
            cfg.output = run_dir.display().to_string();
        }
    }
    cfg.validate().with_context(|| match &a.config {
        Some(p) => format!("settings ({} and flags)", p.display()),
        None => "settings (flags)".to_string(),
    })?;
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
        // The demo is one fixed run: running it again replaces the last one.
        overwrite: true,
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
    println!("  {:<14} {:>10} {:>10}", "", "before", "after");
    for k in [
        "accuracy",
        "margin",
        "logps/chosen",
        "logps/rejected",
        "loss",
    ] {
        println!(
            "  {:<14} {:>10.4} {:>10.4}",
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
        Cmd::Generate {
            model,
            adapter,
            device,
            max_new,
            prompt,
        } => (|| {
            let device = Device::parse(&device)?;
            let loaded = trainer::load_model_and_tokenizer(&model, &device)?;
            let lora = match adapter {
                Some(p) => {
                    let lora = lorafit::model::Lora::load_peft(&p, &loaded.model.spec, &device)?;
                    trainer::check_finite_adapter(&lora, &p.display().to_string())?;
                    Some(lora)
                }
                None => None,
            };
            let text = lorafit::infer::chat(
                &loaded.model,
                lora.as_ref(),
                &loaded.tokenizer,
                loaded.template.as_ref(),
                &prompt,
                max_new,
            )?;
            println!("{text}");
            Ok(())
        })(),
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
