"""The daemon's HTTP port against clients that break the rules (issue 14): an over-long
request line, too many or too large headers, a head that trickles in, garbage. Each gets a
status code (414, 431, 408, 400/405) and a closed connection, never a traceback, and the
daemon goes on answering."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from ops_harness import http_get

from kvxferd.sim.cluster import DaemonProc, LocalCluster


def _exchange(
    address: str, chunks: list[bytes], pause_s: float = 0.0, timeout_s: float = 30.0
) -> bytes:
    """Send `chunks` (pausing between them), then read the answer until the server closes."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed before we were done
            if pause_s:
                time.sleep(pause_s)
        got = b""
        while True:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            got += data
    return got


def _status(answer: bytes) -> int:
    first = answer.split(b"\r\n", 1)[0].split()
    assert len(first) >= 2 and first[0] == b"HTTP/1.1", answer[:200]
    return int(first[1])


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProc]:
    cluster = LocalCluster(tmp_path_factory.mktemp("http"))
    d = cluster.start_daemon("ctx", "context")
    yield d
    assert d.stop() == 0


def _still_serves(d: DaemonProc) -> None:
    code, _, body = http_get(d, "/healthz")
    assert (code, body.strip()) == (200, "ok")


def test_an_over_long_request_line_is_414(daemon: DaemonProc) -> None:
    answer = _exchange(daemon.http_address, [b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n"])
    assert _status(answer) == 414
    _still_serves(daemon)


@pytest.mark.parametrize(
    "headers",
    [
        [b"X-Long: " + b"b" * 9000 + b"\r\n"],  # one line over the limit
        [b"X-%d: v\r\n" % i for i in range(200)],  # too many lines
        [b"X-%d: " % i + b"c" * 4000 + b"\r\n" for i in range(12)],  # too much in all
    ],
    ids=["long-line", "many-lines", "large-head"],
)
def test_too_large_headers_are_431(daemon: DaemonProc, headers: list[bytes]) -> None:
    answer = _exchange(daemon.http_address, [b"GET /healthz HTTP/1.1\r\n", *headers, b"\r\n"])
    assert _status(answer) == 431
    _still_serves(daemon)


def test_a_head_that_trickles_in_is_cut_off_with_408(daemon: DaemonProc) -> None:
    """One header line a second never finishes the head: the daemon answers 408 once the
    head's deadline (10 s) has passed, whatever each line's own pace."""
    lines = [b"GET /healthz HTTP/1.1\r\n"] + [b"X-%d: v\r\n" % i for i in range(30)]
    start = time.monotonic()
    answer = _exchange(daemon.http_address, lines, pause_s=1.0)
    assert _status(answer) == 408
    assert time.monotonic() - start < 25  # cut off, not served to the end of the drip
    _still_serves(daemon)


@pytest.mark.parametrize(
    ("request_bytes", "code"),
    [
        (b"\x00\xff\xfe garbage\r\n\r\n", 405),
        (b"\r\n\r\n", 400),
        (b"POST /v1/status HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 405),
    ],
    ids=["binary", "empty-line", "post"],
)
def test_garbage_gets_a_status_not_a_traceback(
    daemon: DaemonProc, request_bytes: bytes, code: int
) -> None:
    assert _status(_exchange(daemon.http_address, [request_bytes])) == code
    _still_serves(daemon)
    assert "Traceback" not in daemon.log_text()
