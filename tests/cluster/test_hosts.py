"""The hosts themselves: isolated from each other, torn down, and a crashed run's
namespaces cleaned by the next run."""

from __future__ import annotations

import subprocess

import pytest

from kvxferd.sim.hosts.network import NAME_BASE, Network, clean_leftovers, namespace_problem


@pytest.fixture(autouse=True)
def _namespaces() -> None:
    problem = namespace_problem()
    if problem is not None:
        pytest.skip(f"hosts as network namespaces: {problem}")


def _netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_hosts_share_nothing_but_the_wire() -> None:
    with Network(2) as net:
        a, b = net.hosts
        # Own /dev/shm: a file one host puts there is not seen by the other, nor here.
        subprocess.run(a.command(["sh", "-c", "echo x > /dev/shm/kvxh-probe"]), check=True)
        seen_b = subprocess.run(
            b.command(["ls", "/dev/shm"]), capture_output=True, text=True, check=True
        ).stdout
        assert "kvxh-probe" not in seen_b
        with pytest.raises(FileNotFoundError):
            open("/dev/shm/kvxh-probe").close()
        # Own PID namespace: a host's process sees only its host's processes.
        pids = subprocess.run(
            a.command(["ls", "/proc"]), capture_output=True, text=True, check=True
        ).stdout.split()
        assert sorted(int(p) for p in pids if p.isdigit())[0] == 1
        assert len([p for p in pids if p.isdigit()]) < 10
        # Own network stack: the host's interface has its address; the other is reached
        # over the bridge (a TCP connect refused there, not unreachable).
        assert a.address in a.run(["ip", "-4", "addr", "show", "eth0"])
        probe = (
            "import socket\ntry: socket.create_connection(('%s', 9), 2)\n"
            "except ConnectionRefusedError: print('refused')"
        )
        out = subprocess.run(
            a.command(["python3", "-c", probe % b.address]), capture_output=True, text=True
        ).stdout
        assert out.strip() == "refused", out
        names = [h.netns for h in net.hosts]
    listed = _netns()
    assert not any(name in listed for name in [*names, net.hub]), listed


def test_leftovers_of_a_dead_run_are_deleted() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid no process has now: a run that crashed
    name = f"{NAME_BASE}{dead.pid}n0-h0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in clean_leftovers()
        assert name not in _netns()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
