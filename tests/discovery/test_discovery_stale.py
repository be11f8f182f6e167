"""A registration that points at another daemon (a stale address): the receive that named
the first daemon fails with why instead of being served by the other one."""

from __future__ import annotations

import asyncio
import json

from daemon_harness import assert_clean, opened, wait_for
from discovery_harness import PREFIX, keys, members

from kvxferd.client import Outcome
from kvxferd.sim.cluster import LocalCluster
from kvxferd.sim.etcd_server import EtcdServer


def test_a_name_that_reaches_another_daemon_fails_the_receive(
    cluster: LocalCluster, etcd: EtcdServer
) -> None:
    ctx = cluster.start_daemon("ctx", "context")
    other = cluster.start_daemon("other", "context")
    gen = cluster.start_daemon("gen", "generation")
    # A hand-written key: "ghost" claims the address where "other" listens.
    forged = {**keys(etcd)["other"], "name": "ghost", "incarnation": "ghost-1"}
    etcd.etcdctl("put", PREFIX + "ghost", json.dumps(forged))
    wait_for(lambda: "ghost" in members(gen), what="gen sees the forged key")

    async def recv_ghost() -> Outcome:
        async with opened(gen, num_blocks=16) as g:
            await g.recv("for-ghost", 100, "ghost")
            return await g.client.wait("for-ghost", timeout_s=30)

    outcome = asyncio.run(recv_ghost())
    assert (outcome.status, outcome.reason) == ("failed", "peer_unreachable"), outcome
    assert "the daemon there is 'other'" in outcome.message, outcome
    assert_clean(gen, ctx, other)
