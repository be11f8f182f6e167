"""Drains on their own: a drained write is released only once the backend says it ended,
its waiters and its pool's mark go with it, and shutdown lets them go without a release.

The backend here is a stand-in whose poll says IN_PROGRESS until the test says otherwise:
a real NIXL write that stays in flight exactly as long as a test needs is what a real
part cannot give (tests/cluster/test_drained_writes.py drains real writes into a
stopped host).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from kvxferd.backends.base import XferHandle, XferStatus
from kvxferd.errors import TransferError
from kvxferd.peers import process
from kvxferd.transceiver import tx_drains
from kvxferd.transceiver.sessions import TxSession
from kvxferd.transceiver.tx_drains import Drain, Drains, cancel_may_leak


@dataclass
class Backend:
    """Poll answers `status` (or raises `fail`); release marks the handle released."""

    status: XferStatus = XferStatus.IN_PROGRESS
    fail: TransferError | None = None
    polls: int = 0
    released: list[str] = field(default_factory=list)

    async def poll(self, handle: XferHandle) -> XferStatus:
        self.polls += 1
        if self.fail is not None:
            raise self.fail
        return self.status

    async def release(self, handle: XferHandle, request_id: str) -> None:
        handle.released = True
        self.released.append(request_id)


def conn(
    name: str = "gen0", incarnation: str = "i1", proc: Any = None, ucx_cma: bool = True
) -> Any:
    peer = SimpleNamespace(name=name, incarnation=incarnation)
    return SimpleNamespace(peer=peer, info=SimpleNamespace(process=proc, ucx_cma=ucx_cma))


def handle() -> XferHandle:
    return XferHandle(native=object(), peer_agent="gen0.i1", nbytes=4096, descriptors=1)


async def _until(predicate: Any, what: str) -> None:
    async def wait() -> None:
        while not predicate():
            await asyncio.sleep(0.001)

    try:
        await asyncio.wait_for(wait(), 10.0)
    except asyncio.TimeoutError:
        raise AssertionError(f"not {what}") from None


def test_released_only_once_the_backend_says_it_ended() -> None:
    async def run() -> None:
        backend = Backend()
        drains = Drains(backend.poll, backend.release)
        ended: list[Drain] = []
        drains.on_end = ended.append
        pool: Any = SimpleNamespace(users=set())
        drain = drains.start("r1", conn(), handle(), pool)
        assert pool.users == {drain.mark}  # the pool stays registered meanwhile
        waiter = asyncio.create_task(Drains.wait(drains.of("gen0", "i1", "r1")))
        await _until(lambda: backend.polls >= 5, "polled")
        assert not waiter.done() and not backend.released and not ended
        backend.status = XferStatus.DONE
        await asyncio.wait_for(waiter, 10.0)
        assert backend.released == ["r1"] and ended == [drain]
        assert drain.how == "DONE" and not pool.users and not drains.active
        assert drains.status() == {"active": 0, "started_total": 1, "ended_total": {"DONE": 1}}

    asyncio.run(run())


def test_a_poll_the_backend_refuses_ends_the_drain() -> None:
    """NIXL forgetting the handle (NOT_FOUND once the agent went): nothing more moves."""

    async def run() -> None:
        backend = Backend(fail=TransferError("NIXL_ERR_NOT_FOUND"))
        drains = Drains(backend.poll, backend.release)
        drain = drains.start("r1", conn(), handle(), None)
        await asyncio.wait_for(drain.ended.wait(), 10.0)
        assert drain.how == "poll_failed" and backend.released == ["r1"]

    asyncio.run(run())


def test_drains_are_found_by_daemon_incarnation_and_request() -> None:
    async def run() -> None:
        backend = Backend()
        drains = Drains(backend.poll, backend.release)
        a = drains.start("r1", conn("gen0", "i1"), handle(), None)
        b = drains.start("r2", conn("gen0", "i1"), handle(), None)
        c = drains.start("r1", conn("gen0", "i2"), handle(), None)
        d = drains.start("r1", conn("gen1", "i1"), handle(), None)
        assert drains.of("gen0", "i1") == [a, b]
        assert drains.of("gen0", "i1", "r1") == [a]
        assert drains.of("gen0", "i2") == [c] and drains.of("gen1", "i1", "r1") == [d]
        assert drains.of("gen2", "i1") == []
        await drains.close()

    asyncio.run(run())


def test_shutdown_lets_waiters_go_without_a_release() -> None:
    """The handle goes with the backend; the blocks are never said to be back."""

    async def run() -> None:
        backend = Backend()
        drains = Drains(backend.poll, backend.release)
        ended: list[str] = []
        drains.on_end = lambda drain: ended.append(drain.how)
        pool: Any = SimpleNamespace(users=set())
        drain = drains.start("r1", conn(), handle(), pool)
        waiter = asyncio.create_task(Drains.wait([drain]))
        await _until(lambda: backend.polls >= 1, "polled")
        left = await drains.close()
        await asyncio.wait_for(waiter, 10.0)
        assert left == [drain] and ended == ["shutdown"] and backend.released == []
        assert not pool.users and drains.ended_total == {"shutdown": 1}

    asyncio.run(run())


def test_only_a_peer_on_another_kernel_or_pid_namespace_may_leak(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With UCX's CMA on both ends (kvxferd/backends/cma.py): the peer's process decides."""
    monkeypatch.setattr(tx_drains, "cma_writes_here", lambda backend: True)
    me = process.me()
    here = process.ProcessInfo(me.boot_id, me.pid_ns, os.getpid(), 1)
    assert not cancel_may_leak(conn(proc=here), "NIXL")
    assert cancel_may_leak(conn(proc=process.ProcessInfo("another-boot", me.pid_ns, 1, 1)), "NIXL")
    assert cancel_may_leak(conn(proc=process.ProcessInfo(me.boot_id, "pid:[1]", 1, 1)), "NIXL")
    assert cancel_may_leak(conn(proc=None), "NIXL")  # unknown: assumed remote


def test_on_one_kernel_a_write_is_cancelled_at_once_only_with_cma_on_both_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    me = process.me()
    here = process.ProcessInfo(me.boot_id, me.pid_ns, os.getpid(), 1)
    monkeypatch.setattr(tx_drains, "cma_writes_here", lambda backend: backend == "NIXL")
    assert not cancel_may_leak(conn(proc=here), "NIXL")
    # The receiver's UCX without CMA (or too old to say): it lands queued messages later.
    assert cancel_may_leak(conn(proc=here, ucx_cma=False), "NIXL")
    # Ours without CMA (Mooncake's own TCP here; or UCX_TLS leaving CMA out).
    assert cancel_may_leak(conn(proc=here), "MOONCAKE")


def test_memory_a_drained_write_reads_goes_back_when_every_drain_ended() -> None:
    """A bounce or staging reservation is handed back once the session's writes are all
    quiescent: at once without a drain, else when the last of its drains ends."""

    async def run() -> None:
        backend = Backend()
        drains = Drains(backend.poll, backend.release)
        s = TxSession("r1", None)
        back: list[str] = []
        s.when_quiescent(lambda: back.append("now"))
        assert back == ["now"]
        s.draining = [drains.start("r1", conn(), handle(), None) for _ in range(2)]
        s.when_quiescent(lambda: back.append("later"))
        assert back == ["now"] and s.held
        backend.status = XferStatus.ERROR
        await asyncio.wait_for(Drains.wait(s.draining), 10.0)
        assert back == ["now", "later"] and not s.held

    asyncio.run(run())
