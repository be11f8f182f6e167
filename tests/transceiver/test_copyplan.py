"""copyplan: which pool bytes a gather or scatter moves, and in which packed order, checked
against references that do not share its arithmetic: the byte map of a reshaped pool of
byte offsets (packed (logical block, layer, K/V, token, heads)), the layout's own
block_segments and heads.head_slice_offsets. Drawn over small geometries: block- and
layer-major, 1 to 5 layers, 1 to 6 heads, int8/fp16/fp32, every head slice."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_harness import MAJORS, draw_blocks, geometries, tiny_layout

from kvxferd.memory.heads import head_slice_offsets, slice_block_bytes
from kvxferd.memory.layout import BLOCK_MAJOR, KvLayout, LayoutError
from kvxferd.transceiver.copyplan import CopyPlan, copy_plan, word_rows


def _reference_bytes(layout: KvLayout, blocks: list[int], heads: tuple[int, int]) -> np.ndarray:
    """The pool offset of every packed byte, from a reshape of the pool's byte offsets."""
    offsets = np.arange(layout.pool_bytes, dtype=np.int64)
    head_bytes = layout.head_dim * layout.itemsize
    shape = (layout.tokens_per_block, layout.num_kv_heads, head_bytes)
    if layout.major == BLOCK_MAJOR:
        view = offsets.reshape(layout.num_blocks, layout.pieces_per_block, *shape)
        picked = view[blocks]
    else:
        view = offsets.reshape(layout.pieces_per_block, layout.num_blocks, *shape)
        picked = view[:, blocks].transpose(1, 0, 2, 3, 4)
    return np.ascontiguousarray(picked[:, :, :, heads[0] : heads[1], :]).ravel()


def _plan_bytes(plan: CopyPlan) -> np.ndarray:
    index = plan.index.astype(np.int64)
    return (index[:, None] * plan.unit + np.arange(plan.unit, dtype=np.int64)).ravel()


def _runs(byte_map: np.ndarray) -> list[tuple[int, int]]:
    """Maximal runs of consecutive pool offsets, in packed order."""
    runs: list[tuple[int, int]] = []
    for offset in byte_map.tolist():
        if runs and runs[-1][0] + runs[-1][1] == offset:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((offset, 1))
    return runs


def _covered(segments: np.ndarray) -> set[int]:
    return {b for s, n in segments.tolist() for b in range(s, s + n)}


Case = tuple[KvLayout, list[int], tuple[int, int]]  # a layout, block ids, a head slice


@st.composite
def plans(draw: st.DrawFn) -> Case:
    geo = draw(geometries(layers=5, heads=6, dtypes=("int8", "float16", "float32")))
    layout = KvLayout(
        **geo, major=draw(st.sampled_from(MAJORS)), num_blocks=draw(st.integers(1, 6))
    )
    blocks = draw_blocks(draw, layout, draw(st.integers(0, layout.num_blocks)))
    start = draw(st.integers(0, layout.num_kv_heads - 1))
    end = draw(st.integers(start + 1, layout.num_kv_heads))
    return layout, blocks, (start, end)


@settings(max_examples=300, deadline=None)
@given(case=plans())
def test_a_plan_moves_exactly_the_reference_bytes_in_packed_order(case: Case) -> None:
    layout, blocks, heads = case
    plan = copy_plan(layout, blocks, heads)
    expected = _reference_bytes(layout, blocks, heads)
    got = _plan_bytes(plan)
    assert np.array_equal(got, expected)
    assert plan.nbytes == got.size == len(blocks) * slice_block_bytes(layout, heads[1] - heads[0])
    assert plan.nbytes == plan.index.size * plan.unit
    assert np.unique(got).size == got.size  # no pool byte twice
    # Units tile the pool: the 2-D (units, words) views of the copiers are whole rows.
    assert layout.pool_bytes % plan.unit == 0
    assert plan.index.dtype == np.intp
    # segments() is the byte map's runs, in packed order.
    assert [tuple(r) for r in plan.segments().tolist()] == _runs(got)


@settings(max_examples=200, deadline=None)
@given(case=plans())
def test_whole_blocks_are_the_layouts_block_segments(case: Case) -> None:
    layout, blocks, _ = case
    plan = copy_plan(layout, blocks)
    assert plan.nbytes == len(blocks) * layout.block_bytes
    # Every head is the whole-block plan itself, not merely the same bytes.
    every = copy_plan(layout, blocks, (0, layout.num_kv_heads))
    assert every.unit == plan.unit and np.array_equal(every.index, plan.index)
    reference = layout.block_segments(blocks)
    if layout.major == BLOCK_MAJOR:
        # Packed order is block order: the very same runs.
        assert np.array_equal(plan.segments(), reference)
    else:
        # block_segments walks region by region, packed order block by block: same bytes.
        assert _covered(plan.segments()) == _covered(reference)
        assert plan.unit == layout.piece_bytes


@settings(max_examples=200, deadline=None)
@given(case=plans())
def test_a_head_slice_starts_its_runs_where_head_slice_offsets_says(case: Case) -> None:
    layout, blocks, heads = case
    if heads == (0, layout.num_kv_heads):
        return  # the whole-block plan (tested above)
    plan = copy_plan(layout, blocks, heads)
    run = (heads[1] - heads[0]) * layout.head_dim * layout.itemsize
    starts = head_slice_offsets(layout, blocks, heads)
    assert np.array_equal(_plan_bytes(plan)[::run], starts)
    assert run % plan.unit == 0
    # Asked in the plan's units, the same starts (computed before broadcasting).
    assert np.array_equal(head_slice_offsets(layout, blocks, heads, plan.unit), starts // plan.unit)


def test_every_head_slice_of_every_small_geometry() -> None:
    """Exhaustive where hypothesis samples: both majors, three dtypes, 1 to 3 layers, K/V
    or K only, 1 to 6 heads, every slice of them, a few block lists."""
    checked = 0
    dims = itertools.product(MAJORS, ("int8", "float16", "float32"), (1, 2, 3), (1, 2), range(1, 7))
    for major, dtype, layers, kv, heads in dims:
        layout = tiny_layout(
            num_layers=layers,
            kv_factor=kv,
            num_kv_heads=heads,
            dtype=dtype,
            major=major,
            num_blocks=4,
        )
        slices = [(a, b) for a in range(heads) for b in range(a + 1, heads + 1)]
        for blocks, part in itertools.product(([], [0], [2, 0], [1, 3, 0, 2], [3, 2]), slices):
            plan = copy_plan(layout, blocks, part)
            assert np.array_equal(_plan_bytes(plan), _reference_bytes(layout, blocks, part))
            assert layout.pool_bytes % plan.unit == 0
            checked += 1
    assert checked == 2 * 3 * 3 * 2 * 5 * 56


def test_bad_blocks_heads_and_orders_are_refused_as_the_layout_refuses_them() -> None:
    layout = tiny_layout(num_kv_heads=3)
    with pytest.raises(LayoutError, match="out of range"):
        copy_plan(layout, [4])
    with pytest.raises(LayoutError, match="repeats"):
        copy_plan(layout, [1, 1])
    with pytest.raises(LayoutError, match="not within the pool's 3 heads"):
        copy_plan(layout, [0], (2, 4))
    other = tiny_layout(major="layer,block,kv,token,head")
    for heads in (None, (0, 1)):
        with pytest.raises(LayoutError, match="no contiguous"):
            copy_plan(other, [0], heads)


def test_an_empty_request_plans_nothing() -> None:
    plan = copy_plan(tiny_layout(), [])
    assert (plan.index.size, plan.nbytes) == (0, 0)
    assert plan.segments().shape == (0, 2)


@pytest.mark.parametrize(
    ("unit", "word", "rows"),
    [(8, 8, 1), (4096, 8, 512), (12, 4, 3), (4, 4, 1), (6, 2, 3), (2, 2, 1), (3, 1, 3), (1, 1, 1)],
)
def test_word_rows_takes_the_widest_word_that_divides_the_unit(
    unit: int, word: int, rows: int
) -> None:
    dtype, count = word_rows(unit)
    assert (dtype.itemsize, dtype.kind, count) == (word, "u", rows)


def test_a_unit_holds_a_byte() -> None:
    with pytest.raises(ValueError, match="at least one byte"):
        word_rows(0)
