#!/usr/bin/env bash
# Issue 16's no-regression check of the bounce buffer: the fragmented layer-major layout
# (4 KiB segments, 8000 tokens, 1 in flight), per-block path and bounce buffer in one run,
# this tree and BASE alternating (a second worktree: git worktree add /tmp/base0 2c5acb4).
#
#   BASE=/tmp/base0 PASSES=2 benchmarks/issue16_bounce_ab.sh
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
base=${BASE:?set BASE to the other checkout}
py=$here/.venv/bin/python
for p in $(seq 1 "${PASSES:-2}"); do
  trees=("$here" "$base")
  [ $((p % 2)) = 0 ] && trees=("$base" "$here")
  for t in "${trees[@]}"; do
    # PYTHONPATH and the working directory pick the tree (the editable install points here).
    (cd "$t" && PYTHONPATH=$t "$py" -m kvxferd.cli bench --layout layer-major --segment-bytes 4096 \
        --configs nixl-python,nixl-python-bounce --tokens 8000 --requests 10 --in-flight 1 \
        --json --no-progress 2>/dev/null) |
      "$py" -c '
import json, sys
for x in json.load(sys.stdin)["results"]:
    print(sys.argv[1], sys.argv[2], x["config"], "GB/s", round(x["gbps"], 2),
          "vs raw", round(x["ratio_to_raw"], 2), "bounce_vs_per_block", x.get("bounce_vs_per_block"))
' "$p" "$t"
  done
done
