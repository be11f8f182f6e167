"""`kvxferd demo --cluster NxM` as a newcomer runs it, at a small size."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest
from cli_harness import kvxferd
from nixl_harness import nixl_or_skip

from kvxferd.sim.hosts.network import namespace_problem

nixl_or_skip("the demo needs NIXL (scripts/install.sh)")


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    return kvxferd("demo", "--cluster", *args, timeout=300)


def _check(summary: dict[str, Any], requests: int, routes: int) -> None:
    assert summary["requests"] == requests, summary
    # The reasons first: pytest cuts a long dict short, and a CI run under load once failed
    # 8 of 40 requests with only "..." where the reasons were.
    failed = {k: summary.get(k) for k in ("verified", "failed", "wrong", "lost")}
    assert summary["verified"] == requests and summary["failed"] == {}, (failed, summary)
    assert summary["wrong"] == 0 and summary["lost"] == 0, summary
    assert summary["routes"] == routes and summary["left_on_daemons"] == {}, summary
    assert set(summary["daemon_exit_codes"].values()) == {0}, summary


def _on_namespaces(*args: str) -> dict[str, Any]:
    """A 2x2 demo of 40 requests on network namespaces, checked; its summary."""
    problem = namespace_problem()
    if problem is not None:
        pytest.skip(f"hosts as network namespaces: {problem}")
    proc = _demo("2x2", *args, "--requests", "40", "--max-tokens", "256", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads(proc.stdout)
    _check(summary, 40, 4)
    assert summary["bytes_on_veths"] >= summary["bytes"] > 0, summary
    return summary


def test_cluster_demo_on_network_namespaces() -> None:
    summary = _on_namespaces("--gen-tp", "2")
    assert summary["hosts"] == "network namespaces"
    assert summary["instances"] == {"context": 2, "generation": 2}
    assert summary["daemons"] == 6  # two context daemons, two per generation instance


def test_cluster_demo_over_mpi_on_network_namespaces() -> None:
    """Each host its own hostname, as separate machines have: MPICH tells processes apart
    by hostname, pid and start second, and the daemons of every host are pid 3 of their
    namespace, started in the same second. With one hostname for all, the links of half
    the routes went to the wrong daemon and every request on them timed out."""
    _on_namespaces("--backend", "MPI")


def test_cluster_demo_on_loopback_table() -> None:
    proc = _demo("2x1", "--hosts", "loopback", "--requests", "12", "--max-tokens", "200")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "running every instance on loopback instead" in proc.stderr
    for line in (r"routes\s+2\b", r"verified\s+12\b", r"wrong\s+0\b", r"lost\s+0\b"):
        assert re.search(line, proc.stdout), proc.stdout


@pytest.mark.parametrize("bad", ["2", "2y2", "0x1", "9x1"])
def test_cluster_demo_refuses_a_bad_size(bad: str) -> None:
    proc = _demo(bad)
    assert proc.returncode == 2
    assert "--cluster" in proc.stderr, proc.stderr
    assert "NxM" in proc.stderr or "1 to 8" in proc.stderr, proc.stderr
