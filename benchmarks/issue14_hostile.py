"""Issue 14, acceptance: thousands of hostile messages against live daemons, then a transfer.

Starts a context and a generation daemon on loopback (real NIXL, a shared secret) and runs
the live fuzzer of kvxferd.sim.hostile (the same code as tests/daemon/test_live_fuzz.py):
hostile peer messages to both daemons, before authentication and on channels that passed a
real handshake, hostile engine frames to both engine sockets, slow-loris connections on
both; then one real transfer, verified byte for byte.

Prints the messages sent (by kind), crashes, tracebacks and forged log lines, hung
connections, the daemons' RSS before and after, and the verification; exits 1 on any
crash, traceback, forged line, hung connection or unverified transfer.

Usage: .venv/bin/python benchmarks/issue14_hostile.py [--peer 20000] [--engine 5000]
       [--stolen N] [--seed N] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from kvxferd.backends.nixl import NixlBackend
from kvxferd.sim.cluster import LocalCluster
from kvxferd.sim.hostile import LiveResult, run_live

MiB = 1 << 20
AGENT = "fuzzer.agent"


def _print(result: LiveResult, seed: int, codes: dict[str, int]) -> None:
    print(f"seed {seed}, {result.seconds:.1f} s")
    for r in result.reports:
        s = r.summary()
        print(
            f"  {r.name:<22} messages {s['messages']:>6}  connections {s['connections']:>5}  "
            f"answered {s['answered']:>5}  closed {s['closed']:>5}  hung {s['hung']}  "
            f"unexpected {s['unexpected']}"
        )
        for case in r.hung_cases[:5]:
            print(f"      hung: {case[:400]}")
        for case in r.unexpected[:5]:
            print(f"      unexpected: {case[:400]}")
    print(f"hostile peer messages:   {result.messages('peer')}")
    print(f"hostile engine messages: {result.messages('engine')}")
    print(f"crashes:                 {len(result.crashed)} {result.crashed or ''}")
    tracebacks = sum(len(v) for v in result.tracebacks.values())
    print(f"tracebacks:              {tracebacks}")
    for name, lines in result.tracebacks.items():
        for line in lines[:5]:
            print(f"      {name}: {line[:300]}")
    print(f"forged log lines:        {sum(len(v) for v in result.forged.values())}")
    print(f"hung connections:        {result.hung}")
    print(f"surprises:               {sum(len(r.unexpected) for r in result.reports)}")
    for name in result.rss_before:
        before, after = result.rss_before[name] / MiB, result.rss_after[name] / MiB
        print(f"RSS {name}:                 {before:.1f} MiB -> {after:.1f} MiB")
    print(f"verified transfer:       {result.verified} ({result.verify_detail})")
    print(f"exit codes after SIGTERM: {codes}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", type=int, default=20_000, help="hostile peer messages")
    parser.add_argument("--engine", type=int, default=5_000, help="hostile engine messages")
    parser.add_argument(
        "--stolen",
        type=int,
        default=0,
        help="real sends asked for by the intruder with hostile addresses (peer messages too)",
    )
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000)
    parser.add_argument("--json", action="store_true", help="also print a JSON summary")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="kvxferd-issue14-"))
    with LocalCluster(workdir) as cluster:
        timeout = {"kv_transfer_timeout_ms": 20000}
        ctx = cluster.start_daemon("ctx", "context", transceiver=timeout)
        gen = cluster.start_daemon("gen", "generation", transceiver=timeout)
        secret = (workdir / "ctx.secret").read_bytes().rstrip()
        agent = NixlBackend(AGENT)
        started = time.monotonic()

        def progress(text: str) -> None:
            print(f"[{time.monotonic() - started:6.1f} s] {text[:160]}", file=sys.stderr)

        try:
            result = asyncio.run(
                run_live(
                    ctx,
                    gen,
                    secret,
                    (AGENT, agent.metadata()),
                    args.peer,
                    args.engine,
                    args.seed,
                    stolen=args.stolen,
                    progress=progress,
                )
            )
        finally:
            agent.close()
        codes = cluster.stop_all()
    _print(result, args.seed, codes)
    ok = (
        result.ok
        and not any(result.forged.values())
        and result.messages("peer") >= args.peer + 2 * args.stolen
        and result.messages("engine") >= args.engine
        and codes == {"ctx": 0, "gen": 0}
    )
    if args.json:
        doc = {
            "seed": args.seed,
            "peer_messages": result.messages("peer"),
            "engine_messages": result.messages("engine"),
            "crashes": result.crashed,
            "tracebacks": sum(len(v) for v in result.tracebacks.values()),
            "forged_log_lines": sum(len(v) for v in result.forged.values()),
            "hung_connections": result.hung,
            "rss_before": result.rss_before,
            "rss_after": result.rss_after,
            "verified": result.verified,
            "exit_codes": codes,
            "reports": {r.name: r.summary() for r in result.reports},
            "ok": ok,
        }
        print(json.dumps(doc, indent=2))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
