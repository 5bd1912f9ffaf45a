#!/bin/bash
# On the GPU machine: `lorafit train` for 20 ORPO steps on a Qwen2-shaped random model with random
# preference data, once on the CPU and once on CUDA, then the per-step losses side by side.
# Exits non-zero when a run fails, when either run logged other than 20 steps, or when a step's
# losses differ by more than the bound (NaN never passes).
#   scripts/cuda_train_check.sh LORAFIT_BIN
set -eu
bin=$1; dir=${OUT:-/tmp}/randmodel
python3 scripts/make_random_model.py "$dir" >/dev/null
for dev in cpu cuda; do
  "$bin" train --model "$dir" --data "$dir/train.jsonl" --device $dev --steps 20 --lr 1e-3 \
    --output "$dir/run-$dev" --set save_every=0 --set segment_size=2 >/dev/null 2>"$dir/train-$dev.log" \
    || { echo "train on $dev failed:"; tail -5 "$dir/train-$dev.log"; exit 1; }
done
python3 - "$dir" <<'PY'
import json, math, sys
d, steps, bound = sys.argv[1], 20, 2e-2
L = {dev: [json.loads(l)["loss"] for l in open(f"{d}/run-{dev}/metrics.jsonl") if '"train"' in l] for dev in ("cpu", "cuda")}
diffs = [abs(a - b) / abs(a) for a, b in zip(L["cpu"], L["cuda"])]
# max() skips a NaN that is not first; a NaN difference is the worst one.
worst = max(diffs, key=lambda x: (math.isnan(x), x), default=math.nan)
ok = len(L["cpu"]) == len(L["cuda"]) == steps and all(x <= bound for x in diffs)
print("lorafit train, 20 ORPO steps, Qwen2-shaped random model (4 layers, h256, V512)")
print("  cpu :", " ".join(f"{x:.4f}" for x in L["cpu"]))
print("  cuda:", " ".join(f"{x:.4f}" for x in L["cuda"]))
print(f"  steps logged: cpu {len(L['cpu'])}, cuda {len(L['cuda'])} (want {steps})")
print(f"  worst relative difference {worst:.3e} (bound {bound:.0e}): {'ok' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
