"""deploy/kubernetes/ played for real with `podman kube play`: the Secret, the prefill and
decode pods (the reference engine beside each kvxferd sidecar), their ConfigMaps, probes
and scrape annotations. The two pods' engines exchange their workload, every byte
verified, and each daemon's endpoints answer on its pod IP, as a probe or Prometheus
would reach them. Only what a cluster would provide differently changes: names carry the
run's id, the image is the one just built, and the decode daemon dials the prefill pod's
IP where a cluster's DNS would resolve the Service."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from container_harness import (
    HTTP_PORT,
    IMAGE,
    REPO,
    RUN_ID,
    container_state,
    free_port,
    http_get,
    metric,
    pod_ip,
    podman,
    poll,
)

from kvxferd.sim.cluster import summarise

pytestmark = pytest.mark.timeout(1800)  # the first test builds the image (minutes, once)

MANIFESTS = REPO / "deploy" / "kubernetes"


def _load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]


def _renamed(docs: list[dict[str, Any]], suffix: str) -> list[dict[str, Any]]:
    """The manifests with this run's names and image."""
    for doc in docs:
        doc["metadata"]["name"] += suffix
        if doc["kind"] != "Pod":
            continue
        # podman makes each emptyDir a named volume, shared by every pod (and every later
        # run) that names it, and left behind by kube down: this run's own (a stale engine
        # API socket there once sent the prefill engine to the decode daemon).
        scratch = {}
        for vol in doc["spec"]["volumes"]:
            if "configMap" in vol:
                vol["configMap"]["name"] += suffix
            if "secret" in vol:
                vol["secret"]["secretName"] += suffix
            if "emptyDir" in vol:
                scratch[vol["name"]] = vol["name"] + suffix
                vol["name"] += suffix
        for c in doc["spec"]["containers"]:
            for mount in c.get("volumeMounts", []):
                mount["name"] = scratch.get(mount["name"], mount["name"])
            c["image"] = IMAGE
            # podman 4.3 publishes every containerPort on the host (as hostPort): give
            # each a free loopback port so that two pods, or two runs, do not collide.
            for port in c.get("ports", []):
                port.update(hostIP="127.0.0.1", hostPort=free_port())
    return docs


def _secret_as_host_path(docs: list[dict[str, Any]], secret: dict[str, Any], tmp: Path) -> None:
    """podman 4.3 (Debian 12) panics on a Pod's `secret:` volume (kube play's
    VolumeFromSecret), though it plays the Secret itself: mount the Secret's data as a
    host directory instead, the files and mode the kubelet would give it."""
    where = tmp / secret["metadata"]["name"]
    where.mkdir(exist_ok=True)
    for key, value in secret["stringData"].items():
        (where / key).write_text(value)
        os.chown(where / key, 10001, 10001)
        (where / key).chmod(0o440)
    for vol in _pod(docs)["spec"]["volumes"]:
        if "secret" in vol:
            del vol["secret"]
            vol["hostPath"] = {"path": str(where), "type": "Directory"}


def _shm_from_the_pod(docs: list[dict[str, Any]]) -> None:
    """podman 4.3 makes the `*-dshm` emptyDir (medium: Memory) a root-owned volume, not the
    world-writable tmpfs a kubelet mounts, and UCX (inside NIXL) cannot make its shared
    memory there as uid 10001 (NIXL_ERR_BACKEND). Drop it: the containers then share the
    pod's own /dev/shm (one IPC namespace), as in a pod without that volume."""
    pod = _pod(docs)
    dshm = {
        v["name"] for v in pod["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"
    }
    assert dshm, "the manifest's /dev/shm emptyDir"
    pod["spec"]["volumes"] = [v for v in pod["spec"]["volumes"] if v["name"] not in dshm]
    for c in pod["spec"]["containers"]:
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] not in dshm]


def _pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == "Pod")


def _config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    config: dict[str, Any] = yaml.safe_load(cm["data"]["kvxferd.yaml"])
    return config


def _set_config(docs: list[dict[str, Any]], config: dict[str, Any]) -> None:
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    cm["data"]["kvxferd.yaml"] = yaml.safe_dump(config, sort_keys=False)


def _report(container: str) -> dict[str, Any]:
    out = podman("logs", container).stdout
    line = next(x for x in reversed(out.splitlines()) if x.startswith('{"role"'))
    report: dict[str, Any] = json.loads(line)
    return report


def _runs_seen(pod: str, state: dict[str, Any]) -> str:
    """What else tells why an engine failed: how often podman restarted it, whether the
    kernel killed it for memory (neither leaves a line in its log), and what its daemon
    logged last (an engine seen leaving, a pool kept registered for its holds)."""
    engine = f"{pod}-engine"
    restarts = podman(
        "inspect", "--type", "container", "--format", "{{.RestartCount}}", engine, check=False
    ).stdout.strip()
    daemon_log = podman("logs", "--tail", "40", f"{pod}-kvxferd", check=False)
    return (
        f"--- podman: restarts {restarts or '?'}, OOMKilled {state.get('OOMKilled')}, "
        f"error {state.get('Error') or '-'}; the daemon's last lines:\n"
        f"{(daemon_log.stdout + daemon_log.stderr)[-4000:]}"
    )


def _assert_workload_verified(prefill_pod: str, decode_pod: str) -> None:
    """Both engines exited 0 and all 16 requests verified: the decode engine checks every
    byte and exits once its workload is done."""

    def exited(container: str) -> dict[str, Any] | None:
        state = container_state(container)
        return None if state.get("Running") or not state.get("FinishedAt") else state

    for pod in (prefill_pod, decode_pod):
        state = poll(f"{pod}'s engine done", lambda p=pod: exited(f"{p}-engine"), 150, 0.5)
        if state["ExitCode"] != 0:
            # Under restartPolicy OnFailure the log holds every run: the first failure is
            # the cause, the last one what the restarts ran into.
            err = podman("logs", f"{pod}-engine").stderr
            shown = err if len(err) <= 6000 else err[:3000] + "\n[...]\n" + err[-3000:]
            raise AssertionError(
                f"{pod}'s engine exited {state['ExitCode']}:\n{shown}\n{_runs_seen(pod, state)}"
            )
    summary = summarise(_report(f"{prefill_pod}-engine"), _report(f"{decode_pod}-engine"))
    assert summary["requests"] == 16
    assert summary["verified"] == 16, summary


@pytest.fixture
def played(image: str, tmp_path: Path) -> Iterator[list[Path]]:
    """The files played (in order); each is taken down and its pods removed at the end."""
    files: list[Path] = []
    try:
        yield files
    finally:
        for path in reversed(files):
            podman("kube", "down", str(path), check=False, timeout=120)
            for doc in yaml.safe_load_all(path.read_text()):
                if doc["kind"] == "Pod":
                    podman("pod", "rm", "-f", "-t", "0", doc["metadata"]["name"], check=False)
                    for vol in doc["spec"]["volumes"]:
                        if "emptyDir" in vol:  # a named volume to podman; kube down leaves it
                            podman("volume", "rm", "-f", vol["name"], check=False)
                if doc["kind"] == "Secret":
                    podman("secret", "rm", doc["metadata"]["name"], check=False)
                if doc["kind"] == "ConfigMap":  # played as a volume; kube down leaves it
                    podman("volume", "rm", "-f", doc["metadata"]["name"], check=False)


def _play(
    played: list[Path], tmp_path: Path, name: str, docs: list[dict[str, Any]], *opts: str
) -> None:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    played.append(path)
    podman("kube", "play", *opts, str(path), timeout=180)


def test_manifests_declare_probes_scrape_and_config(image: str) -> None:
    for name in ("prefill.yaml", "decode.yaml"):
        docs = _load(name)
        pod = _pod(docs)
        notes = pod["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert int(notes["prometheus.io/port"]) == HTTP_PORT
        sidecar = next(c for c in pod["spec"]["containers"] if c["name"] == "kvxferd")
        for probe, path in (
            ("startupProbe", "/readyz"),
            ("readinessProbe", "/readyz"),
            ("livenessProbe", "/healthz"),
        ):
            assert sidecar[probe]["httpGet"]["path"] == path
        config = _config(docs)
        assert config["daemon"]["http"].endswith(f":{HTTP_PORT}")
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        assert grace * 1000 > config["daemon"]["drain_timeout_ms"]
        assert pod["spec"]["securityContext"]["runAsUser"] == 10001


def test_kube_play_prefill_and_decode_exchange_verified_kv(
    played: list[Path], tmp_path: Path
) -> None:
    suffix = f"-{RUN_ID}"
    secret = _renamed(_load("secret.yaml"), suffix)
    prefill = _renamed(_load("prefill.yaml"), suffix)
    decode = _renamed(_load("decode.yaml"), suffix)
    prefill_pod, decode_pod = _pod(prefill)["metadata"]["name"], _pod(decode)["metadata"]["name"]

    _play(played, tmp_path, "secret.yaml", secret)
    name = secret[0]["metadata"]["name"]
    assert podman("secret", "inspect", name, check=False).returncode == 0, "Secret not played"
    for docs in (prefill, decode):
        _secret_as_host_path(docs, secret[0], tmp_path)
        _shm_from_the_pod(docs)
    _play(played, tmp_path, "prefill.yaml", prefill)
    prefill_ip = pod_ip(prefill_pod)
    # Where a cluster's DNS resolves the Service kvxferd-prefill: the prefill pod's IP.
    config = _config(decode)
    assert config["daemon"]["peers"]["ctx0"].startswith("kvxferd-prefill:")
    config["daemon"]["peers"]["ctx0"] = f"{prefill_ip}:47400"
    _set_config(decode, config)
    _play(played, tmp_path, "decode.yaml", decode)
    decode_ip = pod_ip(decode_pod)

    _assert_workload_verified(prefill_pod, decode_pod)

    # The probes' and Prometheus's view: the pod IP, the port the annotations name.
    for ip, side in ((prefill_ip, "send"), (decode_ip, "recv")):
        address = f"{ip}:{HTTP_PORT}"
        assert http_get(address, "/healthz")[0] == 200
        assert http_get(address, "/readyz")[0] == 200
        status, text = http_get(address, "/metrics")
        assert status == 200
        assert metric(text, "kvxferd_requests_total", side=side, status="done") == 16
    # The sidecar runs as the manifest says: uid 10001, read-only root, JSON logs.
    sidecar = f"{decode_pod}-kvxferd"
    assert podman("exec", sidecar, "id", "-u").stdout.strip() == "10001"
    touch = podman("exec", sidecar, "touch", "/opt/kvxferd/x", check=False)
    assert touch.returncode != 0 and "Read-only" in touch.stderr
    logs = podman("logs", sidecar).stderr + podman("logs", sidecar).stdout
    assert any(x.startswith("{") and '"ready"' in x for x in logs.splitlines()), logs[-2000:]


def _etcd_block(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's commented `discovery: etcd` block, uncommented: what an operator
    switching to etcd does, so the block the manifest documents is the one played."""
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    lines = cm["data"]["kvxferd.yaml"].splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# discovery: etcd")
    indent = len(lines[start]) - len(lines[start].lstrip())
    block = []
    for line in lines[start:]:
        if not line.strip().startswith("#"):
            break
        block.append(line[indent + 2 :])
    found: dict[str, Any] = yaml.safe_load("\n".join(block))
    assert found["discovery"] == "etcd" and found["etcd"]["endpoints"], found
    return found


KUBE_NETWORK = "podman-default-kube-network"  # where `podman kube play` puts its pods


def _kube_gateway() -> str:
    """The gateway of kube play's network (the host, as the pods reach it), the network
    made first if no kube play has run on this machine yet."""
    if podman("network", "exists", KUBE_NETWORK, check=False).returncode != 0:
        podman("network", "create", KUBE_NETWORK)
    doc = json.loads(podman("network", "inspect", KUBE_NETWORK).stdout)[0]
    return str(doc["subnets"][0]["gateway"])


def test_kube_play_with_etcd_discovery(played: list[Path], tmp_path: Path) -> None:
    """The manifests' own `discovery: etcd` block, played: no daemon.peers anywhere; the
    decode daemon finds ctx0 through etcd, and every byte verifies. Only what a cluster
    provides changes: etcd is Debian's etcd-server on the host (a cluster's Service
    kvxferd-etcd). Each daemon advertises its pod's IP (`advertise_address: auto`, as
    the block says). The prefill daemon starts before etcd does, and registers once etcd
    comes (a daemon must not need etcd to start)."""
    from kvxferd.sim.etcd_server import EtcdServer, etcd_binary

    if etcd_binary() is None:
        pytest.skip("no etcd binary (Debian etcd-server: scripts/test-deps.sh)")
    suffix = f"-e{RUN_ID}"
    secret = _renamed(_load("secret.yaml"), suffix)
    prefill = _renamed(_load("prefill.yaml"), suffix)
    decode = _renamed(_load("decode.yaml"), suffix)
    prefill_pod, decode_pod = _pod(prefill)["metadata"]["name"], _pod(decode)["metadata"]["name"]
    _play(played, tmp_path, "secret.yaml", secret)
    gateway = _kube_gateway()
    etcd = EtcdServer(tmp_path / "etcd", host=gateway)
    (tmp_path / "etcd").mkdir()
    cluster = f"kube{os.getpid()}"
    for docs in (prefill, decode):
        _secret_as_host_path(docs, secret[0], tmp_path)
        _shm_from_the_pod(docs)
        config = _config(docs)
        config["daemon"].pop("peers", None)
        config["daemon"].update(_etcd_block(docs))
        assert config["daemon"]["etcd"]["advertise_address"] == "auto"
        # Where a cluster has the Service kvxferd-etcd.
        config["daemon"]["etcd"].update(endpoints=[etcd.endpoint], cluster=cluster)
        _set_config(docs, config)
    try:
        _play(played, tmp_path, "prefill.yaml", prefill)
        ips = {"prefill": pod_ip(prefill_pod)}
        address = f"{ips['prefill']}:{HTTP_PORT}"

        def ready() -> bool | None:
            try:  # refused until the sidecar listens
                return http_get(address, "/readyz")[0] == 200 or None
            except OSError:
                return None

        poll("prefill's daemon ready without etcd", ready, 120)
        etcd.start()

        def registered() -> bool | None:
            doc = json.loads(http_get(address, "/v1/status")[1])
            return doc["discovery"].get("registered") or None

        poll("prefill's daemon registered once etcd came", registered, 60)
        _play(played, tmp_path, "decode.yaml", decode)
        ips["decode"] = pod_ip(decode_pod)
        _assert_workload_verified(prefill_pod, decode_pod)
        for side in ("prefill", "decode"):
            doc = json.loads(http_get(f"{ips[side]}:{HTTP_PORT}", "/v1/status")[1])
            assert doc["discovery"]["member_names"] == ["ctx0", "gen0"], doc["discovery"]
            text = http_get(f"{ips[side]}:{HTTP_PORT}", "/metrics")[1]
            assert metric(text, "kvxferd_discovery_up") == 1
            assert metric(text, "kvxferd_discovery_registered") == 1
            assert metric(text, "kvxferd_discovery_members") == 2
    finally:
        etcd.kill()
