"""How the staged runtime sizes one reservation per leg: every leg's reservation a whole
number of that leg's blocks, all of them (each rounded up to whole pages) within the region;
and how a request's blocks are cut into rounds through it."""

from __future__ import annotations

import itertools

import pytest

from kvxferd.transceiver.bounce import RESERVATION_ALIGN
from kvxferd.transceiver.staging import (
    blocks_per_round,
    one_sided_round_bytes,
    plan_rounds,
    round_blocks,
)

KIB = 1024
MIB = 1024 * KIB


@pytest.mark.parametrize(
    ("region", "blocks", "legs", "expected"),
    [
        (512 * KIB, 7, [256 * KIB], 2),  # one leg, whole blocks: the region's 2 blocks
        (512 * KIB, 1, [256 * KIB], 1),  # a short request takes only what it needs
        (512 * KIB, 7, [128 * KIB, 128 * KIB], 2),  # a merge: half a block per leg
        (512 * KIB, 7, [64 * KIB, 192 * KIB], 2),  # uneven legs (e.g. TP 3 -> 2)
        (256 * KIB, 7, [256 * KIB, 256 * KIB], 0),  # not one block of each leg fits
        # Page rounding: 3 legs of 5000 bytes fit 3 blocks in 45,000 bytes, but each
        # reservation is rounded up to pages (3 x 16 KiB > 45,000), so 2 blocks.
        (45_000, 10, [5000, 5000, 5000], 2),
    ],
)
def test_blocks_per_round(region: int, blocks: int, legs: list[int], expected: int) -> None:
    k = blocks_per_round(region, blocks, legs)
    assert k == expected
    pages = sum(-(-k * b // RESERVATION_ALIGN) * RESERVATION_ALIGN for b in legs)
    assert pages <= region


@pytest.mark.parametrize(
    ("first", "end", "ring", "per_round"),
    [(0, 10, 10, 5), (3, 17, 5, 2), (0, 7, 4, 4), (2, 3, 8, 4), (0, 9, 1, 1), (5, 30, 6, 4)],
)
def test_rounds_tile_the_blocks_through_the_ring_without_wrapping(
    first: int, end: int, ring: int, per_round: int
) -> None:
    rounds = plan_rounds(first, end, ring, per_round)
    assert rounds[0][0] == first and rounds[-1][1] == end
    for (b, stop, slot), (nxt, _, nxt_slot) in itertools.pairwise(rounds):
        assert nxt == stop  # in order, no gap
        assert nxt_slot == (slot + stop - b) % ring  # right after the one before, in the ring
    for b, stop, slot in rounds:
        assert 0 < stop - b <= per_round
        assert slot == (b - first) % ring and slot + stop - b <= ring  # never wraps


@pytest.mark.parametrize(
    ("ring", "block", "expected"),
    [
        (250, 4 * MIB, 4),  # 16 MiB rounds of 4 MiB blocks
        (6, 4 * MIB, 3),  # at most half the reservation, so two rounds overlap
        (1, 4 * MIB, 1),  # a reservation of one block: one block a round
        (250, 64 * MIB, 1),  # a block larger than the target: one block a round
        (1000, 256 * KIB, 64),
    ],
)
def test_round_size(ring: int, block: int, expected: int) -> None:
    assert round_blocks(ring, block, 16 * MIB) == expected


@pytest.mark.parametrize(
    ("leg_bytes", "expected"),
    [
        (1000 * MIB, 62 * MIB + 512 * KIB),  # a large leg: about 16 rounds
        (256 * MIB, 16 * MIB),  # up to 256 MiB: ROUND_BYTES, as before
        (4 * MIB, 16 * MIB),  # a small one: one round (plan_rounds ends it with the leg)
        (64 << 30, 64 * MIB),  # never above ONE_SIDED_ROUND_MAX_BYTES
    ],
)
def test_one_sided_round_target(leg_bytes: int, expected: int) -> None:
    assert one_sided_round_bytes(leg_bytes) == expected


@pytest.mark.parametrize(
    ("leg_bytes", "region", "expected"),
    [
        (1000 * MIB, 1024 * MIB, 256 * MIB),  # a quarter of our send region
        (100 * MIB, 1024 * MIB, 100 * MIB),  # the whole leg where it fits in that
        (4 * MIB, 1024 * MIB, 16 * MIB),  # never under ROUND_BYTES
        (1000 * MIB, 32 * MIB, 16 * MIB),  # a small region: ROUND_BYTES (fits bounds it)
    ],
)
def test_device_round_target(leg_bytes: int, region: int, expected: int) -> None:
    assert one_sided_round_bytes(leg_bytes, device_region=region) == expected
