#!/bin/bash
# Runs, in one call on the GPU machine, the PyTorch anchors (../shared/anchors, copied into
# .gpu/anchors with their wheels in .gpu/whl by ../shared/anchors/fetch-wheels.sh) and
# `lorafit bench` on the same shapes, then prints one table with the ratios.
#
#   scripts/gpu_bench.sh LORAFIT_BIN "shape P R anchor-mode [segment-size|auto] [bench flags...]" ...
#
# e.g. scripts/gpu_bench.sh .gpu/lorafit "qwen1.5b 3584 512 expert-liger" "llama8b 3584 512 trl-liger+expert-liger 0 --also 3584,512,4,0"
# Anchor modes are joined by "+"; "-" skips the anchors for that row. ANCHOR_STEPS="steps warmup"
# shortens the anchor runs. Mode `unsloth` runs ../shared/anchors/unsloth_orpo_bench.py through
# run-unsloth.sh with the two wheel folders of fetch-unsloth-wheels.sh, UNSLOTH_WHEELS="A B"
# (default ".whl/unsA .whl/unsB"; carried in two back-to-back calls). In the bench flags, `@MODE`
# is that anchor's peak on the row (or an earlier row of the same shape and P), e.g.
# "llama8b 3584 512 unsloth auto" "llama8b 3584 512 - auto --memory-limit @unsloth".
# Every lorafit row is printed beside every anchor of its shape and P. Results go to $OUT (or
# /tmp) as JSON lines, each lorafit row's stderr to lorafit-ROW-SHAPE-P.err (with $OUT set, the
# .err files of the call go into one errs.tgz, as the GPU machine sends back at most 8 files).
set -u
bin=$1; shift
out=${OUT:-/tmp}
# The shared TRL and Unsloth anchors' tokenizer split their rows' words (scripts/anchor_tokens.py):
# their copies here build the fixed one, or no anchor runs.
[ -d .gpu/anchors ] && { python3 scripts/anchor_tokens.py --fix .gpu/anchors || exit 1; }
: > "$out/lorafit.jsonl"
row=0
for spec in "$@"; do
  row=$((row + 1))
  set -- $spec
  shape=$1; P=$2; R=$3; mode=$4; seg=${5:-auto}; shift 4; [ $# -gt 0 ] && shift; extra="$*"
  segflag=""; [ "$seg" != "auto" ] && segflag="--segment-size $seg"
  if [ "$mode" != "-" ]; then
    for m in ${mode//+/ }; do
      if [ "$m" = unsloth ]; then
        OUT=$out .gpu/anchors/run-unsloth.sh ${UNSLOTH_WHEELS:-.whl/unsA .whl/unsB} "$shape $P $R ${ANCHOR_STEPS:-}" >/dev/null
      else
        OUT=$out .gpu/anchors/run-anchor.sh .gpu/whl "$m $shape $P $R ${ANCHOR_STEPS:-}" >/dev/null
      fi
    done
  fi
  # `@MODE` in the bench flags stands for that anchor's allocator peak on this row (GiB), measured
  # just above: `--memory-limit @unsloth` runs lorafit within Unsloth's own memory.
  while [[ "$extra" =~ @([a-z-]+) ]]; do
    m=${BASH_REMATCH[1]}
    peak=$(python3 -c 'import json,sys
rows=[json.loads(l.split("RESULT ",1)[-1]) for l in open(sys.argv[1]) if l.strip()]
hit=[r for r in rows if r.get("mode")==sys.argv[2] and r.get("arch")==sys.argv[3] and int(r.get("P"))==int(sys.argv[4])]
print(hit[-1]["peak_alloc_gib"] if hit else "")' "$out/anchors.jsonl" "$m" "$shape" "$P" 2>/dev/null)
    [ -n "$peak" ] || { echo "no $m peak for $shape $P in $out/anchors.jsonl: lorafit row skipped"; continue 2; }
    extra=${extra//@$m/$peak}
  done
  "$bin" bench --shape "$shape" --prompt-len "$P" --resp-len "$R" $segflag $extra --device cuda \
    2>"$out/lorafit-$row-$shape-$P.err" | grep '^RESULT' | sed 's/^RESULT //' >> "$out/lorafit.jsonl" \
    || echo "lorafit bench failed for $spec (see $out/lorafit-$row-$shape-$P.err)"
done
python3 - "$out" <<'PY'
import json, sys, os
out = sys.argv[1]
def load(p):
    rows = []
    if os.path.exists(p):
        for line in open(p):
            line = line.strip()
            if line.startswith("RESULT "): line = line[7:]
            if line:
                try: rows.append(json.loads(line))
                except Exception: pass
    return rows
ours = load(f"{out}/lorafit.jsonl"); anchors = load(f"{out}/anchors.jsonl")
def key(r): return (r.get("shape") or r.get("arch"), int(r.get("P") or r.get("prompt_len")))
def plan(r):
    p = f"seg {r['segment_size']}" + (" +attn" if r.get('keep_attention') else "") + \
        (f" +kv{r['keep_kv_layers']}" if r.get('keep_kv_layers') else "") + \
        (f" full{r['full_layers']}" if r.get('full_layers') else "") + \
        (f" mlp{r['mlp_chunk']}" if r.get('mlp_chunk') else "") + (" nested" if r.get('nested') else "") + \
        (" host" if r.get('offload') else "")
    return p + (f" @{r['memory_limit_gib']}G" if r.get('memory_limit_gib') else "")
print(f"{'shape':<9} {'P/R':>11} {'plan':<32} | {'lorafit s':>9} {'GiB':>6} {'MFU':>5} | {'anchor':<13} {'s':>7} {'GiB':>6} | {'speedup':>7} {'mem ratio':>9}")
for r in ours:
    if 'refused' in r:
        print(f"{r['shape']:<9} {str(r['P'])+'/'+str(r['R']):>11} refused: {r['refused']}")
        continue
    matching = [x for x in anchors if key(x) == key(r)] or [None]
    s = r["s_per_step"]; g = r["peak_gib"]
    for a in matching:
        line = f"{r['shape']:<9} {str(r['P'])+'/'+str(r['R']):>11} {plan(r):<32} | {s:>9.3f} {g:>6.1f} {r['mfu']:>5.1%} | "
        if a:
            ast = a.get("s_per_step"); ag = a.get("peak_alloc_gib", a.get("peak_gib"))
            line += f"{a.get('mode','?'):<13} {ast:>7.3f} {ag:>6.1f} | {ast/s:>6.2f}x {g/ag:>9.2f}"
        else:
            line += f"{'-':<13} {'':>7} {'':>6} |"
        print(line)
PY
# The GPU machine sends back at most 8 files from $OUT: the per-run stderr logs go back as one
# archive (errs.tgz) beside the JSON lines.
if [ -n "${OUT:-}" ] && ls "$out"/*.err >/dev/null 2>&1; then
  (cd "$out" && tar czf errs.tgz ./*.err && rm -f ./*.err)
fi
