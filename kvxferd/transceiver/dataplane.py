"""Drives a (synchronous, not thread-safe) backend from one worker thread.

Transport libraries block in some calls (NIXL's post over shared memory copies
inline) and are not safe across threads. One dedicated thread runs every call,
so the event loop stays responsive (heartbeats, engine calls) and the library
only ever sees that thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
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

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise RuntimeError("data plane not started")
        return self._backend

    async def start(self) -> Backend:
        loop = asyncio.get_running_loop()
        self._backend = await loop.run_in_executor(self._pool, self._factory)
        return self._backend

    async def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def close(self) -> None:
        if self._backend is not None:
            backend, self._backend = self._backend, None
            await self.call(backend.close)
        self._pool.shutdown(wait=True)
