"""The event loop stays out of MPI while an MPI_Comm_accept waits.

MPICH (5.0, UCX netmod) makes every MPI call of a process wait while an
MPI_Comm_accept of that process waits in another thread: a main-thread MPI_Irecv beside
an accept whose peer never connected made no progress in 60 s. The event loop's next
MPI call (a keepalive, a header test, a send) then stopped the whole daemon, its engine
API included, for as long as the accept waited. The accept's thread counts itself here
(`DYNAMIC`), and the loop's MPI work waits for it: the housekeeping tick skips its MPI
part, a send or a receive awaits `quiet()` before it posts. An accept is bounded by
ACCEPT_WINDOW_S (accepts.py). An MPI_Comm_connect does not hold the other calls (a
connect to a stopped listener left a message over another link to arrive in 0.3 s), so
it is not counted.

An accept that starts between the check and the loop's MPI call still makes that one
call wait; the window is a few instructions wide.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Iterator


class DynamicCalls:
    """How many MPI_Comm_accept calls are under way, process-wide."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.busy = 0  # read without the lock: an int, written under it
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Around the blocking call, in its own thread."""
        with self._lock:
            self.busy += 1
        try:
            yield None
        finally:
            with self._lock:
                self.busy -= 1
                waiters = self._waiters if self.busy == 0 else []
                if waiters:
                    self._waiters = []
            for loop, fut in waiters:
                with contextlib.suppress(RuntimeError):  # that loop is gone
                    loop.call_soon_threadsafe(_settle, fut)

    async def quiet(self) -> None:
        """Return once no accept is under way (at once when none is)."""
        while self.busy:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()
            with self._lock:
                if not self.busy:
                    return
                self._waiters.append((loop, fut))
            await fut

    async def quiet_by(self, deadline: float) -> bool:
        """`quiet()`, giving up at `deadline` (the loop's clock); whether it is quiet."""
        if self.busy:
            timeout = deadline - asyncio.get_running_loop().time()
            if timeout <= 0:
                return False
            if math.isinf(timeout):  # uvloop takes no infinite timer
                await self.quiet()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.quiet(), timeout)
        return not self.busy


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


DYNAMIC = DynamicCalls()
