"""Hostile frame bodies for one message union: garbage, mutated valid messages, wrong
field types, deep nesting, lying length headers, odd top-level values (issue 14)."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable

import msgspec

from kvxferd.peers.framing import PREAUTH_MAX_FRAME_BYTES
from kvxferd.sim.hostile.values import INTS, STRINGS, Values, fields_of, message_types, tag_of

HEADER = struct.Struct(">I")


def frame(body: bytes) -> bytes:
    """A length-prefixed frame around any body (the codecs' own framing, minus checks)."""
    return HEADER.pack(len(body)) + body


def _wrong_kind(rng: random.Random) -> bytes:
    """One encoded msgpack value of a random kind (a field's wrong type)."""
    enc = msgspec.msgpack.encode
    return rng.choice(
        (
            lambda: enc(rng.choice(INTS)),
            lambda: enc(rng.choice(STRINGS)),
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
                lambda: enc(self.rng.choice(INTS)),
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
