"""Summarise benchmarks/gpu_ab.sh: per configuration and tree, the median GB/s, p50 and
ratio to the bench's bare NIXL pair over the passes, and this tree over base.

Usage: python benchmarks/gpu_ab_summary.py DIR
"""

from __future__ import annotations

import collections
import json
import statistics
import sys
from pathlib import Path


def main() -> None:
    folder = Path(sys.argv[1])
    runs: dict[tuple[str, str], list[dict[str, float]]] = collections.defaultdict(list)
    for path in sorted(folder.glob("*-*.json")):
        tree = path.stem.rsplit("-", 1)[0]
        try:
            report = json.loads(path.read_text())
        except json.JSONDecodeError:
            print(f"{path.name}: no report (see {path.stem}.err)")
            continue
        for r in report.get("results", []):
            runs[(r["config"], tree)].append(r)
    print(f"{'config':22s} {'tree':5s} {'runs':>4s} {'GB/s':>8s} {'p50 ms':>8s} {'/raw':>6s}")
    for config in sorted({c for c, _ in runs}):
        gbps = {}
        for tree in ("base", "this"):
            rs = runs.get((config, tree), [])
            if not rs:
                continue
            gbps[tree] = statistics.median(r["gbps"] for r in rs)
            p50 = statistics.median(r["p50_ms"] for r in rs)
            ratio = statistics.median(r["ratio_to_raw"] for r in rs)
            spread = ", ".join(f"{r['gbps']:.0f}" for r in rs)
            print(
                f"{config:22s} {tree:5s} {len(rs):4d} {gbps[tree]:8.1f} {p50:8.2f} "
                f"{ratio:6.3f}  ({spread})"
            )
        if len(gbps) == 2:
            print(f"{config:22s} this/base {gbps['this'] / gbps['base']:.2f}x")


if __name__ == "__main__":
    main()
