"""Fault injection across real daemons: real processes, real NIXL on loopback, real signals.

Each test is one named scenario of RELIABILITY.md ("fault cases worth a test each"): a
peer daemon SIGKILLed or SIGSTOPped mid-transfer, a peer restarted under its name, an
engine that disconnects, cancels, wrong secrets and incompatible peers, malformed engine
calls and peer messages, the admission window, and both deadlines. Every test ends by
checking that nothing (session, transfer handle, admission slot, pool) is left behind.

What the transport does here (UCX inside NIXL, both daemons on one host): a NIXL WRITE
is a UCX put over the `cma` transport (process_vm_writev), which is one-sided: the bytes
land in a SIGSTOPped peer's memory at once. The write's *completion* only stays "PROC"
while the UCX endpoint is not wired up yet, which needs the peer's reply: that holds for
the first write after a handshake, not for later ones. The busy-cancel test relies on
exactly that, and says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import signal
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from daemon_harness import (
    GEOMETRY,
    SimEngine,
    assert_clean,
    blocks_untouched,
    core_share,
    delivered,
    healthy,
    logged,
    metric,
    opened,
    peer_names,
    restart_daemon,
    serve_once,
    serve_then_hold,
    start_pair,
    status,
    transfer_one,
    ucx_over_tcp,
    until,
    wait_all,
)
from nixl_harness import nixl_or_skip

from kvxferd import PROTOCOL_VERSION
from kvxferd.api.messages import (
    DAEMON_CODEC,
    ENGINE_CODEC,
    DaemonHello,
    EngineHello,
    Query,
    RegisterPool,
    Reply,
)
from kvxferd.client import Outcome
from kvxferd.errors import IncompatiblePeerError
from kvxferd.peers.handshake import Identity, PeerIdentity, client_handshake
from kvxferd.peers.messages import PEER_CODEC, Auth, Challenge, Hello, Info, Ping, Refused
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.content import clear_blocks

TPB = int(GEOMETRY["tokens_per_block"])
PEER_FAILURES = ("peer_lost", "transfer_error")


def _cfg(timeout_ms: int, **daemon: Any) -> dict[str, Any]:
    return {"transceiver": {"kv_transfer_timeout_ms": timeout_ms}, "daemon": daemon}


def admission(daemon: DaemonProc) -> dict[str, Any]:
    doc = status(daemon)["admission"]
    return {k: doc[k] for k in ("window_blocks", "in_flight_blocks", "waiting")}


# ----------------------------------------------------------------- peers killed mid-transfer


def _check_killed_peer_outcomes(outcomes: dict[str, Outcome], reasons: tuple[str, ...]) -> None:
    for o in outcomes.values():
        if o.status != "done":  # done: it finished before the kill
            assert o.status == "failed" and o.reason in reasons and o.fault == "peer", o
            assert o.message, o
    assert any(o.status == "failed" for o in outcomes.values()), (
        f"the kill hit no transfer in flight: {outcomes}"
    )


# The kill tests: KILL_N requests of KILL_TOKENS tokens in flight when a daemon dies.
KILL_N, KILL_TOKENS, KILL_TIMEOUT_MS = 16, 2000, 8000
KILL_BLOCKS = KILL_N * math.ceil(KILL_TOKENS / TPB)


async def _writes_in_flight_then_killed(
    ctx: DaemonProc,
    c: SimEngine,
    g: SimEngine,
    rids: list[str],
    victim: DaemonProc,
) -> tuple[float, float]:
    """Every request (of KILL_TOKENS) received by `g` and sent by `c` at once, then
    `victim` SIGKILLed with a write in flight. Returns the monotonic times just before
    the sends were posted and just after every one was accepted."""
    tokens = KILL_TOKENS
    src = {}
    for rid in rids:
        await g.recv(rid, tokens, ctx.peer_address)
        src[rid] = c.fill(rid, tokens)
    await until(
        lambda: status(ctx)["sessions"]["send"] == {"ready": len(rids)},
        what="ctx has every request",
    )
    posted_at = time.monotonic()
    await asyncio.gather(*(c.client.send(r, c.pool_id, src[r], tokens) for r in rids))
    sent_at = time.monotonic()
    await until(
        lambda: status(ctx)["sessions"]["send"].get("transferring", 0) > 0,
        what="a write in flight",
    )
    victim.kill(signal.SIGKILL)
    return posted_at, sent_at


async def _a_new_peer_is_served(
    cluster: LocalCluster, survivor: DaemonProc, engine: SimEngine, rid: str
) -> None:
    """The surviving daemon (its engine `engine`) serves a new daemon of the other role,
    and has it as its only peer."""
    if survivor.role == "context":
        new = cluster.start_daemon("gen2", "generation", **_cfg(KILL_TIMEOUT_MS))
        async with opened(new) as g2:
            await transfer_one(survivor, engine, g2, rid, 1000)
    else:
        new = cluster.start_daemon("ctx2", "context", **_cfg(KILL_TIMEOUT_MS))
        async with opened(new) as c2:
            await transfer_one(new, c2, engine, rid, 1000)
    assert peer_names(survivor) == [new.name]


def _assert_survived(daemon: DaemonProc) -> None:
    """Nothing left behind, still healthy, nothing raised, nothing spinning (idle: 0-4 %)."""
    assert_clean(daemon)
    assert healthy(daemon)
    assert "Traceback" not in daemon.log_text()
    assert core_share(daemon) < 0.15


def _kill_mid_transfer(cluster: LocalCluster, victim_role: str) -> None:
    """KILL_N requests in flight when the daemon of `victim_role` is SIGKILLed: every
    request on the surviving side ends within its deadline, failed by the peer where the
    kill cut it; the survivor drops the dead peer, holds nothing, and serves a new daemon
    of the dead one's role."""
    ctx, gen = start_pair(cluster, **_cfg(KILL_TIMEOUT_MS))
    victim, survivor = (gen, ctx) if victim_role == "generation" else (ctx, gen)
    rids = [f"{victim.name[0]}kill-{i}" for i in range(KILL_N)]

    async def scenario() -> None:
        async with opened(survivor, num_blocks=KILL_BLOCKS + 40) as s:
            async with opened(victim, num_blocks=KILL_BLOCKS) as v:
                c, g = (s, v) if survivor is ctx else (v, s)
                posted_at, sent_at = await _writes_in_flight_then_killed(ctx, c, g, rids, victim)
                # Every send ends within its absolute deadline (plus scheduling slack); the
                # receive tasks' deadlines started before posted_at.
                started = sent_at if survivor is ctx else posted_at
                outcomes = await wait_all(s.client, rids, started + KILL_TIMEOUT_MS / 1e3 + 2.0)
            _check_killed_peer_outcomes(
                outcomes, PEER_FAILURES if survivor is ctx else ("peer_lost",)
            )
            await until(
                lambda: peer_names(survivor) == [], what=f"{survivor.name} dropped the dead peer"
            )
            if survivor is ctx:
                assert status(ctx)["open_transfer_handles"] == 0
            for rid in rids:
                await s.client.release(rid)
            if survivor is gen:
                assert status(gen)["admission"]["in_flight_blocks"] == 0

            await _a_new_peer_is_served(cluster, survivor, s, f"after-{victim.name}-kill")

    asyncio.run(scenario())
    _assert_survived(survivor)


async def _ended(engine: SimEngine, rid: str, timeout_s: float, needle: str, **want: str) -> None:
    """Wait for `rid`'s outcome: its fields `want` (status, reason, fault) as given, `needle`
    in its message; then release it."""
    got = await engine.client.wait(rid, timeout_s=timeout_s)
    assert {field: getattr(got, field) for field in want} == want, got
    assert needle in got.message, got
    await engine.client.release(rid)


def test_generation_daemon_killed_mid_transfer(cluster: LocalCluster) -> None:
    _kill_mid_transfer(cluster, "generation")


def test_context_daemon_killed_mid_transfer(cluster: LocalCluster) -> None:
    _kill_mid_transfer(cluster, "context")


def test_peer_restarted_under_same_name(cluster: LocalCluster) -> None:
    ctx, gen = start_pair(cluster, **_cfg(10000))
    old_incarnation = status(gen)["incarnation"]

    async def scenario() -> str:
        async with opened(ctx) as c:
            async with opened(gen) as g:
                await transfer_one(ctx, c, g, "before-restart", 100)
            peers = [(p["name"], p["incarnation"]) for p in status(ctx)["peers"]]
            assert peers == [("gen", old_incarnation)], peers
            gen.kill(signal.SIGKILL)
            new = restart_daemon(cluster, gen, **_cfg(10000))
            async with opened(new) as g:
                await transfer_one(ctx, c, g, "after-restart", 100)
            return str(status(new)["incarnation"])

    new_incarnation = asyncio.run(scenario())
    assert new_incarnation != old_incarnation
    peers = [(p["name"], p["incarnation"]) for p in status(ctx)["peers"]]
    assert peers == [("gen", new_incarnation)], peers
    assert_clean(ctx)


def test_stale_incarnation_replaced_while_the_old_one_hangs(cluster: LocalCluster) -> None:
    """The old incarnation does not die but hangs (SIGSTOP, its TCP connection still open,
    heartbeats far off): the new incarnation's handshake alone must evict it."""
    cfg = _cfg(10000, heartbeat_timeout_ms=30000)
    ctx, gen = start_pair(cluster, **cfg)
    old_incarnation = status(gen)["incarnation"]

    async def scenario() -> str:
        async with opened(ctx) as c:
            async with opened(gen) as g:
                await serve_then_hold(ctx, c, g, "before-hang", "held-by-old")
                gen.kill(signal.SIGSTOP)
                new_cfg = _cfg(10000, heartbeat_timeout_ms=30000)
                new_cfg["daemon"]["api_socket"] = str(cluster.workdir / "gen-new.sock")
                new = restart_daemon(cluster, gen, **new_cfg)
                async with opened(new) as g2:
                    await transfer_one(ctx, c, g2, "after-hang", 100)
                # The stale connection went, and with it what it had asked for.
                assert status(ctx)["sessions"]["send"] == {}
                gen.kill(signal.SIGKILL)
            return str(status(new)["incarnation"])

    new_incarnation = asyncio.run(scenario())
    assert new_incarnation != old_incarnation
    peers = [(p["name"], p["incarnation"]) for p in status(ctx)["peers"]]
    assert peers == [("gen", new_incarnation)], peers
    logged(ctx, "gen", "restarted", old_incarnation, new_incarnation)
    assert_clean(ctx)


def test_hung_peer_declared_lost_by_heartbeat(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that stops answering (SIGSTOP) with a write in flight: the heartbeat timeout,
    not the 20 s deadline, ends the request; both sides recover once it runs again.

    Run over UCX's TCP: there a write's completion needs the receiver's acknowledgement,
    so it stays in flight while the receiver is stopped, on a wired endpoint too (over
    UCX's shared memory the writer completes it alone with CMA once the endpoint is wired,
    and NIXL may wire it before the first post: nothing would be in flight). Its bytes
    wait in the sender's socket, which a cancel does not empty: the context daemon drains
    the write (its blocks held) and the receiver keeps its blocks until that drain ends,
    so the bytes the resumed receiver lands reach blocks still on loan."""
    if ucx_over_tcp(monkeypatch) != "tcp":
        pytest.skip("no network device for UCX's TCP on this host")
    cfg = _cfg(20000, heartbeat_interval_ms=300, heartbeat_timeout_ms=1500)
    ctx, gen = start_pair(cluster, **cfg)

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g:
            await transfer_one(ctx, c, g, "wired", 300)
            blocks = await g.recv("hung", 500, ctx.peer_address)
            await until(lambda: status(ctx)["sessions"]["send"] == {"ready": 1}, what="request")
            gen.kill(signal.SIGSTOP)
            try:
                await c.send("hung", 500)
                o = await c.client.wait("hung", timeout_s=10)
                assert (o.status, o.reason, o.fault) == ("failed", "peer_lost", "peer"), o
                assert "heartbeat" in o.message, o
                # In flight when the request ended: drained, never cancelled.
                assert o.blocks_held, o
                doc = status(ctx)
                assert doc["open_transfer_handles"] == 1, doc
                assert doc["drains"]["active"] == 1, doc["drains"]
                assert c.client.released("hung") is None
                assert peer_names(ctx) == []
            finally:
                gen.kill(signal.SIGCONT)
            # Resumed, the receiver lands the write: the drain ends, the blocks come back.
            sent_back = await c.client.wait_released("hung", timeout_s=10)
            assert sent_back.how == "drained", sent_back
            got = await g.client.wait("hung", timeout_s=10)
            assert (got.status, got.fault) == ("failed", "peer"), got
            assert got.blocks_held, got
            await g.client.wait_released("hung", timeout_s=10)
            # Fenced: nothing of that write can land any more.
            doc = status(ctx)
            assert doc["open_transfer_handles"] == 0, doc
            assert doc["drains"]["active"] == 0, doc["drains"]
            assert doc["drains"]["ended_total"] == {"DONE": 1}, doc["drains"]
            clear_blocks(g.pool, g.layout, blocks)
            await g.client.release("hung")
            await c.client.release("hung")
            # The generation daemon dials again and the pair works.
            await transfer_one(ctx, c, g, "after-hang", 300)
            assert blocks_untouched(g, blocks), "a write landed after its blocks were fenced"

    asyncio.run(scenario())
    logged(ctx, "gen", "declaring it lost")
    assert_clean(ctx, gen)


# ------------------------------------------------------------------------------ engines


def test_engine_disconnects_with_requests_in_flight(cluster: LocalCluster) -> None:
    timeout_ms = 2500
    ctx, gen = start_pair(cluster, **_cfg(timeout_ms))

    async def scenario() -> None:
        async with opened(ctx) as c:
            # 1. Generation first: receives posted, the context engine has not sent yet.
            g = await SimEngine.open(gen)
            early = [f"gone-g{i}" for i in range(3)]
            for rid in early:
                await g.recv(rid, 64, ctx.peer_address)
            await until(lambda: status(ctx)["sessions"]["send"] == {"ready": 3}, what="requests")
            await g.close(deregister=False)  # the engine goes away without cleaning up
            await until(
                lambda: (
                    status(gen)["sessions"] == {"send": {}, "recv": {}}
                    and status(gen)["pools"] == []
                    and status(gen)["engines"] == 0
                ),
                what="the gen daemon dropped the engine's sessions and pools",
            )
            # The ctx daemon was told: it forgot the requests it was holding.
            await until(lambda: status(ctx)["sessions"]["send"] == {}, what="ctx told of the abort")
            sent_at = time.monotonic()
            for rid in early:
                await c.send(rid, 64)
            for rid, o in (await wait_all(c.client, early, sent_at + timeout_ms / 1e3 + 2)).items():
                assert o.status in ("failed", "timed_out", "cancelled"), (rid, o)
                assert o.reason and o.message, o
                await c.client.release(rid)
            logged(gen, "engine_disconnected", count=len(early))

            # 2. Context first: the ctx engine sent a first chunk (last=False), so the
            # ctx daemon holds the request; the gen engine posts and then disconnects.
            g = await SimEngine.open(gen)
            late = [f"gone-c{i}" for i in range(3)]
            for rid in late:
                blocks = c.fill(rid, 128)
                await c.client.send(rid, c.pool_id, blocks[:2], 64, last=False)
            for rid in late:
                await g.recv(rid, 128, ctx.peer_address)
            await until(
                lambda: status(gen)["sessions"]["recv"] == {"ready": 3}, what="requests sent"
            )
            await g.close(deregister=False)
            by = time.monotonic() + timeout_ms / 1e3 + 2
            for rid, o in (await wait_all(c.client, late, by)).items():
                assert (o.status, o.fault) == ("failed", "peer"), (rid, o)
                assert "engine_disconnected" in o.message, o
                await c.client.release(rid)
            await until(
                lambda: (
                    status(gen)["sessions"] == {"send": {}, "recv": {}}
                    and status(gen)["pools"] == []
                ),
                what="gen clean",
            )

    asyncio.run(scenario())
    assert_clean(ctx, gen)
    # Both daemons still serve a new engine pair.
    asyncio.run(serve_once(ctx, gen, "after-disconnect"))


def test_context_engine_disconnects_mid_write(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ctx engine goes away while a write from its pool is in flight: the ctx daemon
    fails the send, keeps the pool until the write is quiescent, and tells the gen side.

    Over UCX's TCP (see test_hung_peer_declared_lost_by_heartbeat), with the generation
    daemon SIGSTOPped, the write stays in flight and is drained: the pool stays mapped
    under a held name while the write may still read it, and the gen side's Abort goes
    out once the drain ended, so its receive ends with nothing held."""
    if ucx_over_tcp(monkeypatch) != "tcp":
        pytest.skip("no network device for UCX's TCP on this host")
    cfg = _cfg(10000, heartbeat_timeout_ms=30000)
    ctx, gen = start_pair(cluster, **cfg)

    async def scenario() -> None:
        async with opened(gen) as g:
            c = await SimEngine.open(ctx)
            try:
                await transfer_one(ctx, c, g, "wired", 300)
                await g.recv("orphan", 500, ctx.peer_address)
                await until(lambda: status(ctx)["sessions"]["send"] == {"ready": 1}, what="request")
                gen.kill(signal.SIGSTOP)
                try:
                    await c.send("orphan", 500)
                    await until(lambda: status(ctx)["open_transfer_handles"] == 1, what="write")
                    await c.close(deregister=False)
                    await until(lambda: status(ctx)["engines"] == 0, what="the engine gone")
                    # Its send failed; its write still reads the pool: kept, out of reach.
                    doc = status(ctx)
                    assert doc["sessions"] == {"send": {}, "recv": {}}, doc["sessions"]
                    assert doc["open_transfer_handles"] == 1 and doc["drains"]["active"] == 1, doc
                    (held,) = doc["pools"]
                    assert held.startswith("pool0@held"), doc["pools"]
                finally:
                    gen.kill(signal.SIGCONT)
                await until(
                    lambda: (
                        (doc := status(ctx))["pools"] == []
                        and doc["open_transfer_handles"] == 0
                        and doc["drains"]["active"] == 0
                    ),
                    what="ctx quiesced the write and dropped the pool",
                )
                assert status(ctx)["drains"]["ended_total"] == {"DONE": 1}
            finally:
                with contextlib.suppress(Exception):
                    await c.close(deregister=False)
            got = await g.client.wait("orphan", timeout_s=10)
            assert (got.status, got.fault) == ("failed", "peer"), got
            assert "engine_disconnected" in got.message and not got.blocks_held, got
            await g.client.release("orphan")

    asyncio.run(scenario())
    logged(ctx, "orphan", "engine_disconnected")
    assert_clean(ctx, gen)


def test_cancel_busy_while_write_in_flight(cluster: LocalCluster) -> None:
    """A cancel answers "busy" while a write is in flight; the sender deadline ends it.

    To hold a write in flight the generation daemon is SIGSTOPped before the first write
    after the handshake. That write's bytes land at once (UCX cma writes into the stopped
    process's memory) but its completion needs the stopped peer's wire-up reply, so NIXL
    reports "PROC" until the handle is released. (A later write on the wired-up endpoint
    completes despite SIGSTOP: that is why nothing is sent to this peer beforehand.)
    """
    timeout_ms = 3000
    cfg = _cfg(timeout_ms, heartbeat_timeout_ms=30000)
    ctx, gen = start_pair(cluster, **cfg)
    tokens = 500

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g:
            blocks = await g.recv("busy", tokens, ctx.peer_address)
            await until(lambda: status(ctx)["sessions"]["send"] == {"ready": 1}, what="request")
            gen.kill(signal.SIGSTOP)
            try:
                await c.send("busy", tokens)
                await until(
                    lambda: (
                        (doc := status(ctx))["sessions"]["send"] == {"transferring": 1}
                        and doc["open_transfer_handles"] == 1
                    ),
                    what="the write in flight",
                )
                assert await c.client.cancel("busy") == "busy"
                o = await c.client.wait("busy", timeout_s=timeout_ms / 1e3 + 5)
                assert (o.status, o.reason, o.fault) == ("timed_out", "sender_deadline", "local"), o
                assert status(ctx)["open_transfer_handles"] == 0
                assert await c.client.cancel("busy") == "finished"
                # The handle was released: nothing of this write may land from now on.
                clear_blocks(g.pool, g.layout, blocks)
            finally:
                gen.kill(signal.SIGCONT)
            got = await g.client.wait("busy", timeout_s=timeout_ms / 1e3 + 5)
            assert got.status != "done" and got.reason and got.message, got
            assert blocks_untouched(g, blocks), "a write landed after its handle was released"
            await g.client.release("busy")
            await c.client.release("busy")

    asyncio.run(scenario())
    assert_clean(ctx, gen)


def test_cancel_before_transfer(cluster: LocalCluster) -> None:
    ctx, gen = start_pair(cluster, **_cfg(20000))

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g:
            # Generation side: the request reached ctx, whose engine never sends.
            await g.recv("rx-cancel", 100, ctx.peer_address)
            await until(lambda: status(ctx)["sessions"]["send"] == {"ready": 1}, what="request")
            assert await g.client.cancel("rx-cancel") == "cancelled"
            o = await g.client.wait("rx-cancel", timeout_s=5)
            assert (o.status, o.reason) == ("cancelled", "cancelled"), o
            assert await g.client.cancel("rx-cancel") == "finished"
            await g.client.release("rx-cancel")
            await until(lambda: status(ctx)["sessions"]["send"] == {}, what="ctx told")
            assert_clean(gen)
            # Context side: a send with no receive posted.
            await c.send("tx-cancel", 100)
            assert await c.client.cancel("tx-cancel") == "cancelled"
            o = await c.client.wait("tx-cancel", timeout_s=5)
            assert (o.status, o.reason) == ("cancelled", "cancelled"), o
            await c.client.release("tx-cancel")
            assert_clean(ctx)
            # Both ids can be used again and move KV normally.
            await transfer_one(ctx, c, g, "rx-cancel", 100)
            await transfer_one(ctx, c, g, "tx-cancel", 100)

    asyncio.run(scenario())
    assert_clean(ctx, gen)


# ------------------------------------------------------------------- refused peers


def test_wrong_shared_secret_is_refused(cluster: LocalCluster) -> None:
    ctx = cluster.start_daemon("ctx", "context", **_cfg(10000))
    gen = cluster.start_daemon("gen", "generation", secret=b"other", **_cfg(10000))

    async def daemon_with_other_secret() -> None:
        async with opened(ctx), opened(gen) as g:
            await g.recv("secret", 64, ctx.peer_address)
            o = await g.client.wait("secret", timeout_s=15)
            assert o.status == "failed" and o.reason in ("peer_unreachable", "peer_refused"), o
            assert "secret" in o.message, o
            await g.client.release("secret")

    async def client_without_secret() -> list[Any]:
        """A client that skips checking the server's proof and sends a made-up one."""
        host, port = ctx.peer_address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            hello = Hello(
                version=PROTOCOL_VERSION,
                name="mallory",
                incarnation="1",
                role="generation",
                nonce=os.urandom(32),
            )
            writer.write(PEER_CODEC.encode(hello))
            await writer.drain()
            challenge = await asyncio.wait_for(PEER_CODEC.read(reader), 10)
            assert isinstance(challenge, Challenge), challenge
            writer.write(PEER_CODEC.encode(Auth(proof=b"\0" * 32)))
            await writer.drain()
            return await _closed_by_daemon(reader, PEER_CODEC)
        finally:
            writer.close()

    asyncio.run(daemon_with_other_secret())
    logged(ctx, "handshake", "secret")
    logged(gen, "handshake", "secret")
    # Nothing after the failed proof but a refusal: no Info (agent metadata, pools).
    seen = asyncio.run(client_without_secret())
    assert [type(m) for m in seen] == [Refused], seen
    assert seen[0].reason == "auth" and "secret" in seen[0].message, seen
    logged(ctx, "handshake", "mallory", "secret")
    assert status(ctx)["peers"] == [] and status(gen)["peers"] == []
    assert sum(status(ctx)["handshake_failures"].values()) == 2, status(ctx)["handshake_failures"]
    assert_clean(ctx, gen)
    # The context daemon still serves a peer that knows the secret.
    good = cluster.start_daemon("gen-good", "generation", **_cfg(10000))
    asyncio.run(serve_once(ctx, good, "right-secret"))
    assert healthy(ctx)


def test_incompatible_layout_refused(cluster: LocalCluster) -> None:
    """A generation pool with another head_dim: refused in the handshake when both pools
    exist by then, else the request fails with block_mismatch; the message names head_dim
    either way."""
    ctx = cluster.start_daemon("ctx", "context", **_cfg(10000))
    wide = {**GEOMETRY, "head_dim": 128}
    engine_cfg = {"kv_layout": wide}
    late = cluster.start_daemon("gen-late", "generation", engine=engine_cfg, **_cfg(10000))
    early = cluster.start_daemon("gen-early", "generation", engine=engine_cfg, **_cfg(10000))

    async def scenario() -> None:
        # (a) Handshake before the ctx engine registered its pool: nothing to compare yet.
        async with opened(late, geometry=wide) as g:
            await g.recv("geo-late", 64, ctx.peer_address)
            await until(lambda: status(ctx)["sessions"]["send"] == {"ready": 1}, what="request")
            async with opened(ctx) as c:
                await c.send("geo-late", 64)
                sent = await c.client.wait("geo-late", timeout_s=15)
                got = await g.client.wait("geo-late", timeout_s=15)
                assert (sent.status, sent.reason) == ("failed", "block_mismatch"), sent
                assert "head_dim" in sent.message, sent
                assert got.status == "failed" and "head_dim" in got.message, got
                await g.client.release("geo-late")
                await c.client.release("geo-late")

                # (b) Both pools exist before the handshake: the handshake refuses the peer.
                async with opened(early, geometry=wide) as g2:
                    await g2.recv("geo-early", 64, ctx.peer_address)
                    await _ended(
                        g2, "geo-early", 15, "head_dim", status="failed", reason="peer_refused"
                    )

    asyncio.run(scenario())
    logged(ctx, "handshake", "head_dim")
    logged(early, "handshake", "head_dim")
    assert "gen-early" not in peer_names(ctx)
    for d in (ctx, late, early):
        assert_clean(d)


def _async(make: Callable[[], Info]) -> Callable[[], Awaitable[Info]]:
    """The handshake asks for our Info asynchronously (the daemon reads NIXL metadata
    on its data-plane thread)."""

    async def wrapped() -> Info:
        return make()

    return wrapped


def _cpp_info() -> Info:
    """What a generation daemon running the CPP runtime would advertise."""
    compat = {"backend": "NIXL", "runtime": "CPP", "pipelined_transfer": False}
    canonical = json.dumps(compat, sort_keys=True, separators=(",", ":"))
    return Info(
        agent_name="cpp-gen.1",
        agent_metadata=b"x",
        pools=[],
        fingerprint=hashlib.sha256(canonical.encode()).hexdigest()[:16],
        compat=dict(compat),
        transceiver={},
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        context_parallel_size=1,
    )


def _accept(peer: PeerIdentity, info: Info) -> None:
    return None


def _refused_handshake(ctx: DaemonProc, me: Identity, info: Any) -> IncompatiblePeerError:
    """Dial `ctx` as `me`, offering the Info `info()` makes; the refusal it must end in."""

    async def handshake() -> IncompatiblePeerError:
        host, port = ctx.peer_address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            with pytest.raises(IncompatiblePeerError) as err:
                await asyncio.wait_for(
                    client_handshake(reader, writer, me, _async(info), _accept, ctx.peer_address),
                    10,
                )
            return err.value
        finally:
            writer.close()

    return asyncio.run(handshake())


def test_agent_metadata_that_does_not_load_is_refused_in_the_handshake(
    cluster: LocalCluster,
) -> None:
    """Info whose agent metadata the backend cannot load gets a Refused naming it, before
    Ready: the peer hears why, instead of a Ready followed by a closed connection."""
    ctx, gen = start_pair(cluster, **_cfg(10000))
    secret = (cluster.workdir / "ctx.secret").read_bytes().rstrip()

    err = _refused_handshake(
        ctx,
        Identity("garbled", "1", "generation", secret),
        lambda: _fake_gen_info(gen, "garbled.1", b"not an agent"),
    )
    assert "agent_metadata" in str(err), err
    logged(ctx, "handshake", "agent metadata")
    assert "garbled" not in peer_names(ctx)
    asyncio.run(serve_once(ctx, gen, "after-garbled"))
    assert_clean(ctx)
    assert healthy(ctx)


def test_incompatible_settings_refused(cluster: LocalCluster) -> None:
    ctx, gen = start_pair(cluster, **_cfg(10000))
    secret = (cluster.workdir / "ctx.secret").read_bytes().rstrip()

    err = _refused_handshake(ctx, Identity("cpp-gen", "1", "generation", secret), _cpp_info)
    assert "runtime" in str(err), err
    assert "CPP" in str(err) and "PYTHON" in str(err), err
    lines = logged(ctx, "handshake", "runtime")
    assert "CPP" in lines[-1], ctx.log_text()[-3000:]
    assert "cpp-gen" not in peer_names(ctx)
    asyncio.run(serve_once(ctx, gen, "after-cpp"))
    assert_clean(ctx)
    assert healthy(ctx)


# ---------------------------------------------------------------------- malformed input


async def _raw_engine(socket_path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(socket_path)
    writer.write(ENGINE_CODEC.encode(EngineHello(version=PROTOCOL_VERSION, engine="raw")))
    await writer.drain()
    hello = await asyncio.wait_for(DAEMON_CODEC.read(reader), 10)
    assert isinstance(hello, DaemonHello), hello
    return reader, writer


async def _next_reply(reader: asyncio.StreamReader) -> Reply:
    msg = await asyncio.wait_for(DAEMON_CODEC.read(reader), 10)
    assert isinstance(msg, Reply), msg
    return msg


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


async def _closed_by_daemon(reader: asyncio.StreamReader, codec: Any = DAEMON_CODEC) -> list[Any]:
    """Read until the other side closes (within 10 s); the messages read on the way."""
    seen: list[Any] = []

    async def drain() -> None:
        while True:
            try:
                msg = await codec.read(reader)
            except (ConnectionError, OSError):
                return
            if msg is None:
                return
            seen.append(msg)

    await asyncio.wait_for(drain(), 10)
    return seen


def test_malformed_engine_calls(cluster: LocalCluster) -> None:
    ctx, gen = start_pair(cluster, **_cfg(10000))

    async def scenario() -> None:
        async with (
            opened(ctx) as c,
            opened(gen) as g,
        ):  # attached before the bad engine, used after it
            reader, writer = await _raw_engine(gen.api_socket)
            # With the call id the reply names, when one can still be read: the caller's
            # call fails at once instead of waiting for a reply it cannot match.
            garbage = [
                (b"\xc1\xc1\xc1\xc1", -1),  # 0xc1 is never valid msgpack
                (b"\x81\xa4type\xa4send", -1),  # a send without any of its fields
                (b"\x82\xa4type\xa6launch\xa7call_id\x07", 7),  # an unknown call
                (b"\x83\xa4type\xa5query\xa7call_id\xa1x\xaarequest_id\x01", -1),  # types
                (b"\x83\xa4type\xa5query\xa7call_id\x09\xaarequest_id\x01", 9),  # a bad field
            ]
            for body, call_id in garbage:
                writer.write(_frame(body))
                await writer.drain()
                reply = await _next_reply(reader)
                assert (reply.ok, reply.error) == (False, "bad_request"), (body, reply)
                assert reply.call_id == call_id, (body, reply)
                assert reply.message, reply
            # The same connection still works: valid calls get their own replies.
            writer.write(ENGINE_CODEC.encode(Query(call_id=41, request_id="nothing")))
            await writer.drain()
            reply = await _next_reply(reader)
            assert (reply.call_id, reply.ok, reply.error) == (41, False, "unknown_request"), reply
            layout = g.layout.to_wire()
            writer.write(
                ENGINE_CODEC.encode(
                    RegisterPool(
                        call_id=42, pool_id="raw", shm_name="no-such-shm", nbytes=1, layout=layout
                    )
                )
            )
            await writer.drain()
            reply = await _next_reply(reader)
            assert reply.call_id == 42 and not reply.ok and reply.error, reply
            assert status(gen)["engines"] == 2 and status(gen)["pools"] == ["pool0"]
            # A hostile length prefix: the stream cannot resynchronise, so it is closed.
            writer.write(struct.pack(">I", 0xFFFFFFF0) + b"\0" * 64)
            await writer.drain()
            await _closed_by_daemon(reader)
            writer.close()
            await until(lambda: status(gen)["engines"] == 1, what="the bad engine detached")
            logged(gen, "engine", "exceeds")
            # The daemon, and the engine attached before, are unaffected.
            assert healthy(gen)
            await transfer_one(ctx, c, g, "after-bad-engine", 300)

    asyncio.run(scenario())
    assert_clean(ctx, gen)


def _fake_gen_info(gen: DaemonProc, agent_name: str, metadata: bytes) -> Info:
    """An Info like a real generation daemon's: its compat fields and fingerprint."""
    doc = status(gen)
    settings = doc["settings"]
    return Info(
        agent_name=agent_name,
        agent_metadata=metadata,
        pools=[],
        fingerprint=doc["fingerprint"],
        compat={k: settings[k] for k in ("backend", "runtime", "pipelined_transfer")},
        transceiver={},
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        context_parallel_size=1,
    )


def test_malformed_peer_messages(cluster: LocalCluster) -> None:
    nixl = nixl_or_skip()
    ctx, gen = start_pair(cluster, **_cfg(10000))
    secret = (cluster.workdir / "ctx.secret").read_bytes().rstrip()
    host, port = ctx.peer_address.rsplit(":", 1)
    # A real NIXL agent, so that the ctx daemon can load its metadata.
    agent_name = "intruder.1"
    agent = nixl.nixl_agent(
        agent_name, nixl.nixl_agent_config(enable_listen_thread=False, backends=["UCX"])
    )
    metadata = bytes(agent.get_agent_metadata())

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(host, int(port))

    async def scenario() -> None:
        # A real generation daemon is connected throughout, and serves before and after.
        await serve_once(ctx, gen, "before-bad-peers")
        assert peer_names(ctx) == ["gen"]
        failures_before = sum(status(ctx)["handshake_failures"].values())

        # 1. Garbage bytes (an HTTP request on the peer port).
        reader, writer = await connect()
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        assert await _closed_by_daemon(reader, PEER_CODEC) == []
        writer.close()

        # 2. A truncated frame: the length says 200 bytes, 10 arrive, then EOF.
        reader, writer = await connect()
        writer.write(struct.pack(">I", 200) + b"\x85" + b"\0" * 9)
        writer.write_eof()
        await writer.drain()
        assert await _closed_by_daemon(reader, PEER_CODEC) == []
        writer.close()

        # 3. A well-framed Hello of another protocol version: refused with a reason.
        reader, writer = await connect()
        writer.write(
            PEER_CODEC.encode(
                Hello(
                    version=PROTOCOL_VERSION + 1,
                    name="future",
                    incarnation="1",
                    role="generation",
                    nonce=b"\0" * 32,
                )
            )
        )
        await writer.drain()
        seen = await _closed_by_daemon(reader, PEER_CODEC)
        assert len(seen) == 1 and isinstance(seen[0], Refused), seen
        assert seen[0].reason == "version" and str(PROTOCOL_VERSION + 1) in seen[0].message
        writer.close()

        await until(
            lambda: sum(status(ctx)["handshake_failures"].values()) == failures_before + 3,
            what="three failed handshakes counted",
        )
        logged(ctx, "handshake", "exceeds")
        logged(ctx, "handshake", "truncated")
        logged(ctx, "handshake", "protocol version")
        assert peer_names(ctx) == ["gen"]

        # 4. A complete, valid handshake, then a frame that does not decode.
        reader, writer = await connect()
        me = Identity("intruder", "1", "generation", secret)
        peer, _ = await asyncio.wait_for(
            client_handshake(
                reader,
                writer,
                me,
                _async(lambda: _fake_gen_info(gen, agent_name, metadata)),
                _accept,
                ctx.peer_address,
            ),
            10,
        )
        assert peer.name == "ctx"
        await until(lambda: peer_names(ctx) == ["gen", "intruder"], what="intruder connected")
        writer.write(_frame(b"\xc1\xc1\xc1\xc1"))
        await writer.drain()
        seen = await _closed_by_daemon(reader, PEER_CODEC)
        assert all(isinstance(m, (Ping,)) for m in seen), seen
        writer.close()
        await until(lambda: peer_names(ctx) == ["gen"], what="intruder dropped")
        logged(ctx, "intruder", "bad message")
        assert (
            metric(ctx, "kvxferd_malformed_messages_total", source="peer", reason="malformed") == 1
        )

        # Through all of it, the real peer kept its connection and is served.
        await serve_once(ctx, gen, "after-bad-peers")

    try:
        asyncio.run(scenario())
    finally:
        del agent
    assert healthy(ctx)
    assert_clean(ctx, gen)


# --------------------------------------------------------------------- admission window


def _window(max_tokens_in_buffer: int, poll_ms: int) -> dict[str, Any]:
    """An admission window of max_tokens_in_buffer, re-evaluated every poll_ms."""
    return {
        "transceiver": {
            "kv_transfer_timeout_ms": 20000,
            "max_tokens_in_buffer": max_tokens_in_buffer,
            "kv_transfer_poll_interval_ms": poll_ms,
        }
    }


def test_admission_window_full(cluster: LocalCluster) -> None:
    # max_tokens_in_buffer 64 / 32 tokens per block: at most 2 blocks in flight.
    ctx, gen = start_pair(cluster, **_window(max_tokens_in_buffer=64, poll_ms=200))
    rids = ["adm-1", "adm-2", "adm-3"]

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g:
            dst = {rid: await g.recv(rid, 64, ctx.peer_address) for rid in rids}
            # adm-1 (2 blocks) fills the window; adm-2 and adm-3 queue behind it.
            await until(lambda: status(ctx)["sessions"]["send"] == {"ready": 1}, what="adm-1")
            assert admission(gen) == {
                "window_blocks": 2,
                "in_flight_blocks": 2,
                "waiting": 2,
            }
            assert [await g.client.query(r) for r in rids] == [
                "ready",
                "waiting_for_peer",
                "waiting_for_peer",
            ]
            # The ctx engine has adm-3 ready first: it still may not overtake adm-2.
            await c.send("adm-3", 64)
            await c.send("adm-1", 64)
            assert (await g.client.wait("adm-1", timeout_s=15)).status == "done"
            await until(
                lambda: status(ctx)["sessions"]["send"].get("ready") == 1,
                what="adm-2 admitted and requested from ctx",
            )
            assert await g.client.query("adm-2") == "ready"
            assert await g.client.query("adm-3") == "waiting_for_peer"
            assert g.client.poll("adm-3") is None
            assert status(gen)["admission"]["in_flight_blocks"] == 2
            assert status(gen)["admission"]["waiting"] == 1
            await c.send("adm-2", 64)
            for rid in rids:
                await delivered(c, g, rid, dst[rid], 64, timeout_s=15)

    asyncio.run(scenario())
    assert_clean(ctx, gen)


def test_cancel_while_waiting_for_admission(cluster: LocalCluster) -> None:
    # Window of 4 blocks; a poll interval far longer than any wait below.
    ctx, gen = start_pair(cluster, **_window(max_tokens_in_buffer=128, poll_ms=60000))

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g:
            first = await g.recv("adm-first", 64, ctx.peer_address)  # 2 blocks in flight
            await until(lambda: status(ctx)["sessions"]["send"] == {"ready": 1}, what="first")
            await g.recv("adm-big", 128, ctx.peer_address)  # 4 blocks: has to wait
            assert admission(gen) == {
                "window_blocks": 4,
                "in_flight_blocks": 2,
                "waiting": 1,
            }
            assert await g.client.cancel("adm-big") == "cancelled"
            o = await g.client.wait("adm-big", timeout_s=5)
            assert (o.status, o.reason) == ("cancelled", "cancelled"), o
            await g.client.release("adm-big")
            # Nothing waits any more...
            await until(
                lambda: status(gen)["admission"]["waiting"] == 0,
                timeout_s=2,
                what="the cancelled receive to leave the admission queue",
            )
            # ... and a 2-block request fits beside the first one: admitted at once.
            second = await g.recv("adm-second", 64, ctx.peer_address)
            await until(
                lambda: status(ctx)["sessions"]["send"] == {"ready": 2},
                timeout_s=2,
                what="the fitting request to be admitted",
            )
            for rid, blocks in (("adm-first", first), ("adm-second", second)):
                await c.send(rid, 64)
                await delivered(c, g, rid, blocks, 64, timeout_s=15)

    asyncio.run(scenario())
    assert_clean(ctx, gen)


# ---------------------------------------------------------------------------- deadlines


def test_receiver_timeout_when_context_never_sends(cluster: LocalCluster) -> None:
    ctx, gen = start_pair(cluster, **_cfg(1500))

    async def scenario() -> None:
        async with opened(ctx), opened(gen) as g:
            blocks = await g.recv("rx-timeout", 64, ctx.peer_address)
            o = await g.client.wait("rx-timeout", timeout_s=15)
            assert (o.status, o.reason, o.fault) == ("timed_out", "receiver_timeout", "local"), o
            assert o.message, o
            assert blocks_untouched(g, blocks)
            await g.client.release("rx-timeout")
            await until(lambda: status(ctx)["sessions"]["send"] == {}, what="ctx told")

    asyncio.run(scenario())
    logged(gen, "rx-timeout", "receiver_timeout")
    logged(ctx, "rx-timeout", "receiver_timeout")
    assert_clean(ctx, gen)


def test_sender_deadline_when_no_receive(cluster: LocalCluster) -> None:
    ctx, gen = start_pair(cluster, **_cfg(1500))

    async def scenario() -> None:
        async with opened(ctx) as c:
            await c.send("tx-deadline", 64)
            assert await c.client.query("tx-deadline") == "waiting_for_peer"
            await _ended(
                c,
                "tx-deadline",
                15,
                "receiver",
                status="timed_out",
                reason="sender_deadline",
                fault="local",
            )

    asyncio.run(scenario())
    logged(ctx, "tx-deadline", "sender_deadline")
    assert_clean(ctx, gen)
