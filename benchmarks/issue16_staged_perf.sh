#!/usr/bin/env bash
# Issue 16: where a staged run's daemons spend their CPU. perf's software clock (this VM has
# no hardware counters) samples every CPU for 15 s during `kvxferd bench --tokens 8000`, and
# both daemons' samples are sorted into the three copies (memcpy: gather/scatter; the kernel's
# CMA copy), UCX's spinlock, Python and the rest. As root (perf -a); needs Debian's linux-perf.
#
#   benchmarks/issue16_staged_perf.sh                          # nixl-cpp
#   ENVX=UCX_USE_MT_MUTEX=n benchmarks/issue16_staged_perf.sh  # with UCX's spinlock
#   CONF=mpi-cpp benchmarks/issue16_staged_perf.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v perf >/dev/null || { echo "perf not found (apt-get install linux-perf)" >&2; exit 2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
CONF=${CONF:-nixl-cpp}
env ${ENVX:-} .venv/bin/python -m kvxferd.cli bench --configs $CONF --tokens 8000 --requests 10 --no-progress > $TMP/bench.out 2>&1 &
B=$!; for i in $(seq 1 1200); do pgrep -f "bench.engine.*--role generation" >/dev/null && break; sleep 0.1; done; sleep 3
ctx=$(pgrep -f "bench-ctx.yaml"); gen=$(pgrep -f "bench-gen.yaml")
perf record -e cpu-clock -F 999 -a -o $TMP/perf.data -- sleep 15 >/dev/null 2>&1; wait $B
grep -E "^$CONF" $TMP/bench.out
perf script -i $TMP/perf.data -F pid,tid,ip,sym,dso 2>/dev/null > $TMP/perf.txt
python3 - "$ctx" "$gen" "$TMP/perf.txt" <<'PY'
import sys, collections, re
ctx, gen, path = sys.argv[1:4]
cat = collections.Counter(); thr = collections.Counter()
def kind(sym):
    if 'copy_from_iter' in sym or 'process_vm' in sym or 'copy_page' in sym: return 'CMA copy (kernel)'
    if 'memmove' in sym or 'memcpy' in sym: return 'memcpy (gather/scatter, shm FIFO)'
    if 'spin_lock' in sym and 'GLIBC' in sym: return 'pthread_spin_lock'
    if 'python' in sym.lower() or 'PyEval' in sym or 'Py' in sym or 'gc_' in sym: return 'Python'
    if 'kallsyms' in sym: return 'other kernel'
    return 'other user'
for line in open(path):
    parts = line.split(None, 2)
    if len(parts) < 3: continue
    pid = parts[0].split('/')[0]
    if pid not in (ctx, gen): continue
    side = 'context' if pid == ctx else 'generation'
    cat[(side, kind(parts[2]))] += 1
tot = collections.Counter()
for (side, k), n in cat.items(): tot[side] += n
for side in ('context', 'generation'):
    print(f"{side} daemon: {tot[side]} samples")
    for (s, k), n in sorted(cat.items(), key=lambda kv: -kv[1]):
        if s == side: print(f"  {100*n/tot[side]:5.1f}% {k}")
PY
