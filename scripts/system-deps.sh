#!/usr/bin/env bash
# Installs the Debian libraries the MOONCAKE backend's transfer engine loads
# (mooncake-transfer-engine-non-cuda links against them even over TCP; libcurl4 was
# found missing only when the container image was built from a minimal base). Not fatal:
# every other backend works without them, and a daemon configured for MOONCAKE then
# refuses to start with a message naming the missing library.
exec "$(dirname "$0")/apt-install.sh" \
  "the MOONCAKE backend will not load without them" \
  libibverbs1 librdmacm1 libnuma1 liburing2 libnl-3-200 libnl-route-3-200 libcurl4
