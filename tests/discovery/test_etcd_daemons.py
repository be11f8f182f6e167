"""Real daemons find each other through a real etcd: registration, resolution by name,
refusal of a live name, leaving when the lease ends."""

from __future__ import annotations

import asyncio
import time

import pytest
from daemon_harness import (
    assert_clean,
    delivered,
    logged,
    opened,
    status,
    wait_for,
)
from discovery_harness import LEASE_TTL_S, key_lease, keys, lease_left, members

from kvxferd.client import CallError
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.etcd_server import EtcdServer


async def move_by_name(ctx: DaemonProc, gen: DaemonProc, rids: list[str]) -> None:
    """Each request received by `gen` naming the context daemon by name only, sent by
    `ctx`, every byte verified."""
    async with opened(ctx, num_blocks=64) as c, opened(gen, num_blocks=64) as g:
        for rid in rids:
            blocks = await g.recv(rid, 100, ctx.name)
            await c.send(rid, 100)
            await delivered(c, g, rid, blocks, 100)


def test_two_daemons_find_each_other_and_move_verified_kv(
    cluster: LocalCluster, etcd: EtcdServer
) -> None:
    ctx = cluster.start_daemon("ctx", "context")
    gen = cluster.start_daemon("gen", "generation")
    regs = keys(etcd)
    assert sorted(regs) == ["ctx", "gen"]
    assert regs["ctx"]["role"] == "context" and regs["ctx"]["address"] == ctx.peer_address
    assert regs["gen"]["incarnation"] == status(gen)["incarnation"]
    assert (regs["gen"]["tp_rank"], regs["gen"]["tp_size"]) == (0, 1)
    wait_for(lambda: members(gen) == ["ctx", "gen"], what="gen sees both members")
    asyncio.run(move_by_name(ctx, gen, ["by-name-1", "by-name-2"]))
    assert_clean(ctx, gen)
    assert cluster.stop_all() == {"ctx": 0, "gen": 0}
    # A clean stop revokes the lease: the keys go at once, not a TTL later.
    assert keys(etcd) == {}


def test_a_second_daemon_with_a_live_name_is_refused(
    cluster: LocalCluster, etcd: EtcdServer
) -> None:
    first = cluster.start_daemon("ctx", "context")
    holder = keys(etcd)["ctx"]["incarnation"]
    second = cluster.start_daemon(
        "ctx", "context", wait=False, daemon={"api_socket": str(cluster.workdir / "ctx2.sock")}
    )
    assert second.proc.wait(LEASE_TTL_S + 30) != 0
    text = second.log_text()
    assert "daemon name 'ctx' is taken" in text and str(holder) in text, text[-2000:]
    # The first one still holds its name and serves.
    assert first.alive() and keys(etcd)["ctx"]["incarnation"] == holder


def test_a_killed_daemon_leaves_when_its_lease_ends_and_its_name_fails_fast(
    cluster: LocalCluster, etcd: EtcdServer
) -> None:
    ctx = cluster.start_daemon("ctx", "context")
    gen = cluster.start_daemon("gen", "generation")
    wait_for(lambda: "ctx" in members(gen), what="gen sees ctx")
    ctx.kill()
    wait_for(lambda: "ctx" not in keys(etcd), timeout_s=LEASE_TTL_S + 10, what="ctx's key gone")
    wait_for(lambda: "ctx" not in members(gen), what="gen saw ctx leave")

    async def recv_vanished() -> CallError:
        async with opened(gen, num_blocks=16) as g:
            with pytest.raises(CallError) as raised:
                await g.recv("to-nobody", 100, "ctx")
            return raised.value

    err = asyncio.run(recv_vanished())
    assert err.code == "peer_unknown", err
    assert "left discovery" in str(err), err
    assert_clean(gen)


def test_a_killed_daemon_restarted_under_its_name_registers_after_its_old_lease(
    cluster: LocalCluster, etcd: EtcdServer
) -> None:
    # A TTL longer than a daemon's start-up, so that the old key is still there.
    longer = {"etcd": {"lease_ttl_s": 6}}
    ctx = cluster.start_daemon("ctx", "context", daemon=longer)
    old = keys(etcd)["ctx"]["incarnation"]
    ctx.kill()
    again = cluster.start_daemon("ctx", "context", daemon=longer, timeout_s=40)
    logged(again, "is held in etcd by incarnation", old)
    assert keys(etcd)["ctx"]["incarnation"] == status(again)["incarnation"] != old
    # Its own lease, granted before it waited, was kept alive meanwhile: the key stays
    # under that lease until the daemon's keepalive refreshes it (the TTL left goes up).
    # Before, the lease ended seconds after the registration and took the key with it.
    lease = key_lease(etcd, "ctx")
    first = lease_left(etcd, lease)
    deadline = time.monotonic() + 3 * 6
    while (left := lease_left(etcd, lease)) <= first:
        assert key_lease(etcd, "ctx") == lease, "the restarted daemon's key lost its lease"
        assert left > 0 and time.monotonic() < deadline, f"lease {lease:x}: {left} s left"
        first = min(first, left)
        time.sleep(0.2)
