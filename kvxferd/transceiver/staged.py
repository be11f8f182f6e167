"""The staged runtime (transceiver_runtime CPP, or null, or auto falling back to it).

KV moves through preallocated staging buffers instead of straight into the
destination blocks: the context side gathers a round of whole blocks into its
send staging region, the bytes cross into a reservation the generation side
made in its receive staging region, and the generation side scatters them into
the destination blocks. A request larger than its reservation moves in rounds;
the receiver acknowledges each round (RoundAck) once scattered, so the same
reservation takes the next one.

With different tensor-parallel sizes each (context rank, generation rank) leg
moves only the heads both hold: a round of a leg is its blocks' shared heads,
packed (logical block, layer, K/V, token, heads), gathered and scattered at
each side's own head offset. The generation side reserves room per leg (a
head-merge has one leg per context rank); the context side serves a
head-split's legs one after the other, each into its own receiver's
reservation, with its own rounds and acknowledgements.

Both regions are sized by max_tokens_in_buffer (else the engine's
max_seq_len, else DEFAULT_STAGING_TOKENS) worth of whole blocks, so every
request the admission window lets in fits. The seed's timeouts apply as in
the PYTHON runtime: the sender's absolute deadline covers all rounds, the
receiver's per-task timeout covers the whole receive (every round's wait is
bounded by what is left of the one deadline fixed at admission, with the
timeout read when the receive was accepted). Reservations are freed only when
no write into them can still land.

This runtime reuses the PYTHON runtime's sessions, admission, peer channel
and quiescence rules; only how bytes cross differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from kvxferd.backends.base import XferStatus
from kvxferd.backends.twosided import TwoSidedTransport, round_tag
from kvxferd.errors import KvxferdError, PeerLostError, TransferError, TransferTimeoutError
from kvxferd.memory.heads import mapping_problems
from kvxferd.memory.layout import LayoutError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import Result, RoundAck
from kvxferd.transceiver.bounce import RESERVATION_ALIGN, BounceBuffers, BounceRegion, Reservation
from kvxferd.transceiver.direct import leg_target
from kvxferd.transceiver.legs import RxLeg, TxLeg, leg_block_bytes, leg_heads
from kvxferd.transceiver.postguard import post_refusal
from kvxferd.transceiver.receiver import Receiver
from kvxferd.transceiver.sessions import RxSession, Terminal, TxSession
from kvxferd.transceiver.state import Reason, SessionState, Status
from kvxferd.transceiver.writes import Writes

if TYPE_CHECKING:
    from kvxferd.transceiver.movers import Match, Route

DEFAULT_STAGING_TOKENS = 8192

_R = TypeVar("_R")

# How often a request waiting for staging room looks again (room frees when
# another request's round completes; the deadline bounds the wait).
_ROOM_POLL_S = 0.001
# Opening the UCX endpoint to a peer the handshake already vouched for.
_CONNECT_TIMEOUT_S = 10.0


def staging_bytes(tokens: int, tokens_per_block: int, block_bytes: int) -> int:
    return math.ceil(tokens / tokens_per_block) * block_bytes


async def _reserve(reserve: Callable[[], _R | None], deadline: float) -> _R | None:
    """Try `reserve` until it finds room or the deadline passes."""
    while True:
        res = reserve()
        if res is not None or time.monotonic() >= deadline:
            return res
        await asyncio.sleep(_ROOM_POLL_S)


def _reserve_all(region: BounceRegion, sizes: list[int]) -> list[Reservation] | None:
    """One reservation per size, all or none: a request never holds part of its room
    while it waits for the rest (two requests could then wait on each other)."""
    got: list[Reservation] = []
    for nbytes in sizes:
        res = region.reserve(nbytes)
        if res is None:
            for each in got:
                region.release(each)
            return None
        got.append(res)
    return got


def _aligned(nbytes: int) -> int:
    return -(-nbytes // RESERVATION_ALIGN) * RESERVATION_ALIGN


def blocks_per_round(region_bytes: int, blocks: int, leg_block_bytes: list[int]) -> int:
    """How many blocks each leg's reservation holds so that one reservation per leg fits the
    region together (each rounded up to the reservation alignment): every block when they
    can, else as many as fit; 0 when not even one block of every leg fits."""
    per_block = sum(leg_block_bytes)
    k = min(blocks, region_bytes // per_block)
    while k > 0 and sum(_aligned(k * b) for b in leg_block_bytes) > region_bytes:
        k -= 1
    return k


class StagedMover:
    """The staged runtime's SendMover (transceiver/movers.py). Context side: for every leg
    of a request (one, or one per generation rank of a head-split), gather each round of
    blocks (only the heads that leg's receiver holds) into the send region and move it
    into that receiver's reservation."""

    def __init__(
        self, writes: Writes, bounce: BounceBuffers, pipelined: bool, match: Match
    ) -> None:
        self.writes = writes
        self.bounce = bounce
        self.pipelined = pipelined
        self._match = match
        # The two-sided transport once started (UCX, MPI); None: one-sided writes.
        self.transport: TwoSidedTransport | None = None
        self._connected: set[str] | None = None

    def routes(self) -> dict[type, Route]:
        return {RoundAck: self.on_round_ack}

    def attach(self, transport: TwoSidedTransport) -> None:
        self.transport = transport

    def peer_gone(self, peer_key: str) -> None:
        self.forget_peer(peer_key)

    async def on_round_ack(self, conn: PeerConnection, msg: RoundAck) -> None:
        s = self._match(conn, msg.request_id, msg.rx_token)
        leg = s.leg_of(conn, msg.rx_token) if s is not None else None
        if s is not None and leg is not None:
            leg.acked_block = max(leg.acked_block, msg.end_block)
            s.wake.set()

    def _leg_geometry(
        self, s: TxSession, start: int, end: int, leg: TxLeg
    ) -> tuple[tuple[int, int] | None, int] | Terminal:
        """(the heads of our pool the leg moves or None for whole blocks, its bytes per
        block), once the leg's blocks and head mapping are checked."""
        assert s.pool is not None
        target = leg_target(s, start, end, leg, self.pipelined)
        if isinstance(target, Terminal):
            return target
        dst_layout, _, dst_tp = target
        ours, our_tp = s.pool.layout, s.pool.tp
        try:
            problems = mapping_problems(ours, our_tp, dst_layout, dst_tp)
            if problems:
                raise LayoutError(
                    "source and destination pools have incompatible KV geometry: "
                    + "; ".join(problems)
                )
            dst_layout.check_blocks(leg.dst_blocks(*leg.span(start, end)))
            heads = leg_heads(ours, our_tp, dst_layout, dst_tp)
        except LayoutError as exc:
            return Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, str(exc))
        return heads, leg_block_bytes(ours, heads)

    async def write_slice(self, s: TxSession, start: int, end: int, last: bool) -> None:
        assert s.conn is not None and s.request is not None and s.pool is not None
        legs = s.legs or [TxLeg(s.conn, s.request)]
        geometry: list[tuple[tuple[int, int] | None, int]] = []
        for leg in legs:  # every leg first: a bad leg fails the request before any write
            checked = self._leg_geometry(s, start, end, leg)
            if isinstance(checked, Terminal):
                s.request_end(checked)
                return
            geometry.append(checked)
        staging = self.bounce
        deadline = s.deadline if s.deadline is not None else math.inf
        s.advance(SessionState.TRANSFERRING)  # status and metrics see staged rounds too
        # Legs one after the other: each receiver's reservation is its own, and one send
        # reservation at a time per request leaves room to the other requests.
        for leg, (heads, leg_bytes) in zip(legs, geometry, strict=True):
            if s.terminal is not None:
                return  # ended between legs (a cancel, a receiver gone): write no more
            per_round = min(leg.request.bounce_nbytes, staging.send.nbytes) // leg_bytes
            if per_round < 1 or leg.conn.info.bounce_nbytes == 0:
                s.request_end(
                    Terminal.peer(
                        Status.FAILED,
                        Reason.BLOCK_MISMATCH,
                        f"the staging reservation ({leg.request.bounce_nbytes} bytes offered "
                        f"by {leg.conn.peer.name}, {staging.send.nbytes} here) cannot hold one "
                        f"block's {leg_bytes} bytes",
                    )
                )
                return
            # Rounds count the request's logical blocks (Result.first_block); none before
            # the receiver's block_start.
            first, _ = leg.span(start, end)
            while first < end:
                if s.terminal is not None:
                    return
                stop = min(end, first + per_round)
                final = stop == end and last
                if not await self._one_round(s, leg, heads, first, stop, final, deadline):
                    return
                first = stop
            if last:  # its last Result went out: it has all it asked for
                leg.served = True
                if len(s.legs) > 1:
                    leg.told = True  # that receiver is done: a later leg's failure is not its news
        if s.terminal is None:
            s.written = end

    async def _one_round(
        self,
        s: TxSession,
        leg: TxLeg,
        heads: tuple[int, int] | None,
        first: int,
        stop: int,
        last: bool,
        deadline: float,
    ) -> bool:
        assert s.pool is not None and self.bounce is not None
        staging = self.bounce
        nbytes = (stop - first) * leg_block_bytes(s.pool.layout, heads)
        res = await _reserve(lambda: staging.send.reserve(nbytes), deadline)
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
            rx_token=leg.request.rx_token,
            status=Reason.OK,
            nbytes=nbytes,
            last=last,
            bounced=True,
            first_block=first,
            end_block=stop,
        )
        try:
            await staging.gather(
                s.pool.region.array, s.pool.layout, s.blocks[first:stop], res, nbytes, heads
            )
            if self.transport is not None:
                if not await self._send_two_sided(s, leg, res, nbytes, result, deadline):
                    return False
            else:
                local = np.array([[staging.send.address + res.offset, nbytes]], dtype=np.int64)
                remote = np.array(
                    [[leg.conn.info.bounce_base + leg.request.bounce_offset, nbytes]],
                    dtype=np.int64,
                )
                status = await self.writes.post_and_wait(s, local, remote, leg.conn)
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
        # One-sided: the bytes are in place, say so. Two-sided: said before sending.
        sent = self.transport is not None or await leg.conn.send(result)
        if not sent:
            s.request_end(
                Terminal.peer(Status.FAILED, Reason.PEER_LOST, "could not report the round")
            )
            s.mark_told(leg)
            return False
        if last:
            return True
        # The receiver's reservation is reused: wait until it scattered this round.
        while leg.acked_block < stop and s.terminal is None:
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
        self,
        s: TxSession,
        leg: TxLeg,
        res: Reservation,
        nbytes: int,
        result: Result,
        deadline: float,
    ) -> bool:
        """Announce the round (the receiver then receives it by tag), then send it."""
        assert self.transport is not None and self.bounce is not None
        conn = leg.conn
        if self._connected is None:
            self._connected = set()
        s.posting = True  # from here a cancel answers "busy"
        try:
            try:
                if conn.key not in self._connected:
                    await self.transport.connect(
                        conn.key, conn.info.transport_address, _CONNECT_TIMEOUT_S
                    )
                    self._connected.add(conn.key)
                await conn.fresh()
                refused = post_refusal(s, conn)
                if refused is not None:
                    s.request_end(refused)  # an ended request announces no further round
                    return False
                if not await conn.send(result):
                    s.request_end(
                        Terminal.peer(Status.FAILED, Reason.PEER_LOST, "could not announce a round")
                    )
                    s.mark_told(leg)
                    return False
                # Announced: the round goes out even if the request ends now. The receiver
                # waits for it by tag, and two-sided bytes land only in its own posted
                # receive, so sending cannot touch memory it handed back.
                data = self.bounce.send.view(res, nbytes).data
                tag = round_tag(leg.request.rx_token, result.first_block)
                remaining = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
                # On timeout the send is cancelled, which returns only once the transport no
                # longer reads the staging bytes (or the endpoint was closed).
                await asyncio.wait_for(self.transport.send(conn.key, tag, data), remaining)
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
                self._connected.discard(conn.key)
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
    """Generation side: one reservation per leg (one, or one per context rank of a
    head-merge), each sized for that leg's heads; every round is scattered into the heads
    its leg holds, then acknowledged to that leg."""

    transport: TwoSidedTransport | None = None
    _drops: set[asyncio.Task[None]] | None = None
    # Peers write only into the staging reservations; our own scatter fills the blocks.
    exposes_blocks = False

    def _reservations_exposed(self) -> bool:
        # Two-sided: bytes land only where our own posted receive puts them, and that
        # receive has completed or expired (nothing lands after) before a session ends.
        return self.transport is None

    async def on_result(self, conn: PeerConnection, msg: Result) -> None:
        s = self._match(conn, msg.request_id, msg.rx_token)
        if (
            self.transport is not None
            and s is not None
            and s.terminal is not None
            and msg.bounced
            and msg.status == Reason.OK
        ):
            # Announced after this receive ended (e.g. another leg of a merge failed): the
            # sender is sending it and cannot quiesce, nor answer our Abort, until it is taken.
            self._drop_round(conn.key, round_tag(s.rx_token, msg.first_block), msg.nbytes)
            return
        await super().on_result(conn, msg)

    async def _quiesce(self, s: RxSession) -> None:
        if self.transport is not None:
            # Rounds announced but not received: their senders wait for them to be taken.
            for leg, first, _end, nbytes, _last in s.rounds:
                if leg.conn is not None:
                    self._drop_round(leg.conn.key, round_tag(s.rx_token, first), nbytes)
            s.rounds.clear()
        await super()._quiesce(s)

    def _drop_round(self, peer_key: str, tag: int, nbytes: int) -> None:
        """Take a two-sided round nobody will scatter: received into scratch memory if it is
        there, else abandoned to the transport, which drops it when it arrives."""
        transport = self.transport
        assert transport is not None

        async def drop() -> None:
            scratch = memoryview(bytearray(max(0, nbytes)))
            with contextlib.suppress(KvxferdError):  # a timeout abandons the tag: dropped
                await transport.recv(peer_key, tag, scratch, 0.0)

        if self._drops is None:
            self._drops = set()
        task = asyncio.create_task(drop(), name=f"drop-round-{tag}")
        self._drops.add(task)
        task.add_done_callback(self._drops.discard)

    async def _make_offer(self, s: RxSession, conn: PeerConnection, deadline: float) -> None:
        """Every staged request needs a staging reservation per leg, together up to the whole
        region, each a whole number of that leg's blocks. Waits for room (bounded by the
        receive deadline)."""
        assert self.bounce is not None and s.pool is not None
        layout = s.pool.layout
        region = self.bounce.recv
        try:
            # A leg whose context daemon announced no pool yet: sized for whole blocks (no
            # leg moves more); the sender fits its rounds into what it is offered.
            sizes = [leg_block_bytes(layout, self._leg_heads(s, leg)) for leg in s.legs]
        except LayoutError as exc:
            s.request_end(Terminal.peer(Status.FAILED, Reason.BLOCK_MISMATCH, str(exc)))
            return
        k = blocks_per_round(region.nbytes, len(s.blocks), sizes)
        if self._reservations_exposed():
            # A peer that stalls mid-request leaves its reservation quarantined until it is
            # fenced (kvxferd.transceiver.holds): one request never takes more than half the
            # region, so one stalled peer cannot stop every other peer's transfers.
            half = blocks_per_round(region.nbytes // 2, len(s.blocks), sizes)
            if half > 0:
                k = min(k, half)
        if k == 0:
            s.request_end(
                Terminal.local(
                    Status.FAILED,
                    Reason.BLOCK_MISMATCH,
                    f"the staging buffer ({region.nbytes} bytes) cannot hold one block of "
                    f"each of the {len(sizes)} leg(s) ({', '.join(map(str, sizes))} bytes); "
                    "raise max_tokens_in_buffer",
                )
            )
            return
        wanted = [k * size for size in sizes]
        got = await _reserve(lambda: _reserve_all(region, wanted), deadline)
        if got is None:
            s.request_end(
                Terminal.local(
                    Status.TIMED_OUT,
                    Reason.RECEIVER_TIMEOUT,
                    "kv_transfer_timeout_ms elapsed waiting for room in the staging buffer",
                )
            )
            return
        self.bounce.reservations_made += len(got)
        for leg, res, nbytes in zip(s.legs, got, wanted, strict=True):
            leg.res = res
            leg.offer = Reservation(res.offset, nbytes)

    async def _scatter(self, s: RxSession, leg: RxLeg, first: int, end: int, nbytes: int) -> None:
        if self.transport is not None:
            assert leg.conn is not None and self.bounce is not None
            if leg.res is None or not 0 < nbytes <= leg.res.nbytes:
                s.request_end(
                    Terminal.peer(
                        Status.FAILED,
                        Reason.TRANSFER_ERROR,
                        f"round of blocks [{first}, {end}) announced {nbytes} bytes, "
                        f"{leg.res.nbytes if leg.res else 0} reserved",
                    )
                )
                return
            out = self.bounce.recv.view(leg.res, nbytes).data
            # Bounded by what is left of the receive's own deadline: the outcome is due then.
            # The transport bounds only the wait for the round to start arriving; one that
            # stalls mid-message (its sender stopped) it gives a grace past that before it
            # lets go of our buffer. The receive does not wait for that grace: it ends at
            # its deadline and leaves the reservation to the transport until it lets go.
            left = s.deadline - time.monotonic()
            bound = None if left == math.inf else max(0.0, left)
            recv = asyncio.ensure_future(
                self.transport.recv(leg.conn.key, round_tag(s.rx_token, first), out, bound)
            )
            try:
                await asyncio.wait({recv}, timeout=bound)
            finally:
                if not recv.done():  # past the deadline mid-message, or the task cancelled
                    self._leave_to_transport(recv, leg)
            if not recv.done():
                s.request_end(
                    Terminal.local(
                        Status.TIMED_OUT,
                        Reason.RECEIVER_TIMEOUT,
                        f"kv_transfer_timeout_ms elapsed while the round of blocks [{first}, "
                        f"{end}) was arriving",
                    )
                )
                return
            try:
                got = recv.result()
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
        await super()._scatter(s, leg, first, end, nbytes)

    def _leave_to_transport(self, recv: asyncio.Future[int], leg: RxLeg) -> None:
        """A round's receive still in progress when the receive ends: its staging
        reservation is released only once the transport returns (it may still be writing
        there), not with the session."""
        res, leg.res = leg.res, None
        bounce = self.bounce
        assert res is not None and bounce is not None

        def done(fut: asyncio.Future[int]) -> None:
            if not fut.cancelled():
                fut.exception()  # retrieved: the receive already ended, the error is moot
            bounce.recv.release(res)

        recv.add_done_callback(done)

    async def _round_done(self, s: RxSession, leg: RxLeg, end: int) -> None:
        assert leg.conn is not None
        await leg.conn.send(RoundAck(request_id=s.request_id, rx_token=s.rx_token, end_block=end))
