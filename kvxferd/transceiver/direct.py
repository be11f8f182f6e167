"""The direct mover: the PYTHON runtime's one-sided writes from the engine's blocks into
the receiver's, one descriptor per contiguous run, or through the bounce buffer (one
contiguous write) when the receiver offered a reservation and it pays off.

A mover is what a send coordinator (transceiver/sender.py) hands each due slice of a
request to: `write_slice(session, start, end, last)` writes blocks [start, end) to every
receiver of the request and sends each its Result, or ends the request with why. It knows
nothing of how requests are matched with receivers.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from kvxferd.backends.base import XferStatus
from kvxferd.backends.twosided import TwoSidedTransport
from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.peers.messages import PoolInfo
from kvxferd.transceiver.bounce import BounceBuffers, Reservation, worth_bouncing
from kvxferd.transceiver.legs import TxLeg, split_problem, whole_blocks
from kvxferd.transceiver.plan import plan_write
from kvxferd.transceiver.sessions import Terminal, TxSession
from kvxferd.transceiver.state import Reason, Status
from kvxferd.transceiver.writes import Writes

if TYPE_CHECKING:
    from kvxferd.transceiver.movers import Route


def leg_target(
    s: TxSession, start: int, end: int, leg: TxLeg, pipelined: bool
) -> tuple[KvLayout, PoolInfo, TpRank] | Terminal:
    """The destination pool of a leg (layout, announced info, rank) once the block counts
    and the head mapping of blocks [start, end) are checked; else why the request ends."""
    assert s.pool is not None
    req = leg.request
    info = leg.conn.pools.get(req.pool_id)
    dst_layout = leg.conn.layouts.get(req.pool_id)
    if info is None or dst_layout is None:
        return Terminal.peer(
            Status.FAILED, Reason.UNKNOWN_POOL, f"peer pool {req.pool_id!r} is unknown here"
        )
    last = end == len(s.blocks) and s.last_seen
    # The receiver's blocks are ours from its block_start on (those before it has).
    b = req.block_start
    if (
        b < 0
        or not req.blocks
        or (last and len(req.blocks) != len(s.blocks) - b)
        or b + len(req.blocks) < end
    ):
        return Terminal.local(
            Status.FAILED,
            Reason.BLOCK_MISMATCH,
            f"context sends {len(s.blocks)} blocks, generation expects {len(req.blocks)}"
            if b == 0
            else f"context sends {len(s.blocks)} blocks and generation receives from "
            f"block_start {b} on, so it needs {len(s.blocks) - b} blocks; it gave "
            f"{len(req.blocks)}",
        )
    if isinstance(dst_layout, LayoutError):
        return Terminal.peer(
            Status.FAILED,
            Reason.BLOCK_MISMATCH,
            f"the receiver's pool {req.pool_id!r} cannot be written: {dst_layout}",
        )
    try:
        dst_tp = TpRank(info.tp_rank, info.tp_size)
        problem = split_problem(s.pool, s.legs, dst_tp, pipelined)
        if problem is not None:
            raise LayoutError(problem)
    except LayoutError as exc:
        return Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, str(exc))
    return dst_layout, info, dst_tp


class DirectMover:
    """A SendMover (transceiver/movers.py)."""

    def __init__(self, writes: Writes, bounce: BounceBuffers | None, pipelined: bool) -> None:
        self.writes = writes
        self.bounce = bounce
        self.pipelined = pipelined

    def routes(self) -> dict[type, Route]:
        return {}  # every peer message of a direct write is the coordinator's

    def attach(self, transport: TwoSidedTransport) -> None:
        raise TypeError("the direct mover writes one-sided; it takes no two-sided transport")

    def peer_gone(self, peer_key: str) -> None:
        pass  # it keeps nothing per peer

    def _plan(
        self, s: TxSession, start: int, end: int, leg: TxLeg | None = None
    ) -> tuple[np.ndarray, np.ndarray] | Terminal:
        assert s.request is not None and s.conn is not None and s.pool is not None
        leg = leg or (s.legs[0] if s.legs else TxLeg(s.conn, s.request))
        target = leg_target(s, start, end, leg, self.pipelined)
        if isinstance(target, Terminal):
            return target
        dst_layout, info, dst_tp = target
        first, end = leg.span(start, end)
        try:
            return plan_write(
                s.pool.layout,
                s.pool.base,
                s.blocks[first:end],
                dst_layout,
                info.base,
                leg.dst_blocks(first, end),
                s.pool.tp,
                dst_tp,
            )
        except LayoutError as exc:
            return Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, str(exc))

    async def _bounce_plan(
        self, s: TxSession, local: np.ndarray, remote: np.ndarray, blocks: list[int]
    ) -> tuple[np.ndarray, np.ndarray, Reservation | None]:
        """Gather `blocks` (what the receiver takes of ours) into a send reservation when
        the receiver offered one and it pays off."""
        req, bounce, conn = s.request, self.bounce, s.conn
        assert req is not None and conn is not None and s.pool is not None
        nbytes = int(local[:, 1].sum())
        if (
            bounce is None
            or len(s.legs) > 1
            or (s.legs and not whole_blocks(s.pool, s.legs[0]))  # head slices: per block
            or req.bounce_nbytes < nbytes
            or conn.info.bounce_nbytes == 0
            or not s.pool.layout.named  # the copier packs (layer, kv) pieces
            or not worth_bouncing(len(local), nbytes)
        ):
            return local, remote, None
        res = bounce.send.reserve(nbytes)
        if res is None:
            bounce.fallbacks += 1  # never wait for room: take the per-block path now
            return local, remote, None
        bounce.reservations_made += 1
        await bounce.gather(s.pool.region.array, s.pool.layout, blocks, res, nbytes)
        one_local = np.array([[bounce.send.address + res.offset, nbytes]], dtype=np.int64)
        one_remote = np.array([[conn.info.bounce_base + req.bounce_offset, nbytes]], dtype=np.int64)
        return one_local, one_remote, res

    async def write_slice(self, s: TxSession, start: int, end: int, last: bool) -> None:
        """Write blocks [start, end) to every receiver (one, or each rank of a head-split)."""
        assert s.conn is not None and s.request is not None
        legs = s.legs or [TxLeg(s.conn, s.request)]
        if len(legs) > 1 and end > start:
            for leg in legs:  # every plan first: a bad leg fails the request before any write
                if leg.span(start, end)[0] >= end:
                    continue  # all before its block_start: nothing to plan for it
                plan = self._plan(s, start, end, leg)
                if isinstance(plan, Terminal):
                    s.request_end(plan)
                    return
        for leg in legs:
            if s.terminal is not None:
                return
            await self._write_leg(s, leg, start, end, last)
        if s.terminal is None:
            s.written = end

    async def _write_leg(self, s: TxSession, leg: TxLeg, start: int, end: int, last: bool) -> None:
        nbytes = 0
        bounced = False
        first, _ = leg.span(start, end)
        if first >= end and not last:
            return  # the slice is all before the receiver's block_start: nothing for it
        if end > first:
            plan = self._plan(s, start, end, leg)
            if isinstance(plan, Terminal):
                s.request_end(plan)
                return
            local, remote = plan
            reservation = None
            if start == 0 and last:  # the whole request in one write
                blocks = s.blocks[first:end]
                local, remote, reservation = await self._bounce_plan(s, local, remote, blocks)
            try:
                status = await self.writes.post_and_wait(s, local, remote, leg.conn)
            finally:
                if reservation is not None and self.bounce is not None:
                    self.bounce.send.release(reservation)  # the write is quiescent now
            if status is not XferStatus.DONE or s.terminal is not None:
                return
            if s.deadline is not None and time.monotonic() > s.deadline:
                s.request_end(
                    Terminal.timed_out(
                        Reason.SENDER_DEADLINE,
                        "the write completed after kv_transfer_timeout_ms; not reported as success",
                    )
                )
                return
            nbytes = int(local[:, 1].sum())
            bounced = reservation is not None
            s.nbytes += nbytes
        elif first > start:
            # The last slice, all before the receiver's block_start: nothing to write, but
            # the block counts still decide whether this is success.
            target = leg_target(s, start, end, leg, self.pipelined)
            if isinstance(target, Terminal):
                s.request_end(target)
                return
        sent = await leg.conn.send(leg.written(s.request_id, nbytes, last, bounced, (0, 0)))
        if not sent:
            s.request_end(
                Terminal.peer(Status.FAILED, Reason.PEER_LOST, "could not report the result")
            )
            s.mark_told(leg if s.legs else None)
        elif last:
            leg.served = True
            if len(s.legs) > 1:
                leg.told = True  # that receiver is done: a later leg's failure is not its news
