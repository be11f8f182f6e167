"""MOONCAKE's peer metadata: what a daemon tells its peers about its transfer engine, and
the strict decoding of what a peer told us (kvxferd/backends/mooncake.py uses both).

The metadata (encode_metadata; MooncakeBackend.metadata() sends it) is a small JSON
document, never pickle: format version, our agent name, our session id, our Mooncake
package version and the regions we registered. It travels inside kvxferd's authenticated
peer handshake (Info, PoolsUpdate); `add_peer` decodes it strictly (decode_metadata) and
raises TransferError on anything malformed. The regions let `post_write` refuse a write
outside the peer's registered memory before it leaves, with a message that says which
segment; the peer's engine refuses such writes too (it checks every request against its
registrations).

The addresses in it are checked here too: our own (check_host: the host peers are told to
reach our engine at) and a peer's session id ("host:rpc_port", split_session).
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import re
from dataclasses import dataclass

from kvxferd.errors import StartupError
from kvxferd.hostport import split_hostport

# Peer metadata: format version and bounds. It comes from the network, so
# every field is checked and every size is bounded before anything is built.
METADATA_VERSION = 1
_METADATA_KEY = "kvxferd_mooncake"
_MAX_METADATA_BYTES = 256 * 1024
_MAX_REGIONS = 4096
_MAX_AGENT_CHARS = 256
_AGENT_RE = re.compile(r"[A-Za-z0-9._:@/-]+")
_VERSION_RE = re.compile(r"[A-Za-z0-9.+_-]{1,64}")
_HOSTNAME_RE = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
_ADDRESS_LIMIT = 1 << 64


def check_host(host: str) -> str:
    """The address peers are told to reach our engine at."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if host == "localhost":
            return "127.0.0.1"
        if _HOSTNAME_RE.fullmatch(host) is None:
            raise StartupError(f"MOONCAKE: {host!r} is not an IPv4 address or host name") from None
        return host
    if ip.version != 4:
        raise StartupError(
            f"MOONCAKE: daemon.peer_listen's host {host} is IPv6; Mooncake's session ids "
            "(host:port) take IPv4 addresses and host names only"
        )
    if ip.is_unspecified:
        raise StartupError(
            f"MOONCAKE: daemon.peer_listen's host {host} is a wildcard, and peers must be "
            "told an address they can reach the transfer engine at; set daemon.peer_listen "
            "to this host's address on the network the peers use"
        )
    return host


def split_session(session: str) -> tuple[str, int]:
    host, port = split_hostport(session, "session id")
    if port == 0:
        raise ValueError(f"session id {session[:300]!r} has port 0")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if _HOSTNAME_RE.fullmatch(host) is None:
            raise ValueError(f"session id {session!r} has no valid host") from None
    else:
        if ip.version != 4 or ip.is_unspecified:
            raise ValueError(f"session id {session!r} has no usable IPv4 host")
    return host, port


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class PeerMetadata:
    agent: str
    session: str
    regions: tuple[tuple[int, int], ...]  # (address, nbytes), sorted by address
    engine: str  # the peer's Mooncake package version


def encode_metadata(agent: str, session: str, regions: list[tuple[int, int]], engine: str) -> bytes:
    doc = {
        _METADATA_KEY: METADATA_VERSION,
        "agent": agent,
        "session": session,
        "engine": engine,
        "regions": [[a, n] for a, n in sorted(regions)],
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_metadata(data: bytes) -> PeerMetadata:
    """Strictly decode a peer's metadata; ValueError says what is wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"metadata is {type(data).__name__}, not bytes")
    if len(data) > _MAX_METADATA_BYTES:
        raise ValueError(f"metadata is {len(data)} bytes, more than {_MAX_METADATA_BYTES}")
    try:
        doc = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        # RecursionError: nesting deeper than the decoder's stack allows.
        raise ValueError(f"metadata is not JSON ({exc!r}); is the peer a MOONCAKE daemon?") from exc
    if not isinstance(doc, dict):
        raise ValueError("metadata is not a JSON object; is the peer a MOONCAKE daemon?")
    if doc.get(_METADATA_KEY) != METADATA_VERSION:
        raise ValueError(
            f"metadata format {doc.get(_METADATA_KEY)!r} is not {METADATA_VERSION}; "
            "is the peer a MOONCAKE daemon of this version?"
        )
    expected = {_METADATA_KEY, "agent", "session", "engine", "regions"}
    if set(doc) != expected:
        raise ValueError(f"metadata fields {sorted(doc)} are not {sorted(expected)}")
    agent, session, engine, raw = doc["agent"], doc["session"], doc["engine"], doc["regions"]
    if (
        not isinstance(agent, str)
        or len(agent) > _MAX_AGENT_CHARS
        or _AGENT_RE.fullmatch(agent) is None
    ):
        raise ValueError(f"agent name {agent!r} is not a short printable name")
    if not isinstance(engine, str) or _VERSION_RE.fullmatch(engine) is None:
        raise ValueError(f"engine version {engine!r} is not a short version string")
    if not isinstance(session, str) or len(session) > 300:
        raise ValueError("session id is not a short string")
    split_session(session)
    if not isinstance(raw, list) or len(raw) > _MAX_REGIONS:
        raise ValueError(f"regions is not a list of at most {_MAX_REGIONS}")
    regions: list[tuple[int, int]] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and all(_is_int(v) for v in item)):
            raise ValueError(f"region {item!r} is not [address, nbytes]")
        address, nbytes = item
        if not (address > 0 and nbytes > 0 and address + nbytes <= _ADDRESS_LIMIT):
            raise ValueError(f"region [{address:#x}, +{nbytes}) is not a valid address range")
        regions.append((address, nbytes))
    regions.sort()
    for (a0, n0), (a1, _) in itertools.pairwise(regions):
        if a0 + n0 > a1:
            raise ValueError(f"regions at {a0:#x} and {a1:#x} overlap")
    return PeerMetadata(agent, session, tuple(regions), engine)
