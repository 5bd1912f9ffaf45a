//! The bad-input corpus for runs: settings files and flags, output folders, resumes, warm starts
//! and model files that a user can get wrong. Each case runs the `lorafit` binary on a tiny
//! model and must fail with exit status 2 (an error, not a panic's 101) and a message that
//! names the file and the setting or field at fault; none may train. Beside it, the model
//! loaders get zeros in every count field of a GGUF file and of config.json, and truncated
//! files: each is an error or (for a field the model does not read) a model, never a panic.

mod common;
use common::tiny_run::{data_file, model_folder};
use std::path::{Path, PathBuf};
use std::process::Command;

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("corpus_runs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dest = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_dir(&p, &dest);
        } else {
            std::fs::copy(&p, &dest).unwrap();
        }
    }
}

/// `lorafit train` with the tiny model, data and `out`, then `args`.
fn train(root: &Path, out: &Path, args: &[String]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .args(["train", "--model"])
        .arg(root.join("model"))
        .arg("--data")
        .arg(root.join("train.jsonl"))
        .arg("--output")
        .arg(out)
        // Settings a case may change go through `--set` (a later one wins; flags may not be
        // given twice).
        .args(["--set", "steps=4", "--set", "rank=4", "--set", "seed=3"])
        .args(["--set", "save_every=2", "--set", "eval_every=0"])
        .args(["--set", "max_seq_len=48", "--set", "max_prompt_len=24"])
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .unwrap()
}

fn s(x: &str) -> String {
    x.to_string()
}

/// Writes `text` as `name` under `dir`; returns its path as an argument.
fn file(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

/// Sets `key` of the JSON file `path` to `value`.
fn edit_json(path: &Path, key: &str, value: serde_json::Value) {
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    v[key] = value;
    std::fs::write(path, v.to_string()).unwrap();
}

/// Overwrites the first f32 of tensor `name` in the safetensors file `path` with NaN.
fn poison_tensor(path: &Path, name: &str) {
    let mut bytes = std::fs::read(path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    assert_eq!(header[name]["dtype"], "F32", "{name}");
    let start = 8 + header_len + header[name]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[start..start + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(path, bytes).unwrap();
}

/// Multiplies every f32 of tensor `name` in the safetensors file `path` by `by` (another base
/// of the same shape).
fn scale_tensor(path: &Path, name: &str, by: f32) {
    let mut bytes = std::fs::read(path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    assert_eq!(header[name]["dtype"], "F32", "{name}");
    let at = |i: usize| 8 + header_len + header[name]["data_offsets"][i].as_u64().unwrap() as usize;
    for v in bytes[at(0)..at(1)].chunks_exact_mut(4) {
        let x = f32::from_le_bytes(v.try_into().unwrap()) * by;
        v.copy_from_slice(&x.to_le_bytes());
    }
    std::fs::write(path, bytes).unwrap();
}

struct Case {
    name: &'static str,
    /// The output folder the case trains into.
    out: PathBuf,
    args: Vec<String>,
    /// Substrings the error must contain (the file and the setting or field, at least).
    expect: Vec<String>,
}

#[test]
fn bad_runs_are_errors_that_name_file_and_setting() {
    let root = scratch("corpus");
    model_folder(&root);
    data_file(&root.join("train.jsonl"), 8, 1);
    let cfgs = root.join("configs");
    std::fs::create_dir_all(&cfgs).unwrap();

    // A finished run with checkpoints at steps 2 and 4, the base of the resume cases.
    let done = root.join("done");
    let o = train(&root, &done, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(done.join("checkpoint-000002/run.toml").is_file());
    // A copy of it for each case that changes files, so that cases stay independent.
    let copy_of_done = |name: &str| -> PathBuf {
        let d = root.join(name);
        copy_dir(&done, &d);
        d
    };
    let fresh = |name: &str| root.join(name);

    let mut cases: Vec<Case> = Vec::new();
    let setting = |name: &'static str, toml: &str, expect: &[&str]| {
        let path = file(&cfgs, &format!("{name}.toml"), toml);
        let mut e: Vec<String> = expect.iter().map(|x| x.to_string()).collect();
        e.push(format!("{name}.toml"));
        (path, e)
    };
    // Settings files: each value out of range, misspelt, of the wrong type, or in conflict.
    for (name, toml, expect) in [
        (
            "lr_negative",
            "lr = -1e-4",
            vec!["lr = -0.0001", "expected a number in [0"],
        ),
        ("lr_nan", "learning_rate = nan", vec!["learning_rate = NaN"]),
        (
            "epochs_negative",
            "epochs = -3.0\nsteps = 0",
            vec!["epochs = -3"],
        ),
        (
            "warmup_ratio",
            "warmup_ratio = 1.5",
            vec!["warmup_ratio = 1.5"],
        ),
        ("grad_clip", "grad_clip = -1.0", vec!["grad_clip = -1"]),
        ("adam_beta1", "adam_beta1 = 1.5", vec!["adam_beta1 = 1.5"]),
        ("targets_empty", "targets = []", vec!["targets is empty"]),
        ("log_every", "log_every = 0", vec!["log_every = 0"]),
        (
            "warmup_steps",
            "warmup_steps = 50",
            vec!["warmup_steps = 50", "steps (4)"],
        ),
        (
            "typo",
            "learnig_rate = 1e-4",
            vec!["learnig_rate", "did you mean `learning_rate`"],
        ),
        ("rank_zero", "rank = 1\nlora_r = 0", vec!["rank"]),
        ("dropout", "lora_dropout = 1.0", vec!["lora_dropout"]),
        (
            "schedule",
            "schedule = \"cosine_with_restarts\"",
            vec![
                "schedule",
                "cosine_with_restarts",
                "expected cosine, linear or constant",
            ],
        ),
        (
            "rank_pattern",
            "[rank_pattern]\ndown_proj = 0",
            vec!["rank_pattern.down_proj = 0"],
        ),
        ("wrong_type", "save_every = \"often\"", vec!["save_every"]),
        (
            "twice",
            "lr = 1e-4\nlearning_rate = 2e-4",
            vec!["`lr` is given twice"],
        ),
    ] {
        let (path, expect) = setting(name, toml, &expect);
        cases.push(Case {
            name,
            out: fresh(name),
            args: vec![s("--config"), path],
            expect,
        });
    }
    // The rank flag overrides the file; prompt length against sequence length from flags.
    cases.push(Case {
        name: "prompt_longer_than_sequence",
        out: fresh("prompt_longer"),
        args: vec![s("--set"), s("max_prompt_len=64")],
        expect: vec![
            s("max_prompt_len (64)"),
            s("max_seq_len (48)"),
            s("settings (flags)"),
        ],
    });
    cases.push(Case {
        name: "yaml_file",
        out: fresh("yaml"),
        args: vec![
            s("--config"),
            file(&cfgs, "run.yaml", "learning_rate: 1e-4\nbf16: true\n"),
        ],
        expect: vec![s("run.yaml"), s("`bf16` (TRL's)")],
    });
    cases.push(Case {
        name: "set_without_value",
        out: fresh("set_without_value"),
        args: vec![s("--set"), s("orpo_lambda")],
        expect: vec![s("--set orpo_lambda"), s("KEY=VALUE")],
    });
    cases.push(Case {
        name: "set_unknown",
        out: fresh("set_unknown"),
        args: vec![s("--set"), s("orpo_lamda=0.2")],
        expect: vec![s("orpo_lamda"), s("did you mean `orpo_lambda`")],
    });
    cases.push(Case {
        name: "data_missing",
        out: fresh("data_missing"),
        args: vec![
            s("--set"),
            format!("data={}", root.join("nope.jsonl").display()),
        ],
        expect: vec![s("nope.jsonl")],
    });

    // Output folders and resumes.
    cases.push(Case {
        name: "existing_run_folder",
        out: done.clone(),
        args: vec![],
        expect: vec![
            done.display().to_string(),
            s("already holds a run"),
            s("--overwrite"),
        ],
    });
    cases.push(Case {
        name: "resume_missing",
        out: fresh("resume_missing"),
        args: vec![
            s("--resume"),
            root.join("no-such-run").display().to_string(),
        ],
        expect: vec![s("no-such-run"), s("no such checkpoint")],
    });
    let empty = fresh("empty_run");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::write(empty.join("plan.toml"), "").unwrap();
    cases.push(Case {
        name: "resume_without_checkpoint",
        out: empty.clone(),
        args: vec![s("--resume"), empty.display().to_string()],
        expect: vec![s("empty_run"), s("no checkpoint")],
    });
    let resume_done = |extra: &[&str]| -> Vec<String> {
        let mut a = vec![s("--resume"), done.display().to_string()];
        a.extend(extra.iter().map(|x| x.to_string()));
        a
    };
    cases.push(Case {
        name: "resume_other_rank",
        out: done.clone(),
        args: resume_done(&["--set", "rank=8", "--set", "steps=6"]),
        expect: vec![
            s("checkpoint-000004"),
            s("rank: checkpoint 4, now 8"),
            s("alpha"),
        ],
    });
    cases.push(Case {
        name: "resume_other_targets",
        out: done.clone(),
        args: resume_done(&["--set", "targets=[\"q\",\"v\"]", "--set", "steps=6"]),
        expect: vec![s("checkpoint-000004"), s("targets: checkpoint")],
    });
    cases.push(Case {
        name: "resume_other_tokenization",
        out: done.clone(),
        args: resume_done(&["--set", "max_seq_len=40", "--set", "steps=6"]),
        expect: vec![
            s("checkpoint-000004"),
            s("max_seq_len: checkpoint 48, now 40"),
        ],
    });
    data_file(&root.join("other.jsonl"), 8, 99);
    let weightless = file(
        &root,
        "weightless.jsonl",
        &std::fs::read_to_string(root.join("other.jsonl"))
            .unwrap()
            .replace("}\n", ", \"weight\": 0}\n"),
    );
    cases.push(Case {
        name: "all_weights_zero",
        out: fresh("all_weights_zero"),
        args: vec![s("--set"), format!("data={weightless}")],
        expect: vec![
            s("weightless.jsonl"),
            s("every training example has weight 0"),
        ],
    });
    cases.push(Case {
        name: "resume_other_data",
        out: done.clone(),
        args: resume_done(&[
            "--set",
            &format!("data={}", root.join("other.jsonl").display()),
            "--set",
            "steps=6",
        ]),
        expect: vec![
            s("checkpoint-000004"),
            s("data: the training examples differ"),
            s("other.jsonl"),
        ],
    });
    let other_base = root.join("other_base");
    copy_dir(&root.join("model"), &other_base);
    scale_tensor(
        &other_base.join("model.safetensors"),
        "model.embed_tokens.weight",
        3.0,
    );
    cases.push(Case {
        name: "resume_other_base",
        out: done.clone(),
        args: resume_done(&[
            "--set",
            &format!("model={}", other_base.display()),
            "--set",
            "steps=6",
        ]),
        expect: vec![
            s("checkpoint-000004"),
            s("other_base"),
            s("is not the one the checkpoint was trained on"),
        ],
    });
    let branched = copy_of_done("branched");
    cases.push(Case {
        name: "resume_earlier_checkpoint_in_place",
        out: branched.clone(),
        args: vec![
            s("--resume"),
            branched.join("checkpoint-000002").display().to_string(),
        ],
        expect: vec![
            s("checkpoint-000002"),
            s("went on past step 2 (checkpoint-000004, adapter)"),
            s("--overwrite"),
        ],
    });
    cases.push(Case {
        name: "resume_into_another_run",
        out: branched.clone(),
        args: vec![
            s("--resume"),
            done.join("checkpoint-000002").display().to_string(),
        ],
        expect: vec![s("branched"), s("already holds a run"), s("--output")],
    });
    cases.push(Case {
        name: "resume_finished",
        out: done.clone(),
        args: resume_done(&[]),
        expect: vec![
            s("checkpoint-000004"),
            s("finished at step 4"),
            s("steps to more than 4"),
        ],
    });
    cases.push(Case {
        name: "resume_shorter",
        out: done.clone(),
        args: resume_done(&["--set", "steps=3"]),
        expect: vec![
            s("checkpoint-000004"),
            s("planned to 4 steps"),
            s("the settings ask for 3"),
        ],
    });
    let nan_ckpt = copy_of_done("nan_checkpoint");
    poison_tensor(
        &nan_ckpt.join("checkpoint-000004/adapter_model.safetensors"),
        "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight",
    );
    cases.push(Case {
        name: "resume_nan_adapter",
        out: nan_ckpt.clone(),
        args: vec![
            s("--resume"),
            nan_ckpt.display().to_string(),
            s("--set"),
            s("steps=6"),
        ],
        expect: vec![
            s("checkpoint-000004"),
            s("layers.1.mlp.down_proj.lora_B"),
            s("non-finite"),
        ],
    });
    let bad_state = copy_of_done("bad_state");
    std::fs::write(
        bad_state.join("checkpoint-000004/trainer_state.json"),
        "{\"step\": ",
    )
    .unwrap();
    cases.push(Case {
        name: "resume_corrupt_state",
        out: bad_state.clone(),
        args: vec![
            s("--resume"),
            bad_state.join("checkpoint-000004").display().to_string(),
            s("--set"),
            s("steps=6"),
        ],
        expect: vec![s("checkpoint-000004/trainer_state.json")],
    });
    let no_opt = copy_of_done("no_optimizer");
    std::fs::remove_file(no_opt.join("checkpoint-000004/optimizer.safetensors")).unwrap();
    cases.push(Case {
        name: "resume_missing_optimizer",
        out: no_opt.clone(),
        args: vec![
            s("--resume"),
            no_opt.display().to_string(),
            s("--set"),
            s("steps=6"),
        ],
        expect: vec![s("checkpoint-000004/optimizer.safetensors")],
    });
    let adapter = done.join("adapter").display().to_string();
    cases.push(Case {
        name: "warm_start_other_rank",
        out: fresh("warm_rank"),
        args: vec![s("--warm-start"), adapter.clone(), s("--set"), s("rank=8")],
        expect: vec![adapter.clone(), s("rank: adapter 4, settings 8")],
    });
    let nan_adapter = copy_of_done("nan_adapter").join("adapter");
    poison_tensor(
        &nan_adapter.join("adapter_model.safetensors"),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
    );
    cases.push(Case {
        name: "warm_start_nan_adapter",
        out: fresh("warm_nan"),
        args: vec![s("--warm-start"), nan_adapter.display().to_string()],
        expect: vec![
            s("nan_adapter/adapter"),
            s("layers.0.self_attn.q_proj.lora_A"),
            s("non-finite"),
        ],
    });

    // Model files.
    let model_case = |name: &'static str, edit: &dyn Fn(&Path)| -> String {
        let m = root.join(format!("model-{name}"));
        copy_dir(&root.join("model"), &m);
        edit(&m);
        m.display().to_string()
    };
    let m = model_case("zero_heads", &|m| {
        edit_json(&m.join("config.json"), "num_attention_heads", 0.into())
    });
    cases.push(Case {
        name: "config_zero_heads",
        out: fresh("zero_heads"),
        args: vec![s("--set"), format!("model={m}")],
        expect: vec![s("config.json"), s("num_attention_heads")],
    });
    let m = model_case("nan_weight", &|m| {
        poison_tensor(
            &m.join("model.safetensors"),
            "model.layers.1.mlp.up_proj.weight",
        )
    });
    cases.push(Case {
        name: "nan_weight",
        out: fresh("nan_weight"),
        args: vec![s("--set"), format!("model={m}")],
        expect: vec![
            s("model-nan_weight"),
            s("model.layers.1.mlp.up_proj.weight"),
            s("non-finite"),
        ],
    });
    let m = model_case("no_tokenizer", &|m| {
        std::fs::remove_file(m.join("tokenizer.json")).unwrap()
    });
    cases.push(Case {
        name: "tokenizer_missing",
        out: fresh("no_tokenizer"),
        args: vec![s("--set"), format!("model={m}")],
        expect: vec![s("model-no_tokenizer/tokenizer.json")],
    });
    let m = model_case("bad_config", &|m| {
        std::fs::write(m.join("config.json"), "{\"architectures\": [").unwrap()
    });
    cases.push(Case {
        name: "config_not_json",
        out: fresh("bad_config"),
        args: vec![s("--set"), format!("model={m}")],
        expect: vec![s("model-bad_config/config.json"), s("not valid JSON")],
    });
    let gguf = root.join("truncated.gguf");
    let bytes = std::fs::read(common::fixture("gguf/minicpm.gguf")).unwrap();
    std::fs::write(&gguf, &bytes[..bytes.len() / 3]).unwrap();
    cases.push(Case {
        name: "gguf_truncated",
        out: fresh("gguf_truncated"),
        args: vec![s("--set"), format!("model={}", gguf.display())],
        expect: vec![s("truncated.gguf")],
    });
    // A learning rate so large that the weights overflow: the step that goes non-finite stops
    // the run, naming the step, the example's row and the last checkpoint, which stays loadable.
    let blowup = fresh("blowup");
    cases.push(Case {
        name: "non_finite_step",
        out: blowup.clone(),
        args: vec![
            s("--set"),
            s("lr=1e30"),
            s("--set"),
            s("save_every=1"),
            s("--set"),
            s("grad_clip=0"),
        ],
        expect: vec![
            s("step "),
            s("non-finite"),
            // The example by its row: the file and the line a user can open.
            s("the training example at "),
            s("train.jsonl:"),
            s("checkpoint-000001"),
            s("is intact"),
        ],
    });

    assert!(cases.len() >= 25, "{} cases", cases.len());
    let mut failures = Vec::new();
    for case in &cases {
        let o = train(&root, &case.out, &case.args);
        let err = String::from_utf8_lossy(&o.stderr);
        let code = o.status.code();
        if code != Some(2) || err.contains("panicked") {
            failures.push(format!(
                "{}: exit {code:?} (want 2, an error):\n{err}",
                case.name
            ));
            continue;
        }
        let missing: Vec<&String> = case
            .expect
            .iter()
            .filter(|x| !err.contains(x.as_str()))
            .collect();
        if !missing.is_empty() {
            failures.push(format!(
                "{}: the error lacks {missing:?}:\n{err}",
                case.name
            ));
        }
    }
    eprintln!("{} cases, {} failed", cases.len(), failures.len());
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));

    // The run that went non-finite kept its last whole checkpoint: finite and loadable.
    let ckpt = blowup.join("checkpoint-000001");
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], 1);
    let adapter = common::read_safetensors(&ckpt.join("adapter_model.safetensors"));
    assert!(adapter
        .values()
        .all(|(_, v)| v.iter().all(|x| x.is_finite())));
    // The refused resumes left the finished run as it was.
    assert!(done.join("checkpoint-000004/trainer_state.json").is_file());
    let _ = std::fs::remove_dir_all(&root);
}

// ---------------------------------------------------------------------------------------------
// Loaders: zeros in every count field, truncated files
// ---------------------------------------------------------------------------------------------

/// Where a GGUF header keeps its counts: `(what, byte offset, width)` for the tensor and
/// metadata counts, every integer metadata value (each entry of a model key's integer array),
/// every string and array length, and each tensor's dimension count and dimensions.
fn gguf_count_fields(b: &[u8]) -> Vec<(String, usize, usize)> {
    let u32_at = |p: usize| u32::from_le_bytes(b[p..p + 4].try_into().unwrap());
    let u64_at = |p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap());
    let mut fields = vec![
        ("tensor count".to_string(), 8, 8),
        ("metadata count".to_string(), 16, 8),
    ];
    let (n_tensors, n_kv) = (u64_at(8), u64_at(16));
    let mut p = 24;
    let read_str = |p: &mut usize| -> String {
        let n = u64_at(*p) as usize;
        let s = String::from_utf8_lossy(&b[*p + 8..*p + 8 + n]).to_string();
        *p += 8 + n;
        s
    };
    fn width(ty: u32) -> usize {
        match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            _ => 0,
        }
    }
    for _ in 0..n_kv {
        let key_at = p;
        let key = read_str(&mut p);
        fields.push((format!("length of key {key}"), key_at, 8));
        let ty = u32_at(p);
        p += 4;
        match ty {
            8 => {
                fields.push((format!("{key}: string length"), p, 8));
                read_str(&mut p);
            }
            9 => {
                let et = u32_at(p);
                let n = u64_at(p + 4) as usize;
                fields.push((format!("{key}: array length"), p + 4, 8));
                p += 12;
                // The model's per-layer counts (Gemma 4's head_count_kv, feed_forward_length),
                // element by element; not the tokenizer's arrays.
                let per_layer =
                    !key.starts_with("tokenizer.") && matches!(et, 0 | 2 | 4 | 5 | 10 | 11);
                for i in 0..n {
                    if et == 8 {
                        read_str(&mut p);
                    } else {
                        if per_layer {
                            fields.push((format!("{key}[{i}] (integer)"), p, width(et)));
                        }
                        p += width(et);
                    }
                }
            }
            t => {
                if matches!(t, 0 | 2 | 4 | 5 | 10 | 11) {
                    fields.push((format!("{key} (integer)"), p, width(t)));
                }
                p += width(t);
            }
        }
    }
    for _ in 0..n_tensors {
        let name = read_str(&mut p);
        let n_dims = u32_at(p) as usize;
        fields.push((format!("{name}: n_dims"), p, 4));
        p += 4;
        for d in 0..n_dims {
            fields.push((format!("{name}: dim {d}"), p, 8));
            p += 8;
        }
        p += 4 + 8;
    }
    fields
}

/// Calls `f`, turning a panic into a failure message naming `what`.
fn no_panic<T>(
    what: &str,
    f: impl FnOnce() -> anyhow::Result<T>,
) -> Result<anyhow::Result<T>, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        format!("{what}: panicked: {msg}")
    })
}

/// Fields whose zero must be an error (the model cannot be built without them); `model`: the
/// file holds a model (not a tokenizer alone, which may have no tensors).
fn must_refuse(field: &str, model: bool) -> bool {
    (field == "tensor count" && model)
        || field.ends_with(": n_dims")
        || field.contains(": dim ")
        || [
            ".block_count",
            ".embedding_length",
            ".attention.head_count",
            ".feed_forward_length",
            "tokenizer.ggml.tokens: array length",
        ]
        .iter()
        .any(|k| field.contains(k) && !field.starts_with("length of key"))
}

#[test]
fn gguf_zero_counts_and_truncation_never_panic() {
    let d = scratch("gguf");
    let mut failures = Vec::new();
    let mut refused = 0;
    for fixture in [
        "minicpm.gguf",
        "gemma2.gguf",
        "gemma4.gguf",
        "spm_prefix.gguf",
    ] {
        let bytes = std::fs::read(common::fixture(&format!("gguf/{fixture}"))).unwrap();
        let fields = gguf_count_fields(&bytes);
        assert!(
            fields.len() > 20,
            "{fixture}: {} count fields",
            fields.len()
        );
        let path = d.join(fixture);
        let load = |path: &Path| -> anyhow::Result<()> {
            let g = lorafit::model::gguf::GgufFile::open(path)?;
            if g.get("tokenizer.ggml.tokens").is_some() {
                lorafit::data::gguf_tokenizer::load_gguf_tokenizer(&g)?;
            }
            if !fixture.starts_with("spm") {
                lorafit::model::load(path, &lorafit::tensor::Device::Cpu)?;
            }
            Ok(())
        };
        for (field, at, width) in &fields {
            let mut b = bytes.clone();
            b[*at..*at + width].fill(0);
            std::fs::write(&path, &b).unwrap();
            match no_panic(&format!("{fixture}: {field} = 0"), || load(&path)) {
                Err(panic) => failures.push(panic),
                Ok(Ok(())) if must_refuse(field, !fixture.starts_with("spm")) => {
                    failures.push(format!("{fixture}: {field} = 0 was accepted"))
                }
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    let e = format!("{e:#}");
                    if !e.contains(fixture) {
                        failures.push(format!(
                            "{fixture}: {field} = 0: error without the file: {e}"
                        ));
                    }
                    refused += 1;
                }
            }
        }
        // Truncated at 40 points, the header's first bytes included.
        for k in 0..40 {
            let len = if k < 8 {
                k * 13
            } else {
                bytes.len() * (k - 7) / 33
            };
            std::fs::write(&path, &bytes[..len.min(bytes.len() - 1)]).unwrap();
            match no_panic(&format!("{fixture} cut to {len} bytes"), || load(&path)) {
                Err(panic) => failures.push(panic),
                Ok(Ok(())) => failures.push(format!("{fixture} cut to {len} bytes was accepted")),
                Ok(Err(_)) => {}
            }
        }
    }
    eprintln!("GGUF zero-count cases refused: {refused}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let _ = std::fs::remove_dir_all(&d);
}

/// Every numeric field of every fixture config.json, set to 0 (and each array emptied): an
/// error naming config.json for the counts a model needs, never a panic.
#[test]
fn config_json_zero_counts_never_panic() {
    let d = scratch("config");
    let mut failures = Vec::new();
    let mut cases = 0;
    let needed = [
        "num_attention_heads",
        "num_key_value_heads",
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "vocab_size",
        "head_dim",
    ];
    for family in [
        "llama", "qwen2", "qwen3", "gemma2", "gemma3", "minicpm", "minicpm5", "mistral",
    ] {
        let src = common::fixture(&format!("models/{family}"));
        let text = std::fs::read_to_string(src.join("config.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let top = v.as_object().unwrap().clone();
        let nested = v.get("text_config").and_then(|t| t.as_object()).cloned();
        let mut variants: Vec<(String, serde_json::Value)> = Vec::new();
        for (k, x) in &top {
            if x.is_number() {
                let mut w = v.clone();
                w[k] = 0.into();
                variants.push((k.clone(), w));
            } else if x.is_array() {
                let mut w = v.clone();
                w[k] = serde_json::json!([]);
                variants.push((format!("{k} (emptied)"), w));
            }
        }
        if let Some(t) = &nested {
            for (k, x) in t {
                if x.is_number() {
                    let mut w = v.clone();
                    w["text_config"][k] = 0.into();
                    variants.push((format!("text_config.{k}"), w));
                }
            }
        }
        let m = d.join(family);
        std::fs::create_dir_all(&m).unwrap();
        std::fs::copy(src.join("model.safetensors"), m.join("model.safetensors")).unwrap();
        for (field, w) in variants {
            cases += 1;
            std::fs::write(m.join("config.json"), w.to_string()).unwrap();
            let what = format!("{family}: {field} = 0");
            match no_panic(&what, || {
                lorafit::model::load(&m, &lorafit::tensor::Device::Cpu)
            }) {
                Err(p) => failures.push(p),
                Ok(Ok(_))
                    if needed
                        .iter()
                        .any(|n| field == *n || field.ends_with(&format!(".{n}"))) =>
                {
                    failures.push(format!("{what} was accepted"))
                }
                Ok(Ok(_)) => {}
                Ok(Err(e)) => {
                    let e = format!("{e:#}");
                    if !e.contains(family) {
                        failures.push(format!("{what}: error without the folder: {e}"));
                    }
                }
            }
        }
        // Truncated config.json and model.safetensors.
        for cut in [0, 1, text.len() / 2] {
            std::fs::write(m.join("config.json"), &text[..cut]).unwrap();
            cases += 1;
            match no_panic(&format!("{family}: config.json cut"), || {
                lorafit::model::load(&m, &lorafit::tensor::Device::Cpu)
            }) {
                Err(p) => failures.push(p),
                Ok(Ok(_)) => failures.push(format!("{family}: config.json cut to {cut} accepted")),
                Ok(Err(_)) => {}
            }
        }
        std::fs::write(m.join("config.json"), &text).unwrap();
        let st = std::fs::read(src.join("model.safetensors")).unwrap();
        for cut in [0, 7, 8, 100, st.len() / 2, st.len() - 1] {
            std::fs::write(m.join("model.safetensors"), &st[..cut]).unwrap();
            cases += 1;
            match no_panic(&format!("{family}: model.safetensors cut"), || {
                lorafit::model::load(&m, &lorafit::tensor::Device::Cpu)
            }) {
                Err(p) => failures.push(p),
                Ok(Ok(_)) => {
                    failures.push(format!("{family}: model.safetensors cut to {cut} accepted"))
                }
                Ok(Err(_)) => {}
            }
        }
    }
    eprintln!("config.json / safetensors cases: {cases}");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let _ = std::fs::remove_dir_all(&d);
}

/// TRL's `beta` in a settings file is the β of the method the run ends with: the file's, or the
/// one `--method` or a later `--set method=` gives (it went to ORPO's λ when the method came from
/// a flag).
#[test]
fn trl_beta_follows_the_runs_method() {
    let root = scratch("trl-beta");
    model_folder(&root);
    data_file(&root.join("train.jsonl"), 8, 1);
    let config = file(&root, "trl.toml", "beta = 0.05\nmax_steps = 1\n");
    for (args, key, want) in [
        (vec!["--method", "dpo"], "dpo_beta", 0.05),
        (
            vec!["--set", "beta=0.07", "--set", "method=dpo"],
            "dpo_beta",
            0.07,
        ),
        (vec!["--set", "method=simpo"], "simpo_beta", 0.05),
        (vec![], "orpo_lambda", 0.05),
    ] {
        let out = root.join(format!("run-{key}-{}", args.len()));
        let mut a = vec![s("--config"), config.clone()];
        a.extend(args.iter().map(|x| s(x)));
        let o = train(&root, &out, &a);
        assert!(
            o.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let plan: toml::Table =
            toml::from_str(&std::fs::read_to_string(out.join("plan.toml")).unwrap()).unwrap();
        assert_eq!(plan[key].as_float(), Some(want), "{args:?}: {key}");
    }
    // transformers' `max_steps = -1` through --set too: the steps come from the epochs (8 rows,
    // one a step).
    let out = root.join("run-max-steps");
    let o = train(&root, &out, &[s("--set"), s("max_steps=-1")]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let plan: toml::Table =
        toml::from_str(&std::fs::read_to_string(out.join("plan.toml")).unwrap()).unwrap();
    assert_eq!(plan["steps"].as_integer(), Some(8));
}

/// `lorafit train` takes settings as flags the way TRL's scripts pass them (underscores or
/// dashes, `=` or a separate value, a bare flag for true), with TRL's meaning of each value, and
/// answers every TRL setting it has no counterpart for at once, naming each flag as given.
#[test]
fn trl_flags_are_settings() {
    let root = scratch("trl-flags");
    model_folder(&root);
    data_file(&root.join("train.jsonl"), 8, 1);
    let out = root.join("run-flags");
    let flags = [
        "--max_steps",
        "-1",
        "--learning_rate=5e-5",
        "--lora-r",
        "8",
        "--use_rslora",
        "--beta",
        "0.07",
    ];
    let o = train(&root, &out, &flags.map(s));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let plan: toml::Table =
        toml::from_str(&std::fs::read_to_string(out.join("plan.toml")).unwrap()).unwrap();
    // 8 rows, one a step: max_steps = -1 is "from the epochs".
    assert_eq!(plan["steps"].as_integer(), Some(8));
    assert_eq!(plan["lr"].as_float(), Some(5e-5));
    assert_eq!(plan["rank"].as_integer(), Some(8));
    assert_eq!(plan["rslora"].as_bool(), Some(true));
    assert_eq!(plan["orpo_lambda"].as_float(), Some(0.07));

    // The same settings as a TRL recipe in YAML (the helper's own --sets would override the
    // file, so the run is called here with the file alone).
    let recipe = file(
        &root,
        "recipe.yaml",
        "# ORPO\nmax_steps: -1\nlearning_rate: 5.0e-5\nlora_r: 8\nuse_rslora: yes\nbeta: 0.07\n\
         max_length: 48\nmax_prompt_length: 24\nsave_steps: 0\n",
    );
    let out = root.join("run-recipe");
    let o = Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .args(["train", "--model"])
        .arg(root.join("model"))
        .arg("--data")
        .arg(root.join("train.jsonl"))
        .arg("--output")
        .arg(&out)
        .args(["--config", &recipe])
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let recipe_plan: toml::Table =
        toml::from_str(&std::fs::read_to_string(out.join("plan.toml")).unwrap()).unwrap();
    for key in ["steps", "lr", "rank", "rslora", "orpo_lambda"] {
        assert_eq!(recipe_plan[key], plan[key], "{key}");
    }

    let out = root.join("run-refused");
    let flags = [
        "--per_device_train_batch_size",
        "2",
        "--bf16",
        "--no_remove_unused_columns",
        "--max_stepz",
        "1",
        "--foo",
    ];
    let o = train(&root, &out, &flags.map(s));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && !out.join("plan.toml").exists(),
        "{e}"
    );
    for want in [
        "5 settings cannot be taken",
        "--per_device_train_batch_size 2: `per_device_train_batch_size` (TRL's)",
        "--bf16: `bf16` (TRL's)",
        // transformers' parser's `--no_NAME`: NAME off.
        "--no_remove_unused_columns: `remove_unused_columns` (TRL's)",
        "--max_stepz 1: unknown setting `max_stepz` (did you mean `max_steps`?)",
        "--foo: unknown setting `foo`",
    ] {
        assert!(e.contains(want), "{want:?} in {e}");
    }
    // The list of settings, where a name is far from all of them, once for all refusals.
    assert!(e.matches("settings: ").count() <= 1, "{e}");
}
