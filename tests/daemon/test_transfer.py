"""KV moves between two real daemons over NIXL and arrives byte for byte."""

from __future__ import annotations

import asyncio

import pytest
from daemon_harness import (
    SimEngine,
    assert_clean,
    delivered,
    opened,
    status,
    transfer_one,
    with_engines,
)

from kvxferd.client import CallError
from kvxferd.sim.cluster import DaemonProc

Pair = tuple[DaemonProc, DaemonProc]


async def _transfer(
    ctx: DaemonProc,
    gen: DaemonProc,
    requests: list[tuple[str, int]],
    ctx_major: str = "block-major",
    gen_major: str = "block-major",
    context_first: bool = False,
) -> None:
    async with (
        opened(ctx, major=ctx_major, num_blocks=256) as c,
        opened(gen, major=gen_major, num_blocks=256) as g,
    ):
        dst: dict[str, list[int]] = {}
        if context_first:
            for rid, tokens in requests:
                await c.send(rid, tokens)
            for rid, tokens in requests:
                dst[rid] = await g.recv(rid, tokens, ctx.peer_address)
        else:
            for rid, tokens in requests:
                dst[rid] = await g.recv(rid, tokens, ctx.peer_address)
            for rid, tokens in requests:
                await c.send(rid, tokens)
        for rid, tokens in requests:
            got, sent = await delivered(c, g, rid, dst[rid], tokens)
            assert got.nbytes == sent.nbytes > 0


def test_one_request_arrives_intact(pair: Pair) -> None:
    ctx, gen = pair
    asyncio.run(_transfer(ctx, gen, [("one", 200)]))
    assert_clean(ctx, gen)


@pytest.mark.parametrize(
    ("ctx_major", "gen_major"),
    [
        ("block-major", "block-major"),
        ("layer-major", "layer-major"),
        ("block-major", "layer-major"),
        ("layer-major", "block-major"),
    ],
)
def test_layouts_and_partial_last_blocks(pair: Pair, ctx_major: str, gen_major: str) -> None:
    ctx, gen = pair
    # 1 token, exactly one block, one past a block, and a long prompt with a partial tail.
    lengths = [1, 32, 33, 1000]
    reqs = [(f"lay-{ctx_major}-{gen_major}-{n}", n) for n in lengths]
    asyncio.run(_transfer(ctx, gen, reqs, ctx_major, gen_major))
    assert_clean(ctx, gen)


def test_many_concurrent_requests(pair: Pair) -> None:
    ctx, gen = pair
    reqs = [(f"many-{i}", 17 + 23 * i) for i in range(24)]  # 221 blocks in all
    asyncio.run(_transfer(ctx, gen, reqs))
    assert_clean(ctx, gen)


def test_context_first_order(pair: Pair) -> None:
    """The context engine sends before the receive is posted: the daemon holds the send."""
    ctx, gen = pair
    reqs = [(f"cfirst-{i}", 100 + i) for i in range(4)]
    asyncio.run(_transfer(ctx, gen, reqs, context_first=True))
    assert_clean(ctx, gen)


def test_duplicate_request_id_is_refused_and_first_is_unaffected(pair: Pair) -> None:
    ctx, gen = pair

    async def scenario(c: SimEngine, g: SimEngine) -> None:
        blocks = await g.recv("dup", 64, ctx.peer_address)
        with pytest.raises(CallError) as err:
            await g.recv("dup", 64, ctx.peer_address)
        assert err.value.code == "duplicate_request"
        await c.send("dup", 64)
        with pytest.raises(CallError) as err:
            await c.send("dup", 64)
        assert err.value.code == "duplicate_request"
        await delivered(c, g, "dup", blocks, 64)
        # After release the id may be used again.
        await transfer_one(ctx, c, g, "dup", 40)

    with_engines(ctx, gen, scenario)


def test_bad_calls_get_clear_errors_and_change_nothing(pair: Pair) -> None:
    ctx, gen = pair

    async def scenario(c: SimEngine, g: SimEngine) -> None:
        cases = [
            (g.client.recv("x", "nope", [0], ctx.peer_address), "unknown_pool"),
            (g.client.recv("x", "pool0", [999999], ctx.peer_address), "bad_request"),
            (g.client.recv("x", "pool0", [1, 1], ctx.peer_address), "bad_request"),
            (g.client.recv("x", "pool0", [1], "not-an-address"), "bad_request"),
            (g.client.recv("x", "pool0", [1, 2], ctx.peer_address, 500), "bad_request"),
            (g.client.send("x", "pool0", [1], 10), "wrong_role"),
            (c.client.recv("x", "pool0", [1], ctx.peer_address), "wrong_role"),
            (c.client.send("x", "pool0", [1, 2, 3], 10), "bad_request"),
            (c.client.send("x", "pool0", [1], 10, token_start=5), "bad_request"),
            (g.client.cancel("never-posted"), "unknown_request"),
            (g.client.release("never-posted"), "unknown_request"),
        ]
        for call, code in cases:
            with pytest.raises(CallError) as err:
                await call
            assert err.value.code == code, err.value
            assert err.value.message
        # The daemon still serves this engine normally.
        await transfer_one(ctx, c, g, "after-bad", 50)

    with_engines(ctx, gen, scenario)


def test_status_reports_peers_and_fingerprint(pair: Pair) -> None:
    ctx, gen = pair
    asyncio.run(_transfer(ctx, gen, [("status-probe", 10)]))
    doc = status(gen)
    assert doc["role"] == "generation" and doc["ready"] is True
    assert [p["name"] for p in doc["peers"]] == ["ctx"]
    assert doc["fingerprint"] == status(ctx)["fingerprint"]
    assert doc["settings"]["runtime"] == "PYTHON" and doc["settings"]["backend"] == "NIXL"


def test_small_writes_go_out_from_prepared_lists(pair: Pair) -> None:
    """A one-block request is written from NIXL descriptor lists prepared once per region
    (kvxferd.backends.nixl_prepared), arrives intact, and the status page counts it; the
    gen daemon, which writes nothing, prepares nothing."""
    ctx, gen = pair
    before = status(ctx)["data_plane"]
    asyncio.run(_transfer(ctx, gen, [("prepared-1", 10), ("prepared-2", 32)]))
    after = status(ctx)["data_plane"]
    assert after["prepared_writes"] - before["prepared_writes"] == 2
    assert after["inline_calls"] > before["inline_calls"]
    assert status(gen)["data_plane"]["prepared_writes"] == 0
    assert_clean(ctx, gen)
