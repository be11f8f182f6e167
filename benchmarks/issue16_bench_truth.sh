#!/usr/bin/env bash
# Issue 16: each backend against its own bare transport, in the same run.
#
# PASSES passes (default 3) of `kvxferd bench --tokens 8000`, one run per configuration
# (the order rotated each pass, so no configuration always runs first or last), then
# `--small` for nixl-python at 1 and 32 in flight (32 KiB blocks), alternating which goes
# first. Each run's JSON and table land in $OUT/issue16_bench_truth_*; the summary
# (median and range per configuration over the passes) in issue16_bench_truth_summary.txt.
#
#   PASSES=5 REQUESTS=3 benchmarks/issue16_bench_truth.sh
#   PARTS=sweep benchmarks/issue16_bench_truth.sh        # or PARTS=small
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PASSES=${PASSES:-3}
REQUESTS=${REQUESTS:-3}
SECONDS_SMALL=${SECONDS_SMALL:-8}
PARTS=${PARTS:-"sweep small"}
OUT=${OUT:-benchmarks/results/$(date -u +%F)}
mkdir -p "$OUT"
configs=(nixl-python nixl-cpp ucx-cpp mpi-cpp mooncake-cpp)

run() {  # run NAME ARGS...: one bench run, JSON and table kept; a failed run is tried
  local name=$1; shift  # once more, then recorded in $OUT/$name.failed and skipped
  for attempt in 1 2; do
    echo "== $name: kvxferd bench $* (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
    if timeout 600 "$PY" -m kvxferd.cli bench "$@" --json --no-progress > "$OUT/$name.json" \
        2> "$OUT/$name.err"; then
      rm -f "$OUT/$name.err" "$OUT/$name.failed"
      "$PY" -c 'import json, sys; from kvxferd.bench.report import format_table
print(format_table(json.load(open(sys.argv[1]))))' "$OUT/$name.json" | tee "$OUT/$name.txt"
      return 0
    fi
    echo "   attempt $attempt failed: $(grep -m1 -E 'error|Error' "$OUT/$name.err")" >&2
    { echo "attempt $attempt:"; tail -c 3000 "$OUT/$name.err"; } >> "$OUT/$name.failed"
    rm -f "$OUT/$name.json"
  done
  rm -f "$OUT/$name.err"
}

for pass in $(seq 1 "$PASSES"); do
  if [[ " $PARTS " == *" sweep "* ]]; then
    n=${#configs[@]}; k=$(( (pass - 1) % n ))
    order=("${configs[@]:k}" "${configs[@]:0:k}")
    # One run per configuration (raw NIXL, its bare pair, then itself): each stays well
    # under 10 minutes on a loaded host, and its ratios come from one run.
    for c in "${order[@]}"; do
      run "issue16_bench_truth_pass${pass}_$c" --tokens 8000 --requests "$REQUESTS" --warmup 1 \
        --configs "$c"
    done
  fi
  if [[ " $PARTS " == *" small "* ]]; then
    for f in $( ((pass % 2)) && echo "1 32" || echo "32 1"); do
      run "issue16_bench_truth_small${f}_pass$pass" --small --in-flight "$f" \
        --seconds "$SECONDS_SMALL" --layers 2 --kv-heads 2 --head-dim 64 --configs nixl-python
    done
  fi
done

"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/issue16_bench_truth_summary.txt"
import glob, json, statistics, sys
out = sys.argv[1]

def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):  # a run still being written, or one that failed
        return {"results": [], "bare": [], "host": {"loadavg_start": [float("nan")]}}

def spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.3g} ({min(values):.3g}-{max(values):.3g}, n={len(values)})"

rows = {}
for path in sorted(glob.glob(f"{out}/issue16_bench_truth_pass*.json")):
    for r in load(path)["results"]:
        rows.setdefault(r["config"], []).append(r)
print("8000 tokens: median (range, passes)")
for config, rs in rows.items():
    print(f"  {config:<13} bare {rs[0]['bare']:<16} GB/s {spread([r['gbps'] for r in rs])}"
          f"  bare GB/s {spread([r['bare_gbps'] for r in rs])}"
          f"  vs bare {spread([r['ratio_to_bare'] for r in rs])}"
          f"  vs raw NIXL {spread([r['ratio_to_raw'] for r in rs])}"
          f"  CPU s/GB {spread([r['cpu_s_per_gb'] for r in rs])}")
bare = {}
for path in sorted(glob.glob(f"{out}/issue16_bench_truth_pass*.json")):
    for b in load(path).get("bare", []):
        bare.setdefault(b["bare"], []).append(b)
for name, bs in bare.items():
    print(f"  bare {name:<16} rounds {bs[0]['round_blocks']} blocks, CPU s/GB "
          f"{spread([b['cpu_s_per_gb'] for b in bs])}")
for f in (1, 32):
    rs = [r for p in sorted(glob.glob(f"{out}/issue16_bench_truth_small{f}_pass*.json")) for r in load(p)["results"][:1]]
    if rs:
        print(f"--small, {f} in flight: req/s {spread([r['requests_per_s'] for r in rs])}"
              f"  bare req/s {spread([r['bare_requests_per_s'] for r in rs])}"
              f"  vs bare rate {spread([r['ratio_to_bare_rate'] for r in rs])}"
              f"  p50 - bare ms {spread([r['p50_minus_bare_ms'] for r in rs])}"
              f"  CPU ms/req {spread([r['cpu_ms_per_request'] for r in rs])}")
loads = [load(p)["host"]["loadavg_start"][0]
         for p in sorted(glob.glob(f"{out}/issue16_bench_truth_*pass*.json"))]
print(f"load average at the starts: {min(loads):.1f}-{max(loads):.1f}")
PYEOF
