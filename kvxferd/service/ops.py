"""The daemon's operational side tasks: the one-line summary systemd shows, the tasks
that run for the daemon's whole life (loop monitor, watchdog), and the scope that owns
every background task the daemon starts, so that stopping awaits them all."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvxferd.service.view import DaemonView

log = logging.getLogger("kvxferd.daemon")

STATUS_REFRESH_S = 10.0


def summary_line(daemon: DaemonView) -> str:
    """What `systemctl status` shows as Status: (kept short)."""
    settings = daemon.settings
    line = (
        f"{_state(daemon)}: {daemon.role}, {settings.runtime} over {settings.backend}; "
        f"{len(daemon.peers.connections)} peer(s), {len(daemon.api.engines)} engine(s), "
        f"{daemon.sender.active_count() + daemon.receiver.active_count()} request(s) in flight"
    )
    last = daemon.last_reload
    if last is not None and (last.result == "rejected" or last.restart_needed):
        line += f"; last {last.status_line()}"
    return line


def _state(daemon: DaemonView) -> str:
    if daemon.draining:
        return "draining"
    if daemon.ready:
        return "ready"
    return "stalled" if daemon.serving else "starting"  # serving: a peer's transfers stalled


async def refresh_status(daemon: DaemonView) -> None:
    """Keep systemd's STATUS= current while serving (only sent when it changes)."""
    if not daemon.notifier.enabled:
        return
    previous = ""
    while True:
        await asyncio.sleep(STATUS_REFRESH_S)
        line = summary_line(daemon)
        if line != previous and not daemon.draining:
            daemon.notifier.status(line)
            previous = line


class TaskScope:
    """Background tasks owned together: each is forgotten when it ends (a long-lived
    daemon starts many short ones), and `cancel` ends and awaits those still running, so
    nothing the daemon started outlives its stop. A task that fails is logged, never
    lost silently."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s task %s failed", self.name, task.get_name(), exc_info=task.exception())

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
