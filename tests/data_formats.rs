//! The data files people have, each read into the examples lorafit trains on: the H4
//! UltraFeedback layout, ShareGPT, Alpaca, and local Parquet files (snappy, zstd, gzip pages) with
//! the same layouts; and what `lorafit lint` (`data::check`) finds in a pair: BOS/EOS, a token
//! merged across the boundary, where the two tokenizations differ, truncation and what it cut,
//! length ratios, duplicates. Also: an SFT `{text}` row (no prompt) plans without a panic, and
//! the shards of a split named by a pattern read as one dataset; and files as other tools write
//! them: Parquet `binary` columns and extra float columns, corrupt Parquet, old-Mac JSONL, pandas'
//! CSV, `datasets`' save_to_disk folders.

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
    let e = refusal(&spec);
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

/// One column of a Parquet file written by [`write_parquet`]: raw bytes (a `binary` column, no
/// UTF-8 annotation) or doubles.
enum Col {
    Bytes(&'static str, Vec<Vec<u8>>),
    Double(&'static str, Vec<f64>),
}

/// A Parquet file of required columns, one row group, no compression.
fn write_parquet(path: &std::path::Path, columns: Vec<Col>) {
    use parquet::data_type::{ByteArray, ByteArrayType, DoubleType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let fields: Vec<String> = columns
        .iter()
        .map(|c| match c {
            Col::Bytes(name, _) => format!("REQUIRED BYTE_ARRAY {name};"),
            Col::Double(name, _) => format!("REQUIRED DOUBLE {name};"),
        })
        .collect();
    let schema = parquet::schema::parser::parse_message_type(&format!(
        "message rows {{ {} }}",
        fields.join(" ")
    ))
    .unwrap();
    let file = std::fs::File::create(path).unwrap();
    let props = std::sync::Arc::new(WriterProperties::builder().build());
    let mut writer = SerializedFileWriter::new(file, std::sync::Arc::new(schema), props).unwrap();
    let mut group = writer.next_row_group().unwrap();
    for c in &columns {
        let mut col = group.next_column().unwrap().unwrap();
        match c {
            Col::Bytes(_, v) => {
                let v: Vec<ByteArray> = v.iter().map(|b| ByteArray::from(b.clone())).collect();
                col.typed::<ByteArrayType>()
                    .write_batch(&v, None, None)
                    .unwrap();
            }
            Col::Double(_, v) => {
                col.typed::<DoubleType>()
                    .write_batch(v, None, None)
                    .unwrap();
            }
        }
        col.close().unwrap();
    }
    group.close().unwrap();
    writer.close().unwrap();
}

/// The error reading `path` as preference rows gives.
fn refusal(path: impl AsRef<std::path::Path>) -> String {
    load_dataset(path, DatasetKind::Preference, false)
        .unwrap_err()
        .to_string()
}

fn scratch(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("lorafit-formats-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A Parquet `binary` column holds text as bytes: read as that text where it is UTF-8, a row error
/// naming the row and field where it is not. A NaN in a column lorafit does not read is ignored;
/// in `weight` it is a row error.
#[test]
fn parquet_binary_columns_and_extra_float_columns() {
    let dir = scratch("binary");
    let texts = |v: &[&str]| v.iter().map(|s| s.as_bytes().to_vec()).collect::<Vec<_>>();
    let good = dir.join("binary.parquet");
    write_parquet(
        &good,
        vec![
            Col::Bytes("prompt", texts(&["What is 2+2?", "Wie heißt 東京?"])),
            Col::Bytes("chosen", texts(&[" 4", " Tokio"])),
            Col::Bytes("rejected", texts(&[" 5", " Kyoto"])),
            Col::Double("score", vec![f64::NAN, f64::INFINITY]),
        ],
    );
    let (ex, _) = load_dataset(&good, DatasetKind::Preference, false).unwrap();
    assert_eq!(
        ex[1],
        Example::Preference {
            line: 2,
            data: PreferenceData::Text {
                prompt: "Wie heißt 東京?".into(),
                chosen: " Tokio".into(),
                rejected: " Kyoto".into()
            },
            weight: RowWeight::default(),
        }
    );
    let bad = dir.join("latin1.parquet");
    write_parquet(
        &bad,
        vec![
            Col::Bytes("prompt", texts(&["Q1", "Q2"])),
            Col::Bytes("chosen", texts(&["a", "b"])),
            Col::Bytes("rejected", vec![b"c".to_vec(), b"caf\xe9".to_vec()]),
        ],
    );
    let e = refusal(&bad);
    assert!(
        e.starts_with(&format!(
            "{}: row 2: field \"rejected\": bytes that are not UTF-8 text",
            bad.display()
        )),
        "{e}"
    );
    let weight = dir.join("inf_weight.parquet");
    write_parquet(
        &weight,
        vec![
            Col::Bytes("prompt", texts(&["Q1"])),
            Col::Bytes("chosen", texts(&["a"])),
            Col::Bytes("rejected", texts(&["b"])),
            Col::Double("weight", vec![f64::INFINITY]),
        ],
    );
    let e = refusal(&weight);
    assert!(
        e.ends_with("row 1: field \"weight\": inf, where a finite number is expected"),
        "{e}"
    );
}

/// A Parquet file corrupted where the `parquet` crate panics (in its footer's metadata, in a
/// page, in a column chunk's levels) is an error naming the file, and the process goes on.
#[test]
fn corrupt_parquet_is_an_error_not_a_panic() {
    let dir = scratch("corrupt");
    let fixture = std::fs::read(common::fixture("data/text_gzip.parquet")).unwrap();
    for offset in [535, 743, 759] {
        let mut bytes = fixture.clone();
        bytes[offset] ^= 0xff;
        let path = dir.join(format!("flipped-{offset}.parquet"));
        std::fs::write(&path, bytes).unwrap();
        let e = load_dataset(&path, DatasetKind::Preference, true)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!(
                "{}: not a readable Parquet file (",
                path.display()
            )),
            "{offset}: {e}"
        );
    }
}

/// Text files as other tools write them: JSONL with old-Mac line ends, JSONL named `.csv`, and
/// pandas' `to_csv` (its index as a first column with no name) or a header with a trailing
/// delimiter.
#[test]
fn text_files_as_other_tools_write_them() {
    let dir = scratch("text");
    let rows = [
        r#"{"prompt":"What is 2+2?","chosen":" 4","rejected":" 5"}"#,
        r#"{"prompt":"Capital of France?","chosen":" Paris","rejected":" Lyon"}"#,
        r#"{"prompt":"Colour of the sky?","chosen":" Blue","rejected":" Green"}"#,
    ];
    let prompts = |path: &std::path::Path| -> Vec<(usize, String)> {
        let (ex, _) =
            load_dataset(path, DatasetKind::Preference, false).unwrap_or_else(|e| panic!("{e:#}"));
        ex.iter()
            .map(|e| match e {
                Example::Preference {
                    line,
                    data: PreferenceData::Text { prompt, .. },
                    ..
                } => (*line, prompt.clone()),
                other => panic!("{other:?}"),
            })
            .collect()
    };
    let want = vec![
        (1, "What is 2+2?".to_string()),
        (2, "Capital of France?".to_string()),
        (3, "Colour of the sky?".to_string()),
    ];
    let cr = dir.join("cr.jsonl");
    std::fs::write(&cr, format!("{}\r", rows.join("\r"))).unwrap();
    assert_eq!(prompts(&cr), want);
    let named_csv = dir.join("rows.csv");
    std::fs::write(&named_csv, rows.join("\n")).unwrap();
    assert_eq!(prompts(&named_csv), want);
    let pandas = dir.join("pandas.csv");
    std::fs::write(
        &pandas,
        ",prompt,chosen,rejected\n0,What is 2+2?, 4, 5\n1,Capital of France?, Paris, Lyon\n",
    )
    .unwrap();
    // A CSV record is named by its line, the header's being 1.
    let csv_want = vec![
        (2, "What is 2+2?".to_string()),
        (3, "Capital of France?".to_string()),
    ];
    assert_eq!(prompts(&pandas), csv_want);
    let trailing = dir.join("trailing.csv");
    std::fs::write(
        &trailing,
        "prompt,chosen,rejected,\nWhat is 2+2?, 4, 5,\nCapital of France?, Paris, Lyon,\n",
    )
    .unwrap();
    assert_eq!(prompts(&trailing), csv_want);
    // A column without a name between named ones is still refused.
    let middle = dir.join("middle.csv");
    std::fs::write(&middle, "prompt,,rejected\nq,a,b\n").unwrap();
    let e = refusal(&middle);
    assert!(
        e.ends_with("middle.csv:1: header column 2 has no name"),
        "{e}"
    );
}

/// A folder `datasets`' save_to_disk wrote, a Dataset or a DatasetDict, is answered with how to
/// write it as Parquet; a broken symbolic link names its target.
#[test]
fn saved_datasets_folders_and_broken_links() {
    let dir = scratch("saved");
    let saved = dir.join("saved");
    let split = dir.join("dict").join("train");
    for d in [&saved, &split] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("data-00000-of-00001.arrow"), [0xff; 8]).unwrap();
        std::fs::write(d.join("dataset_info.json"), "{}").unwrap();
        std::fs::write(d.join("state.json"), "{}").unwrap();
    }
    std::fs::write(
        dir.join("dict").join("dataset_dict.json"),
        r#"{"splits": ["train"]}"#,
    )
    .unwrap();
    let e = refusal(&saved);
    assert!(
        e.contains("is a folder") && e.contains("it holds .arrow files: Arrow files"),
        "{e}"
    );
    assert!(
        e.contains("datasets.load_from_disk(DIR).to_parquet(\"train.parquet\")"),
        "{e}"
    );
    let e = load_dataset(dir.join("dict"), DatasetKind::Preference, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("it holds a DatasetDict saved by `datasets` (splits train, as .arrow files)")
            && e.contains("load_from_disk(DIR)[\"train\"].to_parquet"),
        "{e}"
    );
    let link = dir.join("link.jsonl");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("nowhere.jsonl", &link).unwrap();
    let e = refusal(&link);
    assert!(
        e.contains(&format!(
            "{}: a symbolic link to nowhere.jsonl, which does not exist",
            link.display()
        )),
        "{e}"
    );
}
