"""The copy ceiling: one single-threaded memcpy of a request's bytes, or (GPU pools) one
device-to-device copy."""

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


def device_copy_gbps(nbytes: int, repeats: int = 3, device: int = 0) -> float:
    """GB/s of one device-to-device copy of `nbytes` on CUDA device `device` (cupy), timed by
    CUDA events, best of `repeats`: the ceiling of a run whose pools are in device memory."""
    if nbytes <= 0:
        return 0.0
    import cupy

    with cupy.cuda.Device(device):
        src = cupy.ones(nbytes, dtype=cupy.uint8)
        dst = cupy.zeros(nbytes, dtype=cupy.uint8)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        best = float("inf")
        for _ in range(repeats):
            start.record()
            cupy.copyto(dst, src)
            end.record()
            end.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(start, end) * 1e6)  # ms to ns
        del src, dst
        cupy.get_default_memory_pool().free_all_blocks()  # leave the device to the daemons
    return nbytes / best if best > 0 else 0.0
