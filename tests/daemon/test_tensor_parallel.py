"""Different tensor-parallel sizes on each side: head-merge (context TP 2 -> generation TP 1),
head-split (TP 1 -> TP 2, TP 2 -> TP 4), the refusals, and the faults of one leg (a peer
dying before or after it was served, a stray or hostile RequestData). Real daemons (one per
rank) as separate processes, real NIXL on loopback; every byte of every rank's pool is
verified."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from daemon_harness import (
    GEOMETRY,
    SimEngine,
    assert_clean,
    delivered,
    layout_for,
    peer_names,
    staged_backends,
    status,
    wait_for,
)
from nixl_harness import nixl_or_skip

from kvxferd.client import AsyncClient, CallError
from kvxferd.memory import ShmRegion, TpRank
from kvxferd.peers.compat import tp_support_problem
from kvxferd.peers.handshake import Identity, client_handshake
from kvxferd.peers.messages import PEER_CODEC, Abort, Info, Ping, Pong, PoolInfo, RequestData
from kvxferd.sim.cluster import DaemonProc, LocalCluster

TOTAL_HEADS = GEOMETRY["num_kv_heads"]  # 4: two per rank at TP 2, one at TP 4
TIMEOUT_MS = 20000


class RankEngine(SimEngine):
    """The reference engine of one tensor-parallel rank: its pool holds its heads."""

    @classmethod
    async def open_rank(
        cls,
        daemon: DaemonProc,
        tp: TpRank,
        major: str = "block-major",
        num_blocks: int = 64,
        heads: int | None = None,
        base: dict[str, Any] | None = None,
    ) -> RankEngine:
        """`heads`: this rank's (default: its share of TOTAL_HEADS); `base`: the geometry."""
        geometry = dict(base or GEOMETRY, num_kv_heads=heads or TOTAL_HEADS // tp.size)
        return await cls.open(daemon, major, num_blocks, geometry=geometry, tp=tp)


def _start(cluster: LocalCluster, name: str, role: str, tp_size: int, **kw: Any) -> DaemonProc:
    engine = {
        "tensor_parallel_size": tp_size,
        "kv_layout": dict(GEOMETRY, num_kv_heads=TOTAL_HEADS // tp_size),
    }
    engine.update(kw.pop("engine", {}))
    transceiver = {"kv_transfer_timeout_ms": TIMEOUT_MS, **kw.pop("transceiver", {})}
    return cluster.start_daemon(name, role, engine=engine, transceiver=transceiver, **kw)


@pytest.fixture(scope="module")
def tp_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, DaemonProc]]:
    """Context TP 2 (ctx0, ctx1), generation TP 1 (gen); context TP 1 (solo), generation
    TP 2 (half0, half1). Shared by the well-behaved tests of this module."""
    with LocalCluster(tmp_path_factory.mktemp("tp")) as c:
        d = {
            "ctx0": _start(c, "ctx0", "context", 2),
            "ctx1": _start(c, "ctx1", "context", 2),
            "gen": _start(c, "gen", "generation", 1),
            "solo": _start(c, "solo", "context", 1),
            "half0": _start(c, "half0", "generation", 2),
            "half1": _start(c, "half1", "generation", 2),
        }
        yield d
        codes = c.stop_all()
        assert set(codes.values()) == {0}, codes


# Odd block counts (1, 3, 5, 7 blocks of 32 tokens), partial tails included.
LENGTHS = [1, 70, 150, 224]


@contextlib.asynccontextmanager
async def ranks(
    daemons: list[DaemonProc], size: int, major: str
) -> AsyncIterator[list[RankEngine]]:
    engines = [
        await RankEngine.open_rank(d, TpRank(rank, size), major) for rank, d in enumerate(daemons)
    ]
    try:
        yield engines
    finally:
        for e in engines:
            await e.close()


async def _outcomes(engine: SimEngine, request_id: str) -> Any:
    outcome = await engine.client.wait(request_id, timeout_s=30)
    await engine.client.release(request_id)
    return outcome


async def _done(engine: SimEngine, request_id: str) -> Any:
    """The request's outcome (released), which must be done and ok."""
    outcome = await _outcomes(engine, request_id)
    assert (outcome.status, outcome.reason) == ("done", "ok"), outcome
    return outcome


async def _merge(cs: list[RankEngine], g: RankEngine, peers: list[str], prefix: str) -> None:
    """Head-merge: one request `prefix`-n of each of LENGTHS from the context ranks `cs`
    (TP 2) into `g` (TP 1). Every outcome done and ok, each context rank moving its half of
    every token and no more, every byte verified."""
    dst = {f"{prefix}-{n}": (await g.recv(f"{prefix}-{n}", n, peers), n) for n in LENGTHS}
    for rid, (_, n) in dst.items():
        for c in cs:
            await c.send(rid, n)
    for rid, (blocks, n) in dst.items():
        got = await _outcomes(g, rid)
        sent = [await _outcomes(c, rid) for c in cs]
        assert (got.status, got.reason) == ("done", "ok"), got
        for one in sent:
            assert (one.status, one.reason) == ("done", "ok"), one
            assert one.nbytes == len(blocks) * g.layout.block_bytes // 2
        assert got.nbytes == sum(one.nbytes for one in sent)
        result = g.verify(rid, blocks, n)
        assert result.ok and result.bytes_checked > 0, result.first_mismatch


async def _split(c: RankEngine, gs: list[RankEngine], peer: str, prefix: str) -> None:
    """Head-split: one request `prefix`-n of each of LENGTHS from `c` (TP 1) into the
    generation ranks `gs` (TP 2), the send posted before the receives for every other one.
    Every outcome done and ok, each rank receiving its half of every token, every byte of
    every rank verified."""
    dst: dict[str, tuple[list[list[int]], int]] = {}
    for i, n in enumerate(LENGTHS):
        rid = f"{prefix}-{n}"
        if i % 2:
            # Context first: the daemon holds the send until both ranks asked.
            await c.send(rid, n)
        dst[rid] = ([await g.recv(rid, n, peer) for g in gs], n)
        if not i % 2:
            await c.send(rid, n)
    for rid, (blocks, n) in dst.items():
        sent = await _outcomes(c, rid)
        got = [await _outcomes(g, rid) for g in gs]
        assert (sent.status, sent.reason) == ("done", "ok"), sent
        for one, g in zip(got, gs, strict=True):
            assert (one.status, one.reason) == ("done", "ok"), one
            assert one.nbytes == len(blocks[0]) * g.layout.block_bytes
        assert sent.nbytes == sum(one.nbytes for one in got)
        assert sent.nbytes == len(blocks[0]) * c.layout.block_bytes
        for g, b in zip(gs, blocks, strict=True):
            result = g.verify(rid, b, n)
            assert result.ok, (g.tp, result.first_mismatch)


MAJOR_PAIRS = [
    ("block-major", "block-major"),
    ("layer-major", "layer-major"),
    ("block-major", "layer-major"),
]


@pytest.mark.parametrize(("ctx_major", "gen_major"), MAJOR_PAIRS)
def test_head_merge_two_context_ranks_into_one(
    tp_cluster: dict[str, DaemonProc], ctx_major: str, gen_major: str
) -> None:
    d = tp_cluster
    peers = [d["ctx0"].peer_address, d["ctx1"].peer_address]

    async def scenario() -> None:
        async with (
            ranks([d["ctx0"], d["ctx1"]], 2, ctx_major) as ctx,
            ranks([d["gen"]], 1, gen_major) as (gen,),
        ):
            await _merge(ctx, gen, peers, f"merge-{ctx_major}-{gen_major}")

    asyncio.run(scenario())
    for name in ("ctx0", "ctx1", "gen"):
        assert_clean(d[name])


@pytest.mark.parametrize(("ctx_major", "gen_major"), MAJOR_PAIRS)
def test_head_split_one_context_rank_into_two(
    tp_cluster: dict[str, DaemonProc], ctx_major: str, gen_major: str
) -> None:
    d = tp_cluster
    solo = d["solo"].peer_address

    async def scenario() -> None:
        async with (
            ranks([d["solo"]], 1, ctx_major) as (ctx,),
            ranks([d["half0"], d["half1"]], 2, gen_major) as gen,
        ):
            await _split(ctx, gen, solo, f"split-{ctx_major}-{gen_major}")

    asyncio.run(scenario())
    for name in ("solo", "half0", "half1"):
        assert_clean(d[name])


def test_status_shows_each_pools_heads(tp_cluster: dict[str, DaemonProc]) -> None:
    d = tp_cluster

    async def scenario() -> None:
        async with ranks([d["ctx0"], d["ctx1"]], 2, "block-major"):
            doc = status(d["ctx1"])
            assert doc["tensor_parallel"] == {
                "pool0": {"rank": 1, "size": 2, "heads": [2, 4], "total_heads": 4}
            }

    asyncio.run(scenario())


def test_registration_validates_the_rank(tp_cluster: dict[str, DaemonProc]) -> None:
    d = tp_cluster

    async def scenario() -> None:
        client = await AsyncClient.connect(d["gen"].api_socket, engine="bad-rank")
        region = ShmRegion.create(
            f"kvxferd-tp-bad-{os.getpid()}", layout_for("block-major", 4).pool_bytes
        )
        try:
            layout = layout_for("block-major", 4)
            with pytest.raises(CallError) as err:
                await client.register_pool("p", region.name, layout, tp_rank=2, tp_size=2)
            assert err.value.code == "bad_request"
            assert "tp_rank" in str(err.value) and "got 2" in str(err.value)
            with pytest.raises(CallError) as err:
                await client.register_pool("p", region.name, layout, tp_rank=0, tp_size=0)
            assert "tp_size" in str(err.value)
            # One daemon serves one engine rank: a second pool of another rank is refused.
            await client.register_pool("p", region.name, layout, tp_rank=0, tp_size=1)
            with pytest.raises(CallError) as err:
                await client.register_pool("q", region.name, layout, tp_rank=1, tp_size=2)
            assert "a daemon serves one engine rank" in str(err.value)
            await client.deregister_pool("p")
        finally:
            region.unlink()
            region.close()
            await client.close()

    asyncio.run(scenario())


def test_merge_with_a_missing_or_repeated_context_rank_fails_clearly(
    tp_cluster: dict[str, DaemonProc],
) -> None:
    d = tp_cluster

    async def scenario() -> None:
        async with (
            ranks([d["ctx0"], d["ctx1"]], 2, "block-major"),
            ranks([d["gen"]], 1, "block-major") as (gen,),
        ):
            # Only one of the two context ranks named: half the heads would be missing.
            await gen.recv("merge-half", 64, d["ctx0"].peer_address)
            got = await _outcomes(gen, "merge-half")
            assert (got.status, got.reason) == ("failed", "block_mismatch"), got
            assert "needs the context ranks 0, 1 of 2" in got.message, got
            assert "ctx0 (rank 0)" in got.message, got
            # The same daemon twice.
            peer = d["ctx0"].peer_address
            with pytest.raises(CallError) as err:
                await gen.client.recv("merge-twice", "pool0", [0], [peer, peer], 10)
            assert err.value.code == "bad_request" and "same context daemon" in str(err.value)
            with pytest.raises(CallError) as err:
                await gen.client.recv("merge-none", "pool0", [0], [], 10)
            assert "needs a context peer" in str(err.value)

    asyncio.run(scenario())
    assert_clean(d["gen"])
    assert_clean(d["ctx0"])


def test_two_context_ranks_into_four_generation_ranks(cluster: LocalCluster) -> None:
    ctx = [_start(cluster, f"c{r}", "context", 2) for r in range(2)]
    gen = [_start(cluster, f"g{r}", "generation", 4) for r in range(4)]

    async def scenario() -> None:
        async with ranks(ctx, 2, "layer-major") as cs, ranks(gen, 4, "block-major") as gs:
            n = 99  # 4 blocks
            dst = [await g.recv("two-four", n, ctx[r // 2].peer_address) for r, g in enumerate(gs)]
            for c in cs:
                await c.send("two-four", n)
            for c in cs:
                assert (await _outcomes(c, "two-four")).status == "done"
            for g, blocks in zip(gs, dst, strict=True):
                await _done(g, "two-four")
                result = g.verify("two-four", blocks, n)
                assert result.ok, (g.tp, result.first_mismatch)

    asyncio.run(scenario())
    for p in ctx + gen:
        assert_clean(p)


# ----------------------------------------------------------------------------- refusals


async def _refused(gen: RankEngine, request_id: str, peers: str | list[str]) -> str:
    await gen.recv(request_id, 64, peers)
    got = await _outcomes(gen, request_id)
    assert (got.status, got.reason) == ("failed", "peer_refused"), got
    message: str = got.message
    return message


def test_heads_that_cannot_be_mapped_are_refused_at_the_handshake(cluster: LocalCluster) -> None:
    """Context: 2 ranks of 2 heads (4 in all); generation: 1 rank of 2 heads."""
    ctx = _start(cluster, "ctx", "context", 2)
    gen = _start(
        cluster, "gen", "generation", 1, engine={"kv_layout": dict(GEOMETRY, num_kv_heads=2)}
    )

    async def scenario() -> None:
        async with ranks([ctx], 2, "block-major"):
            g = await RankEngine.open_rank(gen, TpRank(), heads=2)
            try:
                message = await _refused(g, "narrow", ctx.peer_address)
            finally:
                await g.close()
            assert "num_kv_heads" in message, message
            assert "2 per rank x tensor-parallel size 1 = 2 heads here" in message, message
            assert "2 x 2 = 4 there" in message, message

    asyncio.run(scenario())
    assert "num_kv_heads" in ctx.log_text() + gen.log_text()
    assert_clean(ctx, gen)


def test_different_pipeline_parallel_sizes_are_refused(cluster: LocalCluster) -> None:
    ctx = _start(cluster, "ctx", "context", 1, engine={"pipeline_parallel_size": 2})
    gen = _start(cluster, "gen", "generation", 1)

    async def scenario() -> None:
        async with ranks([gen], 1, "block-major") as (g,):
            message = await _refused(g, "pp", ctx.peer_address)
            assert "pipeline parallel sizes differ: ours 1, peer 2; not supported yet" in message

    asyncio.run(scenario())
    assert_clean(gen)


# ------------------------------------------------------------------- staged runtime (CPP)

# 64 tokens of staging: 2 blocks of each daemon's own rank, so the 7-block requests move in
# 4 rounds per leg (both legs of a merge share the generation rank's region).
STAGED = {"transceiver_runtime": "CPP", "max_tokens_in_buffer": 64}


@pytest.mark.parametrize("backend", staged_backends())
def test_staged_merge_and_split_move_every_heads_round(cluster: LocalCluster, backend: str) -> None:
    """Head-merge (TP 2 -> 1) and head-split (TP 1 -> 2) under the staged runtime: each leg's
    heads cross through the staging buffers in rounds (one write or message each) and every
    byte of every rank is verified."""
    staged = {**STAGED, "backend": backend}
    ctx = [_start(cluster, f"ctx{r}", "context", 2, transceiver=staged) for r in range(2)]
    gen = _start(cluster, "gen", "generation", 1, transceiver=staged)
    solo = _start(cluster, "solo", "context", 1, transceiver=staged)
    halves = [_start(cluster, f"half{r}", "generation", 2, transceiver=staged) for r in range(2)]
    peers = [c.peer_address for c in ctx]

    async def scenario() -> None:
        async with (
            ranks(ctx, 2, "layer-major") as cs,
            ranks([gen], 1, "block-major") as (g,),
            ranks([solo], 1, "block-major") as (c,),
            ranks(halves, 2, "layer-major") as gs,
        ):
            await asyncio.gather(
                _merge(cs, g, peers, "smerge"), _split(c, gs, solo.peer_address, "ssplit")
            )

    asyncio.run(scenario())
    for d in (*ctx, gen, solo, *halves):
        doc = status(d)
        assert doc["settings"]["runtime"] == "CPP" and doc["settings"]["backend"] == backend
        staging = doc["staging"]
        assert staging["send_in_use_bytes"] == 0 and staging["recv_in_use_bytes"] == 0, staging
        assert_clean(d)
    # The generation side's region holds 2 of its blocks: one reservation per leg, so a
    # 7-block request took several rounds on every leg.
    assert status(gen)["staging"]["region_bytes"] == 2 * layout_for("block-major").block_bytes


# ------------------------------------------------------------------------------- faults


async def _half_sent_then_rank_1_killed(
    ctx: tuple[DaemonProc, DaemonProc],
    c: tuple[RankEngine, RankEngine],
    g: RankEngine,
    half_sent_tokens: int,
    unsent_tokens: int,
) -> None:
    """Two merged receives from context ranks ctx[0], ctx[1] (engines c[0], c[1]):
    "half-sent", for which rank 0 has written its heads, and "unsent", which nobody has
    sent yet. Then rank 1 dies: both receives fail with peer_lost naming it, and rank 0
    forgets "unsent"."""
    peers = [d.peer_address for d in ctx]
    await g.recv("half-sent", half_sent_tokens, peers)
    await g.recv("unsent", unsent_tokens, peers)
    await c[0].send("half-sent", half_sent_tokens)
    assert (await c[0].client.wait("half-sent", timeout_s=30)).status == "done"
    await c[0].client.release("half-sent")
    wait_for(
        lambda: status(ctx[1])["sessions"]["send"].get("ready", 0) == 2,
        what="both requests known to ctx1",
    )
    ctx[1].kill(signal.SIGKILL)
    await c[1].close(deregister=False)  # its daemon is gone
    for rid in ("half-sent", "unsent"):
        got = await _outcomes(g, rid)
        assert (got.status, got.reason) == ("failed", "peer_lost"), got
        assert "ctx1" in got.message, got
    wait_for(lambda: status(ctx[0])["sessions"]["send"] == {}, what="ctx0 forgets 'unsent'")


def test_context_rank_killed_during_a_merge(cluster: LocalCluster) -> None:
    """One of two context ranks dies while a merged receive waits for it: the receive fails
    with peer_lost naming it, the surviving rank's leg is aborted, nothing leaks."""
    ctx0 = _start(cluster, "ctx0", "context", 2)
    ctx1 = _start(cluster, "ctx1", "context", 2)
    gen = _start(cluster, "gen", "generation", 1)

    async def scenario() -> None:
        c1 = await RankEngine.open_rank(ctx1, TpRank(1, 2))
        async with ranks([ctx0], 2, "block-major") as (c0,), ranks([gen], 1, "block-major") as (g,):
            await _half_sent_then_rank_1_killed((ctx0, ctx1), (c0, c1), g, 100, 100)

    asyncio.run(scenario())
    assert_clean(gen, ctx0)


@pytest.mark.parametrize("when", ["idle", "mid-rounds"])
@pytest.mark.parametrize("backend", ["NIXL", "UCX"])
def test_context_rank_killed_during_a_staged_merge(
    cluster: LocalCluster, backend: str, when: str
) -> None:
    """Under the staged runtime one of two context ranks dies. "idle": its leg of one
    receive had not started while the other rank's leg was served, and nobody had sent the
    other receive; "mid-rounds": both ranks were sending a 7-block request (4 rounds per leg
    through 2-block reservations) and the rank dies wherever its rounds are. A receive fails
    with peer_lost naming it (or, if the rank finished first, completes with every byte
    right); the surviving rank's leg ends; no session, reservation or admission slot is
    left behind."""
    # find_spec, never an import here: see tests/conftest.py.
    if backend == "UCX" and importlib.util.find_spec("ucxx") is None:
        pytest.skip("ucxx is not installed (scripts/install.sh)")
    staged = {**STAGED, "backend": backend}
    ctx0 = _start(cluster, "ctx0", "context", 2, transceiver=staged)
    ctx1 = _start(cluster, "ctx1", "context", 2, transceiver=staged)
    gen = _start(cluster, "gen", "generation", 1, transceiver=staged)
    peers = [ctx0.peer_address, ctx1.peer_address]

    async def idle(c0: RankEngine, c1: RankEngine, g: RankEngine) -> None:
        # One block each: both receives' reservations fit the 2-block region together.
        await _half_sent_then_rank_1_killed((ctx0, ctx1), (c0, c1), g, 32, 20)

    async def mid_rounds(c0: RankEngine, c1: RankEngine, g: RankEngine) -> None:
        blocks = await g.recv("racing", 224, peers)
        wait_for(
            lambda: status(ctx1)["sessions"]["send"].get("ready", 0) == 1,
            what="the request known to ctx1",
        )
        await c0.send("racing", 224)
        await c1.send("racing", 224)
        ctx1.kill(signal.SIGKILL)
        await c1.close(deregister=False)
        got = await _outcomes(g, "racing")
        if got.status == "done":  # ctx1 finished its rounds before it died
            result = g.verify("racing", blocks, 224)
            assert result.ok, result.first_mismatch
        else:
            assert (got.status, got.reason) == ("failed", "peer_lost"), got
            assert "ctx1" in got.message, got
        sent = await _outcomes(c0, "racing")
        assert sent.status in ("done", "failed"), sent

    async def scenario() -> None:
        c1 = await RankEngine.open_rank(ctx1, TpRank(1, 2))
        async with ranks([ctx0], 2, "block-major") as (c0,), ranks([gen], 1, "layer-major") as (g,):
            await (idle if when == "idle" else mid_rounds)(c0, c1, g)

    asyncio.run(scenario())
    for d in (gen, ctx0):
        staging = status(d)["staging"]
        assert staging["send_in_use_bytes"] == 0 and staging["recv_in_use_bytes"] == 0, staging
        assert_clean(d)


def test_split_waits_for_every_generation_rank_within_the_deadline(cluster: LocalCluster) -> None:
    """Only one of the two generation ranks asks: the context side never writes half a
    split; its deadline ends the request and the rank that asked is told."""
    ctx = _start(cluster, "ctx", "context", 1, transceiver={"kv_transfer_timeout_ms": 1500})
    gen = _start(cluster, "gen0", "generation", 2)

    async def scenario() -> None:
        async with ranks([ctx], 1, "block-major") as (c,), ranks([gen], 2, "block-major") as (g,):
            await g.recv("lonely", 64, ctx.peer_address)
            await c.send("lonely", 64)
            sent = await _outcomes(c, "lonely")
            assert (sent.status, sent.reason) == ("timed_out", "sender_deadline"), sent
            assert "1 of 2 arrived" in sent.message, sent
            got = await _outcomes(g, "lonely")
            assert (got.status, got.reason) == ("failed", "peer_timed_out"), got

    asyncio.run(scenario())
    assert_clean(ctx, gen)


# Small pieces (32 tokens x 1 head x 16 dims x fp16 = 1 KiB per rank): what the bounce buffer
# would take between equal sizes.
SMALL = {**GEOMETRY, "num_kv_heads": 2, "head_dim": 16}


BOUNCE = {"kv_cache_bounce_size_mb": 8}


# The layout of both sides' pools, and which path a tensor-parallel leg then takes: many
# 1 KiB (layer, K/V) pieces (layer-major) are gathered on one side and scattered on the
# other; whole 16-32 KiB blocks (block-major) are written straight into or out of the
# pool on the side that holds fewer heads, with one copy only (BouncePlanner.one_sided).
PATHS = pytest.mark.parametrize(
    "major", ["layer-major", "block-major"], ids=["two-sided", "one-sided"]
)


@PATHS
def test_a_head_split_goes_through_the_bounce_buffer(cluster: LocalCluster, major: str) -> None:
    """With a bounce buffer on both sides, a head-split (TP 1 -> 2) gathers each rank's
    heads into one send reservation and writes it as one descriptor into the reservation
    that rank offered (even though it offered before the context pool was known), which
    the rank scatters into its blocks (issue 16); or, block-major, straight into the
    rank's blocks, one descriptor per block, with nothing for it to scatter. Every byte of
    both ranks is verified."""
    cluster.geometry = dict(SMALL)
    ctx = cluster.start_daemon(
        "ctx",
        "context",
        engine={"kv_layout": dict(SMALL)},
        transceiver={"kv_transfer_timeout_ms": TIMEOUT_MS, **BOUNCE},
    )
    gens = [
        cluster.start_daemon(
            f"gen{r}",
            "generation",
            engine={"tensor_parallel_size": 2, "kv_layout": {**SMALL, "num_kv_heads": 1}},
            transceiver={"kv_transfer_timeout_ms": TIMEOUT_MS, **BOUNCE},
        )
        for r in range(2)
    ]

    async def open_small(d: DaemonProc, tp: TpRank) -> RankEngine:
        return await RankEngine.open_rank(d, tp, major, 256, 2 // tp.size, SMALL)

    async def scenario() -> None:
        gs = [await open_small(g, TpRank(r, 2)) for r, g in enumerate(gens)]
        for g in gs:
            g.alloc.shuffle(5)  # scattered blocks: many small segments
        try:
            n = 32 * 40 + 3  # 41 blocks
            # Posted before the context engine registers its pool.
            dst = [await g.recv("split", n, ctx.peer_address) for g in gs]
            wait_for(
                lambda: status(ctx)["sessions"]["send"].get("ready") == 1,
                what="both ranks' requests at the context daemon",
            )
            c = await open_small(ctx, TpRank())
            try:
                await c.send("split", n)
                sent = await _outcomes(c, "split")
                assert sent.status == "done" and sent.nbytes == 41 * c.layout.block_bytes
            finally:
                await c.close()
            for g, blocks in zip(gs, dst, strict=True):
                got = await _done(g, "split")
                assert got.nbytes == 41 * g.layout.block_bytes
                result = g.verify("split", blocks, n)
                assert result.ok, (g.tp, result.first_mismatch)
        finally:
            for g in gs:
                await g.close()

    asyncio.run(scenario())
    one_sided = major == "block-major"
    b = status(ctx)["bounce"]
    assert b["reservations_made"] == 2 and b["fallbacks"] == 0, b  # one per rank
    assert b["gathers"] == 2 and b["one_sided_legs"] == (2 if one_sided else 0), b
    assert b["send_in_use_bytes"] == 0, b
    for g in gens:
        b = status(g)["bounce"]
        assert b["scatters"] == (0 if one_sided else 1) and b["recv_in_use_bytes"] == 0, b
        if not one_sided:
            assert b["reservations_made"] == 1, b
    for d in (ctx, *gens):
        assert_clean(d)


def _small_merge_daemons(cluster: LocalCluster) -> tuple[list[DaemonProc], DaemonProc]:
    """Two context ranks (TP 2, one head each) and a generation daemon (TP 1) of the SMALL
    geometry, every one with a bounce buffer."""
    cluster.geometry = dict(SMALL)
    ctxs = [
        cluster.start_daemon(
            f"ctx{r}",
            "context",
            engine={"tensor_parallel_size": 2, "kv_layout": {**SMALL, "num_kv_heads": 1}},
            transceiver={"kv_transfer_timeout_ms": TIMEOUT_MS, **BOUNCE},
        )
        for r in range(2)
    ]
    gen = cluster.start_daemon(
        "gen",
        "generation",
        engine={"kv_layout": dict(SMALL)},
        transceiver={"kv_transfer_timeout_ms": TIMEOUT_MS, **BOUNCE},
    )
    return ctxs, gen


async def _merged(
    cs: list[RankEngine], g: RankEngine, rid: str, n: int, blocks: list[int]
) -> tuple[Any, list[Any]]:
    """Both context ranks send `rid` (received into `blocks`): every outcome done and ok,
    every byte verified; the outcomes (generation, then each context rank's)."""
    for c in cs:
        await c.send(rid, n)
    got = await _done(g, rid)
    sent = [await _done(c, rid) for c in cs]
    result = g.verify(rid, blocks, n)
    assert result.ok, result.first_mismatch
    return got, sent


async def _open_small(d: DaemonProc, tp: TpRank, major: str = "block-major") -> RankEngine:
    return await RankEngine.open_rank(d, tp, major, 256, 2 // tp.size, SMALL)


@PATHS
def test_a_head_merge_goes_through_the_bounce_buffer(cluster: LocalCluster, major: str) -> None:
    """Head-merge (TP 2 -> 1) through the bounce buffer: the generation daemon offers one
    reservation per context rank, each rank writes its whole blocks into its own (gathered
    first, or, block-major, straight out of its pool), and the generation daemon scatters
    each into its half of every token."""
    ctxs, gen = _small_merge_daemons(cluster)

    async def scenario() -> None:
        cs = [await _open_small(c, TpRank(r, 2), major) for r, c in enumerate(ctxs)]
        g = await _open_small(gen, TpRank(), major)
        g.alloc.shuffle(5)
        try:
            n = 32 * 40 + 3
            blocks = await g.recv("merge", n, [c.peer_address for c in ctxs])
            got, sent = await _merged(cs, g, "merge", n, blocks)
            assert got.nbytes == 41 * g.layout.block_bytes
            for c, one in zip(cs, sent, strict=True):
                assert one.nbytes == 41 * c.layout.block_bytes
        finally:
            for e in (*cs, g):
                await e.close()

    asyncio.run(scenario())
    one_sided = major == "block-major"
    b = status(gen)["bounce"]
    assert b["reservations_made"] == 2 and b["recv_in_use_bytes"] == 0, b  # one per rank
    assert b["scatters"] == 2, b
    for c in ctxs:
        b = status(c)["bounce"]
        assert b["gathers"] == (0 if one_sided else 1) and b["send_in_use_bytes"] == 0, b
        assert b["one_sided_legs"] == (1 if one_sided else 0), b
    for d in (*ctxs, gen):
        assert_clean(d)


def test_a_head_merge_posted_before_a_context_rank_registered_its_pool_still_bounces(
    cluster: LocalCluster,
) -> None:
    """The receive of a head-merge is posted, and its daemon has dialed both context ranks,
    before one rank's engine registered its pool (engines starting side by side). The
    receive waits for that rank's pools message (Receiver._await_sources) and offers both
    legs bounce room: taken to hold our heads instead, that rank's leg was offered room of
    the wrong size or none."""
    ctxs, gen = _small_merge_daemons(cluster)

    async def scenario() -> None:
        c0 = await _open_small(ctxs[0], TpRank(0, 2))
        g = await _open_small(gen, TpRank())
        g.alloc.shuffle(5)
        cs = [c0]
        try:
            n = 32 * 40 + 3
            blocks = await g.recv("early", n, [c.peer_address for c in ctxs])
            loop = asyncio.get_running_loop()
            until = loop.time() + 10
            while peer_names(gen) != ["ctx0", "ctx1"]:  # dialed: ctx1 announced no pool
                assert loop.time() < until, status(gen)["peers"]
                await asyncio.sleep(0.01)
            cs.append(await _open_small(ctxs[1], TpRank(1, 2)))
            await _merged(cs, g, "early", n, blocks)
        finally:
            for e in (*cs, g):
                await e.close()

    asyncio.run(scenario())
    b = status(gen)["bounce"]
    assert (b["reservations_made"], b["scatters"], b["fallbacks"]) == (2, 2, 0), b
    for c in ctxs:
        b = status(c)["bounce"]
        assert b["one_sided_legs"] == 1 and b["fallbacks"] == 0, b
    for d in (*ctxs, gen):
        assert_clean(d)


def test_only_pipelining_refuses_different_sizes() -> None:
    two, one = TpRank(0, 2), TpRank(0, 1)
    assert tp_support_problem("context", two, TpRank(1, 2), True) is None  # equal sizes
    # Either runtime moves head slices (the staged one through its staging buffers).
    assert tp_support_problem("context", two, one, False) is None
    assert tp_support_problem("generation", one, two, False) is None
    piped = tp_support_problem("context", two, one, True)
    assert piped is not None and "(ctx 2, gen 1)" in piped
    assert "enable_pipelined_transfer" in piped
    piped = tp_support_problem("generation", one, two, True)
    assert piped is not None and "(ctx 2, gen 1)" in piped


# ----------------------------------------------------------------- legs: review fixes


@pytest.mark.parametrize("gen_size", [2, 4])
def test_a_rank_holding_none_of_the_heads_is_refused_alone(
    cluster: LocalCluster, gen_size: int
) -> None:
    """Context rank 0 of 2 holds heads [0, 2) of 4. A generation rank holding none of them
    (rank 1 of 2, or rank 2 of 4) names it by mistake before the context pool is known (so
    the generation daemon cannot tell yet). Its receive is refused, naming the heads, and
    the ranks that do hold those heads are served as if it had never asked."""
    ctx = _start(cluster, "c0", "context", 2)
    holders = gen_size // 2  # generation ranks holding some of heads [0, 2)
    gens = [_start(cluster, f"g{r}", "generation", gen_size) for r in range(holders + 1)]
    n = 99

    async def scenario() -> None:
        async with ranks(gens, gen_size, "block-major") as gs:
            stray, served = gs[-1], gs[:-1]
            # The stray rank asks first: the context daemon must not count it as a leg.
            stray_blocks = await stray.recv("stray", n, ctx.peer_address)
            wait_for(
                lambda: status(ctx)["sessions"]["send"] == {"ready": 1},
                what="the stray request at the context daemon",
            )
            dst = [await g.recv("stray", n, ctx.peer_address) for g in served]
            async with ranks([ctx], 2, "block-major") as (c,):
                await c.send("stray", n)
                await _done(c, "stray")
            for g, blocks in zip(served, dst, strict=True):
                got = await _done(g, "stray")
                result = g.verify("stray", blocks, n)
                assert result.ok, (g.tp, result.first_mismatch)
            got = await _outcomes(stray, "stray")
            assert (got.status, got.reason, got.fault) == ("failed", "peer_failed", "peer"), got
            assert "block_mismatch" in got.message and "no KV head in common" in got.message
            assert "heads [0, 2) of 4" in got.message, got
            assert all(not b.any() for b in stray.pool_blocks(stray_blocks)), "written"

    asyncio.run(scenario())
    for d in (ctx, *gens):
        assert_clean(d)


class _Intruder:
    """A hand-driven generation peer: a real handshake (and NIXL agent metadata), then
    whatever RequestData a test writes; Pings are answered while it reads."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, msg: Any) -> None:
        self.writer.write(PEER_CODEC.encode(msg))
        await self.writer.drain()

    async def next(self, kind: type[Any], timeout_s: float = 10.0) -> Any:
        async def read() -> Any:
            while True:
                msg = await PEER_CODEC.read(self.reader)
                assert msg is not None, "the daemon closed the connection"
                if isinstance(msg, Ping):
                    await self.send(Pong(seq=msg.seq))
                elif isinstance(msg, kind):
                    return msg

        return await asyncio.wait_for(read(), timeout_s)


@contextlib.asynccontextmanager
async def _intruder(
    cluster: LocalCluster, ctx: DaemonProc, like: DaemonProc, pools: list[PoolInfo]
) -> AsyncIterator[_Intruder]:
    nixl = nixl_or_skip()
    agent = nixl.nixl_agent(
        "intruder.1", nixl.nixl_agent_config(enable_listen_thread=False, backends=["UCX"])
    )
    doc = status(like)  # a real generation daemon's settings, so the handshake passes
    info = Info(
        agent_name="intruder.1",
        agent_metadata=bytes(agent.get_agent_metadata()),
        pools=pools,
        fingerprint=doc["fingerprint"],
        compat={k: doc["settings"][k] for k in ("backend", "runtime", "pipelined_transfer")},
        transceiver={},
        tensor_parallel_size=pools[0].tp_size if pools else 1,
        pipeline_parallel_size=1,
        context_parallel_size=1,
    )

    async def make_info() -> Info:
        return info

    secret = (cluster.workdir / f"{ctx.name}.secret").read_bytes().rstrip()
    host, port = ctx.peer_address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        me = Identity("intruder", "1", "generation", secret)
        await asyncio.wait_for(
            client_handshake(reader, writer, me, make_info, lambda p, i: None, ctx.peer_address),
            10,
        )
        yield _Intruder(reader, writer)
    finally:
        writer.close()
        del agent


def test_hostile_request_data_is_refused_and_changes_nothing_else(cluster: LocalCluster) -> None:
    """A peer's RequestData naming a pool that holds none of our heads is refused at once,
    and the request it names waits on for the rank that holds them; one receive sending its
    RequestData twice ends that request (it was told so) instead of leaving it behind."""
    ctx = _start(cluster, "c0", "context", 2)
    gen = _start(cluster, "g0", "generation", 2)
    n = 70

    async def scenario() -> None:
        async with ranks([ctx], 2, "block-major") as (c,), ranks([gen], 2, "block-major") as (g,):
            await c.send("kv", n)  # the context daemon knows which heads it holds
            # The heads of rank 1 of 2: [2, 4), none of rank 0's.
            foreign = PoolInfo(
                pool_id="p",
                layout=dict(g.layout.to_wire()),
                base=1 << 30,  # a plausible address: a pool at 0 is refused as outside user space
                nbytes=g.layout.pool_bytes,
                tp_rank=1,
                tp_size=2,
            )
            async with _intruder(cluster, ctx, gen, [foreign]) as peer:
                await peer.send(
                    RequestData(request_id="kv", rx_token=1, pool_id="p", blocks=[0, 1, 2])
                )
                abort = await peer.next(Abort)
                assert (abort.request_id, abort.rx_token, abort.reason) == (
                    "kv",
                    1,
                    "block_mismatch",
                )
                assert "no KV head in common" in abort.message, abort
                assert status(ctx)["sessions"]["send"] == {"waiting_for_peer": 1}
                # One receive (one token) asking twice: told once, and nothing left behind.
                twice = RequestData(request_id="twice", rx_token=2, pool_id="p", blocks=[3])
                await peer.send(twice)
                await peer.send(twice)
                abort = await peer.next(Abort)
                assert (abort.request_id, abort.rx_token) == ("twice", 2), abort
                assert abort.reason == "duplicate_request", abort
                # Forgotten before the Abort went out (not later, when the heartbeat of
                # this silent peer runs out).
                assert status(ctx)["sessions"]["send"] == {"waiting_for_peer": 1}
            # The rank that holds the heads is served as if nothing had happened.
            blocks = await g.recv("kv", n, ctx.peer_address)
            await _done(c, "kv")
            await _done(g, "kv")
            assert g.verify("kv", blocks, n).ok

    asyncio.run(scenario())
    assert_clean(ctx, gen)


def test_a_served_leg_whose_context_rank_dies_does_not_fail_the_merge(
    cluster: LocalCluster,
) -> None:
    """Context rank 0 delivered its heads (its last Result arrived), then its daemon dies
    before rank 1 sends: what rank 0 wrote is in place and it can write nothing more, so
    the merge completes when rank 1 delivers."""
    ctx0 = _start(cluster, "ctx0", "context", 2)
    ctx1 = _start(cluster, "ctx1", "context", 2)
    gen = _start(cluster, "gen", "generation", 1)
    n = 150
    peers = [ctx0.peer_address, ctx1.peer_address]

    async def scenario() -> None:
        c0 = await RankEngine.open_rank(ctx0, TpRank(0, 2))
        async with ranks([gen], 1, "block-major") as (g,):
            c1 = await RankEngine.open_rank(ctx1, TpRank(1, 2))
            try:
                blocks = await g.recv("late-death", n, peers)
                await c0.send("late-death", n)
                assert (await c0.client.wait("late-death", timeout_s=30)).status == "done"
                wait_for(
                    lambda: status(gen)["sessions"]["recv"] == {"transferring": 1},
                    what="rank 0's last Result at the generation daemon",
                )
                ctx0.kill(signal.SIGKILL)
                await c0.close(deregister=False)  # its daemon is gone
                wait_for(
                    lambda: peer_names(gen) == ["ctx1"],
                    what="the generation daemon sees rank 0 gone",
                )
                # Peers are forgotten after their requests were handled: still going.
                assert status(gen)["sessions"]["recv"] == {"transferring": 1}
                await c1.send("late-death", n)
                await delivered(c1, g, "late-death", blocks, n)
            finally:
                await c1.close()

    asyncio.run(scenario())
    assert_clean(gen, ctx1)


def _receivers(ctx: DaemonProc) -> int:
    """The receivers the context daemon knows of its requests: taken, or (before the
    engine's send names whose request it is) contending."""
    doc = status(ctx)
    return int(doc["receivers"]) + int(doc["contending_receives"])


def test_a_served_leg_whose_generation_rank_dies_does_not_fail_the_split(
    cluster: LocalCluster,
) -> None:
    """Head-split: rank 0 was served (its receive is done), then its daemon dies while the
    write to rank 1 is still in flight. Rank 1 is still served and the context engine hears
    `done`: the request did not fail.

    To hold rank 1's write in flight its daemon is SIGSTOPped before the first write after
    the handshake (see test_faults.test_cancel_busy_while_write_in_flight: the bytes land,
    the completion waits for the stopped peer's wire-up reply)."""
    cfg = {"daemon": {"heartbeat_timeout_ms": 30000}}
    ctx = _start(cluster, "solo", "context", 1, **cfg)
    half0 = _start(cluster, "half0", "generation", 2, **cfg)
    half1 = _start(cluster, "half1", "generation", 2, **cfg)
    n = 150

    async def scenario() -> None:
        g0 = await RankEngine.open_rank(half0, TpRank(0, 2))
        async with ranks([ctx], 1, "block-major") as (c,):
            g1 = await RankEngine.open_rank(half1, TpRank(1, 2))
            try:
                # Rank 0's request first (so it is served first), then rank 1's.
                await g0.recv("split-death", n, ctx.peer_address)
                wait_for(
                    lambda: status(ctx)["sessions"]["send"] == {"ready": 1},
                    what="rank 0's request at the context daemon",
                )
                blocks = await g1.recv("split-death", n, ctx.peer_address)
                # At the context daemon, not only queued at half1: a frame queued when its
                # daemon is stopped never leaves, and the split then waits for that leg
                # (one run in ~30 under load, before).
                wait_for(
                    lambda: _receivers(ctx) == 2, what="rank 1's request at the context daemon"
                )
                half1.kill(signal.SIGSTOP)
                try:
                    await c.send("split-death", n)
                    await _done(g0, "split-death")
                    wait_for(
                        lambda: status(ctx)["open_transfer_handles"] == 1,
                        what="the write to rank 1 in flight",
                    )
                    half0.kill(signal.SIGKILL)
                    await g0.close(deregister=False)
                    wait_for(
                        lambda: peer_names(ctx) == ["half1"],
                        what="the context daemon sees rank 0 gone",
                    )
                    # Peers are forgotten after their requests were handled: still going.
                    assert status(ctx)["sessions"]["send"] == {"transferring": 1}
                finally:
                    half1.kill(signal.SIGCONT)
                await delivered(c, g1, "split-death", blocks, n)
            finally:
                await g1.close()

    asyncio.run(scenario())
    assert_clean(ctx, half1)
