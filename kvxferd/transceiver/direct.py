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
"""

from __future__ import annotations

import math
import time
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from kvxferd.backends.base import HOST, Memory, XferStatus, vram
from kvxferd.backends.twosided import TwoSidedTransport
from kvxferd.memory.heads import TpRank, tp_rank
from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.peers.messages import PoolInfo
from kvxferd.transceiver.bounce import BounceBuffers, Reservation, worth_bouncing
from kvxferd.transceiver.copyplan import copy_plan
from kvxferd.transceiver.legs import TxLeg, dst_tp, leg_block_bytes, leg_heads, split_problem
from kvxferd.transceiver.plan import plan_write
from kvxferd.transceiver.sessions import Terminal, TxSession
from kvxferd.transceiver.staging import NO_BOUNCE_ROOM, reserve_by
from kvxferd.transceiver.state import Reason, Status
from kvxferd.transceiver.writes import Writes, nbytes_of

if TYPE_CHECKING:
    from kvxferd.service.pools import LocalPool
    from kvxferd.transceiver.movers import Route


def peer_memory(kind: str, device: int) -> Memory | None:
    """A peer's memory as it announced it ("host", or "vram" on its CUDA `device`), in the
    backend's terms; None for a kind this build does not know."""
    if kind == "host":
        return HOST
    if kind == "vram" and device >= 0:
        return vram(device)
    return None


def must_bounce(pool: LocalPool, info: PoolInfo) -> bool:
    """Whether a write from `pool` into the peer's pool `info` can only go through the
    bounce buffer: one side is copy-only (device memory the backend has not registered:
    the daemon copies to and from it on the device, NIXL never touches it)."""
    return not pool.zero_copy or not info.writable


def _unknown_memory(what: str, kind: str) -> Terminal:
    return Terminal.peer(
        Status.FAILED,
        Reason.BLOCK_MISMATCH,
        f"the receiver announced its {what} in memory {kind!r}, which this build does not "
        "know (host or vram)",
    )


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
        dst_tp = tp_rank(info.tp_rank, info.tp_size)
        problem = split_problem(s.pool, s.legs, dst_tp, pipelined)
        if problem is not None:
            raise LayoutError(problem)
    except LayoutError as exc:
        return Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, str(exc))
    return dst_layout, info, dst_tp


def _leg_heads(s: TxSession, leg: TxLeg) -> tuple[int, int] | Terminal | None:
    """The heads of our pool a leg moves (None: every head), for its bounce gather; the
    leg's destination was checked by its plan."""
    assert s.pool is not None
    dst_layout, tp = leg.conn.layouts.get(leg.request.pool_id), dst_tp(leg)
    if not isinstance(dst_layout, KvLayout) or tp is None:
        return Terminal.peer(
            Status.FAILED, Reason.UNKNOWN_POOL, f"peer pool {leg.request.pool_id!r} is unknown"
        )
    try:
        return leg_heads(s.pool.layout, s.pool.tp, dst_layout, tp)
    except LayoutError as exc:
        return Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, str(exc))


def _packed(base: int, runs: np.ndarray) -> np.ndarray:
    """Descriptors for `runs`' lengths laid back to back from `base` (packed order)."""
    out = np.empty_like(runs)
    out[:, 1] = runs[:, 1]
    out[0, 0] = base
    np.cumsum(runs[:-1, 1], out=out[1:, 0])
    out[1:, 0] += base
    return out


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

    def _check_leg(self, s: TxSession, start: int, end: int, leg: TxLeg) -> Terminal | None:
        """Why a leg's write of blocks [start, end) cannot be planned, or None: its target,
        both sides' block ids, and the pair's geometry on one block. A whole plan of a head
        slice is ~2 ms per 64 blocks here, and the write plans again what it needs."""
        assert s.pool is not None
        target = leg_target(s, start, end, leg, self.pipelined)
        if isinstance(target, Terminal):
            return target
        dst_layout, info, tp = target
        first, end = leg.span(start, end)
        try:
            s.pool.layout.check_blocks(s.blocks[first:end])
            dst_layout.check_blocks(leg.dst_blocks(first, end))
            plan_write(
                s.pool.layout,
                s.pool.base,
                s.blocks[first : first + 1],
                dst_layout,
                info.base,
                leg.dst_blocks(first, first + 1),
                s.pool.tp,
                tp,
            )
        except LayoutError as exc:
            return Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, str(exc))
        return None

    async def _leg_plan(
        self, s: TxSession, leg: TxLeg, start: int, end: int, last: bool, copy_only: bool
    ) -> tuple[np.ndarray, np.ndarray, Reservation | None, bool] | Terminal:
        """One leg's write of blocks [start, end): (local, remote, our send reservation or
        None, whether it goes into the receiver's reservation), or why the request ends.
        Only a whole request (one write) bounces."""
        first, _ = leg.span(start, end)
        whole = start == 0 and last
        if whole and copy_only:
            return await self._copy_only_leg(s, leg, start, end, first)
        if whole:
            one_sided = await self._one_sided(s, leg, first, end)
            if one_sided is not None:
                return one_sided
        plan = self._plan(s, start, end, leg)
        if isinstance(plan, Terminal):
            return plan
        local, remote = plan
        if whole:
            bounced = await self._bounce_plan(s, leg, local, remote, s.blocks[first:end])
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

    async def _copy_only_leg(
        self, s: TxSession, leg: TxLeg, start: int, end: int, first: int
    ) -> tuple[np.ndarray, np.ndarray, Reservation | None, bool] | Terminal:
        """A whole copy-only leg: checked as a plan would check it, then bounced. Its write
        is one descriptor and the gather makes its own copy plan, so only the byte count
        is wanted of the per-block plan. (Between two GPU pools on an H200 the time from
        the leg's start to its gather went from 0.32 to 0.26 ms of a ~5 ms request; the
        rest is the checks and the reservation: docs/benchmarks.md, "GPU check".)"""
        assert s.pool is not None
        problem = self._check_leg(s, start, end, leg)
        if problem is not None:
            return problem
        heads = _leg_heads(s, leg)
        if isinstance(heads, Terminal):
            return heads
        blocks = s.blocks[first:end]
        nbytes = len(blocks) * leg_block_bytes(s.pool.layout, heads)
        bounced = await self._copy_only_plan(s, leg, nbytes, blocks, heads)
        if isinstance(bounced, Terminal):
            return bounced
        local, remote, reservation = bounced
        return local, remote, reservation, True

    async def _one_sided(
        self, s: TxSession, leg: TxLeg, first: int, end: int
    ) -> tuple[np.ndarray, np.ndarray, Reservation | None, bool] | None:
        """A head-split or head-merge leg moved with one copy on one side, not one on each:
        (local, remote, our send reservation or None, whether the write goes into the
        receiver's reservation); None when this does not apply or pay (the two-sided
        bounce or the per-block path then moves it).

        Split (the receiver holds a slice of our heads): we gather the slice into our send
        region, packed as the receiver's whole blocks, and write it straight into the
        receiver's blocks, one descriptor per run of its pool (bounced=False: nothing for
        it to scatter). Merge (we hold a slice of the receiver's heads): our whole blocks go
        straight from our pool into the reservation the receiver offered, where it scatters
        them into its heads. Either way the other side's copy is gone: on two cores, where
        both engines and all daemons share the CPU, one copy of every byte fewer (docs/
        benchmarks.md, issue 16 "tensor parallelism"). Taken only where the side written
        without a copy has few runs (worth_bouncing says no); the packed order is the one
        the two-sided bounce already agrees on (kvxferd.transceiver.copyplan)."""
        assert s.pool is not None
        bounce, req, conn = self.bounce, leg.request, leg.conn
        tp, dst_layout, info = (
            dst_tp(leg),
            conn.layouts.get(req.pool_id),
            conn.pools.get(req.pool_id),
        )
        if bounce is None or tp is None or not isinstance(dst_layout, KvLayout) or info is None:
            return None
        if not s.pool.layout.named or not dst_layout.named or tp.size == s.pool.tp.size:
            return None
        heads = _leg_heads(s, leg)
        if isinstance(heads, Terminal):
            return None  # the per-block plan names the problem
        blocks = s.blocks[first:end]
        if heads is not None and tuple(heads) == (0, s.pool.layout.num_kv_heads):
            heads = None  # every head of ours: whole blocks
        try:
            if heads is not None and tp.size > s.pool.tp.size:
                runs = copy_plan(dst_layout, leg.dst_blocks(first, end)).segments()
            elif heads is None and tp.size < s.pool.tp.size:
                runs = copy_plan(s.pool.layout, blocks).segments()
            else:
                return None
        except LayoutError:
            return None
        nbytes = nbytes_of(runs)
        if worth_bouncing(len(runs), nbytes):
            return None  # that side is fragmented: a packed write both sides copy pays
        if heads is None:  # merge: out of our blocks into the receiver's reservation
            if req.bounce_nbytes < nbytes or conn.info.bounce_nbytes == 0:
                return None
            local = runs.copy()
            local[:, 0] += s.pool.base
            bounce.one_sided_legs += 1
            return local, _packed(conn.info.bounce_base + req.bounce_offset, runs), None, True
        # split: gathered here, into the receiver's blocks
        if nbytes > bounce.send.nbytes or not info.writable:
            return None
        res = bounce.send.reserve(nbytes)
        if res is None:
            return None  # no room now: the two-sided plan falls back as it always did
        bounce.reservations_made += 1
        try:
            await bounce.gather(s.pool.region.array, s.pool.layout, blocks, res, nbytes, heads)
        except BaseException:
            bounce.send.release(res)
            raise
        remote = runs.copy()
        remote[:, 0] += info.base
        bounce.one_sided_legs += 1
        return _packed(bounce.send.address + res.offset, runs), remote, res, False

    async def _bounce_plan(
        self,
        s: TxSession,
        leg: TxLeg,
        local: np.ndarray,
        remote: np.ndarray,
        blocks: list[int],
    ) -> tuple[np.ndarray, np.ndarray, Reservation | None] | Terminal:
        """Gather `blocks` (what the leg's receiver takes of ours: every head, or the slice
        of a head-split) into a send reservation when that receiver offered one and it pays
        off. (A copy-only leg, which must bounce whatever it costs: _copy_only_leg.)"""
        req, bounce, conn = leg.request, self.bounce, leg.conn
        assert s.pool is not None
        if bounce is None:
            return local, remote, None  # no bounce buffer here: the per-block path
        nbytes = nbytes_of(local)
        heads = _leg_heads(s, leg)
        if isinstance(heads, Terminal):
            return heads
        if (
            req.bounce_nbytes < nbytes
            or conn.info.bounce_nbytes == 0
            or not s.pool.layout.named  # the copier packs (layer, kv) pieces
            or not worth_bouncing(len(local), nbytes)
        ):
            return local, remote, None
        res = bounce.send.reserve(nbytes)
        if res is None:
            bounce.fallbacks += 1  # never wait for room: take the per-block path now
            return local, remote, None
        return await self._gathered(s, leg, blocks, res, nbytes, heads)

    async def _gathered(
        self,
        s: TxSession,
        leg: TxLeg,
        blocks: list[int],
        res: Reservation,
        nbytes: int,
        heads: tuple[int, int] | None,
    ) -> tuple[np.ndarray, np.ndarray, Reservation]:
        """Gather into the reservation `res`; the one-descriptor write that carries it into
        the reservation the leg's receiver offered."""
        req, bounce, conn = leg.request, self.bounce, leg.conn
        assert s.pool is not None and bounce is not None
        bounce.reservations_made += 1
        await bounce.gather(s.pool.region.array, s.pool.layout, blocks, res, nbytes, heads)
        one_local = np.array([[bounce.send.address + res.offset, nbytes]], dtype=np.int64)
        one_remote = np.array([[conn.info.bounce_base + req.bounce_offset, nbytes]], dtype=np.int64)
        return one_local, one_remote, res

    async def _copy_only_plan(
        self,
        s: TxSession,
        leg: TxLeg,
        nbytes: int,
        blocks: list[int],
        heads: tuple[int, int] | None,
    ) -> tuple[np.ndarray, np.ndarray, Reservation] | Terminal:
        """The bounce of a request that cannot be written per block, or why it cannot go."""
        req, bounce, conn = leg.request, self.bounce, leg.conn
        assert s.pool is not None
        what = (
            f"pool {s.pool.pool_id!r} here is copy-only"
            if not s.pool.zero_copy
            else f"the receiver's pool {req.pool_id!r} is copy-only"
        )
        why = (
            f"{what} (device memory the backend does not read or write itself), so the "
            f"request's {nbytes} bytes can only move through the bounce buffer, but "
        )
        problem = None
        if bounce is None:
            problem = "this daemon has none (set kv_cache_bounce_size_mb)"
        elif not s.pool.layout.named:
            problem = "the pool's layout has no named order (the copier packs its pieces)"
        elif nbytes > bounce.send.nbytes:
            problem = (
                f"this daemon's region holds {bounce.send.nbytes} bytes (raise "
                "kv_cache_bounce_size_mb, or use transceiver_runtime CPP, which moves rounds)"
            )
        elif conn.info.bounce_nbytes == 0 or req.bounce_nbytes < nbytes:
            problem = (
                f"the receiver offered a reservation of {req.bounce_nbytes} bytes "
                f"(kv_cache_bounce_size_mb {conn.info.bounce_nbytes >> 20} on the receiver)"
            )
        if problem is not None:
            return Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, why + problem)
        assert bounce is not None
        deadline = s.deadline if s.deadline is not None else math.inf
        res = await reserve_by(lambda: bounce.send.reserve(nbytes), deadline)
        if res is None:
            return Terminal.timed_out(Reason.SENDER_DEADLINE, NO_BOUNCE_ROOM)
        if s.terminal is not None:  # ended (cancelled, peer lost) while it waited
            bounce.send.release(res)
            return s.terminal  # ending it again changes nothing: the first end stands
        return await self._gathered(s, leg, blocks, res, nbytes, heads)

    def _memories(self, s: TxSession, leg: TxLeg) -> tuple[bool, Memory, Memory] | Terminal:
        """(must the leg bounce, our pool's memory, the receiver pool's memory) for a
        per-block write; the leg's pool was checked known by its plan."""
        assert s.pool is not None
        info = leg.conn.pools[leg.request.pool_id]
        remote = peer_memory(info.memory, info.device)
        if remote is None:
            return _unknown_memory(f"pool {info.pool_id!r}", info.memory)
        return must_bounce(s.pool, info), s.pool.memory, remote

    async def write_slice(self, s: TxSession, start: int, end: int, last: bool) -> None:
        """Write blocks [start, end) to every receiver (one, or each rank of a head-split)."""
        assert s.conn is not None and s.request is not None
        legs = s.legs or [TxLeg(s.conn, s.request)]
        if len(legs) > 1 and end > start:
            for leg in legs:  # every leg checked first: a bad one fails the request before
                if leg.span(start, end)[0] >= end:  # any write
                    continue  # all before its block_start: nothing to plan for it
                problem = self._check_leg(s, start, end, leg)
                if problem is not None:
                    s.request_end(problem)
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
            target = leg_target(s, start, end, leg, self.pipelined)
            if isinstance(target, Terminal):
                s.request_end(target)
                return
            memories = self._memories(s, leg)
            if isinstance(memories, Terminal):
                s.request_end(memories)
                return
            copy_only, local_memory, remote_memory = memories
            planned = await self._leg_plan(s, leg, start, end, last, copy_only)
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
                    if reservation is not None and self.bounce is not None:
                        self.bounce.send.release(reservation)
                    s.request_end(_unknown_memory("bounce region", leg.conn.info.bounce_memory))
                    return
                remote_memory = bounce_memory
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
                        "the write completed after kv_transfer_timeout_ms; not reported as success",
                    )
                )
                return
            nbytes = nbytes_of(local)
            bounced = into_bounce  # the receiver scatters out of its reservation
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
