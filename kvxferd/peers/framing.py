"""Length-prefixed msgpack frames over asyncio streams.

Used by both the peer channel (TCP) and the engine API (Unix socket). A frame is
a 4-byte big-endian length followed by a msgpack map decoded by msgspec into a
typed Struct by field name. Nothing is ever decoded with pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import Callable
from typing import ClassVar, Generic, TypeVar

import msgspec

from kvxferd.errors import MalformedMessageError, ProtocolError

_HEADER = struct.Struct(">I")

# Large enough for NIXL agent metadata and block lists of long prompts; small
# enough that a hostile length prefix cannot make us allocate gigabytes.
MAX_FRAME_BYTES = 16 << 20

# Until a peer has proved the shared secret it may only send Hello, Challenge, Auth or
# Refused. Measured at the largest identity the handshake accepts (128-character name,
# 64-character incarnation, 32-byte nonce and proof): Hello 294 bytes, Challenge 338,
# Auth 55, a version Refused naming a 255-character host 353. The NIXL agent metadata
# (measured 339 bytes bare, 591 with 4 registered regions, UCX on loopback; with RDMA
# devices it can reach tens of KiB) and the pools travel in Info (1.8 KiB with those 4
# regions as pools), which each side sends only after the other proved the secret,
# under MAX_FRAME_BYTES. 64 KiB is ~180x the largest legitimate
# pre-authentication frame (room for a later protocol version's Hello, which must still
# decode to be refused by version) and no more than asyncio's own StreamReader buffer
# limit, so an unauthenticated peer makes us hold at most that much of a frame body.
PREAUTH_MAX_FRAME_BYTES = 64 << 10

T = TypeVar("T")


class FrameTooLargeError(ProtocolError):
    """A length prefix over the limit of the connection's state; the body was not read."""

    def __init__(self, message: str, length: int, limit: int) -> None:
        super().__init__(message)
        self.length = length
        self.limit = limit


def _too_large(what: str, length: int, limit: int) -> FrameTooLargeError:
    return FrameTooLargeError(
        f"{what} frame of {length} bytes exceeds the {limit}-byte limit", length, limit
    )


def _truncated(what: str, partial: bytes) -> ProtocolError:
    """A stream that ended inside a frame: `partial` is what arrived of it, header first."""
    if len(partial) < _HEADER.size:
        return ProtocolError(f"truncated {what} frame header")
    (length,) = _HEADER.unpack_from(partial)
    got = len(partial) - _HEADER.size
    return ProtocolError(f"truncated {what} frame: {got} of {length} bytes")


class CorkedWriter:
    """Batches the frames written during one event-loop iteration into one socket write.

    At thousands of requests a second each reply, outcome and peer message would
    otherwise cost its own send() syscall. Frames keep their order; `flush` runs
    on the next loop iteration, or at once when the buffer grows large or holds
    FLUSH_AT_FRAMES frames.

    Why not the whole iteration's frames, however many: an engine and its daemon, and the
    two daemons, then pass their requests on in one batch each, and the batch travels
    from process to process with the others idle (a convoy). With 32 one-block requests
    in flight the four processes of kvxferd bench --small kept 1.3 of 2 cores busy; with
    a write per 8 frames 1.8, and moved ~20 % more requests for ~5 % more CPU each
    (docs/benchmarks.md, issue 16 "small requests").
    """

    # Constants of the class, not fields of each writer: mypyc compiles the module only
    # when they say so (benchmarks/issue16_mypyc.sh).
    FLUSH_AT_BYTES: ClassVar[int] = 256 << 10
    FLUSH_AT_FRAMES: ClassVar[int] = 8
    ABORT_GRACE_S: ClassVar[float] = 1.0

    def __init__(self, writer: asyncio.StreamWriter, yield_turns: int = 0) -> None:
        """`yield_turns`: loop turns the scheduled flush waits beyond the next one, so that
        what other connections write meanwhile leaves first."""
        self.writer = writer
        self.yield_turns = yield_turns
        self._buf: list[bytes] = []
        self._size = 0
        self._scheduled = False
        self.failed: BaseException | None = None

    def write(self, frame: bytes) -> None:
        if self.failed is not None:
            raise ConnectionResetError(f"connection unusable: {self.failed}")
        self._buf.append(frame)
        self._size += len(frame)
        if self._size >= self.FLUSH_AT_BYTES or len(self._buf) >= self.FLUSH_AT_FRAMES:
            self.flush()
        elif not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_after, self.yield_turns)

    def _flush_after(self, turns: int) -> None:
        if turns > 0:
            asyncio.get_running_loop().call_soon(self._flush_after, turns - 1)
        else:
            self.flush()

    def flush(self) -> None:
        self._scheduled = False
        if not self._buf:
            return
        data = self._buf[0] if len(self._buf) == 1 else b"".join(self._buf)
        self._buf.clear()
        self._size = 0
        try:
            self.writer.write(data)
        except (ConnectionError, OSError, RuntimeError) as exc:
            self.failed = exc

    async def drain(self) -> None:
        """Back-pressure: wait only when the transport itself is over its high-water mark."""
        if self.failed is not None:
            raise ConnectionResetError(f"connection unusable: {self.failed}")
        transport = self.writer.transport
        if transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:
            self.flush()
            await self.writer.drain()

    def close(self) -> None:
        """Close after the buffered frames, or drop them if the peer will not take them.

        A peer that stopped reading (SIGSTOP, hung) keeps the transport open as long as
        its buffer holds data, and every `drain` waits with it, past any deadline. The
        frames get ABORT_GRACE_S to leave; then the transport is aborted, which ends
        the waiting drains instead of leaving them hanging.
        """
        self.flush()
        self.writer.close()
        transport = self.writer.transport
        if transport.get_write_buffer_size() > 0:
            asyncio.get_running_loop().call_later(self.ABORT_GRACE_S, transport.abort)


class FrameCodec(Generic[T]):
    """Encodes and decodes one message union `T` (a Union of tagged msgspec Structs)."""

    def __init__(self, message_type: type[T], what: str) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(message_type)
        self._encoder = msgspec.msgpack.Encoder()
        self._what = what

    def encode(self, message: object) -> bytes:
        body = self._encoder.encode(message)
        if len(body) > MAX_FRAME_BYTES:
            raise ProtocolError(f"{self._what} message too large: {len(body)} bytes")
        return _HEADER.pack(len(body)) + body

    def decode(self, body: bytes) -> T:
        try:
            return self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise MalformedMessageError(f"malformed {self._what} message: {exc}", body) from exc
        except RecursionError:
            # A value nested thousands deep (inside a free-form field such as a layout):
            # msgspec gives up with RecursionError, which no caller expects from a decode.
            raise MalformedMessageError(
                f"malformed {self._what} message: nested too deeply to decode", body
            ) from None

    def frames(self, reader: asyncio.StreamReader) -> FrameReader:
        """A FrameReader of `reader` (its errors name this codec's messages)."""
        return FrameReader(reader, self._what)

    async def read(
        self, reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES
    ) -> T | None:
        """The next message, or None on a clean end of stream between frames.

        `max_bytes` is the largest body taken (PREAUTH_MAX_FRAME_BYTES before the peer
        is authenticated); the length prefix is checked against it before any of the
        body is read. Raises ProtocolError on a truncated frame, an oversize length
        (FrameTooLargeError) or a body that does not decode; the connection is then
        unusable.
        """
        try:
            header = await reader.readexactly(_HEADER.size)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return None
            raise _truncated(self._what, exc.partial) from exc
        (length,) = _HEADER.unpack(header)
        if length > max_bytes:
            raise _too_large(self._what, length, max_bytes)
        try:
            body = await reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise _truncated(self._what, header + exc.partial) from exc
        return self.decode(body)


class FrameReader:
    """A connection's frames read in bulk, for the loops that read a stream to its end.

    Each read takes whatever the stream holds (up to CHUNK_BYTES) and gives back every
    complete frame in it, undecoded: a frame costs a slice, not the two `readexactly` (and
    their checks) of FrameCodec.read. At thousands of requests a second most reads find
    several frames waiting; this took ~10 of the ~200 Python calls a one-block request costs
    each daemon, and as many of each engine's ~80 (docs/benchmarks.md, issue 16).

    It owns the stream from its first read: it keeps the bytes past the last complete frame,
    so nothing else may read the stream after it (a handshake before it reads frames exactly,
    with FrameCodec.read, and leaves nothing behind). The limits and errors are
    FrameCodec.read's: a length prefix is checked against `max_bytes` before any of its body
    is waited for; a frame over it, or a stream cut inside a frame, raises ProtocolError
    (FrameTooLargeError) once the frames complete before it were given back.
    """

    CHUNK_BYTES: ClassVar[int] = 256 << 10

    def __init__(self, reader: asyncio.StreamReader, what: str) -> None:
        self._reader = reader
        self._what = what
        self._rest = b""  # the start of a frame not yet complete
        self._error: ProtocolError | None = None  # found behind frames given back first

    async def read(self, max_bytes: int = MAX_FRAME_BYTES) -> list[bytes] | None:
        """The bodies of the next complete frames (at least one), or None on a clean end
        of stream between frames."""
        if self._error is not None:
            raise self._error
        while True:
            data = await self._reader.read(self.CHUNK_BYTES)
            if not data:
                if not self._rest:
                    return None
                raise _truncated(self._what, self._rest)
            data = self._rest + data if self._rest else data
            bodies, rest = self._split(data, max_bytes)
            if isinstance(rest, ProtocolError):  # a frame over the limit: those before it first
                self._rest, self._error = b"", rest
                if bodies:
                    return bodies
                raise rest
            if not bodies and len(rest) >= _HEADER.size:
                # One frame longer than what came: wait for exactly the rest of it rather
                # than joining chunk after chunk (a 16 MiB frame would copy quadratically).
                (length,) = _HEADER.unpack_from(rest)
                missing = _HEADER.size + length - len(rest)
                try:
                    tail = await self._reader.readexactly(missing)
                except asyncio.IncompleteReadError as exc:
                    raise _truncated(self._what, rest + exc.partial) from exc
                self._rest = b""
                return [rest[_HEADER.size :] + tail]
            self._rest = rest
            if bodies:
                return bodies

    def _split(self, data: bytes, max_bytes: int) -> tuple[list[bytes], bytes | ProtocolError]:
        """(the complete frames' bodies, the bytes after them), or as the second the error
        of a length prefix over `max_bytes`."""
        bodies: list[bytes] = []
        at, end = 0, len(data)
        while end - at >= _HEADER.size:
            (length,) = _HEADER.unpack_from(data, at)
            if length > max_bytes:
                return bodies, _too_large(self._what, length, max_bytes)
            stop = at + _HEADER.size + length
            if stop > end:
                break
            bodies.append(data[at + _HEADER.size : stop])
            at = stop
        return bodies, data[at:] if at else data


async def until_heard(done: Callable[[], bool], heard: asyncio.Event, deadline: float) -> bool:
    """True once `done()` holds, checked again each time the stream's reader sets `heard`
    (on every frame); False at `deadline` (time.monotonic())."""
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        heard.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(heard.wait(), left)
    return True
