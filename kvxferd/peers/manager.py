"""Peer connections: listening, dialing, handshakes, and the registry of live peers.

A slow or failing handshake with one peer never blocks others: each address has
its own dial in flight, shared by every request waiting for that peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from kvxferd import hostport
from kvxferd.errors import (
    HandshakeError,
    IncompatiblePeerError,
    KvxferdError,
    ProtocolError,
    StartupError,
)
from kvxferd.peers import tls
from kvxferd.peers.backoff import DialBackoff
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.framing import FrameTooLargeError
from kvxferd.peers.handshake import (
    ForPeer,
    Identity,
    InfoCheck,
    PeerIdentity,
    client_handshake,
    server_handshake,
)
from kvxferd.peers.messages import Info, PeerMessage, PoolsUpdate, Refused
from kvxferd.peers.preauth import PreauthGate
from kvxferd.service.logs import TEXT_LIMIT, LogLimiter, shown
from kvxferd.transceiver.dataplane import DataPlane

log = logging.getLogger("kvxferd.peers")

# Handshake failures are logged at most a few per source host in this many seconds.
_FAILURE_LOG_INTERVAL_S = 10.0

OnMessage = Callable[[PeerConnection, PeerMessage], Awaitable[None]]
OnClosed = Callable[[PeerConnection], Awaitable[None]]


def split_hostport(address: str) -> tuple[str, int]:
    try:
        return hostport.split_hostport(address, "peer address")
    except ValueError as exc:
        raise KvxferdError(str(exc)) from None


class PeerObserver(Protocol):
    """Told of handshakes and lost peers (the daemon's metrics)."""

    def handshake_ok(self, peer: str) -> None: ...

    def handshake_failed(self, exc: BaseException) -> None: ...

    def connection_refused(self, reason: str) -> None: ...

    def malformed_message(self, source: str, exc: ProtocolError) -> None: ...

    def peer_closed(self, peer: str, heartbeat_lost: bool) -> None: ...


class Resolver(Protocol):
    """Peer name -> address to dial (kvxferd.discovery.AddressResolver)."""

    @property
    def static_peers(self) -> dict[str, str]:
        """daemon.peers, replaced in place by a reload (empty with etcd discovery)."""
        ...

    def resolve_address(self, peer: str) -> str:
        """The address for `peer` (a name or HOST:PORT); KvxferdError saying why not."""
        ...


@dataclass
class PeerTimings:
    handshake_s: float
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


class PeerManager:
    def __init__(
        self,
        me: Identity,
        dataplane: DataPlane,
        make_info: Callable[[], Awaitable[Info]],
        check_info: InfoCheck,
        timings: PeerTimings,
        resolver: Resolver,
        on_message: OnMessage,
        on_closed: OnClosed,
    ) -> None:
        self.me = me
        self._dp = dataplane
        self._make_info = make_info
        self._check_info = check_info
        self.timings = timings
        # Names resolve through discovery (static or etcd), given, not built, here.
        self.resolver = resolver
        self._on_message = on_message
        self._on_closed = on_closed
        self.connections: dict[str, PeerConnection] = {}  # by peer key name/incarnation
        self._by_address: dict[str, PeerConnection] = {}
        self._dialing: dict[str, asyncio.Task[PeerConnection]] = {}
        self._server: asyncio.base_events.Server | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self.handshake_failures: dict[str, int] = {}
        # Accepted connections not yet authenticated, and those refused for their number.
        self.preauth = PreauthGate()
        self.preauth.on_refused = self._connection_refused
        self._failure_log = LogLimiter(_FAILURE_LOG_INTERVAL_S, burst=3)
        self.listen_address = ""
        # Mutual TLS for every connection made from now on (None: plain TCP); a reload
        # replaces it, connections already established keep the one they were made with.
        self.tls: tls.PeerTls | None = None
        self.observer: PeerObserver | None = None
        # What of our Info is for one peer alone (its link secret: PeerRoutes.info_for).
        self.info_for_peer: ForPeer | None = None
        # Called once a connection is registered, with the Info we sent in its handshake:
        # what changed on our side since that Info was made reached no broadcast.
        self.on_established: Callable[[PeerConnection, Info], Awaitable[None]] | None = None
        # Waits until nothing that incarnation asked for can still be written (our
        # transfers for it released); True when so. Backs a quiescent refusal.
        self.settle_incarnation: Callable[[PeerIdentity], Awaitable[bool]] | None = None
        # Awaited before a closed connection's agent is evicted (it may wait long).
        self.before_evict: Callable[[PeerConnection], Awaitable[None]] | None = None
        # Agents whose metadata a handshake in progress loads (by the name its Info
        # gives): a closed connection's eviction, which may have waited long for a drain,
        # must not remove the agent a new connection of the same incarnation just loaded.
        self._loading: Counter[str] = Counter()

    # ------------------------------------------------------------- listening

    async def listen(self, host: str, port: int) -> str:
        try:
            self._server = await asyncio.start_server(self._accept, host, port)
        except OSError as exc:
            raise StartupError(f"cannot listen for peers on {host}:{port}: {exc}") from exc
        sock = self._server.sockets[0].getsockname()
        self.listen_address = f"{sock[0]}:{sock[1]}"
        return self.listen_address

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername")
        label = f"{peername[0]}:{peername[1]}" if peername else "unknown"
        source = str(peername[0]) if peername else "unknown"
        # Before anything is read: over a cap, the connection is dropped at once.
        authenticated = self.preauth.enter(source, label)
        if authenticated is None:
            writer.transport.abort()
            return

        task = asyncio.current_task()
        if task is not None:
            self._handshakes.add(task)
        make_info, sent = self._recording_info()
        load = _AgentLoad(self)
        context = self.tls.server if self.tls is not None else None

        async def handshake() -> tuple[PeerIdentity, Info]:
            names = None
            if context is not None:
                names = await tls.accept(reader, writer, tls.TlsPeer(context, label))
            return await server_handshake(
                reader,
                writer,
                self.me,
                make_info,
                load,
                label,
                self._admit,
                authenticated,
                tls_names=names,
                for_peer=self.info_for_peer,
            )

        try:
            peer, info = await asyncio.wait_for(handshake(), self.timings.handshake_s)
            await self._established(reader, writer, peer, info, label, load.agent, sent)
        except asyncio.CancelledError:
            await load.undo()
            raise
        except (KvxferdError, OSError, asyncio.TimeoutError) as exc:
            await load.undo()
            self._count_failure(exc)
            # One line per source host per window: a peer (or a scanner) failing over and
            # over must not become a flood of lines.
            self._failure_log.log(
                log,
                logging.WARNING,
                ("from", source),
                "handshake from %s failed: %s",
                label,
                shown(exc, TEXT_LIMIT, quote=False) if str(exc) else "timed out",
            )
            if isinstance(exc, FrameTooLargeError):
                writer.transport.abort()  # its body is not read, nor waited for
            else:
                writer.close()
        finally:
            load.done()  # registered, undone, or cancelled: no longer loading
            authenticated()
            if task is not None:
                self._handshakes.discard(task)

    def _connection_refused(self, reason: str) -> None:
        if self.observer is not None:
            self.observer.connection_refused(reason)

    # --------------------------------------------------------------- dialing

    @property
    def static_peers(self) -> dict[str, str]:
        return self.resolver.static_peers

    def resolve_address(self, peer: str) -> str:
        address = self.resolver.resolve_address(peer)
        split_hostport(address)
        return address

    async def connect(self, peer: str) -> PeerConnection:
        """The live connection to `peer` (a static peer name or HOST:PORT), dialing if needed."""
        address = self.resolve_address(peer)
        conn = self._by_address.get(address)
        if conn is not None and not conn.closed.is_set():
            return conn
        dial = self._dialing.get(address)
        if dial is None:
            # A peer that failed its last dial waits before the next: fail now, saying
            # when and why, rather than dial a dead peer once per receive.
            self.dial_backoff.check(address)
            dial = asyncio.create_task(self._dial(address), name=f"dial-{address}")
            self._dialing[address] = dial
            dial.add_done_callback(partial(self._dial_done, address))
        # Shielded: one waiter giving up must not abort the dial others share.
        return await asyncio.shield(dial)

    def _dial_done(self, address: str, dial: asyncio.Task[PeerConnection]) -> None:
        self._dialing.pop(address, None)
        # Every receive that waited may have given up (cancelled by its engine) before the
        # shared dial failed: its error is then nobody's, and asyncio would log it as a
        # "Task exception was never retrieved" ERROR with a traceback. It is counted in
        # the dial backoff, which tells the next receive.
        if not dial.cancelled():
            dial.exception()

    @property
    def dial_backoff(self) -> DialBackoff:
        """Per peer address, the backoff after failed dials (kvxferd.peers.backoff)."""
        backoff: DialBackoff | None = getattr(self, "_dial_backoff", None)
        if backoff is None:
            backoff = self._dial_backoff = DialBackoff()
        return backoff

    async def _dial(self, address: str) -> PeerConnection:
        backoff = self.dial_backoff
        backoff.dialing(address)
        try:
            conn = await self._dial_once(address)
        except IncompatiblePeerError:
            # It answered and refused: alive. Its refusal is told every time, no backoff.
            backoff.answered(address)
            raise
        except (KvxferdError, OSError, asyncio.TimeoutError) as exc:
            wait_s = backoff.failed(address, shown(exc, TEXT_LIMIT, quote=False))
            log.debug("peer %s: dial failed; next dial in %.2f s at the earliest", address, wait_s)
            raise
        backoff.succeeded(address)
        return conn

    async def _dial_once(self, address: str) -> PeerConnection:
        host, port = split_hostport(address)
        context = self.tls.client if self.tls is not None else None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), self.timings.handshake_s
            )
        except (OSError, asyncio.TimeoutError) as exc:
            self._count_failure(exc)
            raise HandshakeError(f"cannot connect to peer {address}: {exc or 'timed out'}") from exc
        make_info, sent = self._recording_info()
        load = _AgentLoad(self)

        async def handshake() -> tuple[PeerIdentity, Info]:
            names = None
            if context is not None:
                names = await tls.dial(reader, writer, tls.TlsPeer(context, address))
            return await client_handshake(
                reader,
                writer,
                self.me,
                make_info,
                load,
                address,
                tls_names=names,
                for_peer=self.info_for_peer,
            )

        try:
            peer, info = await asyncio.wait_for(handshake(), self.timings.handshake_s)
        except asyncio.CancelledError:
            await load.undo()
            raise
        except asyncio.TimeoutError as exc:
            writer.close()
            await load.undo()
            self._count_failure(exc)
            hint = " (no StartTls came: does it have daemon.tls_* set?)" if context else ""
            raise HandshakeError(f"handshake with {address} timed out{hint}") from exc
        except (KvxferdError, OSError) as exc:
            writer.close()
            await load.undo()
            self._count_failure(exc)
            self._failure_log.log(
                log,
                logging.WARNING,
                ("with", address),
                "handshake with %s failed: %s",
                address,
                shown(exc, TEXT_LIMIT, quote=False),
            )
            raise
        try:
            conn = await self._established(
                reader, writer, peer, info, address, load.agent, sent, dialed=True
            )
        finally:
            load.done()
        self._by_address[address] = conn
        return conn

    def _recording_info(self) -> tuple[Callable[[], Awaitable[Info]], list[Info]]:
        """make_info for one handshake, and the list that will hold the Info it made."""
        sent: list[Info] = []

        async def make_info() -> Info:
            info = await self._make_info()
            sent.append(info)
            return info

        return make_info, sent

    async def _admit(self, peer: PeerIdentity) -> Refused | None:
        """A second daemon under the name of a live, connected peer is refused: replacing
        the live one would fail all its requests. An old connection that does not answer
        a ping in time (its daemon died without a FIN, or restarted and the old socket is
        half-open) is closed and the newcomer admitted."""
        # As long as the heartbeat would give a silent peer, within the handshake's time.
        probe_s = min(self.timings.heartbeat_timeout_s, self.timings.handshake_s / 2)
        for old in list(self.connections.values()):
            if old.peer.name != peer.name or old.closed.is_set():
                continue
            if await old.probe(probe_s):
                log.warning(
                    "refused a second peer named %r (incarnation %s): the connected one "
                    "(incarnation %s, %s) answers",
                    peer.name,
                    peer.incarnation,
                    old.peer.incarnation,
                    old.label,
                )
                # The refused daemon may be a stale incarnation that resumed and still
                # holds memory our writes could reach: say when nothing of its can.
                quiescent = False
                if self.settle_incarnation is not None:
                    with contextlib.suppress(asyncio.TimeoutError):
                        quiescent = await asyncio.wait_for(
                            self.settle_incarnation(peer), self.timings.handshake_s / 4
                        )
                return Refused(
                    reason="name_in_use",
                    message=f"a live peer named {peer.name!r} is connected and answering; "
                    "a second daemon may not take its name",
                    quiescent=quiescent,
                )
            if old.peer.incarnation != peer.incarnation:
                log.info(
                    "peer %s restarted (incarnation %s -> %s); the old connection did not "
                    "answer, dropping it",
                    peer.name,
                    old.peer.incarnation,
                    peer.incarnation,
                )
            old.close(f"did not answer when another connection claimed the name {peer.name!r}")
        return None

    # ----------------------------------------------------------- established

    async def _established(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: PeerIdentity,
        info: Info,
        label: str,
        agent: str,
        sent: list[Info] | None = None,
        dialed: bool = False,
    ) -> PeerConnection:
        """`agent`: the peer's agent, loaded in the handshake (_AgentLoad)."""
        # A restarted peer (same name, new incarnation) replaces its old connection.
        for old in list(self.connections.values()):
            if old.peer.name == peer.name and old.peer.incarnation != peer.incarnation:
                log.info(
                    "peer %s restarted (incarnation %s -> %s); dropping the stale one",
                    peer.name,
                    old.peer.incarnation,
                    peer.incarnation,
                )
                old.close("peer restarted with a new incarnation")
        conn = PeerConnection(
            reader,
            writer,
            peer,
            info,
            agent,
            label,
            self.timings.heartbeat_interval_s,
            self.timings.heartbeat_timeout_s,
        )
        conn.dialed = dialed
        if self.observer is not None:
            conn.on_protocol_error = partial(self.observer.malformed_message, "peer")
        self.connections[conn.key] = conn
        conn.start(self._on_message, self._closed)
        if self.on_established is not None and sent:
            await self.on_established(conn, sent[-1])
        if self.observer is not None:
            self.observer.handshake_ok(peer.name)
        log.info(
            "peer %s (incarnation %s, role %s) connected via %s, agent %s",
            peer.name,
            peer.incarnation,
            peer.role,
            label,
            shown(agent),  # from the peer's metadata
        )
        return conn

    async def _closed(self, conn: PeerConnection) -> None:
        log.warning(
            "peer %s (%s) disconnected: %s",
            conn.key,
            conn.label,
            shown(conn.close_reason, TEXT_LIMIT, quote=False),
        )
        if self.observer is not None:
            self.observer.peer_closed(conn.peer.name, conn.heartbeat_lost)
        try:
            await self._on_closed(conn)  # sessions quiesce first ...
        finally:
            # ... then the peer's agent is evicted.
            if self.connections.get(conn.key) is conn:
                del self.connections[conn.key]
            for address, c in list(self._by_address.items()):
                if c is conn:
                    del self._by_address[address]
            if self.before_evict is not None:
                # Writes to that daemon still drained (transceiver/tx_drains.py) need its
                # agent: NIXL forgets the handles of an evicted agent while UCX's bytes
                # stay in our socket, so the eviction waits for them.
                await self.before_evict(conn)
            await self._evict_unused(conn.agent_name)

    async def _evict_unused(self, agent: str) -> None:
        """Evict `agent` from the backend unless a live connection uses it or a handshake
        is loading it. Checked on the loop's thread right before the eviction is queued: a
        load that starts after it queues its own call behind the eviction on the
        data-plane thread."""
        if self._loading[agent] > 0 or any(
            c.agent_name == agent for c in self.connections.values()
        ):
            return
        # RuntimeError: the data plane closed (shutdown cancels handshakes): nothing left
        # to evict from.
        with contextlib.suppress(KvxferdError, RuntimeError):
            await self._dp.call(self._dp.backend.remove_peer, agent)

    def _count_failure(self, exc: BaseException) -> None:
        kind = type(exc).__name__
        if isinstance(exc, FrameTooLargeError):
            kind = "oversize_frame"
        elif isinstance(exc, ProtocolError):
            kind = "protocol"
        self.handshake_failures[kind] = self.handshake_failures.get(kind, 0) + 1
        if self.observer is not None:
            self.observer.handshake_failed(exc)

    async def broadcast_pools(self, update: PoolsUpdate) -> None:
        for conn in list(self.connections.values()):
            await conn.send(update)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._handshakes):
            task.cancel()
        for conn in list(self.connections.values()):
            conn.close("daemon shutting down")
        # Let each connection's close handling (session quiescence, agent eviction) run.
        for _ in range(100):
            if not self.connections:
                break
            await asyncio.sleep(0.01)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)


class _AgentLoad:
    """One handshake's check of the peer's Info, which also loads its agent metadata into
    the backend: metadata the backend cannot load is refused inside the handshake, before
    Ready (reason `agent_metadata`), so the peer hears why instead of seeing a connection
    that was answered Ready close at once."""

    def __init__(self, manager: PeerManager) -> None:
        self._m = manager
        self.agent = ""
        self._marked = ""  # the agent this load counts in the manager's _loading

    async def __call__(self, peer: PeerIdentity, info: Info) -> tuple[str, str] | None:
        refusal = self._m._check_info(peer, info)
        if inspect.isawaitable(refusal):
            refusal = await refusal
        if refusal is not None:
            return refusal
        dp = self._m._dp
        self.done()  # (a handshake loads once; this keeps the count right regardless)
        self._marked = info.agent_name
        self._m._loading[self._marked] += 1
        try:
            self.agent = await dp.call(dp.backend.add_peer, info.agent_metadata)
        except KvxferdError as exc:
            return "agent_metadata", f"cannot load the agent metadata of {peer.name}: {exc}"
        return None

    def done(self) -> None:
        """The handshake ended (its connection registered, or failed): the agent's load is
        no longer in progress."""
        if self._marked:
            self._m._loading[self._marked] -= 1
            if self._m._loading[self._marked] <= 0:
                del self._m._loading[self._marked]
            self._marked = ""

    async def undo(self) -> None:
        """The handshake failed after the load began: evict the agent unless a live
        connection of the same incarnation uses it or another handshake is loading it.
        Also when the load itself failed or was cut short: a closed connection's eviction
        may have left that agent to this load (_evict_unused), and no one else evicts it."""
        agent = self.agent or self._marked
        self.agent = ""
        self.done()
        if agent:
            await self._m._evict_unused(agent)
