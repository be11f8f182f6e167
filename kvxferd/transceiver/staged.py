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

The regions are sized in transceiver/staging.py; this module is the context side's
mover (StagedMover), transceiver/staged_rx.py the generation side's (StagedReceive).
The seed's timeouts apply as in
the PYTHON runtime: the sender's absolute deadline covers all rounds, the
receiver's per-task timeout covers the whole receive (every round's wait is
bounded by what is left of the one deadline fixed at admission, with the
timeout read when the receive was accepted). Reservations are freed only when
no write into them can still land.

This runtime shares the coordinators, sessions, admission, peer channel and
quiescence rules of the PYTHON runtime; only how bytes cross differs.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING

import numpy as np

from kvxferd.backends.base import XferStatus, host_only
from kvxferd.backends.twosided import TwoSidedTransport, round_tag
from kvxferd.errors import PeerLostError, StartupError, TransferError
from kvxferd.memory.heads import mapping_problems
from kvxferd.memory.layout import LayoutError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import Result, RoundAck
from kvxferd.transceiver.bounce import BounceBuffers, Reservation
from kvxferd.transceiver.direct import leg_target, peer_memory
from kvxferd.transceiver.legs import TxLeg, leg_block_bytes, leg_heads
from kvxferd.transceiver.postguard import post_refusal
from kvxferd.transceiver.sessions import Terminal, TxSession
from kvxferd.transceiver.staging import NO_ROOM, reserve_by
from kvxferd.transceiver.state import Reason, SessionState, Status
from kvxferd.transceiver.writes import Writes

if TYPE_CHECKING:
    from kvxferd.transceiver.movers import Match, Route


def refuse_device_staging(transport: TwoSidedTransport, staging: BounceBuffers) -> None:
    """Two-sided transports (UCX, MPI) send and receive the staging regions as host
    buffers: with device staging they would read and write the wrong memory. Config
    resolution refuses the combination first; this keeps the movers from running it."""
    if staging.memory.on_device:
        name = getattr(transport, "name", type(transport).__name__)
        raise StartupError(host_only(name, staging.memory) or "")


# Opening the UCX endpoint to a peer the handshake already vouched for.
_CONNECT_TIMEOUT_S = 10.0


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
        # Peers whose transport endpoint is open.
        self._connected: set[str] = set()

    def routes(self) -> dict[type, Route]:
        return {RoundAck: self.on_round_ack}

    def attach(self, transport: TwoSidedTransport) -> None:
        refuse_device_staging(transport, self.bounce)
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
        res = await reserve_by(lambda: staging.send.reserve(nbytes), deadline)
        if res is None:
            s.request_end(Terminal.timed_out(Reason.SENDER_DEADLINE, NO_ROOM))
            return False
        result = leg.written(s.request_id, nbytes, last, True, (first, stop))
        try:
            await staging.gather(
                s.pool.region.array, s.pool.layout, s.blocks[first:stop], res, nbytes, heads
            )
            if self.transport is not None:
                if not await self._send_two_sided(s, leg, res, result, deadline):
                    return False
            else:
                info = leg.conn.info
                remote_memory = peer_memory(info.bounce_memory, info.bounce_device)
                if remote_memory is None:
                    s.request_end(
                        Terminal.peer(
                            Status.FAILED,
                            Reason.BLOCK_MISMATCH,
                            f"the receiver announced its staging in memory "
                            f"{info.bounce_memory!r}, which this build does not know "
                            "(host or vram)",
                        )
                    )
                    return False
                local = np.array([[staging.send.address + res.offset, nbytes]], dtype=np.int64)
                remote = np.array(
                    [[info.bounce_base + leg.request.bounce_offset, nbytes]],
                    dtype=np.int64,
                )
                status = await self.writes.post_and_wait(
                    s,
                    local,
                    remote,
                    leg.conn,
                    local_memory=staging.send.memory,
                    remote_memory=remote_memory,
                )
                if status is not XferStatus.DONE or s.terminal is not None:
                    return False
        finally:
            staging.send.release(res)  # both paths return only once the bytes are quiescent
        if time.monotonic() > deadline:
            late = "a round completed after kv_transfer_timeout_ms; not reported as success"
            s.request_end(Terminal.timed_out(Reason.SENDER_DEADLINE, late))
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
        why = "kv_transfer_timeout_ms elapsed waiting for the receiver to take a round"
        while leg.acked_block < stop and s.terminal is None:
            if not await s.wait_wake(deadline, Reason.SENDER_DEADLINE, why):
                return False
        return s.terminal is None

    async def _send_two_sided(
        self, s: TxSession, leg: TxLeg, res: Reservation, result: Result, deadline: float
    ) -> bool:
        """Announce the round (the receiver then receives it by tag), then send it."""
        assert self.transport is not None and self.bounce is not None
        conn = leg.conn
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
                data = self.bounce.send.view(res, result.nbytes).data
                tag = round_tag(leg.request.rx_token, result.first_block)
                remaining = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
                # On timeout the send is cancelled, which returns only once the transport no
                # longer reads the staging bytes (or the endpoint was closed).
                await asyncio.wait_for(self.transport.send(conn.key, tag, data), remaining)
            except asyncio.TimeoutError:
                s.request_end(
                    Terminal.timed_out(
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
        self._connected.discard(peer_key)
