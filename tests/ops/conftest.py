"""Fixtures for the operations tests: real daemons (as in tests/daemon), a fake
systemd notify socket, and Prometheus scrapes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from nixl_harness import nixl_or_skip

# The daemon tests' in-test engine (SimEngine) and helpers are reused here.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "daemon"))

from kvxferd.sim.cluster import LocalCluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    nixl_or_skip("real daemons need NIXL (scripts/install.sh)")
    with LocalCluster(tmp_path) as c:
        yield c
