"""The staged (CPP) runtime over every backend: gather, one write (or message) per round,
scatter, every byte verified."""

from __future__ import annotations

import asyncio
import os

import pytest
from daemon_harness import assert_clean, move_each, opened, staged_backends, status

from kvxferd.sim.cluster import DaemonProc, LocalCluster

BACKENDS = staged_backends()


def _start(
    cluster: LocalCluster, backend: str = "NIXL", **transceiver: object
) -> tuple[DaemonProc, DaemonProc]:
    t: dict[str, object] = {
        "backend": backend,
        "transceiver_runtime": "CPP",
        "kv_transfer_timeout_ms": 20000,
    }
    t.update(transceiver)
    return (
        cluster.start_daemon("ctx", "context", transceiver=t),
        cluster.start_daemon("gen", "generation", transceiver=t),
    )


async def _run(
    ctx: DaemonProc,
    gen: DaemonProc,
    lengths: list[int],
    major: str = "block-major",
    concurrent: bool = False,
) -> None:
    other = "layer-major" if major == "block-major" else "block-major"
    async with (
        opened(ctx, major=major, num_blocks=512) as c,
        opened(gen, major=other, num_blocks=512) as g,
    ):
        c.alloc.shuffle(1)
        g.alloc.shuffle(2)
        reqs = [(f"st-{i}-{n}", n) for i, n in enumerate(lengths)]
        await move_each(ctx, c, g, reqs, concurrent)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("major", ["block-major", "layer-major"])
def test_requests_larger_than_the_buffer_move_in_rounds(
    cluster: LocalCluster, major: str, backend: str
) -> None:
    # 128 tokens of staging = 4 blocks; 1000 tokens = 32 blocks = 8 rounds.
    ctx, gen = _start(cluster, backend, max_tokens_in_buffer=128)
    asyncio.run(_run(ctx, gen, [1000, 1, 128, 129, 33], major))
    for d in (ctx, gen):
        doc = status(d)
        assert doc["settings"]["runtime"] == "CPP"
        assert doc["settings"]["backend"] == backend
        staging = doc["staging"]
        assert staging["region_bytes"] == 4 * 256 * 1024
        assert staging["send_in_use_bytes"] == 0 and staging["recv_in_use_bytes"] == 0
        assert_clean(d)
        # Over NIXL the staged daemons take UCX's worker lock as a mutex (the environment
        # of the test leaves it to them); other backends leave UCX alone.
        said = "UCX_USE_MT_MUTEX=y" in d.log_text()
        assert said == (backend == "NIXL" and "UCX_USE_MT_MUTEX" not in os.environ)


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_requests_share_the_staging_buffer(cluster: LocalCluster, backend: str) -> None:
    ctx, gen = _start(cluster, backend, max_tokens_in_buffer=256)
    asyncio.run(_run(ctx, gen, [200, 300, 90, 500, 64, 256] * 2, concurrent=True))
    for d in (ctx, gen):
        assert status(d)["staging"]["recv_in_use_bytes"] == 0
        assert_clean(d)


def test_staged_peer_refuses_a_python_runtime_peer(cluster: LocalCluster) -> None:
    t = {"kv_transfer_timeout_ms": 5000}
    ctx = cluster.start_daemon("ctx", "context", transceiver={**t, "transceiver_runtime": "CPP"})
    gen = cluster.start_daemon("gen", "generation", transceiver=t)

    async def scenario() -> None:
        async with opened(gen) as g:
            await g.recv("mix", 64, ctx.peer_address)
            out = await g.client.wait("mix", 30)
            assert (out.status, out.reason) == ("failed", "peer_refused"), out
            assert "runtime" in out.message and "CPP" in out.message, out.message

    asyncio.run(scenario())
