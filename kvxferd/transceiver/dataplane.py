"""Drives a (synchronous, not thread-safe) backend from one worker thread.

Transport libraries block in some calls (NIXL's post over shared memory copies
inline) and are not safe across threads. One dedicated thread runs every call,
so the event loop stays responsive (heartbeats, engine calls) and the library
only ever sees one caller at a time.

A hop to that thread and back costs 40-70 us on a 2-core host (submit, wake the
worker, hand the GIL over twice, wake the loop again), more than the call itself
for a small NIXL post (~15 us, the copy included) or a poll. A backend that allows
it (`inline_calls = True`: safe from any thread as long as one call runs at a
time) therefore takes its cheap calls on the event loop's own thread through
`call_cheap`, when the worker has nothing queued or running: a lock held by
whoever is inside the backend keeps the calls one at a time either way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from kvxferd.backends.base import Backend

P = ParamSpec("P")
R = TypeVar("R")


class DataPlane:
    def __init__(self, backend_factory: Callable[[], Backend]) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvxferd-dataplane"
        )
        self._factory = backend_factory
        self._backend: Backend | None = None
        # Held by whichever thread is inside the backend (the worker or, for an inline
        # call, the event loop's): the library never sees two calls at once.
        self._inside = threading.Lock()
        # Calls handed to the worker and not yet returned (counted on the loop's thread):
        # while any is, an inline call would jump the queue, so the cheap one queues too.
        self._queued = 0
        self._inline = False
        self.inline_calls = 0  # calls taken on the event loop's thread (status, tests)

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("data plane not started")
        return self._backend

    def counters(self) -> dict[str, int | None]:
        """For the status page: backend calls made on the loop's own thread, and writes
        posted from prepared descriptor lists (None: the backend has none, or is not up)."""
        prepared = getattr(self._backend, "prepared_writes", None)
        return {"inline_calls": self.inline_calls, "prepared_writes": prepared}

    async def start(self) -> Backend:
        loop = asyncio.get_running_loop()
        self._backend = await loop.run_in_executor(self._pool, self._factory)
        self._inline = bool(getattr(self._backend, "inline_calls", False))
        return self._backend

    def _locked(self, fn: Callable[[], R]) -> R:
        with self._inside:
            return fn()

    async def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        loop = asyncio.get_running_loop()
        self._queued += 1
        try:
            return await loop.run_in_executor(
                self._pool, self._locked, functools.partial(fn, *args, **kwargs)
            )
        finally:
            self._queued -= 1

    async def call_cheap(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """`call` for a call known to take microseconds (a small post, a poll, a release):
        made right here on the event loop's thread when the backend allows inline calls
        and the worker is idle; otherwise through the worker like any other."""
        if self._inline and not self._queued and self._inside.acquire(blocking=False):
            try:
                self.inline_calls += 1
                return fn(*args, **kwargs)
            finally:
                self._inside.release()
        return await self.call(fn, *args, **kwargs)

    async def close(self) -> None:
        if self._backend is not None:
            backend, self._backend = self._backend, None
            await self.call(backend.close)
        self._pool.shutdown(wait=True)
