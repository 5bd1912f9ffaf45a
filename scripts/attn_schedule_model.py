#!/usr/bin/env python3
"""The makespan of an attention kernel's blocks under two launch orders, by list scheduling.

Each block of a (tile, head) grid does work in proportion to the tiles it meets: a backward
block (a 128-key tile) the 64-query tiles that see its keys, a forward block (a 128-query tile)
the key tiles its queries see, plus one unit for its own set-up. Within a head the tiles go
heaviest first, as the kernels order them (near enough: the forward's last query tiles first). Blocks start in launch order on
whichever SM frees first (one block per SM, as the version 5 kernels run). Compared: head by head
(the grid's x fastest, as CUDA launches it) and rank-major (every head's n-th tile before any
head's n+1-th: `rank_major_head` in src/tensor/cuda/kernels/attention.cu).

    scripts/attn_schedule_model.py            # qwen1.5b, llama8b, gemma2-2b at 3584 / 512
    scripts/attn_schedule_model.py 14336 2048 32 --sms 132
"""
import argparse
import heapq


def makespan(costs, sms):
    free = [0.0] * sms
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)


def tile_costs(p, r):
    """Per-tile work at a prefix-shared layout [P; Rc; Rr] in 128-row tiles, heaviest first."""
    pt, rt = p // 128, r // 128
    # Backward: key tile i of the prompt is seen by the prompt's later query tiles (two 64-row
    # tiles per 128) and by both responses; a response's key tile by its own later queries.
    bwd = [2 * (pt - i) + 4 * rt + 1 for i in range(pt)] + [2 * (rt - j) + 1 for j in range(rt)] * 2
    # Forward: a query tile sees the key tiles up to its own (and a response's, the whole prompt).
    fwd = [i + 2 for i in range(pt)] + [pt + j + 2 for j in range(rt)] * 2
    return sorted(bwd, reverse=True), sorted(fwd, reverse=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt", type=int, nargs="?")
    ap.add_argument("resp", type=int, nargs="?")
    ap.add_argument("heads", type=int, nargs="?")
    ap.add_argument("--sms", type=int, default=132)
    a = ap.parse_args()
    rows = [(a.prompt, a.resp, a.heads)] if a.heads else [(3584, 512, 12), (3584, 512, 32), (3584, 512, 8)]
    for p, r, heads in rows:
        for name, costs in zip(("backward", "forward"), tile_costs(p, r)):
            by_head = [c for _ in range(heads) for c in costs]
            by_rank = [c for c in costs for _ in range(heads)]
            ideal = sum(by_head) / a.sms
            h, k = makespan(by_head, a.sms), makespan(by_rank, a.sms)
            print(f"P {p} R {r}, {heads} heads, {name}: head by head {h:.0f}, rank-major {k:.0f}, "
                  f"all SMs busy {ideal:.0f} (head by head {h / k - 1:+.0%})")


if __name__ == "__main__":
    main()
