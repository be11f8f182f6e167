"""The memcpy ceiling: one single-threaded copy of a request's bytes."""

from __future__ import annotations

import time

import numpy as np


def memcpy_gbps(nbytes: int, repeats: int = 3) -> float:
    """GB/s of np.copyto between two preallocated (and touched) arrays of `nbytes`, best of
    `repeats`."""
    if nbytes <= 0:
        return 0.0
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        np.copyto(dst, src)
        best = min(best, time.perf_counter_ns() - t0)
    return nbytes / best if best > 0 else 0.0  # bytes per ns == GB/s
