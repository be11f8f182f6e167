#!/usr/bin/env bash
# Builds the kvxferd image with podman, from a base image made here when none can be pulled.
#
#   scripts/container-build.sh            # -> localhost/kvxferd:test (and kvxferd:VERSION)
#
# 1. The base: BASE_IMAGE when set (python:3.11-slim, say, where Docker Hub is reachable);
#    otherwise localhost/kvxferd-base:bookworm, made once with mmdebstrap from apt's own
#    mirror (Debian's Python 3.11 in /usr/bin; ~35 s) and kept.
# 2. A containers.conf for what fails on these hosts (../shared/CONTAINERS.md): ulimits the
#    runtime may set without CAP_SYS_RESOURCE, and runc (crun refuses hybrid cgroups). It is
#    written to $KVXFERD_CONTAINERS_CONF and used through CONTAINERS_CONF (nothing in /etc
#    changes); run the image with the same variable set.
# 3. `podman build --format docker` (the OCI format drops HEALTHCHECK), --pull=never, the
#    host's CA bundle mounted for pip; podman's layer cache makes a rebuild seconds.
# Prints each layer's size. Exit status: 0 built, 1 failed, 2 cannot build here (no podman,
# not root, no mmdebstrap): the message says which.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-localhost/kvxferd:test}
LOCAL_BASE=localhost/kvxferd-base:bookworm
BASE_IMAGE=${BASE_IMAGE:-}
STATE=${KVXFERD_CONTAINER_STATE:-/var/tmp/kvxferd-containers}
export KVXFERD_CONTAINERS_CONF=${KVXFERD_CONTAINERS_CONF:-$STATE/containers.conf}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

say() { echo "container-build: $*" >&2; }
cannot() { say "$*"; exit 2; }

command -v podman >/dev/null 2>&1 || cannot "podman is not installed (scripts/container-deps.sh)"
[ "$(id -u)" -eq 0 ] || cannot "needs root (rootful podman; mmdebstrap for the base image)"
mkdir -p "$STATE"
# One build at a time on this host (parallel test runs share the image and the base).
exec 9>"$STATE/build.lock"
flock 9

# --- 2. containers.conf: ulimits within the shell's hard limits, and runc ---------------
nofile=$(ulimit -Hn)
[ "$nofile" = unlimited ] && nofile=1048576
nproc=$(ulimit -Hu)
if [ "$nproc" = unlimited ] || [ "$nproc" -gt 32768 ]; then nproc=32768; fi
runtime=runc
command -v runc >/dev/null 2>&1 || runtime=crun
cat >"$KVXFERD_CONTAINERS_CONF.tmp" <<CONF
# Written by scripts/container-build.sh; use with CONTAINERS_CONF=$KVXFERD_CONTAINERS_CONF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "$runtime"
CONF
mv "$KVXFERD_CONTAINERS_CONF.tmp" "$KVXFERD_CONTAINERS_CONF"
export CONTAINERS_CONF=$KVXFERD_CONTAINERS_CONF

# --- 1. the base image ------------------------------------------------------------------
# apt's own mirrors (deb822 .sources or one-line .list), Debian's and its security archive.
apt_uri() { # apt_uri REGEX DEFAULT: the first URI in apt's sources matching REGEX
  local uri
  uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
          /etc/apt/sources.list.d/*.sources 2>/dev/null \
        | grep -v '^\s*#' | grep -oE '(https?|file)://[^ ]+' | grep -E "$1" | head -n1 || true)
  echo "${uri:-$2}"
}
if [ -z "$BASE_IMAGE" ]; then
  BASE_IMAGE=$LOCAL_BASE
  if ! podman image exists "$LOCAL_BASE"; then
    command -v mmdebstrap >/dev/null 2>&1 \
      || cannot "no base image $LOCAL_BASE and no mmdebstrap to make it (scripts/container-deps.sh)"
    mirror=$(apt_uri '/debian/?$' http://deb.debian.org/debian)
    security=$(apt_uri '/debian-security/?$' http://deb.debian.org/debian-security)
    say "making $LOCAL_BASE with mmdebstrap from $mirror (once)"
    t0=$(date +%s)
    tar=$(mktemp "$STATE/base.XXXXXX.tar")
    trap 'rm -f "$tar"' EXIT
    mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
      bookworm "$tar" \
      "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
      "deb $security bookworm-security main"
    podman import --quiet --change 'CMD ["/bin/bash"]' "$tar" "$LOCAL_BASE" >/dev/null
    rm -f "$tar"
    say "base image made in $(($(date +%s) - t0)) s"
  fi
fi

# --- 3. the image -----------------------------------------------------------------------
ca_args=()
if [ -f "$CA_BUNDLE" ]; then
  # pip verifies PyPI's certificate with the host's bundle (a proxy's CA may be in it).
  ca_args=(-v "$CA_BUNDLE:/run/kvxferd-build-ca.crt:ro" --build-arg PIP_CERT=/run/kvxferd-build-ca.crt)
fi
t0=$(date +%s)
say "building $IMAGE from $BASE_IMAGE"
podman build --format docker --pull=never --layers \
  --build-arg BASE_IMAGE="$BASE_IMAGE" "${ca_args[@]}" \
  -t "$IMAGE" -t "localhost/kvxferd:$VERSION" . >&2
say "built $IMAGE in $(($(date +%s) - t0)) s"

size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
echo "image $IMAGE: $((size / 1000000)) MB; layers (newest first):"
podman history --no-trunc --format '{{.Size}}\t{{.CreatedBy}}' "$IMAGE" \
  | awk -F'\t' '$1 != "0 B" { printf "  %10s  %.90s\n", $1, $2 }'
