"""Pools of an explicit dimension order (vLLM's CPU KV cache) across real daemons.

The PYTHON runtime pairs whole blocks of any order; the staged runtime packs (layer, kv)
pieces, so it refuses such a pool at registration with a clear error.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvxferd.client import AsyncClient, CallError
from kvxferd.memory.layout import BLOCK_MAJOR, KvLayout
from kvxferd.memory.memfd import MemfdRegion
from kvxferd.sim.cluster import LocalCluster

VLLM_CPU = "layer,block,head,kv,token"


def layout(major: str) -> KvLayout:
    # tokens_per_block is the daemons' (the cluster's default geometry).
    return KvLayout(
        num_layers=2, kv_factor=2, num_kv_heads=2, head_dim=32, tokens_per_block=32,
        dtype="float32", major=major, num_blocks=64,
    )  # fmt: skip


@pytest.mark.parametrize("ctx_major", [VLLM_CPU, BLOCK_MAJOR])
def test_a_vllm_ordered_pool_moves_byte_for_byte(cluster: LocalCluster, ctx_major: str) -> None:
    cfg = {"transceiver": {"kv_transfer_timeout_ms": 20000}}
    ctx = cluster.start_daemon("ctx", "context", **cfg)
    gen = cluster.start_daemon("gen", "generation", **cfg)

    async def scenario() -> None:
        src_l, dst_l = layout(ctx_major), layout(VLLM_CPU)
        c = await AsyncClient.connect(ctx.api_socket)
        g = await AsyncClient.connect(gen.api_socket)
        src, dst = MemfdRegion.create(src_l.pool_bytes), MemfdRegion.create(dst_l.pool_bytes)
        try:
            await c.register_pool("p", src, src_l)
            await g.register_pool("p", dst, dst_l)
            src.array[:] = np.random.default_rng(3).integers(0, 256, src.nbytes, dtype=np.uint8)
            src_blocks, dst_blocks = [5, 6, 7, 30, 2], [40, 41, 9, 10, 63]
            await g.recv("r", "p", dst_blocks, ctx.peer_address, 5 * 32)
            await c.send("r", "p", src_blocks, 5 * 32)
            got, sent = await g.wait("r", 30), await c.wait("r", 30)
            assert (got.status, sent.status) == ("done", "done"), (got, sent)
            want = src_l.logical_view(src.array)[src_blocks]
            assert np.array_equal(dst_l.logical_view(dst.array)[dst_blocks], want)
            others = [b for b in range(64) if b not in dst_blocks]
            assert not dst_l.logical_view(dst.array)[others].any()
        finally:
            await c.close()
            await g.close()
            src.close()
            dst.close()

    asyncio.run(scenario())


def test_the_staged_runtime_refuses_an_ordered_pool(cluster: LocalCluster) -> None:
    cfg = {"transceiver": {"transceiver_runtime": "CPP", "kv_transfer_timeout_ms": 20000}}
    gen = cluster.start_daemon("gen", "generation", **cfg)

    async def scenario() -> None:
        g = await AsyncClient.connect(gen.api_socket)
        region = MemfdRegion.create(layout(VLLM_CPU).pool_bytes)
        try:
            with pytest.raises(CallError) as err:
                await g.register_pool("p", region, layout(VLLM_CPU))
            assert err.value.code == "bad_request" and "PYTHON runtime" in str(err.value)
            await g.register_pool("p", region, layout(BLOCK_MAJOR))  # the daemon goes on
        finally:
            await g.close()
            region.close()

    asyncio.run(scenario())
