"""What crosses between two daemons: rendezvous frames, message headers, data tags.

The TCP rendezvous (link.py) speaks frames: magic, version, kind, then
length-prefixed fields (HELLO with the connecting side's key; ACK with the
listener's key and its MPI port name; READY once the listener registered the
link; REFUSED with the reason when it would not). HELLO and ACK also carry a fresh
nonce each, for the proofs of the shared secret below.

Before either side uses a new intercommunicator, each sends its key over it (an
IDENTITY message, tag 0) and checks the other's against the key the TCP side
named: MPICH routes by its own names for processes, and daemons that look alike
to it (one hostname, pid and start second: containers, namespaces) had a link
quietly deliver to another daemon. With a shared secret (daemon.shared_secret_file) the
key comes with an HMAC over both nonces and both keys (identity.py), so only a daemon that
holds the secret can make a link: the TCP rendezvous alone proves nothing.

Messages and tags
-----------------
MPI tags stop at MPI_TAG_UB (2**29 - 1 with MPICH; the standard only promises
32767), the staged runtime's are 63-bit. So a message is two MPI messages on
the link's intercommunicator: a 24-byte header with tag 0 (magic, the 64-bit
tag, the size, a data tag) and the payload with the data tag, a per-link
sequence number in 1..MPI_TAG_UB. Receiving a tag means reading headers (in
arrival order, into a per-peer table) until that tag's header is there, then
receiving the payload by its data tag (transport.py). A keepalive is a header of
another magic and no payload (keepalive.py), read and dropped with the headers.
"""

from __future__ import annotations

import asyncio
import struct

from kvxferd.errors import StartupError, TransferError

# The TCP rendezvous: frames of magic, version, kind, then length-prefixed fields.
_MAGIC = b"KVXM"
# 2: after the rendezvous, GAVE_UP and the connection's end mean what link.py says.
# 3: the IDENTITY exchange over the new intercommunicator, and REFUSED.
# 4: keepalives on both paths of a link (ALIVE, keepalive headers; keepalive.py).
_VERSION = 4
_FRAME_HEAD = struct.Struct("!4sBBB")  # magic, version, kind, number of fields
_FIELD_LEN = struct.Struct("!H")
MAX_FIELD = 4096
HELLO, ACK, READY, REFUSED = 1, 2, 3, 4
# After the rendezvous, the one byte a side writes when it gives the link up; before it, any
# number of ALIVE bytes (keepalive.py).
GAVE_UP = b"L"
ALIVE = b"A"

# Per message, tag 0 on the intercommunicator: magic, 64-bit tag, size, data tag.
_HEADER = struct.Struct("<4sQQI")
_HEADER_MAGIC = b"KVXH"
HEADER_SIZE = _HEADER.size
HEADER_TAG = 0
# A keepalive (keepalive.py): a header of its own magic, no payload, never a message.
_KEEPALIVE_MAGIC = b"KVXA"


# A side's key over the new intercommunicator, tag 0 (before any message header): magic,
# the key's length, the key, then its proof of the shared secret (empty without one).
_IDENTITY_MAGIC = b"KVXI"
_IDENTITY_LEN = struct.Struct("!H")
IDENTITY_MAX = len(_IDENTITY_MAGIC) + _IDENTITY_LEN.size + MAX_FIELD + 64


def identity(key: str, proof: bytes) -> bytes:
    raw = key.encode()[:MAX_FIELD]
    return _IDENTITY_MAGIC + _IDENTITY_LEN.pack(len(raw)) + raw + proof


def identity_parts(message: bytes) -> tuple[str, bytes] | None:
    """(key, proof) of an IDENTITY message; None if it is not one."""
    head = len(_IDENTITY_MAGIC) + _IDENTITY_LEN.size
    if not message.startswith(_IDENTITY_MAGIC) or len(message) < head:
        return None
    (n,) = _IDENTITY_LEN.unpack_from(message, len(_IDENTITY_MAGIC))
    if len(message) < head + n:
        return None
    return message[head : head + n].decode(errors="replace"), message[head + n :]


class RefusedError(TransferError):
    """The listener refused the link (its REFUSED frame), saying why."""


def frame(kind: int, *fields: bytes) -> bytes:
    out = [_FRAME_HEAD.pack(_MAGIC, _VERSION, kind, len(fields))]
    for f in fields:
        if len(f) > MAX_FIELD:
            raise StartupError(f"MPI rendezvous field of {len(f)} bytes is too long")
        out += [_FIELD_LEN.pack(len(f)), f]
    return b"".join(out)


_KINDS = {HELLO: "HELLO", ACK: "ACK", READY: "READY", REFUSED: "REFUSED"}


async def read_frame(
    reader: asyncio.StreamReader, expect: int, names: tuple[str, ...] = ()
) -> list[bytes]:
    """The fields of the next frame, which must be an `expect` with as many fields as
    `names`; RefusedError when it is the listener's REFUSED instead."""
    magic, version, kind, n = _FRAME_HEAD.unpack(await reader.readexactly(_FRAME_HEAD.size))
    refused = magic == _MAGIC and version == _VERSION and kind == REFUSED != expect
    if not refused and (magic != _MAGIC or version != _VERSION or kind != expect):
        raise TransferError(
            f"not a kvxferd MPI rendezvous frame (magic {magic!r}, version {version}, "
            f"kind {kind}); another program, or another kvxferd version, is on that port"
        )
    fields = []
    for _ in range(n):
        (length,) = _FIELD_LEN.unpack(await reader.readexactly(_FIELD_LEN.size))
        fields.append(await reader.readexactly(length))
    if refused:
        why = fields[0].decode(errors="replace") if fields else "no reason given"
        raise RefusedError(f"the peer refused the link: {why}")
    if len(fields) != len(names):
        raise TransferError(
            f"a {_KINDS[expect]} of {len(fields)} fields, not {len(names)} "
            f"({', '.join(names) or 'none'}): another kvxferd version, or not kvxferd"
        )
    return fields


def pack_header(tag: int, nbytes: int, data_tag: int) -> bytes:
    return _HEADER.pack(_HEADER_MAGIC, tag, nbytes, data_tag)


def unpack_header(buf: bytes | bytearray) -> tuple[int, int, int] | None:
    """(tag, size, data tag) of a header; None if `buf` does not hold one."""
    magic, tag, nbytes, data_tag = _HEADER.unpack(buf)
    if magic != _HEADER_MAGIC:
        return None
    return tag, nbytes, data_tag


def keepalive_header() -> bytearray:
    """A keepalive's header (its own buffer: MPI reads it until the send completes)."""
    return bytearray(_HEADER.pack(_KEEPALIVE_MAGIC, 0, 0, 0))


def is_keepalive(buf: bytes | bytearray) -> bool:
    return len(buf) == HEADER_SIZE and buf[:4] == _KEEPALIVE_MAGIC


def next_data_tag(last: int, tag_ub: int) -> int:
    """The data tag after `last` on a link: 1..tag_ub in turn, never HEADER_TAG."""
    return last % tag_ub + 1
