"""Writes that ended while in flight to a daemon on another host: drained, not cancelled.

Over UCX's TCP transport a put is bytes in our socket. Releasing (cancelling) an in-flight
NIXL handle drops what UCX had not handed to the socket yet, not the bytes already in our
kernel's send buffer: a cut link that heals retransmits them, and the receiver's UCX copies
them to the address they name whether that memory is still lent, registered or mapped
(seen: SIGSEGV in uct_tcp_iface_progress, benchmarks/results/2026-12-01/
issue18_link_flap_segfault.txt). Our Abort and AbortAck tell the receiver that nothing
more of the write can land, so such a write is never just cancelled: its handle is polled
until the backend reports DONE (NIXL ends a transfer with an endpoint flush: every put
was acknowledged by the receiver after it copied it) or ERROR (UCX failed the endpoint
and closed its socket), and only then released.

That wait has no timer (only the backend knows when the write stopped), so it never holds
up the engine's outcome (promise 1): the request ends on time with `blocks_held`, the
source blocks stay lent and their pool registered, and the engine hears `released`
(how "drained") when the drain ends. What waits for it is what must mean "quiescent": an
AbortAck to that receiver, an Abort we owe it, and settling its old incarnation.

A write to a daemon on this kernel and pid namespace is still cancelled at once when UCX
may move it with CMA on both ends (cancel_may_leak): the writer's own process copies the
bytes, and a cancelled write leaves nothing to land later. Without CMA (UCX_TLS=tcp, or
Yama's ptrace_scope) it is drained like one to another host: a receiver stopped mid-write
lands the queued bytes when it resumes (tests/daemon/test_faults.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from kvxferd.backends.base import XferHandle, XferStatus
from kvxferd.backends.cma import cma_writes_here
from kvxferd.errors import TransferError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.process import comparable
from kvxferd.service.logs import TEXT_LIMIT, shown
from kvxferd.service.pools import LocalPool

log = logging.getLogger("kvxferd.sender")

# The poll back-off of a drain: quick at first (most drains end within a round trip),
# then at most this often; and how often a drain that does not end is reported.
_POLL_FIRST_S = 0.001
_POLL_MAX_S = 0.05
_WARN_EVERY_S = 10.0


def cancel_may_leak(conn: PeerConnection, backend: str) -> bool:
    """Whether cancelling an in-flight write of `backend` to `conn`'s daemon may leave
    bytes that land later: True unless that daemon runs on this kernel in our pid
    namespace and both ends' UCX may write with CMA (kvxferd/backends/cma.py). Across
    hosts, and on one host without CMA, the bytes travel as messages (UCX over TCP: our
    kernel's send buffer; its shared-memory queues; RDMA: the NIC's queue) that the
    receiver lands when it runs, which a cancel does not take back."""
    return not (comparable(conn.info.process) and conn.info.ucx_cma and cma_writes_here(backend))


@dataclass(eq=False)
class Drain:
    """One write being drained: whose, into which daemon incarnation, and its handle.
    `mark`: its entry among the source pool's users (the pool stays registered)."""

    request_id: str
    peer_name: str
    incarnation: str
    handle: XferHandle
    pool: LocalPool | None
    mark: str
    since: float = field(default_factory=time.monotonic)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    how: str = ""  # what the backend reported at the end: DONE, ERROR or poll_failed
    # Run when it ends: hand back what the write read from (TxSession.when_quiescent).
    then: list[Callable[[], None]] = field(default_factory=list)

    @property
    def held_ms(self) -> float:
        return (time.monotonic() - self.since) * 1e3


Poll = Callable[[XferHandle], Awaitable[XferStatus]]
Release = Callable[[XferHandle, str], Awaitable[None]]


class Drains:
    """The drains of the sender's writes. `poll` and `release` are the data plane's calls
    (Writes); `on_end` is told of each drain once its handle is released."""

    def __init__(self, poll: Poll, release: Release) -> None:
        self._poll = poll
        self._release = release
        self.active: list[Drain] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.on_end: Callable[[Drain], None] | None = None
        self.started_total = 0
        self.ended_total: dict[str, int] = {}

    def start(
        self, request_id: str, conn: PeerConnection, handle: XferHandle, pool: LocalPool | None
    ) -> Drain:
        """Take over `handle`, an in-flight write of `request_id` to `conn`'s daemon."""
        self.started_total += 1
        mark = f"tx-drain:{request_id}#{self.started_total}"
        drain = Drain(request_id, conn.peer.name, conn.peer.incarnation, handle, pool, mark)
        if pool is not None:
            pool.users.add(mark)
        self.active.append(drain)
        task = asyncio.create_task(self._run(drain), name=f"drain-{request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        log.info(
            "request %s: the write to %s was in flight when the request ended; draining it "
            "(over TCP a cancel would leave its bytes in the socket); its blocks stay lent",
            shown(request_id),
            drain.peer_name,
            extra={"request_id": request_id},
        )
        return drain

    def of(self, peer_name: str, incarnation: str, request_id: str | None = None) -> list[Drain]:
        """The active drains into that daemon incarnation (of one request, or all)."""
        return [
            d
            for d in self.active
            if d.peer_name == peer_name
            and d.incarnation == incarnation
            and (request_id is None or d.request_id == request_id)
        ]

    @staticmethod
    async def wait(drains: Iterable[Drain]) -> None:
        """Until every one of `drains` has ended (no timer: see the module's text)."""
        for drain in list(drains):
            await drain.ended.wait()

    async def _run(self, drain: Drain) -> None:
        pause = _POLL_FIRST_S
        warn_at = drain.since + _WARN_EVERY_S
        try:
            while True:
                try:
                    status = await self._poll(drain.handle)
                except TransferError as exc:
                    # The backend no longer knows the write: nothing more of it can move.
                    log.warning(
                        "request %s: polling a drained write failed (%s); releasing it",
                        shown(drain.request_id),
                        shown(exc, TEXT_LIMIT),
                    )
                    drain.how = "poll_failed"
                    break
                if status is not XferStatus.IN_PROGRESS:
                    drain.how = status.name
                    break
                now = time.monotonic()
                if now >= warn_at:
                    log.warning(
                        "request %s: a write to %s ended %.0f s ago and is still in flight; "
                        "its blocks stay lent until the transport completes or fails it",
                        shown(drain.request_id),
                        drain.peer_name,
                        now - drain.since,
                    )
                    warn_at = now + _WARN_EVERY_S
                await asyncio.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_S)
            await self._release(drain.handle, drain.request_id)
        finally:
            # Shutdown cancels a drain only after the backend is closing: the handle goes
            # with it. In every case the waiters are let go and the pool's mark dropped.
            self._end(drain)

    def _end(self, drain: Drain) -> None:
        if drain in self.active:
            self.active.remove(drain)
        if drain.pool is not None:
            drain.pool.users.discard(drain.mark)
        for release in drain.then:
            release()
        drain.then.clear()
        how = drain.how = drain.how or "shutdown"
        self.ended_total[how] = self.ended_total.get(how, 0) + 1
        log.info(
            "request %s: drained write to %s ended (%s) after %.1f s; its blocks are back",
            shown(drain.request_id),
            drain.peer_name,
            how,
            drain.held_ms / 1e3,
            extra={"request_id": drain.request_id},
        )
        drain.ended.set()
        if self.on_end is not None:
            self.on_end(drain)

    async def close(self) -> list[Drain]:
        """Shutdown: stop waiting; the drains still active are returned (reported by the
        caller: their blocks must be treated as never returned)."""
        left = list(self.active)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        return left

    def status(self) -> dict[str, object]:
        return {
            "active": len(self.active),
            "started_total": self.started_total,
            "ended_total": dict(self.ended_total),
        }
