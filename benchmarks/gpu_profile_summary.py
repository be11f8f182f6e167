"""Summarise benchmarks/gpu_profile.sh's py-spy files: per process and thread, the share of
samples in each innermost stack tail and in each kvxferd function (inclusive).

Usage: python benchmarks/gpu_profile_summary.py DIR [--top N] [--depth D]

py-spy's raw format is one line per distinct stack, "frame;frame;...;frame COUNT", outermost
first; with --threads the first frame names the thread. Sampling ran with --idle, so shares
are of wall time: a thread waiting in epoll or in a GPU synchronise shows there.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

_LOCATION = re.compile(r" \(([^()]*?):\d+\)$")


def _short(frame: str) -> str:
    """'fn (path/to/file.py:12)' -> 'fn (file.py)': lines split one function's samples."""
    m = _LOCATION.search(frame)
    if m is None:
        return frame
    return frame[: m.start()] + f" ({Path(m.group(1)).name})"


def summarise(path: Path, top: int, depth: int) -> list[str]:
    threads: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    totals: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread = re.sub(r"^thread \(\d+\): ", "", frames[0])
        thread = re.sub(r"_\d+$", "", thread)  # one line for a pool's workers
        body = frames[1:]
        totals[thread] += count
        threads[thread][" <- ".join(_short(f) for f in reversed(body[-depth:]))] += count
        for fn in {_short(f) for f in body if "kvxferd/" in f or "(kvxferd" in f}:
            inclusive[thread][fn] += count
    out = [f"== {path.stem}"]
    for thread, total in totals.most_common():
        out.append(f"  -- {thread}: {total} samples")
        for tail, n in threads[thread].most_common(top):
            out.append(f"     {100 * n / total:5.1f}%  {tail}")
        if inclusive[thread]:
            out.append("     kvxferd functions (inclusive):")
            for fn, n in inclusive[thread].most_common(top):
                out.append(f"       {100 * n / total:5.1f}%  {fn}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--depth", type=int, default=3)
    args = ap.parse_args()
    for path in sorted(args.dir.glob("*.txt")):
        if path.name == "summary.txt":
            continue
        print("\n".join(summarise(path, args.top, args.depth)))


if __name__ == "__main__":
    main()
