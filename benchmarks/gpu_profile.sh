#!/usr/bin/env bash
# Where a `kvxferd bench --memory vram` request's time goes: py-spy samples both daemons and
# both bench engines (wall clock, idle included, every thread) while the bench runs one
# configuration at a time. Made for one short call on the GPU machine (docs/benchmarks.md,
# "GPU check"); `MEMORY=host` runs the same here, which is how the script itself is tried.
#
# Usage: benchmarks/gpu_profile.sh [OUT_DIR]
#   CONFIGS (nixl-python-bounce,nixl-cpp), REQUESTS (150), SECONDS_SAMPLED (5), RATE (1000),
#   MEMORY (vram), PYTHON (python3), SAMPLE (1; 0: no py-spy), TRACE (0; 1: every process
#   also notes when chosen kvxferd functions begin and end, benchmarks/trace_hooks, and
#   <config>-timeline.txt lines them up per request, benchmarks/trace_timeline.py).
#   Wheels: .whl/*.whl (scripts/fetch-gpu-wheels.sh) and the py-spy wheel in .whl-prof/ are
#   installed into /tmp/kvxferd-gpu-site when present (benchmarks/gpu_env.sh).
# Writes OUT_DIR/<config>-bench.json (the bench's report), <config>-<process>.txt (py-spy's
# raw collapsed stacks, one line per stack with its sample count) and summary.txt
# (benchmarks/gpu_profile_summary.py of them, when it ran).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 3
OUT_DIR=${1:-${OUT:-gpu-profile-out}}
mkdir -p "$OUT_DIR"
# shellcheck source=benchmarks/gpu_env.sh
source benchmarks/gpu_env.sh
SPY=$SITE/bin/py-spy
[[ -x $SPY ]] || SPY=$(command -v py-spy || echo "$(dirname "$PY")/py-spy")
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# The first pid whose command line matches $1 (pgrep -f), waiting up to 90 s for it.
find_pid() {
  local deadline=$((SECONDS + 90)) pid
  while ((SECONDS < deadline)); do
    pid=$(pgrep -f -- "$1" | head -n 1)
    [[ -n $pid ]] && { echo "$pid"; return 0; }
    sleep 0.1
  done
  return 1
}

# py-spy on both daemons and both engines of configuration $1 while its requests run.
sample() {
  local cfg=$1 name spies=() ctx_engine gen_engine ctx_daemon gen_daemon
  # The raw NIXL pair runs first; the daemons' engines start after it.
  if ! gen_engine=$(find_pid "kvxferd.bench.engine.*--role generation"); then
    echo "$cfg: no generation engine appeared" >&2
    return
  fi
  ctx_engine=$(find_pid "kvxferd.bench.engine.*--role context")
  ctx_daemon=$(find_pid "kvxferd.cli run --config .*/$cfg/bench-ctx.yaml")
  gen_daemon=$(find_pid "kvxferd.cli run --config .*/$cfg/bench-gen.yaml")
  sleep 1 # past the warm-up requests
  for name in ctx_daemon gen_daemon ctx_engine gen_engine; do
    "$SPY" record --pid "${!name}" --idle --threads --nonblocking --rate "${RATE:-1000}" \
      --duration "${SECONDS_SAMPLED:-5}" --format raw \
      --output "$OUT_DIR/$cfg-$name.txt" >"$OUT_DIR/$cfg-$name.spy.log" 2>&1 &
    spies+=($!)
  done
  wait "${spies[@]}"
}

IFS=, read -r -a configs <<<"${CONFIGS:-nixl-python-bounce,nixl-cpp}"
for cfg in "${configs[@]}"; do
  trace=()
  if [[ ${TRACE:-0} == 1 ]]; then
    rm -rf "$OUT_DIR/trace-$cfg"
    trace=(env "KVXFERD_TRACE_DIR=$OUT_DIR/trace-$cfg" "PYTHONPATH=$PWD/benchmarks/trace_hooks:$PYTHONPATH")
  fi
  "${trace[@]}" "$PY" -m kvxferd.cli bench --memory "${MEMORY:-vram}" --tokens 8000 \
    --requests "${REQUESTS:-150}" --warmup 3 --configs "$cfg" --json --no-progress \
    --timeout 200 >"$OUT_DIR/$cfg-bench.json" 2>"$OUT_DIR/$cfg-bench.err" &
  bench=$!
  if [[ ${SAMPLE:-1} != 0 ]]; then
    sample "$cfg"
  fi
  wait "$bench"
  echo "$cfg: bench exit $?"
  if [[ ${TRACE:-0} == 1 ]]; then
    "$PY" benchmarks/trace_timeline.py "$OUT_DIR/trace-$cfg" >"$OUT_DIR/$cfg-timeline.txt" 2>&1
    cat "$OUT_DIR/$cfg-timeline.txt"
  fi
done
"$PY" benchmarks/gpu_profile_summary.py "$OUT_DIR" >"$OUT_DIR/summary.txt" 2>&1
cat "$OUT_DIR/summary.txt"
