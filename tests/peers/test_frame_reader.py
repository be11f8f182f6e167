"""kvxferd.peers.framing.FrameReader on its own, over StreamReaders fed by hand: the same
frames, limits and errors as FrameCodec.read, however the bytes are cut as they arrive."""

from __future__ import annotations

import asyncio
import random
import struct
from typing import Any

import pytest
from framing_messages import CODEC, Blob, Message, Ping

from kvxferd.errors import ProtocolError
from kvxferd.peers.framing import MAX_FRAME_BYTES, FrameReader, FrameTooLargeError

DEADLINE_S = 10.0


def run_reader(chunks: list[bytes], eof: bool = True, **kw: Any) -> tuple[list[Any], Any]:
    """Feed `chunks` one loop turn apart to a FrameReader; (what each read gave back: a list
    of messages or None, the exception that ended the reads or None)."""

    async def scenario() -> tuple[list[Any], Any]:
        reader = asyncio.StreamReader()
        frames = CODEC.frames(reader)

        async def feed() -> None:
            for chunk in chunks:
                reader.feed_data(chunk)
                await asyncio.sleep(0)
            if eof:
                reader.feed_eof()

        feeder = asyncio.ensure_future(feed())
        reads: list[Any] = []
        try:
            while True:
                bodies = await frames.read(**kw)
                reads.append(None if bodies is None else [CODEC.decode(b) for b in bodies])
                if bodies is None:
                    return reads, None
        except ProtocolError as exc:
            return reads, exc
        finally:
            await feeder

    return asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))


def messages(reads: list[Any]) -> list[Any]:
    return [m for r in reads if r is not None for m in r]


def cut(data: bytes, rng: random.Random) -> list[bytes]:
    """`data` in pieces of random sizes, some a single byte, some several frames long."""
    out, at = [], 0
    while at < len(data):
        n = rng.choice([1, 2, 3, 5, 17, 100, 4096, 70_000])
        out.append(data[at : at + n])
        at += n
    return out


MSGS: list[Message] = [Ping(i) if i % 3 else Blob(bytes([i]) * (i * 997)) for i in range(60)]
STREAM = b"".join(CODEC.encode(m) for m in MSGS)


@pytest.mark.parametrize("seed", range(8))
def test_every_frame_arrives_once_in_order_however_the_bytes_are_cut(seed: int) -> None:
    reads, error = run_reader(cut(STREAM, random.Random(seed)))
    assert error is None
    assert messages(reads) == MSGS
    assert reads[-1] is None  # the clean end, once
    assert all(r for r in reads[:-1])  # never an empty batch


def test_frames_that_arrived_together_come_back_together() -> None:
    some = MSGS[:20]
    data = b"".join(CODEC.encode(m) for m in some)
    assert len(data) < FrameReader.CHUNK_BYTES
    reads, _ = run_reader([data])
    assert reads == [some, None]


def test_a_clean_end_between_frames_is_none() -> None:
    assert run_reader([]) == ([None], None)


@pytest.mark.parametrize("cut_at", [1, 2, 3])
def test_a_truncated_header_is_an_error_after_the_frames_before_it(cut_at: int) -> None:
    frame = CODEC.encode(Ping(1))
    reads, error = run_reader([frame + frame[:cut_at]])
    assert messages(reads) == [Ping(1)]
    assert isinstance(error, ProtocolError)
    assert str(error) == "truncated test frame header"


@pytest.mark.parametrize("chunks", [1, 3])
def test_a_truncated_body_names_what_arrived(chunks: int) -> None:
    frame = CODEC.encode(Blob(b"y" * 20_000))
    length = len(frame) - 4
    data = frame[:-7]
    step = -(-len(data) // chunks)
    _, error = run_reader([data[i : i + step] for i in range(0, len(data), step)])
    assert str(error) == f"truncated test frame: {length - 7} of {length} bytes"


def test_a_frame_over_the_limit_ends_the_reads_after_the_frames_before_it() -> None:
    big = CODEC.encode(Blob(b"z" * 100))
    length = len(big) - 4
    before = CODEC.encode(Ping(5))
    # Only the oversize frame's header arrives: its body is never waited for.
    reads, error = run_reader([before + big[:4]], eof=False, max_bytes=length - 1)
    assert reads == [[Ping(5)]]
    assert isinstance(error, FrameTooLargeError)
    assert (error.length, error.limit) == (length, length - 1)
    assert str(error) == f"test frame of {length} bytes exceeds the {length - 1}-byte limit"


def test_the_error_stays_once_found() -> None:
    async def scenario() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(struct.pack(">I", MAX_FRAME_BYTES + 1))
        frames = FrameReader(reader, "test")
        for _ in range(2):
            with pytest.raises(FrameTooLargeError):
                await frames.read()

    asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))


def test_a_frame_longer_than_a_read_is_awaited_whole() -> None:
    """A body several reads long (past CHUNK_BYTES) comes back whole, with the frames after
    it."""
    big = Blob(b"\x07" * (3 * FrameReader.CHUNK_BYTES + 11))
    data = CODEC.encode(Ping(1)) + CODEC.encode(big) + CODEC.encode(Ping(2))
    reads, error = run_reader(cut(data, random.Random(1)))
    assert error is None
    assert messages(reads) == [Ping(1), big, Ping(2)]


def test_a_frame_of_exactly_the_limit_is_waited_for_not_refused() -> None:
    async def scenario() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(struct.pack(">I", MAX_FRAME_BYTES))
        read = asyncio.ensure_future(FrameReader(reader, "test").read())
        for _ in range(3):
            await asyncio.sleep(0)
        assert not read.done()
        read.cancel()

    asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
