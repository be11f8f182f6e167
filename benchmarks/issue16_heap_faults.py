"""Issue 16: what glibc's heap trimming costs the reference engine's content check, with and
without kvxferd's malloc thresholds (kvxferd/service/heap_tuning.py).

Each pass runs, in a fresh interpreter per mode ("glibc": its own adaptive thresholds;
"kept": keep_freed_heap()), `verify_blocks` and `fill_blocks` of one 2048-token request at
the demo's geometry (8 layers, 4 KV heads of 64 fp16 dims, 32 tokens per block: 64 blocks
of 256 KiB), whole heads and a tensor-parallel rank's half, on consecutive blocks and on
blocks scattered over a 640-block pool (as a long-running engine's are), and reports GB/s
and the page faults of the process over the timed calls. The modes alternate between
passes.

    .venv/bin/python benchmarks/issue16_heap_faults.py [--passes 3] [--calls 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, random, resource, sys, time
import numpy as np
from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import KvLayout
from kvxferd.sim.content import fill_blocks, verify_blocks
if sys.argv[1] == "kept":
    from kvxferd.service.heap_tuning import keep_freed_heap
    keep_freed_heap()
calls = int(sys.argv[2])
out = []
for heads, tp in ((4, None), (2, TpRank(0, 2))):
    layout = KvLayout(8, 2, heads, 64, 32, "float16", "block-major", 640)
    pool = np.zeros(layout.pool_bytes, np.uint8)
    kw = {} if tp is None else {"tp": tp}
    for order in ("consecutive", "scattered"):
        ids = list(range(64)) if order == "consecutive" else random.Random(1).sample(range(640), 64)
        fill_blocks(pool, layout, ids, 123, **kw)
        assert verify_blocks(pool, layout, ids, 123, 2048, **kw).ok
        row = {"heads": heads, "blocks": order}
        for name, call in (
            ("verify", lambda: verify_blocks(pool, layout, ids, 123, 2048, **kw)),
            ("fill", lambda: fill_blocks(pool, layout, ids, 123, **kw)),
        ):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            for _ in range(calls):
                call()
            dt = (time.perf_counter() - t) / calls
            row[name + "_gbps"] = 64 * layout.block_bytes / dt / 1e9
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            row[name + "_faults"] = faults / calls
        out.append(row)
print(json.dumps(out))
"""

MODES = ("glibc", "kept")


def child(mode: str, calls: int) -> list[dict[str, float | str | int]]:
    # The operator's malloc settings would decide both modes: run without them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    got = subprocess.run(
        [sys.executable, "-c", _CHILD, mode, str(calls)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    rows: list[dict[str, float | str | int]] = json.loads(got.stdout)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    runs: dict[tuple[str, int, str], list[dict[str, float | str | int]]] = {}
    for k in range(args.passes):
        for mode in MODES if k % 2 == 0 else MODES[::-1]:
            for row in child(mode, args.calls):
                runs.setdefault((mode, int(row["heads"]), str(row["blocks"])), []).append(row)
        print(f"pass {k + 1} done", file=sys.stderr)
    print("| malloc | heads | blocks | verify GB/s | faults/verify | fill GB/s | faults/fill |")
    print("|---|---|---|---|---|---|---|")
    for (mode, heads, blocks), rows in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][2])):

        def med(key: str, rows: list[dict[str, float | str | int]] = rows) -> float:
            return statistics.median(float(r[key]) for r in rows)

        print(
            f"| {mode} | {heads} | {blocks} | {med('verify_gbps'):.2f} | "
            f"{med('verify_faults'):.0f} | {med('fill_gbps'):.2f} | {med('fill_faults'):.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
