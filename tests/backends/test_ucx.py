"""What is particular to the UCX adapter (kvxferd.backends.ucx), across real
processes on loopback: its progress mode, how a stalled sender and a cancelled
recv end, and NIXL beside it in one process. What every two-sided transport
must do, UCX included, is in test_twosided_contract.py; the child-process
harness is twosided_harness.py.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from twosided_harness import MIB, REPO, connected_pair, pattern
from twosided_harness import UcxChild as Child

if (_untestable := Child.untestable()) is not None:
    pytest.skip(_untestable, allow_module_level=True)


@pytest.fixture
def pair() -> Iterator[tuple[Child, Child]]:
    """A receiver listening and a sender connected to it."""
    with connected_pair(Child) as rx_tx:
        yield rx_tx


def test_progress_mode(pair: tuple[Child, Child]) -> None:
    """Blocking mode by default (UCXPY_PROGRESS_MODE overrides it); what it
    costs while idle is test_twosided_contract.py's
    test_connected_transports_cost_no_cpu_while_idle."""
    rx, tx = pair
    mode = os.environ.get("UCXPY_PROGRESS_MODE") or "blocking"
    assert rx.ok("info")["mode"] == mode and tx.ok("info")["mode"] == mode


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
    assert res["digest"] == hashlib.sha256(pattern(4, size)).hexdigest()
    time.sleep(0.2)
    assert rx.ok("digest", keep="b")["digest"] == res["digest"]


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


def test_a_late_answer_fails_with_the_childs_thread_stacks() -> None:
    # The harness's own diagnosis (twosided_harness.TransportChild.wait): a child whose
    # event loop stands still is asked for its threads' stacks, which the failure shows.
    child = Child("stuck")
    try:
        child.submit("block", seconds=5)
        with pytest.raises(AssertionError) as caught:
            child.wait(child.submit("info"), timeout=0.5)
        text = str(caught.value)
        assert "no answer to command 2" in text
        assert "Current thread" in text or "Thread 0x" in text, text
        assert "in run" in text, text  # the frame the loop is stuck in (the 'block' op)
    finally:
        child.stop()
