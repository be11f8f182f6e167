#!/usr/bin/env bash
# Issue 16, huge pages: nixl-python at 8000 tokens with every host pool (the engines' and
# the raw NIXL pair's) on 4 KiB pages, on hugetlb pages, and on transparent huge pages,
# in alternating passes (the host is shared and noisy: only ratios of one run count, and
# their spread over passes). One JSON per run into benchmarks/results/<date>/ and a summary
# (medians and ranges) on stdout.
#
# Usage (as root, for the hugetlb reservation and the THP switch):
#   benchmarks/issue16_hugepages.sh [PASSES] [extra kvxferd bench options]
# FIRST=N numbers the passes from N (to add passes to a directory of earlier ones).
# hugetlb: `--huge-pages reserve` reserves the pages, lets the host settle (20 s) and
# restores vm.nr_hugepages itself.
# THP: shmem_enabled is set to `advise` for that run only and put back at once (and on exit).
# Without root the hugetlb and THP runs fail with the reason; the 4 KiB runs still count.
set -euo pipefail
cd "$(dirname "$0")/.."
kvxferd=${KVXFERD:-.venv/bin/kvxferd}
python=${PYTHON:-.venv/bin/python}
out=benchmarks/results/$(date -u +%Y-%m-%d)/issue16_hugepages
mkdir -p "$out"
passes=${1:-4}
shift || true
extra="$*"
shmem=/sys/kernel/mm/transparent_hugepage/shmem_enabled
shmem_before=$(sed 's/.*\[\(.*\)\].*/\1/' "$shmem" 2>/dev/null || echo "")
restore() { [ -n "$shmem_before" ] && echo "$shmem_before" >"$shmem" 2>/dev/null || true; }
trap restore EXIT

bench() {  # NAME OPTIONS...
    local name=$1
    shift
    echo "== $(date -u +%H:%M:%S) $name: kvxferd bench $* $extra (load $(cut -d' ' -f1 /proc/loadavg))" >&2
    # shellcheck disable=SC2086
    "$kvxferd" bench --configs nixl-python --tokens 8000 --requests 5 --no-progress --json \
        "$@" $extra >"$out/$name.json" 2>"$out/$name.err" || echo "   failed: $(tail -1 "$out/$name.err")" >&2
}

first=${FIRST:-1}
for pass in $(seq "$first" $((first + passes - 1))); do
    bench "p$pass-4k"
    bench "p$pass-hugetlb" --huge-pages reserve
    if echo advise >"$shmem" 2>/dev/null; then
        bench "p$pass-thp" --huge-pages auto
        restore
    fi
done

"$python" benchmarks/issue16_summary.py "$out"
