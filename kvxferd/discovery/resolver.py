"""Peer name -> address for the PeerManager (composition: it is given one of these)."""

from __future__ import annotations

from kvxferd import hostport
from kvxferd.discovery.base import Discovery, PeerUnknownError


class AddressResolver:
    """A receive names its context peer by discovery name or as HOST:PORT."""

    def __init__(self, discovery: Discovery) -> None:
        self.discovery = discovery

    @property
    def static_peers(self) -> dict[str, str]:
        return self.discovery.static_peers

    def resolve_address(self, peer: str) -> str:
        """The address to dial for `peer`; PeerUnknownError saying why when there is none."""
        found = self.discovery.resolve(peer)
        if found.address is not None:
            return found.address
        if _is_hostport(peer):
            return peer
        kind = self.discovery.state.kind
        raise PeerUnknownError(
            f"peer {peer[:200]!r} is unknown to {kind} discovery: {found.why}; "
            "name a registered daemon, or give HOST:PORT"
        )


def _is_hostport(text: str) -> bool:
    try:
        _, port = hostport.split_hostport(text)
    except ValueError:
        return False
    return port >= 0
