"""Peer name -> address for the PeerManager (composition: it is given one of these), and
the check that a name resolved through etcd reached that daemon."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

from kvxferd import hostport
from kvxferd.discovery.base import Discovery, PeerUnknownError
from kvxferd.errors import KvxferdError
from kvxferd.peers.channel import PeerConnection

Connect = Callable[[str], Awaitable[PeerConnection]]


class AddressResolver:
    """A receive names its context peer by discovery name or as HOST:PORT."""

    def __init__(self, discovery: Discovery) -> None:
        self.discovery = discovery

    @property
    def static_peers(self) -> dict[str, str]:
        return self.discovery.static_peers

    def resolve_address(self, peer: str) -> str:
        """The address to dial for `peer`; PeerUnknownError saying why when there is none."""
        if _is_hostport(peer):
            # No daemon name has a ':' (config and discovery records both refuse one), so
            # HOST:PORT is never a name: not looked up, which for a miss also spelt out every
            # known name for the message, once per receive.
            return peer
        found = self.discovery.resolve(peer)
        if found.address is not None:
            return found.address
        kind = self.discovery.state.kind
        if kind == "static":
            # A name that is not in the file is the engine's or the file's mistake (a bad
            # request), not a peer that left.
            raise KvxferdError(f"peer {peer[:200]!r}: {found.why}, nor HOST:PORT")
        raise PeerUnknownError(
            f"peer {peer[:200]!r} is unknown to {kind} discovery: {found.why}; "
            "name a registered daemon, or give HOST:PORT"
        )


@functools.lru_cache(maxsize=1024)
def _is_hostport(text: str) -> bool:
    # A pure function of the text, asked for every receive that names its peer as HOST:PORT;
    # an engine names the same few peers again and again.
    try:
        _, port = hostport.split_hostport(text)
    except ValueError:
        return False
    return port >= 0


def named_connect(connect: Connect, discovery: Discovery) -> Connect:
    """`connect`, plus a check that a name etcd resolved reached the daemon of that name.

    A registration is a hint: during an etcd outage, or with a Kubernetes pod IP taken by
    another pod, the address may now belong to another daemon (which authenticates fine,
    being one of ours). Its handshake says its name; a receive for `ctx-0` must not be
    served by `ctx-1`. Static names are not checked: daemon.peers may alias a daemon.
    """
    if discovery.state.kind == "static":
        return connect

    async def checked(peer: str) -> PeerConnection:
        conn = await connect(peer)
        if discovery.resolve(peer).address is not None and conn.peer.name != peer:
            raise PeerUnknownError(
                f"peer {peer[:200]!r} resolved to {conn.label}, but the daemon there is "
                f"{conn.peer.name!r}: the registration is stale (it moved, or etcd is behind)"
            )
        return conn

    return checked
