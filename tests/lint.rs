//! `lorafit lint` as a user runs it: the checks of a run's own settings file (`--config`: its
//! model, data, tokenization and limits), each overridden by its flag, and an error that says
//! what to name when no data is given.

mod common;

use std::path::Path;
use std::process::{Command, Output};

fn lint(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .current_dir(dir)
        .arg("lint")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn lint_reads_a_runs_settings_and_its_flags_win() {
    let dir = std::env::temp_dir().join(format!("lorafit-lint-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = common::tiny_run::model_folder(&dir);
    common::tiny_run::data_file(&dir.join("train.jsonl"), 5, 1);
    common::tiny_run::data_file(&dir.join("other.jsonl"), 3, 2);
    std::fs::write(
        dir.join("run.toml"),
        format!(
            "model = {:?}\ndata = \"train.jsonl\"\ntokenization = \"trl\"\nmax_seq_len = 64\nmax_prompt_len = 32\n",
            model.display().to_string()
        ),
    )
    .unwrap();

    let o = lint(&dir, &["--config", "run.toml", "--quiet"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        out.starts_with("train.jsonl: 5 rows used") && out.contains("tokenization trl"),
        "{out}"
    );

    let o = lint(
        &dir,
        &[
            "--config",
            "run.toml",
            "--data",
            "other.jsonl",
            "--tokenization",
            "separate",
            "--quiet",
        ],
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.starts_with("other.jsonl: 3 rows used") && out.contains("tokenization separate"),
        "{out}"
    );

    std::fs::write(
        dir.join("nodata.toml"),
        format!("model = {:?}\n", model.display().to_string()),
    )
    .unwrap();
    for args in [&["--config", "nodata.toml"][..], &[][..]] {
        let o = lint(&dir, args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains("--data"), "{args:?}: {err}");
    }
}

/// A settings file lint cannot take is an error that names the file and the setting, before any
/// row is read: a misspelt name, a value of the wrong type, limits that contradict each other.
#[test]
fn a_bad_settings_file_is_named_with_its_setting() {
    let dir = std::env::temp_dir().join(format!("lorafit-lint-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = common::tiny_run::model_folder(&dir);
    common::tiny_run::data_file(&dir.join("train.jsonl"), 3, 1);
    let head = format!(
        "model = {:?}\ndata = \"train.jsonl\"\n",
        model.display().to_string()
    );
    for (name, body, expect) in [
        (
            "typo.toml",
            "tokenisation = \"trl\"\n",
            vec!["typo.toml", "tokenisation"],
        ),
        (
            "type.toml",
            "max_seq_len = \"long\"\n",
            vec!["type.toml", "max_seq_len"],
        ),
        (
            "limits.toml",
            "max_seq_len = 64\nmax_prompt_len = 64\n",
            vec!["limits.toml", "max_prompt_len"],
        ),
        (
            "template.toml",
            "chat_template = \"no-such.jinja\"\n",
            vec!["chat_template", "no-such.jinja"],
        ),
    ] {
        std::fs::write(dir.join(name), format!("{head}{body}")).unwrap();
        let o = lint(&dir, &["--config", name, "--quiet"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{name}: {err}");
        for e in expect {
            assert!(err.contains(e), "{name}: {err} does not name {e}");
        }
        assert!(!err.contains("panicked"), "{name}: {err}");
    }
}

/// What train refuses in sum is an error of lint's too (status 1): rows whose every weight is 0,
/// and a file without one usable row, whose rows' errors are printed.
#[test]
fn lint_fails_files_train_refuses_and_names_their_rows() {
    let dir = std::env::temp_dir().join(format!("lorafit-lint-sum-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = common::tiny_run::model_folder(&dir);
    common::tiny_run::data_file(&dir.join("train.jsonl"), 3, 1);
    let weightless = std::fs::read_to_string(dir.join("train.jsonl"))
        .unwrap()
        .replace("}\n", ", \"weight\": 0}\n");
    std::fs::write(dir.join("weightless.jsonl"), weightless).unwrap();
    std::fs::write(
        dir.join("bad.jsonl"),
        "{\"prompt\":\"w2\",\"chosen\":\"w3\"}\n{\"prompt\":\"w2\",\"answer\":\"w3\"}\n",
    )
    .unwrap();
    let m = model.to_str().unwrap();
    let o = lint(&dir, &["--model", m, "--data", "weightless.jsonl"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(out.contains("every row has weight 0"), "{out}");
    let o = lint(&dir, &["--model", m, "--data", "bad.jsonl"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains("bad.jsonl:1: field \"rejected\": missing")
            && out.contains("bad.jsonl:2: field \"chosen\": missing"),
        "{out}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A LoRA adapter folder given as `--model` is named for what it is, with the flags to pass it
/// and its base by (the base from its adapter_config.json), not as a missing config.json.
#[test]
fn lint_says_an_adapter_folder_given_as_the_model_is_one() {
    let dir = std::env::temp_dir().join(format!("lorafit-lint-adapter-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let adapter = dir.join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    let src = common::fixture("models/qwen2/adapter");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json")).unwrap())
            .unwrap();
    config["base_model_name_or_path"] = "Qwen/Qwen2-0.5B".into();
    std::fs::write(adapter.join("adapter_config.json"), config.to_string()).unwrap();
    common::tiny_run::data_file(&dir.join("train.jsonl"), 3, 1);
    let o = lint(&dir, &["--model", "adapter", "--data", "train.jsonl"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("is a LoRA adapter folder")
            && err.contains("--adapter adapter")
            && err.contains("--model Qwen/Qwen2-0.5B")
            && !err.contains("No such file"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
