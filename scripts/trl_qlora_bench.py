"""TRL's ORPOTrainer on a 4-bit (bitsandbytes NF4, double quantization) base: the QLoRA anchor
beside `lorafit bench --shape llama70b --base-quant q4_0`.

A 70B model does not fit the GPU in bf16, and nothing can download one, so the model is built on
the meta device and its seven projections per layer are made one at a time as random bf16
weights (std 0.02) on the GPU and quantized at once into `bnb.nn.Linear4bit`; embedding, norms
and head are random bf16. Then what a QLoRA user runs: peft's `prepare_model_for_kbit_training`
(through TRL), LoRA r16 / alpha 32 on the seven projections, gradient checkpointing, bf16, one
pair per step, chosen and rejected padded into one batch of two (the fixed-shape anchor's
settings, `torch_orpo_bench.py`, imported from `--anchors`).

Needs bitsandbytes (folder A of ../shared/anchors/fetch-unsloth-wheels.sh) and TRL
(../shared/anchors/fetch-wheels.sh) installed on PYTHONPATH.

    python3 scripts/trl_qlora_bench.py --anchors .gpu/anchors --arch llama70b --prompt-len 3584 \
        --resp-len 512 --steps 4 --warmup 1

Prints one `RESULT {json}` line: s/step (median of the timed steps) and the allocator's peak.
"""
import argparse, json, os, statistics, sys, time

LLAMA70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False)
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_4bit_model(shape, max_pos):
    """A random Llama whose projections are bitsandbytes NF4 (double quantization) on the GPU."""
    import torch
    import bitsandbytes as bnb
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    cfg = LlamaConfig(max_position_embeddings=max_pos, **shape)
    cfg.pad_token_id = 0; cfg.bos_token_id = 1; cfg.eos_token_id = 2
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    dev = torch.device("cuda")

    def dense(*size):
        return torch.randn(*size, device=dev, dtype=torch.bfloat16) * 0.02

    for layer in model.model.layers:
        for part in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                lin = getattr(part, name, None)
                if lin is None:
                    continue
                # On the meta device, so that no full-width weight is made on the host first.
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False,
                                      compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                      device="meta")
                # `.to(cuda)` of an unquantized Params4bit quantizes it (NF4 blocks of 64, their
                # scales quantized again: double quantization).
                q.weight = bnb.nn.Params4bit(dense(lin.out_features, lin.in_features), requires_grad=False,
                                             compress_statistics=True, quant_type="nf4", module=q).to(dev)
                setattr(part, name, q)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight = torch.nn.Parameter(torch.ones(cfg.hidden_size, device=dev, dtype=torch.bfloat16))
    model.model.norm.weight = torch.nn.Parameter(torch.ones(cfg.hidden_size, device=dev, dtype=torch.bfloat16))
    model.model.embed_tokens.weight = torch.nn.Parameter(dense(cfg.vocab_size, cfg.hidden_size))
    model.lm_head.weight = torch.nn.Parameter(dense(cfg.vocab_size, cfg.hidden_size))
    # Non-persistent buffers made on the meta device: the rotary table again, on the GPU.
    model.model.rotary_emb = LlamaRotaryEmbedding(config=cfg, device=dev)
    # What `from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`
    # marks, so that TRL runs peft's `prepare_model_for_kbit_training` (not `is_quantized`:
    # transformers' Trainer would then look for the loader's quantizer, which there is none of).
    model.is_loaded_in_4bit = True
    model.config._attn_implementation = "sdpa"
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--anchors", required=True, help="folder holding torch_orpo_bench.py")
    ap.add_argument("--arch", default="llama70b", choices=["llama70b", "llama8b"])
    ap.add_argument("--prompt-len", type=int, required=True)
    ap.add_argument("--resp-len", type=int, required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    sys.path.insert(0, args.anchors)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    import torch_orpo_bench as anchor
    rec = dict(mode="trl-qlora-nf4", arch=args.arch, P=args.prompt_len, R=args.resp_len)
    try:
        from datasets import Dataset
        from anchor_tokens import anchor_tokenizer, trl_rows  # this folder's
        from trl_mix_bench import step_timer
        try:
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer
        except ImportError:  # TRL before ORPO moved to experimental
            from trl import ORPOConfig, ORPOTrainer
        shape = LLAMA70B if args.arch == "llama70b" else {k: v for k, v in anchor.ARCHS["llama8b"].items() if k != "kind"}
        V = shape["vocab_size"]
        hf_tok = anchor_tokenizer(V)
        n = args.steps + args.warmup
        rows = trl_rows(hf_tok, anchor.rand_pairs(n, args.prompt_len, args.resp_len, V))
        t0 = time.perf_counter()
        model = build_4bit_model(shape, args.prompt_len + args.resp_len + 16)
        rec.update(build_s=round(time.perf_counter() - t0, 1),
                   weights_gib=round(torch.cuda.memory_allocated() / 2**30, 2))
        times = []
        cfg = ORPOConfig(output_dir="/tmp/orpo-qlora-out", max_length=args.prompt_len + args.resp_len + 4,
                         per_device_train_batch_size=1, max_steps=n, learning_rate=1e-5, beta=0.1, bf16=True,
                         gradient_checkpointing=True, logging_steps=1000, save_strategy="no", report_to=[],
                         remove_unused_columns=False, seed=0)
        tr = ORPOTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=hf_tok,
                         peft_config=anchor.lora_config(), callbacks=[step_timer(args.warmup, times)])
        tr.train()
        timed = times[args.warmup:]
        rec.update(s_per_step=round(statistics.median(timed), 4), steps_timed=len(timed),
                   peak_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                   peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2))
    except torch.cuda.OutOfMemoryError:
        rec.update(error="OOM")
    except Exception as e:
        rec.update(error=f"{type(e).__name__}: {str(e)[:300]}")
    print("RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
