"""The legs of a request: one per (context rank, generation rank) pair that moves KV.

Between pools holding the same heads a request has one leg, as without tensor parallelism.
When the two instances have different tensor-parallel sizes it has several:

* head-split (more generation ranks): the context daemon serves one RequestData per
  generation rank holding some of its heads, each a TxLeg of its session;
* head-merge (more context ranks): the generation daemon asks every context daemon
  holding some of its heads, each an RxLeg of its session.

What is here decides, from the pools both sides announced, how many legs a request needs,
whether a RequestData is one of them, and whether the legs cover the heads exactly once;
and tells legs that a request ended. The sender and the receiver do everything else.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvxferd.memory.by_identity import by_identity
from kvxferd.memory.heads import (
    TpRank,
    common_heads,
    describe,
    head_range,
    local_heads,
    mapping_problems,
    overlapping_ranks,
    same_heads,
    slice_block_bytes,
    total_heads,
    tp_rank,
)
from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.compat import tp_support_problem
from kvxferd.peers.messages import Abort, RequestData, Result
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver.bounce import Reservation
from kvxferd.transceiver.state import Reason


@dataclass(eq=False)
class TxLeg:
    """One receiver of a request on the context side: a generation daemon's RequestData.

    A request has one leg, or one per generation rank when the generation instance has more
    tensor-parallel ranks than the context instance (head-split).
    """

    conn: PeerConnection
    request: RequestData
    told: bool = False  # this receiver knows the outcome (or cannot be told any more)
    served: bool = False  # its last Result went out: it has all it asked for
    acked_block: int = 0  # staged: the receiver scattered every block before this one

    def span(self, start: int, end: int) -> tuple[int, int]:
        """What this receiver takes of our blocks [start, end): nothing before its
        block_start (it has those in its prefix cache); empty when all of them are."""
        return max(start, self.request.block_start), end

    def written(
        self,
        request_id: str,
        nbytes: int,
        last: bool,
        bounced: bool,
        span: tuple[int, int],
        offset: int = 0,
    ) -> Result:
        """The Result telling this leg's receiver that `nbytes` are in place: the logical
        blocks `span` (first, end), or (0, 0) for the whole request; a staged round at
        `offset` in the receiver's reservation."""
        return Result(
            request_id=request_id,
            rx_token=self.request.rx_token,
            status=Reason.OK,
            nbytes=nbytes,
            last=last,
            bounced=bounced,
            first_block=span[0],
            end_block=span[1],
            round_offset=offset,
        )

    def dst_blocks(self, first: int, end: int) -> list[int]:
        """The receiver's blocks for our blocks [first, end) (within its span): it lists
        its blocks from the request's block block_start on, not from block 0."""
        b = self.request.block_start
        return self.request.blocks[first - b : end - b]


@dataclass(eq=False)
class RxLeg:
    """One context daemon a receive reads from; several when the context instance has more
    tensor-parallel ranks than the generation instance (head-merge)."""

    peer_address: str
    conn: PeerConnection | None = None
    request_sent: bool = False
    done: bool = False  # its last Result arrived
    told: bool = False  # it knows the outcome (or cannot be told any more)
    abort_acked: bool = False
    # Nothing it sends can land in our memory any more: its Abort (sent once quiescent) or
    # AbortAck, a cancel it agreed to, or its last Result. A closed connection is no proof.
    fenced: bool = False
    # Our staging/bounce reservation for this leg's bytes (freed once quiescent), and the
    # part of it offered to the context daemon with the RequestData.
    res: Reservation | None = None
    offer: Reservation | None = None
    # The context daemon's pool (rank, layout) as announced when its first Result arrived:
    # what it wrote from, even if its engine deregisters the pool before we are done.
    source: tuple[TpRank, KvLayout] | None = None


async def abort_legs(
    request_id: str, legs: list[TxLeg], skip: TxLeg | None, reason: str, message: str
) -> None:
    """Tell every receiver of a request (but `skip`, and those already told) that it ended."""
    for leg in legs:
        if leg is not skip and not leg.told:
            leg.told = True
            await leg.conn.send(
                Abort(
                    request_id=request_id,
                    rx_token=leg.request.rx_token,
                    reason=reason,
                    message=message,
                )
            )


# ------------------------------------------------ what one leg moves (staged runtime)


def leg_heads(
    ours: KvLayout, our_tp: TpRank, theirs: KvLayout, their_tp: TpRank
) -> tuple[int, int] | None:
    """The heads [start, end) of our pool (its own indices) that a leg between our pool and
    theirs moves; None when both hold the same heads (whole blocks move). LayoutError when
    they share none."""
    if same_heads(ours, our_tp, theirs, their_tp):
        return None
    heads = local_heads(ours, our_tp, theirs, their_tp)
    if heads is None:
        raise LayoutError(
            f"our pool ({describe(ours, our_tp)}) and the peer's ({describe(theirs, their_tp)}) "
            "hold no KV head in common"
        )
    return heads


def leg_block_bytes(layout: KvLayout, heads: tuple[int, int] | None) -> int:
    """Bytes one block contributes to a leg moving `heads` of a pool (None: every head)."""
    return layout.block_bytes if heads is None else slice_block_bytes(layout, heads[1] - heads[0])


# ------------------------------------------------------- context side: head-split


def dst_tp(leg: TxLeg) -> TpRank | None:
    """The tensor-parallel rank of a leg's destination pool (None: unknown or invalid)."""
    info = leg.conn.pools.get(leg.request.pool_id)
    if info is None:
        return None
    try:
        return tp_rank(info.tp_rank, info.tp_size)
    except LayoutError:
        return None


def another_rank(legs: list[TxLeg], new_leg: TxLeg) -> bool:
    """A further RequestData for a request is a head-split leg, not a duplicate, when it
    comes from another daemon, for a pool of another rank of the same multi-rank generation
    instance as every known leg. (Whether the request may still take one is the caller's.)"""
    new = dst_tp(new_leg)
    if new is None or new.size == 1:
        return False
    conn = new_leg.conn
    for leg in legs:
        if leg.conn is conn or leg.conn.peer.name == conn.peer.name:
            return False
        known = dst_tp(leg)
        if known is None or known.size != new.size or known.rank == new.rank:
            return False
    return True


def refusal(
    pool: LocalPool | None, legs: list[TxLeg], leg: TxLeg, still_open: bool
) -> tuple[str, str] | None:
    """(reason, message) refusing a RequestData as a leg of a request whose legs so far are
    `legs`, or None to take it. `still_open`: the request may take another leg (it has not
    ended, nothing was written)."""
    if legs and not (still_open and another_rank(legs, leg)):
        return (
            Reason.DUPLICATE_REQUEST,
            f"request {leg.request.request_id!r} is already requested by another receive "
            f"(from {legs[0].conn.peer.name})",
        )
    # Refused alone: the request waits on for the ranks that hold our heads.
    stray = no_common_heads(pool, leg)
    return None if stray is None else (Reason.BLOCK_MISMATCH, stray)


def drop_strangers(pool: LocalPool, legs: list[TxLeg]) -> list[tuple[TxLeg, str]]:
    """Take out of `legs` those holding none of our heads (they asked before our pool was
    known), each with why."""
    strangers = [(leg, why) for leg in legs if (why := no_common_heads(pool, leg))]
    for leg, _ in strangers:
        legs.remove(leg)
    return strangers


def no_common_heads(pool: LocalPool | None, leg: TxLeg) -> str | None:
    """Why a receiver's pool holds none of our pool's heads; None when it holds some, or
    when that cannot be told yet (our pool is unknown until the engine sends; a pool that
    cannot be mapped at all is the plan's to report)."""
    if pool is None:
        return None
    dst_layout = leg.conn.layouts.get(leg.request.pool_id)
    dst = dst_tp(leg)
    if not isinstance(dst_layout, KvLayout) or dst is None:
        return None
    if _shares_heads_or_unmappable(pool.layout, pool.tp, dst_layout, dst):
        return None
    return (
        f"pool {leg.request.pool_id!r} of {leg.conn.peer.name} holds "
        f"{describe(dst_layout, dst)} and this context daemon holds "
        f"{describe(pool.layout, pool.tp)}: no KV head in common, so it has nothing to write there"
    )


@by_identity
def _shares_heads_or_unmappable(
    src: KvLayout, src_tp: TpRank, dst: KvLayout, dst_tp: TpRank
) -> bool:
    """Whether the pools share a head, or cannot be mapped at all (the plan's to report).
    Asked for every request and the same few pool pairs: layouts and ranks are frozen
    (hashable), so it is worked out once per pair."""
    if mapping_problems(src, src_tp, dst, dst_tp):
        return True
    return common_heads(src, src_tp, dst, dst_tp) is not None


def expected_legs(pool: LocalPool | None, legs: list[TxLeg]) -> int:
    """How many receivers the request has: the generation ranks holding any of our heads
    (1 unless the generation instance has more ranks than ours). Until our pool and the
    first receiver's pool are known (or when they cannot be mapped, which the plan
    reports), 1."""
    if pool is None or not legs:
        return 1
    leg = legs[0]
    info = leg.conn.pools.get(leg.request.pool_id)
    if info is None or info.tp_size == pool.tp.size:
        return 1  # equal sizes: rank i holds the heads of rank i (the common case)
    dst_layout = leg.conn.layouts.get(leg.request.pool_id)
    dst = dst_tp(leg)
    if not isinstance(dst_layout, KvLayout) or dst is None:
        return 1
    return _ranks_holding_ours(pool.layout, pool.tp, dst_layout, dst)


@by_identity
def _ranks_holding_ours(src: KvLayout, src_tp: TpRank, dst: KvLayout, dst_tp: TpRank) -> int:
    """expected_legs for one pair of pools: asked several times a request (the mapping
    check compares every geometry field), always for the same few pairs."""
    if mapping_problems(src, src_tp, dst, dst_tp):
        return 1
    ours = head_range(src, src_tp)
    return max(1, len(overlapping_ranks(ours, dst.num_kv_heads, dst_tp.size)))


def coverage_problem(pool: LocalPool, legs: list[TxLeg]) -> str | None:
    """Why the receivers of a head-split do not cover our heads exactly once."""
    expected = expected_legs(pool, legs)
    ranks = [dst_tp(leg) for leg in legs]
    if len(legs) != expected or len({tp.rank for tp in ranks if tp}) != len(ranks):
        return (
            f"our pool holds {describe(pool.layout, pool.tp)}: {expected} generation "
            f"rank(s) must request it once each, got requests from "
            + ", ".join(
                f"{leg.conn.peer.name} ({tp or 'unknown rank'})"
                for leg, tp in zip(legs, ranks, strict=True)
            )
        )
    return None


def split_problem(pool: LocalPool, legs: list[TxLeg], dst: TpRank, pipelined: bool) -> str | None:
    """Why our pool cannot write into a receiver pool of rank `dst` as one of `legs`: these
    settings cannot move head slices, or the legs do not cover our heads exactly once."""
    problem = tp_support_problem("context", pool.tp, dst, pipelined)
    # `is` first: ranks come from tp_rank's cache, and a dataclass's != is a Python call.
    if problem is None and (len(legs) > 1 or (dst is not pool.tp and dst != pool.tp)):
        problem = coverage_problem(pool, legs)
    return problem


def whole_blocks(pool: LocalPool | None, leg: TxLeg) -> bool:
    """The receiver holds exactly our heads: whole blocks move (the bounce buffer may)."""
    dst_layout = leg.conn.layouts.get(leg.request.pool_id)
    dst = dst_tp(leg)
    return (
        pool is not None
        and isinstance(dst_layout, KvLayout)
        and dst is not None
        and same_heads(pool.layout, pool.tp, dst_layout, dst)
    )


# --------------------------------------------------- generation side: head-merge


def peer_tp(conn: PeerConnection) -> tuple[TpRank, KvLayout] | str | None:
    """A context daemon's rank and pool layout (one engine rank per daemon, so its pools
    agree); None while it has no usable pool; a string when its pools disagree. A pool
    with a bad layout is left out here: only requests into it fail, in the sender's plan."""
    found: tuple[TpRank, KvLayout] | None = None
    for info in conn.pools.values():
        layout = conn.layouts.get(info.pool_id)
        try:
            tp = tp_rank(info.tp_rank, info.tp_size)
        except LayoutError:
            continue
        if not isinstance(layout, KvLayout):
            continue
        if found is not None and found[0] != tp:
            return f"context daemon {conn.peer.name} has pools of two ranks ({found[0]}, {tp})"
        found = (tp, layout)
    return found


def rx_leg_heads(pool: LocalPool, leg: RxLeg) -> tuple[int, int] | None:
    """The heads of our pool a receive's leg moves (None: whole blocks). A context daemon
    that announced no pool yet is taken to hold our heads (a receive without tensor
    parallelism); LayoutError when it holds none of them."""
    assert leg.conn is not None
    peer = leg.source if leg.source is not None else peer_tp(leg.conn)
    if peer is None:
        return None
    if isinstance(peer, str):
        raise LayoutError(peer)
    tp, layout = peer
    return leg_heads(pool.layout, pool.tp, layout, tp)


def whole_blocks_from(pool: LocalPool, conn: PeerConnection) -> bool:
    """The peer holds exactly our heads (or says nothing yet: the legacy case)."""
    peer = peer_tp(conn)
    if peer is None:
        return True
    if isinstance(peer, str):
        return False
    tp, layout = peer
    return same_heads(layout, tp, pool.layout, pool.tp)


def source_problem(pool: LocalPool, legs: list[RxLeg], final: bool, pipelined: bool) -> str | None:
    """Why the context daemons of a receive do not hold our heads exactly once.

    Checked before asking (when their pools are known by then) and again when every leg
    has delivered (final: their pools must be known, since each wrote from one). A single
    context daemon whose pools are still unknown keeps the behaviour of a receive without
    tensor parallelism.
    """
    ours, our_tp = pool.layout, pool.tp
    ranks: list[tuple[RxLeg, TpRank, KvLayout]] = []
    for leg in legs:
        assert leg.conn is not None
        peer = leg.source if leg.source is not None else peer_tp(leg.conn)
        if isinstance(peer, str):
            return peer
        if peer is None:
            if final and len(legs) > 1:
                return (
                    f"context daemon {leg.conn.peer.name} has announced no pool: "
                    "cannot tell which KV heads it wrote"
                )
            return None
        ranks.append((leg, *peer))
    if len(ranks) == 1 and ranks[0][1] == our_tp and ranks[0][2].num_kv_heads == ours.num_kv_heads:
        return None  # the plain case: the same heads on both sides
    sizes = {tp.size for _, tp, _ in ranks}
    if len(sizes) > 1:
        return (
            "the context daemons of this receive declare different tensor-parallel sizes: "
            + ", ".join(f"{_name(leg)} ({tp})" for leg, tp, _ in ranks)
        )
    src_tp, src_layout = ranks[0][1], ranks[0][2]
    problem = tp_support_problem("generation", our_tp, src_tp, pipelined)
    if problem is not None:
        return problem
    if total_heads(src_layout, src_tp) != total_heads(ours, our_tp):
        return (
            f"our pool holds {describe(ours, our_tp)}, but context daemon "
            f"{ranks[0][0].conn.peer.name if ranks[0][0].conn else ''} holds "
            f"{describe(src_layout, src_tp)}: the instances hold different heads in all"
        )
    needed = overlapping_ranks(head_range(ours, our_tp), src_layout.num_kv_heads, src_tp.size)
    got = sorted(tp.rank for _, tp, _ in ranks)
    if got != needed:
        named = ", ".join(f"{_name(leg)} (rank {tp.rank})" for leg, tp, _ in ranks)
        return (
            f"our pool holds {describe(ours, our_tp)}: it needs the context ranks "
            f"{', '.join(map(str, needed))} of {src_tp.size} once each, and the receive "
            f"names {named}"
        )
    return None


def _name(leg: RxLeg) -> str:
    return leg.conn.peer.name if leg.conn else leg.peer_address
