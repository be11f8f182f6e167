"""Log hygiene (issue 14): strings from engines and peers reach a log line escaped and
truncated (`shown`), every formatted message is bounded once more, and a failure one
source repeats at will is rate-limited (`LogLimiter`).

The unit tests drive the helpers with an injected clock; the live ones attack a real
daemon through its engine socket and read its captured log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import sys
from collections.abc import Iterator

import msgspec
import pytest
from daemon_harness import SimEngine, layout_for, metric, wait_for

from kvxferd import PROTOCOL_VERSION
from kvxferd.api.messages import DAEMON_CODEC, ENGINE_CODEC, EngineHello, Reply
from kvxferd.client import AsyncClient, CallError
from kvxferd.memory.shm import ShmRegion
from kvxferd.service.logs import (
    MESSAGE_LIMIT,
    SHOWN_LIMIT,
    TEXT_LIMIT,
    JsonFormatter,
    LogLimiter,
    TextFormatter,
    shown,
)
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.transceiver.sessions import Terminal

FORGED = "2026-12-01 00:00:00,000 ERROR kvxferd.daemon: forged line"
MIB = 1 << 20
# The longest line the attacks below may leave: a few bounded values and one bounded
# message, nowhere near the megabytes sent.
MAX_LINE = 8192


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Lines(logging.Handler):
    """Collects the formatted messages of one logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def lines() -> Iterator[Lines]:
    logger = logging.getLogger("kvxferd.test-log-hygiene")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    handler = Lines()
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


# ------------------------------------------------------------------ shown()


def test_shown_quotes_and_escapes_a_value() -> None:
    assert shown("gen-1") == "'gen-1'"
    assert shown(f"gen\n{FORGED}") == repr(f"gen\n{FORGED}")
    for breaker in ("\n", "\r", "\x85", "\u2028", "\u2029", "\x1b", "\x00", "\x0b", "\x0c"):
        out = shown(f"a{breaker}b")
        assert len(out.splitlines()) == 1 and breaker not in out, repr(out)


def test_shown_truncates_and_names_the_full_length() -> None:
    out = shown("x" * (4 * MIB))
    assert out == repr("x" * SHOWN_LIMIT) + f"... ({4 * MIB} chars)"
    assert shown("abcdef", limit=3) == "'abc'... (6 chars)"
    assert shown("abc", limit=3) == "'abc'"


def test_shown_free_text_is_escaped_but_not_quoted() -> None:
    assert shown("peer said: no", quote=False) == "peer said: no"
    assert shown(f"bad\n{FORGED}", quote=False) == f"bad\\n{FORGED}"
    assert shown("\tx\u2028", quote=False) == "\\tx\\u2028"
    assert shown("y" * 10, limit=4, quote=False) == "yyyy... (10 chars)"


def test_shown_handles_values_that_are_not_str() -> None:
    assert shown(42) == "42"
    assert shown(ValueError(f"boom\n{FORGED}")) == f"boom\\n{FORGED}"
    assert shown(b"\x00\nab") == repr(b"\x00\nab")
    assert shown(bytearray(b"z" * 300), limit=2) == "b'zz'... (300 chars)"
    assert shown(None) == "None"


# --------------------------------------------------------------- LogLimiter


def test_limiter_lets_the_first_line_through_then_one_per_interval() -> None:
    clock = FakeClock()
    limiter = LogLimiter(interval_s=10.0, clock=clock)
    assert limiter.allow("peer-a") == 0
    assert [limiter.allow("peer-a") for _ in range(5)] == [None] * 5
    assert limiter.allow("peer-b") == 0  # another source is not held back
    clock.now += 9.9
    assert limiter.allow("peer-a") is None
    clock.now += 0.1
    assert limiter.allow("peer-a") == 6  # the six suppressed since the last one
    assert limiter.allow("peer-a") is None
    clock.now += 10.0
    assert limiter.allow("peer-a") == 1
    clock.now += 10.0
    assert limiter.allow("peer-a") == 0


def test_limiter_burst_allows_several_lines_a_window() -> None:
    clock = FakeClock()
    limiter = LogLimiter(interval_s=5.0, burst=3, clock=clock)
    assert [limiter.allow("k") for _ in range(5)] == [0, 0, 0, None, None]
    clock.now += 5.0
    assert [limiter.allow("k") for _ in range(4)] == [2, 0, 0, None]


def test_limiter_memory_is_bounded_oldest_key_forgotten_first() -> None:
    clock = FakeClock()
    limiter = LogLimiter(interval_s=60.0, max_keys=3, clock=clock)
    for key in ("a", "b", "c"):
        assert limiter.allow(key) == 0
    assert limiter.allow("a") is None  # "a" is now the most recently seen
    assert limiter.allow("d") == 0  # over the cap: "b", the least recently seen, goes
    assert len(limiter) == 3
    assert limiter.allow("b") == 0  # forgotten, so new again
    assert limiter.allow("a") is None  # kept all along
    for n in range(10_000):
        limiter.allow(("source", n))
    assert len(limiter) == 3


def test_limiter_forget_returns_what_was_never_logged() -> None:
    clock = FakeClock()
    limiter = LogLimiter(interval_s=10.0, clock=clock)
    limiter.allow("conn")
    for _ in range(7):
        limiter.allow("conn")
    assert limiter.forget("conn") == 7
    assert limiter.forget("conn") == 0
    assert limiter.allow("conn") == 0


def test_limiter_log_says_how_many_similar_lines_were_suppressed(lines: Lines) -> None:
    clock = FakeClock()
    limiter = LogLimiter(interval_s=10.0, clock=clock)
    logger = logging.getLogger("kvxferd.test-log-hygiene")
    for n in range(100):
        limiter.log(logger, logging.WARNING, "engine-1", "bad call %d: %s", n, "100% wrong")
    clock.now += 10.0
    assert limiter.log(logger, logging.WARNING, "engine-1", "bad call %d", 100)
    assert not limiter.log(logger, logging.WARNING, "engine-1", "bad call %d", 101)
    assert lines.messages == [
        "bad call 0: 100% wrong",
        "bad call 100 (99 similar suppressed)",
    ]
    # A level the logger does not emit counts nothing.
    assert not limiter.log(logger, logging.NOTSET, "engine-2", "x")


def test_limiter_rejects_nonsense_settings() -> None:
    with pytest.raises(ValueError):
        LogLimiter(interval_s=0)
    with pytest.raises(ValueError):
        LogLimiter(burst=0)
    with pytest.raises(ValueError):
        LogLimiter(max_keys=0)


def test_a_peer_message_in_an_outcome_is_bounded() -> None:
    """A peer's Abort or Result message becomes the request's outcome message (logged, and
    sent to the engine): bounded and escaped on the way in."""
    text = f"context side: x\n{FORGED}" + "m" * MIB
    term = Terminal.peer("failed", "peer_failed", text)
    assert "\n" not in term.message and term.message.endswith(f"({len(text)} chars)")
    assert len(term.message) < TEXT_LIMIT + 64
    assert Terminal.peer("failed", "peer_failed", "plain").message == "plain"


# -------------------------------------------------------- formatter backstop


def _record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("kvxferd.api", logging.WARNING, __file__, 1, msg, args, None)


def test_text_formatter_bounds_whatever_a_call_site_passes() -> None:
    out = TextFormatter("%(levelname)s %(name)s: %(message)s").format(
        _record("engine %s sent %s", f"x\n{FORGED}", "y" * (4 * MIB))
    )
    assert len(out.splitlines()) == 1
    assert len(out) < MESSAGE_LIMIT + 100
    assert out.startswith("WARNING kvxferd.api: engine x\\n" + FORGED)


def test_text_formatter_keeps_a_traceback_readable() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("kvxferd", logging.ERROR, __file__, 1, "x", (), sys.exc_info())
    out = TextFormatter("%(message)s").format(record)
    assert out.startswith("x\nTraceback") and out.endswith("ValueError: boom")


def test_json_formatter_bounds_the_message_and_the_request_id() -> None:
    record = _record("send %s: failed", "r" * (2 * MIB))
    record.request_id = f"r\n{FORGED}" + "r" * (2 * MIB)
    line = JsonFormatter().format(record)
    assert len(line.splitlines()) == 1 and len(line) < MESSAGE_LIMIT + 1024
    doc = json.loads(line)
    assert doc["request_id"].startswith(f"r\n{FORGED}") and len(doc["request_id"]) == SHOWN_LIMIT
    doc = json.loads(JsonFormatter().format(_record("ok \u2028 there")))
    assert doc["msg"] == "ok \\u2028 there"


# ------------------------------------------------------------ a live daemon


def _hostile_lines(text: str) -> tuple[list[str], list[str]]:
    """(lines that look forged, lines over MAX_LINE) of a daemon's log."""
    lines = text.splitlines()
    return [ln for ln in lines if ln.startswith(FORGED)], [ln for ln in lines if len(ln) > MAX_LINE]


def test_engine_strings_reach_the_log_escaped_and_bounded(cluster: LocalCluster) -> None:
    """An engine names itself, its pool and its requests with newlines that would forge
    whole lines and with megabytes of text: the daemon logs them (the registration, the
    request that times out, the malformed call, the detach) on bounded single lines."""
    ctx = cluster.start_daemon("ctx", "context", transceiver={"kv_transfer_timeout_ms": 300})
    engine_name = f"eng\n{FORGED}\n" + "e" * (32 << 10)  # the hello must fit the first frame
    pool_id = f"pool\n{FORGED}\n" + "p" * MIB
    rid = f"r\n{FORGED}\n" + "r" * 150  # a request id is at most 256 characters: accepted
    huge_rid = f"r\n{FORGED}\n" + "r" * MIB
    before = len(ctx.log_text())

    async def scenario() -> None:
        client = await AsyncClient.connect(ctx.api_socket, engine=engine_name)
        engine = SimEngine(client, layout_for("block-major", num_blocks=16), pool_id)
        engine.region = ShmRegion.create(
            f"kvxferd-test-hygiene-{os.getpid()}", engine.layout.pool_bytes
        )
        try:
            try:
                await client.register_pool(pool_id, engine.region.name, engine.layout)
            finally:
                engine.region.unlink()
            await engine.send(rid, 32)  # nobody receives it: it times out, logged
            outcome = await client.wait(rid, timeout_s=30)
            assert outcome.reason == "sender_deadline", outcome
            await client.release(rid)
            calls = (
                client.send(huge_rid, pool_id, [0], 32),
                client.query(huge_rid),
                client.cancel(huge_rid),
                client.release(huge_rid),
            )
            for call in calls:
                with pytest.raises(CallError):
                    await call
            # A call the daemon cannot decode, its tag a forged line and a megabyte, on a
            # second connection of the same engine.
            reader, writer = await _raw_engine(ctx, engine_name)
            bad = msgspec.msgpack.encode({"type": f"x\n{FORGED}\n" + "x" * MIB, "call_id": 7})
            writer.write(len(bad).to_bytes(4, "big") + bad)
            reply = await asyncio.wait_for(DAEMON_CODEC.read(reader), 30)
            assert isinstance(reply, Reply) and reply.call_id == 7 and not reply.ok
            writer.close()
            await client.deregister_pool(pool_id)
        finally:
            await client.close()
            engine.region.close()

    asyncio.run(scenario())
    wait_for(lambda: "detached" in ctx.log_text()[before:], 20, "the engine's detach logged")
    text = ctx.log_text()[before:]
    forged, long_lines = _hostile_lines(text)
    assert not forged, forged
    assert not long_lines, [ln[:300] for ln in long_lines]
    # Each of the engine's strings made it into the log, escaped and cut.
    assert "registered pool pool\\n" + FORGED in text
    assert "'r\\n" + FORGED in text and "sender_deadline" in text
    assert "sent a malformed call" in text and "(1048" in text
    assert "chars)" in text and "Traceback" not in text
    # Megabytes sent, kilobytes logged.
    assert len(text) < 64 << 10, len(text)
    assert ctx.alive()


async def _raw_engine(
    daemon: DaemonProc, name: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(daemon.api_socket)
    writer.write(ENGINE_CODEC.encode(EngineHello(version=PROTOCOL_VERSION, engine=name)))
    await writer.drain()
    await asyncio.wait_for(DAEMON_CODEC.read(reader), 10)
    return reader, writer


def test_a_thousand_malformed_engine_frames_log_a_handful_of_lines(
    cluster: LocalCluster,
) -> None:
    """1,000 calls that do not decode, on one engine connection: each is answered (by its
    call id), a few are logged, and the detach line counts the rest."""
    ctx = cluster.start_daemon("ctx", "context")
    n = 1000
    before = len(ctx.log_text())

    async def scenario() -> None:
        reader, writer = await _raw_engine(ctx, "flooder")
        try:
            for call_id in range(n):
                body = msgspec.msgpack.encode({"type": f"bogus\n{FORGED}", "call_id": call_id})
                writer.write(len(body).to_bytes(4, "big") + body)
            await writer.drain()
            answered = set()
            for _ in range(n):
                reply = await asyncio.wait_for(DAEMON_CODEC.read(reader), 30)
                assert isinstance(reply, Reply) and not reply.ok and reply.error == "bad_request"
                answered.add(reply.call_id)
            assert answered == set(range(n))
        finally:
            writer.close()

    asyncio.run(scenario())
    wait_for(lambda: "'flooder' detached" in ctx.log_text()[before:], 20, "the detach line")
    text = ctx.log_text()[before:]
    malformed = [ln for ln in text.splitlines() if "sent a malformed call" in ln]
    # The limiter lets 3 a 10 s window through: a slow host may see a window or two more.
    assert 1 <= len(malformed) <= 12, malformed
    [detached] = [ln for ln in text.splitlines() if "'flooder' detached" in ln]
    # Every call not logged is counted: in the next line logged, or at the detach.
    counted = sum(int(k) for ln in malformed for k in re.findall(r"\((\d+) similar suppressed", ln))
    unlogged = re.search(r"\((\d+) malformed call\(s\) not logged\)", detached)
    assert unlogged is not None, detached
    assert counted + int(unlogged.group(1)) == n - len(malformed), (malformed, detached)
    forged, long_lines = _hostile_lines(text)
    assert not forged and not long_lines
    assert metric(ctx, "kvxferd_malformed_messages_total", source="engine", reason="malformed") == n
    assert ctx.alive()
