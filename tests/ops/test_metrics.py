"""/metrics after known workloads on real daemons: the counts equal what the
engines saw, the exposition passes `promtool check metrics`, labels stay
low-cardinality (no request ids), and handshake failures and missed heartbeats
are counted by reason and peer."""

from __future__ import annotations

import asyncio
import shutil
import signal

import pytest
from daemon_harness import SimEngine, status, wait_for
from ops_harness import Samples, http_get, parse, promtool_check, scrape, value

import kvxferd
from kvxferd.client import Outcome
from kvxferd.sim.cluster import LocalCluster

TIMEOUT_MS = 1500
SIZES = [32, 40, 64, 100, 128, 7, 96, 33, 64, 120]  # tokens; 32 per block


def test_counts_after_a_known_workload_match_what_the_engines_saw(cluster: LocalCluster) -> None:
    ctx = cluster.start_daemon("ctx", "context", transceiver={"kv_transfer_timeout_ms": TIMEOUT_MS})
    gen = cluster.start_daemon(
        "gen",
        "generation",
        # A window of 8 blocks, so some receives wait for admission.
        transceiver={"kv_transfer_timeout_ms": TIMEOUT_MS, "max_tokens_in_buffer": 256},
    )
    expositions: dict[str, str] = {}

    async def scenario() -> tuple[list[Outcome], list[Outcome]]:
        c = await SimEngine.open(ctx, num_blocks=128)
        g = await SimEngine.open(gen, num_blocks=128)
        try:
            # One receive its context engine never sends (receiver_timeout), one send
            # nobody receives (sender_deadline); both run alongside the workload.
            await g.recv("lonely-recv", 32, ctx.peer_address)
            await c.send("lonely-send", 32)
            blocks = {}
            for i, tokens in enumerate(SIZES):
                blocks[f"req-{i}"] = await g.recv(f"req-{i}", tokens, ctx.peer_address)
                await c.send(f"req-{i}", tokens)
            sends = [await c.client.wait(f"req-{i}", 30) for i in range(len(SIZES))]
            recvs = [await g.client.wait(f"req-{i}", 30) for i in range(len(SIZES))]
            for i, tokens in enumerate(SIZES):
                assert g.verify(f"req-{i}", blocks[f"req-{i}"], tokens).ok
            sends.append(await c.client.wait("lonely-send", 30))
            recvs.append(await g.client.wait("lonely-recv", 30))
            # Scraped while both engines are attached.
            expositions["ctx"] = scrape(ctx)
            expositions["gen"] = scrape(gen)
            return sends, recvs
        finally:
            await g.close()
            await c.close()

    sends, recvs = asyncio.run(scenario())
    assert [o.status for o in sends] == ["done"] * len(SIZES) + ["timed_out"]
    assert [o.status for o in recvs] == ["done"] * len(SIZES) + ["timed_out"]
    assert (sends[-1].reason, recvs[-1].reason) == ("sender_deadline", "receiver_timeout")
    c, g = parse(expositions["ctx"]), parse(expositions["gen"])
    n = len(SIZES)

    # Requests by outcome: exactly the engines' outcomes.
    assert value(c, "kvxferd_requests_total", side="send", status="done", reason="ok") == n
    assert (
        value(
            c, "kvxferd_requests_total", side="send", status="timed_out", reason="sender_deadline"
        )
        == 1
    )
    assert value(g, "kvxferd_requests_total", side="recv", status="done", reason="ok") == n
    assert (
        value(
            g, "kvxferd_requests_total", side="recv", status="timed_out", reason="receiver_timeout"
        )
        == 1
    )
    assert _total(c, "kvxferd_requests_total") == n + 1
    assert _total(g, "kvxferd_requests_total") == n + 1

    # Bytes moved: the sum of the outcomes' nbytes, the same on both sides.
    sent_bytes = sum(o.nbytes for o in sends)
    assert sent_bytes == sum(o.nbytes for o in recvs) > 0
    assert value(c, "kvxferd_transferred_bytes_total", side="send") == sent_bytes
    assert value(g, "kvxferd_transferred_bytes_total", side="recv") == sent_bytes

    # Histograms: one end-to-end observation per outcome; wire time and descriptors
    # per completed write (context side); admission wait per admitted receive.
    assert value(c, "kvxferd_request_duration_seconds_count", side="send") == n + 1
    assert value(g, "kvxferd_request_duration_seconds_count", side="recv") == n + 1
    assert value(c, "kvxferd_request_duration_seconds_sum", side="send") == pytest.approx(
        sum(o.elapsed_ms for o in sends) / 1e3, rel=1e-6
    )
    assert value(c, "kvxferd_wire_duration_seconds_count") == n
    assert value(c, "kvxferd_transfer_descriptors_count") == n
    assert value(c, "kvxferd_transfer_descriptors_sum") >= n
    assert value(g, "kvxferd_admission_wait_seconds_count") == n + 1
    assert value(g, "kvxferd_admission_window_blocks") == 8

    # Timeouts by phase.
    assert value(c, "kvxferd_timeouts_total", phase="sender_deadline") == 1
    assert value(c, "kvxferd_timeouts_total", phase="receiver_timeout") == 0
    assert value(g, "kvxferd_timeouts_total", phase="receiver_timeout") == 1
    assert value(g, "kvxferd_timeouts_total", phase="sender_deadline") == 0

    # Gauges at rest, with both engines attached and one peer each.
    for samples in (c, g):
        assert value(samples, "kvxferd_requests_in_flight", side="send") == 0
        assert value(samples, "kvxferd_requests_in_flight", side="recv") == 0
        assert value(samples, "kvxferd_admission_blocked_requests") == 0
        assert value(samples, "kvxferd_engine_connections") == 1
        assert value(samples, "kvxferd_peer_connections") == 1
        assert value(samples, "kvxferd_open_transfer_handles") == 0
        assert value(samples, "kvxferd_ready") == 1
        assert value(samples, "kvxferd_draining") == 0
        # Bounce counters exist (zero: bounce is off here).
        assert value(samples, "kvxferd_bounce_reservations_total") == 0
        assert value(samples, "kvxferd_bounce_fallbacks_total") == 0
        assert value(samples, "kvxferd_bounce_room_waits_total") == 0
    assert value(c, "kvxferd_handshakes_total", peer="gen") == 1
    assert value(g, "kvxferd_handshakes_total", peer="ctx") == 1
    assert (
        value(
            c,
            "kvxferd_daemon_info",
            name="ctx",
            role="context",
            backend="NIXL",
            runtime="PYTHON",
            version=kvxferd.__version__,
            fingerprint=status(ctx)["fingerprint"],
        )
        == 1
    )

    # Request ids go to logs, never to labels.
    for samples in (c, g):
        for _name, labels in samples:
            for label, label_value in labels:
                assert label != "request_id"
                assert not label_value.startswith(("req-", "lonely-")), (label, label_value)

    # `promtool check metrics` (lint: names, units, help, types) on both.
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed (scripts/test-deps.sh installs Debian's prometheus)")
    for name, text in expositions.items():
        result = promtool_check(text)
        assert result.returncode == 0 and not result.stdout.strip(), (
            name,
            result.stdout,
            result.stderr,
        )


def test_handshake_failures_and_missed_heartbeats_are_counted(cluster: LocalCluster) -> None:
    quick = {"heartbeat_interval_ms": 200, "heartbeat_timeout_ms": 1000}
    gen = cluster.start_daemon("gen", "generation", daemon=quick)
    ctx = cluster.start_daemon("ctx", "context", daemon=quick)
    stranger = cluster.start_daemon("stranger", "context", secret=b"not the shared secret")

    async def scenario() -> None:
        g = await SimEngine.open(gen)
        c = await SimEngine.open(ctx)
        try:
            await g.recv("to-stranger", 32, stranger.peer_address)
            out = await g.client.wait("to-stranger", 30)
            assert (out.status, out.reason) == ("failed", "peer_unreachable"), out
            await g.recv("ok", 32, ctx.peer_address)
            await c.send("ok", 32)
            assert (await g.client.wait("ok", 30)).status == "done"
        finally:
            await g.close()
            await c.close()

    asyncio.run(scenario())
    # Both ends of the failed handshake count it as an authentication failure.
    assert value(parse(scrape(gen)), "kvxferd_handshake_failures_total", reason="auth") == 1
    assert value(parse(scrape(stranger)), "kvxferd_handshake_failures_total", reason="auth") == 1

    # A frozen peer stops answering heartbeats: the generation side declares it lost.
    ctx.proc.send_signal(signal.SIGSTOP)
    try:

        def missed() -> float:
            samples = parse(scrape(gen))
            key = ("kvxferd_heartbeats_missed_total", frozenset({("peer", "ctx")}))
            return samples.get(key, 0.0)

        wait_for(lambda: missed() == 1, 20, "the missed heartbeat to be counted")
    finally:
        ctx.proc.send_signal(signal.SIGCONT)
    g = parse(scrape(gen))
    assert value(g, "kvxferd_peer_disconnects_total", peer="ctx") == 1
    assert value(g, "kvxferd_peer_connections") == 0
    assert http_get(gen, "/healthz")[0] == 200


def _total(samples: Samples, name: str) -> float:
    return sum(v for (n, _labels), v in samples.items() if n == name)
