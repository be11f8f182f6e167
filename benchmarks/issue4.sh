#!/usr/bin/env bash
# The measurements of docs/benchmarks.md (issue 4): the default sweep, --small at the default
# geometry and --small with small blocks. Writes one JSON object per run (and the sweep's
# plot) into benchmarks/results/<UTC date>/ and prints the tables.
#
# Usage: benchmarks/issue4.sh [extra kvxferd bench options, e.g. --configs nixl-python]
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
from kvxferd.bench.report import format_table
print(format_table(json.load(open(sys.argv[1]))), end="\n\n")
EOF
}

EXTRA="$*"
run sweep --tokens 100,1000,8000 --requests 5 --plot "$out/sweep.png"
run small --small --in-flight 32 --seconds 10
run small-32k --small --in-flight 32 --seconds 10 --layers 2 --kv-heads 2 --head-dim 64
echo "results in $out" >&2
