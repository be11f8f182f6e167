#!/usr/bin/env bash
# Downloads the cp312 manylinux wheels the GPU machine lacks into .whl/ (git-ignored), strips
# nixl-cu13 to fit the device tool's 64 MiB carry limit, and prints the sizes.
#
# Usage: scripts/fetch-gpu-wheels.sh [--dry-run]     (PYTHON=... picks the pip that downloads)
#
# Run it here, where PyPI is reachable; the GPU machine has no network. It has Python 3.12,
# cupy and torch for CUDA 13, uvloop, PyYAML and prometheus-client, but not NIXL, msgspec or
# pydantic (../shared/GPU.md). scripts/gpu-check.sh installs what lies in .whl/ with
# `pip --no-index --no-deps --target`. The versions are this venv's (pip list), so the check
# runs what the tests here ran; typing-extensions travels because pydantic 2.14 needs >=4.16
# and the GPU machine's own copy is of unknown age. One version of each: pip refuses two.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
WHEELS=(
  nixl-cu13==1.5.1
  msgspec==0.23.0
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
)
# pip matches manylinux_2_N exactly, so every N a wheel of these may carry is named.
PLATFORMS=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$tag")
done
# --no-deps: nixl-cu13 declares torch, which the GPU machine has and which would not fit.
cmd=("$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12
  --implementation cp "${PLATFORMS[@]}" -d .whl "${WHEELS[@]}")

if [[ "${1:-}" == --dry-run ]]; then
  printf '%q ' "${cmd[@]}"
  echo
  exit 0
fi

mkdir -p .whl
# Old versions left beside new ones would stop the install there.
rm -f .whl/*.whl
"${cmd[@]}"

nixl=(.whl/nixl_cu13-*.whl)
[[ -f "${nixl[0]}" ]] || {
  echo "fetch-gpu-wheels: no nixl_cu13 wheel was downloaded" >&2
  exit 1
}
"$PY" scripts/strip_wheel.py "${nixl[0]}"

echo "wheels in .whl/ (bytes):"
du -b .whl/*.whl | sort -n
wheels=$(du -cb .whl/*.whl | tail -n 1 | cut -f 1)
# What travels besides: the tracked tree (untracked files travel too; keep the tree clean).
tree=$( (git ls-files -z | xargs -0 stat -c %s 2>/dev/null || true) | awk '{s += $1} END {print s + 0}')
limit=$((60 * 1024 * 1024))
awk -v w="$wheels" -v t="$tree" 'BEGIN {
  m = 1048576
  printf "wheels %d B (%.1f MiB) + tracked tree %d B (%.1f MiB) = %.1f MiB (limit here 60, device 64)\n",
    w, w / m, t, t / m, (w + t) / m
}'
if ((wheels + tree >= limit)); then
  echo "fetch-gpu-wheels: wheels + tree exceed 60 MiB; strip more (scripts/strip_wheel.py --more)" >&2
  exit 1
fi
