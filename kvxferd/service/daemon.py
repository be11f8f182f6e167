"""The daemon: one engine, its pools, its peers, and the PYTHON runtime over NIXL.

Lifecycle (one log line per step): capture signals -> start the data plane ->
listen for peers -> open the engine API -> ready -> serve until the shutdown
trigger -> drain (new requests refused, in-flight ones finish up to the drain
timeout, the rest fail with a reason and peers are told) -> close peers ->
deregister pools -> stop the data plane.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvxferd import PROTOCOL_VERSION, __version__
from kvxferd.api.messages import (
    ApiError,
    Cancel,
    DeregisterPool,
    EngineHello,
    EngineMessage,
    Query,
    Recv,
    RegisterPool,
    Release,
    Send,
)
from kvxferd.api.server import ApiServer, EngineConnection
from kvxferd.backends.base import Backend
from kvxferd.config import KvxferdConfig, ResolvedSettings
from kvxferd.errors import RequestError, StartupError
from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.handshake import Identity, PeerIdentity
from kvxferd.peers.manager import PeerManager, PeerTimings, split_hostport
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
from kvxferd.service.http import HttpServer
from kvxferd.service.pools import PoolError, PoolRegistry
from kvxferd.transceiver.admission import AdmissionWindow
from kvxferd.transceiver.dataplane import DataPlane
from kvxferd.transceiver.receiver import Receiver, ReceiverTimeouts
from kvxferd.transceiver.sender import Sender, SenderTimeouts

log = logging.getLogger("kvxferd.daemon")

SENDING_ROLES = ("context", "both")
RECEIVING_ROLES = ("generation", "both")


@dataclass
class Overrides:
    role: str | None = None
    api_socket: str | None = None
    peer_listen: str | None = None
    http: str | None = None


def _make_backend(settings: ResolvedSettings, agent_name: str) -> Backend:
    if settings.backend != "NIXL" or settings.runtime != "PYTHON":
        raise StartupError(
            f"backend {settings.backend} with the {settings.runtime} runtime is not available "
            "in this build: only the PYTHON runtime over NIXL moves KV yet "
            "(set cache_transceiver_config.backend to NIXL or DEFAULT, and "
            "transceiver_runtime to PYTHON or auto)"
        )
    from kvxferd.backends.nixl import NixlBackend

    return NixlBackend(agent_name)


class Daemon:
    def __init__(self, cfg: KvxferdConfig, settings: ResolvedSettings) -> None:
        self.cfg = cfg
        self.settings = settings
        d = cfg.daemon
        self.daemon_name = d.name
        self.role = cfg.engine.role
        self.tokens_per_block = cfg.engine.kv_layout.tokens_per_block
        self.incarnation = f"{int(time.time()):x}-{secrets.token_hex(4)}"
        self.agent_name = f"{d.name}.{self.incarnation}"
        if settings.kv_transfer_timeout_ms is None:
            raise StartupError("the PYTHON runtime needs a finite kv_transfer_timeout_ms")
        secret = d.read_shared_secret()
        host, _ = split_hostport(d.peer_listen)
        if secret is None and host not in ("127.0.0.1", "localhost", "::1"):
            raise StartupError(
                f"daemon.peer_listen {d.peer_listen} is not loopback, so peers must authenticate: "
                "set daemon.shared_secret_file to a file holding a shared secret"
            )
        self.secret_configured = secret is not None
        self.identity = Identity(d.name, self.incarnation, self.role, secret or b"")
        self.dataplane = DataPlane(lambda: _make_backend(settings, self.agent_name))
        self.pools = PoolRegistry(self.dataplane)
        self.peers = PeerManager(
            self.identity,
            self.dataplane,
            self._make_info,
            self._check_info,
            PeerTimings(
                handshake_s=d.handshake_timeout_ms / 1e3,
                heartbeat_interval_s=d.heartbeat_interval_ms / 1e3,
                heartbeat_timeout_s=d.heartbeat_timeout_ms / 1e3,
            ),
            dict(d.peers),
            self._on_peer_message,
            self._on_peer_closed,
        )
        timeout_s = settings.kv_transfer_timeout_ms / 1e3
        self.sender = Sender(
            SenderTimeouts(
                timeout_s=timeout_s,
                slice_s=(settings.kv_transfer_sender_future_timeout_ms or 1000) / 1e3,
            ),
            self.dataplane,
        )
        poll_ms = settings.kv_transfer_poll_interval_ms
        self.admission = AdmissionWindow(
            settings.admission_window_blocks, poll_ms / 1e3 if poll_ms else None
        )
        self.receiver = Receiver(
            ReceiverTimeouts(timeout_s=timeout_s, answer_s=d.heartbeat_timeout_ms / 1e3),
            self.admission,
            self.peers.connect,
        )
        self.api = ApiServer(d.api_socket_path(), self)
        self.http = HttpServer(self) if d.http else None
        self.ready = False
        self.draining = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.started_at = time.monotonic()

    # ------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        d = self.cfg.daemon
        log.info(
            "kvxferd %s starting: name %s, role %s, %s runtime over %s (%s), incarnation %s",
            __version__,
            d.name,
            self.role,
            self.settings.runtime,
            self.settings.backend,
            self.settings.runtime_reason,
            self.incarnation,
        )
        if not self.secret_configured:
            log.warning("no daemon.shared_secret_file: peers are not authenticated (loopback only)")
        await self.dataplane.start()
        log.info("data plane up: %s agent %s", self.settings.backend, self.agent_name)
        host, port = split_hostport(d.peer_listen)
        address = await self.peers.listen(host, port)
        log.info("listening for peers on %s", address)
        await self.api.start()
        log.info("engine API on %s", self.api.path)
        if self.http is not None and d.http:
            http_address = await self.http.start(*split_hostport(d.http))
            log.info("HTTP (health, status) on %s", http_address)
        self.ready = True
        log.info("ready")

    async def serve(self, shutdown: asyncio.Event) -> None:
        """Start, run until `shutdown` is set, then stop. Injected trigger: tests
        drain the daemon without sending real signals."""
        try:
            await self.start()
            await shutdown.wait()
        finally:
            await self.stop()

    async def stop(self) -> None:
        if self.draining:
            return
        self.draining = True
        self.ready = False
        deadline = time.monotonic() + self.cfg.daemon.drain_timeout_ms / 1e3
        active = self.sender.active_count() + self.receiver.active_count()
        log.info("draining: %d request(s) in flight", active)
        await asyncio.gather(self.sender.drain(deadline), self.receiver.drain(deadline))
        log.info("drained; closing the engine API")
        await self.api.close()
        log.info("closing peer connections")
        await self.peers.close()
        await self.admission.close()
        for pool_id in list(self.pools.pools):
            self.pools.pools[pool_id].users.clear()
            await self.pools.deregister(pool_id)
        if self.http is not None:
            await self.http.close()
        await self.dataplane.close()
        log.info("stopped")

    # ------------------------------------------------------------ engine API

    async def handle_call(self, engine: EngineConnection, msg: EngineMessage) -> str:
        if isinstance(msg, EngineHello):
            raise RequestError(ApiError.BAD_REQUEST, "hello was already exchanged")
        if self.draining and isinstance(msg, (Recv, Send, RegisterPool)):
            raise RequestError(ApiError.DRAINING, "the daemon is draining; no new work")
        if isinstance(msg, RegisterPool):
            return await self._register_pool(engine, msg)
        if isinstance(msg, DeregisterPool):
            pool = self._own_pool(engine, msg.pool_id)
            await self._pool_call(self.pools.deregister(pool.pool_id))
            await self.peers.broadcast_pools(PoolsUpdate(pools=self.pools.infos()))
            return ""
        if isinstance(msg, Recv):
            self._require_role(RECEIVING_ROLES, "recv")
            self._check_request_id(msg.request_id)
            pool = self._own_pool(engine, msg.pool_id)
            try:
                self.peers.resolve_address(msg.peer)
            except Exception as exc:
                raise RequestError(
                    ApiError.BAD_REQUEST,
                    f"peer {msg.peer!r} is neither a static peer name "
                    f"({', '.join(self.peers.static_peers) or 'none configured'}) nor HOST:PORT",
                ) from exc
            self.receiver.recv(engine, msg.request_id, pool, msg.blocks, msg.peer, msg.num_tokens)
            return ""
        if isinstance(msg, Send):
            self._require_role(SENDING_ROLES, "send")
            self._check_request_id(msg.request_id)
            pool = self._own_pool(engine, msg.pool_id)
            self.sender.send(
                engine,
                msg.request_id,
                pool,
                msg.blocks,
                msg.token_start,
                msg.token_end,
                msg.last,
            )
            return ""
        if isinstance(msg, Cancel):
            side = self._side_of(engine, msg.request_id)
            return await side.cancel(msg.request_id)
        if isinstance(msg, Release):
            self._side_of(engine, msg.request_id).release(msg.request_id)
            return ""
        if isinstance(msg, Query):
            side = self._side_of(engine, msg.request_id)
            s = side.sessions[msg.request_id]
            return s.outcome.status if s.outcome else s.state.name.lower()
        raise RequestError(ApiError.BAD_REQUEST, f"unsupported call {type(msg).__name__}")

    @staticmethod
    def _check_request_id(request_id: str) -> None:
        if not request_id or len(request_id) > 256:
            raise RequestError(ApiError.BAD_REQUEST, "request_id must be 1 to 256 characters")

    def _require_role(self, roles: tuple[str, ...], call: str) -> None:
        if self.role not in roles:
            raise RequestError(
                ApiError.WRONG_ROLE,
                f"{call} needs a daemon with role {' or '.join(roles)}; this one is {self.role}",
            )

    def _side_of(self, engine: EngineConnection, request_id: str) -> Sender | Receiver:
        for side in (self.receiver, self.sender):
            s = side.sessions.get(request_id)
            if s is not None and s.engine is engine:
                return side
        raise RequestError(ApiError.UNKNOWN_REQUEST, f"no request {request_id!r} of this engine")

    def _own_pool(self, engine: EngineConnection, pool_id: str):  # type: ignore[no-untyped-def]
        try:
            pool = self.pools.get(pool_id)
        except PoolError as exc:
            raise RequestError(exc.code, str(exc)) from exc
        if pool.owner is not engine:
            raise RequestError(ApiError.UNKNOWN_POOL, f"pool {pool_id!r} belongs to another engine")
        return pool

    @staticmethod
    async def _pool_call(coro: Awaitable[object]) -> object:
        try:
            return await coro
        except PoolError as exc:
            raise RequestError(exc.code, str(exc)) from exc

    async def _register_pool(self, engine: EngineConnection, msg: RegisterPool) -> str:
        try:
            layout = KvLayout.from_wire(msg.layout)
        except LayoutError as exc:
            raise RequestError(ApiError.BAD_REQUEST, f"pool {msg.pool_id!r}: {exc}") from exc
        if layout.tokens_per_block != self.tokens_per_block:
            raise RequestError(
                ApiError.BAD_REQUEST,
                f"pool {msg.pool_id!r} has {layout.tokens_per_block} tokens per block, but "
                f"engine.kv_layout.tokens_per_block is {self.tokens_per_block} in "
                f"{self.cfg.source}",
            )
        await self._pool_call(
            self.pools.register(msg.pool_id, msg.shm_name, msg.nbytes, layout, engine)
        )
        await self.peers.broadcast_pools(PoolsUpdate(pools=self.pools.infos()))
        return ""

    async def engine_gone(self, engine: EngineConnection) -> None:
        reason, message = "engine_disconnected", f"engine {engine.name!r} disconnected"
        await asyncio.gather(
            self.sender.abort_engine(engine, reason, message),
            self.receiver.abort_engine(engine, reason, message),
        )
        mine = [p for p in self.pools.pools.values() if p.owner is engine]
        for pool in mine:
            await self.pools.deregister(pool.pool_id)
        if mine:
            await self.peers.broadcast_pools(PoolsUpdate(pools=self.pools.infos()))

    # ----------------------------------------------------------------- peers

    def _make_info(self) -> Info:
        engine = self.cfg.engine
        return Info(
            agent_name=self.agent_name,
            agent_metadata=self.dataplane.backend.metadata(),
            pools=self.pools.infos(),
            fingerprint=self.settings.fingerprint(),
            compat=dict(self.settings.peer_compat_fields()),
            transceiver=self.cfg.cache_transceiver_config.advertised(),
            tensor_parallel_size=engine.tensor_parallel_size,
            pipeline_parallel_size=engine.pipeline_parallel_size,
            context_parallel_size=engine.context_parallel_size,
        )

    def _check_info(self, peer: PeerIdentity, info: Info) -> tuple[str, str] | None:
        sends = self.role in SENDING_ROLES and peer.role in RECEIVING_ROLES
        receives = self.role in RECEIVING_ROLES and peer.role in SENDING_ROLES
        if not (sends or receives):
            return ("role", f"a {self.role} daemon cannot pair with a {peer.role} daemon")
        if info.fingerprint != self.settings.fingerprint():
            mine = self.settings.peer_compat_fields()
            diffs = [
                f"{key}: ours {mine[key]}, peer {info.compat.get(key)}"
                for key in mine
                if info.compat.get(key) != mine[key]
            ]
            return (
                "settings",
                "effective transceiver settings differ ("
                + ("; ".join(diffs) or "fingerprints differ")
                + "); keep context and generation configurations consistent",
            )
        for theirs in info.pools:
            try:
                their_layout = KvLayout.from_wire(theirs.layout)
            except LayoutError as exc:
                return ("layout", f"peer pool {theirs.pool_id!r} has a bad layout: {exc}")
            for pool in self.pools.pools.values():
                diffs = pool.layout.same_geometry(their_layout)
                if diffs:
                    return (
                        "layout",
                        f"KV geometry of peer pool {theirs.pool_id!r} and our pool "
                        f"{pool.pool_id!r} differ: {'; '.join(diffs)}",
                    )
        return None

    async def _on_peer_message(self, conn: PeerConnection, msg: PeerMessage) -> None:
        if isinstance(msg, RequestData):
            if self.role not in SENDING_ROLES:
                await conn.send(
                    Abort(
                        request_id=msg.request_id,
                        rx_token=msg.rx_token,
                        reason="wrong_role",
                        message=f"{self.daemon_name} is a {self.role} daemon",
                    )
                )
                return
            await self.sender.on_request_data(conn, msg)
        elif isinstance(msg, Result):
            await self.receiver.on_result(conn, msg)
        elif isinstance(msg, Abort):
            if self.receiver.owns(conn, msg.request_id, msg.rx_token):
                await self.receiver.on_abort(conn, msg)
            else:
                # Waits for our write to quiesce; the read loop must keep going meanwhile.
                self._background(self.sender.on_abort(conn, msg))
        elif isinstance(msg, AbortAck):
            await self.receiver.on_abort_ack(conn, msg)
        elif isinstance(msg, CancelRequest):
            self._background(self.sender.on_cancel_request(conn, msg))
        elif isinstance(msg, CancelAnswer):
            await self.receiver.on_cancel_answer(conn, msg)
        elif isinstance(msg, PoolsUpdate):
            conn.pools = {p.pool_id: p for p in msg.pools}
        else:
            log.warning(
                "peer %s sent %s outside a handshake; ignored", conn.key, type(msg).__name__
            )

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _on_peer_closed(self, conn: PeerConnection) -> None:
        await asyncio.gather(self.sender.on_peer_closed(conn), self.receiver.on_peer_closed(conn))

    # ---------------------------------------------------------------- status

    def status(self) -> dict[str, object]:
        return {
            "name": self.daemon_name,
            "version": __version__,
            "protocol_version": PROTOCOL_VERSION,
            "role": self.role,
            "incarnation": self.incarnation,
            "pid": os.getpid(),
            "ready": self.ready,
            "draining": self.draining,
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            "settings": self.settings.to_json_dict(),
            "fingerprint": self.settings.fingerprint(),
            "peer_listen": self.peers.listen_address,
            "api_socket": self.api.path,
            "peers": [
                {
                    "name": c.peer.name,
                    "incarnation": c.peer.incarnation,
                    "role": c.peer.role,
                    "address": c.label,
                    "pools": sorted(c.pools),
                }
                for c in self.peers.connections.values()
            ],
            "pools": sorted(self.pools.pools),
            "sessions": {
                "send": _count_states(self.sender.sessions.values()),
                "recv": _count_states(self.receiver.sessions.values()),
            },
            "admission": {
                "window_blocks": self.admission.capacity,
                "in_flight_blocks": self.admission.in_flight_blocks,
                "waiting": self.admission.waiting,
            },
            "engines": len(self.api.engines),
            "open_transfer_handles": self.sender.open_handles,
            "handshake_failures": dict(self.peers.handshake_failures),
        }


def _count_states(sessions: object) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in sessions:  # type: ignore[attr-defined]
        key = s.outcome.status if s.outcome else s.state.name.lower()
        counts[key] = counts.get(key, 0) + 1
    return counts
