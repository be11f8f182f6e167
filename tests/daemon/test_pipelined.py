"""Pipelined transfer: each prefill chunk's complete blocks move while later chunks compute."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from daemon_harness import (
    SimEngine,
    delivered,
    opened,
    status,
    wait_for,
    with_engines,
)

from kvxferd.client import CallError
from kvxferd.memory.memfd import MemfdRegion
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.content import fill_blocks, request_seed

PIPELINED = {"enable_pipelined_transfer": True, "kv_transfer_timeout_ms": 20000}
ENGINE = {"enable_chunked_prefill": True}


def _start(cluster: LocalCluster, **transceiver: object) -> tuple[DaemonProc, DaemonProc]:
    t = {**PIPELINED, **transceiver}
    return (
        cluster.start_daemon("ctx", "context", transceiver=t, engine=ENGINE),
        cluster.start_daemon("gen", "generation", transceiver=t, engine=ENGINE),
    )


def _gen_state(gen: DaemonProc) -> dict[str, int]:
    return dict(status(gen)["sessions"]["recv"])


async def _send_chunks(
    c: SimEngine, rid: str, tokens: int, chunk: int, pause: asyncio.Event | None = None
) -> list[int]:
    """The context engine 'computes' the prompt chunk by chunk and sends each."""
    blocks = c.blocks_for(tokens)
    fill_blocks(c.pool, c.layout, blocks, request_seed(rid))
    tpb = c.layout.tokens_per_block
    start = 0
    while start < tokens:
        end = min(tokens, start + chunk)
        used = blocks[: math.ceil(end / tpb)]
        await c.client.send(rid, c.pool_id, used, end, token_start=start, last=end == tokens)
        if pause is not None and start == 0:
            await pause.wait()
        start = end
    return blocks


async def _first_of_two_chunks(
    ctx: DaemonProc, c: SimEngine, g: SimEngine, rid: str
) -> tuple[list[int], list[int]]:
    """A 640-token receive posted; the context engine sends the first 320 tokens (ten
    blocks) of it, not the last chunk. Returns the receive's and the send's blocks."""
    dst = await g.recv(rid, 640, ctx.peer_address)
    src = c.fill(rid, 640)
    await c.client.send(rid, "pool0", src[:10], 320, last=False)
    return dst, src


@pytest.mark.parametrize("chunk", [32, 50, 1000, 4096])
def test_chunks_of_several_sizes_arrive_intact(cluster: LocalCluster, chunk: int) -> None:
    ctx, gen = _start(cluster)

    async def scenario(c: SimEngine, g: SimEngine) -> None:
        for rid, tokens in ((f"p{chunk}-a", 1000), (f"p{chunk}-b", 33), (f"p{chunk}-c", 64)):
            dst = await g.recv(rid, tokens, ctx.peer_address)
            await _send_chunks(c, rid, tokens, chunk)
            got, sent = await delivered(c, g, rid, dst, tokens)
            assert sent.nbytes == got.nbytes > 0
            assert got.nbytes == math.ceil(tokens / 32) * g.layout.block_bytes

    with_engines(ctx, gen, scenario, num_blocks=256)


def test_early_chunks_land_before_the_last_is_sent(cluster: LocalCluster) -> None:
    ctx, gen = _start(cluster)

    async def scenario() -> None:
        async with opened(ctx, num_blocks=128) as c, opened(gen, num_blocks=128) as g:
            dst = await g.recv("early", 640, ctx.peer_address)
            held = asyncio.Event()
            sender = asyncio.create_task(_send_chunks(c, "early", 640, 320, pause=held))
            # The first chunk's ten blocks are written while the 'prefill' of the
            # second chunk has not even been sent.
            first = dst[:10]
            tpb_bytes = g.layout.block_bytes

            def first_chunk_landed() -> bool:
                return (
                    bool(g.verify_prefix("early", first, 320))
                    and _gen_state(gen).get("transferring", 0) == 1
                )

            await asyncio.to_thread(wait_for, first_chunk_landed, 20, "the first chunk")
            assert tpb_bytes > 0
            assert not np.any(g.pool_blocks(dst[10:])), "second chunk data before it was sent"
            held.set()
            await sender
            await delivered(c, g, "early", dst, 640)

    asyncio.run(scenario())


def test_per_request_rejections_affect_only_that_request(cluster: LocalCluster) -> None:
    ctx, gen = _start(cluster)

    async def scenario(c: SimEngine, g: SimEngine) -> None:
        blocks = c.blocks_for(20 * 32)
        # Beam width above 1, on either side.
        with pytest.raises(CallError, match="beam width 1"):
            await g.client.recv("beam", "pool0", g.blocks_for(64), ctx.peer_address, 64, 2)
        with pytest.raises(CallError, match="beam width 1"):
            await c.client.send("beam", "pool0", blocks[:2], 64, beam_width=2)
        # Out of order: a chunk that skips tokens ends the request.
        await c.client.send("gap", "pool0", blocks[:2], 64, token_start=0, last=False)
        with pytest.raises(CallError, match="must be in order"):
            await c.client.send("gap", "pool0", blocks[:4], 128, token_start=96, last=False)
        out = await c.client.wait("gap", 30)
        assert (out.status, out.reason) == ("failed", "bad_chunk")
        # Overlapping chunk.
        await c.client.send("overlap", "pool0", blocks[4:6], 64, token_start=0, last=False)
        with pytest.raises(CallError, match="overlap"):
            await c.client.send("overlap", "pool0", blocks[4:7], 96, token_start=32)
        assert (await c.client.wait("overlap", 30)).reason == "bad_chunk"
        # A chunk after the last one.
        dst = await g.recv("after-last", 64, ctx.peer_address)
        await c.client.send("after-last", "pool0", blocks[8:10], 64)
        with pytest.raises(CallError, match="after the one marked last"):
            await c.client.send("after-last", "pool0", blocks[8:11], 96, token_start=64)
        # A later chunk in another pool of the same engine: the first pool holds the
        # request (its memory is what the transfer reads) until it ends.
        other = MemfdRegion.create(c.layout.pool_bytes, "kvxferd-test-pool1")
        try:
            await c.client.register_pool("pool1", other, c.layout)
            await c.client.send("pools", "pool0", blocks[12:14], 64, last=False)
            with pytest.raises(CallError, match="names pool 'pool1', the first one 'pool0'"):
                await c.client.send("pools", "pool1", blocks[12:15], 96, token_start=64)
            assert (await c.client.wait("pools", 30)).reason == "bad_chunk"
            await c.client.release("pools")
            await c.client.deregister_pool("pool1")  # never held by the rejected chunk
        finally:
            other.close()
        # ... and a well-formed request beside them is unaffected.
        ok = await g.recv("fine", 100, ctx.peer_address)
        await _send_chunks(c, "fine", 100, 40)
        assert (await g.client.wait("fine", 30)).status == "done"
        assert g.verify("fine", ok, 100).ok
        # Rejected: failed unless its write had already completed; never half-done.
        late = await g.client.wait("after-last", 30)
        if late.status == "done":
            assert g.verify("after-last", dst, 64).ok
        else:
            assert late.reason in ("peer_failed", "bad_chunk"), late
            sent = await c.client.wait("after-last", 30)
            assert (sent.status, sent.reason) == ("failed", "bad_chunk")
        for rid in ("gap", "overlap", "after-last", "fine"):
            await c.client.wait(rid, 30)
            await c.client.release(rid)
        for rid in ("after-last", "fine"):
            await g.client.release(rid)

    with_engines(ctx, gen, scenario, num_blocks=256)


def test_cancel_mid_pipeline_writes_nothing_more(cluster: LocalCluster) -> None:
    ctx, gen = _start(cluster)

    async def scenario(c: SimEngine, g: SimEngine) -> None:
        dst, src = await _first_of_two_chunks(ctx, c, g, "cx")
        await asyncio.to_thread(
            wait_for,
            lambda: _gen_state(gen).get("transferring", 0) == 1,
            20,
            "the first chunk",
        )
        answer = "busy"
        while answer == "busy":  # busy only while a chunk's write is in flight
            answer = await g.client.cancel("cx")
        assert answer == "cancelled"
        got = await g.client.wait("cx", 30)
        assert got.status == "cancelled"
        sent = await c.client.wait("cx", 30)
        assert (sent.status, sent.reason, sent.fault) == ("cancelled", "peer_cancelled", "peer")
        with pytest.raises(CallError):
            await c.client.send("cx", "pool0", src, 640, token_start=320)
        assert not np.any(g.pool_blocks(dst[10:])), "a chunk was written after the cancel"
        await g.client.release("cx")
        await c.client.release("cx")

    with_engines(ctx, gen, scenario, num_blocks=128)


def test_timeout_mid_pipeline(cluster: LocalCluster) -> None:
    ctx, gen = _start(cluster, kv_transfer_timeout_ms=1500)

    async def scenario(c: SimEngine, g: SimEngine) -> None:
        dst, _ = await _first_of_two_chunks(ctx, c, g, "tx")
        got = await g.client.wait("tx", 30)
        assert (got.status, got.reason) == ("timed_out", "receiver_timeout")
        sent = await c.client.wait("tx", 30)
        assert sent.status != "done" and sent.fault == "peer", sent
        assert not np.any(g.pool_blocks(dst[10:]))
        await g.client.release("tx")
        await c.client.release("tx")

    with_engines(ctx, gen, scenario, num_blocks=128)
