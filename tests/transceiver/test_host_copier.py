"""HostCopier (the bounce buffer's and staged runtime's gather/scatter) against the layout
math: packed order is (logical block, layer, K/V), whole pieces, for both majors, with
and without the copy split over threads; head slices (a tensor-parallel leg's heads) packed
as (logical block, layer, K/V, token, heads) and checked against kvxferd.memory.heads."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_harness import tiny_layout

from kvxferd.memory.heads import (
    TpRank,
    head_range,
    local_heads,
    overlapping_ranks,
    pair_head_segments,
    slice_block_bytes,
)
from kvxferd.memory.layout import BLOCK_MAJOR, LAYER_MAJOR, KvLayout, LayoutError, pair_segments
from kvxferd.transceiver import bounce
from kvxferd.transceiver.bounce import HostCopier


def _layout(major: str, num_blocks: int, layers: int, heads: int) -> KvLayout:
    return tiny_layout(
        num_layers=layers,
        num_kv_heads=heads,
        head_dim=4,
        tokens_per_block=3,
        major=major,
        num_blocks=num_blocks,
    )


def _expected_packed(pool: np.ndarray, layout: KvLayout, blocks: list[int]) -> np.ndarray:
    """The reference: pair_segments into a block-major pool of just these blocks."""
    packed_layout = dataclasses.replace(layout, major=BLOCK_MAJOR, num_blocks=len(blocks))
    out = np.zeros(len(blocks) * layout.block_bytes, dtype=np.uint8)
    src, dst = pair_segments(layout, blocks, packed_layout, range(len(blocks)))
    for (s, n), (d, _) in zip(src.tolist(), dst.tolist(), strict=True):
        out[d : d + n] = pool[s : s + n]
    return out


@settings(max_examples=60, deadline=None)
@given(
    major=st.sampled_from([BLOCK_MAJOR, LAYER_MAJOR]),
    num_blocks=st.integers(1, 12),
    layers=st.integers(1, 3),
    heads=st.integers(1, 3),
    threads=st.integers(1, 3),
    data=st.data(),
)
def test_gather_then_scatter_matches_the_layout_math(
    major: str, num_blocks: int, layers: int, heads: int, threads: int, data: st.DataObject
) -> None:
    layout = _layout(major, num_blocks, layers, heads)
    blocks = data.draw(st.permutations(range(num_blocks)).map(lambda p: p[: max(1, len(p) // 2)]))
    rng = np.random.default_rng(len(blocks) * 7 + threads)
    pool = rng.integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    copier = HostCopier(threads)
    old = bounce._SPLIT_MIN_BYTES
    bounce._SPLIT_MIN_BYTES = 1  # split every copy, so the threaded path runs too
    try:
        packed = np.full(len(blocks) * layout.block_bytes + 5, 0xEE, dtype=np.uint8)
        copier.gather(pool, layout, blocks, packed)
        assert np.array_equal(packed[:-5], _expected_packed(pool, layout, blocks))
        assert (packed[-5:] == 0xEE).all()  # nothing past the request's bytes

        target = np.zeros_like(pool)
        copier.scatter(packed, target, layout, blocks)
        assert np.array_equal(_expected_packed(target, layout, blocks), packed[:-5])
        others = [b for b in range(num_blocks) if b not in blocks]
        if others:  # blocks outside the request are untouched
            assert not _expected_packed(target, layout, others).any()
    finally:
        bounce._SPLIT_MIN_BYTES = old
        copier.close()


def test_a_pool_of_the_wrong_shape_is_refused() -> None:
    layout = _layout(BLOCK_MAJOR, 4, 1, 1)
    copier = HostCopier(1)
    try:
        with pytest.raises(ValueError, match="pool must be a 1-D uint8 array"):
            copier.gather(
                np.zeros(layout.pool_bytes - 1, np.uint8), layout, [0], np.zeros(99, np.uint8)
            )
    finally:
        copier.close()


# ------------------------------------------------------------------ head slices (TP legs)


def _packed_reference(
    pool: np.ndarray, layout: KvLayout, blocks: list[int], heads: tuple[int, int]
) -> np.ndarray:
    """Packed order written out with reshapes: (logical block, layer, K/V, token, heads)."""
    head_bytes = layout.head_dim * layout.itemsize
    shape = (layout.tokens_per_block, layout.num_kv_heads, head_bytes)
    if layout.major == BLOCK_MAJOR:
        view = pool[: layout.pool_bytes].reshape(layout.num_blocks, layout.pieces_per_block, *shape)
        picked = view[blocks]
    else:
        view = pool[: layout.pool_bytes].reshape(layout.pieces_per_block, layout.num_blocks, *shape)
        picked = view[:, blocks].transpose(1, 0, 2, 3, 4)
    return np.ascontiguousarray(picked[:, :, :, heads[0] : heads[1], :]).ravel()


@settings(max_examples=80, deadline=None)
@given(
    src_major=st.sampled_from([BLOCK_MAJOR, LAYER_MAJOR]),
    dst_major=st.sampled_from([BLOCK_MAJOR, LAYER_MAJOR]),
    sizes=st.sampled_from([(1, 2), (2, 1), (1, 4), (4, 1), (2, 4), (4, 2), (2, 3), (3, 2)]),
    layers=st.integers(1, 3),
    threads=st.integers(1, 3),
    data=st.data(),
)
def test_head_slices_move_what_the_head_segments_move(
    src_major: str,
    dst_major: str,
    sizes: tuple[int, int],
    layers: int,
    threads: int,
    data: st.DataObject,
) -> None:
    """Gather a leg's heads from a context rank, scatter them into a generation rank: the
    result is exactly what heads.pair_head_segments copies, and nothing else changes."""
    src_size, dst_size = sizes
    total = 12  # divisible by every size above; 2 -> 3 and 3 -> 2 give uneven slices
    src_rank = data.draw(st.integers(0, src_size - 1))
    src_tp = TpRank(src_rank, src_size)
    src = _layout(src_major, 6, layers, total // src_size)
    # A generation rank holding some of the source's heads.
    s0, s1 = head_range(src, src_tp)
    dst_h = total // dst_size
    dst_rank = data.draw(st.sampled_from(overlapping_ranks((s0, s1), dst_h, dst_size)))
    dst_tp = TpRank(dst_rank, dst_size)
    dst = _layout(dst_major, 7, layers, dst_h)
    src_blocks = data.draw(st.permutations(range(6)).map(lambda p: p[: max(1, len(p) // 2)]))
    dst_blocks = data.draw(st.permutations(range(7)).map(lambda p: p[: len(src_blocks)]))
    src_heads = local_heads(src, src_tp, dst, dst_tp)
    dst_heads = local_heads(dst, dst_tp, src, src_tp)
    assert src_heads is not None and dst_heads is not None
    count = src_heads[1] - src_heads[0]
    nbytes = len(src_blocks) * slice_block_bytes(src, count)
    assert nbytes == len(src_blocks) * slice_block_bytes(dst, count)

    rng = np.random.default_rng(sum(src_blocks) + 31 * threads)
    pool = rng.integers(0, 256, src.pool_bytes, dtype=np.uint8)
    target = rng.integers(0, 256, dst.pool_bytes, dtype=np.uint8)
    expected = target.copy()
    segs_src, segs_dst = pair_head_segments(src, src_tp, src_blocks, dst, dst_tp, dst_blocks)
    for (s, n), (d, _) in zip(segs_src.tolist(), segs_dst.tolist(), strict=True):
        expected[d : d + n] = pool[s : s + n]

    copier = HostCopier(threads)
    old = bounce._SPLIT_MIN_BYTES
    bounce._SPLIT_MIN_BYTES = 1  # split every copy, so the threaded path runs too
    try:
        packed = np.full(nbytes + 5, 0xEE, dtype=np.uint8)
        copier.gather_heads(pool, src, src_blocks, src_heads, packed)
        assert np.array_equal(packed[:-5], _packed_reference(pool, src, src_blocks, src_heads))
        assert (packed[-5:] == 0xEE).all()  # nothing past the leg's bytes
        copier.scatter_heads(packed, target, dst, dst_blocks, dst_heads)
        assert np.array_equal(target, expected)
    finally:
        bounce._SPLIT_MIN_BYTES = old
        copier.close()


@pytest.mark.parametrize("major", [BLOCK_MAJOR, LAYER_MAJOR])
@pytest.mark.parametrize("heads", [(0, 1), (1, 3), (2, 5), (3, 4), (1, 5), (0, 5)])
def test_any_head_slice_round_trips(major: str, heads: tuple[int, int]) -> None:
    """Slices whose runs do not sit on multiples of their length (e.g. heads [1, 3) of 5)
    take the smaller-element path; every slice, with all heads too, packs in the canonical
    order and scatters back only into its heads."""
    layout = _layout(major, 5, 2, 5)
    blocks = [3, 0, 4]
    rng = np.random.default_rng(heads[0] * 10 + heads[1])
    pool = rng.integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    copier = HostCopier(1)
    try:
        nbytes = len(blocks) * slice_block_bytes(layout, heads[1] - heads[0])
        packed = np.zeros(nbytes, dtype=np.uint8)
        copier.gather_heads(pool, layout, blocks, heads, packed)
        assert np.array_equal(packed, _packed_reference(pool, layout, blocks, heads))
        if heads == (0, 5):  # every head: the whole-block packing
            whole = np.zeros(len(blocks) * layout.block_bytes, dtype=np.uint8)
            copier.gather(pool, layout, blocks, whole)
            assert np.array_equal(packed, whole)
        target = np.zeros_like(pool)
        copier.scatter_heads(packed, target, layout, blocks, heads)
        # Only the slice's bytes of those blocks were written.
        assert np.array_equal(_packed_reference(target, layout, blocks, heads), packed)
        written = np.zeros_like(pool)
        copier.scatter_heads(np.full(nbytes, 1, np.uint8), written, layout, blocks, heads)
        assert int(written.sum()) == nbytes
    finally:
        copier.close()


def test_a_bad_head_slice_or_short_buffer_is_refused() -> None:
    layout = _layout(BLOCK_MAJOR, 4, 1, 2)
    pool = np.zeros(layout.pool_bytes, np.uint8)
    copier = HostCopier(1)
    try:
        with pytest.raises(LayoutError, match=r"head slice \[1, 3\) is not within"):
            copier.gather_heads(pool, layout, [0], (1, 3), np.zeros(99, np.uint8))
        with pytest.raises(ValueError, match="the packed buffer holds 3 bytes"):
            copier.gather_heads(pool, layout, [0], (0, 1), np.zeros(3, np.uint8))
    finally:
        copier.close()
