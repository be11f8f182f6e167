"""Property-based fuzzing of the frame codec and of both message schemas (issue 14).

Whatever bytes arrive, a decoder gives a message of its union or kvxferd's own protocol
error (ProtocolError; MalformedMessageError when the frame boundary held), never another
exception (RecursionError, ValueError, UnicodeDecodeError, OverflowError, MemoryError...),
and it never takes a frame over the connection's limit. Every message type of the peer,
engine and daemon unions round-trips; the strategies are built from the schemas
themselves (msgspec.inspect), so a message type added later is covered without a change
here. The live counterpart (real daemons) is tests/daemon/test_live_fuzz.py.
"""

from __future__ import annotations

import asyncio
import math
import random
import struct
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxferd.api.messages import DAEMON_CODEC, ENGINE_CODEC, DaemonMessage, EngineMessage
from kvxferd.errors import MalformedMessageError, ProtocolError
from kvxferd.peers.framing import (
    MAX_FRAME_BYTES,
    PREAUTH_MAX_FRAME_BYTES,
    FrameCodec,
    FrameTooLargeError,
)
from kvxferd.peers.messages import PEER_CODEC, PeerMessage
from kvxferd.sim.hostile import Bodies, frame, message_types

CODECS: list[tuple[str, FrameCodec[Any], object]] = [
    ("peer", PEER_CODEC, PeerMessage),
    ("engine", ENGINE_CODEC, EngineMessage),
    ("daemon", DAEMON_CODEC, DaemonMessage),
]
CODEC_IDS = [name for name, _, _ in CODECS]
ALL_TYPES = [(name, cls) for name, _, union in CODECS for cls in message_types(union)]

# Bounded so that the file runs in well under 30 s on a small CI host.
FUZZ = settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Each example of these runs several generated bodies (of up to 150 KB: the deep ones).
HOSTILE = settings(FUZZ, max_examples=100)

# A stream's bytes: well-framed garbage, anything (frame boundaries included), bare
# length prefixes, in any order.
STREAMS = st.lists(
    st.one_of(
        st.binary(max_size=64).map(frame),
        st.binary(max_size=96),
        st.integers(0, 2**32 - 1).map(lambda n: struct.pack(">I", n)),
    ),
    max_size=6,
).map(b"".join)


def _decode(codec: FrameCodec[Any], union: object, body: bytes) -> None:
    """Decode `body`: a message of the union, or MalformedMessageError; anything else fails
    the test (pytest reports the stray exception with the body that raised it)."""
    try:
        msg = codec.decode(body)
    except MalformedMessageError as exc:
        assert str(exc), "a protocol error must say what was wrong"
        assert exc.body == body
        return
    assert isinstance(msg, tuple(message_types(union))), msg


def _read(codec: FrameCodec[Any], data: bytes, max_bytes: int) -> list[object]:
    """Every frame of `data` read off a stream that then ends, with the limit `max_bytes`:
    the messages up to a clean end of stream or a ProtocolError, which must stop reading
    at once. A frame over the limit is refused on its prefix, before its body is taken."""

    async def run() -> list[object]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        got: list[object] = []
        offset = 0
        while True:
            try:
                msg = await asyncio.wait_for(codec.read(reader, max_bytes), 5)
            except FrameTooLargeError as exc:
                (length,) = struct.unpack_from(">I", data, offset)
                assert exc.length == length > max_bytes == exc.limit
                return got
            except MalformedMessageError:
                # The frame boundary held: the next frame starts right after this one.
                (length,) = struct.unpack_from(">I", data, offset)
                offset += 4 + length
                got.append(None)
                continue
            except ProtocolError:
                return got  # truncated: the stream ends here
            if msg is None:
                assert offset == len(data), "a clean end of stream only between frames"
                return got
            (length,) = struct.unpack_from(">I", data, offset)
            assert length <= max_bytes
            offset += 4 + length
            got.append(msg)

    return asyncio.run(run())


# ----------------------------------------------------------------- (a) arbitrary input


@pytest.mark.parametrize(("name", "codec", "union"), CODECS, ids=CODEC_IDS)
@FUZZ
@given(body=st.binary(max_size=512))
def test_arbitrary_bytes_decode_or_raise_a_protocol_error(
    name: str, codec: FrameCodec[Any], union: object, body: bytes
) -> None:
    _decode(codec, union, body)


@pytest.mark.parametrize(("name", "codec", "union"), CODECS, ids=CODEC_IDS)
@FUZZ
@given(
    data=STREAMS,
    max_bytes=st.sampled_from([64, PREAUTH_MAX_FRAME_BYTES, MAX_FRAME_BYTES]),
)
def test_arbitrary_streams_give_messages_or_a_protocol_error_within_the_limit(
    name: str, codec: FrameCodec[Any], union: object, data: bytes, max_bytes: int
) -> None:
    for msg in _read(codec, data, max_bytes):
        assert msg is None or isinstance(msg, tuple(message_types(union)))


def test_a_message_over_the_frame_limit_is_refused_by_the_encoder() -> None:
    from kvxferd.peers.messages import Auth

    with pytest.raises(ProtocolError, match="too large"):
        PEER_CODEC.encode(Auth(proof=b"\0" * (MAX_FRAME_BYTES + 1)))


# ------------------------------------------------------- (b) round trips of every type


def _free_values() -> st.SearchStrategy[object]:
    """What a field typed `object` holds after a decode (msgpack's own types)."""
    leaves = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(allow_nan=False),
        st.text(max_size=20),
        st.binary(max_size=20),
    )
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=12,
    )


def strategy_for(t: mi.Type) -> st.SearchStrategy[Any]:
    """Valid values of schema type `t`. A type this does not know fails the test, naming
    it: teach it here rather than leave a new message uncovered."""
    if isinstance(t, mi.IntType):
        return st.integers(-(2**63), 2**64 - 1)
    if isinstance(t, mi.StrType):
        return st.text(max_size=40)
    if isinstance(t, mi.BytesType):
        return st.binary(max_size=40)
    if isinstance(t, mi.BoolType):
        return st.booleans()
    if isinstance(t, mi.FloatType):
        return st.floats(allow_nan=False)
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.UnionType):
        return st.one_of(*(strategy_for(u) for u in t.types))
    if isinstance(t, mi.ListType):
        return st.lists(strategy_for(t.item_type), max_size=6)
    if isinstance(t, mi.DictType):
        return st.dictionaries(strategy_for(t.key_type), strategy_for(t.value_type), max_size=4)
    if isinstance(t, (mi.AnyType, mi.CustomType)):
        return _free_values()
    if isinstance(t, mi.StructType):
        return struct_strategy(t.cls)
    raise AssertionError(f"no strategy for schema type {t!r}: add one to strategy_for")


def struct_strategy(cls: type[msgspec.Struct]) -> st.SearchStrategy[msgspec.Struct]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    required = {f.name: strategy_for(f.type) for f in info.fields if f.required}
    optional = {f.name: strategy_for(f.type) for f in info.fields if not f.required}
    return st.fixed_dictionaries(required, optional=optional).map(lambda kw: cls(**kw))


def test_every_message_type_of_every_union_is_covered() -> None:
    """The unions hold the types the daemon dispatches on; each has a strategy."""
    assert len(ALL_TYPES) >= 16 + 9 + 4
    for _, cls in ALL_TYPES:
        strategy_for(mi.type_info(cls))


def _same(a: object, b: object) -> bool:
    """Equality that also holds for -0.0/0.0 and tuples decoded as lists."""
    if isinstance(a, msgspec.Struct):
        return type(a) is type(b) and all(
            _same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__
        )
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize(
    ("union_name", "cls"), ALL_TYPES, ids=[f"{n}-{c.__name__}" for n, c in ALL_TYPES]
)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_type_round_trips(
    union_name: str, cls: type[msgspec.Struct], data: st.DataObject
) -> None:
    codec = {name: codec for name, codec, _ in CODECS}[union_name]
    msg = data.draw(struct_strategy(cls))
    encoded = codec.encode(msg)
    (length,) = struct.unpack_from(">I", encoded)
    assert length == len(encoded) - 4
    back = codec.decode(encoded[4:])
    assert _same(msg, back), (msg, back)


# ------------------------------------------------- (c) mutated and hostile valid frames


@pytest.mark.parametrize(("name", "codec", "union"), CODECS, ids=CODEC_IDS)
@HOSTILE
@given(rng=st.randoms(use_true_random=False))
def test_hostile_bodies_decode_or_raise_a_protocol_error(
    name: str, codec: FrameCodec[Any], union: object, rng: random.Random
) -> None:
    """Bit flips, truncations, splices, wrong field types, values nested 50,000 deep,
    str/bin/array/map headers announcing 4 GiB, odd top-level values and trailing bytes
    (kvxferd.sim.hostile, the generators the live fuzzer sends to real daemons)."""
    bodies = Bodies(union, rng, max_str=1024)
    for _ in range(10):
        _, body = bodies.any()
        _decode(codec, union, body)


@pytest.mark.parametrize(("name", "codec", "union"), CODECS, ids=CODEC_IDS)
@HOSTILE
@given(rng=st.randoms(use_true_random=False), cut=st.integers(0, 2**32 - 1))
def test_mutated_frames_on_a_stream(
    name: str, codec: FrameCodec[Any], union: object, rng: random.Random, cut: int
) -> None:
    """Hostile frames back to back on one stream, one with a lying length prefix: each
    well-framed one is a message or a malformed one that leaves the stream usable; the
    liar ends the stream with a protocol error (truncated, or over the limit)."""
    bodies = Bodies(union, rng, max_str=1024)
    frames = [frame(bodies.any()[1]) for _ in range(4)]
    liar = struct.pack(">I", cut) + bodies.any()[1]
    data = b"".join(frames) + liar
    got = _read(codec, data, MAX_FRAME_BYTES)
    assert len(got) >= len(frames)  # the well-framed ones are all read before the liar


@pytest.mark.parametrize(("name", "codec", "union"), CODECS, ids=CODEC_IDS)
@pytest.mark.parametrize("depth", [1_000, 100_000, 1_000_000])
def test_deep_nesting_anywhere_is_a_malformed_message(
    name: str, codec: FrameCodec[Any], union: object, depth: int
) -> None:
    """Nesting at the top, and in every field of every message type (typed or free-form)."""
    enc = msgspec.msgpack.encode
    for nest in (b"\x91" * depth + b"\xc0", b"\x81\xa1a" * depth + b"\xc0"):
        with pytest.raises(MalformedMessageError):
            codec.decode(nest)
        for cls in message_types(union):
            info = mi.type_info(cls)
            assert isinstance(info, mi.StructType) and isinstance(info.tag, str)
            head = b"\x82" + enc("type") + enc(info.tag)
            for f in info.fields:
                _decode(codec, union, head + enc(f.encode_name) + nest)


def _outcomes_exact(codec: FrameCodec[Any], data: bytes, max_bytes: int) -> list[object]:
    """What FrameCodec.read makes of `data`: each frame's message or "malformed", then how
    the stream ended ("end", or the ProtocolError's class and text)."""

    async def run() -> list[object]:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        out: list[object] = []
        while True:
            try:
                msg = await asyncio.wait_for(codec.read(reader, max_bytes), 5)
            except MalformedMessageError:
                out.append("malformed")
                continue
            except ProtocolError as exc:
                return [*out, (type(exc).__name__, str(exc))]
            if msg is None:
                return [*out, "end"]
            out.append(msg)

    return asyncio.run(run())


def _outcomes_bulk(codec: FrameCodec[Any], chunks: list[bytes], max_bytes: int) -> list[object]:
    """The same through FrameReader, the bytes arriving as `chunks` a loop turn apart."""

    async def run() -> list[object]:
        reader = asyncio.StreamReader()

        async def feed() -> None:
            for chunk in chunks:
                reader.feed_data(chunk)
                await asyncio.sleep(0)
            reader.feed_eof()

        feeder = asyncio.ensure_future(feed())
        frames = codec.frames(reader)
        out: list[object] = []
        try:
            while True:
                try:
                    bodies = await asyncio.wait_for(frames.read(max_bytes), 5)
                except ProtocolError as exc:
                    return [*out, (type(exc).__name__, str(exc))]
                if bodies is None:
                    return [*out, "end"]
                assert bodies, "a read gives at least one frame"
                for body in bodies:
                    try:
                        out.append(codec.decode(body))
                    except MalformedMessageError:
                        out.append("malformed")
        finally:
            await feeder

    return asyncio.run(run())


@pytest.mark.parametrize(("name", "codec", "union"), CODECS, ids=CODEC_IDS)
@FUZZ
@given(
    data=STREAMS,
    cuts=st.lists(st.integers(1, 64), max_size=8),
    max_bytes=st.sampled_from([64, PREAUTH_MAX_FRAME_BYTES, MAX_FRAME_BYTES]),
)
def test_bulk_reads_give_what_exact_reads_give(
    name: str, codec: FrameCodec[Any], union: object, data: bytes, cuts: list[int], max_bytes: int
) -> None:
    """FrameReader (the read loops' way) against FrameCodec.read (the handshake's) on the
    same hostile stream, however it is cut as it arrives: the same messages, the same
    malformed frames, the same end (clean, or the same protocol error and words)."""
    chunks, at = [], 0
    for n in cuts:
        chunks.append(data[at : at + n])
        at += n
    chunks.append(data[at:])
    assert _outcomes_bulk(codec, chunks, max_bytes) == _outcomes_exact(codec, data, max_bytes)
