"""Issue 16, "no regression": the large-request PYTHON path, medium shuffled requests and
the bounce buffer, in this checkout and another one, in the same passes.

Each pass runs, for every tree (this one, and `--base DIR`), three `kvxferd bench` runs,
the order of the trees alternating between passes:

* `--configs nixl-python --tokens 8000 --requests 10 --in-flight 1`: large block-major
  requests (the target: about 1.0x the raw NIXL pair, on the same memory);
* `--configs nixl-python --tokens 1024 --requests 200 --in-flight 4`: medium requests
  whose 32 blocks are shuffled (each a write of its own);
* `--layout layer-major --segment-bytes 4096 --configs nixl-python,nixl-python-bounce
  --tokens 8000 --requests 10 --in-flight 1`: the bounce buffer against the per-block path
  at 4 KiB segments (the target: about 2x).

Reported per (tree, run): medians and ranges over the passes of GB/s, the ratio to the raw
pair of the same run, and the bounce buffer's ratio to the per-block path.

    .venv/bin/python benchmarks/issue16_noregression.py --passes 2 --base DIR [--json]

`--base DIR`: e.g. `git worktree add DIR COMMIT` (the same .venv serves it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from checkouts import cell, in_pass, kvxferd_json, stat, trees

RUNS = {
    "large 8000": ["--configs", "nixl-python", "--tokens", "8000", "--requests", "10",
                   "--in-flight", "1"],
    "medium 1024": ["--configs", "nixl-python", "--tokens", "1024", "--requests", "200",
                    "--in-flight", "4"],
    "bounce 4 KiB": ["--layout", "layer-major", "--segment-bytes", "4096", "--configs",
                     "nixl-python,nixl-python-bounce", "--tokens", "8000", "--requests", "10",
                     "--in-flight", "1"],
}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--base", help="another checkout, measured in the same passes")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    measured = trees(args.base)
    # (tree, run, config) -> one result row per pass
    rows: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for k in range(args.passes):
        for name, tree in in_pass(measured, k):
            for run, run_args in RUNS.items():
                doc = kvxferd_json(["bench", *run_args, "--json", "--no-progress"], tree)
                for r in doc["results"]:
                    rows.setdefault((name, run, r["config"]), []).append(r)
                    print(
                        f"pass {k + 1} {name:4} {run:12} {r['config']:18} "
                        f"{r['gbps']:.2f} GB/s, vs raw {r['ratio_to_raw']:.2f}, "
                        f"bounce/per-block {r.get('bounce_vs_per_block')}, "
                        f"load {os.getloadavg()[0]:.1f}",
                        file=sys.stderr,
                    )
    summary = {
        f"{name} | {run} | {config}": {
            "runs": len(rs),
            "gbps": stat([r["gbps"] for r in rs]),
            "ratio_to_raw": stat([r["ratio_to_raw"] for r in rs]),
            "bounce_vs_per_block": stat(
                [r["bounce_vs_per_block"] for r in rs if r.get("bounce_vs_per_block")]
            ),
        }
        for (name, run, config), rs in sorted(rows.items())
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print("| tree | run | config | runs | GB/s | vs raw | bounce / per-block |")
    print("|---|---|---|---|---|---|---|")
    for key, s in summary.items():
        cells = [cell(s[f]) for f in ("gbps", "ratio_to_raw", "bounce_vs_per_block")]
        print(f"| {key} | {s['runs']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
