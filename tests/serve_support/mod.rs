//! What the `lorafit serve` tests share: a workspace with a tiny model (the qwen2 fixture plus a
//! word-level tokenizer) and preference data, a server started as a child process on an
//! ephemeral loopback port, and a small HTTP/1.1 client (plain requests and a server-sent-event
//! reader) over std's TcpStream, so that the tests need no HTTP client crate.
#![allow(dead_code)]

use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A fresh folder for one test: `root/` (the server's root, holding `model/`, `train.jsonl`,
/// `valid.jsonl`) and the database beside it.
pub struct Workspace {
    pub dir: PathBuf,
    pub root: PathBuf,
}

const VOCAB: usize = 256;

fn lcg(state: &mut u64) -> u64 {
    *state = state
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *state >> 33
}

/// Text preference rows over the words `w0 … w255`: chosen words from the lowest quarter of
/// the vocabulary, rejected ones from the upper half (a learnable preference).
pub fn pairs_jsonl(n: usize, seed: u64) -> String {
    let mut s = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let words = |count: usize, lo: u64, hi: u64, s: &mut u64| -> String {
        (0..count)
            .map(|_| format!("w{}", lo + lcg(s) % (hi - lo)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut out = String::new();
    for _ in 0..n {
        let np = 6 + (lcg(&mut s) % 6) as usize;
        let nc = 3 + (lcg(&mut s) % 5) as usize;
        let nr = 3 + (lcg(&mut s) % 5) as usize;
        let row = json!({
            "prompt": words(np, 2, VOCAB as u64, &mut s),
            "chosen": words(nc, 2, VOCAB as u64 / 4, &mut s),
            "rejected": words(nr, VOCAB as u64 / 2, VOCAB as u64, &mut s),
        });
        out.push_str(&row.to_string());
        out.push('\n');
    }
    out
}

impl Workspace {
    pub fn new(name: &str) -> Workspace {
        let dir = std::env::temp_dir().join(format!("lorafit-serve-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let root = dir.join("root");
        let model = root.join("model");
        std::fs::create_dir_all(&model).unwrap();
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/qwen2");
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture.join(f), model.join(f)).unwrap();
        }
        let vocab: serde_json::Map<String, Value> = (0..VOCAB)
            .map(|i| (format!("w{i}"), Value::from(i as u64)))
            .collect();
        let tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "w0"}
        });
        std::fs::write(model.join("tokenizer.json"), tokenizer.to_string()).unwrap();
        std::fs::write(
            model.join("tokenizer_config.json"),
            r#"{"eos_token": "w1"}"#,
        )
        .unwrap();
        std::fs::write(root.join("train.jsonl"), pairs_jsonl(24, 1)).unwrap();
        std::fs::write(root.join("valid.jsonl"), pairs_jsonl(6, 2)).unwrap();
        Workspace { dir, root }
    }

    pub fn db(&self) -> PathBuf {
        self.dir.join("jobs.sqlite")
    }
}

/// A job config for the tiny model: `steps` ORPO steps on the workspace's data.
pub fn tiny_job(steps: usize) -> Value {
    json!({
        "model": "model", "data": "train.jsonl", "valid": "valid.jsonl", "method": "orpo",
        "steps": steps, "rank": 4, "lr": 1e-3, "max_seq_len": 64, "max_prompt_len": 32,
        "eval_every": 0, "save_every": 0, "seed": 3, "warmup_ratio": 0.0
    })
}

/// `lorafit serve` as a child process; killed (SIGKILL) when dropped.
pub struct Server {
    pub child: Child,
    pub port: u16,
    pub token: Option<String>,
}

impl Server {
    pub fn start(ws: &Workspace, extra: &[&str]) -> Server {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(ws.dir.join("server.log"))
            .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_lorafit"))
            .args(["serve", "--listen", "127.0.0.1:0", "--db"])
            .arg(ws.db())
            .arg("--root")
            .arg(&ws.root)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("starting lorafit serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port = line
            .trim()
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| {
                let _ = child.kill();
                panic!(
                    "no `listening on` line from the server (got {line:?}); log:\n{}",
                    std::fs::read_to_string(ws.dir.join("server.log")).unwrap_or_default()
                )
            });
        Server {
            child,
            port,
            token: None,
        }
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn auth(&self) -> Vec<(String, String)> {
        match &self.token {
            Some(t) => vec![("Authorization".into(), format!("Bearer {t}"))],
            None => vec![],
        }
    }

    pub fn get(&self, path: &str) -> Response {
        request(self.port, "GET", path, &self.auth(), None)
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        let mut h = self.auth();
        h.push(("Content-Type".into(), "application/json".into()));
        request(
            self.port,
            "POST",
            path,
            &h,
            Some(body.to_string().as_bytes()),
        )
    }

    pub fn delete(&self, path: &str) -> Response {
        let mut h = self.auth();
        h.push(("Content-Type".into(), "application/json".into()));
        request(self.port, "DELETE", path, &h, None)
    }

    /// Submits a job; panics unless it is accepted. Returns its id.
    pub fn submit(&self, cfg: &Value) -> i64 {
        let r = self.post("/jobs", cfg);
        assert_eq!(r.status, 201, "submit: {}", r.text());
        r.json()["id"].as_i64().unwrap()
    }

    pub fn job(&self, id: i64) -> Value {
        let r = self.get(&format!("/jobs/{id}"));
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    }

    pub fn events(&self, id: i64) -> EventReader {
        EventReader::open(self.port, &format!("/jobs/{id}/events"), &self.auth())
    }

    /// Polls the job until `pred` holds (or panics after `secs`).
    pub fn wait_for(&self, id: i64, secs: u64, pred: impl Fn(&Value) -> bool) -> Value {
        let t0 = Instant::now();
        loop {
            let j = self.job(id);
            if pred(&j) {
                return j;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(secs),
                "job {id} did not get there in {secs}s: {j}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

fn send_head(
    stream: &mut TcpStream,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: Option<&[u8]>,
) {
    let mut head =
        format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!("Content-Length: {}\r\n", b.len()));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    if let Some(b) = body {
        // A server may answer (413) and close before reading a large body; that is not an error.
        let _ = stream.write_all(b);
    }
}

fn read_head(reader: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut status_line = String::new();
    reader.read_line(&mut status_line).unwrap();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {status_line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((k, v)) = line.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    (status, headers)
}

fn is_chunked(headers: &[(String, String)]) -> bool {
    headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    })
}

/// One request on its own connection (`Connection: close`).
pub fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(String, String)],
    body: Option<&[u8]>,
) -> Response {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    send_head(&mut stream, port, method, path, headers, body);
    let mut reader = BufReader::new(stream);
    let (status, headers) = read_head(&mut reader);
    let mut raw = Vec::new();
    let _ = reader.read_to_end(&mut raw);
    let body = if is_chunked(&headers) {
        dechunk(&raw)
    } else {
        raw
    };
    Response {
        status,
        headers,
        body,
    }
}

fn dechunk(mut raw: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let Some(eol) = raw.windows(2).position(|w| w == b"\r\n") else {
            return out;
        };
        let size_text = String::from_utf8_lossy(&raw[..eol]);
        let size =
            usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap_or(0);
        raw = &raw[eol + 2..];
        if size == 0 || raw.len() < size {
            return out;
        }
        out.extend_from_slice(&raw[..size]);
        raw = &raw[(size + 2).min(raw.len())..];
    }
}

/// One server-sent event.
#[derive(Debug, Clone)]
pub struct Sse {
    pub id: i64,
    pub kind: String,
    pub data: Value,
}

/// Reads a `text/event-stream` response event by event.
pub struct EventReader {
    reader: BufReader<TcpStream>,
    chunked: bool,
    pending: String,
    ended: bool,
}

impl EventReader {
    pub fn open(port: u16, path: &str, headers: &[(String, String)]) -> EventReader {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(120)))
            .unwrap();
        send_head(&mut stream, port, "GET", path, headers, None);
        let mut reader = BufReader::new(stream);
        let (status, headers) = read_head(&mut reader);
        assert_eq!(status, 200, "events of {path}");
        let ct = headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("content-type"))
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        assert!(ct.starts_with("text/event-stream"), "content type {ct}");
        EventReader {
            chunked: is_chunked(&headers),
            reader,
            pending: String::new(),
            ended: false,
        }
    }

    fn fill(&mut self) -> bool {
        if self.ended {
            return false;
        }
        if self.chunked {
            let mut line = String::new();
            if self.reader.read_line(&mut line).unwrap_or(0) == 0 {
                self.ended = true;
                return false;
            }
            let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or("0"), 16)
                .unwrap_or(0);
            if size == 0 {
                self.ended = true;
                return false;
            }
            let mut buf = vec![0u8; size + 2];
            if self.reader.read_exact(&mut buf).is_err() {
                self.ended = true;
                return false;
            }
            self.pending
                .push_str(&String::from_utf8_lossy(&buf[..size]));
        } else {
            let mut buf = [0u8; 4096];
            match self.reader.read(&mut buf) {
                Ok(0) | Err(_) => {
                    self.ended = true;
                    return false;
                }
                Ok(n) => self.pending.push_str(&String::from_utf8_lossy(&buf[..n])),
            }
        }
        true
    }

    /// The next event with data (keep-alive comments are skipped); None when the stream ends.
    pub fn next_event(&mut self) -> Option<Sse> {
        loop {
            while let Some(cut) = self.pending.find("\n\n") {
                let block: String = self.pending[..cut].to_string();
                self.pending.drain(..cut + 2);
                let (mut id, mut kind, mut data) = (0, String::from("message"), String::new());
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("id:") {
                        id = v.trim().parse().unwrap_or(0);
                    } else if let Some(v) = line.strip_prefix("event:") {
                        kind = v.trim().to_string();
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push_str(v.strip_prefix(' ').unwrap_or(v));
                    }
                }
                if !data.is_empty() {
                    let data = serde_json::from_str(&data).unwrap_or(Value::String(data));
                    return Some(Sse { id, kind, data });
                }
            }
            if !self.fill() {
                return None;
            }
        }
    }

    /// Events up to and including the first of kind `kind` (panics if the stream ends first).
    pub fn until(&mut self, kind: &str) -> Vec<Sse> {
        let mut seen = Vec::new();
        while let Some(e) = self.next_event() {
            let stop = e.kind == kind;
            seen.push(e);
            if stop {
                return seen;
            }
        }
        panic!(
            "the stream ended before a `{kind}` event; saw {:?}",
            seen.iter().map(|e| (&e.kind, &e.data)).collect::<Vec<_>>()
        )
    }

    /// All remaining events until the stream ends.
    pub fn rest(&mut self) -> Vec<Sse> {
        let mut seen = Vec::new();
        while let Some(e) = self.next_event() {
            seen.push(e);
        }
        seen
    }
}
