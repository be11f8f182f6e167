"""AsyncClient.start_send / start_recv: a request written without a coroutine waiting for
the daemon's reply, and the future of its outcome. Real daemons and NIXL.

What must hold: the futures end with the requests' outcomes and the KV arrives; a refusal
fails the future with the code the waiting call raises, and gives the id back; a timeout
fails it with TimeoutError; the daemon's death fails it with DaemonGoneError; and none of
these leaves a wait or a started call behind in the client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

import pytest
from daemon_harness import SimEngine, assert_clean, opened

from kvxferd.client import AsyncClient, CallError, Client, DaemonGoneError, Outcome
from kvxferd.memory.shm import ShmRegion
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.content import clear_blocks, request_seed, verify_blocks

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


def _refusal(client: Client) -> BaseException:
    try:
        client.query("b4")
    except BaseException as exc:
        return exc
    raise AssertionError("a blocking call on the loop thread went through")


def test_the_blocking_clients_started_requests(pair: tuple[DaemonProc, DaemonProc]) -> None:
    """Client.start_recv / start_send: concurrent futures of the outcomes, with the same
    ends as AsyncClient's (the KV arrives; a refusal fails the future with the call's code;
    a bad argument fails it too: nothing waits at the call); cancelling a future leaves the
    request to the daemon; a start made on the client's loop thread (a done callback) is
    queued like any other, and one made after close fails its future."""
    ctx, gen = pair

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g:
            name = f"kvxferd-test-blocking-{os.getpid()}"
            region = ShmRegion.create(name, g.layout.pool_bytes)
            client = await asyncio.to_thread(Client, gen.api_socket, "blocking-test")
            try:
                try:
                    client.register_pool("bpool", name, g.layout)
                finally:
                    region.unlink()
                tpb = g.layout.tokens_per_block
                dst = list(range(-(-TOKENS // tpb)))
                got = client.start_recv(
                    "b1", "bpool", dst, ctx.peer_address, TOKENS, auto_release=True,
                    timeout_s=WAIT_S,
                )  # fmt: skip
                assert isinstance(got, concurrent.futures.Future)
                src = c.fill("b1", TOKENS)
                await c.client.send("b1", c.pool_id, src, TOKENS, auto_release=True)
                outcome = await asyncio.wait_for(asyncio.wrap_future(got), WAIT_S)
                assert outcome.status == "done" and outcome.auto_released, outcome
                seed = request_seed("b1")
                assert verify_blocks(region.array, g.layout, dst, seed, TOKENS).ok
                c.alloc.give(src)

                refused = client.start_send("b2", "bpool", dst, TOKENS)  # a generation daemon
                with pytest.raises(CallError) as err:
                    await asyncio.wait_for(asyncio.wrap_future(refused), WAIT_S)
                assert err.value.code == "wrong_role"
                # Nothing raises at the call: a bad argument fails the future too.
                bad = client.start_recv("b3", "bpool", ["x"], ctx.peer_address, TOKENS)  # type: ignore[list-item]
                with pytest.raises(ValueError):
                    bad.result(WAIT_S)

                lonely = client.start_recv("b4", "bpool", dst, ctx.peer_address, TOKENS)
                assert lonely.cancel() and lonely.cancelled()
                client._run(asyncio.sleep(0.05))  # the loop thread takes the cancel
                ((_, waiting),) = client._client._book._waiters["b4"]
                assert waiting.cancelled(), "the asyncio future was cancelled too"
                # A future's done callback may run on the loop thread: a blocking call
                # made there refuses instead of waiting for that thread forever.
                refusals: list[BaseException] = []
                client._loop.call_soon_threadsafe(lambda: refusals.append(_refusal(client)))
                client._run(asyncio.sleep(0))  # after that callback
                assert len(refusals) == 1 and isinstance(refusals[0], RuntimeError), refusals
                # A start is queued, not waited for: one made on the loop thread goes out.
                from_loop: list[concurrent.futures.Future[Outcome]] = []
                client._loop.call_soon_threadsafe(
                    lambda: from_loop.append(
                        client.start_recv("b6", "bpool", ["y"], ctx.peer_address, TOKENS)  # type: ignore[list-item]
                    )
                )
                client._run(asyncio.sleep(0))
                with pytest.raises(ValueError):
                    from_loop[0].result(WAIT_S)
                # The receive went on till now; a cancel and a release may be queued too.
                assert client.start_cancel("b4").result(WAIT_S) == "cancelled"
                assert client.wait("b4", WAIT_S).status == "cancelled"
                assert client.start_release("b4").result(WAIT_S) is None
                # Left pending: the daemon ends it when the engine leaves.
                orphan = client.start_recv("b5", "bpool", dst, ctx.peer_address, TOKENS)
                assert client.query("b5") in ("waiting_for_peer", "ready", "transferring")
            finally:
                client.close()
                region.close()
            # Closing the client fails what it started, on the engine's side too.
            with pytest.raises(DaemonGoneError):
                orphan.result(WAIT_S)
            late = client.start_recv("b7", "bpool", dst, ctx.peer_address, TOKENS)
            with pytest.raises(DaemonGoneError):
                late.result(WAIT_S)
            with pytest.raises(DaemonGoneError):
                client.start_cancel("b5").result(WAIT_S)

    asyncio.run(scenario())
    assert_clean(ctx, gen)
