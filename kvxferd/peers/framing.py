"""Length-prefixed msgpack frames over asyncio streams.

Used by both the peer channel (TCP) and the engine API (Unix socket). A frame is
a 4-byte big-endian length followed by a msgpack map decoded by msgspec into a
typed Struct by field name. Nothing is ever decoded with pickle.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Generic, TypeVar

import msgspec

from kvxferd.errors import MalformedMessageError, ProtocolError

_HEADER = struct.Struct(">I")

# Large enough for NIXL agent metadata and block lists of long prompts; small
# enough that a hostile length prefix cannot make us allocate gigabytes.
MAX_FRAME_BYTES = 16 << 20

T = TypeVar("T")


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
            raise MalformedMessageError(f"malformed {self._what} message: {exc}") from exc

    async def read(self, reader: asyncio.StreamReader) -> T | None:
        """The next message, or None on a clean end of stream between frames.

        Raises ProtocolError on a truncated frame, an oversize length or a body
        that does not decode; the connection is then unusable.
        """
        try:
            header = await reader.readexactly(_HEADER.size)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return None
            raise ProtocolError(f"truncated {self._what} frame header") from exc
        (length,) = _HEADER.unpack(header)
        if length > MAX_FRAME_BYTES:
            raise ProtocolError(
                f"{self._what} frame of {length} bytes exceeds the {MAX_FRAME_BYTES}-byte limit"
            )
        try:
            body = await reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise ProtocolError(
                f"truncated {self._what} frame: {len(exc.partial)} of {length} bytes"
            ) from exc
        return self.decode(body)
