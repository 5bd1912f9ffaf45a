//! `lorafit curate`: each filter removes exactly the rows it should and counts them, raw
//! UltraFeedback rows become their best/worst pair, binarized message rows become training
//! rows as `lorafit train` reads them (with their weight), the validation split is seeded, and
//! bad rows are named by file, line and field.

mod common;

use common::fixture;
use lorafit::curate::{curate_file, curate_reader, load_text_tokenizer, CurateOptions};
use lorafit::data::{ChatTemplate, DatasetKind, TextTokenizer};
use serde_json::{json, Value};

fn tokenizer() -> TextTokenizer {
    load_text_tokenizer(&fixture("gguf/spm_prefix.gguf"))
        .unwrap()
        .0
}

fn template() -> ChatTemplate {
    let src = std::fs::read_to_string(fixture("smollm2_chat_template.jinja")).unwrap();
    ChatTemplate::new(src, "", "").unwrap()
}

fn run(
    lines: &[Value],
    opts: &CurateOptions,
) -> (Vec<Value>, Vec<Value>, lorafit::curate::CurateReport) {
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    curate_reader(
        std::io::Cursor::new(text),
        "in.jsonl",
        &tokenizer(),
        Some(&template()),
        opts,
    )
    .unwrap()
}

/// The error curating `text` as f.jsonl gives.
fn refused(text: String, template: Option<&ChatTemplate>) -> String {
    curate_reader(
        std::io::Cursor::new(text),
        "f.jsonl",
        &tokenizer(),
        template,
        &CurateOptions::default(),
    )
    .err()
    .unwrap()
    .to_string()
}

fn bin(prompt: &str, chosen: &str, rejected: &str, sc: f64, sr: f64) -> Value {
    json!({"prompt": prompt, "chosen": chosen, "rejected": rejected,
           "score_chosen": sc, "score_rejected": sr})
}

#[test]
fn each_filter_removes_and_counts_its_rows() {
    let long = "word ".repeat(400);
    let rows = vec![
        bin("Name a colour.", "Blue is a colour.", "Maybe.", 8.0, 3.0), // kept
        bin("Name a fruit.", "An apple.", "A pear.", 5.0, 4.5),         // gap 0.5 < 1
        bin("Name a tree.", "An oak.", "An oak.", 9.0, 2.0),            // identical
        bin("  name a COLOUR. ", "Red.", "No idea at all.", 7.0, 1.0),  // duplicate prompt
        bin("Write a lot.", &long, "Short answer here.", 9.0, 1.0),     // over the cap
        bin(
            "Say hi.",
            "Hi there, it is lovely to meet you today my friend.",
            "Hi.",
            6.0,
            2.0,
        ), // ratio
        bin(
            "Name a river.",
            "The Nile is a river.",
            "A lake is not.",
            6.0,
            4.0,
        ), // kept
    ];
    let opts = CurateOptions {
        max_tokens: 200,
        ..CurateOptions::default()
    };
    let (train, valid, r) = run(&rows, &opts);
    assert_eq!(r.rows, 7);
    assert_eq!(
        (
            r.small_gap,
            r.identical,
            r.duplicate_prompt,
            r.too_long,
            r.length_ratio
        ),
        (1, 1, 1, 1, 1),
        "{r}"
    );
    assert_eq!((r.train, r.valid), (2, 0));
    assert!(valid.is_empty());
    assert_eq!(train[0]["prompt"], "Name a colour.");
    assert_eq!(train[0]["score_chosen"], 8.0);
    assert_eq!(train[1]["chosen"], "The Nile is a river.");
    // Each filter off: its row comes back.
    let loose = CurateOptions {
        min_score_gap: 0.5,
        max_length_ratio: 1000.0,
        max_tokens: 100_000,
        dedupe: false,
        ..CurateOptions::default()
    };
    let (train, _, r) = run(&rows, &loose);
    assert_eq!(r.train, 6, "{r}");
    assert_eq!(r.identical, 1, "identical responses are never a pair");
    assert_eq!(train.len(), 6);
    // The report prints every count.
    let text = r.to_string();
    assert!(
        text.contains("identical responses") && text.contains("kept"),
        "{text}"
    );
}

#[test]
fn raw_rows_pick_best_and_worst_completion() {
    let raw = json!({
        "instruction": "Explain rain.",
        "completions": [
            {"response": "Water falls.", "overall_score": 6.0,
             "annotations": {"helpfulness": {"Rating": "3"}, "honesty": {"Rating": "5"}}},
            {"response": "Clouds release droplets of water.", "overall_score": 9.0,
             "annotations": {"helpfulness": {"Rating": "5"}, "honesty": {"Rating": "5"}}},
            {"response": "It just happens.", "overall_score": 2.5,
             "annotations": {"helpfulness": {"Rating": "1"}, "honesty": {"Rating": "N/A"}}},
        ]
    });
    let one =
        json!({"instruction": "Alone.", "completions": [{"response": "x", "overall_score": 1}]});
    let (train, _, r) = run(&[raw.clone(), one], &CurateOptions::default());
    assert_eq!(r.too_few_completions, 1);
    assert_eq!(train.len(), 1);
    assert_eq!(train[0]["prompt"], "Explain rain.");
    assert_eq!(train[0]["chosen"], "Clouds release droplets of water.");
    assert_eq!(train[0]["rejected"], "It just happens.");
    assert_eq!(
        (
            train[0]["score_chosen"].as_f64(),
            train[0]["score_rejected"].as_f64()
        ),
        (Some(9.0), Some(2.5))
    );
    // By annotations: means 4.0, 5.0 and 1.0 (N/A is not a rating).
    let opts = CurateOptions {
        score_field: "annotations".into(),
        ..CurateOptions::default()
    };
    let (train, _, _) = run(&[raw], &opts);
    assert_eq!(train[0]["score_chosen"].as_f64(), Some(5.0));
    assert_eq!(train[0]["score_rejected"].as_f64(), Some(1.0));
}

/// HuggingFaceH4/ultrafeedback_binarized's layout: a string prompt and message lists that
/// repeat the user turn. The output is conversational and `lorafit train` reads it.
#[test]
fn binarized_message_rows_become_training_rows() {
    let row = json!({
        "prompt": "What is 2+2?",
        "prompt_id": "abc",
        "chosen": [{"role": "user", "content": "What is 2+2?"},
                   {"role": "assistant", "content": "2+2 is 4."}],
        "rejected": [{"role": "user", "content": "What is 2+2?"},
                     {"role": "assistant", "content": "It is 5."}],
        "score_chosen": 9.0, "score_rejected": 2.0,
    });
    let (train, _, r) = run(&[row], &CurateOptions::default());
    assert_eq!(r.train, 1, "{r}");
    let out = &train[0];
    assert_eq!(
        out["prompt"],
        json!([{"role": "user", "content": "What is 2+2?"}])
    );
    assert_eq!(
        out["chosen"],
        json!([{"role": "assistant", "content": "2+2 is 4."}])
    );
    let line = out.to_string();
    let ex = lorafit::data::dataset::parse_line(&line, DatasetKind::Preference, 1).unwrap();
    assert!(ex.is_chat());
}

#[test]
fn validation_split_is_seeded_and_disjoint() {
    let rows: Vec<Value> = (0..40)
        .map(|i| {
            bin(
                &format!("Question number {i}?"),
                "A fine answer.",
                "A poor one.",
                8.0,
                2.0,
            )
        })
        .collect();
    let opts = |seed| CurateOptions {
        valid_fraction: 0.25,
        seed,
        ..CurateOptions::default()
    };
    let (t1, v1, r) = run(&rows, &opts(3));
    assert_eq!((r.train, r.valid), (30, 10));
    let (t2, v2, _) = run(&rows, &opts(3));
    assert_eq!((&t1, &v1), (&t2, &v2), "same seed, same split");
    let (_, v3, _) = run(&rows, &opts(4));
    assert_ne!(v1, v3, "another seed, another split");
    let prompts = |v: &[Value]| -> Vec<String> {
        v.iter()
            .map(|r| r["prompt"].as_str().unwrap().to_string())
            .collect()
    };
    let (pt, pv) = (prompts(&t1), prompts(&v1));
    assert!(pv.iter().all(|p| !pt.contains(p)), "disjoint");
    // Input order is kept inside each file.
    let index = |p: &String| {
        p.trim_start_matches("Question number ")
            .trim_end_matches('?')
            .parse::<usize>()
            .unwrap()
    };
    assert!(pt.windows(2).all(|w| index(&w[0]) < index(&w[1])));
}

#[test]
fn bad_rows_are_named_by_file_line_and_field() {
    let text = format!(
        "{}\n\n{}\n",
        bin("Fine.", "Good answer.", "Bad answer.", 5.0, 1.0),
        json!({"prompt": "No scores.", "chosen": "a", "rejected": "b"})
    );
    let e = curate_reader(
        std::io::Cursor::new(text.clone()),
        "in.jsonl",
        &tokenizer(),
        None,
        &CurateOptions::default(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("in.jsonl:3") && e.contains("score_chosen"),
        "{e}"
    );
    let cases = [
        (
            json!({"instruction": "x", "completions": [{"response": "a", "overall_score": 1},
                {"response": "b"}]}),
            "completions[1].overall_score",
        ),
        (
            json!({"instruction": "x", "completions": [{"overall_score": 1}, {"response": "b", "overall_score": 2}]}),
            "completions[0].response",
        ),
        (
            json!({"prompt": "p", "chosen": "a", "rejected": 3, "score_chosen": 2, "score_rejected": 1}),
            "rejected",
        ),
        (
            json!({"prompt": "p", "chosen": "a", "rejected": "b", "score_chosen": "high", "score_rejected": 1}),
            "score_chosen",
        ),
    ];
    // A null score is said as null, not as missing.
    let null_score = json!({"prompt": "p", "chosen": "a", "rejected": "b", "score_chosen": null, "score_rejected": 1});
    let e = refused(format!("{null_score}\n"), None);
    assert!(e.contains("field \"score_chosen\": null"), "{e}");
    for (row, field) in cases {
        let e = refused(format!("{row}\n"), None);
        assert!(
            e.contains("f.jsonl:1") && e.contains(&format!("\"{field}\"")),
            "{field}: {e}"
        );
    }
    let e = refused("{not json\n".to_string(), None);
    assert!(e.contains("f.jsonl:1: invalid JSON"), "{e}");
    // With skip_bad_rows the bad row is counted, the rest kept.
    let (train, _, r) = curate_reader(
        std::io::Cursor::new(text),
        "in.jsonl",
        &tokenizer(),
        None,
        &CurateOptions {
            skip_bad_rows: true,
            ..CurateOptions::default()
        },
    )
    .unwrap();
    assert_eq!((r.bad_rows, r.blank_lines, train.len()), (1, 1, 1));
    // Scores become optional with a zero gap.
    let (train, _, _) = curate_reader(
        std::io::Cursor::new(format!(
            "{}\n",
            json!({"prompt": "p", "chosen": "a b", "rejected": "c d"})
        )),
        "in.jsonl",
        &tokenizer(),
        None,
        &CurateOptions {
            min_score_gap: 0.0,
            ..CurateOptions::default()
        },
    )
    .unwrap();
    assert_eq!(train.len(), 1);
    assert!(train[0].get("score_chosen").is_none());
}

/// Message rows need a chat template to be measured: a model without one refuses them, and
/// `chat_template` (`--chat-template`) supplies one, as `lorafit train`'s setting does.
#[test]
fn message_rows_are_measured_with_the_chat_template_setting() {
    let dir = std::env::temp_dir().join(format!("lorafit-curate-tpl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("in.jsonl");
    let row = |i: usize| {
        json!({
            "prompt": format!("Prompt {i}"),
            "chosen": [{"role": "user", "content": format!("Prompt {i}")},
                       {"role": "assistant", "content": "Yes indeed."}],
            "rejected": [{"role": "user", "content": format!("Prompt {i}")},
                         {"role": "assistant", "content": "No way."}],
            "score_chosen": 7.0, "score_rejected": 1.0,
        })
    };
    let rows: String = (0..4).map(|i| format!("{}\n", row(i))).collect();
    std::fs::write(&input, rows).unwrap();
    let model = fixture("gguf/spm_prefix.gguf");
    let out = dir.join("out.jsonl");
    let e = curate_file(&input, &out, None, &model, &CurateOptions::default())
        .expect_err("message rows without a template");
    assert!(format!("{e:#}").contains("template"), "{e:#}");
    let opts = CurateOptions {
        chat_template: Some(fixture("smollm2_chat_template.jinja").display().to_string()),
        ..CurateOptions::default()
    };
    let r = curate_file(&input, &out, None, &model, &opts).unwrap();
    assert_eq!(r.train, 4);
}

#[test]
fn curate_file_writes_both_files() {
    let dir = std::env::temp_dir().join(format!("lorafit-curate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("in.jsonl");
    let rows: String = (0..10)
        .map(|i| {
            format!(
                "{}\n",
                bin(&format!("Prompt {i}"), "Yes indeed.", "No way.", 7.0, 1.0)
            )
        })
        .collect();
    std::fs::write(&input, rows).unwrap();
    let (out, valid) = (dir.join("train.jsonl"), dir.join("valid.jsonl"));
    let opts = CurateOptions {
        valid_fraction: 0.2,
        ..CurateOptions::default()
    };
    let r = curate_file(
        &input,
        &out,
        Some(&valid),
        &fixture("gguf/spm_prefix.gguf"),
        &opts,
    )
    .unwrap();
    assert_eq!((r.train, r.valid), (8, 2));
    let (ex, _) = lorafit::data::load_dataset(&out, DatasetKind::Preference, false).unwrap();
    assert_eq!(ex.len(), 8);
    let (ex, _) = lorafit::data::load_dataset(&valid, DatasetKind::Preference, false).unwrap();
    assert_eq!(ex.len(), 2);
    let e = curate_file(
        &dir.join("missing.jsonl"),
        &out,
        None,
        &fixture("gguf/spm_prefix.gguf"),
        &opts,
    )
    .err()
    .unwrap();
    assert!(format!("{e:#}").contains("missing.jsonl"), "{e:#}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Shards named by a pattern are curated as one input: a prompt seen in an earlier shard is a
/// duplicate in a later one, a CSV shard reads beside a JSONL one, and a bad row is named by its
/// own shard.
#[test]
fn curate_file_reads_the_shards_a_pattern_names() {
    let dir = std::env::temp_dir().join(format!("lorafit-curate-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let rows: String = (0..3)
        .map(|i| {
            format!(
                "{}\n",
                bin(&format!("Prompt {i}"), "Yes indeed.", "No way.", 7.0, 1.0)
            )
        })
        .collect();
    std::fs::write(dir.join("part-0.jsonl"), rows).unwrap();
    std::fs::write(
        dir.join("part-1.csv"),
        "prompt,chosen,rejected\nPrompt 2,Yes indeed.,No way.\nPrompt 3,Sure.,Never.\n",
    )
    .unwrap();
    let out = dir.join("train.jsonl");
    let pattern = dir.join("part-*");
    let model = fixture("gguf/spm_prefix.gguf");
    let opts = CurateOptions {
        min_score_gap: 0.0,
        ..CurateOptions::default()
    };
    let r = curate_file(&pattern, &out, None, &model, &opts).unwrap();
    assert_eq!((r.rows, r.duplicate_prompt, r.train), (5, 1, 4), "{r}");
    std::fs::write(
        dir.join("part-1.csv"),
        "prompt,chosen,rejected\nPrompt 9,,No.\n",
    )
    .unwrap();
    let e = curate_file(&pattern, &out, None, &model, &opts)
        .err()
        .unwrap();
    assert!(
        format!("{e:#}").contains("part-1.csv:2: field \"chosen\""),
        "{e:#}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rows are tokenised in parallel after the other filters, and the first failing row is still
/// the error: here row 2 cannot be tokenised (messages, and the model has no template) and row
/// 3 is malformed; row 2 is named.
#[test]
fn the_first_failing_row_is_named_whatever_its_stage() {
    let dir = std::env::temp_dir().join(format!("lorafit-curate-order-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("order.jsonl");
    let rows = [
        bin("Prompt 1", "Yes indeed.", "No way.", 7.0, 1.0),
        json!({"prompt": "Prompt 2",
               "chosen": [{"role": "user", "content": "Prompt 2"}, {"role": "assistant", "content": "Yes."}],
               "rejected": [{"role": "user", "content": "Prompt 2"}, {"role": "assistant", "content": "No."}],
               "score_chosen": 7.0, "score_rejected": 1.0}),
        json!({"prompt": "Prompt 3", "chosen": 5, "rejected": "No.", "score_chosen": 7.0, "score_rejected": 1.0}),
    ];
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(&input, text).unwrap();
    let e = curate_file(
        &input,
        &dir.join("out.jsonl"),
        None,
        &fixture("gguf/spm_prefix.gguf"),
        &CurateOptions::default(),
    )
    .expect_err("row 2 cannot be tokenised");
    let msg = format!("{e:#}");
    assert!(msg.contains("order.jsonl:2: tokenizing"), "{msg}");
}

#[test]
fn one_file_for_both_outputs_is_refused_before_anything_is_written() {
    let dir = std::env::temp_dir().join(format!("lorafit-curate-same-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("in.jsonl");
    let row = bin("Question?", "Yes.", "No.", 8.0, 2.0);
    std::fs::write(&input, format!("{row}\n")).unwrap();
    let out = dir.join("out.jsonl");
    // The same file named two ways: as given, and through its folder's `..`.
    let again = dir
        .join("..")
        .join(dir.file_name().unwrap())
        .join("out.jsonl");
    let opts = CurateOptions {
        valid_fraction: 0.2,
        ..CurateOptions::default()
    };
    let model = fixture("gguf/spm_prefix.gguf");
    let e = curate_file(&input, &out, Some(&again), &model, &opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--output and --valid-output both name"), "{e}");
    assert!(!out.exists(), "nothing is written");
    // The input named as an output: refused, the input left as it was.
    for (train, valid) in [(&input, None), (&out, Some(&input))] {
        let e = curate_file(&input, train, valid.map(|v| v.as_path()), &model, &opts)
            .unwrap_err()
            .to_string();
        assert!(e.contains("is both read (--input) and written"), "{e}");
    }
    assert_eq!(std::fs::read_to_string(&input).unwrap(), format!("{row}\n"));
    let _ = std::fs::remove_dir_all(&dir);
}

fn msg(role: &str, content: &str) -> Value {
    json!({"role": role, "content": content})
}

/// An H4-layout row: a string prompt, and chosen/rejected as `shared` followed by each tail.
fn h4(prompt: &str, shared: &[Value], chosen: &str, rejected: &str) -> Value {
    let whole = |tail: &str| {
        let mut m = shared.to_vec();
        m.push(msg("assistant", tail));
        Value::Array(m)
    };
    json!({"prompt": prompt, "chosen": whole(chosen), "rejected": whole(rejected),
           "score_chosen": 9, "score_rejected": 2})
}

/// The pair `lorafit train` reads from a row.
fn train_reads(row: &Value) -> lorafit::data::PreferenceData {
    match lorafit::data::dataset::parse_row(row, DatasetKind::Preference, 1).unwrap() {
        lorafit::data::Example::Preference { data, .. } => data,
        other => panic!("not a preference row: {other:?}"),
    }
}

/// H4 rows whose conversations share several leading turns, or open with a system message:
/// the prompt is every shared message and the responses the differing tails, as `lorafit
/// train` splits them, and the filters measure those tails.
#[test]
fn h4_rows_are_split_as_train_splits_them() {
    let multi_turn = h4(
        "Tell me a number",
        &[
            msg("user", "Tell me a number"),
            msg("assistant", "7"),
            msg("user", "Another one"),
        ],
        "8",
        "banana",
    );
    let system = h4(
        "Capital of France?",
        &[
            msg("system", "Be brief."),
            msg("user", "Capital of France?"),
        ],
        "Paris",
        "Lyon",
    );
    let (train, _, r) = run(
        &[multi_turn.clone(), system.clone()],
        &CurateOptions::default(),
    );
    assert_eq!(r.train, 2, "{r}");
    assert_eq!(
        train[0]["prompt"],
        json!([
            msg("user", "Tell me a number"),
            msg("assistant", "7"),
            msg("user", "Another one")
        ])
    );
    assert_eq!(train[0]["chosen"], json!([msg("assistant", "8")]));
    assert_eq!(train[0]["rejected"], json!([msg("assistant", "banana")]));
    assert_eq!(
        train[1]["prompt"],
        json!([
            msg("system", "Be brief."),
            msg("user", "Capital of France?")
        ])
    );
    assert_eq!(train[1]["chosen"], json!([msg("assistant", "Paris")]));
    for (input, output) in [(&multi_turn, &train[0]), (&system, &train[1])] {
        assert_eq!(train_reads(output), train_reads(input));
    }

    // The length ratio is of the tails: a long shared turn no longer hides a one-word chosen
    // reply against a long rejected one.
    let long = "many words in a row ".repeat(15);
    let lopsided = h4(
        "Tell me a story",
        &[
            msg("user", "Tell me a story"),
            msg("assistant", &long),
            msg("user", "Now say it in one word."),
        ],
        "Fine.",
        &long,
    );
    let (train, _, r) = run(&[lopsided], &CurateOptions::default());
    assert_eq!((r.length_ratio, train.len()), (1, 0), "{r}");

    // Two equal conversations leave no response to split off: an identical pair, counted as
    // such; a malformed message in them is still the row's error.
    let same = h4("Hi?", &[msg("user", "Hi?")], "Hello.", "Hello.");
    let (train, _, r) = run(
        &[
            same.clone(),
            h4("Yo?", &[msg("user", "Yo?")], "Hey there.", "Go away."),
        ],
        &CurateOptions::default(),
    );
    assert_eq!((r.identical, r.train), (1, 1), "{r}");
    assert_eq!(train[0]["prompt"], json!([msg("user", "Yo?")]));
    let mut bad = same;
    bad["chosen"][0]["role"] = json!("robot");
    bad["rejected"] = bad["chosen"].clone();
    let e = refused(format!("{bad}\n"), Some(&template()));
    assert!(e.contains("f.jsonl:1: field \"chosen[0].role\""), "{e}");
}

/// `weight`, which `lorafit train` reads, is carried to the output row (from binarized and raw
/// rows); a row without one gets none, and a bad one is the row's error.
#[test]
fn weight_is_carried_to_the_output_row() {
    let mut weighted = bin("Color of sky?", "Blue", "Green", 9.0, 2.0);
    weighted["weight"] = json!(0.25);
    let raw = json!({"instruction": "Explain snow.", "weight": 2,
        "completions": [{"response": "Frozen water falls.", "overall_score": 8},
                        {"response": "Magic.", "overall_score": 2}]});
    let plain = bin("Color of grass?", "Green", "Red", 9.0, 2.0);
    let (train, _, r) = run(&[weighted, raw, plain], &CurateOptions::default());
    assert_eq!(r.train, 3, "{r}");
    assert_eq!(train[0]["weight"], json!(0.25));
    assert_eq!(train[1]["weight"], json!(2.0));
    assert!(train[2].get("weight").is_none(), "{}", train[2]);
    let ex = lorafit::data::dataset::parse_line(&train[0].to_string(), DatasetKind::Preference, 1)
        .unwrap();
    assert_eq!(ex.weight(), 0.25);
    let mut bad = bin("p", "a b", "c d", 9.0, 2.0);
    bad["weight"] = json!(-1);
    let e = refused(format!("{bad}\n"), None);
    assert!(e.contains("f.jsonl:1: field \"weight\""), "{e}");
}

/// An empty CSV score cell is a missing score: kept without it when scores are optional (a
/// score that is there is kept), named as empty when the gap filter needs it.
#[test]
fn empty_csv_score_cells_are_missing_scores() {
    let dir = std::env::temp_dir().join(format!("lorafit-curate-csv-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let input = dir.join("scores.csv");
    std::fs::write(
        &input,
        "prompt,chosen,rejected,score_chosen,score_rejected,weight\n\
         What is 2+2?,4,5,,,\n\
         Capital?,Paris,Lyon,8, ,0.5\n",
    )
    .unwrap();
    let out = dir.join("out.jsonl");
    let model = fixture("gguf/spm_prefix.gguf");
    let optional = CurateOptions {
        min_score_gap: 0.0,
        ..CurateOptions::default()
    };
    let r = curate_file(&input, &out, None, &model, &optional).unwrap();
    assert_eq!(r.train, 2, "{r}");
    let rows: Vec<Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        rows[0],
        json!({"prompt": "What is 2+2?", "chosen": "4", "rejected": "5"})
    );
    assert_eq!(
        rows[1],
        json!({"prompt": "Capital?", "chosen": "Paris", "rejected": "Lyon",
               "score_chosen": 8.0, "weight": 0.5})
    );
    let e = curate_file(&input, &out, None, &model, &CurateOptions::default())
        .err()
        .unwrap();
    assert!(
        format!("{e:#}").contains("scores.csv:2: field \"score_chosen\": empty"),
        "{e:#}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
