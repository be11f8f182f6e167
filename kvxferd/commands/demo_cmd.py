"""`kvxferd demo`: daemons move verified KV between two reference engines.

One daemon per engine rank: `--ctx-tp N --gen-tp M` starts N context and M
generation daemons, and each engine process drives all ranks of its instance
(the model's `--kv-heads` split over the ranks); KV heads are split or merged
between the two sides and every byte of every rank's pool is verified.

`--memory vram` keeps every engine's pools in GPU memory (filled and verified on the
device) and runs the daemons with engine.kv_memory: vram; it needs cupy and a CUDA device
here, and says so at once when there is none.

`--cluster NxM` runs N context and M generation instances, each on its own host, with
requests over every pair (kvxferd.commands.demo_cluster).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from typing import TYPE_CHECKING, Any

from kvxferd.commands.demo_cluster import parse_cluster
from kvxferd.commands.kv_memory import add_kv_memory_args

if TYPE_CHECKING:
    from kvxferd.sim.cluster import DaemonProc

EXIT_USAGE = 2


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "demo",
        help="run a context and a generation daemon with reference engines on this machine",
    )
    p.add_argument("--requests", type=int, default=300, help="number of requests (default 300)")
    p.add_argument("--in-flight", type=int, default=8, help="requests outstanding per engine")
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="longest prompt (default 2048; 512 with --cluster)",
    )
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
    p.add_argument(
        "--bounce-mb",
        type=int,
        default=None,
        help="kv_cache_bounce_size_mb of every daemon (the PYTHON runtime's bounce buffer, "
        "which also carries head-split and head-merge; default: unset)",
    )
    p.add_argument(
        "--ctx-tp",
        type=int,
        default=1,
        help="tensor-parallel size of the context instance, 1 to 4 (one daemon per rank)",
    )
    p.add_argument(
        "--gen-tp",
        type=int,
        default=1,
        help="tensor-parallel size of the generation instance, 1 to 4 (one daemon per rank)",
    )
    p.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="the model's KV heads, divisible by both sizes (default 4, or the smallest "
        "multiple of 4 both sizes divide)",
    )
    add_kv_memory_args(
        p,
        "where the engines keep their KV pools: host (shared memory) or vram (GPU "
        "memory, needs cupy and a CUDA device; runtime auto then means CPP, whose staging "
        "is always there, and PYTHON gets a bounce buffer sized for the requests in flight)",
    )
    p.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS between the daemons (a test CA and a certificate per daemon, made "
        "with openssl in the demo's directory; docs/operations.md, 'Mutual TLS')",
    )
    p.add_argument(
        "--cluster",
        type=parse_cluster,
        default=None,
        metavar="NxM",
        help="N context and M generation instances, each on its own host (a network "
        "namespace when run as root, else loopback), requests over every pair; --requests "
        "is then the total over all pairs",
    )
    p.add_argument(
        "--hosts",
        choices=["auto", "netns", "loopback"],
        default="auto",
        help="--cluster: each instance in its own network namespace (netns: needs root), "
        "all on loopback, or netns where it can be made (default auto)",
    )
    p.set_defaults(handler=_demo)


def _tp_problem(args: argparse.Namespace) -> str | None:
    """Why the tensor-parallel arguments cannot describe one model (None: they can);
    fills in the default --kv-heads."""
    for flag, size in (("--ctx-tp", args.ctx_tp), ("--gen-tp", args.gen_tp)):
        if not 1 <= size <= 4:
            return f"{flag} must be 1 to 4, got {size}"
    if args.kv_heads is None:
        args.kv_heads = math.lcm(4, args.ctx_tp, args.gen_tp)
    if args.kv_heads < 1:
        return f"--kv-heads must be positive, got {args.kv_heads}"
    for flag, size in (("--ctx-tp", args.ctx_tp), ("--gen-tp", args.gen_tp)):
        if args.kv_heads % size:
            return (
                f"--kv-heads {args.kv_heads} cannot be split over {flag} {size} ranks: "
                "the model's KV heads must be divisible by both tensor-parallel sizes"
            )
    return None


def _vram_problem(args: argparse.Namespace) -> str | None:
    """Why --memory vram cannot run (None: it can, or host memory was asked for)."""
    if args.memory != "vram":
        return None
    if args.backend not in ("DEFAULT", "NIXL"):
        return (
            f"--memory vram moves device pools through NIXL only; --backend {args.backend} "
            "moves host memory (use --backend NIXL)"
        )
    from kvxferd.sim.device_content import vram_problem

    return vram_problem()


def _vram_transceiver(args: argparse.Namespace, geometry: dict[str, Any]) -> dict[str, Any]:
    """The transceiver settings device pools need: the PYTHON runtime moves them only
    through its bounce buffer, here sized for every request in flight at its longest."""
    if args.runtime == "auto":
        return {"transceiver_runtime": "CPP"}
    if args.runtime != "PYTHON":
        return {}
    from kvxferd.memory.layout import KvLayout

    layout = KvLayout(
        num_layers=geometry["num_layers"],
        kv_factor=2,
        num_kv_heads=args.kv_heads // min(args.ctx_tp, args.gen_tp),
        head_dim=geometry["head_dim"],
        tokens_per_block=geometry["tokens_per_block"],
        dtype=geometry["dtype"],
        major=geometry["layout"],
        num_blocks=1,
    )
    blocks = -(-args.max_tokens // layout.tokens_per_block)
    return {"kv_cache_bounce_size_mb": -(-blocks * layout.block_bytes * args.in_flight // 2**20)}


def _cluster_problem(args: argparse.Namespace) -> str | None:
    """What --cluster does not combine with (None: nothing asked for it does)."""
    if args.cluster is None:
        return None
    for flag, given in (("--memory vram", args.memory == "vram"), ("--tls", args.tls)):
        if given:
            return f"--cluster runs host pools over plain TCP; {flag} is for the single pair"
    if args.max_tokens_in_buffer is not None:
        return "--cluster does not take --max-tokens-in-buffer"
    return None


def _cpu(*groups: list[DaemonProc]) -> float:
    """CPU seconds the daemons of `groups` have used so far (0 for one that cannot be
    read)."""
    from kvxferd.bench.cpu import cpu_seconds

    return sum(cpu_seconds(d.proc.pid) or 0.0 for group in groups for d in group)


def _names(prefix: str, size: int) -> list[str]:
    # One rank keeps the plain name (demo-ctx, demo-gen).
    return [prefix] if size == 1 else [f"{prefix}{r}" for r in range(size)]


def _demo(args: argparse.Namespace) -> int:
    from kvxferd.bench.fragmented import daemon_status
    from kvxferd.sim.cluster import LocalCluster, default_workdir, summarise

    if args.max_tokens is None:
        args.max_tokens = 512 if args.cluster else 2048
    problem = _tp_problem(args) or _vram_problem(args) or _cluster_problem(args)
    if problem is not None:
        print(f"kvxferd demo: error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    if args.cluster is not None:
        from kvxferd.commands.demo_cluster import run_cluster_demo

        return run_cluster_demo(args)
    workdir = default_workdir("kvxferd-demo")

    def say(text: str) -> None:
        if not args.json:
            print(text, file=sys.stderr)

    max_blocks = -(-args.max_tokens // 32)
    pool_blocks = max_blocks * args.in_flight + 8
    ok = False
    try:
        with LocalCluster(workdir, tls=args.tls) as cluster:
            cluster.geometry["layout"] = args.layout
            cluster.geometry["num_kv_heads"] = args.kv_heads
            cluster.transceiver = {
                "backend": args.backend,
                "transceiver_runtime": args.runtime,
                "max_tokens_in_buffer": args.max_tokens_in_buffer,
            }
            if args.bounce_mb is not None:
                cluster.transceiver["kv_cache_bounce_size_mb"] = args.bounce_mb
            if args.memory == "vram":
                cluster.kv_memory, cluster.vram_share = "vram", args.vram_share
                cluster.transceiver.update(_vram_transceiver(args, cluster.geometry))
                say(f"kvxferd demo: KV pools in GPU memory (shared by {args.vram_share})")
            tp = args.ctx_tp, args.gen_tp
            if tp == (1, 1):
                say(
                    "kvxferd demo: starting a context and a generation daemon"
                    f"{' with mutual TLS' if args.tls else ''} ({workdir})"
                )
            else:
                say(
                    f"kvxferd demo: {args.kv_heads} KV heads, context TP {tp[0]} -> generation "
                    f"TP {tp[1]}: starting one daemon per rank ({workdir})"
                )

            def start(name: str, role: str, size: int) -> DaemonProc:
                heads = {**cluster.geometry, "num_kv_heads": args.kv_heads // size}
                engine = {"tensor_parallel_size": size, "kv_layout": heads}
                d = cluster.start_daemon(name, role, engine=engine)
                label = f"{role} daemon {name}"
                say(f"  {label:<26} peers on {d.peer_address}, engine API {d.api_socket}")
                return d

            ctx = [start(n, "context", tp[0]) for n in _names("demo-ctx", tp[0])]
            gen = [start(n, "generation", tp[1]) for n in _names("demo-gen", tp[1])]
            say(f"running {args.requests} requests of {args.min_tokens}-{args.max_tokens} tokens")
            # The workload flags both engines take, under the same names, as given here.
            workload = ("requests", "seed", "min_tokens", "max_tokens", "in_flight")
            common = {name: getattr(args, name) for name in workload}
            common["pool_blocks"] = pool_blocks
            # Generation-first, as in a deployment: the generation engine announces
            # each posted receive over a pipe and the context engine sends only then,
            # so latency is the transfer's, not one engine waiting for the other.
            wait_fd, notify_fd = os.pipe()
            daemon_cpu0 = _cpu(ctx, gen)
            ctx_engine = cluster.start_engine(
                ctx, "context", pass_fds=(wait_fd,), wait_fd=wait_fd, **common
            )
            gen_engine = cluster.start_engine(
                gen,
                "generation",
                pass_fds=(notify_fd,),
                notify_fd=notify_fd,
                peer=[d.peer_address for d in ctx],
                progress=not args.json and sys.stderr.isatty(),
                **common,
            )
            os.close(wait_fd)
            os.close(notify_fd)
            reports = cluster.engine_reports({"generation": gen_engine, "context": ctx_engine})
            gen_report, ctx_report = reports["generation"], reports["context"]
            daemon_cpu = _cpu(ctx, gen) - daemon_cpu0
            # What the peer channel ran, as each generation daemon's status says.
            channels = sorted(
                {
                    peer.get("tls") or "plain TCP"
                    for d in gen
                    for peer in daemon_status(d.http_address).get("peers", [])
                }
            )
            # How each daemon's bounce buffer (PYTHON) or staging regions (the staged
            # runtime) carried the bytes; absent without either.
            copies = (
                "reservations_made",
                "fallbacks",
                "room_waits",
                "gathers",
                "scatters",
                "one_sided_legs",
                "pool_rounds",
            )
            regions: dict[str, dict[str, Any]] = {"bounce": {}, "staging": {}}
            for d in (*ctx, *gen):
                doc = daemon_status(d.http_address)
                for name, per_daemon in regions.items():
                    got = doc.get(name)
                    if isinstance(got, dict):
                        per_daemon[d.name] = {k: got[k] for k in copies if k in got}
            codes = cluster.stop_all()
            summary = summarise(ctx_report, gen_report)
            summary["peer_channel"] = channels
            summary.update({name: got for name, got in regions.items() if got})
            # Where the cores went during the workload: both engines (their own account)
            # and every daemon (from /proc); over `seconds`, how many cores were busy.
            engine_cpu = float(ctx_report.get("cpu_s", 0.0)) + float(gen_report.get("cpu_s", 0.0))
            summary["cpu_s"] = {"engines": round(engine_cpu, 3), "daemons": round(daemon_cpu, 3)}
            summary["daemon_exit_codes"] = codes
            summary["ctx_tp"], summary["gen_tp"] = tp
            summary["kv_heads"] = args.kv_heads
            if args.memory == "vram":
                summary["memory"] = "vram"
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
    if (s["ctx_tp"], s["gen_tp"]) != (1, 1):
        print(
            f"  parallel   context TP {s['ctx_tp']} -> generation TP {s['gen_tp']} "
            f"({s['kv_heads']} KV heads)"
        )
    if s.get("memory") == "vram":
        print("  memory     vram (pools filled and verified on the device)")
    print(f"  bytes      {s['bytes']:,}")
    print(f"  peers      {', '.join(s['peer_channel']) or '-'}")
    print(f"  bandwidth  {s['gbps']:.2f} GB/s over {s['seconds']:.2f} s")
    print(f"  latency    p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms (send to completion)")
    if s.get("first_failure"):
        print(f"  first failure: {s['first_failure']}")
    if s.get("first_mismatch"):
        print(f"  first mismatch: {s['first_mismatch']}")
