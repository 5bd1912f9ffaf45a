//! The data files people have, each read into the examples lorafit trains on: the H4
//! UltraFeedback layout, ShareGPT, Alpaca, and local Parquet files (snappy, zstd, gzip pages) with
//! the same layouts; and what `lorafit lint` (`data::check`) finds in a pair: BOS/EOS, a token
//! merged across the boundary, where the two tokenizations differ, truncation and what it cut,
//! length ratios, duplicates. Also: an SFT `{text}` row (no prompt) plans without a panic, and
//! the shards of a split named by a pattern read as one dataset.

mod common;
use lorafit::data::dataset::{load_dataset, read_jsonl, DatasetKind, Example, RowWeight};
use lorafit::data::{
    load_and_check, ChatTemplate, CheckOptions, Finding, Message, PreferenceData, RowTokens,
    SftData, TextTokenizer, TokenRules, TokenizeOptions,
};

fn read(kind: DatasetKind, text: &str) -> Vec<Example> {
    read_jsonl(text.as_bytes(), "t.jsonl", kind, false)
        .unwrap()
        .0
}

fn chat_pair(ex: &Example) -> (&[Message], &[Message], &[Message]) {
    match ex {
        Example::Preference {
            data:
                PreferenceData::Chat {
                    prompt,
                    chosen,
                    rejected,
                },
            ..
        } => (prompt, chosen, rejected),
        other => panic!("not a chat pair: {other:?}"),
    }
}

fn h4_row(q: &str, good: &str, bad: &str) -> String {
    serde_json::json!({
        "prompt": q, "prompt_id": "abc",
        "chosen": [{"role": "user", "content": q}, {"role": "assistant", "content": good}],
        "rejected": [{"role": "user", "content": q}, {"role": "assistant", "content": bad}],
        "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": good}],
        "score_chosen": 8.0, "score_rejected": 2.5
    })
    .to_string()
}

#[test]
fn h4_ultrafeedback_rows() {
    let ex = read(DatasetKind::Preference, &h4_row("What is 2+2?", "4", "5"));
    let (prompt, chosen, rejected) = chat_pair(&ex[0]);
    assert_eq!(prompt, [Message::user("What is 2+2?")]);
    assert_eq!(chosen, [Message::assistant("4")]);
    assert_eq!(rejected, [Message::assistant("5")]);
}

#[test]
fn sharegpt_rows() {
    let sft = read(
        DatasetKind::Sft,
        r#"{"conversations":[{"from":"system","value":"Be brief."},{"from":"human","value":"Hi"},{"from":"gpt","value":"Hello"}]}"#,
    );
    assert_eq!(
        sft[0],
        Example::Sft {
            line: 1,
            weight: RowWeight::default(),
            data: SftData::Chat {
                prompt: vec![Message::system("Be brief."), Message::user("Hi")],
                completion: vec![Message::assistant("Hello")],
            }
        }
    );
    // Preference: the conversation, then the chosen and rejected reply (a message, a list or a
    // string).
    let pref = read(
        DatasetKind::Preference,
        &[
            r#"{"conversations":[{"from":"human","value":"2+2?"}],"chosen":{"from":"gpt","value":"4"},"rejected":{"from":"gpt","value":"5"}}"#,
            r#"{"conversations":[{"from":"human","value":"2+2?"}],"chosen":[{"from":"gpt","value":"4"}],"rejected":"5"}"#,
        ]
        .join("\n"),
    );
    for ex in &pref {
        let (prompt, chosen, rejected) = chat_pair(ex);
        assert_eq!(prompt, [Message::user("2+2?")]);
        assert_eq!(chosen, [Message::assistant("4")]);
        assert_eq!(rejected, [Message::assistant("5")]);
    }
}

#[test]
fn alpaca_rows() {
    let ex = read(
        DatasetKind::Sft,
        &[
            r#"{"instruction":"Add the numbers.","input":"2 and 2","output":"4"}"#,
            r#"{"instruction":"Name the capital of France.","input":"","output":"Paris."}"#,
            r#"{"instruction":"Translate.","input":"hola","output":"hello","system":"You translate."}"#,
        ]
        .join("\n"),
    );
    let chat = |ex: &Example| match ex {
        Example::Sft {
            data: SftData::Chat { prompt, completion },
            ..
        } => (prompt.clone(), completion.clone()),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        chat(&ex[0]),
        (
            vec![Message::user("Add the numbers.\n\n2 and 2")],
            vec![Message::assistant("4")]
        )
    );
    assert_eq!(
        chat(&ex[1]).0,
        vec![Message::user("Name the capital of France.")]
    );
    assert_eq!(
        chat(&ex[2]).0,
        vec![
            Message::system("You translate."),
            Message::user("Translate.\n\nhola")
        ]
    );
}

#[test]
fn parquet_files_in_the_hub_layouts() {
    let h4 = read(
        DatasetKind::Preference,
        &[
            h4_row("What is the capital of France?", "Paris.", "Rome."),
            h4_row("What is 2+2?", "4", "5"),
            h4_row("What is 7 plus 8?", "It is 15.", "It is 16."),
        ]
        .join("\n"),
    );
    for name in ["h4_snappy.parquet", "h4_zstd.parquet"] {
        let (ex, rep) = load_dataset(
            common::fixture(&format!("data/{name}")),
            DatasetKind::Preference,
            false,
        )
        .unwrap();
        assert_eq!(
            (rep.loaded, rep.chat_rows, rep.files[0].numbered_rows),
            (3, 3, true),
            "{name}"
        );
        // The same examples as the JSONL rows (lines numbered as rows).
        assert_eq!(ex, h4, "{name}");
    }
    let (ex, rep) = load_dataset(
        common::fixture("data/text_gzip.parquet"),
        DatasetKind::Preference,
        false,
    )
    .unwrap();
    assert_eq!((rep.loaded, rep.text_rows), (2, 2));
    assert_eq!(
        ex[1],
        Example::Preference {
            line: 2,
            data: PreferenceData::Text {
                prompt: "Q: What is 2+2?\nA:".into(),
                chosen: " 4".into(),
                rejected: " 5".into()
            },
            weight: RowWeight::default(),
        }
    );
    let (ex, _) = load_dataset(
        common::fixture("data/alpaca.parquet"),
        DatasetKind::Sft,
        false,
    )
    .unwrap();
    assert_eq!(ex.len(), 2);
    assert!(ex.iter().all(|e| e.is_chat()));
    // skip_bad_rows: rows 2 (null chosen) and 3 (empty prompt) skipped and counted, by row.
    let (ex, rep) = load_dataset(
        common::fixture("data/bad_rows.parquet"),
        DatasetKind::Preference,
        true,
    )
    .unwrap();
    assert_eq!((ex.len(), rep.skipped), (1, 2));
    assert!(rep.skip_reasons[0].ends_with(
        "bad_rows.parquet: row 2: field \"chosen\": expected a string or a list of messages, found null"
    ), "{}", rep.skip_reasons[0]);
    assert!(
        rep.skip_reasons[1].ends_with("row 3: field \"prompt\": empty prompt"),
        "{}",
        rep.skip_reasons[1]
    );
}

fn chatml() -> (TextTokenizer, ChatTemplate) {
    let dir = common::fixture("trl_ids/chatml");
    (
        TextTokenizer::from_file(dir.join("tokenizer.json")).unwrap(),
        ChatTemplate::from_tokenizer_config(dir.join("tokenizer_config.json"))
            .unwrap()
            .unwrap(),
    )
}

fn lint(
    text: &str,
    max_seq: usize,
    max_prompt: usize,
) -> (Vec<Vec<Finding>>, lorafit::data::CheckReport) {
    let (tok, t) = chatml();
    let path = std::env::temp_dir().join(format!(
        "lorafit-lint-{}-{max_seq}.jsonl",
        std::process::id()
    ));
    std::fs::write(&path, text).unwrap();
    let opts = CheckOptions {
        kind: DatasetKind::Preference,
        skip_bad: false,
        tokenize: TokenizeOptions::new(max_seq, max_prompt),
        compare: Some(TokenRules::TrlOrpo),
        model_vocab: tok.vocab_size(),
    };
    let (rows, rep) =
        load_and_check(&path.display().to_string(), None, &tok, Some(&t), &opts).unwrap();
    (rows.into_iter().map(|r| r.findings).collect(), rep)
}

/// The parts a `RulesDiffer` finding names, in order (empty when there is none).
fn differing_parts(findings: &[Finding]) -> Vec<&'static str> {
    findings
        .iter()
        .find_map(|f| match f {
            Finding::RulesDiffer(parts) => Some(parts.iter().map(|p| p.part).collect()),
            _ => None,
        })
        .unwrap_or_default()
}

#[test]
fn lint_findings_per_pair_and_in_sum() {
    let rows = [
        // 1: text, the prompt ends with a space: " Paris" merges across the boundary; no BOS
        // (ChatML's add_bos_token is false); TRL's ORPO rules would add BOS and move the space.
        r#"{"prompt":"Q: What is the capital of France? A: ","chosen":"Paris.","rejected":"Rome."}"#,
        // 2: chat: ends with <|im_end|>\n, so EOS is there; TRL's ORPO rules add a second one.
        r#"{"prompt":[{"role":"user","content":"What is 2+2?"}],"chosen":[{"role":"assistant","content":"4"}],"rejected":[{"role":"assistant","content":"5"}]}"#,
        // 3: a long chosen against a one-word rejected.
        r#"{"prompt":"Q:","chosen":" Paris Paris Paris Paris Paris Paris Paris Paris Paris Paris Paris Paris","rejected":" Rome"}"#,
        // 4: the same as 1.
        r#"{"prompt":"Q: What is the capital of France? A: ","chosen":"Paris.","rejected":"Rome."}"#,
    ]
    .join("\n");
    let (f, rep) = lint(&rows, 256, 128);
    assert!(f[0].contains(&Finding::NoBos), "{:?}", f[0]);
    assert!(
        f[0].contains(&Finding::BoundaryMerge("chosen")),
        "{:?}",
        f[0]
    );
    assert!(
        f[0].contains(&Finding::BoundaryMerge("rejected")),
        "{:?}",
        f[0]
    );
    assert!(
        differing_parts(&f[0]) == ["prompt", "chosen", "rejected"],
        "{:?}",
        f[0]
    );
    assert!(
        !f[0].iter().any(|x| matches!(x, Finding::NoEos(_))),
        "EOS appended: {:?}",
        f[0]
    );
    assert!(
        differing_parts(&f[1]) == ["chosen", "rejected"],
        "{:?}",
        f[1]
    );
    // Where they differ, shown as text: TRL's second <|im_end|> after ChatML's own.
    let shown = f[1]
        .iter()
        .find(|x| matches!(x, Finding::RulesDiffer(_)))
        .unwrap()
        .to_string();
    assert!(
        shown.contains(r#"chosen from token 3: (its end) here, ["<|im_end|>"] there"#),
        "{shown}"
    );
    assert!(
        !f[1].iter().any(|x| matches!(x, Finding::BoundaryMerge(_))),
        "{:?}",
        f[1]
    );
    assert!(
        f[2].iter()
            .any(|x| matches!(x, Finding::LengthRatio(r) if *r > 4.0)),
        "{:?}",
        f[2]
    );
    assert!(
        matches!(f[3].last(), Some(Finding::Duplicate(at)) if at.ends_with(".jsonl:1")),
        "{:?}",
        f[3]
    );
    assert_eq!(
        (
            rep.boundary_merges,
            rep.duplicates,
            rep.length_ratio,
            rep.errors(),
            rep.warnings()
        ),
        (4, 1, 1, 0, 1)
    );
    assert_eq!(rep.rules_differ, 4);
    let shown = rep.to_string();
    assert!(shown.contains("1 duplicate rows"), "{shown}");
    assert!(
        shown.contains("4 rows get other ids under tokenization trl (ORPOTrainer)"),
        "{shown}"
    );

    // Truncation: what it cut, in tokens and text.
    let (f, rep) = lint(&rows, 8, 4);
    assert_eq!(rep.prompt_cut, 3);
    let cut = f[2]
        .iter()
        .find_map(|x| match x {
            Finding::ResponseCut(n, text) => Some((*n, text.clone())),
            _ => None,
        })
        .expect("row 3's chosen is cut");
    assert!(cut.0 > 0 && cut.1.starts_with(" Paris"), "{cut:?}");
}

#[test]
fn lint_sums_a_trl_run_with_split_prompts() {
    // A merge in chosen only: TRL's ORPOTrainer gives the two responses different prompts.
    let row = r#"{"prompt":"Q: What is the capital of France? A: ","chosen":"Paris.","rejected":"\nRome."}"#;
    let (tok, t) = chatml();
    let path =
        std::env::temp_dir().join(format!("lorafit-lint-split-{}.jsonl", std::process::id()));
    std::fs::write(&path, row).unwrap();
    let opts = CheckOptions {
        kind: DatasetKind::Preference,
        skip_bad: false,
        tokenize: TokenizeOptions::new(256, 128).with_rules(TokenRules::TrlOrpo),
        compare: Some(TokenRules::Separate),
        model_vocab: tok.vocab_size(),
    };
    let (rows, rep) =
        load_and_check(&path.display().to_string(), None, &tok, Some(&t), &opts).unwrap();
    assert_eq!(rep.tokenize.split_prompts, 1);
    assert!(rep
        .to_string()
        .contains("1 pairs whose responses split the prompt differently"));
    let RowTokens::Pair(p) = &rows[0].tokens else {
        panic!()
    };
    // BOS first (TRL adds it), the space token starts the rejected response.
    assert_eq!(p.prompt[0], tok.bos_id().unwrap());
    assert_eq!(p.rejected[0], tok.encode(" ").unwrap()[0]);
}

#[test]
fn sft_text_rows_without_prompt_plan() {
    // `{text}` rows have no prompt: the first token is not a target, the rest are, and nothing
    // panics (the prompt's rows are empty).
    let plan = lorafit::train::plan::Plan::sft(&[], &[5, 6, 7]).unwrap();
    assert_eq!(plan.chosen.response.rows, [0, 1]);
    assert_eq!(plan.chosen.response.targets, [6, 7]);
    assert!(plan.chosen.prompt.rows.is_empty() && plan.chosen.prompt.targets.is_empty());
    assert!(lorafit::train::plan::Plan::sft(&[], &[5]).is_err());
}

/// The shards of one split, named by a pattern, are one dataset: their examples in name order,
/// whatever each shard's format, each row named by its own file, and a duplicate across shards
/// named by the first one's file.
#[test]
fn a_pattern_reads_the_shards_of_a_split_as_one_dataset() {
    let dir = std::env::temp_dir().join(format!("lorafit-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let row = |p: &str| format!(r#"{{"prompt":"{p}","chosen":" a","rejected":" b"}}"#);
    std::fs::write(
        dir.join("train-0.jsonl"),
        format!("{}\n{}\n", row("Q1"), row("Q2")),
    )
    .unwrap();
    std::fs::write(
        dir.join("train-1.csv"),
        "prompt,chosen,rejected\nQ3, a, b\nQ1, a, b\n",
    )
    .unwrap();
    std::fs::write(dir.join("test-0.jsonl"), format!("{}\n", row("T"))).unwrap();
    let spec = format!("{}/train-*", dir.display());
    let (ex, rep) = load_dataset(&spec, DatasetKind::Preference, false).unwrap();
    let prompts: Vec<&str> = ex
        .iter()
        .map(|e| match e {
            Example::Preference {
                data: PreferenceData::Text { prompt, .. },
                ..
            } => prompt.as_str(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(prompts, ["Q1", "Q2", "Q3", "Q1"]);
    assert_eq!(
        (rep.loaded, rep.files.len(), rep.path.as_str()),
        (4, 2, spec.as_str())
    );
    assert_eq!(
        rep.location(2, 2),
        format!("{}/train-1.csv:2", dir.display())
    );
    assert_eq!(
        rep.location(1, 2),
        format!("{}/train-0.jsonl:2", dir.display())
    );

    let (tok, t) = chatml();
    let opts = CheckOptions {
        kind: DatasetKind::Preference,
        skip_bad: false,
        tokenize: TokenizeOptions::new(256, 128),
        compare: None,
        model_vocab: tok.vocab_size(),
    };
    let (rows, rep) = load_and_check(&spec, None, &tok, Some(&t), &opts).unwrap();
    assert_eq!(rep.duplicates, 1);
    assert_eq!(rows[3].at, format!("{}/train-1.csv:3", dir.display()));
    assert_eq!(
        rows[3].findings.last(),
        Some(&Finding::Duplicate(format!(
            "{}/train-0.jsonl:1",
            dir.display()
        )))
    );

    // A bad row in the second shard is named by that shard.
    std::fs::write(dir.join("train-1.csv"), "prompt,chosen,rejected\nQ3,, b\n").unwrap();
    let e = load_dataset(&spec, DatasetKind::Preference, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(&format!(
            "{}/train-1.csv:2: field \"chosen\"",
            dir.display()
        )),
        "{e}"
    );
}

/// Rows whose prompt is implicit in two whole texts split where TRL 1.16's `maybe_extract_prompt`
/// splits them (its output for HH-style and random texts, made by
/// scripts/make_implicit_prompt_fixture.py), and are refused exactly where TRL's split has no
/// meaning: texts that never differ, that differ from the first character (TRL then takes the
/// text up to its last character as the prompt) or share only whitespace, or a response that is
/// only whitespace.
#[test]
fn implicit_text_prompts_split_as_trl_splits_them() {
    let fixture: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixture("data/implicit_text_trl.json")).unwrap(),
    )
    .unwrap();
    let mut split = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let (c, r) = (
            case["chosen"].as_str().unwrap(),
            case["rejected"].as_str().unwrap(),
        );
        let trl: Vec<&str> = case["trl"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        let row = serde_json::json!({"chosen": c, "rejected": r});
        let never = c.starts_with(r) || r.starts_with(c);
        let first_differs = c.chars().next() != r.chars().next();
        match lorafit::data::dataset::parse_row(&row, DatasetKind::Preference, 1) {
            Ok(Example::Preference {
                data:
                    PreferenceData::Text {
                        prompt,
                        chosen,
                        rejected,
                    },
                ..
            }) => {
                assert!(!never && !first_differs, "{case}");
                assert_eq!([prompt.as_str(), &chosen, &rejected], trl[..], "{case}");
                split += 1;
            }
            Ok(other) => panic!("{case}: {other:?}"),
            Err(e) => {
                let e = e.to_string();
                let why = if never {
                    "never differ"
                } else if first_differs || trl[0].trim().is_empty() {
                    "share no leading text"
                } else {
                    assert!(
                        trl[1].trim().is_empty() || trl[2].trim().is_empty(),
                        "{case}: {e}"
                    );
                    "empty response"
                };
                assert!(e.contains(why), "{case}: {e}");
            }
        }
    }
    assert!(split >= 100, "only {split} rows split");
}

/// Every real chat template the fixtures hold — Jinja files, tokenizer_config.json files, GGUF
/// metadata — and SmolLM2's own GGUF template where the model is cached, passes the check a
/// template read from a file must pass (it shows the messages it is given).
#[test]
fn every_real_chat_template_shows_the_messages() {
    fn files(dir: &std::path::Path, found: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                files(&path, found);
            } else {
                found.push(path);
            }
        }
    }
    let gguf_template = |path: &std::path::Path| -> Option<String> {
        let g = lorafit::model::gguf::GgufFile::open(path).unwrap();
        g.get("tokenizer.chat_template")
            .map(|_| g.get_str("tokenizer.chat_template").unwrap().to_string())
    };
    let mut found = Vec::new();
    files(&common::fixture(""), &mut found);
    let mut checked = Vec::new();
    for path in found {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let is_template_file = name.ends_with(".jinja")
            || (name == "tokenizer_config.json"
                && std::fs::read_to_string(&path)
                    .unwrap()
                    .contains("\"chat_template\""));
        if is_template_file {
            ChatTemplate::from_file(&path, "<s>", "</s>")
                .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
            checked.push(path);
        } else if name.ends_with(".gguf") {
            if let Some(source) = gguf_template(&path) {
                ChatTemplate::new(source, "<s>", "</s>")
                    .and_then(|t| t.check_shows_messages())
                    .unwrap_or_else(|e| panic!("{}: {e:#}", path.display()));
                checked.push(path);
            }
        }
    }
    if let Some(path) = lorafit::model::smollm2::find() {
        let source = gguf_template(&path).expect("SmolLM2's GGUF has a chat template");
        ChatTemplate::new(source, "<|im_start|>", "<|im_end|>")
            .and_then(|t| t.check_shows_messages())
            .unwrap();
        checked.push(path);
    }
    // smollm2_chat_template.jinja and the two trl_ids tokenizer configs at least.
    assert!(checked.len() >= 3, "{checked:?}");
}
