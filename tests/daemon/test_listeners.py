"""No listener outside the configuration (issue 14): with every address on loopback, each
backend's own listeners (UCX under NIXL opened one on every network device) are on
loopback too, as `ss` shows; a daemon without a shared secret whose backend would listen
elsewhere refuses to start, naming the listener."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxferd.service.listeners import device_of, ipv4_of, is_loopback, listening_sockets
from kvxferd.sim.cluster import ClusterError, DaemonProc, LocalCluster


def _ss_listeners(pid: int) -> list[str]:
    """The local addresses `ss` lists for pid's listening TCP sockets."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return sorted(line.split()[3] for line in out.splitlines() if f"pid={pid}," in line)


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]")


def _external_device() -> tuple[str, str] | None:
    """A non-loopback network device with an IPv4 address, if the host has one."""
    for _, name in socket.if_nameindex():
        host = ipv4_of(name) if name != "lo" else None
        if host is not None and device_of(host) == name:
            return name, host
    return None


@pytest.fixture
def open_cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    """A cluster whose daemons have no shared secret (loopback only)."""
    with LocalCluster(tmp_path, secret=None) as c:
        yield c


def _start(cluster: LocalCluster, backend: str, **kw: object) -> DaemonProc:
    runtime = "PYTHON" if backend == "NIXL" else "CPP"
    return cluster.start_daemon(
        "ctx", "context", transceiver={"backend": backend, "transceiver_runtime": runtime}, **kw
    )


@pytest.mark.parametrize("backend", ["NIXL", "MPI"])
def test_every_listener_is_on_loopback_without_a_secret(
    open_cluster: LocalCluster, backend: str
) -> None:
    d = _start(open_cluster, backend)
    try:
        found = listening_sockets(d.proc.pid)
        assert d.peer_address in found
        # Before the daemon pinned UCX to `lo`, NIXL's agent listened on every device.
        assert all(is_loopback(_host(a)) for a in found), found
        if shutil.which("ss"):
            by_ss = _ss_listeners(d.proc.pid)
            assert by_ss == found, (by_ss, found)
        assert "listening sockets:" in d.log_text()
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("backend", ["UCX", "MOONCAKE"])
def test_backends_that_bind_every_interface_need_a_secret(
    open_cluster: LocalCluster, backend: str
) -> None:
    """ucxx's listener and Mooncake's engine take no address: without a secret the daemon
    refuses to start, naming the listener; with one it starts and logs it."""
    with pytest.raises(ClusterError) as err:
        _start(open_cluster, backend)
    text = str(err.value)
    assert "listens on 0.0.0.0:" in text and "binds every interface" in text, text
    d = _start(open_cluster, backend, secret=b"a-secret-for-this-test")
    try:
        found = listening_sockets(d.proc.pid)
        assert any(_host(a) == "0.0.0.0" for a in found), found
        assert "outside the configured addresses" in d.log_text()
    finally:
        assert d.stop() == 0


def test_a_backend_listener_off_loopback_without_a_secret_is_refused(
    open_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    external = _external_device()
    if external is None:
        pytest.skip("this host has no non-loopback IPv4 device")
    name, host = external
    # The operator's own UCX_NET_DEVICES wins over the daemon's pin: here it sends UCX's
    # listener to the external device, which an unauthenticated daemon must not accept.
    monkeypatch.setenv("UCX_NET_DEVICES", name)
    with pytest.raises(ClusterError) as err:
        open_cluster.start_daemon("ctx", "context")
    text = str(err.value)
    assert f"listens on {host}:" in text, text
    assert "not authenticated" in text, text
