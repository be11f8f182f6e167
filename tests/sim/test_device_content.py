"""The device content, run with numpy as its array module, is exactly the host content.

No GPU here: what these tests prove is that the code written against `xp` computes the same
bytes, checks the same bytes and names the same first wrong byte as kvxferd.sim.content;
on a GPU the same code runs in cupy (scripts/gpu-check.sh, `kvxferd bench --memory vram`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_harness import MAJORS, geometries, tiny_layout

from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.sim import device_content as dc
from kvxferd.sim.content import clear_blocks, fill_blocks, request_seed, verify_blocks
from kvxferd.sim.device_content import (
    DeviceContent,
    clear_device_blocks,
    fill_device_blocks,
    verify_device_blocks,
)


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    """A pool of random geometry and order, a tensor-parallel rank, a random block list and
    a token count that fits it (a partial last block included)."""
    geo = draw(geometries(heads=2))
    tp_size = draw(st.sampled_from([1, 2, 3]))
    layout = KvLayout(
        major=draw(st.sampled_from(MAJORS)), num_blocks=draw(st.integers(1, 8)), **geo
    )
    n = draw(st.integers(1, layout.num_blocks))
    blocks = draw(st.permutations(range(layout.num_blocks)))[:n]
    tpb = layout.tokens_per_block
    return dict(
        layout=layout,
        tp=TpRank(draw(st.integers(0, tp_size - 1)), tp_size),
        blocks=blocks,
        tokens=draw(st.integers((n - 1) * tpb + 1, n * tpb)),
        start=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**64 - 1)),
    )


def _pools(layout: KvLayout) -> tuple[Any, Any]:
    base = np.random.default_rng(0).integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    return base.copy(), base.copy()


@settings(max_examples=150, deadline=None)
@given(cases())
def test_fill_with_numpy_is_the_host_content(c: dict[str, Any]) -> None:
    host, dev = _pools(c["layout"])
    fill_blocks(host, c["layout"], c["blocks"], c["seed"], c["start"], tp=c["tp"])
    fill_device_blocks(dev, c["layout"], c["blocks"], c["seed"], c["start"], tp=c["tp"], xp=np)
    assert np.array_equal(host, dev)  # the blocks, and every byte outside them untouched


@settings(max_examples=150, deadline=None)
@given(cases())
def test_verify_with_numpy_checks_what_the_host_checks(c: dict[str, Any]) -> None:
    layout, blocks, seed, tokens, tp = c["layout"], c["blocks"], c["seed"], c["tokens"], c["tp"]
    pool, _ = _pools(layout)
    fill_device_blocks(pool, layout, blocks, seed, tp=tp, xp=np)
    want = verify_blocks(pool, layout, blocks, seed, tokens, tp=tp)
    got = verify_device_blocks(pool, layout, blocks, seed, tokens, tp=tp, xp=np)
    assert want.ok and got == want
    # Another request's content: both name the same first wrong byte.
    other = verify_blocks(pool, layout, blocks, seed ^ 1, tokens, tp=tp)
    assert verify_device_blocks(pool, layout, blocks, seed ^ 1, tokens, tp=tp, xp=np) == other


@settings(max_examples=100, deadline=None)
@given(cases(), st.data())
def test_one_wrong_byte_is_reported_as_the_host_reports_it(
    c: dict[str, Any], data: st.DataObject
) -> None:
    layout, blocks, seed, tokens, tp = c["layout"], c["blocks"], c["seed"], c["tokens"], c["tp"]
    pool, _ = _pools(layout)
    fill_blocks(pool, layout, blocks, seed, tp=tp)
    # A byte of a checked token: logical block j, piece r, offset in the piece.
    j = data.draw(st.integers(0, len(blocks) - 1))
    in_block = min(layout.tokens_per_block, tokens - j * layout.tokens_per_block)
    r = data.draw(st.integers(0, layout.pieces_per_block - 1))
    off = data.draw(st.integers(0, in_block * layout.token_bytes - 1))
    at = int(layout.piece_offsets(np.array([blocks[j]]), block_first=True)[0, r]) + off
    pool[at] ^= 0x5A
    want = verify_blocks(pool, layout, blocks, seed, tokens, tp=tp)
    assert not want.ok
    assert verify_device_blocks(pool, layout, blocks, seed, tokens, tp=tp, xp=np) == want


@pytest.mark.parametrize("major", MAJORS)
def test_clear_and_chunks_match_the_host(major: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of one block: the loop over chunks, not one chunk, is what runs here.
    layout = tiny_layout(num_kv_heads=2, head_dim=4, tokens_per_block=4, major=major, num_blocks=6)
    monkeypatch.setattr(dc, "_CHUNK_BYTES", layout.block_bytes)
    host, dev = _pools(layout)
    seed = request_seed("device-content")
    for pool, fill in ((host, fill_blocks), (dev, None)):
        if fill is not None:
            fill(pool, layout, [5, 0, 3, 2], seed)
        else:
            fill_device_blocks(pool, layout, [5, 0, 3, 2], seed, xp=np)
    assert np.array_equal(host, dev)
    result = verify_device_blocks(dev, layout, [5, 0, 3, 2], seed, 15, xp=np)
    assert result == verify_blocks(host, layout, [5, 0, 3, 2], seed, 15)
    assert result.ok and result.bytes_checked == 3 * layout.block_bytes + 3 * layout.token_bytes * 4
    clear_blocks(host, layout, [0, 3])
    clear_device_blocks(dev, layout, [0, 3], xp=np)
    assert np.array_equal(host, dev)


def test_refusals_are_the_host_ones() -> None:
    layout = tiny_layout(num_layers=1, head_dim=4, num_blocks=3)
    pool = np.zeros(layout.pool_bytes, dtype=np.uint8)
    with pytest.raises(LayoutError, match="need 2 blocks"):
        verify_device_blocks(pool, layout, [0], 1, 3, xp=np)
    with pytest.raises(LayoutError, match="the layout needs"):
        fill_device_blocks(pool[:-1], layout, [0], 1, xp=np)


def test_device_content_with_numpy_runs_inline() -> None:
    # The engine's wrapper: with numpy there is no device to enter or synchronise.
    layout = tiny_layout(num_layers=1, head_dim=4, num_blocks=3)
    pool = np.zeros(layout.pool_bytes, dtype=np.uint8)
    content = DeviceContent(0, xp=np)
    content.fill(pool, layout, [2, 1], 9)
    content.synchronize()
    assert content.verify(pool, layout, [2, 1], 9, 4).ok
    content.clear(pool, layout, [2, 1])
    assert not pool.any()
