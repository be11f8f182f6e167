"""One established, authenticated connection to a peer daemon.

Owns the socket after the handshake: a reader loop that hands each message to
the daemon, a heartbeat task that declares the peer lost when nothing was heard
for `heartbeat_timeout_ms`, and an ordered writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from kvxferd.errors import ProtocolError
from kvxferd.memory.layout import KvLayout, LayoutError
from kvxferd.peers.framing import CorkedWriter, until_heard
from kvxferd.peers.handshake import PeerIdentity
from kvxferd.peers.messages import PEER_CODEC, Info, PeerMessage, Ping, Pong, PoolInfo
from kvxferd.service.logs import TEXT_LIMIT, shown
from kvxferd.transceiver.wake import Wake

log = logging.getLogger("kvxferd.peers")


# Highest address + 1 a pool may reach: user space on every 64-bit Linux is below 2**63,
# and the write plan computes addresses as int64.
_ADDRESS_LIMIT = 1 << 63


def _check_extent(p: PoolInfo, layout: KvLayout) -> None:
    """A peer's pool must lie in user space and hold its own layout: a base near 2**64 or
    a size short of the layout would otherwise reach the write plan (and overflow it)."""
    if not 0 < p.base < _ADDRESS_LIMIT or not 0 < p.nbytes <= _ADDRESS_LIMIT - p.base:
        raise LayoutError(
            f"pool {p.pool_id[:64]!r} spans [{p.base:#x}, +{p.nbytes}), outside user space"
        )
    if p.nbytes < layout.pool_bytes:
        raise LayoutError(
            f"pool {p.pool_id[:64]!r} is {p.nbytes} bytes but its layout needs {layout.pool_bytes}"
        )


class PeerConnection:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: PeerIdentity,
        info: Info,
        agent_name: str,
        label: str,
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self._out = CorkedWriter(writer)
        self.peer = peer
        self.agent_name = agent_name  # the peer's NIXL agent as loaded into ours
        self.label = label
        self.pools: dict[str, PoolInfo] = {}
        # Parsed once per pools message, off the per-request path; a bad layout
        # is kept as its error so only requests into that pool fail.
        self.layouts: dict[str, KvLayout | LayoutError] = {}
        self.info = info
        # Set by every pools message and by the close (pools_announced).
        self._pools_changed = Wake()
        self.set_pools(info.pools)
        self._interval = heartbeat_interval_s
        self._timeout = heartbeat_timeout_s
        self._last_heard = time.monotonic()
        self._heard = asyncio.Event()  # set on every frame (probe waits on it)
        self._seq = 0
        # When we sent the Pings not yet answered, and when we sent the latest one that was:
        # the peer was alive then, on our clock. Frames that waited in a socket buffer while
        # we were stopped refresh _last_heard, but never this.
        self._pings: dict[int, float] = {}
        self._alive_at = time.monotonic()
        self.closed = asyncio.Event()
        self.close_reason = ""
        self.heartbeat_lost = False  # closed because the peer fell silent
        self.dialed = False  # we opened it (to `label`), rather than accepted it
        # Our wall clock minus the peer's, from its Info (0: unknown). A deadline the peer
        # states in its own wall clock is ours plus this.
        self.clock_offset_ms = int(time.time() * 1e3) - info.wall_ms if info.wall_ms else 0
        self._tasks: list[asyncio.Task[None]] = []
        # Told of a message that did not decode, before the connection closes (metrics).
        self.on_protocol_error: Callable[[ProtocolError], None] | None = None

    def set_pools(self, pools: list[PoolInfo]) -> None:
        self.pools = {p.pool_id: p for p in pools}
        self.layouts = {}
        for p in pools:
            try:
                layout = KvLayout.from_wire(p.layout)
                _check_extent(p, layout)
                self.layouts[p.pool_id] = layout
            except LayoutError as exc:
                self.layouts[p.pool_id] = exc
        # The peer's memory we may write, (address, nbytes): a hint the backend may use to
        # prepare descriptors once per region (kvxferd.backends.nixl_prepared).
        regions = [(p.base, p.nbytes) for p in pools if p.writable and p.nbytes > 0]
        if self.info.bounce_nbytes > 0:
            regions.append((self.info.bounce_base, self.info.bounce_nbytes))
        self.regions: tuple[tuple[int, int], ...] = tuple(regions)
        self._pools_changed.set()

    async def pools_announced(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the peer's next pools message, or the connection to
        close; whether either came."""
        self._pools_changed.clear()
        return await self._pools_changed.wait(timeout_s)

    @property
    def tls(self) -> str | None:
        """The TLS version and cipher this connection runs (None: plain TCP)."""
        obj = self.writer.get_extra_info("ssl_object")
        if obj is None:
            return None
        cipher = obj.cipher()
        return f"{obj.version()} {cipher[0]}" if cipher else str(obj.version())

    @property
    def key(self) -> str:
        return self.peer.key

    def start(
        self,
        on_message: Callable[[PeerConnection, PeerMessage], Awaitable[None]],
        on_closed: Callable[[PeerConnection], Awaitable[None]],
    ) -> None:
        self._tasks = [
            asyncio.create_task(self._read_loop(on_message), name=f"peer-read-{self.key}"),
            asyncio.create_task(self._heartbeat(), name=f"peer-heartbeat-{self.key}"),
        ]
        watcher = asyncio.create_task(self._watch(on_closed), name=f"peer-watch-{self.key}")
        self._tasks.append(watcher)

    async def send(self, msg: object) -> bool:
        """Queue a message; False when the connection is already closed."""
        if self.closed.is_set():
            return False
        try:
            self._out.write(PEER_CODEC.encode(msg))
            await self._out.drain()
        except (ConnectionError, OSError, RuntimeError) as exc:
            # RuntimeError: uvloop's "the handler is closed", when the peer's socket went
            # away (killed) between our last read and this write, before we noticed.
            self.close(f"write failed: {exc}")
            return False
        # A drain can end because the connection was closed (and its unsent frames
        # dropped) meanwhile: then the message may never have left.
        return not self.closed.is_set()

    async def probe(self, timeout_s: float) -> bool:
        """Ping and wait up to `timeout_s` for the answer to a ping sent now: True when the
        peer's daemon runs and reads this connection. Frames that were already on their way
        (queued before a stall, sent by a daemon that has since closed) do not count."""
        start = time.monotonic()
        if not await self._ping():
            return False
        ended = await until_heard(
            lambda: self.closed.is_set() or self._alive_at >= start, self._heard, start + timeout_s
        )
        return ended and not self.closed.is_set()  # a closed connection is no answer

    async def _ping(self) -> bool:
        self._seq += 1
        self._pings[self._seq] = time.monotonic()
        if len(self._pings) > 64:  # a peer that never answers: keep the newest only
            del self._pings[min(self._pings)]
        return await self.send(Ping(seq=self._seq))

    def _ponged(self, seq: int) -> None:
        sent = self._pings.get(seq)
        if sent is None:
            return
        self._alive_at = max(self._alive_at, sent)
        for old in [k for k in self._pings if k <= seq]:
            del self._pings[old]

    async def fresh(self) -> bool:
        """Not stale, or the peer answers a ping now (up to two heartbeat intervals): after
        a stall of our own the connection looks stale until the next ping round trip,
        which must not fail the writes of a peer that is fine."""
        return not self.stale or await self.probe(2 * self._interval)

    @property
    def stale(self) -> bool:
        """No answer to a Ping sent within the heartbeat timeout: the peer may well have
        given up on this connection even if we have not noticed (we were stopped, and
        what it sent meanwhile is still queued). Judged on our own clock from when we sent
        the Ping it answered, so frames read late after a stall do not count."""
        return time.monotonic() - self._alive_at > self._timeout

    def close(self, reason: str) -> None:
        if self.closed.is_set():
            return
        self.close_reason = reason
        self.closed.set()
        self._pools_changed.set()
        with contextlib.suppress(Exception):
            self._out.close()

    async def _read_loop(
        self, on_message: Callable[[PeerConnection, PeerMessage], Awaitable[None]]
    ) -> None:
        frames = PEER_CODEC.frames(self.reader)
        try:
            while True:
                bodies = await frames.read()
                if bodies is None:
                    self.close("connection closed by peer")
                    return
                for body in bodies:
                    msg = PEER_CODEC.decode(body)
                    if self.closed.is_set():
                        # Closed (replaced, abandoned) while this frame waited: a message
                        # read from a connection we gave up on must not start anything.
                        return
                    self._last_heard = time.monotonic()
                    self._heard.set()
                    if isinstance(msg, Ping):
                        await self.send(Pong(seq=msg.seq))
                    elif isinstance(msg, Pong):
                        self._ponged(msg.seq)
                    else:
                        await on_message(self, msg)
        except ProtocolError as exc:
            text = shown(exc, TEXT_LIMIT, quote=False)  # it may quote what the peer sent
            if self.on_protocol_error is not None:
                self.on_protocol_error(exc)
            # Once per connection: it is closed now, and a redial is a handshake again.
            log.warning("peer %s (%s) sent a bad message, closing: %s", self.key, self.label, text)
            self.close(f"protocol error: {text}")
        except (ConnectionError, OSError) as exc:
            self.close(f"connection error: {exc}")
        except asyncio.CancelledError:
            self.close("shutting down")
            raise

    async def _heartbeat(self) -> None:
        while not self.closed.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.closed.wait(), self._interval)
            if self.closed.is_set():
                return
            silent = time.monotonic() - self._last_heard
            if silent > self._timeout:
                log.warning(
                    "peer %s (%s) silent for %.1f s, declaring it lost",
                    self.key,
                    self.label,
                    silent,
                )
                self.heartbeat_lost = True
                self.close(f"no heartbeat for {silent:.1f} s")
                return
            await self._ping()

    async def _watch(self, on_closed: Callable[[PeerConnection], Awaitable[None]]) -> None:
        await self.closed.wait()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        await on_closed(self)
