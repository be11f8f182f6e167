"""The staged runtime (transceiver_runtime CPP, or null, or auto falling back to it).

KV moves through preallocated staging buffers instead of straight into the
destination blocks: the context side gathers a round of whole blocks into its
send staging region, the bytes cross into a reservation the generation side
made in its receive staging region, and the generation side scatters them into
the destination blocks. A request larger than its reservation moves in rounds;
the receiver acknowledges each round (RoundAck) once scattered, so the same
reservation takes the next one.

Both regions are sized by max_tokens_in_buffer (else the engine's
max_seq_len, else DEFAULT_STAGING_TOKENS) worth of whole blocks, so every
request the admission window lets in fits. The seed's timeouts apply as in
the PYTHON runtime: the sender's absolute deadline covers all rounds, the
receiver's per-task timeout covers the whole receive. Reservations are freed
only when no write into them can still land.

This runtime reuses the PYTHON runtime's sessions, admission, peer channel
and quiescence rules; only how bytes cross differs.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import numpy as np

from kvxferd.backends.base import XferStatus
from kvxferd.backends.twosided import TwoSidedTransport, round_tag
from kvxferd.errors import PeerLostError, TransferError, TransferTimeoutError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import Result, RoundAck
from kvxferd.transceiver.bounce import Reservation
from kvxferd.transceiver.receiver import Receiver
from kvxferd.transceiver.sender import Sender
from kvxferd.transceiver.sessions import RxSession, Terminal, TxSession
from kvxferd.transceiver.state import Reason, SessionState, Status

DEFAULT_STAGING_TOKENS = 8192

# How often a request waiting for staging room looks again (room frees when
# another request's round completes; the deadline bounds the wait).
_ROOM_POLL_S = 0.001
# Opening the UCX endpoint to a peer the handshake already vouched for.
_CONNECT_TIMEOUT_S = 10.0


def staging_bytes(tokens: int, tokens_per_block: int, block_bytes: int) -> int:
    return math.ceil(tokens / tokens_per_block) * block_bytes


async def _reserve(
    reserve: Callable[[int], Reservation | None], nbytes: int, deadline: float
) -> Reservation | None:
    while True:
        res = reserve(nbytes)
        if res is not None or time.monotonic() >= deadline:
            return res
        await asyncio.sleep(_ROOM_POLL_S)


class StagedSender(Sender):
    # Set by the daemon when the backend is two-sided (UCX); None: NIXL writes.
    transport: TwoSidedTransport | None = None
    _connected: set[str] | None = None

    async def on_round_ack(self, conn: PeerConnection, msg: RoundAck) -> None:
        s = self._match(conn, msg.request_id, msg.rx_token)
        if s is not None:
            s.acked_block = max(s.acked_block, msg.end_block)
            s.wake.set()

    async def _write_slice(self, s: TxSession, start: int, end: int, last: bool) -> None:
        assert s.conn is not None and s.request is not None and s.pool is not None
        assert self.bounce is not None
        plan = self._plan(s, start, end)  # block counts and geometry, checked once
        if isinstance(plan, Terminal):
            s.request_end(plan)
            return
        staging = self.bounce
        block_bytes = s.pool.layout.block_bytes
        per_round = min(s.request.bounce_nbytes, staging.send.nbytes) // block_bytes
        if per_round < 1 or s.conn.info.bounce_nbytes == 0:
            s.request_end(
                Terminal.peer(
                    Status.FAILED,
                    Reason.BLOCK_MISMATCH,
                    f"the staging reservation ({s.request.bounce_nbytes} bytes offered, "
                    f"{staging.send.nbytes} here) cannot hold one {block_bytes}-byte block",
                )
            )
            return
        deadline = s.deadline if s.deadline is not None else math.inf
        s.advance(SessionState.TRANSFERRING)  # status and metrics see staged rounds too
        first = start
        while first < end and s.terminal is None:
            stop = min(end, first + per_round)
            if not await self._one_round(s, first, stop, stop == end and last, deadline):
                return
            first = stop

    async def _one_round(
        self, s: TxSession, first: int, stop: int, last: bool, deadline: float
    ) -> bool:
        assert s.conn is not None and s.request is not None and s.pool is not None
        assert self.bounce is not None
        staging = self.bounce
        nbytes = (stop - first) * s.pool.layout.block_bytes
        res = await _reserve(staging.send.reserve, nbytes, deadline)
        if res is None:
            s.request_end(
                Terminal.local(
                    Status.TIMED_OUT,
                    Reason.SENDER_DEADLINE,
                    "kv_transfer_timeout_ms elapsed waiting for room in the staging buffer",
                )
            )
            return False
        result = Result(
            request_id=s.request_id,
            rx_token=s.request.rx_token,
            status=Reason.OK,
            nbytes=nbytes,
            last=last,
            bounced=True,
            first_block=first,
            end_block=stop,
        )
        try:
            await staging.gather(
                s.pool.region.array, s.pool.layout, s.blocks[first:stop], res, nbytes
            )
            if self.transport is not None:
                if not await self._send_two_sided(s, res, nbytes, result, deadline):
                    return False
            else:
                local = np.array([[staging.send.address + res.offset, nbytes]], dtype=np.int64)
                remote = np.array(
                    [[s.conn.info.bounce_base + s.request.bounce_offset, nbytes]],
                    dtype=np.int64,
                )
                status = await self._post_and_wait(s, local, remote)
                if status is not XferStatus.DONE or s.terminal is not None:
                    return False
        finally:
            staging.send.release(res)  # both paths return only once the bytes are quiescent
        if time.monotonic() > deadline:
            s.request_end(
                Terminal.local(
                    Status.TIMED_OUT,
                    Reason.SENDER_DEADLINE,
                    "a round completed after kv_transfer_timeout_ms; not reported as success",
                )
            )
            return False
        s.nbytes += nbytes
        s.written = stop
        # One-sided: the bytes are in place, say so. Two-sided: said before sending.
        sent = self.transport is not None or await s.conn.send(result)
        if not sent:
            s.request_end(
                Terminal.peer(Status.FAILED, Reason.PEER_LOST, "could not report the round")
            )
            s.peer_told = True
            return False
        if last:
            return True
        # The receiver's reservation is reused: wait until it scattered this round.
        while s.acked_block < stop and s.terminal is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                s.request_end(
                    Terminal.local(
                        Status.TIMED_OUT,
                        Reason.SENDER_DEADLINE,
                        "kv_transfer_timeout_ms elapsed waiting for the receiver to take a round",
                    )
                )
                return False
            s.wake.clear()
            try:
                await asyncio.wait_for(s.wake.wait(), None if remaining == math.inf else remaining)
            except asyncio.TimeoutError:
                continue
        return s.terminal is None

    async def _send_two_sided(
        self, s: TxSession, res: Reservation, nbytes: int, result: Result, deadline: float
    ) -> bool:
        """Announce the round (the receiver then receives it by tag), then send it."""
        assert self.transport is not None and self.bounce is not None
        assert s.conn is not None and s.request is not None
        if self._connected is None:
            self._connected = set()
        s.posting = True  # from here a cancel answers "busy"
        try:
            try:
                if s.conn.key not in self._connected:
                    await self.transport.connect(
                        s.conn.key, s.conn.info.transport_address, _CONNECT_TIMEOUT_S
                    )
                    self._connected.add(s.conn.key)
                if not await s.conn.send(result):
                    s.request_end(
                        Terminal.peer(Status.FAILED, Reason.PEER_LOST, "could not announce a round")
                    )
                    s.peer_told = True
                    return False
                data = self.bounce.send.view(res, nbytes).data
                tag = round_tag(s.request.rx_token, result.first_block)
                remaining = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
                # On timeout the send is cancelled, which returns only once UCX no
                # longer reads the staging bytes (or the endpoint was closed).
                await asyncio.wait_for(self.transport.send(s.conn.key, tag, data), remaining)
            except asyncio.TimeoutError:
                s.request_end(
                    Terminal.local(
                        Status.TIMED_OUT,
                        Reason.SENDER_DEADLINE,
                        "kv_transfer_timeout_ms elapsed while a round was being sent",
                    )
                )
                return False
            except PeerLostError as exc:
                self._connected.discard(s.conn.key)
                s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_LOST, str(exc)))
                return False
            except TransferError as exc:
                s.request_end(Terminal.local(Status.FAILED, Reason.TRANSFER_ERROR, str(exc)))
                return False
        finally:
            s.posting = False
        return s.terminal is None

    def forget_peer(self, peer_key: str) -> None:
        if self._connected is not None:
            self._connected.discard(peer_key)


class StagedReceiver(Receiver):
    transport: TwoSidedTransport | None = None

    async def _make_offer(
        self, s: RxSession, conn: PeerConnection, deadline: float
    ) -> Reservation | None:
        """Every staged request needs a staging reservation: up to the whole region,
        whole blocks. Waits for room (bounded by the receive deadline)."""
        assert self.bounce is not None and s.pool is not None
        block_bytes = s.pool.layout.block_bytes
        region = self.bounce.recv
        nbytes = min(len(s.blocks) * block_bytes, (region.nbytes // block_bytes) * block_bytes)
        if nbytes == 0:
            s.request_end(
                Terminal.local(
                    Status.FAILED,
                    Reason.BLOCK_MISMATCH,
                    f"the staging buffer ({region.nbytes} bytes) cannot hold one "
                    f"{block_bytes}-byte block; raise max_tokens_in_buffer",
                )
            )
            return None
        res = await _reserve(region.reserve, nbytes, deadline)
        if res is None:
            s.request_end(
                Terminal.local(
                    Status.TIMED_OUT,
                    Reason.RECEIVER_TIMEOUT,
                    "kv_transfer_timeout_ms elapsed waiting for room in the staging buffer",
                )
            )
            return None
        self.bounce.reservations_made += 1
        s.bounce_res = res
        return Reservation(res.offset, nbytes)

    async def _scatter(self, s: RxSession, first: int, end: int, nbytes: int) -> None:
        if self.transport is not None:
            assert s.conn is not None and s.bounce_res is not None and self.bounce is not None
            out = self.bounce.recv.view(s.bounce_res, nbytes).data
            try:
                got = await self.transport.recv(
                    s.conn.key, round_tag(s.rx_token, first), out, self.timeouts.timeout_s
                )
            except TransferTimeoutError as exc:
                s.request_end(Terminal.local(Status.TIMED_OUT, Reason.RECEIVER_TIMEOUT, str(exc)))
                return
            except PeerLostError as exc:
                s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_LOST, str(exc)))
                return
            except TransferError as exc:
                s.request_end(Terminal.local(Status.FAILED, Reason.TRANSFER_ERROR, str(exc)))
                return
            if got != nbytes:
                s.request_end(
                    Terminal.peer(
                        Status.FAILED,
                        Reason.TRANSFER_ERROR,
                        f"round of blocks [{first}, {end}) carried {got} bytes, {nbytes} announced",
                    )
                )
                return
        await super()._scatter(s, first, end, nbytes)

    async def _round_done(self, s: RxSession, end: int) -> None:
        assert s.conn is not None
        await s.conn.send(RoundAck(request_id=s.request_id, rx_token=s.rx_token, end_block=end))
