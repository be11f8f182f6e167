#!/usr/bin/env bash
# Installs the system tools some tests use, when they are missing:
#   promtool          (Debian package "prometheus")  - tests/ops checks /metrics with it
#   systemd-analyze   (Debian package "systemd")     - tests/ops verifies deploy/*.service
# Needs apt-get and root (or sudo). Failure is not fatal: the tests that need a
# missing tool skip and say which one; everything else still runs.
set -uo pipefail

need=()
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
  echo "test-deps: apt-get not found; cannot install ${need[*]} (the tests that need them will skip)" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "test-deps: not root and no password-less sudo; cannot install ${need[*]} (the tests that need them will skip)" >&2
    exit 0
  fi
fi

echo "test-deps: installing ${need[*]} (apt-get)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { $SUDO apt-get update -qq \
      && $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"; } >/dev/null; then
  echo "test-deps: apt-get could not install ${need[*]} (offline or no permission?); the tests that need them will skip" >&2
fi
exit 0
