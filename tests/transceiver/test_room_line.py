"""Receives waiting for staging room are served in the order they began to wait
(staging.RoomLine), so the generation ranks of a head-split cannot grant their room to
different requests and wait on each other.

The regions here are counters: which waiter gets room, and when, is the whole question, and
a real region's bytes play no part in it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace

import pytest

from kvxferd.transceiver import staging
from kvxferd.transceiver.staging import RoomLine, reserve_by


class Region:
    """Room counted in units."""

    def __init__(self, units: int) -> None:
        self.free = units

    def reserve(self, units: int) -> int | None:
        if units > self.free:
            return None
        self.free -= units
        return units

    def release(self, units: int) -> None:
        self.free += units


Reserve = Callable[[Callable[[], int | None], float], Awaitable[int | None]]


async def _two_ranks(reserve_on: list[Reserve], deadline_s: float) -> list[str]:
    """A head-split's two generation ranks, 10 units of staging room each, and four
    requests their engines post in the same order (units per leg): P 6, Q 5, R 5, S 4. A
    request moves once it has room on both ranks (its sender waits for every leg), then
    gives the room back. Rank 0 starts with 5 units held by another peer's receive, given
    back once every request waits. The requests that moved, in the order they did."""
    regions = [Region(10), Region(10)]
    regions[0].reserve(5)
    deadline = time.monotonic() + deadline_s
    moved: list[str] = []

    async def leg(rank: int, units: int) -> bool:
        region = regions[rank]
        return await reserve_on[rank](lambda: region.reserve(units), deadline) is not None

    async def request(name: str, units: int) -> None:
        got = await asyncio.gather(leg(0, units), leg(1, units))
        if all(got):
            moved.append(name)
        for rank, ok in enumerate(got):
            if ok:
                regions[rank].release(units)

    tasks = [
        asyncio.ensure_future(request(n, u)) for n, u in [("P", 6), ("Q", 5), ("R", 5), ("S", 4)]
    ]
    for _ in range(5):
        await asyncio.sleep(0)  # every leg asked for room once
    regions[0].release(5)
    await asyncio.gather(*tasks)
    return moved


def test_ranks_that_grant_room_in_arrival_order_move_every_request() -> None:
    lines = [RoomLine(), RoomLine()]
    moved = asyncio.run(_two_ranks([lines[0].reserve_by, lines[1].reserve_by], 5.0))
    # P first everywhere; then Q and R together; S once they gave room back.
    assert moved == ["P", "Q", "R", "S"]
    assert len(lines[0]) == len(lines[1]) == 0


def test_ranks_that_grant_room_to_whoever_fits_wait_on_each_other() -> None:
    """What the line prevents: rank 0 gives its free 5 units to Q and then R (P needs 6),
    rank 1 its room to P and S (Q and R do not fit beside P): each request holds one rank
    and waits for the other until the deadline."""
    moved = asyncio.run(_two_ranks([reserve_by, reserve_by], 0.3))
    assert moved == []


def test_a_waiter_that_gives_up_or_is_cancelled_leaves_the_line() -> None:
    async def go() -> None:
        line, region = RoomLine(), Region(4)
        region.reserve(4)
        now = time.monotonic()
        first = asyncio.ensure_future(line.reserve_by(lambda: region.reserve(4), now + 0.05))
        second = asyncio.ensure_future(line.reserve_by(lambda: region.reserve(4), now + 60))
        third = asyncio.ensure_future(line.reserve_by(lambda: region.reserve(1), now + 60))
        await asyncio.sleep(0)
        assert len(line) == 3
        assert await first is None  # its deadline passed: the next is at the head
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        assert len(line) == 1
        region.release(4)
        assert await third == 1  # alone in the line: room at once
        assert len(line) == 0

    asyncio.run(go())


def test_a_later_waiter_that_would_fit_waits_for_the_one_before_it() -> None:
    async def go() -> None:
        line, region = RoomLine(), Region(10)
        region.reserve(7)
        deadline = time.monotonic() + 60
        big = asyncio.ensure_future(line.reserve_by(lambda: region.reserve(6), deadline))
        small = asyncio.ensure_future(line.reserve_by(lambda: region.reserve(2), deadline))
        for _ in range(20):
            await asyncio.sleep(0.001)
        assert not big.done() and not small.done()  # 3 free: the small one fits, but waits
        region.release(7)
        assert await big == 6
        assert await small == 2

    asyncio.run(go())


def test_only_the_head_of_a_line_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Twenty waiters on a full region: only the head sleeps and polls; the nineteen behind
    it wait for their turn (each used to wake once a millisecond, to find it was not)."""
    naps = [0]

    async def counted_sleep(delay: float) -> None:
        naps[0] += 1
        await asyncio.sleep(delay)

    monkeypatch.setattr(
        staging, "asyncio", SimpleNamespace(**{**vars(asyncio), "sleep": counted_sleep})
    )

    async def go() -> None:
        line = RoomLine()
        calls = [0] * 20
        free = [False]

        def reserve(i: int) -> int | None:
            calls[i] += 1
            return i if free[0] else None

        deadline = time.monotonic() + 30
        waiters = [
            asyncio.ensure_future(line.reserve_by(lambda i=i: reserve(i), deadline))
            for i in range(20)
        ]
        for _ in range(10):
            await asyncio.sleep(0.002)
        assert calls[0] >= 2 and calls[1:] == [0] * 19
        assert naps[0] <= calls[0]  # one nap per poll of the head, none for the others
        free[0] = True
        assert await asyncio.gather(*waiters) == list(range(20))  # in their order
        assert calls[1:] == [1] * 19  # each tried once, when its turn came

    asyncio.run(go())
