"""kvxferd.peers.framing on its own: CorkedWriter over a recording writer, FrameCodec over
StreamReaders fed by hand (no sockets, no daemons).

Covers the corked writer's flush on the next loop iteration and at FLUSH_AT_BYTES, its
write-failure path (the connection marked unusable, later writes and drains refused), the
back-pressure threshold, close's abort of a transport that keeps data; and the reader's
distinction between a clean end of stream, a truncated header and a truncated body.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import pytest
from framing_messages import CODEC, Blob, Ping

from kvxferd.errors import MalformedMessageError, ProtocolError
from kvxferd.peers import framing
from kvxferd.peers.framing import (
    MAX_FRAME_BYTES,
    PREAUTH_MAX_FRAME_BYTES,
    CorkedWriter,
    FrameCodec,
    FrameTooLargeError,
)

T = TypeVar("T")
DEADLINE_S = 10.0


class FakeTransport:
    def __init__(self, buffered: int = 0, high: int = 100) -> None:
        self.buffered = buffered
        self.high = high
        self.aborted = 0

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return (self.high // 4, self.high)

    def abort(self) -> None:
        self.aborted += 1


class FakeWriter:
    """Records every write; `fail_with` makes the next write raise."""

    def __init__(self, transport: FakeTransport | None = None) -> None:
        self.transport = transport or FakeTransport()
        self.writes: list[bytes] = []
        self.fail_with: BaseException | None = None
        self.drains = 0
        self.closed = 0

    def write(self, data: bytes) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.writes.append(data)

    async def drain(self) -> None:
        self.drains += 1

    def close(self) -> None:
        self.closed += 1


def run(scenario: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))  # type: ignore[arg-type]


async def next_iteration() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def corked(
    transport: FakeTransport | None = None, fail_with: BaseException | None = None
) -> tuple[CorkedWriter, FakeWriter]:
    """A CorkedWriter over a FakeWriter whose writes raise `fail_with`, where given."""
    fake = FakeWriter(transport)
    fake.fail_with = fail_with
    return CorkedWriter(fake), fake  # type: ignore[arg-type]


# -- CorkedWriter ----------------------------------------------------------------------------


def test_frames_of_one_iteration_leave_in_one_write_in_order() -> None:
    async def scenario() -> None:
        out, fake = corked()
        for frame in (b"a", b"bc", b"def"):
            out.write(frame)
        assert fake.writes == []  # nothing yet: corked until the next iteration
        await next_iteration()
        assert fake.writes == [b"abcdef"]
        out.write(b"g")  # a new iteration schedules a new flush
        await next_iteration()
        assert fake.writes == [b"abcdef", b"g"]
        await next_iteration()
        assert fake.writes == [b"abcdef", b"g"]  # an idle flush writes nothing

    run(scenario)


def test_one_flush_is_scheduled_per_iteration() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        scheduled: list[object] = []
        call_soon = loop.call_soon

        def counting_call_soon(callback: Any, *args: Any, **kw: Any) -> asyncio.Handle:
            scheduled.append(callback)
            return call_soon(callback, *args, **kw)

        loop.call_soon = counting_call_soon  # type: ignore[method-assign]
        try:
            out, fake = corked()
            for frame in (b"a", b"b", b"c"):
                out.write(frame)
            flushes = [cb for cb in scheduled if cb == out._flush_after]
            assert len(flushes) == 1
            await next_iteration()
            out.write(b"d")
            assert len([cb for cb in scheduled if cb == out._flush_after]) == 2
            await next_iteration()
            assert fake.writes == [b"abc", b"d"]
        finally:
            del loop.call_soon

    run(scenario)


def test_a_single_frame_is_written_as_it_is() -> None:
    async def scenario() -> None:
        out, fake = corked()
        frame = b"x" * 10
        out.write(frame)
        out.flush()
        assert fake.writes == [frame] and fake.writes[0] is frame
        out.flush()
        assert fake.writes == [frame]

    run(scenario)


def test_the_buffer_flushes_at_once_when_it_reaches_the_threshold() -> None:
    async def scenario() -> None:
        out, fake = corked()
        limit = CorkedWriter.FLUSH_AT_BYTES
        out.write(b"a" * (limit - 1))
        assert fake.writes == []  # one byte short: still corked
        out.write(b"b")
        assert fake.writes == [b"a" * (limit - 1) + b"b"]  # exactly the threshold: at once
        out.write(b"c" * (limit - 1))  # the count restarted from zero: one byte short again
        assert len(fake.writes) == 1
        out.write(b"c")
        assert fake.writes[1:] == [b"c" * limit]
        out.write(b"e" * 10)
        await next_iteration()
        assert fake.writes[2:] == [b"e" * 10]
        out.write(b"d" * (2 * limit))  # one frame over the threshold alone
        assert fake.writes[3:] == [b"d" * (2 * limit)]

    assert CorkedWriter.FLUSH_AT_BYTES == 256 << 10

    run(scenario)


def test_a_writer_that_yields_flushes_after_another_writers_frames() -> None:
    # The engine API's writer yields a turn. A daemon reads a send, starts its task and
    # writes the reply; the next turn the task writes the Result to the peer and the
    # outcome to the engine. The Result leaves first, then reply and outcome in one write.
    # Without the yield the reply would leave alone, before the Result.
    async def scenario(yield_turns: int) -> list[str]:
        order: list[str] = []
        peer, peer_fake = corked()
        engine, engine_fake = corked()
        engine.yield_turns = yield_turns
        peer_fake.write = lambda data: order.append(f"peer:{data.decode()}")  # type: ignore[method-assign]
        engine_fake.write = lambda data: order.append(f"engine:{data.decode()}")  # type: ignore[method-assign]

        def task_step() -> None:
            peer.write(b"result")
            engine.write(b"outcome")

        asyncio.get_running_loop().call_soon(task_step)  # created before the reply
        engine.write(b"reply")
        for _ in range(4):
            await next_iteration()
        return order

    assert run(lambda: scenario(1)) == ["peer:result", "engine:replyoutcome"]
    assert run(lambda: scenario(0)) == ["engine:replyoutcome", "peer:result"]


def test_the_buffer_flushes_at_once_every_few_frames() -> None:
    # A whole loop turn's frames in one write make the processes take turns (a convoy):
    # every FLUSH_AT_FRAMES frames go out at once, the rest at the next iteration.
    async def scenario() -> None:
        out, fake = corked()
        n = CorkedWriter.FLUSH_AT_FRAMES
        frames = [bytes([65 + i % 26]) for i in range(2 * n + 3)]
        for i, frame in enumerate(frames):
            out.write(frame)
            assert len(fake.writes) == (i + 1) // n
        assert fake.writes == [b"".join(frames[:n]), b"".join(frames[n : 2 * n])]
        await next_iteration()
        assert fake.writes[2:] == [b"".join(frames[2 * n :])]

    assert 1 < CorkedWriter.FLUSH_AT_FRAMES <= 32
    run(scenario)


def test_a_write_failure_makes_the_connection_unusable() -> None:
    async def scenario() -> None:
        out, fake = corked(fail_with=BrokenPipeError("peer gone"))
        out.write(b"lost")
        assert out.failed is None
        await next_iteration()  # the scheduled flush hits the failure
        assert isinstance(out.failed, BrokenPipeError)
        with pytest.raises(ConnectionResetError, match="connection unusable: peer gone"):
            out.write(b"more")
        with pytest.raises(ConnectionResetError, match="connection unusable"):
            await out.drain()
        assert fake.writes == []

    run(scenario)


@pytest.mark.parametrize(
    "exc", [ConnectionResetError("reset"), OSError("os"), RuntimeError("closed loop")]
)
def test_each_kind_of_write_failure_is_caught(exc: BaseException) -> None:
    async def scenario() -> None:
        out, _ = corked(fail_with=exc)
        out.write(b"x" * CorkedWriter.FLUSH_AT_BYTES)  # flushes inside write: no raise
        assert out.failed is exc

    run(scenario)


def test_a_failed_flush_drops_its_frames_and_resets_the_buffer() -> None:
    async def scenario() -> None:
        out, fake = corked(fail_with=OSError("x"))
        out.write(b"a")
        out.write(b"b")
        out.flush()
        assert out.failed is not None
        fake.fail_with = None
        out.failed = None  # as if a new connection: nothing of the old frames is left
        out.write(b"c")
        out.flush()
        assert fake.writes == [b"c"]

    run(scenario)


def test_drain_waits_only_over_the_high_water_mark() -> None:
    async def scenario() -> None:
        transport = FakeTransport(buffered=100, high=100)
        out, fake = corked(transport)
        out.write(b"q")
        await out.drain()  # at the mark, not over: no wait, no early flush
        assert fake.drains == 0 and fake.writes == []
        transport.buffered = 101
        await out.drain()
        assert fake.drains == 1
        assert fake.writes == [b"q"]  # flushed before waiting

    run(scenario)


def test_close_flushes_and_aborts_only_a_transport_that_keeps_data() -> None:
    async def scenario() -> None:
        out, fake = corked(FakeTransport(buffered=0))
        out.ABORT_GRACE_S = 0.0
        out.write(b"bye")
        out.close()
        assert fake.writes == [b"bye"] and fake.closed == 1
        await next_iteration()
        assert fake.transport.aborted == 0

        stuck = FakeTransport(buffered=1)
        out, fake = corked(stuck)
        out.ABORT_GRACE_S = 0.0
        out.close()
        assert fake.closed == 1 and stuck.aborted == 0  # not at once: after the grace
        await asyncio.sleep(0.05)
        assert stuck.aborted == 1

    run(scenario)


def test_close_gives_the_peer_a_grace_period_first() -> None:
    async def scenario() -> None:
        stuck = FakeTransport(buffered=1)
        out, _fake = corked(stuck)
        out.close()  # ABORT_GRACE_S = 1.0
        await asyncio.sleep(0.05)
        assert stuck.aborted == 0

    assert CorkedWriter.ABORT_GRACE_S == 1.0
    run(scenario)


# -- FrameCodec ------------------------------------------------------------------------------


def reader_with(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def read_all(data: bytes, **kw: Any) -> list[Any]:
    async def scenario() -> list[Any]:
        reader = reader_with(data)
        out: list[Any] = []
        while (msg := await CODEC.read(reader, **kw)) is not None:
            out.append(msg)
        return out

    return run(scenario)


def test_encode_is_a_big_endian_length_and_the_body() -> None:
    frame = CODEC.encode(Ping(7))
    body = msgspec.msgpack.encode(Ping(7))
    assert frame == struct.pack(">I", len(body)) + body
    assert CODEC.decode(frame[4:]) == Ping(7)


def test_frames_round_trip_and_a_clean_end_is_none() -> None:
    msgs = [Ping(1), Blob(b"x" * 300), Ping(-5)]
    assert read_all(b"".join(CODEC.encode(m) for m in msgs)) == msgs
    assert read_all(b"") == []


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_a_truncated_header_is_a_protocol_error_not_an_end(cut: int) -> None:
    frame = CODEC.encode(Ping(1))
    with pytest.raises(ProtocolError, match="truncated test frame header"):
        read_all(frame + frame[:cut])


@pytest.mark.parametrize("missing", [1, 5])
def test_a_truncated_body_names_what_arrived(missing: int) -> None:
    frame = CODEC.encode(Blob(b"y" * 20))
    length = len(frame) - 4
    with pytest.raises(
        ProtocolError, match=rf"^truncated test frame: {length - missing} of {length} bytes$"
    ):
        read_all(frame[:-missing])


def test_an_empty_frame_header_with_no_body_is_malformed() -> None:
    with pytest.raises(MalformedMessageError):
        read_all(struct.pack(">I", 0))


def test_the_length_limit_is_checked_before_the_body() -> None:
    frame = CODEC.encode(Blob(b"z" * 100))
    length = len(frame) - 4
    assert read_all(frame, max_bytes=length) == [Blob(b"z" * 100)]  # exactly at the limit
    with pytest.raises(FrameTooLargeError) as info:
        read_all(frame[:4], max_bytes=length - 1)  # only the header: the body is not awaited
    err = info.value
    assert (err.length, err.limit) == (length, length - 1)
    assert str(err) == f"test frame of {length} bytes exceeds the {length - 1}-byte limit"
    assert isinstance(err, ProtocolError)


def test_the_default_limit_is_max_frame_bytes() -> None:
    header = struct.pack(">I", MAX_FRAME_BYTES + 1)
    with pytest.raises(FrameTooLargeError) as info:
        read_all(header)
    assert info.value.limit == MAX_FRAME_BYTES == 16 << 20
    assert PREAUTH_MAX_FRAME_BYTES == 64 << 10


def test_a_frame_of_exactly_the_default_limit_is_read() -> None:
    async def scenario() -> int:
        reader = reader_with(struct.pack(">I", MAX_FRAME_BYTES), eof=False)
        read = asyncio.ensure_future(CODEC.read(reader))
        await next_iteration()
        assert not read.done()  # waiting for the body, not refused
        read.cancel()
        return 0

    run(scenario)


def test_encode_refuses_a_body_over_the_limit() -> None:
    overhead = len(msgspec.msgpack.encode(Blob(b"\0" * 70_000))) - 70_000
    at_limit = Blob(b"\0" * (MAX_FRAME_BYTES - overhead))
    frame = CODEC.encode(at_limit)
    assert len(frame) == MAX_FRAME_BYTES + 4
    with pytest.raises(ProtocolError, match=r"^test message too large: 16777217 bytes$"):
        CODEC.encode(Blob(b"\0" * (MAX_FRAME_BYTES - overhead + 1)))


def test_a_body_that_does_not_decode_is_malformed_with_the_body_kept() -> None:
    for body in (
        b"\xc1",
        msgspec.msgpack.encode({"type": "nope"}),
        msgspec.msgpack.encode({"type": "ping", "n": "x"}),
    ):
        with pytest.raises(MalformedMessageError, match=r"^malformed test message: ") as info:
            CODEC.decode(body)
        assert info.value.body == body


def test_a_value_nested_too_deep_is_malformed() -> None:
    deep = b"\x91" * 200_000 + b"\xc0"
    codec: FrameCodec[Any] = FrameCodec(Any, "deep")  # type: ignore[arg-type]
    with pytest.raises(MalformedMessageError, match="nested too deeply to decode") as info:
        codec.decode(deep)
    assert info.value.body == deep


def test_the_header_is_four_bytes() -> None:
    assert framing._HEADER.size == 4
