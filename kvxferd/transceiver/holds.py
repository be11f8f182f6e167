"""Holds: what an ended receive keeps from reuse until no write into it can still land.

A receive that fails, times out or is cancelled while a context daemon may still be
writing (one-sided backends write straight into our memory, and a closed TCP
connection does not stop a write already queued in the kernel or the NIC) reports
its outcome on time but keeps its memory on loan: the engine's blocks (PYTHON
runtime: the peer writes into them) and our bounce/staging reservations (the peer
writes into those). Each context daemon that may still write is a *pending leg* of
the hold. A leg is *fenced*, and never ends on a timer, when:

- it answers our Abort with AbortAck (it sends that only once its transfers are
  quiescent: see below for TCP), on the old connection or on a new
  one with the same incarnation;
- its process is gone: same kernel and pid namespace, watched through a pidfd
  (kvxferd.peers.process); a stopped process is not gone;
- it came back with a new incarnation and its old process cannot be watched here
  (another host): the old daemon's transfers died with it;
- an operator says its process is gone for good (FenceWriter, `kvxferd fence`): for a
  writer on another host that died and will not come back, nothing else can tell.

The keeper dials every peer with pending legs whose connection is gone, with
back-off, and sends the Aborts again on every new connection of the same
incarnation, and on the live one for a hold added after that connection came up (a
receive that failed because the old connection closed, ended just after the peer dialed
back in: otherwise nobody would ask it, and the hold would last until the writer's
process exits). When the last leg of a hold is fenced, its memory is handed back
(`on_released`: the engine hears a `released` event).

Over TCP an AbortAck is a fence only because the writer drains, never cancels, a write
to another host that was in flight when its request ended (transceiver/tx_drains.py):
its kernel's send buffer would otherwise deliver bytes after the AbortAck once a cut
link heals (docs/operations.md, "Drained writes"). Measured, and so no fence: this side
evicting the writer's agent (NIXL remove_remote_agent, done when the peer connection
closes): UCX's sockets to the writer stayed ESTABLISHED and the crashes came after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvxferd.errors import IncompatiblePeerError, KvxferdError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.messages import Abort
from kvxferd.peers.process import ProcessInfo, ProcessWatch, watch
from kvxferd.service.logs import shown
from kvxferd.service.pools import LocalPool
from kvxferd.transceiver.bounce import Reservation

log = logging.getLogger("kvxferd.holds")

Connect = Callable[[str], Awaitable[PeerConnection]]


class Fence:
    """How a leg was fenced (the `how` of a release; a metric label)."""

    ABORT_ACK = "abort_ack"
    PEER_EXITED = "peer_exited"
    PEER_RESTARTED = "peer_restarted"
    # It refused our new connection (our name was taken meanwhile), saying that every
    # transfer we asked of it is released (Refused.quiescent).
    PEER_QUIESCENT = "peer_quiescent"
    # An operator said its process is gone for good (FenceWriter, `kvxferd fence`): the
    # only fence for a writer on another host that died and will not come back.
    OPERATOR = "operator"


@dataclass(eq=False)
class HeldLeg:
    """A context daemon (one incarnation) that may still write into a hold's memory."""

    name: str
    incarnation: str
    address: str  # HOST:PORT we reached it at: where to dial it again
    process: ProcessInfo | None

    @property
    def key(self) -> str:
        return f"{self.name}/{self.incarnation}"


@dataclass(eq=False)
class Hold:
    request_id: str
    rx_token: int
    reason: str  # why the receive ended
    message: str
    pool: LocalPool | None
    block_ids: list[int]  # engine blocks kept on loan (none: the engine has them back)
    reservations: list[Reservation]
    pending: list[HeldLeg]
    since: float = field(default_factory=time.monotonic)
    # The receive's context peer as the engine named it: with request_id, the receive's
    # identity (request ids are unique per context instance only).
    peer: str = ""

    @property
    def key(self) -> tuple[str, int]:
        return (self.request_id, self.rx_token)

    @property
    def user(self) -> str:
        """Its mark among the pool's users: a held pool cannot be deregistered."""
        return f"held:{self.request_id}:{self.rx_token}"

    @property
    def blocks(self) -> int:
        return len(self.block_ids)


@dataclass(eq=False)
class _Peer:
    """Per incarnation of a context daemon with pending legs: its watch and its redial."""

    leg: HeldLeg
    watch: ProcessWatch | None
    task: asyncio.Task[None] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    reading: bool = False
    # The connection each of its holds was last asked on (an Abort sent there): a hold is
    # asked once per connection of the incarnation.
    asked: dict[tuple[str, int], PeerConnection] = field(default_factory=dict)


class HoldKeeper:
    def __init__(
        self,
        connect: Connect,
        release_reservation: Callable[[Reservation], None],
        retry_s: float,
        retry_max_s: float,
    ) -> None:
        self._connect = connect
        self._release_reservation = release_reservation
        self._retry_s = retry_s
        self._retry_max_s = retry_max_s
        self.holds: dict[tuple[str, int], Hold] = {}
        self._peers: dict[str, _Peer] = {}
        # Told of every hold whose memory is back, and how its last leg was fenced.
        self.on_released: Callable[[Hold, str], None] | None = None
        self.released_total: dict[str, int] = {}
        self.closed = False
        self.empty = asyncio.Event()  # set while no hold is kept (shutdown waits on it)
        self.empty.set()

    # ----------------------------------------------------------------- holding

    def add(self, hold: Hold) -> None:
        """Keep `hold` until every pending leg is fenced."""
        self.holds[hold.key] = hold
        self.empty.clear()
        if hold.pool is not None and hold.blocks:
            hold.pool.users.add(hold.user)  # a peer may write into the pool: keep it
        log.warning(
            "request %s: %d block(s) and %d reservation(s) held until %s cannot write any more",
            shown(hold.request_id),
            hold.blocks,
            len(hold.reservations),
            ", ".join(leg.key for leg in hold.pending),
            extra={"request_id": hold.request_id},
        )
        for leg in list(hold.pending):
            peer = self._peers.get(leg.key)
            if peer is None:
                peer = _Peer(leg, watch(leg.process) if leg.process else None)
                self._peers[leg.key] = peer
                if peer.watch is not None and peer.watch.gone_at_open:
                    self._fence_peer(leg.key, Fence.PEER_EXITED)
                    continue
                self._watch_exit(peer)
                peer.task = asyncio.create_task(self._redial(peer), name=f"fence-{leg.key}")
            peer.wake.set()

    def _watch_exit(self, peer: _Peer) -> None:
        if peer.watch is None or peer.watch.fd < 0:
            return
        try:
            asyncio.get_running_loop().add_reader(
                peer.watch.fd, self._fence_peer, peer.leg.key, Fence.PEER_EXITED
            )
            peer.reading = True
        except (OSError, ValueError, NotImplementedError) as exc:
            log.warning("cannot watch the process of %s: %s", peer.leg.key, exc)

    # ------------------------------------------------------------- the fences

    def on_fence_message(self, conn: PeerConnection, request_id: str, rx_token: int) -> bool:
        """A message the writer sends only once nothing more of it can land (AbortAck, its
        own Abort, its last Result) arrived from `conn`: True when it fenced a leg."""
        hold = self.holds.get((request_id, rx_token))
        if hold is None:
            return False
        for leg in hold.pending:
            if leg.key == conn.key:
                self._fence(hold, leg, Fence.ABORT_ACK)
                return True
        return False

    async def on_established(self, conn: PeerConnection) -> None:
        """A connection to a context daemon: ask its incarnation again, or take a new one on
        another host as proof that the old process and its transfers are gone."""
        for peer in list(self._peers.values()):
            if peer.leg.name == conn.peer.name:
                await self._on_connection(peer, conn)
                peer.wake.set()

    async def _on_connection(self, peer: _Peer, conn: PeerConnection) -> None:
        """What a live connection to `peer`'s daemon does for its holds: its incarnation is
        asked the Aborts not asked there yet; another incarnation reached where the old one
        was fences the legs whose old process cannot be watched."""
        leg = peer.leg
        if leg.incarnation == conn.peer.incarnation:
            await self._ask(peer, conn)
        elif peer.watch is None and conn.dialed and conn.label == leg.address:
            # Only a daemon we reached where the old one was: a name alone proves nothing
            # (another daemon misconfigured with it, a replacement elsewhere while the old
            # one still drains and writes).
            log.info(
                "peer %s came back as incarnation %s: its old transfers are gone",
                leg.key,
                conn.peer.incarnation,
            )
            self._fence_peer(leg.key, Fence.PEER_RESTARTED)

    async def _ask(self, peer: _Peer, conn: PeerConnection) -> None:
        """Send the Abort of each hold of `peer` not yet asked on `conn` (a connection of its
        incarnation); the AbortAck, on any connection of it, fences the leg."""
        for hold in self._holds_of(peer.leg.key):
            if peer.asked.get(hold.key) is conn:
                continue
            peer.asked[hold.key] = conn
            await conn.send(
                Abort(
                    request_id=hold.request_id,
                    rx_token=hold.rx_token,
                    reason=hold.reason,
                    message=hold.message,
                )
            )

    def _holds_of(self, peer_key: str) -> list[Hold]:
        return [h for h in self.holds.values() if any(leg.key == peer_key for leg in h.pending)]

    def _fence_peer(self, peer_key: str, how: str) -> None:
        for hold in self._holds_of(peer_key):
            for leg in list(hold.pending):
                if leg.key == peer_key:
                    self._fence(hold, leg, how)
        self._forget_peer(peer_key)

    def _fence(self, hold: Hold, leg: HeldLeg, how: str) -> None:
        if leg not in hold.pending:
            return
        hold.pending.remove(leg)
        peer = self._peers.get(leg.key)
        if peer is not None:
            peer.asked.pop(hold.key, None)
        log.info("request %s: %s fenced (%s)", shown(hold.request_id), leg.key, how)
        if not hold.pending:
            self._release(hold, how)
        if not self._holds_of(leg.key):
            self._forget_peer(leg.key)

    def _release(self, hold: Hold, how: str) -> None:
        self.holds.pop(hold.key, None)
        if not self.holds:
            self.empty.set()
        for res in hold.reservations:
            self._release_reservation(res)
        hold.reservations = []
        if hold.pool is not None:
            hold.pool.users.discard(hold.user)
        self.released_total[how] = self.released_total.get(how, 0) + 1
        log.warning(
            "request %s: held memory released after %.1f s (%s)",
            shown(hold.request_id),
            time.monotonic() - hold.since,
            how,
            extra={"request_id": hold.request_id},
        )
        if self.on_released is not None:
            self.on_released(hold, how)

    def _forget_peer(self, peer_key: str) -> None:
        peer = self._peers.pop(peer_key, None)
        if peer is None:
            return
        if peer.task is not None and peer.task is not asyncio.current_task():
            peer.task.cancel()
        if peer.watch is not None:
            if peer.reading:
                with contextlib.suppress(Exception):
                    asyncio.get_running_loop().remove_reader(peer.watch.fd)
            peer.watch.close()

    def fence_by_operator(self, name: str, incarnation: str = "") -> tuple[list[str], list[str]]:
        """Fence every pending leg of daemon `name` (of one `incarnation`; "": all of them)
        on an operator's word that its process is gone (Fence.OPERATOR). Returns the peer
        keys fenced and those left alone because their process is watched here and has
        not exited (a stopped one can still write; killed, it fences itself). The caller
        refuses it for a daemon still connected."""
        fenced, alive = [], []
        for key, peer in list(self._peers.items()):
            if peer.leg.name != name or (incarnation and peer.leg.incarnation != incarnation):
                continue
            if peer.watch is not None:
                alive.append(key)  # its exit would have fenced it already
                continue
            log.warning("holds: %s fenced on an operator's word that its process is gone", key)
            self._fence_peer(key, Fence.OPERATOR)
            fenced.append(key)
        return fenced, alive

    # -------------------------------------------------------------- re-asking

    async def _redial(self, peer: _Peer) -> None:
        """While legs of this peer are pending: whenever no connection of its incarnation is
        up, dial it again (back-off), so the Aborts can be asked again and answered."""
        pause = self._retry_s
        conn: PeerConnection | None = None
        while peer.leg.key in self._peers and not self.closed:
            if conn is None or conn.closed.is_set():
                try:
                    # A new connection runs on_established, which asks again.
                    conn = await self._connect(peer.leg.address)
                except IncompatiblePeerError as exc:
                    if (
                        exc.quiescent
                        and exc.peer_name == peer.leg.name
                        and exc.peer_incarnation == peer.leg.incarnation
                    ):
                        self._fence_peer(peer.leg.key, Fence.PEER_QUIESCENT)
                        return
                except (KvxferdError, OSError, asyncio.TimeoutError):
                    pass
            # Cleared before the asking below: a hold added meanwhile sets it again.
            peer.wake.clear()
            if conn is not None and not conn.closed.is_set():
                # The connection may have come up before this hold was added (or be the
                # one another receive dialed): on_established saw only the holds of then.
                await self._on_connection(peer, conn)
                if peer.leg.key not in self._peers:
                    return  # fenced (the daemon came back as a new incarnation)
            waits: list[asyncio.Future[object]] = [asyncio.ensure_future(peer.wake.wait())]
            if conn is not None and not conn.closed.is_set():
                waits.append(asyncio.ensure_future(conn.closed.wait()))
            try:
                await asyncio.wait(waits, timeout=pause, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            pause = min(pause * 2, self._retry_max_s)

    # ------------------------------------------------------------ reporting

    def held_blocks(self) -> int:
        return sum(h.blocks for h in self.holds.values())

    def held_reservation_bytes(self) -> int:
        return sum(r.nbytes for h in self.holds.values() for r in h.reservations)

    def oldest_age_s(self) -> float:
        if not self.holds:
            return 0.0
        return time.monotonic() - min(h.since for h in self.holds.values())

    def by_peer(self) -> dict[str, dict[str, float]]:
        """Per context daemon (name): holds, blocks held and the age of its oldest hold."""
        now = time.monotonic()
        out: dict[str, dict[str, float]] = {}
        for hold in self.holds.values():
            for name in {leg.name for leg in hold.pending}:
                row = out.setdefault(name, {"holds": 0, "blocks": 0, "oldest_s": 0.0})
                row["holds"] += 1
                row["blocks"] += hold.blocks
                row["oldest_s"] = max(row["oldest_s"], now - hold.since)
        return out

    async def close(self) -> list[Hold]:
        """Stop re-asking (daemon shutdown); returns the holds never fenced."""
        self.closed = True
        left = list(self.holds.values())
        for key in list(self._peers):
            self._forget_peer(key)
        return left
