"""Static discovery: daemon.peers, as before discovery existed."""

from __future__ import annotations

from kvxferd.discovery.base import DiscoveryState, Resolution


class StaticDiscovery:
    """Names from the configuration file; always up, nothing to register."""

    def __init__(self, peers: dict[str, str]) -> None:
        self.static_peers = peers
        self.state = DiscoveryState("static", registered=False)

    async def start(self, listen_address: str) -> None:
        self.state.members = len(self.static_peers)

    def resolve(self, name: str) -> Resolution:
        address = self.static_peers.get(name)
        if address is not None:
            return Resolution(address, "static peer")
        known = ", ".join(sorted(self.static_peers)) or "none configured"
        return Resolution(None, f"not a static peer in daemon.peers ({known})")

    def members(self) -> dict[str, str]:
        self.state.members = len(self.static_peers)
        return dict(self.static_peers)

    async def close(self) -> None:
        return None
