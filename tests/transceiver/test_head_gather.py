"""Every leg of a head-split gathered in one pass (HostCopier.gather_slices, head_gather.py):
byte for byte what a gather_heads per leg packs, for both majors, any split of the heads
into slices, scattered and consecutive blocks, runs longer than the cache share, and the
copy split over threads; bad slices and short buffers are refused before any byte moves."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_harness import tiny_layout

from kvxferd.memory.heads import slice_block_bytes
from kvxferd.memory.layout import BLOCK_MAJOR, LAYER_MAJOR, KvLayout, LayoutError
from kvxferd.transceiver import bounce, head_gather
from kvxferd.transceiver.bounce import HostCopier


def _layout(major: str, num_blocks: int, heads: int) -> KvLayout:
    return tiny_layout(
        num_layers=2,
        num_kv_heads=heads,
        head_dim=4,
        tokens_per_block=3,
        major=major,
        num_blocks=num_blocks,
    )


def _slices(heads: int, cuts: list[int]) -> list[tuple[int, int]]:
    """[0, heads) cut at `cuts` into consecutive slices (a head-split's legs)."""
    bounds = [0, *sorted({c for c in cuts if 0 < c < heads}), heads]
    return list(itertools.pairwise(bounds))


@settings(max_examples=80, deadline=None)
@given(
    major=st.sampled_from([BLOCK_MAJOR, LAYER_MAJOR]),
    heads=st.integers(1, 6),
    num_blocks=st.integers(1, 16),
    threads=st.integers(1, 3),
    data=st.data(),
)
def test_the_legs_gathered_together_pack_what_each_leg_gathered_alone_packs(
    major: str, heads: int, num_blocks: int, threads: int, data: st.DataObject
) -> None:
    layout = _layout(major, num_blocks, heads)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    pool = rng.integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    blocks = data.draw(st.permutations(range(num_blocks)))
    blocks = blocks[: data.draw(st.integers(1, num_blocks))]
    if data.draw(st.booleans()):
        blocks = sorted(blocks)  # runs of consecutive blocks
    slices = _slices(heads, data.draw(st.lists(st.integers(1, 5), max_size=4)))
    copier = HostCopier(threads=threads)
    old_split, old_cache = bounce._SPLIT_MIN_BYTES, head_gather._CACHED_BYTES
    bounce._SPLIT_MIN_BYTES = 1  # split every copy, so the threaded path runs too
    # Cut runs short too: a run of consecutive blocks is copied a share at a time.
    head_gather._CACHED_BYTES = data.draw(st.sampled_from([1, layout.block_bytes * 2, 1 << 20]))
    try:
        outs = [
            np.zeros(len(blocks) * slice_block_bytes(layout, end - start) + 5, np.uint8)
            for start, end in slices
        ]
        copier.gather_slices(pool, layout, blocks, list(zip(slices, outs, strict=True)))
        for heads_of, out in zip(slices, outs, strict=True):
            alone = np.zeros_like(out)
            copier.gather_heads(pool, layout, blocks, heads_of, alone)
            assert np.array_equal(out, alone), heads_of
            assert not out[-5:].any()  # nothing past the leg's bytes
    finally:
        bounce._SPLIT_MIN_BYTES, head_gather._CACHED_BYTES = old_split, old_cache
        copier.close()


def test_a_bad_slice_or_short_buffer_is_refused_before_anything_is_copied() -> None:
    layout = _layout(BLOCK_MAJOR, 4, 4)
    pool = np.full(layout.pool_bytes, 7, np.uint8)
    leg = slice_block_bytes(layout, 2) * 2
    copier = HostCopier(threads=1)
    try:
        first = np.zeros(leg, np.uint8)
        with pytest.raises(ValueError, match=r"leg 1 \(heads \[2, 4\)\) needs .* 1-D uint8"):
            copier.gather_slices(
                pool, layout, [0, 1], [((0, 2), first), ((2, 4), np.zeros(leg - 1, np.uint8))]
            )
        with pytest.raises(LayoutError, match=r"head slice \[3, 5\) is not within"):
            copier.gather_slices(pool, layout, [0, 1], [((0, 2), first), ((3, 5), first)])
        with pytest.raises(LayoutError, match="block id 4 at position 1 is out of range"):
            copier.gather_slices(pool, layout, [0, 4], [((0, 2), first)])
        assert not first.any()
    finally:
        copier.close()
