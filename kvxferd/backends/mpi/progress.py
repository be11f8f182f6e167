"""A thread that drives MPI while payloads move, off the event loop.

MPI moves a message's bytes only inside MPI calls. Polling them from the
daemon's event loop meant either spinning the loop (every other request and
peer message then waits behind it) or testing once a millisecond (0.5 GB/s
between two bare processes here). Instead each payload request is handed to
this thread, which settles each one's future on the event loop
(call_soon_threadsafe) once MPI is done with its buffer. It runs only while it
holds requests and sleeps on a condition otherwise; MPI calls let go of the GIL,
so the event loop keeps running beside it.

How it waits: while it holds a request not demoted it blocks in MPI_Waitany over
those requests and one receive of its own on a private self-communicator, which
`watch`, `demote`, `forsake` and `close` complete (a one-byte send to itself) when
the thread may be waiting. MPICH then drives the bytes from C without pause. The
thread used to test each request from Python, one pass after another, yielding the
GIL between passes: two processes moving 16 MiB messages, 4 in flight, over UCX
shared memory without CMA moved 3.9 GB/s that way and 8.8 blocked in Waitany
(docs/benchmarks.md, issue 16 "staged runtime"). A request Waitany completed is
settled with the count its status gave; the rest are tested as before.

A request given to the thread stays with it until MPI completes it, whatever
the caller does meanwhile: its future is also how long its buffer stays lent to
MPI (transport.py: a receive given up mid-message keeps its staging bytes lent
until then). Two exceptions, both decided by transport.py:

* a request its caller gave up on (its peer lost) is `demote`d: tested every
  `_SLOW_PERIOD_S`, not back to back. MPI never ends a request whose peer died
  mid-message, and testing one without pause held a core for good.
* a request whose peer is done with the link (link.py: its end of the
  connection closed) is `forsake`n: dropped with an error, its request and
  buffer kept referenced for the life of the process (MPI still holds them,
  but nothing more arrives for a receive, and nobody takes a send).

MPI_THREAD_MULTIPLE (bootstrap.py) allows MPI calls from this thread beside
the event loop's; no request is touched by both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kvxferd.mpi")

# A demoted request is tested this often (each test also drives MPI for every link).
_SLOW_PERIOD_S = 0.001
# The tag of the thread's wake-up message to itself (on its own communicator).
_WAKE_TAG = 1


@dataclass(eq=False)
class _Watched:
    reqs: list[Any]
    status: Any
    keep: object  # the buffers MPI uses, alive as long as it may
    fut: asyncio.Future[int]
    loop: asyncio.AbstractEventLoop
    slow: bool = False
    next_test: float = 0.0
    # A single request that Waitany completed (its handle is then null): its byte count.
    waited: int | None = None


class Progress:
    """Completes MPI requests in a background thread; see the module docstring."""

    def __init__(self, MPI: Any) -> None:
        self._MPI = MPI
        self._cond = threading.Condition()
        self._new: list[_Watched] = []
        # Futures the event loop demoted (None) or forsook (the error to settle them with).
        self._orders: dict[asyncio.Future[int], BaseException | None] = {}
        # Forsaken requests and their buffers: MPI may hold them for good.
        self._forsaken: list[tuple[list[Any], object]] = []
        self._held = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        # Set (under _cond) while the thread may be in Waitany: a change must wake it.
        self._waiting = False
        self._wake_comm: Any = None  # made by the thread, before it first waits
        self._wake_out = bytearray(1)

    def watch(
        self, reqs: list[Any], status: Any = None, keep: object = None
    ) -> asyncio.Future[int]:
        """A future for `reqs` (posted, not touched again by the caller; `keep`: their
        buffers): the byte count of `status` (an MPI.Status for a single request, or
        None: 0) once all completed, or the MPI error that ended them."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        with self._changing():
            if self._closed:
                raise RuntimeError("MPI progress thread closed")
            self._new.append(_Watched(reqs, status, keep, fut, loop))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="kvxferd-mpi-progress", daemon=True
                )
                self._thread.start()
        return fut

    def demote(self, fut: asyncio.Future[int]) -> None:
        """Its caller gave up on that request: test it only every `_SLOW_PERIOD_S`."""
        with self._changing():
            self._orders.setdefault(fut, None)

    def forsake(self, fut: asyncio.Future[int], error: BaseException) -> None:
        """That request can never end (its peer is done with the link): stop testing it
        and fail its future with `error`. A receive's buffer is the caller's again."""
        with self._changing():
            self._orders[fut] = error

    @property
    def held(self) -> int:
        """Requests the thread tests (demoted included; forsaken ones not)."""
        return self._held

    def close(self) -> None:
        """Stop the thread once it holds no request (requests MPI never completes keep
        it, a daemon thread, until the process exits)."""
        with self._changing():
            self._closed = True

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Change what the thread works on, under _cond: the thread is notified and, if it
        may be waiting in Waitany, woken once (after the lock is let go)."""
        with self._cond:
            yield
            self._cond.notify()
            wake, self._waiting = self._waiting, False
        if wake:
            self._wake()

    def _wake(self) -> None:
        """Complete the thread's own receive (a one-byte message to itself): Waitany
        returns. Eager and local, so the send returns at once."""
        try:
            self._wake_comm.Send([self._wake_out, self._MPI.BYTE], 0, _WAKE_TAG)
        except Exception:  # MPI is failing: the thread's own calls will say so
            log.debug("MPI progress: the wake-up send failed", exc_info=True)

    def _run(self) -> None:
        MPI = self._MPI
        held: list[_Watched] = []
        wake_in = bytearray(1)
        wake: Any = None
        try:
            self._wake_comm = MPI.COMM_SELF.Dup()
            wake = self._wake_comm.Irecv([wake_in, MPI.BYTE], 0, _WAKE_TAG)
        except Exception as exc:  # never seen; the old way still moves every byte
            log.warning("MPI progress: no wake-up receive (%s); testing requests in a loop", exc)
        scratch = MPI.Status()
        try:
            while True:
                with self._cond:
                    while not held and not self._new:
                        if self._closed:
                            return
                        self._cond.wait()
                    held.extend(self._new)
                    self._new.clear()
                    orders, self._orders = self._orders, {}
                if orders:
                    self._obey(held, orders)
                busy = _one_pass(MPI, held, time.monotonic())
                self._held = len(held)
                if busy and wake is None:
                    time.sleep(0)  # lets the event loop's thread take the GIL
                elif busy:
                    with self._cond:
                        if self._new or self._orders:
                            continue
                        self._waiting = True
                    if _wait_any(MPI, held, wake, scratch):
                        try:
                            wake = self._wake_comm.Irecv([wake_in, MPI.BYTE], 0, _WAKE_TAG)
                        except Exception as exc:
                            log.warning("MPI progress: wake-up receive lost (%s); testing", exc)
                            wake = None
                    with self._cond:
                        self._waiting = False
                else:
                    with self._cond:  # only demoted requests: a new one wakes it at once
                        if not self._new and not self._orders:
                            self._cond.wait(_SLOW_PERIOD_S)
        finally:
            if wake is not None:
                with contextlib.suppress(Exception):
                    wake.Cancel()
                    wake.Wait()

    def _obey(
        self, held: list[_Watched], orders: dict[asyncio.Future[int], BaseException | None]
    ) -> None:
        for w in list(held):
            if w.fut not in orders:
                continue
            error = orders[w.fut]
            if error is None:
                w.slow = True
                continue
            held.remove(w)
            self._forsaken.append((w.reqs, w.keep))
            _settle(w, 0, error)


def _wait_any(MPI: Any, held: list[_Watched], wake: Any, status: Any) -> bool:
    """Block in MPI until one request of a watch not demoted completes, or the wake-up
    receive `wake` does (True: it must be posted again). A single request completed here
    keeps its count in `waited` (its handle is null now); a watch of several is tested
    whole afterwards (null handles count as complete). An MPI error ends the watch whose
    request it was (the one whose handle went null), or, when none did, is left to the
    test pass that follows to find."""
    flat: list[tuple[_Watched, Any]] = []
    for w in held:
        if w.slow or w.waited is not None:
            continue
        flat.extend((w, r) for r in w.reqs if r != MPI.REQUEST_NULL)
    if not flat:
        return False
    try:
        index = MPI.Request.Waitany([wake] + [r for _, r in flat], status)
    except Exception as exc:
        for w, r in flat:
            if r == MPI.REQUEST_NULL and w in held:
                held.remove(w)
                _settle(w, 0, exc)
        return bool(wake == MPI.REQUEST_NULL)  # the wake-up receive itself failed: again
    if index == 0:
        return True
    if 0 < index <= len(flat):
        w, _ = flat[index - 1]
        if len(w.reqs) == 1:
            w.waited = 0 if w.status is None else int(status.Get_count(MPI.BYTE))
    return False


def _one_pass(MPI: Any, held: list[_Watched], now: float) -> bool:
    """Test every held request once (a demoted one only when its turn came); settle and
    drop those that ended. True while a request not demoted is held. A function of its
    own so that no finished request (nor the buffer it kept) stays referenced from the
    thread's frame: a staging region cannot be unmapped while a view of it lives."""
    busy = False
    for w in list(held):
        if w.slow:
            if now < w.next_test:
                continue
            w.next_test = now + _SLOW_PERIOD_S
        else:
            busy = True
        if w.waited is not None:  # Waitany completed it
            held.remove(w)
            _settle(w, w.waited, None)
            continue
        try:
            one = len(w.reqs) == 1
            done = w.reqs[0].Test(w.status) if one else MPI.Request.Testall(w.reqs)
        except Exception as exc:
            held.remove(w)
            _settle(w, 0, exc)
            continue
        if done:
            held.remove(w)
            count = 0 if w.status is None else int(w.status.Get_count(MPI.BYTE))
            _settle(w, count, None)
    return busy


def _settle(w: _Watched, count: int, error: BaseException | None) -> None:
    def settle() -> None:
        if w.fut.done():
            return
        if error is None:
            w.fut.set_result(count)
        else:
            w.fut.set_exception(error)

    with contextlib.suppress(RuntimeError):  # the loop is gone
        w.loop.call_soon_threadsafe(settle)
