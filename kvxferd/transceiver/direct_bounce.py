"""The bounce buffer's side of a PYTHON-runtime write (BouncePlanner): whether a leg
moves through the send and receive reservations instead of block by block, and the gather
into ours that such a write starts from.

* A whole request whose blocks are fragmented is gathered into a send reservation and
  written as one descriptor into the reservation its receiver offered (bounce_plan).
* A head-split or head-merge leg moves with one copy on one side where the other side has
  few runs (one_sided).
* A copy-only pool (device memory the backend does not register) can only bounce
  (copy_only_leg), and says why when it cannot.

transceiver/direct.py decides per leg and makes the write; this module only plans it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.peers.messages import PoolInfo
from kvxferd.transceiver.bounce import BounceBuffers, Reservation, reserved_bytes, worth_bouncing
from kvxferd.transceiver.copyplan import copy_plan
from kvxferd.transceiver.leg_targets import check_leg, heads_of_leg
from kvxferd.transceiver.legs import TxLeg, dst_tp, leg_block_bytes
from kvxferd.transceiver.sessions import Terminal, TxSession
from kvxferd.transceiver.staging import (
    BOUNCE_ROOM_WAIT_S,
    NO_BOUNCE_ROOM,
    RegionWarnings,
    RoomLine,
    reserve_all,
)
from kvxferd.transceiver.state import Reason, Status
from kvxferd.transceiver.writes import nbytes_of

# (local, remote, our send reservation or None, whether it goes into the receiver's
# reservation): a leg's write as planned.
LegWrite = tuple[np.ndarray, np.ndarray, "Reservation | None", bool]


def _packed(base: int, runs: np.ndarray) -> np.ndarray:
    """Descriptors for `runs`' lengths laid back to back from `base` (packed order)."""
    out = np.empty_like(runs)
    out[:, 1] = runs[:, 1]
    out[0, 0] = base
    np.cumsum(runs[:-1, 1], out=out[1:, 0])
    out[1:, 0] += base
    return out


class BouncePlanner:
    """Plans the bounced writes of the direct mover (`bounce`: this daemon's buffers, or
    None when it has none: then nothing bounces; `pipelined`: slices may be written before
    the request's last)."""

    def __init__(self, bounce: BounceBuffers | None, pipelined: bool) -> None:
        self.bounce = bounce
        self.pipelined = pipelined
        # Legs waiting for room in the send region, served in the order they began to wait.
        self.room = RoomLine()
        self.warn = RegionWarnings()

    async def copy_only_leg(
        self, s: TxSession, leg: TxLeg, start: int, end: int, first: int
    ) -> LegWrite | Terminal:
        """A whole copy-only leg: checked as a plan would check it, then bounced. Its write
        is one descriptor and the gather makes its own copy plan, so only the byte count
        is wanted of the per-block plan. (Between two GPU pools on an H200 the time from
        the leg's start to its gather went from 0.32 to 0.26 ms of a ~5 ms request; the
        rest is the checks and the reservation: docs/benchmarks.md, "GPU check".)"""
        assert s.pool is not None
        problem = check_leg(s, leg, start, end, self.pipelined)
        if problem is not None:
            return problem
        heads = heads_of_leg(s, leg)
        if isinstance(heads, Terminal):
            return heads
        blocks = s.blocks[first:end]
        nbytes = len(blocks) * leg_block_bytes(s.pool.layout, heads)
        bounced = await self._copy_only_plan(s, leg, nbytes, blocks, heads)
        if isinstance(bounced, Terminal):
            return bounced
        local, remote, reservation = bounced
        return local, remote, reservation, True

    def _one_sided_shape(self, s: TxSession, leg: TxLeg, first: int, end: int) -> _OneSided | None:
        """What a one-sided move of a leg would copy (see one_sided), or None when it does
        not apply or pay."""
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
        heads = heads_of_leg(s, leg)
        if isinstance(heads, Terminal):
            return None  # the per-block plan names the problem
        if heads is not None and tuple(heads) == (0, s.pool.layout.num_kv_heads):
            heads = None  # every head of ours: whole blocks
        try:
            if heads is not None and tp.size > s.pool.tp.size:
                runs = copy_plan(dst_layout, leg.dst_blocks(first, end)).segments()
            elif heads is None and tp.size < s.pool.tp.size:
                runs = copy_plan(s.pool.layout, s.blocks[first:end]).segments()
            else:
                return None
        except LayoutError:
            return None
        nbytes = nbytes_of(runs)
        if worth_bouncing(len(runs), nbytes):
            return None  # that side is fragmented: a packed write both sides copy pays
        return _OneSided(heads, runs, nbytes, info)

    async def one_sided(
        self, s: TxSession, leg: TxLeg, first: int, end: int
    ) -> LegWrite | Terminal | None:
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
        the two-sided bounce already agrees on (kvxferd.transceiver.copyplan).

        A split that finds no room waits for it, up to BOUNCE_ROOM_WAIT_S: the per-block
        path it would fall back to moves a head slice ten times slower. A Terminal: the
        request ended while it waited."""
        assert s.pool is not None
        bounce, req, conn = self.bounce, leg.request, leg.conn
        shape = self._one_sided_shape(s, leg, first, end)
        if shape is None:
            return None
        assert bounce is not None
        heads, runs, nbytes, info = shape.heads, shape.runs, shape.nbytes, shape.info
        if heads is None:  # merge: out of our blocks into the receiver's reservation
            if req.bounce_nbytes < nbytes or conn.info.bounce_nbytes == 0:
                return None
            local = runs.copy()
            local[:, 0] += s.pool.base
            bounce.one_sided_legs += 1
            return local, _packed(conn.info.bounce_base + req.bounce_offset, runs), None, True
        # split: gathered here, into the receiver's blocks
        if not info.writable:
            return None
        if nbytes > bounce.send.nbytes:
            bounce.fallbacks += 1
            self.warn.never_fits("a head-split leg", nbytes, bounce.send.nbytes)
            return None
        res = await self._room(s, nbytes, BOUNCE_ROOM_WAIT_S)
        if res is None:
            bounce.fallbacks += 1
            self.warn.busy("a head-split leg", nbytes, bounce.send.nbytes, BOUNCE_ROOM_WAIT_S)
            return None  # no room in time: the two-sided plan falls back as it always did
        if s.terminal is not None:  # ended (cancelled, peer lost) while it waited
            bounce.send.release(res)
            return s.terminal
        bounce.reservations_made += 1
        try:
            await bounce.gather(
                s.pool.region.array, s.pool.layout, s.blocks[first:end], res, nbytes, heads
            )
        except BaseException:
            bounce.send.release(res)
            raise
        bounce.one_sided_legs += 1
        return _split_write(bounce, res, shape)

    async def split_together(
        self, s: TxSession, legs: list[TxLeg], first: int, end: int
    ) -> list[LegWrite | None] | Terminal | None:
        """Every leg of a head-split moved as one_sided moves a split leg, with all the
        legs' room reserved at once (all or none, in line, up to BOUNCE_ROOM_WAIT_S) and
        their slices gathered in one pass over our blocks (Copier.gather_slices): the pool
        is read once, not once per leg. Each leg's write, or None for a leg to plan without
        a one-sided move (no room in time: the per-block path, as one_sided falls back);
        None when some leg does not qualify (each then plans its own); a Terminal: the
        request ended while it waited."""
        bounce = self.bounce
        assert s.pool is not None
        if bounce is None or len(legs) < 2:
            return None
        shapes: list[_OneSided] = []
        slice_heads: list[tuple[int, int]] = []
        for leg in legs:
            shape = self._one_sided_shape(s, leg, first, end)
            if shape is None or shape.heads is None or not shape.info.writable:
                return None
            shapes.append(shape)
            slice_heads.append(shape.heads)
        sizes = [shape.nbytes for shape in shapes]
        if sum(map(reserved_bytes, sizes)) > bounce.send.nbytes:
            return None  # they never fit at once: one leg at a time
        got = await self._rooms(s, sizes, BOUNCE_ROOM_WAIT_S)
        if got is None:
            bounce.fallbacks += len(legs)
            self.warn.busy(
                "a head-split's legs together", sum(sizes), bounce.send.nbytes, BOUNCE_ROOM_WAIT_S
            )
            return [None] * len(legs)
        if s.terminal is not None:  # ended (cancelled, peer lost) while it waited
            for res in got:
                bounce.send.release(res)
            return s.terminal
        bounce.reservations_made += len(got)
        slices = [
            (heads, res, shape.nbytes)
            for heads, res, shape in zip(slice_heads, got, shapes, strict=True)
        ]
        try:
            await bounce.gather_slices(
                s.pool.region.array, s.pool.layout, s.blocks[first:end], slices
            )
        except BaseException:
            for res in got:
                bounce.send.release(res)
            raise
        bounce.one_sided_legs += len(legs)
        return [_split_write(bounce, res, shape) for shape, res in zip(shapes, got, strict=True)]

    async def bounce_plan(
        self,
        s: TxSession,
        leg: TxLeg,
        local: np.ndarray,
        remote: np.ndarray,
        blocks: list[int],
    ) -> tuple[np.ndarray, np.ndarray, Reservation | None] | Terminal:
        """Gather `blocks` (what the leg's receiver takes of ours: every head, or the slice
        of a head-split) into a send reservation when that receiver offered one and it pays
        off. (A copy-only leg, which must bounce whatever it costs: copy_only_leg.)"""
        req, bounce, conn = leg.request, self.bounce, leg.conn
        assert s.pool is not None
        if bounce is None:
            return local, remote, None  # no bounce buffer here: the per-block path
        nbytes = nbytes_of(local)
        heads = heads_of_leg(s, leg)
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
        res = await self._room(s, nbytes, math.inf)
        if res is None:
            return Terminal.timed_out(Reason.SENDER_DEADLINE, NO_BOUNCE_ROOM)
        if s.terminal is not None:  # ended (cancelled, peer lost) while it waited
            bounce.send.release(res)
            return s.terminal  # ending it again changes nothing: the first end stands
        return await self._gathered(s, leg, blocks, res, nbytes, heads)

    async def _room(self, s: TxSession, nbytes: int, wait_s: float) -> Reservation | None:
        """A send reservation of `nbytes`: at once when no one waits and there is room,
        else in line, until `wait_s` from now or the request's deadline (None then)."""
        bounce = self.bounce
        assert bounce is not None
        res, waited = await self.room.take(
            lambda: bounce.send.reserve(nbytes), _room_deadline(s, wait_s)
        )
        bounce.room_waits += waited
        return res

    async def _rooms(
        self, s: TxSession, sizes: list[int], wait_s: float
    ) -> list[Reservation] | None:
        """_room for several reservations, all or none (staging.reserve_all)."""
        bounce = self.bounce
        assert bounce is not None
        got, waited = await self.room.take(
            lambda: reserve_all(bounce.send, sizes), _room_deadline(s, wait_s)
        )
        bounce.room_waits += waited
        return got


def _room_deadline(s: TxSession, wait_s: float) -> float:
    """`wait_s` from now, or the request's deadline when that comes first."""
    return min(s.deadline if s.deadline is not None else math.inf, time.monotonic() + wait_s)


@dataclass(frozen=True)
class _OneSided:
    """What a one-sided move copies: our heads a split leg gathers (None: a merge leg,
    whole blocks), the runs of the side written without a copy (in packed order), their
    bytes, and the receiver's pool."""

    heads: tuple[int, int] | None
    runs: np.ndarray
    nbytes: int
    info: PoolInfo


def _split_write(bounce: BounceBuffers, res: Reservation, shape: _OneSided) -> LegWrite:
    """A split leg gathered into `res`: written packed out of it into the receiver's runs."""
    remote = shape.runs.copy()
    remote[:, 0] += shape.info.base
    return _packed(bounce.send.address + res.offset, shape.runs), remote, res, False
