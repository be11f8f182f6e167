"""The staged runtime (transceiver_runtime CPP, or null, or auto falling back to it).

KV moves through preallocated staging buffers instead of straight into the
destination blocks: the context side gathers a round of whole blocks into its
send staging region, the bytes cross into a reservation the generation side
made in its receive staging region, and the generation side scatters them into
the destination blocks. Over NIXL a round whose blocks lie in long runs of the
pool is written from the pool itself, packed into the same slots (round_source.py):
the context side's copy is skipped, the receiver's is not.

A request moves in rounds of a few MiB (staging.ROUND_BYTES; up to 64 MiB for a
large one-sided leg, and on device staging the whole leg up to a quarter of the send
region, staging.one_sided_round_bytes; at most half the reservation)
through the receiver's reservation used as a ring (staging.plan_rounds): each
round lies in the slots right after the one before it (Result.round_offset),
and the receiver acknowledges each round (RoundAck) once scattered. While round
k moves, round k+1 is gathered into a send reservation of its own, and the
receiver scatters round k-1 (two-sided: it has posted the receive of round k
too; one-sided: round k+1's write is posted while round k's moves, its Result
after round k's); a round goes into slots that held earlier blocks only once those
were acknowledged. A receiver whose Info lacks `round_offsets` gets one round per
reservation, each after the previous one's acknowledgement, as before.

With different tensor-parallel sizes each (context rank, generation rank) leg
moves only the heads both hold: a round of a leg is its blocks' shared heads,
packed (logical block, layer, K/V, token, heads), gathered and scattered at
each side's own head offset. The generation side reserves room per leg (a
head-merge has one leg per context rank); the context side serves a
head-split's legs one after the other, each into its own receiver's
reservation, with its own rounds and acknowledgements.

The regions are sized in transceiver/staging.py; this module is the context side's
mover (StagedMover: which rounds, and their overlap), transceiver/staged_round.py how
one round crosses (RoundCrossing), transceiver/staged_rx.py the generation side's
receive (StagedReceive).
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
from functools import partial
from typing import TYPE_CHECKING, Any

from kvxferd.backends.twosided import TwoSidedTransport
from kvxferd.memory.heads import mapping_problems
from kvxferd.memory.layout import LayoutError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import RoundAck
from kvxferd.transceiver.bounce import BounceBuffers
from kvxferd.transceiver.leg_targets import leg_target
from kvxferd.transceiver.legs import TxLeg, leg_block_bytes, leg_heads
from kvxferd.transceiver.round_source import RoundSource, pool_runs
from kvxferd.transceiver.sessions import Terminal, TxSession
from kvxferd.transceiver.staged_round import RoundCrossing
from kvxferd.transceiver.staging import (
    NO_ROOM,
    ONE_SIDED_ROUNDS_AHEAD,
    ROUND_BYTES,
    TWO_SIDED_ROUNDS_AHEAD,
    one_sided_round_bytes,
    plan_rounds,
    reserve_by,
    round_blocks,
    rounds_moving,
    two_sided_round_bytes,
)
from kvxferd.transceiver.state import Reason, SessionState, Status
from kvxferd.transceiver.writes import Writes

if TYPE_CHECKING:
    from kvxferd.transceiver.movers import Match, Route


class StagedMover:
    """The staged runtime's SendMover (transceiver/movers.py). Context side: for every leg
    of a request (one, or one per generation rank of a head-split), gather each round of
    blocks (only the heads that leg's receiver holds) into the send region and move it
    into that receiver's reservation."""

    def __init__(
        self, writes: Writes, bounce: BounceBuffers, pipelined: bool, match: Match
    ) -> None:
        self.bounce = bounce
        self.pipelined = pipelined
        self._match = match
        self.crossing = RoundCrossing(writes, bounce)

    def routes(self) -> dict[type, Route]:
        return {RoundAck: self.on_round_ack}

    def attach(self, transport: TwoSidedTransport) -> None:
        self.crossing.attach(transport)

    def peer_gone(self, peer_key: str) -> None:
        self.crossing.forget_peer(peer_key)

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
        target = leg_target(s, leg, start, end, self.pipelined)
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
        s.advance(SessionState.TRANSFERRING)  # status and metrics see staged rounds too
        # Legs one after the other: each receiver's reservation is its own, and two send
        # reservations of a few MiB at a time per request (one moving, the next being
        # gathered) leave room to the other requests.
        for leg, (heads, leg_bytes) in zip(legs, geometry, strict=True):
            if s.terminal is not None:
                return  # ended between legs (a cancel, a receiver gone): write no more
            ring = leg.request.bounce_nbytes // leg_bytes  # the receiver's reservation
            fits = staging.send.nbytes // leg_bytes  # what one send reservation can take
            if min(ring, fits) < 1 or leg.conn.info.bounce_nbytes == 0:
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
            if leg.conn.info.round_offsets:
                # Rounds of a few MiB through the reservation as a ring: the gather of the
                # next, the move of this one and the receiver's scatter of the one before
                # overlap. One-sided rounds of a large leg are larger (staging.py).
                target = (
                    min(ROUND_BYTES, two_sided_round_bytes(staging.send.nbytes))
                    if self.crossing.transport is not None
                    else one_sided_round_bytes(
                        (end - first) * leg_bytes,
                        device_region=staging.send.nbytes if staging.memory.on_device else 0,
                    )
                )
                per_round = min(round_blocks(ring, leg_bytes, target), fits)
            else:
                # A receiver that takes every round at its reservation's start: one round
                # at a time, each once the one before it was scattered.
                ring = per_round = min(ring, fits)
            rounds = plan_rounds(first, end, ring, per_round)
            if rounds and not await self._rounds(s, leg, heads, leg_bytes, rounds, ring, last):
                return
            if last:  # its last Result went out: it has all it asked for
                leg.served = True
                if len(s.legs) > 1:
                    leg.told = True  # that receiver is done: a later leg's failure is not its news
        if s.terminal is None:
            s.written = end

    async def _rounds(
        self,
        s: TxSession,
        leg: TxLeg,
        heads: tuple[int, int] | None,
        leg_bytes: int,
        rounds: list[tuple[int, int, int]],
        ring: int,
        last: bool,
    ) -> bool:
        """Move one slice of a leg round by round (staging.plan_rounds), gathering the next
        round into a send reservation of its own while this one moves; False when the
        request ended."""
        deadline = s.deadline if s.deadline is not None else math.inf
        base = rounds[0][0]
        # Two-sided: the next round is announced and sent while this one is still being
        # received, so the receiver has its receive posted when this one ends (a send
        # completes only once the receiver took it). One-sided: the next round's write is
        # posted while this one moves (each Result after its write, in order).
        two_sided = self.crossing.transport is not None
        depth = (
            rounds_moving(
                TWO_SIDED_ROUNDS_AHEAD,
                self.bounce.send.nbytes,
                max(stop - first for first, stop, _ in rounds) * leg_bytes,
            )
            if two_sided
            else ONE_SIDED_ROUNDS_AHEAD
        )
        ahead: asyncio.Future[RoundSource | None] | None = self._gather_ahead(
            s, heads, leg_bytes, rounds[0], deadline
        )
        moving: list[tuple[asyncio.Task[bool], RoundSource]] = []
        ok = True
        try:
            for i, (first, stop, slot) in enumerate(rounds):
                assert ahead is not None
                if not await self._retire_while(s, ahead, moving):
                    ok = False
                    break
                # Shielded: a cancel must not free a reservation its copy still writes.
                res = await asyncio.shield(ahead)
                ahead = None
                if res is None or s.terminal is not None:
                    if res is not None:
                        self._free(res)
                    ok = False
                    break
                if i + 1 < len(rounds):
                    ahead = self._gather_ahead(s, heads, leg_bytes, rounds[i + 1], deadline)
                final = last and i == len(rounds) - 1
                announced = asyncio.Event()
                move = asyncio.ensure_future(
                    self.crossing.cross(
                        s,
                        leg,
                        res,
                        (first, stop, slot),
                        (base, ring, leg_bytes),
                        final,
                        deadline,
                        announced,
                        moving[-1][0] if moving else None,
                    )
                )
                moving.append((move, res))
                # The next round's move starts once this one is announced (its Result out
                # first: rounds are announced in order) and fewer than `depth` move.
                waiter = asyncio.ensure_future(announced.wait())
                try:
                    await asyncio.wait({move, waiter}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                while moving and (len(moving) >= depth or moving[0][0].done()):
                    done, res_done = moving.pop(0)
                    try:
                        ok = await asyncio.shield(done)
                    finally:
                        if done.done():  # the move ended: its write is quiescent or drained
                            s.when_quiescent(partial(self._free, res_done))
                        else:
                            moving.insert(0, (done, res_done))
                    if not ok:
                        break
                if not ok:
                    break
            while ok and moving:
                await asyncio.shield(moving[0][0])
                ok = self._retire_first(s, moving)
            if not ok:
                return False
            if not last:
                # The next slice starts at the reservation's start again: every round of
                # this one must have been scattered first.
                why = "kv_transfer_timeout_ms elapsed waiting for the receiver to take a round"
                while leg.acked_block < rounds[-1][1] and s.terminal is None:
                    if not await s.wait_wake(deadline, Reason.SENDER_DEADLINE, why):
                        return False
            return s.terminal is None
        except asyncio.CancelledError:
            for move, _ in moving:
                move.cancel()  # each quiesces its transfer
            raise
        finally:
            await self._settle_moves(s, moving)
            if ahead is not None:
                await self._settle(ahead)

    async def _retire_while(
        self,
        s: TxSession,
        ahead: asyncio.Future[RoundSource | None],
        moving: list[tuple[asyncio.Task[bool], RoundSource]],
    ) -> bool:
        """Wait for the next round's gather, which may be waiting for room, giving back the
        reservation of each move that ends meanwhile (in order): that room may be all the
        next round can get. The region is shared by every request, so it can be split
        such that no second round fits beside the one moving; the next round then waited
        for room while holding the round that had moved, until the deadline (1 run in 10
        of test_concurrent_requests_share_the_staging_buffer[MPI]). False when a move
        failed."""
        while not ahead.done() and moving:
            move = moving[0][0]
            either: set[asyncio.Future[Any]] = {ahead, move}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if move.done() and not self._retire_first(s, moving):
                return False
        return True

    def _retire_first(
        self, s: TxSession, moving: list[tuple[asyncio.Task[bool], RoundSource]]
    ) -> bool:
        """Take the first move, which ended, off `moving`; its send reservation is freed
        once its write is quiescent. Whether it succeeded."""
        move, res = moving.pop(0)
        s.when_quiescent(partial(self._free, res))
        return move.result()

    def _free(self, src: RoundSource) -> None:
        """Give back a round's send reservation (a round read from the pool has none)."""
        if src.res is not None:
            self.bounce.send.release(src.res)

    async def _settle_moves(
        self, s: TxSession, moving: list[tuple[asyncio.Task[bool], RoundSource]]
    ) -> None:
        """Moves still running when the slice ends early: each runs to its end (an announced
        round is sent even when the request ended: its receiver waits for it), or to its
        quiescence when cancelled; its send reservation is freed then."""
        cancelled = False
        for move, res in moving:
            while not move.done():
                try:
                    await asyncio.wait({move})
                except asyncio.CancelledError:
                    cancelled = True
            if not move.cancelled():
                move.exception()  # retrieved: the slice already failed
            s.when_quiescent(partial(self._free, res))
        moving.clear()
        if cancelled:
            raise asyncio.CancelledError

    def _gather_ahead(
        self,
        s: TxSession,
        heads: tuple[int, int] | None,
        leg_bytes: int,
        rnd: tuple[int, int, int],
        deadline: float,
    ) -> asyncio.Future[RoundSource | None]:
        """Reserve room for a round in the send region and gather it there (None: no room
        before the deadline, and the request ended); or, for a one-sided round whose pool
        runs are long, name those runs, to be written without a gather (round_source.py)."""
        assert s.pool is not None
        pool, staging = s.pool, self.bounce
        first, stop, _ = rnd
        nbytes = (stop - first) * leg_bytes
        blocks = s.blocks[first:stop]
        # Two-sided sends take one buffer; device staging was never measured on this path.
        gather_only = self.crossing.transport is not None or staging.memory.on_device
        runs = (
            None
            if gather_only
            else pool_runs(pool, blocks, heads, self.crossing.writes.backend_name)
        )
        if runs is not None:
            ready: asyncio.Future[RoundSource | None] = asyncio.get_running_loop().create_future()
            ready.set_result(RoundSource(None, runs))
            return ready

        async def gather() -> RoundSource | None:
            res = await reserve_by(lambda: staging.send.reserve(nbytes), deadline)
            if res is None:
                s.request_end(Terminal.timed_out(Reason.SENDER_DEADLINE, NO_ROOM))
                return None
            try:
                await staging.gather(pool.region.array, pool.layout, blocks, res, nbytes, heads)
            except BaseException:
                staging.send.release(res)
                raise
            return RoundSource(res)

        return asyncio.ensure_future(gather())

    async def _settle(self, task: asyncio.Future[RoundSource | None]) -> None:
        """A gather started for a round that will not move: free its reservation once the
        copy into it finished (a cancel waits for that too, then goes on)."""
        cancelled = False
        while not task.done():
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                cancelled = True
        if not task.cancelled() and task.exception() is None:
            res = task.result()
            if res is not None:
                self._free(res)
        if cancelled:
            raise asyncio.CancelledError
