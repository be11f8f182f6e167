"""Issue 13, measured: the redesign against the commit before it, side by side.

Each pass runs the same `kvxferd bench` measurements with the old tree and with the new
one, alternating which goes first: small one-block requests (`--small`, 32 KiB blocks,
32 in flight: where per-request code costs show) and 8000-token requests (GB/s), each
for the PYTHON runtime over NIXL (`nixl-python`) and the staged runtime (`nixl-cpp`).
Each measurement is taken as its ratio to raw NIXL measured in the same bench run (the
host is shared and noisy: raw NIXL itself moves by 1.5x between runs), and the
comparison is new/old of those ratios within a pass; the median over passes is reported.
Every bench runs from a neutral directory (the temp dir), so each Python imports its own
tree (a bench started from this checkout would import it, whatever the Python); the
script prints which tree each Python imports.

The old tree needs a Python that imports it instead of this checkout: e.g.

    git worktree add /tmp/old 987bd65
    .venv/bin/python -m venv --without-pip /tmp/oldvenv
    printf '/tmp/old\\n%s\\n' "$PWD/.venv/lib/python3.11/site-packages" \\
        > /tmp/oldvenv/lib/python3.11/site-packages/zz_old.pth
    .venv/bin/python benchmarks/issue13_compare.py --old-python /tmp/oldvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from typing import Any

CONFIGS = "nixl-python,nixl-cpp"
SMALL = ("--small", "--layers", "8", "--kv-heads", "2", "--head-dim", "32",
         "--tokens-per-block", "16", "--in-flight", "32")  # fmt: skip
LARGE = ("--tokens", "8000", "--requests", "5", "--warmup", "1")
_NEUTRAL = tempfile.gettempdir()


def bench(python: str, args: tuple[str, ...], seconds: float) -> dict[str, float]:
    cmd = [python, "-m", "kvxferd.cli", "bench", *args, "--configs", CONFIGS,
           "--json", "--no-progress"]  # fmt: skip
    if "--small" in args:
        cmd += ["--seconds", str(seconds)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=1200, check=False, cwd=_NEUTRAL
    )
    if done.returncode != 0:
        raise SystemExit(f"{python}: bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
    report: dict[str, Any] = json.loads(done.stdout)
    return {r["config"]: float(r["ratio_to_raw"]) for r in report["results"]}


def tree_of(python: str) -> str:
    done = subprocess.run(
        [python, "-c", "import kvxferd; print(kvxferd.__file__)"],
        capture_output=True, text=True, check=True, cwd=_NEUTRAL,
    )  # fmt: skip
    return done.stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-python", required=True, help="a Python that imports the old tree")
    ap.add_argument("--new-python", default=sys.executable)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0, help="--small: seconds each")
    args = ap.parse_args()
    old_tree, new_tree = tree_of(args.old_python), tree_of(args.new_python)
    print(f"old: {old_tree}\nnew: {new_tree}")
    if old_tree == new_tree:
        raise SystemExit("both Pythons import the same tree; see the usage above")
    ratios: dict[str, list[float]] = {}
    for i in range(args.passes):
        order = ("old", "new") if i % 2 == 0 else ("new", "old")
        for what, bench_args in (("small req/s", SMALL), ("8000-token GB/s", LARGE)):
            got = {
                side: bench(args.old_python if side == "old" else args.new_python,
                            bench_args, args.seconds)
                for side in order
            }  # fmt: skip
            for config in got["new"]:
                r = got["new"][config] / got["old"][config]
                ratios.setdefault(f"{config} {what}", []).append(r)
                print(
                    f"pass {i + 1} ({order[0]} first) {config:12} {what:16} "
                    f"vs raw: old {got['old'][config]:.3f}  new {got['new'][config]:.3f}  "
                    f"new/old {r:.3f}",
                    flush=True,
                )
    print("median new/old over passes:")
    for name, values in ratios.items():
        print(
            f"  {name:32} {statistics.median(values):.3f} "
            f"(range {min(values):.3f}-{max(values):.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
