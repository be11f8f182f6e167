"""The MPI adapter (kvxferd.backends.mpi) across real processes on loopback.

Every transport runs in its own child process (this file run as a script:
`python test_mpi.py child NAME INCARNATION`), driven over JSON lines on
stdin/stdout, so that a peer can be SIGKILLed mid-transfer (the harness,
shared with test_ucx.py, is twosided_harness.py). Each child is started like a
daemon (no mpiexec) unless a test says otherwise.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twosided_harness import (
    MIB,
    REPO,
    TransportChild,
    child_main,
    connected,
    connected_pair,
    importable,
    wait_until,
)

HERE = Path(__file__).resolve()


def _make_transport(name: str, incarnation: str) -> Any:
    from kvxferd.backends.mpi import MpiTransport

    return MpiTransport(name, incarnation, stall_grace_s=2.0)


def _info(transport: Any) -> dict[str, Any]:
    return {
        "mode": transport.mode,
        "peers": transport.peers(),
        "accepting": sum(t.name == "kvxferd-mpi-accept" for t in threading.enumerate()),
        "pmi_env": sorted(k for k in os.environ if k.startswith("PMI_")),
    }


class Child(TransportChild):
    script = HERE
    ready_timeout = 60.0


if __name__ != "__main__" and not importable("mpi4py"):
    pytest.skip(
        "mpi4py does not import here (pip install mpi4py mpich); the MPI backend is untestable",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def shared_pair() -> Iterator[tuple[Child, Child]]:
    """A receiver listening and a sender connected to it, for well-behaved tests."""
    with connected_pair(Child) as rx_tx:
        yield rx_tx


@pytest.fixture
def pair() -> Iterator[tuple[Child, Child]]:
    """A pair of its own, for tests that kill or disconnect a side."""
    with connected_pair(Child) as rx_tx:
        yield rx_tx


def test_both_sides_run_under_a_process_manager_of_their_own(
    shared_pair: tuple[Child, Child],
) -> None:
    """Started without mpiexec, each process got one (MPICH singletons cannot
    connect to each other), and no PMI variable is left for its children."""
    for c in shared_pair:
        info = c.ok("info")
        assert info["mode"] == "bootstrapped", info
        assert info["pmi_env"] == [], info
    # The accept thread ends with the rendezvous.
    rx = shared_pair[0]
    wait_until(lambda: rx.ok("info")["accepting"] == 0, 10, "the accept thread ending")


def test_messages_of_every_size_arrive_intact_in_any_order(
    shared_pair: tuple[Child, Child],
) -> None:
    rx, tx = shared_pair
    sizes = [1, 4096, 64 * MIB, 12345, 0, 8191, 8193, 1 * MIB + 7]
    tags = [(1 << 63) + 5, 0, 7, 2**64 - 1, 42, 43, 1 << 40, 45]
    sends = [
        tx.submit("send", peer=rx.key, tag=t, size=s, seed=i)
        for i, (t, s) in enumerate(zip(tags, sizes, strict=True))
    ]
    # Received in reverse order of sending; buffers exactly the size, or larger.
    recvs = [
        (i, rx.submit("recv", peer=tx.key, tag=t, size=s + (i % 2) * 100, deadline=30, seed=i))
        for i, (t, s) in reversed(list(enumerate(zip(tags, sizes, strict=True))))
    ]
    for i, id_ in recvs:
        res = rx.wait(id_, timeout=60)
        assert res["ok"], res
        assert res["n"] == sizes[i] and res["verified"], (sizes[i], res)
    for id_ in sends:
        assert tx.wait(id_, timeout=60)["ok"]
    # The accepting side can send back over the link the sender opened.
    back = rx.submit("send", peer=tx.key, tag=9, size=3 * MIB, seed=99)
    res = tx.ok("recv", peer=rx.key, tag=9, size=3 * MIB, deadline=30, seed=99)
    assert res["verified"]
    assert rx.wait(back)["ok"]


def test_one_recv_per_tag_at_a_time(shared_pair: tuple[Child, Child]) -> None:
    rx, tx = shared_pair
    first = rx.submit("recv", peer=tx.key, tag=6, size=10, deadline=20, seed=6)
    time.sleep(0.1)
    res = rx.call("recv", peer=tx.key, tag=6, size=10, deadline=20)
    assert res["error"] == "TransferError" and "already being received" in res["msg"], res
    tx.ok("send", peer=rx.key, tag=6, size=10, seed=6)
    assert rx.wait(first)["verified"]


def test_too_small_buffer_is_refused_and_the_message_kept(
    shared_pair: tuple[Child, Child],
) -> None:
    rx, tx = shared_pair
    send = tx.submit("send", peer=rx.key, tag=3, size=100_000, seed=3)
    res = rx.call("recv", peer=tx.key, tag=3, size=1000, deadline=10)
    assert res["error"] == "TransferError" and "100000 bytes" in res["msg"], res
    assert rx.ok("recv", peer=tx.key, tag=3, size=100_000, deadline=10, seed=3)["verified"]
    assert tx.wait(send)["ok"]


def test_timeout_and_a_late_message_never_lands(shared_pair: tuple[Child, Child]) -> None:
    rx, tx = shared_pair
    for tag, size in ((11, 2 * MIB), (12, 100)):  # rendezvous and eager
        res = rx.call("recv", peer=tx.key, tag=tag, size=size, deadline=0.3, keep=f"b{tag}")
        assert res["error"] == "TransferTimeoutError", res
        # Now the late message: the sender's send completes (it is drained)...
        tx.ok("send", peer=rx.key, tag=tag, size=size, seed=tag, timeout=15)
    # ...and never reaches the buffer of the receive that timed out.
    time.sleep(0.3)
    for tag in (11, 12):
        assert rx.ok("untouched", keep=f"b{tag}")["untouched"]
    # The link is still fine, and a tag is reusable after its timeout.
    send = tx.submit("send", peer=rx.key, tag=11, size=5 * MIB, seed=5)
    assert rx.ok("recv", peer=tx.key, tag=11, size=5 * MIB, deadline=20, seed=5)["verified"]
    assert tx.wait(send)["ok"]


def test_cancelled_recv_leaves_the_buffer_alone(shared_pair: tuple[Child, Child]) -> None:
    """A recv cancelled while its payload is still coming never writes `out`,
    then or later: the payload goes to a scratch buffer that recv copies
    from only when it returns the size."""
    rx, tx = shared_pair
    size = 32 * MIB
    recv = rx.submit("recv", peer=tx.key, tag=4, size=size, deadline=30, keep="c")
    rx.submit("cancel", target=recv)
    res = rx.wait(recv, timeout=20)
    assert res["error"] == "CancelledError", res
    # The message still arrives; the next recv of the tag gets it.
    send = tx.submit("send", peer=rx.key, tag=4, size=size, seed=4)
    assert rx.ok("recv", peer=tx.key, tag=4, size=size, deadline=30, seed=4)["verified"]
    assert tx.wait(send, timeout=30)["ok"]
    assert rx.ok("untouched", keep="c")["untouched"]


def test_connected_transports_cost_no_cpu_while_idle(shared_pair: tuple[Child, Child]) -> None:
    # Nothing polls MPI while nothing is pending (a blocked MPI_Comm_accept
    # alone would spin half a core).
    for c in shared_pair:
        assert c.ok("idle_cpu", seconds=1.0)["percent"] < 25


def test_missing_peer_is_peer_lost() -> None:
    c = Child("lonely")
    try:
        res = c.call("send", peer="nobody/0", tag=1, size=10, seed=1)
        assert res["error"] == "PeerLostError" and "nobody/0" in res["msg"], res
        res = c.call("recv", peer="nobody/0", tag=1, size=10, deadline=1)
        assert res["error"] == "PeerLostError" and "never connected" in res["msg"], res
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        res = c.call("connect", peer="nobody/0", address=f"127.0.0.1:{free}", deadline=5)
        assert res["error"] == "PeerLostError", res
    finally:
        c.stop()


def test_restarted_peer_is_refused_by_key() -> None:
    rx, tx = Child("gen", "2"), Child("ctx")
    try:
        address = rx.ok("start")["address"]
        res = tx.call("connect", peer="gen/1", address=address)
        assert res["error"] == "PeerLostError" and "gen/2" in res["msg"], res
        # The listener is fine afterwards.
        tx.ok("connect", peer="gen/2", address=address)
        assert rx.ok("info")["peers"] == [tx.key]
    finally:
        tx.stop()
        rx.stop()


@pytest.mark.parametrize("phase", ["waiting", "mid-message"])
def test_sender_killed_is_peer_lost_promptly(pair: tuple[Child, Child], phase: str) -> None:
    rx, tx = pair
    size = 512 * MIB if phase == "mid-message" else 10
    recv = rx.submit("recv", peer=tx.key, tag=77, size=size, deadline=60, keep="k")
    if phase == "mid-message":
        send = tx.submit("send", peer=rx.key, tag=77, size=size, seed=1)
        assert tx.event(send) == "sending"
        time.sleep(0.05)
    else:
        time.sleep(0.3)
    tx.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    res = rx.wait(recv, timeout=15)
    assert res["error"] == "PeerLostError", res
    assert time.monotonic() - killed < 10
    # Whatever MPI still does with that receive, `out` is not written.
    time.sleep(0.2)
    assert rx.ok("untouched", keep="k")["untouched"]
    # Later calls fail at once; removing the peer forgets it.
    res = rx.call("send", peer=tx.key, tag=1, size=10, seed=1)
    assert res["error"] == "PeerLostError", res
    rx.ok("remove_peer", peer=tx.key)
    assert rx.ok("info")["peers"] == []


def test_receiver_killed_fails_the_pending_send(pair: tuple[Child, Child]) -> None:
    """A large send waits for the receiver to take it; the receiver dies instead."""
    rx, tx = pair
    send = tx.submit("send", peer=rx.key, tag=5, size=256 * MIB, seed=5)
    assert tx.event(send) == "sending"
    with pytest.raises(AssertionError, match="no answer"):
        tx.wait(send, timeout=0.5)  # pending: nobody receives it
    rx.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    res = tx.wait(send, timeout=15)
    assert res["error"] == "PeerLostError", res
    assert time.monotonic() - killed < 10
    res = tx.call("send", peer=rx.key, tag=6, size=10, seed=6)
    assert res["error"] == "PeerLostError", res


def test_removed_peer_fails_pending_receives_and_tells_the_peer(
    pair: tuple[Child, Child],
) -> None:
    rx, tx = pair
    recv = rx.submit("recv", peer=tx.key, tag=5, size=10, deadline=30, keep="r")
    back = tx.submit("recv", peer=rx.key, tag=6, size=10, deadline=30)
    time.sleep(0.2)
    rx.ok("remove_peer", peer=tx.key)
    res = rx.wait(recv, timeout=10)
    assert res["error"] == "PeerLostError", res
    # The peer hears of it (its end of the link closes) and fails its own.
    res = tx.wait(back, timeout=10)
    assert res["error"] == "PeerLostError", res
    assert rx.ok("untouched", keep="r")["untouched"]
    # And it can connect again.
    assert tx.ok("info")["peers"] == []
    tx.ok("remove_peer", peer=rx.key)
    tx.ok("connect", peer=rx.key, address=rx.address)
    send = tx.submit("send", peer=rx.key, tag=5, size=1000, seed=5)
    assert rx.ok("recv", peer=tx.key, tag=5, size=1000, deadline=20, seed=5)["verified"]
    assert tx.wait(send)["ok"]


def test_a_link_closed_by_its_own_side_leaves_no_stale_header(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """Closing a link cancels its pending header receive; that receive, once
    complete, is not a header. It was read as one: the last header that came
    over the link went back into the table (a later recv of that tag, over the
    next link, took it and failed), or, where none had come, it was logged as
    a malformed header. (The pair is made here so that capfd has its stderr.)"""
    rx, tx = Child("gen"), Child("ctx")
    try:
        connected(rx, tx)
        send = tx.submit("send", peer=rx.key, tag=7, size=1000, seed=7)
        assert rx.ok("recv", peer=tx.key, tag=7, size=1000, deadline=20, seed=7)["verified"]
        assert tx.wait(send)["ok"]
        # A send nobody receives, cancelled: stall_grace_s later rx closes the link.
        back = rx.submit("send", peer=tx.key, tag=8, size=64 * MIB, seed=8)
        assert rx.event(back) == "sending"
        time.sleep(0.3)
        rx.submit("cancel", target=back)
        assert rx.wait(back, timeout=20)["error"] == "CancelledError"
        wait_until(lambda: tx.ok("info")["peers"] == [], 10, "the peer seeing the link closed")
        time.sleep(0.2)  # rx's tick completes its cancelled header receive
        tx.ok("remove_peer", peer=rx.key)
        tx.ok("connect", peer=rx.key, address=rx.address)
        send = tx.submit("send", peer=rx.key, tag=7, size=1000, seed=70)
        res = rx.call("recv", peer=tx.key, tag=7, size=1000, deadline=20, seed=70)
        assert res["ok"] and res["verified"], res
        assert tx.wait(send)["ok"]
        # The same from tx, which never received over its link.
        back = tx.submit("send", peer=rx.key, tag=9, size=64 * MIB, seed=9)
        assert tx.event(back) == "sending"
        time.sleep(0.3)
        tx.submit("cancel", target=back)
        assert tx.wait(back, timeout=20)["error"] == "CancelledError"
        wait_until(lambda: rx.ok("info")["peers"] == [], 10, "the peer seeing the link closed")
        time.sleep(0.2)
        err = capfd.readouterr().err
        assert err.count("cancelled and not done") == 2 and "malformed" not in err, err
    finally:
        tx.stop()
        rx.stop()


def test_a_connector_that_vanishes_mid_rendezvous_leaves_no_accept_spinning() -> None:
    """A client that says hello, takes the MPI port and disappears: the
    listener's MPI_Comm_accept is released (it would spin forever), and the
    listener still takes real peers."""
    from kvxferd.backends.mpi.wire import ACK, HELLO, frame

    rx = Child("gen")
    try:
        host, port = rx.ok("start")["address"].rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(frame(HELLO, b"ghost/1"))
            head = s.recv(7)
            assert head[:4] == b"KVXM" and head[5] == ACK, head
            (n,) = struct.unpack("!H", s.recv(2))
            s.recv(n)
        wait_until(lambda: rx.ok("info")["accepting"] == 0, 60, "the abandoned accept ending")
        tx = Child("ctx")
        try:
            tx.ok("connect", peer=rx.key, address=f"{host}:{port}")
            send = tx.submit("send", peer=rx.key, tag=1, size=1000, seed=1)
            assert rx.ok("recv", peer=tx.key, tag=1, size=1000, deadline=20, seed=1)["verified"]
            assert tx.wait(send)["ok"]
        finally:
            tx.stop()
    finally:
        rx.stop()


def test_a_daemon_under_mpiexec_and_a_singleton_connect() -> None:
    """Started by `mpiexec -n 1` the adapter uses that process manager; with
    the bootstrap off a process is an MPI singleton, which can still connect
    to a peer that has a process manager."""
    from kvxferd.backends.mpi.bootstrap import find_mpiexec

    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec")
    rx = Child("gen", prefix=[mpiexec, "-n", "1"])
    tx = Child("ctx", env={"KVXFERD_MPI_BOOTSTRAP": "off"})
    try:
        connected(rx, tx)
        assert rx.ok("info")["mode"] == "process manager"
        assert tx.ok("info")["mode"] == "singleton"
        send = tx.submit("send", peer=rx.key, tag=2, size=3 * MIB, seed=2)
        assert rx.ok("recv", peer=tx.key, tag=2, size=3 * MIB, deadline=20, seed=2)["verified"]
        assert tx.wait(send)["ok"]
    finally:
        tx.stop()
        rx.stop()


def test_missing_package_is_backend_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxferd.backends import mpi
    from kvxferd.errors import BackendUnavailableError

    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes `import mpi4py` raise ImportError
    with pytest.raises(BackendUnavailableError, match="pip install mpi4py mpich"):
        mpi.MpiTransport("ctx", "1")


def test_the_registry_builds_it_lazily() -> None:
    """MPI is a two-sided backend; importing the registry loads neither the
    adapter nor mpi4py (a NIXL daemon never loads MPI)."""
    code = (
        "import sys; from kvxferd.backends import registry; "
        "assert registry.is_two_sided('MPI'); "
        "assert 'kvxferd.backends.mpi' not in sys.modules and 'mpi4py' not in sys.modules; "
        "t = registry.make_transport('MPI', 'd', '1'); "
        "assert 'mpi4py.MPI' not in sys.modules, 'MPI loads on first use only'; "
        "print(type(t).__name__)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert res.returncode == 0 and "MpiTransport" in res.stdout, res.stderr[-2000:]


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    asyncio.run(child_main(sys.argv[2], sys.argv[3], _make_transport, _info))
