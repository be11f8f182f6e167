"""kvxferd.transceiver.plan on its own: block-id validation and write plans applied to bytes.

Every plan here is carried out on numpy byte arrays (source pool random, destination pool a
known filler) and checked against a reference written in this file: the request's
destination blocks hold exactly the source blocks' bytes (or, across tensor-parallel sizes,
the heads both pools hold), and every other byte of the destination is untouched, so a plan
that writes one block (or one byte) beyond the request fails.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layout_harness import (
    block_id_lists,
    draw_blocks,
    draw_pools,
    geometries,
    tiny_layout,
    tp_transfers,
)

from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import BLOCK_MAJOR, LAYER_MAJOR, KvLayout, LayoutError
from kvxferd.transceiver import plan
from kvxferd.transceiver.plan import plan_write, validate_block_ids

FILLER = 0xA5
SRC_BASE = 1 << 20
DST_BASE = 3 << 30

Bytes = npt.NDArray[np.uint8]


def layout(major: str = BLOCK_MAJOR, **kw: Any) -> KvLayout:
    """tiny_layout with 2 heads and 8 blocks."""
    return tiny_layout(**{"num_kv_heads": 2, "major": major, "num_blocks": 8, **kw})


def pools(src: KvLayout, dst: KvLayout, seed: int = 0) -> tuple[Bytes, Bytes]:
    rng = np.random.default_rng(seed)
    src_pool = rng.integers(0, 256, src.pool_bytes, dtype=np.uint8)
    dst_pool = np.full(dst.pool_bytes, FILLER, dtype=np.uint8)
    return src_pool, dst_pool


def apply(
    local: npt.NDArray[np.int64],
    remote: npt.NDArray[np.int64],
    src_pool: Bytes,
    dst_pool: Bytes,
    src_base: int = SRC_BASE,
    dst_base: int = DST_BASE,
) -> None:
    """Carry the plan out: every row pair is one copy of `length` bytes."""
    assert local.dtype == np.int64 and remote.dtype == np.int64
    assert local.ndim == 2 and local.shape[1] == 2
    assert local.shape == remote.shape
    for (src_addr, src_len), (dst_addr, dst_len) in zip(
        local.tolist(), remote.tolist(), strict=True
    ):
        assert src_len == dst_len and src_len > 0
        s, d = src_addr - src_base, dst_addr - dst_base
        assert s >= 0 and s + src_len <= src_pool.size, "source row outside the source pool"
        assert d >= 0 and d + dst_len <= dst_pool.size, "destination row outside the pool"
        dst_pool[d : d + dst_len] = src_pool[s : s + src_len]


def expected_destination(
    src: KvLayout,
    src_pool: Bytes,
    src_blocks: list[int],
    dst: KvLayout,
    dst_pool: Bytes,
    dst_blocks: list[int],
    src_tp: TpRank | None = None,
    dst_tp: TpRank | None = None,
) -> Bytes:
    """The reference: the destination pool after a correct transfer (computed head by head
    on the logical (block, layer, kv, token, head, bytes) views)."""
    src_tp, dst_tp = src_tp or TpRank(), dst_tp or TpRank()
    out = dst_pool.copy()
    sv, dv = src.logical_view(src_pool), dst.logical_view(out)
    s_first, d_first = src_tp.rank * src.num_kv_heads, dst_tp.rank * dst.num_kv_heads
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        for g in range(
            max(s_first, d_first), min(s_first + src.num_kv_heads, d_first + dst.num_kv_heads)
        ):
            dv[d, :, :, :, g - d_first] = sv[s, :, :, :, g - s_first]
    return out


def check_plan(
    src: KvLayout,
    src_blocks: list[int],
    dst: KvLayout,
    dst_blocks: list[int],
    src_tp: TpRank | None = None,
    dst_tp: TpRank | None = None,
    seed: int = 0,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    src_pool, dst_pool = pools(src, dst, seed)
    want = expected_destination(
        src, src_pool, src_blocks, dst, dst_pool, dst_blocks, src_tp, dst_tp
    )
    local, remote = plan_write(src, SRC_BASE, src_blocks, dst, DST_BASE, dst_blocks, src_tp, dst_tp)
    apply(local, remote, src_pool, dst_pool)
    if not np.array_equal(dst_pool, want):
        wrong = np.flatnonzero(dst_pool != want)
        pytest.fail(
            f"{wrong.size} destination bytes differ from the reference, first at offset "
            f"{int(wrong[0])} (destination block {int(wrong[0]) // dst.block_bytes} if "
            "block-major)"
        )
    return local, remote


def reference_runs(blocks_src: list[int], blocks_dst: list[int]) -> list[tuple[int, int, int]]:
    """(first src, first dst, count) of the runs consecutive on both sides."""
    runs: list[list[int]] = []
    for s, d in zip(blocks_src, blocks_dst, strict=True):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


def rows(a: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    return [(int(x), int(y)) for x, y in a.tolist()]


# -- validate_block_ids ----------------------------------------------------------------------


def test_valid_ids_pass_in_any_order() -> None:
    validate_block_ids(layout(), [7, 0, 3])
    validate_block_ids(layout(), [])
    validate_block_ids(layout(num_blocks=1), [0])


def test_block_id_equal_to_num_blocks_is_rejected() -> None:
    with pytest.raises(LayoutError, match=r"block id 8 at position 1 is out of range") as info:
        validate_block_ids(layout(), [0, 8])
    assert "the pool has 8 blocks (valid ids 0..7)" in str(info.value)


def test_last_block_id_is_accepted_and_negative_rejected() -> None:
    validate_block_ids(layout(), [7])
    with pytest.raises(LayoutError, match=r"block id -1 at position 0 is out of range"):
        validate_block_ids(layout(), [-1])


def test_the_first_bad_id_is_named() -> None:
    with pytest.raises(LayoutError, match=r"block id 9 at position 2"):
        validate_block_ids(layout(), [1, 2, 9, 10])


def test_repeated_id_names_both_positions() -> None:
    with pytest.raises(LayoutError, match=r"^block id 3 at position 2 repeats the one at 0$"):
        validate_block_ids(layout(), [3, 1, 3])
    with pytest.raises(LayoutError, match=r"^block id 1 at position 3 repeats the one at 1$"):
        validate_block_ids(layout(), [0, 1, 2, 1, 0])


@settings(max_examples=150, deadline=None)
@given(block_id_lists(20, 3, 12))
def test_validation_matches_the_reference(case: tuple[int, list[int]]) -> None:
    n, blocks = case
    ok = all(0 <= b < n for b in blocks) and len(set(blocks)) == len(blocks)
    if ok:
        validate_block_ids(layout(num_blocks=n), blocks)
    else:
        with pytest.raises(LayoutError):
            validate_block_ids(layout(num_blocks=n), blocks)


# -- block-major fast path -------------------------------------------------------------------


def test_contiguous_blocks_are_one_row_with_the_bases_added() -> None:
    lay = layout()
    local, remote = check_plan(lay, [2, 3, 4], lay, [5, 6, 7])
    size = lay.block_bytes
    assert rows(local) == [(SRC_BASE + 2 * size, 3 * size)]
    assert rows(remote) == [(DST_BASE + 5 * size, 3 * size)]


def test_single_block_moves_exactly_one_block() -> None:
    lay = layout()
    local, remote = check_plan(lay, [0], lay, [3])
    assert rows(local) == [(SRC_BASE, lay.block_bytes)]
    assert rows(remote) == [(DST_BASE + 3 * lay.block_bytes, lay.block_bytes)]


def test_runs_contiguous_on_one_side_only_are_not_merged() -> None:
    lay = layout()
    size = lay.block_bytes
    local, remote = check_plan(lay, [0, 1, 2], lay, [0, 2, 3])
    assert rows(local) == [(SRC_BASE, size), (SRC_BASE + size, 2 * size)]
    assert rows(remote) == [(DST_BASE, size), (DST_BASE + 2 * size, 2 * size)]
    local, remote = check_plan(lay, [4, 6, 7], lay, [1, 2, 3])
    assert rows(local) == [(SRC_BASE + 4 * size, size), (SRC_BASE + 6 * size, 2 * size)]
    assert rows(remote) == [(DST_BASE + size, size), (DST_BASE + 2 * size, 2 * size)]


def test_descending_ids_are_not_a_run() -> None:
    lay = layout()
    size = lay.block_bytes
    local, remote = check_plan(lay, [3, 2, 1], lay, [3, 2, 1])
    assert rows(local) == [(SRC_BASE + b * size, size) for b in (3, 2, 1)]
    assert rows(remote) == [(DST_BASE + b * size, size) for b in (3, 2, 1)]


def test_the_last_block_of_each_pool() -> None:
    src, dst = layout(num_blocks=3), layout(num_blocks=5)
    _local, remote = check_plan(src, [1, 2], dst, [3, 4])
    assert rows(remote) == [(DST_BASE + 3 * dst.block_bytes, 2 * dst.block_bytes)]


def test_empty_request_is_an_empty_plan() -> None:
    for major in (BLOCK_MAJOR, LAYER_MAJOR):
        local, remote = plan_write(layout(major), 0, [], layout(major), 0, [])
        assert local.shape == (0, 2) and remote.shape == (0, 2)


def test_counts_that_differ_are_refused() -> None:
    with pytest.raises(LayoutError, match="context sends 2 blocks, generation expects 1"):
        plan_write(layout(), 0, [0, 1], layout(), 0, [0])


def test_geometry_that_differs_is_refused_with_the_differences() -> None:
    with pytest.raises(LayoutError, match=r"^KV geometry differs: head_dim: 2 here, 4 there$"):
        plan_write(layout(), 0, [0], layout(head_dim=4), 0, [0])
    with pytest.raises(
        LayoutError,
        match=r"num_layers: 2 here, 3 there; head_dim: 2 here, 1 there; "
        r"dtype: float16 here, bfloat16",
    ):
        plan_write(layout(), 0, [0], layout(num_layers=3, dtype="bfloat16", head_dim=1), 0, [0])


def test_long_requests_take_the_numpy_path_with_the_same_result() -> None:
    n = plan._LOOP_MAX_BLOCKS + 1
    lay = layout(
        num_blocks=2 * n, num_layers=1, kv_factor=1, num_kv_heads=1, head_dim=1, tokens_per_block=1
    )
    src_blocks = list(range(n))
    dst_blocks = [2 * b for b in range(n)]  # nothing merges on the destination side
    local, _remote = check_plan(lay, src_blocks, lay, dst_blocks)
    assert local.shape == (n, 2)
    # Out-of-range ids on the numpy path are refused by the layout check.
    with pytest.raises(LayoutError, match="out of range"):
        plan_write(lay, 0, [2 * n, *range(n - 1)], lay, 0, list(range(n)))


def test_the_numpy_path_and_the_loop_agree_at_the_threshold() -> None:
    n = plan._LOOP_MAX_BLOCKS
    lay = layout(
        num_blocks=2 * n + 2,
        num_layers=1,
        kv_factor=1,
        num_kv_heads=1,
        head_dim=1,
        tokens_per_block=1,
    )
    rng = np.random.default_rng(5)
    for count in (n, n + 1):
        src_blocks = rng.permutation(2 * n + 2)[:count].tolist()
        dst_blocks = sorted(rng.permutation(2 * n + 2)[:count].tolist())
        check_plan(lay, src_blocks, lay, dst_blocks)


# -- property: random layouts and block lists ------------------------------------------------

ORDERS = [BLOCK_MAJOR, LAYER_MAJOR, "layer,block,head,kv,token", "token,head,block,kv,layer"]


@st.composite
def same_heads_case(draw: st.DrawFn) -> tuple[KvLayout, list[int], KvLayout, list[int]]:
    src, dst = draw_pools(draw, draw(geometries()), ORDERS, 10)
    n = draw(st.integers(0, min(src.num_blocks, dst.num_blocks)))
    src_blocks = draw_blocks(draw, src, n)
    # Often contiguous runs on both sides, sometimes not.
    if draw(st.booleans()):
        start = draw(st.integers(0, dst.num_blocks - n))
        dst_blocks = list(range(start, start + n))
        if draw(st.booleans()):
            s0 = draw(st.integers(0, src.num_blocks - n))
            src_blocks = list(range(s0, s0 + n))
    else:
        dst_blocks = draw_blocks(draw, dst, n)
    return src, src_blocks, dst, dst_blocks


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(same_heads_case(), st.integers(0, 2**32 - 1))
def test_any_plan_writes_exactly_the_requested_blocks(
    case: tuple[KvLayout, list[int], KvLayout, list[int]], seed: int
) -> None:
    src, src_blocks, dst, dst_blocks = case
    local, remote = check_plan(src, src_blocks, dst, dst_blocks, seed=seed)
    assert int(local[:, 1].sum()) == len(src_blocks) * src.block_bytes
    if src.major == dst.major == BLOCK_MAJOR:
        runs = reference_runs(src_blocks, dst_blocks)
        size = src.block_bytes
        assert rows(local) == [(SRC_BASE + s * size, n * size) for s, _, n in runs]
        assert rows(remote) == [(DST_BASE + d * size, n * size) for _, d, n in runs]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp_transfers(layers=3, dtypes=("float16", "int8", "float32"), max_blocks=6))
def test_plans_across_tensor_parallel_sizes_move_only_the_shared_heads(
    case: dict[str, Any],
) -> None:
    src, dst, src_tp, dst_tp = case["src"], case["dst"], case["src_tp"], case["dst_tp"]
    s0, d0 = src_tp.rank * src.num_kv_heads, dst_tp.rank * dst.num_kv_heads
    shared = max(s0, d0) < min(s0 + src.num_kv_heads, d0 + dst.num_kv_heads)
    if not shared:
        with pytest.raises(LayoutError, match="no KV head in common"):
            plan_write(src, 0, case["src_blocks"], dst, 0, case["dst_blocks"], src_tp, dst_tp)
        return
    check_plan(src, case["src_blocks"], dst, case["dst_blocks"], src_tp, dst_tp)


def test_head_split_by_hand() -> None:
    """TP 1 -> TP 2: rank 1 of the destination gets the second half of every token."""
    src = layout(num_kv_heads=2, head_dim=1, dtype="int8", num_layers=1, kv_factor=1)
    dst = layout(num_kv_heads=1, head_dim=1, dtype="int8", num_layers=1, kv_factor=1)
    local, remote = check_plan(src, [1], dst, [2], TpRank(0, 1), TpRank(1, 2))
    # Source block 1: tokens of 2 bytes (heads 0, 1); head 1 is byte 1 of each token.
    assert rows(local) == [(SRC_BASE + 4 + 1, 1), (SRC_BASE + 4 + 3, 1)]
    assert rows(remote) == [(DST_BASE + 4, 1), (DST_BASE + 5, 1)]


def test_same_heads_in_ranks_of_equal_size_take_the_whole_block_path() -> None:
    lay = layout()
    local, _remote = check_plan(lay, [1, 2], lay, [4, 5], TpRank(1, 2), TpRank(1, 2))
    assert rows(local) == [(SRC_BASE + lay.block_bytes, 2 * lay.block_bytes)]


def test_unmappable_tensor_parallel_pools_are_refused() -> None:
    with pytest.raises(LayoutError, match="incompatible KV geometry"):
        plan_write(layout(), 0, [0], layout(), 0, [0], TpRank(0, 1), TpRank(1, 2))


def test_a_legs_pair_check_is_the_one_block_plans_and_made_once_per_pair() -> None:
    from kvxferd.transceiver.leg_targets import _pair_problem

    def pool(heads: int, blocks: int) -> KvLayout:
        return KvLayout(2, 2, heads, 64, 16, "float16", BLOCK_MAJOR, blocks)

    ctx, gen = pool(4, 8), pool(2, 5)
    assert _pair_problem(ctx, TpRank(0, 1), gen, TpRank(1, 2)) is None
    # A 3-head pool cannot be rank 0 of 2 of a 4-head model: the one-block plan's own words.
    with pytest.raises(LayoutError) as raised:
        plan_write(ctx, 0, [0], pool(3, 5), 0, [0], TpRank(0, 1), TpRank(0, 2))
    assert _pair_problem(ctx, TpRank(0, 1), pool(3, 5), TpRank(0, 2)) == str(raised.value)
    # Kept by the identity of its arguments: the same objects again make no new entry; equal
    # ones that are other objects are answered afresh, alike.
    ctx_tp, gen_tp, other = TpRank(0, 1), TpRank(1, 2), pool(2, 5)
    entries = len(_pair_problem)  # type: ignore[arg-type]
    for _ in range(3):
        assert _pair_problem(ctx, ctx_tp, other, gen_tp) is None
    assert len(_pair_problem) == entries + 1  # type: ignore[arg-type]
    assert _pair_problem(ctx, TpRank(0, 1), pool(2, 5), TpRank(1, 2)) is None
