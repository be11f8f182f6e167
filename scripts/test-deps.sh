#!/usr/bin/env bash
# Installs the system tools some tests use, when they are missing:
#   promtool          (Debian package "prometheus")  - tests/ops checks /metrics with it
#   systemd-analyze   (Debian package "systemd")     - tests/ops verifies deploy/*.service
#   openssl           (Debian package "openssl")     - the mutual-TLS tests make a test CA
#   etcd, etcdctl     (Debian "etcd-server", "etcd-client") - tests/discovery start a real
#                     etcd on loopback (never as a service: the package starts none)
#   nft, ip, tc       (Debian "nftables", "iproute2")  - tests/cluster make hosts of
#                     network namespaces and drop packets between them (as root only)
# Not fatal: the tests that need a missing tool skip (or fail) and say which one.
need=()
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v etcdctl >/dev/null 2>&1 || need+=(etcd-client)
command -v nft >/dev/null 2>&1 || need+=(nftables)
command -v tc >/dev/null 2>&1 || need+=(iproute2)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
exec "$(dirname "$0")/apt-install.sh" "the tests that need them will skip" "${need[@]}"
