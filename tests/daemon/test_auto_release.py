"""auto_release: a request sent or received with it is forgotten by its daemon as the
outcome goes out, so that the engine makes no release call (two frames each way less per
request). Real daemons and NIXL; the held case stops the writer for real.

What must hold: the outcome says so; the daemon has forgotten the request (query and a
second release are refused, status counts no session) without any call; the id moves
again right away; a request without the option is kept until released, as before; and a
receive whose blocks are held keeps its id taken until they are back, then frees it with
no call either.
"""

from __future__ import annotations

import asyncio
import signal

import pytest
from daemon_harness import SimEngine, assert_clean, opened, status, wait_for

from kvxferd.client import AsyncClient, CallError, Outcome
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.content import clear_blocks

TOKENS = 100
WAIT_S = 20.0


async def move(c: SimEngine, g: SimEngine, ctx: DaemonProc, rid: str, auto: bool) -> list[int]:
    """One request, both sides with auto_release `auto`; both done and verified."""
    blocks = g.blocks_for(TOKENS)
    clear_blocks(g.pool, g.layout, blocks)
    await g.client.recv(rid, g.pool_id, blocks, ctx.peer_address, TOKENS, auto_release=auto)
    sent_blocks = c.fill(rid, TOKENS)
    await c.client.send(rid, c.pool_id, sent_blocks, TOKENS, auto_release=auto)
    got = await g.client.wait(rid, WAIT_S)
    sent = await c.client.wait(rid, WAIT_S)
    assert (got.status, sent.status) == ("done", "done"), (got, sent)
    assert got.auto_released is auto and sent.auto_released is auto, (got, sent)
    assert g.verify(rid, blocks, TOKENS).ok
    c.alloc.give(sent_blocks)
    return blocks


async def forgotten(client: AsyncClient, rid: str) -> None:
    """The daemon no longer knows `rid`: query and a release that reaches it are refused."""
    for call in (client.query, client.release):
        with pytest.raises(CallError) as refused:
            await call(rid)
        assert refused.value.code == "unknown_request", refused.value


def test_auto_released_requests_are_forgotten_with_their_outcome(
    pair: tuple[DaemonProc, DaemonProc],
) -> None:
    ctx, gen = pair

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g:
            blocks = await move(c, g, ctx, "auto", auto=True)
            # Forgotten by both daemons with the outcome, without any call.
            assert status(gen)["sessions"]["recv"] == {}, status(gen)["sessions"]
            assert status(ctx)["sessions"]["send"] == {}, status(ctx)["sessions"]
            # The id stays taken until the engine released it: the client refuses.
            with pytest.raises(CallError) as dup:
                await g.client.recv("auto", g.pool_id, [0], ctx.peer_address, 16)
            assert dup.value.code == "duplicate_request", dup.value
            # release asks nothing: it drops the outcome kept by the client...
            await g.client.release("auto")
            await c.client.release("auto")
            assert g.client.poll("auto") is None and c.client.poll("auto") is None
            # ...and a release or query that does reach the daemon finds no such request.
            await forgotten(g.client, "auto")
            await forgotten(c.client, "auto")
            g.alloc.give(blocks)
            # The id is free again as soon as the outcome arrived: it moves again.
            blocks = await move(c, g, ctx, "auto", auto=True)
            assert c.client.forget("auto") and g.client.forget("auto")
            assert not c.client.forget("auto"), "nothing left to forget"
            g.alloc.give(blocks)
            # Without the option the daemons keep the request until it is released.
            blocks = await move(c, g, ctx, "kept", auto=False)
            assert not g.client.forget("kept") and not c.client.forget("kept")
            assert await g.client.query("kept") == "done"
            assert await c.client.query("kept") == "done"
            await g.client.release("kept")
            await c.client.release("kept")
            await forgotten(g.client, "kept")
            g.alloc.give(blocks)

    asyncio.run(scenario())
    assert_clean(ctx, gen)


def test_a_chunk_after_an_auto_released_failure_says_the_send_is_gone(
    pair: tuple[DaemonProc, DaemonProc],
) -> None:
    """A send cancelled after its first chunk is forgotten with its outcome: a later chunk
    of it is refused, saying no send of that id is active (not as a new request)."""
    ctx, _ = pair

    async def scenario() -> None:
        async with opened(ctx) as c:
            blocks = c.fill("chunked", TOKENS)
            half = 64  # two whole blocks of 32 tokens
            await c.client.send(
                "chunked", c.pool_id, blocks[:2], half, last=False, auto_release=True
            )
            assert await c.client.cancel("chunked") == "cancelled"
            o = await c.client.wait("chunked", WAIT_S)
            assert (o.status, o.auto_released) == ("cancelled", True), o
            with pytest.raises(CallError) as refused:
                await c.client.send(
                    "chunked", c.pool_id, blocks, TOKENS, token_start=half, auto_release=True
                )
            assert refused.value.code == "bad_request", refused.value
            assert "no send of 'chunked' is active" in refused.value.message, refused.value
            assert status(ctx)["sessions"]["send"] == {}

    asyncio.run(scenario())
    assert_clean(ctx)


def test_auto_released_receive_keeps_its_id_while_its_blocks_are_held(
    cluster: LocalCluster,
) -> None:
    """The writer is stopped after the request reached it: the receive fails with its
    blocks held. Its id stays taken (a recv with it is refused) although the engine made no
    release call; once the writer is back and confirms, `released` comes and the id is
    free, with no call either: the same id then moves."""
    timeouts = {"transceiver": {"kv_transfer_timeout_ms": 1500}}
    ctx = cluster.start_daemon("ctx", "context", **timeouts)
    gen = cluster.start_daemon("gen", "generation", **timeouts)

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g:
            blocks = g.blocks_for(TOKENS)
            await g.client.recv(
                "held", g.pool_id, blocks, ctx.peer_address, TOKENS, auto_release=True
            )
            wait_for(lambda: status(ctx)["sessions"]["send"] == {"ready": 1}, what="the request")
            ctx.kill(signal.SIGSTOP)
            try:
                o: Outcome = await g.client.wait("held", 15)
                assert o.blocks_held and o.auto_released, o
                await g.client.release("held")  # no call; the id stays taken meanwhile
                with pytest.raises(CallError) as dup:
                    await g.client.recv(
                        "held", g.pool_id, g.blocks_for(TOKENS), ctx.peer_address, TOKENS
                    )
                assert dup.value.code == "duplicate_request", dup.value
            finally:
                ctx.kill(signal.SIGCONT)
            released = await g.client.wait_released("held", 30)
            assert released.how == "abort_ack", released
            wait_for(lambda: status(gen)["sessions"]["recv"] == {}, what="the id to be free")
            wait_for(lambda: status(ctx)["sessions"]["send"] == {}, what="ctx to drop it")
            # The same id now moves, into the blocks that were held.
            clear_blocks(g.pool, g.layout, blocks)
            await g.client.recv(
                "held", g.pool_id, blocks, ctx.peer_address, TOKENS, auto_release=True
            )
            sent_blocks = c.fill("held", TOKENS)
            await c.client.send("held", c.pool_id, sent_blocks, TOKENS, auto_release=True)
            got = await g.client.wait("held", WAIT_S)
            sent = await c.client.wait("held", WAIT_S)
            assert (got.status, sent.status) == ("done", "done"), (got, sent)
            assert g.verify("held", blocks, TOKENS).ok

    asyncio.run(scenario())
    assert all(d.alive() for d in (ctx, gen))
    assert_clean(ctx, gen)
