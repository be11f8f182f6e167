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
import secrets
import time
from functools import partial

from kvxferd import __version__
from kvxferd.api.server import ApiServer
from kvxferd.backends import registry
from kvxferd.backends.nixl import prefer_mutex_worker_lock
from kvxferd.config import KvxferdConfig, ResolvedSettings
from kvxferd.discovery import AddressResolver
from kvxferd.discovery.build import make_discovery
from kvxferd.discovery.resolver import named_connect
from kvxferd.errors import KvxferdError, StartupError
from kvxferd.memory import device
from kvxferd.peers import tls
from kvxferd.peers.handshake import Identity
from kvxferd.peers.manager import PeerManager, PeerTimings, split_hostport
from kvxferd.service import listeners
from kvxferd.service.engine_calls import EngineCalls
from kvxferd.service.http import HttpServer
from kvxferd.service.logs import shown
from kvxferd.service.loopmon import LoopMonitor
from kvxferd.service.metrics import DaemonMetrics
from kvxferd.service.ops import TaskScope, refresh_status, summary_line
from kvxferd.service.peer_routes import PeerRoutes
from kvxferd.service.pools import PoolRegistry
from kvxferd.service.reload import ConfigLoader, ReloadReport, serve_reloads
from kvxferd.service.sdnotify import Notifier
from kvxferd.service.status import daemon_status, readiness_detail, stall_health_problem
from kvxferd.service.timeouts import timeouts_of
from kvxferd.transceiver.admission import AdmissionWindow
from kvxferd.transceiver.bounce import BounceBuffers
from kvxferd.transceiver.dataplane import DataPlane
from kvxferd.transceiver.movers import RECV_MOVERS, SEND_MOVERS
from kvxferd.transceiver.receiver import Receiver
from kvxferd.transceiver.sender import Sender
from kvxferd.transceiver.staging import DEFAULT_STAGING_TOKENS, host_staging, staging_bytes

log = logging.getLogger("kvxferd.daemon")


def _check_startup(cfg: KvxferdConfig, settings: ResolvedSettings) -> None:
    """What must hold before anything starts (StartupError naming it)."""
    problem = registry.startup_problem(settings.backend, settings.runtime)
    if problem is None and settings.runtime == "PYTHON" and settings.kv_transfer_timeout_ms is None:
        problem = "the PYTHON runtime needs a finite kv_transfer_timeout_ms"
    if problem is not None:
        raise StartupError(problem)
    if settings.kv_memory == "vram":
        _check_device(cfg, settings)
    d = cfg.daemon
    host, _ = split_hostport(d.peer_listen)
    if not d.peers_authenticated and host not in ("127.0.0.1", "localhost", "::1"):
        raise StartupError(
            f"daemon.peer_listen {d.peer_listen} is not loopback, so peers must authenticate: "
            "set daemon.shared_secret_file to a file holding a shared secret, or the "
            "daemon.tls_* files (mutual TLS)"
        )


def _check_device(cfg: KvxferdConfig, settings: ResolvedSettings) -> None:
    """A vram daemon needs its CUDA device now: its staging lives there, and every pool it
    will accept is on it. Refusing here says why at once, not at the first registration."""
    found = device.probe()
    where = f"engine.kv_memory is vram in {cfg.source}"
    if not found.available:
        raise StartupError(
            f"{where}, but this host has no usable CUDA device: {found.why} "
            "(docs/engine-integration.md, 'GPU pools')"
        )
    if settings.cuda_device >= found.count:
        raise StartupError(
            f"{where} with engine.cuda_device {settings.cuda_device}, but this daemon sees "
            f"{found.count} CUDA device(s) (ordinals 0..{found.count - 1}; "
            "CUDA_VISIBLE_DEVICES?)"
        )


def _transfer_buffers(
    cfg: KvxferdConfig, settings: ResolvedSettings, staged: bool
) -> BounceBuffers | None:
    """The staged runtime's staging buffers (every request goes through them), or the
    PYTHON runtime's bounce buffer when configured; in device memory for GPU pools."""
    nbytes = 0
    if staged:
        layout = cfg.engine.kv_layout
        block_bytes = (
            cfg.engine.kv_factor
            * layout.num_layers
            * layout.tokens_per_block
            * layout.num_kv_heads
            * layout.head_dim
            * layout.itemsize
        )
        tokens = settings.max_tokens_in_buffer or cfg.engine.max_seq_len or DEFAULT_STAGING_TOKENS
        nbytes = staging_bytes(tokens, layout.tokens_per_block, block_bytes)
    elif settings.bounce_buffer_mb > 0:
        nbytes = settings.bounce_buffer_mb << 20
    if nbytes == 0:
        return None
    if settings.kv_memory == "vram":
        return _device_buffers(nbytes, settings.cuda_device)
    # On huge pages where daemon.huge_pages and the host allow (transceiver/staging.py).
    return BounceBuffers(nbytes, backing=host_staging(cfg.daemon.huge_pages))


def _device_buffers(nbytes: int, cuda_device: int) -> BounceBuffers:
    """Device staging for GPU pools: two regions of `nbytes` in VRAM on `cuda_device`,
    gathered into and scattered from on the device (Daemon.start registers them as VRAM)."""
    # Imported here: the device copier imports cupy when it is made, and host daemons never
    # make one.
    from kvxferd.transceiver.device_copy import device_buffers

    return device_buffers(nbytes, cuda_device)


def _device_status(settings: ResolvedSettings) -> dict[str, object] | None:
    """The GPU a vram daemon uses, for /v1/status and the start-up log (None: host pools)."""
    if settings.kv_memory != "vram":
        return None
    found = device.probe()
    try:
        uuid: str | None = device.uuid_of(settings.cuda_device)
    except device.DeviceError:
        uuid = None  # informative only; the device itself was checked at start-up
    try:
        from kvxferd.backends.nixl import nixl_module_name

        nixl_module = nixl_module_name()
    except (ImportError, KvxferdError):
        nixl_module = None
    return {
        "kv_memory": settings.kv_memory,
        "cuda_device": settings.cuda_device,
        "uuid": uuid,
        "cuda_runtime": found.runtime_version,
        "cuda_driver": found.driver_version,
        "cupy": found.cupy_version,
        "nixl_module": nixl_module,
        "zero_copy": settings.device_zero_copy,
    }


class Daemon:
    """The composition root: builds the parts from the configuration, wires them, and
    runs their lifecycle (start, serve, drain, stop). What an engine or a peer says is
    handled by EngineCalls and PeerRoutes; status, reload and metrics read DaemonView."""

    def __init__(self, cfg: KvxferdConfig, settings: ResolvedSettings) -> None:
        self.cfg = cfg
        self.settings = settings
        d = cfg.daemon
        self.daemon_name = d.name
        self.role = cfg.engine.role
        self.incarnation = f"{int(time.time()):x}-{secrets.token_hex(4)}"
        self.agent_name = f"{d.name}.{self.incarnation}"
        _check_startup(cfg, settings)
        secret = d.read_shared_secret()
        self.secret_configured = secret is not None
        peer_tls = tls.load(d)
        host, _ = split_hostport(d.peer_listen)
        # Before the backend starts: UCX listens on every device it finds otherwise.
        self.ucx_devices = listeners.pin_ucx_devices(host)
        # Where our own threads copy beside NIXL's writes (the staged runtime's gathers and
        # scatters, the PYTHON runtime's bounce buffer and head slices): UCX's worker lock as
        # a mutex, so that NIXL's progress thread sleeps rather than spins on the core those
        # copies need while a post holds the lock. Writes straight out of the engine's blocks
        # (PYTHON without a bounce buffer) keep the spinlock, which was faster there.
        copies = settings.runtime == "CPP" or settings.bounce_buffer_mb > 0
        self.ucx_mutex = settings.backend == "NIXL" and copies and prefer_mutex_worker_lock()
        self.identity = Identity(d.name, self.incarnation, self.role, secret or b"")
        # MOONCAKE tells peers `host` and keeps its own timeouts below ours.
        options = registry.BackendOptions(host, settings.kv_transfer_timeout_ms)
        self.dataplane = DataPlane(
            lambda: registry.make_backend(settings.backend, self.agent_name, options)
        )
        self.pools = PoolRegistry(
            self.dataplane,
            cuda_device=settings.cuda_device,
            device_zero_copy=settings.device_zero_copy,
        )
        # What /v1/status says of the GPU (None for a host daemon); probed once, here.
        self.device = _device_status(settings)
        # Every background task the daemon starts; stop() ends and awaits them.
        self.tasks = TaskScope("daemon")
        self.staged = settings.runtime == "CPP"
        self.bounce = _transfer_buffers(cfg, settings, self.staged)
        sender_timeouts, receiver_timeouts = timeouts_of(cfg, settings)
        # The send coordinator, with the runtime's mover (how a slice's bytes cross).
        self.sender = Sender(
            sender_timeouts, self.dataplane, pipelined=settings.pipelined_transfer,
            bounce=self.bounce, mover=SEND_MOVERS[settings.runtime],
            max_requests=self._max_requests,
        )  # fmt: skip
        self.routes = PeerRoutes(self, self.dataplane, self.tasks, self.agent_name)
        # How peer names become addresses: daemon.peers, or etcd (registered at start).
        self.discovery = make_discovery(cfg, self.incarnation)
        self.peers = PeerManager(
            self.identity,
            self.dataplane,
            self.routes.make_info,
            self.routes.check_info,
            PeerTimings(
                handshake_s=d.handshake_timeout_ms / 1e3,
                heartbeat_interval_s=d.heartbeat_interval_ms / 1e3,
                heartbeat_timeout_s=d.heartbeat_timeout_ms / 1e3,
            ),
            AddressResolver(self.discovery),
            self.routes.on_message,
            self.routes.closed,
        )
        self.peers.tls = peer_tls
        self.peers.info_for_peer = self.routes.info_for
        poll_ms = settings.kv_transfer_poll_interval_ms
        self.admission = AdmissionWindow(
            settings.admission_window_blocks, poll_ms / 1e3 if poll_ms else None
        )
        # The receive coordinator, with the runtime's receive mover.
        rx_mover = RECV_MOVERS[settings.runtime](self.bounce, settings.pipelined_transfer)
        self.receiver = Receiver(
            receiver_timeouts, self.admission, named_connect(self.peers.connect, self.discovery),
            rx_mover,
            pipelined=settings.pipelined_transfer, max_requests=self._max_requests,
        )  # fmt: skip
        self.calls = EngineCalls(self, self.tasks, self.routes.announce_pools)
        self.api = ApiServer(d.api_socket_path(), self.calls)
        # Operations: per-daemon metrics registry, sd_notify, loop lag, reload history.
        self.metrics = DaemonMetrics(
            d.name, self.role, settings.backend, settings.runtime, settings.fingerprint()
        )
        self._observe()
        self.notifier = Notifier()
        self.loop_monitor = LoopMonitor()
        self.last_reload: ReloadReport | None = None
        self.http = HttpServer(self, self.metrics.render) if d.http else None
        # Up and serving, from start until the drain (`ready` adds the transport's word).
        self.serving = False
        self._unhealthy = False  # health_problem's last answer, to log each change once
        self.draining = False
        self.started_at = time.monotonic()

    def _observe(self) -> None:
        """Metrics hear of outcomes, writes, refusals, admission waits and handshakes; the
        parts hear of each other's events."""
        m = self.metrics
        m.bind(self)
        self.api.on_outcome = m.observe_outcome
        self.api.on_malformed = partial(m.malformed_message, "engine")
        self.sender.writes.on_write_done = m.observe_write
        self.sender.on_refused = m.request_refused
        self.admission.on_wait = m.observe_admission_wait
        self.peers.observer = m
        self.peers.on_established = self.routes.established
        self.peers.settle_incarnation = lambda peer: self.sender.settle_incarnation(
            peer.name, peer.incarnation
        )
        self.receiver.on_hold_released = self.calls.hold_released
        self.sender.on_pool_user_left = self.calls.pool_user_left
        self.peers.before_evict = self.sender.drained_into

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
        if self.device is not None:
            dev = self.device
            log.info(
                "GPU pools: cuda:%s (%s), CUDA runtime %s, driver %s, cupy %s, NIXL module %s, "
                "zero-copy %s",
                dev["cuda_device"],
                dev["uuid"] or "UUID unknown",
                dev["cuda_runtime"],
                dev["cuda_driver"],
                dev["cupy"],
                dev["nixl_module"] or "?",
                "on" if dev["zero_copy"] else "off",
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
                    self.dataplane.backend.register, region.address, region.nbytes, region.memory
                )
            pages = self.bounce.send.pages
            log.info(
                "%s: two regions of %.1f MiB registered, %s",
                "staging buffers" if self.staged else "bounce buffer",
                self.bounce.send.nbytes / (1 << 20),
                f"on {pages.describe()} pages" if pages is not None else "device memory",
            )
        host, port = split_hostport(d.peer_listen)
        address = await self.peers.listen(host, port)
        log.info("listening for peers on %s", address)
        # Registered once peers can reach us; etcd absent is not fatal (discovery down).
        await self.discovery.start(address)
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
        if self.ucx_mutex:
            log.info(
                "%s over NIXL: UCX_USE_MT_MUTEX=y (set it to choose otherwise)",
                "staged runtime" if self.settings.runtime == "CPP" else "bounce buffer",
            )
        self.serving = True
        log.info("ready")

    async def _start_transport(self) -> None:
        # Mutual TLS covers the peer channel, not the transport's own listener: without a
        # shared secret, each pair of daemons proves a key made of secrets they swapped
        # over TLS (kvxferd/backends/link_secrets.py). With neither, start-up already
        # warned that nothing is authenticated.
        per_pair = self.peers.tls is not None and not self.secret_configured
        transport = registry.make_transport(
            self.settings.backend,
            self.daemon_name,
            self.incarnation,
            self.identity.secret,
            per_pair_secrets=per_pair,
        )
        host, _ = split_hostport(self.cfg.daemon.peer_listen)
        self.routes.transport_address = await transport.start(host)
        if per_pair:
            log.info(
                "%s links prove a key each pair of daemons swapped over TLS",
                self.settings.backend,
            )
        self.routes.transport = transport
        self.sender.mover.attach(transport)
        self.receiver.mover.attach(transport)
        log.info(
            "data plane up: %s transport listening on %s",
            self.settings.backend,
            self.routes.transport_address,
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
        background = TaskScope("operations")
        background.start(self.loop_monitor.run(), "loop-monitor")
        background.start(
            self.notifier.watchdog_loop(lambda: self.health_problem() is None), "sd-watchdog"
        )
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

    def _max_requests(self) -> int:
        return self.cfg.daemon.max_requests  # read live: a reload applies at once

    async def stop(self) -> None:
        if self.draining:
            return
        self.draining = True
        self.serving = False
        # Leave discovery first: nobody should pick this daemon for new work while it drains.
        await self.discovery.close()
        deadline = time.monotonic() + self.cfg.daemon.drain_timeout_ms / 1e3
        active = self.sender.active_count() + self.receiver.active_count()
        log.info("draining: %d request(s) in flight", active)
        await asyncio.gather(self.sender.drain(deadline), self.receiver.drain(deadline))
        await self._wait_holds(deadline)
        await self._wait_drains(deadline)
        log.info("drained; closing the engine API")
        await self.api.close()
        log.info("closing peer connections")
        await self.peers.close()
        # Background work still running (an abort waiting for a write to quiesce, a link
        # made ahead) ends here, before what it uses is released: nothing outlives stop.
        await self.tasks.cancel()
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
        if self.routes.transport is not None:
            await self.routes.transport.close()
        await self.dataplane.close()
        log.info("stopped")

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

    async def _wait_drains(self, deadline: float) -> None:
        """Shutdown: writes drained rather than cancelled (tx_drains.py) get until the
        drain deadline; what is left is reported, as holds are."""
        drains = self.sender.writes.drains
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                drains.wait(drains.active), max(0.0, deadline - time.monotonic())
            )
        for drain in await self.sender.close_drains():
            log.error(
                "request %s: shutting down with its write to %s still in flight (drained "
                "for %.1f s); its source blocks may still be read, and the receiver keeps "
                "its own blocks held",
                shown(drain.request_id),
                drain.peer_name,
                drain.held_ms / 1e3,
                extra={"request_id": drain.request_id},
            )

    # ---------------------------------------------------------------- status

    def status(self) -> dict[str, object]:
        return daemon_status(self)

    @property
    def ready(self) -> bool:
        """Serving, and no live peer's transfers stopped arriving (stalled_peers)."""
        return self.serving and not self.stalled_peers()

    def stalled_peers(self) -> dict[str, float]:
        """Peers alive whose transport messages stopped arriving (a two-sided transport's
        word: MPI's receive queue held up by a process stopped or killed mid-send)."""
        transport = self.routes.transport
        return {} if transport is None else transport.stalled_peers()

    def listener_refused(self) -> dict[str, int]:
        """Connections to the staged transport's own listener (UCX, MPI) closed before their
        hellos, by reason."""
        transport = self.routes.transport
        return {} if transport is None else transport.listener_refused()

    def readiness_detail(self) -> str:
        return readiness_detail(self)

    def health_problem(self) -> str | None:
        """Why a supervisor should restart the daemon (one line per peer), or None: a live
        peer stalled for daemon.stall_unhealthy_s (over MPI a receive queue held up by a
        process killed mid-send stays held until this process ends). Said in the log once
        each time it turns unhealthy."""
        problem = stall_health_problem(self.stalled_peers(), self.cfg.daemon.stall_unhealthy_s)
        if (problem is not None) != self._unhealthy:
            self._unhealthy = problem is not None
            if problem is not None:
                log.error("unhealthy (/healthz 503): %s", problem.replace("\n", "; "))
            else:
                log.warning("healthy again: the stalled peers' messages arrive")
        return problem
