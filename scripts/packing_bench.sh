#!/bin/bash
# Packing on an UltraFeedback-like length mix, in one call on the GPU machine: `lorafit bench
# --mix` per shape, one pair a step and packed, then a table of pairs/s, tokens/s, MFU and peak.
# MIX (default 200-600,100-400), PACK (tokens a pack, default 16384), STEPS="steps warmup"
# (default "8 2"). With TRL_BATCH (batch sizes, e.g. "8,16") the anchor runs first on each shape:
# TRL's ORPOTrainer + Liger on the same mix (`scripts/trl_mix_bench.py`; the anchors and their
# wheels in .gpu/anchors and .gpu/whl, see ../shared/anchors/README.md; or TRL_SITE, a folder
# where TRL and Liger are installed already). Results go to $OUT (or /tmp): packing.jsonl,
# anchors-mix.jsonl and packing.err.
#
#   TRL_BATCH=8,16 scripts/packing_bench.sh .gpu/lorafit qwen1.5b llama8b
set -u
bin=$1; shift
out=${OUT:-/tmp}
mix=${MIX:-200-600,100-400}
read -r steps warmup <<<"${STEPS:-8 2}"
: > "$out/packing.jsonl"; : > "$out/packing.err"; : > "$out/anchors-mix.jsonl"
here=$(cd "$(dirname "$0")" && pwd)
site=${TRL_SITE:-/tmp/site}
if [ -n "${TRL_BATCH:-}" ] && [ -z "${TRL_SITE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl >/dev/null 2>&1
fi
for shape in "$@"; do
  if [ -n "${TRL_BATCH:-}" ]; then
    echo "=== trl-liger $shape batch $TRL_BATCH" >> "$out/packing.err"
    PYTHONPATH=$site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false timeout "${ROW_TIMEOUT:-300}" \
      python3 "$here/trl_mix_bench.py" --anchors .gpu/anchors --arch "$shape" --mix "$mix" \
      --batch "$TRL_BATCH" --steps "$steps" --warmup "$warmup" 2>>"$out/packing.err" \
      | grep '^RESULT' | sed 's/^RESULT //' >> "$out/anchors-mix.jsonl"
  fi
  for pack in 0 "${PACK:-16384}"; do
    echo "=== $shape pack $pack" >> "$out/packing.err"
    timeout "${ROW_TIMEOUT:-300}" "$bin" bench --shape "$shape" --device cuda --mix "$mix" \
      --pack-tokens "$pack" --steps "$steps" --warmup "$warmup" 2>>"$out/packing.err" \
      | grep '^RESULT' | sed 's/^RESULT //' >> "$out/packing.jsonl" || echo "bench failed: $shape $pack"
  done
done
python3 - "$out/packing.jsonl" "$out/anchors-mix.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
anchors = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
print(f"{'shape':<9} {'run':<16} | {'pairs/s':>8} {'tokens/s':>9} {'MFU':>6} {'peak GiB':>8} | plan")
for a in anchors:
    if 'error' in a:
        print(f"{a['arch']:<9} {a['mode'] + ' b' + str(a['batch']):<16} | {a['error']}")
        continue
    print(f"{a['arch']:<9} {a['mode'] + ' b' + str(a['batch']):<16} | {a['pairs_per_s']:>8.2f} {a['tokens_per_s']:>9.0f} "
          f"{'':>6} {a['peak_alloc_gib']:>8.2f} |")
for r in rows:
    best = max((a['pairs_per_s'] for a in anchors if a['arch'] == r['shape'] and 'pairs_per_s' in a), default=None)
    vs = f" ({r['pairs_per_s'] / best:.2f}x the best TRL batch)" if best else ""
    print(f"{r['shape']:<9} {'lorafit pack ' + str(r['pack_tokens']):<16} | {r['pairs_per_s']:>8.2f} {r['tokens_per_s']:>9.0f} "
          f"{r['mfu']:>6.1%} {r['peak_gib']:>8.2f} | {r['plan']}{vs}")
PY
