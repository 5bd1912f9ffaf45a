#!/bin/bash
# Decode speed on the GPU machine in one call: transformers' `generate` (scripts/decode_bench.py)
# and `lorafit bench --decode` on the same random-weight shape, batch sizes and lengths, then one
# table with the ratios. Results go to $OUT (or /tmp) as JSON lines.
#
#   scripts/decode_bench.sh LORAFIT_BIN [shape [batches [prompt_len [new_tokens]]]]
#
# e.g. scripts/decode_bench.sh .gpu/lorafit llama8b 1,8 128 128
set -u
bin=$1; shape=${2:-llama8b}; batches=${3:-1,8}; P=${4:-128}; N=${5:-128}
out=${OUT:-/tmp}
python3 "$(dirname "$0")/decode_bench.py" --shape "$shape" --batch "$batches" --prompt-len "$P" \
  --new-tokens "$N" 2>"$out/decode-transformers.err" | grep '^RESULT' | sed 's/^RESULT //' \
  > "$out/decode-transformers.jsonl" || echo "decode_bench.py failed (see $out/decode-transformers.err)"
"$bin" bench --decode --shape "$shape" --batch "$batches" --decode-prompt-len "$P" \
  --new-tokens "$N" --base bf16,q4_0 --device cuda 2>"$out/decode-lorafit.err" \
  | grep '^RESULT' | sed 's/^RESULT //' > "$out/decode-lorafit.jsonl" \
  || echo "lorafit bench --decode failed (see $out/decode-lorafit.err)"
python3 - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(name):
    p = os.path.join(out, name)
    return [json.loads(l) for l in open(p) if l.strip()] if os.path.exists(p) else []
rows = load("decode-lorafit.jsonl") + load("decode-transformers.jsonl")
print(f"{'tool':<13} {'base':<9} {'batch':>5} | {'tok/s':>8} {'per seq':>8} {'ms/step':>8} {'prefill s':>9} {'GiB':>6} | vs transformers bf16")
for r in rows:
    ref = [x for x in rows if x["tool"] == "transformers" and x["base"] == "bf16" and x["batch"] == r["batch"]]
    ratio = f"{r['decode_tokens_per_s'] / ref[0]['decode_tokens_per_s']:.2f}x" if ref else "-"
    print(f"{r['tool']:<13} {r['base']:<9} {r['batch']:>5} | {r['decode_tokens_per_s']:>8.1f} "
          f"{r['per_sequence_tokens_per_s']:>8.1f} {r['ms_per_step']:>8.2f} {r['prefill_s']:>9.3f} "
          f"{r['peak_gib']:>6.1f} | {ratio}")
PY
