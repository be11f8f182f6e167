"""Event-loop responsiveness: how late a short periodic sleep wakes up.

The lag is what every other task on the loop (peer heartbeats, engine calls,
HTTP) waits on top of its own work. /healthz is served by the same loop, so an
answer proves the loop runs; the lag says how well.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque


class LoopMonitor:
    def __init__(self, interval_s: float = 0.1, window: int = 100) -> None:
        self.interval_s = interval_s
        self.lag_s = 0.0
        self._recent: deque[float] = deque(maxlen=window)  # ~10 s at the default interval
        self.ticks = 0

    @property
    def max_lag_s(self) -> float:
        """The worst lag of the recent window."""
        return max(self._recent, default=0.0)

    async def run(self) -> None:
        # time.monotonic, not loop.time(): uvloop's clock has millisecond resolution.
        while True:
            start = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self.lag_s = max(0.0, time.monotonic() - start - self.interval_s)
            self._recent.append(self.lag_s)
            self.ticks += 1
