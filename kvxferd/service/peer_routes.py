"""The peer side of the daemon: each peer message routed to its handler by type, what we
tell a peer in the handshake and how we judge what it tells us, and what a peer's
connection coming and going means for our pools and sessions."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from kvxferd.backends.cma import cma_writes_here
from kvxferd.backends.twosided import TwoSidedTransport
from kvxferd.errors import KvxferdError
from kvxferd.peers import process
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.compat import SENDING_ROLES, check_peer
from kvxferd.peers.handshake import PeerIdentity
from kvxferd.peers.messages import (
    Abort,
    AbortAck,
    CancelAnswer,
    CancelRequest,
    Info,
    PeerMessage,
    PoolsUpdate,
    RequestData,
    Result,
)
from kvxferd.service.logs import TEXT_LIMIT, shown
from kvxferd.service.ops import TaskScope
from kvxferd.service.view import DaemonView
from kvxferd.transceiver.dataplane import DataPlane
from kvxferd.transceiver.state import Reason

log = logging.getLogger("kvxferd.daemon")

Route = Callable[[PeerConnection, Any], Awaitable[None]]


class PeerRoutes:
    def __init__(
        self, daemon: DaemonView, dataplane: DataPlane, scope: TaskScope, agent_name: str
    ) -> None:
        self._d = daemon
        self._dp = dataplane
        self._scope = scope
        self._agent_name = agent_name
        # The two-sided transport, once started (staged runtime over UCX or MPI).
        self.transport: TwoSidedTransport | None = None
        self.transport_address = ""
        # Built at the first message: the sides it routes to may be made after us.
        self._routes: dict[type, Route] | None = None

    def _table(self) -> dict[type, Route]:
        d = self._d
        routes: dict[type, Route] = {
            RequestData: self._request_data,
            Result: d.receiver.on_result,
            Abort: self._abort,
            AbortAck: d.receiver.on_abort_ack,
            CancelRequest: self._cancel_request,
            CancelAnswer: d.receiver.on_cancel_answer,
            PoolsUpdate: self._pools_update,
        }
        # What the sender's mover takes itself (the staged rounds' acknowledgements).
        routes.update(d.sender.mover.routes())
        return routes

    async def on_message(self, conn: PeerConnection, msg: PeerMessage) -> None:
        if self._routes is None:
            self._routes = self._table()
        route = self._routes.get(type(msg))
        if route is None:
            log.warning(
                "peer %s sent %s outside a handshake; ignored", conn.key, type(msg).__name__
            )
            return
        await route(conn, msg)

    async def _request_data(self, conn: PeerConnection, msg: RequestData) -> None:
        d = self._d
        if d.role not in SENDING_ROLES:
            await conn.send(
                Abort(
                    request_id=msg.request_id,
                    rx_token=msg.rx_token,
                    reason=Reason.WRONG_ROLE,
                    message=f"{d.daemon_name} is a {d.role} daemon",
                )
            )
            return
        await d.sender.on_request_data(conn, msg)

    async def _abort(self, conn: PeerConnection, msg: Abort) -> None:
        if self._d.receiver.owns(conn, msg.request_id, msg.rx_token):
            await self._d.receiver.on_abort(conn, msg)
        else:
            # Waits for our write to quiesce; the read loop must keep going meanwhile.
            self._scope.start(self._d.sender.on_abort(conn, msg), f"abort-{conn.key}")

    async def _cancel_request(self, conn: PeerConnection, msg: CancelRequest) -> None:
        self._scope.start(self._d.sender.on_cancel_request(conn, msg), f"cancel-{conn.key}")

    async def _pools_update(self, conn: PeerConnection, msg: PoolsUpdate) -> None:
        if msg.agent_metadata:
            # New registrations: reload before any later message (same connection, in
            # order) can ask us to write there.
            try:
                await self._dp.call(self._dp.backend.add_peer, msg.agent_metadata)
            except KvxferdError as exc:
                text = shown(exc, TEXT_LIMIT, quote=False)  # may quote the metadata
                log.error("peer %s sent agent metadata NIXL refused: %s", conn.key, text)
                conn.close(f"bad agent metadata in a pools update: {text}")
                return
        conn.set_pools(msg.pools)

    # ------------------------------------------------------- our pools, told

    async def announce_pools(self) -> None:
        if not self._d.peers.connections:
            return
        metadata = await self._dp.call(self._dp.backend.metadata)
        await self._d.peers.broadcast_pools(
            PoolsUpdate(pools=self._d.pools.infos(), agent_metadata=metadata)
        )

    async def established(self, conn: PeerConnection, sent: Info) -> None:
        await self._pools_since_handshake(conn, sent)
        # A context daemon that holds might write into our memory: ask it again.
        await self._d.receiver.holds.on_established(conn)

    async def _pools_since_handshake(self, conn: PeerConnection, sent: Info) -> None:
        """A pool registered or dropped while this peer's handshake ran was in neither our
        Info nor a broadcast (the connection was not registered yet): tell the peer now,
        before anything we write for it (a peer judges heads from the pools it knows)."""
        current = self._d.pools.infos()
        if current == sent.pools:
            return
        try:
            metadata = await self._dp.call(self._dp.backend.metadata)
        except KvxferdError as exc:
            log.error("cannot tell peer %s about our pools: %s", conn.key, shown(exc, TEXT_LIMIT))
            conn.close(f"our pools changed during the handshake and cannot be announced: {exc}")
            return
        await conn.send(PoolsUpdate(pools=current, agent_metadata=metadata))

    # ------------------------------------------------------------- handshake

    async def make_info(self) -> Info:
        d = self._d
        engine = d.cfg.engine
        # Through the data-plane thread: the NIXL agent is not thread-safe.
        metadata = await self._dp.call(self._dp.backend.metadata)
        return Info(
            agent_name=self._agent_name,
            agent_metadata=metadata,
            pools=d.pools.infos(),
            fingerprint=d.settings.fingerprint(),
            compat=dict(d.settings.peer_compat_fields()),
            transceiver=d.cfg.cache_transceiver_config.advertised(),
            tensor_parallel_size=engine.tensor_parallel_size,
            pipeline_parallel_size=engine.pipeline_parallel_size,
            context_parallel_size=engine.context_parallel_size,
            transport_address=self.transport_address,
            bounce_base=d.bounce.recv.address if d.bounce else 0,
            bounce_nbytes=d.bounce.recv.nbytes if d.bounce else 0,
            # A vram daemon's bounce/staging regions are its own VRAM on engine.cuda_device
            # (it does not start without them): what a peer names when it writes there.
            bounce_memory="vram" if d.bounce and d.settings.kv_memory == "vram" else "host",
            bounce_device=d.settings.cuda_device if d.settings.kv_memory == "vram" else 0,
            round_offsets=True,  # transceiver/staged_rx.py places rounds where they say
            process=process.me(),
            ucx_cma=cma_writes_here(self._dp.backend.name),
            wall_ms=int(time.time() * 1e3),
        )

    def info_for(self, peer: PeerIdentity, info: Info) -> Info:
        """Our Info as `peer` alone reads it (over TLS): with per-pair link keys, the
        secret drawn for that peer (kvxferd/backends/link_secrets.py)."""
        transport = self.transport
        if transport is None or not transport.link_secrets.per_pair:
            return info
        given = transport.link_secrets.given(peer.key)
        return msgspec.structs.replace(info, link_secret=given)

    def check_info(self, peer: PeerIdentity, info: Info) -> tuple[str, str] | None:
        d = self._d
        refusal = check_peer(
            d.role,
            d.settings,
            [(p.layout, p.tp) for p in d.pools.pools.values()],
            peer,
            info,
            d.cfg.engine.pipeline_parallel_size,
        )
        transport = self.transport
        if refusal is None and transport is not None:
            # Read only over TLS (per-pair keys exist only then): what our links with this
            # peer process will prove.
            transport.link_secrets.learn(peer.key, info.link_secret)
        # MPI: link now, not at the first round; a peer dying during MPI's link
        # set-up can crash this process (docs/backends-mpi.md).
        if (
            refusal is None
            and transport is not None
            and transport.link_ahead
            and d.role in SENDING_ROLES
            and info.transport_address
        ):
            self._scope.start(
                self._link_ahead(transport, peer.key, info.transport_address), f"link-{peer.key}"
            )
        return refusal

    async def _link_ahead(self, transport: TwoSidedTransport, key: str, address: str) -> None:
        try:
            await transport.connect(key, address, 10.0)
        except KvxferdError as exc:
            log.info(
                "%s link to %s not made ahead: %s",
                transport.name,
                key,
                shown(exc, TEXT_LIMIT, quote=False),
            )

    # ------------------------------------------------------------ peer gone

    async def closed(self, conn: PeerConnection) -> None:
        d = self._d
        await asyncio.gather(d.sender.on_peer_closed(conn), d.receiver.on_peer_closed(conn))
        d.sender.mover.peer_gone(conn.key)  # sessions are quiescent: forget it there too
        if self.transport is not None:
            await self.transport.remove_peer(conn.key)
