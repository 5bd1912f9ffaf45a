//! Settings and flags are checked before anything runs, each error naming the flag or the key
//! as the user wrote it: `bench`'s numbers, lengths and shapes, `train`'s ranges under TRL's
//! names, negative numbers after a space, and the hints each command prints.

use lorafit::config::{SetHint, TrainConfig};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lorafit-settings-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs lorafit; its exit code and stderr with stdout.
fn lorafit(args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    (out.status.code(), text)
}

const BT: &[&str] = &[
    "bench",
    "--device",
    "cpu",
    "--shape",
    "tiny",
    "--warmup",
    "0",
    "--steps",
    "1",
    "--prompt-len",
    "16",
    "--resp-len",
    "8",
];

/// `BT` with `extra` flags in place of its own of the same names.
fn bench(extra: &[&str]) -> (Option<i32>, String) {
    let mut args: Vec<&str> = Vec::new();
    let mut i = 0;
    while i < BT.len() {
        if BT[i].starts_with("--") && extra.contains(&BT[i]) {
            i += 2;
            continue;
        }
        args.push(BT[i]);
        i += 1;
    }
    lorafit(&[&args, extra].concat())
}

fn refused(r: (Option<i32>, String), wants: &[&str]) {
    let (code, text) = r;
    // lorafit's status for a refused input (never a panic's 101 or an abort).
    assert!(matches!(code, Some(1 | 2)), "{text}");
    assert!(!text.contains("RESULT"), "ran a workload: {text}");
    for w in wants {
        assert!(text.contains(w), "no {w:?} in: {text}");
    }
}

#[test]
fn cce_filter_eps_stops_below_one() {
    for v in ["1", "-1", "nan"] {
        refused(
            bench(&["--cce-filter-eps", v]),
            &["--cce-filter-eps", "[0, 1)"],
        );
    }
    let c = TrainConfig {
        data: "x.jsonl".into(),
        cce_filter_eps: 1.0,
        ..Default::default()
    };
    let e = c.validate().unwrap_err().to_string();
    assert!(
        e.contains("cce_filter_eps = 1") && e.contains("[0, 1)"),
        "{e}"
    );
}

#[test]
fn lengths_past_the_planners_arithmetic_are_refused() {
    for flag in ["--prompt-len", "--resp-len"] {
        for v in ["4611686018427387904", "18446744073709551615"] {
            refused(bench(&[flag, v]), &[flag, "at most"]);
        }
    }
    let c = TrainConfig {
        data: "x.jsonl".into(),
        max_seq_len: 1 << 60,
        ..Default::default()
    };
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("max_seq_len"), "{e}");
}

#[test]
fn a_model_past_host_memory_is_refused_before_it_is_drawn() {
    let d = scratch("huge");
    let cfg = d.join("config.json");
    std::fs::write(
        &cfg,
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":1000000000000,"intermediate_size":256,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":512}"#,
    )
    .unwrap();
    refused(bench(&["--shape", cfg.to_str().unwrap()]), &["GiB"]);
}

#[test]
fn bench_memory_numbers_are_checked() {
    for v in ["0", "-1", "nan", "inf"] {
        refused(bench(&["--memory-limit", v]), &["--memory-limit"]);
    }
    for v in ["-1", "nan"] {
        refused(bench(&["--host-gib", v]), &["--host-gib"]);
    }
}

#[test]
fn a_limit_below_the_model_names_the_model() {
    refused(bench(&["--memory-limit", "1e-6"]), &["model alone"]);
}

#[test]
fn base_quant_offers_what_bench_draws() {
    let (code, text) = lorafit(&["bench", "--help"]);
    assert_eq!(code, Some(0), "{text}");
    let line = text
        .lines()
        .skip_while(|l| !l.contains("--base-quant"))
        .take(6)
        .collect::<String>();
    assert!(!line.contains("q4_1") && !line.contains("q4_k"), "{line}");
    for v in ["q4_1", "q4_k"] {
        let (code, text) = bench(&["--base-quant", v]);
        assert_eq!(code, Some(2), "{text}");
    }
}

/// `--full-layers` and `--resident-layers` are measuring knobs over the planner's choice: where
/// the plan has no place for them, or the model fewer layers, the row runs and says so, and its
/// JSON carries what ran.
#[test]
fn plan_knobs_say_where_they_do_not_apply() {
    let (code, text) = bench(&["--full-layers", "5", "--resident-layers", "3"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("--full-layers has no effect"), "{text}");
    assert!(text.contains("--resident-layers has no effect"), "{text}");
    assert!(text.contains("\"full_layers\":0"), "{text}");
    let (code, text) = bench(&["--full-layers", "100", "--segment-size", "1"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("--full-layers 100: the model has 2 layers, and all 1 below the top one"),
        "{text}"
    );
    assert!(text.contains("\"full_layers\":1,"), "{text}");
    let (code, text) = bench(&["--full-layers", "1", "--segment-size", "1"]);
    assert_eq!(code, Some(0), "{text}");
    assert!(!text.contains("--full-layers"), "{text}");
}

#[test]
fn every_workload_is_checked_before_the_first_runs() {
    refused(bench(&["--also", "0,8"]), &["--also", "field 1"]);
    refused(bench(&["--also", "16,0"]), &["--also", "field 2"]);
    refused(bench(&["--prompt-len", "0"]), &["--prompt-len"]);
}

#[test]
fn shape_files_and_folders() {
    let d = scratch("shape");
    let good = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":200}"#;
    let cfg = d.join("config.json");
    std::fs::write(&cfg, &good[..good.len() / 2]).unwrap();
    refused(
        bench(&["--shape", cfg.to_str().unwrap()]),
        &[cfg.to_str().unwrap()],
    );
    std::fs::write(
        &cfg,
        good.replace("\"intermediate_size\":96", "\"intermediate_size\":0"),
    )
    .unwrap();
    refused(
        bench(&["--shape", cfg.to_str().unwrap()]),
        &["intermediate_size = 0"],
    );
    // A model folder is its config.json.
    std::fs::write(&cfg, good).unwrap();
    let (code, text) = bench(&["--shape", d.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("RESULT"), "{text}");
}

/// Errors of `validate_as` under the keys as written.
fn err_as(c: TrainConfig, given: &[(&str, &str)]) -> String {
    let given: BTreeMap<String, String> = given
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    c.validate_as(&given, SetHint::Set).unwrap_err().to_string()
}

#[test]
fn range_errors_name_the_key_as_written() {
    let base = || TrainConfig {
        data: "x.jsonl".into(),
        ..Default::default()
    };
    let e = err_as(
        TrainConfig {
            orpo_lambda: -1.0,
            ..base()
        },
        &[("orpo_lambda", "beta")],
    );
    assert!(
        e.starts_with("beta = -1") && e.contains("orpo_lambda"),
        "{e}"
    );
    let e = err_as(
        TrainConfig { lr: -1.0, ..base() },
        &[("lr", "learning_rate")],
    );
    assert!(e.starts_with("learning_rate = -1"), "{e}");
    let e = err_as(
        TrainConfig {
            max_seq_len: 0,
            ..base()
        },
        &[("max_seq_len", "max_length")],
    );
    assert!(e.starts_with("max_length = 0"), "{e}");
    let e = err_as(
        TrainConfig {
            lora_dropout: 1.5,
            ..base()
        },
        &[],
    );
    assert!(e.contains("lora_dropout = 1.5"), "{e}");
    // Through the command line, from --set and from a file.
    let (_, text) = lorafit(&["train", "--data", "/nonexistent.jsonl", "--set", "beta=-1"]);
    assert!(text.contains("beta = -1"), "{text}");
    let d = scratch("names");
    let f = d.join("run.toml");
    std::fs::write(&f, "learning_rate = -1\ndata = \"x.jsonl\"\n").unwrap();
    let (_, text) = lorafit(&["train", "--config", f.to_str().unwrap()]);
    assert!(text.contains("learning_rate = -1"), "{text}");
}

#[test]
fn hints_are_valid_for_their_command() {
    let c = TrainConfig {
        data: "x.jsonl".into(),
        max_seq_len: 2,
        ..Default::default()
    };
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("--set max_prompt_len=1"), "{e}");
    let e = c
        .validate_as(&BTreeMap::new(), SetHint::Flags)
        .unwrap_err()
        .to_string();
    assert!(e.contains("--max-prompt-len 1"), "{e}");
    let e = TrainConfig {
        max_prompt_len: 0,
        ..c
    }
    .validate()
    .unwrap_err()
    .to_string();
    assert!(e.contains("max_prompt_len = 0"), "{e}");
}

#[test]
fn steps_over_epochs_is_noted() {
    let (_, text) = lorafit(&[
        "train",
        "--data",
        "/nonexistent.jsonl",
        "--steps",
        "5",
        "--epochs",
        "3",
    ]);
    assert!(text.contains("epochs = 3 is not used"), "{text}");
}

#[test]
fn bool_errors_say_what_to_write_and_f32s_are_short() {
    let e = TrainConfig::check_type("rslora", "rslora", &toml::Value::String("yes".into()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("write true or false"), "{e}");
    let t = TrainConfig {
        lora_dropout: 0.05,
        ..Default::default()
    }
    .to_toml()
    .unwrap();
    assert!(t.contains("lora_dropout = 0.05\n"), "{t}");
}

#[test]
fn negative_numbers_reach_the_range_check() {
    let (_, text) = lorafit(&["train", "--data", "/nonexistent.jsonl", "--lr", "-1"]);
    assert!(
        text.contains("lr = -1") && !text.contains("unexpected argument"),
        "{text}"
    );
    let (_, text) = lorafit(&["train", "--data", "/nonexistent.jsonl", "--steps", "-1"]);
    assert!(
        text.contains("--steps") && !text.contains("unexpected argument"),
        "{text}"
    );
}

#[test]
fn chat_refuses_zero_new_tokens() {
    let (code, text) = lorafit(&["chat", "--max-new-tokens", "0"]);
    assert!(matches!(code, Some(1 | 2)), "{text}");
    assert!(text.contains("--max-new-tokens 0"), "{text}");
}
