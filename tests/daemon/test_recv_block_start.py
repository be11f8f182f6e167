"""A receive that starts at a block offset (decode-side prefix caching): the generation
engine already holds the first k blocks of the prompt, gives recv only its blocks for the
logical blocks k.., and those alone move. Real daemons, real NIXL on loopback (and UCX for
the two-sided staged path); the received blocks are verified byte for byte, and every other
block of the receiver's pool (the cached ones above all) must keep its sentinel bytes."""

from __future__ import annotations

import asyncio
import math
import os
from typing import Any

import numpy as np
import pytest
from daemon_harness import (
    GEOMETRY,
    SMALL_PIECES,
    SimEngine,
    assert_clean,
    layout_for,
    opened,
    staged_backends,
    status,
)

from kvxferd.client import CallError, Client
from kvxferd.memory import ShmRegion, TpRank
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.content import clear_blocks, fill_blocks, request_seed, verify_blocks

Pair = tuple[DaemonProc, DaemonProc]

# What a block the transfer must not touch holds: never a byte of the reference content
# of a whole block, nor zero.
SENTINEL = 0xA5
TIMEOUT_MS = 20000


class Engine(SimEngine):
    """The reference engine of one tensor-parallel rank, with a prefix cache to fake: its
    pool starts as SENTINEL bytes, and `given` collects the blocks a transfer may write."""

    tp: TpRank = TpRank()
    given: set[int]

    @classmethod
    async def open_tp(
        cls,
        daemon: DaemonProc,
        major: str = "block-major",
        num_blocks: int = 256,
        geometry: dict[str, Any] | None = None,
        tp: TpRank | None = None,
    ) -> Engine:
        tp = tp or TpRank()
        g = dict(geometry or GEOMETRY)
        g["num_kv_heads"] = g["num_kv_heads"] // tp.size
        engine = await cls.open(daemon, major, num_blocks, geometry=g, tp=tp, fill_with=SENTINEL)
        engine.given = set()
        return engine

    async def send_chunks(self, request_id: str, tokens: int, chunk: int | None = None) -> None:
        """Fill, then send the whole prompt (or chunk by chunk: pipelined transfer)."""
        blocks = self.fill(request_id, tokens)
        chunk = chunk or tokens
        tpb = self.layout.tokens_per_block
        for start in range(0, tokens, chunk):
            end = min(tokens, start + chunk)
            used = blocks[: math.ceil(end / tpb)]
            await self.client.send(
                request_id, self.pool_id, used, end, token_start=start, last=end == tokens
            )

    async def recv_from_block(
        self, request_id: str, tokens: int, k: int, peer: str | list[str]
    ) -> tuple[list[int], list[int]]:
        """Post a receive of the logical blocks k.. of a `tokens`-token request: (the k
        'cached' blocks, left out of the receive, and the receive's blocks). Both come from
        the same run of the allocator, so a write shifted by a block lands on a neighbour."""
        n = math.ceil(tokens / self.layout.tokens_per_block)
        cached = self.alloc.take(k)
        fresh = self.alloc.take(n - k)
        clear_blocks(self.pool, self.layout, fresh)
        self.given.update(fresh)
        await self.client.recv(request_id, self.pool_id, fresh, peer, tokens, block_start=k)
        return cached, fresh

    def touched(self) -> list[int]:
        """The blocks outside `given` whose bytes are no longer all SENTINEL."""
        others = sorted(set(range(self.layout.num_blocks)) - self.given)
        if not others:
            return []
        raw = np.asarray(self.pool_blocks(others))
        axes = (1,) if self.layout.major == "block-major" else (0, 2)
        intact = np.all(raw == SENTINEL, axis=axes)
        return [others[i] for i in np.flatnonzero(~intact)]

    def verify_from(
        self, request_id: str, cached: list[int], fresh: list[int], tokens: int
    ) -> None:
        """The receive's blocks hold the logical blocks k.. of the request. Checked once the
        cached blocks are shown untouched: they are then given the request's first k blocks
        (what a prefix cache holds) so that the whole request verifies in one pass."""
        assert not self.touched(), f"blocks outside the receive written: {self.touched()}"
        seed = request_seed(request_id)
        fill_blocks(self.pool, self.layout, cached, seed, tp=self.tp)
        self.given.update(cached)
        result = verify_blocks(self.pool, self.layout, cached + fresh, seed, tokens, tp=self.tp)
        assert result.ok, result.first_mismatch
        assert result.bytes_checked > 0


async def _done(engine: SimEngine, request_id: str) -> Any:
    outcome = await engine.client.wait(request_id, timeout_s=60)
    await engine.client.release(request_id)
    return outcome


async def _move(
    c: Engine,
    g: Engine,
    peer: str,
    cases: list[tuple[str, int, int]],
    chunk: int | None = None,
) -> None:
    """Each (request, tokens, k) in turn: receive from block k, send, check it all."""
    for rid, tokens, k in cases:
        cached, fresh = await g.recv_from_block(rid, tokens, k, peer)
        await c.send_chunks(rid, tokens, chunk)
        got, sent = await _done(g, rid), await _done(c, rid)
        assert (got.status, got.reason) == ("done", "ok"), got
        assert (sent.status, sent.reason) == ("done", "ok"), sent
        # Only the blocks k.. crossed: whole blocks, the partial tail included.
        assert got.nbytes == sent.nbytes == len(fresh) * g.layout.block_bytes, (got, sent)
        g.verify_from(rid, cached, fresh, tokens)


# ------------------------------------------------ the default path (PYTHON, NIXL)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with LocalCluster(tmp_path_factory.mktemp("block-start")) as cl:
        t = {"kv_transfer_timeout_ms": TIMEOUT_MS}
        ctx = cl.start_daemon("ctx", "context", transceiver=t)
        gen = cl.start_daemon("gen", "generation", transceiver=t)
        yield ctx, gen
        codes = cl.stop_all()
        assert codes == {"ctx": 0, "gen": 0}, (ctx.log_text()[-2000:], gen.log_text()[-2000:])


# (tokens, k): a few blocks cached; all but the partial tail cached; one block cached of two
# (the second partial); all but one whole block cached.
CASES = [(200, 2), (1000, 31), (33, 1), (256, 7)]


@pytest.mark.parametrize("gen_major", ["block-major", "layer-major"])
def test_only_the_blocks_from_block_start_move(pair: Pair, gen_major: str) -> None:
    ctx, gen = pair

    async def scenario() -> None:
        async with (
            opened(ctx, using=Engine.open_tp) as c,
            opened(gen, using=Engine.open_tp, major=gen_major) as g,
        ):
            cases = [(f"bs-{gen_major}-{n}-{k}", n, k) for n, k in CASES]
            await _move(c, g, ctx.peer_address, cases)
            # block_start 0 given explicitly is the ordinary receive.
            await _move(c, g, ctx.peer_address, [(f"bs-{gen_major}-zero", 100, 0)])

    asyncio.run(scenario())
    assert_clean(ctx, gen)


def test_bad_block_starts_are_refused_clearly(pair: Pair) -> None:
    ctx, gen = pair

    async def scenario() -> None:
        async with opened(ctx, using=Engine.open_tp) as c, opened(gen, using=Engine.open_tp) as g:
            peer = ctx.peer_address
            cases = [
                # A negative block index.
                (dict(blocks=[1, 2], tokens=64, k=-1), ["block_start", "-1"]),
                # Starts at token 64 of a 64-token request: nothing left to receive.
                (dict(blocks=[1], tokens=64, k=2), ["block_start 2", "token 64", "64 tokens"]),
                (dict(blocks=[1], tokens=10, k=5), ["block_start 5", "10 tokens"]),
                # 200 tokens are blocks 0..6: from block 2 on that is 5 blocks, not 4 or 6.
                (dict(blocks=[1, 2, 3, 4], tokens=200, k=2), ["200 tokens", "from block 2"]),
                (dict(blocks=list(range(1, 7)), tokens=200, k=2), ["from block 2"]),
            ]
            for case, words in cases:
                with pytest.raises(CallError) as err:
                    await g.client.recv(
                        "refused",
                        "pool0",
                        case["blocks"],
                        peer,
                        case["tokens"],
                        block_start=case["k"],
                    )
                assert err.value.code == "bad_request", err.value
                for word in words:
                    assert word in err.value.message, (word, err.value.message)

            # Without num_tokens the daemon cannot check the count; the context side does,
            # and fails the request on both sides, naming both counts and block_start.
            fresh = g.alloc.take(4)
            clear_blocks(g.pool, g.layout, fresh)
            g.given.update(fresh)
            await g.client.recv("short", "pool0", fresh, peer, block_start=2)
            await c.send_chunks("short", 200)  # 7 blocks: 5 are due from block 2 on
            got, sent = await _done(g, "short"), await _done(c, "short")
            assert (sent.status, sent.reason) == ("failed", "block_mismatch"), sent
            # The generation side hears the context side's reason.
            assert (got.status, got.reason) == ("failed", "peer_failed"), got
            assert "block_mismatch" in got.message, got
            for word in ("7 blocks", "block_start 2", "needs 5", "gave 4"):
                assert word in sent.message and word in got.message, (word, sent, got)
            assert not np.any(np.asarray(g.pool_blocks(fresh))), "written although refused"
            assert not g.touched()

            # The daemons serve on as before.
            await _move(c, g, peer, [("after-refusals", 100, 1)])

    asyncio.run(scenario())
    assert_clean(ctx, gen)


def test_the_blocking_client_passes_block_start(pair: Pair) -> None:
    _, gen = pair
    layout = layout_for("block-major", 8)
    region = ShmRegion.create(f"kvxferd-bs-blocking-{os.getpid()}", layout.pool_bytes)
    try:
        with Client(gen.api_socket, engine="blocking") as client:
            client.register_pool("blocking", region.name, layout)
            with pytest.raises(CallError) as err:
                client.recv("b", "blocking", [1, 2], "127.0.0.1:1", 64, block_start=3)
            assert err.value.code == "bad_request" and "block_start 3" in err.value.message
            client.deregister_pool("blocking")
    finally:
        region.unlink()
        region.close()
    assert_clean(gen)


# --------------------------------- the bounce buffer, pipelined transfer, staged rounds

# SMALL_PIECES (layer-major): many segments a request, what the bounce is for.


def test_through_the_bounce_buffer(cluster: LocalCluster) -> None:
    cluster.geometry = dict(SMALL_PIECES)
    t = {"kv_cache_bounce_size_mb": 8, "kv_transfer_timeout_ms": TIMEOUT_MS}
    ctx = cluster.start_daemon("ctx", "context", transceiver=t)
    gen = cluster.start_daemon("gen", "generation", transceiver=t)

    async def scenario() -> None:
        kw = dict(using=Engine.open_tp, major="layer-major", num_blocks=2048, geometry=SMALL_PIECES)
        async with opened(ctx, **kw) as c, opened(gen, **kw) as g:
            # Scattered blocks: many segments, so that bouncing pays off (a stray write is still
            # caught: every block outside the receive keeps its sentinel).
            c.alloc.shuffle(7)
            g.alloc.shuffle(3)
            await _move(c, g, ctx.peer_address, [("bounce-a", 1000, 5), ("bounce-b", 4000, 60)])

    asyncio.run(scenario())
    for d in (ctx, gen):
        b = status(d)["bounce"]
        assert b["reservations_made"] >= 2 and b["fallbacks"] == 0, b
        assert b["send_in_use_bytes"] == 0 and b["recv_in_use_bytes"] == 0, b
        assert_clean(d)


def test_pipelined_chunks_before_and_across_block_start(cluster: LocalCluster) -> None:
    t = {"enable_pipelined_transfer": True, "kv_transfer_timeout_ms": TIMEOUT_MS}
    engine = {"enable_chunked_prefill": True}
    ctx = cluster.start_daemon("ctx", "context", transceiver=t, engine=engine)
    gen = cluster.start_daemon("gen", "generation", transceiver=t, engine=engine)

    async def scenario() -> None:
        async with opened(ctx, using=Engine.open_tp) as c, opened(gen, using=Engine.open_tp) as g:
            peer = ctx.peer_address
            # 50-token chunks: the first two end before block 3 (token 96) and send nothing,
            # the third straddles it.
            await _move(c, g, peer, [("pipe-before", 1000, 3)], chunk=50)
            # 320-token chunks (10 blocks): the first straddles block 5, only 5.. move.
            await _move(c, g, peer, [("pipe-across", 640, 5)], chunk=320)
            # Every chunk but the last is before block_start: the last one moves it all.
            await _move(c, g, peer, [("pipe-tail", 100, 3)], chunk=32)

    asyncio.run(scenario())
    assert_clean(ctx, gen)


STAGED = [p for p in staged_backends() if p.id in ("NIXL", "UCX")]


@pytest.mark.parametrize("backend", STAGED)
def test_staged_rounds_start_at_block_start(cluster: LocalCluster, backend: str) -> None:
    # 128 tokens of staging = 4 blocks a round.
    t = {
        "backend": backend,
        "transceiver_runtime": "CPP",
        "kv_transfer_timeout_ms": TIMEOUT_MS,
        "max_tokens_in_buffer": 128,
    }
    ctx = cluster.start_daemon("ctx", "context", transceiver=t)
    gen = cluster.start_daemon("gen", "generation", transceiver=t)

    async def scenario() -> None:
        async with (
            opened(ctx, using=Engine.open_tp, num_blocks=512) as c,
            opened(gen, using=Engine.open_tp, major="layer-major", num_blocks=512) as g,
        ):
            c.alloc.shuffle(1)
            # 1000 tokens from block 6: 26 blocks in 7 rounds, the first from block 6.
            cases = [("st-long", 1000, 6), ("st-tail", 129, 4), ("st-one-round", 200, 3)]
            await _move(c, g, ctx.peer_address, cases)

    asyncio.run(scenario())
    for d in (ctx, gen):
        staging = status(d)["staging"]
        assert staging["send_in_use_bytes"] == 0 and staging["recv_in_use_bytes"] == 0
        assert_clean(d)


def test_head_split_ranks_each_receive_from_block_start(cluster: LocalCluster) -> None:
    """Context TP 1 into generation TP 2: each rank takes its heads of the blocks k.."""
    heads = GEOMETRY["num_kv_heads"]

    def start(name: str, role: str, size: int) -> DaemonProc:
        engine = {
            "tensor_parallel_size": size,
            "kv_layout": dict(GEOMETRY, num_kv_heads=heads // size),
        }
        t = {"kv_transfer_timeout_ms": TIMEOUT_MS}
        return cluster.start_daemon(name, role, engine=engine, transceiver=t)

    solo = start("solo", "context", 1)
    halves = [start("half0", "generation", 2), start("half1", "generation", 2)]

    async def scenario() -> None:
        c = await Engine.open_tp(solo, num_blocks=64)
        gens = [
            await Engine.open_tp(d, "layer-major", 64, tp=TpRank(rank, 2))
            for rank, d in enumerate(halves)
        ]
        try:
            for rid, tokens, k in (("split-a", 150, 2), ("split-b", 224, 6)):
                posted = [await g.recv_from_block(rid, tokens, k, solo.peer_address) for g in gens]
                await c.send_chunks(rid, tokens)
                sent = await _done(c, rid)
                got = [await _done(g, rid) for g in gens]
                assert (sent.status, sent.reason) == ("done", "ok"), sent
                for outcome in got:
                    assert (outcome.status, outcome.reason) == ("done", "ok"), outcome
                fresh = len(posted[0][1])
                assert sent.nbytes == sum(o.nbytes for o in got) == fresh * c.layout.block_bytes
                for g, (cached, blocks) in zip(gens, posted, strict=True):
                    g.verify_from(rid, cached, blocks, tokens)
        finally:
            await c.close()
            for g in gens:
                await g.close()

    asyncio.run(scenario())
    for d in (solo, *halves):
        assert_clean(d)
