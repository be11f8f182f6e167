"""`kvxferd demo --cluster NxM`: N context and M generation instances, every pair.

Each instance is one engine with its daemons (one per tensor-parallel rank, `--ctx-tp`
and `--gen-tp`) on its own host: a network namespace with its own IPC, PID and mount
namespaces (kvxferd.sim.hosts.network), so that KV crosses a veth and a bridge through
the kernel's network stack, as between machines. Without root (or without `ip`,
`unshare`, `nft`) the instances run as plain processes on loopback instead, and the
demo says so. Requests go from every context instance to every generation instance
(kvxferd.sim.hosts.traffic); the generation engines verify every byte.

Exit status: 0 when no request is wrong or lost (failed requests, each with its
reason, are counted and shown), 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from contextlib import ExitStack
from typing import Any

EXIT_USAGE = 2
MAX_SIDE = 8  # instances per side: each is a host with its daemons and engines


def parse_cluster(text: str) -> tuple[int, int]:
    """'2x3' -> (2, 3); argparse turns a ValueError into a usage error naming --cluster."""
    found = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not found:
        raise argparse.ArgumentTypeError(f"expected NxM (e.g. 2x2), got {text!r}")
    n, m = int(found.group(1)), int(found.group(2))
    if not (1 <= n <= MAX_SIDE and 1 <= m <= MAX_SIDE):
        raise argparse.ArgumentTypeError(f"N and M must be 1 to {MAX_SIDE}, got {text!r}")
    return n, m


def run_cluster_demo(args: argparse.Namespace) -> int:
    from kvxferd.sim.cluster import LocalCluster, default_workdir
    from kvxferd.sim.hosts.cluster import HostCluster, wait_clean
    from kvxferd.sim.hosts.network import Network, namespace_problem
    from kvxferd.sim.hosts.traffic import Round, Workload

    contexts, generations = args.cluster
    routes = contexts * generations
    per_route = max(1, -(-args.requests // routes))

    def say(text: str) -> None:
        if not args.json:
            print(text, file=sys.stderr)

    problem = "loopback asked for (--hosts loopback)" if args.hosts == "loopback" else None
    problem = problem or namespace_problem()
    if problem is not None and args.hosts == "netns":
        print(f"kvxferd demo: error: --hosts netns: {problem}", file=sys.stderr)
        return EXIT_USAGE
    workdir = default_workdir("kvxferd-demo-cluster")
    ok = False
    with ExitStack() as stack:
        net = None
        if problem is None:
            net = stack.enter_context(Network(contexts + generations))
            say(
                f"kvxferd demo: {contexts + generations} hosts as network namespaces on "
                f"{net.subnet}.0/24 (own network stack, IPC, PID and /dev/shm each)"
            )
        else:
            say(f"kvxferd demo: note: {problem}; running every instance on loopback instead")
        local = LocalCluster(workdir)
        local.geometry["layout"] = args.layout
        local.geometry["num_kv_heads"] = args.kv_heads
        # Long deadlines: a newcomer's machine may be busy, and a request failed for a
        # starved heartbeat says nothing about the cluster.
        local.transceiver = {
            "backend": args.backend,
            "transceiver_runtime": args.runtime,
            "kv_transfer_timeout_ms": 30000,
        }
        settings = {"heartbeat_interval_ms": 500, "heartbeat_timeout_ms": 10000}
        hc = stack.enter_context(HostCluster(local, net, daemon_settings=settings))
        hc.plan(contexts, args.ctx_tp, generations, args.gen_tp)
        say(
            f"starting {contexts} context (TP {args.ctx_tp}) and {generations} generation "
            f"(TP {args.gen_tp}) instances, "
            f"{contexts * args.ctx_tp + generations * args.gen_tp} daemons ({workdir})"
        )
        hc.start()
        for inst in hc.instances:
            where = inst.host.address if inst.host else "loopback"
            daemons = ", ".join(d.name for d in inst.daemons)
            say(f"  {inst.role:<10} {inst.name:<5} on {where}: {daemons}")
        workload = Workload(
            requests=per_route,
            in_flight=args.in_flight,
            ctx_in_flight=2 * args.in_flight,
            min_tokens=args.min_tokens,
            max_tokens=args.max_tokens,
            tokens_per_block=int(local.geometry["tokens_per_block"]),
            seed=args.seed,
        )
        say(
            f"running {per_route} requests on each of {routes} routes "
            "(every context instance to every generation instance)"
        )
        before = {h.name: h.iface_bytes()[0] for h in net.hosts} if net else {}
        out = Round(hc, workload).start().finish(timeout_s=600.0)
        on_veths = sum(h.iface_bytes()[0] - before[h.name] for h in net.hosts) if net else 0
        left = wait_clean(hc.all_daemons(), timeout_s=30.0)
        codes = local.stop_all()
        summary: dict[str, Any] = {
            "cluster": f"{contexts}x{generations}",
            "hosts": "network namespaces" if net else "loopback",
            "instances": {"context": contexts, "generation": generations},
            "tensor_parallel": {"context": args.ctx_tp, "generation": args.gen_tp},
            "daemons": len(codes),
            "routes": routes,
            **out.to_json(),
            "bytes_on_veths": on_veths,
            "left_on_daemons": left,
            "daemon_exit_codes": codes,
        }
        ok = (
            not out.wrong
            and not out.lost
            and not out.engine_errors
            and out.requests == routes * per_route
            and not left
            and all(c == 0 for c in codes.values())
        )
    if ok and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(summary))
    else:
        _print(summary)
        if not ok:
            print(f"logs and configs kept in {workdir}", file=sys.stderr)
    return 0 if ok else 1


def _print(s: dict[str, Any]) -> None:
    inst, tp = s["instances"], s["tensor_parallel"]
    print(f"kvxferd demo --cluster {s['cluster']} summary ({s['hosts']})")
    print(
        f"  instances  {inst['context']} context (TP {tp['context']}), "
        f"{inst['generation']} generation (TP {tp['generation']}); {s['daemons']} daemons"
    )
    print(f"  routes     {s['routes']} (every context to every generation)")
    print(f"  requests   {s['requests']}")
    print(f"  verified   {s['verified']}  (every byte checked by the generation engines)")
    failed = sum(s["failed"].values())
    print(f"  failed     {failed}" + (f"  {s['failed']}" if failed else ""))
    print(f"  wrong      {s['wrong']}")
    print(f"  lost       {s['lost']}")
    print(
        f"  bytes      {s['bytes']:,}"
        + (f"  ({s['bytes_on_veths']:,} received on the veths)" if s["bytes_on_veths"] else "")
    )
    print(f"  seconds    {s['seconds']:.2f}")
    for key, label in (
        ("first_wrong", "wrong"),
        ("first_lost", "lost"),
        ("engine_errors", "engine"),
    ):
        for line in s[key]:
            print(f"  {label}: {line}")
    if s["left_on_daemons"]:
        print(f"  left on daemons: {s['left_on_daemons']}")
