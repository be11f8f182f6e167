"""Summarise benchmarks/issue16_hugepages.sh's runs: one line per run, then per set and page
kind the median and range of GB/s, raw GB/s and the ratio to raw.

A run is NAME.json, NAME = SET-KIND with SET the pass (p1, p2, ...: `--huge-pages reserve`
right before the run; pre1, ...: hugetlb pages reserved ahead of the whole set) and KIND 4k,
hugetlb or thp. A run that failed has only NAME.err: its last error line is shown.

Usage: python benchmarks/issue16_summary.py DIR
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

KINDS = ("4k", "hugetlb", "thp")


def main(directory: str) -> None:
    rows: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    print(
        f"{'run':<15}{'GB/s':>7}{'raw GB/s':>10}{'vs raw':>8}{'p50 ms':>8}{'raw p50':>9}{'load':>7}"
    )
    runs = sorted(Path(directory).glob("*.err"), key=lambda p: p.stat().st_mtime)
    for err in runs:
        name = err.stem
        m = re.fullmatch(r"(p|pre)(\d+)-(4k|hugetlb|thp)", name)
        if not m:
            continue
        try:
            doc = json.loads(err.with_suffix(".json").read_text())
            r = doc["results"][0]
        except (OSError, ValueError, KeyError, IndexError):
            text = err.read_text().splitlines()
            lines = [x for x in text if "Error" in x or "error" in x] or text or ["?"]
            print(f"{name:<15}failed: {lines[-1][:150]}")
            continue
        set_name = "p (reserve right before)" if m.group(1) == "p" else "pre (reserved ahead)"
        rows.setdefault((set_name, m.group(3)), []).append(
            (r["gbps"], r["raw_gbps"], r["ratio_to_raw"])
        )
        print(
            f"{name:<15}{r['gbps']:>7.2f}{r['raw_gbps']:>10.2f}{r['ratio_to_raw']:>8.2f}"
            f"{r['p50_ms']:>8.0f}{r['raw_p50_ms']:>9.0f}{doc['host']['loadavg_start'][0]:>7.2f}"
        )
    print()
    print(f"{'set':<26}{'pages':<9}{'runs':>5}{'GB/s':>20}{'raw GB/s':>20}{'vs raw':>20}")
    for (set_name, kind), vals in sorted(
        rows.items(), key=lambda kv: (kv[0][0], KINDS.index(kv[0][1]))
    ):

        def col(i: int, vals: list[tuple[float, float, float]] = vals) -> str:
            v = [x[i] for x in vals]
            return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"

        print(f"{set_name:<26}{kind:<9}{len(vals):>5}{col(0):>20}{col(1):>20}{col(2):>20}")


if __name__ == "__main__":
    main(sys.argv[1])
