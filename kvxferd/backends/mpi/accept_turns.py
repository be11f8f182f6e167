"""MPI's one accept at a time, handed out fairly (the rendezvous listener, link.py).

MPICH (5.0, UCX netmod) kills the process when two MPI_Comm_accept calls of one
process overlap, so the listener accepts one peer at a time. What a stranger of the TCP
port could do with that turn before, and what bounds it now:

* Say hello, take the ACK (and its MPI port) and close. The listener's accept then
  never completes and spins until a throwaway process releases it (accepts.py). The
  turn was handed on at once, so the next stranger's accept ran beside the one being
  released: four strangers looping kept up to five accepts and five releasing
  processes alive at once (python and mpiexec each), a process spawned for every
  hello. The turn now stays with the abandoned accept until it has ended, so there is
  one release at a time, and a stranger pays for its own.
* Queue many connections for the turn. The turn went first come first served, so one
  address with a hundred hellos queued kept a real peer waiting behind all of them.
  Now the turn goes round the source addresses waiting (one each, in the order they
  first queued), and at most MAX_WAITING connections may wait at once,
  MAX_WAITING_PER_SOURCE from one address: beyond, the newcomer is refused, counted as
  `accept_queue_limit`.
* Loop: every abandoned rendezvous costs a release, and pauses the daemon's MPI work
  while its accept waits (quiet.py). A source that left an accept to release waits
  before its next rendezvous is taken, 1 s, then twice as long each time, up to 60 s;
  a link made from it clears that. Daemons do not abandon rendezvous but when they die
  in one.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

# Connections that read their hello and wait for the accept turn: far above a reconnect
# wave (one connection per peer daemon), and what bounds the descriptors and tasks a
# stranger's queued hellos hold.
MAX_WAITING = 256
# From one source address: twice the daemons of an 8-GPU host, as the peer channel's
# PREAUTH_MAX_PER_SOURCE. Without it one address queued 256 hellos in 1.1 s and every
# other peer was refused.
MAX_WAITING_PER_SOURCE = 16
# A source whose rendezvous left an accept to release waits this long before its next
# one is taken, doubling with each such rendezvous up to _PENALTY_MAX_S. A link made from
# it clears the count, as does _PENALTY_MAX_S without another.
_PENALTY_FIRST_S = 1.0
_PENALTY_MAX_S = 60.0
# Sources remembered at most; beyond, those whose wait is long over are forgotten.
_PENALTY_SOURCES = 4096


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    called = False

    def call() -> None:
        nonlocal called
        if not called:
            called = True
            fn()

    return call


class AcceptTurns:
    """One holder at a time; waiters served round the source addresses (see above).

    `take(source)` waits for the turn and returns the call that hands it on (only the
    first call counts). Runs on the event loop.
    """

    def __init__(
        self, max_waiting: int = MAX_WAITING, max_per_source: int = MAX_WAITING_PER_SOURCE
    ) -> None:
        self.max_waiting = max_waiting
        self.max_per_source = max_per_source
        self.held = False
        self.waiting = 0
        self._waiting_from: dict[str, int] = {}
        # By source, in rotation order: dicts keep insertion order, and a source served
        # with more left goes to the back.
        self._queues: dict[str, deque[asyncio.Future[None]]] = {}
        # By source: (rendezvous abandoned in a row, monotonic time before which its
        # next one waits).
        self._penalties: dict[str, tuple[int, float]] = {}

    def full(self, source: str) -> str | None:
        """Why a new rendezvous from `source` may not wait (None: it may)."""
        if self.waiting >= self.max_waiting:
            return f"{self.waiting} rendezvous already wait for MPI's one accept at a time"
        if self._waiting_from.get(source, 0) >= self.max_per_source:
            return f"{self.max_per_source} rendezvous from {source} already wait for the accept"
        return None

    def penalize(self, source: str) -> None:
        """`source` left an accept to release: its next rendezvous waits (see above)."""
        now = time.monotonic()
        count, until = self._penalties.pop(source, (0, now))
        if now - until > _PENALTY_MAX_S:
            count = 0
        wait = min(_PENALTY_FIRST_S * 2**count, _PENALTY_MAX_S)
        self._penalties[source] = (count + 1, now + wait)
        if len(self._penalties) > _PENALTY_SOURCES:
            over = [k for k, (_, t) in self._penalties.items() if now - t > _PENALTY_MAX_S]
            for k in over or list(self._penalties)[: len(self._penalties) // 2]:
                del self._penalties[k]

    def forgive(self, source: str) -> None:
        """A link was made from `source`."""
        self._penalties.pop(source, None)

    async def take(self, source: str) -> Callable[[], None]:
        # Counted here only, overall and by source, for as long as the call waits.
        self.waiting += 1
        self._waiting_from[source] = self._waiting_from.get(source, 0) + 1
        try:
            return await self._take(source)
        finally:
            self.waiting -= 1
            left = self._waiting_from[source] - 1
            if left:
                self._waiting_from[source] = left
            else:
                del self._waiting_from[source]

    async def _take(self, source: str) -> Callable[[], None]:
        penalty = self._penalties.get(source)
        if penalty is not None:
            wait = penalty[1] - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        if not self.held:
            self.held = True
            return _once(self._hand_on)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(source, deque()).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._hand_on()  # granted as its waiter was cancelled: pass it on
            else:
                self._forget(source, fut)
            raise
        return _once(self._hand_on)

    def _forget(self, source: str, fut: asyncio.Future[None]) -> None:
        queue = self._queues.get(source)
        if queue is None or fut not in queue:
            return
        queue.remove(fut)
        if not queue:
            del self._queues[source]

    def _hand_on(self) -> None:
        while self._queues:
            source = next(iter(self._queues))
            queue = self._queues.pop(source)
            fut = queue.popleft()
            if queue:
                self._queues[source] = queue
            if not fut.done():
                fut.set_result(None)  # still held: now by that waiter
                return
        self.held = False
