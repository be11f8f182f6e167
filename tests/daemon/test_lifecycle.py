"""Daemon lifecycle: start-up errors, the API socket, and shutdown by signal."""

from __future__ import annotations

import asyncio
import os
import signal
import stat
from pathlib import Path

from cli_harness import kvxferd
from daemon_harness import SimEngine, start_on_a_busy_peer_port, wait_for

from kvxferd.sim.cluster import LocalCluster


def test_api_socket_is_private_and_a_stale_one_is_replaced(cluster: LocalCluster) -> None:
    ctx = cluster.start_daemon("ctx", "context")
    mode = stat.S_IMODE(os.stat(ctx.api_socket).st_mode)
    assert mode == 0o600, oct(mode)
    ctx.kill()  # SIGKILL leaves the socket file behind
    assert os.path.exists(ctx.api_socket)
    again = cluster.start_daemon("ctx", "context")
    assert again.alive()
    assert stat.S_IMODE(os.stat(again.api_socket).st_mode) == 0o600


def test_second_daemon_on_the_same_socket_is_refused(cluster: LocalCluster) -> None:
    first = cluster.start_daemon("ctx", "context")
    second = cluster.start_daemon(
        "ctx2", "context", wait=False, daemon={"api_socket": first.api_socket}
    )
    assert second.proc.wait(60) == 1
    text = second.log_text()
    assert "another daemon is serving the engine API" in text
    assert "Traceback" not in text
    assert first.alive()


def test_busy_peer_port_is_a_clear_startup_error(cluster: LocalCluster) -> None:
    d, port = start_on_a_busy_peer_port(cluster)
    text = d.log_text()
    assert f"cannot listen for peers on 127.0.0.1:{port}" in text
    assert "Traceback" not in text
    assert not os.path.exists(d.api_socket)


def test_bad_config_exits_2_naming_the_value(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("cache_transceiver_config:\n  kv_transfer_timeout_ms: -5\n")
    proc = kvxferd("run", "--config", str(cfg), timeout=60)
    assert proc.returncode == 2
    assert "cache_transceiver_config.kv_transfer_timeout_ms" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_sigterm_drains_finishes_what_can_finish_and_fails_the_rest(
    cluster: LocalCluster,
) -> None:
    ctx = cluster.start_daemon(
        "ctx",
        "context",
        daemon={"drain_timeout_ms": 1500},
        transceiver={"kv_transfer_timeout_ms": 60000},
    )
    gen = cluster.start_daemon("gen", "generation")

    async def scenario() -> None:
        c = await SimEngine.open(ctx, num_blocks=64)
        g = await SimEngine.open(gen, num_blocks=64)
        try:
            # One request that completes, then sends that can never complete (no receive).
            blocks = await g.recv("ok-before", 64, ctx.peer_address)
            await c.send("ok-before", 64)
            assert (await g.client.wait("ok-before", 30)).status == "done"
            assert g.verify("ok-before", blocks, 64).ok
            for i in range(3):
                await c.send(f"stuck-{i}", 32)
            # A receive the context side holds (its engine never sends).
            await g.recv("held", 32, ctx.peer_address)
            ctx.proc.send_signal(signal.SIGTERM)
            for i in range(3):
                out = await c.client.wait(f"stuck-{i}", 30)
                assert (out.status, out.reason, out.fault) == ("failed", "shutdown", "local")
            held = await g.client.wait("held", 30)
            assert held.status != "done" and held.fault == "peer" and held.reason, held
        finally:
            await g.close()
            await c.client.close()

    asyncio.run(scenario())
    assert ctx.proc.wait(30) == 0
    text = ctx.log_text()
    for step in ("SIGTERM received: draining", "draining:", "closing peer connections", "stopped"):
        assert step in text, step


def test_second_signal_forces_exit(cluster: LocalCluster) -> None:
    ctx = cluster.start_daemon(
        "ctx",
        "context",
        daemon={"drain_timeout_ms": 120000},
        transceiver={"kv_transfer_timeout_ms": 120000},
    )

    async def send_stuck() -> None:
        c = await SimEngine.open(ctx, num_blocks=8)
        await c.send("stuck", 32)
        ctx.proc.send_signal(signal.SIGINT)
        wait_for(lambda: "draining" in ctx.log_text(), 30, "the drain to start")
        ctx.proc.send_signal(signal.SIGINT)
        await asyncio.sleep(0)  # let the client notice nothing; the process is gone
        await c.client.close()

    asyncio.run(send_stuck())
    assert ctx.proc.wait(30) == 1
    assert "forcing exit" in ctx.log_text()
