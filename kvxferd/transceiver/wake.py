"""A session's wake-up: an asyncio.Event whose timed wait costs no task.

`asyncio.wait_for(event.wait(), t)` wraps the coroutine in a new Task on Python 3.11
(create, schedule, cancel, collect): ~20 us, paid by every session several times per
request (the sender's wait for work and each poll pause of its write, the receiver's wait
for its result). At thousands of one-block requests a second on two cores that is a few
per cent of both daemons' CPU (docs/benchmarks.md, issue 16 "small requests"). A wait here
is one future and, when bounded, one timer handle.
"""

from __future__ import annotations

import asyncio


def _expire(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)


class Wake:
    """set / clear / is_set as asyncio.Event's; `wait(timeout)` says whether it was set."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[asyncio.Future[bool]] = []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(True)

    def clear(self) -> None:
        self._set = False

    async def wait(self, timeout: float | None = None) -> bool:
        """Until set (True) or `timeout` seconds passed (False; None: no limit; 0 still
        lets the loop turn once). Cancelling the waiting task leaves nothing behind."""
        if self._set:
            return True
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        self._waiters.append(fut)
        timer = None if timeout is None else loop.call_later(timeout, _expire, fut)
        try:
            return await fut
        finally:
            if timer is not None:
                timer.cancel()
            if fut in self._waiters:  # timed out or cancelled (set() empties the list)
                self._waiters.remove(fut)
