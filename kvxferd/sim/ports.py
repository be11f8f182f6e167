"""Free TCP ports for a server a harness starts later (etcd, vLLM, a podman pod).

A port from bind(0) is an EPHEMERAL one: between the moment it is picked and the
moment the server binds it (a pod played a minute later, an etcd killed and
restarted on the same port), any process's outgoing connection or bind(0) may take
it. Seen in CI: podman's "cannot listen on the TCP port ... address already in use"
for a kube pod's published port. So these ports come from below the kernel's
ephemeral range, where only a server asking for that very port would land.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Below the registered services most hosts run (and above the privileged ones).
_FLOOR = 20000


def _ephemeral_low() -> int:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that is free now and outside the ephemeral range."""
    low = _ephemeral_low()
    floor = _FLOOR if low > _FLOOR + 1000 else 1024
    for _ in range(500):
        port = random.randrange(floor, max(low, floor + 1))
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port on {host} in {floor}..{low - 1}")
