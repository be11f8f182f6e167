"""Fixtures: a real etcd on loopback per test, and daemons that find each other through it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from discovery_harness import CLUSTER, LEASE_TTL_S
from nixl_harness import nixl_or_skip

from kvxferd.sim.cluster import LocalCluster
from kvxferd.sim.etcd_server import EtcdServer, etcd_binary


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    if etcd_binary() is None:
        pytest.skip("no etcd binary: install Debian's etcd-server (scripts/test-deps.sh)")
    pytest.importorskip("aetcd", reason="the etcd client is the extra `etcd` (scripts/install.sh)")
    server = EtcdServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def cluster(tmp_path: Path, etcd: EtcdServer) -> Iterator[LocalCluster]:
    nixl_or_skip("the daemon tests need NIXL (scripts/install.sh)")
    etcd_section = {"endpoints": [etcd.endpoint], "cluster": CLUSTER, "lease_ttl_s": LEASE_TTL_S}
    with LocalCluster(tmp_path / "cluster", etcd=etcd_section) as c:
        yield c
