"""The direct mover: the PYTHON runtime's one-sided writes from the engine's blocks into
the receiver's, one descriptor per contiguous run, or through the bounce buffer (one
contiguous write) when the receiver offered a reservation and it pays off, and always when
either pool is copy-only (device memory the backend has not registered: must_bounce).
Every post names each side's memory kind (the pools' for per-block writes, the bounce
regions' for a bounce).

A mover is what a send coordinator (transceiver/sender.py) hands each due slice of a
request to: `write_slice(session, start, end, last)` writes blocks [start, end) to every
receiver of the request and sends each its Result, or ends the request with why. It knows
nothing of how requests are matched with receivers.

Where each leg writes and whether it can is transceiver/leg_targets.py; whether and how it
bounces, direct_bounce.py (BouncePlanner); this module chooses per leg, posts the write
and reports it.
"""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import TYPE_CHECKING

from kvxferd.backends.base import Memory, XferStatus
from kvxferd.backends.twosided import TwoSidedTransport
from kvxferd.transceiver.bounce import BounceBuffers
from kvxferd.transceiver.direct_bounce import BouncePlanner, LegWrite
from kvxferd.transceiver.leg_targets import (
    LegTarget,
    check_leg,
    leg_target,
    must_bounce,
    peer_memory,
    plan_leg,
    unknown_memory,
)
from kvxferd.transceiver.legs import TxLeg
from kvxferd.transceiver.sessions import Terminal, TxSession
from kvxferd.transceiver.state import Reason, Status
from kvxferd.transceiver.writes import Writes, nbytes_of

if TYPE_CHECKING:
    from kvxferd.transceiver.movers import Route


def _prepared(together: list[LegWrite | None] | None, i: int) -> tuple[LegWrite | None, bool]:
    """(leg i's write gathered with the others, whether it may still move one-sided)."""
    if together is None:
        return None, True  # the legs plan their own
    return together[i], together[i] is not None


class DirectMover:
    """A SendMover (transceiver/movers.py)."""

    def __init__(self, writes: Writes, bounce: BounceBuffers | None, pipelined: bool) -> None:
        self.writes = writes
        self.bounce = bounce
        self.pipelined = pipelined
        self._bouncer = BouncePlanner(bounce, pipelined)

    def routes(self) -> dict[type, Route]:
        return {}  # every peer message of a direct write is the coordinator's

    def attach(self, transport: TwoSidedTransport) -> None:
        raise TypeError("the direct mover writes one-sided; it takes no two-sided transport")

    def peer_gone(self, peer_key: str) -> None:
        pass  # it keeps nothing per peer

    async def _leg_plan(
        self,
        s: TxSession,
        leg: TxLeg,
        start: int,
        end: int,
        last: bool,
        copy_only: bool,
        one_sided_ok: bool = True,
        target: LegTarget | None = None,
    ) -> LegWrite | Terminal:
        """One leg's write of blocks [start, end): (local, remote, our send reservation or
        None, whether it goes into the receiver's reservation), or why the request ends.
        Only a whole request (one write) bounces; `one_sided_ok` False: not moved one-sided
        (the split's legs found no room together). `target`: the leg's, checked already."""
        first, _ = leg.span(start, end)
        whole = start == 0 and last
        if whole and copy_only:
            return await self._bouncer.copy_only_leg(s, leg, start, end, first)
        if whole and one_sided_ok:
            one_sided = await self._bouncer.one_sided(s, leg, first, end)
            if one_sided is not None:
                return one_sided
        plan = plan_leg(s, leg, start, end, self.pipelined, target)
        if isinstance(plan, Terminal):
            return plan
        local, remote = plan
        if whole:
            bounced = await self._bouncer.bounce_plan(s, leg, local, remote, s.blocks[first:end])
            if isinstance(bounced, Terminal):
                return bounced
            local, remote, reservation = bounced
            return local, remote, reservation, reservation is not None
        if copy_only:
            # Config resolution refuses pipelining with device pools; this guard keeps a
            # slice off the copy-only blocks.
            return Terminal.local(
                Status.FAILED,
                Reason.BLOCK_MISMATCH,
                f"blocks [{start}, {end}) of a request into or out of a copy-only pool cannot "
                "be written on their own (only a whole request bounces); turn "
                "enable_pipelined_transfer off",
            )
        return local, remote, None, False

    def _memories(self, s: TxSession, leg: TxLeg) -> tuple[bool, Memory, Memory] | Terminal:
        """(must the leg bounce, our pool's memory, the receiver pool's memory) for a
        per-block write; the leg's pool was checked known by its plan."""
        assert s.pool is not None
        info = leg.conn.pools[leg.request.pool_id]
        remote = peer_memory(info.memory, info.device)
        if remote is None:
            return unknown_memory(f"pool {info.pool_id!r}", info.memory)
        return must_bounce(s.pool, info), s.pool.memory, remote

    async def write_slice(self, s: TxSession, start: int, end: int, last: bool) -> None:
        """Write blocks [start, end) to every receiver (one, or each rank of a head-split)."""
        assert s.conn is not None and s.request is not None
        legs = s.legs or [TxLeg(s.conn, s.request)]
        if len(legs) > 1 and end > start:
            for leg in legs:  # every leg checked first: a bad one fails the request before
                if leg.span(start, end)[0] >= end:  # any write
                    continue  # all before its block_start: nothing to plan for it
                problem = check_leg(s, leg, start, end, self.pipelined)
                if problem is not None:
                    s.request_end(problem)
                    return
        if len(legs) == 1:
            await self._write_leg(s, legs[0], start, end, last)
        else:
            together = await self._split_together(s, legs, start, end, last)
            if isinstance(together, Terminal):
                s.request_end(together)
                return
            # Each rank's leg at once: one leg's write moves while the next one gathers.
            done = await asyncio.gather(
                *(
                    self._write_leg(s, leg, start, end, last, *_prepared(together, i))
                    for i, leg in enumerate(legs)
                ),
                return_exceptions=True,
            )
            for outcome in done:
                if isinstance(outcome, BaseException):
                    raise outcome
        if s.terminal is None:
            s.written = end

    async def _split_together(
        self, s: TxSession, legs: list[TxLeg], start: int, end: int, last: bool
    ) -> list[LegWrite | None] | Terminal | None:
        """The legs of a whole head-split request gathered in one pass
        (BouncePlanner.split_together), where every leg takes the same blocks of a pool
        the backend reads itself; None: each leg plans its own."""
        assert s.pool is not None
        if start != 0 or not last or not s.pool.zero_copy:
            return None
        firsts = {leg.span(start, end)[0] for leg in legs}
        if len(firsts) != 1 or (first := firsts.pop()) >= end:
            return None
        return await self._bouncer.split_together(s, legs, first, end)

    async def _write_leg(
        self,
        s: TxSession,
        leg: TxLeg,
        start: int,
        end: int,
        last: bool,
        prepared: LegWrite | None = None,
        one_sided_ok: bool = True,
    ) -> None:
        """One leg's write and Result; `prepared`: its write, already gathered. Its send
        reservation is this leg's to give back: once the write is quiescent, or here when
        the leg ends before its post."""
        unposted = prepared[2] if prepared is not None else None
        try:
            if s.terminal is not None:
                return  # another leg ended the request before this one began
            nbytes = 0
            bounced = False
            first, _ = leg.span(start, end)
            if first >= end and not last:
                return  # the slice is all before the receiver's block_start: nothing for it
            if end > first:
                target = leg_target(s, leg, start, end, self.pipelined)
                if isinstance(target, Terminal):
                    s.request_end(target)
                    return
                memories = self._memories(s, leg)
                if isinstance(memories, Terminal):
                    s.request_end(memories)
                    return
                copy_only, local_memory, remote_memory = memories
                planned = prepared or await self._leg_plan(
                    s, leg, start, end, last, copy_only, one_sided_ok, target
                )
                if isinstance(planned, Terminal):
                    s.request_end(planned)
                    return
                local, remote, reservation, into_bounce = planned
                if reservation is not None:  # we write out of our send region
                    assert self.bounce is not None
                    local_memory = self.bounce.send.memory
                if into_bounce:  # into the reservation the receiver offered
                    bounce_memory = peer_memory(
                        leg.conn.info.bounce_memory, leg.conn.info.bounce_device
                    )
                    if bounce_memory is None:
                        unposted = None
                        if reservation is not None and self.bounce is not None:
                            self.bounce.send.release(reservation)
                        s.request_end(unknown_memory("bounce region", leg.conn.info.bounce_memory))
                        return
                    remote_memory = bounce_memory
                unposted = None  # from here on the post's own end gives it back
                try:
                    status = await self.writes.post_and_wait(
                        s,
                        local,
                        remote,
                        leg.conn,
                        local_memory=local_memory,
                        remote_memory=remote_memory,
                    )
                finally:
                    if reservation is not None and self.bounce is not None:
                        # Once the write is quiescent: now, or when its drain ends.
                        s.when_quiescent(partial(self.bounce.send.release, reservation))
                if status is not XferStatus.DONE or s.terminal is not None:
                    return
                if s.deadline is not None and time.monotonic() > s.deadline:
                    s.request_end(
                        Terminal.timed_out(
                            Reason.SENDER_DEADLINE,
                            "the write completed after kv_transfer_timeout_ms; not reported as "
                            "success",
                        )
                    )
                    return
                nbytes = nbytes_of(local)
                bounced = into_bounce  # the receiver scatters out of its reservation
                s.nbytes += nbytes
            elif first > start:
                # The last slice, all before the receiver's block_start: nothing to write, but
                # the block counts still decide whether this is success.
                target = leg_target(s, leg, start, end, self.pipelined)
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
        finally:
            if unposted is not None and self.bounce is not None:
                self.bounce.send.release(unposted)
