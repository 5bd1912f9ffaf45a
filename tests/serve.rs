//! `lorafit serve` end to end on the CPU: each test starts its own server (the real binary, on an
//! ephemeral loopback port, with its own database and root) and drives it over HTTP with a tiny
//! model: submit → events → done → adapter download; cancel and resume; the queue; a bad config
//! (400 naming the field); a path escape (403); a missing token (401); 50 concurrent status
//! requests during a run; a failing job; a job's chat template; a kill -9 mid-run after which the restarted server
//! resumes the job to an adapter bit-identical to an uninterrupted run's; an eval job whose
//! scores, report and chart are `lorafit eval`'s on the same inputs; an export job whose merged
//! folder lorafit loads; and bad or escaping eval and export jobs (400 naming the field, 403).

mod serve_support;
use serde_json::{json, Value};
use serve_support::*;
use std::collections::BTreeSet;

fn kinds(events: &[Sse]) -> Vec<&str> {
    events.iter().map(|e| e.kind.as_str()).collect()
}

fn steps_of(events: &[Sse], kind: &str) -> Vec<i64> {
    events
        .iter()
        .filter(|e| e.kind == kind)
        .map(|e| e.data["step"].as_i64().unwrap())
        .collect()
}

fn metric_steps(server: &Server, id: i64, split: &str) -> Vec<i64> {
    let m = server.get(&format!("/jobs/{id}/metrics"));
    assert_eq!(m.status, 200, "{}", m.text());
    m.json()["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["split"] == split)
        .map(|r| r["step"].as_i64().unwrap())
        .collect()
}

/// Each body POSTed to /jobs is refused with `status` and an error that names its field (a 403
/// starts with the field: the path that escaped).
fn assert_all_refused<'a>(
    server: &Server,
    cases: impl IntoIterator<Item = (&'a Value, &'a str)>,
    status: u16,
) {
    for (body, field) in cases {
        let r = server.post("/jobs", body);
        assert_eq!(r.status, status, "{body}: {}", r.text());
        let msg = r.json()["error"].as_str().unwrap().to_string();
        let named = if status == 403 {
            msg.starts_with(&format!("{field}:"))
        } else {
            msg.contains(field)
        };
        assert!(named, "{body}: the error {msg:?} does not name {field}");
    }
}

#[test]
fn submit_follow_events_and_download_the_adapter() {
    let ws = Workspace::new("submit");
    let server = Server::start(&ws, &[]);
    let mut cfg = tiny_job(8);
    cfg["eval_every"] = json!(4);
    cfg["save_every"] = json!(3);
    let id = server.submit(&cfg);
    let mut stream = server.events(id);
    let events = stream.until("done");
    assert!(stream.rest().is_empty(), "the stream ends after `done`");

    let k = kinds(&events);
    assert_eq!(k[0], "state");
    assert_eq!(events[0].data["state"], "queued");
    assert!(k.contains(&"started"), "{k:?}");
    assert_eq!(steps_of(&events, "step"), (1..=8).collect::<Vec<_>>());
    assert_eq!(steps_of(&events, "valid"), vec![0, 4, 8]);
    // Periodic checkpoints at 3 and 6, the final one at 8, plus best-margin copies.
    let ckpts: BTreeSet<i64> = events
        .iter()
        .filter(|e| e.kind == "checkpoint" && e.data["best"] == false)
        .map(|e| e.data["step"].as_i64().unwrap())
        .collect();
    assert_eq!(ckpts, BTreeSet::from([3, 6, 8]));
    let ids: Vec<i64> = events.iter().map(|e| e.id).collect();
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "event ids increase: {ids:?}"
    );
    for e in events.iter().filter(|e| e.kind == "step") {
        let loss = e.data["loss"].as_f64().unwrap();
        assert!(loss.is_finite() && loss > 0.0, "{}", e.data);
        assert_eq!(e.data["total_steps"], 8);
        assert!(e.data["metrics"]["margin"].is_number(), "{}", e.data);
    }

    let job = server.job(id);
    assert_eq!(job["state"], "done");
    assert_eq!(
        (job["step"].as_i64(), job["total_steps"].as_i64()),
        (Some(8), Some(8))
    );
    assert_eq!(job["plan"]["total_steps"], 8);
    assert_eq!(job["plan"]["lora_rank"], 4);
    assert_eq!(job["config"]["rank"], 4);
    assert_eq!(job["latest"]["train"]["step"], 8);
    assert_eq!(job["latest"]["valid"]["step"], 8);
    let output = std::path::PathBuf::from(job["output"].as_str().unwrap());
    assert_eq!(output, ws.root.canonicalize().unwrap().join("runs/job-1"));
    assert_eq!(
        metric_steps(&server, id, "train"),
        (1..=8).collect::<Vec<_>>()
    );
    assert_eq!(metric_steps(&server, id, "valid"), vec![0, 4, 8]);

    // A replay from the start sends the same events again, and one after the last id nothing.
    let replay = server.events(id).rest();
    assert_eq!(kinds(&replay), k);
    let last = events.last().unwrap().id;
    let after = EventReader::open(
        server.port,
        &format!("/jobs/{id}/events"),
        &[("Last-Event-ID".into(), last.to_string())],
    )
    .rest();
    assert!(after.is_empty(), "{after:?}");

    let r = server.get(&format!("/jobs/{id}/adapter"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/x-tar"));
    // A train job's result is a tar: another format is refused, not answered with it.
    let bad = server.get(&format!("/jobs/{id}/result?format=markdown"));
    assert_eq!(bad.status, 400, "{}", bad.text());
    assert!(bad.text().contains("result is a tar"), "{}", bad.text());
    let files = lorafit::serve::tar::read_tar(&r.body).unwrap();
    let names: Vec<&str> = files.iter().map(|f| f.0.as_str()).collect();
    assert!(
        names.contains(&"job-1-adapter/adapter_model.safetensors"),
        "{names:?}"
    );
    assert!(
        names.contains(&"job-1-adapter/adapter_config.json"),
        "{names:?}"
    );
    for (name, bytes) in &files {
        let on_disk = std::fs::read(
            output
                .join("adapter")
                .join(name.rsplit('/').next().unwrap()),
        )
        .unwrap();
        assert!(bytes == &on_disk, "{name} differs from the adapter on disk");
    }
    let adapter_config: Value = serde_json::from_slice(
        &files
            .iter()
            .find(|f| f.0.ends_with("adapter_config.json"))
            .unwrap()
            .1,
    )
    .unwrap();
    assert_eq!(adapter_config["r"], 4);

    let listed = server.get("/jobs").json();
    assert_eq!(listed["jobs"][0]["id"], id);
    assert_eq!(listed["jobs"][0]["state"], "done");
    let r = server.delete(&format!("/jobs/{id}"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(server.get(&format!("/jobs/{id}")).status, 404);
    assert!(
        output.join("adapter/adapter_model.safetensors").is_file(),
        "files stay"
    );
}

#[test]
fn cancel_a_running_job_resume_it_and_cancel_a_queued_one() {
    let ws = Workspace::new("cancel");
    let server = Server::start(&ws, &[]);
    let long = tiny_job(100_000);
    let id = server.submit(&long);
    let mut queued_cfg = tiny_job(5);
    queued_cfg["output"] = json!("runs/second");
    let second = server.submit(&queued_cfg);
    let mut stream = server.events(id);
    stream.until("step");
    // One job at a time: the second waits in the queue.
    assert_eq!(server.job(second)["state"], "queued");
    assert_eq!(
        server.delete(&format!("/jobs/{id}")).status,
        409,
        "a running job is not deleted"
    );
    assert_eq!(server.get(&format!("/jobs/{id}/adapter")).status, 409);

    let r = server.post(&format!("/jobs/{second}/cancel"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["state"], "cancelled");

    let r = server.post(&format!("/jobs/{id}/cancel"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let rest = stream.until("cancelled");
    let stopped_at = rest.last().unwrap().data["step"].as_i64().unwrap();
    assert!((1..100_000).contains(&stopped_at), "{stopped_at}");
    let job = server.job(id);
    assert_eq!(job["state"], "cancelled");
    assert_eq!(job["step"], stopped_at);
    assert_eq!(job["checkpoint"]["step"], stopped_at);
    let ckpt = std::path::PathBuf::from(job["checkpoint"]["path"].as_str().unwrap());
    assert!(ckpt.join("trainer_state.json").is_file());
    let state: Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("trainer_state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"], stopped_at);
    // The second job never ran.
    assert_eq!(server.job(second)["step"], 0);
    assert_eq!(
        server
            .post(&format!("/jobs/{second}/cancel"), &json!({}))
            .status,
        409
    );

    // Resume: it continues from the checkpoint; steps stay continuous.
    let r = server.post(&format!("/jobs/{id}/resume"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let mut stream = server.events(id);
    let target = stopped_at + 3;
    loop {
        let e = stream.next_event().expect("events after resume");
        if e.kind == "step" && e.data["step"].as_i64().unwrap() >= target {
            break;
        }
    }
    assert_eq!(
        server
            .post(&format!("/jobs/{id}/cancel"), &json!({}))
            .status,
        200
    );
    stream.until("cancelled");
    let job = server.job(id);
    assert_eq!(job["plan"]["start_step"], stopped_at);
    let steps = metric_steps(&server, id, "train");
    let n = job["step"].as_i64().unwrap();
    assert!(n >= target);
    assert_eq!(
        steps,
        (1..=n).collect::<Vec<_>>(),
        "train rows: each step once"
    );
}

#[test]
fn a_bad_config_is_a_400_that_names_the_field() {
    let ws = Workspace::new("badcfg");
    let server = Server::start(&ws, &[]);
    let cases: &[(Value, &str)] = &[
        (
            json!({"data": "train.jsonl", "lerning_rate": 1e-4}),
            "lerning_rate",
        ),
        (json!({"data": "train.jsonl", "steps": "ten"}), "steps"),
        // A type error names the key as written (TRL's), not only lorafit's name for it.
        (
            json!({"data": "train.jsonl", "max_steps": "ten"}),
            "max_steps",
        ),
        (json!({"data": "train.jsonl", "lr": -1.0}), "lr"),
        (
            json!({"data": "train.jsonl", "warmup_ratio": 2.0}),
            "warmup_ratio",
        ),
        (json!({"data": "train.jsonl", "method": "ppo"}), "method"),
        (
            json!({"data": "train.jsonl", "max_prompt_len": 64, "max_seq_len": 64}),
            "max_prompt_len",
        ),
        (json!({"model": "model"}), "data"),
        (
            json!({"data": "train.jsonl", "model": "no-such-model"}),
            "model",
        ),
        // Files a job reads beside its data, named inside the roots but not there.
        (
            json!({"data": "train.jsonl", "chat_template": "no-such.jinja"}),
            "chat_template",
        ),
        (
            json!({"data": "train.jsonl", "rank_scaling": "by_kl", "rank_kl_file": "no-kl.json"}),
            "rank_kl_file",
        ),
        (
            json!({"kind": "eval", "data": "train.jsonl", "chat_template": "no-such.jinja"}),
            "chat_template",
        ),
        // An eval job takes lorafit eval's --base-quant, by name.
        (
            json!({"kind": "eval", "data": "train.jsonl", "base_quant": "q9"}),
            "base_quant",
        ),
        (
            json!({"kind": "export", "model": "model", "adapter": "model",
                   "chat_template": "no-such.jinja"}),
            "chat_template",
        ),
        // The device is checked at submit, as an eval job's is.
        (
            json!({"model": "model", "data": "train.jsonl", "device": "tpu"}),
            "device",
        ),
    ];
    assert_all_refused(&server, cases.iter().map(|(b, f)| (b, *f)), 400);
    let r = server.post(
        "/jobs",
        &json!({"kind": "eval", "data": "train.jsonl", "base_quant": "q9"}),
    );
    assert!(!r.text().contains("not a setting"), "{}", r.text());
    if lorafit::tensor::Device::check("cuda").is_err() {
        let r = server.post(
            "/jobs",
            &json!({"model": "model", "data": "train.jsonl", "device": "cuda"}),
        );
        assert_eq!(r.status, 400, "{}", r.text());
        let msg = r.json()["error"].as_str().unwrap().to_string();
        assert!(msg.starts_with("device:"), "{msg}");
        assert!(!msg.contains("--device"), "the API's words: {msg}");
    }
    // Not JSON, not an object, not declared JSON, too large.
    let h = vec![("Content-Type".to_string(), "application/json".to_string())];
    let r = request(server.port, "POST", "/jobs", &h, Some(b"{not json"));
    assert_eq!(r.status, 400, "{}", r.text());
    let r = server.post("/jobs", &json!([1, 2]));
    assert_eq!(r.status, 400);
    assert!(r.json()["error"].as_str().unwrap().contains("JSON object"));
    let r = request(server.port, "POST", "/jobs", &[], Some(b"{}"));
    assert_eq!(r.status, 415, "{}", r.text());
    let msg = r.json()["error"].as_str().unwrap().to_string();
    assert!(
        msg.contains("POST /jobs needs `Content-Type: application/json` (the body is the job"),
        "{msg}"
    );
    let r = request(server.port, "POST", "/jobs/1/cancel", &[], None);
    assert_eq!(r.status, 415, "{}", r.text());
    assert!(r.json()["error"]
        .as_str()
        .unwrap()
        .contains("(an empty body is fine)"));
    // Media types compare without regard to case.
    let h = vec![("Content-Type".to_string(), "Application/JSON".to_string())];
    let r = request(server.port, "POST", "/jobs", &h, Some(b"[1]"));
    assert_eq!(r.status, 400, "{}", r.text());
    // An endpoint or a method the API lacks is a JSON error too: 404 and 405.
    let r = server.get("/jobs/1/nope");
    assert_eq!(r.status, 404, "{}", r.text());
    assert!(r.json()["error"].as_str().unwrap().contains("/jobs/1/nope"));
    for method in ["PUT", "OPTIONS"] {
        let r = request(server.port, method, "/jobs", &h, None);
        assert_eq!(r.status, 405, "{method}: {}", r.text());
        assert!(
            r.json()["error"].as_str().unwrap().contains(method),
            "{}",
            r.text()
        );
    }
    // An id that is not one is the API's JSON error, not the framework's text.
    for path in [
        "/jobs/abc",
        "/jobs/99999999999999999999",
        "/jobs/1.5/metrics",
    ] {
        let r = server.get(path);
        assert_eq!(r.status, 400, "{path}: {}", r.text());
        let msg = r.json()["error"].as_str().unwrap().to_string();
        assert!(
            msg.starts_with("id:") && msg.contains("not a job id"),
            "{msg}"
        );
    }
    let r = server.post("/jobs/abc/cancel", &json!({}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.json()["error"].as_str().unwrap().starts_with("id:"));
    let big = format!("{{\"data\": \"{}\"}}", "x".repeat(100_000));
    let r = request(server.port, "POST", "/jobs", &h, Some(big.as_bytes()));
    assert_eq!(r.status, 413, "{}", r.text());
    assert!(server.get("/jobs").json()["jobs"]
        .as_array()
        .unwrap()
        .is_empty());
    assert_eq!(server.get("/jobs/99").status, 404);
    // A token-less server answers only requests addressed to a loopback name.
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    use std::io::{Read, Write};
    stream
        .write_all(b"GET /jobs HTTP/1.1\r\nHost: evil.example:80\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 403"), "{answer}");
    assert!(answer.contains("not a loopback name"), "{answer}");
}

#[test]
fn a_path_outside_the_roots_is_a_403() {
    let ws = Workspace::new("escape");
    std::fs::write(ws.dir.join("outside.jsonl"), pairs_jsonl(4, 9)).unwrap();
    std::os::unix::fs::symlink(&ws.dir, ws.root.join("up")).unwrap();
    let server = Server::start(&ws, &[]);
    let outside = ws.dir.join("outside.jsonl").display().to_string();
    let cases: Vec<(Value, &str)> = vec![
        (
            json!({"model": "model", "data": "../outside.jsonl"}),
            "data",
        ),
        (json!({"model": "model", "data": outside}), "data"),
        (
            json!({"model": "model", "data": "up/outside.jsonl"}),
            "data",
        ),
        (
            json!({"model": "model", "data": "train.jsonl", "valid": "/etc/hostname"}),
            "valid",
        ),
        (json!({"model": "/", "data": "train.jsonl"}), "model"),
        (
            json!({"model": "model", "data": "train.jsonl", "output": "/tmp/lorafit-escape"}),
            "output",
        ),
        (
            json!({"model": "model", "data": "train.jsonl", "output": "up/run"}),
            "output",
        ),
        (
            json!({"model": "model", "data": "train.jsonl", "output": "runs/../../x"}),
            "output",
        ),
        // Every file a job reads, the template and the KL file included.
        (
            json!({"model": "model", "data": "train.jsonl", "chat_template": "/etc/hostname"}),
            "chat_template",
        ),
        (
            json!({"model": "model", "data": "train.jsonl", "rank_scaling": "by_kl",
                   "rank_kl_file": outside}),
            "rank_kl_file",
        ),
        (
            json!({"kind": "eval", "model": "model", "data": "train.jsonl",
                   "chat_template": "up/outside.jsonl"}),
            "chat_template",
        ),
        (
            json!({"kind": "eval", "data": "train.jsonl", "config": "escaping.toml"}),
            "chat_template",
        ),
        (
            json!({"kind": "export", "model": "model", "adapter": "model",
                   "chat_template": "/etc/hostname"}),
            "chat_template",
        ),
    ];
    // A config inside the roots whose template is not.
    std::fs::write(
        ws.root.join("escaping.toml"),
        "model = \"model\"\nchat_template = \"/etc/hostname\"\n",
    )
    .unwrap();
    assert_all_refused(&server, cases.iter().map(|(b, f)| (b, *f)), 403);
    assert!(server.get("/jobs").json()["jobs"]
        .as_array()
        .unwrap()
        .is_empty());
    // Two jobs may not share an output folder.
    let mut cfg = tiny_job(1);
    cfg["output"] = json!("runs/shared");
    server.submit(&cfg);
    let r = server.post("/jobs", &cfg);
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.json()["error"].as_str().unwrap().starts_with("output:"));
}

#[test]
fn a_token_is_required_when_configured_and_off_loopback() {
    let ws = Workspace::new("token");
    let token = "s3cret-token-0123456789";
    std::fs::write(ws.dir.join("token"), format!("{token}\n")).unwrap();
    let token_file = ws.dir.join("token").display().to_string();
    let mut server = Server::start(&ws, &["--token-file", &token_file]);
    let r = server.get("/jobs");
    assert_eq!(r.status, 401);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    // The scheme's name in any case (RFC 7235): lowercase `bearer` with the right token passes.
    let lower = vec![("Authorization".to_string(), format!("bearer {token}"))];
    assert_eq!(
        request(server.port, "GET", "/jobs", &lower, None).status,
        200
    );
    let wrong = vec![(
        "Authorization".to_string(),
        "Bearer s3cret-token-0123456780".to_string(),
    )];
    assert_eq!(
        request(server.port, "GET", "/jobs", &wrong, None).status,
        401
    );
    let h = vec![("Content-Type".to_string(), "application/json".to_string())];
    assert_eq!(
        request(
            server.port,
            "POST",
            "/jobs",
            &h,
            Some(tiny_job(1).to_string().as_bytes())
        )
        .status,
        401
    );
    assert_eq!(server.get("/jobs/1/events").status, 401);
    // The page itself holds no data and loads without the token.
    assert_eq!(server.get("/").status, 200);
    server.token = Some(token.to_string());
    assert_eq!(server.get("/jobs").status, 200);
    server.kill();

    // Off loopback without a token the server refuses to start (it exits before binding).
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .args(["serve", "--listen", "0.0.0.0:0", "--db"])
        .arg(ws.dir.join("other.sqlite"))
        .arg("--root")
        .arg(&ws.root)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("token"), "{err}");
    // A short token is refused too.
    std::fs::write(ws.dir.join("short"), "abc\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .args(["serve", "--listen", "127.0.0.1:0", "--token-file"])
        .arg(ws.dir.join("short"))
        .arg("--db")
        .arg(ws.dir.join("other.sqlite"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("16 characters"));
}

#[test]
fn fifty_concurrent_status_requests_during_a_run_are_all_answered() {
    let ws = Workspace::new("concurrent");
    let server = Server::start(&ws, &[]);
    let id = server.submit(&tiny_job(100_000));
    server.events(id).until("step");
    let port = server.port;
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..50)
            .map(|i| {
                s.spawn(move || {
                    let path = if i % 5 == 4 {
                        "/jobs".to_string()
                    } else {
                        format!("/jobs/{id}")
                    };
                    let r = request(port, "GET", &path, &[], None);
                    (r.status, r.json())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(answers.len(), 50);
    let mut steps = Vec::new();
    for (status, body) in &answers {
        assert_eq!(*status, 200, "{body}");
        if let Some(state) = body.get("state") {
            assert_eq!(state, "running", "{body}");
            steps.push(body["step"].as_i64().unwrap());
        } else {
            assert_eq!(body["jobs"][0]["state"], "running");
        }
    }
    assert_eq!(steps.len(), 40);
    assert!(steps.iter().all(|&s| s >= 1));
    assert_eq!(
        server
            .post(&format!("/jobs/{id}/cancel"), &json!({}))
            .status,
        200
    );
    server.events(id).until("cancelled");
}

#[test]
fn a_failing_job_is_marked_failed_and_the_queue_goes_on() {
    let ws = Workspace::new("failing");
    std::fs::write(
        ws.root.join("bad.jsonl"),
        "{\"prompt\": \"w3 w4\", \"chosen\": \"w5\", \"rejected\": \"w200\"}\n{\"prompt\": \"w3\", \"chosen\": \"w5\"}\n",
    )
    .unwrap();
    let server = Server::start(&ws, &[]);
    let mut bad = tiny_job(3);
    bad["data"] = json!("bad.jsonl");
    let bad_id = server.submit(&bad);
    let good_id = server.submit(&tiny_job(2));
    let events = server.events(bad_id).until("failed");
    let reason = events.last().unwrap().data["reason"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        reason.contains("bad.jsonl:2") && reason.contains("\"rejected\": missing"),
        "{reason}"
    );
    let job = server.job(bad_id);
    assert_eq!(job["state"], "failed");
    assert_eq!(job["message"], reason);
    server.events(good_id).until("done");
    assert_eq!(server.job(good_id)["state"], "done");
}

/// A train job's `chat_template` setting is the template its data is read with, as with
/// `lorafit train`: chat rows on a model without a template train with it.
#[test]
fn a_train_job_reads_chat_rows_with_its_chat_template() {
    let ws = Workspace::new("template");
    let row = json!({
        "prompt": [{"role": "user", "content": "w5 w6 w7"}],
        "chosen": [{"role": "assistant", "content": "w9 w10"}],
        "rejected": [{"role": "assistant", "content": "w200 w201"}],
    });
    std::fs::write(ws.root.join("chat.jsonl"), format!("{row}\n{row}\n")).unwrap();
    std::fs::write(
        ws.root.join("plain.jinja"),
        "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    )
    .unwrap();
    let server = Server::start(&ws, &[]);
    let mut cfg = tiny_job(1);
    cfg["data"] = json!("chat.jsonl");
    cfg["valid"] = json!("chat.jsonl");
    cfg["chat_template"] = json!("plain.jinja");
    let id = server.submit(&cfg);
    server.events(id).until("done");
    assert_eq!(server.job(id)["state"], "done");
}

#[test]
fn kill_9_mid_run_then_restart_resumes_to_a_bit_identical_adapter() {
    let ws = Workspace::new("kill9");
    let steps = 120;
    let mut cfg = tiny_job(steps);
    cfg["save_every"] = json!(10);
    cfg["eval_every"] = json!(40);

    let mut server = Server::start(&ws, &[]);
    let mut reference = cfg.clone();
    reference["output"] = json!("runs/uninterrupted");
    let ref_id = server.submit(&reference);
    server.events(ref_id).until("done");

    let mut interrupted = cfg.clone();
    interrupted["output"] = json!("runs/interrupted");
    let id = server.submit(&interrupted);
    let mut stream = server.events(id);
    loop {
        let e = stream.next_event().expect("events before the kill");
        if e.kind == "checkpoint" && e.data["best"] == false && e.data["step"] == 20 {
            break;
        }
    }
    server.kill(); // SIGKILL: no chance to checkpoint or record anything more
    drop(stream);
    // The trainer may have checkpointed again (30, 40...) between the step-20 event reaching
    // this test and the kill landing: the restart resumes from the newest checkpoint the server
    // had recorded, whichever that is.
    let server = Server::start(&ws, &[]);
    let events = server.events(id).until("done");
    let resumed_at: i64 = events
        .iter()
        .filter(|e| e.kind == "state")
        .find_map(|e| {
            let msg = e.data["message"].as_str().unwrap_or("");
            let (_, after) = msg.split_once("resuming from the checkpoint of step ")?;
            msg.contains("interrupted at step")
                .then(|| after.trim().parse().unwrap())
        })
        .expect("the restart says the job was interrupted and where it resumes");
    assert!(
        resumed_at >= 20 && resumed_at < steps as i64 && resumed_at % 10 == 0,
        "{resumed_at}"
    );
    let job = server.job(id);
    assert_eq!(job["state"], "done");
    assert_eq!(
        job["plan"]["start_step"], resumed_at,
        "resumed from the newest checkpoint written before the kill"
    );
    assert_eq!(job["step"], steps as i64);
    assert_eq!(
        metric_steps(&server, id, "train"),
        (1..=steps as i64).collect::<Vec<_>>()
    );
    assert_eq!(metric_steps(&server, id, "valid"), vec![0, 40, 80, 120]);
    // The record is the uninterrupted run's, step for step.
    let losses = |id: i64| -> Vec<f64> {
        server.get(&format!("/jobs/{id}/metrics")).json()["rows"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["split"] == "train")
            .map(|r| r["loss"].as_f64().unwrap())
            .collect()
    };
    assert_eq!(losses(id), losses(ref_id));

    let out = |name: &str| ws.root.join("runs").join(name).join("adapter");
    for f in ["adapter_model.safetensors", "adapter_config.json"] {
        let a = std::fs::read(out("uninterrupted").join(f)).unwrap();
        let b = std::fs::read(out("interrupted").join(f)).unwrap();
        assert!(
            a == b,
            "{f}: the resumed run's differs from the uninterrupted run's"
        );
    }
    let a = server.get(&format!("/jobs/{ref_id}/adapter"));
    let b = server.get(&format!("/jobs/{id}/adapter"));
    let fa = lorafit::serve::tar::read_tar(&a.body).unwrap();
    let fb = lorafit::serve::tar::read_tar(&b.body).unwrap();
    let weights = |f: &[(String, Vec<u8>)]| {
        f.iter()
            .find(|e| e.0.ends_with("adapter_model.safetensors"))
            .unwrap()
            .1
            .clone()
    };
    assert!(
        weights(&fa) == weights(&fb),
        "the downloads' weights are bit-identical"
    );
}

#[test]
fn sigterm_checkpoints_the_running_job_and_the_next_server_resumes_it() {
    let ws = Workspace::new("sigterm");
    let mut server = Server::start(&ws, &[]);
    let id = server.submit(&tiny_job(100_000));
    server.events(id).until("step");
    let pid = server.child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(s) = server.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed().as_secs() < 60,
            "the server did not stop on SIGTERM"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");

    let server = Server::start(&ws, &[]);
    let job = server.wait_for(id, 60, |j| {
        j["state"] == "running"
            && !j["plan"]["start_step"].is_null()
            && j["plan"]["start_step"] != 0
    });
    let stopped_at = job["plan"]["start_step"].as_i64().unwrap();
    assert!(job["plan"]["resumed_from"]
        .as_str()
        .unwrap()
        .ends_with(&format!("checkpoint-{stopped_at:06}")));
    assert_eq!(
        server
            .post(&format!("/jobs/{id}/cancel"), &json!({}))
            .status,
        200
    );
    server.events(id).until("cancelled");
    let n = server.job(id)["step"].as_i64().unwrap();
    assert_eq!(
        metric_steps(&server, id, "train"),
        (1..=n).collect::<Vec<_>>()
    );
}

/// `lorafit serve` on the workspace's database with `--listen ADDR`, run to its end: it must
/// fail; its stderr.
fn refused_server(ws: &Workspace, db: &std::path::Path, listen: &str) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .args(["serve", "--listen", listen, "--db"])
        .arg(db)
        .arg("--root")
        .arg(&ws.root)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "the server started: {err}");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    err
}

fn state_messages(events: &[Sse]) -> Vec<&str> {
    events
        .iter()
        .filter(|e| e.kind == "state")
        .map(|e| e.data["message"].as_str().unwrap_or(""))
        .collect()
}

#[test]
fn a_second_server_on_the_same_database_is_refused_and_changes_nothing() {
    let ws = Workspace::new("second");
    let mut server = Server::start(&ws, &[]);
    let id = server.submit(&tiny_job(100_000));
    server.events(id).until("step");
    let db = ws.db().display().to_string();
    for listen in [
        "127.0.0.1:0".to_string(),
        format!("127.0.0.1:{}", server.port),
    ] {
        let err = refused_server(&ws, &ws.db(), &listen);
        assert!(
            err.contains(&format!(
                "the job database {db} is in use by another lorafit serve"
            )) && err.contains(&format!(
                "(pid {}, http://127.0.0.1:{})",
                server.child.id(),
                server.port
            )),
            "{err}"
        );
    }
    // The first server's job runs on, untouched: not rewound, still cancellable.
    let step = server.job(id)["step"].as_i64().unwrap();
    let job = server.wait_for(id, 60, |j| j["step"].as_i64().unwrap() > step + 2);
    assert_eq!(job["state"], "running");
    assert_eq!(job["plan"]["start_step"], 0);
    assert_eq!(
        server
            .post(&format!("/jobs/{id}/cancel"), &json!({}))
            .status,
        200
    );
    let events = server.events(id).until("cancelled");
    let messages = state_messages(&events);
    assert!(
        !messages.iter().any(|m| m.contains("interrupted")),
        "the job was taken for an interrupted one: {messages:?}"
    );

    // A server that cannot listen changes nothing either: a job left running by a killed
    // server stays as it was until a server that starts recovers it.
    let second = server.submit(&tiny_job(100_000));
    server.events(second).until("step");
    server.kill();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let listen = taken.local_addr().unwrap().to_string();
    let err = refused_server(&ws, &ws.db(), &listen);
    assert!(err.contains(&format!("listening on {listen}")), "{err}");
    let record = lorafit::serve::db::Db::open(&ws.db())
        .unwrap()
        .job(second)
        .unwrap()
        .unwrap();
    assert_eq!(record.state, lorafit::serve::db::JobState::Running);
    assert!(record.step >= 1);
    let server = Server::start(&ws, &[]);
    let events = server.events(second).until("step");
    let messages = state_messages(&events);
    assert!(
        messages.iter().any(|m| m.contains("interrupted at step")),
        "{messages:?}"
    );
    let r = server.post(&format!("/jobs/{second}/cancel"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    server.events(second).until("cancelled");

    // A --db that is not a database is named.
    let err = refused_server(&ws, &ws.root.join("train.jsonl"), "127.0.0.1:0");
    assert!(
        err.contains(&format!(
            "opening the job database {}",
            ws.root.join("train.jsonl").display()
        )) && err.contains("not a database"),
        "{err}"
    );
}

#[test]
fn a_jobs_own_folder_is_a_free_one_and_a_run_in_a_named_one_is_a_409() {
    let ws = Workspace::new("freefolder");
    // A run of an earlier database over the same root left `runs/job-1`.
    std::fs::create_dir_all(ws.root.join("runs/job-1/adapter")).unwrap();
    std::fs::write(ws.root.join("runs/job-1/plan.toml"), "").unwrap();
    // An empty folder is free.
    std::fs::create_dir_all(ws.root.join("runs/job-2")).unwrap();
    let server = Server::start(&ws, &[]);
    let root = ws.root.canonicalize().unwrap();
    let first = server.submit(&tiny_job(2));
    let second = server.submit(&tiny_job(2));
    assert_eq!(
        server.job(first)["output"],
        root.join("runs/job-1-2").display().to_string()
    );
    assert_eq!(
        server.job(second)["output"],
        root.join("runs/job-2").display().to_string()
    );
    server.events(first).until("done");
    server.events(second).until("done");

    // A named folder that holds a run is refused at submit, naming the API's way to replace it.
    let mut cfg = tiny_job(2);
    cfg["output"] = json!("runs/job-1");
    let r = server.post("/jobs", &cfg);
    assert_eq!(r.status, 409, "{}", r.text());
    let msg = r.json()["error"].as_str().unwrap().to_string();
    assert!(
        msg.starts_with("output:")
            && msg.contains("already holds a run (adapter, plan.toml)")
            && msg.contains("`\"overwrite\": true`")
            && !msg.contains("--"),
        "{msg}"
    );
    // Once its job is deleted, a job's folder is no one's, but the run in it still is.
    server.delete(&format!("/jobs/{first}"));
    cfg["output"] = json!("runs/job-1-2");
    let r = server.post("/jobs", &cfg);
    assert_eq!(r.status, 409, "{}", r.text());
    cfg["overwrite"] = json!(true);
    let id = server.submit(&cfg);
    server.events(id).until("done");
    // A job without output after those: its own folder, never one in use.
    let id = server.submit(&tiny_job(1));
    let output = server.job(id)["output"].as_str().unwrap().to_string();
    assert_eq!(
        output,
        root.join(format!("runs/job-{id}")).display().to_string()
    );
}

#[test]
fn a_job_killed_before_its_first_checkpoint_starts_over_in_its_own_folder() {
    let ws = Workspace::new("startover");
    let mut server = Server::start(&ws, &[]);
    let id = server.submit(&tiny_job(100_000));
    server.events(id).until("step");
    server.kill();
    let server = Server::start(&ws, &[]);
    let events = server.events(id).until("step");
    let messages = state_messages(&events);
    assert!(
        messages
            .iter()
            .any(|m| m.contains("before any checkpoint; starting over")),
        "{messages:?}"
    );
    let job = server.wait_for(id, 60, |j| {
        j["state"] != "running" || j["step"].as_i64().unwrap() >= 2
    });
    assert_eq!(job["state"], "running", "{job}");
    assert_eq!(job["plan"]["start_step"], 0);
    let r = server.post(&format!("/jobs/{id}/cancel"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    server.events(id).until("cancelled");
    let n = server.job(id)["step"].as_i64().unwrap();
    assert_eq!(
        metric_steps(&server, id, "train"),
        (1..=n).collect::<Vec<_>>()
    );
}

/// Trains the workspace's tiny model for a few steps through the server; the adapter's folder
/// (canonical) and the job's id.
fn trained_adapter(server: &Server, ws: &Workspace) -> (std::path::PathBuf, i64) {
    let mut cfg = tiny_job(4);
    cfg["output"] = json!("runs/trained");
    let id = server.submit(&cfg);
    server.events(id).until("done");
    let dir = ws.root.canonicalize().unwrap().join("runs/trained/adapter");
    assert!(dir.join("adapter_model.safetensors").is_file());
    (dir, id)
}

fn png_size(png: &[u8]) -> (u32, u32) {
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "PNG signature");
    assert_eq!(&png[12..16], b"IHDR");
    let be = |at: usize| u32::from_be_bytes(png[at..at + 4].try_into().unwrap());
    (be(16), be(20))
}

#[test]
fn an_eval_job_gives_the_clis_scores_report_and_chart() {
    let ws = Workspace::new("evaljob");
    let server = Server::start(&ws, &[]);
    let (adapter, train_id) = trained_adapter(&server, &ws);
    let id = server.submit(&json!({
        "kind": "eval", "model": "model", "data": "valid.jsonl",
        "compare": ["base", "runs/trained/adapter"], "output": "evals/before-after"
    }));
    let events = server.events(id).until("done");
    let k = kinds(&events);
    assert!(k.contains(&"started"), "{k:?}");
    // Six pairs, two subjects: progress up to 12 of 12.
    assert_eq!(steps_of(&events, "progress").last(), Some(&12), "{k:?}");
    let job = server.job(id);
    assert_eq!(job["kind"], "eval");
    assert_eq!(job["state"], "done");
    assert_eq!(
        (job["step"].as_i64(), job["total_steps"].as_i64()),
        (Some(12), Some(12))
    );
    let listed = server.get("/jobs").json();
    let kinds_listed: Vec<&str> = listed["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds_listed, ["train", "eval"]);
    let done = events.last().unwrap();
    assert!(
        done.data["summary"].as_str().unwrap().contains("6 pairs"),
        "{}",
        done.data
    );

    let r = server.get(&format!("/jobs/{id}/result"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/json"));
    let served = r.json();
    let md = server.get(&format!("/jobs/{id}/result?format=markdown"));
    assert_eq!(md.status, 200, "{}", md.text());
    let png = server.get(&format!("/jobs/{id}/result?format=png"));
    assert_eq!(png.status, 200, "{}", png.text());
    assert_eq!(png.header("content-type"), Some("image/png"));
    assert_eq!(png_size(&png.body), (960, 480));
    assert_eq!(
        server.get(&format!("/jobs/{id}/result?format=pdf")).status,
        400
    );
    assert_eq!(server.get(&format!("/jobs/{id}/adapter")).status, 409);
    // A training job's result is its adapter.
    let r = server.get(&format!("/jobs/{train_id}/result"));
    assert_eq!(r.header("content-type"), Some("application/x-tar"));

    // `lorafit eval` on the same inputs writes the same scores, report and chart.
    let root = ws.root.canonicalize().unwrap();
    let out = ws.dir.join("cli.json");
    let report = ws.dir.join("cli.md");
    let cli = std::process::Command::new(env!("CARGO_BIN_EXE_lorafit"))
        .arg("eval")
        .arg("--model")
        .arg(root.join("model"))
        .arg("--data")
        .arg(root.join("valid.jsonl"))
        .arg("--compare")
        .arg("base")
        .arg(&adapter)
        .arg("--out")
        .arg(&out)
        .arg("--report")
        .arg(&report)
        .output()
        .unwrap();
    assert!(
        cli.status.success(),
        "{}",
        String::from_utf8_lossy(&cli.stderr)
    );
    let cli_json: Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(cli_json, served, "the job's scores are the CLI's");
    assert_eq!(cli_json["after"]["subject"], adapter.display().to_string());
    assert_eq!(cli_json["per_example"].as_array().unwrap().len(), 6);
    assert_eq!(std::fs::read_to_string(&report).unwrap(), md.text());
    let cli_png = std::fs::read(ws.dir.join("cli.png")).expect("--report FILE.md writes FILE.png");
    assert!(cli_png == png.body, "the job's chart is the CLI's");
    let stdout = String::from_utf8_lossy(&cli.stdout);
    assert!(stdout.contains("margin grew on"), "{stdout}");
}

#[test]
fn an_export_job_writes_a_merged_folder_that_lorafit_loads() {
    let ws = Workspace::new("exportjob");
    let server = Server::start(&ws, &[]);
    trained_adapter(&server, &ws);
    let id = server.submit(&json!({
        "kind": "export", "model": "model", "adapter": "runs/trained/adapter",
        "format": ["merged"], "dtype": "f32", "check": true, "output": "exports/merged"
    }));
    let events = server.events(id).until("done");
    // One artefact written, then checked.
    assert_eq!(steps_of(&events, "progress"), vec![1, 2]);
    let done = events.last().unwrap();
    assert_eq!(done.data["written"][0]["format"], "hf", "{}", done.data);
    assert_eq!(done.data["checks"].as_array().unwrap().len(), 1);
    let job = server.job(id);
    assert_eq!(
        (job["kind"].as_str(), job["state"].as_str()),
        (Some("export"), Some("done"))
    );

    let out = ws.root.canonicalize().unwrap().join("exports/merged");
    let merged = lorafit::model::load(&out.join("merged-hf"), &lorafit::tensor::Device::Cpu)
        .expect("lorafit's loader reads the merged folder");
    let base = lorafit::model::load(&ws.root.join("model"), &lorafit::tensor::Device::Cpu).unwrap();
    assert_eq!(
        (merged.spec.vocab, merged.spec.n_layers),
        (base.spec.vocab, base.spec.n_layers)
    );
    assert!(out.join("check.json").is_file());

    let r = server.get(&format!("/jobs/{id}/result"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/x-tar"));
    let files = lorafit::serve::tar::read_tar(&r.body).unwrap();
    let names: Vec<&str> = files.iter().map(|f| f.0.as_str()).collect();
    for want in [
        "job-2-export/check.json",
        "job-2-export/merged-hf/config.json",
        "job-2-export/merged-hf/model.safetensors",
    ] {
        assert!(names.contains(&want), "{want} not in {names:?}");
    }
    let on_disk = std::fs::read(out.join("merged-hf/model.safetensors")).unwrap();
    let tarred = &files
        .iter()
        .find(|f| f.0.ends_with("merged-hf/model.safetensors"))
        .unwrap()
        .1;
    assert!(tarred == &on_disk);

    // Whatever the job's folder holds downloads, names past ustar's 100 bytes included, and the
    // archive is streamed: the server's memory does not grow with it.
    let long_dir = out.join(format!("{}/{}", "d".repeat(120), "e".repeat(90)));
    std::fs::create_dir_all(&long_dir).unwrap();
    let long_name = format!("{}.json", "f".repeat(150));
    std::fs::write(long_dir.join(&long_name), b"{\"deep\": true}").unwrap();
    let big_size: u64 = 160 << 20;
    std::fs::File::create(out.join("big.bin"))
        .unwrap()
        .set_len(big_size)
        .unwrap();
    let pid = server.child.id();
    // Resets the peak resident size (VmHWM) to the current one.
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
    let before = resident_kib(pid, "VmRSS");
    let r = server.get(&format!("/jobs/{id}/result"));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("content-length"),
        Some(r.body.len().to_string().as_str())
    );
    let grew_mib = (resident_kib(pid, "VmHWM") - before) / 1024;
    assert!(
        grew_mib < 64,
        "a {} MiB download raised the server's peak memory by {grew_mib} MiB",
        big_size >> 20
    );
    let files = lorafit::serve::tar::read_tar(&r.body).unwrap();
    let deep = files
        .iter()
        .find(|f| f.0.ends_with(&long_name))
        .expect("the long name is in the archive");
    assert_eq!(
        deep.0,
        format!(
            "job-2-export/{}/{}/{long_name}",
            "d".repeat(120),
            "e".repeat(90)
        )
    );
    assert_eq!(deep.1, b"{\"deep\": true}");
    let big = files
        .iter()
        .find(|f| f.0 == "job-2-export/big.bin")
        .unwrap();
    assert_eq!(big.1.len() as u64, big_size);

    // An export job writes into a new or an empty folder only: its result is the whole folder.
    std::fs::create_dir_all(ws.root.join("exports/empty")).unwrap();
    let export_into = |output: &str| {
        server.post(
            "/jobs",
            &json!({"kind": "export", "model": "model", "adapter": "runs/trained/adapter",
                    "format": "gguf-adapter", "output": output}),
        )
    };
    for taken in [".", "runs", "exports"] {
        let r = export_into(taken);
        assert_eq!(r.status, 409, "{taken}: {}", r.text());
        let msg = r.json()["error"].as_str().unwrap().to_string();
        // Not empty, and (the root and runs/) holding other jobs' outputs: either is said.
        assert!(
            msg.starts_with("output:")
                && (msg.contains("not empty") || msg.contains("output folder of job")),
            "{msg}"
        );
    }
    // Inside another job's output: its download would hold this job's files.
    let r = export_into("runs/trained/adapter/x");
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(
        r.text().contains("lies inside the output folder of job"),
        "{}",
        r.text()
    );
    let r = export_into("exports/empty");
    assert_eq!(r.status, 201, "{}", r.text());
    server
        .events(r.json()["id"].as_i64().unwrap())
        .until("done");

    // An export written into a queued job's folder while it waits is not the job's to delete:
    // the job fails naming it, and the file is left as it was.
    let mut long = tiny_job(100_000);
    long["output"] = json!("runs/long");
    let long_id = server.submit(&long);
    let r = export_into("exports/waited");
    assert_eq!(r.status, 201, "{}", r.text());
    let waiting = r.json()["id"].as_i64().unwrap();
    server.events(long_id).until("step");
    assert_eq!(server.job(waiting)["state"], "queued");
    let foreign = ws.root.join("exports/waited/check.json");
    std::fs::create_dir_all(foreign.parent().unwrap()).unwrap();
    std::fs::write(&foreign, b"{\"someone\": \"else\"}").unwrap();
    let r = server.post(&format!("/jobs/{long_id}/cancel"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let events = server.events(waiting).until("failed");
    let reason = events.last().unwrap().data["reason"].as_str().unwrap();
    assert!(
        reason.contains("now holds an export (check.json)") && reason.contains("exports/waited"),
        "{reason}"
    );
    assert_eq!(
        std::fs::read(&foreign).unwrap(),
        b"{\"someone\": \"else\"}",
        "the file written while the job waited is untouched"
    );
}

/// A line of /proc/PID/status in KiB (`VmRSS`, `VmHWM`).
fn resident_kib(pid: u32, field: &str) -> i64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

#[test]
fn bad_eval_and_export_jobs_are_refused_naming_the_field() {
    let ws = Workspace::new("badjobs");
    std::fs::create_dir_all(ws.root.join("some-adapter")).unwrap();
    std::os::unix::fs::symlink(&ws.dir, ws.root.join("up")).unwrap();
    std::fs::write(ws.dir.join("outside.jsonl"), pairs_jsonl(2, 5)).unwrap();
    let server = Server::start(&ws, &[]);
    let eval = |extra: Value| {
        let mut body = json!({"kind": "eval", "model": "model", "data": "valid.jsonl"});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let export = |extra: Value| {
        let mut body = json!({"kind": "export", "model": "model", "adapter": "some-adapter"});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    let bad: Vec<(Value, &str)> = vec![
        (json!({"kind": "evaluate", "data": "valid.jsonl"}), "kind"),
        (json!({"kind": 3}), "kind"),
        (eval(json!({"scorer": "bleu"})), "scorer"),
        (eval(json!({"limit": -1})), "limit"),
        (eval(json!({"max_new": "many"})), "max_new"),
        (eval(json!({"lerning_rate": 1e-4})), "lerning_rate"),
        (eval(json!({"compare": ["base"]})), "compare"),
        (eval(json!({"compare": "base"})), "compare"),
        (
            eval(json!({"compare": ["base", "some-adapter"], "adapter": "some-adapter"})),
            "adapter",
        ),
        (eval(json!({"method": "ppo"})), "method"),
        (eval(json!({"method": "sft"})), "method"),
        (eval(json!({"device": "tpu"})), "device"),
        (eval(json!({"data": null})), "data"),
        (eval(json!({"data": "missing.jsonl"})), "data"),
        (export(json!({"adapter": null})), "adapter"),
        (export(json!({"model": null})), "model"),
        (export(json!({"format": "zip"})), "format"),
        (export(json!({"format": "merged-gguf"})), "format"),
        (export(json!({"check": "yes"})), "check"),
        (export(json!({"dtype": "f8"})), "dtype"),
        (export(json!({"quantize": true})), "quantize"),
    ];
    assert_all_refused(&server, bad.iter().map(|(b, f)| (b, *f)), 400);
    let outside = ws.dir.join("outside.jsonl").display().to_string();
    let forbidden: Vec<(Value, &str)> = vec![
        (export(json!({"output": "/tmp/lorafit-escape"})), "output"),
        (export(json!({"output": "up/export"})), "output"),
        (export(json!({"output": "exports/../../x"})), "output"),
        (export(json!({"adapter": "up"})), "adapter"),
        (export(json!({"model": "/"})), "model"),
        (eval(json!({"output": "/tmp/lorafit-escape"})), "output"),
        (eval(json!({"data": outside})), "data"),
        (eval(json!({"compare": ["base", "up"]})), "compare"),
        (eval(json!({"config": "up/jobs.sqlite"})), "config"),
    ];
    assert_all_refused(&server, forbidden.iter().map(|(b, f)| (b, *f)), 403);
    assert!(server.get("/jobs").json()["jobs"]
        .as_array()
        .unwrap()
        .is_empty());
}

/// Paths are checked again when a job starts, not only when it is submitted: a symbolic link
/// made while the job waited cannot lead its output out of the roots. An output folder holding
/// the job's own inputs, or an eval's earlier results, is a 409; a result deleted from the disk
/// since is a 410.
#[test]
fn outputs_are_confined_when_the_job_runs_and_never_hold_its_inputs() {
    let ws = Workspace::new("confined");
    let server = Server::start(&ws, &[]);
    let outside = ws.dir.join("outside");
    std::fs::create_dir_all(&outside).unwrap();

    let mut long = tiny_job(100_000);
    long["output"] = json!("runs/long");
    let long_id = server.submit(&long);
    let mut later = tiny_job(2);
    later["output"] = json!("later/out");
    let later_id = server.submit(&later);
    server.events(long_id).until("step");
    std::os::unix::fs::symlink(&outside, ws.root.join("later")).unwrap();
    let r = server.post(&format!("/jobs/{long_id}/cancel"), &json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let events = server.events(later_id).until("failed");
    let reason = events.last().unwrap().data["reason"].as_str().unwrap();
    assert!(
        reason.contains("refused to run") && reason.contains("output"),
        "{reason}"
    );
    assert_eq!(
        std::fs::read_dir(&outside).unwrap().count(),
        0,
        "nothing is written through the link"
    );

    // The base model's folder as a train job's output; an eval's earlier results.
    let mut into_model = tiny_job(1);
    into_model["output"] = json!("model");
    let r = server.post("/jobs", &into_model);
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.text().contains("the job's model"), "{}", r.text());
    std::fs::create_dir_all(ws.root.join("notes")).unwrap();
    std::fs::write(ws.root.join("notes/report.md"), "mine").unwrap();
    let r = server.post(
        "/jobs",
        &json!({"kind": "eval", "model": "model", "data": "valid.jsonl", "output": "notes"}),
    );
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.text().contains("report.md"), "{}", r.text());
    assert_eq!(
        std::fs::read_to_string(ws.root.join("notes/report.md")).unwrap(),
        "mine"
    );

    // A finished job's adapter deleted from the disk.
    let mut done = tiny_job(1);
    done["output"] = json!("runs/done");
    let done_id = server.submit(&done);
    server.events(done_id).until("done");
    std::fs::remove_dir_all(ws.root.join("runs/done/adapter")).unwrap();
    let r = server.get(&format!("/jobs/{done_id}/adapter"));
    assert_eq!(r.status, 410, "{}", r.text());
    assert!(r.text().contains("no longer on the disk"), "{}", r.text());
}
