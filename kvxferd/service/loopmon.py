"""Event-loop responsiveness: how late a short periodic sleep wakes up.

The lag is what every other task on the loop (peer heartbeats, engine calls,
HTTP) waits on top of its own work. /healthz is served by the same loop, so an
answer proves the loop runs; the lag says how well.

A stall (the loop not waking for STALL_S) is counted and logged when it ends. In a
daemon's own process (`dump_stacks_on_stalls`) every thread's Python stack is also
written to stderr while the stall lasts: faulthandler's timer thread needs neither
the loop nor the GIL, so the stacks show what held the loop even when a native call
held the GIL (a peer then sees no heartbeats and declares us lost).
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import time
from collections import deque

log = logging.getLogger("kvxferd.daemon")

# Far past any lag the loop has in normal work (~ms) and short of the 5 s default
# heartbeat timeout, so the stacks are taken before peers give up on us.
STALL_S = 2.0

_dump_stacks = False


def dump_stacks_on_stalls() -> None:
    """Write every thread's stack to stderr when a loop stalls; once per process (one
    faulthandler timer serves the whole process, so not for daemons sharing one)."""
    global _dump_stacks
    _dump_stacks = True


class LoopMonitor:
    def __init__(self, interval_s: float = 0.1, window: int = 100) -> None:
        self.interval_s = interval_s
        self.lag_s = 0.0
        self._recent: deque[float] = deque(maxlen=window)  # ~10 s at the default interval
        self.ticks = 0
        self.stalls = 0  # wakes later than STALL_S

    @property
    def max_lag_s(self) -> float:
        """The worst lag of the recent window."""
        return max(self._recent, default=0.0)

    async def run(self) -> None:
        dump = _dump_stacks
        try:
            # time.monotonic, not loop.time(): uvloop's clock has millisecond resolution.
            while True:
                if dump:  # re-armed each wake: it fires only if the next one is late
                    faulthandler.dump_traceback_later(self.interval_s + STALL_S)
                start = time.monotonic()
                await asyncio.sleep(self.interval_s)
                self.lag_s = max(0.0, time.monotonic() - start - self.interval_s)
                self._recent.append(self.lag_s)
                self.ticks += 1
                if self.lag_s >= STALL_S:
                    self.stalls += 1
                    log.warning(
                        "the event loop stalled for %.1f s: no heartbeat, engine call or "
                        "transfer moved meanwhile%s",
                        self.lag_s,
                        " (every thread's stack was written to stderr during it)" if dump else "",
                    )
        finally:
            if dump:
                faulthandler.cancel_dump_traceback_later()
