"""kvxferd.memory.heads edge cases, each function against a reference written here.

Empty head ranges, the upper bound of overlapping ranks, non-integer tensor-parallel sizes,
pools of different num_kv_heads, and head-sliced pairings applied to bytes: the shared heads
of every requested block arrive, nothing else of the destination changes.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layout_harness import tiny_layout, tp_transfers

from kvxferd.memory.heads import (
    TpRank,
    common_heads,
    describe,
    head_range,
    head_slice_offsets,
    local_heads,
    mapping_problems,
    overlapping_ranks,
    pair_head_segments,
    same_heads,
    slice_block_bytes,
    total_heads,
)
from kvxferd.memory.layout import BLOCK_MAJOR, LAYER_MAJOR, KvLayout, LayoutError


def layout(heads: int = 2, major: str = BLOCK_MAJOR, **kw: Any) -> KvLayout:
    """tiny_layout with `heads` heads, 3 tokens per block and 5 blocks."""
    fields = {"num_kv_heads": heads, "major": major, "tokens_per_block": 3, "num_blocks": 5}
    return tiny_layout(**{**fields, **kw})


# -- TpRank ----------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [2.0, "2", None, True, 0, -1, 1.5])
def test_tp_size_must_be_an_integer_of_at_least_one(size: Any) -> None:
    with pytest.raises(
        LayoutError,
        match=rf"^tp_size must be an integer of at least 1, got {re.escape(repr(size))}$",
    ):
        TpRank(0, size)


@pytest.mark.parametrize("rank", [1.0, "0", None, False, -1, 3, 4])
def test_tp_rank_must_be_an_integer_below_the_size(rank: Any) -> None:
    with pytest.raises(
        LayoutError,
        match=r"^tp_rank must be an integer in \[0, tp_size - 1\] = \[0, 2\], "
        + rf"got {re.escape(repr(rank))}$",
    ):
        TpRank(rank, 3)


def test_tp_rank_bounds_and_normalisation() -> None:
    assert TpRank() == TpRank(0, 1)
    assert TpRank(0, 1).size == 1
    last = TpRank(np.int64(3), np.int32(4))
    assert (last.rank, last.size) == (3, 4)
    assert type(last.rank) is int and type(last.size) is int
    assert str(last) == "tensor-parallel rank 3 of 4"
    with pytest.raises(AttributeError):
        last.rank = 0  # type: ignore[misc]


# -- ranges ----------------------------------------------------------------------------------


def test_ranges_totals_and_descriptions() -> None:
    lay = layout(heads=3)
    assert total_heads(lay, TpRank(1, 4)) == 12
    assert head_range(lay, TpRank(0, 4)) == (0, 3)
    assert head_range(lay, TpRank(3, 4)) == (9, 12)
    assert describe(lay, TpRank(2, 4)) == "heads [6, 9) of 12 (tensor-parallel rank 2 of 4)"


def test_touching_ranges_share_no_head() -> None:
    assert common_heads(layout(2), TpRank(0, 2), layout(2), TpRank(1, 2)) is None
    assert local_heads(layout(2), TpRank(1, 2), layout(2), TpRank(0, 2)) is None
    assert common_heads(layout(1), TpRank(1, 4), layout(2), TpRank(0, 2)) == (1, 2)
    assert common_heads(layout(1), TpRank(2, 4), layout(2), TpRank(0, 2)) is None


def test_local_heads_are_relative_to_the_pool() -> None:
    # A pool of heads [4, 8) next to one of [6, 7): shares 6, local index 2.
    assert local_heads(layout(4), TpRank(1, 2), layout(1), TpRank(6, 8)) == (2, 3)
    assert local_heads(layout(1), TpRank(6, 8), layout(4), TpRank(1, 2)) == (0, 1)
    assert local_heads(layout(4), TpRank(0, 1), layout(4), TpRank(0, 1)) == (0, 4)


def test_same_heads_compares_the_ranges_only() -> None:
    assert same_heads(layout(2), TpRank(1, 2), layout(2), TpRank(1, 2))
    assert not same_heads(layout(2), TpRank(0, 2), layout(2), TpRank(1, 2))
    assert not same_heads(layout(4), TpRank(0, 1), layout(2), TpRank(0, 2))
    assert same_heads(layout(2), TpRank(0, 1), layout(2, major=LAYER_MAJOR), TpRank(0, 3))


@st.composite
def rank_pair(draw: st.DrawFn) -> tuple[KvLayout, TpRank, KvLayout, TpRank]:
    h1, h2 = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    n1, n2 = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return (
        layout(h1),
        TpRank(draw(st.integers(0, n1 - 1)), n1),
        layout(h2),
        TpRank(draw(st.integers(0, n2 - 1)), n2),
    )


@settings(max_examples=200, deadline=None)
@given(rank_pair())
def test_common_and_local_heads_match_a_head_by_head_reference(
    case: tuple[KvLayout, TpRank, KvLayout, TpRank],
) -> None:
    a, a_tp, b, b_tp = case
    mine = set(range(a_tp.rank * a.num_kv_heads, (a_tp.rank + 1) * a.num_kv_heads))
    theirs = set(range(b_tp.rank * b.num_kv_heads, (b_tp.rank + 1) * b.num_kv_heads))
    shared = sorted(mine & theirs)
    want = (shared[0], shared[-1] + 1) if shared else None
    assert common_heads(a, a_tp, b, b_tp) == want
    first = a_tp.rank * a.num_kv_heads
    assert local_heads(a, a_tp, b, b_tp) == (
        None if want is None else (want[0] - first, want[1] - first)
    )
    assert same_heads(a, a_tp, b, b_tp) == (mine == theirs)


# -- overlapping ranks -----------------------------------------------------------------------


def reference_ranks(start: int, end: int, per_rank: int, size: int) -> list[int]:
    return [r for r in range(size) if max(start, r * per_rank) < min(end, (r + 1) * per_rank)]


def test_overlapping_ranks_edges() -> None:
    assert overlapping_ranks((0, 4), 2, 2) == [0, 1]
    assert overlapping_ranks((1, 3), 2, 2) == [0, 1]
    assert overlapping_ranks((2, 4), 2, 2) == [1]
    assert overlapping_ranks((0, 2), 2, 2) == [0]
    assert overlapping_ranks((3, 4), 2, 3) == [1]
    assert overlapping_ranks((4, 4), 2, 3) == []  # empty range
    assert overlapping_ranks((5, 4), 2, 3) == []  # reversed range
    assert overlapping_ranks((0, 1), 0, 3) == []  # no heads per rank
    assert overlapping_ranks((0, 100), 2, 3) == [0, 1, 2]  # clipped to the last rank
    assert overlapping_ranks((5, 6), 2, 3) == [2]  # the last head of the last rank
    assert overlapping_ranks((6, 8), 2, 3) == []  # beyond the group
    assert overlapping_ranks((-4, 1), 2, 3) == [0]
    assert overlapping_ranks((0, 1), 1, 1) == [0]


@settings(max_examples=300, deadline=None)
@given(st.integers(-5, 30), st.integers(-5, 30), st.integers(-1, 5), st.integers(1, 6))
def test_overlapping_ranks_match_the_reference(
    start: int, end: int, per_rank: int, size: int
) -> None:
    want = reference_ranks(start, end, per_rank, size) if per_rank >= 1 else []
    assert overlapping_ranks((start, end), per_rank, size) == want


# -- mapping problems ------------------------------------------------------------------------


def test_pools_that_hold_the_same_heads_in_all_map() -> None:
    assert mapping_problems(layout(4), TpRank(0, 1), layout(2), TpRank(1, 2)) == []
    assert mapping_problems(layout(2), TpRank(0, 3), layout(3), TpRank(0, 2)) == []


def test_different_totals_of_heads_do_not_map() -> None:
    problems = mapping_problems(layout(4), TpRank(0, 1), layout(4), TpRank(0, 2))
    assert problems == [
        "num_kv_heads: 4 per rank x tensor-parallel size 1 = 4 heads here, 4 x 2 = 8 there "
        "(both instances must hold the same heads in all)"
    ]
    # Different num_kv_heads with the same tensor-parallel size: different models.
    assert len(mapping_problems(layout(2), TpRank(0, 2), layout(3), TpRank(0, 2))) == 1


def test_geometry_other_than_heads_must_match() -> None:
    problems = mapping_problems(layout(2), TpRank(), layout(2, head_dim=4, dtype="int8"), TpRank())
    assert problems == ["head_dim: 2 here, 4 there", "dtype: float16 here, int8 there"]
    assert (
        mapping_problems(layout(2), TpRank(), layout(2, num_blocks=9, major=LAYER_MAJOR), TpRank())
        == []
    )


# -- slices ----------------------------------------------------------------------------------


def test_slice_block_bytes() -> None:
    lay = layout(
        heads=4, head_dim=3, tokens_per_block=5, dtype="float32", num_layers=2, kv_factor=1
    )
    assert slice_block_bytes(lay, 1) == 2 * 5 * 3 * 4
    assert slice_block_bytes(lay, 4) == lay.block_bytes
    assert slice_block_bytes(lay, 0) == 0


@pytest.mark.parametrize(
    "heads", [(1, 1), (2, 1), (-1, 1), (0, 3), (3, 3), (1.0, 2), (0, True), (True, 2)]
)
def test_head_slices_outside_the_pool_or_empty_are_refused(heads: Any) -> None:
    with pytest.raises(LayoutError, match=r"is not within the pool's 2 heads"):
        head_slice_offsets(layout(2), [0], heads)


def test_head_slice_bad_block_ids_are_refused() -> None:
    with pytest.raises(LayoutError, match="out of range"):
        head_slice_offsets(layout(2), [5], (0, 1))


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 4),
    st.sampled_from([BLOCK_MAJOR, LAYER_MAJOR]),
    st.data(),
)
def test_head_slice_offsets_match_the_logical_view(
    heads: int, major: str, data: st.DataObject
) -> None:
    lay = layout(
        heads,
        major,
        head_dim=data.draw(st.integers(1, 3)),
        kv_factor=data.draw(st.sampled_from([1, 2])),
    )
    start = data.draw(st.integers(0, heads - 1))
    end = data.draw(st.integers(start + 1, heads))
    blocks = data.draw(st.permutations(range(lay.num_blocks)))[
        : data.draw(st.integers(0, lay.num_blocks))
    ]
    offsets = head_slice_offsets(lay, blocks, (start, end))
    # Reference: tag every byte with its own offset, read the slice through the logical view.
    pool_offsets = np.arange(lay.pool_bytes, dtype=np.int64)
    view = np.lib.stride_tricks.as_strided(
        pool_offsets,
        shape=lay.logical_view(np.zeros(lay.pool_bytes, np.uint8)).shape,
        strides=tuple(s * 8 for s in lay.logical_view(np.zeros(lay.pool_bytes, np.uint8)).strides),
    )
    want = [
        int(view[b, layer, k, t, start, 0])
        for b in blocks
        for layer in range(lay.num_layers)
        for k in range(lay.kv_factor)
        for t in range(lay.tokens_per_block)
    ]
    assert offsets.dtype == np.int64
    assert offsets.tolist() == want


# -- head-sliced pairing ---------------------------------------------------------------------


def test_pairing_refuses_unmappable_pools_then_disjoint_ones() -> None:
    with pytest.raises(
        LayoutError,
        match=r"^source and destination pools have incompatible KV geometry: num_kv_heads",
    ):
        pair_head_segments(layout(2), TpRank(0, 1), [0], layout(2), TpRank(1, 2), [0])
    with pytest.raises(
        LayoutError,
        match=r"^the source pool \(heads \[0, 2\) of 4 \(tensor-parallel rank 0 of 2\)\) and the "
        r"destination pool \(heads \[2, 4\) of 4 \(tensor-parallel rank 1 of 2\)\) hold no KV head",
    ):
        pair_head_segments(layout(2), TpRank(0, 2), [0], layout(2), TpRank(1, 2), [0])
    with pytest.raises(LayoutError, match="cannot be paired"):
        pair_head_segments(layout(4), TpRank(0, 1), [0, 1], layout(2), TpRank(0, 2), [0])
    with pytest.raises(LayoutError, match="out of range"):
        pair_head_segments(layout(4), TpRank(0, 1), [0], layout(2), TpRank(0, 2), [5])


def test_head_merge_by_hand() -> None:
    """TP 2 -> TP 1, one layer, K only, int8, head_dim 1, 2 tokens: rank 1 fills byte 1 of
    every destination token."""
    kw = dict(num_layers=1, kv_factor=1, head_dim=1, dtype="int8", tokens_per_block=2)
    src, dst = layout(1, **kw), layout(2, **kw)
    local, remote = pair_head_segments(src, TpRank(1, 2), [3], dst, TpRank(0, 1), [1])
    assert local.tolist() == [[6, 1], [7, 1]]
    assert remote.tolist() == [[5, 1], [7, 1]]


def test_same_heads_merge_into_whole_blocks() -> None:
    lay = layout(2)
    local, remote = pair_head_segments(lay, TpRank(1, 2), [1, 2], lay, TpRank(1, 2), [3, 4])
    assert local.tolist() == [[lay.block_bytes, 2 * lay.block_bytes]]
    assert remote.tolist() == [[3 * lay.block_bytes, 2 * lay.block_bytes]]


def copy_rows(
    local: npt.NDArray[np.int64],
    remote: npt.NDArray[np.int64],
    src: npt.NDArray[np.uint8],
    dst: npt.NDArray[np.uint8],
) -> None:
    assert local.shape == remote.shape and local.dtype == np.int64
    for (s, n), (d, m) in zip(local.tolist(), remote.tolist(), strict=True):
        assert n == m > 0
        assert s >= 0 and s + n <= src.size and d >= 0 and d + m <= dst.size
        dst[d : d + m] = src[s : s + n]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp_transfers(layers=2, dtypes=("int8", "float16"), max_blocks=5), st.integers(0, 2**32 - 1))
def test_pairing_moves_the_shared_heads_and_nothing_else(case: dict[str, Any], seed: int) -> None:
    src, dst, src_tp, dst_tp = case["src"], case["dst"], case["src_tp"], case["dst_tp"]
    s0, d0 = src_tp.rank * src.num_kv_heads, dst_tp.rank * dst.num_kv_heads
    lo, hi = max(s0, d0), min(s0 + src.num_kv_heads, d0 + dst.num_kv_heads)
    if lo >= hi:
        with pytest.raises(LayoutError, match="no KV head in common"):
            pair_head_segments(src, src_tp, case["src_blocks"], dst, dst_tp, case["dst_blocks"])
        return
    rng = np.random.default_rng(seed)
    src_pool = rng.integers(0, 256, src.pool_bytes, dtype=np.uint8)
    dst_pool = np.full(dst.pool_bytes, 0x5A, dtype=np.uint8)
    want = dst_pool.copy()
    sv, wv = src.logical_view(src_pool), dst.logical_view(want)
    for s, d in zip(case["src_blocks"], case["dst_blocks"], strict=True):
        wv[d, :, :, :, lo - d0 : hi - d0] = sv[s, :, :, :, lo - s0 : hi - s0]
    local, remote = pair_head_segments(
        src, src_tp, case["src_blocks"], dst, dst_tp, case["dst_blocks"]
    )
    copy_rows(local, remote, src_pool, dst_pool)
    assert np.array_equal(dst_pool, want)
    unit = (hi - lo) * src.head_dim * src.itemsize
    assert (
        int(local[:, 1].sum())
        == len(case["src_blocks"]) * src.pieces_per_block * src.tokens_per_block * unit
    )
    # Rows are runs of whole token slices, and adjacent rows never continue each other on
    # both sides (they would have been merged).
    assert all(n % unit == 0 for n in local[:, 1].tolist())
    for j in range(1, local.shape[0]):
        assert not (
            local[j, 0] == local[j - 1, 0] + local[j - 1, 1]
            and remote[j, 0] == remote[j - 1, 0] + remote[j - 1, 1]
        )
