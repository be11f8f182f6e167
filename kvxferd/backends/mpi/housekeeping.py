"""What keeps an MPI transport's links moving between its sends and receives.

MPI moves data only inside MPI calls, and the ofi netmod sends and acknowledges only
there too. So while a link exists a tick calls MPI every few milliseconds, whether or
not anything waits on it (about 1.5 % of a core per idle daemon here), and does what
nobody else would:

* reads the headers that arrived into each peer's pending table (also done by a recv
  that waits for its header, transport.py);
* drains the late message of a tag whose recv timed out into scratch and drops it, so
  the sender's `send` completes and the stale bytes never reach a later recv of that
  tag (tagbook.py keeps which tags are abandoned);
* keeps requests the transport gave up on (a send that failed half-posted, a late
  message's receive), with the buffers MPI may still use, until MPI ends them;
* sends each link's keepalives and marks a link whose MPI went silent while its peer
  runs (keepalive.py: a receive queue held up by another process on the host).

The tick stops once no link is live and nothing it holds may still end; it looks only
twice a second at requests whose peer is gone, which MPI may never end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxferd.backends.mpi import keepalive, wire
from kvxferd.backends.mpi.bootstrap import Runtime
from kvxferd.backends.mpi.link import Links
from kvxferd.backends.mpi.link_state import Link, Peer
from kvxferd.backends.mpi.quiet import ACCEPTS
from kvxferd.backends.tagbook import TagBook

log = logging.getLogger("kvxferd.backends.mpi")

# While a link exists, MPI is called this often regardless.
TICK_S = 0.005
# Requests abandoned for a peer that is gone may never end: look at them rarely.
STUCK_PERIOD_S = 0.5


@dataclass(eq=False)
class _Zombie:
    """An abandoned MPI request and the buffer it may still use."""

    req: Any
    buf: object
    peer_key: str
    link: Link
    since: float = field(default_factory=time.monotonic)


class Housekeeping:
    """The tick of one transport, and the requests it holds until MPI ends them.
    `runtime`: the transport's MPI runtime (None until it started; the tick starts only
    once a link exists, which needs it)."""

    def __init__(
        self, links: Links, tags: TagBook[tuple[str, int]], runtime: Callable[[], Runtime | None]
    ) -> None:
        self._links = links
        self._tags = tags
        self._runtime = runtime
        self._zombies: list[_Zombie] = []
        self._ticker: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Tick from now on, if not already ticking (idempotent)."""
        if not self._links.closed and (self._ticker is None or self._ticker.done()):
            self._ticker = asyncio.ensure_future(self._tick())

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    # -- headers ---------------------------------------------------------------

    def pump(self, peer: Peer, rt: Runtime) -> None:
        """Read the headers that arrived from the peer into its pending table."""
        for link in peer.links:
            while True:
                try:
                    if link.header_req is None:
                        if link.lost is not None:
                            break
                        link.header_req = link.comm.Irecv(
                            [link.header_buf, rt.MPI.BYTE], 0, wire.HEADER_TAG
                        )
                    if not link.header_req.Test():
                        break
                except Exception as exc:
                    if link.lost is None:
                        link.lost = f"MPI error reading a header ({exc})"
                    link.give_up()
                    link.header_req = None
                    break
                link.header_req = None
                if link.header_cancelled:
                    # The buffer holds the last header read, or nothing: not a
                    # new message (nor a malformed one).
                    break
                link.mpi_heard = time.monotonic()
                if wire.is_keepalive(link.header_buf):
                    continue  # only says that MPI delivers (keepalive.py)
                header = wire.unpack_header(link.header_buf)
                if header is None:
                    log.error("MPI: peer %s sent a malformed header; closing the link", peer.key)
                    self._links.drop_links(peer, "malformed message header", link.writer)
                    break
                tag, nbytes, data_tag = header
                if self._tags.take_back((peer.key, tag)):
                    self._drop_late(peer, link, tag, nbytes, data_tag, rt)
                else:
                    peer.pending.setdefault(tag, deque()).append((link, nbytes, data_tag))

    # -- late messages and abandoned requests ---------------------------------

    def park(self, reqs: list[Any], buf: object, peer: Peer, link: Link) -> None:
        """Keep requests (and their buffer) until MPI is done with them."""
        for req in reqs:
            with contextlib.suppress(Exception):
                req.Cancel()  # takes effect for a receive that has not matched yet
            self._zombies.append(_Zombie(req, buf, peer.key, link))
        self.start()

    def abandon(self, peer_key: str, tag: int) -> None:
        """A recv of `tag` timed out: its message, if it comes, is dropped."""
        self._tags.abandon((peer_key, tag), peer_key)
        self.start()

    def _drop_late(
        self, peer: Peer, link: Link, tag: int, nbytes: int, data_tag: int, rt: Runtime
    ) -> None:
        scratch = np.empty(max(nbytes, 1), dtype=np.uint8)
        try:
            req = link.comm.Irecv([scratch, nbytes, rt.MPI.BYTE], 0, data_tag)
        except Exception as exc:
            log.debug("MPI: could not drain a late message from %s: %s", peer.key, exc)
            return
        self._zombies.append(_Zombie(req, scratch, peer.key, link))
        self.start()
        log.info(
            "MPI: dropped a late %d-byte message with tag %d from %s (its recv had timed out)",
            nbytes,
            tag,
            peer.key,
        )

    # -- the tick ----------------------------------------------------------------

    async def _tick(self) -> None:
        while not self._links.closed:
            try:
                pause = self._tick_once()
            except Exception:
                # A stopped tick would stall every link without a word: say why, go on.
                log.exception("MPI progress tick failed; retrying")
                pause = STUCK_PERIOD_S
            if pause is None:
                return
            await asyncio.sleep(pause)

    def _tick_once(self) -> float | None:
        """One pass of the tick; how long to pause before the next, None to stop."""
        rt = self._runtime()
        assert rt is not None  # a link exists, or something was parked on one
        if ACCEPTS.count:
            # Every MPI call would wait behind an accept (quiet.py): the loop
            # would stop with it. Keepalives resume within ACCEPT_WINDOW_S, under STALL_S.
            return TICK_S
        now = time.monotonic()
        self._tags.expire(now)
        live = False
        for peer in list(self._links.peers.values()):
            self.pump(peer, rt)
            for link in peer.links:
                keepalive.send_keepalives(link, rt.MPI, now)
                keepalive.check_stall(peer, link, now)
            live = live or peer.live_link() is not None
        waiting = False  # on a request that may still end
        for z in list(self._zombies):
            try:
                finished = z.req.Test()
            except Exception:
                finished = True
            if finished:
                self._zombies.remove(z)
            elif z.link.lost is None or now - z.since < 1.0:
                waiting = True
        if live or waiting or self._tags.abandoned():
            return TICK_S
        if self._zombies:
            # Only receives from peers that are gone, which may never end.
            return STUCK_PERIOD_S
        return None
