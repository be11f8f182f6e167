"""kvxferd.memory.layout against references written here: offsets from the documented
formulas, segments applied to byte arrays, and the validation edge cases.

The reference for a layout of any order is the stride of each dimension, computed here
from the order (head_dim bytes innermost); every segment result is checked by carrying it
out on bytes: the requested blocks arrive, every other byte stays as it was.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from layout_harness import block_id_lists, tiny_layout

from kvxferd.memory import layout as layout_mod
from kvxferd.memory.layout import (
    BLOCK_MAJOR,
    DIMS,
    LAYER_MAJOR,
    KvLayout,
    LayoutError,
    block_runs,
    pair_segments,
    paired_blocks,
    parse_order,
)

ORDERS = [
    BLOCK_MAJOR,
    LAYER_MAJOR,
    "layer,block,head,kv,token",
    "block,kv,layer,head,token",
    "token,head,kv,layer,block",
    "kv,block,token,layer,head",
]


def lay(major: str = BLOCK_MAJOR, **kw: Any) -> KvLayout:
    """tiny_layout with 2 heads and 3 tokens per block: token 8 bytes, piece 24, block 96,
    pool 384."""
    return tiny_layout(**{"num_kv_heads": 2, "tokens_per_block": 3, "major": major, **kw})


def ref_strides(layout: KvLayout, order: tuple[str, ...]) -> dict[str, int]:
    sizes = {
        "block": layout.num_blocks,
        "layer": layout.num_layers,
        "kv": layout.kv_factor,
        "token": layout.tokens_per_block,
        "head": layout.num_kv_heads,
    }
    unit = layout.head_dim * DTYPE[layout.dtype]
    return {d: unit * math.prod(sizes[e] for e in order[order.index(d) + 1 :]) for d in order}


DTYPE = {"float16": 2, "bfloat16": 2, "float32": 4, "float8": 1, "int8": 1}


def ref_offset(
    layout: KvLayout, order: tuple[str, ...], b: int, la: int, k: int, t: int, h: int
) -> int:
    s = ref_strides(layout, order)
    return b * s["block"] + la * s["layer"] + k * s["kv"] + t * s["token"] + h * s["head"]


def block_bytes_set(layout: KvLayout, order: tuple[str, ...], blocks: list[int]) -> list[int]:
    unit = layout.head_dim * DTYPE[layout.dtype]
    out = []
    for b in blocks:
        for la in range(layout.num_layers):
            for k in range(layout.kv_factor):
                for t in range(layout.tokens_per_block):
                    for h in range(layout.num_kv_heads):
                        o = ref_offset(layout, order, b, la, k, t, h)
                        out.extend(range(o, o + unit))
    return out


def rows(a: npt.NDArray[np.int64]) -> list[tuple[int, int]]:
    return [(int(x), int(y)) for x, y in a.tolist()]


# -- orders ----------------------------------------------------------------------------------


def test_parse_order() -> None:
    assert parse_order(BLOCK_MAJOR) == ("block", "layer", "kv", "token", "head")
    assert parse_order(LAYER_MAJOR) == ("layer", "kv", "block", "token", "head")
    assert parse_order(" layer, block ,head,kv,token") == ("layer", "block", "head", "kv", "token")
    assert parse_order("block,layer,kv,token") is None
    assert parse_order("block,layer,kv,token,head,head") is None
    assert parse_order("block,block,kv,token,head") is None
    assert parse_order("row-major") is None


def test_an_explicit_order_that_a_name_stands_for_is_that_name() -> None:
    assert lay("block,layer,kv,token,head").major == BLOCK_MAJOR
    assert lay("layer, kv, block, token, head").major == LAYER_MAJOR
    other = lay("layer,block,head,kv,token")
    assert other.major == "layer,block,head,kv,token"
    assert not other.named and lay().named and lay(LAYER_MAJOR).named
    assert other.order == ("layer", "block", "head", "kv", "token")
    assert lay().order == ("block", "layer", "kv", "token", "head")


# -- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field", ["num_layers", "num_kv_heads", "head_dim", "tokens_per_block", "num_blocks"]
)
@pytest.mark.parametrize("value", [2.0, "2", True, None])
def test_integer_fields_refuse_non_integers(field: str, value: Any) -> None:
    with pytest.raises(
        LayoutError,
        match=rf"^invalid KV layout: {field} must be an integer, got {re.escape(repr(value))}$",
    ):
        lay(**{field: value})


@pytest.mark.parametrize(
    "field",
    ["num_layers", "kv_factor", "num_kv_heads", "head_dim", "tokens_per_block", "num_blocks"],
)
@pytest.mark.parametrize("value", [0, -1])
def test_integer_fields_must_be_positive(field: str, value: int) -> None:
    with pytest.raises(LayoutError, match=rf"{field} must be positive, got {value}"):
        lay(**{field: value})


def test_kv_factor_is_one_or_two() -> None:
    assert lay(kv_factor=1).pieces_per_block == 2
    with pytest.raises(
        LayoutError,
        match=r"^invalid KV layout: kv_factor must be 2 \(K and V\) or 1 \(MLA\), got 3$",
    ):
        lay(kv_factor=3)
    with pytest.raises(LayoutError, match=r"kv_factor must be an integer, got 2\.0$"):
        lay(kv_factor=2.0)


@pytest.mark.parametrize("dtype", ["float64", "", None, 2])
def test_unknown_dtypes_are_refused(dtype: Any) -> None:
    with pytest.raises(
        LayoutError,
        match=r"dtype must be one of float16, bfloat16, float32, float8, int8, "
        + rf"got {re.escape(repr(dtype))}$",
    ):
        lay(dtype=dtype)


@pytest.mark.parametrize("major", ["row-major", "block,layer,kv,token", None, 3])
def test_unknown_majors_are_refused(major: Any) -> None:
    with pytest.raises(
        LayoutError,
        match=r"major must be block-major or layer-major, or the dimensions "
        r"block,layer,kv,token,head",
    ):
        lay(major=major)


def test_every_problem_is_reported_together() -> None:
    with pytest.raises(LayoutError) as info:
        lay(num_layers=0, head_dim="x", dtype="f", major="m")
    text = str(info.value)
    assert text.startswith(
        "invalid KV layout: num_layers must be positive, got 0; head_dim must be"
    )
    assert "; dtype must be" in text and "; major must be" in text


def test_pool_size_limit_is_inclusive() -> None:
    one_byte = dict(
        num_layers=1, kv_factor=1, num_kv_heads=1, head_dim=1, tokens_per_block=1, dtype="int8"
    )
    assert KvLayout(**one_byte, major=BLOCK_MAJOR, num_blocks=1 << 60).pool_bytes == 1 << 60
    with pytest.raises(
        LayoutError,
        match=rf"pool of {(1 << 60) + 1} bytes exceeds the supported maximum of {1 << 60} bytes",
    ):
        KvLayout(**one_byte, major=BLOCK_MAJOR, num_blocks=(1 << 60) + 1)


def test_numpy_integers_become_plain_ints_and_the_layout_is_frozen() -> None:
    layout = lay(num_blocks=np.int64(4), num_layers=np.int32(2))
    assert type(layout.num_blocks) is int and type(layout.num_layers) is int
    assert layout == lay() and hash(layout) == hash(lay())
    with pytest.raises(AttributeError):
        layout.num_blocks = 5  # type: ignore[misc]


# -- sizes and strides -----------------------------------------------------------------------


def test_sizes() -> None:
    layout = lay(dtype="float32", num_blocks=5)
    assert layout.itemsize == 4
    assert layout.token_bytes == 2 * 2 * 4
    assert layout.piece_bytes == 3 * 16
    assert layout.pieces_per_block == 4
    assert layout.block_bytes == 4 * 48
    assert layout.pool_bytes == 5 * 192
    assert [
        lay(dtype=d).itemsize for d in ("float16", "bfloat16", "float32", "float8", "int8")
    ] == [2, 2, 4, 1, 1]


@pytest.mark.parametrize("major", ORDERS)
def test_strides_match_the_order(major: str) -> None:
    layout = lay(major, kv_factor=1, num_blocks=5, dtype="float32")
    assert layout.strides() == ref_strides(layout, layout.order)


@pytest.mark.parametrize("major", ORDERS)
def test_the_logical_view_reads_every_byte_where_the_order_puts_it(major: str) -> None:
    layout = lay(major, num_blocks=3)
    order = layout.order
    pool = np.arange(layout.pool_bytes + 7, dtype=np.int64).astype(np.uint8)  # longer than the pool
    view = layout.logical_view(pool)
    assert view.shape == (3, 2, 2, 3, 2, 4)
    for b, la, k, t, h in [(0, 0, 0, 0, 0), (2, 1, 1, 2, 1), (1, 0, 1, 2, 0), (2, 1, 0, 1, 1)]:
        o = ref_offset(layout, order, b, la, k, t, h)
        assert view[b, la, k, t, h].tolist() == [(o + i) % 256 for i in range(4)]
    view[2, 1, 1, 2, 1, 3] = 77  # a view, writeable, onto the pool itself
    assert pool[ref_offset(layout, order, 2, 1, 1, 2, 1) + 3] == 77


def test_named_orders_match_the_documented_formulas() -> None:
    layout = lay(num_blocks=3)
    p = layout.piece_bytes
    lm = lay(LAYER_MAJOR, num_blocks=3)
    for b in range(3):
        for la in range(2):
            for k in range(2):
                assert (
                    ref_offset(layout, layout.order, b, la, k, 0, 0)
                    == b * layout.block_bytes + (la * 2 + k) * p
                )
                assert ref_offset(lm, lm.order, b, la, k, 0, 0) == ((la * 2 + k) * 3 + b) * p


# -- wire ------------------------------------------------------------------------------------


@pytest.mark.parametrize("major", ORDERS)
def test_wire_round_trip(major: str) -> None:
    layout = lay(major)
    wire = layout.to_wire()
    assert wire == {
        "num_layers": 2,
        "kv_factor": 2,
        "num_kv_heads": 2,
        "head_dim": 2,
        "tokens_per_block": 3,
        "dtype": "float16",
        "major": layout.major,
        "num_blocks": 4,
    }
    assert KvLayout.from_wire(wire) == layout


def test_bad_wire_forms() -> None:
    wire: dict[str, Any] = lay().to_wire()
    with pytest.raises(LayoutError, match=r"^KV layout must be a mapping, got list$"):
        KvLayout.from_wire([1])
    with pytest.raises(LayoutError, match=r"^invalid KV layout: missing field\(s\) dtype, major$"):
        KvLayout.from_wire({k: v for k, v in wire.items() if k not in ("dtype", "major")})
    with pytest.raises(LayoutError, match=r"^invalid KV layout: unknown field\(s\) a, z$"):
        KvLayout.from_wire({**wire, "z": 1, "a": 2})
    with pytest.raises(
        LayoutError, match=r"^invalid KV layout: missing field\(s\) dtype; unknown field\(s\) x$"
    ):
        KvLayout.from_wire({**{k: v for k, v in wire.items() if k != "dtype"}, "x": 0})
    for bad in (np.int64(4), 4.0, True):
        with pytest.raises(
            LayoutError,
            match=r"^invalid KV layout: num_blocks must be an integer, "
            + rf"got {re.escape(repr(bad))}$",
        ):
            KvLayout.from_wire({**wire, "num_blocks": bad})
    with pytest.raises(LayoutError, match="dtype must be one of"):
        KvLayout.from_wire({**wire, "dtype": "float64"})


# -- geometry --------------------------------------------------------------------------------


def test_same_geometry_names_each_difference_and_ignores_major_and_count() -> None:
    assert lay().same_geometry(lay(LAYER_MAJOR, num_blocks=9)) == []
    other = lay(
        num_layers=3, kv_factor=1, num_kv_heads=4, head_dim=1, tokens_per_block=2, dtype="int8"
    )
    assert lay().same_geometry(other) == [
        "num_layers: 2 here, 3 there",
        "kv_factor: 2 here, 1 there",
        "num_kv_heads: 2 here, 4 there",
        "head_dim: 2 here, 1 there",
        "tokens_per_block: 3 here, 2 there",
        "dtype: float16 here, int8 there",
    ]
    assert "num_kv_heads: 2 here, 4 there" not in lay().same_geometry(other, heads=False)
    assert len(lay().same_geometry(other, heads=False)) == 5
    assert lay().same_geometry(lay(num_kv_heads=4), heads=False) == []


def test_pools_with_different_num_kv_heads_are_not_paired() -> None:
    with pytest.raises(
        LayoutError,
        match=r"^source and destination pools have different KV geometry: "
        r"num_kv_heads: 2 here, 1 there$",
    ):
        pair_segments(lay(), [0], lay(num_kv_heads=1), [0])


# -- block ids -------------------------------------------------------------------------------


def test_check_blocks_accepts_every_integer_form_in_order() -> None:
    layout = lay()
    for blocks in (
        [3, 0, 2],
        (3, 0, 2),
        np.array([3, 0, 2], dtype=np.uint8),
        [np.int32(3), 0, np.int64(2)],
    ):
        ids = layout.check_blocks(blocks)
        assert ids.dtype == np.int64 and ids.tolist() == [3, 0, 2]
    assert layout.check_blocks(range(1, 4)).tolist() == [1, 2, 3]
    assert layout.check_blocks(np.array([3], dtype=object)).tolist() == [3]
    for empty in ([], (), np.zeros(0, dtype=np.float64), range(0)):
        ids = layout.check_blocks(empty)
        assert ids.dtype == np.int64 and ids.shape == (0,)
    assert layout.check_blocks([0, 1, 2, 3]).tolist() == [0, 1, 2, 3]  # the last id is valid


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        ([0, True], r"^block id True at position 1 is not an integer$"),
        ([1.0], r"^block id 1.0 at position 0 is not an integer$"),
        (["1"], r"^block id '1' at position 0 is not an integer$"),
        (
            [0, 4],
            r"^block id 4 at position 1 is out of range: the pool has 4 blocks \(valid ids 0..3\)$",
        ),
        ([2, -1, 9], r"^block id -1 at position 1 is out of range"),
        (np.array([0, 5]), r"^block id 5 at position 1 is out of range"),
        (
            np.array([2**70], dtype=object),
            r"^block id 1180591620717411303424 at position 0 is out of range",
        ),
        ([2**70], r"at position 0 is out of range"),
        (np.array([[0, 1]]), r"^block ids must be a 1-D sequence, got shape \(1, 2\)$"),
        (np.array([0.0, 1.0]), r"^block ids must be integers, got an array of float64$"),
        (np.array([True]), r"^block ids must be integers, got an array of bool$"),
        ([1, 2, 1], r"^block id 1 at position 2 repeats the one at position 0$"),
        ([3, 0, 2, 0, 3], r"^block id 0 at position 3 repeats the one at position 1$"),
        (np.array([2, 2]), r"^block id 2 at position 1 repeats the one at position 0$"),
    ],
)
def test_check_blocks_names_the_first_bad_id(blocks: Any, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        lay().check_blocks(blocks)


@settings(max_examples=150, deadline=None)
@given(block_id_lists(12, 2, 10))
def test_check_blocks_matches_the_reference(case: tuple[int, list[int]]) -> None:
    n, blocks = case
    layout = lay(num_blocks=n)
    if all(0 <= b < n for b in blocks) and len(set(blocks)) == len(blocks):
        assert layout.check_blocks(blocks).tolist() == blocks
        assert layout.check_blocks(np.array(blocks, dtype=np.int64)).tolist() == blocks
    else:
        with pytest.raises(LayoutError):
            layout.check_blocks(blocks)
        with pytest.raises(LayoutError):
            layout.check_blocks(np.array(blocks, dtype=np.int64))


def test_paired_blocks_need_equal_counts() -> None:
    s, d = paired_blocks(lay(), [0, 1], lay(num_blocks=9), [8, 7])
    assert s.tolist() == [0, 1] and d.tolist() == [8, 7]
    with pytest.raises(
        LayoutError, match=r"^2 source blocks cannot be paired with 1 destination blocks$"
    ):
        paired_blocks(lay(), [0, 1], lay(), [0])
    with pytest.raises(LayoutError, match="out of range"):
        paired_blocks(lay(), [0], lay(num_blocks=2), [2])


# -- pieces and block segments ---------------------------------------------------------------


@pytest.mark.parametrize("major", [BLOCK_MAJOR, LAYER_MAJOR])
def test_piece_offsets_both_ways(major: str) -> None:
    layout = lay(major, num_blocks=5)
    blocks = np.array([4, 0, 2], dtype=np.int64)
    want = [
        [ref_offset(layout, layout.order, b, r // 2, r % 2, 0, 0) for r in range(4)]
        for b in blocks.tolist()
    ]
    first = layout.piece_offsets(blocks, block_first=True)
    assert first.shape == (3, 4) and first.tolist() == want
    second = layout.piece_offsets(blocks, block_first=False)
    assert second.shape == (4, 3) and second.tolist() == np.array(want).T.tolist()
    assert second.flags.c_contiguous


def test_piece_offsets_need_a_named_order() -> None:
    with pytest.raises(LayoutError, match="has no contiguous"):
        lay("layer,block,head,kv,token").piece_offsets(np.array([0]), block_first=True)


def test_block_major_segments_coalesce_runs_in_the_given_order() -> None:
    layout = lay(num_blocks=8)
    bb = layout.block_bytes
    assert rows(layout.block_segments([2, 3, 4, 0, 7, 6])) == [
        (2 * bb, 3 * bb),
        (0, bb),
        (7 * bb, bb),
        (6 * bb, bb),
    ]
    assert layout.block_segments([]).shape == (0, 2)


def test_layer_major_segments_are_region_by_region_and_merge_across_regions() -> None:
    layout = lay(LAYER_MAJOR, num_blocks=3)
    p = layout.piece_bytes
    assert rows(layout.block_segments([1])) == [(r * 3 * p + p, p) for r in range(4)]
    # The last block of region r and the first of region r + 1 are adjacent: one run.
    assert rows(layout.block_segments([0, 2])) == [
        (0, p),
        (2 * p, 2 * p),
        (5 * p, 2 * p),
        (8 * p, 2 * p),
        (11 * p, p),
    ]
    assert rows(layout.block_segments([2, 0])) == [(o * p, p) for o in (2, 0, 5, 3, 8, 6, 11, 9)]
    assert rows(layout.block_segments([0, 1, 2])) == [(0, 12 * p)]


def test_an_explicit_order_segments_by_hand() -> None:
    # vLLM's CPU order: per layer one tensor; per block, per head, K then V rows of tokens.
    layout = lay("layer,block,head,kv,token", num_blocks=3)
    # Inside (layer, block) all heads, kv and tokens are contiguous: 2 * 2 * 3 * 4 = 48 bytes.
    assert rows(layout.block_segments([1])) == [(48, 48), (3 * 48 + 48, 48)]
    assert rows(layout.block_segments([0, 1])) == [(0, 96), (144, 96)]
    assert rows(layout.block_segments([2, 0, 1])) == [(96, 48), (0, 96), (240, 48), (144, 96)]


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(ORDERS), st.data())
def test_block_segments_cover_exactly_the_blocks(major: str, data: st.DataObject) -> None:
    layout = lay(
        major,
        num_layers=data.draw(st.integers(1, 3)),
        kv_factor=data.draw(st.sampled_from([1, 2])),
        num_kv_heads=data.draw(st.integers(1, 2)),
        tokens_per_block=data.draw(st.integers(1, 3)),
        num_blocks=data.draw(st.integers(1, 6)),
    )
    blocks = data.draw(st.permutations(range(layout.num_blocks)))[
        : data.draw(st.integers(0, layout.num_blocks))
    ]
    segs = layout.block_segments(blocks)
    assert segs.dtype == np.int64 and segs.shape[1:] == (2,)
    covered = [o for off, n in segs.tolist() for o in range(off, off + n)]
    assert sorted(covered) == sorted(block_bytes_set(layout, layout.order, list(blocks)))
    for j in range(1, segs.shape[0]):
        assert segs[j, 0] != segs[j - 1, 0] + segs[j - 1, 1], "adjacent rows left unmerged"


# -- pairing ---------------------------------------------------------------------------------


def test_coalesce_of_nothing_is_two_distinct_empty_arrays() -> None:
    a, b = layout_mod._coalesce(np.zeros(0, np.int64), np.zeros(0, np.int64), 8)
    assert a.shape == (0, 2) and b.shape == (0, 2) and a.dtype == np.int64
    assert a is not b


def test_coalesce_merges_only_what_continues_on_both_sides() -> None:
    src = np.array([0, 8, 16, 40, 48], dtype=np.int64)
    dst = np.array([100, 108, 200, 208, 216], dtype=np.int64)
    s, d = layout_mod._coalesce(src, dst, 8)
    assert rows(s) == [(0, 16), (16, 8), (40, 16)]
    assert rows(d) == [(100, 16), (200, 8), (208, 16)]


def test_pair_segments_by_hand() -> None:
    b, lm = lay(num_blocks=4), lay(LAYER_MAJOR, num_blocks=4)
    bb, p = b.block_bytes, b.piece_bytes
    s, d = pair_segments(b, [0, 1, 3], b, [1, 2, 0])
    assert rows(s) == [(0, 2 * bb), (3 * bb, bb)] and rows(d) == [(bb, 2 * bb), (0, bb)]
    s, d = pair_segments(lm, [0, 1], lm, [2, 3])
    assert rows(s) == [(r * 4 * p, 2 * p) for r in range(4)]
    assert rows(d) == [(r * 4 * p + 2 * p, 2 * p) for r in range(4)]
    s, d = pair_segments(b, [1], lm, [2])  # mixed: piece by piece in the source's order
    assert rows(s) == [(bb + r * p, p) for r in range(4)]
    assert rows(d) == [(r * 4 * p + 2 * p, p) for r in range(4)]
    s, d = pair_segments(lm, [2], b, [1])
    assert rows(s) == [(r * 4 * p + 2 * p, p) for r in range(4)]
    assert rows(d) == [(bb + r * p, p) for r in range(4)]


def test_pairing_refuses_counts_ids_and_geometry() -> None:
    with pytest.raises(LayoutError, match="cannot be paired"):
        pair_segments(lay(), [0, 1], lay(), [1])
    with pytest.raises(LayoutError, match=r"block id 4 at position 0 is out of range"):
        pair_segments(lay(), [0], lay(), [4])
    with pytest.raises(LayoutError, match=r"tokens_per_block: 3 here, 2 there"):
        pair_segments(lay("layer,block,head,kv,token"), [0], lay(tokens_per_block=2), [0])


@st.composite
def pairing(draw: st.DrawFn) -> tuple[KvLayout, list[int], KvLayout, list[int], int]:
    geo = dict(
        num_layers=draw(st.integers(1, 3)),
        kv_factor=draw(st.sampled_from([1, 2])),
        num_kv_heads=draw(st.integers(1, 2)),
        head_dim=draw(st.integers(1, 2)),
        tokens_per_block=draw(st.integers(1, 3)),
        dtype=draw(st.sampled_from(["int8", "float16"])),
    )
    src = KvLayout(**geo, major=draw(st.sampled_from(ORDERS)), num_blocks=draw(st.integers(1, 6)))
    dst = KvLayout(**geo, major=draw(st.sampled_from(ORDERS)), num_blocks=draw(st.integers(1, 6)))
    n = draw(st.integers(0, min(src.num_blocks, dst.num_blocks)))
    if draw(st.booleans()):
        a, c = draw(st.integers(0, src.num_blocks - n)), draw(st.integers(0, dst.num_blocks - n))
        src_blocks, dst_blocks = list(range(a, a + n)), list(range(c, c + n))
    else:
        src_blocks = list(draw(st.permutations(range(src.num_blocks)))[:n])
        dst_blocks = list(draw(st.permutations(range(dst.num_blocks)))[:n])
    return src, src_blocks, dst, dst_blocks, draw(st.integers(0, 2**32 - 1))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pairing())
def test_pair_segments_move_exactly_the_requested_blocks(
    case: tuple[KvLayout, list[int], KvLayout, list[int], int],
) -> None:
    src, src_blocks, dst, dst_blocks, seed = case
    rng = np.random.default_rng(seed)
    src_pool = rng.integers(0, 256, src.pool_bytes, dtype=np.uint8)
    dst_pool = np.full(dst.pool_bytes, 0xC3, dtype=np.uint8)
    want = dst_pool.copy()
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        dst.logical_view(want)[d] = src.logical_view(src_pool)[s]
    local, remote = pair_segments(src, src_blocks, dst, dst_blocks)
    assert local.dtype == np.int64 and local.shape == remote.shape and local.shape[1:] == (2,)
    for (so, sn), (do, dn) in zip(local.tolist(), remote.tolist(), strict=True):
        assert sn == dn > 0
        assert so >= 0 and so + sn <= src.pool_bytes
        assert do >= 0 and do + dn <= dst.pool_bytes
        dst_pool[do : do + dn] = src_pool[so : so + sn]
    assert np.array_equal(dst_pool, want)
    assert int(local[:, 1].sum()) == len(src_blocks) * src.block_bytes
    # Runs are as long as both sides allow: no row continues the previous one on both sides.
    for j in range(1, local.shape[0]):
        assert not (
            local[j, 0] == local[j - 1, 0] + local[j - 1, 1]
            and remote[j, 0] == remote[j - 1, 0] + remote[j - 1, 1]
        )
    if src.major == dst.major and src.num_blocks == dst.num_blocks and src_blocks == dst_blocks:
        assert rows(local) == rows(remote)  # the same layout and blocks: the same rows


def test_dims_are_the_five_dimensions() -> None:
    assert DIMS == ("block", "layer", "kv", "token", "head")


@settings(max_examples=80, deadline=None)
@given(
    ids=st.lists(st.integers(0, 200), unique=True, max_size=150),
    cap=st.integers(1, 9),
    data=st.data(),
)
def test_block_runs_cover_every_block_once_in_runs_of_consecutive_ids(
    ids: list[int], cap: int, data: st.DataObject
) -> None:
    # Both ways of finding the runs (Python up to 64 ids, numpy beyond) and any share.
    start = data.draw(st.integers(0, len(ids)))
    end = data.draw(st.integers(start, len(ids)))
    arr = np.array(ids, dtype=np.int64)
    covered: list[int] = []
    for i, j, first in block_runs(arr, cap, start, end):
        assert 0 < j - i <= cap and first == ids[i]
        assert ids[i:j] == list(range(first, first + j - i))  # one slice of the pool
        covered.extend(range(i, j))
    assert covered == list(range(start, end))
    # A run is cut only where the ids jump or the cap is reached.
    runs = list(block_runs(arr, 10**6))
    for (_, j, _), (k, _, _) in itertools.pairwise(runs):
        assert ids[k] != ids[j - 1] + 1
