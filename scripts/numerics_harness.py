#!/usr/bin/env python3
"""One ORPO run four ways, step by step: lorafit on the CPU (f32, the reference), lorafit on
CUDA (bf16 storage, f32 accumulation), and transformers + PEFT in bfloat16 and in float32 (the
last checks the harness itself: it should track the CPU run to ~1e-5).

    python3 scripts/numerics_harness.py --lorafit target/release/lorafit \\
        --model ~/.cache/lorafit/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --data demo/train.jsonl --steps 30 --lr 1e-4 --lr 1e-5 --out runs/numerics

Every run starts from the same adapter (lorafit's own initialisation, B = 0, given to each
lorafit run as `warm_start`), sees the same token ids in the same order (the CPU run's
batches.jsonl, `record_batches = true`) and takes the same learning rate per step (the CPU run's
metrics.jsonl). The PyTorch runs load the base weights that `lorafit export --dtype f32` writes
from the same model file, so both frameworks start from the same numbers; PEFT keeps the adapter
in float32 (its default), AdamW is torch's own with lorafit's hyperparameters, and the clip is
lorafit's (scale by max_norm / norm when the norm is above max_norm).

Per step it records the loss, the gradient norm before clipping, and the update's relative
distance to the CPU run's: |Δθ − Δθ_cpu| / |Δθ_cpu| with Δθ = θ_step − θ_0 over every LoRA
matrix (A barely moves from its initialisation, so the distance of θ itself would hide
everything). It writes OUT/report.md and OUT/report.json.

`--lorafit-devices cpu` (or `--torch none`) runs fewer columns; `--lorafit-cuda-bin` adds a
second CUDA column from another lorafit binary (a before/after comparison in one call).
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM


def sh(cmd):
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)


def read_lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plan_value(run_dir, key):
    """A top-level `key = value` of a run's plan.toml (numbers and strings only)."""
    for line in open(os.path.join(run_dir, "plan.toml")):
        k, _, v = line.partition("=")
        if k.strip() == key:
            v = v.strip()
            return v.strip('"') if v.startswith('"') else float(v)
    raise KeyError(f"{key} not in {run_dir}/plan.toml")


def make_init_adapter(args, out):
    """lorafit's initial adapter: one CPU step leaves A as initialised (B = 0 gives A a zero
    gradient, and AdamW with zero moments moves nothing); B is set back to 0."""
    init_run = os.path.join(out, "init-run")
    init = os.path.join(out, "init-adapter")
    if os.path.exists(os.path.join(init, "adapter_model.safetensors")):
        return init
    sh([args.lorafit, "train", "--model", args.model, "--data", args.data, "--method", "orpo",
        "--lr", "1e-5", "--steps", "1", "--seed", str(args.seed), "--device", "cpu",
        "--output", init_run, "--overwrite", "--set", "save_every=0"])
    os.makedirs(init, exist_ok=True)
    tensors = load_file(os.path.join(init_run, "adapter", "adapter_model.safetensors"))
    tensors = {k: (torch.zeros_like(v) if ".lora_B." in k else v) for k, v in tensors.items()}
    save_file(tensors, os.path.join(init, "adapter_model.safetensors"))
    shutil.copy(os.path.join(init_run, "adapter", "adapter_config.json"), init)
    return init


def export_base(args, out, init):
    """The base weights as an f32 Hugging Face folder (the init adapter's B = 0 merges as 0)."""
    base = os.path.join(out, "base")
    hf = os.path.join(base, "merged-hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        sh([args.lorafit, "export", "--model", args.model, "--adapter", init, "--output", base,
            "--format", "hf", "--dtype", "f32"])
    return hf


def lorafit_run(bin_path, args, device, lr, init, run_dir, record=False):
    """One lorafit run with a checkpoint per step; `record` also writes batches.jsonl (the
    reference run's, which every other run replays or sees in the same order)."""
    sh([bin_path, "train", "--model", args.model, "--data", args.data, "--method", "orpo",
        "--lr", str(lr), "--steps", str(args.steps), "--seed", str(args.seed),
        "--device", device, "--output", run_dir, "--overwrite", "--set", "save_every=1",
        "--set", f"warm_start={os.path.abspath(init)}"]
       + (["--set", "record_batches=true"] if record else []))
    steps = [m for m in read_lines(os.path.join(run_dir, "metrics.jsonl"))
             if m.get("split") == "train"]
    params = []
    for s in range(1, args.steps + 1):
        ck = os.path.join(run_dir, f"checkpoint-{s:06d}", "adapter_model.safetensors")
        params.append(load_file(ck))
    return {
        "loss": [m["loss"] for m in steps],
        "grad_norm": [m["grad_norm"] for m in steps],
        "params": params,
        "lr": [m["learning_rate"] for m in steps],
    }


def sequence_logps(model, ids, device):
    """Per-token log p(ids[t] | ids[:t]) for t = 1..len-1, in float32."""
    x = torch.tensor([ids], device=device)
    logits = model(input_ids=x).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, x[0, 1:, None])[:, 0]


def log1mexp(x):
    """log(1 - exp(x)) for x < 0."""
    return torch.where(x > -math.log(2), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(model, batch, lam, device):
    """lorafit's ORPO (`train::objectives::orpo_sums`, `sft_scope = "full"`): token-mean NLL over
    the chosen sequence's predicted tokens, plus λ·(−log σ(log odds)) of the mean response
    logps."""
    p, c, r = batch["prompt"], batch["chosen"], batch["rejected"]
    lc = sequence_logps(model, p + c, device)
    lrj = sequence_logps(model, p + r, device)
    n_prompt = len(p) - 1
    lw = lc[n_prompt:].double().mean()
    lr = lrj[n_prompt:].double().mean()
    nll = -lc.double().sum() / lc.numel()
    log_odds = (lw - lr) - (log1mexp(lw) - log1mexp(lr))
    return nll - lam * torch.nn.functional.logsigmoid(log_odds)


def torch_run(args, hf_dir, init, reference_dir, dtype, lr_per_step):
    device = args.torch_device
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32 if dtype == "f32w" else dtype, attn_implementation="eager")
    if dtype == "f32w":
        # float32 arithmetic on bf16-rounded base weights: what the rounding of the weights
        # alone costs (the CUDA backend dequantizes to bf16, as PyTorch's bf16 load does).
        with torch.no_grad():
            for p in base.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    model = PeftModel.from_pretrained(base, init, is_trainable=True).to(device)
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    lam = plan_value(reference_dir, "orpo_lambda")
    clip = plan_value(reference_dir, "grad_clip")
    opt = torch.optim.AdamW(
        [p for _, p in named], lr=lr_per_step[0],
        betas=(plan_value(reference_dir, "adam_beta1"), plan_value(reference_dir, "adam_beta2")),
        eps=plan_value(reference_dir, "adam_eps"),
        weight_decay=plan_value(reference_dir, "weight_decay"))
    batches = read_lines(os.path.join(reference_dir, "batches.jsonl"))
    out = {"loss": [], "grad_norm": [], "params": []}
    for step in range(1, args.steps + 1):
        micro = [b for b in batches if b["step"] == step]
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for b in micro:
            loss = orpo_loss(model, b, lam, device) / len(micro)
            loss.backward()
            loss_sum += loss.item()
        norm = math.sqrt(sum(p.grad.double().pow(2).sum().item() for _, p in named))
        if clip > 0 and norm > clip:
            for _, p in named:
                p.grad.mul_(clip / norm)
        for g in opt.param_groups:
            g["lr"] = lr_per_step[step - 1]
        opt.step()
        out["loss"].append(loss_sum)
        out["grad_norm"].append(norm)
        # PEFT's names carry the adapter name; lorafit's files do not.
        out["params"].append({n.replace(".default.", "."): p.detach().float().cpu().clone()
                              for n, p in named})
    return out


def update_distance(run, ref, init):
    """|Δθ_run − Δθ_ref| / |Δθ_ref| per step, over every LoRA matrix."""
    dist = []
    for theta, theta_ref in zip(run["params"], ref["params"]):
        num = den = 0.0
        for k, t0 in init.items():
            d_ref = theta_ref[k].double() - t0.double()
            d_run = theta[k].double() - t0.double()
            num += (d_run - d_ref).pow(2).sum().item()
            den += d_ref.pow(2).sum().item()
        dist.append(math.sqrt(num / den) if den > 0 else 0.0)
    return dist


def report(lr, runs, init):
    ref = runs["lorafit cpu"]
    cols = [k for k in runs if k != "lorafit cpu"]
    for k in cols:
        runs[k]["update_distance"] = update_distance(runs[k], ref, init)
    lines = [f"### lr {lr:g}, {len(ref['loss'])} steps", ""]
    head = ["step", "CPU loss"] + [f"{k} loss" for k in cols] + ["CPU grad norm"]
    head += [f"{k} grad norm" for k in cols] + [f"{k} Δθ dist" for k in cols]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    n = len(ref["loss"])
    show = sorted({1, 2, 4, 8, 16, 26, n} & set(range(1, n + 1)))
    for s in show:
        i = s - 1
        row = [str(s), f"{ref['loss'][i]:.5f}"]
        row += [f"{runs[k]['loss'][i]:.5f} ({rel(runs[k]['loss'][i], ref['loss'][i])})" for k in cols]
        row += [f"{ref['grad_norm'][i]:.4f}"]
        row += [f"{runs[k]['grad_norm'][i]:.4f}" for k in cols]
        row += [f"{runs[k]['update_distance'][i]:.2e}" for k in cols]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("| run | mean abs rel loss diff (steps 2..) | mean abs rel grad-norm diff | "
                 "Δθ dist at the last step |")
    lines.append("|---|---|---|---|")
    summary = {}
    for k in cols:
        ld = mean([abs(a - b) / abs(b) for a, b in zip(runs[k]["loss"][1:], ref["loss"][1:])])
        gd = mean([abs(a - b) / abs(b) for a, b in zip(runs[k]["grad_norm"], ref["grad_norm"])])
        summary[k] = {"loss_rel": ld, "grad_norm_rel": gd,
                      "final_update_distance": runs[k]["update_distance"][-1]}
        lines.append(f"| {k} | {ld:.2%} | {gd:.2%} | {runs[k]['update_distance'][-1]:.3e} |")
    lines.append("")
    return "\n".join(lines), summary


def rel(a, b):
    return f"{(a - b) / abs(b):+.3%}"


def mean(xs):
    return sum(xs) / max(len(xs), 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lorafit", required=True)
    ap.add_argument("--lorafit-cuda-bin", action="append", default=[],
                    help="NAME=PATH: another lorafit binary's CUDA run as its own column")
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, action="append")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--lorafit-devices", default="cpu,cuda")
    ap.add_argument("--torch", default="bf16,f32",
                    help="comma list of bf16, f32, f32w (f32 on bf16-rounded weights); or none")
    ap.add_argument("--torch-device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    lrs = args.lr or [1e-4, 1e-5]
    os.makedirs(args.out, exist_ok=True)
    init = make_init_adapter(args, args.out)
    init_tensors = load_file(os.path.join(init, "adapter_model.safetensors"))
    hf = export_base(args, args.out, init) if args.torch != "none" else None
    text = ["# Real-model numerics: lorafit CPU (f32) vs lorafit CUDA vs PyTorch", "",
            f"model `{os.path.basename(args.model)}`, data `{args.data}`, ORPO, seed {args.seed}; "
            "loss columns give the relative difference to the CPU run; Δθ dist is the update's "
            "relative distance to the CPU run's.", ""]
    all_summary = {}
    for lr in lrs:
        runs = {}
        lr_dir = os.path.join(args.out, f"lr{lr:g}")
        for dev in args.lorafit_devices.split(","):
            runs[f"lorafit {dev}"] = lorafit_run(args.lorafit, args, dev, lr, init,
                                                 os.path.join(lr_dir, f"lorafit-{dev}"),
                                                 record=dev == "cpu")
        for spec in args.lorafit_cuda_bin:
            name, path = spec.split("=", 1)
            runs[name] = lorafit_run(path, args, "cuda", lr, init,
                                     os.path.join(lr_dir, f"lorafit-{name}"))
        ref_dir = os.path.join(lr_dir, "lorafit-cpu")
        lr_steps = runs["lorafit cpu"]["lr"]
        for name in [] if args.torch == "none" else args.torch.split(","):
            dtype = {"bf16": torch.bfloat16, "f32": torch.float32, "f32w": "f32w"}[name]
            runs[f"torch {name}"] = torch_run(args, hf, init, ref_dir, dtype, lr_steps)
        section, summary = report(lr, runs, init_tensors)
        text.append(section)
        all_summary[f"{lr:g}"] = {
            "summary": summary,
            "per_step": {k: {f: v[f] for f in ("loss", "grad_norm", "update_distance") if f in v}
                         for k, v in runs.items()},
        }
        print(section, flush=True)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("\n".join(text))
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(all_summary, f, indent=1)


if __name__ == "__main__":
    main()
