#!/bin/bash
# Packing on an UltraFeedback-like length mix, in one call on the GPU machine: `lorafit bench
# --mix` per shape, one pair a step and packed, then a table of pairs/s, tokens/s, MFU and peak.
# MIX (default 200-600,100-400), PACK (tokens a pack, default 16384), STEPS="steps warmup"
# (default "8 2"). Results go to $OUT (or /tmp): packing.jsonl and packing.err.
#
#   scripts/packing_bench.sh .gpu/lorafit qwen1.5b llama8b
set -u
bin=$1; shift
out=${OUT:-/tmp}
mix=${MIX:-200-600,100-400}
read -r steps warmup <<<"${STEPS:-8 2}"
: > "$out/packing.jsonl"; : > "$out/packing.err"
for shape in "$@"; do
  for pack in 0 "${PACK:-16384}"; do
    echo "=== $shape pack $pack" >> "$out/packing.err"
    timeout "${ROW_TIMEOUT:-300}" "$bin" bench --shape "$shape" --device cuda --mix "$mix" \
      --pack-tokens "$pack" --steps "$steps" --warmup "$warmup" 2>>"$out/packing.err" \
      | grep '^RESULT' | sed 's/^RESULT //' >> "$out/packing.jsonl" || echo "bench failed: $shape $pack"
  done
done
python3 - "$out/packing.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"{'shape':<9} {'pack':>6} | {'pairs/s':>8} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>8} | plan")
for r in rows:
    print(f"{r['shape']:<9} {r['pack_tokens']:>6} | {r['pairs_per_s']:>8.2f} {r['tokens_per_s']:>9.0f} "
          f"{r['mfu']:>6.1%} {r['peak_gib']:>8.2f} | {r['plan']}")
PY
