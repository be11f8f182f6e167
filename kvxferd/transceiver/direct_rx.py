"""The PYTHON runtime's receive mover: the context daemon writes straight into the
engine's blocks, or, when we offered a bounce reservation and it pays off, one write into
that reservation that we scatter into the blocks. A copy-only receive (our pool, or the
peer's, is device memory the backend has not registered) always gets a reservation,
waiting for room up to its deadline: it can arrive no other way.

A receive mover is what the receive coordinator (transceiver/receiver.py) asks how a
request's bytes arrive: what to offer with the RequestData, how to take a reported
round into the blocks, and what a peer may still write into once a receive ended
(transceiver/movers.py, RecvMover).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvxferd.backends.twosided import TwoSidedTransport
from kvxferd.memory.layout import LayoutError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import Result
from kvxferd.transceiver.bounce import BounceBuffers, Reservation, worth_bouncing
from kvxferd.transceiver.copyplan import whole_blocks
from kvxferd.transceiver.legs import RxLeg, leg_block_bytes, rx_leg_heads
from kvxferd.transceiver.sessions import RxSession, Terminal
from kvxferd.transceiver.staging import (
    BOUNCE_ROOM_WAIT_S,
    NO_BOUNCE_ROOM,
    RegionWarnings,
    RoomLine,
    offer_legs,
    reserve_all,
)
from kvxferd.transceiver.state import Reason, Status

if TYPE_CHECKING:
    from kvxferd.service.pools import LocalPool


def copy_only(pool: LocalPool, conn: PeerConnection) -> bool:
    """Whether a receive into `pool` from `conn` can only arrive through the bounce buffer:
    our pool is copy-only (the peer may not write into it), or the peer's are (it cannot
    write out of them per block). A daemon's pools share one memory kind, so any of the
    peer's copy-only pools speaks for the one it will send from."""
    return not pool.zero_copy or any(not info.writable for info in conn.pools.values())


async def scatter_round(
    bounce: BounceBuffers | None,
    s: RxSession,
    leg: RxLeg,
    first: int,
    end: int,
    nbytes: int,
    offset: int = 0,
) -> None:
    """Move one round of a leg's bytes from its reservation (from `offset` on) into the
    request's logical blocks [first, end) (only into the heads that leg holds); or end the
    request saying why the round does not fit."""
    res = leg.res
    if bounce is None or res is None or s.pool is None:
        raise RuntimeError("the peer bounced a request that has no reservation here")
    try:
        heads = rx_leg_heads(s.pool, leg)
    except LayoutError as exc:
        s.request_end(Terminal.peer(Status.FAILED, Reason.BLOCK_MISMATCH, str(exc)))
        return
    expected = (end - first) * leg_block_bytes(s.pool.layout, heads)
    ours = (s.block_start, s.block_start + len(s.blocks))  # the logical blocks we hold
    fits = offset >= 0 and offset + nbytes <= res.nbytes
    if not ours[0] <= first < end <= ours[1] or nbytes != expected or not fits:
        held = f"(we hold [{ours[0]}, {ours[1]}))" if s.block_start else f"of {len(s.blocks)}"
        s.request_end(
            Terminal.peer(
                Status.FAILED,
                Reason.TRANSFER_ERROR,
                f"the peer reported blocks [{first}, {end}) {held} with "
                f"{nbytes} bytes at offset {offset}; {expected} expected, {res.nbytes} "
                "reserved",
            )
        )
        return
    dst = s.blocks[first - s.block_start : end - s.block_start]
    at = Reservation(res.offset + offset, nbytes)
    await bounce.scatter(at, nbytes, s.pool.region.array, s.pool.layout, dst, heads)


class DirectReceive:
    """RecvMover of the PYTHON runtime."""

    # The context daemon writes into the engine's blocks itself: an ended receive's blocks
    # stay on loan until that writer is fenced.
    exposes_blocks = True

    def __init__(self, bounce: BounceBuffers | None, pipelined: bool) -> None:
        self.bounce = bounce
        self.pipelined = pipelined
        # Copy-only receives waiting for room, served in the order they began to wait.
        self.room = RoomLine()
        self.warn = RegionWarnings()

    def reservations_exposed(self) -> bool:
        return True  # one-sided: the peer writes into the bounce reservation itself

    def attach(self, transport: TwoSidedTransport) -> None:
        """Never called: this runtime has no two-sided transport."""

    async def make_offer(self, s: RxSession, conn: PeerConnection, deadline: float) -> None:
        """Reserve room in the receive region when bouncing this request pays off; else
        offer nothing (the per-block path). Waits for room only for the legs of a
        head-merge (up to BOUNCE_ROOM_WAIT_S: _sliced_offer) and for a copy-only request
        (copy_only_offer), which can arrive no other way."""
        if s.pool is not None and copy_only(s.pool, conn):
            await self._copy_only_offer(s, conn, deadline)
            return
        if self.bounce is None or self.pipelined or s.pool is None or not s.pool.layout.named:
            return
        layout = s.pool.layout
        sliced: list[RxLeg] = []
        sizes: list[int] = []
        for leg in s.legs:
            assert leg.conn is not None
            if leg.conn.info.bounce_nbytes == 0:
                continue  # that context daemon has no bounce buffer: it writes per block
            try:
                heads = rx_leg_heads(s.pool, leg)
            except LayoutError:
                continue  # the per-block path names the mismatch when it plans
            nbytes = len(s.blocks) * leg_block_bytes(layout, heads)
            if not whole_blocks(layout, heads):
                # A head-merge leg arrives as one run per (block, layer, K/V, token) of our
                # pool: always worth one write and a scatter (docs/benchmarks.md, issue 16
                # "tensor parallelism"), and worth waiting for room (BOUNCE_ROOM_WAIT_S).
                runs = len(s.blocks) * layout.pieces_per_block * layout.tokens_per_block
                if worth_bouncing(runs, nbytes):
                    sliced.append(leg)
                    sizes.append(nbytes)
                continue
            # Whole blocks of ours: from a peer of our heads, or a head-split's sender, which
            # gathers our heads and writes them straight into our blocks where they lie in
            # few runs (BouncePlanner.one_sided). Only where they lie in many does a
            # reservation pay (that sender then writes its gather into it).
            if not worth_bouncing(len(layout.block_segments(s.blocks)), nbytes):
                continue
            res = self.bounce.recv.reserve(nbytes)
            if res is None:
                self.bounce.fallbacks += 1  # never wait for room: the per-block path it is
                continue
            offer_legs(self.bounce, [leg], [res], [nbytes])
        if sliced:
            await self._sliced_offer(s, sliced, sizes, deadline)

    async def _sliced_offer(
        self, s: RxSession, legs: list[RxLeg], sizes: list[int], deadline: float
    ) -> None:
        """Reserve the head-merge legs' room, all of them or none (two requests each
        holding one leg's room could wait on each other), waiting in line for it up to
        BOUNCE_ROOM_WAIT_S; without room by then they take the per-block path."""
        assert self.bounce is not None
        region = self.bounce.recv
        what, total = "a head-merge's legs together", sum(sizes)
        if total > region.nbytes:  # no room will ever do
            self.bounce.fallbacks += len(legs)
            self.warn.never_fits(what, total, region.nbytes)
            return
        wait_until = min(deadline, time.monotonic() + BOUNCE_ROOM_WAIT_S)
        got, waited = await self.room.take(lambda: reserve_all(region, sizes), wait_until)
        self.bounce.room_waits += waited
        if got is None:
            self.bounce.fallbacks += len(legs)
            self.warn.busy(what, total, region.nbytes, BOUNCE_ROOM_WAIT_S)
            return
        if s.terminal is not None:  # ended while it waited: nothing was offered
            for res in got:
                region.release(res)
            return
        offer_legs(self.bounce, legs, got, sizes)

    async def _copy_only_offer(self, s: RxSession, conn: PeerConnection, deadline: float) -> None:
        """Reserve the whole request in the receive region, waiting for room up to the
        receive's deadline; or end the request saying why it cannot bounce."""
        assert s.pool is not None
        layout = s.pool.layout
        try:
            # One reservation per leg: each context rank of a head-merge sends its slice.
            sizes = [
                len(s.blocks) * leg_block_bytes(layout, rx_leg_heads(s.pool, leg)) for leg in s.legs
            ]
        except LayoutError as exc:
            s.request_end(Terminal.peer(Status.FAILED, Reason.BLOCK_MISMATCH, str(exc)))
            return
        nbytes = sum(sizes)
        what = (
            f"pool {s.pool.pool_id!r} here is copy-only"
            if not s.pool.zero_copy
            else f"context daemon {conn.peer.name} has copy-only pools"
        )
        why = (
            f"{what} (device memory the backend does not read or write itself), so the "
            f"request's {nbytes} bytes can only arrive through the bounce buffer, but "
        )
        problem = None
        if self.bounce is None:
            problem = "this daemon has none (set kv_cache_bounce_size_mb)"
        elif self.pipelined:
            problem = "pipelined transfers write per block; turn enable_pipelined_transfer off"
        elif conn.info.bounce_nbytes == 0:
            problem = f"context daemon {conn.peer.name} has no bounce buffer"
        elif not layout.named:
            problem = "the pool's layout has no named order (the copier packs its pieces)"
        elif nbytes > self.bounce.recv.nbytes:
            problem = (
                f"it exceeds the bounce region ({self.bounce.recv.nbytes} bytes); raise "
                "kv_cache_bounce_size_mb or use transceiver_runtime CPP, which moves rounds"
            )
        if problem is not None:
            s.request_end(Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, why + problem))
            return
        assert self.bounce is not None
        region = self.bounce.recv
        got, waited = await self.room.take(lambda: reserve_all(region, sizes), deadline)
        self.bounce.room_waits += waited
        if got is None:
            s.request_end(Terminal.timed_out(Reason.RECEIVER_TIMEOUT, NO_BOUNCE_ROOM))
            return
        if s.terminal is not None:  # ended while it waited: nothing was offered
            for res in got:
                region.release(res)
            return
        offer_legs(self.bounce, s.legs, got, sizes)

    async def take_round(
        self, s: RxSession, leg: RxLeg, first: int, end: int, nbytes: int, offset: int = 0
    ) -> None:
        await scatter_round(self.bounce, s, leg, first, end, nbytes, offset)

    async def round_done(self, s: RxSession, leg: RxLeg, end: int) -> None:
        """A bounce never has more than one round."""
        raise RuntimeError("the peer sent a partial round to a receiver without rounds")

    def late_round(self, conn: PeerConnection, s: RxSession, msg: Result) -> bool:
        return False  # a late one-sided round is already written: the hold covers it

    def drop_unscattered(self, s: RxSession) -> None:
        """Rounds reported and not taken need nothing: their bytes are already in place."""

    def release(self, res: Reservation) -> None:
        if self.bounce is not None:
            self.bounce.recv.release(res)
