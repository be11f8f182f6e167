"""The daemon: one engine, its pools, its peers, and the PYTHON runtime over NIXL.

Lifecycle (one log line per step): capture signals -> start the data plane ->
listen for peers -> open the engine API -> ready -> serve until the shutdown
trigger -> drain (new requests refused, in-flight ones finish up to the drain
timeout, the rest fail with a reason and peers are told) -> close peers ->
deregister pools -> stop the data plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Awaitable, Coroutine
from functools import partial
from typing import Any

from kvxferd import __version__
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
from kvxferd.backends import registry
from kvxferd.backends.twosided import TwoSidedTransport
from kvxferd.config import KvxferdConfig, ResolvedSettings
from kvxferd.errors import KvxferdError, RequestError, StartupError
from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.peers import process, tls
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.compat import RECEIVING_ROLES, SENDING_ROLES, check_peer
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
    RoundAck,
)
from kvxferd.service import listeners
from kvxferd.service.http import HttpServer
from kvxferd.service.logs import TEXT_LIMIT, shown
from kvxferd.service.loopmon import LoopMonitor
from kvxferd.service.metrics import DaemonMetrics
from kvxferd.service.ops import TaskSet, refresh_status, summary_line
from kvxferd.service.pools import PoolError, PoolRegistry
from kvxferd.service.reload import ConfigLoader, ReloadReport, serve_reloads
from kvxferd.service.sdnotify import Notifier
from kvxferd.service.status import daemon_status
from kvxferd.transceiver.admission import AdmissionWindow
from kvxferd.transceiver.bounce import BounceBuffers
from kvxferd.transceiver.dataplane import DataPlane
from kvxferd.transceiver.holds import Hold
from kvxferd.transceiver.receiver import Receiver, ReceiverTimeouts
from kvxferd.transceiver.sender import Sender, SenderTimeouts
from kvxferd.transceiver.staged import (
    DEFAULT_STAGING_TOKENS,
    StagedReceiver,
    StagedSender,
    staging_bytes,
)

log = logging.getLogger("kvxferd.daemon")

# A peer named by a send: a daemon name, as the handshake accepts one (1-128 characters).
_DAEMON_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


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
        problem = registry.startup_problem(settings.backend, settings.runtime)
        if (
            problem is None
            and settings.runtime == "PYTHON"
            and (settings.kv_transfer_timeout_ms is None)
        ):
            problem = "the PYTHON runtime needs a finite kv_transfer_timeout_ms"
        if problem is not None:
            raise StartupError(problem)
        secret = d.read_shared_secret()
        host, _ = split_hostport(d.peer_listen)
        if not d.peers_authenticated and host not in ("127.0.0.1", "localhost", "::1"):
            raise StartupError(
                f"daemon.peer_listen {d.peer_listen} is not loopback, so peers must authenticate: "
                "set daemon.shared_secret_file to a file holding a shared secret, or the "
                "daemon.tls_* files (mutual TLS)"
            )
        self.secret_configured = secret is not None
        peer_tls = tls.load(d)
        # Before the backend starts: UCX listens on every device it finds otherwise.
        self.ucx_devices = listeners.pin_ucx_devices(host)
        self.identity = Identity(d.name, self.incarnation, self.role, secret or b"")
        # MOONCAKE tells peers `host` and keeps its own timeouts below ours.
        options = registry.BackendOptions(host, settings.kv_transfer_timeout_ms)
        self.dataplane = DataPlane(
            lambda: registry.make_backend(settings.backend, self.agent_name, options)
        )
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
        self.peers.tls = peer_tls
        # null (staged runtime only, the seed: "None remains available to other
        # runtimes"): no sender deadline and no receive timeout.
        timeout_ms = settings.kv_transfer_timeout_ms
        timeout_s = None if timeout_ms is None else timeout_ms / 1e3
        self.staged = settings.runtime == "CPP"
        if self.staged:
            # The staged runtime's transfer buffers: every request goes through them.
            layout = cfg.engine.kv_layout
            block_bytes = (
                cfg.engine.kv_factor
                * layout.num_layers
                * layout.tokens_per_block
                * layout.num_kv_heads
                * layout.head_dim
                * layout.itemsize
            )
            tokens = (
                settings.max_tokens_in_buffer or cfg.engine.max_seq_len or DEFAULT_STAGING_TOKENS
            )
            self.bounce: BounceBuffers | None = BounceBuffers(
                staging_bytes(tokens, layout.tokens_per_block, block_bytes)
            )
        elif settings.bounce_buffer_mb > 0:
            self.bounce = BounceBuffers(settings.bounce_buffer_mb << 20)
        else:
            self.bounce = None
        sender_cls = StagedSender if self.staged else Sender
        receiver_cls = StagedReceiver if self.staged else Receiver
        self.sender = sender_cls(
            SenderTimeouts(
                timeout_s=timeout_s,
                # null: no slicing, one wait up to the deadline (docs/configuration.md).
                slice_s=(
                    settings.kv_transfer_sender_future_timeout_ms / 1e3
                    if settings.kv_transfer_sender_future_timeout_ms is not None
                    else math.inf
                ),
            ),
            self.dataplane,
            pipelined=settings.pipelined_transfer,
            bounce=self.bounce,
        )
        poll_ms = settings.kv_transfer_poll_interval_ms
        self.admission = AdmissionWindow(
            settings.admission_window_blocks, poll_ms / 1e3 if poll_ms else None
        )
        self.receiver = receiver_cls(
            ReceiverTimeouts(
                timeout_s=timeout_s,
                answer_s=d.heartbeat_timeout_ms / 1e3,
                # The outcome of a failed receive is due at its deadline plus at most one
                # heartbeat interval; a peer that has not confirmed by then leaves a hold.
                ack_grace_s=d.heartbeat_interval_ms / 1e3,
                redial_s=d.heartbeat_interval_ms / 1e3,
                redial_max_s=d.heartbeat_timeout_ms / 1e3,
            ),
            self.admission,
            self.peers.connect,
            pipelined=settings.pipelined_transfer,
            bounce=self.bounce,
        )
        self.api = ApiServer(d.api_socket_path(), self)
        # Operations: per-daemon metrics registry, sd_notify, loop lag, reload history.
        self.metrics = DaemonMetrics(
            d.name, self.role, settings.backend, settings.runtime, settings.fingerprint()
        )
        self.metrics.bind(self)
        self.api.on_outcome = self.metrics.observe_outcome
        self.api.on_malformed = partial(self.metrics.malformed_message, "engine")
        self.sender.on_write_done = self.metrics.observe_write
        self.sender.on_refused = self.metrics.request_refused
        self.admission.on_wait = self.metrics.observe_admission_wait
        self.peers.observer = self.metrics
        self.peers.on_established = self._established
        self.peers.settle_incarnation = lambda peer: self.sender.settle_incarnation(
            peer.name, peer.incarnation
        )
        self.receiver.on_hold_released = self._hold_released
        self.notifier = Notifier()
        self.loop_monitor = LoopMonitor()
        self.last_reload: ReloadReport | None = None
        self.http = HttpServer(self, self.metrics.render) if d.http else None
        self.ready = False
        self.draining = False
        self.transport: TwoSidedTransport | None = None
        self.transport_address = ""
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
        if self.peers.tls is not None:
            log.info(
                "peer channel: mutual TLS (certificate for %s, expires %s)%s",
                ", ".join(sorted(self.peers.tls.own_names)) or "?",
                self.peers.tls.not_after or "?",
                " and the shared secret" if self.secret_configured else "",
            )
        elif not self.secret_configured:
            log.warning(
                "no daemon.shared_secret_file or daemon.tls_* files: peers are not "
                "authenticated (loopback only)"
            )
        await self.dataplane.start()
        if registry.is_two_sided(self.settings.backend):
            await self._start_transport()
        else:
            log.info("data plane up: %s agent %s", self.settings.backend, self.agent_name)
        if self.bounce is not None:
            for region in (self.bounce.send, self.bounce.recv):
                region.registration = await self.dataplane.call(
                    self.dataplane.backend.register, region.address, region.nbytes
                )
            log.info(
                "%s: two regions of %.1f MiB registered",
                "staging buffers" if self.staged else "bounce buffer",
                self.bounce.send.nbytes / (1 << 20),
            )
        host, port = split_hostport(d.peer_listen)
        address = await self.peers.listen(host, port)
        log.info("listening for peers on %s", address)
        await self.api.start()
        log.info("engine API on %s", self.api.path)
        if self.http is not None and d.http:
            http_address = await self.http.start(*split_hostport(d.http))
            log.info("HTTP (health, status) on %s", http_address)
        # Every listener is up now, the backend's included: none may be where the
        # configuration does not allow it.
        found = listeners.check_listeners(
            self.cfg.daemon.peers_authenticated,
            [split_hostport(d.peer_listen)[0], split_hostport(d.http)[0] if d.http else ""],
            self.settings.backend,
        )
        log.info(
            "listening sockets: %s%s",
            ", ".join(found),
            f" (UCX_NET_DEVICES={self.ucx_devices})" if self.ucx_devices else "",
        )
        self.ready = True
        log.info("ready")

    async def _start_transport(self) -> None:
        transport = registry.make_transport(
            self.settings.backend, self.daemon_name, self.incarnation
        )
        host, _ = split_hostport(self.cfg.daemon.peer_listen)
        self.transport_address = await transport.start(host)
        self.transport = transport
        for side in (self.sender, self.receiver):
            if isinstance(side, (StagedSender, StagedReceiver)):
                side.transport = transport
        log.info(
            "data plane up: %s transport listening on %s",
            self.settings.backend,
            self.transport_address,
        )

    async def serve(
        self,
        shutdown: asyncio.Event,
        reload_requests: asyncio.Event | None = None,
        load: ConfigLoader | None = None,
    ) -> None:
        """Start, run until `shutdown` is set, then stop. Injected triggers: tests
        drain (and reload) the daemon without sending real signals.

        systemd hears READY=1 only after start() (every listener up), RELOADING=1
        and READY=1 around each reload, STOPPING=1 as the drain begins; the loop
        monitor and the watchdog pings run until the very end (a drain can be long).
        """
        background = TaskSet()
        background.start(self.loop_monitor.run(), "loop-monitor")
        background.start(self.notifier.watchdog_loop(), "sd-watchdog")
        try:
            self.notifier.status("starting")
            await self.start()
            self.notifier.ready(summary_line(self))
            background.start(refresh_status(self), "sd-status")
            if reload_requests is not None and load is not None:
                background.start(serve_reloads(self, reload_requests, load), "reload")
            await shutdown.wait()
        finally:
            active = self.sender.active_count() + self.receiver.active_count()
            self.notifier.stopping(f"draining: {active} request(s) in flight")
            try:
                await self.stop()
            finally:
                await background.cancel()
                self.notifier.close()

    async def stop(self) -> None:
        if self.draining:
            return
        self.draining = True
        self.ready = False
        deadline = time.monotonic() + self.cfg.daemon.drain_timeout_ms / 1e3
        active = self.sender.active_count() + self.receiver.active_count()
        log.info("draining: %d request(s) in flight", active)
        await asyncio.gather(self.sender.drain(deadline), self.receiver.drain(deadline))
        await self._wait_holds(deadline)
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
        if self.bounce is not None:
            for region in (self.bounce.send, self.bounce.recv):
                if region.registration is not None:
                    await self.dataplane.call(
                        self.dataplane.backend.deregister, region.registration
                    )
            self.bounce.close()
        if self.transport is not None:
            await self.transport.close()
        await self.dataplane.close()
        log.info("stopped")

    # ------------------------------------------------------------ engine API

    async def handle_call(self, engine: EngineConnection, msg: EngineMessage) -> str:
        if isinstance(msg, EngineHello):
            raise RequestError(ApiError.BAD_REQUEST, "hello was already exchanged")
        if self.draining and isinstance(msg, (Recv, Send, RegisterPool)):
            # A later chunk of a send this engine already started is not new work.
            tx = self.sender.sessions.get(msg.request_id) if isinstance(msg, Send) else None
            if tx is None or tx.engine is not engine:
                raise RequestError(ApiError.DRAINING, "the daemon is draining; no new work")
        if isinstance(msg, RegisterPool):
            return await self._register_pool(engine, msg)
        if isinstance(msg, DeregisterPool):
            pool = self._own_pool(engine, msg.pool_id)
            await self._pool_call(self.pools.deregister(pool.pool_id))
            await self._announce_pools()
            return ""
        if isinstance(msg, Recv):
            self._require_role(RECEIVING_ROLES, "recv")
            self._check_request_id(msg.request_id)
            pool = self._usable_pool(engine, msg.pool_id)
            peers = self._recv_peers(msg)
            self.receiver.recv(
                engine,
                msg.request_id,
                pool,
                msg.blocks,
                peers,
                msg.num_tokens,
                msg.beam_width,
                msg.block_start,
            )
            return ""
        if isinstance(msg, Send):
            self._require_role(SENDING_ROLES, "send")
            self._check_request_id(msg.request_id)
            pool = self._usable_pool(engine, msg.pool_id)
            if msg.peer and not _DAEMON_NAME.fullmatch(msg.peer):
                raise RequestError(
                    ApiError.BAD_REQUEST,
                    f"peer {msg.peer[:40]!r}{'...' if len(msg.peer) > 40 else ''} is not a "
                    "daemon name (1-128 letters, digits, '_', '.', '-')",
                )
            self.sender.send(
                engine,
                msg.request_id,
                pool,
                msg.blocks,
                msg.token_start,
                msg.token_end,
                msg.last,
                msg.beam_width,
                msg.peer,
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

    def _recv_peers(self, msg: Recv) -> list[str]:
        """The context daemons of a receive: `peer`, or the list `peers` (head-merge)."""
        if msg.peer and msg.peers:
            raise RequestError(ApiError.BAD_REQUEST, "give either peer or peers (a list), not both")
        peers = list(msg.peers) if msg.peers else [msg.peer] if msg.peer else []
        if not peers:
            raise RequestError(ApiError.BAD_REQUEST, "a receive needs a context peer")
        seen: dict[str, str] = {}
        for peer in peers:
            try:
                address = self.peers.resolve_address(peer)
            except Exception as exc:
                raise RequestError(
                    ApiError.BAD_REQUEST,
                    f"peer {peer!r} is neither a static peer name "
                    f"({', '.join(self.peers.static_peers) or 'none configured'}) nor HOST:PORT",
                ) from exc
            if address in seen:
                raise RequestError(
                    ApiError.BAD_REQUEST,
                    f"peers {seen[address]!r} and {peer!r} name the same context daemon "
                    f"({address}); each context rank is named once",
                )
            seen[address] = peer
        return peers

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

    def _usable_pool(self, engine: EngineConnection, pool_id: str):  # type: ignore[no-untyped-def]
        """_own_pool, refusing new work on a shm-name pool its engine shrank (SIGBUS ahead)."""
        pool = self._own_pool(engine, pool_id)
        try:
            pool.check_intact()
        except PoolError as exc:
            raise RequestError(exc.code, str(exc)) from exc
        return pool

    @staticmethod
    async def _pool_call(coro: Awaitable[object]) -> object:
        try:
            return await coro
        except PoolError as exc:
            raise RequestError(exc.code, str(exc)) from exc

    async def _register_pool(self, engine: EngineConnection, msg: RegisterPool) -> str:
        if bool(msg.handoff) == bool(msg.shm_name):
            raise RequestError(
                ApiError.BAD_REQUEST,
                f"pool {msg.pool_id!r}: give exactly one of handoff (a sealed memfd handed "
                "over first) and shm_name (a POSIX shm object)",
            )
        if not msg.handoff:
            return await self._register_checked_pool(engine, msg, None)
        # Taken (used up) first, so that every refusal below still closes the fd.
        fd = self.api.take_handoff(msg.handoff, engine, msg.pool_id)
        try:
            return await self._register_checked_pool(engine, msg, fd)
        finally:
            os.close(fd)  # the daemon's mapping keeps the memory

    async def _register_checked_pool(
        self, engine: EngineConnection, msg: RegisterPool, fd: int | None
    ) -> str:
        try:
            layout = KvLayout.from_wire(msg.layout)
        except LayoutError as exc:
            raise RequestError(ApiError.BAD_REQUEST, f"pool {msg.pool_id!r}: {exc}") from exc
        if self.staged and not layout.named:
            raise RequestError(
                ApiError.BAD_REQUEST,
                f"pool {msg.pool_id!r} has the order {layout.major}: the staged (CPP) runtime "
                "packs (layer, kv) pieces, which only block-major and layer-major pools have; "
                "use the PYTHON runtime for this pool",
            )
        if layout.tokens_per_block != self.tokens_per_block:
            raise RequestError(
                ApiError.BAD_REQUEST,
                f"pool {msg.pool_id!r} has {layout.tokens_per_block} tokens per block, but "
                f"engine.kv_layout.tokens_per_block is {self.tokens_per_block} in "
                f"{self.cfg.source}",
            )
        try:
            tp = TpRank(msg.tp_rank, msg.tp_size)
        except LayoutError as exc:
            raise RequestError(ApiError.BAD_REQUEST, f"pool {msg.pool_id!r}: {exc}") from exc
        for other in self.pools.pools.values():
            # One daemon serves one engine rank: its peers map heads by the daemon's pools.
            if other.tp != tp:
                raise RequestError(
                    ApiError.BAD_REQUEST,
                    f"pool {msg.pool_id!r} declares {tp}, but pool {other.pool_id!r} of this "
                    f"daemon declares {other.tp}; a daemon serves one engine rank",
                )
        if tp.size != self.cfg.engine.tensor_parallel_size:
            log.warning(
                "pool %s declares %s, but engine.tensor_parallel_size is %d in %s; "
                "KV heads are mapped by the pool's declaration",
                shown(msg.pool_id, quote=False),
                tp,
                self.cfg.engine.tensor_parallel_size,
                self.cfg.source,
            )
        await self._pool_call(
            self.pools.register(msg.pool_id, msg.shm_name, msg.nbytes, layout, engine, tp, fd)
        )
        await self._announce_pools()
        return ""

    async def engine_gone(self, engine: EngineConnection) -> None:
        reason, message = "engine_disconnected", f"engine {engine.name!r} disconnected"
        await asyncio.gather(
            self.sender.abort_engine(engine, reason, message),
            self.receiver.abort_engine(engine, reason, message),
        )
        mine = [p for p in self.pools.pools.values() if p.owner is engine]
        for pool in mine:
            if pool.users:
                # Held: a write may still land there. Our mapping keeps the memory valid
                # (a late write lands harmlessly); the pool goes once its holds are fenced,
                # under another id meanwhile, so a restarted engine can register its own.
                aside = self.pools.set_aside(pool.pool_id)
                log.warning(
                    "pool %s of the gone engine %r stays registered as %s until its %d "
                    "hold(s) are fenced",
                    shown(pool.pool_id, quote=False),
                    engine.name,
                    aside,
                    len(pool.users),
                )
                continue
            await self.pools.deregister(pool.pool_id)
        if mine:
            await self._announce_pools()

    def _hold_released(self, hold: Hold, how: str) -> None:
        pool = hold.pool
        if pool is None or pool.users or self.draining:
            return
        owner = pool.owner
        gone = isinstance(owner, EngineConnection) and owner.closed
        if gone and self.pools.pools.get(pool.pool_id) is pool:
            self._background(self._drop_orphan(pool.pool_id))

    async def _drop_orphan(self, pool_id: str) -> None:
        try:
            await self.pools.deregister(pool_id)
        except (PoolError, KvxferdError) as exc:
            log.error(
                "cannot deregister pool %s of a gone engine: %s",
                shown(pool_id, quote=False),
                shown(exc, TEXT_LIMIT, quote=False),
            )
            return
        await self._announce_pools()

    async def _wait_holds(self, deadline: float) -> None:
        """Shutdown: holds get until the drain deadline to be fenced; what is left is
        reported, since the engine must then treat those blocks as never returned."""
        holds = self.receiver.holds
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(holds.empty.wait(), max(0.0, deadline - time.monotonic()))
        for hold in await holds.close():
            log.error(
                "request %s: shutting down with %d block(s) still held for %s; a write into "
                "them may still land, so the engine must not reuse them",
                shown(hold.request_id),
                hold.blocks,
                ", ".join(leg.key for leg in hold.pending),
                extra={"request_id": hold.request_id},
            )

    # ----------------------------------------------------------------- peers

    async def _announce_pools(self) -> None:
        if not self.peers.connections:
            return
        metadata = await self.dataplane.call(self.dataplane.backend.metadata)
        await self.peers.broadcast_pools(
            PoolsUpdate(pools=self.pools.infos(), agent_metadata=metadata)
        )

    async def _established(self, conn: PeerConnection, sent: Info) -> None:
        await self._pools_since_handshake(conn, sent)
        # A context daemon that holds might write into our memory: ask it again.
        await self.receiver.holds.on_established(conn)

    async def _pools_since_handshake(self, conn: PeerConnection, sent: Info) -> None:
        """A pool registered or dropped while this peer's handshake ran was in neither our
        Info nor a broadcast (the connection was not registered yet): tell the peer now,
        before anything we write for it (a peer judges heads from the pools it knows)."""
        current = self.pools.infos()
        if current == sent.pools:
            return
        try:
            metadata = await self.dataplane.call(self.dataplane.backend.metadata)
        except KvxferdError as exc:
            log.error("cannot tell peer %s about our pools: %s", conn.key, shown(exc, TEXT_LIMIT))
            conn.close(f"our pools changed during the handshake and cannot be announced: {exc}")
            return
        await conn.send(PoolsUpdate(pools=current, agent_metadata=metadata))

    async def _make_info(self) -> Info:
        engine = self.cfg.engine
        # Through the data-plane thread: the NIXL agent is not thread-safe.
        metadata = await self.dataplane.call(self.dataplane.backend.metadata)
        return Info(
            agent_name=self.agent_name,
            agent_metadata=metadata,
            pools=self.pools.infos(),
            fingerprint=self.settings.fingerprint(),
            compat=dict(self.settings.peer_compat_fields()),
            transceiver=self.cfg.cache_transceiver_config.advertised(),
            tensor_parallel_size=engine.tensor_parallel_size,
            pipeline_parallel_size=engine.pipeline_parallel_size,
            context_parallel_size=engine.context_parallel_size,
            transport_address=self.transport_address,
            bounce_base=self.bounce.recv.address if self.bounce else 0,
            bounce_nbytes=self.bounce.recv.nbytes if self.bounce else 0,
            process=process.me(),
            wall_ms=int(time.time() * 1e3),
        )

    def _check_info(self, peer: PeerIdentity, info: Info) -> tuple[str, str] | None:
        refusal = check_peer(
            self.role,
            self.settings,
            [(p.layout, p.tp) for p in self.pools.pools.values()],
            peer,
            info,
            self.cfg.engine.pipeline_parallel_size,
        )
        # MPI: link now, not at the first round; a peer dying during MPI's link
        # set-up can crash this process (docs/backends-mpi.md).
        transport = self.transport
        if (
            refusal is None
            and transport is not None
            and transport.link_ahead
            and self.role in SENDING_ROLES
            and info.transport_address
        ):
            key = f"{peer.name}/{peer.incarnation}"
            self._background(self._link_ahead(transport, key, info.transport_address))
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
        elif isinstance(msg, RoundAck):
            if isinstance(self.sender, StagedSender):
                await self.sender.on_round_ack(conn, msg)
        elif isinstance(msg, CancelAnswer):
            await self.receiver.on_cancel_answer(conn, msg)
        elif isinstance(msg, PoolsUpdate):
            if msg.agent_metadata:
                # New registrations: reload before any later message (same
                # connection, in order) can ask us to write there.
                try:
                    await self.dataplane.call(self.dataplane.backend.add_peer, msg.agent_metadata)
                except KvxferdError as exc:
                    text = shown(exc, TEXT_LIMIT, quote=False)  # may quote the metadata
                    log.error("peer %s sent agent metadata NIXL refused: %s", conn.key, text)
                    conn.close(f"bad agent metadata in a pools update: {text}")
                    return
            conn.set_pools(msg.pools)
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
        if self.transport is not None:  # sessions are quiescent: drop its endpoints too
            if isinstance(self.sender, StagedSender):
                self.sender.forget_peer(conn.key)
            await self.transport.remove_peer(conn.key)

    # ---------------------------------------------------------------- status

    def status(self) -> dict[str, object]:
        return daemon_status(self)
