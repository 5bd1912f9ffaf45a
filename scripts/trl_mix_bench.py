"""TRL's ORPOTrainer (+ Liger) on pairs of mixed lengths, the anchor beside `lorafit bench --mix`.

Pairs are drawn as lorafit's `--mix` draws them: prompt length uniform in P_LO..P_HI, each response
uniform in R_LO..R_HI on its own, random token ids. TRL pads each batch of `--batch` pairs (chosen
and rejected as 2·batch rows) to its longest row; the batch size is the knob a TRL user tunes, so
every size given is run in turn and each prints its own line (the first that runs out of memory
ends the list). Model, LoRA and TRL settings are the fixed-shape anchor's
(`torch_orpo_bench.py`, imported from `--anchors`).

    python3 scripts/trl_mix_bench.py --anchors .gpu/anchors --arch llama8b --mix 200-600,100-400 \
        --batch 8,16 --steps 6 --warmup 2

Prints one `RESULT {json}` line per batch size: pairs/s and real (unpadded) tokens/s over the timed
steps, and the allocator's peak.
"""
import argparse, json, os, random, statistics, sys, time


def step_timer(warmup, times):
    """A TrainerCallback that appends each step's seconds (device synchronised) to `times` and
    starts the allocator's peak again after `warmup` steps."""
    import torch
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, a, s, c, **k):
            torch.cuda.synchronize(); self.t = time.perf_counter()
            if s.global_step == warmup: torch.cuda.reset_peak_memory_stats()

        def on_step_end(self, a, s, c, **k):
            torch.cuda.synchronize(); times.append(time.perf_counter() - self.t)

    return Timer()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--anchors", required=True, help="folder holding torch_orpo_bench.py")
    ap.add_argument("--arch", required=True)
    ap.add_argument("--mix", default="200-600,100-400")
    ap.add_argument("--batch", default="8,16")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-liger", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, args.anchors)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    import torch_orpo_bench as anchor
    from datasets import Dataset
    from anchor_tokens import anchor_tokenizer, trl_rows  # this folder's
    try:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer
    except ImportError:  # TRL before ORPO moved to experimental
        from trl import ORPOConfig, ORPOTrainer

    (p_lo, p_hi), (r_lo, r_hi) = [tuple(int(x) for x in part.split("-")) for part in args.mix.split(",")]
    V = anchor.ARCHS[args.arch]["vocab_size"]
    hf_tok = anchor_tokenizer(V)
    model = anchor.make_model(args.arch, p_hi + r_hi + 16)
    for batch in [int(b) for b in args.batch.split(",")]:
        rng = random.Random(1)
        draw = lambda lo, hi: rng.randint(lo, hi)
        ids = lambda n: [rng.randint(3, V - 1) for _ in range(n)]
        n_pairs = batch * (args.steps + args.warmup)
        pairs = [(ids(draw(p_lo, p_hi)), ids(draw(r_lo, r_hi)), ids(draw(r_lo, r_hi))) for _ in range(n_pairs)]
        rows = trl_rows(hf_tok, pairs)
        # Real tokens of each step's pairs (chosen and rejected rows each carry the prompt).
        step_tokens = [sum(2 * len(p) + len(c) + len(r) for p, c, r in pairs[s * batch:(s + 1) * batch])
                       for s in range(args.steps + args.warmup)]
        times = []
        rec = dict(mode="trl" if args.no_liger else "trl-liger", arch=args.arch, mix=args.mix, batch=batch)
        try:
            cfg = ORPOConfig(output_dir="/tmp/orpo-mix-out", max_length=p_hi + r_hi + 4,
                             per_device_train_batch_size=batch, max_steps=args.steps + args.warmup,
                             learning_rate=1e-5, beta=0.1, bf16=True, gradient_checkpointing=True,
                             logging_steps=1000, save_strategy="no", report_to=[],
                             use_liger_kernel=not args.no_liger, remove_unused_columns=False, seed=0,
                             dataloader_drop_last=True)
            # No shuffling of the pairs: each step takes the next `batch`, as `step_tokens` counts.
            ORPOTrainer._get_train_sampler = lambda self, *a, **k: torch.utils.data.SequentialSampler(self.train_dataset)
            tr = ORPOTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=hf_tok,
                             peft_config=anchor.lora_config(), callbacks=[step_timer(args.warmup, times)])
            tr.train()
            timed = times[args.warmup:]
            seconds = sum(timed)
            tokens = sum(step_tokens[args.warmup:args.warmup + len(timed)])
            rec.update(steps_timed=len(timed), seconds=round(seconds, 3),
                       pairs_per_s=round(batch * len(timed) / seconds, 3), tokens_per_s=round(tokens / seconds),
                       s_per_step=round(statistics.median(timed), 4),
                       peak_alloc_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                       peak_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2))
            # The next batch size trains a fresh adapter on the same base.
            model = tr.model.unload() if hasattr(tr.model, "unload") else model
            del tr
        except torch.cuda.OutOfMemoryError:
            rec.update(error="OOM")
        except Exception as e:
            rec.update(error=f"{type(e).__name__}: {str(e)[:300]}")
        print("RESULT " + json.dumps(rec), flush=True)
        torch.cuda.empty_cache()
        if "error" in rec:
            break


if __name__ == "__main__":
    main()
