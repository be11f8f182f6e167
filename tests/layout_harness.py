"""Small KV layouts for the memory and transceiver tests, and hypothesis strategies that
draw random ones.

Imported as a top-level module (`from layout_harness import tiny_layout`): tests/ has
no __init__.py and holds the suite's conftest.py, so pytest puts it on sys.path.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st

from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import BLOCK_MAJOR, LAYER_MAJOR, KvLayout
from kvxferd.transceiver.bounce import Copier

# 2 layers, K and V, 1 head of 2 fp16, 2 tokens per block, 4 blocks: token 4 bytes,
# piece 8 bytes, block 32 bytes, pool 128 bytes.
TINY: dict[str, Any] = dict(
    num_layers=2,
    kv_factor=2,
    num_kv_heads=1,
    head_dim=2,
    tokens_per_block=2,
    dtype="float16",
    major=BLOCK_MAJOR,
    num_blocks=4,
)

MAJORS = (BLOCK_MAJOR, LAYER_MAJOR)


def tiny_layout(**fields: Any) -> KvLayout:
    """TINY with `fields` in place of its own."""
    return KvLayout(**{**TINY, **fields})


# -- hypothesis strategies -------------------------------------------------------------------


@st.composite
def geometries(
    draw: st.DrawFn,
    *,
    layers: int = 3,
    heads: int = 2,
    head_dim: int = 2,
    dtypes: Sequence[str] = ("float16", "int8", "float32"),
) -> dict[str, Any]:
    """KvLayout fields but major and num_blocks: 1 to `layers` layers, K and V or K only,
    1 to `heads` heads (none drawn where `heads` is 0), 1 to `head_dim`, 1 to 3 tokens per
    block, one of `dtypes`."""
    geo: dict[str, Any] = dict(
        num_layers=draw(st.integers(1, layers)),
        kv_factor=draw(st.sampled_from([1, 2])),
        head_dim=draw(st.integers(1, head_dim)),
        tokens_per_block=draw(st.integers(1, 3)),
        dtype=draw(st.sampled_from(dtypes)),
    )
    if heads:
        geo["num_kv_heads"] = draw(st.integers(1, heads))
    return geo


def draw_pools(
    draw: st.DrawFn,
    geo: dict[str, Any],
    majors: Sequence[str],
    max_blocks: int,
    heads: tuple[int, int] | None = None,
) -> tuple[KvLayout, KvLayout]:
    """A source and a destination layout of geometry `geo` (and `heads` heads each, where
    given), each with its own order from `majors` and 1 to `max_blocks` blocks."""
    sides: list[dict[str, Any]] = (
        [{}, {}] if heads is None else [{"num_kv_heads": h} for h in heads]
    )
    src, dst = (
        KvLayout(
            **geo,
            **side,
            major=draw(st.sampled_from(majors)),
            num_blocks=draw(st.integers(1, max_blocks)),
        )
        for side in sides
    )
    return src, dst


def draw_blocks(draw: st.DrawFn, layout: KvLayout, n: int) -> list[int]:
    """`n` distinct block ids of `layout`, in any order."""
    return list(draw(st.permutations(range(layout.num_blocks)))[:n])


@st.composite
def tp_transfers(
    draw: st.DrawFn, *, layers: int, dtypes: Sequence[str], max_blocks: int
) -> dict[str, Any]:
    """One transfer between tensor-parallel ranks of sizes 1 to 4 (heads divisible by both):
    src, dst (block- or layer-major, up to `max_blocks` blocks), src_tp, dst_tp, and as many
    src_blocks as dst_blocks."""
    src_size, dst_size = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    total = math.lcm(src_size, dst_size) * draw(st.integers(1, 2))
    geo = draw(geometries(layers=layers, heads=0, dtypes=dtypes))
    src, dst = draw_pools(draw, geo, MAJORS, max_blocks, (total // src_size, total // dst_size))
    n = draw(st.integers(0, min(src.num_blocks, dst.num_blocks)))
    return dict(
        src=src,
        dst=dst,
        src_tp=TpRank(draw(st.integers(0, src_size - 1)), src_size),
        dst_tp=TpRank(draw(st.integers(0, dst_size - 1)), dst_size),
        src_blocks=draw_blocks(draw, src, n),
        dst_blocks=draw_blocks(draw, dst, n),
    )


Heads = tuple[int, int] | None  # None: whole blocks


@st.composite
def sliced_blocks(
    draw: st.DrawFn, *, layers: int, heads: int, max_blocks: int, min_count: int = 0
) -> tuple[KvLayout, list[int], Heads]:
    """A layout of geometry `geometries(layers, heads)` (int8, fp16 or fp32), either order,
    1 to `max_blocks` blocks; `min_count` up to all of its block ids in any order; and None
    (whole blocks) or a head slice (start, end) of at least one head."""
    geo = draw(geometries(layers=layers, heads=heads, dtypes=("int8", "float16", "float32")))
    layout = KvLayout(
        **geo, major=draw(st.sampled_from(MAJORS)), num_blocks=draw(st.integers(1, max_blocks))
    )
    blocks = draw_blocks(draw, layout, draw(st.integers(min_count, layout.num_blocks)))
    if draw(st.booleans()):
        return layout, blocks, None
    start = draw(st.integers(0, layout.num_kv_heads - 1))
    return layout, blocks, (start, draw(st.integers(start + 1, layout.num_kv_heads)))


def copies(c: Copier, heads: Heads) -> tuple[Callable[..., None], Callable[..., None]]:
    """`c`'s gather and scatter for whole blocks (`heads` None) or for the head slice
    `heads`, called as gather(pool, layout, blocks, out) and scatter(packed, pool, layout,
    blocks)."""
    if heads is None:
        return c.gather, c.scatter
    return (
        lambda pool, layout, blocks, out: c.gather_heads(pool, layout, blocks, heads, out),
        lambda packed, pool, layout, blocks: c.scatter_heads(packed, pool, layout, blocks, heads),
    )


def block_id_lists(
    max_blocks: int, spill: int, max_size: int
) -> st.SearchStrategy[tuple[int, list[int]]]:
    """A pool's block count n (1 to `max_blocks`) and up to `max_size` ids from -`spill` to
    n + `spill`: some out of range, some repeated."""
    return st.integers(1, max_blocks).flatmap(
        lambda n: st.tuples(st.just(n), st.lists(st.integers(-spill, n + spill), max_size=max_size))
    )


def count_calls(fn: Callable[[], object]) -> int:
    """Python and C function calls made while fn runs (sys.setprofile events): how a test
    tells a vectorised routine (a fixed number of calls) from a loop over its pieces (one
    or more per piece) without timing it."""
    count = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count
