#!/usr/bin/env python3
"""transformers' `generate` on a random-weight model of a named shape, for `lorafit bench
--decode` to be compared with on the same GPU: greedy decoding of NEW tokens after a PROMPT-token
random prompt per sequence, at each batch size, in bf16 and (where bitsandbytes is installed)
with a 4-bit base (bitsandbytes NF4 weights, bf16 compute: transformers' usual 4-bit path; lorafit's
Q4_0 is a different 4-bit format of the same size). Prints one `RESULT {json}` line per run, with
the keys lorafit's lines use. Needs no network: the model is built from its config.

    python3 scripts/decode_bench.py --shape llama8b --batch 1,8 --prompt-len 128 --new-tokens 128
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch
import transformers

SHAPES = {
    # As src/bench.rs `named_shape`.
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                    rope_theta=500000.0, tie_word_embeddings=False, rms_norm_eps=1e-5),
    "qwen1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                     num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                     rope_theta=1000000.0, tie_word_embeddings=True, rms_norm_eps=1e-6),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                 tie_word_embeddings=False),
}


def random_model(shape, device):
    cfg = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=8192,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.eval()
    return model


def timed_generate(model, ids, new_tokens):
    """Seconds for `generate` of exactly `new_tokens` greedy tokens."""
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              pad_token_id=0, eos_token_id=None, use_cache=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return time.perf_counter() - t


def bench(model, base, args):
    vocab = model.config.vocab_size
    for batch in args.batch:
        g = torch.Generator().manual_seed(1 + batch)
        ids = torch.randint(3, vocab, (batch, args.prompt_len), generator=g).to(model.device)
        timed_generate(model, ids, 4)  # warm-up
        torch.cuda.reset_peak_memory_stats()
        # Prefill and the first token alone, then the whole run: the difference is the
        # decode steps (new_tokens - 1 of them), as lorafit counts them.
        prefill = min(timed_generate(model, ids, 1) for _ in range(2))
        total = timed_generate(model, ids, args.new_tokens)
        steps = args.new_tokens - 1
        decode_s = max(total - prefill, 1e-9)
        line = dict(tool="transformers", mode="decode", shape=args.shape, base=base, batch=batch,
                    prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                    device=torch.cuda.get_device_name(), transformers=transformers.__version__,
                    torch=torch.__version__, decode_tokens_per_s=batch * steps / decode_s,
                    per_sequence_tokens_per_s=steps / decode_s, ms_per_step=1e3 * decode_s / steps,
                    prefill_s=prefill, peak_gib=torch.cuda.max_memory_allocated() / 2**30)
        print("RESULT " + json.dumps(line), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    p.add_argument("--batch", default="1,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--base", default="bf16,4bit", help="bf16 and/or 4bit (bitsandbytes NF4)")
    args = p.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    bases = args.base.split(",")
    if not torch.cuda.is_available():
        sys.exit("decode_bench.py measures a GPU: no CUDA device")
    model = random_model(args.shape, "cuda")
    if "bf16" in bases:
        bench(model, "bf16", args)
    if "4bit" in bases:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            print("SKIPPED transformers 4-bit: bitsandbytes is not installed", file=sys.stderr)
            return
        # bitsandbytes quantizes at load: the same random weights through a saved folder.
        with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
            model.save_pretrained(d)
            del model
            torch.cuda.empty_cache()
            q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                bnb_4bit_compute_dtype=torch.bfloat16)
            model4 = transformers.LlamaForCausalLM.from_pretrained(
                d, quantization_config=q, device_map="cuda", dtype=torch.bfloat16)
        model4.generation_config.eos_token_id = None
        bench(model4, "4bit-nf4", args)


if __name__ == "__main__":
    main()
