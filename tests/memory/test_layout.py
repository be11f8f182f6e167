"""KvLayout: validation, wire form, block -> segment math, source/destination pairing."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from layout_harness import MAJORS, count_calls, draw_blocks, draw_pools, geometries, tiny_layout

from kvxferd.errors import KvxferdError
from kvxferd.memory import (
    BLOCK_MAJOR,
    LAYER_MAJOR,
    KvLayout,
    LayoutError,
    pair_segments,
)


def layout(major: str = BLOCK_MAJOR, **kw: Any) -> KvLayout:
    """A tiny layout: 2 layers, K and V, 1 head of 2 fp16, 2 tokens per block, 4 blocks.

    token 4 bytes, piece 8 bytes, block 32 bytes, pool 128 bytes.
    """
    return tiny_layout(major=major, **kw)


def rows(segments: np.ndarray) -> list[tuple[int, int]]:
    return [(int(o), int(n)) for o, n in segments]


# -- sizes and validation --------------------------------------------------------------------


def test_sizes_of_a_typical_layout() -> None:
    lay = KvLayout(32, 2, 8, 128, 32, "bfloat16", BLOCK_MAJOR, 1000)
    assert lay.itemsize == 2
    assert lay.token_bytes == 8 * 128 * 2
    assert lay.piece_bytes == 32 * 2048
    assert lay.pieces_per_block == 64
    assert lay.block_bytes == 64 * 65536
    assert lay.pool_bytes == 1000 * 4 * 2**20


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"num_layers": 0}, "num_layers must be positive"),
        ({"head_dim": -3}, "head_dim must be positive"),
        ({"num_blocks": True}, "num_blocks must be an integer"),
        ({"tokens_per_block": 2.0}, "tokens_per_block must be an integer"),
        ({"kv_factor": 3}, "kv_factor must be 2 (K and V) or 1 (MLA)"),
        ({"dtype": "float64"}, "dtype must be one of"),
        ({"major": "row-major"}, "major must be block-major or layer-major"),
        ({"num_blocks": 2**62}, "exceeds the supported maximum"),
    ],
)
def test_invalid_layout_is_refused_with_the_field_named(
    change: dict[str, Any], needle: str
) -> None:
    with pytest.raises(LayoutError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        layout(**change)


def test_layout_error_is_a_kvxferd_error_and_a_value_error() -> None:
    with pytest.raises(KvxferdError):
        layout(num_layers=0)
    with pytest.raises(ValueError):
        layout(num_layers=0)


def test_numpy_integers_are_normalised_to_plain_ints() -> None:
    lay = layout(num_blocks=np.int64(4))
    assert type(lay.num_blocks) is int
    assert lay == layout()


# -- wire form -------------------------------------------------------------------------------


@pytest.mark.parametrize("major", [BLOCK_MAJOR, LAYER_MAJOR])
def test_wire_round_trip_through_json(major: str) -> None:
    lay = layout(major, kv_factor=1, dtype="int8", num_blocks=77)
    wire = json.loads(json.dumps(lay.to_wire()))
    assert KvLayout.from_wire(wire) == lay


@pytest.mark.parametrize(
    ("wire", "needle"),
    [
        ("not a dict", "must be a mapping"),
        ({k: v for k, v in layout().to_wire().items() if k != "dtype"}, "missing field.*dtype"),
        ({**layout().to_wire(), "stride": 5}, "unknown field.*stride"),
        ({**layout().to_wire(), "num_layers": "2"}, "num_layers must be an integer"),
        ({**layout().to_wire(), "num_layers": 2.0}, "num_layers must be an integer"),
        ({**layout().to_wire(), "num_layers": True}, "num_layers must be an integer"),
        ({**layout().to_wire(), "num_blocks": -1}, "num_blocks must be positive"),
        ({**layout().to_wire(), "dtype": "fp4"}, "dtype must be one of"),
        ({**layout().to_wire(), "major": None}, "major must be block-major or layer-major"),
    ],
)
def test_bad_wire_input_raises_layout_error(wire: object, needle: str) -> None:
    with pytest.raises(LayoutError, match=needle):
        KvLayout.from_wire(wire)


# -- geometry --------------------------------------------------------------------------------


def test_same_geometry_ignores_major_and_block_count() -> None:
    assert layout(BLOCK_MAJOR, num_blocks=4).same_geometry(layout(LAYER_MAJOR, num_blocks=9)) == []


def test_same_geometry_names_every_difference() -> None:
    diffs = layout().same_geometry(layout(head_dim=4, dtype="bfloat16", kv_factor=1))
    assert diffs == [
        "kv_factor: 2 here, 1 there",
        "head_dim: 2 here, 4 there",
        "dtype: float16 here, bfloat16 there",
    ]


# -- check_blocks ----------------------------------------------------------------------------


def test_check_blocks_returns_int64_in_the_given_order() -> None:
    ids = layout().check_blocks([3, 0, 2])
    assert ids.dtype == np.int64
    assert ids.tolist() == [3, 0, 2]
    assert layout().check_blocks(np.array([1, 2], dtype=np.uint8)).tolist() == [1, 2]
    assert layout().check_blocks([]).shape == (0,)


@pytest.mark.parametrize(
    ("blocks", "needle"),
    [
        ([0, 4, 9], "block id 4 at position 1 is out of range: the pool has 4 blocks"),
        ([1, -1], "block id -1 at position 1 is out of range"),
        (np.array([2, 7], dtype=np.uint64), "block id 7 at position 1 is out of range"),
        ([2, 1, 2, 1], "block id 2 at position 2 repeats the one at position 0"),
        ([0, 1.0], "block id 1.0 at position 1 is not an integer"),
        ([0, True], "block id True at position 1 is not an integer"),
        ([0, "1"], "block id '1' at position 1 is not an integer"),
        ([0, 2**70], "out of range"),
        ([[0, 1]], "not an integer"),
        (np.array([[0, 1]]), "1-D"),
        (np.array([0.0, 1.0]), "must be integers, got an array of float64"),
        (np.array([0, "x"], dtype=object), "block id .x. at position 1 is not an integer"),
        (np.array([0, 1], dtype=bool), "must be integers, got an array of bool"),
    ],
)
def test_check_blocks_names_the_first_bad_id(blocks: Any, needle: str) -> None:
    with pytest.raises(LayoutError, match=needle):
        layout().check_blocks(blocks)


# -- block_segments: hand-computed offsets ---------------------------------------------------


@pytest.mark.parametrize(
    ("blocks", "expected"),
    [
        ([1], [(32, 32)]),
        ([1, 2], [(32, 64)]),  # consecutive ids: one segment
        ([0, 1, 2, 3], [(0, 128)]),
        ([0, 2], [(0, 32), (64, 32)]),  # a gap splits
        ([2, 1], [(64, 32), (32, 32)]),  # reversed order is not merged
        ([3, 1, 2], [(96, 32), (32, 64)]),
        ([], []),
    ],
)
def test_block_major_segments(blocks: list[int], expected: list[tuple[int, int]]) -> None:
    assert rows(layout(BLOCK_MAJOR).block_segments(blocks)) == expected


@pytest.mark.parametrize(
    ("blocks", "expected"),
    [
        # Regions (l0,K) (l0,V) (l1,K) (l1,V) of 4 pieces of 8 bytes: region stride 32.
        ([1], [(8, 8), (40, 8), (72, 8), (104, 8)]),
        ([1, 2], [(8, 16), (40, 16), (72, 16), (104, 16)]),
        ([3, 0], [(24, 8), (0, 8), (56, 8), (32, 8), (88, 8), (64, 8), (120, 8), (96, 8)]),
        ([2, 3], [(16, 16), (48, 16), (80, 16), (112, 16)]),
        ([0, 1, 2, 3], [(0, 128)]),  # a run that fills its region continues into the next
    ],
)
def test_layer_major_segments(blocks: list[int], expected: list[tuple[int, int]]) -> None:
    assert rows(layout(LAYER_MAJOR).block_segments(blocks)) == expected


def test_segments_are_int64_pairs() -> None:
    segs = layout(LAYER_MAJOR).block_segments([0])
    assert segs.dtype == np.int64
    assert segs.shape == (4, 2)
    assert layout().block_segments([]).shape == (0, 2)


# -- pair_segments ---------------------------------------------------------------------------


def reference_offset(lay: KvLayout, block: int, layer: int, kv: int) -> int:
    """Piece offset straight from the layout's definition, one piece at a time."""
    r = layer * lay.kv_factor + kv
    if lay.major == BLOCK_MAJOR:
        return block * lay.block_bytes + r * lay.piece_bytes
    return (r * lay.num_blocks + block) * lay.piece_bytes


def reference_pairs(
    src: KvLayout, src_blocks: list[int], dst: KvLayout, dst_blocks: list[int]
) -> set[tuple[int, int]]:
    return {
        (reference_offset(src, s, layer, kv), reference_offset(dst, d, layer, kv))
        for s, d in zip(src_blocks, dst_blocks, strict=True)
        for layer in range(src.num_layers)
        for kv in range(src.kv_factor)
    }


def expand(src: np.ndarray, dst: np.ndarray, piece: int) -> list[tuple[int, int]]:
    """Split paired segments back into (src piece offset, dst piece offset)."""
    assert src.shape == dst.shape
    out: list[tuple[int, int]] = []
    for (so, sl), (do, dl) in zip(src.tolist(), dst.tolist(), strict=True):
        assert sl == dl and sl > 0 and sl % piece == 0
        out.extend((so + t * piece, do + t * piece) for t in range(sl // piece))
    return out


@st.composite
def pairings(draw: st.DrawFn) -> tuple[KvLayout, list[int], KvLayout, list[int]]:
    geo = draw(geometries(head_dim=3, dtypes=("int8", "float16", "float32")))
    src, dst = draw_pools(draw, geo, MAJORS, 8)
    n = draw(st.integers(0, min(src.num_blocks, dst.num_blocks)))
    # Runs of consecutive ids are common in practice: mix them with shuffles.
    src_blocks = draw_blocks(draw, src, n)
    dst_blocks = (
        draw_blocks(draw, dst, n)
        if draw(st.booleans())
        else list(range(dst.num_blocks - n, dst.num_blocks))
    )
    if draw(st.booleans()):
        src_blocks = list(range(n))
    return src, src_blocks, dst, dst_blocks


@settings(max_examples=400, deadline=None)
@given(pairings())
def test_pair_segments_matches_the_per_piece_reference(
    case: tuple[KvLayout, list[int], KvLayout, list[int]],
) -> None:
    src, src_blocks, dst, dst_blocks = case
    s, d = pair_segments(src, src_blocks, dst, dst_blocks)
    assert s.dtype == d.dtype == np.int64
    assert s.shape == d.shape and s.shape[1] == 2
    pieces = expand(s, d, src.piece_bytes)
    assert len(pieces) == len(set(pieces)), "a piece is copied twice"
    assert set(pieces) == reference_pairs(src, src_blocks, dst, dst_blocks)
    # Coalescing is maximal in output order: no two neighbours continue each other on both sides.
    for j in range(1, s.shape[0]):
        assert not (s[j, 0] == s[j - 1, 0] + s[j - 1, 1] and d[j, 0] == d[j - 1, 0] + d[j - 1, 1])


@pytest.mark.parametrize("src_major", [BLOCK_MAJOR, LAYER_MAJOR])
@pytest.mark.parametrize("dst_major", [BLOCK_MAJOR, LAYER_MAJOR])
def test_pair_segments_small_case_all_majors(src_major: str, dst_major: str) -> None:
    src, dst = layout(src_major), layout(dst_major, num_blocks=6)
    s, d = pair_segments(src, [2, 0], dst, [5, 1])
    assert sorted(expand(s, d, 8)) == sorted(reference_pairs(src, [2, 0], dst, [5, 1]))


def test_block_major_consecutive_ids_on_both_sides_give_one_pair() -> None:
    src = KvLayout(32, 2, 8, 128, 32, "float16", BLOCK_MAJOR, 1000)
    dst = KvLayout(32, 2, 8, 128, 32, "float16", BLOCK_MAJOR, 600)
    s, d = pair_segments(src, range(100, 350), dst, range(300, 550))
    assert rows(s) == [(100 * src.block_bytes, 250 * src.block_bytes)]
    assert rows(d) == [(300 * src.block_bytes, 250 * src.block_bytes)]


def test_coalescing_needs_contiguity_on_both_sides() -> None:
    # Source consecutive, destination split in two: two pairs, cut where the destination jumps.
    s, d = pair_segments(layout(), [0, 1, 2], layout(), [1, 2, 0])
    assert rows(s) == [(0, 64), (64, 32)]
    assert rows(d) == [(32, 64), (0, 32)]


def test_layer_major_pairs_are_region_by_region() -> None:
    s, d = pair_segments(layout(LAYER_MAJOR), [0, 1], layout(LAYER_MAJOR), [2, 3])
    assert rows(s) == [(0, 16), (32, 16), (64, 16), (96, 16)]
    assert rows(d) == [(16, 16), (48, 16), (80, 16), (112, 16)]


def test_geometry_mismatch_is_refused_with_the_difference() -> None:
    with pytest.raises(LayoutError, match=r"different KV geometry: head_dim: 2 here, 4 there"):
        pair_segments(layout(), [0], layout(head_dim=4), [0])


def test_block_count_mismatch_is_refused() -> None:
    with pytest.raises(LayoutError, match="2 source blocks cannot be paired with 1"):
        pair_segments(layout(), [0, 1], layout(), [0])


def test_bad_destination_id_is_refused() -> None:
    with pytest.raises(LayoutError, match="block id 4 at position 0"):
        pair_segments(layout(), [0], layout(), [4])


def test_pair_segments_is_vectorised() -> None:
    # 64k tokens, 32 tokens/block, 32 layers, K and V: 128k pieces. A Python loop over
    # pieces makes at least one Python or C call per piece; numpy makes a fixed number,
    # whatever the count. Calls are counted, not timed (a timing is a benchmark's job).
    lay_b = KvLayout(32, 2, 8, 128, 32, "float16", BLOCK_MAJOR, 4000)
    lay_l = KvLayout(32, 2, 8, 128, 32, "float16", LAYER_MAJOR, 4000)
    rng = np.random.default_rng(1)
    src_ids = rng.permutation(4000)[:2000]
    dst_ids = rng.permutation(4000)[:2000]
    for a, b in [(lay_b, lay_l), (lay_l, lay_l), (lay_l, lay_b)]:
        calls = count_calls(partial(pair_segments, a, src_ids, b, dst_ids))
        assert calls < 1000, f"{a.major} -> {b.major}: {calls} calls for 128k pieces"
