"""Ports for servers a harness starts later come from outside the ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

from kvxferd.sim.ports import free_port


def test_free_ports_are_bindable_and_never_ephemeral() -> None:
    low, _high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    for _ in range(50):
        port = free_port()
        assert 1024 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free: nothing of ours holds it


def test_a_port_held_by_a_listener_is_not_given() -> None:
    held: list[socket.socket] = []
    try:
        taken = set()
        for _ in range(20):
            port = free_port()
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            held.append(s)
            taken.add(port)
        assert len(taken) == 20
        assert all(free_port() not in taken for _ in range(200))
    finally:
        for s in held:
            s.close()
