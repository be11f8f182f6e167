"""Issue 16, staged MPI: does the GIL hand-off between the event loop and MPI's progress
thread bound it? An experiment, not a setting: the daemons of `kvxferd bench --configs
mpi-cpp --tokens 8000` run with CPython's switch interval (how long a thread that wants the
GIL waits before it asks the holder to drop it; 5 ms by default) at each value given,
passes alternating between the values. If the progress thread's spinning made the event
loop and the copy threads wait for the GIL, a shorter interval would move more.

The interval is set in every process of the run through a `sitecustomize` module put first
on PYTHONPATH (the daemons and engines are this interpreter's children); "default" leaves
it alone.

    .venv/bin/python benchmarks/issue16_mpi_switch.py --passes 3 [--values default,0.0005,0.00005]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from checkouts import kvxferd_json

SITE = """import os, sys
_v = os.environ.get("KVX_BENCH_SWITCH_INTERVAL")
if _v:
    sys.setswitchinterval(float(_v))
"""


def one_run(value: str, requests: int, site_dir: str) -> dict[str, float]:
    env = {"PYTHONPATH": os.pathsep.join(p for p in (site_dir, os.environ.get("PYTHONPATH")) if p)}
    if value != "default":
        env["KVX_BENCH_SWITCH_INTERVAL"] = value
    args = ["bench", "--configs", "mpi-cpp", "--tokens", "8000", "--requests", str(requests),
            "--json", "--no-progress"]  # fmt: skip
    row = kvxferd_json(args, env=env, timeout=1800)["results"][0]
    return {k: float(row[k]) for k in ("gbps", "bare_gbps", "ratio_to_bare", "cpu_s_per_gb")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--values", default="default,0.0005,0.00005")
    args = ap.parse_args()
    values = args.values.split(",")
    rows: dict[str, list[dict[str, float]]] = {v: [] for v in values}
    with tempfile.TemporaryDirectory() as site_dir:
        Path(site_dir, "sitecustomize.py").write_text(SITE)
        for p in range(args.passes):
            order = values if p % 2 == 0 else list(reversed(values))
            for v in order:
                r = one_run(v, args.requests, site_dir)
                rows[v].append(r)
                print(f"pass {p + 1} switch={v}: " + json.dumps(r), flush=True)
    print("\nswitch interval | GB/s median (range) | vs bare MPI median | daemons CPU s/GB")
    for v, rs in rows.items():
        g = [r["gbps"] for r in rs]
        print(
            f"{v} | {statistics.median(g):.2f} ({min(g):.2f}-{max(g):.2f}) | "
            f"{statistics.median(r['ratio_to_bare'] for r in rs):.2f} | "
            f"{statistics.median(r['cpu_s_per_gb'] for r in rs):.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
