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
import stat
from collections.abc import Awaitable, Callable
from typing import Protocol

from kvxferd import PROTOCOL_VERSION
from kvxferd.api.messages import (
    DAEMON_CODEC,
    ENGINE_CODEC,
    ApiError,
    Cancel,
    DaemonHello,
    EngineHello,
    EngineMessage,
    OutcomeMsg,
    Reply,
)
from kvxferd.errors import MalformedMessageError, ProtocolError, RequestError, StartupError
from kvxferd.peers.framing import CorkedWriter
from kvxferd.transceiver.state import Outcome

log = logging.getLogger("kvxferd.api")


class EngineConnection:
    """One engine attached to the daemon; implements the EngineLink protocol."""

    def __init__(self, writer: asyncio.StreamWriter, name: str) -> None:
        self.name = name
        self._out = CorkedWriter(writer)
        self.closed = False
        # Sees every outcome exactly once, delivered or not (the daemon's metrics).
        self.on_outcome: Callable[[Outcome], None] | None = None

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
        self._write(
            OutcomeMsg(
                request_id=outcome.request_id,
                side=outcome.side,
                status=outcome.status,
                reason=outcome.reason,
                fault=outcome.fault,
                message=outcome.message,
                nbytes=outcome.nbytes,
                elapsed_ms=outcome.elapsed_ms,
            )
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
    def __init__(self, path: str, handler: EngineHandler) -> None:
        self.path = path
        self._handler = handler
        self._server: asyncio.base_events.Server | None = None
        self.engines: set[EngineConnection] = set()
        self._conn_tasks: set[asyncio.Task[None]] = set()
        self.on_engine_count: Callable[[int], Awaitable[None]] | None = None
        self.on_outcome: Callable[[Outcome], None] | None = None

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
        old_umask = os.umask(0o177)  # the socket is born 0600: no window where others connect
        try:
            self._server = await asyncio.start_unix_server(self._serve, self.path)
        except OSError as exc:
            raise StartupError(f"cannot create engine API socket {self.path}: {exc}") from exc
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    async def _is_live(self) -> bool:
        try:
            _, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), 1.0)
        except (OSError, asyncio.TimeoutError):
            return False
        writer.close()
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conn_tasks.add(task)
        engine: EngineConnection | None = None
        try:
            hello = await ENGINE_CODEC.read(reader)
            if not isinstance(hello, EngineHello):
                raise ProtocolError("the first engine message must be hello")
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
            engine = EngineConnection(writer, hello.engine or "engine")
            engine.on_outcome = self.on_outcome
            self.engines.add(engine)
            writer.write(
                DAEMON_CODEC.encode(
                    DaemonHello(
                        version=PROTOCOL_VERSION,
                        daemon=self._handler.daemon_name,
                        role=self._handler.role,
                        tokens_per_block=self._handler.tokens_per_block,
                    )
                )
            )
            log.info("engine %r attached", engine.name)
            while True:
                try:
                    msg = await ENGINE_CODEC.read(reader)
                except MalformedMessageError as exc:
                    # The frame boundary held, so the stream can go on.
                    log.warning("engine %r sent a malformed call: %s", engine.name, exc)
                    engine.error(-1, ApiError.BAD_REQUEST, str(exc))
                    await engine.drain()
                    continue
                if msg is None:
                    break
                await self._dispatch(engine, msg)
        except ProtocolError as exc:
            log.warning("engine connection closed: %s", exc)
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            # close() at shutdown. Not re-raised: this task is the root of its own
            # stack, and asyncio's stream callback logs a cancelled one as an error.
            pass
        finally:
            if engine is not None:
                engine.flush()
                engine.closed = True
                self.engines.discard(engine)
                log.info("engine %r detached", engine.name)
                await self._handler.engine_gone(engine)
            with contextlib.suppress(Exception):
                writer.close()
            if task is not None:
                self._conn_tasks.discard(task)

    async def _dispatch(self, engine: EngineConnection, msg: EngineMessage) -> None:
        if isinstance(msg, Cancel):
            # A cancel may wait for the peer's answer; other calls must not queue behind it.
            task = asyncio.create_task(self._answer(engine, msg))
            self._conn_tasks.add(task)
            task.add_done_callback(self._conn_tasks.discard)
        else:
            await self._answer(engine, msg)

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
        if self._server is not None:
            self._server.close()
        for task in list(self._conn_tasks):
            task.cancel()
        if self._conn_tasks:
            await asyncio.gather(*self._conn_tasks, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
