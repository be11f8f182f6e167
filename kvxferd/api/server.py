"""The engine-facing API on a Unix socket (mode 0600).

Each engine connection is an EngineLink: calls are answered in order with a
Reply; outcomes are pushed as they happen. A malformed call gets a clear error
Reply and leaves the connection, the daemon and every other request untouched;
only an unreadable frame (the stream cannot be resynchronised) closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable
from typing import Protocol

import msgspec

from kvxferd import PROTOCOL_VERSION
from kvxferd.api.handoff import (
    FIRST_FRAME_TIMEOUT_S,
    HANDOFF_KINDS,
    FirstFrame,
    HandoffError,
    HandoffTable,
    PeerCred,
    close_fds,
    peer_cred,
    read_first_frame,
)
from kvxferd.api.messages import (
    DAEMON_CODEC,
    ENGINE_CODEC,
    ApiError,
    Cancel,
    ConnectionState,
    DaemonHello,
    EngineHello,
    EngineMessage,
    PoolHandoff,
    ReleasedMsg,
    Reply,
)
from kvxferd.errors import MalformedMessageError, ProtocolError, RequestError, StartupError
from kvxferd.memory.memfd import MemfdError, UnsealedMemfdError, check_memfd
from kvxferd.peers import process
from kvxferd.peers.framing import CorkedWriter
from kvxferd.service.logs import TEXT_LIMIT, LogLimiter, shown
from kvxferd.transceiver.state import Outcome

log = logging.getLogger("kvxferd.api")


class _CallIdOnly(msgspec.Struct):
    """What a malformed call may still say: its id (anything else is ignored)."""

    call_id: int = -1


_CALL_ID = msgspec.msgpack.Decoder(_CallIdOnly)


def _call_id_of(body: bytes) -> int:
    """The call id of a frame that did not decode as a call; -1 if it has none."""
    try:
        return _CALL_ID.decode(body).call_id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return -1


class EngineConnection:
    """One engine attached to the daemon; implements the EngineLink protocol."""

    def __init__(self, writer: asyncio.StreamWriter, name: str, connection_id: int = 0) -> None:
        # Its number in this daemon process (DaemonHello.connection, ConnectionState).
        self.connection_id = connection_id
        # A label the engine chose: escaped and bounded once, here, since it goes into
        # log lines and outcome messages.
        self.name = shown(name, quote=False)
        self.peer: PeerCred | None = None  # SO_PEERCRED of the engine process (pool handoffs)
        # Replies and outcomes leave a loop turn after what the daemon writes to its peers
        # in the same turns: the context daemon's Result (which the generation side waits
        # for) goes before the reply to the send that started it, and the reply then goes
        # with the outcome in one write. At one request in flight every write wakes a
        # sleeping process, which costs the writer ~60-200 us on a small VM.
        self._out = CorkedWriter(writer, yield_turns=1)
        # Nothing more can be written to it (a failed write sets it before the end: calls
        # already read are still served).
        self.closed = False
        # Served no more: the server read its last call (set before engine_gone).
        self.ended = False
        # engine_gone ended every request it made.
        self.requests_ended = False
        # Sees every outcome exactly once, delivered or not (the daemon's metrics).
        self.on_outcome: Callable[[Outcome], None] | None = None
        # Ended, and nothing it started can touch its memory any more (settle()).
        self.settled = False
        self.on_settled: Callable[[EngineConnection], None] | None = None

    def settle(self) -> None:
        """The daemon let go of everything this ended connection started: its requests
        ended and its pools are deregistered (ConnectionState "gone")."""
        if self.ended and self.requests_ended and not self.settled:
            self.settled = True
            if self.on_settled is not None:
                self.on_settled(self)

    def _write(self, msg: object) -> None:
        if self.closed:
            return
        try:
            self._out.write(DAEMON_CODEC.encode(msg))
        except (ConnectionError, OSError, RuntimeError):
            self.closed = True

    def deliver(self, outcome: Outcome) -> None:
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        self._write(outcome)

    def released(
        self, request_id: str, side: str, how: str, held_ms: float, peer: str = ""
    ) -> None:
        self._write(
            ReleasedMsg(request_id=request_id, side=side, how=how, held_ms=held_ms, peer=peer)
        )

    def reply(self, call_id: int, result: str = "") -> None:
        self._write(Reply(call_id=call_id, ok=True, result=result))

    def error(self, call_id: int, code: str, message: str) -> None:
        self._write(Reply(call_id=call_id, ok=False, error=code, message=message))

    async def drain(self) -> None:
        if not self.closed:
            try:
                await self._out.drain()
            except (ConnectionError, OSError):
                self.closed = True

    def flush(self) -> None:
        self._out.flush()


def _close_quietly(conn: socket.socket) -> None:
    """Close a refused connection so that its answer arrives: a Unix socket closed with
    unread input resets the peer (ECONNRESET), so what is already there is read away first
    (never waiting; any fds in it are dropped, and closed, by the kernel)."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        for _ in range(16):
            if not conn.recv(1 << 16):
                break
    conn.close()


class EngineHandler(Protocol):
    @property
    def daemon_name(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def tokens_per_block(self) -> int: ...

    async def handle_call(self, engine: EngineConnection, msg: EngineMessage) -> str: ...

    async def engine_gone(self, engine: EngineConnection) -> None: ...


class ApiServer:
    """Accepts connections itself (not asyncio.start_unix_server): the first frame of each is
    read with recvmsg on the raw socket, so that a pool handoff's fd (SCM_RIGHTS) is not lost
    to the streams' recv(). An engine connection (hello) is then wrapped in streams."""

    def __init__(
        self,
        path: str,
        handler: EngineHandler,
        first_frame_timeout_s: float = FIRST_FRAME_TIMEOUT_S,
    ) -> None:
        self.path = path
        self._handler = handler
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self.first_frame_timeout_s = first_frame_timeout_s
        self.handoffs = HandoffTable()
        self.engines: set[EngineConnection] = set()
        # Open connections and closed ones not settled yet, by number (ConnectionState).
        self._by_number: dict[int, EngineConnection] = {}
        self._last_number = 0  # the last number given out (they count up from 1)
        self._conn_tasks: set[asyncio.Task[None]] = set()
        self.on_engine_count: Callable[[int], Awaitable[None]] | None = None
        self.on_outcome: Callable[[Outcome], None] | None = None
        # An engine can repeat a bad call (or a bad connection) as fast as it likes: a few
        # lines per engine connection (per process before the hello) and a count.
        self.log_limiter = LogLimiter(interval_s=10.0, burst=3)
        # Told of each engine call that did not decode (metrics).
        self.on_malformed: Callable[[ProtocolError], None] | None = None

    async def start(self) -> None:
        if os.path.exists(self.path):
            if not stat.S_ISSOCK(os.stat(self.path).st_mode):
                raise StartupError(f"engine API socket path {self.path} exists and is not a socket")
            if await self._is_live():
                raise StartupError(
                    f"another daemon is serving the engine API at {self.path}; "
                    "stop it or choose another daemon.api_socket"
                )
            os.unlink(self.path)  # stale socket of a daemon that died
        parent = os.path.dirname(self.path) or "."
        os.makedirs(parent, exist_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others connect
        try:
            listener.bind(self.path)
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise StartupError(f"cannot create engine API socket {self.path}: {exc}") from exc
        finally:
            os.umask(old_umask)
        listener.setblocking(False)
        self._listener = listener
        os.chmod(self.path, 0o600)
        self._accept_task = asyncio.create_task(self._accept_loop())

    async def _is_live(self) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), 1.0)
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        return True

    async def _accept_loop(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                # EMFILE, ENFILE, ENOBUFS: keep serving the connections we have, retry soon.
                log.error("engine API: cannot accept a connection: %s", exc)
                await asyncio.sleep(0.5)
                continue
            conn.setblocking(False)
            task = asyncio.create_task(self._serve_socket(conn))
            self._conn_tasks.add(task)
            task.add_done_callback(self._conn_tasks.discard)

    async def _refuse_first(self, conn: socket.socket, message: str) -> None:
        """Answer a connection's unacceptable first frame (bad_request); the caller closes."""
        await self._send_raw(
            conn, Reply(call_id=0, ok=False, error=ApiError.BAD_REQUEST, message=message)
        )

    async def _send_raw(self, conn: socket.socket, msg: object) -> None:
        """Best effort: one frame on a connection not (yet) wrapped in streams."""
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.get_running_loop().sock_sendall(conn, DAEMON_CODEC.encode(msg)), 1.0
            )

    async def _serve_socket(self, conn: socket.socket) -> None:
        cred = peer_cred(conn)
        handed_over = False  # the socket belongs to the stream transport from then on
        try:
            try:
                first = await read_first_frame(conn, self.first_frame_timeout_s)
            except ProtocolError as exc:
                self._refused_log(cred, exc)
                await self._send_raw(
                    conn, Reply(call_id=0, ok=False, error=ApiError.BAD_REQUEST, message=str(exc))
                )
                return
            if first is None:
                return  # closed without a word (a liveness probe)
            try:
                msg = ENGINE_CODEC.decode(first.body)
            except MalformedMessageError as exc:
                close_fds(first.fds)
                self._refused_log(cred, exc)
                await self._send_raw(
                    conn, Reply(call_id=0, ok=False, error=ApiError.BAD_REQUEST, message=str(exc))
                )
                return
            if isinstance(msg, PoolHandoff):
                await self._handoff(conn, msg, first, cred)
                return
            if first.fds or first.fds_truncated:
                close_fds(first.fds)
                await self._refuse_first(
                    conn,
                    "file descriptors are accepted only with a pool_handoff, "
                    "as the first frame of its own connection",
                )
                return
            if not isinstance(msg, EngineHello):
                self._refused_log(cred, "no hello")
                await self._refuse_first(
                    conn,
                    f"the first engine message must be hello (or pool_handoff, on "
                    f"its own connection), not {type(msg).__name__}",
                )
                return
            reader, writer = await asyncio.open_unix_connection(sock=conn)
            handed_over = True
        except (ConnectionError, OSError):
            return
        except asyncio.CancelledError:
            return  # close() at shutdown; this task is the root of its own stack
        finally:
            if not handed_over:
                _close_quietly(conn)
        await self._serve(msg, reader, writer, cred)

    def _refused_log(self, cred: PeerCred | None, why: object) -> None:
        """One engine API connection closed at its first frame, logged within the rate of
        its process (a client can open connections in a loop)."""
        self.log_limiter.log(
            log,
            logging.WARNING,
            ("first frame", cred.pid if cred is not None else None),
            "engine API connection from %s closed: %s",
            cred or "?",
            shown(why, TEXT_LIMIT),
        )

    async def _handoff(
        self, conn: socket.socket, msg: PoolHandoff, first: FirstFrame, cred: PeerCred | None
    ) -> None:
        fds = first.fds
        try:
            if msg.version != PROTOCOL_VERSION:
                raise HandoffError(
                    ApiError.VERSION,
                    f"engine API version {msg.version}, daemon speaks {PROTOCOL_VERSION}",
                )
            if len(fds) > 1 or first.fds_truncated:
                more = " or more" if first.fds_truncated else ""
                raise HandoffError(
                    ApiError.BAD_REQUEST,
                    f"pool {msg.pool_id!r}: the handoff carries {len(fds)}{more} file "
                    "descriptors; send exactly one, the pool's memfd",
                )
            if not fds:
                raise HandoffError(
                    ApiError.BAD_REQUEST,
                    f"pool {msg.pool_id!r}: the handoff carries no file descriptor; send the "
                    "memfd as SCM_RIGHTS in the same sendmsg as the frame (socket.send_fds)",
                )
            if msg.nbytes <= 0:
                raise HandoffError(
                    ApiError.BAD_REQUEST, f"pool {msg.pool_id!r}: nbytes must be positive"
                )
            if msg.kind not in HANDOFF_KINDS:
                raise HandoffError(
                    ApiError.BAD_REQUEST,
                    f"pool {msg.pool_id!r}: unknown handoff kind {shown(msg.kind, 40)} "
                    f"(known: {', '.join(HANDOFF_KINDS)})",
                )
            if msg.kind == "memfd":
                try:
                    check_memfd(fds[0], msg.nbytes, f"pool {msg.pool_id!r}")
                except UnsealedMemfdError as exc:
                    raise HandoffError(ApiError.UNSEALED_POOL, str(exc)) from exc
                except MemfdError as exc:
                    raise HandoffError(ApiError.BAD_REQUEST, str(exc)) from exc
            # A VMM fd has no seals and no size the kernel knows: the CUDA driver checks it
            # when the daemon imports it at RegisterPool, where a bad one is refused.
            token = self.handoffs.put(fds[0], cred, msg.pool_id, msg.nbytes, msg.kind)
            fds.clear()  # the table owns it now
        except HandoffError as exc:
            self.log_limiter.log(
                log,
                logging.WARNING,
                ("handoff", cred.pid if cred is not None else None),
                "pool handoff from %s refused: %s",
                cred or "?",
                shown(exc, TEXT_LIMIT),
            )
            await self._send_raw(
                conn, Reply(call_id=msg.call_id, ok=False, error=exc.code, message=str(exc))
            )
            return
        finally:
            close_fds(fds)
        log.info(
            "pool %s handed over as %s by %s (%d bytes)",
            shown(msg.pool_id),
            HANDOFF_KINDS[msg.kind],
            cred or "?",
            msg.nbytes,
        )
        await self._send_raw(conn, Reply(call_id=msg.call_id, ok=True, result=token))

    def take_handoff(
        self, token: str, engine: EngineConnection, pool_id: str, kind: str = "memfd"
    ) -> int:
        """The fd handed over under `token` as `kind`, now the caller's to close;
        RequestError if the token is unknown, expired, used, for another pool, from another
        process, or of another kind."""
        try:
            fd, _ = self.handoffs.take(token, engine.peer, pool_id, kind)
        except HandoffError as exc:
            raise RequestError(exc.code, str(exc)) from exc
        return fd

    async def _malformed(self, engine: EngineConnection, exc: MalformedMessageError) -> None:
        """A frame whose body does not decode. Its boundary held, so the stream goes on; the
        call it was fails at once on the caller's side when its id can still be read."""
        if self.on_malformed is not None:
            self.on_malformed(exc)
        self.log_limiter.log(
            log,
            logging.WARNING,
            ("malformed", id(engine)),
            "engine %r sent a malformed call: %s",
            engine.name,
            shown(exc, TEXT_LIMIT),
        )
        engine.error(_call_id_of(exc.body), ApiError.BAD_REQUEST, str(exc))
        await engine.drain()

    async def _serve(
        self,
        hello: EngineHello,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        cred: PeerCred | None,
    ) -> None:
        engine: EngineConnection | None = None
        try:
            if hello.version != PROTOCOL_VERSION:
                writer.write(
                    DAEMON_CODEC.encode(
                        Reply(
                            call_id=0,
                            ok=False,
                            error=ApiError.VERSION,
                            message=f"engine API version {hello.version}, "
                            f"daemon speaks {PROTOCOL_VERSION}",
                        )
                    )
                )
                await writer.drain()
                return
            self._last_number += 1
            engine = EngineConnection(writer, hello.engine or "engine", self._last_number)
            engine.peer = cred
            engine.on_outcome = self.on_outcome
            engine.on_settled = self._settled
            self.engines.add(engine)
            self._by_number[engine.connection_id] = engine
            writer.write(
                DAEMON_CODEC.encode(
                    DaemonHello(
                        version=PROTOCOL_VERSION,
                        daemon=self._handler.daemon_name,
                        role=self._handler.role,
                        tokens_per_block=self._handler.tokens_per_block,
                        process=process.me(),
                        connection=engine.connection_id,
                    )
                )
            )
            log.info("engine %r attached", engine.name)
            frames = ENGINE_CODEC.frames(reader)
            while (bodies := await frames.read()) is not None:
                for body in bodies:
                    try:
                        msg = ENGINE_CODEC.decode(body)
                    except MalformedMessageError as exc:
                        await self._malformed(engine, exc)
                        continue
                    await self._dispatch(engine, msg)
        except ProtocolError as exc:
            if self.on_malformed is not None:
                self.on_malformed(exc)  # a frame that broke the stream (oversize, cut short)
            log.warning(
                "engine %r: connection closed: %s",
                engine.name if engine is not None else "?",
                shown(exc, TEXT_LIMIT),
            )
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            # close() at shutdown. Not re-raised: this task is the root of its own
            # stack, and asyncio's stream callback logs a cancelled one as an error.
            pass
        finally:
            if engine is not None:
                engine.flush()
                engine.closed = engine.ended = True
                self.engines.discard(engine)
                unlogged = self.log_limiter.forget(("malformed", id(engine)))
                log.info(
                    "engine %r detached%s",
                    engine.name,
                    f" ({unlogged} malformed call(s) not logged)" if unlogged else "",
                )
                await self._handler.engine_gone(engine)
            with contextlib.suppress(Exception):
                writer.close()

    async def _dispatch(self, engine: EngineConnection, msg: EngineMessage) -> None:
        if isinstance(msg, PoolHandoff):
            # Its fd would have been dropped by the stream's recv() (the kernel closes it).
            engine.error(
                msg.call_id,
                ApiError.BAD_REQUEST,
                "a pool handoff is the first frame of its own connection, with the memfd as "
                "SCM_RIGHTS in the same sendmsg (kvxferd.client does it)",
            )
            await engine.drain()
            return
        if isinstance(msg, ConnectionState):
            try:
                engine.reply(msg.call_id, self.connection_state(msg.connection))
            except RequestError as exc:
                engine.error(msg.call_id, exc.code, str(exc))
            await engine.drain()
            return
        if isinstance(msg, Cancel):
            # A cancel may wait for the peer's answer; other calls must not queue behind it.
            task = asyncio.create_task(self._answer(engine, msg))
            self._conn_tasks.add(task)
            task.add_done_callback(self._conn_tasks.discard)
        else:
            await self._answer(engine, msg)

    def _settled(self, engine: EngineConnection) -> None:
        self._by_number.pop(engine.connection_id, None)

    def connection_state(self, number: int) -> str:
        """ConnectionState's answer for engine connection `number`."""
        if not 0 < number <= self._last_number:
            raise RequestError(
                ApiError.BAD_REQUEST,
                f"no engine connection {number} was opened on this daemon process "
                f"(the last was {self._last_number}); a daemon restarted since is another "
                "process, and numbers its connections anew",
            )
        engine = self._by_number.get(number)
        if engine is None:
            return "gone"
        return "closing" if engine.ended else "live"

    async def _answer(self, engine: EngineConnection, msg: EngineMessage) -> None:
        call_id = getattr(msg, "call_id", 0)
        try:
            result = await self._handler.handle_call(engine, msg)
        except RequestError as exc:
            engine.error(call_id, exc.code, str(exc))
        else:
            engine.reply(call_id, result)
        await engine.drain()

    async def close(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            await asyncio.gather(self._accept_task, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
        self.handoffs.close_all()
        for task in list(self._conn_tasks):
            task.cancel()
        if self._conn_tasks:
            await asyncio.gather(*self._conn_tasks, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
