"""A small HTTP/1.1 endpoint for health, status and metrics (loopback by default).

/healthz: the process and its event loop answer (served by that loop, so an
answer is the proof). /readyz: 200 only once the data plane, peer listener and
engine API are up, and not while draining. /v1/status: JSON status. /metrics:
Prometheus text format. Kept dependency-free; each response closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Protocol

from kvxferd.errors import StartupError

log = logging.getLogger("kvxferd.http")

_MAX_REQUEST_LINE = 8192


class StatusSource(Protocol):
    ready: bool

    def status(self) -> dict[str, object]: ...


class HttpServer:
    def __init__(self, source: StatusSource, metrics: Callable[[], bytes] | None = None) -> None:
        self._source = source
        self._metrics = metrics
        self._server: asyncio.base_events.Server | None = None
        self.address = ""

    async def start(self, host: str, port: int) -> str:
        try:
            self._server = await asyncio.start_server(self._serve, host, port)
        except OSError as exc:
            raise StartupError(f"cannot serve HTTP on {host}:{port}: {exc}") from exc
        sock = self._server.sockets[0].getsockname()
        self.address = f"{sock[0]}:{sock[1]}"
        return self.address

    def route(self, path: str) -> tuple[int, str, bytes]:
        if path == "/healthz":
            return 200, "text/plain", b"ok\n"
        if path == "/readyz":
            if self._source.ready:
                return 200, "text/plain", b"ready\n"
            return 503, "text/plain", b"not ready\n"
        if path == "/v1/status":
            body = json.dumps(self._source.status(), indent=2).encode() + b"\n"
            return 200, "application/json", body
        if path == "/metrics" and self._metrics is not None:
            return 200, "text/plain; version=0.0.4; charset=utf-8", self._metrics()
        return 404, "text/plain", b"not found\n"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
            parts = line[:_MAX_REQUEST_LINE].decode("latin-1").split()
            # Headers are read and ignored: nothing here depends on them.
            while True:
                header = await asyncio.wait_for(reader.readline(), 5.0)
                if header in (b"\r\n", b"\n", b""):
                    break
            if len(parts) < 2 or parts[0] not in ("GET", "HEAD"):
                code, ctype, body = 405, "text/plain", b"only GET\n"
            else:
                code, ctype, body = self.route(parts[1].split("?", 1)[0])
            reason = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Unavailable"}
            head = (
                f"HTTP/1.1 {code} {reason.get(code, '')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            writer.write(head + (body if parts and parts[0] != "HEAD" else b""))
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError, OSError, UnicodeDecodeError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
