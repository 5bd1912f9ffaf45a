//! The job runner's web page in headless Chromium (Debian's `chromium`), driven through the
//! DevTools protocol over `--remote-debugging-pipe` (two FIFOs, NUL-separated JSON), so that no
//! WebSocket client is needed: the page loads from a real `lorafit serve`, a job is submitted
//! through its form, the job appears in the list, its chart fills step by step from the event
//! stream and is drawn, and a screenshot is written to `$CARGO_TARGET_TMPDIR/serve_page.png`.
//!
//! Without chromium the test prints `SKIPPED …` and passes, unless LORAFIT_REQUIRE_CHROMIUM=1
//! (CI installs chromium and sets it).

mod serve_support;
#[path = "common/skip.rs"]
mod skip;

use serde_json::{json, Value};
use serve_support::*;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn find_chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    for dir in std::env::split_paths(&path) {
        for name in ["chromium", "chromium-browser"] {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p);
            }
        }
    }
    None
}

fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a' + 26) as u32,
            b'0'..=b'9' => (c - b'0' + 52) as u32,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c}"),
        }
    };
    let bytes: Vec<u8> = text
        .bytes()
        .filter(|&c| c != b'=' && !c.is_ascii_whitespace())
        .collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= value(c) << (18 - 6 * i);
        }
        let n = chunk.len() * 6 / 8;
        out.extend_from_slice(&acc.to_be_bytes()[1..1 + n]);
    }
    out
}

/// A headless Chromium and its DevTools pipe.
struct Browser {
    child: Child,
    to_browser: std::fs::File,
    from_browser: mpsc::Receiver<Value>,
    next_id: u64,
    session: Option<String>,
}

impl Browser {
    fn start(chromium: &Path, dir: &Path) -> Browser {
        let (to, from) = (dir.join("cdp-in"), dir.join("cdp-out"));
        for f in [&to, &from] {
            let _ = std::fs::remove_file(f);
            let ok = Command::new("mkfifo").arg(f).status().unwrap().success();
            assert!(ok, "mkfifo {}", f.display());
        }
        // fd 3: what the browser reads; fd 4: what it writes.
        let script = format!(
            "exec '{}' --headless=new --no-sandbox --disable-gpu --no-first-run \
             --disable-dev-shm-usage --hide-scrollbars --user-data-dir='{}' \
             --remote-debugging-pipe about:blank 3<'{}' 4>'{}'",
            chromium.display(),
            dir.join("chromium-profile").display(),
            to.display(),
            from.display()
        );
        let child = Command::new("sh")
            .args(["-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.join("chromium.log")).unwrap(),
            ))
            .spawn()
            .unwrap();
        let to_browser = std::fs::OpenOptions::new().write(true).open(&to).unwrap();
        let mut reader = std::fs::File::open(&from).unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut pending = Vec::new();
            let mut buf = [0u8; 65536];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                pending.extend_from_slice(&buf[..n]);
                while let Some(end) = pending.iter().position(|&b| b == 0) {
                    let msg: Vec<u8> = pending.drain(..=end).collect();
                    if let Ok(v) = serde_json::from_slice::<Value>(&msg[..msg.len() - 1]) {
                        if tx.send(v).is_err() {
                            return;
                        }
                    }
                }
            }
        });
        Browser {
            child,
            to_browser,
            from_browser: rx,
            next_id: 1,
            session: None,
        }
    }

    fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = json!({"id": id, "method": method, "params": params});
        if let Some(s) = &self.session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = msg.to_string().into_bytes();
        bytes.push(0);
        self.to_browser.write_all(&bytes).unwrap();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let v = self
                .from_browser
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no answer from chromium to {method}"));
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method}: {}", v["error"]);
                return v["result"].clone();
            }
        }
    }

    /// Evaluates `expr` in the page (promises awaited) and returns its value.
    fn eval(&mut self, expr: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
        );
        assert!(
            r.get("exceptionDetails").is_none(),
            "{expr}: {}",
            r["exceptionDetails"]
        );
        r["result"]["value"].clone()
    }

    fn wait_until(&mut self, what: &str, secs: u64, expr: &str) -> Value {
        let t0 = Instant::now();
        loop {
            let v = self.eval(expr);
            if v.as_bool() == Some(true) {
                return v;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(secs),
                "the page never showed {what}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn page_submits_a_job_and_charts_it_live() {
    let Some(chromium) = find_chromium() else {
        assert!(
            std::env::var("LORAFIT_REQUIRE_CHROMIUM").as_deref() != Ok("1"),
            "LORAFIT_REQUIRE_CHROMIUM=1 but no chromium on PATH"
        );
        skip::skip_note(
            "page_submits_a_job_and_charts_it_live",
            "no chromium on PATH (apt-get install chromium)",
        );
        return;
    };
    let ws = Workspace::new("page");
    let server = Server::start(&ws, &[]);
    let mut b = Browser::start(&chromium, &ws.dir);
    let target = b.call("Target.createTarget", json!({"url": "about:blank"}));
    let session = b.call(
        "Target.attachToTarget",
        json!({"targetId": target["targetId"], "flatten": true}),
    );
    b.session = Some(session["sessionId"].as_str().unwrap().to_string());
    b.call(
        "Emulation.setDeviceMetricsOverride",
        json!({"width": 1400, "height": 900, "deviceScaleFactor": 1, "mobile": false}),
    );
    b.call("Page.enable", json!({}));
    b.call(
        "Page.navigate",
        json!({"url": format!("http://127.0.0.1:{}/", server.port)}),
    );
    b.wait_until(
        "the form",
        30,
        "document.readyState === 'complete' && !!document.getElementById('submit-form')",
    );

    // Long enough that the page is open and following the job while it runs (at 300 steps a
    // fast machine finished the job before the page's first sample, and the chart was seen
    // only whole; at 2000 steps of one example each, once too): 2000 steps of 8 examples.
    let steps = 2000;
    let fill = format!(
        r#"(() => {{
            const set = (id, v) => {{ const e = document.getElementById(id); e.value = v;
                e.dispatchEvent(new Event('input', {{bubbles: true}})); }};
            set('f-model', 'model'); set('f-data', 'train.jsonl'); set('f-valid', 'valid.jsonl');
            set('f-method', 'orpo'); set('f-steps', '{steps}'); set('f-lr', '0.001');
            set('f-rank', '4');
            set('f-extra', '{{"max_seq_len": 64, "max_prompt_len": 32, "eval_every": 100, "save_every": 0, "seed": 3, "grad_accum": 8}}');
            document.getElementById('submit-button').click();
            return true;
        }})()"#
    );
    b.eval(&fill);
    b.wait_until(
        "the submitted job in the list",
        30,
        "!!document.querySelector('#jobs tr.job[data-id=\"1\"]')",
    );
    // The chart fills as step events arrive: sample its point count until the run is done.
    let t0 = Instant::now();
    let mut seen = Vec::new();
    loop {
        let n = b
            .eval("Number(document.getElementById('chart').dataset.points)")
            .as_i64()
            .unwrap();
        if seen.last() != Some(&n) {
            seen.push(n);
        }
        if n == steps {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "chart points so far: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(40));
    }
    let nonzero: Vec<i64> = seen.iter().copied().filter(|&n| n > 0).collect();
    assert!(nonzero.len() >= 2, "the chart grew in steps: {seen:?}");
    assert!(nonzero.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    b.wait_until(
        "the job as done in the list",
        30,
        "document.querySelector('#jobs tr.job[data-id=\"1\"]').dataset.state === 'done'",
    );
    assert_eq!(
        b.eval("Number(document.getElementById('chart').dataset.validPoints)"),
        json!(steps / 100 + 1)
    );
    // The chart is drawn: count pixels of the loss line's colour (#0a6bd1).
    let loss_pixels = b.eval(
        "(() => { const c = document.getElementById('chart');
                  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                  let n = 0;
                  for (let i = 0; i < d.length; i += 4)
                    if (Math.abs(d[i] - 10) < 40 && Math.abs(d[i+1] - 107) < 40 && Math.abs(d[i+2] - 209) < 40) n++;
                  return n; })()",
    );
    assert!(
        loss_pixels.as_i64().unwrap() > 100,
        "loss line pixels: {loss_pixels}"
    );
    let log = b.eval("document.getElementById('log').textContent");
    assert!(
        log.as_str()
            .unwrap()
            .contains(&format!("done: {steps} steps")),
        "{log}"
    );
    assert_eq!(
        b.eval("document.getElementById('resume-button').disabled"),
        json!(true)
    );

    // What the page submitted is what the server ran.
    let job = server.job(1);
    assert_eq!(job["state"], "done");
    assert_eq!(job["config"]["rank"], 4);
    assert_eq!(job["config"]["eval_every"], 100);
    assert!(job["config"]["data"]
        .as_str()
        .unwrap()
        .ends_with("/train.jsonl"));

    let shot = b.call("Page.captureScreenshot", json!({"format": "png"}));
    let png = base64_decode(shot["data"].as_str().unwrap());
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("serve_page.png");
    std::fs::write(&path, &png).unwrap();
    eprintln!("screenshot: {}", path.display());
    b.session = None;
    b.call("Browser.close", json!({}));
}
