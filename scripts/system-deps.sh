#!/usr/bin/env bash
# Installs the Debian libraries the MOONCAKE backend's transfer engine loads
# (mooncake-transfer-engine-non-cuda links against them even over TCP):
#   libibverbs1 librdmacm1 libnuma1 liburing2 libnl-3-200 libnl-route-3-200
# Needs apt-get and root (or password-less sudo). Failure is not fatal: every
# other backend works without them, and a daemon configured for MOONCAKE then
# refuses to start with a message naming the missing library.
set -uo pipefail

libs=(libibverbs1 librdmacm1 libnuma1 liburing2 libnl-3-200 libnl-route-3-200)
need=()
for lib in "${libs[@]}"; do
  dpkg-query -W -f='${Status}' "$lib" 2>/dev/null | grep -q "ok installed" || need+=("$lib")
done
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: apt-get not found; cannot install ${need[*]} (the MOONCAKE backend will not load)" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "system-deps: not root and no password-less sudo; cannot install ${need[*]} (the MOONCAKE backend will not load)" >&2
    exit 0
  fi
fi
echo "system-deps: installing ${need[*]} (apt-get, for the MOONCAKE backend)" >&2
export DEBIAN_FRONTEND=noninteractive
# Try without refreshing the package lists first: an up-to-date image needs no network.
if ! $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1; then
  if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"; } >/dev/null; then
    echo "system-deps: apt-get could not install ${need[*]}; the MOONCAKE backend will not load" >&2
  fi
fi
exit 0
