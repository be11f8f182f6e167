#!/usr/bin/env bash
# One device-tool call's worth of GPU work for a change to the device path, most telling
# first, each step under its own time limit so that one stuck step leaves the others' results:
#   1. the device-path tests, on the real cupy and NIXL (tests that need no GPU are skipped
#      or pass there as here), then benchmarks/gpu_rows.py (the row kernel against take);
#   2. benchmarks/gpu_ab.sh: this tree against BASE_DIR's kvxferd, alternating;
#   3. a traced bounce request (benchmarks/gpu_profile.sh TRACE=1 SAMPLE=0): where its time goes;
#   4. `kvxferd demo --memory vram`, with pools shared as CUDA IPC handles, then as VMM fds;
#   5. `kvxferd bench --memory vram --vram-share vmm`;
#   6. scripts/gpu-check.sh (issue 15's check), if the time left allows.
#
# Usage: benchmarks/gpu_session.sh BASE_DIR [OUT_DIR]
#   BASE_DIR: the other tree's kvxferd/, e.g.
#   `mkdir -p .gpu-base && git archive REV kvxferd | tar -x -C .gpu-base` (ignored, carried).
#   Carry .whl (scripts/fetch-gpu-wheels.sh) and BASE_DIR. BUDGET_S (480): step 6 runs only
#   if 110 s of it are left. SKIP: step names not to run (tests rows ab trace demo-ipc
#   demo-vmm bench-vmm gpu-check).
# Writes OUT_DIR/summary.txt (each step's exit and the tables) and OUT_DIR/gpu-session.tar.gz
# (every step's output), within the device tool's limits on what comes back.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
BASE_DIR=${1:?usage: gpu_session.sh BASE_DIR [OUT_DIR]}
OUT_DIR=${2:-${OUT:-gpu-session-out}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(mktemp -d /tmp/gpu-session.XXXXXX)
SUMMARY=$OUT_DIR/summary.txt
BUDGET_S=${BUDGET_S:-480}
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
site=$PYTHONPATH
export PYTHONPATH="$PWD${site:+:$site}"

step() { # step NAME LIMIT_S COMMAND...: runs it, its output in $WORK/NAME.log
  local name=$1 limit=$2 start=$SECONDS rc
  shift 2
  if [[ " ${SKIP:-} " == *" $name "* ]]; then
    echo "== $name: skipped (SKIP)" | tee -a "$SUMMARY"
    return 0
  fi
  timeout -k 5 "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  echo "== $name: exit $rc in $((SECONDS - start)) s" | tee -a "$SUMMARY"
}

: >"$SUMMARY"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader >>"$SUMMARY" 2>&1
step tests 90 "$PY" -m pytest -q -p no:cacheprovider tests/transceiver/test_device_paths.py \
  tests/transceiver/test_poll_pause.py tests/backends/test_nixl_memory.py \
  tests/sim/test_device_content.py tests/transceiver/test_device_rows_gpu.py
tail -n 3 "$WORK/tests.log" >>"$SUMMARY"
step rows 90 "$PY" benchmarks/gpu_rows.py --json "$WORK/rows.json"
cat "$WORK/rows.log" >>"$SUMMARY"
step ab 240 env PASSES="${PASSES:-2}" benchmarks/gpu_ab.sh "$BASE_DIR" "$WORK/ab"
cat "$WORK/ab/summary.txt" >>"$SUMMARY" 2>/dev/null
step trace 100 env TRACE=1 SAMPLE=0 CONFIGS=nixl-python-bounce REQUESTS=100 \
  benchmarks/gpu_profile.sh "$WORK/trace"
head -n 45 "$WORK"/trace/*timeline*.txt >>"$SUMMARY" 2>/dev/null
for share in ipc vmm; do
  step "demo-$share" 90 "$PY" -m kvxferd.cli demo --memory vram --vram-share "$share" \
    --requests 100 --json
  tail -c 1500 "$WORK/demo-$share.log" >>"$SUMMARY"
  echo >>"$SUMMARY"
done
step bench-vmm 120 "$PY" -m kvxferd.cli bench --memory vram --vram-share vmm --tokens 8000 \
  --requests 20 --warmup 3 --configs nixl-python-bounce,nixl-cpp --no-progress --timeout 100
tail -n 25 "$WORK/bench-vmm.log" >>"$SUMMARY"
if ((BUDGET_S - SECONDS >= 110)); then
  step gpu-check 100 env GPU_CHECK_TIMEOUT_S=95 GPU_CHECK_BUDGET_S=85 \
    bash scripts/gpu-check.sh "$WORK/gpu-check"
  grep -A3 '"ratios"' "$WORK/gpu-check/gpu-check.json" >>"$SUMMARY" 2>/dev/null
else
  echo "== gpu-check: skipped, $((BUDGET_S - SECONDS)) s of the budget left" >>"$SUMMARY"
fi
tar -czf "$OUT_DIR/gpu-session.tar.gz" -C "$WORK" . 2>>"$SUMMARY"
echo "== done in $SECONDS s" >>"$SUMMARY"
