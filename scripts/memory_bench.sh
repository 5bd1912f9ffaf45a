#!/bin/bash
# The memory planner against the allocator, in one call on the GPU machine: `lorafit bench` per
# row, then one table of predicted and measured peaks (GiB) with their ratio, the plan, s/step and
# MFU. Rows are `shape P R [bench flags...]`; STEPS="steps warmup" (default "1 1") for every row,
# a row's own `--steps`/`--warmup` win. Results go to $OUT (or /tmp): memory.jsonl, and every
# row's stderr (with LORAFIT_MEMTRACE=1 where set) in memory.err. ROW_TIMEOUT (seconds, default
# 300) bounds each row.
#
#   scripts/memory_bench.sh .gpu/lorafit "qwen1.5b 3584 512" "llama8b 114688 16384 --warmup 0"
set -u
bin=$1; shift
out=${OUT:-/tmp}
read -r steps warmup <<<"${STEPS:-1 1}"
: > "$out/memory.jsonl"; : > "$out/memory.err"
for row in "$@"; do
  set -- $row
  shape=$1; P=$2; R=$3; shift 3
  echo "=== $row" >> "$out/memory.err"
  own="$*"; counts=""
  [[ "$own" == *--steps* ]] || counts="$counts --steps $steps"
  [[ "$own" == *--warmup* ]] || counts="$counts --warmup $warmup"
  timeout "${ROW_TIMEOUT:-300}" "$bin" bench --shape "$shape" --prompt-len "$P" --resp-len "$R" $counts \
    --device cuda "$@" 2>>"$out/memory.err" | grep '^RESULT' | sed 's/^RESULT //' >> "$out/memory.jsonl" \
    || echo "bench failed: $row (see memory.err)"
done
python3 - "$out/memory.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'shape':<9} {'P/R':>13} {'quant':>5} {'limit':>5} | {'plan':<28} | {'s/step':>8} {'MFU':>6} | {'predicted':>9} {'measured':>9} {'ratio':>6}")
for r in rows:
    if 'refused' in r:
        lim = r.get('memory_limit_gib') or '-'
        print(f"{r['shape']:<9} {str(r['P'])+'/'+str(r['R']):>13} {r.get('base_quant','none'):>5} {lim!s:>5} | refused: {r['refused']}")
        continue
    plan = f"seg {r['segment_size']}" + (" +attn" if r['keep_attention'] else "") + \
        (f" +kv{r['keep_kv_layers']}" if r['keep_kv_layers'] else "") + \
        (f" mlp{r['mlp_chunk']}" if r['mlp_chunk'] else "") + \
        (f" host({r.get('pinned_gib', 0):.1f}G, est {r.get('predicted_host_gib', 0):.1f})" if r.get('offload') else "")
    lim = r.get('memory_limit_gib') or '-'
    pr, me = r['predicted_peak_gib'], r['peak_gib']
    print(f"{r['shape']:<9} {str(r['P'])+'/'+str(r['R']):>13} {r.get('base_quant','none'):>5} {lim!s:>5} | {plan:<28} | "
          f"{r['s_per_step']:>8.3f} {r['mfu']:>6.1%} | {pr:>9.2f} {me:>9.2f} {pr/me:>6.3f}")
PY
