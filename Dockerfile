# kvxferd as a container: a sidecar beside one inference engine.
#
#   scripts/container-build.sh                       # podman, local base image: README
#   docker build --build-arg BASE_IMAGE=python:3.11-slim -t kvxferd .
#   docker run --rm --ipc=container:ENGINE -v /run/kvxferd:/run/kvxferd \
#     -v ./kvxferd.yaml:/etc/kvxferd/kvxferd.yaml:ro kvxferd
#
# What this image holds: kvxferd with every backend the project installs elsewhere
# (scripts/install.sh): NIXL (nixl-cu12, both runtimes; its bundled UCX: TCP and shared
# memory, RDMA when the host's devices are passed in), UCX (ucxx-cu12), MPI (mpi4py over
# the MPICH wheel, which brings mpiexec) and MOONCAKE (mooncake-transfer-engine-non-cuda,
# with the Debian libraries it loads: scripts/system-deps.sh), and the etcd client for
# daemon.discovery: etcd (the extra `etcd`). KV pools in host memory
# (memfd / POSIX shared memory). GPU (CUDA IPC) pools are not supported in the image.
# The reference engine (python -m kvxferd.sim.engine) runs from the same image with
# another entry point: the tests' pods and deploy/kubernetes/ use it as the engine.
#
# BASE_IMAGE: any Debian-based image with Python >= 3.10 and its venv module:
# python:3.11-slim (Python in /usr/local), or the local base that
# scripts/container-build.sh makes with mmdebstrap (Debian's Python in /usr/bin). Every
# command below says python3 and works with both. The venv is made in the build stage
# and copied into a final stage of the same base, so its interpreter path holds.
# Tested (tests/container): podman 4.3 on Debian 12, the mmdebstrap base.
# Kubernetes manifests and probes: deploy/kubernetes/, docs/operations.md.

ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# Where PyPI's certificate is checked against a bundle mounted into the build
# (scripts/container-build.sh passes the host's); unset, pip uses its own.
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
RUN python3 -m venv /opt/kvxferd/venv \
 && /opt/kvxferd/venv/bin/pip install -q --upgrade pip
# As scripts/install.sh: nixl-cu12 without its declared torch dependency (NIXL never
# imports it; pip would pull a multi-GB CUDA build). See docs/install.md.
RUN /opt/kvxferd/venv/bin/pip install -q --no-deps 'nixl-cu12>=1.5,<2'
# kvxferd's dependencies and its backend extras, read from pyproject.toml, in a layer of
# their own: a change to kvxferd's code rebuilds only the small layer after it.
COPY pyproject.toml ./
RUN /opt/kvxferd/venv/bin/python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + [r for e in ('ucx', 'mpi', 'mooncake', 'etcd') for r in p['optional-dependencies'][e]]))" > /tmp/requirements.txt \
 && /opt/kvxferd/venv/bin/pip install -q -r /tmp/requirements.txt
COPY README.md ./
COPY kvxferd ./kvxferd
RUN /opt/kvxferd/venv/bin/pip install -q --no-deps . \
 && /opt/kvxferd/venv/bin/python -c "import nixl_cu12, ucxx, mpi4py, aetcd, kvxferd; print('kvxferd', kvxferd.__version__)"

FROM ${BASE_IMAGE}
# The Debian libraries Mooncake's transfer engine loads (scripts/system-deps.sh, and
# libcurl4, which a host usually has already), no
# recommends, no package lists left behind.
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libibverbs1 librdmacm1 libnuma1 liburing2 libnl-3-200 libnl-route-3-200 libcurl4 >/dev/null \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log
# A fixed, non-root uid: the engine API socket is mode 0600, so the engine's container
# must run as this same uid (runAsUser: 10001). Written directly: the mmdebstrap base has
# no useradd.
RUN echo 'kvxferd:x:10001:' >> /etc/group \
 && echo 'kvxferd:x:10001:10001:kvxferd:/nonexistent:/usr/sbin/nologin' >> /etc/passwd \
 && mkdir -p /etc/kvxferd /run/kvxferd \
 && chown 10001:10001 /run/kvxferd
COPY --from=build /opt/kvxferd/venv /opt/kvxferd/venv
COPY configs/ /usr/share/doc/kvxferd/examples/
ENV PATH=/opt/kvxferd/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVXFERD_HEALTH_URL=http://127.0.0.1:9400/healthz
# Every backend imports (Mooncake's engine loads the Debian libraries above).
RUN python -c "import nixl_cu12, ucxx, mpi4py, mooncake.engine, kvxferd"
USER 10001:10001
# 47400: peer control channel (daemon.peer_listen); 9400: /metrics, /healthz,
# /readyz, /v1/status (daemon.http; listen on 0.0.0.0 for probes and scrapes).
EXPOSE 47400 9400
# No curl in the image: Python asks /healthz (set KVXFERD_HEALTH_URL when daemon.http
# uses another port). The loop that serves it is the daemon's event loop, so a stalled
# loop fails the 2 s timeout: unhealthy.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen(os.environ['KVXFERD_HEALTH_URL'], timeout=2).status == 200 else 1)"]
# SIGTERM drains (daemon.drain_timeout_ms), so give `docker stop -t` / the pod's
# terminationGracePeriodSeconds more than that. SIGHUP reloads the file.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvxferd", "run"]
CMD ["--config", "/etc/kvxferd/kvxferd.yaml"]
