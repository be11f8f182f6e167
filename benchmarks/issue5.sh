#!/usr/bin/env bash
# The measurements of docs/benchmarks.md for issue 5: the fragmented layer-major layout with
# and without the bounce buffer (4 KiB and 16 KiB segments, 1, 2 and 4 requests in flight),
# and --pipeline-compare. Writes one JSON object per run into benchmarks/results/<UTC date>/
# and prints the tables.
#
# Usage: benchmarks/issue5.sh [extra kvxferd bench options, e.g. --requests 20]
# Run it on a quiet machine: every other process competes for the same cores.
set -euo pipefail
cd "$(dirname "$0")/.."
kvxferd=${KVXFERD:-.venv/bin/kvxferd}
python=${PYTHON:-.venv/bin/python}
out=benchmarks/results/$(date -u +%Y-%m-%d)
mkdir -p "$out"

run() {
    local name=$1
    shift
    echo "== kvxferd bench $* $EXTRA" >&2
    # shellcheck disable=SC2086
    "$kvxferd" bench "$@" $EXTRA --json >"$out/$name.json"
    "$python" - "$out/$name.json" <<'EOF'
import json, sys
from kvxferd.bench import fragmented, pipeline, report
r = json.load(open(sys.argv[1]))
if r["mode"] == pipeline.MODE:
    print(pipeline.format_table(r), end="\n\n")
else:
    print("\n".join([report.format_table(r), *fragmented.summary_lines(r)]), end="\n\n")
EOF
}

EXTRA="$*"
BOUNCE=(--layout layer-major --configs nixl-python,nixl-python-bounce --tokens 1000,8000
        --requests 10)
for seg in 4096 16384; do
    for n in 1 2 4; do
        run "fragmented-$seg-if$n" "${BOUNCE[@]}" --segment-bytes "$seg" --in-flight "$n"
    done
done
run pipeline --pipeline-compare --tokens 1000,8000 --chunk-tokens 512 --compute-ms 50 \
    --requests 10
echo "results in $out" >&2
