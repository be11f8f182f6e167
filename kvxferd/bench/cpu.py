"""CPU seconds of processes, from /proc/<pid>/stat: what the bench charges a path per GB.

utime + stime of every thread of the process (the kernel sums them in the process's stat
line); children are not counted. Read before and after a timed phase, the difference is what
the process spent in it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def _ticks_per_s() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100


_TICKS = _ticks_per_s()


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of `pid` in seconds, or None when it cannot be read (gone, no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        # Fields 14 and 15 of the line (utime, stime); fields[0] here is field 3.
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (IndexError, ValueError):
        return None


def sample(pids: Iterable[int]) -> dict[str, float | None]:
    """cpu_seconds of each pid, keyed by the pid as a string (JSON keys)."""
    return {str(pid): cpu_seconds(pid) for pid in pids}


def spent(before: dict[str, float | None], after: dict[str, float | None]) -> float | None:
    """CPU seconds spent by all of them between two samples; None if one was unreadable."""
    total = 0.0
    for pid, start in before.items():
        end = after.get(pid)
        if start is None or end is None:
            return None
        total += end - start
    return total


def per_gb(seconds: float | None, nbytes: int) -> float | None:
    """CPU seconds per GB (1e9 bytes) moved; None when unknown or nothing moved."""
    if seconds is None or nbytes <= 0:
        return None
    return seconds / (nbytes / 1e9)
