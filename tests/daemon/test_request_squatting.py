"""Whose request it is: a context engine's send may name the generation daemon it serves.

Any process that speaks the peer protocol (here: a second, well-behaved generation
daemon, "squat", whose engine posts a receive under another engine's request id) can
ask for a request. With `send(..., peer="gen")` only gen's receive is served: the
squatter's is refused (`not_your_request`), nothing is written into its blocks, and the
request waits on for gen, whichever order the RequestData and the send arrive in. A send
naming no peer serves the first to ask, as before; a receive that comes after the KV
went to someone else is told so (`already_served`, naming the peer) and a receive
waiting behind a squatter takes its place when the squatter goes away.
"""

from __future__ import annotations

import asyncio

import pytest
from daemon_harness import (
    SimEngine,
    assert_clean,
    blocks_untouched,
    logged,
    metric,
    opened,
    status,
    until,
)
from test_faults import _cfg

from kvxferd.client import CallError
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.content import fill_blocks, request_seed

TOKENS = 100
WAIT_S = 20.0


def _trio(cluster: LocalCluster) -> tuple[DaemonProc, DaemonProc, DaemonProc]:
    cfg = _cfg(20000)
    ctx = cluster.start_daemon("ctx", "context", **cfg)
    gen = cluster.start_daemon("gen", "generation", **cfg)
    squat = cluster.start_daemon("squat", "generation", **cfg)
    return ctx, gen, squat


def refused_total(daemon: DaemonProc, reason: str) -> float:
    return metric(daemon, "kvxferd_refused_request_data_total", 0.0, reason=reason)


async def send(c: SimEngine, rid: str, peer: str | None = None) -> None:
    blocks = c.blocks_for(TOKENS)
    fill_blocks(c.pool, c.layout, blocks, request_seed(rid))
    await c.client.send(rid, c.pool_id, blocks, TOKENS, peer=peer)


def contenders(ctx: DaemonProc) -> int:
    return int(status(ctx)["contending_receives"])


def test_squatter_first_is_refused_when_the_send_names_the_real_peer(
    cluster: LocalCluster,
) -> None:
    """The squatter asks first, gen asks next (it waits as a contender), then the send
    names gen: the squatter is refused and gets nothing, gen gets every byte."""
    ctx, gen, squat = _trio(cluster)
    rid = "r-squatted-first"

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g, opened(squat) as q:
            q_blocks = await q.recv(rid, TOKENS, ctx.peer_address)
            await until(
                lambda: status(ctx)["sessions"]["send"] == {"ready": 1},
                what="the squatter's RequestData at the context daemon",
            )
            g_blocks = await g.recv(rid, TOKENS, ctx.peer_address)
            await until(lambda: contenders(ctx) == 1, what="gen's receive waits behind it")
            await send(c, rid, peer="gen")

            squatted = await q.client.wait(rid, timeout_s=WAIT_S)
            assert (squatted.status, squatted.reason) == ("failed", "not_your_request"), squatted
            assert "not yours" in squatted.message, squatted
            assert not squatted.blocks_held, squatted
            assert blocks_untouched(q, q_blocks)

            got = await g.client.wait(rid, timeout_s=WAIT_S)
            sent = await c.client.wait(rid, timeout_s=WAIT_S)
            assert (got.status, got.reason) == ("done", "ok"), got
            assert (sent.status, sent.reason) == ("done", "ok"), sent
            assert g.verify(rid, g_blocks, TOKENS).ok
            for client in (c.client, g.client, q.client):
                await client.release(rid)
            assert contenders(ctx) == 0

    asyncio.run(scenario())
    lines = logged(ctx, "not_your_request", "'squat'", "WARNING")
    assert len(lines) == 1 and "'gen'" in lines[0], lines
    assert refused_total(ctx, "not_your_request") == 1
    for daemon in (ctx, gen, squat):
        assert_clean(daemon)


def test_squatter_after_a_send_naming_the_real_peer(cluster: LocalCluster) -> None:
    """The send (naming gen) comes first; the squatter's RequestData is refused on
    arrival and the request keeps waiting for gen, which is served when it asks."""
    ctx, gen, squat = _trio(cluster)
    rid = "r-send-first"

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g, opened(squat) as q:
            # A peer must be a daemon name: refused before anything is accepted.
            with pytest.raises(CallError) as err:
                await c.client.send("r-bad-peer", c.pool_id, [0], TOKENS, peer="gen\nforged")
            assert err.value.code == "bad_request" and "not a daemon name" in str(err.value)
            await send(c, rid, peer="gen")
            q_blocks = await q.recv(rid, TOKENS, ctx.peer_address)
            squatted = await q.client.wait(rid, timeout_s=WAIT_S)
            assert (squatted.status, squatted.reason) == ("failed", "not_your_request"), squatted
            assert blocks_untouched(q, q_blocks)
            # Refusing it ended nothing here: the send still waits for its peer.
            assert status(ctx)["sessions"]["send"] == {"waiting_for_peer": 1}
            assert c.client.poll(rid) is None

            g_blocks = await g.recv(rid, TOKENS, ctx.peer_address)
            got = await g.client.wait(rid, timeout_s=WAIT_S)
            sent = await c.client.wait(rid, timeout_s=WAIT_S)
            assert (got.status, got.reason) == ("done", "ok"), got
            assert (sent.status, sent.reason) == ("done", "ok"), sent
            assert g.verify(rid, g_blocks, TOKENS).ok

            # Asking again once it is served: still not the squatter's.
            await q.client.release(rid)
            await q.recv(rid, TOKENS, ctx.peer_address)
            again = await q.client.wait(rid, timeout_s=WAIT_S)
            assert (again.status, again.reason) == ("failed", "not_your_request"), again
            for client in (c.client, g.client, q.client):
                await client.release(rid)

    asyncio.run(scenario())
    assert refused_total(ctx, "not_your_request") == 2
    assert len(logged(ctx, "not_your_request", "'squat'", count=2)) == 2
    for daemon in (ctx, gen, squat):
        assert_clean(daemon)


def test_send_without_peer_serves_the_first_and_tells_the_others(cluster: LocalCluster) -> None:
    """No peer in the send: whoever asks first is served, as before. A receive that comes
    after the KV went to the squatter is told that (already_served, naming it); one that
    waited behind the squatter is refused as a duplicate naming it; and one waiting behind
    a squatter that cancels takes its place and is served."""
    ctx, gen, squat = _trio(cluster)
    late, early, cancelled = "r-late", "r-early", "r-squatter-cancels"

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g, opened(squat) as q:
            # The squatter is served; gen asks after that.
            q_blocks = await q.recv(late, TOKENS, ctx.peer_address)
            await send(c, late)
            squatted = await q.client.wait(late, timeout_s=WAIT_S)
            sent = await c.client.wait(late, timeout_s=WAIT_S)
            assert (squatted.status, sent.status) == ("done", "done"), (squatted, sent)
            assert q.verify(late, q_blocks, TOKENS).ok
            await g.recv(late, TOKENS, ctx.peer_address)
            got = await g.client.wait(late, timeout_s=WAIT_S)
            assert (got.status, got.reason) == ("failed", "already_served"), got
            assert "already served to another peer (squat)" in got.message, got
            assert "named no peer" in got.message, got
            assert not got.blocks_held, got

            # Gen asks while the squatter's receive waits for the send: refused at the
            # send, naming who asked first.
            q_blocks = await q.recv(early, TOKENS, ctx.peer_address)
            await until(
                lambda: status(ctx)["sessions"]["send"].get("ready") == 1, what="the squatter"
            )
            await g.recv(early, TOKENS, ctx.peer_address)
            await until(lambda: contenders(ctx) == 1, what="gen's receive waits behind it")
            await send(c, early)
            got = await g.client.wait(early, timeout_s=WAIT_S)
            assert (got.status, got.reason) == ("failed", "peer_failed"), got
            assert "duplicate_request" in got.message and "(from squat)" in got.message, got
            squatted = await q.client.wait(early, timeout_s=WAIT_S)
            assert squatted.status == "done" and q.verify(early, q_blocks, TOKENS).ok

            # The squatter asks first and gives up before the send: gen, which waited
            # behind it, becomes the receiver and is served.
            await q.recv(cancelled, TOKENS, ctx.peer_address)
            await until(
                lambda: status(ctx)["sessions"]["send"].get("ready") == 1, what="the squatter"
            )
            g_blocks = await g.recv(cancelled, TOKENS, ctx.peer_address)
            await until(lambda: contenders(ctx) == 1, what="gen's receive waits behind it")
            assert await q.client.cancel(cancelled) == "cancelled"
            await until(lambda: contenders(ctx) == 0, what="gen's receive taken")
            await send(c, cancelled)
            got = await g.client.wait(cancelled, timeout_s=WAIT_S)
            assert (got.status, got.reason) == ("done", "ok"), got
            assert g.verify(cancelled, g_blocks, TOKENS).ok

            for rid in (late, early, cancelled):
                for client in (c.client, g.client, q.client):
                    await client.release(rid)

    asyncio.run(scenario())
    assert refused_total(ctx, "already_served") == 1
    assert refused_total(ctx, "duplicate_request") == 1
    assert refused_total(ctx, "not_your_request") == 0
    assert logged(ctx, "already_served", "'gen'", "'squat'")
    for daemon in (ctx, gen, squat):
        assert_clean(daemon)
