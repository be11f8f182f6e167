"""Fixtures: real daemons (separate `kvxferd run` processes, real NIXL on loopback)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from nixl_harness import nixl_or_skip

from kvxferd.sim.cluster import DaemonProc, LocalCluster

nixl_or_skip("the daemon tests need NIXL (scripts/install.sh)")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path) as c:
        yield c


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """One context and one generation daemon shared by a module's well-behaved tests."""
    with LocalCluster(tmp_path_factory.mktemp("pair")) as c:
        ctx = c.start_daemon("ctx", "context", transceiver={"kv_transfer_timeout_ms": 20000})
        gen = c.start_daemon("gen", "generation", transceiver={"kv_transfer_timeout_ms": 20000})
        yield ctx, gen
        codes = c.stop_all()
        assert codes == {"ctx": 0, "gen": 0}, (ctx.log_text()[-2000:], gen.log_text()[-2000:])
