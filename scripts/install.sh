#!/usr/bin/env bash
# Creates .venv and installs kvxferd with its backends: NIXL (the default) and UCX.
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
"$VENV/bin/python" -m pip install -q -e ".[dev,ucx]"
"$VENV/bin/python" -c "import nixl_cu12, ucxx, kvxferd; print('kvxferd', kvxferd.__version__, 'installed with NIXL and UCX')"
