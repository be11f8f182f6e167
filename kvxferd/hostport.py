"""HOST:PORT, split one way everywhere: the peer channel, the backends' own addresses,
listeners read back from /proc. The configuration checks addresses more strictly when
it loads them (kvxferd.config.sections.parse_hostport, with YAML paths in its errors);
this is for addresses already accepted or received from a peer."""

from __future__ import annotations

import functools
import socket


# A pure function of its text, asked on every receive (the peer it names is validated
# before it is dialed or looked up) for the same few addresses; a ValueError is not cached.
@functools.lru_cache(maxsize=1024)
def split_hostport(address: str, what: str = "address") -> tuple[str, int]:
    """(host, port) of "host:port" or "[v6]:port", the host without brackets. ValueError
    naming `what` when it is not that shape or the port is outside 0-65535."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or len(port) > 5 or int(port) > 65535:
        raise ValueError(f"{what} {address[:300]!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def source_address_towards(address: str) -> str:
    """This host's address on the route to `address` (HOST:PORT; a name is resolved): the
    source address the kernel would pick. A UDP connect sends nothing; it only binds the
    route. OSError when the name does not resolve or no route leads there."""
    host, port = split_hostport(address)
    family, kind, proto, _, target = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(target)
        return str(probe.getsockname()[0])
