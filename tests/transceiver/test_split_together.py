"""A head-split's legs moved together under the PYTHON runtime (BouncePlanner.split_together,
DirectMover.write_slice): their send room is reserved all at once, in line, and their slices
are gathered in one copy; without room in time each leg goes per block; a request that ends
while it waits, or a leg that ends before its post, gives its room back."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from layout_harness import tiny_layout
from mover_harness import RecordingBackend, two_rank_split, writes_over

from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import BLOCK_MAJOR, KvLayout
from kvxferd.peers.messages import Result
from kvxferd.sim.content import verify_blocks
from kvxferd.transceiver import direct_bounce
from kvxferd.transceiver.bounce import BounceBuffers, HostCopier
from kvxferd.transceiver.direct import DirectMover
from kvxferd.transceiver.direct_bounce import BouncePlanner
from kvxferd.transceiver.sessions import Terminal, TxSession
from kvxferd.transceiver.state import Reason, Status

BLOCKS = list(range(8))
DST = ([8, 9, 10, 11, 12, 13, 14, 15], [0, 1, 2, 3, 4, 5, 6, 7])
LEG_BYTES = len(BLOCKS) * 1024  # 2 heads of 8 fp16 dims x 8 tokens x 2 layers x K/V


def _layout(heads: int) -> KvLayout:
    return tiny_layout(
        num_kv_heads=heads, head_dim=8, tokens_per_block=8, major=BLOCK_MAJOR, num_blocks=16
    )


class CountingCopier(HostCopier):
    """A HostCopier that counts the legs gathered alone and the splits gathered together."""

    def __init__(self) -> None:
        super().__init__(threads=1)
        self.alone = 0
        self.together = 0

    def gather_heads(self, *args: Any) -> None:
        self.alone += 1
        super().gather_heads(*args)

    def gather_slices(self, *args: Any) -> None:
        self.together += 1
        super().gather_slices(*args)


def _split() -> tuple[TxSession, list[np.ndarray]]:
    """A send of 8 blocks of our 4-head pool to both generation ranks of 2 (2 heads each)."""
    s, dsts = two_rank_split(_layout(4), _layout(2), BLOCKS, list(DST), seed=5)
    s.deadline = time.monotonic() + 30
    return s, dsts


def _each_rank_has_its_heads(s: TxSession, dsts: list[np.ndarray]) -> None:
    for rank, dst in enumerate(dsts):
        got = verify_blocks(dst, _layout(2), DST[rank], 5, len(BLOCKS) * 8, tp=TpRank(rank, 2))
        assert got.ok, (rank, got.first_mismatch)
        results = [m for m in s.legs[rank].conn.sent if isinstance(m, Result)]
        assert len(results) == 1 and results[0].last and not results[0].bounced


def _write(s: TxSession, bounce: BounceBuffers) -> None:
    async def go() -> None:
        async with writes_over(RecordingBackend()) as writes:
            mover = DirectMover(writes, bounce, pipelined=False)
            await asyncio.wait_for(mover.write_slice(s, 0, len(BLOCKS), True), 10)

    asyncio.run(go())


def test_both_legs_are_gathered_in_one_copy_and_written_into_each_rank() -> None:
    copier = CountingCopier()
    bounce = BounceBuffers(4 * LEG_BYTES, copier)
    s, dsts = _split()
    try:
        _write(s, bounce)
        assert (copier.together, copier.alone) == (1, 0)
        assert (bounce.gathers, bounce.one_sided_legs, bounce.reservations_made) == (2, 2, 2)
        assert bounce.send.in_use_bytes == 0  # each leg's room back once its write ended
    finally:
        bounce.close()
    assert s.terminal is None and s.written == len(BLOCKS)
    _each_rank_has_its_heads(s, dsts)


def test_room_for_one_leg_only_holds_nothing_until_both_fit() -> None:
    bounce = BounceBuffers(3 * LEG_BYTES)
    planner = BouncePlanner(bounce, pipelined=False)
    s, _ = _split()

    async def go() -> None:
        held = bounce.send.reserve(2 * LEG_BYTES)  # a write in flight, say: one leg fits
        assert held is not None
        together = asyncio.ensure_future(planner.split_together(s, s.legs, 0, len(BLOCKS)))
        for _ in range(5):
            await asyncio.sleep(0.002)
        assert not together.done()
        assert bounce.send.in_use_bytes == 2 * LEG_BYTES  # the waiter holds nothing
        bounce.send.release(held)
        planned = await together
        assert isinstance(planned, list) and all(p is not None for p in planned)
        assert (bounce.room_waits, bounce.fallbacks, bounce.reservations_made) == (1, 0, 2)
        for p in planned:
            assert p is not None and p[2] is not None
            bounce.send.release(p[2])

    try:
        asyncio.run(go())
    finally:
        bounce.close()


def test_without_room_in_time_each_leg_goes_per_block_and_the_request_completes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(direct_bounce, "BOUNCE_ROOM_WAIT_S", 0.05)
    copier = CountingCopier()
    bounce = BounceBuffers(3 * LEG_BYTES, copier)
    held = bounce.send.reserve(2 * LEG_BYTES)  # held by a write to a stalled peer
    s, dsts = _split()
    try:
        _write(s, bounce)
        # No second wait per leg: both went per block at once, nothing gathered.
        assert (copier.together, copier.alone, bounce.fallbacks) == (0, 0, 2)
        assert bounce.room_waits == 1 and bounce.send.in_use_bytes == 2 * LEG_BYTES
    finally:
        assert held is not None
        bounce.send.release(held)
        bounce.close()
    _each_rank_has_its_heads(s, dsts)


def test_a_request_that_ends_while_its_legs_wait_gives_all_their_room_back() -> None:
    bounce = BounceBuffers(3 * LEG_BYTES)
    planner = BouncePlanner(bounce, pipelined=False)
    s, _ = _split()

    async def go() -> None:
        held = bounce.send.reserve(2 * LEG_BYTES)
        end = Terminal.local(Status.CANCELLED, Reason.CANCELLED, "cancelled by the engine")
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, s.request_end, end)
        loop.call_later(0.02, bounce.send.release, held)
        assert await planner.split_together(s, s.legs, 0, len(BLOCKS)) is end
        assert bounce.send.in_use_bytes == 0 and bounce.gathers == 0

    try:
        asyncio.run(go())
    finally:
        bounce.close()


def test_a_leg_that_ends_before_its_post_gives_its_gathered_room_back() -> None:
    bounce = BounceBuffers(4 * LEG_BYTES)
    planner = BouncePlanner(bounce, pipelined=False)
    s, dsts = _split()

    async def go() -> None:
        planned = await planner.split_together(s, s.legs, 0, len(BLOCKS))
        assert isinstance(planned, list) and bounce.send.in_use_bytes == 2 * LEG_BYTES
        # The other leg failed first: this one must not post, and must not keep its room.
        s.request_end(Terminal.peer(Status.FAILED, Reason.PEER_LOST, "gen0 went away"))
        async with writes_over(RecordingBackend()) as writes:
            mover = DirectMover(writes, bounce, pipelined=False)
            for leg, prepared in zip(s.legs, planned, strict=True):
                await mover._write_leg(s, leg, 0, len(BLOCKS), True, prepared)
        assert bounce.send.in_use_bytes == 0

    try:
        asyncio.run(go())
    finally:
        bounce.close()
    assert not any(dst.any() for dst in dsts)
