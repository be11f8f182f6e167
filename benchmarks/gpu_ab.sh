#!/usr/bin/env bash
# This tree against another's kvxferd on the GPU path, in one call of the device tool:
# `kvxferd bench --memory vram` for each configuration, alternating base and this tree
# PASSES times, then benchmarks/gpu_ab_summary.py's table (medians per tree; every run's
# ratio is to the bench's own bare NIXL pair of the same run).
#
# Usage: benchmarks/gpu_ab.sh BASE_DIR [OUT_DIR]
#   BASE_DIR holds the other tree's kvxferd/ (for example
#   `mkdir -p .gpu-base && git archive REV kvxferd | tar -x -C .gpu-base`, an ignored folder
#   the device tool carries). PASSES (2), REQUESTS (30), CONFIGS
#   (nixl-python-bounce,nixl-cpp), TOKENS (8000), MEMORY (vram), PYTHON (python3).
# Writes OUT_DIR/<tree>-<pass>.json (the bench's reports) and summary.txt.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
BASE_DIR=$(cd "${1:?usage: gpu_ab.sh BASE_DIR [OUT_DIR]}" && pwd) || exit 3
OUT_DIR=${2:-${OUT:-gpu-ab-out}}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
deps=$PYTHONPATH
for ((pass = 1; pass <= ${PASSES:-2}; pass++)); do
  for tree in base this; do
    [[ $tree == base ]] && root=$BASE_DIR || root=$PWD
    # From the tree's own folder: `python -m` puts the working directory first on sys.path
    # (before PYTHONPATH and an editable install), and the daemons the bench starts inherit it.
    (cd "$root" && PYTHONPATH="$root${deps:+:$deps}" "$PY" -m kvxferd.cli bench --memory "${MEMORY:-vram}" \
      --tokens "${TOKENS:-8000}" --requests "${REQUESTS:-30}" --warmup 3 \
      --configs "${CONFIGS:-nixl-python-bounce,nixl-cpp}" --json --no-progress --timeout 200 \
      >"$OUT_DIR/$tree-$pass.json" 2>"$OUT_DIR/$tree-$pass.err")
    echo "pass $pass $tree: exit $?"
  done
done
"$PY" "$PWD/benchmarks/gpu_ab_summary.py" "$OUT_DIR" | tee "$OUT_DIR/summary.txt"
