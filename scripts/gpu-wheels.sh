# Sourced by scripts/gpu-check.sh and benchmarks/gpu_env.sh: how the wheels carried to the
# GPU machine are installed there. --no-deps: the carried set is complete by construction
# (scripts/fetch-gpu-wheels.sh), and nixl's declared torch must not be resolved;
# --no-index: the GPU machine has no network.
#
# install_gpu_wheels SITE WHEEL...   (with $PY the Python to install for)
# A site already holding exactly these wheels (names and sizes, in SITE/.kvxferd-wheels) is
# kept: one device call often runs several scripts that each install the same set
# (benchmarks/gpu_session.sh runs gpu_ab.sh, gpu_profile.sh and gpu-check.sh).
install_gpu_wheels() {
  local site=$1 stamp
  shift
  stamp=$(for w in "$@"; do printf '%s %s\n' "$(basename "$w")" "$(wc -c <"$w")"; done | sort)
  if [[ -f $site/.kvxferd-wheels && $(<"$site/.kvxferd-wheels") == "$stamp" ]]; then
    return 0
  fi
  rm -rf "$site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$@" || return
  printf '%s\n' "$stamp" >"$site/.kvxferd-wheels"
}
