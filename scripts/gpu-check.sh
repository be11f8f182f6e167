#!/usr/bin/env bash
# The GPU check of issue 15 (docs/benchmarks.md, "GPU check"): device copy rates, bare NIXL
# VRAM->VRAM, foreign (IPC / VMM) memory with NIXL, and kvxferd bench --memory vram, in one
# run of at most ~8 minutes on one GPU, with no network.
#
# Usage: scripts/gpu-check.sh [OUT_DIR] [gpucheck options, e.g. --steps device_copy,kvxferd_bench]
#   OUT_DIR defaults to $GPU_CHECK_OUT, then $OUT (the device tool's), then gpu-check-out/.
#   PYTHON (default python3), GPU_CHECK_TIMEOUT_S (480), GPU_CHECK_BUDGET_S (450),
#   GPU_CHECK_SITE (where the wheels are installed, default /tmp/kvxferd-gpu-site),
#   GPU_CHECK_WHEELS (the folder of wheels, default .whl).
#
# Writes OUT_DIR/gpu-check.json (rewritten after every step), gpu-check.log (this output) and
# gpu-check-logs.tar.gz (each probe's own output). Exit status: 0 every criterion passed,
# 1 all measured and a criterion failed, 2 incomplete (a step skipped or broke; no GPU here),
# 3 the wheels in .whl/ did not install, 124 the whole check ran out of time (the JSON holds
# every step finished before).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3

OUT_DIR=${1:-${GPU_CHECK_OUT:-${OUT:-gpu-check-out}}}
(($# > 0)) && shift
mkdir -p "$OUT_DIR" || exit 3
OUT_DIR=$(cd "$OUT_DIR" && pwd)
LOG="$OUT_DIR/gpu-check.log"
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/kvxferd-gpu-site}
WHEELS_DIR=${GPU_CHECK_WHEELS:-.whl}

shopt -s nullglob
wheels=("$WHEELS_DIR"/*.whl)
shopt -u nullglob
if ((${#wheels[@]} > 0)); then
  echo "gpu-check: installing ${#wheels[@]} wheels from $WHEELS_DIR/ into $SITE" | tee "$LOG"
  # shellcheck source=scripts/gpu-wheels.sh
  source scripts/gpu-wheels.sh
  if ! install_gpu_wheels "$SITE" "${wheels[@]}" 2>&1 | tee -a "$LOG"; then
    echo "gpu-check: the wheels in $WHEELS_DIR/ did not install (see above)" | tee -a "$LOG" >&2
    exit 3
  fi
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  # Without wheels the Python's own packages must do (this is how the CPU tests run it).
  echo "gpu-check: no $WHEELS_DIR/*.whl; using $PY's own packages" | tee "$LOG"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

export PYTHONUNBUFFERED=1
# The outer timeout is a backstop; the driver keeps its own budget a little inside it and
# writes the JSON after every step, so a kill still leaves the finished steps behind.
timeout -k 10 "${GPU_CHECK_TIMEOUT_S:-480}" "$PY" -m kvxferd.bench.gpucheck \
  --out "$OUT_DIR" --budget-s "${GPU_CHECK_BUDGET_S:-450}" "$@" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "gpu-check: exit $rc; results in $OUT_DIR/gpu-check.json" | tee -a "$LOG"
exit "$rc"
