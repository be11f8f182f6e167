"""HostCopier (the bounce buffer's and staged runtime's gather/scatter) against the layout
math: packed order is (logical block, layer, K/V), whole pieces, for both majors, with
and without the copy split over threads."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxferd.memory.layout import BLOCK_MAJOR, LAYER_MAJOR, KvLayout, pair_segments
from kvxferd.transceiver import bounce
from kvxferd.transceiver.bounce import HostCopier


def _layout(major: str, num_blocks: int, layers: int, heads: int) -> KvLayout:
    return KvLayout(
        num_layers=layers,
        kv_factor=2,
        num_kv_heads=heads,
        head_dim=4,
        tokens_per_block=3,
        dtype="float16",
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
