"""etcd faults with real daemons: etcd killed mid-run and restarted, a key deleted under a
daemon, malformed values written by hand, etcd absent at start."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from daemon_harness import (
    assert_clean,
    delivered,
    healthy,
    logged,
    metric,
    opened,
    status,
    wait_for,
)
from discovery_harness import PREFIX, keys, members, one_by_name

from kvxferd.client import CallError
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.etcd_server import EtcdServer


def discovery(d: DaemonProc) -> dict[str, object]:
    doc: dict[str, object] = status(d)["discovery"]
    return doc


def readyz(d: DaemonProc) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://{d.http_address}/readyz", timeout=10) as resp:
        return resp.status, resp.read().decode()


def test_etcd_killed_mid_run_then_restarted(cluster: LocalCluster, etcd: EtcdServer) -> None:
    ctx = cluster.start_daemon("ctx", "context")
    gen = cluster.start_daemon("gen", "generation")
    wait_for(lambda: members(gen) == ["ctx", "gen"], what="gen sees both")

    async def scenario() -> None:
        async with opened(ctx, num_blocks=64) as c, opened(gen, num_blocks=64) as g:
            # Connected while etcd is up; one receive posted, its send not yet made.
            first = await g.recv("before", 100, ctx.name)
            etcd.kill()
            await asyncio.to_thread(
                wait_for, lambda: not discovery(gen)["up"], 20, "gen's discovery down"
            )
            # The transfer in flight completes, and so does a new one by name: the
            # connection keeps its own heartbeat, the name resolves from the last list.
            await c.send("before", 100)
            await delivered(c, g, "before", first, 100)
            second = await g.recv("during", 100, ctx.name)
            await c.send("during", 100)
            await delivered(c, g, "during", second, 100)

    asyncio.run(scenario())
    assert_clean(ctx, gen)
    code, body = readyz(gen)
    assert code == 200 and "discovery: down since" in body, body
    assert metric(gen, "kvxferd_discovery_up") == 0
    assert discovery(ctx)["last_error"]

    etcd.start()
    for d in (ctx, gen):
        wait_for(lambda d=d: members(d) == ["ctx", "gen"], 30, f"{d.name} back up with both")
    regs = keys(etcd)
    assert {n: r["incarnation"] for n, r in regs.items()} == {
        d.name: status(d)["incarnation"] for d in (ctx, gen)
    }
    assert metric(gen, "kvxferd_discovery_up") == 1
    asyncio.run(one_by_name(ctx, gen, "after"))
    assert cluster.stop_all() == {"ctx": 0, "gen": 0}


def test_a_daemon_whose_key_is_deleted_registers_again(
    cluster: LocalCluster, etcd: EtcdServer
) -> None:
    ctx = cluster.start_daemon("ctx", "context")
    etcd.etcdctl("del", PREFIX + "ctx")
    logged(ctx, "was deleted; registering again")
    wait_for(lambda: "ctx" in keys(etcd), what="ctx registered again")
    assert keys(etcd)["ctx"]["incarnation"] == status(ctx)["incarnation"]
    wait_for(lambda: discovery(ctx)["up"] is True, what="ctx's discovery up again")


def test_malformed_values_are_ignored_with_a_log(cluster: LocalCluster, etcd: EtcdServer) -> None:
    gen = cluster.start_daemon("gen", "generation")
    bad = {
        "name": "bad-type",
        "role": "context",
        "address": "127.0.0.1:1",
        "tp_rank": "0",  # a string: decoded strictly, not coerced
        "tp_size": 1,
        "incarnation": "x",
        "version": "0",
    }
    etcd.etcdctl("put", PREFIX + "not-json", "{this is not json")
    etcd.etcdctl("put", PREFIX + "bad-type", json.dumps(bad))
    etcd.etcdctl("put", PREFIX + "other-name", json.dumps({**bad, "tp_rank": 0}))
    etcd.etcdctl("put", PREFIX + "huge", "x" * 10000)
    logged(gen, "discovery: ignoring", count=4)
    assert healthy(gen)
    assert members(gen) == ["gen"]
    assert metric(gen, "kvxferd_discovery_errors_total", kind="malformed") == 4

    async def recv_bogus() -> CallError:
        async with opened(gen, num_blocks=16) as g:
            with pytest.raises(CallError) as raised:
                await g.recv("to-bogus", 100, "bad-type")
            return raised.value

    err = asyncio.run(recv_bogus())
    assert err.code == "peer_unknown", err
    # A good value after the bad ones is taken (the watch went on).
    ctx = cluster.start_daemon("ctx", "context")
    wait_for(lambda: members(gen) == ["ctx", "gen"], what="gen sees ctx after the bad values")
    asyncio.run(one_by_name(ctx, gen, "after-bad"))


def test_etcd_absent_at_start_registers_when_it_comes(
    cluster: LocalCluster, etcd: EtcdServer
) -> None:
    etcd.kill()
    gen = cluster.start_daemon("gen", "generation", daemon={"etcd": {"connect_timeout_ms": 500}})
    disc = discovery(gen)
    assert disc["up"] is False and disc["registered"] is False
    assert readyz(gen)[0] == 200 and status(gen)["ready"]
    etcd.start()
    wait_for(lambda: "gen" in keys(etcd), 30, "gen registered once etcd came")
    wait_for(lambda: discovery(gen)["up"] is True, what="gen's discovery up")
