"""The UCX adapter (kvxferd.backends.ucx) across real processes on loopback.

Every transport runs in its own child process (this file run as a script:
`python test_ucx.py child NAME INCARNATION`), driven over JSON lines on
stdin/stdout, so that a peer can be SIGKILLed mid-transfer (the harness,
shared with test_mpi.py, is twosided_harness.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from twosided_harness import MIB, REPO, TransportChild, child_main, connected_pair, importable
from twosided_harness import pattern as _pattern

HERE = Path(__file__).resolve()


def _make_transport(name: str, incarnation: str) -> Any:
    from kvxferd.backends.ucx import UcxTransport

    return UcxTransport(name, incarnation, stall_grace_s=2.0)


def _info(transport: Any) -> dict[str, Any]:
    return {"mode": transport.progress_mode, "peers": transport.peers()}


class Child(TransportChild):
    script = HERE


if __name__ != "__main__" and not importable("ucxx"):
    pytest.skip(
        "ucxx does not import here (pip install ucxx-cu12); the UCX backend is untestable",
        allow_module_level=True,
    )


@pytest.fixture
def pair() -> Iterator[tuple[Child, Child]]:
    """A receiver listening and a sender connected to it."""
    with connected_pair(Child) as rx_tx:
        yield rx_tx


def test_messages_of_every_size_arrive_intact_in_any_order(pair: tuple[Child, Child]) -> None:
    rx, tx = pair
    sizes = [1, 4096, 64 * MIB, 12345, 3, 8191, 8193, 1 * MIB + 7]
    tags = [(1 << 63) + 5, 0, 7, 2**64 - 1, 42, 43, 44, 45]
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
    # The listener side can send back on the endpoint the sender opened.
    back = rx.submit("send", peer=tx.key, tag=9, size=3 * MIB, seed=99)
    res = tx.ok("recv", peer=rx.key, tag=9, size=3 * MIB, deadline=30, seed=99)
    assert res["verified"]
    assert rx.wait(back)["ok"]


def test_progress_mode_and_idle_cpu(pair: tuple[Child, Child]) -> None:
    """Blocking mode by default (UCXPY_PROGRESS_MODE overrides it); a connected
    transport then costs next to no CPU while idle (ucxx 0.52's own blocking
    mode spun a whole core once an endpoint existed)."""
    rx, tx = pair
    mode = os.environ.get("UCXPY_PROGRESS_MODE") or "blocking"
    assert rx.ok("info")["mode"] == mode and tx.ok("info")["mode"] == mode
    if mode in {"blocking", "thread"}:
        for c in pair:
            assert c.ok("idle_cpu", seconds=1.0)["percent"] < 25


def test_one_recv_per_tag_at_a_time(pair: tuple[Child, Child]) -> None:
    rx, tx = pair
    first = rx.submit("recv", peer=tx.key, tag=6, size=10, deadline=20, seed=6)
    time.sleep(0.1)
    res = rx.call("recv", peer=tx.key, tag=6, size=10, deadline=20)
    assert res["error"] == "TransferError" and "already being received" in res["msg"], res
    tx.ok("send", peer=rx.key, tag=6, size=10, seed=6)
    assert rx.wait(first)["verified"]


def test_too_small_buffer_is_refused_and_the_message_kept(pair: tuple[Child, Child]) -> None:
    rx, tx = pair
    send = tx.submit("send", peer=rx.key, tag=3, size=100_000, seed=3)
    res = rx.call("recv", peer=tx.key, tag=3, size=1000, deadline=10)
    assert res["error"] == "TransferError" and "100000 bytes" in res["msg"]
    assert rx.ok("recv", peer=tx.key, tag=3, size=100_000, deadline=10, seed=3)["verified"]
    assert tx.wait(send)["ok"]


def test_timeout_and_a_late_message_never_lands(pair: tuple[Child, Child]) -> None:
    rx, tx = pair
    for tag, size in ((11, 2 * MIB), (12, 100)):  # rendezvous and eager
        res = rx.call("recv", peer=tx.key, tag=tag, size=size, deadline=0.3, keep=f"b{tag}")
        assert res["error"] == "TransferTimeoutError", res
        assert 0.25 < res["elapsed"] < 3, res
        # Now the late message: the sender's send completes (it is drained)...
        tx.ok("send", peer=rx.key, tag=tag, size=size, seed=tag, timeout=15)
    # ...and never reaches the buffer of the receive that timed out.
    time.sleep(0.3)
    for tag in (11, 12):
        assert rx.ok("untouched", keep=f"b{tag}")["untouched"]
    # The connection is still fine, and a tag is reusable after its timeout.
    send = tx.submit("send", peer=rx.key, tag=11, size=5 * MIB, seed=5)
    assert rx.ok("recv", peer=tx.key, tag=11, size=5 * MIB, deadline=20, seed=5)["verified"]
    assert tx.wait(send)["ok"]


def test_missing_peer_is_peer_lost() -> None:
    c = Child("lonely")
    try:
        res = c.call("send", peer="nobody/0", tag=1, size=10, seed=1)
        assert res["error"] == "PeerLostError" and "nobody/0" in res["msg"], res
        res = c.call("recv", peer="nobody/0", tag=1, size=10, deadline=1)
        assert res["error"] == "PeerLostError" and "never connected" in res["msg"], res
        res = c.call("connect", peer="nobody/0", address="127.0.0.1:1", deadline=5)
        assert res["error"] in {"PeerLostError", "TransferTimeoutError"}, res
    finally:
        c.stop()


def test_restarted_peer_is_refused_by_key() -> None:
    rx, tx = Child("gen", "2"), Child("ctx")
    try:
        address = rx.ok("start")["address"]
        res = tx.call("connect", peer="gen/1", address=address)
        assert res["error"] == "PeerLostError" and "gen/2" in res["msg"], res
    finally:
        tx.stop()
        rx.stop()


@pytest.mark.parametrize("phase", ["waiting", "mid-message"])
def test_sender_killed_is_peer_lost_promptly(pair: tuple[Child, Child], phase: str) -> None:
    rx, tx = pair
    size = 512 * MIB if phase == "mid-message" else 10
    recv = rx.submit("recv", peer=tx.key, tag=77, size=size, deadline=60)
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
    if phase == "mid-message":
        assert "recv of tag 77" in res["msg"], res  # failed by UCX, not found dead while waiting
    rx.ok("remove_peer", peer=tx.key)
    assert rx.ok("info")["peers"] == []


def test_stalled_sender_then_nothing_lands_after_recv_returned(pair: tuple[Child, Child]) -> None:
    """The sender stops (SIGSTOP) with its message matched but not moved: recv
    gives up stall_grace_s (2 s in the children) past its deadline, closes the
    connection, and the buffer no longer changes once recv returned, even when
    the sender resumes."""
    rx, tx = pair
    size = 64 * MIB
    send = tx.submit("send", peer=rx.key, tag=8, size=size, seed=8)
    assert tx.event(send) == "sending"
    time.sleep(0.2)  # its rendezvous header is queued at the receiver
    tx.proc.send_signal(signal.SIGSTOP)
    try:
        res = rx.call("recv", peer=tx.key, tag=8, size=size, deadline=0.5, keep="b")
        assert res["error"] == "PeerLostError" and "stalled" in res["msg"], res
        assert res["elapsed"] < 6, res
    finally:
        tx.proc.send_signal(signal.SIGCONT)
    assert tx.wait(send, timeout=20)["error"] == "PeerLostError"
    time.sleep(0.3)
    assert rx.ok("digest", keep="b")["digest"] == res["digest"]


def test_cancelled_recv_returns_once_the_buffer_is_quiescent(pair: tuple[Child, Child]) -> None:
    """Cancelling the task in recv mid-message defers the CancelledError until
    UCX is done with the buffer (the peer is alive: the message completes)."""
    rx, tx = pair
    size = 64 * MIB
    send = tx.submit("send", peer=rx.key, tag=4, size=size, seed=4)
    assert tx.event(send) == "sending"
    time.sleep(0.2)  # queued at the receiver: recv posts at once, then awaits
    recv = rx.submit("recv", peer=tx.key, tag=4, size=size, deadline=30, keep="b")
    rx.submit("cancel", target=recv)
    res = rx.wait(recv, timeout=20)
    assert res["error"] == "CancelledError", res
    assert tx.wait(send, timeout=20)["ok"]
    assert res["digest"] == hashlib.sha256(_pattern(4, size)).hexdigest()
    time.sleep(0.2)
    assert rx.ok("digest", keep="b")["digest"] == res["digest"]


def test_removed_peer_fails_pending_receives(pair: tuple[Child, Child]) -> None:
    rx, tx = pair
    recv = rx.submit("recv", peer=tx.key, tag=5, size=10, deadline=30)
    time.sleep(0.2)
    rx.ok("remove_peer", peer=tx.key)
    res = rx.wait(recv, timeout=10)
    assert res["error"] == "PeerLostError", res


def test_missing_package_is_backend_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvxferd.backends import ucx
    from kvxferd.errors import BackendUnavailableError

    monkeypatch.setitem(sys.modules, "ucxx", None)  # makes `import ucxx` raise ImportError
    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "n")  # what the adapter sets; restored after
    with pytest.raises(BackendUnavailableError, match="pip install ucxx-cu12"):
        ucx.UcxTransport("ctx", "1")


_BOTH_LIBRARIES = """
import asyncio, sys
import numpy as np
first = sys.argv[1]
if first == "nixl":
    from kvxferd.backends.nixl import NixlBackend
    from kvxferd.backends.ucx import UcxTransport
else:
    from kvxferd.backends.ucx import UcxTransport
    from kvxferd.backends.nixl import NixlBackend
import nixl_cu12, ucxx
print("ucx", ucxx.get_ucx_version())

# NIXL: one write between two agents of this process.
a, b = NixlBackend("a"), NixlBackend("b")
src = np.arange(1 << 16, dtype=np.uint8); dst = np.zeros_like(src)
a.register(src.ctypes.data, src.nbytes); b.register(dst.ctypes.data, dst.nbytes)
peer = a.add_peer(b.metadata()); a.connect(peer)
seg = lambda arr: np.array([[arr.ctypes.data, arr.nbytes]], dtype=np.int64)
handle, status = a.post_write(seg(src), seg(dst), peer)
while int(status) == 0:
    status = a.poll(handle)
assert int(status) == 1 and (src == dst).all(), status

# UCX: one message between two transports of this process.
async def main():
    rx, tx = UcxTransport("rx", "1"), UcxTransport("tx", "1")
    address = await rx.start()
    await tx.connect("rx/1", address, 10)
    out = bytearray(3 << 20)
    msg = np.random.default_rng(0).bytes(len(out))
    send = asyncio.ensure_future(tx.send("rx/1", 5, memoryview(msg)))
    assert await rx.recv("tx/1", 5, memoryview(out), 10) == len(out)
    await send
    assert out == msg
    await tx.close(); await rx.close()
asyncio.run(main())
print("both ok")
"""


@pytest.mark.parametrize("first", ["nixl", "ucx"])
def test_nixl_and_ucxx_in_one_process(first: str) -> None:
    pytest.importorskip("nixl_cu12", reason="NIXL is not installed (scripts/install.sh)")
    res = subprocess.run(
        [sys.executable, "-c", _BOTH_LIBRARIES, first],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert res.returncode == 0 and "both ok" in res.stdout, res.stdout + res.stderr[-3000:]


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    asyncio.run(child_main(sys.argv[2], sys.argv[3], _make_transport, _info))
