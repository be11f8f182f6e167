"""`kvxferd demo`: two daemons move verified KV between two reference engines."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run a context and a generation daemon with reference engines on this machine",
    )
    p.add_argument("--requests", type=int, default=300, help="number of requests (default 300)")
    p.add_argument("--in-flight", type=int, default=8, help="requests outstanding per engine")
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--layout", choices=["block-major", "layer-major"], default="block-major")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--keep", action="store_true", help="keep configs and daemon logs")
    p.add_argument(
        "--backend",
        choices=["DEFAULT", "NIXL", "UCX", "MPI", "MOONCAKE"],
        default="NIXL",
        help="cache_transceiver_config.backend of both daemons (default NIXL)",
    )
    p.add_argument(
        "--runtime",
        choices=["auto", "PYTHON", "CPP"],
        default="auto",
        help="cache_transceiver_config.transceiver_runtime of both daemons (default auto)",
    )
    p.add_argument(
        "--max-tokens-in-buffer",
        type=int,
        default=None,
        help="staging buffer / admission window in tokens (default: unset)",
    )
    p.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    from kvxferd.sim.cluster import LocalCluster, default_workdir, summarise

    workdir = default_workdir("kvxferd-demo")

    def say(text: str) -> None:
        if not args.json:
            print(text, file=sys.stderr)

    max_blocks = -(-args.max_tokens // 32)
    pool_blocks = max_blocks * args.in_flight + 8
    ok = False
    try:
        with LocalCluster(workdir) as cluster:
            cluster.geometry["layout"] = args.layout
            cluster.transceiver = {
                "backend": args.backend,
                "transceiver_runtime": args.runtime,
                "max_tokens_in_buffer": args.max_tokens_in_buffer,
            }
            say(f"kvxferd demo: starting a context and a generation daemon ({workdir})")
            ctx = cluster.start_daemon("demo-ctx", "context")
            gen = cluster.start_daemon("demo-gen", "generation")
            say(f"  context daemon    peers on {ctx.peer_address}, engine API {ctx.api_socket}")
            say(f"  generation daemon peers on {gen.peer_address}, engine API {gen.api_socket}")
            say(f"running {args.requests} requests of {args.min_tokens}-{args.max_tokens} tokens")
            common = dict(
                requests=args.requests,
                seed=args.seed,
                min_tokens=args.min_tokens,
                max_tokens=args.max_tokens,
                in_flight=args.in_flight,
                pool_blocks=pool_blocks,
            )
            # Generation-first, as in a deployment: the generation engine announces
            # each posted receive over a pipe and the context engine sends only then,
            # so latency is the transfer's, not one engine waiting for the other.
            wait_fd, notify_fd = os.pipe()
            ctx_engine = cluster.start_engine(
                ctx, "context", pass_fds=(wait_fd,), wait_fd=wait_fd, **common
            )
            gen_engine = cluster.start_engine(
                gen,
                "generation",
                pass_fds=(notify_fd,),
                notify_fd=notify_fd,
                peer=ctx.peer_address,
                progress=not args.json and sys.stderr.isatty(),
                **common,
            )
            os.close(wait_fd)
            os.close(notify_fd)
            gen_report = cluster.engine_report(gen_engine)
            ctx_report = cluster.engine_report(ctx_engine)
            codes = cluster.stop_all()
            summary = summarise(ctx_report, gen_report)
            summary["daemon_exit_codes"] = codes
            ok = (
                summary["failed"] == 0
                and summary["verified"] == summary["requests"]
                and all(c == 0 for c in codes.values())
            )
    finally:
        if ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary)
        if not ok:
            print(f"logs and configs kept in {workdir}", file=sys.stderr)
    return 0 if ok else 1


def _print_summary(s: dict[str, Any]) -> None:
    print("kvxferd demo summary")
    print(f"  requests   {s['requests']}")
    print(f"  verified   {s['verified']}  (every byte checked by the generation engine)")
    print(f"  failed     {s['failed']}" + (f"  {s['failures']}" if s["failures"] else ""))
    print(f"  bytes      {s['bytes']:,}")
    print(f"  bandwidth  {s['gbps']:.2f} GB/s over {s['seconds']:.2f} s")
    print(f"  latency    p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms (send to completion)")
    if s.get("first_mismatch"):
        print(f"  first mismatch: {s['first_mismatch']}")
