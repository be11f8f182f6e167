"""etcd stopped (SIGSTOP) mid-run for several lease TTLs, then resumed: its connections stay
open and its calls hang instead of failing, unlike a killed etcd (test_etcd_faults.py), and
as it resumes it revokes the leases that ran out meanwhile, deleting the daemons' keys."""

from __future__ import annotations

import asyncio
import signal
import time

from daemon_harness import assert_clean, status, wait_for
from discovery_harness import LEASE_TTL_S, keys, members, one_by_name

from kvxferd.sim.cluster import LocalCluster
from kvxferd.sim.etcd_server import EtcdServer

STALL_S = 4 * LEASE_TTL_S


def test_etcd_stopped_then_resumed(cluster: LocalCluster, etcd: EtcdServer) -> None:
    ctx = cluster.start_daemon("ctx", "context")
    gen = cluster.start_daemon("gen", "generation")
    wait_for(lambda: members(gen) == ["ctx", "gen"], what="gen sees both")
    assert etcd.proc is not None
    etcd.proc.send_signal(signal.SIGSTOP)
    try:
        stalled_at = time.monotonic()
        # Transfers by name go on from the last list while etcd hangs.
        asyncio.run(one_by_name(ctx, gen, "during"))
        wait_for(lambda: not status(gen)["discovery"]["up"], 30, "gen's discovery down")
        left = STALL_S - (time.monotonic() - stalled_at)
        if left > 0:
            time.sleep(left)  # past the leases' TTL: etcd revokes them as it resumes
    finally:
        etcd.proc.send_signal(signal.SIGCONT)
    for d in (ctx, gen):
        wait_for(lambda d=d: members(d) == ["ctx", "gen"], 60, f"{d.name} back up with both")
        wait_for(lambda d=d: status(d)["discovery"]["up"], 60, f"{d.name}'s discovery up")
    wait_for(lambda: set(keys(etcd)) == {"ctx", "gen"}, 60, "both registered again")
    regs = keys(etcd)
    assert {n: r["incarnation"] for n, r in regs.items()} == {
        d.name: status(d)["incarnation"] for d in (ctx, gen)
    }
    # The keys stay past a TTL: their new leases are kept alive (not a one-off write).
    until = time.monotonic() + 2 * LEASE_TTL_S
    while time.monotonic() < until:
        assert set(keys(etcd)) == {"ctx", "gen"}
        time.sleep(0.2)
    asyncio.run(one_by_name(ctx, gen, "after"))
    assert_clean(ctx, gen)
    assert cluster.stop_all() == {"ctx": 0, "gen": 0}
