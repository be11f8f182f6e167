"""SIGTERM under load: every request completes or is reported failed with a
reason, on both sides; new work is refused with "draining"; /readyz turns 503
while /healthz stays 200; the daemon exits 0."""

from __future__ import annotations

import asyncio
import random
import signal

from daemon_harness import SimEngine, assert_clean, wait_for
from ops_harness import http_get, parse, scrape, value

from kvxferd.client import CallError, Outcome
from kvxferd.sim.cluster import LocalCluster

N = 60


def test_sigterm_under_load_loses_nothing(cluster: LocalCluster) -> None:
    ctx = cluster.start_daemon(
        "ctx",
        "context",
        daemon={"drain_timeout_ms": 2000},
        transceiver={"kv_transfer_timeout_ms": 30000},
    )
    gen = cluster.start_daemon("gen", "generation", transceiver={"kv_transfer_timeout_ms": 30000})
    rng = random.Random(6)
    sizes = {f"r{i}": rng.randint(1, 128) for i in range(N)}

    async def scenario() -> tuple[dict[str, Outcome], dict[str, Outcome], dict[str, str]]:
        c = await SimEngine.open(ctx, num_blocks=4 * N)
        g = await SimEngine.open(gen, num_blocks=4 * N)
        try:
            blocks = {
                rid: await g.recv(rid, tokens, ctx.peer_address) for rid, tokens in sizes.items()
            }
            # Nobody receives this one: it holds the drain open for its whole timeout.
            await c.send("stuck", 32)
            accepted: list[str] = ["stuck"]
            refused: dict[str, str] = {}
            for i, (rid, tokens) in enumerate(sizes.items()):
                if i == N // 3:
                    ctx.proc.send_signal(signal.SIGTERM)
                try:
                    await c.send(rid, tokens)
                    accepted.append(rid)
                except CallError as exc:
                    refused[rid] = exc.code
                await asyncio.sleep(0.01)
            sends = {rid: await c.client.wait(rid, 30) for rid in accepted}
            assert not c.client.errors
            recvs = {rid: await g.client.wait(rid, 30) for rid in sizes}
            for rid, out in recvs.items():
                if out.status == "done":
                    assert g.verify(rid, blocks[rid], sizes[rid]).ok, rid
                await g.client.release(rid)
            return sends, recvs, refused
        finally:
            await g.close()
            await c.client.close()

    sends, recvs, refused = asyncio.run(scenario())
    assert ctx.proc.wait(30) == 0

    # Every send was either refused as new work during the drain, or has an outcome.
    stuck = sends.pop("stuck")
    assert (stuck.status, stuck.reason, stuck.fault) == ("failed", "shutdown", "local"), stuck
    assert set(sends) | set(refused) == set(sizes)
    assert set(refused.values()) == {"draining"}, refused
    # What was accepted before the drain had the time to finish, and did.
    assert all(out.status == "done" for out in sends.values()), [
        (o.request_id, o.status, o.reason) for o in sends.values() if o.status != "done"
    ]
    # Every receive has an outcome: done for what was sent, and a failure with a
    # reason for the rest (the context side told it why: it shut down).
    assert set(recvs) == set(sizes)
    for rid, out in recvs.items():
        if rid in sends:
            assert out.status == "done", out
        else:
            assert out.status == "failed" and out.reason and out.fault == "peer", out
            assert "shut down" in out.message, out
    # The generation daemon is unharmed and holds nothing.
    assert gen.alive()
    assert_clean(gen)
    text = ctx.log_text()
    assert "Traceback" not in text
    for step in ("SIGTERM received: draining", "draining:", "stopped"):
        assert step in text, step


def test_while_draining_readyz_fails_healthz_answers_and_new_work_is_refused(
    cluster: LocalCluster,
) -> None:
    ctx = cluster.start_daemon(
        "ctx",
        "context",
        daemon={"drain_timeout_ms": 3000},
        transceiver={"kv_transfer_timeout_ms": 60000},
    )
    assert http_get(ctx, "/readyz")[0] == 200

    async def scenario() -> Outcome:
        c = await SimEngine.open(ctx, num_blocks=16)
        try:
            await c.send("stuck", 32)  # nobody receives it: holds the drain open
            ctx.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: http_get(ctx, "/readyz")[0] == 503, 10, "/readyz to turn 503")
            assert http_get(ctx, "/healthz")[0] == 200
            assert value(parse(scrape(ctx)), "kvxferd_draining") == 1
            for call in (c.send("new", 32), c.client.recv("new2", "pool0", [1], "x:1", 32)):
                try:
                    await call
                except CallError as exc:
                    assert exc.code == "draining", exc
                else:
                    raise AssertionError("new work was accepted while draining")
            return await c.client.wait("stuck", 30)
        finally:
            await c.client.close()

    out = asyncio.run(scenario())
    assert (out.status, out.reason, out.fault) == ("failed", "shutdown", "local")
    assert ctx.proc.wait(30) == 0
