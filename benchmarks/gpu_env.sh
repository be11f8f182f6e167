# Sourced by the GPU benchmarks (gpu_profile.sh, gpu_ab.sh): installs the carried wheels
# (.whl/ from scripts/fetch-gpu-wheels.sh, .whl-prof/ for py-spy) into /tmp/kvxferd-gpu-site
# when there are any (scripts/gpu-wheels.sh, as scripts/gpu-check.sh), and sets PY, SITE and
# PYTHONPATH.
PY=${PYTHON:-python3}
# Absolute, for scripts that run it from another folder.
[[ $PY == */* ]] && PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")"
SITE=/tmp/kvxferd-gpu-site
shopt -s nullglob
wheels=(.whl/*.whl .whl-prof/*.whl)
shopt -u nullglob
if ((${#wheels[@]} > 0)); then
  # shellcheck source=scripts/gpu-wheels.sh
  source scripts/gpu-wheels.sh
  install_gpu_wheels "$SITE" "${wheels[@]}" || exit 3
  export PYTHONPATH="$SITE"
else
  export PYTHONPATH=""
fi
export PYTHONUNBUFFERED=1
