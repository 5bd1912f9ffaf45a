#!/bin/bash
# On the GPU machine: the trainer's retry of a step the device runs out of memory for. A random
# Qwen2-shaped model with long prompts trains 4 steps three times: every activation kept
# (segment_size 0: its peak P0), segment size 1 (P1), and on the automatic plan under an allocator
# cap halfway between (LORAFIT_DEVICE_CAP_GIB; the planner still reads the whole card as free, so
# it picks segment 0 and the first step runs out of memory). The capped run must say it retried,
# finish its 4 steps on a smaller plan with every step's peak under the cap, and give the
# uncapped runs' losses (relative bound 2e-2, the CUDA trainer's bf16 bound).
#   scripts/oom_retry_check.sh LORAFIT_BIN
set -eu
bin=$1; dir=${OUT:-/tmp}/oomcheck
python3 scripts/make_random_model.py "$dir" 300-400 >/dev/null
run() { # name, extra flags...
  local name=$1; shift
  "$bin" train --model "$dir" --data "$dir/train.jsonl" --device cuda --steps 4 --lr 1e-3 \
    --output "$dir/run-$name" --set save_every=0 --set max_seq_len=1024 --set max_prompt_len=512 "$@" \
    >/dev/null 2>"$dir/train-$name.log" || { echo "train $name failed:"; tail -5 "$dir/train-$name.log"; exit 1; }
}
peak() { python3 -c "import json,sys; print(max(json.loads(l)['peak_bytes'] for l in open(sys.argv[1])))" "$dir/run-$1/timing.jsonl"; }
run seg0 --set segment_size=0
run seg1 --set segment_size=1
p0=$(peak seg0); p1=$(peak seg1)
cap=$(python3 -c "print(($p0 + $p1) / 2 / 2**30)")
LORAFIT_DEVICE_CAP_GIB=$cap run capped
python3 - "$dir" "$p0" "$p1" "$cap" <<'PY'
import json, sys
d, p0, p1, cap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]) * 2**30
loss = lambda n: [json.loads(l)["loss"] for l in open(f"{d}/run-{n}/metrics.jsonl") if '"train"' in l]
timing = [json.loads(l) for l in open(f"{d}/run-capped/timing.jsonl")]
log = open(f"{d}/train-capped.log").read()
said = [l for l in log.splitlines() if "out of device memory" in l]
ref, got = loss("seg0"), loss("capped")
worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
peaks = [t["peak_bytes"] for t in timing]
plans = [t["pass"]["segment_size"] for t in timing]
ok = len(said) >= 1 and len(got) == 4 and worst <= 2e-2 and max(peaks) <= cap and plans[0] > 0
print(f"peaks: segment 0 {p0/2**20:.1f} MiB, segment 1 {p1/2**20:.1f} MiB, cap {cap/2**20:.1f} MiB")
print("retry said:", said[0] if said else "nothing")
print(f"capped run: {len(got)} steps, segment sizes {plans}, peaks {[round(p/2**20,1) for p in peaks]} MiB")
print(f"losses seg0 {[round(x,4) for x in ref]} capped {[round(x,4) for x in got]}; worst relative difference {worst:.2e}")
print("ok" if ok else "FAIL")
sys.exit(0 if ok else 1)
PY
