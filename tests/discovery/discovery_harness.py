"""Helpers for the discovery tests: the test cluster's key prefix, reads of what etcd
holds and of what a daemon's discovery knows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvxferd.sim.cluster import DaemonProc
from kvxferd.sim.etcd_server import EtcdServer

# The daemon tests' in-test engine and helpers (deadline-bounded waits, status reads).
sys.path.insert(0, str(Path(__file__).parent.parent / "daemon"))

from daemon_harness import status

# Short enough that a killed daemon leaves within a test, and what etcd grants by default.
LEASE_TTL_S = 2
CLUSTER = "test"
PREFIX = f"/kvxferd/{CLUSTER}/daemons/"


def keys(etcd: EtcdServer) -> dict[str, dict[str, object]]:
    """Every registration under the test cluster's prefix, by daemon name."""
    out = etcd.etcdctl("get", "--prefix", PREFIX).splitlines()
    found = {}
    for key, value in zip(out[::2], out[1::2], strict=True):
        found[key[len(PREFIX) :]] = json.loads(value)
    return found


def members(d: DaemonProc) -> list[str]:
    """The names the daemon's discovery knows ([] while it is down)."""
    disc = status(d)["discovery"]
    return list(disc["member_names"]) if disc["up"] else []
