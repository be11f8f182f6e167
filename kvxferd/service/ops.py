"""The daemon's operational side tasks: the one-line summary systemd shows, and
the tasks that run for the daemon's whole life (loop monitor, watchdog)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvxferd.service.daemon import Daemon

STATUS_REFRESH_S = 10.0


def summary_line(daemon: Daemon) -> str:
    """What `systemctl status` shows as Status: (kept short)."""
    state = "draining" if daemon.draining else "ready" if daemon.ready else "starting"
    line = (
        f"{state}: {daemon.role}, {daemon.settings.runtime} over {daemon.settings.backend}; "
        f"{len(daemon.peers.connections)} peer(s), {len(daemon.api.engines)} engine(s), "
        f"{daemon.sender.active_count() + daemon.receiver.active_count()} request(s) in flight"
    )
    last = daemon.last_reload
    if last is not None and (last.result == "rejected" or last.restart_needed):
        line += f"; last {last.status_line()}"
    return line


async def refresh_status(daemon: Daemon) -> None:
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


class TaskSet:
    """Background tasks cancelled together (at the very end of the daemon's life)."""

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))

    async def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
