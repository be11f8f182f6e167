"""Event-loop responsiveness: how late a short periodic sleep wakes up.

The lag is what every other task on the loop (peer heartbeats, engine calls,
HTTP) waits on top of its own work. /healthz is served by the same loop, so an
answer proves the loop runs; the lag says how well.

A stall (the loop not waking for STALL_S) is counted and logged when it ends. In a
daemon's own process (`watch_for_stalls`) a watcher thread also logs, while the stall
lasts, where the loop's thread is: a peer that then declares us lost (no heartbeats)
is explained in our own log. The watcher reads the stack under the GIL
(sys._current_frames): faulthandler's timer reads it without, and crashed daemons
resumed after a SIGSTOP when it raced the running thread. A native call that holds the
GIL stops the watcher too; it then says how late it woke itself, which only a stopped
process or such a call explains.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback
from collections import deque

log = logging.getLogger("kvxferd.daemon")

# Far past any lag the loop has in normal work (~ms) and short of the 5 s default
# heartbeat timeout, so the stack is logged before peers give up on us.
STALL_S = 2.0
_WATCH_EVERY_S = 0.5
_STACK_FRAMES = 25

_watch = False
# Set when the process's loop is done (runner): a loop torn down without cancelling its
# monitor (an exception through the runner) must not look stalled from then on.
_loops_done = threading.Event()


def watch_for_stalls() -> None:
    """Log where the loop's thread is when a loop stalls (a daemon's own process)."""
    global _watch
    _watch = True


def stop_watching() -> None:
    _loops_done.set()


class LoopMonitor:
    def __init__(self, interval_s: float = 0.1, window: int = 100) -> None:
        self.interval_s = interval_s
        self.lag_s = 0.0
        self._recent: deque[float] = deque(maxlen=window)  # ~10 s at the default interval
        self.ticks = 0
        self.stalls = 0  # wakes later than STALL_S
        self._last_wake = time.monotonic()

    @property
    def max_lag_s(self) -> float:
        """The worst lag of the recent window."""
        return max(self._recent, default=0.0)

    async def run(self) -> None:
        stop = threading.Event()
        if _watch:
            threading.Thread(
                target=self._watch,
                args=(threading.get_ident(), stop),
                name="kvxferd-loop-watch",
                daemon=True,
            ).start()
        try:
            # time.monotonic, not loop.time(): uvloop's clock has millisecond resolution.
            while True:
                start = self._last_wake = time.monotonic()
                await asyncio.sleep(self.interval_s)
                self.lag_s = max(0.0, time.monotonic() - start - self.interval_s)
                self._recent.append(self.lag_s)
                self.ticks += 1
                if self.lag_s >= STALL_S:
                    self.stalls += 1
                    log.warning(
                        "the event loop stalled for %.1f s: no heartbeat, engine call or "
                        "transfer moved meanwhile",
                        self.lag_s,
                    )
        finally:
            stop.set()

    def _watch(self, loop_thread: int, stop: threading.Event) -> None:
        reported = 0.0  # the wake whose stall was logged
        while not stop.is_set():
            asleep = time.monotonic()
            stop.wait(_WATCH_EVERY_S)
            if stop.is_set() or _loops_done.is_set():
                return
            now = time.monotonic()
            last = self._last_wake
            if now - last < self.interval_s + STALL_S or last == reported:
                continue
            reported = last
            frame = sys._current_frames().get(loop_thread)
            where = "".join(traceback.format_stack(frame, _STACK_FRAMES)) if frame else "?\n"
            late = now - asleep - _WATCH_EVERY_S
            log.warning(
                "the event loop has not run for %.1f s; its thread is at:\n%s%s",
                now - last - self.interval_s,
                where.rstrip("\n"),
                (
                    f"\n(this watcher itself woke {late:.1f} s late: the process was stopped, "
                    "or a native call held the GIL)"
                    if late >= STALL_S
                    else ""
                ),
            )
