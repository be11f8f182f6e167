"""A two-sided staged leg holds at most half the send region (staging.two_sided_round_bytes,
rounds_moving): a receiver that stalls completes none of the sends to it, so every round
in flight to it keeps its reservation until it is declared lost, and the other half must
serve the requests to other receivers.

The transport is a stand-in whose sends end a moment after they start, as a receiver that
takes them does; it records how much of the send region was in use at each send."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from layout_harness import tiny_layout
from mover_harness import acking, peer_conn, pool, tx_session

from kvxferd.memory.layout import LAYER_MAJOR, KvLayout
from kvxferd.peers.messages import Result
from kvxferd.transceiver import staging as staging_mod
from kvxferd.transceiver.bounce import BounceBuffers, HostCopier
from kvxferd.transceiver.staged import StagedMover


class HeldSends:
    """Two-sided sends that end `after_s` after they start."""

    name = "UCX"

    def __init__(self, staging: BounceBuffers, after_s: float = 0.02) -> None:
        self.staging, self.after_s = staging, after_s
        self.in_use: list[int] = []  # send region bytes in use at each send
        self.moving = 0
        self.most_moving = 0

    async def connect(self, peer_key: str, address: str, timeout_s: float) -> None:
        return None

    async def send(self, peer_key: str, tag: int, data: memoryview) -> None:
        self.in_use.append(self.staging.send.in_use_bytes)
        self.moving += 1
        self.most_moving = max(self.most_moving, self.moving)
        try:
            await asyncio.sleep(self.after_s)  # the receiver takes it a moment later
        finally:
            self.moving -= 1


def _layout() -> KvLayout:
    # 4 KiB blocks: a reservation takes whole pages (bounce.RESERVATION_ALIGN).
    return tiny_layout(
        num_kv_heads=2, head_dim=64, tokens_per_block=4, major=LAYER_MAJOR, num_blocks=32
    )


def _send(region_blocks: int, nblocks: int) -> tuple[HeldSends, Any, KvLayout]:
    layout = _layout()
    src = np.random.default_rng(region_blocks).integers(0, 256, layout.pool_bytes, np.uint8)
    ring = np.zeros(16 * layout.block_bytes, np.uint8)  # the receiver's reservation
    staging = BounceBuffers(region_blocks * layout.block_bytes, HostCopier(threads=1))
    transport = HeldSends(staging)
    blocks = list(range(nblocks))

    async def go() -> Any:
        conn = peer_conn(layout, np.zeros_like(src), bounce=ring)
        conn.info.round_offsets = True
        s = tx_session(
            pool(layout, src), conn, blocks, blocks, bounce_offset=0, bounce_nbytes=ring.nbytes
        )
        acking(conn, s)
        mover = StagedMover(Any, staging, False, lambda *a: None)  # type: ignore[arg-type]
        mover.attach(transport)  # type: ignore[arg-type]
        try:
            await mover.write_slice(s, 0, len(blocks), True)
            assert s.terminal is None and staging.send.in_use_bytes == 0
        finally:
            staging.close()
        return [m for m in conn.sent if isinstance(m, Result)]

    results = asyncio.run(go())
    assert results and results[-1].last and results[-1].end_block == nblocks
    return transport, results, layout


@pytest.mark.parametrize("region_blocks", [4, 10, 20])
def test_a_leg_keeps_half_the_send_region_free(region_blocks: int) -> None:
    transport, results, layout = _send(region_blocks, 12)
    half = region_blocks * layout.block_bytes // 2
    assert transport.in_use and max(transport.in_use) <= half, (transport.in_use, half)
    # Rounds as large as that allows: at least one block each, several moving where several
    # fit (not one round at a time for every region).
    per_round = max(1, half // staging_mod.TWO_SIDED_ROUNDS_AHEAD // layout.block_bytes)
    assert max(r.end_block - r.first_block for r in results) <= per_round
    if region_blocks >= 10:
        assert transport.most_moving > 1, transport.most_moving


@pytest.mark.parametrize(
    ("depth", "region", "round_bytes", "moving"),
    [
        (4, 512 << 10, 128 << 10, 1),  # four moving and one gathered would fill it
        (4, 1 << 30, 16 << 20, 4),  # a region of many rounds: as deep as asked
        (4, 160 << 20, 16 << 20, 4),  # five rounds in half of it
        (4, 128 << 20, 16 << 20, 3),
        (4, 64 << 10, 64 << 10, 1),  # not even one round in half: still one
    ],
)
def test_rounds_moving(depth: int, region: int, round_bytes: int, moving: int) -> None:
    assert staging_mod.rounds_moving(depth, region, round_bytes) == moving


def test_two_sided_rounds_fit_five_in_half_the_region() -> None:
    assert staging_mod.two_sided_round_bytes(1 << 30) == (512 << 20) // 5
    assert staging_mod.two_sided_round_bytes(512 << 10) == (256 << 10) // 5
