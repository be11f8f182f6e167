#!/usr/bin/env bash
# The measurements of docs/benchmarks.md (issue 7): the staged (CPP) runtime over every
# backend beside the PYTHON runtime over NIXL, in one run (the raw NIXL and memcpy baselines
# are measured in the same run), and the same for different tensor-parallel sizes through
# the demo. Writes JSON into benchmarks/results/<UTC date>/ and prints the tables.
#
# Usage: benchmarks/issue7.sh [extra kvxferd bench options]    TAG=pass2 to keep several runs
# Run it on a quiet machine: every other process competes for the same cores.
set -euo pipefail
cd "$(dirname "$0")/.."
kvxferd=${KVXFERD:-.venv/bin/kvxferd}
python=${PYTHON:-.venv/bin/python}
out=benchmarks/results/$(date -u +%Y-%m-%d)
tag=${TAG:+-$TAG}
mkdir -p "$out"

echo "== kvxferd bench: every backend under the staged runtime, beside nixl-python" >&2
# shellcheck disable=SC2086,SC2048
"$kvxferd" bench --tokens 1000,8000 --requests 3 --no-progress \
    --configs nixl-python,nixl-cpp,ucx-cpp,mpi-cpp,mooncake-cpp $* --json \
    >"$out/staged-backends$tag.json"
"$python" - "$out/staged-backends$tag.json" <<'PY'
import json, sys
from kvxferd.bench.report import format_table
print(format_table(json.load(open(sys.argv[1]))), end="\n\n")
PY

# Split and merge on the PYTHON runtime's per-block path, then through the staged buffers.
for runtime in PYTHON CPP; do
    for tp in "1 1" "2 1" "1 2"; do
        set -- $tp
        echo "== kvxferd demo --ctx-tp $1 --gen-tp $2 --runtime $runtime" >&2
        "$kvxferd" demo --ctx-tp "$1" --gen-tp "$2" --runtime "$runtime" --requests 40 \
            --max-tokens 2000 --json >"$out/demo-$runtime-tp$1-to-$2$tag.json"
        "$python" -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], {k: d[k] for k in ("requests","verified","failed","gbps","p50_ms","p99_ms")})' \
            "$out/demo-$runtime-tp$1-to-$2$tag.json" "$runtime tp $1 -> $2"
    done
done
echo "results in $out" >&2
