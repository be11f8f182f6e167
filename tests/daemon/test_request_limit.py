"""daemon.max_requests: a careless engine cannot grow the daemon without bound.

Every request a daemon keeps (in progress, finished and not released, or asked for by a
peer before its engine sends) costs ~3 KiB; an engine that never releases its finished
requests, or posts sends nobody asks for, once grew a context daemon by 314 MiB in 100,000
sends (3 s of posting). Each side is capped: a `recv` or `send` beyond the limit is
refused with `too_many_requests`, naming the limit, and a peer's request for a new send
with `overloaded`. Requests already kept are untouched, releasing one makes room, and a
reload applies a new limit at once. Real daemons on loopback.
"""

from __future__ import annotations

import asyncio
import signal

import pytest
import yaml
from daemon_harness import SimEngine, metric, opened, status, until
from test_faults import _cfg

from kvxferd.client import CallError
from kvxferd.sim.cluster import DaemonProc, LocalCluster

TOKENS = 32
LIMIT = 3
WAIT_S = 20.0


def refused_total(daemon: DaemonProc, reason: str) -> float:
    return metric(daemon, "kvxferd_refused_request_data_total", 0.0, reason=reason)


async def refused_send(c: SimEngine, rid: str) -> CallError:
    with pytest.raises(CallError) as info:
        await c.send(rid, TOKENS)
    return info.value


def test_sends_beyond_the_limit_are_refused_until_one_is_released(
    cluster: LocalCluster,
) -> None:
    """Sends nobody asks for fill the context daemon's table; the next is refused naming
    the limit, and a peer asking for a new request is told `overloaded`. Cancelled and
    released, one send makes room again; a reload raises the limit at once."""
    ctx = cluster.start_daemon("ctx", "context", **_cfg(60000, max_requests=LIMIT))
    gen = cluster.start_daemon("gen", "generation", **_cfg(60000))

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g:
            for i in range(LIMIT):
                await c.send(f"unasked-{i}", TOKENS)
            err = await refused_send(c, "one-too-many")
            assert err.code == "too_many_requests", err
            assert f"daemon.max_requests {LIMIT}" in str(err) and f"keeps {LIMIT} sends" in str(
                err
            ), err
            assert status(ctx)["sessions"]["send"] == {"waiting_for_peer": LIMIT}

            # A receiver asking for a new request: refused without a session.
            await g.recv("asked", TOKENS, ctx.peer_address)
            o = await g.client.wait("asked", timeout_s=WAIT_S)
            assert (o.status, o.reason) == ("failed", "peer_failed"), o
            assert "overloaded" in o.message and "daemon.max_requests" in o.message, o
            assert refused_total(ctx, "overloaded") == 1.0
            assert status(ctx)["sessions"]["send"] == {"waiting_for_peer": LIMIT}

            # Finished but not released still counts; released, it makes room.
            assert await c.client.cancel("unasked-0") == "cancelled"
            await c.client.wait("unasked-0", timeout_s=WAIT_S)
            assert (await refused_send(c, "still-too-many")).code == "too_many_requests"
            await c.client.release("unasked-0")
            await c.send("room-again", TOKENS)
            assert (await refused_send(c, "full-again")).code == "too_many_requests"

            await _reload_limit(ctx, LIMIT + 1)
            await c.send("after-reload", TOKENS)
            # Every request kept before is still there and still works: one is served.
            g_blocks = await g.recv("unasked-1", TOKENS, ctx.peer_address)
            o = await g.client.wait("unasked-1", timeout_s=WAIT_S)
            assert o.status == "done", o
            assert g.verify("unasked-1", g_blocks, TOKENS).ok
            for rid in ("unasked-2", "room-again", "after-reload"):
                assert await c.client.cancel(rid) == "cancelled"

    asyncio.run(scenario())


def test_receives_beyond_the_limit_are_refused_and_released_ones_make_room(
    cluster: LocalCluster,
) -> None:
    """Receives the context side never serves fill the generation daemon's table; the
    next is refused naming the limit and changes nothing else."""
    ctx = cluster.start_daemon("ctx", "context", **_cfg(60000))
    gen = cluster.start_daemon("gen", "generation", **_cfg(60000, max_requests=LIMIT))

    async def scenario() -> None:
        async with opened(ctx), opened(gen) as g:
            for i in range(LIMIT):
                await g.recv(f"r-{i}", TOKENS, ctx.peer_address)
            with pytest.raises(CallError) as info:
                await g.recv("one-too-many", TOKENS, ctx.peer_address)
            assert info.value.code == "too_many_requests", info.value
            assert f"keeps {LIMIT} receives" in str(info.value), info.value
            await until(
                lambda: status(ctx)["sessions"]["send"] == {"ready": LIMIT},
                what="the context daemon to know the kept receives",
            )
            assert await g.client.cancel("r-0") == "cancelled"
            await g.client.wait("r-0", timeout_s=WAIT_S)
            await g.client.release("r-0")
            await g.recv("room-again", TOKENS, ctx.peer_address)
            for rid in ("r-1", "r-2", "room-again"):
                assert await g.client.cancel(rid) == "cancelled"

    asyncio.run(scenario())


async def _reload_limit(d: DaemonProc, limit: int) -> None:
    doc = yaml.safe_load(d.config_path.read_text())
    doc["daemon"]["max_requests"] = limit
    d.config_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    before = status(d)["config"].get("last_reload")
    d.proc.send_signal(signal.SIGHUP)
    await until(
        lambda: status(d)["config"].get("last_reload") not in (None, before),
        what="the reload",
    )
    last = status(d)["config"]["last_reload"]
    assert last["result"] == "applied", last


def test_one_receiving_daemon_gets_half_the_table_before_the_engine_sends(
    cluster: LocalCluster,
) -> None:
    """Receives the context engine has not sent (generation-first) are kept for their peer
    alone, as long as it keeps them posted: one generation daemon may hold half of
    daemon.max_requests that way, and is refused `overloaded` beyond, naming its share.
    The other half stays for the engine's own sends. Before, a daemon that posted and never
    cancelled took the whole table, and the engine's sends were refused too."""
    limit = 4
    ctx = cluster.start_daemon("ctx", "context", **_cfg(60000, max_requests=limit))
    gen = cluster.start_daemon("gen", "generation", **_cfg(60000))

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g:
            posted = {}
            for i in range(limit // 2):
                posted[f"posted-{i}"] = await g.recv(f"posted-{i}", TOKENS, ctx.peer_address)
            await until(
                lambda: status(ctx)["sessions"]["send"] == {"ready": limit // 2},
                what="the context daemon to keep the first receives",
            )
            await g.recv("beyond-share", TOKENS, ctx.peer_address)
            o = await g.client.wait("beyond-share", timeout_s=WAIT_S)
            assert (o.status, o.reason) == ("failed", "peer_failed"), o
            assert "its share (half of daemon.max_requests 4)" in o.message, o
            assert refused_total(ctx, "overloaded") == 1.0
            # The engine's own sends still find room, up to the limit.
            for i in range(limit // 2):
                await c.send(f"own-{i}", TOKENS)
            assert (await refused_send(c, "own-too-many")).code == "too_many_requests"
            # The kept receives are served when the engine sends them.
            for rid, blocks in posted.items():
                await c.send(rid, TOKENS)
                o = await g.client.wait(rid, timeout_s=WAIT_S)
                assert o.status == "done", o
                assert g.verify(rid, blocks, TOKENS).ok
            for i in range(limit // 2):
                assert await c.client.cancel(f"own-{i}") == "cancelled"

    asyncio.run(scenario())
