"""Issue 16, the staged runtime: every backend against its own bare transport, and staged
NIXL against the PYTHON runtime, optionally beside another checkout in the same passes.

Each pass runs, for every tree (this one, and `--base DIR` if given; the order alternates
between passes), one `kvxferd bench --configs nixl-python,nixl-cpp,ucx-cpp,mpi-cpp,mooncake-cpp
--tokens 8000 --requests R --json` (every byte verified; each configuration's bare transport
measured in the same run right before it). Reported per (tree, configuration): medians and
ranges over the passes of GB/s, the ratio to its own bare transport (the issue's target:
0.8), the ratio to nixl-python's GB/s in the same run (the issue's target for nixl-cpp:
0.9), and both daemons' CPU seconds per GB moved.

    .venv/bin/python benchmarks/issue16_staged.py --passes 3 [--requests 3]
        [--configs nixl-python,nixl-cpp,...] [--base DIR] [--tokens-per-block N]
        [--layout layer-major] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any

from checkouts import in_pass, kvxferd_json, trees

CONFIGS = "nixl-python,nixl-cpp,ucx-cpp,mpi-cpp,mooncake-cpp"
FIELDS = {
    "gbps": "GB/s",
    "bare_gbps": "bare GB/s",
    "ratio_to_bare": "vs bare",
    "vs_python": "vs nixl-python",
    "cpu_s_per_gb": "daemons CPU s/GB",
}


def bench(
    tree: str | None,
    configs: str,
    requests: int,
    tokens_per_block: int | None = None,
    layout: str | None = None,
) -> list[dict[str, Any]]:
    args = ["bench", "--configs", configs, "--tokens", "8000", "--requests", str(requests),
            "--json", "--no-progress"]  # fmt: skip
    if tokens_per_block is not None:
        args += ["--tokens-per-block", str(tokens_per_block)]
    if layout is not None:
        args += ["--layout", layout]
    rows: list[dict[str, Any]] = kvxferd_json(args, tree, timeout=1800)["results"]
    python = next((r["gbps"] for r in rows if r["config"] == "nixl-python"), None)
    for r in rows:
        r["vs_python"] = r["gbps"] / python if python else None
        r["load"] = os.getloadavg()[0]
    return rows


def cell(values: list[float]) -> str:
    if not values:
        return "-"
    m = statistics.median(values)
    return f"{m:.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--configs", default=CONFIGS)
    p.add_argument("--base", help="another checkout, measured in the same passes")
    p.add_argument(
        "--tokens-per-block",
        type=int,
        help="kvxferd bench's block size in tokens (its default: 32, 4 MiB blocks)",
    )
    p.add_argument("--layout", choices=["block-major", "layer-major"], help="kvxferd bench's")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    measured = trees(args.base)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for k in range(args.passes):
        for name, tree in in_pass(measured, k):
            for row in bench(tree, args.configs, args.requests, args.tokens_per_block, args.layout):
                runs.setdefault((name, row["config"]), []).append(row)
                print(
                    f"pass {k + 1} {name:4} {row['config']:13}: {row['gbps']:.2f} GB/s, "
                    f"bare {row['bare_gbps']:.2f}, load {row['load']:.1f}",
                    file=sys.stderr,
                )
    if args.json:
        out = {f"{a} {b}": rows for (a, b), rows in runs.items()}
        print(json.dumps(out, indent=1))
        return 0
    header = ["config", "tree", "runs", *FIELDS.values()]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    order = args.configs.split(",")
    for (name, config), rows in sorted(runs.items(), key=lambda kv: (order.index(kv[0][1]),
                                                                     kv[0][0])):  # fmt: skip
        cells = [cell([r[k] for r in rows if r.get(k) is not None]) for k in FIELDS]
        print(f"| {config} | {name} | {len(rows)} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
