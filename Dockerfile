# kvxferd as a container: a sidecar beside one inference engine.
#
#   docker build -t kvxferd .
#   docker run --rm --ipc=container:ENGINE -v /run/kvxferd:/run/kvxferd \
#     -v ./kvxferd.yaml:/etc/kvxferd/kvxferd.yaml:ro kvxferd
#
# What this image supports: NIXL under both runtimes (PYTHON and the staged CPP
# runtime; NIXL's bundled UCX: TCP and shared memory, RDMA when the host's
# devices are passed in), with the engine's KV pools in host memory (POSIX shared
# memory, /dev/shm). The UCX, MPI and MOONCAKE backends' packages are not in it
# (a daemon configured for one refuses to start, naming the package): to add
# them, install kvxferd with the extras `.[ucx,mpi,mooncake]` in the build stage
# and Mooncake's Debian libraries (scripts/system-deps.sh) in the final one.
# GPU (CUDA IPC) pools are not supported yet.
# Kubernetes example and probes: docs/operations.md.

FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvxferd ./kvxferd
# As scripts/install.sh: nixl-cu12 without its declared torch dependency (NIXL
# never imports it; pip would pull a multi-GB CUDA build). See docs/install.md.
RUN python -m venv /opt/kvxferd/venv \
 && /opt/kvxferd/venv/bin/pip install --no-cache-dir -q --upgrade pip \
 && /opt/kvxferd/venv/bin/pip install --no-cache-dir -q --no-deps 'nixl-cu12>=1.5,<2' \
 && /opt/kvxferd/venv/bin/pip install --no-cache-dir -q . \
 && /opt/kvxferd/venv/bin/python -c "import nixl_cu12, kvxferd; print('kvxferd', kvxferd.__version__)"

FROM python:3.11-slim
# A fixed, non-root uid: the engine API socket is mode 0600, so the engine's
# container must run as this same uid (runAsUser: 10001).
RUN groupadd --system --gid 10001 kvxferd \
 && useradd --system --uid 10001 --gid kvxferd --home-dir /nonexistent \
      --no-create-home --shell /usr/sbin/nologin kvxferd \
 && mkdir -p /etc/kvxferd /run/kvxferd \
 && chown kvxferd:kvxferd /run/kvxferd
COPY --from=build /opt/kvxferd/venv /opt/kvxferd/venv
COPY configs/ /usr/share/doc/kvxferd/examples/
ENV PATH=/opt/kvxferd/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVXFERD_HEALTH_URL=http://127.0.0.1:9400/healthz
USER 10001:10001
# 47400: peer control channel (daemon.peer_listen); 9400: /metrics, /healthz,
# /readyz, /v1/status (daemon.http; listen on 0.0.0.0 for probes and scrapes).
EXPOSE 47400 9400
# No curl in the slim image: Python asks /healthz (set KVXFERD_HEALTH_URL when
# daemon.http uses another port). An answer proves the event loop runs.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(0 if urllib.request.urlopen(os.environ['KVXFERD_HEALTH_URL'], timeout=2).status == 200 else 1)"]
# SIGTERM drains (daemon.drain_timeout_ms), so give `docker stop -t` / the pod's
# terminationGracePeriodSeconds more than that. SIGHUP reloads the file.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvxferd", "run"]
CMD ["--config", "/etc/kvxferd/kvxferd.yaml"]
