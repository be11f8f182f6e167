"""The bounce buffer: gathered, written with one descriptor, scattered, every byte verified."""

from __future__ import annotations

import asyncio
from typing import Any

from daemon_harness import SMALL_PIECES, assert_clean, move_each, opened, status

from kvxferd.sim.cluster import DaemonProc, LocalCluster


def _start(cluster: LocalCluster, bounce_mb: int) -> tuple[DaemonProc, DaemonProc]:
    cluster.geometry = dict(SMALL_PIECES)
    t = {"kv_cache_bounce_size_mb": bounce_mb, "kv_transfer_timeout_ms": 20000}
    return (
        cluster.start_daemon("ctx", "context", transceiver=t),
        cluster.start_daemon("gen", "generation", transceiver=t),
    )


async def _run(
    ctx: DaemonProc, gen: DaemonProc, lengths: list[int], concurrent: bool, blocks: int = 2048
) -> None:
    kw = dict(major="layer-major", num_blocks=blocks, geometry=SMALL_PIECES)
    async with opened(ctx, **kw) as c, opened(gen, **kw) as g:
        # Scatter the allocations so every request is many separate segments.
        c.alloc.shuffle(7)
        g.alloc.shuffle(3)
        reqs = [(f"b-{i}-{n}", n) for i, n in enumerate(lengths)]
        await move_each(ctx, c, g, reqs, concurrent)


def _bounce(daemon: DaemonProc) -> dict[str, Any]:
    doc = status(daemon)["bounce"]
    assert doc is not None, "the daemon has no bounce buffer"
    return dict(doc)


def test_every_byte_through_the_bounce_buffer(cluster: LocalCluster) -> None:
    ctx, gen = _start(cluster, bounce_mb=8)
    # Odd sizes: partial last blocks, one block short of a round number.
    asyncio.run(_run(ctx, gen, [257, 1000, 31 * 32 + 5, 4000], concurrent=False))
    for d in (ctx, gen):
        b = _bounce(d)
        assert b["reservations_made"] >= 3, b  # 257 tokens (9 blocks) may bounce too
        assert b["fallbacks"] == 0, b
        assert b["send_in_use_bytes"] == 0 and b["recv_in_use_bytes"] == 0, b
        assert_clean(d)


def test_request_larger_than_the_region_takes_the_per_block_path(cluster: LocalCluster) -> None:
    # 1 MiB regions; 4000 tokens of 16 KiB blocks is ~2 MiB.
    ctx, gen = _start(cluster, bounce_mb=1)
    asyncio.run(_run(ctx, gen, [4000, 300], concurrent=False))
    g = _bounce(gen)
    assert g["fallbacks"] >= 1, g  # the oversize one, verified above all the same
    assert g["reservations_made"] >= 1, g  # the small one still bounced
    assert g["recv_in_use_bytes"] == 0
    assert_clean(ctx)
    assert_clean(gen)


def test_concurrent_requests_share_a_full_region(cluster: LocalCluster) -> None:
    # 1 MiB holds about three of these 300 KiB requests at once: the rest fall back
    # at once (never wait), and every one of them verifies.
    ctx, gen = _start(cluster, bounce_mb=1)
    asyncio.run(_run(ctx, gen, [600] * 12, concurrent=True, blocks=4096))
    g = _bounce(gen)
    assert g["reservations_made"] >= 1, g
    assert g["reservations_made"] + g["fallbacks"] >= 12, g
    for d in (ctx, gen):
        b = _bounce(d)
        assert b["send_in_use_bytes"] == 0 and b["recv_in_use_bytes"] == 0, b
        assert_clean(d)


def test_a_context_side_without_bounce_writes_per_block(cluster: LocalCluster) -> None:
    cluster.geometry = dict(SMALL_PIECES)
    ctx = cluster.start_daemon("ctx", "context")
    gen = cluster.start_daemon("gen", "generation", transceiver={"kv_cache_bounce_size_mb": 4})
    asyncio.run(_run(ctx, gen, [1000, 2000], concurrent=False))
    g = _bounce(gen)
    assert g["recv_in_use_bytes"] == 0, g  # offered, declined, freed
    assert status(ctx)["bounce"] is None
    assert_clean(gen)
