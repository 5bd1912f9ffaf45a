// The job runner page's script: lists jobs (train, eval, export), submits the form as a
// TrainConfig, and follows the selected job's server-sent events (read with fetch, so that the bearer token can go in a
// header) into a chart of loss, margin and accuracy and a log tail.
"use strict";

const $ = (id) => document.getElementById(id);
const LOG_LINES = 200;
let selected = null; // { id, kind, abort, train: Map(step -> row), valid: Map, log: [], state, lastSeq }
const kinds = new Map(); // job id -> "train" | "eval" | "export"
// What a done job's download is, by kind: the link's text and the file's name.
const RESULTS = {
  train: { text: "adapter (.tar)", path: "/adapter", file: (id) => "job-" + id + "-adapter.tar" },
  eval: { text: "scores (.json)", path: "/result", file: (id) => "job-" + id + "-eval.json" },
  export: { text: "export (.tar)", path: "/result", file: (id) => "job-" + id + "-export.tar" },
};

$("token").value = localStorage.getItem("lorafit-token") || "";
$("token").addEventListener("change", () => {
  localStorage.setItem("lorafit-token", $("token").value.trim());
  refreshJobs();
});

function headers(json) {
  const h = {};
  const token = $("token").value.trim();
  if (token) h["Authorization"] = "Bearer " + token;
  if (json) h["Content-Type"] = "application/json";
  return h;
}

async function api(method, path, body) {
  const changing = method !== "GET";
  const r = await fetch(path, {
    method,
    headers: headers(changing),
    body: changing ? JSON.stringify(body || {}) : undefined,
  });
  const text = await r.text();
  let data = null;
  try { data = JSON.parse(text); } catch (_) { data = { error: text }; }
  if (!r.ok) throw new Error((data && data.error) || r.status + " " + r.statusText);
  return data;
}

// ----- job list ------------------------------------------------------------------------------

function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
}

async function refreshJobs() {
  let data;
  try {
    data = await api("GET", "/jobs");
    $("server-note").textContent = "";
  } catch (e) {
    $("server-note").textContent = e.message;
    return;
  }
  const body = $("jobs");
  body.textContent = "";
  for (const job of data.jobs.slice().reverse()) {
    const tr = document.createElement("tr");
    tr.className = "job" + (selected && selected.id === job.id ? " selected" : "");
    tr.dataset.id = job.id;
    tr.dataset.state = job.state;
    tr.dataset.kind = job.kind || "train";
    kinds.set(job.id, job.kind || "train");
    cell(tr, job.id);
    cell(tr, job.kind || "train");
    cell(tr, job.state, "state-" + job.state);
    cell(tr, job.step + (job.total_steps ? " / " + job.total_steps : ""));
    cell(tr, job.method || job.scorer || "");
    cell(tr, String(job.model || "").split("/").pop());
    tr.title = job.message || "";
    tr.addEventListener("click", () => select(job.id));
    body.appendChild(tr);
  }
}

// ----- submit --------------------------------------------------------------------------------

$("submit-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  $("form-error").textContent = "";
  const f = ev.target.elements;
  const cfg = { model: f.model.value.trim(), data: f.data.value.trim(), method: f.method.value };
  for (const [name, key] of [["valid", "valid"], ["output", "output"], ["device", "device"]]) {
    if (f[name].value.trim()) cfg[key] = f[name].value.trim();
  }
  for (const name of ["steps", "rank", "grad_accum"]) {
    if (f[name].value !== "") cfg[name] = Number(f[name].value);
  }
  if (f.lr.value.trim()) cfg.lr = Number(f.lr.value);
  if (f.extra.value.trim()) {
    try {
      Object.assign(cfg, JSON.parse(f.extra.value));
    } catch (e) {
      $("form-error").textContent = "more settings: not JSON (" + e.message + ")";
      return;
    }
  }
  try {
    const job = await api("POST", "/jobs", cfg);
    await refreshJobs();
    select(job.id);
  } catch (e) {
    $("form-error").textContent = e.message;
  }
});

// ----- one job: events, chart, log -----------------------------------------------------------

function setButtons(state) {
  $("cancel-button").disabled = !(state === "queued" || state === "running");
  $("resume-button").disabled = !(state === "cancelled" || state === "failed");
  const kind = (selected && selected.kind) || "train";
  const link = $("adapter-link");
  link.textContent = RESULTS[kind].text;
  link.hidden = state !== "done";
  $("report-link").hidden = !(state === "done" && kind === "eval");
}

function select(id) {
  if (selected && selected.abort) selected.abort.abort();
  const kind = kinds.get(id) || "train";
  selected = { id, kind, abort: null, train: new Map(), valid: new Map(), log: [], state: "", lastSeq: 0 };
  $("detail-title").textContent = (kind === "train" ? "Job " : kind + " job ") + id;
  $("detail-status").textContent = "";
  $("log").textContent = "";
  $("adapter-link").href = "#";
  setButtons("");
  for (const tr of document.querySelectorAll("tr.job")) {
    tr.classList.toggle("selected", Number(tr.dataset.id) === id);
  }
  draw();
  follow(selected);
}

async function follow(job) {
  const abort = new AbortController();
  job.abort = abort;
  const h = headers(false);
  if (job.lastSeq) h["Last-Event-ID"] = String(job.lastSeq);
  try {
    const r = await fetch("/jobs/" + job.id + "/events", { headers: h, signal: abort.signal });
    if (!r.ok) {
      $("detail-status").textContent = (await r.text()) || r.statusText;
      return;
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        handleBlock(job, buf.slice(0, cut));
        buf = buf.slice(cut + 2);
      }
    }
  } catch (e) {
    if (abort.signal.aborted) return;
  }
  // The stream ends when the job is over; otherwise (a dropped connection) follow again.
  if (selected === job && !["done", "failed", "cancelled"].includes(job.state)) {
    setTimeout(() => { if (selected === job) follow(job); }, 1000);
  }
}

function handleBlock(job, block) {
  let kind = "message", data = "", id = null;
  for (const line of block.split("\n")) {
    if (line.startsWith("event:")) kind = line.slice(6).trim();
    else if (line.startsWith("data:")) data += line.slice(5).replace(/^ /, "");
    else if (line.startsWith("id:")) id = Number(line.slice(3).trim());
  }
  if (!data) return;
  if (id) job.lastSeq = id;
  let d;
  try { d = JSON.parse(data); } catch (_) { return; }
  if (selected !== job) return;
  if (kind === "progress") {
    $("detail-status").textContent = d.message || "";
  } else if (kind === "step") {
    job.train.set(d.step, d);
    $("detail-status").textContent = "step " + d.step + " / " + d.total_steps +
      " · loss " + (d.loss == null ? "–" : d.loss.toFixed(4));
  } else if (kind === "valid") {
    job.valid.set(d.step, d);
  } else if (kind === "state") {
    job.state = d.state;
    setButtons(d.state);
    $("detail-status").textContent = d.message || d.state;
  } else if (kind === "done" || kind === "failed" || kind === "cancelled") {
    job.state = kind;
    setButtons(kind);
    if (kind === "done") {
      $("adapter-link").href = "/jobs/" + job.id + RESULTS[job.kind || "train"].path;
      $("report-link").href = "/jobs/" + job.id + "/result?format=markdown";
    }
    $("detail-status").textContent = d.message || kind;
    refreshJobs();
  }
  if (d.message) {
    job.log.push(d.message);
    if (job.log.length > LOG_LINES) job.log.splice(0, job.log.length - LOG_LINES);
    const log = $("log");
    log.textContent = job.log.join("\n");
    log.scrollTop = log.scrollHeight;
  }
  scheduleDraw();
}

let drawPending = false;
function scheduleDraw() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => { drawPending = false; draw(); });
}

// Three panels side by side, each with its own y scale: loss, margin, accuracy. Training steps
// are lines; validation points are dots.
const PANELS = [
  { title: "loss", train: (r) => r.loss, valid: (r) => r.metrics && r.metrics.loss, color: "#0a6bd1" },
  { title: "margin", train: (r) => r.metrics && r.metrics.margin, valid: (r) => r.metrics && r.metrics.margin, color: "#8e44ad" },
  { title: "accuracy", train: (r) => r.metrics && r.metrics.accuracy, valid: (r) => r.metrics && r.metrics.accuracy, color: "#1e8a3a" },
];

function draw() {
  const canvas = $("chart");
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 900, h = canvas.clientHeight || 330;
  canvas.width = w * ratio;
  canvas.height = h * ratio;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const job = selected;
  const train = job ? [...job.train.values()].sort((a, b) => a.step - b.step) : [];
  const valid = job ? [...job.valid.values()].sort((a, b) => a.step - b.step) : [];
  canvas.dataset.points = String(train.length);
  canvas.dataset.validPoints = String(valid.length);
  const maxStep = Math.max(1, ...train.map((r) => r.total_steps || r.step), ...valid.map((r) => r.step));
  const pw = w / PANELS.length;
  ctx.font = "12px system-ui, sans-serif";
  PANELS.forEach((p, i) => {
    const x0 = i * pw + 44, x1 = (i + 1) * pw - 10, y0 = 24, y1 = h - 26;
    const pts = train.map((r) => [r.step, p.train(r)]).filter((q) => Number.isFinite(q[1]));
    const vpts = valid.map((r) => [r.step, p.valid(r)]).filter((q) => Number.isFinite(q[1]));
    const ys = pts.concat(vpts).map((q) => q[1]);
    let lo = ys.length ? Math.min(...ys) : 0, hi = ys.length ? Math.max(...ys) : 1;
    if (hi - lo < 1e-9) { lo -= 0.5; hi += 0.5; }
    const pad = (hi - lo) * 0.08; lo -= pad; hi += pad;
    const X = (s) => x0 + (x1 - x0) * (s / maxStep);
    const Y = (v) => y1 - (y1 - y0) * ((v - lo) / (hi - lo));
    ctx.strokeStyle = "#c9d1d9"; ctx.lineWidth = 1;
    ctx.strokeRect(x0, y0, x1 - x0, y1 - y0);
    ctx.fillStyle = "#1d232b";
    ctx.fillText(p.title + (pts.length ? "  " + pts[pts.length - 1][1].toFixed(4) : ""), x0, y0 - 8);
    ctx.fillStyle = "#6b7c8d";
    ctx.fillText(hi.toPrecision(3), x0 - 42, y0 + 10);
    ctx.fillText(lo.toPrecision(3), x0 - 42, y1);
    ctx.fillText("0", x0, y1 + 15);
    ctx.fillText(String(maxStep), x1 - 24, y1 + 15);
    if (pts.length) {
      // Each step is one batch (accuracy of one pair is 0 or 1): the raw values are drawn
      // faint, their running mean over a window of about a 30th of the run solid.
      const line = (series, alpha, width) => {
        ctx.globalAlpha = alpha; ctx.strokeStyle = p.color; ctx.lineWidth = width;
        ctx.beginPath();
        series.forEach(([s, v], k) => (k ? ctx.lineTo(X(s), Y(v)) : ctx.moveTo(X(s), Y(v))));
        ctx.stroke();
        ctx.globalAlpha = 1;
      };
      const win = Math.max(1, Math.round(maxStep / 30));
      let sum = 0;
      const mean = pts.map(([s, v], k) => {
        sum += v;
        if (k >= win) sum -= pts[k - win][1];
        return [s, sum / Math.min(k + 1, win)];
      });
      line(pts, win > 1 ? 0.3 : 1, 1);
      if (win > 1) line(mean, 1, 2);
    }
    ctx.fillStyle = "#e67e22";
    for (const [s, v] of vpts) {
      ctx.beginPath(); ctx.arc(X(s), Y(v), 3.5, 0, 2 * Math.PI); ctx.fill();
    }
  });
}

$("cancel-button").addEventListener("click", async () => {
  if (!selected) return;
  try { await api("POST", "/jobs/" + selected.id + "/cancel"); } catch (e) { $("detail-status").textContent = e.message; }
  refreshJobs();
});

$("resume-button").addEventListener("click", async () => {
  if (!selected) return;
  const id = selected.id;
  try { await api("POST", "/jobs/" + id + "/resume"); } catch (e) { $("detail-status").textContent = e.message; return; }
  await refreshJobs();
  select(id);
});

// A download carries the token as a header, so it goes through fetch and a blob.
async function downloadResult(path, name) {
  const r = await fetch(path, { headers: headers(false) });
  if (!r.ok) { $("detail-status").textContent = await r.text(); return; }
  const url = URL.createObjectURL(await r.blob());
  const a = document.createElement("a");
  a.href = url; a.download = name;
  a.click();
  URL.revokeObjectURL(url);
}

$("adapter-link").addEventListener("click", async (ev) => {
  ev.preventDefault();
  if (!selected) return;
  const res = RESULTS[selected.kind || "train"];
  await downloadResult("/jobs/" + selected.id + res.path, res.file(selected.id));
});

$("report-link").addEventListener("click", async (ev) => {
  ev.preventDefault();
  if (!selected) return;
  await downloadResult("/jobs/" + selected.id + "/result?format=markdown", "job-" + selected.id + "-report.md");
});

refreshJobs();
setInterval(refreshJobs, 2000);
draw();
