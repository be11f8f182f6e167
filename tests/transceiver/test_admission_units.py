"""kvxferd.transceiver.admission.AdmissionWindow on its own (no daemon, no sockets).

Every scenario runs on its own event loop (`on_window`: a fresh window, closed at the end).
Waiting is bounded: `settle` lets the loop run a fixed number of iterations (enough for a
cancelled task to run its handler and a granted one to resume), and the one test that needs
the poll tick waits for it with a deadline.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Awaitable, Callable

import pytest

from kvxferd.transceiver import admission
from kvxferd.transceiver.admission import AdmissionWindow

DEADLINE_S = 10.0

Scenario = Callable[[AdmissionWindow], Awaitable[None]]


async def settle(rounds: int = 20) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


def run_on(
    capacity: int | None,
    poll_s: float | None,
    scenario: Scenario,
    close: bool = True,
    in_flight: int = 0,
) -> None:
    """`scenario` on a new AdmissionWindow(capacity, poll_s) that has admitted `in_flight`
    blocks already, on its own loop, with a deadline; the window closed after it (unless
    `close` is False: the scenario closes it itself)."""

    async def main() -> None:
        window = AdmissionWindow(capacity, poll_s)
        if in_flight:
            await window.acquire(in_flight)
        await scenario(window)
        if close:
            await window.close()

    asyncio.run(asyncio.wait_for(main(), DEADLINE_S))


def on_window(
    capacity: int | None, poll_s: float | None = 1000, close: bool = True, in_flight: int = 0
) -> Callable[[Scenario], Callable[[], None]]:
    """The test is the scenario it decorates, run by run_on (poll_s 1000: no poll tick
    within the test)."""

    def test_of(scenario: Scenario) -> Callable[[], None]:
        def test() -> None:
            run_on(capacity, poll_s, scenario, close, in_flight)

        test.__name__, test.__doc__ = scenario.__name__, scenario.__doc__
        return test

    return test_of


async def holders(window: AdmissionWindow, *blocks: int) -> list[asyncio.Task[None]]:
    """A task waiting for each of `blocks`, in turn, each given a chance to queue."""
    tasks = []
    for n in blocks:
        tasks.append(asyncio.ensure_future(window.acquire(n)))
        await settle()
    return tasks


def watched(window: AdmissionWindow) -> list[float]:
    """The seconds waited that the window reports, one per admission, as they come."""
    waits: list[float] = []
    window.on_wait = waits.append
    return waits


def load(window: AdmissionWindow) -> tuple[int, int]:
    """(blocks in flight, requests waiting)."""
    return window.in_flight_blocks, window.waiting


@on_window(None, None)
async def test_without_capacity_everything_is_admitted_at_once(window: AdmissionWindow) -> None:
    waits = watched(window)
    for blocks in (5, 1_000_000, 3):
        await window.acquire(blocks)
    assert window.in_flight_blocks == 1_000_008
    assert waits == [0.0, 0.0, 0.0]
    assert window.waiting == 0
    window.release(5)
    assert window.in_flight_blocks == 1_000_003


def test_default_poll_interval_is_five_seconds() -> None:
    assert AdmissionWindow(4, None).poll_interval_s == 5.0
    assert AdmissionWindow(4, 0.25).poll_interval_s == 0.25
    window = AdmissionWindow(None, 0.5)
    assert window.capacity is None
    window.resize(7, None)
    assert (window.capacity, window.poll_interval_s) == (7, 5.0)
    window.resize(None, 2.0)
    assert (window.capacity, window.poll_interval_s) == (None, 2.0)


@on_window(10)
async def test_a_request_that_fills_the_window_exactly_is_admitted(window: AdmissionWindow) -> None:
    await window.acquire(4)
    await window.acquire(6)
    assert window.in_flight_blocks == 10
    (one_more,) = await holders(window, 1)
    assert not one_more.done() and window.waiting == 1
    window.release(1)
    await settle()
    assert one_more.done() and load(window) == (10, 0)
    await one_more


@on_window(4, in_flight=9)
async def test_a_request_larger_than_the_window_is_admitted_alone(window: AdmissionWindow) -> None:
    # The 9 blocks of in_flight came into an empty window: admitted although 9 > 4.
    assert window.in_flight_blocks == 9
    big, small = await holders(window, 9, 1)
    assert not big.done() and not small.done()
    window.release(9)
    await settle()
    assert big.done() and not small.done()  # alone again; the small one waits behind
    assert load(window) == (9, 1)
    window.release(9)
    await settle()
    assert small.done() and window.in_flight_blocks == 1


@on_window(10, in_flight=6)
async def test_first_come_first_served_nobody_overtakes_the_head(window: AdmissionWindow) -> None:
    # 8 does not fit next to 6; 2 would, but queues behind the 8; then the queue is not
    # empty: no shortcut for 1 either.
    big, small, late = await holders(window, 8, 2, 1)
    assert [t.done() for t in (big, small, late)] == [False, False, False]
    assert load(window) == (6, 3)
    window.release(6)
    await settle()
    # Granted in order while they fit: 8, then 2 (10), then 1 must wait.
    assert [t.done() for t in (big, small, late)] == [True, True, False]
    assert load(window) == (10, 1)
    window.release(8)
    await settle()
    assert late.done() and load(window) == (3, 0)


@on_window(10, in_flight=6)  # poll_s 1000: no poll tick within the test
async def test_a_cancelled_head_does_not_block_the_queue(window: AdmissionWindow) -> None:
    head, behind = await holders(window, 8, 2)
    assert window.waiting == 2
    head.cancel()
    await settle()
    assert head.cancelled()
    # Nothing was released and no tick ran: the cancel alone lets the next one in.
    assert behind.done() and not behind.cancelled()
    assert load(window) == (8, 0)


@on_window(4, in_flight=4)
async def test_a_cancelled_waiter_leaves_the_queue_at_once(window: AdmissionWindow) -> None:
    first, middle, last = await holders(window, 1, 1, 1)
    middle.cancel()
    await settle()
    assert load(window) == (4, 2)
    window.release(2)
    await settle()
    assert first.done() and last.done() and middle.cancelled()
    assert load(window) == (4, 0)


@on_window(10, in_flight=10)
async def test_capacity_is_not_leaked_by_a_cancel_right_after_admission(
    window: AdmissionWindow,
) -> None:
    granted, behind = await holders(window, 5, 10)
    window.release(10)  # grants `granted` (5 of 10); `behind` must wait
    assert load(window) == (5, 1)
    granted.cancel()  # before the granted task ever resumed
    await settle()
    assert granted.cancelled()
    # Its 5 blocks came back, and the waiter behind it got the whole window.
    assert behind.done() and not behind.cancelled()
    assert load(window) == (10, 0)
    window.release(10)
    assert window.in_flight_blocks == 0
    await window.acquire(10)  # the full window, at once
    assert window.in_flight_blocks == 10


@on_window(3, in_flight=3)
async def test_a_cancel_of_a_granted_waiter_alone_returns_its_blocks(
    window: AdmissionWindow,
) -> None:
    (granted,) = await holders(window, 2)
    window.release(3)
    assert window.in_flight_blocks == 2
    granted.cancel()
    await settle()
    with pytest.raises(asyncio.CancelledError):
        await granted
    assert load(window) == (0, 0)


@on_window(10, in_flight=10)
async def test_a_head_cancelled_but_not_yet_run_is_skipped_by_a_release(
    window: AdmissionWindow,
) -> None:
    """task.cancel() cancels the awaited future at once; the task's own handler runs only
    on a later iteration. A release in between must pass over the cancelled head."""
    head, behind = await holders(window, 4, 3)
    head.cancel()
    window.release(10)  # before the cancelled task ran: must not grant it
    assert load(window) == (3, 0)
    await settle()
    assert head.cancelled() and behind.done() and not behind.cancelled()
    assert window.in_flight_blocks == 3


def test_on_wait_is_given_the_seconds_waited(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr(admission, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    async def scenario(window: AdmissionWindow) -> None:
        waits = watched(window)
        await window.acquire(1)
        (waiter,) = await holders(window, 1)
        clock[0] = 102.5
        window.release(1)
        await settle()
        assert waiter.done()
        assert waits == [0.0, 2.5]

    run_on(1, 1000, scenario)


@on_window(2)
async def test_on_wait_reports_each_admission_once(window: AdmissionWindow) -> None:
    waits = watched(window)
    await window.acquire(2)
    (waiter,) = await holders(window, 2)
    assert waits == [0.0]
    window.release(2)
    await settle()
    assert waiter.done()
    assert len(waits) == 2 and waits[1] >= 0.0
    (cancelled,) = await holders(window, 2)
    cancelled.cancel()
    await settle()
    assert len(waits) == 2  # a cancelled waiter was never admitted


@on_window(4, in_flight=4)
async def test_resize_re_checks_the_waiters(window: AdmissionWindow) -> None:
    (waiter,) = await holders(window, 3)
    window.resize(6, 1000)
    await settle()
    assert not waiter.done()  # 4 + 3 > 6
    window.resize(7, 1000)
    await settle()
    assert waiter.done() and window.in_flight_blocks == 7
    window.resize(1, 1000)  # admitted requests keep their blocks
    assert window.in_flight_blocks == 7
    (another,) = await holders(window, 1)
    window.resize(None, 1000)
    await settle()
    assert another.done() and window.in_flight_blocks == 8


@on_window(2, 0.01, in_flight=2)
async def test_the_poll_tick_re_evaluates_waiters_without_a_release(
    window: AdmissionWindow,
) -> None:
    (waiter,) = await holders(window, 2)
    window.capacity = 4  # changed behind the window's back: only the tick notices
    await asyncio.wait_for(waiter, DEADLINE_S / 2)
    assert load(window) == (4, 0)


@on_window(1, close=False)
async def test_close_stops_the_poll_tick(window: AdmissionWindow) -> None:
    await window.close()  # nothing started: nothing to stop
    await window.acquire(1)
    (waiter,) = await holders(window, 1)
    ticker = window._ticker
    assert ticker is not None and not ticker.done()
    await window.close()
    assert ticker.cancelled()
    waiter.cancel()
    await settle()
    assert load(window) == (1, 0)


@on_window(1, 0.01, in_flight=1)
async def test_the_tick_ends_when_the_queue_is_empty_and_restarts_with_the_next_waiter(
    window: AdmissionWindow,
) -> None:
    (waiter,) = await holders(window, 1)
    first = window._ticker
    window.release(1)
    await settle()
    assert waiter.done()
    assert first is not None
    await asyncio.wait_for(first, DEADLINE_S / 2)  # ends by itself: the queue is empty
    (again,) = await holders(window, 1)
    second = window._ticker
    assert second is not None and second is not first and not second.done()
    window.release(1)
    await settle()
    assert again.done()
