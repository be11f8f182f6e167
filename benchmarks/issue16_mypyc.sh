#!/usr/bin/env bash
# Issue 16, small requests: what the daemons' per-request Python costs, measured by taking
# the interpreter out of their hot path. A worktree of REV (default HEAD) gets the modules
# below compiled to C extensions with mypyc (part of mypy, in .venv; needs gcc and the
# Python headers), and `issue16_small.py` runs this tree (interpreted) and that worktree
# ("mypyc") in the same alternating passes. PYTHONPATH puts the worktree, its extension
# modules and mypyc's runtime library first on the path of every process the bench starts.
#
#   PASSES=3 SECONDS_PER_RUN=6 IN_FLIGHT="32" benchmarks/issue16_mypyc.sh
#   MODULES="kvxferd/peers/framing.py ..." KEEP=1 REV=HEAD benchmarks/issue16_mypyc.sh
#
# This is an experiment, not a build of kvxferd: the test suite does not run against
# compiled modules (docs/benchmarks.md, issue 16, "the daemons with their hot modules
# compiled (mypyc)" says what breaks there).
# Left out: kvxferd/transceiver/dataplane.py (its attribute `_inline` becomes the C name
# `__inline`, a GCC keyword) and the engine client (kvxferd/client/*: StampingClient in
# kvxferd/bench/engine.py subclasses AsyncClient, which a compiled class forbids unless it
# is marked for it; the engines' CPU did not move when it was compiled).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
py=$here/.venv/bin/python
rev=${REV:-HEAD}
default_modules="
  kvxferd/transceiver/legs.py kvxferd/transceiver/leg_targets.py kvxferd/transceiver/plan.py
  kvxferd/transceiver/sessions.py kvxferd/transceiver/postguard.py
  kvxferd/transceiver/rx_table.py kvxferd/transceiver/sender.py
  kvxferd/transceiver/receiver.py kvxferd/transceiver/writes.py kvxferd/transceiver/direct.py
  kvxferd/transceiver/direct_bounce.py kvxferd/transceiver/direct_rx.py
  kvxferd/transceiver/context_legs.py kvxferd/transceiver/tx_matching.py
  kvxferd/transceiver/tx_chunks.py kvxferd/transceiver/loans.py
  kvxferd/transceiver/admission.py kvxferd/transceiver/wake.py
  kvxferd/peers/framing.py kvxferd/peers/channel.py kvxferd/backends/nixl_prepared.py
  kvxferd/service/engine_calls.py kvxferd/service/peer_routes.py
  kvxferd/service/loop_histogram.py kvxferd/api/server.py"
modules=${MODULES:-$default_modules}
work=$(mktemp -d /tmp/kvxferd-mypyc.XXXXXX)
tree=$work/tree
cleanup() {
  if [ -z "${KEEP:-}" ]; then
    git -C "$here" worktree remove --force "$tree" 2>/dev/null || true
    rm -rf "$work"
  else
    echo "kept the compiled worktree: $tree" >&2
  fi
}
trap cleanup EXIT
git -C "$here" worktree add --detach "$tree" "$rev" >/dev/null
# shellcheck disable=SC2086  # one word per module
(cd "$tree" && "$here/.venv/bin/mypyc" $modules > "$work/mypyc.log" 2>&1) || {
  tail -30 "$work/mypyc.log" >&2
  exit 1
}
compiled=$(find "$tree/kvxferd" -name '*.so' | wc -l)
echo "mypyc: $compiled extension modules in $tree (REV $(git -C "$tree" rev-parse --short HEAD))" >&2
# A compiled module is what the daemon imports: check one before measuring anything.
(cd "$tree" && PYTHONPATH=$tree "$py" -c '
import kvxferd.transceiver.sessions as m, sys
sys.exit(0 if m.__file__.endswith(".so") else f"not compiled: {m.__file__}")')
# shellcheck disable=SC2086  # in-flight counts, one word each
"$py" "$here/benchmarks/issue16_small.py" --passes "${PASSES:-3}" \
  --in-flight ${IN_FLIGHT:-32} --seconds "${SECONDS_PER_RUN:-6}" \
  --base "$tree" --base-name mypyc "$@"
