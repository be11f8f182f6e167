"""Request identity across context instances (issue 18): request ids are unique per
context instance only, so one generation daemon serving two context daemons may receive
"r1" from both at once. A receive is (context peer as named, request id): both land in
their own blocks with their own content, cancel, release and query tell them apart by
peer (and refuse `ambiguous_request` without one), and neither a context daemon ending
its own "r1" nor a hostile peer speaking of "r1" touches the other's receive.

Each context engine fills its blocks with content seeded by its own name as well as the
id, so a receive that got the other context's KV would fail verification.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from daemon_harness import SimEngine, assert_clean, opened, status, until
from nixl_harness import nixl_or_skip

from kvxferd.client import CallError
from kvxferd.memory.layout import KvLayout
from kvxferd.peers.handshake import Identity
from kvxferd.peers.messages import PEER_CODEC, Abort, RequestData, Result
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.content import fill_blocks, request_seed, verify_blocks
from kvxferd.sim.hostile.intruder import Credentials, fake_info, handshake

TOKENS = 100
WAIT_S = 20.0
RID = "r1"

Trio = tuple[DaemonProc, DaemonProc, DaemonProc]


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trio]:
    """Two context daemons and one generation daemon that knows ctxa and ctxb by name."""
    with LocalCluster(tmp_path_factory.mktemp("identity")) as c:
        cfg = {"transceiver": {"kv_transfer_timeout_ms": 20000}}
        ctxa = c.start_daemon("ctxa", "context", **cfg)
        ctxb = c.start_daemon("ctxb", "context", **cfg)
        peers = {"ctxa": ctxa.peer_address, "ctxb": ctxb.peer_address}
        gen = c.start_daemon("gen", "generation", daemon={"peers": peers}, **cfg)
        yield ctxa, ctxb, gen
        assert c.stop_all() == {"ctxa": 0, "ctxb": 0, "gen": 0}


def seed_of(ctx: DaemonProc, rid: str) -> int:
    """Content that says which context instance wrote it."""
    return request_seed(f"{ctx.name}/{rid}")


async def send_from(
    ctx: DaemonProc, c: SimEngine, rid: str, last: bool = True, tokens: int = TOKENS
) -> None:
    blocks = c.blocks_for(tokens)
    fill_blocks(c.pool, c.layout, blocks, seed_of(ctx, rid))
    await c.client.send(rid, c.pool_id, blocks, tokens, last=last)


def holds(g: SimEngine, ctx: DaemonProc, rid: str, blocks: list[int]) -> bool:
    layout: KvLayout = g.layout
    return verify_blocks(g.pool, layout, blocks, seed_of(ctx, rid), TOKENS).ok


def test_two_contexts_send_the_same_id_to_one_generation_daemon(trio: Trio) -> None:
    """Both contexts send "r1" at the same time (one named by name, one by address): each
    lands verified in its own blocks; calls without a peer are refused as ambiguous and
    name both; with a peer (as named, or the daemon's name) they act on that one only."""
    ctxa, ctxb, gen = trio

    async def scenario() -> None:
        async with opened(ctxa) as a, opened(ctxb) as b, opened(gen) as g:
            a_blocks = await g.recv(RID, TOKENS, "ctxa")
            b_blocks = await g.recv(RID, TOKENS, ctxb.peer_address)
            # The same id from the same peer again is still a duplicate, naming the peer.
            with pytest.raises(CallError) as dup:
                await g.recv(RID, TOKENS, "ctxa")
            assert dup.value.code == "duplicate_request" and "'ctxa'" in dup.value.message

            await asyncio.gather(send_from(ctxa, a, RID), send_from(ctxb, b, RID))
            got_a = await g.client.wait(RID, timeout_s=WAIT_S, peer="ctxa")
            got_b = await g.client.wait(RID, timeout_s=WAIT_S, peer=ctxb.peer_address)
            assert (got_a.status, got_a.peer) == ("done", "ctxa"), got_a
            assert (got_b.status, got_b.peer) == ("done", ctxb.peer_address), got_b
            for ctx, c in ((ctxa, a), (ctxb, b)):
                sent = await c.client.wait(RID, timeout_s=WAIT_S)
                assert sent.status == "done", (ctx.name, sent)
            assert holds(g, ctxa, RID, a_blocks) and holds(g, ctxb, RID, b_blocks)
            # Each got its own context's KV, not the other's.
            assert not holds(g, ctxb, RID, a_blocks) and not holds(g, ctxa, RID, b_blocks)

            # Without a peer: refused, naming both candidates (daemon and client alike).
            for call in (g.client.query(RID), g.client.release(RID), g.client.cancel(RID)):
                try:
                    await call
                except CallError as exc:
                    assert exc.code == "ambiguous_request", exc
                    assert "'ctxa'" in exc.message and repr(ctxb.peer_address) in exc.message
                else:
                    raise AssertionError("a call without a peer was accepted")
            with pytest.raises(CallError) as amb:
                g.client.poll(RID)
            assert amb.value.code == "ambiguous_request"
            assert await g.client.query(RID, peer="ctxa") == "done"
            assert await g.client.cancel(RID, peer="ctxa") == "finished"
            # A peer no receive of the id names is unknown, and says which peers are.
            with pytest.raises(CallError) as unknown:
                await g.client.release(RID, peer="elsewhere:1")
            assert unknown.value.code == "unknown_request" and "'ctxa'" in unknown.value.message
            # ctxb was named by address; its daemon name finds it too.
            await g.client.release(RID, peer="ctxb")
            assert g.client.poll(RID, peer="ctxa") is got_a
            # One left: an older engine's call without a peer means it again.
            await g.client.release(RID)
            assert status(gen)["sessions"]["recv"] == {}
            for c in (a, b):
                await c.client.release(RID)

    asyncio.run(scenario())
    assert_clean(*trio)


def test_one_context_ending_its_request_leaves_the_others_alone(trio: Trio) -> None:
    """ctxb's engine cancels its "r1" (its daemon tells gen with an Abort for its own
    receive): only gen's receive from ctxb ends; the one from ctxa is served after it, and
    an old engine's cancel without a peer works once the id is unambiguous."""
    ctxa, ctxb, gen = trio

    async def scenario() -> None:
        async with opened(ctxa) as a, opened(ctxb) as b, opened(gen) as g:
            a_blocks = await g.recv(RID, TOKENS, "ctxa")
            await g.recv(RID, TOKENS, "ctxb")
            await until(
                lambda: status(ctxb)["sessions"]["send"] == {"ready": 1},
                what="gen's RequestData at ctxb",
            )
            await send_from(ctxb, b, RID, last=False)  # a first chunk: nothing moves yet
            assert await b.client.cancel(RID) == "cancelled"
            ended = await g.client.wait(RID, timeout_s=WAIT_S, peer="ctxb")
            assert (ended.status, ended.reason, ended.peer) == (
                "cancelled",
                "peer_cancelled",
                "ctxb",
            ), ended
            assert g.client.poll(RID, peer="ctxa") is None
            assert status(gen)["sessions"]["recv"] == {"ready": 1, "cancelled": 1}

            await send_from(ctxa, a, RID)
            got = await g.client.wait(RID, timeout_s=WAIT_S, peer="ctxa")
            assert got.status == "done" and holds(g, ctxa, RID, a_blocks), got
            for peer in ("ctxa", "ctxb"):
                await g.client.release(RID, peer=peer)
            for c in (a, b):
                await c.client.release(RID)

            # Alone again: a cancel and release without a peer, as an old engine sends.
            await g.recv(RID, TOKENS, "ctxb")
            assert await g.client.cancel(RID) == "cancelled"
            assert (await g.client.wait(RID, timeout_s=WAIT_S)).status == "cancelled"
            await g.client.release(RID)

    asyncio.run(scenario())
    assert_clean(*trio)


def test_the_same_daemon_named_two_ways_is_one_context_instance(trio: Trio) -> None:
    """The name "ctxa" and its HOST:PORT are the same daemon: a second receive of the id through
    the other spelling fails (duplicate_request, once connected: only the handshake tells
    who a HOST:PORT is), and the first is served as if nothing happened."""
    ctxa, _, gen = trio

    async def scenario() -> None:
        async with opened(ctxa) as a, opened(gen) as g:
            blocks = await g.recv(RID, TOKENS, "ctxa")
            await until(
                lambda: status(gen)["sessions"]["recv"] == {"ready": 1},
                what="the first receive connected",
            )
            await g.recv(RID, TOKENS, ctxa.peer_address)
            second = await g.client.wait(RID, timeout_s=WAIT_S, peer=ctxa.peer_address)
            assert (second.status, second.reason, second.fault) == (
                "failed",
                "duplicate_request",
                "local",
            ), second
            assert "'ctxa'" in second.message and "name a context daemon one way" in (
                second.message
            )
            await send_from(ctxa, a, RID)
            got = await g.client.wait(RID, timeout_s=WAIT_S, peer="ctxa")
            assert got.status == "done" and holds(g, ctxa, RID, blocks), got
            for peer in ("ctxa", ctxa.peer_address):
                await g.client.release(RID, peer=peer)
            await a.client.release(RID)

    asyncio.run(scenario())
    assert_clean(*trio)


def test_a_hostile_context_peer_cannot_touch_another_contexts_receive(trio: Trio) -> None:
    """An authenticated peer ("evil", a context daemon by its handshake) sends Abort,
    Result and RequestData for "r1" while gen's receive of "r1" from ctxa waits: with any
    token it cannot know, and the receive is served whole afterwards."""
    nixl = nixl_or_skip()
    ctxa, _, gen = trio
    agent = nixl.nixl_agent(
        "evil.1", nixl.nixl_agent_config(enable_listen_thread=False, backends=["UCX"])
    )
    creds = Credentials(
        secret=(gen.config_path.parent / "gen.secret").read_bytes().rstrip(),
        agent_name="evil.1",
        agent_metadata=bytes(agent.get_agent_metadata()),
    )

    async def scenario() -> None:
        async with opened(ctxa) as a, opened(gen) as g:
            blocks = await g.recv(RID, TOKENS, "ctxa")
            await until(
                lambda: status(ctxa)["sessions"]["send"] == {"ready": 1},
                what="gen's RequestData at ctxa",
            )
            evil = await handshake(
                gen, Identity("evil", "1", "context", creds.secret), fake_info(gen, creds), 10
            )
            try:
                for token in (0, 1, 2**62, 12345):
                    for msg in (
                        Abort(request_id=RID, rx_token=token, reason="cancelled"),
                        Result(request_id=RID, rx_token=token, status="ok", nbytes=1),
                        RequestData(request_id=RID, rx_token=token, pool_id="pool0", blocks=[0]),
                    ):
                        assert evil.write(PEER_CODEC.encode(msg))
                assert await evil.pong(7, 10) == "pong"  # all of it was read by now
                assert g.client.poll(RID) is None
                assert status(gen)["sessions"]["recv"] == {"ready": 1}
            finally:
                evil.writer.close()
            await send_from(ctxa, a, RID)
            got = await g.client.wait(RID, timeout_s=WAIT_S)
            assert got.status == "done" and holds(g, ctxa, RID, blocks), got
            await g.client.release(RID)
            await a.client.release(RID)

    asyncio.run(scenario())
    del agent
    assert_clean(*trio)
