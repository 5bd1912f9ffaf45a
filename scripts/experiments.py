#!/usr/bin/env python3
"""The training-science experiments (docs/experiments.md), run and rendered by one script.

Two preference tasks on SmolLM2-135M-Instruct (Q4_1 GGUF base): the demo's style task
(demo/, chosen in capitals) and a correctness task (data/facts/, written by
scripts/make_facts_data.py: chosen the right fact, rejected a wrong one). Every arm trains ORPO
with the demo's settings (120 steps, lr 2e-4, rank 16, 5% warm-up, cosine) and changes one
thing; validation every 10 steps gives the trajectories.

Arms: static λ ∈ {0.05, 0.1, 0.2, 0.5, 1.0}; the adaptive λ controller; and at λ 0.1, rsLoRA,
LoRA+ ratio 4 and 16, dropout 0.05 (λ 0.1 is their "off" arm: ratio 1, dropout 0, plain scale).
Headline arms (the λ sweep and adaptive) run 3 seeds, the others 2.

    python3 scripts/experiments.py run --lorafit target/release/lorafit --model smollm2 \\
        --device cuda --jobs 4 --out runs/experiments       # writes runs/experiments/*/metrics.jsonl
    python3 scripts/experiments.py render --runs runs/experiments   # docs/experiments.md + SVGs
    python3 scripts/experiments.py render --runs docs/experiments   # the same, from the committed
                                                                     # docs/experiments/valid-rows.jsonl
    python3 scripts/experiments.py all ...                 # both

`run` appends one line per finished run to RUNS/index.jsonl, so an interrupted sweep keeps what
it finished and a second `run` skips those. Standard library only (the plots are written as
SVG by hand).
"""

import argparse
import concurrent.futures as cf
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
TASKS = {
    "style": ("demo/train.jsonl", "demo/valid.jsonl"),
    "facts": ("data/facts/train.jsonl", "data/facts/valid.jsonl"),
}
BASE = ["lr=2e-4", "warmup_ratio=0.05", "rank=16", "max_seq_len=256", "max_prompt_len=128",
        "eval_every=10", "save_every=0"]
LAMBDAS = [0.05, 0.1, 0.2, 0.5, 1.0]
ARMS = {f"λ={x:g}": [f"orpo_lambda={x}"] for x in LAMBDAS}
ARMS["adaptive"] = ["orpo_lambda_schedule=adaptive"]
# The controller as first built: warm-up until lw plateaus, however long that takes.
ARMS["adaptive, no warm-up limit"] = ["orpo_lambda_schedule=adaptive", "orpo_lambda_warmup_max=1"]
ARMS["rsLoRA"] = ["orpo_lambda=0.1", "rslora=true"]
ARMS["LoRA+ 4"] = ["orpo_lambda=0.1", "lora_plus_ratio=4"]
ARMS["LoRA+ 16"] = ["orpo_lambda=0.1", "lora_plus_ratio=16"]
ARMS["dropout 0.05"] = ["orpo_lambda=0.1", "lora_dropout=0.05"]
HEADLINE = [f"λ={x:g}" for x in LAMBDAS] + ["adaptive", "adaptive, no warm-up limit"]
SEEDS_HEADLINE, SEEDS_OTHER = [1, 2, 3], [1, 2]


def slug(arm):
    return (arm.replace("λ=", "lambda").replace(" ", "-").replace("+", "plus")
            .replace(".", "p"))


def plan():
    for task in TASKS:
        for arm in ARMS:
            for seed in (SEEDS_HEADLINE if arm in HEADLINE else SEEDS_OTHER):
                yield task, arm, seed


def run_one(args, task, arm, seed):
    train, valid = TASKS[task]
    out = os.path.join(args.out, f"{task}-{slug(arm)}-s{seed}")
    cmd = [args.lorafit, "train", "--model", args.model, "--device", args.device,
           "--data", os.path.join(ROOT, train), "--valid", os.path.join(ROOT, valid),
           "--output", out, "--steps", str(args.steps), "--seed", str(seed), "--overwrite"]
    for s in BASE + ARMS[arm]:
        cmd += ["--set", s]
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    secs = time.time() - t0
    if p.returncode != 0:
        return {"task": task, "arm": arm, "seed": seed, "error": p.stderr[-2000:]}
    return {"task": task, "arm": arm, "seed": seed, "dir": os.path.basename(out),
            "seconds": round(secs, 1)}


def cmd_run(args):
    os.makedirs(args.out, exist_ok=True)
    index = os.path.join(args.out, "index.jsonl")
    done = set()
    if os.path.exists(index):
        for line in open(index):
            r = json.loads(line)
            if "error" not in r:
                done.add((r["task"], r["arm"], r["seed"]))
    todo = [p for p in plan() if p not in done and (not args.arms or p[1] in args.arms)]
    todo = todo[: args.limit]
    print(f"{len(todo)} runs to do ({len(done)} already done), {args.jobs} at a time", flush=True)
    with cf.ThreadPoolExecutor(args.jobs) as pool, open(index, "a") as fh:
        futures = [pool.submit(run_one, args, *p) for p in todo]
        for i, f in enumerate(cf.as_completed(futures)):
            r = f.result()
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
            fh.flush()
            status = "FAILED: " + r["error"].strip().splitlines()[-1] if "error" in r else \
                f"{r['seconds']} s"
            print(f"[{i + 1}/{len(todo)}] {r['task']} {r['arm']} seed {r['seed']}: {status}",
                  flush=True)


# ------------------------------------------------------------------------------------------
# render


def read_run(path):
    train, valid = [], []
    for line in open(os.path.join(path, "metrics.jsonl")):
        v = json.loads(line)
        (valid if v.get("split") == "valid" else train).append(v)
    return train, valid


def mean_sd(xs):
    if not xs:
        return float("nan"), float("nan")
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def fmt(xs, digits=3):
    if not xs:
        return "—"
    m, s = mean_sd(xs)
    return f"{m:.{digits}f} ± {s:.{digits}f}" if len(xs) > 1 else f"{m:.{digits}f}"


COMPACT = os.path.join(ROOT, "docs", "experiments", "valid-rows.jsonl")


def latest_runs(runs_dir):
    """The index's finished runs, the latest line of each (task, arm, seed) winning."""
    latest = {}
    for line in open(os.path.join(runs_dir, "index.jsonl")):
        r = json.loads(line)
        latest[(r["task"], r["arm"], r["seed"])] = r
    return list(latest.values())


def write_compact(runs_dir):
    """Every finished run's validation rows in one file (docs/experiments/valid-rows.jsonl),
    committed so that `render --runs docs/experiments` redraws the report without the runs."""
    os.makedirs(os.path.dirname(COMPACT), exist_ok=True)
    with open(COMPACT, "w") as fh:
        for r in latest_runs(runs_dir):
            if "error" in r:
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
                continue
            _, valid = read_run(os.path.join(runs_dir, r["dir"]))
            keep = ("accuracy", "margin", "lw", "lr", "orpo_lambda", "orpo_lambda_phase")
            rows = [{"step": v["step"], **{k: v["metrics"][k] for k in keep if k in v["metrics"]}}
                    for v in valid]
            fh.write(json.dumps({**r, "valid": rows}, ensure_ascii=False) + "\n")


def load_compact():
    runs = [json.loads(line) for line in open(COMPACT)]
    return runs, {(r["task"], r["arm"], r["seed"]): [(v["step"], v) for v in r.get("valid", [])]
                  for r in runs}


def summarise(runs_dir):
    """{(task, arm): [per-seed dict]} from the finished runs (or the compact file)."""
    out = {}
    if os.path.exists(os.path.join(runs_dir, "index.jsonl")):
        write_compact(runs_dir)
    runs, valid_of = load_compact()
    for r in runs:
        if "error" in r:
            continue
        traj = valid_of[(r["task"], r["arm"], r["seed"])]
        first, last = traj[0][1], traj[-1][1]
        best = max(traj, key=lambda t: t[1]["margin"])
        out.setdefault((r["task"], r["arm"]), []).append({
            "seed": r["seed"],
            "acc": last["accuracy"], "margin": last["margin"],
            "lw": last["lw"], "lr": last["lr"],
            "d_lw": last["lw"] - first["lw"], "d_lr": last["lr"] - first["lr"],
            "best_margin": best[1]["margin"], "best_step": best[0],
            "acc0": first["accuracy"], "margin0": first["margin"], "lw0": first["lw"],
            "lambda": last.get("orpo_lambda"),
            "traj": [(s, m["margin"], m["lw"], m["lr"], m["accuracy"], m.get("orpo_lambda"))
                     for s, m in traj],
        })
    for v in out.values():
        v.sort(key=lambda d: d["seed"])
    return out


COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf"]


def svg_lines(path, title, ylabel, series):
    """series: [(label, [(x, y)])] → a line chart, written as SVG."""
    w, h, ml, mr, mt, mb = 720, 360, 60, 200, 30, 40
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts if math.isfinite(y)]
    if not xs or not ys:
        return
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        y1 = y0 + 1
    pad = (y1 - y0) * 0.05
    y0, y1 = y0 - pad, y1 + pad
    sx = lambda x: ml + (x - x0) / max(x1 - x0, 1e-9) * (w - ml - mr)  # noqa: E731
    sy = lambda y: mt + (y1 - y) / (y1 - y0) * (h - mt - mb)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
             f'font-family="sans-serif" font-size="11">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{w / 2 - mr / 2}" y="18" text-anchor="middle" font-size="13">{title}</text>',
             f'<line x1="{ml}" y1="{h - mb}" x2="{w - mr}" y2="{h - mb}" stroke="black"/>',
             f'<line x1="{ml}" y1="{mt}" x2="{ml}" y2="{h - mb}" stroke="black"/>',
             f'<text x="{(ml + w - mr) / 2}" y="{h - 8}" text-anchor="middle">step</text>',
             f'<text x="14" y="{(mt + h - mb) / 2}" text-anchor="middle" '
             f'transform="rotate(-90 14 {(mt + h - mb) / 2})">{ylabel}</text>']
    for i in range(5):
        yv = y0 + (y1 - y0) * i / 4
        parts.append(f'<text x="{ml - 4}" y="{sy(yv) + 4:.1f}" text-anchor="end">{yv:.2f}</text>')
        parts.append(f'<line x1="{ml}" y1="{sy(yv):.1f}" x2="{w - mr}" y2="{sy(yv):.1f}" '
                     f'stroke="#ddd"/>')
        xv = x0 + (x1 - x0) * i / 4
        parts.append(f'<text x="{sx(xv):.1f}" y="{h - mb + 14}" text-anchor="middle">{xv:.0f}</text>')
    for k, (label, pts) in enumerate(series):
        c = COLORS[k % len(COLORS)]
        d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts if math.isfinite(y))
        parts.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.8" points="{d}"/>')
        ly = mt + 14 * k + 8
        parts.append(f'<line x1="{w - mr + 10}" y1="{ly}" x2="{w - mr + 28}" y2="{ly}" '
                     f'stroke="{c}" stroke-width="2"/>')
        parts.append(f'<text x="{w - mr + 32}" y="{ly + 4}">{label}</text>')
    parts.append("</svg>")
    with open(path, "w") as fh:
        fh.write("\n".join(parts) + "\n")


def mean_traj(seeds, col):
    """Mean over seeds of trajectory column `col` (1 margin, 2 lw, 3 lr, 4 acc, 5 λ)."""
    by_step = {}
    for s in seeds:
        for row in s["traj"]:
            if row[col] is not None:
                by_step.setdefault(row[0], []).append(row[col])
    return [(st, statistics.fmean(v)) for st, v in sorted(by_step.items())]


def cmd_render(args):
    res = summarise(args.runs)
    docs = os.path.join(ROOT, "docs")
    figs = os.path.join(docs, "experiments")
    os.makedirs(figs, exist_ok=True)
    index = load_compact()[0]
    failed = [r for r in index if "error" in r]
    secs = [r["seconds"] for r in index if "seconds" in r]
    L = ["# Experiments: λ, adaptive λ, rsLoRA, LoRA+, dropout",
         "",
         "Generated by `python3 scripts/experiments.py render` from the runs of "
         "`python3 scripts/experiments.py run` (see the script's header for the commands); "
         "do not edit by hand.",
         "",
         f"{len(index) - len(failed)} runs ({len(failed)} failed), "
         f"{args.device_note}, median {statistics.median(secs) if secs else 0:.0f} s per run "
         f"with {args.jobs_note} runs at a time on one GPU.",
         "",
         "Setup: SmolLM2-135M-Instruct (Q4_1 GGUF base, LoRA in f32 masters on all seven "
         "projections), ORPO, 120 steps of one pair, lr 2e-4 cosine with 5% warm-up, rank 16, "
         "alpha 32; validation every 10 steps on the task's held-out pairs (style: 48, facts: 60). "
         "Each arm changes one setting from λ = 0.1. `acc` and `margin` are the held-out "
         "preference accuracy and mean margin (chosen minus rejected mean logp) at the last step; "
         "`Δlw` and `Δlr` the change of the held-out chosen and rejected mean logps from step 0. "
         "Displacement is margin bought by pushing both down: Δlw < 0 while the margin rises. "
         "Mean ± sample standard deviation over seeds.",
         ""]
    verdicts = []
    for task in TASKS:
        L += [f"## Task `{task}`", "",
              "| arm | seeds | acc | margin | best margin (step) | Δlw | Δlr | final λ |",
              "|---|---|---|---|---|---|---|---|"]
        for arm in ARMS:
            seeds = res.get((task, arm), [])
            if not seeds:
                L.append(f"| {arm} | 0 | | | | | | |")
                continue
            bm = fmt([s["best_margin"] for s in seeds])
            bst = "/".join(str(s["best_step"]) for s in seeds)
            lam = fmt([s["lambda"] for s in seeds if s["lambda"] is not None])
            L.append(f"| {arm} | {len(seeds)} | {fmt([s['acc'] for s in seeds])} | "
                     f"{fmt([s['margin'] for s in seeds])} | {bm} ({bst}) | "
                     f"{fmt([s['d_lw'] for s in seeds])} | {fmt([s['d_lr'] for s in seeds])} | "
                     f"{lam} |")
        s0 = [s for arm in ARMS for s in res.get((task, arm), [])]
        if s0:
            L += ["", f"At step 0 (the base model): acc {fmt([s['acc0'] for s in s0])}, "
                      f"margin {fmt([s['margin0'] for s in s0])}, lw {fmt([s['lw0'] for s in s0])}."]
        # Adaptive against the best static λ, by mean final held-out accuracy then margin.
        static = [(statistics.fmean([s["acc"] for s in res[(task, a)]]),
                   statistics.fmean([s["margin"] for s in res[(task, a)]]), a)
                  for a in ARMS if a.startswith("λ=") and res.get((task, a))]
        ad = res.get((task, "adaptive"))
        if static and ad:
            best = max(static)
            am = (statistics.fmean([s["acc"] for s in ad]),
                  statistics.fmean([s["margin"] for s in ad]))
            sd_best = mean_sd([s["margin"] for s in res[(task, best[2])]])[1]
            sd_ad = mean_sd([s["margin"] for s in ad])[1]
            beat = am[0] > best[0] or (am[0] == best[0] and am[1] > best[1])
            clear = abs(am[1] - best[1]) > sd_best + sd_ad
            verdicts.append(
                f"- `{task}`: the best static λ is {best[2]} (acc {best[0]:.3f}, margin "
                f"{best[1]:.3f}); adaptive reached acc {am[0]:.3f}, margin {am[1]:.3f}. "
                + ("Adaptive **beat** it" if beat else "Adaptive **did not beat** it")
                + (", by more than the seeds' spread." if clear else
                   ", within the seeds' spread (the sum of the two standard deviations)."))
        for col, name in ((1, "margin"), (2, "lw"), (4, "accuracy")):
            series = [(arm, mean_traj(res[(task, arm)], col)) for arm in HEADLINE
                      if res.get((task, arm))]
            f = f"{task}-{name}.svg"
            svg_lines(os.path.join(figs, f), f"{task}: held-out {name}, mean over seeds",
                      name, series)
            L += ["", f"![{task} {name}](experiments/{f})"]
        series = [(arm, mean_traj(res[(task, arm)], 1)) for arm in ARMS
                  if (arm not in HEADLINE or arm == "λ=0.1") and res.get((task, arm))]
        f = f"{task}-margin-adapters.svg"
        svg_lines(os.path.join(figs, f), f"{task}: held-out margin, adapter arms at λ 0.1",
                  "margin", series)
        L += ["", f"![{task} adapter arms](experiments/{f})", ""]
        ad = res.get((task, "adaptive"))
        if ad:
            f = f"{task}-adaptive-lambda.svg"
            svg_lines(os.path.join(figs, f), f"{task}: the adaptive controller's λ per seed",
                      "λ", [(f"seed {s['seed']}", [(r[0], r[5]) for r in s["traj"]
                                                   if r[5] is not None]) for s in ad])
            L += [f"![{task} adaptive λ](experiments/{f})", ""]
    L += ["## Does adaptive λ beat the best constant λ?", ""] + (verdicts or ["- no runs."])
    every = [s for v in res.values() for s in v]
    if every:
        rising = sum(s["d_lw"] > 0 for s in every)
        L += ["", f"Displacement: held-out lw rose from step 0 in {rising} of {len(every)} runs "
                  f"(smallest Δlw {min(s['d_lw'] for s in every):.3f}); " +
              ("no arm bought its margin by pushing the chosen response down, so these tasks "
               "reward a larger λ and give the controller's back-off nothing to do."
               if rising == len(every) else "see the Δlw columns for the runs where it fell.")]
    if any(a == "adaptive, no warm-up limit" for (_, a) in res):
        L += ["", "The `adaptive, no warm-up limit` runs are the controller as first built "
                  "(warm-up until lw plateaus, however long): lw never plateaued within 120 steps, "
                  "so λ stayed at `orpo_lambda_min` for the whole run. That finding is why "
                  "`orpo_lambda_warmup_max` (default 0.1 of the run) and the ramp's start at "
                  "`orpo_lambda` exist; its settings here (`orpo_lambda_warmup_max = 1`) give "
                  "the same λ sequence."]
    L += ["", "Rank scaling (`rank_scaling = \"by_bits\"`) does not apply to this base: every "
              "projection of the SmolLM2 GGUF has the same storage type, so it gives every module "
              "the same rank and is the λ = 0.1 arm.", ""]
    if failed:
        L += ["## Failed runs", ""] + [f"- {r['task']} {r['arm']} seed {r['seed']}: "
                                       f"`{r['error'].strip().splitlines()[-1]}`" for r in failed]
    with open(os.path.join(docs, "experiments.md"), "w") as fh:
        fh.write("\n".join(L) + "\n")
    print(f"wrote {os.path.join(docs, 'experiments.md')} and {figs}/*.svg")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "all"):
        p = sub.add_parser(name)
        p.add_argument("--lorafit", default=os.path.join(ROOT, "target/release/lorafit"))
        p.add_argument("--model", default="smollm2")
        p.add_argument("--device", default="cpu")
        p.add_argument("--steps", type=int, default=120)
        p.add_argument("--jobs", type=int, default=1)
        p.add_argument("--limit", type=int, default=None, help="only the first N runs to do")
        p.add_argument("--arms", nargs="*", default=None, help="only these arms")
        p.add_argument("--out", default=os.path.join(ROOT, "runs/experiments"))
    for name in ("render", "all"):
        p = sub.choices[name] if name in sub.choices else sub.add_parser(name)
        p.add_argument("--runs", default=os.path.join(ROOT, "runs/experiments"))
        p.add_argument("--device-note", default="on one H200 (CUDA, bf16 compute)")
        p.add_argument("--jobs-note", default="4")
    args = ap.parse_args()
    if args.cmd in ("run", "all"):
        cmd_run(args)
    if args.cmd in ("render", "all"):
        if args.cmd == "all":
            args.runs = args.out
        cmd_render(args)


if __name__ == "__main__":
    sys.exit(main())
