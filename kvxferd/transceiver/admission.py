"""The generation side's admission window (the seed's max_tokens_in_buffer).

At most `capacity_blocks` destination blocks may be in flight; requests are
admitted first come, first served. A request larger than the whole window is
admitted alone when nothing else is in flight, so it can never wait forever.
Waiting requests are re-evaluated whenever blocks are released and, as the seed
requires, at least every `poll_interval_s` regardless.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(eq=False)
class _Waiter:
    blocks: int
    future: asyncio.Future[None]


class AdmissionWindow:
    def __init__(self, capacity_blocks: int | None, poll_interval_s: float | None) -> None:
        self.capacity = capacity_blocks
        self.poll_interval_s = poll_interval_s if poll_interval_s is not None else 5.0
        self.in_flight_blocks = 0
        self._queue: deque[_Waiter] = deque()
        self._ticker: asyncio.Task[None] | None = None
        self.on_wait: Callable[[float], None] | None = None  # seconds waited, per admission

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def _fits(self, blocks: int) -> bool:
        if self.capacity is None or self.in_flight_blocks == 0:
            return True
        return self.in_flight_blocks + blocks <= self.capacity

    def _grant_waiting(self) -> None:
        while self._queue:
            head = self._queue[0]
            if head.future.done():  # cancelled while waiting
                self._queue.popleft()
                continue
            if not self._fits(head.blocks):
                return  # FCFS: nobody overtakes the head
            self._queue.popleft()
            self.in_flight_blocks += head.blocks
            head.future.set_result(None)

    async def acquire(self, blocks: int) -> None:
        """Wait for room for `blocks`; cancel-safe (a cancelled waiter holds nothing)."""
        if not self._queue and self._fits(blocks):
            self.in_flight_blocks += blocks
            if self.on_wait is not None:
                self.on_wait(0.0)
            return
        waiter = _Waiter(blocks, asyncio.get_running_loop().create_future())
        self._queue.append(waiter)
        self._ensure_ticker()
        started = time.monotonic()
        try:
            await waiter.future
            if self.on_wait is not None:
                self.on_wait(time.monotonic() - started)
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.in_flight_blocks -= blocks  # granted just as we were cancelled
            else:
                # Leave the queue now: a cancelled head must not hold up the
                # requests behind it until the next poll tick.
                with contextlib.suppress(ValueError):
                    self._queue.remove(waiter)
            self._grant_waiting()
            raise

    def release(self, blocks: int) -> None:
        self.in_flight_blocks -= blocks
        self._grant_waiting()

    def resize(self, capacity_blocks: int | None, poll_interval_s: float | None) -> None:
        """A reload's new window: admitted requests keep their blocks; waiters are re-checked."""
        self.capacity = capacity_blocks
        self.poll_interval_s = poll_interval_s if poll_interval_s is not None else 5.0
        self._grant_waiting()

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick(), name="admission-poll")

    async def _tick(self) -> None:
        # The bounded re-evaluation of the seed's kv_transfer_poll_interval_ms.
        while self._queue:
            await asyncio.sleep(self.poll_interval_s)
            self._grant_waiting()

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
