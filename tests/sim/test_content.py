"""Reference engine content: fill, verify, clear; and the segment math proved end to end."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from layout_harness import count_calls

from kvxferd.memory import BLOCK_MAJOR, LAYER_MAJOR, KvLayout, LayoutError, pair_segments
from kvxferd.sim.content import clear_blocks, fill_blocks, request_seed, verify_blocks

MAJORS = [BLOCK_MAJOR, LAYER_MAJOR]

# Geometries that exercise each code path: whole uint64 words per piece; pieces that are not
# (int8, 3-element heads: bytes path); MLA (kv_factor 1); blocks larger than the 1 MiB chunk
# of the verifier (walked a few regions at a time).
GEOMETRIES: dict[str, dict[str, Any]] = {
    "words": dict(num_layers=3, kv_factor=2, num_kv_heads=2, head_dim=4, tokens_per_block=4,
                  dtype="float16"),
    "bytes": dict(num_layers=2, kv_factor=2, num_kv_heads=1, head_dim=3, tokens_per_block=5,
                  dtype="int8"),
    "mla": dict(num_layers=4, kv_factor=1, num_kv_heads=1, head_dim=6, tokens_per_block=3,
                dtype="bfloat16"),
    "big-block": dict(num_layers=16, kv_factor=2, num_kv_heads=4, head_dim=64, tokens_per_block=64,
                      dtype="float32"),
}  # fmt: skip


def make(geometry: str, major: str, num_blocks: int = 12) -> tuple[KvLayout, np.ndarray]:
    lay = KvLayout(major=major, num_blocks=num_blocks, **GEOMETRIES[geometry])
    pool = np.full(lay.pool_bytes, 0xAB, dtype=np.uint8)
    return lay, pool


def piece_offset(lay: KvLayout, block: int, layer: int, kv: int) -> int:
    r = layer * lay.kv_factor + kv
    if lay.major == BLOCK_MAJOR:
        return block * lay.block_bytes + r * lay.piece_bytes
    return (r * lay.num_blocks + block) * lay.piece_bytes


def byte_of(lay: KvLayout, block: int, layer: int, kv: int, token: int, byte: int = 0) -> int:
    return piece_offset(lay, block, layer, kv) + token * lay.token_bytes + byte


SEED = request_seed("req-1")
BLOCKS = [7, 2, 3, 4, 0]  # a run (2, 3, 4) between jumps


# -- seeds -----------------------------------------------------------------------------------


def test_request_seed_is_stable_and_63_bit() -> None:
    assert request_seed("req-1") == request_seed("req-1")
    assert request_seed("req-1") != request_seed("req-2")
    assert all(0 <= request_seed(f"r{i}") < 2**63 for i in range(100))
    # Pinned: both sides of a transfer (other hosts, other Python builds) must agree.
    assert request_seed("req-1") == 0x05C3A52BEF2A2382


# -- fill / verify ---------------------------------------------------------------------------


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_fill_then_verify(geometry: str, major: str) -> None:
    lay, pool = make(geometry, major)
    before = pool.copy()
    fill_blocks(pool, lay, BLOCKS, SEED)
    result = verify_blocks(pool, lay, BLOCKS, SEED, len(BLOCKS) * lay.tokens_per_block)
    assert result.ok, result.first_mismatch
    assert result.first_mismatch is None
    assert result.bytes_checked == len(BLOCKS) * lay.block_bytes
    # Only the named blocks were written.
    others = [b for b in range(lay.num_blocks) if b not in BLOCKS]
    for b in others:
        for layer in range(lay.num_layers):
            for kv in range(lay.kv_factor):
                o = piece_offset(lay, b, layer, kv)
                assert np.array_equal(
                    pool[o : o + lay.piece_bytes], before[o : o + lay.piece_bytes]
                )


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_a_flipped_byte_is_found_and_located(geometry: str, major: str) -> None:
    lay, pool = make(geometry, major)
    fill_blocks(pool, lay, BLOCKS, SEED)
    logical, layer, kv = 3, lay.num_layers - 1, lay.kv_factor - 1
    token, byte = lay.tokens_per_block - 1, lay.token_bytes - 1
    pool[byte_of(lay, BLOCKS[logical], layer, kv, token, byte)] ^= 0x10
    result = verify_blocks(pool, lay, BLOCKS, SEED, len(BLOCKS) * lay.tokens_per_block)
    assert not result.ok
    assert result.first_mismatch is not None
    assert (
        f"logical block {logical} (physical block {BLOCKS[logical]}), layer {layer}, kv {kv}, "
        f"token {token}, byte {byte} of the token"
    ) in result.first_mismatch
    assert result.bytes_checked == len(BLOCKS) * lay.block_bytes


def test_the_first_mismatch_is_reported_when_there_are_several() -> None:
    lay, pool = make("words", BLOCK_MAJOR)
    fill_blocks(pool, lay, BLOCKS, SEED)
    pool[byte_of(lay, BLOCKS[4], 0, 0, 0)] ^= 1
    pool[byte_of(lay, BLOCKS[1], 2, 1, 3, 5)] ^= 1
    pool[byte_of(lay, BLOCKS[1], 2, 1, 3, 6)] ^= 1
    result = verify_blocks(pool, lay, BLOCKS, SEED, len(BLOCKS) * lay.tokens_per_block)
    assert result.first_mismatch is not None
    assert "logical block 1 (physical block 2), layer 2, kv 1, token 3, byte 5 " in (
        result.first_mismatch
    )


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("geometry", ["words", "bytes"])
def test_partial_last_block(geometry: str, major: str) -> None:
    lay, pool = make(geometry, major)
    fill_blocks(pool, lay, BLOCKS, SEED)
    tail = 2  # tokens used in the last block
    num_tokens = (len(BLOCKS) - 1) * lay.tokens_per_block + tail
    last = BLOCKS[-1]
    layer, kv = lay.num_layers - 1, lay.kv_factor - 1

    # Past num_tokens: scribbled on, not checked.
    for t in range(tail, lay.tokens_per_block):
        pool[byte_of(lay, last, layer, kv, t)] ^= 0xFF
    result = verify_blocks(pool, lay, BLOCKS, SEED, num_tokens)
    assert result.ok, result.first_mismatch
    checked_tail = tail * lay.token_bytes * lay.pieces_per_block
    assert result.bytes_checked == (len(BLOCKS) - 1) * lay.block_bytes + checked_tail

    # The last byte before num_tokens is checked.
    pool[byte_of(lay, last, layer, kv, tail - 1, lay.token_bytes - 1)] ^= 0x01
    result = verify_blocks(pool, lay, BLOCKS, SEED, num_tokens)
    assert not result.ok
    where = (
        f"logical block {len(BLOCKS) - 1} (physical block {last}), layer {layer}, kv {kv}, "
        f"token {tail - 1}, byte {lay.token_bytes - 1} of the token"
    )
    assert where in str(result.first_mismatch)


def test_block_count_must_match_num_tokens() -> None:
    lay, pool = make("words", BLOCK_MAJOR)
    fill_blocks(pool, lay, BLOCKS, SEED)
    tpb = lay.tokens_per_block
    with pytest.raises(LayoutError, match=f"{4 * tpb} tokens .* need 4 blocks, got 5"):
        verify_blocks(pool, lay, BLOCKS, SEED, 4 * tpb)
    with pytest.raises(LayoutError, match="need 6 blocks, got 5"):
        verify_blocks(pool, lay, BLOCKS, SEED, 5 * tpb + 1)
    assert verify_blocks(pool, lay, [], SEED, 0).ok


def test_pool_of_the_wrong_size_or_type_is_refused() -> None:
    lay, pool = make("words", BLOCK_MAJOR)
    with pytest.raises(LayoutError, match="the layout needs"):
        fill_blocks(pool[:-1], lay, [0], SEED)
    with pytest.raises(LayoutError, match="uint8"):
        fill_blocks(pool.view(np.uint16), lay, [0], SEED)  # type: ignore[arg-type]


# -- content identifies its place ------------------------------------------------------------


def test_content_differs_between_requests() -> None:
    lay, pool = make("words", BLOCK_MAJOR)
    fill_blocks(pool, lay, BLOCKS, request_seed("req-A"))
    result = verify_blocks(pool, lay, BLOCKS, request_seed("req-B"), 5 * lay.tokens_per_block)
    assert not result.ok
    assert "logical block 0 " in str(result.first_mismatch)


@pytest.mark.parametrize("major", MAJORS)
def test_a_misplaced_block_is_detected(major: str) -> None:
    lay, pool = make("words", major)
    fill_blocks(pool, lay, BLOCKS, SEED)
    swapped = [BLOCKS[0], BLOCKS[2], BLOCKS[1], *BLOCKS[3:]]
    result = verify_blocks(pool, lay, swapped, SEED, 5 * lay.tokens_per_block)
    assert not result.ok
    assert "logical block 1 " in str(result.first_mismatch)


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize(
    ("a", "b"),
    [((0, 0), (1, 0)), ((1, 0), (1, 1)), ((2, 1), (0, 0))],  # (layer, kv): layers, K/V
)
def test_swapped_pieces_are_detected(major: str, a: tuple[int, int], b: tuple[int, int]) -> None:
    lay, pool = make("words", major)
    fill_blocks(pool, lay, BLOCKS, SEED)
    pa, pb = piece_offset(lay, BLOCKS[2], *a), piece_offset(lay, BLOCKS[2], *b)
    n = lay.piece_bytes
    pool[pa : pa + n], pool[pb : pb + n] = pool[pb : pb + n].copy(), pool[pa : pa + n].copy()
    result = verify_blocks(pool, lay, BLOCKS, SEED, 5 * lay.tokens_per_block)
    assert not result.ok
    first = min(a, b)
    where = f"logical block 2 (physical block {BLOCKS[2]}), layer {first[0]}, kv {first[1]}, "
    assert where + "token 0, " in str(result.first_mismatch)


def test_tokens_shifted_within_a_piece_are_detected() -> None:
    lay, pool = make("words", LAYER_MAJOR)
    fill_blocks(pool, lay, BLOCKS, SEED)
    o, t = piece_offset(lay, BLOCKS[0], 1, 1), lay.token_bytes
    pool[o + t : o + lay.piece_bytes] = pool[o : o + lay.piece_bytes - t].copy()
    result = verify_blocks(pool, lay, BLOCKS, SEED, 5 * lay.tokens_per_block)
    assert "logical block 0 (physical block 7), layer 1, kv 1, token 1," in str(
        result.first_mismatch
    )


# -- clear -----------------------------------------------------------------------------------


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("geometry", ["words", "bytes"])
def test_clear_zeroes_exactly_the_named_blocks(geometry: str, major: str) -> None:
    lay, pool = make(geometry, major)
    everything = list(range(lay.num_blocks))
    fill_blocks(pool, lay, everything, SEED)
    clear_blocks(pool, lay, BLOCKS)
    for b in everything:
        for layer in range(lay.num_layers):
            for kv in range(lay.kv_factor):
                o = piece_offset(lay, b, layer, kv)
                zero = not pool[o : o + lay.piece_bytes].any()
                assert zero == (b in BLOCKS), (b, layer, kv)
    assert not verify_blocks(pool, lay, BLOCKS, SEED, 5 * lay.tokens_per_block).ok


# -- end to end: pair_segments moves the right bytes -----------------------------------------


@pytest.mark.parametrize("dst_major", MAJORS)
@pytest.mark.parametrize("src_major", MAJORS)
@pytest.mark.parametrize("geometry", ["words", "bytes", "mla"])
def test_copying_paired_segments_delivers_the_request(
    geometry: str, src_major: str, dst_major: str
) -> None:
    src, src_pool = make(geometry, src_major, num_blocks=10)
    dst, dst_pool = make(geometry, dst_major, num_blocks=16)
    src_blocks = [4, 5, 6, 1, 9, 0]
    dst_blocks = [10, 11, 3, 2, 15, 7]
    seed = request_seed("e2e")
    num_tokens = 5 * src.tokens_per_block + 1
    fill_blocks(src_pool, src, src_blocks, seed)
    clear_blocks(dst_pool, dst, dst_blocks)
    assert not verify_blocks(dst_pool, dst, dst_blocks, seed, num_tokens).ok

    s, d = pair_segments(src, src_blocks, dst, dst_blocks)
    for (so, n), (do, _) in zip(s.tolist(), d.tolist(), strict=True):
        dst_pool[do : do + n] = src_pool[so : so + n]

    result = verify_blocks(dst_pool, dst, dst_blocks, seed, num_tokens)
    assert result.ok, result.first_mismatch
    # Blocks outside the transfer kept their bytes.
    untouched = [b for b in range(dst.num_blocks) if b not in dst_blocks]
    for b in untouched:
        o = piece_offset(dst, b, 0, 0)
        assert (dst_pool[o : o + dst.piece_bytes] == 0xAB).all()


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("geometry", ["words", "big-block"])
def test_long_requests_of_runs_and_jumps_are_checked_run_by_run(geometry: str, major: str) -> None:
    # 80 blocks (found in numpy, past the Python loop's 64) in runs of 1 to 9 with jumps
    # between them; big-block's 2 MiB blocks cut every run into one-block chunks.
    num_blocks = 160 if geometry == "words" else 24
    lay, pool = make(geometry, major, num_blocks)
    order = np.random.default_rng(5).permutation(num_blocks // 8) * 8
    blocks = [
        int(b + i)
        for b, n in zip(order, [1, 9, 3, 7, 2] * 4, strict=False)
        for i in range(min(n, 8))
    ]
    fill_blocks(pool, lay, blocks, SEED)
    tokens = len(blocks) * lay.tokens_per_block
    assert verify_blocks(pool, lay, blocks, SEED, tokens).ok
    logical = len(blocks) - 3  # inside the last runs
    pool[byte_of(lay, blocks[logical], 0, 0, 1, 2)] ^= 0x40
    result = verify_blocks(pool, lay, blocks, SEED, tokens)
    assert result.first_mismatch is not None
    assert f"logical block {logical} (physical block {blocks[logical]}), layer 0, kv 0, " in (
        result.first_mismatch
    )
    clear_blocks(pool, lay, blocks)
    for b in range(num_blocks):
        o = piece_offset(lay, b, 0, 0)
        assert (pool[o : o + lay.piece_bytes] == 0).all() == (b in blocks)


# -- speed -----------------------------------------------------------------------------------


@pytest.mark.parametrize("major", MAJORS)
def test_fill_and_verify_are_vectorised(major: str) -> None:
    # 32 MiB request in 512 KiB blocks, shuffled: 1,024 pieces of 16 tokens. A loop over
    # tokens would make a call or more per token and piece (16,384); the vectorised code
    # makes a few dozen per block (its chunks). Calls are counted, not timed.
    lay = KvLayout(8, 2, 8, 128, 16, "float16", major, 80)
    pool = np.zeros(lay.pool_bytes, dtype=np.uint8)
    blocks = np.random.default_rng(3).permutation(80)[:64]
    results: list[Any] = []

    def fill_and_verify() -> None:
        fill_blocks(pool, lay, blocks, SEED)
        results.append(verify_blocks(pool, lay, blocks, SEED, 64 * 16))

    calls = count_calls(fill_and_verify)
    assert results[0].ok
    tokens = 64 * lay.pieces_per_block * lay.tokens_per_block
    assert calls < tokens // 4, f"fill + verify made {calls} calls for {tokens} token pieces"


@pytest.mark.parametrize("seed", [0, 1, SEED, (1 << 64) - 1])
def test_a_few_bases_are_the_vectorised_words(seed: int) -> None:
    # A request of a block or two works its bases out in Python (cheaper than numpy on a
    # handful of values); they must be the very words the vectorised path gives.
    from kvxferd.sim.content import _SMALL_BASES, _bases

    wide = _bases(seed, 8, 4)  # 32 bases: the numpy path
    assert wide.shape[0] * wide.shape[1] > _SMALL_BASES
    for blocks, regions in ((1, 1), (1, 4), (2, 3), (4, 4)):
        few = _bases(seed, blocks, regions)
        assert few.dtype == np.uint64 and few.shape == (blocks, regions)
        assert few.tolist() == wide[:blocks, :regions].tolist()
