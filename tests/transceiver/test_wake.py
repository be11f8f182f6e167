"""Wake: the sessions' event with a timed wait that costs no task."""

from __future__ import annotations

import asyncio

from kvxferd.transceiver.wake import Wake


def test_set_wakes_every_waiter() -> None:
    asyncio.run(_set_wakes_every_waiter())


async def _set_wakes_every_waiter() -> None:
    wake = Wake()
    waiters = [asyncio.create_task(wake.wait(5.0)) for _ in range(3)]
    await asyncio.sleep(0)
    wake.set()
    assert await asyncio.gather(*waiters) == [True, True, True]
    assert wake.is_set()
    assert not wake._waiters


def test_timeout_says_false_and_leaves_nothing() -> None:
    asyncio.run(_timeout_says_false_and_leaves_nothing())


async def _timeout_says_false_and_leaves_nothing() -> None:
    wake = Wake()
    assert await wake.wait(0.001) is False
    assert await wake.wait(0) is False
    assert not wake._waiters


def test_set_before_wait_returns_at_once_until_cleared() -> None:
    asyncio.run(_set_before_wait_returns_at_once_until_cleared())


async def _set_before_wait_returns_at_once_until_cleared() -> None:
    wake = Wake()
    wake.set()
    assert await wake.wait(None) is True
    wake.clear()
    assert not wake.is_set()
    assert await wake.wait(0.001) is False


def test_a_cancelled_wait_leaves_nothing() -> None:
    asyncio.run(_a_cancelled_wait_leaves_nothing())


async def _a_cancelled_wait_leaves_nothing() -> None:
    wake = Wake()
    task = asyncio.create_task(wake.wait(None))
    await asyncio.sleep(0)
    assert len(wake._waiters) == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    assert not wake._waiters
    wake.set()  # nothing left to wake, and no error


def test_a_zero_wait_lets_the_loop_turn() -> None:
    asyncio.run(_a_zero_wait_lets_the_loop_turn())


async def _a_zero_wait_lets_the_loop_turn() -> None:
    wake = Wake()
    ran = []
    asyncio.get_running_loop().call_soon(ran.append, 1)
    await wake.wait(0)
    assert ran == [1]
