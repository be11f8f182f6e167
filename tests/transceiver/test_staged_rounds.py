"""How the staged runtime sizes one reservation per leg: every leg's reservation a whole
number of that leg's blocks, all of them (each rounded up to whole pages) within the region."""

from __future__ import annotations

import pytest

from kvxferd.transceiver.bounce import RESERVATION_ALIGN
from kvxferd.transceiver.staging import blocks_per_round

KIB = 1024


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
