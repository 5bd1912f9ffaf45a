//! The bad-input corpus of the data layer: malformed files and rows (JSONL, JSON arrays, CSV /
//! TSV, compressed JSONL and Parquet), wrong
//! types, missing fields, empty strings, ids outside the model's vocabulary, templates that fail
//! and chat-template files that cannot be used. Each must give an error that names the file and,
//! where there is one, the line (the row for Parquet) and the field; rows that train but not as
//! intended (chosen == rejected, duplicates, a prompt ending in an assistant turn) must be counted
//! warnings. All go through `data::load_and_check`, the path `lorafit train` and `lorafit lint`
//! take, and none may panic.

mod common;
use lorafit::data::dataset::DatasetKind;
use lorafit::data::model_files::template_from_setting;
use lorafit::data::{
    load_and_check, ChatTemplate, CheckOptions, CheckReport, TextTokenizer, TokenRules,
    TokenizeOptions,
};
use std::path::PathBuf;

fn scratch() -> PathBuf {
    let d = std::env::temp_dir().join(format!("lorafit-corpus-data-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tokenizer() -> TextTokenizer {
    TextTokenizer::from_file(common::fixture("trl_ids/chatml/tokenizer.json")).unwrap()
}

fn chatml() -> ChatTemplate {
    ChatTemplate::from_tokenizer_config(common::fixture("trl_ids/chatml/tokenizer_config.json"))
        .unwrap()
        .unwrap()
}

/// One corpus entry: a file, how it is read, and what must come of it.
struct Case {
    name: &'static str,
    content: Vec<u8>,
    kind: DatasetKind,
    template: Option<&'static str>,
    vocab: Option<usize>,
    expect: Expect,
}

enum Expect {
    /// An error naming the file, this location (`:N:` for a JSONL line, `row N` for Parquet),
    /// this field, and containing this text.
    Error(Option<&'static str>, Option<&'static str>, &'static str),
    /// Loads, with this counted warning at 1.
    Warning(fn(&CheckReport) -> usize),
}

fn jsonl(name: &'static str, kind: DatasetKind, text: &str, expect: Expect) -> Case {
    Case {
        name,
        content: text.as_bytes().to_vec(),
        kind,
        template: None,
        vocab: None,
        expect,
    }
}

use DatasetKind::{Preference as P, Sft as S};
use Expect::{Error as E, Warning as W};

const GOOD: &str = r#"{"prompt":"What is 2+2?","chosen":" 4","rejected":" 5"}"#;

fn cases() -> Vec<Case> {
    let mut v = vec![
        jsonl("invalid-json", P, "{\"prompt\": ", E(Some(":1:"), None, "invalid JSON")),
        // A file that starts with `[` is one JSON array of rows; a list on a later line is a row.
        jsonl("not-object", P, "[1,2]", E(Some(": row 1:"), None, "expected a JSON object, found a number")),
        jsonl("list-row", P, "{\"prompt\":\"p\",\"chosen\":\"a\",\"rejected\":\"b\"}\n[1,2]", E(Some(":2:"), None, "expected a JSON object, found a list")),
        jsonl("string-row", P, "\"hello\"", E(Some(":1:"), None, "found a string")),
        jsonl("preference-rows-in-sft", S, GOOD, E(Some(":1:"), None, "a preference row (\"chosen\" and \"rejected\"), where SFT needs")),
        jsonl("missing-chosen", P, r#"{"prompt":"p","rejected":"b"}"#, E(Some(":1:"), Some("chosen"), "missing")),
        jsonl("missing-rejected", P, r#"{"prompt":"p","chosen":"a"}"#, E(Some(":1:"), Some("rejected"), "missing")),
        jsonl("chosen-number", P, r#"{"prompt":"p","chosen":5,"rejected":"b"}"#, E(Some(":1:"), Some("chosen"), "found a number")),
        jsonl("chosen-null", P, r#"{"prompt":"p","chosen":null,"rejected":"b"}"#, E(Some(":1:"), Some("chosen"), "found null")),
        jsonl("prompt-number", P, r#"{"prompt":3,"chosen":"a","rejected":"b"}"#, E(Some(":1:"), Some("prompt"), "found a number")),
        jsonl("prompt-object", P, r#"{"prompt":{"x":1},"chosen":"a","rejected":"b"}"#, E(Some(":1:"), Some("prompt"), "found an object")),
        jsonl("empty-chosen", P, r#"{"prompt":"p","chosen":"  ","rejected":"b"}"#, E(Some(":1:"), Some("chosen"), "empty response")),
        jsonl("empty-rejected", P, r#"{"prompt":"p","chosen":"a","rejected":""}"#, E(Some(":1:"), Some("rejected"), "empty response")),
        jsonl("weight-negative", P, &format!("{GOOD}\n{}", r#"{"prompt":"p","chosen":"a","rejected":"b","weight":-0.5}"#), E(Some(":2:"), Some("weight"), "-0.5: expected a number in [0, 1e6]")),
        jsonl("weight-string", P, r#"{"prompt":"p","chosen":"a","rejected":"b","weight":"2"}"#, E(Some(":1:"), Some("weight"), "found a string")),
        jsonl("weight-list", P, r#"{"prompt":"p","chosen":"a","rejected":"b","weight":[1]}"#, E(Some(":1:"), Some("weight"), "found a list")),
        jsonl("empty-prompt", P, r#"{"prompt":"","chosen":"a","rejected":"b"}"#, E(Some(":1:"), Some("prompt"), "empty prompt")),
        jsonl("mixed-types", P, r#"{"prompt":"p","chosen":[{"role":"assistant","content":"a"}],"rejected":"b"}"#, E(Some(":1:"), Some("chosen"), "cannot be mixed")),
        jsonl("unknown-role", P, r#"{"prompt":[{"role":"user","content":"x"}],"chosen":[{"role":"bot","content":"a"}],"rejected":[{"role":"assistant","content":"b"}]}"#, E(Some(":1:"), Some("chosen[0].role"), "unknown role \"bot\"")),
        jsonl("missing-content", P, r#"{"prompt":[{"role":"user"}],"chosen":[{"role":"assistant","content":"a"}],"rejected":[{"role":"assistant","content":"b"}]}"#, E(Some(":1:"), Some("prompt[0].content"), "missing")),
        jsonl("content-number", P, r#"{"prompt":[{"role":"user","content":"x"}],"chosen":[{"role":"assistant","content":7}],"rejected":[{"role":"assistant","content":"b"}]}"#, E(Some(":1:"), Some("chosen[0].content"), "found a number")),
        jsonl("message-not-object", P, r#"{"prompt":[{"role":"user","content":"x"}],"chosen":["a"],"rejected":[{"role":"assistant","content":"b"}]}"#, E(Some(":1:"), Some("chosen[0]"), "expected a message object")),
        jsonl("response-ends-user", P, r#"{"prompt":[{"role":"user","content":"x"}],"chosen":[{"role":"user","content":"a"}],"rejected":[{"role":"assistant","content":"b"}]}"#, E(Some(":1:"), Some("chosen"), "must end with an assistant message")),
        jsonl("empty-prompt-list", P, r#"{"prompt":[],"chosen":[{"role":"assistant","content":"a"}],"rejected":[{"role":"assistant","content":"b"}]}"#, E(Some(":1:"), Some("prompt"), "empty list of messages")),
        jsonl("implicit-no-shared", P, r#"{"chosen":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}],"rejected":[{"role":"user","content":"c"},{"role":"assistant","content":"d"}]}"#, E(Some(":1:"), Some("prompt"), "share no leading messages")),
        jsonl("implicit-text", P, r#"{"chosen":"a","rejected":"b"}"#, E(Some(":1:"), Some("prompt"), "share no leading text")),
        jsonl("implicit-text-equal", P, r#"{"chosen":"Q: a","rejected":"Q: a"}"#, E(Some(":1:"), Some("prompt"), "never differ")),
        jsonl("implicit-mixed", P, r#"{"chosen":"Q: a","rejected":[{"role":"assistant","content":"b"}]}"#, E(Some(":1:"), Some("prompt"), "not both texts")),
        jsonl("h4-prompt-mismatch", P, r#"{"prompt":"What is 2+2?","chosen":[{"role":"user","content":"What is 3+3?"},{"role":"assistant","content":"6"}],"rejected":[{"role":"user","content":"What is 3+3?"},{"role":"assistant","content":"7"}]}"#, E(Some(":1:"), Some("prompt"), "no user turn they share")),
        jsonl("sharegpt-unknown-from", P, r#"{"conversations":[{"from":"bot","value":"x"}],"chosen":{"from":"gpt","value":"a"},"rejected":{"from":"gpt","value":"b"}}"#, E(Some(":1:"), Some("conversations[0].from"), "unknown role")),
        jsonl("sharegpt-missing-chosen", P, r#"{"conversations":[{"from":"human","value":"x"}],"rejected":{"from":"gpt","value":"b"}}"#, E(Some(":1:"), Some("chosen"), "missing")),
        jsonl("sharegpt-not-list", P, r#"{"conversations":"x","chosen":"a","rejected":"b"}"#, E(Some(":1:"), Some("conversations"), "expected a list of messages")),
        jsonl("sharegpt-chosen-number", P, r#"{"conversations":[{"from":"human","value":"x"}],"chosen":3,"rejected":"b"}"#, E(Some(":1:"), Some("chosen"), "found a number")),
        jsonl("error-on-line-4", P, &format!("{GOOD}\n\n{GOOD}\n{{\"prompt\":\"p\",\"chosen\":true,\"rejected\":\"b\"}}\n"), E(Some(":4:"), Some("chosen"), "found a boolean")),
        Case {
            name: "invalid-utf8",
            content: [GOOD.as_bytes(), b"\n{\"prompt\":\"\xff\xfe\"}\n"].concat(),
            kind: P,
            template: None,
            vocab: None,
            expect: E(Some(":2:"), None, "not valid UTF-8"),
        },
        Case {
            name: "ids-outside-vocabulary",
            content: br#"{"prompt":"Q:","chosen":" Paris.","rejected":" Q"}"#.to_vec(),
            kind: P,
            template: None,
            vocab: Some(250),
            expect: E(Some(":1:"), Some("chosen"), "outside the model's vocabulary"),
        },
        Case {
            name: "template-raises",
            content: br#"{"prompt":[{"role":"system","content":"s"},{"role":"user","content":"x"}],"chosen":[{"role":"assistant","content":"a"}],"rejected":[{"role":"assistant","content":"b"}]}"#.to_vec(),
            kind: P,
            template: Some("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"),
            vocab: None,
            expect: E(Some(":1:"), None, "System role not supported"),
        },
        Case {
            name: "template-drops-earlier-turns",
            content: br#"{"prompt":[{"role":"user","content":"x"}],"chosen":[{"role":"assistant","content":"a"}],"rejected":[{"role":"assistant","content":"b"}]}"#.to_vec(),
            kind: P,
            template: Some("{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"),
            vocab: None,
            expect: E(Some(":1:"), None, "chat template problem"),
        },
        jsonl("chat-without-template", P, r#"{"prompt":[{"role":"user","content":"x"}],"chosen":[{"role":"assistant","content":"a"}],"rejected":[{"role":"assistant","content":"b"}]}"#, E(Some(":1:"), None, "no chat template")),
        jsonl("sft-unknown-layout", S, r#"{"foo":"bar"}"#, E(Some(":1:"), None, "expected an SFT row")),
        jsonl("sft-messages-end-user", S, r#"{"messages":[{"role":"user","content":"U"}]}"#, E(Some(":1:"), Some("messages"), "must end with an assistant message")),
        jsonl("sft-messages-only-assistant", S, r#"{"messages":[{"role":"assistant","content":"A"}]}"#, E(Some(":1:"), Some("messages"), "needs at least one message")),
        jsonl("sft-messages-string", S, r#"{"messages":"hi"}"#, E(Some(":1:"), Some("messages"), "expected a list of messages")),
        jsonl("sft-text-number", S, r#"{"text":3}"#, E(Some(":1:"), Some("text"), "found a number")),
        jsonl("sft-text-empty", S, r#"{"text":" "}"#, E(Some(":1:"), Some("text"), "empty text")),
        jsonl("sft-completion-missing", S, r#"{"prompt":"x"}"#, E(Some(":1:"), Some("completion"), "missing")),
        jsonl("sft-completion-empty", S, r#"{"prompt":"x","completion":""}"#, E(Some(":1:"), Some("completion"), "empty response")),
        jsonl("alpaca-missing-output", S, r#"{"instruction":"Do it","input":""}"#, E(Some(":1:"), Some("output"), "missing")),
        jsonl("alpaca-instruction-number", S, r#"{"instruction":1,"output":"x"}"#, E(Some(":1:"), Some("instruction"), "found a number")),
        jsonl("alpaca-empty-output", S, r#"{"instruction":"Do it","output":""}"#, E(Some(":1:"), Some("output"), "empty response")),
        jsonl("alpaca-empty-instruction", S, r#"{"instruction":"","input":"","output":"x"}"#, E(Some(":1:"), Some("instruction"), "empty instruction")),
        jsonl("alpaca-input-list", S, r#"{"instruction":"Do it","input":[1],"output":"x"}"#, E(Some(":1:"), Some("input"), "found a list")),
        jsonl("sharegpt-missing-value", S, r#"{"conversations":[{"from":"human","value":"x"},{"from":"gpt"}]}"#, E(Some(":1:"), Some("conversations[1].value"), "missing")),
        jsonl("sft-completion-number", S, r#"{"prompt":"x","completion":5}"#, E(Some(":1:"), Some("completion"), "found a number")),
        jsonl("empty-file", P, "", E(None, None, "no preference examples found")),
        jsonl("blank-lines-only", P, "\n  \n\n", E(None, None, "no preference examples found")),
        Case {
            name: "not-parquet.parquet",
            content: b"this is not a parquet file".to_vec(),
            kind: P,
            template: None,
            vocab: None,
            expect: E(None, None, "not a readable Parquet file"),
        },
        Case {
            name: "truncated.parquet",
            content: {
                let b = std::fs::read(common::fixture("data/h4_snappy.parquet")).unwrap();
                b[..b.len() / 2].to_vec()
            },
            kind: P,
            template: None,
            vocab: None,
            expect: E(None, None, "Parquet"),
        },
        Case {
            name: "bad-rows.parquet",
            content: std::fs::read(common::fixture("data/bad_rows.parquet")).unwrap(),
            kind: P,
            template: None,
            vocab: None,
            expect: E(Some("row 2"), Some("chosen"), "found null"),
        },
        Case {
            name: "bad-types.parquet",
            content: std::fs::read(common::fixture("data/bad_types.parquet")).unwrap(),
            kind: P,
            template: None,
            vocab: None,
            expect: E(Some("row 1"), Some("chosen"), "found a number"),
        },
        Case {
            name: "sft-rows-in-preference.parquet",
            content: std::fs::read(common::fixture("data/alpaca.parquet")).unwrap(),
            kind: P,
            template: None,
            vocab: None,
            expect: E(Some("row 1"), None, "an SFT row (it has \"output\""),
        },
        // The other formats: a name with an extension is written as given.
        jsonl("wrong-fields.csv", P, "prompt,chosen,rejected\nq,a\n", E(Some(":2:"), None, "2 fields, where the header has 3 columns")),
        jsonl("unclosed-quote.csv", P, "prompt,chosen,rejected\nq,a,b\nq,\"a,b\nr,s,t\n", E(Some(":3:"), None, "never closed")),
        jsonl("empty-prompt.csv", P, "prompt,chosen,rejected\n,a,b\n", E(Some(":2:"), Some("prompt"), "empty prompt")),
        jsonl("bad-weight.csv", P, "prompt,chosen,rejected,weight\nq,a,b,heavy\n", E(Some(":2:"), Some("weight"), "found a string")),
        jsonl("negative-weight.tsv", P, "prompt\tchosen\trejected\tweight\nq\ta\tb\t-1\n", E(Some(":2:"), Some("weight"), "expected a number in [0, 1e6]")),
        jsonl("no-header.csv", P, "", E(None, None, "no header row")),
        jsonl("cut-array.json", P, &format!("[{GOOD},\n{{\"prompt\":"), E(Some(":2:"), None, "does not parse as JSON")),
        jsonl("array-bad-row.json", P, &format!("[{GOOD}, {{\"prompt\":\"p\",\"chosen\":\"a\"}}]"), E(Some(": row 2:"), Some("rejected"), "missing")),
        jsonl("rows-under-a-key.json", P, &format!("{{\n\"train\": [{GOOD}]\n}}"), E(None, None, "Its lists: \"train\" (1 items)")),
        Case {
            name: "bad-line.jsonl.gz",
            content: {
                let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                std::io::Write::write_all(&mut gz, format!("{GOOD}\n{{bad\n").as_bytes()).unwrap();
                gz.finish().unwrap()
            },
            kind: P,
            template: None,
            vocab: None,
            expect: E(Some(":2:"), None, "invalid JSON"),
        },
        Case {
            name: "cut.jsonl.gz",
            content: {
                let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                std::io::Write::write_all(&mut gz, format!("{GOOD}\n{GOOD}\n").as_bytes()).unwrap();
                let b = gz.finish().unwrap();
                b[..b.len() - 12].to_vec()
            },
            kind: P,
            template: None,
            vocab: None,
            expect: E(None, None, "reading"),
        },
        jsonl("weight-huge", P, &format!("{GOOD}\n{}", r#"{"prompt":"p","chosen":"a","rejected":"b","weight":1e308}"#), E(Some(":2:"), Some("weight"), "expected a number in [0, 1e6]")),
        jsonl("h4-first-turns-differ", P, r#"{"prompt":"hi","chosen":[{"role":"user","content":"hi"},{"role":"assistant","content":"x"}],"rejected":[{"role":"user","content":"bye"},{"role":"assistant","content":"y"}]}"#, E(Some(":1:"), Some("prompt"), "their first turns differ")),
        Case {
            name: "nan-weight.parquet",
            content: std::fs::read(common::fixture("data/nan_weight.parquet")).unwrap(),
            kind: P,
            template: None,
            vocab: None,
            expect: E(Some("row 2"), Some("weight"), "NaN, where a finite number is expected"),
        },
        Case {
            name: "utf16.jsonl",
            content: {
                let mut b = vec![0xff, 0xfe];
                b.extend(GOOD.encode_utf16().flat_map(|u| u.to_le_bytes()));
                b
            },
            kind: P,
            template: None,
            vocab: None,
            expect: E(None, None, "the file is UTF-16LE text"),
        },
        Case {
            name: "utf16be-no-bom.jsonl",
            content: GOOD.encode_utf16().flat_map(|u| u.to_be_bytes()).collect(),
            kind: P,
            template: None,
            vocab: None,
            expect: E(None, None, "looks like UTF-16BE text without a byte-order mark"),
        },
        Case {
            name: "utf32le-no-bom.jsonl",
            content: GOOD.chars().flat_map(|c| (c as u32).to_le_bytes()).collect(),
            kind: P,
            template: None,
            vocab: None,
            expect: E(None, None, "looks like UTF-32LE text without a byte-order mark"),
        },
        Case {
            name: "h4.parquet.gz",
            content: {
                let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                let parquet = std::fs::read(common::fixture("data/h4_snappy.parquet")).unwrap();
                std::io::Write::write_all(&mut gz, &parquet).unwrap();
                gz.finish().unwrap()
            },
            kind: P,
            template: None,
            vocab: None,
            expect: E(None, None, "a compressed Parquet file"),
        },
        Case {
            name: "corrupt-metadata.parquet",
            content: flipped_parquet(743),
            kind: P,
            template: None,
            vocab: None,
            expect: E(None, None, "not a readable Parquet file"),
        },
        Case {
            name: "corrupt-page.parquet",
            content: flipped_parquet(535),
            kind: P,
            template: None,
            vocab: None,
            expect: E(None, None, "not a readable Parquet file"),
        },
        Case {
            name: "corrupt-levels.parquet",
            content: flipped_parquet(759),
            kind: P,
            template: None,
            vocab: None,
            expect: E(None, None, "not a readable Parquet file"),
        },
        jsonl("tool-calls", S, TOOL_CALLS, E(Some(":1:"), Some("messages[1].tool_calls"), "tool calls are not read (lorafit trains on text turns): render them into \"content\" or drop the row")),
        jsonl("openai-function-call", S, r#"{"messages":[{"role":"user","content":"Weather?"},{"role":"assistant","content":null,"function_call":{"name":"get_weather","arguments":"{}"}},{"role":"assistant","content":"Sunny."}]}"#, E(Some(":1:"), Some("messages[1].function_call"), "tool calls are not read")),
        jsonl("tools-field", S, r#"{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#, E(Some(":1:"), Some("tools"), "tool definitions are not read")),
        jsonl("message-weight", S, r#"{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello","weight":0},{"role":"user","content":"2+2?"},{"role":"assistant","content":"4","weight":1}]}"#, E(Some(":1:"), Some("messages[1].weight"), "per-message weights are not read")),
        jsonl("preference-tool-calls", P, r#"{"prompt":[{"role":"user","content":"Weather?"}],"chosen":[{"role":"assistant","content":"","tool_calls":[{"type":"function","function":{"name":"w","arguments":"{}"}}]}],"rejected":[{"role":"assistant","content":"No idea."}]}"#, E(Some(":1:"), Some("chosen[0].tool_calls"), "tool calls are not read")),
        jsonl("messages-in-preference", P, r#"{"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Hello"}]}"#, E(Some(":1:"), None, "an SFT row (it has \"messages\" and no \"chosen\"/\"rejected\"), where a preference method (orpo, dpo, simpo) needs chosen and rejected; to train on SFT rows pass --method sft")),
        jsonl("conversations-in-preference", P, r#"{"conversations":[{"from":"human","value":"Hi"},{"from":"gpt","value":"Hello"}]}"#, E(Some(":1:"), None, "an SFT row (it has \"conversations\"")),
        jsonl("text-in-preference", P, r#"{"text":"Once upon a time."}"#, E(Some(":1:"), None, "an SFT row (it has \"text\"")),
        jsonl("rows-under-a-key-one-line.json", P, &format!("{{\"train\": [{GOOD}, {GOOD}]}}\n"), E(None, None, "Its lists: \"train\" (2 items); to train on one, write its items one per line (for example `jq -c '.KEY[]' FILE > rows.jsonl`)")),
        jsonl("pandas-columns.json", P, r#"{"prompt":{"0":"a","1":"b"},"chosen":{"0":"x","1":"y"},"rejected":{"0":"z","1":"w"}}"#, E(None, None, "orient=\"records\", lines=True")),
        jsonl("jq-pretty.json", P, &format!("{0}\n{0}\n", serde_json::to_string_pretty(&serde_json::from_str::<serde_json::Value>(GOOD).unwrap()).unwrap()), E(None, None, "2 JSON objects one after another, each over several lines (as `jq .` prints them)")),
        jsonl("jq-pretty-jsonl", P, &format!("{0}\n{0}\n", serde_json::to_string_pretty(&serde_json::from_str::<serde_json::Value>(GOOD).unwrap()).unwrap()), E(None, None, "write them with `jq -c .")),
        Case {
            name: "rows.jsonl.bz2",
            content: b"BZh91AY&SY\x12\x34\x56\x78rest of the stream".to_vec(),
            kind: P,
            template: None,
            vocab: None,
            expect: E(None, None, "bzip2-compressed: lorafit reads gzip and zstd; decompress it first"),
        },
        Case {
            name: "rows.jsonl.xz",
            content: b"\xfd7zXZ\x00\x00\x04\xe6\xd6\xb4\x46rest of the stream".to_vec(),
            kind: P,
            template: None,
            vocab: None,
            expect: E(None, None, "xz-compressed: lorafit reads gzip and zstd"),
        },
        Case {
            name: "rows.zip",
            content: b"PK\x03\x04\x14\x00\x00\x00\x08\x00rest of the archive".to_vec(),
            kind: P,
            template: None,
            vocab: None,
            expect: E(None, None, "a zip archive: lorafit reads gzip and zstd"),
        },
        jsonl("nan-weight.csv", P, "prompt,chosen,rejected,weight\nq,a,b,NaN\n", E(Some(":2:"), Some("weight"), "NaN, where a finite number is expected")),
        jsonl("inf-weight.tsv", P, "prompt\tchosen\trejected\tweight\nq\ta\tb\tinf\n", E(Some(":2:"), Some("weight"), "inf, where a finite number is expected")),
        jsonl("control-header.csv", P, "prompt,chosen,rejected,a\x1bb,a\x1bb\n", E(Some(":1:"), None, "header names column \"a\\u{1b}b\" twice")),
        jsonl("warn-h4-tie", P, &h4_tie(), W(|r| r.identical_responses)),
        jsonl("warn-implicit-chat-tie", P, r#"{"chosen":[{"role":"user","content":"What is 2+2?"},{"role":"assistant","content":" 4"}],"rejected":[{"role":"user","content":"What is 2+2?"},{"role":"assistant","content":" 4"}]}"#, W(|r| r.identical_responses)),
        jsonl("warn-chosen-equals-rejected", P, r#"{"prompt":"What is 2+2?","chosen":" 4","rejected":" 4"}"#, W(|r| r.identical_responses)),
        jsonl("warn-duplicate", P, &format!("{GOOD}\n{GOOD}\n"), W(|r| r.duplicates)),
        jsonl("warn-prompt-ends-assistant", P, r#"{"prompt":[{"role":"user","content":"x"},{"role":"assistant","content":"The answer"}],"chosen":[{"role":"assistant","content":" is 4"}],"rejected":[{"role":"assistant","content":" is 5"}]}"#, W(|r| r.prompt_ends_with_assistant)),
    ];
    // Every case but the two that test a template (or its absence) gets ChatML.
    for c in &mut v {
        if c.template.is_none() && c.name != "chat-without-template" {
            c.template = Some("chatml");
        }
    }
    v
}

/// An SFT row whose assistant turn is a tool call: its `content` is empty.
const TOOL_CALLS: &str = r#"{"messages":[{"role":"user","content":"Weather in Paris?"},{"role":"assistant","content":"","tool_calls":[{"type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},{"role":"tool","content":"sunny","name":"get_weather"},{"role":"assistant","content":"It is sunny."}]}"#;

/// An H4 UltraFeedback row whose chosen and rejected conversations are the same.
fn h4_tie() -> String {
    let conversation = serde_json::json!([
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": " 4"}
    ]);
    serde_json::json!({"prompt": "What is 2+2?", "chosen": conversation, "rejected": conversation})
        .to_string()
}

/// A text Parquet fixture with the byte at `offset` inverted: at 743 its footer's metadata, at 535
/// a page's data, at 759 a column chunk's description (each made the `parquet` crate panic).
fn flipped_parquet(offset: usize) -> Vec<u8> {
    let mut b = std::fs::read(common::fixture("data/text_gzip.parquet")).unwrap();
    b[offset] ^= 0xff;
    b
}

fn run(c: &Case, skip_bad: bool) -> Result<CheckReport, String> {
    let dir = scratch();
    let ext = if c.name.contains('.') { "" } else { ".jsonl" };
    let path = dir.join(format!("{}{ext}", c.name));
    std::fs::write(&path, &c.content).unwrap();
    let tok = tokenizer();
    let template = match c.template {
        None => None,
        Some("chatml") => Some(chatml()),
        Some(src) => Some(ChatTemplate::new(src, "<|im_start|>", "<|im_end|>").unwrap()),
    };
    let opts = CheckOptions {
        kind: c.kind,
        skip_bad,
        tokenize: TokenizeOptions::new(256, 128),
        compare: Some(TokenRules::TrlOrpo),
        model_vocab: c.vocab.unwrap_or(tok.vocab_size()),
    };
    let p = path.display().to_string();
    load_and_check(&p, None, &tok, template.as_ref(), &opts)
        .map(|(_, r)| r)
        .map_err(|e| format!("{e:#}"))
}

#[test]
fn every_bad_data_input_is_named_or_counted() {
    let cases = cases();
    assert!(cases.len() >= 35, "{} cases", cases.len());
    let mut failures = Vec::new();
    for c in &cases {
        match (&c.expect, run(c, false)) {
            (Expect::Error(at, field, text), Err(e)) => {
                let mut ok = e.contains(c.name) && e.contains(text);
                if let Some(at) = at {
                    ok &= e.contains(at);
                }
                if let Some(f) = field {
                    ok &= e.contains(&format!("field \"{f}\""));
                }
                if !ok {
                    failures.push(format!(
                        "{}: error does not name what it should: {e}",
                        c.name
                    ));
                }
            }
            (Expect::Error(..), Ok(_)) => failures.push(format!("{}: accepted", c.name)),
            (Expect::Warning(count), Ok(r)) => {
                if count(&r) != 1 || r.warnings() != 1 {
                    failures.push(format!("{}: warning not counted once: {r}", c.name));
                }
            }
            (Expect::Warning(_), Err(e)) => failures.push(format!("{}: refused: {e}", c.name)),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The report of preference rows `text` (a file named `name`) read under ChatML with
/// `skip_bad_rows`.
fn skipping(name: &'static str, text: &str) -> CheckReport {
    let c = jsonl(name, P, text, E(None, None, ""));
    run(
        &Case {
            template: Some("chatml"),
            ..c
        },
        true,
    )
    .unwrap()
}

#[test]
fn skip_bad_rows_skips_and_counts_each_bad_row() {
    // Good rows around bad ones of each stage: a malformed row (parse), an id outside the
    // vocabulary (check), a row with no template rendering (check).
    let text = [
        GOOD,
        "not json",
        r#"{"prompt":"What is 3+3?","chosen":" 6","rejected":" 7"}"#,
        r#"{"prompt":"p","chosen":5,"rejected":"b"}"#,
    ]
    .join("\n");
    let r = skipping("skip-bad", &text);
    assert_eq!((r.tokenize.rows, r.load.skipped, r.errors()), (2, 2, 2));
    let reasons = r.load.skip_reasons.join("\n");
    assert!(
        reasons.contains("skip-bad.jsonl:2: invalid JSON"),
        "{reasons}"
    );
    assert!(
        reasons.contains("skip-bad.jsonl:4: field \"chosen\""),
        "{reasons}"
    );
    let shown = r.to_string();
    assert!(
        shown.contains("errors: 2 (2 malformed rows, 0 rows failing a check), skipped"),
        "{shown}"
    );
    // The same in CSV: a record of the wrong width is a row error, skipped and counted.
    let text = "prompt,chosen,rejected\nWhat is 2+2?, 4, 5\nonly,two\nWhat is 3+3?, 6, 7\n";
    let r = skipping("skip-bad.csv", text);
    assert_eq!((r.tokenize.rows, r.load.skipped), (2, 1));
    assert!(
        r.load.skip_reasons[0].contains("skip-bad.csv:3: 2 fields"),
        "{:?}",
        r.load.skip_reasons
    );

    // Rows whose tool calls, tool definitions or per-message weights would be lost are row
    // errors: skipped and counted, never trained as an empty turn.
    let tools = r#"{"prompt":"p","chosen":"a","rejected":"b","tools":[{"type":"function"}]}"#;
    let turn_weight = r#"{"prompt":[{"role":"user","content":"x","weight":0}],"chosen":[{"role":"assistant","content":"a"}],"rejected":[{"role":"assistant","content":"b"}]}"#;
    let tool_call = r#"{"prompt":[{"role":"user","content":"x"}],"chosen":[{"role":"assistant","content":"","tool_calls":[{"type":"function"}]}],"rejected":[{"role":"assistant","content":"b"}]}"#;
    let text = [GOOD, tools, turn_weight, tool_call].join("\n");
    let r = skipping("skip-tools", &text);
    assert_eq!((r.tokenize.rows, r.load.skipped), (1, 3));
    let reasons = r.load.skip_reasons.join("\n");
    for want in [
        "skip-tools.jsonl:2: field \"tools\": tool definitions are not read",
        "skip-tools.jsonl:3: field \"prompt[0].weight\": per-message weights are not read",
        "skip-tools.jsonl:4: field \"chosen[0].tool_calls\": tool calls are not read",
    ] {
        assert!(reasons.contains(want), "{want}: {reasons}");
    }

    // Beyond five errors the summary says how many more there are.
    let mut lines = vec![GOOD.to_string()];
    lines.extend((1..=8).map(|i| format!("bad {i}")));
    let r = skipping("skip-many", &lines.join("\n"));
    let shown = r.to_string();
    assert!(shown.contains("skip-many.jsonl:6: invalid JSON"), "{shown}");
    assert!(!shown.contains("skip-many.jsonl:7:"), "{shown}");
    assert!(shown.contains("\n    ... and 3 more"), "{shown}");

    // A row failing a check after parsing is skipped and counted too: with 262 rows of
    // embedding (the 259 specials and bytes, and a few more), single letters fit and the merged
    // " Paris" (id 278) does not.
    let text = format!(
        "{}\n{}\n",
        r#"{"prompt":"Q:","chosen":"a","rejected":"b"}"#,
        r#"{"prompt":"Q:","chosen":" Paris.","rejected":"b"}"#
    );
    let c = jsonl("skip-vocab", P, &text, E(None, None, ""));
    let r = run(
        &Case {
            vocab: Some(262),
            template: Some("chatml"),
            ..c
        },
        true,
    )
    .unwrap();
    assert_eq!((r.tokenize.rows, r.bad_rows.len()), (1, 1));
    assert!(
        r.bad_rows[0].contains("skip-vocab.jsonl:2: field \"chosen\": token id 278"),
        "{}",
        r.bad_rows[0]
    );
}

#[test]
fn chat_template_setting_files_are_checked() {
    let dir = scratch();
    let tok = tokenizer();
    let missing = dir.join("missing.jinja").display().to_string();
    let e = format!("{:#}", template_from_setting(&missing, &tok).unwrap_err());
    assert!(e.contains("missing.jinja"), "{e}");
    let empty = dir.join("empty.jinja");
    std::fs::write(&empty, "  \n").unwrap();
    let e = format!(
        "{:#}",
        template_from_setting(&empty.display().to_string(), &tok).unwrap_err()
    );
    assert!(e.contains("empty.jinja") && e.contains("empty"), "{e}");
    let broken = dir.join("broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}{{ m['content'] }").unwrap();
    let e = format!(
        "{:#}",
        template_from_setting(&broken.display().to_string(), &tok).unwrap_err()
    );
    assert!(
        e.contains("broken.jinja") && e.contains("does not compile"),
        "{e}"
    );
    let no_template = dir.join("tokenizer_config.json");
    std::fs::write(&no_template, r#"{"eos_token": "<|im_end|>"}"#).unwrap();
    let e = format!(
        "{:#}",
        template_from_setting(&no_template.display().to_string(), &tok).unwrap_err()
    );
    assert!(
        e.contains("tokenizer_config.json") && e.contains("no \"chat_template\""),
        "{e}"
    );
    // A good one renders with the tokenizer's BOS/EOS strings.
    let good = dir.join("good.jinja");
    std::fs::write(
        &good,
        "{{ bos_token }}{% for m in messages %}{{ m['content'] + eos_token }}{% endfor %}",
    )
    .unwrap();
    let t = template_from_setting(&good.display().to_string(), &tok).unwrap();
    let text = t
        .render(&[lorafit::data::Message::user("hi")], false)
        .unwrap();
    assert_eq!(text, "<|im_start|>hi<|im_end|>");
}

/// A row's `weight` reaches the checked rows (1 when absent or null; 0 allowed), preference or
/// SFT.
#[test]
fn row_weights_are_read() {
    let text = [
        GOOD,
        r#"{"prompt":"What is 3+3?","chosen":" 6","rejected":" 7","weight":2.5}"#,
        r#"{"prompt":"What is 4+4?","chosen":" 8","rejected":" 9","weight":0}"#,
        r#"{"prompt":"What is 5+5?","chosen":" 10","rejected":" 11","weight":null}"#,
    ]
    .join("\n");
    let path = scratch().join("weights.jsonl");
    std::fs::write(&path, text).unwrap();
    let tok = tokenizer();
    let opts = CheckOptions {
        kind: P,
        skip_bad: false,
        tokenize: TokenizeOptions::new(256, 128),
        compare: None,
        model_vocab: tok.vocab_size(),
    };
    let (rows, _) = load_and_check(&path.display().to_string(), None, &tok, None, &opts).unwrap();
    let w: Vec<f64> = rows.iter().map(|r| r.weight).collect();
    assert_eq!(w, [1.0, 2.5, 0.0, 1.0]);
    // SFT rows are weighted as preference rows are, and a bad weight is a row error there too.
    let sft = scratch().join("sft-weights.jsonl");
    std::fs::write(
        &sft,
        "{\"prompt\":\"Q:\",\"completion\":\" a\",\"weight\":3}\n{\"prompt\":\"Q:\",\"completion\":\" b\"}\n",
    )
    .unwrap();
    let sft_opts = CheckOptions {
        kind: lorafit::data::DatasetKind::Sft,
        ..opts
    };
    let (rows, _) =
        load_and_check(&sft.display().to_string(), None, &tok, None, &sft_opts).unwrap();
    let w: Vec<f64> = rows.iter().map(|r| r.weight).collect();
    assert_eq!(w, [3.0, 1.0]);
    std::fs::write(
        &sft,
        "{\"prompt\":\"Q:\",\"completion\":\" a\",\"weight\":\"abc\"}\n",
    )
    .unwrap();
    let e = load_and_check(&sft.display().to_string(), None, &tok, None, &sft_opts)
        .unwrap_err()
        .to_string();
    assert!(e.contains(":1: field \"weight\""), "{e}");
}

/// Rows are checked in parallel and gathered in file order: over 3000 rows (beyond the progress
/// bar's threshold) with rows failing a check at lines 700, 1500 and 2900, the strict run names
/// line 700, the skipping run lists the three in order, and a duplicate names the first of its
/// copies, however the threads ran.
#[test]
fn parallel_checks_report_in_file_order() {
    let good = |i: usize| format!(r#"{{"prompt":"Q{i}:","chosen":"a","rejected":"b"}}"#);
    let bad = r#"{"prompt":"Q:","chosen":" Paris.","rejected":"b"}"#;
    let lines: Vec<String> = (1..=3000)
        .map(|line| match line {
            700 | 1500 | 2900 => bad.to_string(),
            2000 => good(10),
            _ => good(line),
        })
        .collect();
    let c = jsonl("ordered", P, &lines.join("\n"), E(None, None, ""));
    let c = Case {
        vocab: Some(262),
        template: Some("chatml"),
        ..c
    };
    let err = run(&c, false).unwrap_err();
    assert!(err.contains("ordered.jsonl:700: field \"chosen\""), "{err}");
    let r = run(&c, true).unwrap();
    let at: Vec<&str> = r
        .bad_rows
        .iter()
        .map(|b| b.split(": field").next().unwrap())
        .collect();
    assert!(
        at.len() == 3
            && at[0].ends_with("ordered.jsonl:700")
            && at[1].ends_with("ordered.jsonl:1500")
            && at[2].ends_with("ordered.jsonl:2900"),
        "{at:?}"
    );
    assert_eq!((r.tokenize.rows, r.duplicates), (2997, 1));
}
