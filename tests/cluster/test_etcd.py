"""The cluster found through etcd alone: etcd absent at start, and etcd restarted mid-run.

The session's daemons have no `daemon.peers`; they started before etcd existed (the
fixture starts etcd only once every daemon is up), and every route of every other test
resolves its context daemons' names through what etcd told them.
"""

from __future__ import annotations

import time

import pytest
import yaml
from conftest import (
    REQUESTS,
    Cluster,
    assert_alive,
    assert_clean,
    assert_crossed_veth,
    assert_every_outcome,
    etcd_problem,
)

from kvxferd.sim.hosts.cluster import status

pytestmark = pytest.mark.skipif(etcd_problem() is not None, reason=str(etcd_problem()))


def _discovery_up(c: Cluster) -> dict[str, bool]:
    return {d.name: bool(status(d)["discovery"]["up"]) for d in c.hc.all_daemons()}


def test_found_through_etcd_alone_though_absent_at_start(cluster: Cluster) -> None:
    # No static peer anywhere: each daemon knows the others from etcd only.
    for d in cluster.hc.all_daemons():
        section = yaml.safe_load(d.config_path.read_text())["daemon"]
        assert section["discovery"] == "etcd" and not section.get("peers"), section
    # They had started without it: ready, not registered, discovery down.
    assert set(cluster.before_etcd) == set(cluster.names())
    for name, disc in cluster.before_etcd.items():
        assert disc["up"] is False and disc["registered"] is False, (name, disc)
    # Then etcd came: each registered itself (with its tensor-parallel rank) and sees all.
    for d in cluster.hc.all_daemons():
        disc = status(d)["discovery"]
        assert disc["registered"] is True and sorted(disc["member_names"]) == cluster.names()
    before = cluster.iface_bytes()
    rnd = cluster.round(seed=11).start()
    out = rnd.finish()
    assert_every_outcome(out, rnd.total)
    assert_crossed_veth(cluster, before, out)
    assert_clean(cluster)


def test_etcd_restarted_mid_run(cluster: Cluster) -> None:
    """etcd SIGKILLed while every route moves requests, and started again: transfers go
    on from what each daemon last listed, and each one registers and lists again."""
    assert cluster.etcd is not None
    rnd = cluster.round(seed=12).start()
    rnd.wait_announced(rnd.total // 4)
    cluster.etcd.kill()
    deadline = time.monotonic() + 30
    while any(_discovery_up(cluster).values()):
        assert time.monotonic() < deadline, _discovery_up(cluster)
        time.sleep(0.2)
    posted = rnd.announced
    rnd.wait_announced(min(rnd.total, posted + 8))  # requests go on while etcd is down
    cluster.etcd.start()
    out = rnd.finish()
    assert_every_outcome(out, rnd.total)
    cluster.wait_members()
    again = cluster.round(requests=max(8, REQUESTS // 4), seed=13).start()
    assert_every_outcome(again.finish(), again.total)
    assert_clean(cluster)
    assert_alive(cluster)
