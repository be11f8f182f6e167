"""Where a leg of a PYTHON-runtime request writes, and whether it can: the receiver's pool
as it announced it (leg_target), the heads a leg moves, its per-block write plan
(plan_leg) or just its checks (check_leg), and the memory kinds both sides named.

The direct mover (transceiver/direct.py) and its bounce planning (direct_bounce.py) ask
these before any write; the staged runtime asks leg_target, peer_memory and
unknown_memory too. Each
answer is the plan, or the Terminal saying why the request ends and whose fault it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvxferd.backends.base import HOST, Memory, vram
from kvxferd.memory.by_identity import by_identity
from kvxferd.memory.heads import TpRank, tp_rank
from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.peers.messages import PoolInfo
from kvxferd.transceiver.legs import TxLeg, dst_tp, leg_heads, split_problem
from kvxferd.transceiver.plan import plan_write
from kvxferd.transceiver.sessions import Terminal, TxSession
from kvxferd.transceiver.state import Reason, Status

if TYPE_CHECKING:
    from kvxferd.service.pools import LocalPool


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


def unknown_memory(what: str, kind: str) -> Terminal:
    return Terminal.peer(
        Status.FAILED,
        Reason.BLOCK_MISMATCH,
        f"the receiver announced its {what} in memory {kind!r}, which this build does not "
        "know (host or vram)",
    )


# A leg's destination: the receiver pool's layout, its announced info, its rank.
LegTarget = tuple[KvLayout, PoolInfo, TpRank]


def leg_target(
    s: TxSession, leg: TxLeg, start: int, end: int, pipelined: bool
) -> LegTarget | Terminal:
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


def heads_of_leg(s: TxSession, leg: TxLeg) -> tuple[int, int] | Terminal | None:
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


def _plan(
    s: TxSession, leg: TxLeg, target: LegTarget, first: int, end: int
) -> tuple[np.ndarray, np.ndarray]:
    """The per-block plan of our logical blocks [first, end) into the leg's target (raises
    LayoutError)."""
    assert s.pool is not None
    dst_layout, info, tp = target
    return plan_write(
        s.pool.layout,
        s.pool.base,
        s.blocks[first:end],
        dst_layout,
        info.base,
        leg.dst_blocks(first, end),
        s.pool.tp,
        tp,
    )


def plan_leg(
    s: TxSession,
    leg: TxLeg,
    start: int,
    end: int,
    pipelined: bool,
    target: LegTarget | None = None,
) -> tuple[np.ndarray, np.ndarray] | Terminal:
    """The per-block write of a leg's share of blocks [start, end): (local, remote)
    descriptors, or why the request ends. `target`: the leg's leg_target for these blocks,
    when the caller has it already (it saves ~6 calls of a one-block request's ~190). It is
    worked out again if the receiver announced its pools anew since (a wait in between):
    the write must go by what it announced last, not into a pool it has given up."""
    if target is None or leg.conn.pools.get(leg.request.pool_id) is not target[1]:
        found = leg_target(s, leg, start, end, pipelined)
        if isinstance(found, Terminal):
            return found
        target = found
    first, end = leg.span(start, end)
    try:
        return _plan(s, leg, target, first, end)
    except LayoutError as exc:
        return Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, str(exc))


@by_identity
def _pair_problem(src: KvLayout, src_tp: TpRank, dst: KvLayout, dst_tp: TpRank) -> str | None:
    """Why no block of a `src` pool can be written into a `dst` pool (their geometry, the
    heads they share), or None: a one-block plan of block 0 on both sides, which any pool
    has. Layouts and ranks are frozen and a daemon sees a few pairs, so it is worked out
    once per pair; it was ~0.45 ms per leg, ~40 % of the context daemon's event loop in a
    head-split (docs/benchmarks.md, issue 16 "tensor parallelism", 2026-12-05)."""
    try:
        plan_write(src, 0, [0], dst, 0, [0], src_tp, dst_tp)
    except LayoutError as exc:
        return str(exc)
    return None


def check_leg(s: TxSession, leg: TxLeg, start: int, end: int, pipelined: bool) -> Terminal | None:
    """Why a leg's write of blocks [start, end) cannot be planned, or None: its target,
    both sides' block ids, and the pair's geometry (_pair_problem). A whole plan of a head
    slice is ~2 ms per 64 blocks here, and the write plans again what it needs."""
    assert s.pool is not None
    target = leg_target(s, leg, start, end, pipelined)
    if isinstance(target, Terminal):
        return target
    first, end = leg.span(start, end)
    try:
        s.pool.layout.check_blocks(s.blocks[first:end])
        target[0].check_blocks(leg.dst_blocks(first, end))
    except LayoutError as exc:
        return Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, str(exc))
    problem = _pair_problem(s.pool.layout, s.pool.tp, target[0], target[2])
    if problem is not None:
        return Terminal.local(Status.FAILED, Reason.BLOCK_MISMATCH, problem)
    return None
