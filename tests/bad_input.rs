//! Bad model input gives an error that names the file and the tensor, never a panic: a missing
//! folder, an unknown architecture, a shape that disagrees with config.json, a truncated
//! safetensors file, a missing tensor. And the CLI refuses, saying why, what it would otherwise
//! do wrongly in silence: flags `generate` would ignore, a prompt past the model's context, a
//! chat template file that is no template.

mod common;
use lorafit::tensor::Device;
use std::path::{Path, PathBuf};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lorafit-bad-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn copy_fixture(to: &Path) {
    let src = common::fixture("models/llama");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), to.join(f)).unwrap();
    }
}

fn load_err(path: &Path) -> String {
    match lorafit::model::load(path, &Device::Cpu) {
        Ok(_) => panic!("{} loaded but should not", path.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn missing_path_is_named() {
    let e = load_err(Path::new("/nonexistent/model"));
    assert!(e.contains("/nonexistent/model"), "{e}");
}

#[test]
fn unknown_architecture_is_named() {
    let d = scratch("arch");
    copy_fixture(&d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("LlamaForCausalLM", "GPTNeoXForCausalLM")
        .replace("\"llama\"", "\"gpt_neox\"");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("GPTNeoXForCausalLM") && e.contains("config.json"),
        "{e}"
    );
}

#[test]
fn shape_disagreeing_with_config_names_file_and_tensor() {
    let d = scratch("shape");
    copy_fixture(&d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 96", "\"intermediate_size\": 128");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("mlp.gate_proj.weight")
            && e.contains(d.to_str().unwrap())
            && e.contains("[96, 64]"),
        "{e}"
    );
}

#[test]
fn truncated_safetensors_names_the_file() {
    let d = scratch("trunc");
    copy_fixture(&d);
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("model.safetensors") && (e.contains("truncated") || e.contains("past the end")),
        "{e}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let d = scratch("missing");
    copy_fixture(&d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("model.layers.2.") && e.contains("missing"),
        "{e}"
    );
}

/// A config.json with zero heads is an error naming the field, not a division by zero.
#[test]
fn zero_heads_are_named() {
    let d = scratch("heads");
    copy_fixture(&d);
    let cfg = std::fs::read_to_string(d.join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
    v["num_attention_heads"] = 0.into();
    std::fs::write(d.join("config.json"), v.to_string()).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("num_attention_heads") && e.contains("config.json"),
        "{e}"
    );
}

/// Settings a run reads are checked before anything runs: each bad value is an error that names
/// its field (none is taken silently at a default).
#[test]
fn bad_settings_name_their_field() {
    use lorafit::config::TrainConfig;
    let base = TrainConfig {
        data: "train.jsonl".into(),
        ..Default::default()
    };
    base.validate().unwrap();
    // Each case: the field whose name the error must start with, and how it is set badly.
    type Case = (&'static str, fn(&mut TrainConfig));
    let cases: Vec<Case> = vec![
        ("lr", |c| c.lr = -1e-4),
        ("lr", |c| c.lr = f64::NAN),
        ("epochs", |c| c.epochs = -3.0),
        ("warmup_ratio", |c| c.warmup_ratio = 1.5),
        ("grad_clip", |c| c.grad_clip = -1.0),
        ("adam_beta1", |c| c.adam_beta1 = 1.5),
        ("adam_beta2", |c| c.adam_beta2 = 1.0),
        ("adam_eps", |c| c.adam_eps = 0.0),
        ("weight_decay", |c| c.weight_decay = f64::INFINITY),
        ("dpo_beta", |c| c.dpo_beta = 0.0),
        ("label_smoothing", |c| c.label_smoothing = 0.7),
        ("targets", |c| c.targets.clear()),
        ("output", |c| c.output = String::new()),
        ("cce_filter_eps", |c| c.cce_filter_eps = -1.0),
        ("orpo_lambda_warmup_max", |c| c.orpo_lambda_warmup_max = 1.5),
        ("orpo_lambda_warmup_max", |c| {
            c.orpo_lambda_warmup_max = -0.1
        }),
        ("orpo_lambda_backoff", |c| c.orpo_lambda_backoff = 1.5),
    ];
    // The ends of a closed range are accepted.
    for v in [0.0, 1.0] {
        let mut c = base.clone();
        c.orpo_lambda_warmup_max = v;
        c.validate().unwrap();
    }
    for (field, set) in cases {
        let mut c = base.clone();
        set(&mut c);
        let e = match c.validate() {
            Ok(()) => panic!("a bad {field} was accepted"),
            Err(e) => format!("{e:#}"),
        };
        assert!(e.starts_with(field), "{field}: {e}");
    }
}

/// An SFT `{text}` row has no prompt: its plan trains every token after the first, and builds
/// without slicing past the empty prompt.
#[test]
fn sft_text_rows_without_prompt_plan() {
    let plan = lorafit::train::plan::Plan::sft(&[], &[5, 6, 7]).unwrap();
    assert!(plan.chosen.prompt.rows.is_empty() && plan.chosen.prompt.targets.is_empty());
    assert_eq!(plan.chosen.response.targets, vec![6, 7]);
}

/// A run's TOML may use TRL's names (`beta` by method); a misspelt name is refused with the
/// nearest one; a YAML recipe is checked the same way; one setting under two names is refused.
#[test]
fn settings_files_take_trl_names_and_name_mistakes() {
    use lorafit::config::TrainConfig;
    let d = scratch("settings");
    let write = |name: &str, text: &str| {
        let p = d.join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let p = write(
        "trl.toml",
        "learning_rate = 5e-5\nmax_steps = 7\nbeta = 0.25\nlora_r = 8\nlora_alpha = 16\n\
         gradient_accumulation_steps = 2\nmax_length = 512\nmax_prompt_length = 256\n\
         num_train_epochs = 2.0\noutput_dir = \"runs/x\"\nwarmup_ratio = 0.1\n",
    );
    let c = TrainConfig::from_toml_file(&p).unwrap();
    assert_eq!((c.lr, c.steps, c.orpo_lambda), (5e-5, 7, 0.25));
    assert_eq!((c.rank, c.alpha, c.grad_accum), (8, 16.0, 2));
    assert_eq!((c.max_seq_len, c.max_prompt_len, c.epochs), (512, 256, 2.0));
    assert_eq!(c.output, "runs/x");
    let p = write("dpo.toml", "method = \"dpo\"\nbeta = 0.3\n");
    let c = TrainConfig::from_toml_file(&p).unwrap();
    assert_eq!((c.dpo_beta, c.orpo_lambda), (0.3, 0.1));
    let err = |p: &Path| format!("{:#}", TrainConfig::from_toml_file(p).unwrap_err());
    let e = err(&write("typo.toml", "learnig_rate = 1e-4\n"));
    assert!(
        e.contains("typo.toml") && e.contains("did you mean `learning_rate`"),
        "{e}"
    );
    // TRL's and PEFT's names for lorafit's settings, and TRL's settings lorafit does not take:
    // all of those named at once, each with what lorafit does instead.
    let p = write(
        "trl_more.toml",
        "max_grad_norm = 0.5\nlr_scheduler_type = \"constant\"\ntarget_modules = [\"q_proj\", \"v_proj\"]\n\
         use_rslora = true\n",
    );
    let c = TrainConfig::from_toml_file(&p).unwrap();
    assert_eq!(
        (c.grad_clip, c.schedule.as_str(), c.rslora),
        (0.5, "constant", true)
    );
    assert_eq!(c.targets, ["q_proj", "v_proj"]);
    let e = err(&write(
        "trl_only.toml",
        "bf16 = true\ngradient_checkpointing = true\nper_device_train_batch_size = 2\nlearnig_rate = 1\n",
    ));
    assert!(
        e.contains("trl_only.toml: 4 settings lorafit does not take:"),
        "{e}"
    );
    for part in [
        "`bf16` (TRL's) is not a lorafit setting: on CUDA lorafit computes in bf16",
        "`gradient_checkpointing` (TRL's) is not a lorafit setting: the memory planner",
        "`per_device_train_batch_size` (TRL's) is not a lorafit setting: lorafit runs one example per micro-step",
        "did you mean `learning_rate`",
    ] {
        assert!(e.contains(part), "{part}: {e}");
    }
    let e = err(&write("twice.toml", "lr = 1e-4\nlearning_rate = 2e-4\n"));
    assert!(e.contains("`lr` is given twice"), "{e}");
    // A TRL recipe in YAML goes through the same checks; what is not flat is refused with
    // its line.
    let e = err(&write("run.yaml", "learning_rate: 1e-4\nbf16: true\n"));
    assert!(
        e.contains("run.yaml") && e.contains("`bf16` (TRL's)"),
        "{e}"
    );
    let e = err(&write(
        "mixer.yaml",
        "learning_rate: 1e-4\ndataset_mixer:\n  uf: 1.0\n",
    ));
    assert!(
        e.contains("mixer.yaml") && e.contains("line 3: `dataset_mixer` holds a mapping"),
        "{e}"
    );
    // A JSON recipe: a nested object and a null inside a list are refused, naming the setting.
    let e = err(&write(
        "nested.json",
        r#"{"learning_rate": 1e-4, "model_init_kwargs": {"dtype": "bfloat16"}}"#,
    ));
    assert!(
        e.contains("nested.json") && e.contains("`model_init_kwargs` holds a nested value"),
        "{e}"
    );
    let e = err(&write(
        "nulls.json",
        r#"{"lora_target_modules": ["q_proj", null]}"#,
    ));
    assert!(
        e.contains("nulls.json") && e.contains("`lora_target_modules`: null inside a list"),
        "{e}"
    );
    let e = err(&write("batches.toml", "record_batches = \"yes\"\n"));
    assert!(
        e.contains("batches.toml") && e.contains("record_batches"),
        "{e}"
    );
    // The memory settings: each bad value names the file and the setting.
    for (file, text, setting) in [
        ("offload.toml", "offload = \"yes\"\n", "offload"),
        ("pack.toml", "pack_tokens = -5\n", "pack_tokens"),
        ("pack_typo.toml", "pack_token = 512\n", "pack_tokens"),
        ("limit.toml", "memory_limit = \"80G\"\n", "memory_limit"),
        ("chunk.toml", "mlp_chunk = 1.5\n", "mlp_chunk"),
    ] {
        let e = err(&write(file, text));
        assert!(e.contains(file) && e.contains(setting), "{file}: {e}");
    }
    // valid_fraction: a value of the wrong type fails the file; one out of range, or beside a
    // valid file, fails the settings' check, naming the setting.
    let e = err(&write("vf_type.toml", "valid_fraction = \"10%\"\n"));
    assert!(
        e.contains("vf_type.toml") && e.contains("valid_fraction"),
        "{e}"
    );
    for (text, want) in [
        (
            "valid_fraction = 0.9\n",
            "valid_fraction = 0.9: expected a number in (0, 0.5]",
        ),
        (
            "valid_fraction = -0.1\n",
            "valid_fraction = -0.1: expected a number in (0, 0.5]",
        ),
        (
            "valid = \"v.jsonl\"\nvalid_fraction = 0.1\n",
            "both name validation rows",
        ),
    ] {
        let c =
            TrainConfig::from_toml_file(&write("vf.toml", &format!("data = \"d.jsonl\"\n{text}")))
                .unwrap();
        let e = format!("{:#}", c.validate().unwrap_err());
        assert!(e.contains(want), "{text}: {e}");
    }
}

/// A value of the wrong type is named by the key the user wrote: TRL's name, with lorafit's
/// beside it, in a settings file and in `--set` alike.
#[test]
fn a_value_of_the_wrong_type_is_named_as_written() {
    use lorafit::config::TrainConfig;
    let d = scratch("settings-types");
    let file = d.join("trl.toml");
    std::fs::write(&file, "max_steps = \"ten\"\n").unwrap();
    let e = format!("{:#}", TrainConfig::from_toml_file(&file).unwrap_err());
    assert!(
        e.contains("trl.toml")
            && e.contains("`max_steps` (lorafit's `steps`): invalid type: string \"ten\""),
        "{e}"
    );
    std::fs::write(&file, "steps = \"ten\"\n").unwrap();
    let e = format!("{:#}", TrainConfig::from_toml_file(&file).unwrap_err());
    assert!(e.contains("setting `steps`: invalid type"), "{e}");
    let data = d.join("train.jsonl");
    for (set, written, ours) in [
        ("learning_rate=true", "learning_rate", "lr"),
        ("max_length=\"long\"", "max_length", "max_seq_len"),
    ] {
        let (ok, err) = lorafit(
            &[
                "train".as_ref(),
                "--data".as_ref(),
                data.as_os_str(),
                "--set".as_ref(),
                set.as_ref(),
            ],
            "",
        );
        assert!(
            !ok && err.contains(&format!(
                "--set {set}: setting `{written}` (lorafit's `{ours}`)"
            )),
            "{err}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A model or dataset named by a Hub id that is no local path and not in the Hugging Face cache
/// is refused, saying lorafit downloads nothing and how to get it; never a bare "no such file".
#[test]
fn hub_ids_not_in_the_cache_are_refused_with_how_to_get_them() {
    let id = "lorafit-no-such-org/no-such-model";
    let e = format!(
        "{:#}",
        lorafit::train::trainer::resolve_model_path(id).unwrap_err()
    );
    assert!(
        e.contains(id) && e.contains("downloads nothing") && e.contains("huggingface-cli download"),
        "{e}"
    );
    let e = format!(
        "{:#}",
        lorafit::data::load_dataset(id, lorafit::data::DatasetKind::Preference, false).unwrap_err()
    );
    assert!(
        e.contains(id) && e.contains("does not download datasets"),
        "{e}"
    );
}

/// Gemma 4's own config fields (per-layer geometry, KV sharing, layer types): each bad value is
/// an error naming the field, never a panic or a division by zero.
#[test]
fn gemma4_config_errors_name_their_field() {
    use serde_json::json;
    let cases: Vec<(&str, serde_json::Value, &str)> = vec![
        ("global_head_dim", json!(0), "global_head_dim"),
        ("global_head_dim", json!(33), "global_head_dim"),
        ("num_kv_shared_layers", json!(8), "num_kv_shared_layers"),
        ("num_kv_shared_layers", json!(7), "num_kv_shared_layers"),
        (
            "layer_types",
            json!(["sliding_attention", "full_attention"]),
            "layer_types",
        ),
        (
            "layer_types",
            json!([
                "sliding_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "diagonal_attention"
            ]),
            "layer_types",
        ),
        (
            "per_layer_config",
            json!({"2": {"head_dim": 0}}),
            "per_layer_config.2.head_dim",
        ),
        (
            "per_layer_config",
            json!({"2": {"num_key_value_heads": 0}}),
            "per_layer_config.2.num_key_value_heads",
        ),
        (
            "per_layer_config",
            json!({"2": {"num_key_value_heads": 3}}),
            "per_layer_config.2.num_key_value_heads",
        ),
        (
            "per_layer_config",
            json!({"99": {"head_dim": 32}}),
            "per_layer_config",
        ),
        ("sliding_window", json!(0), "sliding_window"),
        (
            "vocab_size_per_layer_input",
            json!(7),
            "vocab_size_per_layer_input",
        ),
        ("enable_moe_block", json!(true), "enable_moe_block"),
    ];
    let src = common::fixture("models/gemma4");
    for (i, (key, value, named)) in cases.into_iter().enumerate() {
        let d = scratch(&format!("gemma4-{i}"));
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), d.join(f)).unwrap();
        }
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
        if key == "global_head_dim" {
            // Written by the geometry's own field rather than transformers' per-layer form.
            v.as_object_mut().unwrap().remove("per_layer_config");
        }
        v[key] = value.clone();
        std::fs::write(d.join("config.json"), v.to_string()).unwrap();
        let loaded = std::panic::catch_unwind(|| lorafit::model::load(&d, &Device::Cpu));
        let e = match loaded {
            Err(_) => panic!("{key} = {value}: panicked"),
            Ok(Ok(_)) => panic!("{key} = {value}: loaded"),
            Ok(Err(e)) => format!("{e:#}"),
        };
        assert!(e.contains(named), "{key} = {value}: {e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// A `chat_template` file that cannot be read or compiled, or that is no chat template (a
/// dataset compiles as Jinja but never shows the messages), is an error naming the setting and
/// the file wherever a command takes one: loading a model for a run (train, eval, generate,
/// chat, kl), curate, and export (before anything is written).
#[test]
fn chat_template_files_that_cannot_be_used_are_named() {
    let d = scratch("template");
    let model = common::fixture("models/qwen2");
    let missing = d.join("missing.jinja").display().to_string();
    let broken = d.join("broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}").unwrap();
    let broken = broken.display().to_string();
    let data = d.join("data.jsonl");
    std::fs::write(
        &data,
        r#"{"prompt": "w5 w6", "chosen": "w9", "rejected": "w200"}"#,
    )
    .unwrap();
    let data = data.display().to_string();
    let tiny = common::tiny_run::model_folder(&d);
    let (ok, err) = lorafit(
        &[
            "generate".as_ref(),
            "--model".as_ref(),
            tiny.as_os_str(),
            "--chat-template".as_ref(),
            data.as_ref(),
            "w5".as_ref(),
        ],
        "",
    );
    assert!(
        !ok && err.contains(data.as_str()) && err.contains("never shows the messages"),
        "{err}"
    );
    for t in [&missing, &broken, &data] {
        // The fixture folder has no tokenizer; a GGUF with one stands in for the run's model.
        let gguf = common::fixture("gguf/spm_prefix.gguf");
        let e = lorafit::curate::curate_file(
            &d.join("in.jsonl"),
            &d.join("out.jsonl"),
            None,
            &gguf,
            &lorafit::curate::CurateOptions {
                chat_template: Some(t.clone()),
                ..Default::default()
            },
        )
        .expect_err("curate with an unusable template");
        let e = format!("{e:#}");
        assert!(e.contains("chat_template") && e.contains(t.as_str()), "{e}");

        let out = d.join("export");
        let e = lorafit::export::run(&lorafit::export::ExportPlan {
            model: model.clone(),
            adapter: d.join("no-adapter"),
            output: out.clone(),
            formats: vec![],
            hf_dtype: lorafit::export::hf::HfDtype::Bf16,
            adapter_type: lorafit::export::gguf_out::AdapterType::F32,
            merged_type: lorafit::export::gguf_out::MergedType::Keep,
            check: false,
            chat_template: Some(t.clone()),
        })
        .err()
        .expect("export with an unusable template");
        let e = format!("{e:#}");
        assert!(e.contains("chat_template") && e.contains(t.as_str()), "{e}");
        assert!(!out.exists(), "nothing is written");
    }
}

/// `lorafit` run with `args`: whether it succeeded, and its stderr.
fn lorafit(args: &[&std::ffi::OsStr], stdin: &str) -> (bool, String) {
    use std::io::Write;
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Flags `generate` would drop or a check that would check nothing are refused: `--raw` with
/// `--system` or `--chat-template` (raw text has no template to put them in), and
/// `--check-uncached` with `--max-new-tokens 0`.
#[test]
fn generate_refuses_flags_it_would_ignore() {
    let d = scratch("generate-flags");
    let model = common::tiny_run::model_folder(&d);
    let template = d.join("plain.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    )
    .unwrap();
    let generate = |extra: &[&str]| {
        let mut args: Vec<&std::ffi::OsStr> = vec!["generate".as_ref(), "--model".as_ref()];
        args.push(model.as_os_str());
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        args.push("w5 w6".as_ref());
        lorafit(&args, "")
    };
    let (ok, err) = generate(&["--raw", "--system", "Be brief."]);
    assert!(
        !ok && err.contains("--raw") && err.contains("--system"),
        "{err}"
    );
    let (ok, err) = generate(&["--raw", "--chat-template", template.to_str().unwrap()]);
    assert!(
        !ok && err.contains("--raw") && err.contains("--chat-template"),
        "{err}"
    );
    let (ok, err) = generate(&["--check-uncached", "--max-new-tokens", "0"]);
    assert!(
        !ok && err.contains("--max-new-tokens 0: nothing would be generated"),
        "{err}"
    );
    // Empty strings a flag would act on are named by their flag.
    let (ok, err) = generate(&["--stop", ""]);
    assert!(!ok && err.contains("--stop \"\""), "{err}");
    let mut args: Vec<&std::ffi::OsStr> = vec!["generate".as_ref(), "--model".as_ref()];
    args.extend([model.as_os_str(), "--raw".as_ref(), "".as_ref()]);
    let (ok, err) = lorafit(&args, "");
    assert!(!ok && err.contains("--raw \"\""), "{err}");
    let (ok, err) = generate(&["--check-uncached", "--temperature", "1"]);
    assert!(
        !ok && err.contains("--check-uncached") && err.contains("--temperature"),
        "{err}"
    );
    // Each alone is fine.
    for extra in [
        &["--raw", "--max-new-tokens", "1"][..],
        &["--system", "w7", "--max-new-tokens", "1"],
        &["--check-uncached", "--max-new-tokens", "1"],
    ] {
        let (ok, err) = generate(extra);
        assert!(ok, "{extra:?}: {err}");
    }
}

/// A prompt longer than the model's context (the tiny model's 64 positions) is refused with both
/// numbers, by `generate` and by a `chat` turn, after which the chat goes on.
#[test]
fn prompts_past_the_context_are_refused() {
    let d = scratch("context");
    let model = common::tiny_run::model_folder(&d);
    let long: String = (0..70).map(|i| format!("w{} ", 2 + i)).collect();
    let (ok, err) = lorafit(
        &[
            "generate".as_ref(),
            "--model".as_ref(),
            model.as_os_str(),
            long.trim().as_ref(),
        ],
        "",
    );
    assert!(
        !ok && err.contains("the prompt is 70 tokens, more than the model's context of 64 tokens"),
        "{err}"
    );
    let (ok, err) = lorafit(
        &[
            "chat".as_ref(),
            "--model".as_ref(),
            model.as_os_str(),
            "--max-new-tokens".as_ref(),
            "2".as_ref(),
        ],
        &format!("{long}\n/bogus\nw5 w6\n/quit\n"),
    );
    assert!(ok, "{err}");
    assert!(
        err.contains("the prompt is 70 tokens, more than the model's context of 64 tokens")
            && err.contains("/reset"),
        "{err}"
    );
    assert!(
        err.contains("sequence(s): prefill"),
        "the next turn ran: {err}"
    );
    // A mistyped command is said, not sent to the model.
    assert!(err.contains("(unknown command /bogus"), "{err}");
    assert_eq!(err.matches("sequence(s): prefill").count(), 1, "{err}");
}

/// Training rows longer than the model's context (the tiny model's 64 positions) are said, with
/// the max_seq_len that keeps them within it.
#[test]
fn rows_past_the_context_are_said() {
    let d = scratch("train-context");
    let model = common::tiny_run::model_folder(&d);
    let prompt: String = (0..100).map(|i| format!("w{} ", 2 + i)).collect();
    let row = format!(
        r#"{{"prompt":"{}","chosen":"w3 w4","rejected":"w200 w201"}}"#,
        prompt.trim()
    );
    let data = d.join("long.jsonl");
    std::fs::write(&data, format!("{row}\n{row}\n")).unwrap();
    let (ok, err) = lorafit(
        &[
            "train".as_ref(),
            "--model".as_ref(),
            model.as_os_str(),
            "--data".as_ref(),
            data.as_os_str(),
            "--steps".as_ref(),
            "1".as_ref(),
            "--output".as_ref(),
            d.join("run").as_os_str(),
        ],
        "",
    );
    assert!(ok, "{err}");
    assert!(
        err.contains("more than the model's context of 64 positions")
            && err.contains("--set max_seq_len=64"),
        "{err}"
    );
}

/// Flags that would time nothing or run something else than asked are refused with what to
/// give: `bench --steps 0` (it panicked), `demo --steps 0` (it ran a whole epoch), and
/// `selftest` without a GPU or on the CPU (each pointed at the other); a misspelt bench shape is
/// named before the device is looked for.
#[test]
fn commands_refuse_counts_and_devices_that_do_nothing() {
    let args = |a: &[&str]| -> Vec<std::ffi::OsString> { a.iter().map(|s| s.into()).collect() };
    let run = |a: &[&str]| {
        let a = args(a);
        let refs: Vec<&std::ffi::OsStr> = a.iter().map(|s| s.as_os_str()).collect();
        lorafit(&refs, "")
    };
    let (ok, err) = run(&[
        "bench",
        "--device",
        "cpu",
        "--shape",
        "tiny",
        "--prompt-len",
        "16",
        "--resp-len",
        "8",
        "--steps",
        "0",
        "--warmup",
        "1",
    ]);
    assert!(
        !ok && err.contains("--steps 0: nothing would be timed"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    // The decode bench's default bases include q4_0, kept on a GPU only: refused before the
    // bf16 rows run, not after them.
    let (ok, err) = run(&["bench", "--decode", "--device", "cpu", "--shape", "tiny"]);
    assert!(
        !ok && err.contains("--base q4_0") && !err.contains("RESULT"),
        "{err}"
    );
    // A misspelt shape is said as such on the default device (CUDA), GPU or not, and in
    // both of bench's modes.
    for decode in [false, true] {
        let mut a = vec!["bench", "--shape", "llama-8b", "--steps", "1"];
        if decode {
            a.push("--decode");
        }
        let (ok, err) = run(&a);
        assert!(
            !ok && err.contains("\"llama-8b\" is not a known name"),
            "{err}"
        );
    }
    // A file where export's output folder goes, and eval's options named as its flags.
    let file = env!("CARGO_MANIFEST_DIR").to_string() + "/Cargo.toml";
    let (ok, err) = run(&[
        "export",
        "--model",
        "m",
        "--adapter",
        "a",
        "--output",
        &file,
    ]);
    assert!(
        !ok && err.contains("a file is there; the output is a folder"),
        "{err}"
    );
    let (ok, err) = run(&[
        "eval",
        "--model",
        "m",
        "--scorer",
        "ifeval",
        "--max-new",
        "0",
    ]);
    assert!(
        !ok && err.contains("--max-new: must be at least 1"),
        "{err}"
    );
    let (ok, err) = run(&["demo", "--steps", "0"]);
    assert!(!ok && err.contains("'--steps <STEPS>'"), "{err}");
    let (ok, err) = run(&["selftest", "--device", "cpu"]);
    assert!(!ok && err.contains("pass --device cuda"), "{err}");
    // Without a GPU (CI's machines): the advice is not to run it on the CPU.
    let (ok, err) = run(&["selftest", "--device", "cuda:7"]);
    if !ok {
        assert!(err.contains("selftest needs a GPU"), "{err}");
        assert!(!err.contains("--device cpu"), "{err}");
    }
}

/// A run folder given where an adapter is expected says where its adapter is.
#[test]
fn a_run_folder_as_adapter_names_its_adapter() {
    let d = scratch("run-as-adapter");
    let model = common::tiny_run::model_folder(&d);
    let adapter = d.join("run").join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    let fixture = common::fixture("models/qwen2/adapter");
    for e in std::fs::read_dir(&fixture).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, adapter.join(p.file_name().unwrap())).unwrap();
    }
    let run = d.join("run");
    let (ok, err) = lorafit(
        &[
            "generate".as_ref(),
            "--model".as_ref(),
            model.as_os_str(),
            "--adapter".as_ref(),
            run.as_os_str(),
            "w5 w6".as_ref(),
        ],
        "",
    );
    assert!(
        !ok && err.contains("is a run folder, not an adapter"),
        "{err}"
    );
    assert!(err.contains(&adapter.display().to_string()), "{err}");
}

/// A PEFT adapter folder (the qwen2 fixture's) with one value of one tensor replaced by NaN.
fn adapter_with_a_nan(to: &Path) -> (PathBuf, String) {
    std::fs::create_dir_all(to).unwrap();
    let fixture = common::fixture("models/qwen2/adapter");
    std::fs::copy(
        fixture.join("adapter_config.json"),
        to.join("adapter_config.json"),
    )
    .unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> =
        common::read_safetensors(&fixture.join("adapter_model.safetensors"))
            .into_iter()
            .map(|(name, (shape, data))| (name, shape, data))
            .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let bad = tensors.iter_mut().find(|t| t.0.contains("lora_B")).unwrap();
    bad.2[3] = f32::NAN;
    let name = bad.0.clone();
    lorafit::model::weights::write_f32_safetensors(&to.join("adapter_model.safetensors"), &tensors)
        .unwrap();
    (to.to_path_buf(), name)
}

/// A NaN in an adapter is refused where the adapter is read, naming the file, the tensor and
/// the flat index, by every command that reads one: generate (and so chat), eval and export,
/// which would otherwise write NaN weights.
#[test]
fn an_adapter_holding_a_nan_is_refused_when_read() {
    let d = scratch("nan-adapter");
    let model = common::tiny_run::model_folder(&d);
    let (adapter, tensor) = adapter_with_a_nan(&d.join("adapter"));
    let named = |e: &str| {
        e.contains("adapter_model.safetensors")
            && e.contains(&tensor)
            && e.contains("non-finite value (NaN at index 3)")
    };
    let (ok, err) = lorafit(
        &[
            "generate".as_ref(),
            "--model".as_ref(),
            model.as_os_str(),
            "--adapter".as_ref(),
            adapter.as_os_str(),
            "w5 w6".as_ref(),
        ],
        "",
    );
    assert!(!ok && named(&err), "{err}");
    let out = d.join("export");
    let e = lorafit::export::run(&lorafit::export::ExportPlan {
        model: model.clone(),
        adapter: adapter.clone(),
        output: out.clone(),
        formats: vec![lorafit::export::Format::Hf],
        hf_dtype: lorafit::export::hf::HfDtype::Bf16,
        adapter_type: lorafit::export::gguf_out::AdapterType::F32,
        merged_type: lorafit::export::gguf_out::MergedType::Keep,
        check: false,
        chat_template: None,
    })
    .err()
    .expect("an adapter with a NaN is exported");
    assert!(named(&format!("{e:#}")), "{e:#}");
    assert!(!out.join("merged-hf").exists(), "nothing is written");
    let data = d.join("pairs.jsonl");
    common::tiny_run::data_file(&data, 2, 0);
    let e = lorafit::eval::run(
        &lorafit::eval::EvalOptions {
            model: Some(model.display().to_string()),
            adapter: Some(adapter.clone()),
            data: Some(data.display().to_string()),
            ..Default::default()
        },
        &mut |_| Ok(()),
    )
    .expect_err("an adapter with a NaN is scored");
    assert!(named(&format!("{e:#}")), "{e:#}");
}

/// Standard output that fails: a reader that closed the pipe ends the command quietly with
/// status 141 (no panic), and another failure (/dev/full) is an error naming standard output,
/// status 2; for generate (streaming) and export (its summary).
#[test]
fn failed_writes_to_standard_output_end_the_command_without_a_panic() {
    let d = scratch("stdout");
    let model = common::tiny_run::model_folder(&d);
    let generate = |stdout: std::process::Stdio| {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
            .args(["generate", "--max-new-tokens", "20", "--model"])
            .arg(&model)
            .arg("w5 w6")
            .stdout(stdout)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // A closed pipe: the reader is gone before the first write.
        drop(child.stdout.take());
        child.wait_with_output().unwrap()
    };
    let out = generate(std::process::Stdio::piped());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{err}");
    assert!(!err.contains("panicked") && !err.contains("error"), "{err}");
    if !Path::new("/dev/full").exists() {
        return;
    }
    let full = || {
        std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap()
    };
    let out = generate(full().into());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("error: writing to standard output: No space left on device"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let fixture = common::fixture("models/llama");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .args(["export", "--format", "gguf-adapter", "--model"])
        .arg(&fixture)
        .arg("--adapter")
        .arg(fixture.join("adapter"))
        .arg("--output")
        .arg(d.join("export"))
        .stdout(full())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("error: writing to standard output"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// The output folder's problems are found before the model and data load: a file in the way
/// and a folder holding a run are refused naming the folder even with a model that does not
/// exist, and an output path too long for the checkpoints' files is refused at the start.
#[test]
fn output_folder_problems_come_before_the_model_loads() {
    let d = std::env::temp_dir().join(format!("lorafit-out-first-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("run/checkpoint-000002")).unwrap();
    std::fs::write(
        d.join("run/checkpoint-000002/trainer_state.json"),
        r#"{"step": 2, "position": 2, "total_steps": 4}"#,
    )
    .unwrap();
    std::fs::write(d.join("afile"), "x").unwrap();
    let mut long = d.clone();
    while long.as_os_str().len() < 4060 {
        long = long.join("o".repeat(200));
    }
    for (output, says) in [
        (d.join("afile"), "a file is there"),
        (d.join("run"), "already holds a run"),
        (long, "name a shorter output folder"),
    ] {
        let (ok, err) = lorafit(
            &[
                "train".as_ref(),
                "--model".as_ref(),
                d.join("no-such-model").as_os_str(),
                "--data".as_ref(),
                d.join("train.jsonl").as_os_str(),
                "--output".as_ref(),
                output.as_os_str(),
            ],
            "",
        );
        assert!(!ok && err.contains(says), "{err}");
        assert!(
            !err.contains("no-such-model"),
            "the model was read first: {err}"
        );
    }
    let _ = std::fs::remove_dir_all(&d);
}

/// A final checkpoint that cannot be written after the adapter was (a file size limit stands in
/// for a full disk) is said as such: the adapter is complete and kept, and the advice is not a
/// resume or --overwrite that would train or delete it again.
#[test]
fn a_failed_final_checkpoint_keeps_the_finished_adapter() {
    let d = std::env::temp_dir().join(format!("lorafit-final-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let model = common::tiny_run::model_folder(&d);
    common::tiny_run::data_file(&d.join("train.jsonl"), 4, 1);
    let out = d.join("run");
    let args = format!(
        "train --model {} --data {} --output {} --steps 2 --rank 4 --set save_every=0 \
         --set max_seq_len=48 --set max_prompt_len=24",
        model.display(),
        d.join("train.jsonl").display(),
        out.display()
    );
    let bin = env!("CARGO_BIN_EXE_lorafit");
    // The adapter file fits the limit; the optimiser's moments, twice its size, do not.
    let adapter_bytes = {
        let probe = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("{bin} {args} --overwrite"))
            .output()
            .unwrap();
        assert!(
            probe.status.success(),
            "{}",
            String::from_utf8_lossy(&probe.stderr)
        );
        std::fs::metadata(out.join("adapter/adapter_model.safetensors"))
            .unwrap()
            .len()
    };
    // sh's `ulimit -f` counts 512-byte blocks.
    let blocks = (adapter_bytes * 3 / 2).div_ceil(512);
    let o = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "trap '' XFSZ; ulimit -f {blocks}; exec {bin} {args} --overwrite"
        ))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("adapter in") && err.contains("is complete"),
        "{err}"
    );
    assert!(
        err.contains("final checkpoint could not be written"),
        "{err}"
    );
    assert!(!err.contains("resumes from its last checkpoint"), "{err}");
    assert!(out.join("adapter/adapter_model.safetensors").is_file());
    assert!(!out.join("checkpoint-000002").exists());
    // A resume of the folder says its adapter is a finished run's, not "start again with
    // --overwrite".
    let (ok, err) = lorafit(
        &["train".as_ref(), "--resume".as_ref(), out.as_os_str()],
        "",
    );
    assert!(
        !ok && err.contains("finished run's") && err.contains("would delete it"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// An edit of a fixture's config.json.
type ConfigEdit = Box<dyn FnOnce(&mut serde_json::Value)>;
/// Tensors (name, shape) to add to a fixture's checkpoint.
type ExtraTensors = Vec<(&'static str, Vec<usize>)>;

/// A copy of fixture `name` in `to`: its config.json with `edit` applied, its checkpoint with
/// `extra` tensors (name, shape; filled with 0.01) beside the fixture's.
fn edited_fixture(
    name: &str,
    to: &Path,
    edit: impl FnOnce(&mut serde_json::Value),
    extra: &[(&str, Vec<usize>)],
) {
    let src = common::fixture(&format!("models/{name}"));
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(to.join("config.json"), cfg.to_string()).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> =
        common::read_safetensors(&src.join("model.safetensors"))
            .into_iter()
            .map(|(n, (s, d))| (n, s, d))
            .collect();
    for (n, s) in extra {
        tensors.push((n.to_string(), s.clone(), vec![0.01; s.iter().product()]));
    }
    lorafit::model::weights::write_f32_safetensors(&to.join("model.safetensors"), &tensors)
        .unwrap();
}

/// Tensors of layers at or past num_hidden_layers are an error that says how many layers the
/// checkpoint has and what config.json says, not a model silently cut short.
#[test]
fn checkpoint_layers_past_num_hidden_layers_are_refused() {
    let d = scratch("layers-lowered");
    edited_fixture("llama", &d, |c| c["num_hidden_layers"] = 1.into(), &[]);
    let e = load_err(&d);
    assert!(
        e.contains("2 layers")
            && e.contains("num_hidden_layers")
            && e.contains("model.layers.1.")
            && e.contains("config.json")
            && e.contains("model.safetensors"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&d);
    let d = scratch("layers-extra");
    edited_fixture(
        "llama",
        &d,
        |_| {},
        &[("model.layers.2.input_layernorm.weight", vec![64])],
    );
    let e = load_err(&d);
    assert!(
        e.contains("3 layers")
            && e.contains("num_hidden_layers")
            && e.contains("model.layers.2.input_layernorm.weight"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

/// A bias in the checkpoint that the model as config.json describes does not apply is an error
/// naming the tensor and the config key: a Qwen2 checkpoint relabelled as Mistral or Llama, an
/// o_proj or MLP bias beside a Llama's weights.
#[test]
fn biases_the_model_does_not_apply_are_refused() {
    let relabel = |arch: &'static str, model_type: &'static str| -> ConfigEdit {
        Box::new(move |c: &mut serde_json::Value| {
            if arch.is_empty() {
                c.as_object_mut().unwrap().remove("architectures");
            } else {
                c["architectures"] = serde_json::json!([arch]);
            }
            c["model_type"] = model_type.into();
        })
    };
    let cases: Vec<(&str, ConfigEdit, ExtraTensors, [&str; 3])> = vec![
        (
            "qwen2",
            relabel("MistralForCausalLM", "mistral"),
            vec![],
            ["_proj.bias", "attention_bias", "Qwen2ForCausalLM"],
        ),
        (
            "qwen2",
            relabel("LlamaForCausalLM", "llama"),
            vec![],
            ["_proj.bias", "attention_bias", "Qwen2ForCausalLM"],
        ),
        (
            "qwen2",
            relabel("", "llama"),
            vec![],
            ["_proj.bias", "attention_bias", "Qwen2ForCausalLM"],
        ),
        (
            "llama",
            Box::new(|_| {}),
            vec![("model.layers.0.self_attn.o_proj.bias", vec![64])],
            [
                "model.layers.0.self_attn.o_proj.bias",
                "attention_bias",
                "model.safetensors",
            ],
        ),
        (
            "llama",
            Box::new(|_| {}),
            vec![("model.layers.1.mlp.down_proj.bias", vec![64])],
            [
                "model.layers.1.mlp.down_proj.bias",
                "mlp_bias",
                "model.safetensors",
            ],
        ),
        (
            "qwen2",
            Box::new(|_| {}),
            vec![("model.layers.1.self_attn.o_proj.bias", vec![64])],
            [
                "model.layers.1.self_attn.o_proj.bias",
                "attention_bias",
                "model.safetensors",
            ],
        ),
    ];
    for (i, (fixture, edit, extra, named)) in cases.into_iter().enumerate() {
        let d = scratch(&format!("bias-{i}"));
        edited_fixture(fixture, &d, edit, &extra);
        let e = load_err(&d);
        for n in named {
            assert!(e.contains(n), "case {i} ({fixture}): no {n:?} in: {e}");
        }
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// attention_bias or mlp_bias set where transformers would then add biases lorafit does not
/// apply (o_proj's, the MLP's) is refused naming the key; Mistral ignores attention_bias, as
/// transformers does.
#[test]
fn bias_flags_the_family_cannot_apply_are_refused() {
    for (fixture, key) in [
        ("llama", "attention_bias"),
        ("llama", "mlp_bias"),
        ("minicpm5", "mlp_bias"),
        ("qwen3", "attention_bias"),
        ("gemma2", "attention_bias"),
        ("minicpm", "attention_bias"),
    ] {
        let d = scratch(&format!("flag-{fixture}-{key}"));
        edited_fixture(fixture, &d, |c| c[key] = true.into(), &[]);
        let e = load_err(&d);
        assert!(
            e.contains(key) && e.contains("config.json"),
            "{fixture} {key}: {e}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
    let d = scratch("flag-mistral");
    edited_fixture("mistral", &d, |c| c["attention_bias"] = true.into(), &[]);
    lorafit::model::load(&d, &Device::Cpu).unwrap();
    let _ = std::fs::remove_dir_all(&d);
}

/// Tensors transformers ignores too (rotary inverse-frequency buffers, a head beside tied
/// embeddings) do not stop a load.
#[test]
fn unused_tensors_transformers_ignores_still_load() {
    let d = scratch("unused-ok");
    edited_fixture(
        "llama_linear",
        &d,
        |_| {},
        &[
            ("model.layers.0.self_attn.rotary_emb.inv_freq", vec![8]),
            ("model.layers.1.self_attn.rotary_emb.inv_freq", vec![8]),
            ("lm_head.weight", vec![256, 64]),
        ],
    );
    let m = lorafit::model::load(&d, &Device::Cpu).unwrap();
    assert!(m.weights.lm_head.is_none());
    let _ = std::fs::remove_dir_all(&d);
}

/// An MLP activation the family does not implement is refused naming the key and the value
/// (Llama-style families run SiLU only; Gemma 2/3 read hidden_activation, a tanh GELU).
#[test]
fn activations_the_family_does_not_run_are_refused() {
    for (fixture, key, value) in [
        ("llama", "hidden_act", "gelu"),
        ("llama", "hidden_act", "swishy"),
        ("mistral", "hidden_act", "gelu_pytorch_tanh"),
        ("qwen2", "hidden_act", "relu"),
        ("qwen3", "hidden_act", "gelu"),
        ("minicpm", "hidden_act", "gelu"),
        ("gemma2", "hidden_activation", "gelu"),
        ("gemma3", "hidden_activation", "silu"),
    ] {
        let d = scratch(&format!("act-{fixture}-{value}"));
        edited_fixture(fixture, &d, |c| c[key] = value.into(), &[]);
        let e = load_err(&d);
        assert!(
            e.contains(key) && e.contains(&format!("{value:?}")) && e.contains("config.json"),
            "{fixture} {key} {value}: {e}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
    for (fixture, key, value) in [
        ("llama", "hidden_act", "swish"),
        ("qwen2", "hidden_act", "silu"),
        ("gemma2", "hidden_act", "gelu"),
    ] {
        let d = scratch(&format!("act-ok-{fixture}"));
        edited_fixture(fixture, &d, |c| c[key] = value.into(), &[]);
        lorafit::model::load(&d, &Device::Cpu)
            .unwrap_or_else(|e| panic!("{fixture} {key} {value}: {e:#}"));
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// Numbers with which the model would compute NaN (or nothing) are refused at config load,
/// naming config.json and the key, not blamed later on the data.
#[test]
fn numbers_that_would_make_nan_are_refused() {
    use serde_json::json;
    let cases: Vec<(&str, &str, serde_json::Value, &str)> = vec![
        ("llama", "rope_theta", json!(-1.0), "rope_theta"),
        ("llama", "rope_theta", json!(0), "rope_theta"),
        (
            "llama",
            "rope_parameters.rope_theta",
            json!(-5.0),
            "rope_theta",
        ),
        ("llama", "rope_parameters.factor", json!(0), "factor"),
        (
            "llama_linear",
            "rope_parameters.factor",
            json!(-2.0),
            "factor",
        ),
        ("llama", "rms_norm_eps", json!(-1e-5), "rms_norm_eps"),
        (
            "llama",
            "max_position_embeddings",
            json!(0),
            "max_position_embeddings",
        ),
        (
            "llama",
            "num_key_value_heads",
            json!(0),
            "num_key_value_heads",
        ),
        (
            "llama",
            "num_attention_heads",
            json!(0),
            "num_attention_heads",
        ),
        ("llama", "hidden_size", json!(0), "hidden_size"),
        ("qwen2", "hidden_size", json!(0), "hidden_size"),
        ("llama", "head_dim", json!(0), "head_dim"),
        (
            "minicpm",
            "rope_scaling.short_factor",
            json!([1, 1, 0, 1, 1, 1, 1, 1]),
            "short_factor",
        ),
        (
            "gemma3",
            "rope_parameters.full_attention.factor",
            json!(0),
            "factor",
        ),
        (
            "gemma3",
            "rope_parameters.sliding_attention.rope_theta",
            json!(-1),
            "rope_theta",
        ),
    ];
    for (i, (fixture, path, value, named)) in cases.into_iter().enumerate() {
        let d = scratch(&format!("nan-{i}"));
        edited_fixture(
            fixture,
            &d,
            |c| {
                let mut at = c;
                let keys: Vec<&str> = path.split('.').collect();
                for k in &keys[..keys.len() - 1] {
                    at = &mut at[*k];
                }
                at[keys[keys.len() - 1]] = value.clone();
            },
            &[],
        );
        let loaded = std::panic::catch_unwind(|| lorafit::model::load(&d, &Device::Cpu));
        let e = match loaded {
            Err(_) => panic!("{fixture} {path} = {value}: panicked"),
            Ok(Ok(_)) => panic!("{fixture} {path} = {value}: loaded"),
            Ok(Err(e)) => format!("{e:#}"),
        };
        assert!(
            e.contains(named) && e.contains("config.json"),
            "{fixture} {path} = {value}: {e}"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}

/// With both model.safetensors and model.safetensors.index.json in the folder, lorafit loads
/// model.safetensors, as transformers does (here the shard lacks a tensor, so loading the shards
/// would fail).
#[test]
fn a_single_file_beside_an_index_is_the_one_loaded() {
    let d = scratch("single-and-index");
    copy_fixture(&d);
    let tensors = common::read_safetensors(&d.join("model.safetensors"));
    let shard: Vec<(String, Vec<usize>, Vec<f32>)> = tensors
        .iter()
        .filter(|(n, _)| n.as_str() != "model.norm.weight")
        .map(|(n, (s, v))| (n.clone(), s.clone(), v.clone()))
        .collect();
    lorafit::model::weights::write_f32_safetensors(
        &d.join("model-00001-of-00001.safetensors"),
        &shard,
    )
    .unwrap();
    let map: serde_json::Map<String, serde_json::Value> = tensors
        .keys()
        .map(|n| (n.clone(), "model-00001-of-00001.safetensors".into()))
        .collect();
    std::fs::write(
        d.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    lorafit::model::load(&d, &Device::Cpu).unwrap();
    let files = lorafit::model::weights::safetensors_files(&d).unwrap();
    assert_eq!(files, vec![d.join("model.safetensors")]);
    let _ = std::fs::remove_dir_all(&d);
}

/// config.json problems are said in a user's words, without Rust's debug forms (`Some("…")`,
/// `None`, serde's struct names).
#[test]
fn config_errors_read_without_debug_text() {
    let cases: Vec<(&str, ConfigEdit, Vec<&str>)> = vec![
        (
            "gpt2",
            Box::new(|c| {
                c["architectures"] = serde_json::json!(["GPT2LMHeadModel"]);
                c["model_type"] = "gpt2".into();
            }),
            vec!["GPT2LMHeadModel", "gpt2", "LlamaForCausalLM"],
        ),
        (
            "none",
            Box::new(|c| {
                let o = c.as_object_mut().unwrap();
                o.remove("architectures");
                o.remove("model_type");
            }),
            vec!["architectures", "model_type", "LlamaForCausalLM"],
        ),
        (
            "array",
            Box::new(|c| *c = serde_json::json!([])),
            vec!["JSON object"],
        ),
    ];
    for (name, edit, named) in cases {
        let d = scratch(&format!("words-{name}"));
        edited_fixture("llama", &d, edit, &[]);
        let e = load_err(&d);
        for n in named {
            assert!(e.contains(n), "{name}: no {n:?} in: {e}");
        }
        for bad in ["Some(", "None", "\"\"", "struct HfConfig", "elements"] {
            assert!(!e.contains(bad), "{name}: {bad:?} in: {e}");
        }
        assert!(e.contains("config.json"), "{name}: {e}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
