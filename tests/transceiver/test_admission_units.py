"""kvxferd.transceiver.admission.AdmissionWindow on its own (no daemon, no sockets).

Every scenario runs on its own event loop. Waiting is bounded: `settle` lets the loop run a
fixed number of iterations (enough for a cancelled task to run its handler and a granted one
to resume), and the one test that needs the poll tick waits for it with a deadline.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable

import pytest

from kvxferd.transceiver import admission
from kvxferd.transceiver.admission import AdmissionWindow

DEADLINE_S = 10.0


async def settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))


async def holder(window: AdmissionWindow, blocks: int) -> asyncio.Task[None]:
    """A task waiting for `blocks`, given a chance to queue."""
    task = asyncio.ensure_future(window.acquire(blocks))
    await settle()
    return task


def test_without_capacity_everything_is_admitted_at_once() -> None:
    async def scenario() -> None:
        window = AdmissionWindow(None, None)
        waits: list[float] = []
        window.on_wait = waits.append
        for blocks in (5, 1_000_000, 3):
            await window.acquire(blocks)
        assert window.in_flight_blocks == 1_000_008
        assert waits == [0.0, 0.0, 0.0]
        assert window.waiting == 0
        window.release(5)
        assert window.in_flight_blocks == 1_000_003
        await window.close()

    run(scenario)


def test_default_poll_interval_is_five_seconds() -> None:
    assert AdmissionWindow(4, None).poll_interval_s == 5.0
    assert AdmissionWindow(4, 0.25).poll_interval_s == 0.25
    window = AdmissionWindow(None, 0.5)
    assert window.capacity is None
    window.resize(7, None)
    assert (window.capacity, window.poll_interval_s) == (7, 5.0)
    window.resize(None, 2.0)
    assert (window.capacity, window.poll_interval_s) == (None, 2.0)


def test_a_request_that_fills_the_window_exactly_is_admitted() -> None:
    async def scenario() -> None:
        window = AdmissionWindow(10, 1000)
        await window.acquire(4)
        await window.acquire(6)
        assert window.in_flight_blocks == 10
        one_more = await holder(window, 1)
        assert not one_more.done() and window.waiting == 1
        window.release(1)
        await settle()
        assert one_more.done() and window.in_flight_blocks == 10 and window.waiting == 0
        await one_more
        await window.close()

    run(scenario)


def test_a_request_larger_than_the_window_is_admitted_alone() -> None:
    async def scenario() -> None:
        window = AdmissionWindow(4, 1000)
        await window.acquire(9)  # nothing in flight: admitted although 9 > 4
        assert window.in_flight_blocks == 9
        big = await holder(window, 9)
        small = await holder(window, 1)
        assert not big.done() and not small.done()
        window.release(9)
        await settle()
        assert big.done() and not small.done()  # alone again; the small one waits behind
        assert window.in_flight_blocks == 9 and window.waiting == 1
        window.release(9)
        await settle()
        assert small.done() and window.in_flight_blocks == 1
        await window.close()

    run(scenario)


def test_first_come_first_served_nobody_overtakes_the_head() -> None:
    async def scenario() -> None:
        window = AdmissionWindow(10, 1000)
        await window.acquire(6)
        big = await holder(window, 8)  # does not fit next to 6
        small = await holder(window, 2)  # would fit, but queues behind the big one
        late = await holder(window, 1)  # the queue is not empty: no shortcut either
        assert [t.done() for t in (big, small, late)] == [False, False, False]
        assert window.waiting == 3 and window.in_flight_blocks == 6
        window.release(6)
        await settle()
        # Granted in order while they fit: 8, then 2 (10), then 1 must wait.
        assert [t.done() for t in (big, small, late)] == [True, True, False]
        assert window.in_flight_blocks == 10 and window.waiting == 1
        window.release(8)
        await settle()
        assert late.done() and window.in_flight_blocks == 3 and window.waiting == 0
        await window.close()

    run(scenario)


def test_a_cancelled_head_does_not_block_the_queue() -> None:
    async def scenario() -> None:
        window = AdmissionWindow(10, 1000)  # no poll tick within the test
        await window.acquire(6)
        head = await holder(window, 8)
        behind = await holder(window, 2)
        assert window.waiting == 2
        head.cancel()
        await settle()
        assert head.cancelled()
        # Nothing was released and no tick ran: the cancel alone lets the next one in.
        assert behind.done() and not behind.cancelled()
        assert window.in_flight_blocks == 8 and window.waiting == 0
        await window.close()

    run(scenario)


def test_a_cancelled_waiter_leaves_the_queue_at_once() -> None:
    async def scenario() -> None:
        window = AdmissionWindow(4, 1000)
        await window.acquire(4)
        first = await holder(window, 1)
        middle = await holder(window, 1)
        last = await holder(window, 1)
        middle.cancel()
        await settle()
        assert window.waiting == 2 and window.in_flight_blocks == 4
        window.release(2)
        await settle()
        assert first.done() and last.done() and middle.cancelled()
        assert window.in_flight_blocks == 4 and window.waiting == 0
        await window.close()

    run(scenario)


def test_capacity_is_not_leaked_by_a_cancel_right_after_admission() -> None:
    async def scenario() -> None:
        window = AdmissionWindow(10, 1000)
        await window.acquire(10)
        granted = await holder(window, 5)
        behind = await holder(window, 10)
        window.release(10)  # grants `granted` (5 of 10); `behind` must wait
        assert window.in_flight_blocks == 5 and window.waiting == 1
        granted.cancel()  # before the granted task ever resumed
        await settle()
        assert granted.cancelled()
        # Its 5 blocks came back, and the waiter behind it got the whole window.
        assert behind.done() and not behind.cancelled()
        assert window.in_flight_blocks == 10 and window.waiting == 0
        window.release(10)
        assert window.in_flight_blocks == 0
        await window.acquire(10)  # the full window, at once
        assert window.in_flight_blocks == 10
        await window.close()

    run(scenario)


def test_a_cancel_of_a_granted_waiter_alone_returns_its_blocks() -> None:
    async def scenario() -> None:
        window = AdmissionWindow(3, 1000)
        await window.acquire(3)
        granted = await holder(window, 2)
        window.release(3)
        assert window.in_flight_blocks == 2
        granted.cancel()
        await settle()
        with pytest.raises(asyncio.CancelledError):
            await granted
        assert window.in_flight_blocks == 0 and window.waiting == 0
        await window.close()

    run(scenario)


def test_a_head_cancelled_but_not_yet_run_is_skipped_by_a_release() -> None:
    """task.cancel() cancels the awaited future at once; the task's own handler runs only
    on a later iteration. A release in between must pass over the cancelled head."""

    async def scenario() -> None:
        window = AdmissionWindow(10, 1000)
        await window.acquire(10)
        head = await holder(window, 4)
        behind = await holder(window, 3)
        head.cancel()
        window.release(10)  # before the cancelled task ran: must not grant it
        assert window.in_flight_blocks == 3 and window.waiting == 0
        await settle()
        assert head.cancelled() and behind.done() and not behind.cancelled()
        assert window.in_flight_blocks == 3
        await window.close()

    run(scenario)


def test_on_wait_is_given_the_seconds_waited(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(admission, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    async def scenario() -> None:
        window = AdmissionWindow(1, 1000)
        waits: list[float] = []
        window.on_wait = waits.append
        await window.acquire(1)
        waiter = await holder(window, 1)
        clock[0] = 102.5
        window.release(1)
        await settle()
        assert waiter.done()
        assert waits == [0.0, 2.5]
        await window.close()

    run(scenario)


def test_on_wait_reports_each_admission_once() -> None:
    async def scenario() -> None:
        window = AdmissionWindow(2, 1000)
        waits: list[float] = []
        window.on_wait = waits.append
        await window.acquire(2)
        waiter = await holder(window, 2)
        assert waits == [0.0]
        window.release(2)
        await settle()
        assert waiter.done()
        assert len(waits) == 2 and waits[1] >= 0.0
        cancelled = await holder(window, 2)
        cancelled.cancel()
        await settle()
        assert len(waits) == 2  # a cancelled waiter was never admitted
        await window.close()

    run(scenario)


def test_resize_re_checks_the_waiters() -> None:
    async def scenario() -> None:
        window = AdmissionWindow(4, 1000)
        await window.acquire(4)
        waiter = await holder(window, 3)
        window.resize(6, 1000)
        await settle()
        assert not waiter.done()  # 4 + 3 > 6
        window.resize(7, 1000)
        await settle()
        assert waiter.done() and window.in_flight_blocks == 7
        window.resize(1, 1000)  # admitted requests keep their blocks
        assert window.in_flight_blocks == 7
        another = await holder(window, 1)
        window.resize(None, 1000)
        await settle()
        assert another.done() and window.in_flight_blocks == 8
        await window.close()

    run(scenario)


def test_the_poll_tick_re_evaluates_waiters_without_a_release() -> None:
    async def scenario() -> None:
        window = AdmissionWindow(2, 0.01)
        await window.acquire(2)
        waiter = await holder(window, 2)
        window.capacity = 4  # changed behind the window's back: only the tick notices
        await asyncio.wait_for(waiter, DEADLINE_S / 2)
        assert window.in_flight_blocks == 4 and window.waiting == 0
        await window.close()

    run(scenario)


def test_close_stops_the_poll_tick() -> None:
    async def scenario() -> None:
        window = AdmissionWindow(1, 1000)
        await window.close()  # nothing started: nothing to stop
        await window.acquire(1)
        waiter = await holder(window, 1)
        ticker = window._ticker
        assert ticker is not None and not ticker.done()
        await window.close()
        assert ticker.cancelled()
        waiter.cancel()
        await settle()
        assert window.waiting == 0 and window.in_flight_blocks == 1

    run(scenario)


def test_the_tick_ends_when_the_queue_is_empty_and_restarts_with_the_next_waiter() -> None:
    async def scenario() -> None:
        window = AdmissionWindow(1, 0.01)
        await window.acquire(1)
        waiter = await holder(window, 1)
        first = window._ticker
        window.release(1)
        await settle()
        assert waiter.done()
        assert first is not None
        await asyncio.wait_for(first, DEADLINE_S / 2)  # ends by itself: the queue is empty
        again = await holder(window, 1)
        second = window._ticker
        assert second is not None and second is not first and not second.done()
        window.release(1)
        await settle()
        assert again.done()
        await window.close()

    run(scenario)
