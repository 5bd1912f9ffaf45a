#!/bin/bash
# On the GPU machine: `lorafit train` for 20 ORPO steps on a Qwen2-shaped random model with random
# preference data, once on the CPU and once on CUDA, then the per-step losses side by side.
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
import json, sys
d = sys.argv[1]
L = {dev: [json.loads(l)["loss"] for l in open(f"{d}/run-{dev}/metrics.jsonl") if '"train"' in l] for dev in ("cpu", "cuda")}
worst = max(abs(a - b) / abs(a) for a, b in zip(L["cpu"], L["cuda"]))
print("lorafit train, 20 ORPO steps, Qwen2-shaped random model (4 layers, h256, V512)")
print("  cpu :", " ".join(f"{x:.4f}" for x in L["cpu"]))
print("  cuda:", " ".join(f"{x:.4f}" for x in L["cuda"]))
print(f"  worst relative difference {worst:.3e} (bound 2e-2): {'ok' if worst <= 2e-2 else 'FAIL'}")
PY
