#!/usr/bin/env python3
"""Logits of a Hugging Face model with a lorafit-trained adapter loaded through PEFT.

Usage:
    python3 scripts/peft_roundtrip.py ADAPTER_DIR MODEL_DIR IDS_JSON OUT

Loads MODEL_DIR with transformers (float32, CPU, eager attention), wraps it with
`peft.PeftModel.from_pretrained(model, ADAPTER_DIR)`, runs the token ids in IDS_JSON (a JSON list
of ints) and writes the logits `(T, vocab)` to OUT (safetensors, key "logits").

Used to make tests/fixtures/peft_roundtrip/peft_logits.safetensors; tests/train_e2e.rs checks
that lorafit's forward with the same adapter reproduces these logits (see the top of that file
for the full regeneration commands).
"""

import json
import sys

import torch
import transformers
import peft
from peft import PeftModel
from safetensors.torch import save_file


def load_model(model_dir):
    kw = dict(attn_implementation="eager")
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, **kw)


@torch.no_grad()
def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    adapter_dir, model_dir, ids_json, out = sys.argv[1:]
    torch.manual_seed(0)
    with open(ids_json) as f:
        ids = json.load(f)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids), "IDS_JSON must be a list of ints"

    base = load_model(model_dir)
    base.eval()
    input_ids = torch.tensor([ids], dtype=torch.long)
    base_logits = base(input_ids=input_ids, use_cache=False).logits[0].clone()

    model = PeftModel.from_pretrained(base, adapter_dir)
    model.eval()
    cfg = model.peft_config["default"]
    n_lora = sum(1 for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n)
    max_b = max(p.abs().max().item() for n, p in model.named_parameters() if ".lora_B." in n)
    logits = model(input_ids=input_ids, use_cache=False).logits[0].float().contiguous()

    effect = (logits - base_logits).abs().max().item()
    print(
        f"torch {torch.__version__} transformers {transformers.__version__} peft {peft.__version__}: "
        f"r={cfg.r} alpha={cfg.lora_alpha} rslora={cfg.use_rslora} rank_pattern={dict(cfg.rank_pattern)} "
        f"{n_lora} LoRA matrices, max|B| {max_b:.4g}, logits {tuple(logits.shape)} "
        f"max|logit| {logits.abs().max().item():.4g}, adapter effect max|dlogit| {effect:.4g}"
    )
    assert max_b > 0, "all B matrices are zero: the adapter is a no-op"
    save_file({"logits": logits}, out)


if __name__ == "__main__":
    main()
