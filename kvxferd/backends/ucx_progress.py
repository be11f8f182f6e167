"""How the UCX adapter (ucx.py) drives ucxx's progress: the progress mode, and in the
default "blocking" mode progress on the event loop, woken by the worker's descriptor."""

from __future__ import annotations

import asyncio
import importlib
import os
from typing import Any

from kvxferd.errors import StartupError

PROGRESS_MODE_ENV = "UCXPY_PROGRESS_MODE"
DEFAULT_PROGRESS_MODE = "blocking"
PROGRESS_MODES = ("blocking", "polling", "thread", "thread-polling")

# The blocking mode's safety net: progress and re-arm this often regardless.
_PROGRESS_TICK_S = 0.1


def progress_mode() -> str:
    """The ucxx progress mode to use: $UCXPY_PROGRESS_MODE, else DEFAULT_PROGRESS_MODE."""
    mode = os.environ.get(PROGRESS_MODE_ENV) or DEFAULT_PROGRESS_MODE
    if mode not in PROGRESS_MODES:
        raise StartupError(
            f"{PROGRESS_MODE_ENV}={mode!r} is not a ucxx progress mode; use one of "
            + ", ".join(PROGRESS_MODES)
        )
    return mode


class EventLoopProgress:
    """UCX progress on the event loop, woken by the worker's epoll descriptor.

    This is ucx-py's "blocking" mode, which ucxx 0.52 carries over with its
    re-arm step lost: its BlockingMode arms the worker once and never again,
    so after the first event the descriptor stays readable and the loop
    progresses UCX on every turn, a whole core even when idle. Here every
    event re-arms the worker once the loop has run what was ready, as ucx-py
    did, and a slow tick progresses and re-arms in case an event was missed.
    """

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop, retired: Any) -> None:
        self._worker = worker
        self._loop = loop
        # ucxx's BlockingMode removes the reader when it is garbage collected:
        # keep it alive, or it would remove ours (same descriptor).
        self._retired = retired
        self._fd = worker.epoll_file_descriptor
        self._arm_task: asyncio.Task[None] | None = None
        loop.add_reader(self._fd, self._on_event)
        self._tick_task = loop.create_task(self._tick())
        self._rearm()

    def _on_event(self) -> None:
        self._worker.progress()
        self._rearm()

    def nudge(self) -> None:
        """Progress soon: after we posted or cancelled something, which may
        need progress that no descriptor event will ask for."""
        self._rearm()

    def _rearm(self) -> None:
        if self._arm_task is None or self._arm_task.done():
            self._arm_task = self._loop.create_task(self._arm())

    async def _arm(self) -> None:
        while True:
            self._worker.progress()
            # Arm only once the callbacks that were ready have run (they may
            # post operations that need progress); arm() refuses while UCX
            # still has events to process.
            await asyncio.sleep(0)
            if self._worker.arm():
                return

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(_PROGRESS_TICK_S)
            self._worker.progress()
            self._rearm()


def install_event_loop_progress(ctx: Any, loop: asyncio.AbstractEventLoop) -> EventLoopProgress:
    """Replace ucxx's BlockingMode on `loop` by EventLoopProgress."""
    tasks = importlib.import_module("ucxx._lib_async.application_context").ProgressTasks
    current = tasks.get(loop)
    if isinstance(current, EventLoopProgress):
        return current
    if current is not None:
        loop.remove_reader(ctx.worker.epoll_file_descriptor)
        for task in current._tasks:
            task.cancel()
    driver = EventLoopProgress(ctx.worker, loop, current)
    tasks[loop] = driver
    return driver
