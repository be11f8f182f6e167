"""podman for the container tests: the image (scripts/container-build.sh), pods like
Kubernetes pods (an engine container and a kvxferd container sharing IPC, the network
and a volume for the engine API socket), and polling with deadlines.

Every name carries the run's id (RUN_ID), so parallel runs on one host do not collide,
and every pod a test makes is removed by its fixture (`podman pod rm -f`) even when the
test fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from kvxferd.sim.cluster import DEFAULT_GEOMETRY
from kvxferd.sim.ports import free_port

REPO = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("KVXFERD_TEST_IMAGE", "localhost/kvxferd:test")
STATE = Path(os.environ.get("KVXFERD_CONTAINER_STATE", "/var/tmp/kvxferd-containers"))
CONTAINERS_CONF = STATE / "containers.conf"
RUN_ID = f"kvxt-{os.getpid()}-{uuid.uuid4().hex[:6]}"
UID = 10001
PEER_PORT = 47400
HTTP_PORT = 9400
SECRET = b"kvxferd-container-test-secret"
# The reference engine's geometry (kvxferd.sim.engine defaults), as the daemons' kv_layout.
GEOMETRY = dict(DEFAULT_GEOMETRY)

T = TypeVar("T")

# The reference engine, for a receiver whose context daemon vanished mid-write: blocks a
# write may still reach stay held (fencing: never released on a timer; a peer on another
# host that is gone cannot be proven gone), so the daemon refuses to deregister the pool
# (pool_busy) and the engine would end with that error instead of its report. Here that
# refusal is accepted and the report printed; every other error still fails the engine.
# The engine's wait for those releases before it deregisters (RELEASE_WAIT_S, 60 s) is cut
# to 2 s: they never come here (the test checks the daemon still holds each one), and the
# full wait made the test take 70 s instead of 9 whenever a receive ended held.
HELD_OK = """
import sys
from kvxferd.client import CallError
from kvxferd.sim import engine, reference_engine
reference_engine.RELEASE_WAIT_S = 2.0
close = reference_engine.ReferenceEngine.close
async def close_held_ok(self):
    try:
        await close(self)
    except CallError as exc:
        if exc.code != "pool_busy":
            raise
        print("engine: pool still busy at exit (held blocks):", exc, file=sys.stderr)
reference_engine.ReferenceEngine.close = close_held_ok
sys.exit(engine.main(sys.argv[1:]))
"""


def podman_env() -> dict[str, str]:
    """podman with the containers.conf that container-build.sh wrote (ulimits, runc)."""
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(
    *args: str, timeout: float = 60.0, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["podman", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=podman_env(),
        input=input,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"podman {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
        )
    return proc


def poll(what: str, probe: Callable[[], T | None], timeout_s: float, every_s: float = 0.2) -> T:
    """probe() until it returns something other than None, or fail after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got is not None:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout_s} s")
        time.sleep(every_s)


def http_get(address: str, path: str, timeout: float = 3.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric(exposition: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def container_state(name: str) -> dict[str, Any]:
    out = podman("inspect", "--type", "container", "--format", "{{json .State}}", name)
    state: dict[str, Any] = json.loads(out.stdout)
    return state


def pod_ip(pod: str) -> str:
    """The pod's address on the podman network (its infra container's)."""
    infra = podman("pod", "inspect", "--format", "{{.InfraContainerID}}", pod).stdout.strip()
    info = json.loads(podman("inspect", "--type", "container", infra).stdout)[0]
    settings = info["NetworkSettings"]
    ip: str = settings.get("IPAddress") or next(
        (n["IPAddress"] for n in (settings.get("Networks") or {}).values() if n.get("IPAddress")),
        "",
    )
    assert ip, f"pod {pod} has no IP address: {settings}"
    return ip


def daemon_config(
    name: str, role: str, handshake_timeout_ms: int = 5000, **transceiver: Any
) -> dict[str, Any]:
    """A daemon listening on every address of its pod, as in deploy/kubernetes/."""
    return {
        "cache_transceiver_config": {
            "backend": "NIXL",
            "transceiver_runtime": "PYTHON",
            "max_tokens_in_buffer": 8192,
            "kv_transfer_timeout_ms": 30000,
            **transceiver,
        },
        "engine": {"role": role, "kv_layout": GEOMETRY},
        "daemon": {
            "name": name,
            "api_socket": "/run/kvxferd/kvxferd.sock",
            "peer_listen": f"0.0.0.0:{PEER_PORT}",
            "http": f"0.0.0.0:{HTTP_PORT}",
            "shared_secret_file": "/etc/kvxferd/secret/secret",
            "drain_timeout_ms": 20000,
            "heartbeat_interval_ms": 500,
            "heartbeat_timeout_ms": 3000,
            "handshake_timeout_ms": handshake_timeout_ms,
        },
    }


@dataclass
class Pod:
    """One pod: an engine container and a kvxferd container (named POD-engine and
    POD-kvxferd) in a podman pod sharing IPC, network and UTS, like a Kubernetes pod; the
    engine API socket in a volume both mount; the HTTP port published on the host."""

    name: str
    workdir: Path
    http: str = ""  # 127.0.0.1:PORT on the host
    ip: str = ""  # the pod's address on the podman network
    volume: str = ""
    engine_procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def daemon(self) -> str:
        return f"{self.name}-kvxferd"

    def create(self, config: dict[str, Any]) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / "kvxferd.yaml"
        cfg.write_text(yaml.safe_dump(config, sort_keys=False))
        secret_dir = self.workdir / "secret"
        secret_dir.mkdir()
        (secret_dir / "secret").write_bytes(SECRET)
        for path in (cfg, secret_dir, secret_dir / "secret"):
            os.chown(path, UID, UID)
        (secret_dir / "secret").chmod(0o400)
        port = free_port()
        podman(
            "pod", "create", "--name", self.name, "--share", "ipc,net,uts",
            "--shm-size", "256m", "-p", f"127.0.0.1:{port}:{HTTP_PORT}",
        )  # fmt: skip
        self.http = f"127.0.0.1:{port}"
        # The engine API socket's volume (an emptyDir): podman gives a new named volume
        # the owner of the image's /run/kvxferd (uid 10001), so both containers may use it.
        self.volume = f"{self.name}-sock"
        podman("volume", "create", self.volume)

    def start_daemon(self, *args: str) -> None:
        podman(
            "run", "-d", "--pod", self.name, "--name", self.daemon,
            "--read-only", "--health-interval", "disable",
            "-v", f"{self.volume}:/run/kvxferd",
            "-v", f"{self.workdir / 'kvxferd.yaml'}:/etc/kvxferd/kvxferd.yaml:ro",
            "-v", f"{self.workdir / 'secret'}:/etc/kvxferd/secret:ro",
            IMAGE, "--config", "/etc/kvxferd/kvxferd.yaml", *args,
        )  # fmt: skip
        self.ip = pod_ip(self.name)

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        def ready() -> bool | None:
            try:
                if http_get(self.http, "/readyz")[0] == 200:
                    return True
            except OSError:
                pass
            state = container_state(self.daemon)
            if not state.get("Running"):
                raise AssertionError(
                    f"{self.daemon} exited ({state.get('ExitCode')}) before it was ready:\n"
                    + self.logs()[-3000:]
                )
            return None

        poll(f"{self.daemon} /readyz 200", ready, timeout_s)

    def logs(self, container: str | None = None) -> str:
        out = podman("logs", container or self.daemon, check=False, timeout=30)
        return out.stdout + out.stderr

    def engine(
        self, role: str, *args: str, tag: str = "engine", held_ok: bool = False
    ) -> subprocess.Popen[str]:
        """The reference engine in its own container of this pod (the same image, another
        entry point); its JSON report comes on the Popen's stdout. `held_ok`: blocks may
        stay held at the end (see HELD_OK)."""
        run = ["-c", HELD_OK] if held_ok else ["-m", "kvxferd.sim.engine"]
        proc = subprocess.Popen(
            [
                "podman", "run", "--pod", self.name, "--name", f"{self.name}-{tag}",
                "--read-only", "--health-interval", "disable",
                "-v", f"{self.volume}:/run/kvxferd", "--entrypoint", "python",
                IMAGE, *run, "--role", role,
                "--socket", "/run/kvxferd/kvxferd.sock", *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=podman_env(),
        )  # fmt: skip
        self.engine_procs.append(proc)
        return proc

    def remove(self) -> None:
        for proc in self.engine_procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
        podman("pod", "rm", "-f", "-t", "0", self.name, check=False, timeout=120)
        if self.volume:
            podman("volume", "rm", "-f", self.volume, check=False, timeout=60)


def engine_report(proc: subprocess.Popen[str], timeout_s: float) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"engine exited {proc.returncode}:\n{err[-3000:]}"
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return report
