# Sourced by scripts/gpu-check.sh and benchmarks/gpu_env.sh: how the wheels carried to the
# GPU machine are installed there. --no-deps: the carried set is complete by construction
# (scripts/fetch-gpu-wheels.sh), and nixl's declared torch must not be resolved;
# --no-index: the GPU machine has no network.
#
# install_gpu_wheels SITE WHEEL...   (with $PY the Python to install for)
install_gpu_wheels() {
  local site=$1
  shift
  rm -rf "$site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$@"
}
