"""Issue 14, measured: what mutual TLS on the peer control channel costs small requests.

Small one-block requests are where the control channel dominates (each request is a
RequestData, a Result and the engine calls around them, and a one-block NIXL write), so
that is where TLS costs most. Each pass runs `kvxferd bench --small` with the plain
PYTHON runtime over NIXL (`nixl-python`) and the same with mutual TLS
(`nixl-python-tls`), in one run beside raw NIXL; passes alternate which goes first. The
machine is shared and noisy, so what counts is the ratio within a pass, reported as the
median over passes.

Usage: .venv/bin/python benchmarks/issue14_tls.py [--passes 3] [--seconds 8] [--in-flight 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any

CONFIGS = ("nixl-python", "nixl-python-tls")
# 32 KiB blocks: 8 layers x K,V x 16 tokens x 2 heads x 32 dims x fp16 (issue 16's size).
GEOMETRY = ("--layers", "8", "--kv-heads", "2", "--head-dim", "32", "--tokens-per-block", "16")


def one_pass(order: tuple[str, ...], seconds: float, in_flight: int) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "kvxferd.cli", "bench", "--small", *GEOMETRY,
        "--in-flight", str(in_flight), "--seconds", str(seconds),
        "--configs", ",".join(order), "--json", "--no-progress",
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(done.stdout)
    return {r["config"]: r for r in report["results"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--in-flight", type=int, default=32)
    ap.add_argument("--json", action="store_true", help="print the passes as JSON")
    args = ap.parse_args()
    rows = []
    for i in range(args.passes):
        order = CONFIGS if i % 2 == 0 else CONFIGS[::-1]
        by = one_pass(order, args.seconds, args.in_flight)
        plain, tls = by["nixl-python"], by["nixl-python-tls"]
        row = {
            "pass": i + 1,
            "first": order[0],
            "plain_rps": plain["requests_per_s"],
            "tls_rps": tls["requests_per_s"],
            "plain_p50_ms": plain["p50_ms"],
            "tls_p50_ms": tls["p50_ms"],
            "raw_rps": plain["raw_requests_per_s"],
            "tls_to_plain": round(tls["requests_per_s"] / plain["requests_per_s"], 3),
        }
        rows.append(row)
        print(
            f"pass {row['pass']} ({row['first']} first): plain {row['plain_rps']:.0f} req/s "
            f"p50 {row['plain_p50_ms']:.2f} ms, TLS {row['tls_rps']:.0f} req/s p50 "
            f"{row['tls_p50_ms']:.2f} ms, TLS/plain {row['tls_to_plain']:.3f} "
            f"(raw NIXL {row['raw_rps']:.0f} req/s)",
            flush=True,
        )
    ratios = [r["tls_to_plain"] for r in rows]
    print(
        f"median TLS/plain requests/s over {len(rows)} passes: {statistics.median(ratios):.3f} "
        f"(range {min(ratios):.3f}-{max(ratios):.3f}), {args.in_flight} in flight, 32 KiB blocks"
    )
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
