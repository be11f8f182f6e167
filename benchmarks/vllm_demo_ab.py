"""`make demo-vllm`'s run (kvxferd.integrations.vllm.demo) for this checkout and another, in
alternating passes, with every request's TTFT and KV transfer time pooled per tree.

The demo's own p50s swing 2-3x from run to run on a 2-core host (two vLLM servers, two
daemons, the proxy and the client share it), so one run per tree says nothing about a
change of a few tenths of a millisecond per transfer; the pooled medians of several runs,
beside the single instance's TTFT measured in the same runs, say what they can.

    .venv/bin/python benchmarks/vllm_demo_ab.py --base DIR [--passes 4] [--requests 48]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def run(tree: Path, requests: int) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree), KVXFERD_VLLM_PYTHON=str(VLLM_PYTHON))
    cmd = [sys.executable, "-m", "kvxferd.integrations.vllm.demo", "--requests", str(requests),
           "--json"]  # fmt: skip
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: exit {done.returncode}\n{done.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="another checkout")
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--requests", type=int, default=48)
    args = ap.parse_args()
    trees = [("this", REPO), ("base", args.base.resolve())]
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    for k in range(args.passes):
        for name, tree in trees if k % 2 == 0 else trees[::-1]:
            got = run(tree, args.requests)
            if got["identical"] != got["requests"]:
                raise SystemExit(f"{name}: {got['identical']}/{got['requests']} identical")
            rows[name] += got["rows"]
            print(f"pass {k + 1} {name}: TTFT p50 {got['ttft_ms']['p50']} ms, transfer p50 "
                  f"{got['transfer_ms']['p50']} ms, single instance TTFT p50 "
                  f"{got['single_instance_ttft_ms']['p50']} ms", file=sys.stderr)  # fmt: skip
    print("| tree | requests | TTFT p50 / p90 ms | single instance TTFT p50 ms | "
          "TTFT p50 / single | transfer p50 / p90 ms |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, got in rows.items():
        ttft = [r["ttft_ms"] for r in got]
        single = [r["single_ttft_ms"] for r in got]
        xfer = [r["transfer_ms"] for r in got]
        print(f"| {name} | {len(got)} | {statistics.median(ttft):.1f} / {quantile(ttft, 0.9):.1f} "
              f"| {statistics.median(single):.1f} | "
              f"{statistics.median(ttft) / statistics.median(single):.2f} | "
              f"{statistics.median(xfer):.1f} / {quantile(xfer, 0.9):.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
