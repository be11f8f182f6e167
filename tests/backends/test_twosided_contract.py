"""What every two-sided transport (kvxferd/backends/twosided.py) must do, across
real processes on loopback: each test runs once per transport, UCX and MPI.

What is particular to one transport lives in its own file (test_ucx.py,
test_mpi.py); where the contract allows transports to differ, `Backend` names
the difference, so that a test reads the same for both. The child-process
harness is twosided_harness.py.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from twosided_harness import (
    MIB,
    SECRET_ENV,
    TRUSTING_ENV,
    MpiChild,
    TransportChild,
    UcxChild,
    connected_pair,
    link_carries_a_message,
    stopped_mid_message,
    wait_until,
)

Pair = tuple[TransportChild, TransportChild]


@dataclass(frozen=True)
class Backend:
    """One two-sided transport. The defaults are the strictest reading of the
    contract; a backend names only where it is allowed to differ."""

    id: str
    child: type[TransportChild]
    transport_class: str  # "module:Class", the transport under test
    # Whether the well-behaved tests share one connected pair (MPI: a rendezvous
    # costs seconds) or get a pair each.
    shares_pair: bool = False
    # The smallest message the size test sends: 0, an empty one, where carried.
    smallest: int = 0
    # Variables the adapter sets in its own process, restored after a test that
    # builds one in the test process.
    sets_env: tuple[tuple[str, str], ...] = ()
    # The errors a connect to a port nobody listens on may end in.
    refused: frozenset[str] = frozenset({"PeerLostError"})
    # What the error says when the sender dies mid-message, where the transport
    # fails the recv itself (rather than finding the link dead while waiting).
    lost_mid_message: str | None = None
    # Whether a recv that failed leaves its buffer unwritten, whatever the peer
    # had sent, unless its error says `out` is still lent to the transport (MPI
    # receives into `out` once the message is there and says so; UCX writes
    # into `out` and fails the recv only once it stopped).
    failed_recv_leaves_out_alone: bool = True
    # The variable that picks a progress mode, where one does (some modes poll).
    progress_mode_variable: str | None = None

    def idle_cpu_unmeasured(self) -> str | None:
        """Why the idle-CPU bound does not apply in this environment, or None."""
        if self.progress_mode_variable is None:
            return None
        mode = os.environ.get(self.progress_mode_variable) or "blocking"
        if mode in {"blocking", "thread"}:
            return None
        return f"{self.progress_mode_variable}={mode} polls by design"


UCX = Backend(
    id="ucx",
    child=UcxChild,
    transport_class="kvxferd.backends.ucx:UcxTransport",
    smallest=3,
    sets_env=(("UCX_WARN_UNUSED_ENV_VARS", "n"),),
    refused=frozenset({"PeerLostError", "TransferTimeoutError"}),
    lost_mid_message="recv of tag 77",
    failed_recv_leaves_out_alone=False,
    progress_mode_variable="UCXPY_PROGRESS_MODE",
)
MPI = Backend(
    id="mpi", child=MpiChild, transport_class="kvxferd.backends.mpi:MpiTransport", shares_pair=True
)


@pytest.fixture(scope="module", params=[UCX, MPI], ids=lambda b: b.id)
def backend(request: pytest.FixtureRequest) -> Backend:
    """Module-scoped, so that pytest runs one transport's tests, then the other's."""
    spec: Backend = request.param
    reason = spec.child.untestable()
    if reason is not None:
        pytest.skip(reason)
    return spec


@pytest.fixture(scope="module")
def _module_pair(backend: Backend) -> Iterator[Pair | None]:
    if not backend.shares_pair:
        yield None
        return
    with connected_pair(backend.child) as rx_tx:
        yield rx_tx


@pytest.fixture
def shared_pair(backend: Backend, _module_pair: Pair | None) -> Iterator[Pair]:
    """A receiver listening and a sender connected to it, for well-behaved tests:
    one per module where the backend shares it, else one per test."""
    if _module_pair is not None:
        yield _module_pair
        return
    with connected_pair(backend.child) as rx_tx:
        yield rx_tx


@pytest.fixture
def pair(backend: Backend) -> Iterator[Pair]:
    """A pair of its own, for tests that kill or disconnect a side."""
    with connected_pair(backend.child) as rx_tx:
        yield rx_tx


def test_messages_of_every_size_arrive_intact_in_any_order(
    backend: Backend, shared_pair: Pair
) -> None:
    rx, tx = shared_pair
    sizes = [1, 4096, 64 * MIB, 12345, backend.smallest, 8191, 8193, 1 * MIB + 7]
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
    # The listening side can send back over the connection the sender opened.
    back = rx.submit("send", peer=tx.key, tag=9, size=3 * MIB, seed=99)
    res = tx.ok("recv", peer=rx.key, tag=9, size=3 * MIB, deadline=30, seed=99)
    assert res["verified"]
    assert rx.wait(back)["ok"]


def test_one_recv_per_tag_at_a_time(shared_pair: Pair) -> None:
    rx, tx = shared_pair
    first = rx.submit("recv", peer=tx.key, tag=6, size=10, deadline=20, seed=6)
    time.sleep(0.1)  # the first recv is posted (no answer comes before the message does)
    res = rx.call("recv", peer=tx.key, tag=6, size=10, deadline=20)
    assert res["error"] == "TransferError" and "already being received" in res["msg"], res
    tx.ok("send", peer=rx.key, tag=6, size=10, seed=6)
    assert rx.wait(first)["verified"]


def test_too_small_buffer_is_refused_and_the_message_kept(shared_pair: Pair) -> None:
    rx, tx = shared_pair
    send = tx.submit("send", peer=rx.key, tag=3, size=100_000, seed=3)
    res = rx.call("recv", peer=tx.key, tag=3, size=1000, deadline=10)
    assert res["error"] == "TransferError" and "100000 bytes" in res["msg"], res
    assert rx.ok("recv", peer=tx.key, tag=3, size=100_000, deadline=10, seed=3)["verified"]
    assert tx.wait(send)["ok"]


def test_timeout_and_a_late_message_never_lands(shared_pair: Pair) -> None:
    rx, tx = shared_pair
    for tag, size in ((11, 2 * MIB), (12, 100)):  # rendezvous and eager
        res = rx.call("recv", peer=tx.key, tag=tag, size=size, deadline=0.3, keep=f"b{tag}")
        assert res["error"] == "TransferTimeoutError", res
        assert 0.25 < res["elapsed"] < 3, res
        # Now the late message: the sender's send completes (it is drained)...
        tx.ok("send", peer=rx.key, tag=tag, size=size, seed=tag, timeout=15)
    # ...and never reaches the buffer of the receive that timed out.
    time.sleep(0.3)  # a late write would have landed by now
    for tag in (11, 12):
        assert rx.ok("untouched", keep=f"b{tag}")["untouched"]
    # The connection is still fine, and a tag is reusable after its timeout.
    send = tx.submit("send", peer=rx.key, tag=11, size=5 * MIB, seed=5)
    assert rx.ok("recv", peer=tx.key, tag=11, size=5 * MIB, deadline=20, seed=5)["verified"]
    assert tx.wait(send)["ok"]


def test_connected_transports_cost_no_cpu_while_idle(backend: Backend, shared_pair: Pair) -> None:
    """Nothing polls while nothing is pending (ucxx 0.52's own blocking mode
    spun a whole core once an endpoint existed; a blocked MPI_Comm_accept alone
    would spin half a core)."""
    reason = backend.idle_cpu_unmeasured()
    if reason is not None:
        pytest.skip(reason)
    for c in shared_pair:
        assert c.ok("idle_cpu", seconds=1.0)["percent"] < 25


def test_missing_peer_is_peer_lost(backend: Backend) -> None:
    c = backend.child("lonely")
    try:
        res = c.call("send", peer="nobody/0", tag=1, size=10, seed=1)
        assert res["error"] == "PeerLostError" and "nobody/0" in res["msg"], res
        res = c.call("recv", peer="nobody/0", tag=1, size=10, deadline=1)
        assert res["error"] == "PeerLostError" and "never connected" in res["msg"], res
        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        res = c.call("connect", peer="nobody/0", address=f"127.0.0.1:{free}", deadline=5)
        assert res["error"] in backend.refused, res
    finally:
        c.stop()


def test_restarted_peer_is_refused_by_key(backend: Backend) -> None:
    rx, tx = backend.child("gen", "2"), backend.child("ctx")
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
def test_sender_killed_is_peer_lost_promptly(backend: Backend, pair: Pair, phase: str) -> None:
    rx, tx = pair
    if phase == "mid-message":
        # Stopped with part of the message in: a sleep after the send began raced it.
        recv = stopped_mid_message(rx, tx, tag=77, deadline=60)
        keep = "m77"
    else:
        recv = rx.submit("recv", peer=tx.key, tag=77, size=10, deadline=60, keep="k")
        keep = "k"
        time.sleep(0.3)  # the recv is waiting
    tx.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    res = rx.wait(recv, timeout=15)
    assert res["error"] == "PeerLostError", res
    assert time.monotonic() - killed < 10
    if phase == "mid-message" and backend.lost_mid_message is not None:
        assert backend.lost_mid_message in res["msg"], res  # failed by the transport itself
    if backend.failed_recv_leaves_out_alone and not res["lent"]:
        # Whatever the transport still does with that receive, `out` is not written
        # after the failure (mid-message, part of the payload was in before it).
        time.sleep(0.2)
        assert rx.ok("digest", keep=keep)["digest"] == res["digest"]
        if phase == "waiting":
            assert rx.ok("untouched", keep=keep)["untouched"]
    # Later calls fail at once; removing the peer forgets it.
    res = rx.call("send", peer=tx.key, tag=1, size=10, seed=1)
    assert res["error"] == "PeerLostError", res
    rx.ok("remove_peer", peer=tx.key)
    assert rx.ok("info")["peers"] == []


def test_removed_peer_fails_pending_receives(pair: Pair) -> None:
    rx, tx = pair
    recv = rx.submit("recv", peer=tx.key, tag=5, size=10, deadline=30, keep="r")
    time.sleep(0.2)  # the recv is waiting
    rx.ok("remove_peer", peer=tx.key)
    res = rx.wait(recv, timeout=10)
    assert res["error"] == "PeerLostError", res
    assert rx.ok("untouched", keep="r")["untouched"]


def test_missing_package_is_backend_unavailable(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvxferd.errors import BackendUnavailableError

    module, cls = backend.transport_class.split(":")
    adapter = importlib.import_module(module)
    package = backend.child.package
    monkeypatch.setitem(sys.modules, package, None)  # makes `import X` raise ImportError
    for name, value in backend.sets_env:  # what the adapter sets; restored after
        monkeypatch.setenv(name, value)
    with pytest.raises(BackendUnavailableError, match=re.escape(backend.child.install)):
        getattr(adapter, cls)("ctx", "1")


def test_a_peer_stalled_mid_connect_harms_nobody_once_it_answers(backend: Backend) -> None:
    """tx connects to rx while rx's event loop is stuck (a slow or stopped peer: its
    transport's lower layer accepts the connection, but nothing above answers), and tx gives
    up; rx, back, answers the connect it had queued. That late answer must land nowhere:
    ucxx 0.52 wrote it into a buffer it had freed when the connect gave up, and the
    connecting process died of it moments later (a segfault in Python's allocator; see
    kvxferd/backends/ucx_peer_info.py)."""
    rx, tx = backend.child("gen"), backend.child("ctx")
    try:
        rx.address = rx.ok("start")["address"]
        blocked = rx.submit("block", seconds=3.0)
        res = tx.call("connect", peer=rx.key, address=rx.address, deadline=1.0)
        assert not res["ok"], res
        assert rx.wait(blocked)["ok"]
        tx.ok("connect", peer=rx.key, address=rx.address)
        # Enough work (and allocations) on both sides for a corrupted heap to show.
        for i in range(20):
            send = tx.submit("send", peer=rx.key, tag=100 + i, size=4096 + i, seed=i)
            got = rx.ok("recv", peer=tx.key, tag=100 + i, size=4096 + i, deadline=20, seed=i)
            assert got["verified"] and tx.wait(send)["ok"]
        assert tx.proc.poll() is None and rx.proc.poll() is None
    finally:
        tx.stop()
        rx.stop()


@pytest.mark.parametrize("connector", ["another secret", "no secret", "hostile"])
def test_a_link_is_made_only_by_daemons_that_hold_the_shared_secret(
    backend: Backend, connector: str
) -> None:
    """With a shared secret each side of a new link proves it to the other (the
    transport's own port, which anyone reaching it can speak, proves nothing): a
    connector with another secret, or none, is refused saying why; a hostile one that
    takes any proof and sends a wrong one is refused by the listener, which never
    registers it; one with the same secret then links and moves a message."""
    env = {
        "another secret": {SECRET_ENV: "another secret"},
        "no secret": {},
        "hostile": {SECRET_ENV: "a guess", TRUSTING_ENV: "1"},
    }[connector]
    rx = backend.child("gen", env={SECRET_ENV: "the secret"})
    try:
        address = rx.ok("start")["address"]
        tx = backend.child("ctx", env=env)
        try:
            res = tx.call("connect", peer=rx.key, address=address)
            assert not res["ok"], res
            if connector != "hostile":
                assert "did not prove the shared secret" in res["msg"], res
            else:
                refused = lambda: "did not prove the shared secret" in rx.stderr_text()  # noqa: E731
                wait_until(refused, 10, "the listener's refusal")
            assert tx.ok("info")["peers"] == []
            assert rx.ok("info")["peers"] == []
        finally:
            tx.stop()
        honest = backend.child("ctx2", env={SECRET_ENV: "the secret"})
        try:
            link_carries_a_message(honest, rx, address, tag=7)
        finally:
            honest.stop()
    finally:
        rx.stop()
