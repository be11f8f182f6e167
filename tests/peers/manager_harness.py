"""A PeerManager for tests that look at connections only: no peer discovery beyond
HOST:PORT, and messages and closes that go nowhere."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from kvxferd.discovery import AddressResolver, StaticDiscovery
from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.handshake import Identity
from kvxferd.peers.manager import PeerManager, PeerTimings
from kvxferd.peers.messages import Info, PeerMessage
from kvxferd.transceiver.dataplane import DataPlane


async def _ignore_message(conn: PeerConnection, msg: PeerMessage) -> None:
    return None


async def _ignore_close(conn: PeerConnection) -> None:
    return None


def quiet_manager(
    identity: Identity,
    dp: DataPlane,
    make_info: Callable[[], Awaitable[Info]],
    handshake_s: float,
) -> PeerManager:
    return PeerManager(
        identity,
        dp,
        make_info,
        lambda peer, info: None,
        PeerTimings(handshake_s=handshake_s, heartbeat_interval_s=1.0, heartbeat_timeout_s=5.0),
        AddressResolver(StaticDiscovery({})),
        _ignore_message,
        _ignore_close,
    )
