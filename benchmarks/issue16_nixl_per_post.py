"""What one NIXL write costs per post and per block (issue 16: would merging the small writes
of one loop turn into one post pay?).

Two processes on this host, each a kvxferd NixlBackend with a registered host buffer of
--blocks blocks of --block-kib KiB: the initiator posts writes of k random blocks (k in
--k, one descriptor each, from NIXL's prepared lists as the daemon's small writes are),
polls each to DONE and releases it, one at a time. The descriptor lists are built before
the timed loop, so what is timed is the backend's post, poll and release only. Reported
per k: microseconds of wall time and of the initiator's CPU per post and per block; the
least of --repeats runs.

    .venv/bin/python benchmarks/issue16_nixl_per_post.py [--k 1 2 4 8 16 32] [--posts 2000]
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys
import time
from typing import Any

import numpy as np

from kvxferd.backends.base import XferStatus
from kvxferd.backends.nixl import NixlBackend


def target(blocks: int, block: int) -> int:
    backend = NixlBackend("per-post-target")
    buf = np.zeros(blocks * block, dtype=np.uint8)
    backend.register(int(buf.ctypes.data), buf.nbytes)
    info = {"metadata": base64.b64encode(backend.metadata()).decode(), "base": buf.ctypes.data}
    print("INFO " + json.dumps(info), flush=True)
    sys.stdin.read()  # until the initiator closes our stdin
    return 0


def _lists(base: int, ids: np.ndarray, block: int) -> np.ndarray:
    return np.stack([base + ids * block, np.full(len(ids), block)], axis=1).astype(np.int64)


def initiator(args: argparse.Namespace) -> list[dict[str, Any]]:
    block = args.block_kib << 10
    child = subprocess.Popen(
        [sys.executable, __file__, "--target", "--blocks", str(args.blocks),
         "--block-kib", str(args.block_kib)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None and child.stdin is not None
    line = child.stdout.readline()
    while line and not line.startswith("INFO "):  # NIXL's own start-up lines
        line = child.stdout.readline()
    if not line:
        raise SystemExit("the target process ended before it said where its buffer is")
    info = json.loads(line[5:])
    backend = NixlBackend("per-post-initiator")
    src = np.ones(args.blocks * block, dtype=np.uint8)
    backend.register(int(src.ctypes.data), src.nbytes)
    peer = backend.add_peer(base64.b64decode(info["metadata"]))
    backend.connect(peer)
    regions = ((int(info["base"]), args.blocks * block),)
    rng = np.random.default_rng(0)
    rows = []
    try:
        for k in args.k:
            posts = max(1, args.posts // k)
            pairs = []
            for _ in range(posts):
                ids = rng.choice(args.blocks, k, replace=False)
                pairs.append(
                    (
                        _lists(int(src.ctypes.data), ids, block),
                        _lists(int(info["base"]), ids, block),
                    )
                )
            best: tuple[float, float] | None = None
            for _ in range(args.repeats):
                wall, cpu = time.perf_counter(), time.process_time()
                for local, remote in pairs:
                    handle, status = backend.post_write(local, remote, peer, remote_regions=regions)
                    while status is XferStatus.IN_PROGRESS:
                        status = backend.poll(handle)
                    if status is not XferStatus.DONE:
                        raise SystemExit(f"a write of {k} blocks ended {status.name}")
                    backend.release(handle)
                run = ((time.perf_counter() - wall) / posts, (time.process_time() - cpu) / posts)
                best = run if best is None or run[0] < best[0] else best
            assert best is not None
            rows.append({
                "k": k, "posts": posts,
                "wall_us_per_post": best[0] * 1e6, "cpu_us_per_post": best[1] * 1e6,
                "wall_us_per_block": best[0] * 1e6 / k, "cpu_us_per_block": best[1] * 1e6 / k,
            })  # fmt: skip
        rows.append({"prepared_writes": backend.prepared_writes})
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-kib", type=int, default=32)
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--posts", type=int, default=2000, help="blocks written per k and run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.target:
        return target(args.blocks, args.block_kib << 10)
    rows = initiator(args)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"| blocks per post ({args.block_kib} KiB each) | us per post (wall) | us per block "
          "(wall) | CPU us per block |")  # fmt: skip
    print("|---|---|---|---|")
    for r in rows[:-1]:
        print(f"| {r['k']} | {r['wall_us_per_post']:.1f} | {r['wall_us_per_block']:.1f} | "
              f"{r['cpu_us_per_block']:.1f} |")  # fmt: skip
    print(f"(posts from prepared descriptor lists: {rows[-1]['prepared_writes']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
