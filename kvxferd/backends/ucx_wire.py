"""What the UCX adapter (ucx.py) puts on the wire besides payloads: the hello each side
sends on a new endpoint, and the tag a payload travels under."""

from __future__ import annotations

import hashlib
import struct

from kvxferd.errors import StartupError, TransferError

# The hello: magic, version, key length, key (UTF-8), zero padded to a fixed size.
HELLO_MAGIC = b"KVXU"
HELLO_VERSION = 1
HELLO_HEAD = struct.Struct("!4sBH")
HELLO_BYTES = 512
MAX_KEY_BYTES = HELLO_BYTES - HELLO_HEAD.size
# Small tags that ucxx hashes with the endpoint's private tag (no force_tag).
HELLO_TAG = 1
ACK_TAG = 2


def wire_tag(sender_key: str, tag: int) -> int:
    """The UCX tag that carries `tag` from the daemon whose key is `sender_key`."""
    if not 0 <= tag < 1 << 64:
        raise ValueError(f"tag {tag} is not a 64-bit unsigned integer")
    h = hashlib.blake2b(digest_size=8, person=b"kvxferd-ucx-tag")
    h.update(sender_key.encode())
    h.update(b"\0")
    h.update(tag.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def encode_hello(key: str) -> bytearray:
    raw = key.encode()
    if len(raw) > MAX_KEY_BYTES:
        raise StartupError(f"UCX peer key {key[:40]!r}... is longer than {MAX_KEY_BYTES} bytes")
    out = bytearray(HELLO_BYTES)
    HELLO_HEAD.pack_into(out, 0, HELLO_MAGIC, HELLO_VERSION, len(raw))
    out[HELLO_HEAD.size : HELLO_HEAD.size + len(raw)] = raw
    return out


def decode_hello(buf: bytearray) -> str:
    magic, version, n = HELLO_HEAD.unpack_from(buf, 0)
    if magic != HELLO_MAGIC or version != HELLO_VERSION or n > MAX_KEY_BYTES:
        raise TransferError(
            f"not a kvxferd UCX hello (magic {magic!r}, version {version}); "
            "another program, or another kvxferd version, connected to the UCX port"
        )
    return bytes(buf[HELLO_HEAD.size : HELLO_HEAD.size + n]).decode()
