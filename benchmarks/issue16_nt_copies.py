"""Issue 16: what glibc's non-temporal threshold does to the staging copies, without kvxferd.

The copies are the ones HostCopier (kvxferd/transceiver/bounce.py) makes: a gather is one
`np.take(..., mode="clip")` of whole units out of a 1000 MiB pool into a 16 MiB round of a
64 MiB ring, a scatter the `np.put` back; units of 4 MiB (block-major blocks of the
`kvxferd bench` geometry) and 32 KiB (one (layer, K/V) piece of a layer-major block). Each
setting runs in a child process of its own, because glibc reads GLIBC_TUNABLES only when a
process starts: glibc's own threshold, and the 1 MiB that `kvxferd run` sets
(kvxferd/service/copy_tuning.py). Prints each copy's CPU seconds per GB (best of 2), alone
and with a gather and a scatter at once on two threads, the settings alternating pass by
pass.

    .venv/bin/python benchmarks/issue16_nt_copies.py [--passes 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np

POOL = 1000 << 20
RING = 64 << 20
ROUND = 16 << 20
SETTINGS = {"glibc's own": None, "1 MiB (kvxferd run)": "0x100000"}


def rounds(pool: np.ndarray, ring: np.ndarray, per_round: int, slots: int, gather: bool) -> None:
    """Every round of `pool` through `ring` (units of the same void dtype): gathered into
    the ring's slots in turn (np.take), or scattered back out of them (np.put)."""
    for i, first in enumerate(range(0, len(pool) - per_round + 1, per_round)):
        slot = (i % slots) * per_round
        index = np.arange(first, first + per_round)
        part = ring[slot : slot + per_round]
        if gather:
            np.take(pool, index, out=part, mode="clip")
        else:
            np.put(pool, index, part, mode="clip")


def measure() -> dict[str, float]:
    """CPU s/GB of a gather and of a scatter through the ring, per unit size."""
    pool_bytes = np.ones(POOL, np.uint8)  # touched: no page faults in the timed copies
    ring_bytes = np.ones(RING, np.uint8)
    out: dict[str, float] = {}
    for unit in (4 << 20, 32 << 10):
        pool, ring = pool_bytes.view(f"V{unit}"), ring_bytes.view(f"V{unit}")
        per_round, slots = ROUND // unit, RING // ROUND
        for what in ("gather", "scatter"):
            best = float("inf")
            for _ in range(2):
                cpu = time.process_time()
                rounds(pool, ring, per_round, slots, gather=what == "gather")
                best = min(best, (time.process_time() - cpu) / (POOL / 1e9))
            out[f"{what} {unit >> 10} KiB"] = best
    out["together 4096 KiB"] = together(pool_bytes, ring_bytes, 4 << 20)
    return out


def together(pool_bytes: np.ndarray, ring_bytes: np.ndarray, unit: int) -> float:
    """CPU s/GB when a gather and a scatter run at once on two threads, as the context
    daemon's gather and the generation daemon's scatter do in a staged pipeline (each over
    a pool and a ring of its own); the GIL is released inside each copy."""
    half = POOL // 2
    pools = [pool_bytes[:half].view(f"V{unit}"), pool_bytes[half:].view(f"V{unit}")]
    rings = [ring_bytes[: RING // 2].view(f"V{unit}"), ring_bytes[RING // 2 :].view(f"V{unit}")]
    per_round, slots = ROUND // unit, (RING // 2) // ROUND

    def run(k: int) -> None:
        rounds(pools[k], rings[k], per_round, slots, gather=k == 0)

    best = float("inf")
    for _ in range(2):
        cpu = time.process_time()
        threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        best = min(best, (time.process_time() - cpu) / (POOL / 1e9))
    return best


def main() -> None:
    if "--child" in sys.argv:
        print(json.dumps(measure()))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=3)
    args = p.parse_args()
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    for n in range(args.passes):
        order = list(SETTINGS.items())
        for name, value in order if n % 2 == 0 else order[::-1]:
            env = dict(os.environ)
            env.pop("GLIBC_TUNABLES", None)
            if value is not None:
                env["GLIBC_TUNABLES"] = f"glibc.cpu.x86_non_temporal_threshold={value}"
            child = subprocess.run(
                [sys.executable, __file__, "--child"],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            got = json.loads(child.stdout)
            rows[name].append(got)
            print(f"pass {n + 1} {name:22s} " + "  ".join(f"{k} {v:.3f}" for k, v in got.items()))
    print("\nmedian CPU s/GB:")
    for name, got in rows.items():
        keys = got[0].keys()
        medians = "  ".join(f"{k} {np.median([g[k] for g in got]):.3f}" for k in keys)
        print(f"  {name:22s} {medians}")


if __name__ == "__main__":
    main()
