"""Two small message types and their codec, for the framing tests (test_framing_units.py,
test_frame_reader.py)."""

from __future__ import annotations

import msgspec

from kvxferd.peers.framing import FrameCodec


class Ping(msgspec.Struct, tag="ping"):
    n: int


class Blob(msgspec.Struct, tag="blob"):
    data: bytes


Message = Ping | Blob
CODEC: FrameCodec[Message] = FrameCodec(Message, "test")
