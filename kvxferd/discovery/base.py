"""The surface every discovery offers the daemon, and the state it reports."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from kvxferd.errors import HandshakeError


class PeerUnknownError(HandshakeError):
    """A peer name that discovery does not know (never registered, or vanished): nothing
    to dial. A HandshakeError, so a dial that meets it fails like an unreachable peer."""


class Resolution(NamedTuple):
    """Where a name is, or None with why not (the reason an engine is told)."""

    address: str | None
    why: str


@dataclass
class DiscoveryState:
    """What /readyz, /v1/status, `kvxferd status` and /metrics say of discovery."""

    kind: str  # "static" or "etcd"
    up: bool = True
    # Wall-clock time of the last change of `up` (Unix seconds).
    since: float = field(default_factory=time.time)
    last_error: str | None = None
    registered: bool = False
    key: str | None = None
    members: int = 0
    # Counters by kind: registration, keepalive, watch, malformed, conflict.
    errors: dict[str, int] = field(default_factory=dict)

    def mark(self, up: bool, error: str | None = None) -> bool:
        """Set up/down (and the error that took it down); True when `up` changed."""
        if error is not None:
            self.last_error = error
        if up == self.up:
            return False
        self.up = up
        self.since = time.time()
        return True

    def count(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1

    def to_json_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "up": self.up,
            "since_unix_s": round(self.since, 3),
            "for_s": round(time.time() - self.since, 3),
            "last_error": self.last_error,
            "registered": self.registered,
            "key": self.key,
            "members": self.members,
            "errors": dict(self.errors),
        }


class Discovery(Protocol):
    """Shall be started once with the peer listener's actual address, before the daemon
    says it is ready, and closed once at shutdown (after which it resolves nothing new)."""

    state: DiscoveryState
    # daemon.peers, which a SIGHUP replaces in place (empty with etcd: the two never mix).
    static_peers: dict[str, str]

    async def start(self, listen_address: str) -> None: ...

    def resolve(self, name: str) -> Resolution: ...

    def members(self) -> dict[str, str]:
        """Known daemon names -> peer addresses (this daemon included, with etcd)."""
        ...

    async def close(self) -> None: ...
