"""Turning a request's block lists into the descriptor pairs of one WRITE.

The general case is kvxferd.memory.layout.pair_segments (vectorised numpy).
For the common case of block-major pools on both sides a plain loop over the
blocks is several times cheaper for the short block lists of small requests,
where numpy's fixed per-call cost dominates.

Pools of different tensor-parallel ranks (head-split, head-merge) move only the
heads both hold, one descriptor per token run (kvxferd.memory.heads); pools that
hold the same heads keep the whole-piece paths above.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvxferd.memory.by_identity import by_identity
from kvxferd.memory.heads import TpRank, pair_head_segments, same_heads
from kvxferd.memory.layout import BLOCK_MAJOR, KvLayout, LayoutError, pair_segments

Segments = npt.NDArray[np.int64]

# Below this many blocks the Python loop beats numpy's per-call overhead.
_LOOP_MAX_BLOCKS = 512
_RANK_0_OF_1 = TpRank()


@by_identity
def _pair_kind(
    src: KvLayout, src_tp: TpRank, dst: KvLayout, dst_tp: TpRank
) -> tuple[bool, tuple[str, ...]]:
    """(both pools hold the same heads, the geometry differences): asked for every write
    and the same few pool pairs; layouts and ranks are frozen, so worked out once each."""
    return same_heads(src, src_tp, dst, dst_tp), tuple(src.same_geometry(dst))


def validate_block_ids(layout: KvLayout, blocks: list[int]) -> None:
    """Range and uniqueness of block ids already decoded as ints (msgspec checked the type)."""
    n = layout.num_blocks
    for i, b in enumerate(blocks):
        if not 0 <= b < n:
            raise LayoutError(
                f"block id {b} at position {i} is out of range: the pool has {n} blocks "
                f"(valid ids 0..{n - 1})"
            )
    if len(set(blocks)) != len(blocks):
        seen: dict[int, int] = {}
        for i, b in enumerate(blocks):
            if b in seen:
                raise LayoutError(f"block id {b} at position {i} repeats the one at {seen[b]}")
            seen[b] = i


def plan_write(
    src: KvLayout,
    src_base: int,
    src_blocks: list[int],
    dst: KvLayout,
    dst_base: int,
    dst_blocks: list[int],
    src_tp: TpRank | None = None,
    dst_tp: TpRank | None = None,
) -> tuple[Segments, Segments]:
    """Absolute (address, length) pairs: local source, remote destination.

    `src_tp`/`dst_tp`: the pools' tensor-parallel ranks (None: rank 0 of 1). Pools that hold
    different heads get head-sliced segments; the others whole pieces or blocks.
    """
    if len(src_blocks) != len(dst_blocks):
        raise LayoutError(
            f"context sends {len(src_blocks)} blocks, generation expects {len(dst_blocks)}"
        )
    src_tp = src_tp or _RANK_0_OF_1
    dst_tp = dst_tp or _RANK_0_OF_1
    heads_same, diffs = _pair_kind(src, src_tp, dst, dst_tp)
    if not heads_same:
        local, remote = pair_head_segments(src, src_tp, src_blocks, dst, dst_tp, dst_blocks)
        return _absolute(local, src_base), _absolute(remote, dst_base)
    if diffs:
        raise LayoutError("KV geometry differs: " + "; ".join(diffs))
    if (
        src.major == BLOCK_MAJOR
        and dst.major == BLOCK_MAJOR
        and 0 < len(src_blocks) <= _LOOP_MAX_BLOCKS
    ):
        return _block_major_runs(src, src_base, src_blocks, dst_base, dst_blocks)
    local, remote = pair_segments(src, src_blocks, dst, dst_blocks)
    return _absolute(local, src_base), _absolute(remote, dst_base)


def _absolute(segments: Segments, base: int) -> Segments:
    out: Segments = segments.copy()
    out[:, 0] += base
    return out


def _block_major_runs(
    layout: KvLayout, src_base: int, src_blocks: list[int], dst_base: int, dst_blocks: list[int]
) -> tuple[Segments, Segments]:
    size = layout.block_bytes
    runs: list[tuple[int, int, int]] = []
    first_s = prev_s = src_blocks[0]
    first_d = prev_d = dst_blocks[0]
    count = 1
    for s, d in zip(src_blocks[1:], dst_blocks[1:], strict=True):
        if s == prev_s + 1 and d == prev_d + 1:
            count += 1
        else:
            runs.append((first_s, first_d, count))
            first_s, first_d, count = s, d, 1
        prev_s, prev_d = s, d
    runs.append((first_s, first_d, count))
    local = np.array([(src_base + s * size, n * size) for s, _, n in runs], dtype=np.int64)
    remote = np.array([(dst_base + d * size, n * size) for _, d, n in runs], dtype=np.int64)
    return local, remote
