"""The child-process harness of the two-sided transport tests.

test_twosided_contract.py holds what every two-sided transport must do (run
once per transport); test_ucx.py and test_mpi.py hold what is particular to
one. Every transport runs in its own child process (this file run as a script:
`python twosided_harness.py child TRANSPORT NAME INCARNATION`, which calls
`child_main`), driven over JSON lines on stdin/stdout, so that a peer can be
SIGKILLed mid-transfer. What differs between transports is named once, below:
how the child makes its transport and what it answers to "info" (`TRANSPORTS`),
and, on the parent side, the package it needs and how long it takes to start
(`UcxChild`, `MpiChild`).

Imported by the test files as a top-level module, like tests/daemon/daemon_harness.py:
pytest puts tests/backends (no __init__.py) on sys.path; run as a script, this file's
own folder comes first on sys.path.
"""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np

from kvxferd.backends.twosided import lent_until

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
MIB = 1 << 20
SENTINEL = 0xAB

# The transport of a child: any TwoSidedTransport (kvxferd/backends/twosided.py).
MakeTransport = Callable[[str, str], Any]
Info = Callable[[Any], dict[str, Any]]


def pattern(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).bytes(size)


@functools.cache
def importable(module: str) -> bool:
    """Whether `module` imports in a fresh interpreter (never imported here:
    importing ucxx, say, writes UCX_* variables into os.environ)."""
    probe = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, timeout=60, cwd=REPO
    )
    return probe.returncode == 0


# A child with this set sends that key over each new MPI link instead of its own: what a
# link that MPICH connected to another daemon receives (the rendezvous, over TCP, still
# names the child's own key).
POSE_ENV = "KVXFERD_TEST_MPI_POSE_AS"
# The shared secret a child's links prove (none without it).
SECRET_ENV = "KVXFERD_TEST_SECRET"
# A child with this set takes any proof of the secret from the other side, and sends its
# own: a hostile connector, which the listener's own check must stop.
TRUSTING_ENV = "KVXFERD_TEST_TRUST_ANY_PROOF"


def _secret() -> bytes:
    return os.environ.get(SECRET_ENV, "").encode()


# ---------------------------------------------------------------------------
# The transports: how a child makes one, and what it answers to "info".
# ---------------------------------------------------------------------------


def _ucx_transport(name: str, incarnation: str) -> Any:
    from kvxferd.backends.ucx import UcxTransport

    return UcxTransport(name, incarnation, stall_grace_s=2.0, secret=_secret())


def _ucx_info(transport: Any) -> dict[str, Any]:
    return {"mode": transport.progress_mode, "peers": transport.peers()}


def _mpi_transport(name: str, incarnation: str) -> Any:
    from kvxferd.backends.mpi import MpiTransport

    return MpiTransport(name, incarnation, stall_grace_s=2.0, secret=_secret())


def _mpi_info(transport: Any) -> dict[str, Any]:
    return {
        "mode": transport.mode,
        "peers": transport.peers(),
        "accepting": sum(t.name == "kvxferd-mpi-accept" for t in threading.enumerate()),
        "releasing": sum(t.name == "kvxferd-mpi-release" for t in threading.enumerate()),
        "accept_waiting": transport._links.accept_waiting,
        "penalized": sorted(transport._links._accept_turns._penalties),
        "pmi_env": sorted(k for k in os.environ if k.startswith("PMI_")),
        "requests_in_progress": transport.requests_in_progress(),
        "stalled": transport.stalled_peers(),
    }


TRANSPORTS: dict[str, tuple[MakeTransport, Info]] = {
    "ucx": (_ucx_transport, _ucx_info),
    "mpi": (_mpi_transport, _mpi_info),
}


# ---------------------------------------------------------------------------
# Child side: one transport, commands from stdin, answers on stdout.
# ---------------------------------------------------------------------------


class _NeverLeaves:
    """An MPI send request that never completes (mute_mpi_keepalives)."""

    def Test(self) -> bool:  # mpi4py's name
        return False


async def child_main(
    name: str, incarnation: str, make_transport: MakeTransport, info: Info
) -> None:
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | None] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=read_stdin, daemon=True).start()
    transport = make_transport(name, incarnation)
    buffers: dict[str, bytearray] = {}
    running: dict[int, asyncio.Task[None]] = {}
    # Failed calls whose buffer the transport keeps lent, by id: until when.
    lent: dict[int, asyncio.Future[Any]] = {}

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
            data = memoryview(pattern(cmd["seed"], cmd["size"]))
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
                res["verified"] = bytes(buf[:n]) == pattern(cmd["seed"], n)
            return res
        if op == "untouched":
            return {"untouched": buffers[cmd["keep"]].count(SENTINEL) == len(buffers[cmd["keep"]])}
        if op == "touched":
            return {"touched": buffers[cmd["keep"]].count(SENTINEL) < len(buffers[cmd["keep"]])}
        if op == "lent":
            return {"lent": not lent[cmd["target"]].done()}
        if op == "digest":
            return {"digest": hashlib.sha256(buffers[cmd["keep"]]).hexdigest()}
        if op == "cancel":
            running[cmd["target"]].cancel()
            return {}
        if op == "remove_peer":
            await transport.remove_peer(cmd["peer"])
            return {}
        if op == "block":  # the event loop stuck (a slow or stopped peer) for a while
            time.sleep(cmd["seconds"])
            return {}
        if op == "mute_mpi_keepalives":
            # What a receiver sees of a sender whose MPI messages stopped reaching it while
            # the sender runs (its receive queue held by a third process stopped inside a
            # shared-memory send, which only a debugger stops on purpose): its MPI
            # keepalive never leaves, so no next one is sent; TCP keepalives go on. The
            # real case: benchmarks/mpi_shm_stall.py.
            for peer in transport._links.peers.values():
                for link in peer.links:
                    link.keepalive_req = _NeverLeaves() if cmd["mute"] else None
            return {}
        if op == "flood_alive":  # a hostile MPI peer: keepalive bytes by the thousand
            from kvxferd.backends.mpi import wire

            for peer in transport._links.peers.values():
                for link in peer.links:
                    link.writer.write(wire.ALIVE * cmd["count"])
            return {}
        if op == "idle_cpu":
            cpu0, wall0 = time.process_time(), time.monotonic()
            await asyncio.sleep(cmd["seconds"])
            return {"percent": 100 * (time.process_time() - cpu0) / (time.monotonic() - wall0)}
        if op == "info":
            return info(transport)
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
            # The transport says it may still write `out` (twosided.lent_until).
            until = lent_until(exc)
            res["lent"] = until is not None
            if until is not None:
                lent[cmd["id"]] = until
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


class TransportChild:
    """One child process running one transport (a subclass per transport, below)."""

    transport: ClassVar[str]  # a key of TRANSPORTS
    package: ClassVar[str]  # what the transport imports; without it, it is untestable
    install: ClassVar[str]  # how to get that package
    ready_timeout: ClassVar[float] = 30.0  # for the child's first answer

    @classmethod
    def untestable(cls) -> str | None:
        """Why this transport cannot be tested here (the reason a test skips with), or None."""
        if importable(cls.package):
            return None
        return (
            f"{cls.package} does not import here ({cls.install}); "
            f"the {cls.transport.upper()} backend is untestable"
        )

    def __init__(
        self,
        name: str,
        incarnation: str = "1",
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        self.key = f"{name}/{incarnation}"
        self.address = ""
        command = [sys.executable, str(HERE), "child", self.transport, name, incarnation]
        # The child's stderr (its transport's log, and its threads' stacks when an answer
        # is late: see wait) goes into the failure message.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(
            [*(prefix or []), *command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            cwd=REPO,
            env={**os.environ, **(env or {})},
        )
        self._answers: dict[int | str, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._next = 1
        threading.Thread(target=self._read, daemon=True).start()
        self.wait(0, timeout=self.ready_timeout)

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

    def answer_within(self, id_: int | str, timeout: float) -> dict[str, Any] | None:
        """The answer to command `id_` if it comes within `timeout`, else None."""
        try:
            return self._queue(id_).get(timeout=timeout)
        except queue.Empty:
            return None

    def wait(self, id_: int | str, timeout: float = 30.0) -> dict[str, Any]:
        try:
            return self._queue(id_).get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"{self.key}: no answer to command {id_} in {timeout}s; its stderr, with "
                f"its threads' stacks now:\n{self.stacks()}"
            ) from None

    def stacks(self, limit: int = 6000) -> str:
        """The end of the child's stderr after asking it for its threads' stacks (SIGUSR1:
        faulthandler, registered by the child; mpiexec passes the signal on)."""
        size = self._stderr.seek(0, os.SEEK_END)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and self._stderr.seek(0, os.SEEK_END) == size:
                time.sleep(0.05)
            time.sleep(0.2)  # the dump is written in one go, a thread after the other
        return self.stderr_text()[-limit:]

    def stderr_text(self) -> str:
        """What the child wrote to stderr so far (its transport's log)."""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

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
        self._stderr.close()


class UcxChild(TransportChild):
    transport = "ucx"
    package = "ucxx"
    install = "pip install ucxx-cu12"


class MpiChild(TransportChild):
    transport = "mpi"
    package = "mpi4py"
    install = "pip install mpi4py mpich"
    ready_timeout = 60.0


def connected(rx: TransportChild, tx: TransportChild) -> None:
    """rx listening (its address kept in rx.address), tx connected to it."""
    rx.address = rx.ok("start")["address"]
    tx.ok("connect", peer=rx.key, address=rx.address)


C = TypeVar("C", bound=TransportChild)


@contextmanager
def connected_pair(child: type[C]) -> Iterator[tuple[C, C]]:
    """A receiver "gen" listening and a sender "ctx" connected to it, stopped after."""
    rx, tx = child("gen"), child("ctx")
    try:
        connected(rx, tx)
        yield rx, tx
    finally:
        tx.stop()
        rx.stop()


def link_carries_a_message(by: TransportChild, to: TransportChild, address: str, tag: int) -> None:
    """`by` links to `to` (listening at `address`), and a message crosses, verified."""
    by.ok("connect", peer=to.key, address=address)
    send = by.submit("send", peer=to.key, tag=tag, size=1000, seed=tag)
    assert to.ok("recv", peer=by.key, tag=tag, size=1000, deadline=20, seed=tag)["verified"]
    assert by.wait(send)["ok"]


def stopped_mid_message(
    rx: TransportChild, tx: TransportChild, tag: int, deadline: float, size: int = 512 * MIB
) -> int:
    """A large message from tx under way into rx's recv, then tx stopped (SIGSTOP) with
    part of it landed; returns the recv's id.

    tx is stopped before rx posts the receive (the payload cannot move before that), then
    let run 2 ms at a time until some of it landed: the whole message takes ~60 ms even
    at 8 GB/s. Stopping it once the payload was seen arriving raced the transfer, and
    lost once MPI's progress thread waited in MPI_Waitany instead of testing from Python;
    killing it 50 ms after it began sending raced it too, and lost on a faster host (the
    512 MiB were in before the kill)."""
    assert tx.event(tx.submit("send", peer=rx.key, tag=tag, size=size, seed=tag)) == "sending"
    tx.proc.send_signal(signal.SIGSTOP)
    recv = rx.submit("recv", peer=tx.key, tag=tag, size=size, deadline=deadline, keep=f"m{tag}")
    give_up = time.monotonic() + 30
    while not rx.ok("touched", keep=f"m{tag}")["touched"]:
        assert time.monotonic() < give_up, "the payload never started arriving"
        tx.proc.send_signal(signal.SIGCONT)
        time.sleep(0.002)
        tx.proc.send_signal(signal.SIGSTOP)
        time.sleep(0.02)
    ended = rx.answer_within(recv, timeout=0.2)
    assert ended is None, f"the receive ended before its sender was stopped mid-message: {ended}"
    return recv


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout}s")
        time.sleep(0.05)


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # TransportChild.stacks
    if os.environ.get("KVXFERD_HARNESS_LOG"):  # a child's transport log, when debugging
        import logging

        logging.basicConfig(level=os.environ["KVXFERD_HARNESS_LOG"])
    if posing_as := os.environ.get(POSE_ENV):  # an MPI peer whose MPI side is another's
        from kvxferd.backends.mpi import wire

        _identity = wire.identity
        wire.identity = lambda key, proof: _identity(posing_as, proof)
    if os.environ.get(TRUSTING_ENV):
        from kvxferd.backends.link_proof import Proofs

        Proofs.proves = lambda self, proof, peer, me: True  # type: ignore[method-assign]
    _make, _answer_info = TRANSPORTS[sys.argv[2]]
    asyncio.run(child_main(sys.argv[3], sys.argv[4], _make, _answer_info))
