"""A small HTTP/1.1 endpoint for health, status and metrics (loopback by default).

/healthz: the process and its event loop answer (served by that loop, so an
answer is the proof), and nothing it cannot recover from without a restart holds
it (503: a transport stall longer than daemon.stall_unhealthy_s). /readyz: 200 only
once the data plane, peer listener and engine API are up, and not while draining; its
body says discovery's state too, which does not change the status code (an etcd outage
must not take every pod out at once).
/v1/status: JSON status. /metrics: Prometheus text format. Kept dependency-free; each
response closes the connection.
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

# Limits on what a client may send before it is answered (nothing here needs more): one
# line (the request line or a header) of 8 KiB, 64 header lines, 32 KiB of head in all, and
# the whole head within 10 s, however slowly it trickles in.
_MAX_LINE = 8192
_MAX_HEADERS = 64
_MAX_HEAD_BYTES = 32768
_HEAD_DEADLINE_S = 10.0

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    414: "URI Too Long",
    431: "Request Header Fields Too Large",
    503: "Unavailable",
}


class _Refused(Exception):
    """The request head broke a limit: answer `code` and close."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


async def _line(reader: asyncio.StreamReader, too_long: int) -> bytes:
    try:
        return await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise _Refused(too_long, "line too long") from None
    except asyncio.IncompleteReadError as exc:
        return exc.partial  # the client closed: whatever came is the last line


async def _read_head(reader: asyncio.StreamReader) -> list[str]:
    """The request line's words; headers are read (within the limits) and ignored:
    nothing here depends on them."""
    line = await _line(reader, 414)
    parts = line.decode("latin-1").split()
    total = len(line)
    for _ in range(_MAX_HEADERS + 1):
        header = await _line(reader, 431)
        total += len(header)
        if total > _MAX_HEAD_BYTES:
            raise _Refused(431, "request head too large")
        if header in (b"\r\n", b"\n", b""):
            return parts
    raise _Refused(431, "too many header lines")


class StatusSource(Protocol):
    @property
    def ready(self) -> bool: ...

    def status(self) -> dict[str, object]: ...

    def readiness_detail(self) -> str:
        """Lines after /readyz's first (stalled peers, discovery's state); '' for none."""
        ...

    def health_problem(self) -> str | None:
        """Why /healthz answers 503 (lines after `unhealthy`), or None for 200."""
        ...


class HttpServer:
    def __init__(self, source: StatusSource, metrics: Callable[[], bytes] | None = None) -> None:
        self._source = source
        self._metrics = metrics
        self._server: asyncio.base_events.Server | None = None
        self.address = ""

    async def start(self, host: str, port: int) -> str:
        try:
            # The stream limit is the longest line readuntil accepts.
            self._server = await asyncio.start_server(self._serve, host, port, limit=_MAX_LINE)
        except OSError as exc:
            raise StartupError(f"cannot serve HTTP on {host}:{port}: {exc}") from exc
        sock = self._server.sockets[0].getsockname()
        self.address = f"{sock[0]}:{sock[1]}"
        return self.address

    def route(self, path: str) -> tuple[int, str, bytes]:
        if path == "/healthz":
            problem = self._source.health_problem()
            if problem is None:
                return 200, "text/plain", b"ok\n"
            return 503, "text/plain", b"unhealthy\n" + problem.encode() + b"\n"
        if path == "/readyz":
            detail = self._source.readiness_detail().encode()
            if self._source.ready:
                return 200, "text/plain", b"ready\n" + detail
            return 503, "text/plain", b"not ready\n" + detail
        if path == "/v1/status":
            body = json.dumps(self._source.status(), indent=2).encode() + b"\n"
            return 200, "application/json", body
        if path == "/metrics" and self._metrics is not None:
            return 200, "text/plain; version=0.0.4; charset=utf-8", self._metrics()
        return 404, "text/plain", b"not found\n"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        parts: list[str] = []
        try:
            try:
                parts = await asyncio.wait_for(_read_head(reader), _HEAD_DEADLINE_S)
            except asyncio.TimeoutError:
                raise _Refused(408, "request head not complete in time") from None
            if len(parts) < 2:
                code, ctype, body = 400, "text/plain", b"bad request line\n"
            elif parts[0] not in ("GET", "HEAD"):
                code, ctype, body = 405, "text/plain", b"only GET\n"
            else:
                code, ctype, body = self.route(parts[1].split("?", 1)[0])
        except _Refused as refused:
            code, ctype, body = refused.code, "text/plain", f"{refused}\n".encode()
        try:
            head = (
                f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            writer.write(head + (body if not parts or parts[0] != "HEAD" else b""))
            await asyncio.wait_for(writer.drain(), _HEAD_DEADLINE_S)
        except (asyncio.TimeoutError, ConnectionError, OSError):
            pass  # the client went away or does not read: nothing more to do for it
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
