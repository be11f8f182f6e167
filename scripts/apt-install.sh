#!/usr/bin/env bash
# apt-install.sh WHAT PACKAGE...
# Installs the Debian PACKAGEs that are not installed yet, for WHAT (said in every message).
# Needs apt-get and root (or password-less sudo). Never fatal: whatever cannot be installed
# is reported on stderr, and the callers' features that need it then skip or refuse clearly.
# Tries without refreshing the package lists first: an up-to-date image needs no network.
set -uo pipefail

what=$1
shift
need=()
for pkg in "$@"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || need+=("$pkg")
done
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "apt-install: apt-get not found; cannot install ${need[*]} ($what)" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "apt-install: not root and no password-less sudo; cannot install ${need[*]} ($what)" >&2
    exit 0
  fi
fi
echo "apt-install: installing ${need[*]} ($what)" >&2
export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1; then
  if ! { $SUDO apt-get update -qq \
        && $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"; } >/dev/null; then
    echo "apt-install: apt-get could not install ${need[*]} ($what)" >&2
  fi
fi
exit 0
