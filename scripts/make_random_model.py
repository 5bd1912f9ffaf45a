"""Writes a Qwen2-shaped random model folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a ChatML template) and random preference data, for checking that
`lorafit train` gives the same losses on CUDA as on the CPU.

    python3 scripts/make_random_model.py OUT_DIR [PROMPT_WORDS]

PROMPT_WORDS (default 20-40) sets the prompts' length range as LO-HI words.

Needs torch, transformers and tokenizers (the GPU machine has them).
"""
import json, os, random, sys

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Qwen2Config, Qwen2ForCausalLM

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
V = 512
words = [f"w{i}" for i in range(V - 3)]
vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
vocab.update({w: i + 3 for i, w in enumerate(words)})
tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
tok.save(os.path.join(out, "tokenizer.json"))
template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
json.dump({"bos_token": None, "eos_token": "<|im_end|>", "chat_template": template},
          open(os.path.join(out, "tokenizer_config.json"), "w"))

torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=V, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=512, rope_theta=10000.0)
model = Qwen2ForCausalLM(cfg).to(torch.float32)
with torch.no_grad():
    for name, p in model.named_parameters():
        if p.dim() > 1:
            p.normal_(0.0, 0.05)
        elif "norm" in name:
            p.normal_(1.0, 0.1)
        else:  # q/k/v biases
            p.normal_(0.0, 0.05)
model.save_pretrained(out, safe_serialization=True)

lo, hi = map(int, (sys.argv[2] if len(sys.argv) > 2 else "20-40").split("-"))
rng = random.Random(1)
def sentence(lo, hi, pool):
    return " ".join(rng.choice(pool) for _ in range(rng.randint(lo, hi)))
good, bad = words[: len(words) // 3], words[len(words) // 2 :]
with open(os.path.join(out, "train.jsonl"), "w") as f:
    for _ in range(40):
        f.write(json.dumps({"prompt": [{"role": "user", "content": sentence(lo, hi, words)}],
                            "chosen": [{"role": "assistant", "content": sentence(5, 12, good)}],
                            "rejected": [{"role": "assistant", "content": sentence(5, 12, bad)}]}) + "\n")
print("wrote", out)
