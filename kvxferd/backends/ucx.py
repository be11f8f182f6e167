"""UCX adapter for the staged (CPP) runtime: the only module that imports ucxx
(ucx_progress.py reaches into the ucxx it loaded; ucx_wire.py holds the hello and the
tag hashing described below).

Each round of a request crosses as ONE contiguous tagged message, from the
context daemon's staging buffer to the generation daemon's staging buffer,
over ucxx's asyncio API (two-sided tag send/receive). The transport lives on
the daemon's event loop; ucxx errors are translated into kvxferd errors here:
PeerLostError when the peer is gone, TransferTimeoutError for a receive
deadline, TransferError otherwise, BackendUnavailableError when ucxx does not
import.

Peers and tags
--------------
Our key is "daemon_name/incarnation". `connect` opens an endpoint to the
peer's listener and sends a hello carrying our key; the listener answers with its
own key, which `connect` checks against the key it was asked for (a restarted peer
answers with a new incarnation and is refused), and each proves the shared secret
to the other; the listener registers the endpoint under our key before its last
hello (ucx_hellos.py has the four). Hellos use ucxx's per-endpoint tags, so two peers
connecting at once never swap them. Once an endpoint exists in either
direction, either side may send to and receive from that peer.

UCX matches tags per worker, not per endpoint, so the caller's 64-bit tag is
hashed together with the SENDER's key into the tag on the wire: the same tag
from two peers, or from two incarnations of one peer, never mixes.

Receive deadlines and late messages
-----------------------------------
ucxx cannot cancel one posted receive (only closing its endpoint does), and a
receive posted into `out` keeps writing there for as long as it is posted. So
`recv` never posts a receive before its message is there: it probes the
worker's queue of arrived-but-unmatched messages for the tag, and only once the
message (for a large one: its rendezvous header) has arrived does it post the
receive into `out`. That receive matches the queued message at once. A deadline
that passes before arrival leaves nothing posted that could write into `out`:
a message arriving later has no receive to land in.

The tag is then abandoned: a background drain receives a late message with it
into a scratch buffer and drops it, so the sender's `send` completes instead of
waiting forever and the stale bytes never reach a later `recv` of that tag. A
new `recv` of an abandoned tag takes it back (it gets the next message with
that tag, possibly the late one). Abandoned tags are forgotten after
`abandon_ttl_s`, or when the peer is removed.

A message matched before the deadline is received to the end (the deadline
bounds the wait for ARRIVAL). Should it stall, or should the task calling
`send`/`recv` be cancelled while UCX still uses the buffer, the call waits up
to `stall_grace_s` more, then closes the peer's endpoints (which makes UCX fail
its requests) and waits for UCX to release the request. So: once `send` or
`recv` has returned or raised, including CancelledError, UCX no longer reads
`data` or writes `out`.

`send` returning means `data` may be reused, NOT that the peer has it all:
over TCP the last fragments may still be on their way. Closing or removing the
peer right after a send can cut the receiver's message short; wait for the
receiver's acknowledgement first. Waiting for arrival costs a probe every
millisecond at most, so a message is noticed up to ~1 ms after it arrives.

Progress mode and transports: the default progress mode ("blocking": progress on
the event loop when UCX's epoll descriptor is readable, EventLoopProgress in
ucx_progress.py) was chosen by measurement, and UCX runs TCP only while endpoint error
handling is on (which peer-loss detection needs); docs/backends-ucx.md has the numbers
and UCXPY_PROGRESS_MODE.

The listener binds every interface (ucxx has no bind address). With a shared secret
(daemon.shared_secret_file), or with mutual TLS a key per pair of daemons
(link_secrets.py), a new endpoint is registered only once its connector proved that key
(link_proof.py; the hellos are in ucx_hellos.py), and the connector checks the listener's
proof in turn; with neither the hellos only say which peer an endpoint belongs to.

One ucxx context per process: ucxx keys its progress task by event loop, so
two contexts on one loop would leave the second without progress. Every
transport of a process shares that context; it lives as long as the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import math
import os
from collections.abc import Awaitable
from typing import Any

from kvxferd.backends import ucx_peer_info
from kvxferd.backends.tagbook import TaggedTransport
from kvxferd.backends.twosided import connect_failures, connect_timeout
from kvxferd.backends.ucx_hellos import Hellos
from kvxferd.backends.ucx_progress import (
    EventLoopProgress,
    install_event_loop_progress,
    progress_mode,
)
from kvxferd.backends.ucx_wire import (
    encode_hello,
    wire_tag,
)
from kvxferd.errors import (
    BackendUnavailableError,
    PeerLostError,
    StartupError,
    TransferError,
    TransferTimeoutError,
)
from kvxferd.hostport import split_hostport
from kvxferd.peers.preauth import PreauthGate
from kvxferd.service.logs import TEXT_LIMIT, LogLimiter, shown

log = logging.getLogger("kvxferd.backends.ucx")

_INSTALL_HINT = (
    "install it with `pip install ucxx-cu12` (ucx-py-cu12 on PyPI is only a placeholder; "
    "ucxx is its maintained successor)"
)

# How long a listener waits for an incoming endpoint's hello.
HELLO_TIMEOUT_S = 10.0
# Endpoints in their hellos at once (two descriptors each).
UCX_MAX_GREETING = 256

# Probing for an awaited message: the first polls only yield to the loop,
# later ones sleep up to this long (asyncio sleeps at millisecond resolution).
_PROBE_SPINS = 32
_PROBE_MAX_SLEEP_S = 0.001
_DRAIN_PERIOD_S = 0.01
# ucxx exception class names that mean the connection is gone (a request of
# an endpoint closed by us or by an error is cancelled).
_PEER_LOST_ERRORS = {
    "UCXXCanceledError",
    "UCXXCloseError",
    "UCXXConnectionResetError",
    "UCXXEndpointTimeoutError",
    "UCXXFirstEndpointFailureError",
    "UCXXFirstLinkFailureError",
    "UCXXIOError",
    "UCXXLastEndpointFailureError",
    "UCXXLastLinkFailureError",
    "UCXXNotConnectedError",
    "UCXXRejectedError",
    "UCXXTimedOutError",
    "UCXXUnreachableError",
}


class _PeerGoneFilter(logging.Filter):
    """ucxx logs an ERROR with a full traceback when a peer dies while its endpoint is
    being accepted (the listener's handshake fails). For a daemon that is an expected
    fault, reported through PeerLostError where it matters: keep one WARNING line
    naming the exception instead of a traceback that reads like a crash."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if (
            record.levelno >= logging.ERROR
            and isinstance(args, tuple)
            and len(args) == 2
            and str(args[0]).startswith("Unexpected error in listener handler")
        ):
            last = str(args[1]).rstrip().splitlines()[-1:] or ["?"]
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg, record.args = "UCX: accepting a peer's endpoint failed: %s", (last[0],)
        return True


def _load() -> Any:
    # ucxx sets UCX_MEMTYPE_CACHE for old UCX releases; the UCX it bundles no
    # longer knows it and would warn on every context creation.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    ucx_log = logging.getLogger("ucx")
    if not any(isinstance(f, _PeerGoneFilter) for f in ucx_log.filters):
        ucx_log.addFilter(_PeerGoneFilter())
    try:
        # importlib keeps the untyped package out of mypy's sight.
        ucxx = importlib.import_module("ucxx")
    except (ImportError, OSError) as exc:
        raise BackendUnavailableError(
            f"backend UCX needs the ucxx-cu12 package, which does not import ({exc}); "
            + _INSTALL_HINT
        ) from exc
    ucx_peer_info.install()  # ucxx's own frees a buffer UCX may still write (its docstring)
    return ucxx


def _named(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _split_address(address: str) -> tuple[str, int]:
    try:
        return split_hostport(address, "UCX peer address")
    except ValueError as exc:
        raise TransferError(str(exc)) from None


class UcxTransport(TaggedTransport[int]):  # tags by wire tag: see recv
    """Tagged messages between daemons over UCX (ucxx, asyncio).

    Runs on the daemon's event loop; not thread-safe. See the module docstring
    for the hello, the tags, and what happens to late messages.
    """

    name = "UCX"
    link_ahead = False  # endpoints open at the first round

    def _open(self) -> None:
        self._ucxx = _load()
        encode_hello(self.key)  # a key too long for a hello fails here, at start-up
        self._hellos = Hellos(self.key, self.link_secrets, self._bounded)
        self._ctx: Any = None
        self._driver: EventLoopProgress | None = None
        self._listener: Any = None
        # peer key -> its endpoints (one per direction at most, normally one).
        self._peers: dict[str, list[Any]] = {}
        self._drainer: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        # Endpoints that have not finished their hellos: capped as the peer channel's
        # connections are, but higher (ucxx's listener tells no remote address, so one
        # overall cap, and with per-pair keys a hello may wait 5 s for the peer's Info:
        # a reconnect wave of a large cluster overlaps longer).
        self._greeting = PreauthGate(
            "UCX endpoint(s)", max_connections=UCX_MAX_GREETING, max_per_source=None
        )
        self._refusals = LogLimiter(interval_s=10.0, burst=8)
        # Hello sends and receives that outlived their wait (_bounded): never cancelled.
        self._stranded: set[asyncio.Future[Any]] = set()
        self._closed = False

    # -- set-up ------------------------------------------------------------

    def _context(self) -> Any:
        """The process's ucxx context, created (on the running loop) on first use."""
        if self._closed:
            raise TransferError(f"UCX transport {self.key} is closed")
        if self._ctx is None:
            mode = progress_mode()
            try:
                self._ucxx.init(progress_mode=mode)
            except RuntimeError:
                pass  # another transport of this process made it already
            except Exception as exc:
                raise StartupError(f"UCX could not initialise: {exc}") from exc
            # The context object itself is not exported; its probe is.
            ctx = self._ucxx.core._get_ctx()
            if ctx.progress_mode != mode:
                log.warning(
                    "ucxx already runs in %r progress mode in this process; %r ignored",
                    ctx.progress_mode,
                    mode,
                )
            ctx.continuous_ucx_progress()
            if ctx.progress_mode == "blocking":
                try:
                    self._driver = install_event_loop_progress(ctx, asyncio.get_running_loop())
                except Exception as exc:  # ucxx internals moved: keep its own mode
                    log.warning(
                        "UCX: could not replace ucxx's blocking progress (%s); it may keep "
                        "a core busy while idle",
                        exc,
                    )
            self._ctx = ctx
        return self._ctx

    @property
    def progress_mode(self) -> str | None:
        """The progress mode in effect (None before start/connect)."""
        return None if self._ctx is None else str(self._ctx.progress_mode)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen for peers' endpoints; returns "host:port" to advertise.

        ucxx's listener binds every interface; `host` is only what we advertise.
        """
        ctx = self._context()
        if self._listener is not None:
            raise StartupError(f"UCX transport {self.key} is already listening")
        try:
            self._listener = ctx.create_listener(
                self._on_endpoint, port=port, endpoint_error_handling=True
            )
        except Exception as exc:
            raise StartupError(f"UCX could not listen on port {port}: {exc}") from exc
        return f"{host}:{self._listener.port}"

    async def _on_endpoint(self, ep: Any) -> None:
        """Listener callback: the hellos (ucx_hellos.py), checking the connector's proof
        of the shared secret; registers the endpoint before READY."""
        # Before anything is read: over the cap, the endpoint is closed at once (each
        # holds two descriptors for up to HELLO_TIMEOUT_S; 300 strangers took 600).
        leave = self._greeting.enter("ucx", "a UCX endpoint")
        if leave is None:
            self._abort(ep)
            return
        key = None
        try:
            key, nonce_c = await self._hellos.greeted(ep, HELLO_TIMEOUT_S)
            nonce_l = await self._hellos.answer(ep, key, nonce_c, HELLO_TIMEOUT_S)
            if self._closed:
                raise TransferError("transport closed")
            self._register(key, ep)
            # Registered before READY: once connect() returns on the other side, our
            # recv() for that peer finds the endpoint.
            await self._hellos.ready(ep, nonce_l, HELLO_TIMEOUT_S)
        except Exception as exc:
            # Before the peer channel vouched for it: the key is whatever was sent. Anyone
            # can repeat this at will: at most 8 lines per 10 s, counting the rest.
            self._refusals.log(
                log,
                logging.WARNING,
                "refused",
                "UCX: refused an incoming endpoint (peer %s): %s",
                shown(key),
                shown(str(exc) or type(exc).__name__, TEXT_LIMIT),
            )
            if key is not None:
                self._unregister(key, ep)
            self._abort(ep)
            return
        finally:
            leave()
        log.info("UCX: peer %s connected to us", shown(key))

    async def connect(self, peer_key: str, address: str, timeout_s: float) -> None:
        """Open an endpoint to the peer listening at `address`; the hellos (ucx_hellos.py),
        checking the listener's key and its proof of the shared secret."""
        ctx = self._context()
        host, port = _split_address(address)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        def left() -> float:
            return max(deadline - loop.time(), 0.001)

        # ucxx raises exceptions of its own: their type names say what went wrong.
        with connect_failures("UCX", peer_key, address, timeout_s, Exception, _named):
            ep = await asyncio.wait_for(
                ctx.create_endpoint(
                    host, port, endpoint_error_handling=True, connect_timeout=timeout_s
                ),
                timeout_s,
            )
        try:
            await self._hellos.make(ep, peer_key, address, left)
        except BaseException as exc:
            self._abort(ep)
            if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
                raise connect_timeout("UCX", peer_key, address, "hello answer", timeout_s) from exc
            if isinstance(exc, Exception) and not isinstance(exc, TransferError):
                raise PeerLostError(
                    f"UCX connect to {peer_key} at {address}: hello failed "
                    f"({type(exc).__name__}: {exc})"
                ) from exc
            raise
        self._register(peer_key, ep)

    async def _bounded(self, call: Awaitable[Any], timeout_s: float) -> Any:
        """Await a ucxx send or receive for at most `timeout_s` (else asyncio.TimeoutError)
        without cancelling it: a cancelled ucxx call drops its buffer while UCX may still
        use it. One that outlives its wait is kept, buffer and all, until it ends (the
        caller then aborts its endpoint, which ends it)."""
        task = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
        except asyncio.CancelledError:
            self._strand(task)
            raise
        if not done:
            self._strand(task)
            raise asyncio.TimeoutError()
        return task.result()

    def _strand(self, task: asyncio.Future[Any]) -> None:
        self._stranded.add(task)
        task.add_done_callback(self._unstrand)

    def _unstrand(self, task: asyncio.Future[Any]) -> None:
        self._stranded.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: the call was given up already

    # -- peers ---------------------------------------------------------------

    def _register(self, key: str, ep: Any) -> None:
        eps = [e for e in self._peers.get(key, []) if not e.closed]
        eps.append(ep)
        self._peers[key] = eps

    def _unregister(self, key: str, ep: Any) -> None:
        eps = self._peers.get(key)
        if eps is not None and ep in eps:
            eps.remove(ep)

    def _endpoints(self, peer_key: str) -> list[Any]:
        eps = self._peers.get(peer_key)
        if eps is None:
            raise PeerLostError(
                f"UCX: no endpoint to peer {peer_key}: it never connected (or its hello "
                "has not arrived yet), or it was removed"
            )
        return eps

    def _live_endpoint(self, peer_key: str) -> Any:
        for ep in self._endpoints(peer_key):
            if not ep.closed:
                return ep
        raise PeerLostError(f"UCX: the connection to peer {peer_key} is closed (peer gone)")

    def _abort(self, ep: Any) -> None:
        try:
            # At most 1 s (in ns) for the progress thread to close it.
            ep.abort(period=10**9)
        except Exception as exc:
            log.debug("UCX endpoint abort: %s", exc)
        self._nudge()  # the cancelled requests complete on the next progress

    def _nudge(self) -> None:
        if self._driver is not None:
            self._driver.nudge()

    async def remove_peer(self, peer_key: str) -> None:
        """Close every endpoint of that peer; its pending sends and receives fail."""
        for ep in self._peers.pop(peer_key, []):
            self._abort(ep)
        self._tags.forget_peer(peer_key)
        await asyncio.sleep(0)

    def peers(self) -> list[str]:
        """Keys of the peers with at least one open endpoint."""
        return [k for k, eps in self._peers.items() if any(not e.closed for e in eps)]

    def stalled_peers(self) -> dict[str, float]:
        """None: each endpoint is a TCP connection of its own (endpoint error handling
        rules out UCX's shared-memory receive queue, which MPI's links can stall on)."""
        return {}

    def listener_refused(self) -> dict[str, int]:
        """Endpoints closed before their hellos, by reason (PreauthGate)."""
        return dict(self._greeting.refused)

    # -- data ----------------------------------------------------------------

    def _translate(self, exc: BaseException, peer_key: str, what: str) -> TransferError:
        if isinstance(exc, TransferError):
            return exc
        kind = type(exc).__name__
        gone = peer_key not in self._peers or all(e.closed for e in self._peers[peer_key])
        if gone or kind in _PEER_LOST_ERRORS:
            return PeerLostError(f"UCX {what} with peer {peer_key}: peer lost ({kind}: {exc})")
        return TransferError(f"UCX {what} with peer {peer_key} failed ({kind}: {exc})")

    async def send(self, peer_key: str, tag: int, data: memoryview) -> None:
        """Send `data` (a contiguous host buffer) with `tag`; returns once UCX is done with it.

        A large message completes only when the receiver takes it. If the
        calling task is cancelled meanwhile, see the module docstring.
        """
        ep = self._live_endpoint(peer_key)
        fut = asyncio.ensure_future(ep.send(data, tag=wire_tag(self.key, tag), force_tag=True))
        self._nudge()
        try:
            await asyncio.wait({fut})
        except asyncio.CancelledError:
            await self._quiesce(fut, peer_key, self._stall_grace_s)
            raise
        exc = fut.exception()
        if exc is not None:
            raise self._translate(exc, peer_key, f"send of tag {tag}") from exc

    async def recv(self, peer_key: str, tag: int, out: memoryview, timeout_s: float | None) -> int:
        """Receive the message with `tag` from that peer into `out`; returns its size.

        `timeout_s` (None: unbounded) bounds the wait for the message to arrive; on expiry
        TransferTimeoutError, and nothing was ever posted into `out` (the
        message is drained if it comes later; see the module docstring).
        """
        if out.readonly:
            raise TransferError("UCX recv needs a writable buffer")
        ctx = self._context()
        wt = wire_tag(peer_key, tag)
        self._endpoints(peer_key)
        with self._tags.receiving(wt, peer_key, tag):
            return await self._recv(ctx, peer_key, tag, wt, out, timeout_s)

    async def _recv(
        self, ctx: Any, peer_key: str, tag: int, wt: int, out: memoryview, timeout_s: float | None
    ) -> int:
        loop = asyncio.get_running_loop()
        deadline = math.inf if timeout_s is None else loop.time() + timeout_s
        spins = 0
        while True:
            probe = ctx.tag_probe(wt)
            if probe.matched:
                break
            # Probe before checking the peer: what a peer sent before it
            # closed can still be received.
            self._live_endpoint(peer_key)
            now = loop.time()
            if now >= deadline:
                self._abandon(peer_key, wt)
                raise TransferTimeoutError(
                    f"UCX recv of tag {tag} from {peer_key}: nothing within {timeout_s:g}s"
                )
            spins += 1
            delay = 0.0 if spins < _PROBE_SPINS else _PROBE_MAX_SLEEP_S
            await asyncio.sleep(min(delay, deadline - now))
        nbytes = int(probe.length)
        if nbytes > out.nbytes:
            # Left queued: posting it would truncate, and truncation loses it.
            raise TransferError(
                f"UCX recv of tag {tag} from {peer_key}: the message has {nbytes} bytes, "
                f"the buffer only {out.nbytes}"
            )
        # Any endpoint of that peer will do (matching is per worker); a closed
        # one still receives what was queued before it closed.
        ep = self._endpoints(peer_key)[0]
        target = out if nbytes == out.nbytes else out.cast("B")[:nbytes]
        fut = asyncio.ensure_future(ep.recv(target, tag=wt, force_tag=True))
        self._nudge()
        try:
            done, _ = await asyncio.wait(
                {fut},
                timeout=(
                    None
                    if deadline == math.inf
                    else max(deadline - loop.time(), 0.0) + self._stall_grace_s
                ),
            )
        except asyncio.CancelledError:
            await self._quiesce(fut, peer_key, self._stall_grace_s)
            raise
        if not done:
            await self._quiesce(fut, peer_key, 0.0)
            raise PeerLostError(
                f"UCX recv of tag {tag} from {peer_key}: stalled mid-message "
                f"{self._stall_grace_s:g}s past the deadline; connection closed"
            )
        exc = fut.exception()
        if exc is not None:
            raise self._translate(exc, peer_key, f"recv of tag {tag}") from exc
        return nbytes

    async def _quiesce(self, fut: asyncio.Future[Any], peer_key: str, grace_s: float) -> None:
        """Return only once the UCX request behind `fut` can no longer touch its buffer.

        Waits up to `grace_s`, then closes the peer's endpoints, which makes
        UCX fail the request, and waits for that. Survives further
        cancellation (the caller re-raises it).
        """
        loop = asyncio.get_running_loop()
        limit = loop.time() + grace_s
        escalated = False
        while not fut.done():
            try:
                if escalated:
                    await asyncio.wait({fut})
                else:
                    await asyncio.wait({fut}, timeout=max(limit - loop.time(), 0.0))
            except asyncio.CancelledError:
                continue
            if not fut.done() and not escalated:
                log.warning(
                    "UCX: a transfer with %s is still in flight %.1fs after its deadline or "
                    "cancellation; closing the connection to that peer",
                    peer_key,
                    self._stall_grace_s,
                )
                escalated = True
                for ep in self._peers.pop(peer_key, []):
                    self._abort(ep)
        if not fut.cancelled():
            fut.exception()  # retrieved: no "never retrieved" warning

    # -- late messages -------------------------------------------------------

    def _abandon(self, peer_key: str, wt: int) -> None:
        self._tags.abandon(wt, peer_key)
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        """Receive late messages of abandoned tags into scratch buffers and drop them."""
        while self._tags.abandoned() and not self._closed:
            self._tags.expire()
            for wt, peer_key in self._tags.abandoned():
                probe = self._ctx.tag_probe(wt)
                if not probe.matched:
                    continue
                self._tags.take_back(wt)
                eps = self._peers.get(peer_key)
                if not eps:
                    continue
                scratch = bytearray(int(probe.length))
                task = asyncio.ensure_future(eps[0].recv(scratch, tag=wt, force_tag=True))
                self._nudge()
                self._background.add(task)
                task.add_done_callback(self._drained)
                log.info(
                    "UCX: dropped a late %d-byte message from %s (its recv had timed out)",
                    len(scratch),
                    peer_key,
                )
            await asyncio.sleep(_DRAIN_PERIOD_S)

    def _drained(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("UCX: draining a late message failed: %s", task.exception())

    # -- teardown ------------------------------------------------------------

    async def close(self) -> None:
        """Close the listener and every endpoint. The process's ucxx context stays."""
        if self._closed:
            return
        self._closed = True
        if self._drainer is not None:
            self._drainer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drainer
        for key in list(self._peers):
            for ep in self._peers.pop(key):
                self._abort(ep)
        self._tags.clear()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for task in list(self._background):
            task.cancel()
        await asyncio.sleep(0)
