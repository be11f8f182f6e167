#!/bin/bash
# Issue 16, staged MPI: how promptly the context daemon's event loop answers while MPI's
# progress thread moves payloads (docs/backends-mpi.md, "Progress").
#
# For each checkout given (default: this one; e.g. a `git worktree add` of an older commit),
# runs `kvxferd bench --configs mpi-cpp --tokens 8000 --requests 30` from it and, once the
# context daemon is up, polls its /healthz every 20 ms for 8 s, printing the latency
# percentiles and the bench's GB/s.
#
#   benchmarks/issue16_mpi_loop_latency.sh [TREE ...]
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=$HERE/.venv/bin/python
[ $# -gt 0 ] || set -- "$HERE"
for TREE in "$@"; do
  OUT=$(mktemp)
  before=$(ls -d /tmp/kvxferd-bench.* 2>/dev/null | tr '\n' ' ' || true)
  (cd "$TREE" && PYTHONPATH=$TREE $PY -m kvxferd.cli bench --configs mpi-cpp --tokens 8000 \
      --requests 30 --json --no-progress > "$OUT" 2>/dev/null) &
  bench=$!
  port=""
  for _ in $(seq 240); do
    for d in $(ls -td /tmp/kvxferd-bench.* 2>/dev/null); do
      case " $before " in *" $d "*) continue ;; esac
      port=$(sed -n 's/.*HTTP (health, status) on 127.0.0.1:\([0-9]*\).*/\1/p' \
        "$d/mpi-cpp/bench-ctx.log" 2>/dev/null | head -1 || true)
      break
    done
    [ -n "$port" ] && break
    sleep 0.5
  done
  [ -n "$port" ] || { echo "$TREE: the context daemon never came up" >&2; exit 1; }
  sleep 3  # past start-up, into the transfers
  "$PY" - "$port" "$TREE" <<'PY'
import sys, time, urllib.request
port, tree = sys.argv[1], sys.argv[2]
lat, end = [], time.time() + 8
while time.time() < end:
    t = time.perf_counter()
    urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read()
    lat.append((time.perf_counter() - t) * 1e3)
    time.sleep(0.02)
lat.sort()
p = lambda q: lat[min(len(lat) - 1, int(len(lat) * q))]
print(f"{tree}: /healthz n={len(lat)} p50={p(0.5):.2f} p90={p(0.9):.2f} p99={p(0.99):.2f} max={lat[-1]:.2f} ms")
PY
  wait $bench
  "$PY" -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]; print(f\"  mpi-cpp {r['gbps']:.2f} GB/s\")" "$OUT"
  rm -f "$OUT"
done
