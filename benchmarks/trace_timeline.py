"""Per-request timeline from benchmarks/trace_hooks (KVXFERD_TRACE_DIR): for every traced
function of every process, the median offset of its first begin and its first end after
the context engine's `send`, across the requests of a one-in-flight bench.

Usage: python benchmarks/trace_timeline.py DIR [--skip N]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import itertools
import statistics
from pathlib import Path


def _role(argv: str) -> str:
    if "kvxferd.bench.engine" in argv:
        return "ctx-engine" if "--role context" in argv else "gen-engine"
    if "bench-ctx.yaml" in argv:
        return "ctx-daemon"
    if "bench-gen.yaml" in argv:
        return "gen-daemon"
    return ""


def load(folder: Path) -> dict[str, list[tuple[int, str, str]]]:
    by_role: dict[str, list[tuple[int, str, str]]] = collections.defaultdict(list)
    for path in folder.glob("*.trace"):
        role = ""
        events = []
        for line in path.read_text().splitlines():
            if line.startswith("argv "):
                role = role or _role(line)
                continue
            ns, kind, name, *_ = line.split(" ")
            events.append((int(ns), kind, name))
        if role:
            by_role[role].extend(events)
    for events in by_role.values():
        events.sort()
    return by_role


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--skip", type=int, default=10, help="first requests left out (warm-up)")
    ap.add_argument(
        "--anchor",
        default="AsyncClient.send",
        help="the context engine's call each request is timed from (AsyncClient.start_send "
        "for engines that start their sends)",
    )
    args = ap.parse_args()
    roles = load(args.dir)
    sends = [
        ns
        for ns, kind, name in roles.get("ctx-engine", [])
        if (kind, name) == ("B", args.anchor)
    ]
    sends = sends[args.skip :]
    if len(sends) < 3:
        raise SystemExit(f"too few requests traced in {args.dir}: {len(sends)}")
    offsets: dict[tuple[str, str, str], list[float]] = collections.defaultdict(list)
    counts: dict[tuple[str, str, str], list[int]] = collections.defaultdict(list)
    for start, end in itertools.pairwise(sends):
        for role, events in roles.items():
            seen: dict[tuple[str, str, str], int] = {}
            n: collections.Counter[tuple[str, str, str]] = collections.Counter()
            # Each role's events are sorted: start at this request's first one, not at the
            # trace's beginning for every request.
            for ns, kind, name in events[bisect.bisect_left(events, (start,)) :]:
                if ns >= end:
                    break
                key = (role, name, kind)
                seen.setdefault(key, ns)
                n[key] += 1
            for key, ns in seen.items():
                offsets[key].append((ns - start) / 1e6)
                counts[key].append(n[key])
    total = statistics.median((b - a) / 1e6 for a, b in itertools.pairwise(sends))
    print(f"{len(sends) - 1} requests; median send-to-send {total:.3f} ms")
    print(f"{'ms after send (median)':>24}  {'per req':>7}  event")
    rows = sorted((statistics.median(v), k) for k, v in offsets.items())
    for med, (role, name, kind) in rows:
        per = statistics.median(counts[(role, name, kind)])
        print(f"{med:24.3f}  {per:7.0f}  {role:10s} {kind} {name}")


if __name__ == "__main__":
    main()
