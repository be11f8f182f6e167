"""MpiTransport: tagged messages between daemons over the links, on the event loop.

A message is a header and a payload (wire.py) on one of the peer's links
(link.py); the process's MPI comes from bootstrap.py. MPI errors become
kvxferd errors here: PeerLostError when the peer is gone, TransferTimeoutError
for a receive deadline, TransferError otherwise. One recv per peer and tag at
a time.

Receive deadlines and late messages
-----------------------------------
The payload is received straight into `out` (the staging reservation: no
copy), and only once its header has arrived, so a receive whose deadline
passes before the message came has posted nothing that could write there.
An MPI receive cannot be taken back once it has matched a message (MPI_Cancel
only cancels unmatched ones) and, as link.py says, one from a dead peer never
ends. So a recv that gives up mid-payload (the peer lost or stalled, see
below) raises an error whose `out_lent_until` (twosided.lent_until) is a
future that completes only once MPI is done with `out`, or once the peer is
done with the link (link.py: its end of the TCP connection came, which a
dead peer's kernel sends) and DRAIN_S passed for what it sent before to
land: the request is then given up (progress.py, forsake). Until then `out`
stays lent to MPI, and the staged runtime keeps that reservation out of use.
A recv cancelled mid-payload waits up to `stall_grace_s` for it, then closes
the link; MPI may still write into `out` after that, which is why the staged
runtime never cancels a recv (it leaves it to end by itself).

The deadline bounds the wait for the header; a message whose header came in
time gets `stall_grace_s` more to arrive whole, after which the link is
closed (PeerLostError). A tag whose recv timed out is abandoned: its late
message is received into scratch and dropped, so the sender's `send`
completes and the stale bytes never reach a later recv of that tag. A new
recv of an abandoned tag takes it back; abandoned tags are forgotten after
`abandon_ttl_s` or when the peer is removed.

`send` returns once MPI no longer reads `data` (for a large message: once the
receiver took it). If it must give up first, it raises PeerLostError when
the link is lost; when its task is cancelled it waits `stall_grace_s` for
MPI to finish, then closes the link, so the peer fails that receive instead
of using it. MPI cannot abort a send: in both cases it may go on reading
`data` for a message that was mid-way, into the peer's receive buffer, which
the peer's recv has given up on and keeps lent until MPI ends it.

Progress
--------
MPI moves data only inside MPI calls. Payloads (both directions) are driven
by a progress thread (progress.py) that waits for them in MPI_Waitany while any
moves and resolves their futures on the loop; the event loop only awaits
those futures, looking every few milliseconds whether the link was lost. A
request given up on a lost link is tested only once a millisecond (MPI never
ends one whose peer died), and not at all once its peer's end came.
Headers, rendezvous and late messages stay on the loop (MPI_Comm_accept/
connect in threads of their own; MPI_THREAD_MULTIPLE): a recv waiting for
its header yields to the loop for a few tests, then tests once every
`_POLL_MAX_SLEEP_S`. While a link exists a background tick (housekeeping.py)
calls MPI every 5 ms: it reads headers, drains late messages, keeps the
requests given up until MPI ends them, and sends the links' keepalives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import Any

from kvxferd.backends.mpi import keepalive, wire
from kvxferd.backends.mpi.bootstrap import Runtime, init_runtime, load_mpi4py, process_runtime
from kvxferd.backends.mpi.housekeeping import Housekeeping
from kvxferd.backends.mpi.link import Links
from kvxferd.backends.mpi.link_state import Link, Peer
from kvxferd.backends.mpi.progress import Progress
from kvxferd.backends.mpi.quiet import ACCEPTS
from kvxferd.backends.tagbook import TaggedTransport
from kvxferd.errors import PeerLostError, StartupError, TransferError, TransferTimeoutError

log = logging.getLogger("kvxferd.backends.mpi")

# Waiting for a header: the first polls only yield to the loop, later ones sleep this long.
_POLL_SPINS = 32
_POLL_MAX_SLEEP_S = 0.001
# While the progress thread moves a payload, the loop looks this often whether its
# link was lost, the peer removed or the stall limit passed.
_CHECK_S = 0.005
# A payload still arriving when its link is lost gets this long to complete.
_LOST_GRACE_S = 0.1
# After a link's peer closed its end, what it sent before lands within this; receives
# still pending on the link are then given up (their buffers come back).
DRAIN_S = 1.0


def _lent(exc: TransferError, done: asyncio.Future[int]) -> TransferError:
    """`exc`, saying that MPI may write the recv's `out` until `done` (twosided.lent_until)."""
    done.add_done_callback(_retrieved)
    exc.out_lent_until = done  # type: ignore[attr-defined]
    return exc


def _retrieved(fut: asyncio.Future[int]) -> None:
    if not fut.cancelled():
        fut.exception()  # the recv already failed: its late outcome is moot


def _flat(buf: memoryview, what: str) -> memoryview:
    if not buf.c_contiguous:
        raise TransferError(f"MPI {what} needs a contiguous buffer")
    return buf if buf.ndim == 1 and buf.format == "B" else buf.cast("B")


class MpiTransport(TaggedTransport[tuple[str, int]]):  # tags by (peer key, tag): see recv
    """Tagged messages between daemons over MPI (mpi4py + MPICH).

    Runs on the daemon's event loop; not thread-safe. See the package and
    module docstrings.
    """

    name = "MPI"
    # Asks the daemon to connect when a peer is accepted rather than at its
    # first round: see "Surviving a peer's death" in the package docstring.
    link_ahead = True

    def _open(self) -> None:
        self._mpi4py = load_mpi4py()
        if len(self.key.encode()) > wire.MAX_FIELD:
            raise StartupError(f"MPI peer key {self.key[:40]!r}... is too long")
        self._rt: Runtime | None = None
        self._links = Links(
            self.key, self._runtime, self._start_ticker, self._link_finished, self.link_secrets
        )
        self._house = Housekeeping(self._links, self._tags, lambda: self._rt)
        self._progress: Progress | None = None

    # -- set-up ------------------------------------------------------------

    async def _runtime(self) -> Runtime:
        if self._links.closed:
            raise TransferError(f"MPI transport {self.key} is closed")
        if self._rt is None:
            # Off the loop: the bootstrap starts mpiexec and waits for it.
            rt = process_runtime()
            self._rt = rt if rt is not None else await asyncio.to_thread(init_runtime)
        return self._rt

    @property
    def mode(self) -> str | None:
        """How MPI was initialised ("bootstrapped", "process manager", ...), or None."""
        return None if self._rt is None else self._rt.mode

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Initialise MPI and listen for peers; returns "host:port" to advertise."""
        await self._runtime()
        return await self._links.listen(host, port)

    async def connect(self, peer_key: str, address: str, timeout_s: float) -> None:
        """Rendezvous with the peer listening at `address`; ends with an intercommunicator.

        Returns at once when a live link to that peer exists (in either
        direction); concurrent calls for one peer share one rendezvous.
        """
        rt = await self._runtime()
        await self._links.connect(rt, peer_key, address, timeout_s)

    # -- peers ---------------------------------------------------------------

    async def remove_peer(self, peer_key: str) -> None:
        """Close every link of that peer; its pending sends and receives fail."""
        self._links.remove(peer_key)
        self._tags.forget_peer(peer_key)
        await asyncio.sleep(0)

    def peers(self) -> list[str]:
        """Keys of the peers with at least one live link."""
        return self._links.live_keys()

    # -- data ----------------------------------------------------------------

    def _mpi_error(self, exc: BaseException, peer: Peer, link: Link, what: str) -> TransferError:
        if isinstance(exc, TransferError):
            return exc
        if link.lost is not None or self._links.peers.get(peer.key) is not peer:
            return PeerLostError(f"MPI {what} with peer {peer.key}: peer lost ({exc})")
        return TransferError(f"MPI {what} with peer {peer.key} failed ({exc})")

    async def send(self, peer_key: str, tag: int, data: memoryview) -> None:
        """Send `data` (a contiguous host buffer) with `tag`; returns once MPI is done with it.

        A large message completes only when the receiver takes it. See the
        module docstring for what happens when it must give up first.
        """
        if not 0 <= tag < 1 << 64:
            raise ValueError(f"tag {tag} is not a 64-bit unsigned integer")
        rt = await self._runtime()
        MPI = rt.MPI
        if ACCEPTS.count:  # MPI calls wait behind an accept (quiet.py)
            await ACCEPTS.quiet()
        peer = self._links.peer(peer_key)
        link = peer.live_link()
        if link is None:
            raise PeerLostError(
                f"MPI: the link to peer {peer_key} is closed ({peer.lost_reason()})"
            )
        payload = _flat(data, "send")
        data_tag = link.next_tag()
        header = wire.pack_header(tag, payload.nbytes, data_tag)
        what = f"send of tag {tag}"
        reqs: list[Any] = []
        try:
            reqs.append(link.comm.Isend([header, MPI.BYTE], 0, wire.HEADER_TAG))
            reqs.append(link.comm.Isend([payload, MPI.BYTE], 0, data_tag))
        except Exception as exc:
            self._house.park(reqs, [header, payload], peer, link)
            raise self._mpi_error(exc, peer, link, what) from exc
        progress = self._progress_of(rt)
        done = progress.watch(reqs, keep=(header, payload))
        link.started(done)  # our end of the link stays open until MPI ends it (link.py)
        try:
            while True:
                await asyncio.wait({done}, timeout=_CHECK_S)
                if done.done():
                    try:
                        done.result()
                    except Exception as exc:
                        raise self._mpi_error(exc, peer, link, what) from exc
                    return
                if link.lost is not None or self._links.peers.get(peer_key) is not peer:
                    # The request stays with the progress thread until MPI ends it.
                    done.add_done_callback(_retrieved)
                    progress.demote(done)
                    raise PeerLostError(
                        f"MPI {what} to {peer_key}: peer lost ({link.lost or 'removed'})"
                    )
        except asyncio.CancelledError:
            await self._quiesce_send(done, peer, link)
            raise

    async def _quiesce_send(self, done: asyncio.Future[int], peer: Peer, link: Link) -> None:
        """The task in send was cancelled: give MPI `stall_grace_s` to finish with
        the buffer, then close the link (the peer fails its receive)."""
        loop = asyncio.get_running_loop()
        limit = loop.time() + self._stall_grace_s
        while loop.time() < limit and link.lost is None and not done.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({done}, timeout=_CHECK_S)
        if done.done():
            if not done.cancelled():
                done.exception()  # retrieved: the send was given up anyway
            return
        log.warning(
            "MPI: a send to %s was cancelled and not done %.1fs later; closing the link",
            peer.key,
            self._stall_grace_s,
        )
        self._links.drop_links(peer, "a cancelled send did not finish", link.writer)
        assert self._progress is not None  # it holds `done`
        self._progress.demote(done)

    def _progress_of(self, rt: Runtime) -> Progress:
        if self._progress is None:
            self._progress = Progress(rt.MPI)
        return self._progress

    async def recv(self, peer_key: str, tag: int, out: memoryview, timeout_s: float | None) -> int:
        """Receive the message with `tag` from that peer into `out`; returns its size.

        `timeout_s` (None: unbounded) bounds the wait for the message to arrive;
        on expiry TransferTimeoutError. Nothing is written into `out` except by
        a recv that returns its size (the module docstring says how).
        """
        if out.readonly:
            raise TransferError("MPI recv needs a writable buffer")
        target = _flat(out, "recv")
        rt = await self._runtime()
        peer = self._links.peer(peer_key)
        with self._tags.receiving((peer_key, tag), peer_key, tag):
            return await self._recv(rt, peer, tag, target, timeout_s)

    async def _recv(
        self, rt: Runtime, peer: Peer, tag: int, out: memoryview, timeout_s: float | None
    ) -> int:
        MPI = rt.MPI
        loop = asyncio.get_running_loop()
        deadline = math.inf if timeout_s is None else loop.time() + timeout_s
        spins = 0
        while True:
            if self._links.peers.get(peer.key) is not peer:
                raise PeerLostError(f"MPI recv of tag {tag} from {peer.key}: peer removed")
            if ACCEPTS.count and not await ACCEPTS.quiet_by(deadline):
                # MPI calls wait behind an accept (quiet.py): none before then.
                self._house.abandon(peer.key, tag)
                raise TransferTimeoutError(
                    f"MPI recv of tag {tag} from {peer.key}: nothing within {timeout_s:g}s "
                    "(MPI was held by an accept)"
                )
            self._house.pump(peer, rt)
            queue = peer.pending.get(tag)
            if queue:
                break
            # After the headers: what a peer sent before it died is still received.
            if peer.live_link() is None:
                raise PeerLostError(
                    f"MPI recv of tag {tag} from {peer.key}: peer lost ({peer.lost_reason()})"
                )
            now = loop.time()
            if now >= deadline:
                self._house.abandon(peer.key, tag)
                raise TransferTimeoutError(
                    f"MPI recv of tag {tag} from {peer.key}: nothing within {timeout_s:g}s"
                )
            spins += 1
            delay = 0.0 if spins < _POLL_SPINS else _POLL_MAX_SLEEP_S
            await asyncio.sleep(min(delay, deadline - now))
        link, nbytes, data_tag = queue[0]
        if nbytes > out.nbytes:
            # Left queued for a recv with a buffer large enough.
            raise TransferError(
                f"MPI recv of tag {tag} from {peer.key}: the message has {nbytes} bytes, "
                f"the buffer only {out.nbytes}"
            )
        queue.popleft()
        if not queue:
            del peer.pending[tag]
        what = f"recv of tag {tag}"
        target = out[:nbytes]
        try:
            req = link.comm.Irecv([target, nbytes, MPI.BYTE], 0, data_tag)
        except Exception as exc:
            raise self._mpi_error(exc, peer, link, what) from exc
        limit = (
            math.inf if deadline == math.inf else max(deadline, loop.time()) + self._stall_grace_s
        )
        progress = self._progress_of(rt)
        done = progress.watch([req], MPI.Status(), keep=target)
        link.started(done)
        if link.finished:
            self._link_finished(link)  # its peer sent all it ever will: bounded wait
        lost_at: float | None = None
        try:
            while True:
                await asyncio.wait({done}, timeout=_CHECK_S)
                if done.done():
                    break
                removed = self._links.peers.get(peer.key) is not peer
                if link.lost is not None and lost_at is None and not removed:
                    # What the peer sent before it went (or closed right after
                    # its send returned) may still be here: a moment to take it.
                    lost_at = loop.time()
                if removed or (lost_at is not None and loop.time() - lost_at > _LOST_GRACE_S):
                    progress.demote(done)
                    raise _lent(
                        PeerLostError(
                            f"MPI {what} from {peer.key}: peer lost mid-message "
                            f"({link.lost or 'removed'})"
                        ),
                        done,
                    )
                if loop.time() > limit:
                    self._links.drop_links(peer, "a message stalled", link.writer)
                    progress.demote(done)
                    raise _lent(
                        PeerLostError(
                            f"MPI {what} from {peer.key}: stalled mid-message "
                            f"{self._stall_grace_s:g}s past the deadline; link closed"
                        ),
                        done,
                    )
        except asyncio.CancelledError:
            await self._quiesce_recv(done, peer, link)
            raise
        try:
            return done.result()
        except Exception as exc:
            raise self._mpi_error(exc, peer, link, what) from exc

    async def _quiesce_recv(self, done: asyncio.Future[int], peer: Peer, link: Link) -> None:
        """A recv cancelled mid-payload: MPI writes `out` until the request ends. Give it
        `stall_grace_s`, then close the link (the module docstring says what is left)."""
        loop = asyncio.get_running_loop()
        limit = loop.time() + self._stall_grace_s
        while loop.time() < limit and not done.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({done}, timeout=_CHECK_S)
        if done.done():
            if not done.cancelled():
                done.exception()
            return
        log.warning(
            "MPI: a recv from %s was cancelled mid-message and not done %.1fs later; "
            "closing the link",
            peer.key,
            self._stall_grace_s,
        )
        self._links.drop_links(peer, "a cancelled recv did not finish", link.writer)
        assert self._progress is not None  # it holds `done`
        self._progress.demote(done)

    def _link_finished(self, link: Link) -> None:
        """The peer's end of the link closed: it is done with the link's MPI (link.py).
        What it sent before lands within DRAIN_S (the progress thread and the tick keep
        driving MPI); payload requests still pending then can never end, and are given up:
        a receive's buffer is ours again, a send no longer tested."""
        if link.pending:
            asyncio.get_running_loop().call_later(DRAIN_S, self._forsake, link)

    def _forsake(self, link: Link) -> None:
        if self._progress is None or not link.pending:
            return
        log.info(
            "MPI: %d message(s) under way when the peer ended its link (%s) given up",
            len(link.pending),
            link.lost,
        )
        for done in list(link.pending):
            done.add_done_callback(_retrieved)  # its caller may have gone already
            self._progress.forsake(
                done,
                PeerLostError(f"MPI: the peer ended the link mid-message ({link.lost})"),
            )

    def stalled_peers(self) -> dict[str, float]:
        """Peers alive whose MPI messages have not arrived for a while (keepalive.py): peer
        key -> seconds since the last."""
        return keepalive.stalled_peers(self._links.peers)

    def listener_refused(self) -> dict[str, int]:
        return self._links.listener_refused()

    def requests_in_progress(self) -> int:
        """Payload requests MPI has not ended that the progress thread still tests."""
        return 0 if self._progress is None else self._progress.held

    def _start_ticker(self) -> None:
        self._house.start()

    # -- teardown ------------------------------------------------------------

    async def close(self) -> None:
        """Stop listening and close every link. MPI itself stays up for the process."""
        if self._links.closed:
            return
        self._links.close()
        await self._house.close()
        self._links.drop_all("transport closed")
        self._tags.clear()
        if self._progress is not None:
            self._progress.close()
        await asyncio.sleep(0)
