"""Every context instance to every generation instance, across hosts, all verified."""

from __future__ import annotations

from conftest import Cluster, assert_clean, assert_crossed_veth, assert_every_outcome

from kvxferd.sim.hosts.cluster import status


def test_all_routes_verified_over_the_veths(cluster: Cluster) -> None:
    before = cluster.iface_bytes()
    rnd = cluster.round(seed=1).start()
    out = rnd.finish()
    assert_every_outcome(out, rnd.total)
    assert_crossed_veth(cluster, before, out)
    # Each generation instance is two ranks (two daemons on its host), and each rank's
    # daemon served both context instances, on the other hosts.
    contexts = {d.name for inst in cluster.hc.contexts for d in inst.daemons}
    for gen in cluster.hc.generations:
        assert len(gen.daemons) == 2
        for d in gen.daemons:
            doc = status(d)
            assert {p["name"] for p in doc["peers"]} == contexts, doc["peers"]
            assert {p["address"].split(":")[0] for p in doc["peers"]}.isdisjoint(
                {gen.host.address if gen.host else ""}
            )
    assert_clean(cluster)
