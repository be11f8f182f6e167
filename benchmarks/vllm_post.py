"""What the vLLM connector's `post` (vLLM's start_load_kv, run before each forward pass)
costs a step, against two real daemons (NIXL on loopback), without vLLM.

Each step plans `n` one-block receives on the decode worker and their `n` sends on the
prefill worker (kvxferd.integrations.vllm's Planner and Transfers, as
tests/integrations/test_vllm_transfers.py drives them), times each worker's `post`, then
collects on both until every transfer was reported. Reported per `n`: the median `post`
time of the decode and the prefill worker, and the median time from the decode post to the
last report of the step's transfers.

`--base DIR` (a checkout, e.g. `git worktree add DIR COMMIT`) runs the same measurement
with DIR's kvxferd in alternating passes, each tree in its own process:

    .venv/bin/python benchmarks/vllm_post.py --passes 3 [--per-step 1 8 32] [--base DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

GEOMETRY: dict[str, Any] = {
    "num_layers": 2,
    "num_kv_heads": 2,
    "head_dim": 64,
    "tokens_per_block": 16,
    "dtype": "float16",
    "layout": "block-major",
}
POOL_BLOCKS = 128
TIMEOUT_S = 30.0


def measure(per_step: list[int], steps: int) -> dict[str, Any]:
    """In this process, with whatever kvxferd is first on the path."""
    from kvxferd.client import Client
    from kvxferd.integrations.vllm.plan import Planner
    from kvxferd.integrations.vllm.transfers import Transfers
    from kvxferd.memory.layout import KvLayout
    from kvxferd.memory.memfd import MemfdRegion
    from kvxferd.sim.cluster import LocalCluster

    bs = GEOMETRY["tokens_per_block"]
    layout = KvLayout(
        num_layers=GEOMETRY["num_layers"],
        kv_factor=2,
        num_kv_heads=GEOMETRY["num_kv_heads"],
        head_dim=GEOMETRY["head_dim"],
        tokens_per_block=bs,
        dtype=GEOMETRY["dtype"],
        major=GEOMETRY["layout"],
        num_blocks=POOL_BLOCKS,
    )

    def worker(socket: str, name: str) -> tuple[Transfers, MemfdRegion]:
        region = MemfdRegion.create(layout.pool_bytes, f"vllm-post-{name}")
        client = Client(socket, engine=f"vllm-post-{name}")
        client.register_pool(f"{name}-kv", region, layout)
        return Transfers(lambda: client, f"{name}-kv", client=client), region

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(Path(tmp), geometry=GEOMETRY) as c:
        ctx = c.start_daemon("ctx", "context")
        gen = c.start_daemon("gen", "generation")
        d, d_region = worker(gen.api_socket, "decode")
        p, p_region = worker(ctx.api_socket, "prefill")
        serial = 0
        try:
            for n in per_step:
                d_post, p_post, total = [], [], []
                for step in range(steps + 2):  # the first two warm up
                    dec = Planner(bs, consumer=True, producer=False)
                    pre = Planner(bs, consumer=False, producer=True)
                    ids = []
                    for i in range(n):
                        serial += 1
                        tid, rid = f"t-{serial}", f"r-{serial}"
                        ids.append(rid)
                        where = {"transfer_id": tid, "peer": ctx.peer_address}
                        recv = {"do_remote_prefill": True, "kvxferd": where}
                        dec.matched_tokens(rid, recv, bs, 0)
                        dec.after_alloc(rid, recv, bs, [i], bs, "")
                        send = {"do_remote_decode": True, "kvxferd": {"transfer_id": tid}}
                        pre.finished(rid, send, True, bs, [POOL_BLOCKS - 1 - i])
                    recvs, sends = dec.take(0), pre.take(0)
                    t0 = time.perf_counter()
                    d.post(recvs)
                    t1 = time.perf_counter()
                    p.post(sends)
                    t2 = time.perf_counter()
                    got_d: set[str] = set()
                    got_p: set[str] = set()
                    finished = set(ids)
                    deadline = time.monotonic() + TIMEOUT_S
                    while len(got_d) < n or len(got_p) < n:
                        if time.monotonic() > deadline:
                            raise SystemExit(f"step of {n}: not all reported in {TIMEOUT_S} s")
                        r = d.collect(set(), idle=True)
                        if r.failed:
                            raise SystemExit(f"failed receives: {sorted(r.failed)}")
                        got_d |= r.recving
                        got_p |= p.collect(finished, idle=True).sending
                        finished = set()
                    t3 = time.perf_counter()
                    if step >= 2:
                        d_post.append((t1 - t0) * 1e3)
                        p_post.append((t2 - t1) * 1e3)
                        total.append((t3 - t0) * 1e3)
                out[str(n)] = {
                    "decode_post_ms": statistics.median(d_post),
                    "prefill_post_ms": statistics.median(p_post),
                    "step_to_reported_ms": statistics.median(total),
                }
        finally:
            d.close()
            p.close()
            d_region.close()
            p_region.close()
    return out


def run_tree(tree: Path, per_step: list[int], steps: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", "--steps", str(steps),
           "--per-step", *map(str, per_step)]  # fmt: skip
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: exit {done.returncode}\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--per-step", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--base", type=Path, help="another checkout, measured in the same passes")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if max(args.per_step) > POOL_BLOCKS // 2:
        ap.error(f"--per-step at most {POOL_BLOCKS // 2}")
    if args.measure:
        print(json.dumps(measure(args.per_step, args.steps)))
        return
    trees = [("this", REPO)] + ([("base", args.base.resolve())] if args.base else [])
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for k in range(args.passes):
        order = trees if k % 2 == 0 else trees[::-1]
        for name, tree in order:
            got = run_tree(tree, args.per_step, args.steps)
            for n, row in got.items():
                runs.setdefault((name, n), []).append(row)
                print(f"pass {k + 1} {name:5} {n:>3} a step: {json.dumps(row)}", file=sys.stderr)
    keys = ["decode_post_ms", "prefill_post_ms", "step_to_reported_ms"]
    print("| tree | transfers a step | passes | " + " | ".join(keys) + " |")
    print("|---|---|---|" + "---|" * len(keys))
    for (name, n), rows in sorted(runs.items(), key=lambda kv: (int(kv[0][1]), kv[0][0])):
        cells = []
        for key in keys:
            vals = [r[key] for r in rows]
            cells.append(f"{statistics.median(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})")
        print(f"| {name} | {n} | {len(rows)} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
