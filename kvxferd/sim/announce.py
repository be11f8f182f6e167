"""What the generation engine of a run tells the context engine, over a pipe.

Generation-first, as in a deployment: the generation engine announces each receive it
posted, and the context engine sends a request only then. It also announces each receive
that ended without its KV (failed, timed out, refused): the context engine then does not
send that request, or cancels the send it made, as a real scheduler drops a request whose
decode side gave up. Without that, a context engine that fell behind (its daemon stopped
for a while) went on sending requests whose receives were over, each waiting its full
kv_transfer_timeout for a receiver that would never come, and never caught up.

One line per event, "posted <request id>" or "ended <request id>"; both engines of a run
come from the same tree.
"""

from __future__ import annotations

import asyncio
import os
from typing import TextIO

POSTED = "posted"
ENDED = "ended"


class Announcer:
    """The generation engine's end of the pipe."""

    def __init__(self, fd: int) -> None:
        self._out: TextIO = os.fdopen(fd, "w", buffering=1)

    def __call__(self, kind: str, request_id: str) -> None:
        self._out.write(f"{kind} {request_id}\n")

    def close(self) -> None:
        self._out.close()


class Announcements:
    """The context engine's end: which requests were posted, and which ended."""

    def __init__(self) -> None:
        self._posted: dict[str, asyncio.Event] = {}
        self._ended: dict[str, asyncio.Event] = {}

    def heard(self, kind: str, request_id: str) -> None:
        if kind == ENDED:
            self.ended(request_id).set()
        if kind in (POSTED, ENDED):  # an ended receive is waited for no longer either
            self._event(self._posted, request_id).set()

    async def wait_posted(self, request_id: str) -> bool:
        """Until the receive of `request_id` was posted (True) or ended first (False)."""
        await self._event(self._posted, request_id).wait()
        return not self.ended(request_id).is_set()

    def ended(self, request_id: str) -> asyncio.Event:
        """Set once the generation engine said the receive of `request_id` is over."""
        return self._event(self._ended, request_id)

    def forget(self, request_id: str) -> None:
        """The request is over here too."""
        self._posted.pop(request_id, None)
        self._ended.pop(request_id, None)

    @staticmethod
    def _event(table: dict[str, asyncio.Event], request_id: str) -> asyncio.Event:
        event = table.get(request_id)
        if event is None:
            event = table[request_id] = asyncio.Event()
        return event

    async def listen(self, fd: int) -> None:
        """Read the generation engine's lines from `fd` until it closes."""
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb")
        )
        while line := await reader.readline():
            kind, _, request_id = line.decode().strip().partition(" ")
            self.heard(kind, request_id)
