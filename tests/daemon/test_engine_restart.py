"""An engine that restarts while the daemon is still ending its predecessor's requests
registers its pool under the same id at once (the gone engine's pool is set aside)."""

from __future__ import annotations

import asyncio
import signal

from daemon_harness import SimEngine, assert_clean, status, wait_for

from kvxferd.sim.cluster import DaemonProc, LocalCluster

SMALL = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "tokens_per_block": 32,
         "dtype": "float16"}  # fmt: skip
TPB = 32


def _pair(
    cluster: LocalCluster, timeout_ms: int, heartbeat_ms: int, heartbeat_timeout_ms: int
) -> tuple[DaemonProc, DaemonProc]:
    """A context and a generation daemon with these deadlines."""
    cfg = {
        "transceiver": {"kv_transfer_timeout_ms": timeout_ms},
        "daemon": {
            "heartbeat_interval_ms": heartbeat_ms,
            "heartbeat_timeout_ms": heartbeat_timeout_ms,
        },
    }
    return cluster.start_daemon("ctx", "context", **cfg), cluster.start_daemon(
        "gen", "generation", **cfg
    )


def test_a_restarted_engine_registers_while_its_predecessors_requests_end(
    cluster: LocalCluster,
) -> None:
    """The generation engine leaves with a receive pending from a context daemon that is
    stopped: ending that receive waits up to a heartbeat interval (3 s here) for the
    context daemon's answer. The engine's successor registers pool0 within that window."""
    ctx, gen = _pair(cluster, 30000, 3000, 20000)

    async def scenario() -> None:
        g = await SimEngine.open(gen, num_blocks=64, geometry=SMALL)
        blocks = g.alloc.take(4)
        await g.client.recv("r1", g.pool_id, blocks, ctx.peer_address, 4 * TPB)
        wait_for(lambda: status(ctx)["sessions"]["send"] == {"ready": 1}, what="the request")
        ctx.kill(signal.SIGSTOP)
        again: SimEngine | None = None
        try:
            await g.close(deregister=False)  # gone with its receive pending
            again = await SimEngine.open(gen, num_blocks=64, geometry=SMALL)
            # Registered under its own id beside the old pool, set aside until unused.
            pools = status(gen)["pools"]
            assert pools[0] == "pool0" and len(pools) == 2, pools
            assert pools[1].startswith("pool0@held-"), pools
        finally:
            ctx.kill(signal.SIGCONT)
            if again is not None:
                try:
                    wait_for(lambda: status(gen)["pools"] == ["pool0"], what="the old pool to go")
                finally:
                    await again.close()

    asyncio.run(scenario())
    wait_for(lambda: status(gen)["pools"] == [], what="every pool gone")
    assert_clean(gen)


def test_a_gone_engines_connection_is_closing_until_the_daemon_let_go_of_it(
    cluster: LocalCluster,
) -> None:
    """ConnectionState: the daemon numbers each engine connection (in its hello). One that
    ended reads "closing" while a receive it posted may still be written (here: its
    writer stopped, so its pool stays set aside), and "gone" once the daemon let go of
    everything it started; an engine whose connection ended while the daemon lives on
    learns so on a new one. A number never given out is a bad request."""
    from kvxferd.client import CallError

    ctx, gen = _pair(cluster, 2000, 300, 1500)

    async def scenario() -> None:
        g = await SimEngine.open(gen, num_blocks=64, geometry=SMALL)
        old = g.client.connection_id
        assert old > 0
        blocks = g.alloc.take(4)
        await g.client.recv("r1", g.pool_id, blocks, ctx.peer_address, 4 * TPB)
        wait_for(lambda: status(ctx)["sessions"]["send"] == {"ready": 1}, what="the request")
        again = await SimEngine.open(gen, num_blocks=64, geometry=SMALL, pool_id="pool1")
        try:
            assert again.client.connection_id > old
            assert await again.client.connection_state(old) == "live"
            assert await again.client.connection_state(again.client.connection_id) == "live"
            for never in (0, -1, again.client.connection_id + 1):
                try:
                    await again.client.connection_state(never)
                except CallError as exc:
                    assert exc.code == "bad_request" and "no engine connection" in str(exc)
                else:
                    raise AssertionError(f"connection {never} was never opened")
            ctx.kill(signal.SIGSTOP)
            try:
                await g.close(deregister=False)  # gone with its receive pending
                # Its receive fails at its deadline, held: the stopped writer may write.
                deadline = asyncio.get_running_loop().time() + 30
                while status(gen)["holds"]["requests"] != 1:
                    assert asyncio.get_running_loop().time() < deadline, status(gen)["holds"]
                    assert await again.client.connection_state(old) in ("live", "closing")
                    await asyncio.sleep(0.05)
                for _ in range(5):
                    assert await again.client.connection_state(old) == "closing"
            finally:
                ctx.kill(signal.SIGCONT)
            # The writer's AbortAck ends the hold; the set-aside pool goes, and with it
            # the last of the old connection.
            deadline = asyncio.get_running_loop().time() + 30
            while (state := await again.client.connection_state(old)) != "gone":
                assert state == "closing", state
                assert asyncio.get_running_loop().time() < deadline, status(gen)
                await asyncio.sleep(0.05)
            assert status(gen)["holds"]["requests"] == 0 and status(gen)["pools"] == ["pool1"]
        finally:
            await again.close()

    asyncio.run(scenario())
    wait_for(lambda: status(gen)["pools"] == [], what="every pool gone")
    assert_clean(gen)
