//! `lorafit eval`'s library on a tiny random Qwen2-style model (CPU): per-example preference
//! scores average to exactly the trainer's validation metrics, the base model scores as the
//! untrained adapter does, DPO's base scores are its closed form, comparisons subtract per
//! example, pairs read from a file keep their rows and are read with the run's chat template,
//! and a verifiable-instruction run over the model's own generations scores them as the
//! checkers say.

mod common;

use lorafit::config::{Method, TrainConfig};
use lorafit::data::{TextTokenizer, TokenizedPair};
use lorafit::eval::{self, preference, prompts};
use lorafit::model::weights::{load_weights, RandomSource};
use lorafit::model::{Lora, Model, ModelSpec};
use lorafit::tensor::{Device, Rng};
use lorafit::train::trainer::{evaluate, train, Item, Loaded};
use std::path::{Path, PathBuf};
use std::str::FromStr;

const TINY_QWEN2: &str = r#"{
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": true
}"#;

fn tiny_model() -> Model {
    let spec = ModelSpec::from_config_json(TINY_QWEN2).unwrap();
    let src = RandomSource {
        spec: spec.clone(),
        seed: 11,
    };
    let weights = load_weights(&spec, &src, &Device::Cpu).unwrap();
    Model::new(spec, weights, Device::Cpu)
}

/// Words `w0 … w{vocab-1}`, one token each, eos `w1`.
fn tiny_tokenizer(vocab: usize) -> TextTokenizer {
    let words: serde_json::Map<String, serde_json::Value> = (0..vocab)
        .map(|i| (format!("w{i}"), serde_json::Value::from(i as u64)))
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": words, "unk_token": "w0"}
    });
    let inner = tokenizers::Tokenizer::from_str(&json.to_string()).unwrap();
    TextTokenizer::new(inner, None, Some(1), false).unwrap()
}

fn tiny_loaded() -> Loaded {
    let model = tiny_model();
    Loaded {
        tokenizer: tiny_tokenizer(model.spec.vocab),
        model,
        template: None,
        model_path: PathBuf::from("random-tiny-qwen2"),
    }
}

/// Learnable pairs: chosen tokens from the lowest quarter of the vocabulary, rejected from the
/// upper half.
fn pairs(n: usize, seed: u64, vocab: u64) -> Vec<TokenizedPair> {
    let mut r = Rng(seed);
    let mut pick = |lo: u64, hi: u64| (lo + r.next_u64() % (hi - lo + 1)) as u32;
    (0..n)
        .map(|_| {
            let (np, nc, nr) = (pick(6, 12), pick(3, 8), pick(3, 8));
            TokenizedPair {
                prompt: (0..np).map(|_| pick(2, vocab - 1)).collect(),
                chosen: (0..nc).map(|_| pick(2, vocab / 4 - 1)).collect(),
                rejected: (0..nr).map(|_| pick(vocab / 2, vocab - 1)).collect(),
            }
        })
        .collect()
}

fn items(n: usize, seed: u64) -> Vec<Item> {
    pairs(n, seed, 128).into_iter().map(Item::pair).collect()
}

fn out_dir(name: &str) -> PathBuf {
    let d =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("eval-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn cfg(output: &Path, steps: usize) -> TrainConfig {
    TrainConfig {
        output: output.display().to_string(),
        data: "in-memory".into(),
        steps,
        lr: 1e-2,
        rank: 8,
        save_every: 0,
        eval_every: 0,
        seed: 7,
        ..Default::default()
    }
}

#[test]
fn per_example_scores_average_to_the_trainers_metrics() {
    let loaded = tiny_loaded();
    let dir = out_dir("orpo");
    let c = cfg(&dir, 12);
    let (train_items, valid_items) = (items(16, 1), items(6, 2));
    let out = train(&c, None, &loaded, &train_items, &valid_items).unwrap();
    let mut lora = Lora::load_peft(&out.adapter_dir, &loaded.model.spec, &Device::Cpu).unwrap();

    let base = preference::score_pairs(&loaded.model, None, &valid_items, &c, "base").unwrap();
    let trained =
        preference::score_pairs(&loaded.model, Some(&mut lora), &valid_items, &c, "adapter")
            .unwrap();
    let reference = evaluate(&loaded.model, &mut lora, &valid_items, &c).unwrap();

    // The same code path and the same summation order: bit-equal means.
    assert_eq!(trained.examples.len(), 6);
    for (k, v) in &reference {
        assert_eq!(trained.overall.get(k), Some(v), "{k}");
    }
    // The base model scores as the trainer's step-0 validation (a fresh adapter, B = 0).
    let first = out.first_valid.as_ref().unwrap();
    for (k, v) in first {
        assert_eq!(base.overall.get(k), Some(v), "{k}");
    }
    // Per example: ORPO's nll is its nll_loss; accuracy is [lw > lr]; margin = lw - lr.
    for e in &trained.examples {
        let m = &e.metrics;
        assert_eq!(m["nll"], m["nll_loss"]);
        assert_eq!(m["accuracy"], f64::from(u8::from(m["lw"] > m["lr"])));
        assert!((m["margin"] - (m["lw"] - m["lr"])).abs() < 1e-12);
    }
    // Training moved the margin up on these learnable pairs.
    assert!(
        trained.overall["margin"] > base.overall["margin"],
        "{} vs {}",
        trained.overall["margin"],
        base.overall["margin"]
    );

    let cmp = preference::compare(base, trained).unwrap();
    for e in &cmp.per_example {
        for (k, d) in &e.delta {
            assert_eq!(*d, e.after[k] - e.before[k], "{k}");
        }
    }
    assert_eq!(
        cmp.delta["margin"],
        cmp.after.overall["margin"] - cmp.before.overall["margin"]
    );
    let table = eval::report::preference_comparison_table(&cmp);
    assert!(table.starts_with("6 preference pairs: before = base, after = adapter"));
    for k in preference::HEADLINE {
        assert!(table.contains(&format!("  {k} ")), "{k} in\n{table}");
    }
}

#[test]
fn dpo_base_scores_are_the_closed_form() {
    // Policy = reference: every reward is 0, so the loss is ln 2, the margin 0, accuracy 0.
    let loaded = tiny_loaded();
    let c = TrainConfig {
        method: Method::Dpo,
        ..cfg(&out_dir("dpo"), 1)
    };
    let run = preference::score_pairs(&loaded.model, None, &items(4, 3), &c, "base").unwrap();
    for e in &run.examples {
        assert!(
            (e.metrics["loss"] - std::f64::consts::LN_2).abs() < 1e-6,
            "{e:?}"
        );
        assert!(e.metrics["margin"].abs() < 1e-6);
        assert_eq!(e.metrics["accuracy"], 0.0);
        // DPO has no NLL term: nll is the chosen response's mean NLL per token.
        assert_eq!(e.metrics["nll"], -e.metrics["lw"]);
    }
    // SFT is not a preference objective.
    let sft = TrainConfig {
        method: Method::Sft,
        ..cfg(&out_dir("sft"), 1)
    };
    let err = preference::score_pairs(&loaded.model, None, &items(1, 3), &sft, "base").unwrap_err();
    assert!(err.to_string().contains("preference objective"), "{err}");
}

#[test]
fn pairs_from_a_file_keep_their_rows() {
    let loaded = tiny_loaded();
    let dir = out_dir("file");
    let path = dir.join("pairs.jsonl");
    std::fs::write(
        &path,
        "{\"prompt\": \"w5 w6 w7\", \"chosen\": \"w9 w10\", \"rejected\": \"w100 w101\"}\n\n\
         {\"prompt\": \"w8 w9\", \"chosen\": \"w11\", \"rejected\": \"w120 w121 w122\"}\n",
    )
    .unwrap();
    let c = cfg(&dir, 1);
    let p = preference::load_pairs(path.to_str().unwrap(), &loaded, &c).unwrap();
    let rows: Vec<&str> = p.iter().map(|i| i.at.as_str()).collect();
    assert!(
        rows[0].ends_with("pairs.jsonl:1") && rows[1].ends_with("pairs.jsonl:3"),
        "{rows:?}"
    );
    let run = preference::score_pairs(&loaded.model, None, &p, &c, "base").unwrap();
    assert_eq!(run.examples[1].at.as_deref(), Some(rows[1]));
    let json = serde_json::to_value(&run).unwrap();
    assert_eq!(json["examples"][1]["at"], rows[1]);
    assert_eq!(json["subject"], "base");

    // A bad row names its line.
    std::fs::write(&path, "{\"prompt\": \"w5\", \"chosen\": \"w9\"}\n").unwrap();
    let err = preference::load_pairs(path.to_str().unwrap(), &loaded, &c)
        .err()
        .expect("a row without \"rejected\" is an error");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("pairs.jsonl:1: field \"rejected\": missing"),
        "{msg}"
    );
}

/// `lorafit eval --config runs/x/plan.toml` reads the pairs as the run read its data: a run
/// whose `chat_template` setting gave a template-less model one scores chat rows with it, where
/// the model alone refuses them.
#[test]
fn pairs_are_read_with_the_runs_chat_template() {
    let dir = out_dir("template");
    let model = common::tiny_run::model_folder(&dir);
    let template = dir.join("plain.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    )
    .unwrap();
    let data = dir.join("chat.jsonl");
    std::fs::write(
        &data,
        r#"{"prompt": [{"role": "user", "content": "w5 w6"}], "chosen": [{"role": "assistant", "content": "w9"}], "rejected": [{"role": "assistant", "content": "w200"}]}"#,
    )
    .unwrap();
    let with = TrainConfig {
        model: model.display().to_string(),
        chat_template: Some(template.display().to_string()),
        ..cfg(&dir, 1)
    };
    let loaded = lorafit::train::trainer::load_configured(&with, &Device::Cpu).unwrap();
    let pairs = preference::load_pairs(data.to_str().unwrap(), &loaded, &with).unwrap();
    assert!(pairs[0].at.ends_with("chat.jsonl:1"), "{}", pairs[0].at);
    let run = preference::score_pairs(&loaded.model, None, &pairs, &with, "base").unwrap();
    assert!(run.overall["loss"].is_finite());

    let without = TrainConfig {
        chat_template: None,
        ..with
    };
    let loaded = lorafit::train::trainer::load_configured(&without, &Device::Cpu).unwrap();
    let err = preference::load_pairs(data.to_str().unwrap(), &loaded, &without)
        .err()
        .expect("chat rows without a template are refused");
    assert!(format!("{err:#}").contains("template"), "{err:#}");
}

#[test]
fn instruction_run_scores_the_models_own_replies() {
    let loaded = tiny_loaded();
    let file = [
        r#"{"key": 1, "prompt": "w5 w6 w7", "instruction_id_list": ["punctuation:no_comma", "startend:quotation"], "kwargs": [{}, {}]}"#,
        r#"{"key": 2, "prompt": "w8 w9", "instruction_id_list": ["length_constraints:number_words"], "kwargs": [{"num_words": 3, "relation": "at least"}]}"#,
    ]
    .join("\n");
    let ps = prompts::parse_prompts(&file, "tiny.jsonl").unwrap();
    let run = eval::run_ifeval(&loaded, None, &ps, 6, "base").unwrap();
    assert_eq!(run.results.len(), 2);
    // The word-level tokenizer decodes to "wN" words: no commas, no quotation marks.
    let r0 = &run.results[0];
    assert!(!r0.response.contains(',') && !r0.response.contains('"'));
    assert!(!r0.strict[1]);
    assert_eq!(r0.strict[0], !r0.response.trim().is_empty());
    // Greedy decoding is deterministic: the same replies twice.
    let again = eval::run_ifeval(&loaded, None, &ps, 6, "base").unwrap();
    assert_eq!(
        run.results.iter().map(|r| &r.response).collect::<Vec<_>>(),
        again
            .results
            .iter()
            .map(|r| &r.response)
            .collect::<Vec<_>>()
    );
    let words = eval::ifeval::count_words(&run.results[1].response);
    assert_eq!(run.results[1].strict[0], words >= 3);
    assert_eq!(run.scores.prompts, 2);
    assert_eq!(run.scores.instructions, 3);

    // Canned replies give exact numbers.
    let canned = eval::score_responses(
        &ps,
        vec!["\"w1 w2\"".into(), "Here:\nw3 w4 w5".into()],
        "canned",
        0,
    );
    assert_eq!(canned.results[0].strict, vec![true, true]);
    assert_eq!(canned.results[1].strict, vec![true]);
    let s = &canned.scores;
    assert_eq!((s.prompt_strict, s.instruction_strict), (1.0, 1.0));
    let bad = eval::score_responses(&ps, vec!["w1, w2".into(), "w3".into()], "bad", 0);
    assert_eq!(bad.scores.prompt_strict, 0.0);
    assert_eq!(bad.scores.instruction_strict, 0.0);
    let md = eval::report::ifeval_comparison_markdown("t", "bad", "canned", &bad.scores, s);
    assert!(md.contains("| prompt | 0.0% | 100.0% | +100.0 |"), "{md}");
}

/// The width and height a PNG's IHDR states, after checking its signature.
fn png_size(png: &[u8]) -> (usize, usize) {
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&png[8..16], b"\x00\x00\x00\x0dIHDR", "IHDR first, 13 bytes");
    let be = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap()) as usize;
    (be(16), be(20))
}

/// Writes `chart` as `name`.png and checks the file: a PNG of the chart's size whose bytes are
/// the chart's encoding; returns the pixel counts of the before and after colours.
fn written_chart(chart: &lorafit::plot::Canvas, name: &str) -> (usize, usize) {
    let path = out_dir(name).join("report.png");
    lorafit::plot::write_png(&path, chart).unwrap();
    let png = std::fs::read(&path).unwrap();
    assert_eq!(png_size(&png), eval::run::CHART_SIZE);
    assert_eq!((chart.width, chart.height), eval::run::CHART_SIZE);
    assert!(png == lorafit::plot::encode_png(chart));
    let count = |c: u8| chart.pixels.iter().filter(|&&p| p == c).count();
    (
        count(lorafit::plot::series_colour(0)),
        count(lorafit::plot::series_colour(1)),
    )
}

#[test]
fn before_after_charts_are_pngs_with_their_bars() {
    let run = |subject: &str, accuracy: f64, margin: f64| preference::PreferenceRun {
        subject: subject.into(),
        examples: vec![preference::ExampleScore {
            index: 0,
            at: Some("pairs.jsonl:1".into()),
            metrics: [
                ("accuracy".to_string(), accuracy),
                ("margin".into(), margin),
            ]
            .into(),
        }],
        overall: [
            ("accuracy".to_string(), accuracy),
            ("margin".into(), margin),
        ]
        .into(),
    };
    let c = preference::compare(
        run("base", 0.5, -0.25),
        run("runs/a-long-run-name/checkpoint-000120/adapter", 1.0, 0.75),
    )
    .unwrap();
    let chart = eval::report::preference_chart(&c, eval::run::CHART_SIZE);
    let (before, after) = written_chart(&chart, "pref-chart");
    // Two panels (accuracy, margin), each with a before and an after bar: the after bars are
    // the larger ones, and each panel holds both colours.
    assert!(before > 2000 && after > before, "{before} {after}");
    let half = chart.width / 2;
    for panel in 0..2 {
        let has = |colour: usize| {
            (0..chart.height).any(|y| {
                (panel * half..(panel + 1) * half)
                    .any(|x| chart.get(x, y) == Some(lorafit::plot::series_colour(colour)))
            })
        };
        assert!(has(0) && has(1), "panel {panel}");
    }

    let file = r#"{"key": 1, "prompt": "w5", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
{"key": 2, "prompt": "w6", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}"#;
    let ps = prompts::parse_prompts(file, "t.jsonl").unwrap();
    let half_right = eval::score_responses(&ps, vec!["w1, w2".into(), "w3".into()], "base", 0);
    let all_right = eval::score_responses(&ps, vec!["w1".into(), "w3".into()], "adapter", 0);
    let chart = eval::report::ifeval_chart(
        "base",
        "adapter",
        &half_right.scores,
        &all_right.scores,
        eval::run::CHART_SIZE,
    );
    let (before, after) = written_chart(&chart, "ifeval-chart");
    // Four bar pairs: before at 50% on every level, after at 100%.
    assert!(before > 4000, "{before}");
    assert!(
        (after as f64) > 1.7 * before as f64,
        "before {before} px, after {after} px"
    );
}

/// An output that is an input, or two outputs that are one file, are refused before anything
/// is loaded or written: `eval --out` naming the `--data` file (by another path too), `--report
/// X.png` with `--compare` (the markdown and its chart would be one file), `--out` equal to
/// `--report`, and `kl --output` naming its `--data`; each input is left as it was.
#[test]
fn outputs_that_would_replace_an_input_or_each_other_are_refused() {
    let dir = out_dir("clash");
    let data = dir.join("pairs.jsonl");
    let rows = "{\"prompt\": \"w2\", \"chosen\": \"w3\", \"rejected\": \"w4\"}\n";
    std::fs::write(&data, rows).unwrap();
    let opts = |out: Option<PathBuf>, report: Option<PathBuf>, compare: bool| eval::EvalOptions {
        model: Some("smollm2".into()),
        data: Some(data.display().to_string()),
        compare: if compare {
            vec!["base".into(), dir.join("adapter").display().to_string()]
        } else {
            vec![]
        },
        out,
        report,
        ..Default::default()
    };
    let refused = |o: eval::EvalOptions| match eval::run(&o, &mut |_| Ok(())) {
        Ok(_) => panic!("{o:?} ran"),
        Err(e) => format!("{e:#}"),
    };
    let e = refused(opts(Some(data.clone()), None, false));
    assert!(e.contains("--out") && e.contains("--data"), "{e}");
    let other_path = dir
        .join(".")
        .join("..")
        .join(dir.file_name().unwrap())
        .join("pairs.jsonl");
    let e = refused(opts(Some(other_path), None, false));
    assert!(e.contains("--out") && e.contains("--data"), "{e}");
    let e = refused(opts(None, Some(dir.join("rr2.png")), true));
    assert!(e.contains("--report") && e.contains("chart"), "{e}");
    let same = dir.join("same.json");
    let e = refused(opts(Some(same.clone()), Some(same.clone()), false));
    assert!(e.contains("--out and --report"), "{e}");
    let e = match eval::kl::run(&eval::kl::KlOptions {
        model: "smollm2".into(),
        reference: "smollm2".into(),
        data: data.clone(),
        output: data.clone(),
        max_rows: 1,
        max_len: 8,
        device: "cpu".into(),
        chat_template: None,
    }) {
        Ok(_) => panic!("kl wrote over its data"),
        Err(e) => format!("{e:#}"),
    };
    assert!(e.contains("--output") && e.contains("--data"), "{e}");
    assert_eq!(std::fs::read_to_string(&data).unwrap(), rows);
    assert!(!dir.join("rr2.png").exists() && !same.exists());
}
