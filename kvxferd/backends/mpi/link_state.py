"""One MPI link's state: its intercommunicator, the TCP connection that watches it, and
its end (GAVE_UP, then EOF once nothing of ours is pending on it; link.py's docstring
says why), and a peer's links with the message headers that came over them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvxferd.backends.mpi import wire


@dataclass(eq=False)
class Link:
    """One intercommunicator with a peer, and the TCP connection that watches it."""

    comm: Any
    writer: asyncio.StreamWriter
    tag_ub: int
    lost: str | None = None
    # The receive of the next message header (housekeeping.py reads them).
    header_buf: bytearray = field(default_factory=lambda: bytearray(wire.HEADER_SIZE))
    header_req: Any = None
    # drop_links cancelled header_req: what completes it is no header to read.
    header_cancelled: bool = False
    last_tag: int = 0
    watcher: asyncio.Task[None] | None = None
    # Our payload requests on the link (sends and receives) that MPI has not ended, by
    # their progress futures (transport.py): our end of the connection stays open while
    # any is (the module docstring says why).
    pending: set[asyncio.Future[int]] = field(default_factory=set)
    # We gave the link up (GAVE_UP written) / wrote our EOF / read the peer's EOF.
    given_up: bool = False
    eof_sent: bool = False
    finished: bool = False
    # Keepalives (keepalive.py): when each path of the link last brought something from
    # the peer, when ours last went, our MPI one in flight, and since when MPI is stalled.
    mpi_heard: float = field(default_factory=time.monotonic)
    tcp_heard: float = field(default_factory=time.monotonic)
    tcp_run_since: float = field(default_factory=time.monotonic)
    alive_bytes: int = 0  # ALIVE bytes read, and since when the link is ours
    made: float = field(default_factory=time.monotonic)
    keepalive_sent: float = 0.0
    keepalive_req: Any = None
    keepalive_buf: bytearray = field(default_factory=wire.keepalive_header)
    stalled_since: float | None = None

    @property
    def peer_registered(self) -> bool:
        """The peer registered the link too: it sends ALIVE bytes only for such a link."""
        return self.alive_bytes > 0

    def next_tag(self) -> int:
        self.last_tag = wire.next_data_tag(self.last_tag, self.tag_ub)
        return self.last_tag

    def started(self, done: asyncio.Future[int]) -> None:
        """A payload request on the link, pending until `done`."""
        self.pending.add(done)
        done.add_done_callback(self._ended)

    def _ended(self, done: asyncio.Future[int]) -> None:
        self.pending.discard(done)
        if self.given_up:
            self._end_if_idle()

    def give_up(self) -> None:
        """Tell the peer the link is lost (GAVE_UP, unless its end already came); our EOF
        follows once no send of ours is in flight on it."""
        if self.given_up:
            return
        self.given_up = True
        if not self.finished and not self.writer.is_closing():
            with contextlib.suppress(Exception):  # its end is gone: nothing to tell
                self.writer.write(wire.GAVE_UP)
        self._end_if_idle()

    def peer_ended(self) -> None:
        """The peer's EOF was read: nothing more comes over this link's MPI."""
        self.finished = True
        if self.eof_sent:
            self.writer.close()
        else:
            self.give_up()

    def _end_if_idle(self) -> None:
        # Half-closed, not closed: the watcher goes on reading until the peer's end, and
        # a closed socket would read as that end. Closed once both ends came.
        if self.pending or self.eof_sent:
            return
        self.eof_sent = True
        if self.finished:
            self.writer.close()
            return
        try:
            self.writer.write_eof()
        except Exception:
            self.writer.close()


@dataclass(eq=False)
class Peer:
    key: str
    links: list[Link] = field(default_factory=list)
    # 64-bit tag -> headers arrived and not yet received: (link, size, data tag).
    pending: dict[int, deque[tuple[Link, int, int]]] = field(default_factory=dict)

    def live_link(self) -> Link | None:
        for link in self.links:
            if link.lost is None:
                return link
        return None

    def lost_reason(self) -> str:
        reasons = [link.lost for link in self.links if link.lost]
        return reasons[-1] if reasons else "no connection"
