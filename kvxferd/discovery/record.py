"""What a daemon registers in etcd: the key layout and the value, encoded and decoded.

Key: /kvxferd/<cluster>/daemons/<name>. Value: one JSON object (fields below). A value
read from etcd is a hint from whoever could write there, never trusted: it is decoded
strictly (types exact, size bounded), checked, and a bad one is skipped, never raised
past the watch.
"""

from __future__ import annotations

import re

import msgspec

from kvxferd import hostport

# A registration is a few hundred bytes; anything far larger is not one of ours.
MAX_VALUE_BYTES = 4096
ROLES = ("context", "generation", "both")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_INCARNATION = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def prefix_of(cluster: str) -> str:
    return f"/kvxferd/{cluster}/daemons/"


def key_of(cluster: str, name: str) -> str:
    return prefix_of(cluster) + name


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    """One daemon as it registered itself. Unknown fields are ignored (a newer version
    may add some); every field here is required and of its exact type."""

    name: str
    role: str
    address: str  # HOST:PORT of its peer listener, as peers should dial it
    tp_rank: int
    tp_size: int
    incarnation: str
    version: str


_DECODER = msgspec.json.Decoder(Registration)


class BadRegistration(ValueError):
    """A value under the prefix that is not a usable registration (the text says why)."""


def encode(reg: Registration) -> bytes:
    return msgspec.json.encode(reg)


def decode(key: str, value: bytes, prefix: str) -> Registration:
    """The registration stored at `key`; BadRegistration naming what is wrong."""
    name = key[len(prefix) :] if key.startswith(prefix) else ""
    if not _NAME.match(name):
        raise BadRegistration(f"the key's name {name[:80]!r} is not a daemon name")
    if len(value) > MAX_VALUE_BYTES:
        raise BadRegistration(f"value of {len(value)} bytes (at most {MAX_VALUE_BYTES})")
    try:
        reg = _DECODER.decode(value)
    except msgspec.DecodeError as exc:
        raise BadRegistration(f"not a registration: {str(exc)[:200]}") from None
    problem = _problem(reg, name)
    if problem:
        raise BadRegistration(problem)
    return reg


def _problem(reg: Registration, name: str) -> str:
    if reg.name != name:
        return f"names {reg.name[:80]!r} under the key of {name!r}"
    if reg.role not in ROLES:
        return f"role {reg.role[:40]!r} is not one of {', '.join(ROLES)}"
    try:
        _, port = hostport.split_hostport(reg.address, "address")
    except ValueError as exc:
        return str(exc)
    if port == 0:
        return f"address {reg.address!r} has port 0"
    if not 0 <= reg.tp_rank < reg.tp_size or reg.tp_size > 4096:
        return f"tp_rank {reg.tp_rank} of tp_size {reg.tp_size} is not a rank"
    if not _INCARNATION.match(reg.incarnation):
        return f"incarnation {reg.incarnation[:80]!r} is malformed"
    if len(reg.version) > 64:
        return "version longer than 64 characters"
    return ""
