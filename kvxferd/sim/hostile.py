"""Hostile input for kvxferd's two wire protocols, and a bounded live fuzzer (issue 14).

Two halves, shared by the tests and the acceptance benchmark:

* generators (pure, seeded by a `random.Random`): frame bodies an attacker would send to
  the peer channel or the engine API. Well-typed messages with hostile values are built
  from the msgspec schemas themselves (`msgspec.inspect`), so a message type added to
  either union is fuzzed without touching this file. Garbage, mutated valid frames, wrong
  field types, deep nesting and lying length headers are built at the msgpack level.
* a live fuzzer (`fuzz_peer`, `fuzz_engine`): sends those to a real daemon, before and
  after a real authenticated handshake and over the engine socket, and records what
  happened to every connection: answered, closed, or hung (neither within a deadline).

Nothing here decodes with pickle; all decoding goes through kvxferd's own codecs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import struct
import time
import typing
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import msgspec.inspect as mi

from kvxferd import PROTOCOL_VERSION
from kvxferd.api.messages import (
    DAEMON_CODEC,
    ENGINE_CODEC,
    Cancel,
    DaemonHello,
    DeregisterPool,
    EngineHello,
    EngineMessage,
    PoolHandoff,
    Query,
    Recv,
    RegisterPool,
    Release,
    Reply,
    Send,
)
from kvxferd.errors import KvxferdError, ProtocolError
from kvxferd.memory.layout import KvLayout
from kvxferd.memory.shm import ShmRegion
from kvxferd.peers.framing import PREAUTH_MAX_FRAME_BYTES
from kvxferd.peers.handshake import Identity, PeerIdentity, client_handshake
from kvxferd.peers.messages import (
    PEER_CODEC,
    Abort,
    AbortAck,
    CancelAnswer,
    CancelRequest,
    Hello,
    Info,
    PeerMessage,
    Ping,
    Pong,
    PoolInfo,
    PoolsUpdate,
    RequestData,
    Result,
    RoundAck,
)
from kvxferd.sim.cluster import DEFAULT_GEOMETRY, DaemonProc
from kvxferd.transceiver.state import Outcome

if TYPE_CHECKING:
    from kvxferd.client import AsyncClient

_HEADER = struct.Struct(">I")

# What a daemon log must never hold, whatever it was sent: a Python traceback, or asyncio's
# reports of an exception nobody handled (each comes with a traceback, but not always on
# the same line).
CRASH_MARKERS = (
    "Traceback (most recent call last)",
    "Exception in callback",
    "exception was never retrieved",
    "Unhandled exception",
    "Task was destroyed but it is pending",
)

# A line a hostile string tries to forge in a daemon log (after a newline it carries).
FORGED_LINE = "2026-12-01 00:00:00,000 ERROR kvxferd.forged hostile line"


def frame(body: bytes) -> bytes:
    """A length-prefixed frame around any body (the codecs' own framing, minus checks)."""
    return _HEADER.pack(len(body)) + body


def message_types(union: object) -> list[type[msgspec.Struct]]:
    """The Struct classes of a message union (PeerMessage, EngineMessage...)."""
    return [t for t in typing.get_args(union) if isinstance(t, type)]


def tag_of(cls: type[msgspec.Struct]) -> str:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType) and isinstance(info.tag, str)
    return info.tag


def fields_of(cls: type[msgspec.Struct]) -> tuple[mi.Field, ...]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info.fields


# ----------------------------------------------------------------- hostile values


_INTS = (0, 1, -1, 2, 7, 255, 256, 65535, 2**31 - 1, 2**31, -(2**31), 2**32, 2**53 + 1,
         2**63 - 1, -(2**63), 2**64 - 1)  # fmt: skip
_STRINGS = (
    "",
    " ",
    "a",
    "pool0",
    "r-0",
    "../../etc/passwd",
    "/dev/shm/x",
    "127.0.0.1:1",
    "%s%n%x",
    "\x00",
    "\x1b[31mred",
    "é\u202e\ufeff",
    "\U0001f4a9" * 3,
    f"x\n{FORGED_LINE}",
    f"x\r\n{FORGED_LINE}",
)


class Values:
    """Well-typed values that a schema accepts but a daemon should not trust: extreme
    integers, empty and oversized strings, control characters and newlines (log forging),
    long lists, nested free-form maps. `max_str` and `max_list` bound the sizes."""

    def __init__(self, rng: random.Random, max_str: int = 4096, max_list: int = 2048) -> None:
        self.rng = rng
        self.max_str = max_str
        self.max_list = max_list

    def int_(self) -> int:
        r = self.rng.random()
        if r < 0.5:
            return self.rng.choice(_INTS)
        if r < 0.8:
            return self.rng.randint(-4, 300)
        return self.rng.randint(-(2**63), 2**64 - 1)

    def str_(self) -> str:
        r = self.rng.random()
        if r < 0.55:
            return self.rng.choice(_STRINGS)
        if r < 0.8:
            n = self.rng.randint(1, 64)
            return "".join(chr(self.rng.choice((self.rng.randint(0, 0x7F), 0x2028, 0xE9)))
                           for _ in range(n))  # fmt: skip
        return self.rng.choice("aZ\n") * self.rng.randint(64, self.max_str)

    def bytes_(self) -> bytes:
        r = self.rng.random()
        if r < 0.3:
            return b""
        if r < 0.8:
            return self.rng.randbytes(self.rng.choice((1, 16, 31, 32, 33, 64)))
        return self.rng.randbytes(self.rng.randint(64, self.max_str))

    def float_(self) -> float:
        return self.rng.choice((0.0, -0.0, 1e308, -1e308, float("inf"), float("nan"), 1.5))

    def free(self, depth: int = 0) -> object:
        """Any msgpack value (a field typed `object`)."""
        kinds = ["int", "str", "nil", "bool", "float", "bytes"]
        if depth < 4:
            kinds += ["list", "map", "map"]
        kind = self.rng.choice(kinds)
        if kind == "list":
            return [self.free(depth + 1) for _ in range(self.rng.randint(0, 6))]
        if kind == "map":
            return {self.str_()[:32]: self.free(depth + 1) for _ in range(self.rng.randint(0, 6))}
        return {
            "int": self.int_,
            "str": self.str_,
            "nil": lambda: None,
            "bool": lambda: self.rng.random() < 0.5,
            "float": self.float_,
            "bytes": self.bytes_,
        }[kind]()

    def length(self) -> int:
        r = self.rng.random()
        if r < 0.7:
            return self.rng.randint(0, 8)
        if r < 0.95:
            return self.rng.randint(9, 256)
        return self.rng.randint(257, self.max_list)

    def of(self, t: mi.Type, depth: int = 0) -> object:
        """A value of schema type `t` (msgspec.inspect)."""
        if isinstance(t, mi.IntType):
            return self.int_()
        if isinstance(t, mi.StrType):
            return self.str_()
        if isinstance(t, mi.BytesType):
            return self.bytes_()
        if isinstance(t, mi.BoolType):
            return self.rng.random() < 0.5
        if isinstance(t, mi.FloatType):
            return self.float_()
        if isinstance(t, mi.NoneType):
            return None
        if isinstance(t, mi.UnionType):
            return self.of(self.rng.choice(t.types), depth)
        if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
            # Long lists only at the top: nested ones multiply (a list of pools of lists).
            n = self.length() if depth == 0 else self.rng.randint(0, 3)
            items = [self.of(t.item_type, depth + 1) for _ in range(n)]
            if isinstance(t, mi.VarTupleType):
                return tuple(items)
            return items if isinstance(t, mi.ListType) else set(map(_hashable, items))
        if isinstance(t, mi.DictType):
            n = self.rng.randint(0, 8)
            return {_hashable(self.of(t.key_type, depth + 1)): self.of(t.value_type, depth + 1)
                    for _ in range(n)}  # fmt: skip
        if isinstance(t, mi.StructType):
            return self.message(t.cls, depth + 1)
        if isinstance(t, (mi.AnyType, mi.CustomType)):
            return self.free(depth)
        raise TypeError(f"no hostile values for schema type {t!r}; teach kvxferd.sim.hostile")

    def message(self, cls: type[msgspec.Struct], depth: int = 0) -> msgspec.Struct:
        """A `cls` with every field (optional ones too, mostly) set to a hostile value."""
        kwargs = {
            f.name: self.of(f.type, depth)
            for f in fields_of(cls)
            if f.required or self.rng.random() < 0.8
        }
        return cls(**kwargs)


def _hashable(value: object) -> Any:
    return value if isinstance(value, (str, int, float, bool, bytes, type(None))) else repr(value)


# ------------------------------------------------------------------ hostile bodies


def _wrong_kind(rng: random.Random) -> bytes:
    """One encoded msgpack value of a random kind (a field's wrong type)."""
    enc = msgspec.msgpack.encode
    return rng.choice(
        (
            lambda: enc(rng.choice(_INTS)),
            lambda: enc(rng.choice(_STRINGS)),
            lambda: enc(rng.randbytes(8)),
            lambda: enc([1, "a", None]),
            lambda: enc({"k": [1, 2]}),
            lambda: enc({1: 2}),  # a non-string key
            lambda: b"\xc0",  # nil
            lambda: b"\xc3",  # true
            lambda: enc(1.5),
            lambda: enc(float("nan")),
            lambda: b"\xcb" + struct.pack(">d", float("inf")),
            lambda: enc(msgspec.msgpack.Ext(rng.randint(-128, 127), rng.randbytes(4))),
            lambda: b"\xd7\xff" + rng.randbytes(8),  # the timestamp extension
            lambda: b"\xa3\xff\xfe\xfd",  # a str that is not UTF-8
            lambda: b"\xc1",  # never valid msgpack
        )
    )()


def _lying_header(rng: random.Random) -> bytes:
    """A str/bin/array/map header announcing far more than follows (up to 4 GiB)."""
    n = rng.choice((2**32 - 1, 2**31, 1 << 24, PREAUTH_MAX_FRAME_BYTES + 1, 70000))
    code = rng.choice((b"\xdb", b"\xc6", b"\xdd", b"\xdf"))  # str32 bin32 array32 map32
    return code + struct.pack(">I", n) + rng.randbytes(rng.randint(0, 16))


def _nested(rng: random.Random, depth: int) -> bytes:
    if rng.random() < 0.5:
        return b"\x91" * depth + b"\xc0"  # [[[...nil...]]]
    return b"\x81\xa1a" * depth + b"\xc0"  # {"a": {"a": ...}}


class Bodies:
    """Hostile frame bodies for one message union. Each method returns the bytes of one
    body (frame it with `frame`); `any` picks one of them at random."""

    def __init__(
        self, union: object, rng: random.Random, max_str: int = 4096, max_body: int = 1 << 20
    ) -> None:
        self.types = message_types(union)
        self.rng = rng
        self.values = Values(rng, max_str=max_str, max_list=min(4096, max_str // 2))
        # Far under MAX_FRAME_BYTES: a bigger body would be refused on its length prefix
        # (a stream-level case the fuzzers send on purpose, not by accident).
        self.max_body = max_body
        self._kinds: list[tuple[str, Callable[[], bytes]]] = [
            ("garbage", self.garbage),
            ("mutated", self.mutated),
            ("wrong_types", self.wrong_types),
            ("deep", self.deep),
            ("lying_length", self.lying_length),
            ("odd_top", self.odd_top),
            ("trailing", self.trailing),
            ("valid", self.valid),
        ]

    def any(self) -> tuple[str, bytes]:
        while True:
            kind, make = self.rng.choice(self._kinds)
            body = make()
            if len(body) <= self.max_body:
                return kind, body

    def valid(self) -> bytes:
        """A message that decodes, with hostile values in every field."""
        cls = self.rng.choice(self.types)
        for _ in range(8):
            try:
                return msgspec.msgpack.encode(self.values.message(cls))
            except (OverflowError, TypeError, ValueError):
                continue  # e.g. a huge int in a float field: not encodable, draw again
        return msgspec.msgpack.encode({"type": tag_of(cls)})

    def garbage(self) -> bytes:
        n = self.rng.choice((0, 1, 2, 5, 16, 64, 256, 1024))
        return self.rng.randbytes(n)

    def mutated(self) -> bytes:
        """A valid body with a few bit flips, truncations, insertions or splices."""
        body = bytearray(self.valid())
        for _ in range(self.rng.randint(1, 4)):
            op = self.rng.randrange(6)
            if not body:
                body += self.rng.randbytes(4)
            i = self.rng.randrange(len(body))
            if op == 0:
                body[i] ^= 1 << self.rng.randrange(8)
            elif op == 1:
                body[i] = self.rng.randrange(256)
            elif op == 2:
                del body[i:]
            elif op == 3:
                body[i:i] = self.rng.randbytes(self.rng.randint(1, 8))
            elif op == 4:
                j = self.rng.randrange(len(body))
                body[i:i] = body[min(i, j) : max(i, j)]
            else:
                body[i:i] = _lying_header(self.rng)
        return bytes(body)

    def _map(self, cls: type[msgspec.Struct], fields: list[tuple[bytes, bytes]]) -> bytes:
        enc = msgspec.msgpack.encode
        items = [(enc("type"), enc(tag_of(cls))), *fields]
        return b"\xdf" + struct.pack(">I", len(items)) + b"".join(k + v for k, v in items)

    def wrong_types(self) -> bytes:
        """The right tag, some fields right and some of a wrong type."""
        cls = self.rng.choice(self.types)
        enc = msgspec.msgpack.encode
        fields = []
        for f in fields_of(cls):
            if self.rng.random() < 0.5:
                value = _wrong_kind(self.rng)
            else:
                try:
                    value = enc(self.values.of(f.type))
                except (OverflowError, TypeError, ValueError):
                    value = _wrong_kind(self.rng)
            fields.append((enc(f.encode_name), value))
        self.rng.shuffle(fields)
        return self._map(cls, fields)

    def deep(self) -> bytes:
        """A field (or the whole body) nested thousands deep."""
        depth = self.rng.choice((100, 1000, 5000, 50_000))
        if self.rng.random() < 0.2:
            return _nested(self.rng, depth)
        cls = self.rng.choice(self.types)
        enc = msgspec.msgpack.encode
        names = [f.encode_name for f in fields_of(cls)] or ["x"]
        return self._map(cls, [(enc(self.rng.choice(names)), _nested(self.rng, depth))])

    def lying_length(self) -> bytes:
        cls = self.rng.choice(self.types)
        enc = msgspec.msgpack.encode
        names = [f.encode_name for f in fields_of(cls)] or ["x"]
        return self._map(cls, [(enc(self.rng.choice(names)), _lying_header(self.rng))])

    def odd_top(self) -> bytes:
        """A body that is not a tagged map of this union."""
        enc = msgspec.msgpack.encode
        cls = self.rng.choice(self.types)
        return self.rng.choice(
            (
                lambda: enc([tag_of(cls), 1, 2]),
                lambda: enc(self.rng.choice(_INTS)),
                lambda: b"\xc0",
                lambda: enc("hello"),
                lambda: enc({}),
                lambda: enc({"type": "no-such-message"}),
                lambda: enc({"type": 7}),
                lambda: enc({"type": None, "call_id": 3}),
                lambda: enc({1: "x", "type": tag_of(cls)}),
                lambda: b"\x82\xa4type" + enc(tag_of(cls)) + b"\xa4type" + enc("other"),
                lambda: enc({"TYPE": tag_of(cls)}),
            )
        )()

    def trailing(self) -> bytes:
        return self.valid() + self.rng.randbytes(self.rng.randint(1, 8))


# --------------------------------------------------------------- the live fuzzer


@dataclass
class FuzzReport:
    """What a live fuzzing run saw. `hung` connections neither answered nor closed within
    the deadline; `unexpected` lists surprises (a connection closed after a message that
    should have left it open, a reply missing, a wrong call id) with a reproduction."""

    name: str
    messages: int = 0
    connections: int = 0
    answered: int = 0
    closed: int = 0
    hung: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    replies: dict[str, int] = field(default_factory=dict)  # engine replies by error code
    unexpected: list[str] = field(default_factory=list)
    hung_cases: list[str] = field(default_factory=list)

    def count(self, kind: str, n: int = 1) -> None:
        self.messages += n
        self.by_kind[kind] = self.by_kind.get(kind, 0) + n

    def surprise(self, what: str) -> None:
        if len(self.unexpected) < 50:
            self.unexpected.append(what)

    def hang(self, what: str) -> None:
        self.hung += 1
        if len(self.hung_cases) < 50:
            self.hung_cases.append(what)

    def summary(self) -> dict[str, object]:
        return {
            "messages": self.messages,
            "connections": self.connections,
            "answered": self.answered,
            "closed": self.closed,
            "hung": self.hung,
            "unexpected": len(self.unexpected),
            "by_kind": dict(sorted(self.by_kind.items())),
            **({"replies": dict(sorted(self.replies.items()))} if self.replies else {}),
        }


def http_status(daemon: DaemonProc) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{daemon.http_address}/v1/status", timeout=10) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


def crash_lines(text: str) -> list[str]:
    """Lines of a daemon log that show an unhandled exception (see CRASH_MARKERS)."""
    return [line for line in text.splitlines() if any(m in line for m in CRASH_MARKERS)]


def forged_lines(text: str) -> list[str]:
    """Log lines a hostile string managed to start (a newline in it reached the log)."""
    return [line for line in text.splitlines() if line.startswith(FORGED_LINE)]


def rss_bytes(daemon: DaemonProc) -> int:
    with open(f"/proc/{daemon.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


async def _until_closed(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    """Read (and drop) until the other side closes; False if it is still open at the
    deadline. A reset counts as closed."""

    async def drain() -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while await reader.read(64 << 10):
                pass

    try:
        await asyncio.wait_for(drain(), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


def _hex(data: bytes, limit: int = 96) -> str:
    return data[:limit].hex() + ("..." if len(data) > limit else "")


# --- the peer channel, before authentication


def _preauth_payload(rng: random.Random, bodies: Bodies) -> tuple[str, bytes]:
    """What a stranger sends on a fresh peer connection: one hostile frame, raw garbage, a
    lying length prefix, or a hostile frame after a well-formed Hello."""
    r = rng.random()
    if r < 0.1:
        return "raw_garbage", rng.randbytes(rng.randint(1, 512))
    if r < 0.15:
        return "http", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    if r < 0.2:
        length = rng.choice((PREAUTH_MAX_FRAME_BYTES + 1, 2**32 - 1, 1 << 24))
        return "oversize_prefix", _HEADER.pack(length) + rng.randbytes(rng.randint(0, 64))
    if r < 0.25:
        n = rng.randint(1, 200)
        return "truncated_frame", _HEADER.pack(n + rng.randint(1, 100)) + rng.randbytes(n)
    if r < 0.3:
        return "empty_frame", _HEADER.pack(0)
    kind, body = bodies.any()
    if r < 0.45:
        hello = Hello(
            version=PROTOCOL_VERSION,
            name=f"stranger-{rng.randrange(1000)}",
            incarnation="1",
            role=rng.choice(("generation", "context")),
            nonce=rng.randbytes(32),
        )
        return "after_hello_" + kind, PEER_CODEC.encode(hello) + frame(body)
    return kind, frame(body)


async def _stranger(host: str, port: int, data: bytes, timeout_s: float) -> tuple[bool, bool]:
    """One unauthenticated connection: send `data`, end our side, wait for the close.
    (connected, closed in time)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return False, True
    try:
        with contextlib.suppress(ConnectionError, OSError):
            writer.write(data)
            await writer.drain()
            writer.write_eof()
        return True, await _until_closed(reader, timeout_s)
    finally:
        writer.close()


async def fuzz_preauth(
    daemon: DaemonProc,
    count: int,
    seed: int,
    report: FuzzReport,
    concurrency: int = 8,
    deadline_s: float = 10.0,
) -> None:
    """`count` connections from strangers, each sending hostile bytes before any
    authentication. Every one must be closed by the daemon within `deadline_s` of our
    end of stream. `concurrency` stays under the daemon's per-source pre-auth cap."""
    rng = random.Random(seed)
    bodies = Bodies(PeerMessage, rng, max_str=16 << 10)
    host, port = daemon.peer_address.rsplit(":", 1)
    sem = asyncio.Semaphore(concurrency)
    cases = [_preauth_payload(rng, bodies) for _ in range(count)]

    async def one(i: int, kind: str, data: bytes) -> None:
        async with sem:
            connected, closed = await _stranger(host, int(port), data, deadline_s)
        report.connections += 1
        report.count("preauth_" + kind)
        if not connected:
            report.surprise(f"preauth #{i} ({kind}): could not connect (refused at the cap?)")
        elif closed:
            report.closed += 1
        else:
            report.hang(f"preauth #{i} ({kind}, seed {seed}): open {deadline_s} s: {_hex(data)}")

    await asyncio.gather(*(one(i, k, d) for i, (k, d) in enumerate(cases)))


async def stalled_strangers(
    daemon: DaemonProc, report: FuzzReport, deadline_s: float, n: int = 4
) -> None:
    """Slow-loris strangers on the peer port: silent, or half a frame and then nothing.
    The daemon must close each by its handshake timeout (`deadline_s` includes a margin)."""
    host, port = daemon.peer_address.rsplit(":", 1)
    partial = [b"", _HEADER.pack(200) + b"\x85", b"\x00\x00", PEER_CODEC.encode(
        Hello(version=PROTOCOL_VERSION, name="slow", incarnation="1", role="generation",
              nonce=b"\0" * 32))]  # fmt: skip

    async def one(data: bytes) -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(data)
                await writer.drain()
            report.connections += 1
            report.count("preauth_stalled")
            if await _until_closed(reader, deadline_s):
                report.closed += 1
            else:
                report.hang(
                    f"stalled stranger sending {_hex(data)} still open after {deadline_s} s"
                )
        finally:
            writer.close()

    await asyncio.gather(*(one(partial[i % len(partial)]) for i in range(n)))


# --- the peer channel, after a real handshake


def fake_info(daemon: DaemonProc, agent_name: str, metadata: bytes) -> Info:
    """An Info the daemon accepts: its own compat settings and fingerprint, no pools."""
    doc = http_status(daemon)
    settings = doc["settings"]
    return Info(
        agent_name=agent_name,
        agent_metadata=metadata,
        pools=[],
        fingerprint=doc["fingerprint"],
        compat={k: settings[k] for k in ("backend", "runtime", "pipelined_transfer")},
        transceiver={},
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        context_parallel_size=1,
    )


class _Intruder:
    """An authenticated peer connection we drive: it answers the daemon's Pings (so the
    heartbeat does not end it) and keeps every Pong and the time of the close."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.pongs: set[int] = set()
        self.aborts: dict[str, str] = {}  # request id -> reason of the Abort we were sent
        self.got = asyncio.Event()
        self.eof = asyncio.Event()
        self.error = ""
        self.received = 0
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                msg = await PEER_CODEC.read(self.reader)
                if msg is None:
                    break
                self.received += 1
                if isinstance(msg, Ping):
                    with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                        self.writer.write(PEER_CODEC.encode(Pong(seq=msg.seq)))
                elif isinstance(msg, Pong):
                    self.pongs.add(msg.seq)
                elif isinstance(msg, Abort):
                    self.aborts[msg.request_id] = msg.reason
                self.got.set()
        except (ProtocolError, ConnectionError, OSError) as exc:
            self.error = str(exc)
        finally:
            self.eof.set()
            self.got.set()

    def write(self, data: bytes) -> bool:
        if self.eof.is_set():
            return False
        try:
            self.writer.write(data)
        except (ConnectionError, OSError, RuntimeError):
            return False
        return True

    async def pong(self, seq: int, timeout_s: float) -> str:
        """'pong' once the daemon answered Ping(seq), 'closed', or 'hung' at the deadline."""
        if not self.write(PEER_CODEC.encode(Ping(seq=seq))):
            return "closed"
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.drain()
        deadline = time.monotonic() + timeout_s
        while seq not in self.pongs:
            if self.eof.is_set():
                return "closed"
            left = deadline - time.monotonic()
            if left <= 0:
                return "hung"
            self.got.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.got.wait(), left)
        return "pong"

    async def closed_within(self, timeout_s: float) -> bool:
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.drain()
        try:
            await asyncio.wait_for(self.eof.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def close(self) -> None:
        self.writer.close()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def _semantic(rng: random.Random, values: Values, known_ids: list[str]) -> PeerMessage:
    """A well-formed steady-state message meant to confuse: unknown or stolen request ids,
    wrong tokens, bogus pools, offsets and lengths, handshake messages out of order."""
    rid = rng.choice(known_ids) if known_ids and rng.random() < 0.3 else values.str_()[:200]
    token = values.int_()
    blocks = [values.int_() for _ in range(values.length())]
    kind = rng.randrange(12)
    if kind == 0:
        return RequestData(
            request_id=rid, rx_token=token, pool_id=rng.choice(("pool0", values.str_()[:64])),
            blocks=blocks, num_tokens=rng.choice((None, values.int_())),
            bounce_offset=values.int_(), bounce_nbytes=values.int_(),
            expires_unix_ms=rng.choice((0, values.int_(), int(time.time() * 1e3) + 2000)),
            block_start=values.int_(),
        )  # fmt: skip
    if kind == 1:
        return Result(
            request_id=rid, rx_token=token, status=rng.choice(("ok", "error", values.str_())),
            nbytes=values.int_(), last=rng.random() < 0.5, message=values.str_(),
            bounced=rng.random() < 0.5, first_block=values.int_(), end_block=values.int_(),
        )  # fmt: skip
    if kind == 2:
        return Abort(request_id=rid, rx_token=token, reason=values.str_(), message=values.str_())
    if kind == 3:
        return AbortAck(request_id=rid, rx_token=token)
    if kind == 4:
        return CancelRequest(request_id=rid, rx_token=token)
    if kind == 5:
        return CancelAnswer(request_id=rid, rx_token=token, cancelled=rng.random() < 0.5)
    if kind == 6:
        return RoundAck(request_id=rid, rx_token=token, end_block=values.int_())
    if kind == 7:
        pools = [
            PoolInfo(pool_id=values.str_()[:64], layout=_hostile_layout(rng, values),
                     base=values.int_(), nbytes=values.int_(), tp_rank=values.int_(),
                     tp_size=values.int_())
            for _ in range(rng.randint(0, 4))
        ]  # fmt: skip
        return PoolsUpdate(pools=pools)  # no agent metadata: that would end the connection
    if kind == 8:
        return Pong(seq=values.int_())
    # Handshake messages (and anything else of the union) after the handshake.
    others = [t for t in message_types(PeerMessage) if t not in (PoolsUpdate, Ping)]
    msg = values.message(rng.choice(others))
    return msg  # type: ignore[return-value]


def _hostile_layout(rng: random.Random, values: Values) -> dict[str, object]:
    layout = dict(DEFAULT_GEOMETRY)
    layout.update(major="block-major", kv_factor=2, num_blocks=16)
    for key in rng.sample(sorted(layout), rng.randint(0, 3)):
        layout[key] = values.free()
    if rng.random() < 0.2:
        layout[values.str_()[:16]] = values.free()
    return layout


def _closing_post_auth(rng: random.Random, bodies: Bodies) -> tuple[str, bytes]:
    """A frame after which the daemon must close the channel: it does not decode, its
    length is over the limit, or a PoolsUpdate carries agent metadata NIXL refuses."""
    r = rng.random()
    if r < 0.1:
        return "oversize_prefix", _HEADER.pack(2**32 - 1) + rng.randbytes(16)
    if r < 0.2:
        pools = PoolsUpdate(pools=[], agent_metadata=rng.randbytes(rng.randint(1, 256)))
        return "bad_agent_metadata", PEER_CODEC.encode(pools)
    for _ in range(32):
        kind, body = bodies.any()
        try:
            PEER_CODEC.decode(body)
        except ProtocolError:
            return kind, frame(body)
    return "garbage", frame(b"\xc1")


async def _handshake(
    daemon: DaemonProc,
    me: Identity,
    info: Info,
    timeout_s: float,
) -> _Intruder:
    host, port = daemon.peer_address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))

    async def make_info() -> Info:
        return info

    def accept(_peer: PeerIdentity, _info: Info) -> None:
        return None

    try:
        await asyncio.wait_for(
            client_handshake(reader, writer, me, make_info, accept, daemon.peer_address),
            timeout_s,
        )
    except BaseException:
        writer.close()
        raise
    return _Intruder(reader, writer)


async def _until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def fuzz_postauth(
    daemon: DaemonProc,
    secret: bytes,
    agent_metadata: bytes,
    agent_name: str,
    count: int,
    seed: int,
    report: FuzzReport,
    closing_every: int = 40,
    batch: int = 50,
    deadline_s: float = 10.0,
) -> None:
    """`count` hostile messages on authenticated channels (a real handshake with the shared
    secret and a real NIXL agent's metadata). Most are well-formed but confusing
    (`_semantic`) and must leave the channel open: after each `batch` a Ping must be
    answered within `deadline_s`. One in `closing_every` must make the daemon close the
    channel at once (`_closing_post_auth`); the fuzzer then handshakes again."""
    rng = random.Random(seed)
    values = Values(rng, max_str=64 << 10, max_list=4096)
    bodies = Bodies(PeerMessage, rng, max_str=64 << 10)
    role = "generation" if daemon.role == "context" else "context"
    info = fake_info(daemon, agent_name, agent_metadata)
    known: list[str] = ["r-0", "fuzz", *(f"r-{i}" for i in range(1, 4))]
    incarnation = 0
    sent = 0
    seq = 1 << 40  # far from the daemon's own ping numbers

    def gone(inc: str) -> Callable[[], bool]:
        def check() -> bool:
            peers = http_status(daemon)["peers"]
            return not any(p["name"] == "fuzzer" and p["incarnation"] == inc for p in peers)

        return check

    while sent < count:
        incarnation += 1
        me = Identity("fuzzer", f"{seed}-{incarnation}", role, secret)
        try:
            conn = await _handshake(daemon, me, info, deadline_s)
        except (KvxferdError, OSError, asyncio.TimeoutError) as exc:
            report.hang(f"post-auth handshake {me.incarnation} failed: {exc!r}")
            return
        report.connections += 1
        trace: list[str] = []  # the frames of this connection, for a reproduction
        try:
            while sent < count:
                closing = rng.randrange(closing_every) == 0
                if closing:
                    kind, data = _closing_post_auth(rng, bodies)
                    report.count("postauth_close_" + kind)
                    sent += 1
                    conn.write(data)
                    if await conn.closed_within(deadline_s):
                        report.closed += 1
                    else:
                        report.hang(
                            f"post-auth {kind} (seed {seed}, incarnation {me.incarnation}) "
                            f"left the channel open: {_hex(data)}"
                        )
                    break
                msg = _semantic(rng, values, known)
                try:
                    data = PEER_CODEC.encode(msg)
                except (ProtocolError, OverflowError, TypeError, ValueError):
                    continue  # over the frame limit, or not encodable: not sent, not counted
                if len(data) > bodies.max_body:
                    continue
                if len(trace) < 2000:
                    trace.append(type(msg).__name__)
                report.count("postauth_" + type(msg).__name__)
                sent += 1
                if not conn.write(data):
                    report.surprise(
                        f"post-auth channel {me.incarnation} closed before message {sent} "
                        f"({type(msg).__name__}); last frames {trace[-5:]}"
                    )
                    report.closed += 1
                    break
                if sent % batch == 0 or sent == count:
                    seq += 1
                    got = await conn.pong(seq, deadline_s)
                    if got == "pong":
                        report.answered += 1
                    elif got == "hung":
                        report.hang(
                            f"post-auth channel {me.incarnation}: no Pong in {deadline_s} s"
                        )
                        break
                    else:
                        report.closed += 1
                        report.surprise(
                            f"post-auth channel {me.incarnation} (seed {seed}) closed by the "
                            f"daemon after well-formed messages; last {trace[-5:]}; "
                            f"last frame {_hex(data)}"
                        )
                        break
                    await conn.writer.drain()
        finally:
            await conn.close()
        # The daemon must have dropped this incarnation before the next handshake reuses
        # the NIXL agent (its close evicts the agent).
        if not await _until(gone(me.incarnation), deadline_s):
            report.hang(f"post-auth channel {me.incarnation}: still listed as a peer")


async def fuzz_stolen_sends(
    ctx: DaemonProc,
    secret: bytes,
    agent_metadata: bytes,
    agent_name: str,
    count: int,
    seed: int,
    report: FuzzReport,
    deadline_s: float = 10.0,
) -> None:
    """`count` real sends on `ctx`, each asked for first by the intruder (an authenticated
    peer) into a pool it announced with hostile addresses (a base near 2**64, a size of a
    TiB) or with hostile block ids (negative, past the pool, near 2**63) and bounce
    offsets. Within `deadline_s` either the real send fails as the peer's fault (the
    intruder registered no memory there) or the intruder's RequestData is refused
    (`block_mismatch`: blocks outside its own pool) and the send waits on for a real
    receiver, which the victim then cancels; and the channel must stay served. What the
    daemon logs meanwhile is checked by the caller (no traceback)."""
    from kvxferd.client import AsyncClient

    rng = random.Random(seed)
    layout = fuzz_layout(64)
    wire: dict[str, object] = dict(layout.to_wire())
    client = await AsyncClient.connect(ctx.api_socket, engine="fuzz-victim")
    region = ShmRegion.create(f"kvxferd-victim-{os.getpid()}-{seed}", layout.pool_bytes)
    try:
        await client.register_pool("victim", region.name, layout)
    finally:
        region.unlink()
    info = fake_info(ctx, agent_name, agent_metadata)
    role = "generation"
    conn = await _handshake(
        ctx, Identity("fuzzer", f"steal-{seed}", role, secret), info, deadline_s
    )
    report.connections += 1
    huge = (2**64 - 4096, 2**63, 2**63 - layout.block_bytes, 2**48)
    try:
        for i in range(count):
            rid = f"stolen-{seed}-{i}"
            base = rng.choice((0x1000, *huge))
            nbytes = rng.choice((layout.pool_bytes, 1 << 40, 2**64 - 1, 0, -1))
            blocks = rng.choice(
                (
                    [0, 1, 2, 3],
                    [-1, 0, 1, 2],
                    [60, 61, 62, 63 + 1000],
                    [2**63 - 1, 5, 6, 7],
                    [-(2**63), 1, 2, 3],
                )
            )
            bounce = rng.choice(((0, 0), (2**63, 2**63), (-1, 1 << 20), (1 << 40, 1 << 30)))
            pools = [PoolInfo(pool_id="evil", layout=wire, base=base, nbytes=nbytes)]
            request = RequestData(
                request_id=rid, rx_token=i + 1, pool_id="evil", blocks=blocks, num_tokens=100,
                bounce_offset=bounce[0], bounce_nbytes=bounce[1],
            )  # fmt: skip
            await client.send(rid, "victim", [0, 1, 2, 3], 100)
            conn.write(PEER_CODEC.encode(PoolsUpdate(pools=pools)))
            conn.write(PEER_CODEC.encode(request))
            report.count("stolen_RequestData", 2)
            case = f"base {base:#x}, nbytes {nbytes}, blocks {blocks}, bounce {bounce}"
            outcome, refused = await _outcome_or_refusal(client, conn, rid, deadline_s)
            if outcome is None and refused is not None:
                if refused != "block_mismatch":
                    report.surprise(f"stolen send {rid} ({case}): refused as {refused}")
                # Nobody else will ask for it: the victim gives up on the send.
                await client.cancel(rid)
                outcome = await client.wait(rid, timeout_s=deadline_s)
                if outcome.status != "cancelled":
                    report.surprise(f"stolen send {rid} ({case}): {outcome.status} after cancel")
                report.answered += 1
            elif outcome is None:
                report.hang(f"stolen send {rid} ({case}): no outcome or refusal in {deadline_s} s")
                continue
            elif outcome.status == "done":
                report.surprise(f"stolen send {rid} ({case}) reported done")
            elif outcome.reason == "internal" or outcome.fault == "local":
                # The peer's bogus pool or blocks: a peer fault with a reason of its own,
                # not an internal error of ours.
                report.surprise(
                    f"stolen send {rid} ({case}): {outcome.reason}, {outcome.fault} fault: "
                    f"{outcome.message[:200]}"
                )
            else:
                report.answered += 1
            await client.release(rid)
            if await conn.pong((1 << 41) + i, deadline_s) != "pong":
                report.surprise(f"stolen send {rid} ({case}): the intruder's channel closed")
                break
    finally:
        await conn.close()
        with contextlib.suppress(KvxferdError):
            await client.deregister_pool("victim")
        await client.close()
        region.close()


async def _outcome_or_refusal(
    client: AsyncClient, conn: _Intruder, rid: str, timeout_s: float
) -> tuple[Outcome | None, str | None]:
    """The send's outcome, or the reason the intruder's RequestData was refused (an Abort
    to it), whichever comes first within `timeout_s`; (None, None) when neither did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(asyncio.TimeoutError):
            return await client.wait(rid, timeout_s=0.05), None
        if rid in conn.aborts:
            return None, conn.aborts[rid]
    return None, None


# --- the engine API


def fuzz_layout(num_blocks: int = 16) -> KvLayout:
    g = DEFAULT_GEOMETRY
    return KvLayout(
        num_layers=g["num_layers"], kv_factor=2, num_kv_heads=g["num_kv_heads"],
        head_dim=g["head_dim"], tokens_per_block=g["tokens_per_block"], dtype=g["dtype"],
        major="block-major", num_blocks=num_blocks,
    )  # fmt: skip


def _engine_call(
    rng: random.Random, values: Values, call_id: int, pool_id: str, peer_hint: str
) -> EngineMessage:
    """A well-formed engine call with hostile values (answered with a Reply, never a close).
    Some are plausible (the fuzzer's real pool, blocks in range, the real context peer, a
    small set of request ids): they are accepted, and the calls after them (a duplicate,
    a cancel, a query, a release, a send of a receive's id) meet requests that exist."""
    rid = values.str_()[:300] if rng.random() < 0.4 else f"fz-{rng.randrange(40)}"
    if rng.random() < 0.25:
        n = rng.randint(1, 4)
        blocks = rng.sample(range(16), n)
        if rng.random() < 0.5:
            return Recv(
                call_id=call_id, request_id=rid, pool_id=pool_id, blocks=blocks,
                peer=peer_hint, num_tokens=rng.randint(1, 32 * n),
            )  # fmt: skip
        return Send(
            call_id=call_id, request_id=rid, pool_id=pool_id, blocks=blocks, token_start=0,
            token_end=rng.randint(1, 32 * n), last=rng.random() < 0.7,
        )  # fmt: skip
    pool = pool_id if rng.random() < 0.6 else values.str_()[:64]
    blocks = [rng.randrange(16) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.5:
        blocks = [values.int_() for _ in range(values.length())]
    kind = rng.randrange(9)
    if kind == 0:
        return Recv(
            call_id=call_id, request_id=rid, pool_id=pool, blocks=blocks,
            peer=rng.choice((peer_hint, "", "127.0.0.1:1", values.str_()[:64])),
            num_tokens=rng.choice((None, values.int_(), 32 * len(blocks))),
            beam_width=rng.choice((1, values.int_())),
            peers=rng.choice(([], [peer_hint, peer_hint], [values.str_()[:32]])),
            block_start=rng.choice((0, values.int_())),
        )  # fmt: skip
    if kind == 1:
        start, end = values.int_(), rng.choice((values.int_(), 32 * len(blocks)))
        return Send(
            call_id=call_id, request_id=rid, pool_id=pool, blocks=blocks, token_start=start,
            token_end=end, last=rng.random() < 0.7, beam_width=rng.choice((1, values.int_())),
            peer=rng.choice(("", "gen", values.str_()[:64])),
        )  # fmt: skip
    if kind == 2:
        return Cancel(call_id=call_id, request_id=rid)
    if kind == 3:
        return Release(call_id=call_id, request_id=rid)
    if kind == 4:
        return Query(call_id=call_id, request_id=rid)
    if kind == 5:
        # Never the fuzzer's own pool: later calls need it.
        return DeregisterPool(call_id=call_id, pool_id=values.str_()[:64] + "-x")
    if kind == 6:
        layout = _hostile_layout(rng, values)
        return RegisterPool(
            call_id=call_id, pool_id=values.str_()[:64], shm_name=values.str_()[:255],
            nbytes=values.int_(), layout=layout, tp_rank=values.int_(), tp_size=values.int_(),
            handoff=rng.choice(("", values.str_()[:64])),
        )  # fmt: skip
    if kind == 7:
        return EngineHello(version=values.int_(), engine=values.str_())
    return PoolHandoff(
        call_id=call_id, version=values.int_(), pool_id=values.str_()[:64], nbytes=values.int_()
    )


class _Engine:
    """A raw engine connection: every frame we send must get exactly one Reply."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.replies: list[Reply] = []
        self.call_ids: set[int] = set()
        self.others = 0
        self.got = asyncio.Event()
        self.eof = asyncio.Event()
        self.error = ""
        self._task = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, path: str, timeout_s: float) -> _Engine:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout_s)
        writer.write(ENGINE_CODEC.encode(EngineHello(version=PROTOCOL_VERSION, engine="fuzzer")))
        await writer.drain()
        hello = await asyncio.wait_for(DAEMON_CODEC.read(reader), timeout_s)
        if not isinstance(hello, DaemonHello):
            writer.close()
            raise ProtocolError(f"the daemon answered the hello with {hello!r}")
        return cls(reader, writer)

    async def _read(self) -> None:
        try:
            while True:
                msg = await DAEMON_CODEC.read(self.reader)
                if msg is None:
                    break
                if isinstance(msg, Reply):
                    self.replies.append(msg)
                    self.call_ids.add(msg.call_id)
                else:
                    self.others += 1
                self.got.set()
        except (ProtocolError, ConnectionError, OSError) as exc:
            self.error = str(exc)
        finally:
            self.eof.set()
            self.got.set()

    async def replies_within(self, n: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while len(self.replies) < n and not self.eof.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.got.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.got.wait(), left)
        return len(self.replies) >= n

    async def close(self) -> None:
        self.writer.close()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def _first_frame_case(
    path: str, rng: random.Random, bodies: Bodies, deadline_s: float
) -> tuple[str, bytes, str]:
    """A connection whose first frame is hostile: the daemon answers bad_request (or not)
    and closes. Returns (kind, data, 'closed' | 'hung')."""
    r = rng.random()
    if r < 0.2:
        kind, data = "oversize_first", _HEADER.pack(rng.choice((2**32 - 1, 1 << 20))) + b"\0" * 8
    elif r < 0.3:
        kind, data = "truncated_first", _HEADER.pack(100) + rng.randbytes(rng.randint(0, 99))
    elif r < 0.4:
        call = Query(call_id=1, request_id="x")  # a call before the hello
        kind, data = "call_before_hello", ENGINE_CODEC.encode(call)
    elif r < 0.5:
        handoff = PoolHandoff(call_id=3, version=PROTOCOL_VERSION, pool_id="p", nbytes=4096)
        kind, data = "handoff_without_fd", ENGINE_CODEC.encode(handoff)
    elif r < 0.6:
        hello = EngineHello(version=rng.choice((0, PROTOCOL_VERSION + 1, -1)), engine="old")
        kind, data = "hello_wrong_version", ENGINE_CODEC.encode(hello)
    else:
        kind, body = bodies.any()
        kind, data = "first_" + kind, frame(body)
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), deadline_s)
    try:
        with contextlib.suppress(ConnectionError, OSError):
            writer.write(data)
            await writer.drain()
            writer.write_eof()
        if kind == "hello_wrong_version" or await _until_closed(reader, deadline_s):
            # A hello (of any version) that decodes leaves the stream to the next frame:
            # our end of stream closes it. Either way it must end within the deadline.
            if kind == "hello_wrong_version" and not await _until_closed(reader, deadline_s):
                return kind, data, "hung"
            return kind, data, "closed"
        return kind, data, "hung"
    finally:
        writer.close()


async def _registered_engine(
    daemon: DaemonProc, pool_id: str, seed: int, deadline_s: float
) -> _Engine:
    """A raw engine connection with a small real pool of its own, registered."""
    layout = fuzz_layout()
    name = f"kvxferd-fuzz-{os.getpid()}-{seed}-{time.monotonic_ns()}"
    region = ShmRegion.create(name, layout.pool_bytes)
    try:
        engine = await _Engine.connect(daemon.api_socket, deadline_s)
        register = RegisterPool(
            call_id=1, pool_id=pool_id, shm_name=region.name, nbytes=layout.pool_bytes,
            layout=dict(layout.to_wire()),
        )  # fmt: skip
        engine.writer.write(ENGINE_CODEC.encode(register))
        if not await engine.replies_within(1, deadline_s) or not engine.replies[0].ok:
            await engine.close()
            raise KvxferdError(f"the fuzzer's pool was not registered: {engine.replies}")
    finally:
        region.unlink()
        region.close()  # the daemon has its own mapping
    engine.replies.clear()
    return engine


async def _culprit(
    daemon: DaemonProc, frames: list[tuple[str, bytes]], pool_id: str, deadline_s: float
) -> str:
    """Which frame of a batch made the daemon close the engine connection: each is replayed
    alone on a fresh registered connection. A reproduction, or why none was found."""
    for kind, data in frames:
        engine = await _registered_engine(daemon, pool_id, 0, deadline_s)
        try:
            with contextlib.suppress(ConnectionError, OSError):
                engine.writer.write(data)
                await engine.writer.drain()
            answered = await engine.replies_within(1, deadline_s)
            if not answered or engine.eof.is_set():
                await asyncio.sleep(0)  # a close right after the reply
                return f"{kind} alone closes the connection; frame: {data.hex()}"
        finally:
            await engine.close()
    return "no single frame of the batch closes a connection alone (an interaction)"


async def fuzz_engine(
    daemon: DaemonProc,
    count: int,
    seed: int,
    report: FuzzReport,
    peer_hint: str = "",
    first_frame_every: int = 25,
    batch: int = 32,
    deadline_s: float = 10.0,
) -> None:
    """`count` hostile frames to the engine API. On a registered engine connection (with
    a real pool, so calls get past the first checks) every frame (garbage, mutated,
    wrongly typed, deeply nested, well-formed with hostile values) must be answered by
    exactly one Reply within `deadline_s`, and a Reply to a call whose id the frame still
    carries must name that id. One in `first_frame_every` goes instead as the first frame
    of a fresh connection, which must be closed within `deadline_s`. A connection the
    daemon closes in the middle is a surprise: the frame that did it is found by replay."""
    rng = random.Random(seed)
    values = Values(rng, max_str=64 << 10, max_list=4096)
    bodies = Bodies(EngineMessage, rng, max_str=64 << 10)
    pool_id = "fuzzpool"
    engine = await _registered_engine(daemon, pool_id, seed, deadline_s)
    report.connections += 1
    sent = 0
    call_id = 1000
    pending: list[tuple[str, bytes, int | None]] = []  # the batch not yet answered
    try:
        while sent < count:
            if rng.randrange(first_frame_every) == 0:
                kind, data, how = await _first_frame_case(
                    daemon.api_socket, rng, bodies, deadline_s
                )
                report.connections += 1
                report.count("engine_" + kind)
                sent += 1
                if how == "closed":
                    report.closed += 1
                else:
                    report.hang(f"engine first frame {kind} (seed {seed}) open: {_hex(data)}")
                continue
            call_id += 1
            if rng.random() < 0.45:
                msg = _engine_call(rng, values, call_id, pool_id, peer_hint)
                try:
                    kind, data = "call_" + type(msg).__name__, ENGINE_CODEC.encode(msg)
                except (ProtocolError, OverflowError, TypeError, ValueError):
                    continue  # not encodable: not sent, not counted
                if len(data) > bodies.max_body:
                    continue
                want = call_id if hasattr(msg, "call_id") else None
            else:
                kind, body = bodies.any()
                data, want = frame(body), None
            report.count("engine_" + kind)
            sent += 1
            pending.append((kind, data, want))
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                engine.writer.write(data)
            if len(pending) < batch and sent < count:
                continue
            with contextlib.suppress(ConnectionError, OSError):
                await engine.writer.drain()
            if await engine.replies_within(len(pending), deadline_s):
                report.answered += len(pending)
                for reply in engine.replies:
                    code = "ok" if reply.ok else reply.error
                    report.replies[code] = report.replies.get(code, 0) + 1
                for kind_, data_, want_ in pending:
                    if want_ is not None and want_ not in engine.call_ids:
                        report.surprise(
                            f"engine {kind_}: no Reply with call id {want_}: {_hex(data_)}"
                        )
            else:
                kinds = [k for k, _, _ in pending]
                if engine.eof.is_set():
                    report.closed += 1
                    why = await _culprit(
                        daemon, [(k, d) for k, d, _ in pending], pool_id, deadline_s
                    )
                    report.surprise(
                        f"engine connection closed by the daemon (seed {seed}) in a batch "
                        f"of {kinds}: {why}"
                    )
                else:
                    report.hang(
                        f"engine: {len(pending) - len(engine.replies)} of a batch unanswered "
                        f"after {deadline_s} s (seed {seed}): {kinds}"
                    )
                await engine.close()
                engine = await _registered_engine(daemon, pool_id, seed, deadline_s)
                report.connections += 1
            engine.replies.clear()
            engine.call_ids.clear()
            pending.clear()
    finally:
        await engine.close()


async def silent_engines(
    daemon: DaemonProc, report: FuzzReport, deadline_s: float, n: int = 4
) -> None:
    """Engine connections that never send a full first frame: closed by the daemon's
    first-frame timeout (`deadline_s` includes a margin)."""

    async def one(data: bytes) -> None:
        reader, writer = await asyncio.open_unix_connection(daemon.api_socket)
        try:
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(data)
                await writer.drain()
            report.connections += 1
            report.count("engine_silent")
            if await _until_closed(reader, deadline_s):
                report.closed += 1
            else:
                report.hang(f"silent engine sending {_hex(data)} still open after {deadline_s} s")
        finally:
            writer.close()

    partial = [b"", b"\x00", _HEADER.pack(64) + b"\x82"]
    await asyncio.gather(*(one(partial[i % len(partial)]) for i in range(n)))


# --- afterwards: a real transfer still verifies


async def verified_transfer(
    ctx: DaemonProc, gen: DaemonProc, request_id: str, tokens: int = 100, timeout_s: float = 30
) -> tuple[bool, str]:
    """One request from `ctx` to `gen` through fresh engines; (every byte verified, detail)."""
    from kvxferd.client import AsyncClient
    from kvxferd.sim.content import clear_blocks, fill_blocks, request_seed, verify_blocks

    layout = fuzz_layout(64)
    blocks = list(range(-(-tokens // layout.tokens_per_block)))
    regions: list[ShmRegion] = []
    clients: list[AsyncClient] = []
    try:
        for daemon in (ctx, gen):
            client = await AsyncClient.connect(daemon.api_socket, engine=f"verify-{daemon.name}")
            clients.append(client)
            region = ShmRegion.create(
                f"kvxferd-verify-{os.getpid()}-{daemon.name}", layout.pool_bytes
            )
            regions.append(region)
            try:
                await client.register_pool("verify", region.name, layout)
            finally:
                region.unlink()
        c, g = clients
        fill_blocks(regions[0].array, layout, blocks, request_seed(request_id))
        clear_blocks(regions[1].array, layout, blocks)
        await g.recv(request_id, "verify", blocks, ctx.peer_address, tokens)
        await c.send(request_id, "verify", blocks, tokens)
        got = await g.wait(request_id, timeout_s=timeout_s)
        sent = await c.wait(request_id, timeout_s=timeout_s)
        if (got.status, sent.status) != ("done", "done"):
            return False, f"recv {got.status}/{got.reason}: {got.message}; send {sent.status}"
        result = verify_blocks(regions[1].array, layout, blocks, request_seed(request_id), tokens)
        await g.release(request_id)
        await c.release(request_id)
        for client in clients:
            await client.deregister_pool("verify")
        if not result.ok or result.bytes_checked == 0:
            return False, f"content mismatch: {result.first_mismatch}"
        return True, f"{result.bytes_checked} bytes verified"
    finally:
        for client in clients:
            await client.close()
        for region in regions:
            region.close()


@dataclass
class LiveResult:
    reports: list[FuzzReport]
    crashed: list[str]
    tracebacks: dict[str, list[str]]
    forged: dict[str, list[str]]
    verified: bool
    verify_detail: str
    rss_before: dict[str, int]
    rss_after: dict[str, int]
    seconds: float

    @property
    def hung(self) -> int:
        return sum(r.hung for r in self.reports)

    def messages(self, prefix: str) -> int:
        return sum(r.messages for r in self.reports if r.name.startswith(prefix))

    @property
    def ok(self) -> bool:
        return (
            not self.crashed
            and not any(self.tracebacks.values())
            and self.hung == 0
            and self.verified
        )


async def run_live(
    ctx: DaemonProc,
    gen: DaemonProc,
    secret: bytes,
    agent: tuple[str, bytes],
    peer_messages: int,
    engine_messages: int,
    seed: int,
    preauth_share: float = 0.4,
    stall_deadline_s: float = 15.0,
    stolen: int = 0,
    progress: Callable[[str], Awaitable[None] | None] | None = None,
) -> LiveResult:
    """The whole live run: hostile peer messages to both daemons (a `preauth_share` of
    them before authentication, the rest on authenticated channels), `stolen` real sends
    asked for by the intruder with hostile addresses (fuzz_stolen_sends), hostile engine
    frames to both, slow-loris connections throughout; then a verified transfer, and the
    daemons' liveness, logs and memory."""
    started = time.monotonic()
    daemons = (ctx, gen)
    rss_before = {d.name: rss_bytes(d) for d in daemons}
    log_start = {d.name: len(d.log_text()) for d in daemons}
    agent_name, metadata = agent
    reports: list[FuzzReport] = []

    async def say(text: str) -> None:
        if progress is not None:
            out = progress(text)
            if out is not None:
                await out

    def split(total: int) -> Iterator[int]:
        half = total // 2
        yield half
        yield total - half

    stalls = FuzzReport("peer-stalled")
    silent = FuzzReport("engine-silent")
    slow = asyncio.gather(
        stalled_strangers(ctx, stalls, stall_deadline_s),
        silent_engines(gen, silent, stall_deadline_s),
    )
    # Each part has a seed of its own, derived from `seed`: a failure names the part, and
    # rerunning with the same seed replays it.
    for i, (daemon, n) in enumerate(zip(daemons, split(peer_messages), strict=True)):
        pre = int(n * preauth_share)
        report = FuzzReport(f"peer-preauth-{daemon.name}")
        reports.append(report)
        await fuzz_preauth(daemon, pre, seed * 10 + i, report)
        await say(f"{report.name}: {report.summary()}")
        report = FuzzReport(f"peer-postauth-{daemon.name}")
        reports.append(report)
        await fuzz_postauth(
            daemon, secret, metadata, agent_name, n - pre, seed * 10 + 2 + i, report
        )
        await say(f"{report.name}: {report.summary()}")
    if stolen:
        report = FuzzReport("peer-stolen-ctx")
        reports.append(report)
        await fuzz_stolen_sends(ctx, secret, metadata, agent_name, stolen, seed * 10 + 6, report)
        await say(f"{report.name}: {report.summary()}")
    for i, (daemon, n) in enumerate(zip(daemons, split(engine_messages), strict=True)):
        report = FuzzReport(f"engine-{daemon.name}")
        reports.append(report)
        await fuzz_engine(daemon, n, seed * 10 + 4 + i, report, peer_hint=ctx.peer_address)
        await say(f"{report.name}: {report.summary()}")
    await slow
    reports += [stalls, silent]
    crashed = [f"{d.name} exited with {d.proc.returncode}" for d in daemons if not d.alive()]
    verified, detail = False, "not tried: a daemon is gone"
    if not crashed:
        verified, detail = await verified_transfer(ctx, gen, f"after-fuzz-{seed}")
    texts = {d.name: d.log_text()[log_start[d.name] :] for d in daemons}
    return LiveResult(
        reports=reports,
        crashed=crashed,
        tracebacks={name: crash_lines(text) for name, text in texts.items()},
        forged={name: forged_lines(text) for name, text in texts.items()},
        verified=verified,
        verify_detail=detail,
        rss_before=rss_before,
        rss_after={d.name: rss_bytes(d) if d.alive() else 0 for d in daemons},
        seconds=time.monotonic() - started,
    )


__all__ = [
    "Bodies",
    "FuzzReport",
    "LiveResult",
    "Values",
    "crash_lines",
    "frame",
    "fuzz_engine",
    "fuzz_postauth",
    "fuzz_preauth",
    "message_types",
    "run_live",
    "verified_transfer",
]
