"""Faults on the network between hosts: what this kernel can do without netem.

Every rule lives in the host's own network namespace: nftables rules in one table
(`kvxfault`, input and output chains) and a tbf qdisc on the host's interface, so that
healing a host is deleting that table and that qdisc, whatever was injected.
"""

from __future__ import annotations

import re

from kvxferd.sim.hosts.network import HOST_IFACE, Host, NetworkError

TABLE = "kvxfault"

_CHAINS = f"""
add table inet {TABLE}
add chain inet {TABLE} input {{ type filter hook input priority 0; policy accept; }}
add chain inet {TABLE} output {{ type filter hook output priority 0; policy accept; }}
"""


def _rules(host: Host, *rules: str) -> None:
    host.run(["nft", "-f", "-"], stdin=_CHAINS + "".join(r + "\n" for r in rules))


def partition(a: Host, b: Host) -> None:
    """Drops every packet between `a` and `b`, both ways, on both hosts (the
    connections stay open: no reset, no FIN, as when a switch between them fails)."""
    for one, other in ((a, b), (b, a)):
        _rules(
            one,
            f"add rule inet {TABLE} input ip saddr {other.address} counter drop",
            f"add rule inet {TABLE} output ip daddr {other.address} counter drop",
        )


def _random(percent: int) -> str:
    return f"numgen random mod 100 < {percent} counter drop"


def packet_loss(host: Host, percent: int) -> None:
    """Drops `percent` % of the packets the host receives and sends, at random."""
    if not 0 < percent < 100:
        raise NetworkError(f"packet loss must be 1-99 %, got {percent}")
    _rules(
        host,
        f"add rule inet {TABLE} input iifname {HOST_IFACE} {_random(percent)}",
        f"add rule inet {TABLE} output oifname {HOST_IFACE} {_random(percent)}",
    )


def rate_limit(host: Host, mbit: int, burst_kb: int = 64) -> None:
    """Limits what the host sends to `mbit` Mbit/s (token bucket, tail drop)."""
    host.run(
        [
            *("tc", "qdisc", "replace", "dev", HOST_IFACE, "root", "tbf"),
            *("rate", f"{mbit}mbit", "burst", f"{burst_kb}kb", "latency", "100ms"),
        ]
    )


def overlimits(host: Host) -> int:
    """Times the rate limit held a packet back (tbf's overlimits), 0 without one."""
    qdisc = host.run(["tc", "-s", "qdisc", "show", "dev", HOST_IFACE], check=False)
    found = re.search(r"overlimits (\d+)", qdisc) if "tbf" in qdisc else None
    return int(found.group(1)) if found else 0


def link_down(host: Host) -> None:
    host.run(["ip", "link", "set", HOST_IFACE, "down"])


def link_up(host: Host) -> None:
    host.run(["ip", "link", "set", HOST_IFACE, "up"])


def heal(host: Host) -> None:
    """Removes every fault of this module from the host (idempotent)."""
    host.run(["nft", "delete", "table", "inet", TABLE], check=False)
    host.run(["tc", "qdisc", "del", "dev", HOST_IFACE, "root"], check=False)
    link_up(host)


def dropped(host: Host) -> int:
    """Packets the host's fault rules dropped so far (each rule counts its own)."""
    rules = host.run(["nft", "list", "table", "inet", TABLE], check=False)
    return sum(int(n) for n in re.findall(r"counter packets (\d+)", rules))


def active(host: Host) -> list[str]:
    """What is injected on the host now, as the kernel reports it (for messages)."""
    found = []
    rules = host.run(["nft", "list", "table", "inet", TABLE], check=False)
    found += [line.strip() for line in rules.splitlines() if " drop" in line]
    qdisc = host.run(["tc", "qdisc", "show", "dev", HOST_IFACE], check=False)
    found += [line.strip() for line in qdisc.splitlines() if "tbf" in line]
    return found
