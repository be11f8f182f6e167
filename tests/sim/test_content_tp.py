"""Reference content with tensor-parallel head slices: each rank's pool holds its heads of one
full-head pattern, so split and merged transfers verify byte for byte."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvxferd.memory import BLOCK_MAJOR, LAYER_MAJOR, KvLayout, TpRank
from kvxferd.memory.heads import pair_head_segments
from kvxferd.sim.content import clear_blocks, fill_blocks, request_seed, verify_blocks

MAJORS = [BLOCK_MAJOR, LAYER_MAJOR]
SEED = request_seed("tp-req")

# Total heads of the model; each geometry is split over the ranks.
GEOMETRIES: dict[str, dict[str, Any]] = {
    "words": dict(num_layers=3, kv_factor=2, num_kv_heads=4, head_dim=4, tokens_per_block=4,
                  dtype="float16"),
    "bytes": dict(num_layers=2, kv_factor=2, num_kv_heads=2, head_dim=3, tokens_per_block=5,
                  dtype="int8"),
}  # fmt: skip


def pool_of(geometry: str, major: str, tp_size: int, num_blocks: int = 10) -> tuple[KvLayout, Any]:
    g = dict(GEOMETRIES[geometry])
    g["num_kv_heads"] //= tp_size
    lay = KvLayout(major=major, num_blocks=num_blocks, **g)
    return lay, np.full(lay.pool_bytes, 0xAB, dtype=np.uint8)


# Every geometry, with every major on either side.
EVERY_PAIRING = pytest.mark.parametrize(
    ("geometry", "src_major", "dst_major"),
    [(g, s, d) for g in GEOMETRIES for s in MAJORS for d in MAJORS],
)


def copy(src_pool: Any, dst_pool: Any, s: Any, d: Any) -> None:
    for (so, n), (do, _) in zip(s.tolist(), d.tolist(), strict=True):
        dst_pool[do : do + n] = src_pool[so : so + n]


@pytest.mark.parametrize("major", MAJORS)
def test_rank_0_of_1_is_the_plain_content(major: str) -> None:
    lay, a = pool_of("words", major, 1)
    b = a.copy()
    fill_blocks(a, lay, [3, 1, 2], SEED)
    fill_blocks(b, lay, [3, 1, 2], SEED, tp=TpRank(0, 1))
    assert np.array_equal(a, b)
    assert verify_blocks(b, lay, [3, 1, 2], SEED, 3 * lay.tokens_per_block, tp=TpRank()).ok


@EVERY_PAIRING
def test_head_split_delivers_each_rank_its_heads(
    geometry: str, src_major: str, dst_major: str
) -> None:
    src, src_pool = pool_of(geometry, src_major, 1)
    src_blocks = [4, 5, 6, 1, 9]
    tokens = 4 * src.tokens_per_block + 2
    fill_blocks(src_pool, src, src_blocks, SEED)
    for rank in (0, 1):
        dst, dst_pool = pool_of(geometry, dst_major, 2, num_blocks=12)
        dst_tp = TpRank(rank, 2)
        dst_blocks = [11, 0, 3, 2, 7]
        clear_blocks(dst_pool, dst, dst_blocks)
        assert not verify_blocks(dst_pool, dst, dst_blocks, SEED, tokens, tp=dst_tp).ok
        copy(
            src_pool,
            dst_pool,
            *pair_head_segments(src, TpRank(), src_blocks, dst, dst_tp, dst_blocks),
        )
        result = verify_blocks(dst_pool, dst, dst_blocks, SEED, tokens, tp=dst_tp)
        assert result.ok, result.first_mismatch
        # The same bytes as the rank's own fill.
        direct = np.zeros_like(dst_pool)
        fill_blocks(direct, dst, dst_blocks, SEED, tp=dst_tp)
        want = verify_blocks(direct, dst, dst_blocks, SEED, 5 * dst.tokens_per_block, tp=dst_tp)
        assert want.ok


@EVERY_PAIRING
def test_head_merge_of_two_ranks_verifies_as_one_request(
    geometry: str, src_major: str, dst_major: str
) -> None:
    dst, dst_pool = pool_of(geometry, dst_major, 1, num_blocks=12)
    dst_blocks = [8, 9, 10]
    tokens = 3 * dst.tokens_per_block - 1
    clear_blocks(dst_pool, dst, dst_blocks)
    for rank in (0, 1):
        src, src_pool = pool_of(geometry, src_major, 2)
        src_blocks = [2, 0, 5]
        fill_blocks(src_pool, src, src_blocks, SEED, tp=TpRank(rank, 2))
        assert verify_blocks(src_pool, src, src_blocks, SEED, tokens, tp=TpRank(rank, 2)).ok
        # Before the second rank's heads arrive the request is incomplete.
        assert not verify_blocks(dst_pool, dst, dst_blocks, SEED, tokens).ok
        copy(
            src_pool,
            dst_pool,
            *pair_head_segments(src, TpRank(rank, 2), src_blocks, dst, TpRank(), dst_blocks),
        )
    result = verify_blocks(dst_pool, dst, dst_blocks, SEED, tokens)
    assert result.ok, result.first_mismatch


def test_a_wrong_byte_is_reported_with_its_global_head() -> None:
    lay, pool = pool_of("words", BLOCK_MAJOR, 2)  # 2 heads of 4 fp16 (8 bytes) per rank
    tp = TpRank(1, 2)
    fill_blocks(pool, lay, [1, 2], SEED, tp=tp)
    # Logical block 1 (physical 2), layer 1, kv 0, token 2, second head of the rank, byte 3.
    region = 1 * lay.kv_factor + 0
    offset = 2 * lay.block_bytes + region * lay.piece_bytes + 2 * lay.token_bytes + 8 + 3
    pool[offset] ^= 0xFF
    result = verify_blocks(pool, lay, [1, 2], SEED, 2 * lay.tokens_per_block, tp=tp)
    assert not result.ok
    assert result.first_mismatch is not None
    assert (
        "logical block 1 (physical block 2), layer 1, kv 0, token 2, byte 11 of the token "
        "(kv head 3 of 4, held by tensor-parallel rank 1 of 2)"
    ) in result.first_mismatch
    # Verified as another rank's slice, the same bytes are wrong from the first one.
    other = verify_blocks(pool, lay, [1, 2], SEED, 2 * lay.tokens_per_block, tp=TpRank(0, 2))
    assert not other.ok and "kv head 0 of 4" in str(other.first_mismatch)


def test_tail_tokens_of_a_slice_are_checked_and_the_rest_ignored() -> None:
    lay, pool = pool_of("bytes", LAYER_MAJOR, 2)
    tp = TpRank(0, 2)
    fill_blocks(pool, lay, [0, 1], SEED, tp=tp)
    tokens = lay.tokens_per_block + 2
    # Past the last checked token: ignored.
    region_1 = lay.num_blocks * lay.piece_bytes  # the (layer 0, kv 1) region
    pool[region_1 + 1 * lay.piece_bytes + 3 * lay.token_bytes] ^= 1
    assert verify_blocks(pool, lay, [0, 1], SEED, tokens, tp=tp).ok
    pool[region_1 + 1 * lay.piece_bytes + 1 * lay.token_bytes] ^= 1
    result = verify_blocks(pool, lay, [0, 1], SEED, tokens, tp=tp)
    assert not result.ok and "layer 0, kv 1, token 1, byte 0" in str(result.first_mismatch)
