"""KvLayout with an explicit dimension order (e.g. vLLM's CPU KV cache).

Every check goes through `logical_view`, which gives each byte its meaning (block, layer,
kv, token, head, byte of head_dim) whatever the order: a segment that moves the wrong bytes
cannot pass.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvxferd.memory.layout import BLOCK_MAJOR, LAYER_MAJOR, KvLayout, LayoutError, pair_segments

VLLM_CPU = "layer,block,head,kv,token"  # per layer tensor; per KV head its K rows, then V


def layout(major: str, num_blocks: int = 16, heads: int = 2) -> KvLayout:
    return KvLayout(
        num_layers=3, kv_factor=2, num_kv_heads=heads, head_dim=4, tokens_per_block=8,
        dtype="float16", major=major, num_blocks=num_blocks,
    )  # fmt: skip


def test_vllm_cpu_order_matches_the_tensor_vllm_registers() -> None:
    """vLLM 0.32's CPU backend: a layer is [num_blocks, kv_heads, block_size, 2 * head_dim]
    with C strides, read as [kv_heads, 2 * block_size, head_dim] per block: per head, its
    block_size K rows, then its V rows; layers one after the other in one buffer."""
    lay = layout(VLLM_CPU)
    e = lay.itemsize
    h, t, d, nb = lay.num_kv_heads, lay.tokens_per_block, lay.head_dim, lay.num_blocks
    assert lay.strides() == {
        "layer": nb * h * 2 * t * d * e,
        "block": h * 2 * t * d * e,
        "head": 2 * t * d * e,
        "kv": t * d * e,
        "token": d * e,
    }
    assert lay.block_bytes == lay.num_layers * h * 2 * t * d * e
    assert KvLayout.from_wire(lay.to_wire()) == lay


def test_the_named_orders_spelled_out_are_the_names() -> None:
    assert layout("block,layer,kv,token,head").major == BLOCK_MAJOR
    assert layout("layer,kv,block,token,head").major == LAYER_MAJOR
    with pytest.raises(LayoutError, match="major must be"):
        layout("layer,block,head,kv")  # a dimension missing
    with pytest.raises(LayoutError, match="major must be"):
        layout("layer,block,head,kv,token,token")


def test_pieces_exist_only_in_the_named_orders() -> None:
    with pytest.raises(LayoutError, match="no contiguous"):
        layout(VLLM_CPU).piece_offsets(np.array([0, 1]), block_first=True)


def test_block_segments_cover_exactly_the_blocks() -> None:
    lay = layout(VLLM_CPU)
    blocks = [3, 4, 5, 9, 0]
    marks = np.zeros(lay.pool_bytes, dtype=np.uint8)
    segs = lay.block_segments(blocks)
    for off, n in segs:
        marks[off : off + n] += 1
    view = lay.logical_view(marks)
    assert (view[blocks] == 1).all()
    others = [b for b in range(lay.num_blocks) if b not in blocks]
    assert (view[others] == 0).all()
    # One run per (layer, run of consecutive ids): the whole per-layer block is contiguous.
    assert len(segs) == lay.num_layers * 3


ORDERS = [
    BLOCK_MAJOR,
    LAYER_MAJOR,
    VLLM_CPU,
    "head,layer,block,token,kv",
    "token,block,kv,head,layer",
]


@pytest.mark.parametrize(("src_major", "dst_major"), list(itertools.product(ORDERS, ORDERS)))
def test_pair_segments_move_every_byte_to_its_place(src_major: str, dst_major: str) -> None:
    src, dst = layout(src_major), layout(dst_major, num_blocks=20)
    rng = np.random.default_rng(5)
    src_pool = rng.integers(0, 256, src.pool_bytes, dtype=np.uint8)
    dst_pool = np.zeros(dst.pool_bytes, dtype=np.uint8)
    src_blocks, dst_blocks = [7, 8, 9, 2, 15], [11, 12, 13, 0, 19]
    s_segs, d_segs = pair_segments(src, src_blocks, dst, dst_blocks)
    assert (s_segs[:, 1] == d_segs[:, 1]).all()
    for (so, n), (do, _) in zip(s_segs, d_segs, strict=True):
        dst_pool[do : do + n] = src_pool[so : so + n]
    got, want = dst.logical_view(dst_pool), src.logical_view(src_pool)
    assert np.array_equal(got[dst_blocks], want[src_blocks])
    untouched = [b for b in range(dst.num_blocks) if b not in dst_blocks]
    assert not got[untouched].any()
    if src_major == dst_major == VLLM_CPU:
        # Same order: runs as long as a layer's part of a block, consecutive ids merged.
        assert len(s_segs) == src.num_layers * 3  # [7, 8, 9], [2], [15] per layer


def test_different_geometry_is_refused_for_any_order() -> None:
    with pytest.raises(LayoutError, match="num_kv_heads"):
        pair_segments(layout(VLLM_CPU), [0], layout(VLLM_CPU, heads=1), [0])
