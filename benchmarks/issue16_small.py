"""Issue 16, small requests: `kvxferd bench --small` (one 32 KiB block per request) at
several numbers of requests in flight, against the bare NIXL request rate of the same run,
and optionally against another checkout in the same passes.

Each pass runs, for every in-flight count and every tree (this one, and `--base DIR` if
given), one `kvxferd bench --configs nixl-python --small --layers 2 --kv-heads 2
--head-dim 64 --in-flight N --seconds S --json`; the order of the trees alternates between
passes so that both see the same moments of a noisy host. Reported per (tree, in flight):
medians and ranges over the passes of the request rate, the bare pair's rate, their ratio
(the issue's target: 0.5 at 32 in flight), p50 minus the bare p50 (the target: 0.3 ms at 1
in flight), the daemons' and the engines' CPU milliseconds per request, and the cores the
four processes kept busy (a run near the host's core count is bound by CPU; one well
below it by its processes waiting on each other).

    .venv/bin/python benchmarks/issue16_small.py --passes 4 [--in-flight 1 8 32]
        [--seconds 8] [--base DIR] [--verify each slot] [--json]

`--verify each slot`: this tree's engines with either content discipline in the same passes
(kvxferd bench --verify: each request filled and checked, or each slot once per group as the
raw pair does).

`--base DIR`: e.g. `git worktree add DIR COMMIT` (the same .venv serves it: the bench runs
with DIR as its working directory and on PYTHONPATH). A checkout from before the bench
reported the engines' CPU shows "-" there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from checkouts import cell, in_pass, kvxferd_json, stat

GEOMETRY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64"]  # 32 KiB blocks
FIELDS = {
    "requests_per_s": "req/s",
    "bare_requests_per_s": "bare req/s",
    "ratio_to_bare_rate": "vs bare",
    "p50_minus_bare_ms": "p50 - bare ms",
    "cpu_ms_per_request": "daemons ms/req",
    "engines_cpu_ms_per_request": "engines ms/req",
    "cores_busy": "cores busy",
}


def bench(tree: str | None, in_flight: int, seconds: float, verify: str | None) -> dict[str, Any]:
    args = ["bench", "--configs", "nixl-python", "--small", *GEOMETRY, "--in-flight",
            str(in_flight), "--seconds", str(seconds), "--json", "--no-progress"]  # fmt: skip
    if verify is not None:  # a checkout from before --verify knows only "each", unnamed
        args += ["--verify", verify]
    row: dict[str, Any] = kvxferd_json(args, tree, timeout=600)["results"][0]
    row["load"] = os.getloadavg()[0]
    return row


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": len(rows)}
    for key in FIELDS:
        out[key] = stat([r[key] for r in rows if r.get(key) is not None])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--in-flight", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--base", help="another checkout, measured in the same passes")
    p.add_argument(
        "--base-name", default="base", help="the base's name in the table (default: base)"
    )
    p.add_argument(
        "--verify",
        nargs="+",
        choices=["each", "slot"],
        help="the engines' content discipline(s) of this tree (kvxferd bench --verify); several "
        "are measured in the same passes, as trees of their own (the base runs its default)",
    )
    p.add_argument(
        "--base-verify",
        choices=["each", "slot"],
        help="the base's content discipline (default: its own default; a checkout from "
        "before kvxferd bench --verify knows only each)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    trees: list[tuple[str, str | None, str | None]] = (
        [(f"this/{v}", None, v) for v in args.verify] if args.verify else [("this", None, None)]
    )
    if args.base:
        trees.append((args.base_name, os.path.abspath(args.base), args.base_verify))
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for k in range(args.passes):
        order = in_pass(trees, k)
        for n in args.in_flight:
            for name, tree, verify in order:
                row = bench(tree, n, args.seconds, verify)
                runs.setdefault((name, n), []).append(row)
                print(
                    f"pass {k + 1} {name:9} in flight {n:3}: {row['requests_per_s']:.0f} req/s, "
                    f"bare {row['bare_requests_per_s']:.0f}, load {row['load']:.1f}",
                    file=sys.stderr,
                )
    summary = {f"{name} {n}": summarise(rows) for (name, n), rows in sorted(runs.items())}
    if args.json:
        print(json.dumps({"summary": summary, "runs": {f"{a} {b}": r for (a, b), r in
                                                       runs.items()}}, indent=1))  # fmt: skip
        return 0
    header = ["tree", "in flight", "runs", *FIELDS.values()]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for (name, n), rows in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        s = summarise(rows)
        print(f"| {name} | {n} | {s['runs']} | " + " | ".join(cell(s[k]) for k in FIELDS) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
