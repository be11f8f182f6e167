"""Which file descriptors this process has open, for tests that must leave none behind."""

from __future__ import annotations

import contextlib
import os


def fd_table() -> set[tuple[str, str]]:
    """(fd, what it is) of every open fd: an fd number reused for something else differs.
    Compare tables (nothing opened since is left: `now <= before`), not counts: an fd an
    earlier test of this process left behind may be collected meanwhile."""
    table = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # listdir's own fd, closed by now
            table.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    return table
