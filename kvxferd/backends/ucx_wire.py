"""What the UCX adapter (ucx.py) puts on the wire besides payloads: the hellos of a new
endpoint, and the tag a payload travels under.

A new endpoint carries four hellos, each of HELLO_BYTES under its own tag: the
connector's HELLO (its key and nonce), the listener's ACK (its key, nonce and proof of the
shared secret), the connector's PROOF, and the listener's READY once it registered the
endpoint (link_proof.py: the proofs are empty without a secret)."""

from __future__ import annotations

import hashlib
import struct

from kvxferd.backends.link_proof import NONCE_BYTES, PROOF_BYTES
from kvxferd.errors import StartupError, TransferError

# A hello: magic, version, key length, proof length, then the key (UTF-8), the nonce and
# the proof, zero padded to a fixed size.
HELLO_MAGIC = b"KVXU"
# 2: nonces and proofs, and the PROOF and READY hellos.
HELLO_VERSION = 2
HELLO_HEAD = struct.Struct("!4sBHB")
HELLO_BYTES = 512
MAX_KEY_BYTES = HELLO_BYTES - HELLO_HEAD.size - NONCE_BYTES - PROOF_BYTES
# Small tags that ucxx hashes with the endpoint's private tag (no force_tag).
HELLO_TAG = 1
ACK_TAG = 2
PROOF_TAG = 3
READY_TAG = 4


def wire_tag(sender_key: str, tag: int) -> int:
    """The UCX tag that carries `tag` from the daemon whose key is `sender_key`."""
    if not 0 <= tag < 1 << 64:
        raise ValueError(f"tag {tag} is not a 64-bit unsigned integer")
    h = hashlib.blake2b(digest_size=8, person=b"kvxferd-ucx-tag")
    h.update(sender_key.encode())
    h.update(b"\0")
    h.update(tag.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def encode_hello(key: str, nonce: bytes = bytes(NONCE_BYTES), proof: bytes = b"") -> bytearray:
    raw = key.encode()
    if len(raw) > MAX_KEY_BYTES:
        raise StartupError(f"UCX peer key {key[:40]!r}... is longer than {MAX_KEY_BYTES} bytes")
    assert len(nonce) == NONCE_BYTES and len(proof) <= PROOF_BYTES
    out = bytearray(HELLO_BYTES)
    HELLO_HEAD.pack_into(out, 0, HELLO_MAGIC, HELLO_VERSION, len(raw), len(proof))
    body = raw + nonce + proof
    out[HELLO_HEAD.size : HELLO_HEAD.size + len(body)] = body
    return out


def decode_hello(buf: bytearray) -> tuple[str, bytes, bytes]:
    """(key, nonce, proof) of a hello."""
    magic, version, n, p = HELLO_HEAD.unpack_from(buf, 0)
    if magic != HELLO_MAGIC or version != HELLO_VERSION or n > MAX_KEY_BYTES or p > PROOF_BYTES:
        raise TransferError(
            f"not a kvxferd UCX hello (magic {magic!r}, version {version}); "
            "another program, or another kvxferd version, connected to the UCX port"
        )
    at = HELLO_HEAD.size
    key = bytes(buf[at : at + n]).decode(errors="replace")
    nonce = bytes(buf[at + n : at + n + NONCE_BYTES])
    return key, nonce, bytes(buf[at + n + NONCE_BYTES : at + n + NONCE_BYTES + p])
