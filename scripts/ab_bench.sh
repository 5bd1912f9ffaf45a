#!/bin/bash
# Times one `lorafit bench` workload on several builds, one after another in one call on the GPU
# machine (the same card, so the ratios between builds hold), to find the commit that made a
# step slower or faster.
#
# Here, build the commits to compare (each in its own worktree, sharing one target folder, so the
# dependencies compile once; the stripped binary, 10-18 MB, goes xz-compressed, about 5 MB, to
# .gpu/ab/lf-REV.xz, so that one call's 64 MiB carries several):
#
#   scripts/ab_bench.sh --build 8ba6377 a4aed1a HEAD
#
# There, run them with the same bench flags (a build's own extra flags after a colon, commas for
# spaces, for flags that older builds do not know):
#
#   scripts/ab_bench.sh ".gpu/ab/lf-8ba6377.xz .gpu/ab/lf-HEAD.xz:--offload,false" --device cuda \
#     --shape llama8b --prompt-len 14336 --resp-len 2048 --segment-size 1 --keep-attention true \
#     --keep-kv-layers 16 --steps 4 --warmup 1 --also 14336,2048,0
#
# Each build compiles its own kernels on a fresh machine (about a minute, in the first step on
# builds before prepare_modules), and builds before 5cb9bfd draw random weights on the host (about
# 45 s for llama8b): budget 2-3 minutes a build. A build named NAME.xz is decompressed (Python's
# lzma; the GPU machine has no xz) into /tmp first. Rows go to $OUT/ab.jsonl (or /tmp), each
# build's stderr to $OUT/ab-NAME.err (gathered into $OUT/errs.tgz at the end), and a table to
# stdout.
set -u
if [ "${1:-}" = "--build" ]; then
  shift
  set -e
  root=$(git rev-parse --show-toplevel)
  mkdir -p "$root/.gpu/ab"
  for rev in "$@"; do
    sha=$(git -C "$root" rev-parse --short "$rev")
    wt=/tmp/lorafit-ab-$sha
    git -C "$root" worktree remove --force "$wt" 2>/dev/null || rm -rf "$wt"
    git -C "$root" worktree add -f --detach "$wt" "$sha" >/dev/null 2>&1
    (cd "$wt" && CARGO_TARGET_DIR=/tmp/lorafit-ab-target cargo build --release -q)
    strip -o "/tmp/lf-$rev" /tmp/lorafit-ab-target/release/lorafit
    xz -T2 -6 -c "/tmp/lf-$rev" > "$root/.gpu/ab/lf-$rev.xz" && rm "/tmp/lf-$rev"
    git -C "$root" worktree remove --force "$wt"
    echo "$rev ($sha): .gpu/ab/lf-$rev.xz"
  done
  exit 0
fi
builds=$1; shift
out=${OUT:-/tmp}
: > "$out/ab.jsonl"
for spec in $builds; do
  bin=${spec%%:*}; extra=""
  [ "$spec" != "$bin" ] && extra=${spec#*:} && extra=${extra//,/ }
  name=$(basename "$bin" .xz)
  if [ "${bin%.xz}" != "$bin" ]; then
    python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
      "$bin" "/tmp/$name" && chmod +x "/tmp/$name" && bin=/tmp/$name
  fi
  "$bin" bench "$@" $extra 2>"$out/ab-$name.err" | grep '^RESULT' | sed "s/^RESULT {/{\"build\":\"$name\",/" \
    >> "$out/ab.jsonl" || echo "$name: no result (see $out/ab-$name.err)"
done
python3 - "$out/ab.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
first = {}
print(f"{'build':<16} {'P/R':>11} {'seg':>4} {'kv':>4} | {'s/step':>8} {'GiB':>7} {'MFU':>6} | vs first build")
for r in rows:
    k = (r["P"], r["R"], r.get("segment_size"), r.get("keep_kv_layers"))
    base = first.setdefault(k, r["s_per_step"])
    print(f"{r['build']:<16} {str(r['P'])+'/'+str(r['R']):>11} {r.get('segment_size')!s:>4} {r.get('keep_kv_layers')!s:>4} | "
          f"{r['s_per_step']:>8.3f} {r['peak_gib']:>7.2f} {r['mfu']:>6.1%} | {r['s_per_step']/base:.3f}")
PY
# The GPU machine sends back at most 8 files from $OUT: the per-run stderr logs go back as one
# archive (errs.tgz) beside the JSON lines.
if [ -n "${OUT:-}" ] && ls "$out"/*.err >/dev/null 2>&1; then
  (cd "$out" && tar czf errs.tgz ./*.err && rm -f ./*.err)
fi
