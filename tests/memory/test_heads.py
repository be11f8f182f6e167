"""Tensor-parallel head math: ranges, mappability, and head-sliced segment pairing."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_harness import tiny_layout

from kvxferd.memory import BLOCK_MAJOR, LAYER_MAJOR, KvLayout, LayoutError, pair_segments
from kvxferd.memory.heads import (
    TpRank,
    common_heads,
    head_range,
    mapping_problems,
    overlapping_ranks,
    pair_head_segments,
    same_heads,
)

MAJORS = [BLOCK_MAJOR, LAYER_MAJOR]


def layout(heads: int, major: str = BLOCK_MAJOR, **kw: Any) -> KvLayout:
    """tiny_layout with `heads` heads, 3 tokens per block and 6 blocks."""
    fields = {"num_kv_heads": heads, "major": major, "tokens_per_block": 3, "num_blocks": 6}
    return tiny_layout(**{**fields, **kw})


# -- ranks and ranges ------------------------------------------------------------------------


def test_tp_rank_validation_names_the_field() -> None:
    assert TpRank() == TpRank(0, 1)
    with pytest.raises(LayoutError, match="tp_size"):
        TpRank(0, 0)
    with pytest.raises(LayoutError, match=r"tp_rank .*\[0, 1\].* got 2"):
        TpRank(2, 2)
    with pytest.raises(LayoutError, match="tp_rank"):
        TpRank(-1, 2)
    with pytest.raises(LayoutError, match="tp_rank"):
        TpRank(True, 2)


def test_head_ranges_and_overlaps() -> None:
    assert head_range(layout(2), TpRank(1, 2)) == (2, 4)
    assert common_heads(layout(4), TpRank(0, 1), layout(2), TpRank(1, 2)) == (2, 4)
    assert common_heads(layout(2), TpRank(0, 2), layout(2), TpRank(1, 2)) is None
    assert same_heads(layout(2), TpRank(1, 2), layout(2), TpRank(1, 2))
    assert not same_heads(layout(4), TpRank(0, 1), layout(2), TpRank(0, 2))
    assert overlapping_ranks((0, 4), 2, 2) == [0, 1]
    assert overlapping_ranks((2, 4), 1, 4) == [2, 3]
    assert overlapping_ranks((0, 2), 4, 1) == [0]
    # Non-dividing sizes: 6 heads at TP 2 (3 each) against TP 3 (2 each).
    assert overlapping_ranks((2, 4), 3, 2) == [0, 1]
    assert overlapping_ranks((3, 6), 2, 3) == [1, 2]


def test_mapping_problems_name_heads_and_sizes() -> None:
    assert mapping_problems(layout(4), TpRank(0, 1), layout(2), TpRank(1, 2)) == []
    (problem,) = mapping_problems(layout(4), TpRank(0, 1), layout(4), TpRank(0, 2))
    assert "num_kv_heads" in problem and "4 heads here" in problem and "8 there" in problem
    problems = mapping_problems(layout(4), TpRank(), layout(2, head_dim=4), TpRank(0, 2))
    assert [p.split(":")[0] for p in problems] == ["head_dim"]


def test_no_common_head_is_a_clear_error() -> None:
    with pytest.raises(LayoutError, match=r"heads \[0, 2\).*heads \[2, 4\).*no KV head in common"):
        pair_head_segments(layout(2), TpRank(0, 2), [0], layout(2), TpRank(1, 2), [0])


def test_unmappable_and_miscounted_pairs_are_refused() -> None:
    with pytest.raises(LayoutError, match="num_kv_heads"):
        pair_head_segments(layout(4), TpRank(), [0], layout(4), TpRank(0, 2), [0])
    with pytest.raises(LayoutError, match="2 source blocks cannot be paired with 1"):
        pair_head_segments(layout(4), TpRank(), [0, 1], layout(2), TpRank(0, 2), [0])


# -- segments ----------------------------------------------------------------------------------


@pytest.mark.parametrize("src_major", MAJORS)
@pytest.mark.parametrize("dst_major", MAJORS)
def test_same_heads_gives_the_whole_piece_pairing(src_major: str, dst_major: str) -> None:
    src, dst = layout(2, src_major), layout(2, dst_major, num_blocks=9)
    blocks_s, blocks_d = [3, 4, 5, 0], [1, 2, 3, 8]
    for tp in (TpRank(), TpRank(1, 2)):
        s, d = pair_head_segments(src, tp, blocks_s, dst, tp, blocks_d)
        ref_s, ref_d = pair_segments(src, blocks_s, dst, blocks_d)
        assert np.array_equal(s, ref_s) and np.array_equal(d, ref_d)


def test_head_split_segments_by_hand() -> None:
    # 2 heads x 2 fp16 = 8-byte tokens at the source, 4-byte tokens at each destination rank.
    src = layout(2, num_layers=1, kv_factor=1, num_blocks=2)
    dst = layout(1, num_layers=1, kv_factor=1, num_blocks=2)
    s, d = pair_head_segments(src, TpRank(0, 1), [1], dst, TpRank(1, 2), [0])
    # Source block 1 starts at 24 (3 tokens x 8 bytes); rank 1 takes the second head: +4.
    assert s.tolist() == [[28, 4], [36, 4], [44, 4]]
    # Not merged: the destination is contiguous, the source is not.
    assert d.tolist() == [[0, 4], [4, 4], [8, 4]]


def _labels(
    lay: KvLayout, tp: TpRank, blocks: list[int]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(label of every pool byte, -1 outside `blocks`) and the byte offsets of `blocks`.

    A byte's label is (logical block, piece, token, global head, byte of the head): a byte
    copied into the wrong place, or from the wrong head, carries the wrong label.
    """
    head_bytes = lay.head_dim * lay.itemsize
    pool = np.full(lay.pool_bytes, -1, dtype=np.int64)
    if not blocks:
        return pool, np.zeros(0, dtype=np.int64)
    ids = np.asarray(blocks, dtype=np.int64)
    n, r, t = len(blocks), lay.pieces_per_block, lay.tokens_per_block
    h, total = lay.num_kv_heads, lay.num_kv_heads * tp.size
    pieces = lay.piece_offsets(ids, block_first=True)  # (n, r)
    i_, r_, t_, k_, b_ = np.meshgrid(
        np.arange(n), np.arange(r), np.arange(t), np.arange(h), np.arange(head_bytes), indexing="ij"
    )
    offsets = pieces[i_, r_] + t_ * lay.token_bytes + k_ * head_bytes + b_
    g = k_ + tp.rank * h
    label = (((i_ * r + r_) * t + t_) * total + g) * head_bytes + b_
    pool[offsets.ravel()] = label.ravel()
    return pool, offsets.ravel()


@st.composite
def tp_cases(draw: st.DrawFn) -> dict[str, Any]:
    src_size = draw(st.sampled_from([1, 2, 3, 4]))
    dst_size = draw(st.sampled_from([1, 2, 3, 4]))
    # Total heads divisible by both sizes.
    lcm = int(np.lcm(src_size, dst_size))
    total = lcm * draw(st.integers(1, 2))
    geometry: dict[str, Any] = dict(
        num_layers=draw(st.integers(1, 2)),
        kv_factor=draw(st.sampled_from([1, 2])),
        head_dim=draw(st.integers(1, 3)),
        tokens_per_block=draw(st.integers(1, 3)),
        dtype=draw(st.sampled_from(["int8", "float16"])),
    )
    src_blocks_n = draw(st.integers(1, 6))
    n = draw(st.integers(0, src_blocks_n))
    dst_n = draw(st.integers(max(n, 1), n + 3))
    return dict(
        src_size=src_size,
        dst_size=dst_size,
        dst_rank=draw(st.integers(0, dst_size - 1)),
        src=KvLayout(
            num_kv_heads=total // src_size,
            major=draw(st.sampled_from(MAJORS)),
            num_blocks=src_blocks_n,
            **geometry,
        ),
        dst=KvLayout(
            num_kv_heads=total // dst_size,
            major=draw(st.sampled_from(MAJORS)),
            num_blocks=dst_n,
            **geometry,
        ),
        src_blocks=list(draw(st.permutations(range(src_blocks_n)))[:n]),
        dst_blocks=list(draw(st.permutations(range(dst_n)))[:n]),
    )


@settings(max_examples=300, deadline=None)
@given(tp_cases())
def test_every_destination_byte_comes_from_exactly_one_source_rank(case: dict[str, Any]) -> None:
    """Whatever the two sizes, the source ranks that share heads with one destination rank
    together write each of its request bytes exactly once, each from the right place."""
    src, dst = case["src"], case["dst"]
    dst_tp = TpRank(case["dst_rank"], case["dst_size"])
    expected, dst_offsets = _labels(dst, dst_tp, case["dst_blocks"])
    got = np.full(dst.pool_bytes, -1, dtype=np.int64)
    writes = np.zeros(dst.pool_bytes, dtype=np.int64)
    wanted = overlapping_ranks(head_range(dst, dst_tp), src.num_kv_heads, case["src_size"])
    for rank in range(case["src_size"]):
        src_tp = TpRank(rank, case["src_size"])
        if common_heads(src, src_tp, dst, dst_tp) is None:
            assert rank not in wanted
            continue
        assert rank in wanted
        labels, _ = _labels(src, src_tp, case["src_blocks"])
        s, d = pair_head_segments(src, src_tp, case["src_blocks"], dst, dst_tp, case["dst_blocks"])
        assert (s[:, 1] == d[:, 1]).all() and (s[:, 1] > 0).all()
        for (so, length), (do, _) in zip(s.tolist(), d.tolist(), strict=True):
            got[do : do + length] = labels[so : so + length]
            writes[do : do + length] += 1
    assert (writes[dst_offsets] == 1).all(), "a destination byte is written twice or never"
    assert writes.sum() == dst_offsets.size, "a byte outside the request's blocks is written"
    assert np.array_equal(got, expected)
    # Maximal coalescing is inherited from _coalesce; row counts stay bounded by the units.


def test_two_source_ranks_merge_into_one_destination_by_hand() -> None:
    src = layout(1, num_layers=1, kv_factor=1, num_blocks=1)  # 4-byte tokens
    dst = layout(2, num_layers=1, kv_factor=1, num_blocks=1)  # 8-byte tokens
    rows = []
    for rank in (0, 1):
        s, d = pair_head_segments(src, TpRank(rank, 2), [0], dst, TpRank(0, 1), [0])
        # Token by token: contiguous at the source, every other 4 bytes at the destination.
        assert s.tolist() == [[0, 4], [4, 4], [8, 4]]
        rows += d.tolist()
    assert sorted(rows) == [[0, 4], [4, 4], [8, 4], [12, 4], [16, 4], [20, 4]]
