"""The UCX adapter (kvxferd.backends.ucx) across real processes on loopback.

Every transport runs in its own child process (this file run as a script:
`python test_ucx.py child NAME INCARNATION`), driven over JSON lines on
stdin/stdout, so that a peer can be SIGKILLed mid-transfer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
MIB = 1 << 20
SENTINEL = 0xAB


def _pattern(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


# ---------------------------------------------------------------------------
# Child side: one transport, commands from stdin, answers on stdout.
# ---------------------------------------------------------------------------


async def _child_main(name: str, incarnation: str) -> None:
    from kvxferd.backends.ucx import UcxTransport

    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | None] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read_stdin, daemon=True).start()
    transport = UcxTransport(name, incarnation, stall_grace_s=2.0)
    buffers: dict[str, bytearray] = {}
    running: dict[int, asyncio.Task[None]] = {}

    def answer(msg: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    async def run(cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "start":
            return {"address": await transport.start()}
        if op == "connect":
            await transport.connect(cmd["peer"], cmd["address"], cmd.get("deadline", 10.0))
            return {}
        if op == "send":
            data = memoryview(_pattern(cmd["seed"], cmd["size"]))
            answer({"id": cmd["id"], "event": "sending"})
            await transport.send(cmd["peer"], cmd["tag"], data)
            return {}
        if op == "recv":
            buf = bytearray([SENTINEL]) * cmd["size"]
            if "keep" in cmd:
                buffers[cmd["keep"]] = buf
            n = await transport.recv(cmd["peer"], cmd["tag"], memoryview(buf), cmd["deadline"])
            res: dict[str, Any] = {"n": n}
            if "seed" in cmd:
                res["verified"] = bytes(buf[:n]) == _pattern(cmd["seed"], n)
            return res
        if op == "untouched":
            return {"untouched": buffers[cmd["keep"]].count(SENTINEL) == len(buffers[cmd["keep"]])}
        if op == "digest":
            return {"digest": hashlib.sha256(buffers[cmd["keep"]]).hexdigest()}
        if op == "cancel":
            running[cmd["target"]].cancel()
            return {}
        if op == "remove_peer":
            await transport.remove_peer(cmd["peer"])
            return {}
        if op == "idle_cpu":
            cpu0, wall0 = time.process_time(), time.monotonic()
            await asyncio.sleep(cmd["seconds"])
            return {"percent": 100 * (time.process_time() - cpu0) / (time.monotonic() - wall0)}
        if op == "info":
            return {"mode": transport.progress_mode, "peers": transport.peers()}
        if op == "close":
            await transport.close()
            return {}
        raise ValueError(f"unknown op {op}")

    async def handle(cmd: dict[str, Any]) -> None:
        t0 = time.monotonic()
        try:
            res = await run(cmd)
            res["ok"] = True
        except (Exception, asyncio.CancelledError) as exc:
            res = {"ok": False, "error": type(exc).__name__, "msg": str(exc)}
            if "keep" in cmd and cmd["keep"] in buffers:
                # The buffer as it was when the call returned.
                res["digest"] = hashlib.sha256(buffers[cmd["keep"]]).hexdigest()
        res["id"] = cmd["id"]
        res["elapsed"] = time.monotonic() - t0
        answer(res)

    answer({"id": 0, "ok": True, "ready": True})
    while (line := await lines.get()) is not None:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        running[cmd["id"]] = asyncio.ensure_future(handle(cmd))
    await transport.close()


# ---------------------------------------------------------------------------
# Parent side.
# ---------------------------------------------------------------------------


class Child:
    def __init__(self, name: str, incarnation: str = "1", env: dict[str, str] | None = None):
        self.key = f"{name}/{incarnation}"
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), "child", name, incarnation],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, **(env or {})},
        )
        self._answers: dict[int | str, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._next = 1
        threading.Thread(target=self._read, daemon=True).start()
        self.wait(0, timeout=30)

    def _queue(self, id_: int | str) -> queue.Queue[dict[str, Any]]:
        with self._lock:
            return self._answers.setdefault(id_, queue.Queue())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                msg = json.loads(line)
                self._queue(f"event {msg['id']}" if "event" in msg else msg["id"]).put(msg)

    def submit(self, op: str, **kw: Any) -> int:
        with self._lock:
            id_, self._next = self._next, self._next + 1
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "id": id_, **kw}) + "\n")
        self.proc.stdin.flush()
        return id_

    def wait(self, id_: int | str, timeout: float = 30.0) -> dict[str, Any]:
        try:
            return self._queue(id_).get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.key}: no answer to command {id_} in {timeout}s") from None

    def event(self, id_: int, timeout: float = 30.0) -> str:
        return str(self.wait(f"event {id_}", timeout)["event"])

    def call(self, op: str, timeout: float = 30.0, **kw: Any) -> dict[str, Any]:
        return self.wait(self.submit(op, **kw), timeout)

    def ok(self, op: str, timeout: float = 30.0, **kw: Any) -> dict[str, Any]:
        res = self.call(op, timeout, **kw)
        assert res["ok"], res
        return res

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.submit("exit")
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def _ucxx_importable() -> bool:
    probe = subprocess.run(
        [sys.executable, "-c", "import ucxx"], capture_output=True, timeout=60, cwd=REPO
    )
    return probe.returncode == 0


if __name__ != "__main__" and not _ucxx_importable():
    pytest.skip(
        "ucxx does not import here (pip install ucxx-cu12); the UCX backend is untestable",
        allow_module_level=True,
    )


@pytest.fixture
def pair() -> Any:
    """A receiver listening and a sender connected to it."""
    rx, tx = Child("gen"), Child("ctx")
    try:
        address = rx.ok("start")["address"]
        tx.ok("connect", peer=rx.key, address=address)
        yield rx, tx
    finally:
        tx.stop()
        rx.stop()


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
    asyncio.run(_child_main(sys.argv[2], sys.argv[3]))
