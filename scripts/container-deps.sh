#!/usr/bin/env bash
# Installs what the container tests (tests/container) and scripts/container-build.sh use,
# when it is missing: podman and buildah (build and run the image, pods, `podman kube
# play`), runc (crun refuses hybrid cgroups), mmdebstrap (a local base image made from
# Debian packages, where Docker Hub cannot be reached), umoci and skopeo (image
# inspection), fuse-overlayfs, slirp4netns and uidmap (podman's storage, networking and
# user namespaces), catatonit (the pause process of every pod: podman builds its pause
# image locally from it). See ../shared/CONTAINERS.md for why each one is needed here.
# Idempotent (nothing happens when all are installed) and never fatal: what cannot be
# installed is said on stderr, and the container tests then skip and say why.
set -euo pipefail
cd "$(dirname "$0")"
./apt-install.sh "the container tests will skip" \
  podman buildah mmdebstrap umoci skopeo runc fuse-overlayfs slirp4netns uidmap catatonit || true
if ! command -v podman >/dev/null 2>&1; then
  echo "container-deps: podman is not available; the container tests will skip" >&2
fi
exit 0
