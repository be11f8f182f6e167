"""Who may take a peer's name: real daemons, real signals.

The context daemon admits a second connection under the name of a connected peer only
when the old one does not answer a probe (docs/protocol.md, "Handshake"): an impostor
that knows the secret cannot evict a live peer and fail its requests, a restarted peer
(old process dead) is accepted at once, and a hung one (SIGSTOP) loses its name to its
new incarnation without anyone waiting for the heartbeat timeout.
"""

from __future__ import annotations

import asyncio
import math
import signal
from typing import Any

import pytest
from daemon_harness import (
    GEOMETRY,
    assert_clean,
    delivered,
    log_lines,
    logged,
    opened,
    restart_daemon,
    serve_then_hold,
    start_pair,
    status,
    transfer_one,
    until,
)
from test_faults import _cfg

from kvxferd.errors import IncompatiblePeerError
from kvxferd.peers.handshake import Identity, PeerIdentity, client_handshake
from kvxferd.peers.messages import Info
from kvxferd.sim.cluster import DaemonProc, LocalCluster

TPB = int(GEOMETRY["tokens_per_block"])
# Far beyond every deadline below: a test that passes did not wait for it.
LONG_HEARTBEAT_MS = 30000
REFUSAL_LOG = "refused a second peer named"
# Deadline for a replacement's admission and its transfer: far below the heartbeat timeout.
ADMIT_S = 8.0


def peers(daemon: DaemonProc) -> list[tuple[str, str]]:
    return sorted((p["name"], p["incarnation"]) for p in status(daemon)["peers"])


def failures(daemon: DaemonProc) -> int:
    return sum(status(daemon)["handshake_failures"].values())


async def _no_info() -> Info:
    raise AssertionError("asked for our Info: the daemon sent its own to an impostor")


def _no_check(peer: PeerIdentity, info: Info) -> None:
    raise AssertionError(f"the daemon sent its Info (agent {info.agent_name}) to an impostor")


async def impostor_handshake(ctx: DaemonProc, me: Identity) -> IncompatiblePeerError:
    """Handshake with the context daemon as `me` (it knows the secret); the refusal, once
    the daemon closed the connection. Any Info sent to us fails the test."""
    host, port = ctx.peer_address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        with pytest.raises(IncompatiblePeerError) as err:
            await asyncio.wait_for(
                client_handshake(reader, writer, me, _no_info, _no_check, ctx.peer_address),
                15,
            )
        # Nothing follows the refusal: the daemon hangs up.
        assert await asyncio.wait_for(reader.read(), 10) == b""
        return err.value
    finally:
        writer.close()


def _long_heartbeats() -> dict[str, Any]:
    """A daemon's settings here: 20 s deadlines, heartbeats that never time out in a test."""
    return _cfg(20000, heartbeat_timeout_ms=LONG_HEARTBEAT_MS)


def _pair_with_long_heartbeats(cluster: LocalCluster) -> tuple[DaemonProc, DaemonProc, str]:
    """ctx and gen with _long_heartbeats(), and gen's (first) incarnation."""
    ctx, gen = start_pair(cluster, **_long_heartbeats())
    return ctx, gen, str(status(gen)["incarnation"])


def replace_stopped(cluster: LocalCluster, stopped: DaemonProc) -> tuple[DaemonProc, str]:
    """A new incarnation under the name of the SIGSTOPped `stopped` (with its own api
    socket, the old one still runs): the daemon and its incarnation."""
    new_cfg = _long_heartbeats()
    new_cfg["daemon"]["api_socket"] = str(cluster.workdir / f"{stopped.name}-new.sock")
    new = restart_daemon(cluster, stopped, **new_cfg)
    new_incarnation = str(status(new)["incarnation"])
    return new, new_incarnation


def test_impostor_cannot_evict_a_live_peer(cluster: LocalCluster) -> None:
    """A second client under the live generation daemon's name, with its secret, is
    refused (`name_in_use`), whatever incarnation it claims; the live peer's requests in
    flight are untouched and complete."""
    cfg = _cfg(20000)
    ctx, gen = start_pair(cluster, **cfg)
    incarnation = str(status(gen)["incarnation"])
    secret = (cluster.workdir / "gen.secret").read_bytes().rstrip()
    n, tokens = 8, 300
    per = math.ceil(tokens / TPB)
    rids = [f"live-{i}" for i in range(n)]

    async def scenario() -> None:
        async with opened(ctx, num_blocks=n * per) as c, opened(gen, num_blocks=n * per) as g:
            dst = {rid: await g.recv(rid, tokens, ctx.peer_address) for rid in rids}
            await until(
                lambda: status(ctx)["sessions"]["send"] == {"ready": n},
                what="ctx has every request",
            )
            assert peers(ctx) == [("gen", incarnation)]
            before = failures(ctx)

            for claimed in (f"{incarnation}-impostor", incarnation):
                me = Identity("gen", claimed, "generation", secret)
                err = await impostor_handshake(ctx, me)
                assert "name_in_use" in str(err), err
                # The live peer and everything it asked for are untouched.
                assert peers(ctx) == [("gen", incarnation)]
                assert status(ctx)["sessions"]["send"] == {"ready": n}
                assert sum(status(gen)["sessions"]["recv"].values()) == n, status(gen)

            await until(lambda: failures(ctx) == before + 2, what="both refusals counted")
            lines = logged(ctx, REFUSAL_LOG, "'gen'", count=2)
            assert any(f"{incarnation}-impostor" in line for line in lines), lines

            # The context engine sends them all; every one lands and verifies.
            for rid in rids:
                await c.send(rid, tokens)
            for rid in rids:
                got = await g.client.wait(rid, timeout_s=20)
                sent = await c.client.wait(rid, timeout_s=20)
                assert (got.status, got.reason) == ("done", "ok"), got
                assert (sent.status, sent.reason) == ("done", "ok"), sent
                result = g.verify(rid, dst[rid], tokens)
                assert result.ok and result.bytes_checked > 0, (rid, result.first_mismatch)
                await g.client.release(rid)
                await c.client.release(rid)
            assert peers(ctx) == [("gen", incarnation)]

    asyncio.run(scenario())
    assert peers(ctx) == [("gen", incarnation)]
    assert not log_lines(ctx, "gen", "restarted"), ctx.log_text()[-3000:]
    assert "Traceback" not in ctx.log_text()
    assert_clean(ctx)
    assert_clean(gen)


def test_restarted_peer_is_accepted_at_once(cluster: LocalCluster) -> None:
    """The generation daemon is SIGKILLed with a request held at the context daemon and
    restarted under its name at once: the kernel closed the old socket, so the new
    incarnation is admitted without a refusal, long before any heartbeat timeout."""
    ctx, gen, old_incarnation = _pair_with_long_heartbeats(cluster)

    async def scenario() -> str:
        async with opened(ctx) as c:
            async with opened(gen) as g:
                await serve_then_hold(ctx, c, g, "before-kill", "held-by-dead")
                before = failures(ctx)
                gen.kill(signal.SIGKILL)
            # No wait for the context daemon to notice: the restart races its cleanup.
            new = restart_daemon(cluster, gen, **_long_heartbeats())
            new_incarnation = str(status(new)["incarnation"])
            assert new_incarnation != old_incarnation
            async with opened(new) as g2:
                await asyncio.wait_for(transfer_one(ctx, c, g2, "after-restart", 200), 15)
            await until(
                lambda: peers(ctx) == [("gen", new_incarnation)],
                timeout_s=10,
                what="ctx lists only the new incarnation",
            )
            # The dead incarnation's request went with its connection.
            await until(
                lambda: status(ctx)["sessions"]["send"] == {},
                timeout_s=10,
                what="the dead peer's request dropped",
            )
            assert failures(ctx) == before, status(ctx)["handshake_failures"]
            return new_incarnation

    new_incarnation = asyncio.run(scenario())
    assert peers(ctx) == [("gen", new_incarnation)]
    assert not log_lines(ctx, REFUSAL_LOG), ctx.log_text()[-3000:]
    assert "Traceback" not in ctx.log_text()
    assert_clean(ctx)


def test_stopped_peer_name_taken_without_waiting_for_heartbeat(cluster: LocalCluster) -> None:
    """The generation daemon hangs (SIGSTOP: its connection open, nothing answered) and a
    new incarnation connects under its name: the probe goes unanswered, and the new one
    is admitted and served well inside the (30 s) heartbeat timeout."""
    ctx, gen, old_incarnation = _pair_with_long_heartbeats(cluster)

    async def scenario() -> str:
        async with opened(ctx) as c, opened(gen) as g:
            await serve_then_hold(ctx, c, g, "before-stop", "held-by-stopped")
            before = failures(ctx)
            gen.kill(signal.SIGSTOP)
            try:
                new, new_incarnation = replace_stopped(cluster, gen)
                async with opened(new, pool_id="pool-new") as g2:
                    blocks = await g2.recv("to-new", 200, ctx.peer_address)
                    await until(
                        lambda: peers(ctx) == [("gen", new_incarnation)],
                        timeout_s=ADMIT_S,
                        what="the new incarnation admitted before any heartbeat timeout",
                    )
                    # The stale connection went, and with it the request it held.
                    await until(
                        lambda: status(ctx)["sessions"]["send"] == {"ready": 1},
                        timeout_s=ADMIT_S,
                        what="only the new incarnation's request at ctx",
                    )
                    await c.send("to-new", 200)
                    await delivered(c, g2, "to-new", blocks, 200, timeout_s=ADMIT_S)
                logged(ctx, "did not answer", "'gen'")
                # An eviction, not a refusal: no failed handshake.
                assert failures(ctx) == before, status(ctx)["handshake_failures"]
                assert not log_lines(ctx, REFUSAL_LOG), ctx.log_text()[-3000:]
            finally:
                gen.kill(signal.SIGKILL)
            return new_incarnation

    new_incarnation = asyncio.run(scenario())
    assert new_incarnation != old_incarnation
    assert peers(ctx) == [("gen", new_incarnation)]
    assert "Traceback" not in ctx.log_text()
    assert_clean(ctx)


def test_resumed_stale_incarnation_cannot_take_its_name_back(cluster: LocalCluster) -> None:
    """After its replacement, the stopped incarnation resumes: its held request failed,
    and its dial under its old name is refused while the new incarnation answers; the
    new one keeps its connection and is served.

    The resumed daemon's hold on the failed request's blocks cannot be fenced by an
    AbortAck (every connection it makes is refused) nor by death or a restart of the
    context daemon: the refusal itself says that nothing its incarnation asked for can
    still be written (Refused.quiescent), which releases the hold."""
    ctx, gen, old_incarnation = _pair_with_long_heartbeats(cluster)

    async def scenario() -> None:
        async with opened(ctx) as c, opened(gen) as g:
            await serve_then_hold(ctx, c, g, "before-stop", "held-by-stopped")
            gen.kill(signal.SIGSTOP)
            try:
                new, new_incarnation = replace_stopped(cluster, gen)
                async with opened(new, pool_id="pool-new") as g2:
                    await asyncio.wait_for(transfer_one(ctx, c, g2, "to-new", 100), timeout=ADMIT_S)
                assert peers(ctx) == [("gen", new_incarnation)]
                assert status(ctx)["sessions"]["send"] == {}
                # Before it resumes: the first refused dial of the stale incarnation may be
                # its hold's redial, at once, which the receive below then shares.
                before = failures(ctx)
            finally:
                gen.kill(signal.SIGCONT)

            # Resumed: the old incarnation's connection was closed under it.
            held = await g.client.wait("held-by-stopped", timeout_s=15)
            assert (held.status, held.fault) == ("failed", "peer"), held
            await g.client.release("held-by-stopped")
            # It dials again under its name: the new incarnation answers, so it is refused.
            await g.recv("old-redials", 100, ctx.peer_address)
            o = await g.client.wait("old-redials", timeout_s=15)
            assert (o.status, o.reason) == ("failed", "peer_refused"), o
            assert "name_in_use" in o.message, o
            await g.client.release("old-redials")
            await until(lambda: failures(ctx) > before, what="the refusal counted")
            logged(ctx, REFUSAL_LOG, "'gen'", old_incarnation)
            assert peers(ctx) == [("gen", new_incarnation)]
            # The new incarnation kept its connection and is served.
            async with opened(new, pool_id="pool-after") as g2:
                await transfer_one(ctx, c, g2, "after-resume", 100)
            assert peers(ctx) == [("gen", new_incarnation)]

            # The failed request's memory is handed back on the quiescent refusal.
            assert held.blocks_held, held
            rel = await g.client.wait_released("held-by-stopped", timeout_s=15)
            assert rel.how == "peer_quiescent", rel

    asyncio.run(scenario())
    assert peers(ctx) == [("gen", str(status(ctx)["peers"][0]["incarnation"]))]
    assert "Traceback" not in ctx.log_text()
    assert_clean(ctx)
    assert_clean(gen)
