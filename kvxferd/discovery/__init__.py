"""Discovery: how a peer *name* in a receive becomes an address to dial.

`static` reads daemon.peers; `etcd` registers this daemon under a lease and watches the
others (docs/operations.md, "Discovery with etcd"). What discovery says is a hint: the
peer handshake still authenticates whoever answers at that address.
"""

from kvxferd.discovery.base import Discovery, DiscoveryState, PeerUnknownError, Resolution
from kvxferd.discovery.resolver import AddressResolver
from kvxferd.discovery.static import StaticDiscovery

__all__ = [
    "AddressResolver",
    "Discovery",
    "DiscoveryState",
    "PeerUnknownError",
    "Resolution",
    "StaticDiscovery",
]
