"""Waiting for bounce room (PYTHON runtime): a head-merge receive reserves its legs' room all
or none, in line, for up to BOUNCE_ROOM_WAIT_S, and only then takes the per-block path; a
line of waiters costs one poll, not one per waiter (staging.RoomLine)."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
from layout_harness import tiny_layout
from mover_harness import peer_conn, pool, region, tx_session

from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import BLOCK_MAJOR, KvLayout
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver import direct_bounce, direct_rx
from kvxferd.transceiver.bounce import BounceBuffers, BounceRegion, Reservation
from kvxferd.transceiver.direct_bounce import BouncePlanner
from kvxferd.transceiver.direct_rx import DirectReceive
from kvxferd.transceiver.legs import RxLeg
from kvxferd.transceiver.sessions import RxSession, Terminal, TxSession
from kvxferd.transceiver.state import Reason, Status

BLOCKS = list(range(8))


def _layout(heads: int) -> KvLayout:
    # 2 layers x K/V x 8 tokens x `heads` x 8 dims x fp16: 256 bytes a head per block.
    return tiny_layout(
        num_kv_heads=heads, head_dim=8, tokens_per_block=8, major=BLOCK_MAJOR, num_blocks=16
    )


def _merge(rx_token: int = 1) -> RxSession:
    """A receive of 8 blocks into our 4-head pool from two context ranks of 2 heads each:
    two legs of 8 x 1 KiB (each rank's heads of our blocks)."""
    ours = _layout(4)
    pool = LocalPool("p0", ours, region(np.zeros(ours.pool_bytes, np.uint8)), None, None)
    conn = SimpleNamespace(
        pools={}, layouts={}, info=SimpleNamespace(bounce_nbytes=1 << 20), peer=SimpleNamespace()
    )
    legs = [
        RxLeg(f"ctx{r}", conn=conn, source=(TpRank(r, 2), _layout(2)))  # type: ignore[arg-type]
        for r in range(2)
    ]
    s = RxSession(request_id=f"r{rx_token}", engine=None, legs=legs, rx_token=rx_token)
    s.pool, s.blocks = pool, BLOCKS
    return s


LEG_BYTES = len(BLOCKS) * 1024


def _taken(region: BounceRegion, nbytes: int) -> Reservation:
    """Room held by others (writes in flight, a stalled peer's)."""
    held = region.reserve(nbytes)
    assert held is not None
    return held


def _run(go: Any, bounce: BounceBuffers) -> None:
    try:
        asyncio.run(go())
    finally:
        bounce.close()


def test_a_merge_waits_for_room_for_both_legs_then_offers_both() -> None:
    bounce = BounceBuffers(4 * LEG_BYTES)
    rx = DirectReceive(bounce, pipelined=False)

    async def go() -> None:
        # Room for one leg only: reserving that one and waiting for the other could
        # deadlock two requests, so nothing is held until both fit.
        held = _taken(bounce.recv, 3 * LEG_BYTES)
        s = _merge()
        offer = asyncio.ensure_future(rx.make_offer(s, s.legs[0].conn, time.monotonic() + 30))
        for _ in range(5):
            await asyncio.sleep(0.002)
        assert not offer.done()
        assert bounce.recv.in_use_bytes == 3 * LEG_BYTES  # the waiter holds nothing
        bounce.recv.release(held)
        await offer
        assert s.terminal is None
        assert [leg.offer.nbytes for leg in s.legs if leg.offer] == [LEG_BYTES, LEG_BYTES]
        assert (bounce.room_waits, bounce.fallbacks, bounce.reservations_made) == (1, 0, 2)

    _run(go, bounce)


def test_a_merge_without_room_in_time_takes_the_per_block_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(direct_rx, "BOUNCE_ROOM_WAIT_S", 0.05)
    bounce = BounceBuffers(4 * LEG_BYTES)
    rx = DirectReceive(bounce, pipelined=False)

    async def go() -> None:
        _taken(bounce.recv, 3 * LEG_BYTES)  # by a write to a stalled peer, say
        s = _merge()
        await rx.make_offer(s, s.legs[0].conn, time.monotonic() + 30)
        # Not ended, nothing offered: the context ranks write per block.
        assert s.terminal is None and all(leg.offer is None for leg in s.legs)
        assert (bounce.room_waits, bounce.fallbacks) == (1, 2)
        assert bounce.recv.in_use_bytes == 3 * LEG_BYTES and len(rx.room) == 0
        s = _merge(rx_token=2)  # again: counted, not said again within the minute
        await rx.make_offer(s, s.legs[0].conn, time.monotonic() + 30)
        assert (bounce.room_waits, bounce.fallbacks) == (2, 4)

    with caplog.at_level(logging.WARNING, logger="kvxferd.bounce"):
        _run(go, bounce)
    said = [r.getMessage() for r in caplog.records if r.name == "kvxferd.bounce"]
    assert len(said) == 1, said
    assert said[0].startswith("a head-merge's legs together of 0.0 MiB found no room in this")
    assert "within 0.05 s" in said[0]
    assert "the requests in flight held it" in said[0] and "kv_cache_bounce_size_mb" in said[0]


def test_a_merge_cancelled_while_it_waits_holds_no_room_and_leaves_the_line() -> None:
    bounce = BounceBuffers(4 * LEG_BYTES)
    rx = DirectReceive(bounce, pipelined=False)

    async def go() -> None:
        held = _taken(bounce.recv, 3 * LEG_BYTES)
        first, second = _merge(1), _merge(2)
        waits = [
            asyncio.ensure_future(rx.make_offer(s, s.legs[0].conn, time.monotonic() + 30))
            for s in (first, second)
        ]
        await asyncio.sleep(0.01)
        assert len(rx.room) == 2
        waits[0].cancel()
        await asyncio.gather(waits[0], return_exceptions=True)
        assert len(rx.room) == 1  # the second is at the head now
        bounce.recv.release(held)
        await waits[1]
        assert all(leg.offer is not None for leg in second.legs)
        assert bounce.recv.in_use_bytes == 2 * LEG_BYTES  # the second's two legs only

    _run(go, bounce)


def _split() -> TxSession:
    """A send of 8 blocks of our 4-head pool to generation rank 0 of 2 (2 heads): one
    leg of 8 x 1 KiB, gathered into our send region and written into its blocks."""
    ours, theirs = _layout(4), _layout(2)
    src = np.arange(ours.pool_bytes, dtype=np.uint64).astype(np.uint8)
    conn = peer_conn(theirs, np.zeros(theirs.pool_bytes, np.uint8))
    conn.pools["p0"] = msgspec.structs.replace(conn.pools["p0"], tp_rank=0, tp_size=2)
    s = tx_session(pool(ours, src), conn, BLOCKS, BLOCKS)
    s.deadline = time.monotonic() + 30
    return s


def test_a_split_leg_waits_for_send_room() -> None:
    bounce = BounceBuffers(2 * LEG_BYTES)
    planner = BouncePlanner(bounce, pipelined=False)

    async def go() -> None:
        held = _taken(bounce.send, 2 * LEG_BYTES)
        s = _split()
        asyncio.get_running_loop().call_later(0.02, bounce.send.release, held)
        planned = await planner.one_sided(s, s.legs[0], 0, len(BLOCKS))
        assert isinstance(planned, tuple)
        local, _, res, into_bounce = planned
        assert res is not None and not into_bounce and int(local[:, 1].sum()) == LEG_BYTES
        assert (bounce.room_waits, bounce.fallbacks, bounce.one_sided_legs) == (1, 0, 1)
        bounce.send.release(res)

    _run(go, bounce)


def test_a_split_leg_without_room_in_time_takes_the_per_block_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(direct_bounce, "BOUNCE_ROOM_WAIT_S", 0.05)
    bounce = BounceBuffers(2 * LEG_BYTES)
    planner = BouncePlanner(bounce, pipelined=False)

    async def go() -> None:
        _taken(bounce.send, 2 * LEG_BYTES)
        s = _split()
        assert await planner.one_sided(s, s.legs[0], 0, len(BLOCKS)) is None
        assert (bounce.room_waits, bounce.fallbacks, bounce.one_sided_legs) == (1, 1, 0)
        assert bounce.send.in_use_bytes == 2 * LEG_BYTES and len(planner.room) == 0

    with caplog.at_level(logging.WARNING, logger="kvxferd.bounce"):
        _run(go, bounce)
    said = [r.getMessage() for r in caplog.records if r.name == "kvxferd.bounce"]
    assert len(said) == 1 and said[0].startswith("a head-split leg of"), said
    assert "found no room in this daemon's" in said[0]


def test_a_split_leg_that_ends_while_it_waits_gives_its_room_back() -> None:
    bounce = BounceBuffers(2 * LEG_BYTES)
    planner = BouncePlanner(bounce, pipelined=False)

    async def go() -> None:
        held = _taken(bounce.send, 2 * LEG_BYTES)
        s = _split()
        end = Terminal.local(Status.CANCELLED, Reason.CANCELLED, "cancelled by the engine")
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, s.request_end, end)
        loop.call_later(0.02, bounce.send.release, held)
        assert await planner.one_sided(s, s.legs[0], 0, len(BLOCKS)) is end
        assert bounce.send.in_use_bytes == 0 and bounce.gathers == 0

    _run(go, bounce)


def test_a_split_leg_larger_than_the_region_goes_per_block_and_says_so_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bounce = BounceBuffers(LEG_BYTES // 2)  # half a leg: no wait would ever do
    planner = BouncePlanner(bounce, pipelined=False)

    async def go() -> None:
        for _ in range(3):
            s = _split()
            assert await planner.one_sided(s, s.legs[0], 0, len(BLOCKS)) is None
        assert (bounce.fallbacks, bounce.room_waits, bounce.gathers) == (3, 0, 0)

    with caplog.at_level(logging.WARNING, logger="kvxferd.bounce"):
        _run(go, bounce)
    said = [r.getMessage() for r in caplog.records if r.name == "kvxferd.bounce"]
    assert len(said) == 1, said  # an operator hears it once, not per request
    assert said[0].startswith("a head-split leg of 0.0 MiB can never fit this daemon's")
    assert "Raise kv_cache_bounce_size_mb" in said[0]


def test_a_merge_whose_legs_never_fit_together_goes_per_block_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bounce = BounceBuffers(LEG_BYTES)  # one leg fits, both never will
    rx = DirectReceive(bounce, pipelined=False)

    async def go() -> None:
        s = _merge()
        await rx.make_offer(s, s.legs[0].conn, time.monotonic() + 30)
        assert s.terminal is None and all(leg.offer is None for leg in s.legs)
        assert (bounce.fallbacks, bounce.room_waits, bounce.recv.in_use_bytes) == (2, 0, 0)

    with caplog.at_level(logging.WARNING, logger="kvxferd.bounce"):
        _run(go, bounce)
    said = [r.getMessage() for r in caplog.records if r.name == "kvxferd.bounce"]
    assert len(said) == 1 and said[0].startswith("a head-merge's legs together of"), said
