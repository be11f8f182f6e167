"""AsyncClient.start_send / start_recv: a request written without a coroutine waiting for
the daemon's reply, and the future of its outcome. Real daemons and NIXL.

What must hold: the futures end with the requests' outcomes and the KV arrives; a refusal
fails the future with the code the waiting call raises, and gives the id back; a timeout
fails it with TimeoutError; the daemon's death fails it with DaemonGoneError; and none of
these leaves a wait or a started call behind in the client.
"""

from __future__ import annotations

import asyncio

import pytest
from daemon_harness import SimEngine, assert_clean, opened

from kvxferd.client import AsyncClient, CallError, DaemonGoneError
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.content import clear_blocks

TOKENS = 100
WAIT_S = 20.0


def left_behind(client: AsyncClient) -> tuple[object, object]:
    """What the client still keeps for requests in flight: waits, started calls."""
    return client._book._waiters, client._started._calls


def test_started_requests_end_with_their_outcomes(pair: tuple[DaemonProc, DaemonProc]) -> None:
    ctx, gen = pair

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g:
            rids = [f"started-{i}" for i in range(8)]
            dst: dict[str, list[int]] = {}
            got, sent = {}, {}
            for rid in rids:  # every receive first, then every send: all in flight at once
                dst[rid] = g.blocks_for(TOKENS)
                clear_blocks(g.pool, g.layout, dst[rid])
                got[rid] = g.client.start_recv(
                    rid, g.pool_id, dst[rid], ctx.peer_address, TOKENS, auto_release=True,
                    timeout_s=WAIT_S,
                )  # fmt: skip
            src = {rid: c.fill(rid, TOKENS) for rid in rids}
            for rid in rids:
                sent[rid] = c.client.start_send(
                    rid, c.pool_id, src[rid], TOKENS, auto_release=True, timeout_s=WAIT_S
                )
            for rid in rids:
                r, s = await got[rid], await sent[rid]
                assert (r.status, s.status) == ("done", "done"), (r, s)
                assert r.request_id == s.request_id == rid and r.side == "recv"
                assert r.auto_released and s.auto_released
                assert g.verify(rid, dst[rid], TOKENS).ok, rid
                assert g.client.forget(rid) and c.client.forget(rid)
                c.alloc.give(src[rid])
                g.alloc.give(dst[rid])
            assert left_behind(g.client) == ({}, {}) and left_behind(c.client) == ({}, {})

    asyncio.run(scenario())
    assert_clean(ctx, gen)


def test_a_refused_start_fails_its_future_and_gives_the_id_back(
    pair: tuple[DaemonProc, DaemonProc],
) -> None:
    ctx, gen = pair

    async def scenario() -> None:
        async with opened(gen) as g:
            with pytest.raises(CallError) as waited:  # what the waiting call says
                await g.client.recv("refused", "no-such-pool", [0], ctx.peer_address, 16)
            for _ in range(2):  # the second time: the id was given back, not duplicate
                done = g.client.start_recv(
                    "refused", "no-such-pool", [0], ctx.peer_address, 16, auto_release=True
                )
                with pytest.raises(CallError) as started:
                    await asyncio.wait_for(done, WAIT_S)
                assert started.value.code == waited.value.code != "duplicate_request"
                assert started.value.message == waited.value.message
                assert left_behind(g.client) == ({}, {})
            assert not g.client._book.auto_ids

    asyncio.run(scenario())
    assert_clean(ctx, gen)


def test_a_start_that_times_out_leaves_nothing(pair: tuple[DaemonProc, DaemonProc]) -> None:
    ctx, gen = pair

    async def scenario() -> None:
        async with opened(gen) as g:
            blocks = g.blocks_for(TOKENS)
            done = g.client.start_recv(
                "lonely", g.pool_id, blocks, ctx.peer_address, TOKENS, timeout_s=0.2
            )  # no send will come
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(done, WAIT_S)
            assert left_behind(g.client) == ({}, {})
            # The receive itself goes on at the daemon until cancelled.
            assert await g.client.cancel("lonely") == "cancelled"
            outcome = await g.client.wait("lonely", WAIT_S)
            assert outcome.status == "cancelled", outcome
            await g.client.release("lonely")
            g.alloc.give(blocks)

    asyncio.run(scenario())
    assert_clean(ctx, gen)


def test_the_daemons_death_fails_a_started_request(cluster: LocalCluster) -> None:
    ctx = cluster.start_daemon("ctx", "context")
    gen = cluster.start_daemon("gen", "generation")

    async def scenario() -> None:
        g = await SimEngine.open(gen)
        try:
            done = g.client.start_recv(
                "orphan", g.pool_id, g.blocks_for(TOKENS), ctx.peer_address, TOKENS
            )
            await asyncio.sleep(0)  # written; no send will come
            gen.kill()
            with pytest.raises(DaemonGoneError):
                await asyncio.wait_for(done, WAIT_S)
            assert left_behind(g.client) == ({}, {})
            with pytest.raises(DaemonGoneError):  # and a start after it fails at once
                g.client.start_send("later", g.pool_id, [0], 16, auto_release=True)
            assert not g.client._book.auto_ids, "the id a failed start took is given back"
        finally:
            await g.close(deregister=False)

    asyncio.run(scenario())


def test_a_start_checks_its_arguments_before_taking_the_id() -> None:
    client = AsyncClient(None, None)  # type: ignore[arg-type]  # never connected

    async def calls() -> None:
        with pytest.raises(ValueError):
            client.start_send("r", "pool0", ["not a block"], 16, auto_release=True)  # type: ignore[list-item]
        with pytest.raises(DaemonGoneError):
            client.start_recv("r", "pool0", [1], "ctx0", 16, auto_release=True)
        assert not client._book.auto_ids and left_behind(client) == ({}, {})

    asyncio.run(calls())
