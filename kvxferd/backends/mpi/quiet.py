"""Which MPI dynamic-process calls may run beside what, kept on the event loop.

Measured with MPICH 5.0 (UCX netmod) here:

* While an MPI_Comm_accept waits, every other MPI call of the process waits too: a
  main-thread MPI_Irecv beside an accept whose peer never connected made no progress in
  60 s. The event loop's next MPI call (a keepalive, a header test, a send) stopped the
  whole daemon, its engine API included, for as long as the accept waited. So the loop
  makes no MPI call while `ACCEPTS` counts one: the housekeeping tick skips its MPI part,
  a send or a receive awaits `ACCEPTS.quiet()` before it posts.
* An MPI_Comm_connect made while the process's own accept waits never completes (not
  even at MPICH's connect timeout), and the connect left queued at the peer's port
  matched a later accept there, or crashed it (SIGSEGV). So a rendezvous as the
  connecting side (`CONNECTS`, from its hello until its connect ends) waits for no
  accept, and an accept waits for no connecting rendezvous (link.py).
* A waiting MPI_Comm_connect holds up no other call (a message over another link
  arrived in 0.3 s beside a connect to a stopped listener).

Both counts are entered on the event loop before the thread is started, and left on
the loop once the thread has ended, so a check and the start that follows it are one
step of the loop: nothing can start in between.
"""

from __future__ import annotations

import asyncio
import math


class Gate:
    """How many calls of one kind are under way in this process, and waiting for none."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self._waiters: list[asyncio.Future[None]] = []

    def enter(self) -> None:
        self.count += 1

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            waiters, self._waiters = self._waiters, []
            for fut in waiters:
                _settle(fut)

    async def quiet(self) -> None:
        """Return once none is under way (at once when none is)."""
        await self.quiet_by(math.inf)

    async def quiet_by(self, deadline: float) -> bool:
        """Wait until none is under way, giving up at `deadline` (the loop's clock);
        whether none is. It waits on its own future, woken by `leave()` in the same pass
        of the loop as the callbacks that may start the next call (a listener's turn
        handed on): through wait_for's extra task it woke a pass later, found the next
        accept started, and a receive with 20 s left failed in 0.16 s."""
        loop = asyncio.get_running_loop()
        while self.count:
            if loop.time() >= deadline:
                return False
            fut: asyncio.Future[None] = loop.create_future()
            self._waiters.append(fut)
            timer = None if math.isinf(deadline) else loop.call_at(deadline, _settle, fut)
            try:
                await fut
            finally:
                if timer is not None:
                    timer.cancel()
                if fut in self._waiters:
                    self._waiters.remove(fut)
        return True


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


ACCEPTS = Gate("MPI_Comm_accept")
CONNECTS = Gate("connecting rendezvous")
