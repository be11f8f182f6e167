"""Every socket the daemon listens on, including those its backend opens on its own.

The daemon's own listeners (peer channel, HTTP) bind where the configuration says. The
backends' do not ask: UCX (under NIXL, and ucxx) opens a TCP listener on every network
device it finds, the host's external interface included, even when every address in the
configuration is loopback. So the daemon

* pins UCX to the configured peer address's device (`UCX_NET_DEVICES`: `lo` for a loopback
  address) before the backend starts, unless the operator set that variable;
* once every listener is up, lists the process's listening sockets from /proc and refuses
  to start, naming the listener, if one is not on loopback while peers are not
  authenticated (no `daemon.shared_secret_file`); with a secret, a listener outside the
  configured addresses is logged. ucxx's listener (the UCX backend) and Mooncake's engine
  bind every interface and take no address, so those two backends need a secret.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import MutableMapping
from pathlib import Path

from kvxferd.errors import StartupError
from kvxferd.hostport import split_hostport

log = logging.getLogger("kvxferd.listeners")

_SIOCGIFADDR = 0x8915
_LISTEN = "0A"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ipv4_of(ifname: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(
                s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15])
            )
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def device_of(host: str) -> str | None:
    """The network device holding IPv4 address `host` (None: none here, or not IPv4)."""
    if is_loopback(host):
        return "lo"
    for _, name in socket.if_nameindex():
        if ipv4_of(name) == host:
            return name
    return None


def pin_ucx_devices(host: str, env: MutableMapping[str, str] | None = None) -> str | None:
    """Keep UCX's listeners on the device of the configured peer address; returns the
    device set, or None when the operator chose (UCX_NET_DEVICES set) or none matches
    (a wildcard or a name: UCX then listens where it likes, and check_listeners tells)."""
    env = os.environ if env is None else env
    if "UCX_NET_DEVICES" in env or host in ("", "0.0.0.0", "::"):
        return None
    device = device_of(host)
    if device is not None:
        env["UCX_NET_DEVICES"] = device
    return device


def _decode(hex_addr: str) -> str:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    # /proc/net/tcp{,6} print each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    text = f"[{ip}]" if ip.version == 6 else str(ip)
    return f"{text}:{int(port_hex, 16)}"


def listening_sockets(pid: int | str = "self") -> list[str]:
    """HOST:PORT of every TCP socket process `pid` listens on (its network namespace)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN and fields[9] in inodes:
                found.append(_decode(fields[1]))
    return sorted(set(found))


def _host(address: str) -> str:
    return split_hostport(address, "listener")[0]


def check_listeners(authenticated: bool, configured: list[str], backend: str = "") -> list[str]:
    """Refuse (StartupError) a listener off loopback when peers are not authenticated;
    with authentication, log those outside the `configured` hosts. Returns the listeners."""
    listeners = listening_sockets()
    allowed = {h for h in configured if h}
    for address in listeners:
        host = _host(address)
        if is_loopback(host):
            continue
        wildcard = host in ("0.0.0.0", "::")
        if wildcard:
            # ucxx's listener and Mooncake's engine take no address to bind to.
            how = (
                f"the {backend or 'backend'}'s own listener binds every interface and cannot "
                "be told an address: set daemon.shared_secret_file or the daemon.tls_* files "
                "(and firewall that port)"
            )
        else:
            how = (
                "a backend opened it (UCX: set UCX_NET_DEVICES=lo, or leave it unset so the "
                "daemon pins it to the device of daemon.peer_listen)"
            )
        if not authenticated:
            raise StartupError(
                f"this daemon listens on {address}, which is not loopback, but peers are not "
                f"authenticated (no daemon.shared_secret_file or daemon.tls_* files); {how}"
            )
        if host not in allowed and "0.0.0.0" not in allowed and "::" not in allowed:
            log.warning(
                "listening on %s, outside the configured addresses %s (opened by the %s backend)",
                address,
                sorted(allowed),
                backend or "data-plane",
            )
    return listeners
