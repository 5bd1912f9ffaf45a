#!/bin/bash
# One `lorafit bench` run longer than a device call may last (llama8b at 512K tokens a branch: a
# step of 15-20 minutes against a 10-minute call), run detached across back-to-back calls on a
# warm GPU machine. `start` copies the binary to /tmp/detached (so a later call's carry cannot
# replace it under the run) and starts it in its own process session (setsid), which outlives the
# call; `wait S` waits up to S seconds for it to end, then copies its RESULT line, stderr and
# exit status to $OUT. Call `wait` again in the next call while the run is still going; the
# machine must stay warm in between (its idle release is 30 s), so issue the calls back to back.
#
#   call 1: scripts/detached_bench.sh start .gpu/lorafit --shape llama8b --prompt-len 458752 \
#             --resp-len 65536 --steps 1 --warmup 0 && scripts/detached_bench.sh wait 570
#   call 2: scripts/detached_bench.sh wait 590
set -u
dir=/tmp/detached
out=${OUT:-/tmp}
case "${1:-}" in
  start)
    bin=$2; shift 2
    rm -rf "$dir"; mkdir -p "$dir"
    cp "$bin" "$dir/lorafit"
    setsid bash -c "'$dir/lorafit' bench --device cuda $* > '$dir/out' 2> '$dir/err'; echo \$? > '$dir/rc'" \
      < /dev/null > /dev/null 2>&1 &
    echo "started: lorafit bench $*"
    ;;
  wait)
    limit=${2:-570}
    t0=$(date +%s)
    while [ ! -f "$dir/rc" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 5; done
    cp "$dir/out" "$dir/err" "$out/" 2>/dev/null
    if [ -f "$dir/rc" ]; then
      echo "done: rc $(cat "$dir/rc") after $(( $(date +%s) - t0 )) s of this wait"
      cp "$dir/rc" "$out/"
      grep '^RESULT' "$dir/out"
    else
      echo "still running after $limit s; call 'wait' again in the next call"
    fi
    tail -5 "$dir/err"
    ;;
  *)
    echo "usage: $0 start BIN BENCH_ARGS... | wait SECONDS" >&2
    exit 2
    ;;
esac
