//! A run killed with SIGKILL at any moment and resumed ends exactly as if it had never been
//! interrupted: the `lorafit` binary trains a tiny model (tests/fixtures/models/qwen2 with a
//! word-level tokenizer) once uninterrupted, then 20 times killed after a random delay and
//! resumed (`--resume OUT`, or `--overwrite` when the kill came before the first checkpoint);
//! each time metrics.jsonl, the plots drawn from it, the adapter, `best/` and every checkpoint
//! must equal the uninterrupted run's byte for byte, and timing.jsonl must hold one line per
//! step, in order (its values are wall-clock and memory, which no two runs share).

mod common;
use common::tiny_run::{data_file, model_folder};
use lorafit::train::run_folder::LOCK_FILE;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// One test of this file at a time: the random kills are spread over the time one uninterrupted
/// run takes, measured first, and a run beside it (the SmolLM2 one above all) would stretch that
/// measurement on two cores, so that every later kill came after the end.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

const STEPS: usize = 12;

fn scratch(name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("kill_resume-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

struct Setup {
    model: PathBuf,
    train: PathBuf,
    valid: PathBuf,
}

impl Setup {
    /// The tiny model and `train` / `valid` rows of the word-level vocabulary under `root`.
    fn new(root: &Path, train: usize, valid: usize) -> Setup {
        let setup = Setup {
            model: model_folder(root),
            train: root.join("train.jsonl"),
            valid: root.join("valid.jsonl"),
        };
        data_file(&setup.train, train, 1);
        data_file(&setup.valid, valid, 2);
        setup
    }
}

fn train_command(s: &Setup, out: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lorafit"));
    c.args(["train", "--model"])
        .arg(&s.model)
        .arg("--data")
        .arg(&s.train)
        .arg("--valid")
        .arg(&s.valid)
        .arg("--output")
        .arg(out)
        .args(["--steps", &STEPS.to_string(), "--rank", "4", "--seed", "3"])
        .args([
            "--set",
            "lr=1e-2",
            "--set",
            "save_every=1",
            "--set",
            "eval_every=3",
        ])
        .args(["--set", "max_seq_len=48", "--set", "max_prompt_len=24"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

fn run_to_end(s: &Setup, out: &Path, extra: &[&str]) {
    let o = train_command(s, out, extra).output().unwrap();
    assert!(
        o.status.success(),
        "lorafit train {extra:?} failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Every file under `dir` that must be deterministic, by relative path, with its bytes.
fn deterministic_files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(dir).unwrap().display().to_string();
            if p.is_dir() {
                stack.push(p);
            } else if !["timing.jsonl", "plan.toml", LOCK_FILE].contains(&rel.as_str()) {
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

fn timing_steps(dir: &Path) -> Vec<u64> {
    std::fs::read_to_string(dir.join("timing.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

/// For text files, the first line where `got` and `want` part, both sides shown.
fn first_differing_line(got: &[u8], want: &[u8]) -> String {
    let (Ok(g), Ok(w)) = (std::str::from_utf8(got), std::str::from_utf8(want)) else {
        return String::new();
    };
    let (mut gl, mut wl) = (g.lines(), w.lines());
    for n in 1.. {
        match (gl.next(), wl.next()) {
            (None, None) => break,
            (a, b) if a != b => {
                return format!(
                    " at line {n}:\n  got  {}\n  want {}",
                    a.unwrap_or("(end)"),
                    b.unwrap_or("(end)")
                )
            }
            _ => {}
        }
    }
    String::new()
}

fn has_checkpoint(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.flatten().any(|e| {
            e.file_name().to_string_lossy().starts_with("checkpoint-")
                && e.path().join("trainer_state.json").is_file()
        })
    })
}

#[test]
fn kill_at_random_points_then_resume_equals_uninterrupted() {
    let _one = one_at_a_time();
    let root = scratch("run");
    let setup = Setup::new(&root, 12, 3);

    // Every run writes into the same folder (its path is part of the saved settings); the
    // uninterrupted run's outputs are moved aside once done.
    let out = root.join("run");
    let reference = root.join("reference");
    let t0 = Instant::now();
    run_to_end(&setup, &out, &[]);
    let run_time = t0.elapsed();
    std::fs::rename(&out, &reference).unwrap();
    let want = deterministic_files(&reference);
    for f in [
        "metrics.jsonl",
        "adapter/adapter_model.safetensors",
        "best/trainer_state.json",
        "checkpoint-000001/optimizer.safetensors",
        "checkpoint-000012/adapter_model.safetensors",
        "plots/loss.png",
    ] {
        assert!(want.contains_key(f), "the reference run wrote no {f}");
    }
    assert_eq!(
        timing_steps(&reference),
        (1..=STEPS as u64).collect::<Vec<_>>()
    );

    // Random delays over the whole run (start-up, steps, validation, checkpoint writes); the
    // seed is printed so that a failure can be replayed with LORAFIT_KILL_SEED.
    let seed = std::env::var("LORAFIT_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    eprintln!(
        "uninterrupted run: {:.2}s; kill seed {seed}",
        run_time.as_secs_f64()
    );
    let mut x = seed | 1;
    let mut mid_run = 0;
    for trial in 0..20 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let delay = run_time.mul_f64((x % 10_000) as f64 / 10_000.0);
        let mut child = train_command(&setup, &out, &[]).spawn().unwrap();
        std::thread::sleep(delay);
        let finished_first = child.try_wait().unwrap().is_some();
        child.kill().ok(); // SIGKILL
        child.wait().unwrap();
        let resumable = has_checkpoint(&out);
        let steps_before = if out.join("metrics.jsonl").is_file() {
            timing_steps(&out).len()
        } else {
            0
        };
        if resumable && !finished_first && steps_before < STEPS {
            mid_run += 1;
        }
        eprintln!(
            "trial {trial}: killed after {:.3}s, {steps_before} steps logged, {}",
            delay.as_secs_f64(),
            if !resumable {
                "no checkpoint yet: starting again"
            } else if steps_before == STEPS {
                "after the last step"
            } else {
                "resuming"
            }
        );
        let final_checkpoint = out.join(format!("checkpoint-{STEPS:06}/trainer_state.json"));
        if final_checkpoint.is_file() {
            // The kill came after the last checkpoint: a resume is refused as finished.
            let e = train_command(&setup, &out, &["--resume", out.to_str().unwrap()])
                .output()
                .unwrap();
            let msg = String::from_utf8_lossy(&e.stderr);
            assert!(!e.status.success() && msg.contains("finished"), "{msg}");
        } else if resumable {
            run_to_end(&setup, &out, &["--resume", out.to_str().unwrap()]);
        } else {
            run_to_end(&setup, &out, &["--overwrite"]);
        }
        let got = deterministic_files(&out);
        let names = |m: &BTreeMap<String, Vec<u8>>| m.keys().cloned().collect::<Vec<_>>();
        assert_eq!(names(&got), names(&want), "trial {trial}: files differ");
        for (name, bytes) in &want {
            assert!(
                got[name] == *bytes,
                "trial {trial} (killed after {:.3}s): {name} differs from the uninterrupted run's{}",
                delay.as_secs_f64(),
                first_differing_line(&got[name], bytes)
            );
        }
        assert_eq!(
            timing_steps(&out),
            (1..=STEPS as u64).collect::<Vec<_>>(),
            "trial {trial}: timing.jsonl"
        );
        let _ = std::fs::remove_dir_all(&out);
    }
    eprintln!("{mid_run} of 20 kills came mid-run, after a checkpoint");
    assert!(
        mid_run >= 5,
        "only {mid_run} of 20 kills landed between the first checkpoint and the end"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// `lorafit train --resume OUT` alone continues with the run's own settings (the checkpoint's
/// `run.toml`, flags over it): the same files as a resume that repeats every flag. A setting a
/// resume changes is said.
#[test]
fn a_resume_without_settings_continues_with_the_checkpoints() {
    let _one = one_at_a_time();
    let dir = scratch("bare-resume");
    let setup = Setup::new(&dir, 24, 4);
    let (full, bare) = (dir.join("full"), dir.join("bare"));
    for out in [&full, &bare] {
        run_to_end(&setup, out, &["--set", &format!("steps={}", STEPS / 2)]);
    }
    run_to_end(&setup, &full, &["--resume", full.to_str().unwrap()]);
    let o = Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .args(["train", "--resume"])
        .arg(&bare)
        .args(["--steps", &STEPS.to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("settings from "), "{err}");
    assert!(!err.contains("note: resumed with"), "{err}");
    let (a, b) = (deterministic_files(&full), deterministic_files(&bare));
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, bytes) in &a {
        // plan.toml and run.toml name their own output folder.
        if name.ends_with(".toml") {
            continue;
        }
        assert!(*bytes == b[name], "{name} differs");
    }
    // A changed setting is said.
    let o = Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .args(["train", "--resume"])
        .arg(&bare)
        .args(["--steps", &(STEPS + 2).to_string(), "--set", "lr=5e-3"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("note: resumed with lr: checkpoint 0.01, now 0.005"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ctrl-C (SIGINT) or SIGTERM (a scheduler's or `docker stop`'s) during training stops the run
/// after its step with a checkpoint (status 130 or 143); a resume then ends as the uninterrupted
/// run does: the same metrics and adapter.
#[test]
fn ctrl_c_stops_with_a_checkpoint_and_the_resume_is_exact() {
    let _one = one_at_a_time();
    let dir = scratch("ctrl-c");
    let setup = Setup::new(&dir, 24, 4);
    let long = ["--set", "steps=400", "--set", "save_every=0"];
    let whole = dir.join("whole");
    run_to_end(&setup, &whole, &long);
    for (signal, status) in [("-INT", 130), ("-TERM", 143)] {
        let cut = dir.join(format!("cut{signal}"));
        let child = train_command(&setup, &cut, &long).spawn().unwrap();
        // Interrupted once training has begun (the handler is set just before the first step).
        let metrics = cut.join("metrics.jsonl");
        let t0 = Instant::now();
        while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 20 {
            assert!(
                t0.elapsed().as_secs() < 120,
                "the run never reached step 20"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let pid = child.id().to_string();
        assert!(Command::new("kill")
            .args([signal, &pid])
            .status()
            .unwrap()
            .success());
        let o = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(status), "{signal}: {err}");
        assert!(err.contains("stopped at step"), "{err}");
        // Only Ctrl-C is answered with what a second Ctrl-C does.
        assert_eq!(err.contains("Ctrl-C again"), signal == "-INT", "{err}");
        let stopped_at = std::fs::read_to_string(&metrics).unwrap().lines().count();
        assert!(
            stopped_at < 400,
            "the run ended before the interrupt reached it"
        );
        assert!(has_checkpoint(&cut));
        run_to_end(
            &setup,
            &cut,
            &[&long[..], &["--resume", cut.to_str().unwrap()]].concat(),
        );
        let (a, b) = (deterministic_files(&whole), deterministic_files(&cut));
        for name in ["metrics.jsonl", "adapter/adapter_model.safetensors"] {
            assert!(a[name] == b[name], "{signal}: {name} differs");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A resume without a config reads the run's settings, whose paths are relative to the folder
/// the run started in: from elsewhere it names the path and says so; from there, new `--epochs`
/// count again (run.toml holds the steps the old epochs gave), and a changed validation file is
/// said.
#[test]
fn a_bare_resume_names_relative_paths_and_counts_new_epochs() {
    let _one = one_at_a_time();
    let dir = scratch("relative");
    let setup = Setup::new(&dir, 8, 2);
    let run = |cwd: &Path, args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_lorafit"))
            .current_dir(cwd)
            .args(args)
            .output()
            .unwrap()
    };
    let o = run(
        &dir,
        &[
            "train",
            "--model",
            "model",
            "--data",
            "train.jsonl",
            "--output",
            "r",
            "--epochs",
            "1",
            "--rank",
            "4",
            "--set",
            "save_every=2",
            "--set",
            "max_seq_len=48",
            "--set",
            "max_prompt_len=24",
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let elsewhere = run(
        dir.parent().unwrap(),
        &[
            "train",
            "--resume",
            dir.join("r").to_str().unwrap(),
            "--epochs",
            "2",
        ],
    );
    let err = String::from_utf8_lossy(&elsewhere.stderr);
    assert!(!elsewhere.status.success(), "{err}");
    assert!(
        err.contains("model = \"model\"") && err.contains("relative to the folder the run was"),
        "{err}"
    );
    let valid = setup.valid.file_name().unwrap().to_str().unwrap();
    let o = run(
        &dir,
        &["train", "--resume", "r", "--epochs", "2", "--valid", valid],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("note: resumed with valid: checkpoint unset"),
        "{err}"
    );
    // 8 rows a pass, one a step: two epochs are 16 steps.
    let metrics = std::fs::read_to_string(dir.join("r/metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap()).unwrap();
    assert_eq!(last["step"], 16, "{metrics}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Inside a run folder, a bare checkpoint name is that folder's checkpoint (its run folder
/// `.`): `--resume checkpoint-000004 --output . --overwrite` continues the run from it, deleting
/// only the later steps, never the checkpoint it reads; without --overwrite the later steps
/// are named.
#[test]
fn a_bare_checkpoint_name_resumes_in_its_own_folder() {
    let _one = one_at_a_time();
    let dir = scratch("bare-name");
    let setup = Setup::new(&dir, 8, 2);
    let run = dir.join("r");
    run_to_end(&setup, &run, &["--set", "steps=6", "--set", "save_every=2"]);
    let resume = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_lorafit"))
            .current_dir(&run)
            .args(["train", "--resume", "checkpoint-000004", "--steps", "7"])
            .args(extra)
            .output()
            .unwrap()
    };
    let o = resume(&[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("went on past step 4"), "{err}");
    let o = resume(&["--output", ".", "--overwrite"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    for kept in [
        "checkpoint-000002",
        "checkpoint-000004",
        "checkpoint-000007",
    ] {
        assert!(
            run.join(kept).join("trainer_state.json").is_file(),
            "{kept}"
        );
    }
    assert!(run.join("adapter/adapter_model.safetensors").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run folder is locked for its run's life: a second run into it, or a resume of it, is
/// refused naming the folder and the holder's pid; after a kill -9 the folder is free.
#[test]
fn a_second_process_cannot_train_into_a_running_folder() {
    let _one = one_at_a_time();
    let dir = scratch("lock");
    let setup = Setup::new(&dir, 12, 2);
    let out = dir.join("run");
    let long = ["--set", "steps=5000", "--set", "save_every=2"];
    let mut child = train_command(&setup, &out, &long).spawn().unwrap();
    let t0 = Instant::now();
    while !has_checkpoint(&out) {
        assert!(t0.elapsed().as_secs() < 120, "no checkpoint was written");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let pid = format!("pid {}", child.id());
    for extra in [&["--overwrite"][..], &["--resume", out.to_str().unwrap()]] {
        let o = train_command(&setup, &out, &[&long[..], extra].concat())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{extra:?}: {err}");
        assert!(
            err.contains("another lorafit process") && err.contains(&pid),
            "{extra:?}: {err}"
        );
        assert!(err.contains(&out.display().to_string()), "{err}");
    }
    assert!(
        child.try_wait().unwrap().is_none(),
        "the first run ended early"
    );
    // SIGKILL: the kernel releases the lock, and the folder takes a new run.
    child.kill().unwrap();
    child.wait().unwrap();
    run_to_end(&setup, &out, &["--set", "steps=4", "--overwrite"]);
    assert!(out.join("adapter/adapter_model.safetensors").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run on the built-in `--model smollm2` resumes with `--resume run` alone (the model's name
/// is no path relative to where the run started) and ends as the uninterrupted run; its
/// adapter names the base by its Hub id, as PEFT loads it.
#[test]
fn a_smollm2_run_resumes_by_its_folder() {
    let _one = one_at_a_time();
    if common::smollm2_or_skip("a_smollm2_run_resumes_by_its_folder").is_none() {
        return;
    }
    let dir = scratch("smollm2");
    data_file(&dir.join("train.jsonl"), 6, 1);
    let lorafit = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_lorafit"))
            .current_dir(&dir)
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(o.status.success(), "lorafit {args:?}: {err}");
        err
    };
    lorafit(&[
        "train",
        "--model",
        "smollm2",
        "--data",
        "train.jsonl",
        "--output",
        "run",
        "--steps",
        "4",
        "--rank",
        "2",
        "--set",
        "save_every=2",
        "--set",
        "max_seq_len=32",
        "--set",
        "max_prompt_len=16",
    ]);
    let run = dir.join("run");
    let want = deterministic_files(&run);
    let config: serde_json::Value =
        serde_json::from_slice(&want["adapter/adapter_config.json"]).unwrap();
    assert_eq!(
        config["base_model_name_or_path"],
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    );
    // As a kill after step 2 leaves the folder.
    std::fs::remove_dir_all(run.join("checkpoint-000004")).unwrap();
    std::fs::remove_dir_all(run.join("adapter")).unwrap();
    lorafit(&["train", "--resume", "run"]);
    std::fs::remove_dir_all(run.join("checkpoint-000004")).unwrap();
    std::fs::remove_dir_all(run.join("adapter")).unwrap();
    lorafit(&["train", "--resume", "run", "--model", "smollm2"]);
    let got = deterministic_files(&run);
    for name in ["metrics.jsonl", "adapter/adapter_model.safetensors"] {
        assert!(got[name] == want[name], "{name} differs");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
