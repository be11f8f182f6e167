#!/usr/bin/env bash
# Creates .venv and installs kvxferd with every backend: NIXL (the default), UCX,
# MPI (mpi4py with the MPICH wheel, which brings mpiexec) and MOONCAKE (the
# CPU-only transfer engine; scripts/system-deps.sh installs the Debian libraries it loads).
# nixl-cu12 is installed with --no-deps: its metadata asks for torch, which pip
# would resolve to a multi-GB CUDA build that NIXL never imports.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q --no-deps 'nixl-cu12>=1.5,<2'
"$VENV/bin/python" -m pip install -q -e ".[dev,ucx,mpi,mooncake,etcd]"
./scripts/system-deps.sh
"$VENV/bin/python" -c "import nixl_cu12, ucxx, mpi4py, aetcd, kvxferd; print('kvxferd', kvxferd.__version__, 'installed with NIXL, UCX, MPI and the etcd client')"
# Mooncake's engine loads system libraries; say so here rather than at the first MOONCAKE run.
"$VENV/bin/python" -c "import mooncake.engine" 2>/dev/null && echo "MOONCAKE backend loads" \
  || echo "MOONCAKE backend does not load here (see scripts/system-deps.sh); every other backend works" >&2
