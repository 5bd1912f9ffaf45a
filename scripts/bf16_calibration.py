#!/usr/bin/env python3
"""Sets PyTorch's own bf16 error beside lorafit's for the whole-model parity cases of
`lorafit selftest`.

    LORAFIT_SELFTEST_DUMP=DIR lorafit selftest --device cuda
    python3 scripts/bf16_calibration.py DIR

For each case (a random 2-layer model, its LoRA adapter, input ids and an upstream d(logits)),
it runs transformers + peft in float32 and in bfloat16 on the GPU, and prints, per LoRA matrix
kind, the relative-norm error against the float32 PyTorch gradients of
  - lorafit's CPU reference   (should be ~1e-6: same arithmetic),
  - lorafit's CUDA backend    (bf16 storage, f32 accumulation),
  - PyTorch in bfloat16       (the stack users run today).
"""
import json
import os
import sys

import torch
import transformers
from peft import PeftModel
from safetensors.torch import load_file

CLASSES = {
    "LlamaForCausalLM": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "Qwen2ForCausalLM": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "Qwen3ForCausalLM": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "Gemma2ForCausalLM": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "Gemma3ForCausalLM": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}
if hasattr(transformers, "Gemma4ForCausalLM"):
    CLASSES["Gemma4ForCausalLM"] = (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM)
TF_MAJOR = int(transformers.__version__.split(".")[0])


def hf_kwargs(cfg_json):
    """config.json fields as the installed transformers takes them: Gemma 3's two rotary
    tables as transformers 5's per-layer-type rope_parameters."""
    kw = {k: v for k, v in cfg_json.items() if k != "architectures"}
    if TF_MAJOR >= 5 and "rope_local_base_freq" in kw:
        full = {"rope_type": "default", "rope_theta": kw.pop("rope_theta", 1e6)}
        full.update(kw.pop("rope_scaling", None) or {})
        kw["rope_parameters"] = {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": kw.pop("rope_local_base_freq")},
        }
    return kw


def rel_norm(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def lora_grads(case_dir, dtype, ids, dlogits):
    cfg_json = json.load(open(os.path.join(case_dir, "config.json")))
    cfg_cls, model_cls = CLASSES[cfg_json["architectures"][0]]
    cfg = cfg_cls(**hf_kwargs(cfg_json))
    cfg.architectures = cfg_json["architectures"]
    # Gemma 2's softcap needs eager attention in training; eager everywhere keeps one kernel.
    cfg._attn_implementation = "eager"
    model = model_cls(cfg)
    res = model.load_state_dict(load_file(os.path.join(case_dir, "model.safetensors")), strict=False)
    # Only tied heads may be absent; anything else left at its initial value would void the case.
    missing = [k for k in res.missing_keys if k != "lm_head.weight"]
    if missing or res.unexpected_keys:
        sys.exit(f"{case_dir}: missing {missing}, unexpected {res.unexpected_keys}")
    if cfg.tie_word_embeddings:
        model.tie_weights()
    model = PeftModel.from_pretrained(model, os.path.join(case_dir, "adapter"), is_trainable=True)
    model = model.to("cuda", dtype)
    out = model(input_ids=ids[None].cuda()).logits[0]
    out.backward(dlogits.cuda().to(out.dtype))
    grads = {
        n.replace(".default", ""): p.grad.float().cpu()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    return out.detach().float().cpu(), grads


def main():
    root = sys.argv[1]
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in sorted(os.listdir(root)):
        case_dir = os.path.join(root, name)
        arch = json.load(open(os.path.join(case_dir, "config.json")))["architectures"][0]
        if arch not in CLASSES:
            print(f"{name}: {arch} has no transformers class here; skipped")
            continue
        case = load_file(os.path.join(case_dir, "case.safetensors"))
        ids = case["ids"].long()
        dlogits = case["dlogits"]
        ref_logits, ref = lora_grads(case_dir, torch.float32, ids, dlogits)
        b16_logits, b16 = lora_grads(case_dir, torch.bfloat16, ids, dlogits)
        print(f"{name}: torch bf16 logits rel-norm vs torch float32 {rel_norm(b16_logits, ref_logits):.3e}")
        rows = {"lorafit-cpu": [], "lorafit-cuda": [], "torch-bf16": []}
        for key, g in ref.items():
            rows["lorafit-cpu"].append(rel_norm(case["cpu." + key], g))
            rows["lorafit-cuda"].append(rel_norm(case["gpu." + key], g))
            rows["torch-bf16"].append(rel_norm(b16[key], g))
        print(f"{name}: relative-norm error of {len(ref)} LoRA gradients vs torch float32")
        for who, errs in rows.items():
            errs_sorted = sorted(errs)
            print(
                f"  {who:<13} worst {max(errs):.3e}  median {errs_sorted[len(errs) // 2]:.3e}"
                f"  mean {sum(errs) / len(errs):.3e}"
            )


if __name__ == "__main__":
    main()
