"""Links to peers: the TCP rendezvous that makes them and watches them.

A link is one intercommunicator with a peer, plus the TCP connection it was
made over, which stays open for the life of the link.

Connections
-----------
`listen` opens a TCP listener ("host:port" is the address the daemon
advertises). `connect` opens a TCP connection to it and sends a hello with
our key ("daemon_name/incarnation"); the listener opens an MPI port just for
this connection, starts MPI_Comm_accept on it in a thread, and answers with
its own key and the port name; the connecting side checks the key (a
restarted peer answers with a new incarnation and is refused), runs
MPI_Comm_connect in a thread, and waits for the listener's "ready", sent once
the intercommunicator is registered. Either side may then send to and
receive from the other.

Before that, each side sends its key over the new intercommunicator and checks
the other's against the key the rendezvous named (bounded by IDENTITY_TIMEOUT_S;
the listener answers "refused" with the reason instead of "ready"). MPICH finds
processes by names of its own (hostname, pid, start second): daemons that look
alike to it (containers or namespaces sharing a hostname, each daemon pid 3,
started together) had links that delivered to another daemon, whose only sign
was requests timing out. Now such a link is refused, saying so. With a shared
secret each key comes with a proof of it over both sides' nonces (HELLO's and
ACK's), so a client of the TCP port without the secret cannot make a link.

Why TCP beside MPI:

* a blocked MPI_Comm_accept spins (half a core here), so accept runs only
  while a peer is known to be connecting, on a port of its own;
* MPICH does not notice a dead peer: a receive from a SIGKILLed process stays
  pending forever (measured with both the ucx and the ofi netmod, 20 s+). The
  TCP connection stays open for the life of the link; the kernel closes it
  when the peer dies, and its EOF marks the link lost, which fails that
  peer's pending sends and receives with PeerLostError within milliseconds.

After the rendezvous the connection carries keepalives, one byte and its end:

* ALIVE, any number of them first: a keepalive (keepalive.py says why).
* GAVE_UP: the side that writes it gave the link up (remove_peer, a stalled
  message, a malformed header, the transport closed). The peer marks the link
  lost at once.
* EOF: the writer is done with this link's MPI. A side closes its end only
  once it gave the link up AND none of its payload sends or receives on it is
  still pending (MPI can abort neither once under way: a stopped sender's send
  goes on when it resumes, and the receive it feeds must take it); the kernel
  closes (or resets) it when the process dies. So nothing more can land in the reader's
  receives still pending on the link, nor will its sends ever be taken:
  transport.py gives them up, and their buffers back (`Link.finished`).

The frames are in wire.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kvxferd.backends.link_proof import NONCE_BYTES, Proofs
from kvxferd.backends.link_secrets import LinkSecrets
from kvxferd.backends.mpi import keepalive, wire
from kvxferd.backends.mpi.accept_turns import AcceptTurns
from kvxferd.backends.mpi.accepts import (
    ACCEPT_WINDOW_S,
    RETIRED_FULL,
    PendingAccept,
    retired_full,
)
from kvxferd.backends.mpi.bootstrap import Runtime
from kvxferd.backends.mpi.identity import IDENTITY_TIMEOUT_S, swap_identities
from kvxferd.backends.mpi.link_state import Link, Peer
from kvxferd.backends.mpi.quiet import ACCEPTS, CONNECTS
from kvxferd.backends.twosided import connect_failures, connect_timeout
from kvxferd.errors import PeerLostError, StartupError, TransferError
from kvxferd.hostport import split_hostport
from kvxferd.peers.preauth import PreauthGate
from kvxferd.service.logs import TEXT_LIMIT, LogLimiter, shown

log = logging.getLogger("kvxferd.backends.mpi")

# How long a listener waits for a connecting peer's hello, and for its MPI side.
HELLO_TIMEOUT_S = 10.0
# What the proofs of the shared secret on an MPI link are bound to (link_proof.py).
_LABEL = b"kvxferd-mpi-link"
# The reason a listener refuses a hello from a peer it is linking to itself (Links._crossing).
CROSSING = "crossing rendezvous: ours to you goes on"
# A kvxferd peer sends one byte after the rendezvous; past this many it is not one.
_MAX_AFTER_LINK = 4096

T = TypeVar("T")


def split_address(address: str) -> tuple[str, int]:
    try:
        return split_hostport(address, "MPI peer address")
    except ValueError as exc:
        raise TransferError(str(exc)) from None


def in_thread(fn: Callable[[], T], name: str) -> asyncio.Future[T]:
    """Run a blocking MPI call in a daemon thread (never joined: an MPI call
    that never returns must not hold up the exit of the process)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(value)
        else:
            fut.set_exception(error)

    def run() -> None:
        try:
            value, error = fn(), None
        except BaseException as exc:
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop is gone
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


class _Crossed(Exception):
    """The listener refused our hello: its rendezvous to us goes on (Links._crossing)."""


def _then(fn: Callable[[], None]) -> Callable[[object], None]:
    """`fn` as a done callback (which is given the future)."""
    return lambda _: fn()


def _free_comm(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        with contextlib.suppress(Exception):
            fut.result().Free()


class Links:
    """The rendezvous listener and the peers it linked, by key.

    `runtime` gives the process's MPI (TransferError once the transport is
    closed); `on_link` is called whenever a link is registered. Runs on the
    event loop.
    """

    def __init__(
        self,
        key: str,
        runtime: Callable[[], Awaitable[Runtime]],
        on_link: Callable[[], None],
        on_finished: Callable[[Link], None],
        link_secrets: LinkSecrets | None = None,
    ) -> None:
        """`link_secrets`: what each new link proves (link_secrets.py, identity.py)."""
        self.key = key
        self._secrets = link_secrets or LinkSecrets(key)
        self._runtime = runtime
        self._on_link = on_link
        self._on_finished = on_finished
        self.peers: dict[str, Peer] = {}
        self.closed = False
        self._server: asyncio.base_events.Server | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        self._later: set[asyncio.Future[None]] = set()  # deferred MPI_Cancel calls
        self._connecting: dict[str, asyncio.Future[None]] = {}
        # MPICH (5.0, UCX netmod) kills the process when two MPI_Comm_connect (or two
        # MPI_Comm_accept) calls of one process overlap: a context daemon linking to two
        # generation daemons at once did so every time. One of each at a time: accepts
        # handed out round the sources waiting (accept_turns.py), connecting rendezvous
        # one after another; and an accept never beside a connecting rendezvous
        # (quiet.py), with crossing ones settled by key (_crossing).
        self._accept_turns = AcceptTurns()
        self._queue_refused = 0
        self._connect_turn = asyncio.Lock()
        # Connections that have not finished the rendezvous: capped as the peer channel's.
        self._greeting = PreauthGate("MPI rendezvous connection(s)")
        self._refusals = LogLimiter(interval_s=10.0, burst=8)

    # -- listening side ------------------------------------------------------

    @property
    def accept_waiting(self) -> int:
        """Rendezvous that read their hello and wait for the accept turn."""
        return self._accept_turns.waiting

    def listener_refused(self) -> dict[str, int]:
        """Rendezvous connections refused, by reason: before their hello (PreauthGate),
        or with too many waiting for the accept turn (accept_queue_limit)."""
        refused = dict(self._greeting.refused)
        if self._queue_refused:
            refused["accept_queue_limit"] = self._queue_refused
        return refused

    async def listen(self, host: str, port: int) -> str:
        """Listen for peers; returns "host:port" to advertise."""
        if self._server is not None:
            raise StartupError(f"MPI transport {self.key} is already listening")
        try:
            self._server = await asyncio.start_server(self._on_client, host, port)
        except OSError as exc:
            raise StartupError(f"MPI could not listen on {host}:{port}: {exc}") from exc
        bound = self._server.sockets[0].getsockname()[1]
        return f"{host}:{bound}"

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Before anything is read: over the caps, the connection is closed at once (each
        # holds a descriptor and a task for up to HELLO_TIMEOUT_S). It counts until its
        # hello is read, not while it waits for MPI's one accept at a time: a reconnect
        # wave of more than 16 daemons behind one address (a NAT) would be refused.
        peername = writer.get_extra_info("peername")
        source = str(peername[0]) if peername else "unknown"
        leave = self._greeting.enter(source, f"{source}:{peername[1]}" if peername else source)
        if leave is None:
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self._handshakes.add(task)
        try:
            await self._accept(reader, writer, leave, source)
        finally:
            leave()
            self._handshakes.discard(task)

    async def _accept(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        hello_read: Callable[[], None] = lambda: None,
        source: str = "unknown",
    ) -> None:
        """Listener side of the rendezvous: hello, MPI accept, register, ready."""
        rt = await self._runtime()
        MPI = rt.MPI
        key: str | None = None
        port: str | None = None
        accepting: PendingAccept | None = None
        comm: Any = None
        hand_on: Callable[[], None] | None = None
        loop = asyncio.get_running_loop()
        try:
            raw_key, nonce_c = await asyncio.wait_for(
                wire.read_frame(reader, wire.HELLO, ("key", "nonce")), HELLO_TIMEOUT_S
            )
            hello_read()
            key = raw_key.decode()
            # Before any MPI work: a client naming a daemon we hold no key for gets none. One
            # naming a known daemon is refused only on its proof, after MPI's accept (in
            # its accept turn, up to ACCEPT_WINDOW_S), as with a shared secret.
            secret = await self._secrets.for_peer(key)
            nonce_l = secrets.token_bytes(NONCE_BYTES)
            if self._crossing(key):
                writer.write(wire.frame(wire.REFUSED, self._crossing_reason()))
                raise TransferError(CROSSING)
            full = self._accept_turns.full(source)
            if full is not None:
                self._queue_refused += 1
                raise TransferError(full)
            hand_on = await self._accept_turns.take(source)
            # A connecting rendezvous of ours first: its connect would never complete
            # beside our accept (quiet.py). It ends within its deadline.
            # And none of our accepts (one whose release failed): never two side by side.
            # Both checked after every pause, so none starts in between.
            while CONNECTS.count or ACCEPTS.count:
                if self._crossing(key):
                    writer.write(wire.frame(wire.REFUSED, self._crossing_reason()))
                    raise TransferError(CROSSING)
                gate = CONNECTS if CONNECTS.count else ACCEPTS
                await gate.quiet_by(loop.time() + 0.05)
            if reader.at_eof() or writer.is_closing():
                # Gone while it waited: no port opened, no accept to release.
                raise TransferError("the peer closed the rendezvous before its turn")
            if retired_full():
                raise TransferError(RETIRED_FULL)
            port = MPI.Open_port()
            accepting = PendingAccept(rt, port, ACCEPT_WINDOW_S)
            port = None  # closed (or retired) by accepting, once its accept ended
            writer.write(wire.frame(wire.ACK, self.key.encode(), accepting.port.encode(), nonce_l))
            await writer.drain()
            # The peer now connects; if its TCP side closes first, it never will.
            closed = asyncio.ensure_future(reader.read(1))
            try:
                done, _ = await asyncio.wait(
                    {accepting.future, closed}, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                closed.cancel()
            if closed.done() and not closed.cancelled():
                closed.exception()  # retrieved: a reset says the same as a close
            if accepting.future in done:
                # Taken even when the peer closed as well: an intercommunicator is freed.
                comm = accepting.future.result()
                accepting = None
                if comm is None:
                    self._accept_turns.penalize(source)
                    raise TransferError(
                        f"the peer did not complete MPI_Comm_connect within {ACCEPT_WINDOW_S:g} s"
                    )
            if closed in done:
                raise TransferError("the peer closed the rendezvous during MPI_Comm_connect")
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            proofs = Proofs(_LABEL, secret, nonce_l, nonce_c, listening=True)
            # In the turn still: a next accept would hold the proofs' MPI calls up.
            await self._confirm(comm, rt, key, proofs)
            if self.closed:
                raise TransferError("transport closed")
            self._register(key, comm, reader, writer, rt)
            comm = None
            self._accept_turns.forgive(source)
            writer.write(wire.frame(wire.READY))
            await writer.drain()
        except (Exception, asyncio.CancelledError) as exc:
            # Before the peer channel vouched for it: the key is whatever was sent. A
            # timeout and a cut-off frame say nothing by themselves.
            why = str(exc) or (
                f"no whole frame within {HELLO_TIMEOUT_S:g} s"
                if isinstance(exc, (asyncio.TimeoutError, TimeoutError))
                else type(exc).__name__
            )
            # Anyone can repeat this at will: at most 8 lines per 10 s, counting the rest.
            self._refusals.log(
                log,
                logging.WARNING,
                "refused",
                "MPI: refused an incoming connection (peer %s): %s",
                shown(key),
                shown(why, TEXT_LIMIT),
            )
            if key is not None and key in self.peers:
                self.drop_links(self.peers[key], f"rendezvous failed: {exc}", writer)
            if comm is not None:
                # Made but not ours to use: the connecting side hears why.
                with contextlib.suppress(Exception):
                    writer.write(wire.frame(wire.REFUSED, str(exc).encode()[: wire.MAX_FIELD]))
                with contextlib.suppress(Exception):
                    comm.Free()
            writer.close()
            if port is not None:
                with contextlib.suppress(Exception):
                    MPI.Close_port(port)
            if accepting is not None and hand_on is not None:
                if not accepting.future.done():
                    # The turn stays with this accept until it has ended: a stranger's
                    # hellos would each leave a releasing process behind, their
                    # accepts side by side.
                    accepting.release()
                    self._accept_turns.penalize(source)
                accepting.future.add_done_callback(_free_comm)
                accepting.future.add_done_callback(_then(hand_on))
                hand_on = None
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        finally:
            if hand_on is not None:
                hand_on()
        log.info("MPI: peer %s connected to us", shown(key))

    # -- connecting side -----------------------------------------------------

    async def connect(self, rt: Runtime, peer_key: str, address: str, timeout_s: float) -> None:
        """Rendezvous with the peer listening at `address`; ends with an intercommunicator.

        Returns at once when a live link to that peer exists (in either
        direction); concurrent calls for one peer share one rendezvous.
        """
        peer = self.peers.get(peer_key)
        if peer is not None and peer.live_link() is not None:
            return
        pending = self._connecting.get(peer_key)
        if pending is None:
            pending = asyncio.ensure_future(self._connect(rt, peer_key, address, timeout_s))
            self._connecting[peer_key] = pending
            pending.add_done_callback(lambda f: self._connected(peer_key, f))
        # Shielded: one caller giving up must not abandon the others' rendezvous.
        await asyncio.shield(pending)

    def _connected(self, peer_key: str, fut: asyncio.Future[None]) -> None:
        self._connecting.pop(peer_key, None)
        if not fut.cancelled():
            fut.exception()  # retrieved, even when every caller gave up waiting

    async def _connect(self, rt: Runtime, peer_key: str, address: str, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s

        def remaining() -> float:
            return max(deadline - loop.time(), 0.001)

        secret = await self._secrets.for_peer(peer_key, remaining())
        # One connecting rendezvous at a time, from before its hello to its end: MPICH
        # may take the process down when two connects overlap, and a connect made right
        # after the ACK meets the listener's accept inside its window (accepts.py).
        try:
            await asyncio.wait_for(self._connect_turn.acquire(), remaining())
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise connect_timeout("MPI", peer_key, address, "rendezvous", timeout_s) from exc
        counted = crossed = False
        started: list[asyncio.Future[Any]] = []
        try:
            # None of our accepts may wait while we connect, nor start until we are done
            # (quiet.py): the connect would never complete.
            if not await ACCEPTS.quiet_by(deadline):
                raise connect_timeout("MPI", peer_key, address, "rendezvous", timeout_s)
            CONNECTS.enter()
            counted = True
            await self._dial(rt, peer_key, address, secret, deadline, timeout_s, started)
        except _Crossed:
            crossed = True
        finally:

            def end(_: object = None) -> None:
                if counted:
                    CONNECTS.leave()
                self._connect_turn.release()

            if started and not started[0].done():
                # An abandoned MPI_Comm_connect runs on in its thread, MPICH ends it
                # within its connect timeout (bootstrap.py): until then no accept, and
                # no other connect, starts beside it.
                started[0].add_done_callback(end)
            else:
                end()
        if crossed:
            # The peer is linking to us at the same time, and ours gave way: our accept
            # of its rendezvous waited for this one to end (above).
            await self._linked_from(peer_key, deadline)

    async def _dial(
        self,
        rt: Runtime,
        peer_key: str,
        address: str,
        secret: bytes,
        deadline: float,
        timeout_s: float,
        started: list[asyncio.Future[Any]],
    ) -> None:
        """The connecting side's rendezvous (hello, ACK, MPI_Comm_connect, proofs, READY);
        the connect's future is put in `started`."""
        MPI = rt.MPI
        host, port = split_address(address)
        loop = asyncio.get_running_loop()

        def remaining() -> float:
            return max(deadline - loop.time(), 0.001)

        with connect_failures("MPI", peer_key, address, timeout_s):
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), remaining()
            )
        connecting: asyncio.Future[Any] | None = None
        try:
            nonce_c = secrets.token_bytes(NONCE_BYTES)
            writer.write(wire.frame(wire.HELLO, self.key.encode(), nonce_c))
            await writer.drain()
            try:
                raw_key, raw_port, nonce_l = await asyncio.wait_for(
                    wire.read_frame(reader, wire.ACK, ("key", "port", "nonce")), remaining()
                )
            except wire.RefusedError as exc:
                if CROSSING not in str(exc):
                    raise
                if not str(exc).endswith(f"{CROSSING} ({peer_key})"):
                    # Another incarnation than the one we dial (it restarted): it is
                    # linking to us, but that is not the link asked for.
                    raise PeerLostError(
                        f"MPI: {address} is not {peer_key} (the peer restarted or the "
                        f"address was reused): {exc}"
                    ) from None
                raise _Crossed() from None
            got = raw_key.decode()
            if got != peer_key:
                raise PeerLostError(
                    f"MPI: {address} is {got}, not {peer_key} (the peer restarted or the "
                    "address was reused)"
                )
            port_name = raw_port.decode()
            connecting = in_thread(lambda: MPI.COMM_SELF.Connect(port_name), "kvxferd-mpi-connect")
            started.append(connecting)
            done, _ = await asyncio.wait({connecting}, timeout=remaining())
            if not done:
                raise asyncio.TimeoutError()
            comm = connecting.result()
            connecting = None
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            try:
                proofs = Proofs(_LABEL, secret, nonce_l, nonce_c, listening=False)
                await self._confirm(comm, rt, peer_key, proofs, remaining())
                await asyncio.wait_for(wire.read_frame(reader, wire.READY), remaining())
            except BaseException:
                with contextlib.suppress(Exception):
                    comm.Free()
                raise
        except BaseException as exc:
            writer.close()
            if connecting is not None:
                # Finishes later (MPICH bounds it): free what it makes.
                connecting.add_done_callback(_free_comm)
            if isinstance(exc, _Crossed):
                raise
            if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
                raise connect_timeout("MPI", peer_key, address, "rendezvous", timeout_s) from exc
            if isinstance(exc, asyncio.IncompleteReadError | ConnectionError):
                raise PeerLostError(
                    f"MPI connect to {peer_key} at {address}: the peer closed the rendezvous"
                ) from exc
            if isinstance(exc, Exception) and not isinstance(exc, TransferError):
                raise TransferError(
                    f"MPI connect to {peer_key} at {address} failed ({type(exc).__name__}: {exc})"
                ) from exc
            raise
        if self.closed:
            writer.close()
            with contextlib.suppress(Exception):
                comm.Free()
            raise TransferError(f"MPI transport {self.key} is closed")
        self._register(peer_key, comm, reader, writer, rt)

    async def _linked_from(self, peer_key: str, deadline: float) -> None:
        """Wait for the link `peer_key` makes to us (its rendezvous and ours crossed)."""
        loop = asyncio.get_running_loop()
        while True:
            peer = self.peers.get(peer_key)
            if peer is not None and peer.live_link() is not None:
                return
            if loop.time() >= deadline or self.closed:
                raise TransferError(
                    f"MPI connect to {peer_key}: it was linking to us at the same time, "
                    "and its link did not come"
                )
            await asyncio.sleep(0.01)

    def _crossing_reason(self) -> bytes:
        """The REFUSED of a crossing hello, naming us: the other side checks that we are
        the daemon it dials (a restarted one is not)."""
        return f"{CROSSING} ({self.key})".encode()[: wire.MAX_FIELD]

    def _crossing(self, key: str) -> bool:
        """Our rendezvous to `key` is under way beside its rendezvous to us, and ours
        goes on (the larger key's): its hello is refused, and it waits for our link.
        Without this, each side's accept waited for its own connect, which waited for
        the other's accept, until both gave up."""
        return key in self._connecting and self.key > key

    async def _confirm(
        self,
        comm: Any,
        rt: Runtime,
        expected: str,
        proofs: Proofs,
        timeout_s: float = IDENTITY_TIMEOUT_S,
    ) -> None:
        """Both ways over `comm`: our key and proof out, `expected`'s in (identity.py)."""
        timeout_s = min(timeout_s, IDENTITY_TIMEOUT_S)
        await in_thread(
            lambda: swap_identities(comm, rt.MPI, self.key, expected, proofs, timeout_s),
            "kvxferd-mpi-identity",
        )

    # -- links ---------------------------------------------------------------

    def _register(
        self,
        key: str,
        comm: Any,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        rt: Runtime,
    ) -> None:
        peer = self.peers.get(key)
        if peer is None:
            peer = self.peers[key] = Peer(key)
        # Lost links stay only while headers that came over them wait for a recv.
        waiting = {id(entry[0]) for queue in peer.pending.values() for entry in queue}
        peer.links = [x for x in peer.links if x.lost is None or id(x) in waiting]
        link = Link(comm, writer, rt.tag_ub)
        peer.links.append(link)
        link.watcher = asyncio.ensure_future(self._watch(peer, link, reader))
        self._on_link()

    async def _watch(self, peer: Peer, link: Link, reader: asyncio.StreamReader) -> None:
        """Read the peer's end of the connection: GAVE_UP or its end marks the link lost;
        its end (EOF) also marks it finished (see the module docstring)."""
        extra = 0
        try:
            while data := await reader.read(64):
                rest = data.lstrip(wire.ALIVE) if extra == 0 else data
                alive = len(data) - len(rest)
                if alive and not keepalive.heard_tcp(link, time.monotonic(), alive):
                    rest = data  # more than a kvxferd peer sends: data, not keepalives
                if not rest:
                    continue
                if rest[:1] == wire.GAVE_UP and extra == 0:
                    self._lost(peer, link, "the peer gave the link up")
                else:
                    self._lost(peer, link, "the peer sent data on the MPI rendezvous connection")
                extra += len(rest)
                if extra > _MAX_AFTER_LINK:
                    # Not a kvxferd peer: what it does with MPI is unknown, so unfinished.
                    link.writer.close()
                    return
        except ConnectionResetError:
            # Its end too: a process that dies with bytes unread (our GAVE_UP, when it was
            # stopped) is reset rather than closed; a live kvxferd peer resets only once
            # done with the link's MPI (it then has nothing pending).
            self._lost(peer, link, "the peer reset the connection (died, or closed)")
        except OSError as exc:
            # Not its end (a timeout, an unreachable host): whether its MPI still sends
            # cannot be told, so the link is never finished.
            self._lost(peer, link, f"the connection to the peer failed ({exc})")
            link.writer.close()
            return
        except asyncio.CancelledError:
            return
        else:
            self._lost(peer, link, "the peer closed the connection (exited, died, or removed us)")
        link.peer_ended()
        self._on_finished(link)

    def _lost(self, peer: Peer, link: Link, reason: str) -> None:
        if link.lost is None:
            link.lost = reason
            log.info("MPI: link to %s lost: %s", shown(peer.key), shown(reason, TEXT_LIMIT))
        link.give_up()

    def drop_links(self, peer: Peer, reason: str, writer: Any = None) -> None:
        """Give the peer's links up (only the one over `writer`, if given): tells the peer.
        Their watchers go on reading, to learn when nothing more can come over them."""
        for link in peer.links:
            if writer is not None and link.writer is not writer:
                continue
            if link.lost is None:
                link.lost = reason
            link.give_up()
            if link.header_req is not None:
                # Unmatched: cancelled at once. Matched: its header lands in our
                # own buffer; either way nobody waits for it (housekeeping.py's
                # pump completes it and reads nothing).
                link.header_cancelled = True
                self._cancel_when_quiet(link.header_req)

    def _cancel_when_quiet(self, req: Any) -> None:
        """MPI_Cancel `req` now, or once no accept waits (quiet.py): beside one the call
        would hold the event loop up (remove_peer did, 3.2 s)."""
        if not ACCEPTS.count:
            with contextlib.suppress(Exception):
                req.Cancel()
            return

        async def later() -> None:
            await ACCEPTS.quiet()
            with contextlib.suppress(Exception):  # completed meanwhile: nothing to cancel
                req.Cancel()

        task = asyncio.ensure_future(later())
        self._later.add(task)
        task.add_done_callback(self._later.discard)

    def peer(self, peer_key: str) -> Peer:
        peer = self.peers.get(peer_key)
        if peer is None:
            raise PeerLostError(
                f"MPI: no link to peer {peer_key}: it never connected (or its rendezvous "
                "has not finished yet), or it was removed"
            )
        return peer

    def live_keys(self) -> list[str]:
        """Keys of the peers with at least one live link."""
        return [k for k, p in self.peers.items() if p.live_link() is not None]

    def remove(self, peer_key: str) -> None:
        """Forget that peer and close its links."""
        peer = self.peers.pop(peer_key, None)
        if peer is not None:
            self.drop_links(peer, "the peer was removed")

    # -- teardown ------------------------------------------------------------

    def close(self) -> None:
        """Stop listening and abandon rendezvous in progress; links stay (drop_all)."""
        self.closed = True
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._handshakes):
            task.cancel()

    def drop_all(self, reason: str) -> None:
        """Give every link up and stop watching them (the transport is closing)."""
        for key in list(self.peers):
            peer = self.peers.pop(key)
            self.drop_links(peer, reason)
            for link in peer.links:
                if link.watcher is not None:
                    link.watcher.cancel()
                if not link.pending:
                    link.writer.close()
