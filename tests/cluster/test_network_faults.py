"""Faults on the network between hosts, under load on every route.

Each test injects its fault part-way through a round (once a share of the receives was
posted), then checks what the promises say: every request reached exactly one outcome
(done and verified, or failed with a reason), none wrong, nothing lost, and once the
fault is gone no daemon holds a session, a transfer handle, an admission slot or an
unfenced block. The fault itself is checked to have happened (packets dropped, the rate
limit holding packets back), so that a test cannot pass because its fault missed.
"""

from __future__ import annotations

import time

from conftest import (
    REQUESTS,
    Cluster,
    assert_alive,
    assert_clean,
    assert_crossed_veth,
    assert_every_outcome,
)

from kvxferd.sim.hosts import faults
from kvxferd.sim.hosts.cluster import Instance, status
from kvxferd.sim.hosts.network import Host

# Failure reasons a cut network may give a receive: the peer's heartbeat was lost, it
# could not be dialled, or the transfer ran past its deadline.
CUT_REASONS = {
    "peer_lost",
    "peer_unreachable",
    "receiver_timeout",
    "sender_deadline",
    "peer_timed_out",
    "peer_failed",
    "transfer_error",
}


def _host(inst: Instance) -> Host:
    assert inst.host is not None
    return inst.host


def _connected(gen: Instance, ctx: Instance) -> bool:
    names = {d.name for d in ctx.daemons}
    return all(names <= {p["name"] for p in status(d)["peers"]} for d in gen.daemons)


def _serves(ctx: Instance, gen: Instance) -> bool:
    """Whether some context daemon of `ctx` is connected to a daemon of `gen`."""
    names = {d.name for d in gen.daemons}
    return any(names & {p["name"] for p in status(d)["peers"]} for d in ctx.daemons)


def _wait(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not {what} after {timeout_s} s"
        time.sleep(0.1)


def test_partition_and_heal(cluster: Cluster) -> None:
    """ctx0 and gen0 cannot reach each other for a while; the three other routes go on,
    the cut one fails with reasons, and after healing every route serves again."""
    ctx0, gen0 = cluster.hc.contexts[0], cluster.hc.generations[0]
    rnd = cluster.round(seed=2).start()
    rnd.wait_announced(rnd.total // 4)
    faults.partition(_host(ctx0), _host(gen0))
    cut = next(r for r in rnd.routes if r.ctx is ctx0 and r.gen is gen0)
    others = [r for r in rnd.routes if r is not cut]
    posted = sum(r.announced for r in others)
    # Held until gen0's daemons lose ctx0 (heartbeat timeout), while the other routes
    # keep posting receives: a partition of two hosts does not stop the rest.
    _wait(lambda: not _connected(gen0, ctx0), 20.0, "gen0 lost ctx0")
    rnd.wait_announced(rnd.announced + 1)
    assert faults.dropped(_host(ctx0)) > 0 and faults.dropped(_host(gen0)) > 0
    faults.heal(_host(ctx0))
    faults.heal(_host(gen0))
    out = rnd.finish()
    assert_every_outcome(out, rnd.total, all_verified=False)
    assert sum(r.announced for r in others) > posted
    assert out.failed, out.to_json()  # the partition did fail some requests ...
    assert set(out.failed) <= CUT_REASONS, out.to_json()
    failed_routes = {
        rec["request_id"].rsplit("-", 2)[0]
        for r in rnd.routes
        for rec in (r.gen_report or {}).get("records", [])
        if rec["status"] != "done"
    }
    assert failed_routes == {cut.label}, failed_routes  # ... and only on the cut route
    assert_clean(cluster)
    # Healed: every route, the cut one included, serves again.
    before = cluster.iface_bytes()
    again = cluster.round(requests=max(8, REQUESTS // 4), seed=3).start()
    out = again.finish()
    assert_every_outcome(out, again.total)
    assert_crossed_veth(cluster, before, out)
    assert_clean(cluster)


def test_random_packet_loss(cluster: Cluster) -> None:
    """2 % of the packets to and from gen1 dropped at random: TCP retransmits, every
    transfer still verifies (or fails with a reason), nothing is wrong."""
    gen1 = cluster.hc.generations[1]
    rnd = cluster.round(seed=4).start()
    rnd.wait_announced(rnd.total // 8)
    faults.packet_loss(_host(gen1), 2)
    out = rnd.finish()
    assert faults.dropped(_host(gen1)) > 0
    faults.heal(_host(gen1))
    assert_every_outcome(out, rnd.total, all_verified=False)
    assert out.verified > 0, out.to_json()
    assert_clean(cluster)


def test_rate_limit(cluster: Cluster) -> None:
    """ctx1 sends at 80 Mbit/s: slower, and every request still verified."""
    ctx1 = cluster.hc.contexts[1]
    faults.rate_limit(_host(ctx1), 80)
    before = cluster.iface_bytes()
    rnd = cluster.round(seed=5).start()
    out = rnd.finish()
    assert faults.overlimits(_host(ctx1)) > 0  # the limit held packets back
    faults.heal(_host(ctx1))
    assert_every_outcome(out, rnd.total)
    assert_crossed_veth(cluster, before, out)
    assert_clean(cluster)


def test_link_down_and_up(cluster: Cluster) -> None:
    """gen1's link goes down mid-round and comes back: its receives fail with reasons,
    gen0's go on, and then gen1 serves again."""
    gen1 = cluster.hc.generations[1]
    rnd = cluster.round(seed=6).start()
    rnd.wait_announced(rnd.total // 4)
    faults.link_down(_host(gen1))
    # gen1 cannot be asked (its HTTP is behind the link too): the context daemons say
    # when they lost it.
    _wait(lambda: not any(_serves(c, gen1) for c in cluster.hc.contexts), 20.0, "gen1 cut")
    faults.link_up(_host(gen1))
    out = rnd.finish()
    assert_every_outcome(out, rnd.total, all_verified=False)
    assert set(out.failed) <= CUT_REASONS, out.to_json()
    assert_clean(cluster)
    assert_alive(cluster)
    again = cluster.round(requests=max(8, REQUESTS // 4), seed=7).start()
    assert_every_outcome(again.finish(), again.total)
    assert_alive(cluster)
