"""Tensor parallelism: which KV heads a pool holds, and the segments that move shared heads.

With tensor parallelism every rank of an engine holds a contiguous slice of the model's KV
heads: rank r of n holds the *global* heads [r * h, (r + 1) * h), h being its pool layout's
num_kv_heads. A context instance and a generation instance may use different tensor-parallel
sizes; KV then moves between every (context rank, generation rank) pair whose head slices
overlap, each pair moving only the heads both hold:

* head-split (context TP 1 -> generation TP 2): the one context rank writes heads [0, h/2)
  into generation rank 0 and [h/2, h) into rank 1;
* head-merge (context TP 2 -> generation TP 1): both context ranks write their half of each
  token into the one generation rank.

Two pools can be mapped when everything but num_kv_heads matches (layers, K/V, head_dim,
tokens per block, dtype) and both instances hold the same number of heads in all
(h_src * tp_src == h_dst * tp_dst). Inside a piece tokens are contiguous and each token holds
its heads in order, so a head slice is one run of bytes per token: the segments here are one
(source, destination) pair per (block, layer, K/V, token), merged where they continue each other
on both sides (when both pools hold the same heads this gives the usual whole pieces and blocks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvxferd.memory.layout import (
    BLOCK_MAJOR,
    BlockIds,
    KvLayout,
    LayoutError,
    Segments,
    _coalesce,
    _is_int,
    paired_blocks,
)

__all__ = [
    "TpRank",
    "common_heads",
    "describe",
    "head_range",
    "head_slice_offsets",
    "local_heads",
    "mapping_problems",
    "overlapping_ranks",
    "pair_head_segments",
    "same_heads",
    "slice_block_bytes",
    "total_heads",
]


@dataclass(frozen=True)
class TpRank:
    """A pool's place in its instance's tensor-parallel group: rank `rank` of `size`."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.size) or self.size < 1:
            raise LayoutError(f"tp_size must be an integer of at least 1, got {self.size!r}")
        if not _is_int(self.rank) or not 0 <= self.rank < self.size:
            raise LayoutError(
                f"tp_rank must be an integer in [0, tp_size - 1] = [0, {self.size - 1}], "
                f"got {self.rank!r}"
            )
        object.__setattr__(self, "rank", int(self.rank))
        object.__setattr__(self, "size", int(self.size))

    def __str__(self) -> str:
        return f"tensor-parallel rank {self.rank} of {self.size}"


@functools.lru_cache(maxsize=256, typed=True)
def tp_rank(rank: int, size: int) -> TpRank:
    """TpRank(rank, size), built once per pair: a peer's pool ranks are checked several times
    per request (typed: True is never taken for 1, and is refused as TpRank refuses it)."""
    return TpRank(rank, size)


def total_heads(layout: KvLayout, tp: TpRank) -> int:
    """KV heads of the whole instance (every rank holds the same number)."""
    return layout.num_kv_heads * tp.size


def head_range(layout: KvLayout, tp: TpRank) -> tuple[int, int]:
    """The global heads [start, end) a pool holds."""
    h = layout.num_kv_heads
    return tp.rank * h, (tp.rank + 1) * h


def describe(layout: KvLayout, tp: TpRank) -> str:
    start, end = head_range(layout, tp)
    return f"heads [{start}, {end}) of {total_heads(layout, tp)} ({tp})"


def mapping_problems(src: KvLayout, src_tp: TpRank, dst: KvLayout, dst_tp: TpRank) -> list[str]:
    """Why KV of the source pool cannot be written into the destination pool, one line each
    ("here" is the source); empty when their ranks can exchange the heads they share."""
    problems = src.same_geometry(dst, heads=False)
    ours, theirs = total_heads(src, src_tp), total_heads(dst, dst_tp)
    if ours != theirs:
        problems.append(
            f"num_kv_heads: {src.num_kv_heads} per rank x tensor-parallel size {src_tp.size} = "
            f"{ours} heads here, {dst.num_kv_heads} x {dst_tp.size} = {theirs} there "
            "(both instances must hold the same heads in all)"
        )
    return problems


def common_heads(
    src: KvLayout, src_tp: TpRank, dst: KvLayout, dst_tp: TpRank
) -> tuple[int, int] | None:
    """The global heads [start, end) both pools hold; None when they share none."""
    s0, s1 = head_range(src, src_tp)
    d0, d1 = head_range(dst, dst_tp)
    lo, hi = max(s0, d0), min(s1, d1)
    return (lo, hi) if lo < hi else None


def same_heads(src: KvLayout, src_tp: TpRank, dst: KvLayout, dst_tp: TpRank) -> bool:
    """Both pools hold exactly the same heads: whole pieces move, as without TP."""
    return head_range(src, src_tp) == head_range(dst, dst_tp)


def local_heads(
    layout: KvLayout, tp: TpRank, other: KvLayout, other_tp: TpRank
) -> tuple[int, int] | None:
    """The heads this pool shares with the other one, as [start, end) among its own
    num_kv_heads (not global); None when they share none."""
    common = common_heads(layout, tp, other, other_tp)
    if common is None:
        return None
    first = head_range(layout, tp)[0]
    return common[0] - first, common[1] - first


def slice_block_bytes(layout: KvLayout, heads: int) -> int:
    """Bytes of `heads` heads of every token of every (layer, K/V) piece of one block: what a
    block contributes to a leg that moves that many heads."""
    return (
        layout.pieces_per_block
        * layout.tokens_per_block
        * heads
        * layout.head_dim
        * (layout.itemsize)
    )


def check_head_slice(layout: KvLayout, heads: tuple[int, int]) -> tuple[int, int]:
    """`heads` as ints when it is a slice [start, end) of the pool's heads; else LayoutError."""
    start, end = heads
    if not (_is_int(start) and _is_int(end) and 0 <= start < end <= layout.num_kv_heads):
        raise LayoutError(
            f"head slice [{start}, {end}) is not within the pool's {layout.num_kv_heads} heads"
        )
    return int(start), int(end)


def head_slice_offsets(
    layout: KvLayout, blocks: BlockIds, heads: tuple[int, int], unit: int = 1
) -> npt.NDArray[np.int64]:
    """Pool offset of each (block, layer, K/V, token) run of the pool's heads [start, end)
    (local indices), in the canonical packed order: logical block, then layer and K/V, then
    token. Each run is (end - start) * head_dim * itemsize bytes long.

    In units of `unit` bytes when given, which must divide the token size, the pieces'
    offsets and the skipped heads' bytes (copyplan's unit does): the small per-piece and
    per-token terms are divided before they are broadcast, not the (much longer) result."""
    start, _ = check_head_slice(layout, heads)
    ids = layout.check_blocks(blocks)
    tokens = np.arange(layout.tokens_per_block, dtype=np.int64) * layout.token_bytes
    tokens += start * layout.head_dim * layout.itemsize  # the heads skipped
    pieces = layout.piece_offsets(ids, block_first=True)
    if unit != 1:
        pieces //= unit
        tokens //= unit
    offsets: npt.NDArray[np.int64] = (pieces[..., None] + tokens).ravel()
    return offsets


def overlapping_ranks(heads: tuple[int, int], heads_per_rank: int, size: int) -> list[int]:
    """The ranks of a group of `size` ranks of `heads_per_rank` heads each that hold at least
    one of the global heads [start, end)."""
    start, end = heads
    if start >= end or heads_per_rank < 1:
        return []
    first = start // heads_per_rank
    last = (end - 1) // heads_per_rank
    return list(range(max(0, first), min(size - 1, last) + 1))


def pair_head_segments(
    src: KvLayout,
    src_tp: TpRank,
    src_blocks: BlockIds,
    dst: KvLayout,
    dst_tp: TpRank,
    dst_blocks: BlockIds,
) -> tuple[Segments, Segments]:
    """Segments that copy the heads both pools hold of `src_blocks[i]` into `dst_blocks[i]`.

    Like layout.pair_segments (rows pair up, offsets relative to each pool's base, the source
    major's order), but per (block, layer, K/V, token): each row moves the shared heads of one
    token, or a longer run where consecutive units continue each other on both sides.

    Raises LayoutError when the pools cannot be mapped, share no head, the counts differ, or
    an id is bad.
    """
    problems = mapping_problems(src, src_tp, dst, dst_tp)
    if problems:
        raise LayoutError(
            "source and destination pools have incompatible KV geometry: " + "; ".join(problems)
        )
    s, d = paired_blocks(src, src_blocks, dst, dst_blocks)
    common = common_heads(src, src_tp, dst, dst_tp)
    if common is None:
        raise LayoutError(
            f"the source pool ({describe(src, src_tp)}) and the destination pool "
            f"({describe(dst, dst_tp)}) hold no KV head in common"
        )
    lo, hi = common
    head_bytes = src.head_dim * src.itemsize
    src_skip = (lo - head_range(src, src_tp)[0]) * head_bytes
    dst_skip = (lo - head_range(dst, dst_tp)[0]) * head_bytes
    block_first = src.major == BLOCK_MAJOR
    tokens = np.arange(src.tokens_per_block, dtype=np.int64)
    # (pieces in the source's order, tokens): the token runs innermost, so runs that are
    # contiguous on both sides (whole pieces, whole blocks) still merge.
    src_units = src.piece_offsets(s, block_first=block_first)[..., None] + (
        tokens * src.token_bytes + src_skip
    )
    dst_units = dst.piece_offsets(d, block_first=block_first)[..., None] + (
        tokens * dst.token_bytes + dst_skip
    )
    return _coalesce(src_units.ravel(), dst_units.ravel(), (hi - lo) * head_bytes)
