"""The write operation every sending mover uses: post one WRITE, wait for it in slices up
to the request's deadline, and release it until the backend confirms it quiescent.

A post is checked again on the data-plane thread right before it is made (postguard):
a queued post can run long after it was queued. A write is waited in bounded slices
(kv_transfer_sender_future_timeout_ms) so that cancellation, a lost peer and the deadline
are noticed while it runs. Whatever happens, the caller gets the write back quiescent:
until the backend confirms the release, the blocks stay on loan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

import numpy as np

from kvxferd.backends.base import HOST, Backend, Memory, XferHandle, XferStatus
from kvxferd.errors import KvxferdError, PeerLostError, RemoteMemoryError, TransferError
from kvxferd.peers.channel import PeerConnection
from kvxferd.service.logs import TEXT_LIMIT, shown
from kvxferd.transceiver.dataplane import DataPlane
from kvxferd.transceiver.postguard import PostRefused, post_refusal
from kvxferd.transceiver.sessions import Terminal, TxSession
from kvxferd.transceiver.state import Reason, SessionState, Status
from kvxferd.transceiver.tx_drains import Drains, cancel_may_leak

log = logging.getLogger("kvxferd.sender")

# Poll back-off inside one wait slice: fast first (small writes finish in
# microseconds), capped so a long write costs little CPU. The event loop's timers round to
# whole milliseconds (uvloop: a pause under 0.5 ms is one turn of the loop, a poll every
# ~20 us), so the pauses after the first decide how long the loop polls flat out:
# - a host write doubles its pause (0.1, 0.2, 0.4, 0.8 ms...: three quick polls, then 1
#   and 2 ms). Its bytes are copied by the transport's threads on the same cores, so a
#   loop polling flat out would take CPU from the copy it waits for;
# - a write to or from device memory pauses a quarter of the time waited so far, so it is
#   seen done at most ~25 % late: flat out for about its first 2 ms, then 1 and 2 ms.
#   Its bytes move by DMA. Doubling saw a 1000 MiB write between two GPU staging regions
#   (H200) done 1.36 ms after its post, this at 0.51 ms (docs/benchmarks.md, "GPU check").
_POLL_FIRST_S = 0.0001
_POLL_MAX_S = 0.002
_POLL_SHARE = 0.25


def next_pause(pause_s: float, waited_s: float, device: bool) -> float:
    """The pause before the next poll of a write that paused `pause_s` last and has been
    waited `waited_s` so far; `device`: either side of it is device memory."""
    if device:
        return min(_POLL_MAX_S, max(_POLL_FIRST_S, waited_s * _POLL_SHARE))
    return min(pause_s * 2, _POLL_MAX_S)


# A host-to-host write up to this size is posted on the event loop's own thread when the
# backend allows it (DataPlane.call_cheap): over shared memory NIXL copies inside the post,
# ~15 us for 32 KiB here, against 40-70 us for the hop to the data-plane thread and back;
# 256 KiB keeps the loop's longest stall near 0.1 ms. However many requests are in flight:
# an earlier rule kept posts on the data-plane thread above 2 live requests (NIXL lets go
# of the GIL while it copies, so the loop could turn meanwhile), but on a quiet host the
# hop cost more than that overlap gained: with it gone the context daemon spent 0.21 instead
# of 0.29 ms of CPU per one-block request at 32 in flight, and moved 17 % more of them
# (docs/benchmarks.md, issue 16 "small requests").
INLINE_POST_MAX_BYTES = 256 << 10
# How long to keep retrying a release that NIXL refuses before giving up loudly.
_RELEASE_RETRY_S = 0.01
_RELEASE_RETRY_MAX_S = 0.2


# How long a write that failed as a local error waits for its peer's connection to close
# before it is reported so: see _ended_by.
PEER_GONE_GRACE_S = 0.5


async def _ended_by(exc: TransferError, conn: PeerConnection) -> Terminal:
    """How a backend error at a post or a poll ends its request, and whose fault it is:
    the peer going away, or addresses its agent never registered (RemoteMemoryError,
    raised only at a post), are the peer's; any other failure is ours, unless the peer's
    connection closes within PEER_GONE_GRACE_S. A process killed mid-write closes its
    sockets as it exits, not all at once, so the transport can see its data connection
    fail while the peer still accepts connections (Mooncake then reports a refusal of the
    write, not a lost peer: seen with the generation daemon killed mid-transfer, 1 CI run
    in 4)."""
    if isinstance(exc, PeerLostError):
        return Terminal.peer(Status.FAILED, Reason.PEER_LOST, str(exc))
    if isinstance(exc, RemoteMemoryError):
        return Terminal.peer(Status.FAILED, Reason.TRANSFER_ERROR, str(exc))
    if not conn.closed.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(conn.closed.wait(), PEER_GONE_GRACE_S)
    if conn.closed.is_set():
        return Terminal.peer(
            Status.FAILED,
            Reason.PEER_LOST,
            f"peer lost: {conn.peer.name}: {conn.close_reason} (its write failed: {exc})",
        )
    return Terminal.local(Status.FAILED, Reason.TRANSFER_ERROR, str(exc))


def nbytes_of(segments: np.ndarray) -> int:
    """Bytes of an (N, 2) segment list."""
    if len(segments) <= 64:
        return sum(segments[:, 1].tolist())  # a few runs: cheaper than numpy's own sum
    return int(segments[:, 1].sum())  # a head slice's thousands of runs


class Writes:
    """`slice_s`: the current wait slice (read at each slice: a reload may change it)."""

    def __init__(self, dataplane: DataPlane, slice_s: Callable[[], float]) -> None:
        self._dp = dataplane
        self._slice_s = slice_s
        self.open_handles = 0  # posted writes not yet confirmed quiescent
        # Told (wire seconds from post to done, descriptors) of each completed write.
        self.on_write_done: Callable[[float, int], None] | None = None
        # Writes ended in flight that could still land, waited out rather than cancelled.
        self.drains = Drains(self._poll, self._release)

    @property
    def backend_name(self) -> str:
        """The name of the backend the writes go through, once the data plane started."""
        return self._dp.backend.name

    async def post_and_wait(
        self,
        s: TxSession,
        local: np.ndarray,
        remote: np.ndarray,
        conn: PeerConnection | None = None,
        *,
        local_memory: Memory = HOST,
        remote_memory: Memory = HOST,
        on_posted: Callable[[], None] | None = None,
    ) -> XferStatus:
        """Post one WRITE (to `conn`'s agent, by default the first receiver's) and wait for
        it; always returns with the write quiescent. `local_memory`/`remote_memory`: what
        `local` and `remote` point into (the backend names each side's memory kind).
        `on_posted` is called once the write is in flight (a staged leg then gathers and
        posts its next round while this one moves)."""
        conn = conn or s.conn
        assert conn is not None
        backend = self._dp.backend
        s.advance(SessionState.TRANSFERRING)
        # Counted before posting: from here a cancel answers "busy".
        s.posting += 1
        status = XferStatus.ERROR
        handle: XferHandle | None = None
        device = local_memory.on_device or remote_memory.on_device
        try:
            if conn.stale:  # (fresh() is True at once otherwise: no coroutine for that)
                await conn.fresh()  # post_refusal, on the data-plane thread, judges it
            posted = time.monotonic()
            # `is` first: both are the HOST constant on the host path, and a dataclass's
            # == is a Python call. Decided once here; the post is told (None: host to host).
            host = (local_memory is HOST or local_memory == HOST) and (
                remote_memory is HOST or remote_memory == HOST
            )
            inline = host and nbytes_of(local) <= INLINE_POST_MAX_BYTES
            try:
                posted_write = await (self._dp.call_cheap if inline else self._dp.call)(
                    self._post_if_wanted,
                    s,
                    conn,
                    local,
                    remote,
                    backend,
                    None if host else (local_memory, remote_memory),
                )
            except PostRefused as exc:
                s.request_end(exc.terminal)
                return XferStatus.ERROR
            except TransferError as exc:
                s.request_end(await _ended_by(exc, conn))
                return XferStatus.ERROR
            handle, status = posted_write
            s.xfers.append(handle)
            self.open_handles += 1
            if on_posted is not None:
                on_posted()
            if status is XferStatus.IN_PROGRESS:  # a small post often completes inline
                status = await self._wait(s, handle, status, conn, device)
            if status is XferStatus.DONE and self.on_write_done is not None:
                self.on_write_done(time.monotonic() - posted, len(local))
            if status is XferStatus.ERROR and s.terminal is None:
                s.request_end(
                    Terminal.local(Status.FAILED, Reason.TRANSFER_ERROR, "backend reported ERR")
                )
            return status
        finally:
            if handle is not None:
                in_flight = status is XferStatus.IN_PROGRESS and not handle.released
                # Device memory on either side: never CMA (host memory only), and a copy
                # already queued on a GPU stream runs whatever the handle says.
                if in_flight and (device or cancel_may_leak(conn, backend.name)):
                    # Ended while in flight where a cancel may leak: drained, never cancelled
                    # (tx_drains.py); the request ends now with its blocks held.
                    s.draining.append(self.drains.start(s.request_id, conn, handle, s.pool))
                else:
                    # Until the backend confirms the release, the blocks stay on loan.
                    if handle.released:  # an inline completion was released in the post
                        self.open_handles -= 1
                    else:
                        await self._release(handle, s.request_id)
                s.xfers.remove(handle)
            s.posting -= 1

    def _post_if_wanted(
        self,
        s: TxSession,
        conn: PeerConnection,
        local: np.ndarray,
        remote: np.ndarray,
        backend: Backend,
        memories: tuple[Memory, Memory] | None = None,
    ) -> tuple[XferHandle, XferStatus]:
        """Right before the post, on the thread that makes it (the data-plane thread, or the
        loop's own for a small inline one): a queued post may run long after it was queued
        (the daemon was stopped, the thread was busy), so the request is checked again
        here; only reads, so safe off the event loop. `memories`: (ours, the receiver's)
        when either is not host memory; None: host to host."""
        refused = post_refusal(s, conn)
        if refused is not None:
            raise PostRefused(refused)
        if memories is None:
            # Host to host: the call every backend took before device memory existed.
            return backend.post_write(local, remote, conn.agent_name, remote_regions=conn.regions)
        local_memory, remote_memory = memories
        return backend.post_write(
            local,
            remote,
            conn.agent_name,
            local_memory=local_memory,
            remote_memory=remote_memory,
        )

    async def _wait(
        self,
        s: TxSession,
        handle: XferHandle,
        status: XferStatus,
        conn: PeerConnection,
        device: bool,
    ) -> XferStatus:
        """Poll `handle` until done, error, or an end requested between/inside slices
        (`device`: the write moves device memory, next_pause)."""
        backend = self._dp.backend
        deadline = s.deadline if s.deadline is not None else math.inf
        started = time.monotonic()
        slice_end = started + self._slice_s()
        pause = _POLL_FIRST_S
        while status is XferStatus.IN_PROGRESS:
            if s.terminal is not None:
                return status  # aborted, cancelled or peer lost: caller quiesces
            now = time.monotonic()
            if now >= deadline:
                s.request_end(
                    Terminal.timed_out(
                        Reason.SENDER_DEADLINE,
                        "kv_transfer_timeout_ms elapsed while the write was in progress",
                    )
                )
                return status
            if now >= slice_end:
                # One sender wait slice elapsed: check the peer before the next one.
                if conn.closed.is_set():
                    s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_LOST, conn.close_reason))
                    return status
                slice_end = now + self._slice_s()
            s.wake.clear()
            wait = min(pause, max(0.0, min(slice_end, deadline) - now))
            await s.wake.wait(wait)
            pause = next_pause(pause, time.monotonic() - started, device)
            try:
                status = await self._dp.call_cheap(backend.poll, handle)
            except TransferError as exc:
                s.request_end(await _ended_by(exc, conn))
                return XferStatus.ERROR
        return status

    async def _poll(self, handle: XferHandle) -> XferStatus:
        return await self._dp.call_cheap(self._dp.backend.poll, handle)

    async def _release(self, handle: XferHandle, request_id: str) -> None:
        backend = self._dp.backend
        pause = _RELEASE_RETRY_S
        while not handle.released:  # an inline completion was released in the post
            try:
                await self._dp.call_cheap(backend.release, handle)
            except KvxferdError as exc:
                # A backend that cannot cancel (Mooncake) refuses until the write ends,
                # which can take its whole timeout: say so once, then back off quietly.
                level = logging.WARNING if pause == _RELEASE_RETRY_S else logging.DEBUG
                log.log(
                    level,
                    "request %s: release refused, retrying: %s",
                    shown(request_id),
                    shown(exc, TEXT_LIMIT),
                )
                await asyncio.sleep(pause)
                pause = min(pause * 2, _RELEASE_RETRY_MAX_S)
        self.open_handles -= 1
