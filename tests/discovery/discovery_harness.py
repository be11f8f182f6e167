"""Helpers for the discovery tests: the test cluster's key prefix, reads of what etcd
holds and of what a daemon's discovery knows."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from kvxferd.sim.cluster import DaemonProc
from kvxferd.sim.etcd_server import EtcdServer

# The daemon tests' in-test engine and helpers (deadline-bounded waits, status reads).
sys.path.insert(0, str(Path(__file__).parent.parent / "daemon"))

from daemon_harness import delivered, opened, status

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


def key_lease(etcd: EtcdServer, name: str) -> int:
    """The lease a daemon's key is attached to (0: none, or no key)."""
    doc = json.loads(etcd.etcdctl("get", PREFIX + name, "-w", "json"))
    kvs = doc.get("kvs") or [{}]
    return int(kvs[0].get("lease", 0))


def lease_left(etcd: EtcdServer, lease: int) -> int:
    """Seconds left on `lease` as etcd reports them (-1: it has ended)."""
    out = etcd.etcdctl("lease", "timetolive", f"{lease:x}")
    match = re.search(r"remaining\((-?\d+)s\)", out)
    return int(match.group(1)) if match else -1


async def one_by_name(ctx: DaemonProc, gen: DaemonProc, rid: str) -> None:
    """One request moved from `ctx` to `gen`, the receive naming ctx by its daemon name
    (resolved through discovery); pools of their own, so it runs beside other engines."""
    async with (
        opened(ctx, num_blocks=16, pool_id=f"p-{rid}") as c,
        opened(gen, num_blocks=16, pool_id=f"p-{rid}") as g,
    ):
        blocks = await g.recv(rid, 100, ctx.name)
        await c.send(rid, 100)
        await delivered(c, g, rid, blocks, 100)
