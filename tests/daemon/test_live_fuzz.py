"""A bounded live fuzzer against a real context and generation daemon (issue 14).

Thousands of hostile messages (kvxferd.sim.hostile, seeded: a failure names its seed and
replays with it): on the peer port before authentication (garbage, lying lengths, deep
nesting, wrong types, a Hello and then garbage); on authenticated channels after a real
handshake with the shared secret and a real NIXL agent (unknown and stolen request ids,
wrong tokens, bogus pools, offsets and lengths, handshake messages out of order, frames
that do not decode); and on the engine socket (garbage, mutated and wrongly typed calls,
plausible calls that get accepted and then cancelled, queried, released, duplicated).
Slow-loris connections on both sockets run meanwhile.

Then: both daemons alive and healthy, no traceback in their logs, no hostile string that
started a log line of its own, every connection answered or closed within its deadline,
nothing the fuzzers started left behind, a real transfer verified byte for byte, and a
clean shutdown. The acceptance-sized run is benchmarks/issue14_hostile.py.
"""

from __future__ import annotations

import asyncio
import os
from functools import partial

from daemon_harness import status, wait_for
from test_faults import _cfg, healthy

from kvxferd.backends.nixl import NixlBackend
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.hostile import LiveResult, run_live

SEED = int(os.environ.get("KVXFERD_FUZZ_SEED", "1414"))
PEER_MESSAGES = 3000
ENGINE_MESSAGES = 2000
AGENT = "fuzzer.agent"


def _describe(result: LiveResult) -> str:
    lines = [f"seed {SEED} (KVXFERD_FUZZ_SEED replays it)"]
    for r in result.reports:
        lines.append(f"{r.name}: {r.summary()}")
        lines += [f"  hung: {h[:600]}" for h in r.hung_cases[:5]]
        lines += [f"  unexpected: {u[:600]}" for u in r.unexpected[:5]]
    lines += [f"crashed: {result.crashed}", f"tracebacks: {result.tracebacks}"]
    lines += [f"forged: {result.forged}", f"verified: {result.verify_detail}"]
    return "\n".join(lines)


def _idle(doc: dict[str, object]) -> bool:
    """Nothing the fuzzers started is left: no session, handle, slot, fuzzer pool or peer."""
    admission = doc["admission"]
    assert isinstance(admission, dict)
    peers = doc["peers"]
    assert isinstance(peers, list)
    return (
        doc["sessions"] == {"send": {}, "recv": {}}
        and doc["open_transfer_handles"] == 0
        and admission["in_flight_blocks"] == 0
        and admission["waiting"] == 0
        and doc["engines"] == 0
        and doc["pools"] == []
        and not any(p["name"] == "fuzzer" for p in peers)
    )


def _idle_daemon(daemon: DaemonProc) -> bool:
    return _idle(status(daemon))


def test_thousands_of_hostile_messages_then_a_verified_transfer(cluster: LocalCluster) -> None:
    ctx = cluster.start_daemon("ctx", "context", **_cfg(20000))
    gen = cluster.start_daemon("gen", "generation", **_cfg(20000))
    secret = (cluster.workdir / "ctx.secret").read_bytes().rstrip()
    log_before = {d.name: len(d.log_text()) for d in (ctx, gen)}
    agent = NixlBackend(AGENT)  # a real agent: the daemons load its metadata
    try:
        result = asyncio.run(
            run_live(
                ctx, gen, secret, (AGENT, agent.metadata()), PEER_MESSAGES, ENGINE_MESSAGES, SEED
            )
        )
    finally:
        agent.close()
    report = _describe(result)
    print(report)

    assert result.messages("peer") >= PEER_MESSAGES, report
    assert result.messages("engine") >= ENGINE_MESSAGES, report
    assert not result.crashed, report
    assert result.tracebacks == {"ctx": [], "gen": []}, report
    assert result.forged == {"ctx": [], "gen": []}, report
    assert result.hung == 0, report
    assert all(not r.unexpected for r in result.reports), report
    assert result.verified, report
    for daemon in (ctx, gen):
        assert healthy(daemon)
        wait_for(partial(_idle_daemon, daemon), 30, f"{daemon.name} back to idle")
        # Thousands of refusals, each logged at most once and bounded (rate-limited,
        # truncated): nowhere near the megabytes the hostile strings carried.
        grown = len(daemon.log_text()) - log_before[daemon.name]
        assert grown < 4 << 20, f"{daemon.name} logged {grown} bytes"
    # A daemon that took all of that still shuts down cleanly.
    assert cluster.stop_all() == {"ctx": 0, "gen": 0}


def test_stolen_sends_with_hostile_addresses_fail_as_the_peers_fault(
    cluster: LocalCluster,
) -> None:
    """An authenticated intruder asks first for real sends, into a pool it announced with
    hostile addresses or with hostile block ids: within the deadline each send fails as
    the peer's fault, or the intruder's RequestData is refused (blocks outside its pool)
    and the send waits on; never a traceback; then a real transfer still verifies."""
    ctx = cluster.start_daemon("ctx", "context", **_cfg(20000))
    gen = cluster.start_daemon("gen", "generation", **_cfg(20000))
    secret = (cluster.workdir / "ctx.secret").read_bytes().rstrip()
    agent = NixlBackend(AGENT)
    try:
        result = asyncio.run(
            run_live(ctx, gen, secret, (AGENT, agent.metadata()), 0, 0, SEED, stolen=40)
        )
    finally:
        agent.close()
    report = _describe(result)
    print(report)
    assert ctx.alive() and gen.alive(), report
    assert result.verified, report  # holds today: the daemon survives and still serves
    assert result.hung == 0, report
    assert result.tracebacks == {"ctx": [], "gen": []}, report
    assert all(not r.unexpected for r in result.reports), report
