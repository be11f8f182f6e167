#!/usr/bin/env bash
# Issue 16, small requests: does placing the bench's four processes on the host's cores move
# the rate? Runs `kvxferd bench --small` (32 KiB blocks, 32 in flight) and, as soon as its two
# engines exist, pins every thread of the four processes with taskset:
#   none   the kernel places them (as every other run);
#   pairs  each engine with its own daemon (context pair on CPU 0, generation pair on CPU 1):
#          an engine's and its daemon's wake-ups of each other stay on one core;
#   cross  each daemon with the other side's engine (the daemons on different cores).
# Needs a host with exactly two cores (CPU 0 and 1). Modes alternate within each pass; one
# line per run: mode, kvxferd req/s, bare req/s, ratio, daemons' and engines' CPU ms per
# request, cores busy. The bare pair's run comes first and is never pinned.
#
#   benchmarks/issue16_small_pinning.sh [PASSES] [MODES...]     (default: 3 none pairs cross)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PASSES=${1:-3}
shift || true
if [ $# -gt 0 ]; then MODES=("$@"); else MODES=(none pairs cross); fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

pin() {  # pin PID CPU_MASK: every thread of PID
  taskset -a -p "$2" "$1" >/dev/null
}

one() {
  local mode=$1 json=$out/$1.json
  "$PY" -m kvxferd.cli bench --configs nixl-python --small --layers 2 --kv-heads 2 \
    --head-dim 64 --in-flight 32 --seconds 8 --json --no-progress >"$json" 2>"$out/err" &
  local bench=$!
  for _ in $(seq 1200); do
    [ "$(pgrep -f kvxferd.bench.engine | wc -l)" = 2 ] && break
    sleep 0.1
  done
  local cd gd ce ge
  cd=$(pgrep -f bench-ctx.yaml) gd=$(pgrep -f bench-gen.yaml)
  ce=$(pgrep -f "role context") ge=$(pgrep -f "role generation")
  case $mode in
    pairs) pin "$cd" 1; pin "$ce" 1; pin "$gd" 2; pin "$ge" 2 ;;
    cross) pin "$cd" 1; pin "$ge" 1; pin "$ce" 2; pin "$gd" 2 ;;
    none) ;;
    *) echo "unknown mode $mode" >&2; kill "$bench"; exit 2 ;;
  esac
  wait "$bench" || { cat "$out/err" >&2; exit 1; }
  "$PY" - "$mode" "$json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[2]))["results"][0]
print(f"{sys.argv[1]:6} {r['requests_per_s']:7.0f} req/s  bare {r['bare_requests_per_s']:7.0f}  "
      f"{r['ratio_to_bare_rate']:.3f}x  daemons {r['cpu_ms_per_request']:.3f} ms/req  "
      f"engines {r['engines_cpu_ms_per_request']:.3f} ms/req  cores busy {r['cores_busy']:.2f}")
EOF
}

for _ in $(seq "$PASSES"); do
  for mode in "${MODES[@]}"; do one "$mode"; done
done
