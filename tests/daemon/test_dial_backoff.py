"""Dialing a dead peer (issue 18): receives naming a dead context peer do not each dial
it. After a failed dial the address backs off; receives meanwhile fail at once
(peer_unreachable) saying why and when the next dial is. A peer that comes back at the
address is dialed once its backoff ends, and receives are served again.

Dials are counted (the daemon's status and /metrics), never timed.
"""

from __future__ import annotations

import asyncio
import socket
import time

from daemon_harness import assert_clean, metric, opened, status, until

from kvxferd.sim.cluster import LocalCluster

TOKENS = 100
RECEIVES = 60
ROUNDS = 3


def _dead_address() -> str:
    """An address nothing listens on (a port the kernel just gave and took back)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_receives_naming_a_dead_peer_do_not_each_dial_it(cluster: LocalCluster) -> None:
    dead = _dead_address()
    cfg = {"transceiver": {"kv_transfer_timeout_ms": 20000}}
    gen = cluster.start_daemon("gen", "generation", daemon={"peers": {"ctx": dead}}, **cfg)

    def backoff_over() -> bool:
        peers = status(gen)["dial_backoff"]["peers"]
        return dead not in peers or peers[dead]["next_dial_in_s"] == 0

    async def dead_peer() -> list[str]:
        messages = []
        async with opened(gen) as g:
            for round_ in range(ROUNDS):
                # Each round starts once the backoff is over: its first receive dials.
                await until(backoff_over, what="the backoff of the dead peer over")
                # One after another: each receive would dial on its own without the backoff.
                for i in range(RECEIVES // ROUNDS):
                    rid = f"dead-{round_}-{i}"
                    blocks = await g.recv(rid, TOKENS, "ctx")
                    got = await g.client.wait(rid, timeout_s=20)
                    assert (got.status, got.reason, got.fault) == (
                        "failed",
                        "peer_unreachable",
                        "peer",
                    ), got
                    messages.append(got.message)
                    await g.client.release(rid)
                    g.alloc.give(blocks)
        return messages

    messages = asyncio.run(dead_peer())
    doc = status(gen)["dial_backoff"]
    dials = doc["dials_total"]
    # At least one dial per round (the backoff ended), far fewer than one per receive.
    assert ROUNDS <= dials <= RECEIVES // 4, doc
    assert doc["dials_failed_total"] == dials and doc["dials_ok_total"] == 0, doc
    fast = [m for m in messages if "dial backoff" in m]
    assert len(fast) == RECEIVES - dials == doc["refused_in_backoff_total"], doc
    # Each says which peer, that it was not dialed, for how long, and the last dial's error.
    assert dead in fast[-1] and "not dialed again for" in fast[-1], fast[-1]
    assert "cannot connect to peer" in fast[-1], fast[-1]
    assert doc["peers"][dead]["failures"] == dials, doc
    assert "cannot connect" in doc["peers"][dead]["last_error"], doc
    assert metric(gen, "kvxferd_peer_dials_total", result="failed") == dials
    assert metric(gen, "kvxferd_peer_dials_total", result="refused_in_backoff") == len(fast)

    # The peer comes back at that address: dialed after its backoff, and served.
    ctx = cluster.start_daemon("ctx", "context", daemon={"peer_listen": dead}, **cfg)

    async def back() -> int:
        async with opened(ctx) as c, opened(gen) as g:
            await c.send("back", TOKENS)
            deadline = time.monotonic() + 30
            attempts = 0
            while True:
                attempts += 1
                blocks = await g.recv("back", TOKENS, "ctx")
                got = await g.client.wait("back", timeout_s=20)
                if got.status == "done":
                    assert g.verify("back", blocks, TOKENS).ok
                    break
                assert "dial backoff" in got.message, got  # nothing else may go wrong
                await g.client.release("back")
                g.alloc.give(blocks)
                assert time.monotonic() < deadline, f"not served after {attempts} receives"
                await asyncio.sleep(0.05)
            await g.client.release("back")
            assert (await c.client.wait("back", timeout_s=20)).status == "done"
            await c.client.release("back")
            return attempts

    before = status(gen)["dial_backoff"]["dials_total"]
    attempts = asyncio.run(back())
    after = status(gen)["dial_backoff"]
    # One dial that worked; every other attempt failed at once without dialing.
    assert after["dials_total"] == before + 1 and after["dials_ok_total"] == 1, after
    assert after["refused_in_backoff_total"] == len(fast) + attempts - 1, after
    assert after["peers"] == {}, after  # reset by the handshake
    print(f"{RECEIVES} receives in {ROUNDS} rounds: {dials} dials; back after {attempts}")
    assert metric(gen, "kvxferd_peers_in_dial_backoff") == 0
    assert_clean(ctx, gen)
