"""Issue 18 at full scale: many requests over every route of a cluster of hosts, faults.

N context and M generation instances (generation tensor-parallel 2 by default), each on
its own host (a network namespace with its own IPC, PID and mount namespaces:
kvxferd.sim.hosts), found through etcd alone (etcd in the root namespace, started
after the daemons). Phases, each a round of --requests per route on every route, the
fault injected once a quarter of the round's receives were posted:

  baseline, partition ctx0<->gen0 (healed), 2 % packet loss on gen1, 80 Mbit/s on
  ctx1, ctx1 SIGKILLed and restarted under its name, etcd SIGKILLed and restarted.

Prints one JSON object: per phase and in total, requests, verified, failed by reason,
wrong, lost, bytes, bytes received on the veths, seconds. Exit status 1 if any request
was wrong or lost. Needs root. The tests (tests/cluster) run the same at a small size.

    sudo .venv/bin/python benchmarks/issue18_cluster.py --contexts 2 --generations 2 \\
        --requests 500
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvxferd.sim.cluster import LocalCluster, default_workdir
from kvxferd.sim.etcd_server import EtcdServer
from kvxferd.sim.hosts import faults
from kvxferd.sim.hosts.cluster import HostCluster, status, wait_clean
from kvxferd.sim.hosts.network import Network, namespace_problem
from kvxferd.sim.hosts.traffic import CLUSTER_GEOMETRY, Round, Workload

GEOMETRY = CLUSTER_GEOMETRY


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"not {what} after {timeout_s} s")
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, default=2)
    p.add_argument("--generations", type=int, default=2)
    p.add_argument("--ctx-tp", type=int, default=1)
    p.add_argument("--gen-tp", type=int, default=2)
    p.add_argument("--requests", type=int, default=500, help="per route and phase")
    p.add_argument("--no-etcd", action="store_true", help="static peers instead of etcd")
    args = p.parse_args()
    problem = namespace_problem()
    if problem is not None:
        print(f"issue18_cluster: {problem}", file=sys.stderr)
        return 2
    n, m = args.contexts, args.generations
    phases: dict[str, dict[str, Any]] = {}
    total: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    with Network(n + m) as net:
        workdir = default_workdir("kvxferd-issue18")
        etcd = None if args.no_etcd else EtcdServer(workdir, host=net.root_address)
        local = LocalCluster(
            workdir,
            geometry=dict(GEOMETRY),
            transceiver={"kv_transfer_timeout_ms": 10000},
            etcd=None
            if etcd is None
            else {"endpoints": [etcd.endpoint], "cluster": net.prefix, "lease_ttl_s": 15},
        )
        settings = {"heartbeat_interval_ms": 500, "heartbeat_timeout_ms": 5000}
        try:
            with HostCluster(local, net, daemon_settings=settings) as hc:
                hc.plan(n, args.ctx_tp, m, args.gen_tp)
                t0 = time.monotonic()
                hc.start()
                if etcd is not None:
                    etcd.start()
                    names = sorted(d.name for d in hc.all_daemons())
                    _wait(
                        lambda: all(
                            sorted(status(d)["discovery"]["member_names"]) == names
                            for d in hc.all_daemons()
                        ),
                        60,
                        "every daemon listed by etcd",
                    )
                started_s = time.monotonic() - t0
                ctx0, ctx1 = hc.contexts[0], hc.contexts[-1]
                gen0, gen1 = hc.generations[0], hc.generations[-1]
                assert ctx0.host and ctx1.host and gen0.host and gen1.host

                def partition(rnd: Round) -> None:
                    assert ctx0.host and gen0.host
                    faults.partition(ctx0.host, gen0.host)
                    _wait(
                        lambda: (
                            not any(
                                p["name"] == ctx0.daemons[0].name
                                for d in gen0.daemons
                                for p in status(d)["peers"]
                            )
                        ),
                        30,
                        "gen0 cut from ctx0",
                    )
                    faults.heal(ctx0.host)
                    faults.heal(gen0.host)

                def kill(rnd: Round) -> None:
                    ctx1.daemons[0].kill(signal.SIGKILL)
                    for r in rnd.routes:
                        if r.ctx is ctx1:
                            r.ctx_proc.wait(30)
                    hc.restart(ctx1, 0)

                def etcd_restart(rnd: Round) -> None:
                    assert etcd is not None
                    etcd.kill()
                    time.sleep(2)  # down for a while: daemons notice, requests go on
                    etcd.start()

                plan: list[tuple[str, Callable[[Round], None] | None]] = [
                    ("baseline", None),
                    ("partition_healed", partition),
                    ("loss_2pct", lambda rnd: faults.packet_loss(gen1.host, 2)),  # type: ignore[arg-type]
                    ("rate_80mbit", lambda rnd: faults.rate_limit(ctx1.host, 80)),  # type: ignore[arg-type]
                    ("sigkill_restart", kill),
                ]
                if etcd is not None:
                    plan.append(("etcd_restart", etcd_restart))
                for seed, (name, fault) in enumerate(plan, start=1):
                    before = {h.name: h.iface_bytes()[0] for h in net.hosts}
                    rnd = Round(hc, Workload(requests=args.requests, seed=seed)).start()
                    if fault is not None:
                        rnd.wait_announced(rnd.total // 4, 120)
                        fault(rnd)
                    out = rnd.finish(timeout_s=1800)
                    for host in net.hosts:
                        faults.heal(host)
                    left = wait_clean(hc.all_daemons(), 60)
                    veth = sum(h.iface_bytes()[0] - before[h.name] for h in net.hosts)
                    phases[name] = {**out.to_json(), "bytes_on_veths": veth, "left": left}
                    for key in ("requests", "verified", "bytes"):
                        total[key] += getattr(out, key)
                    total["wrong"] += len(out.wrong)
                    total["lost"] += len(out.lost)
                    total["bytes_on_veths"] += veth
                    failed.update(out.failed)
                    print(f"{name}: {json.dumps(phases[name])}", file=sys.stderr, flush=True)
        finally:
            if etcd is not None:
                etcd.kill()
    report = {
        "instances": {"context": n, "generation": m},
        "tensor_parallel": {"context": args.ctx_tp, "generation": args.gen_tp},
        "discovery": "static" if args.no_etcd else "etcd",
        "start_s": round(started_s, 2),
        "faults_injected": len(plan) - 1,
        "total": {**total, "failed": dict(failed)},
        "phases": phases,
    }
    print(json.dumps(report, indent=1))
    return 1 if total["wrong"] or total["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
