"""A device kernel for the copies of device staging: whole rows, 16 bytes per load.

cupy's `take` (gather) and fancy-index assignment (scatter) over rows of 8-byte words ran
at 0.56-0.62x a device-to-device memcpy on an H200 (issue 15's GPU check: ~1.2 TB/s against
2.1), and a bounce request pays for two of them. This kernel copies each row of `unit`
bytes as 16-byte vectors, a few loads in flight per thread, with one block row of the
launch grid per row of the plan (looping when there are more rows than a grid holds).

It serves rows of at least MIN_UNIT bytes whose buffers and unit are 16-byte aligned; for
anything else `RowKernel.__call__` says no and the caller copies with take/assignment as
before (head slices of 256 B per token, for example, stay there). The kernel is compiled
once per process, at the copier's first use, by cupy's NVRTC (cached on disk by cupy).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

VECTOR = 16
# Below this a row is under 32 vectors: most of a warp would idle, and take does as well.
MIN_UNIT = 32 * VECTOR
_MAX_THREADS = 256
# Blocks per launch to aim for: enough to keep every SM's loads in flight (132 SMs on an
# H200, up to 16 resident blocks of 256 threads each), few enough that each thread moves
# several vectors.
_BLOCKS_TARGET = 2048
_MAX_GRID_Y = 65535
_UNROLL = 4

_SOURCE = r"""
extern "C" __global__ void kvxferd_copy_rows(
    const uint4* __restrict__ src, uint4* __restrict__ dst,
    const long long* __restrict__ index, long long rows, long long vecs, int gather)
{
  const long long step = (long long)gridDim.x * blockDim.x;
  const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long r = blockIdx.y; r < rows; r += gridDim.y) {
    const long long at = index[r];
    const uint4* s = src + (gather ? at : r) * vecs;
    uint4* d = dst + (gather ? r : at) * vecs;
    long long c = first;
    for (; c + 3 * step < vecs; c += 4 * step) {
      uint4 a = s[c], b = s[c + step], e = s[c + 2 * step], f = s[c + 3 * step];
      d[c] = a; d[c + step] = b; d[c + 2 * step] = e; d[c + 3 * step] = f;
    }
    for (; c < vecs; c += step) d[c] = s[c];
  }
}
"""


def _address(array: Any) -> int:
    data = array.data
    ptr = getattr(data, "ptr", None)  # cupy: a MemoryPointer
    return int(ptr) if ptr is not None else int(array.ctypes.data)


def launch_shape(rows: int, vecs: int) -> tuple[tuple[int, int], tuple[int]]:
    """(grid, block) for `rows` rows of `vecs` 16-byte vectors: a block row per plan row
    (up to the grid's limit), threads across a row, and enough blocks across to reach
    about _BLOCKS_TARGET in all."""
    threads = min(_MAX_THREADS, -(-vecs // 32) * 32)
    grid_y = min(rows, _MAX_GRID_Y)
    across = -(-vecs // (threads * _UNROLL))
    grid_x = max(1, min(across, -(-_BLOCKS_TARGET // grid_y)))
    return (grid_x, grid_y), (threads,)


class RowKernel:
    """Copies rows between a pool and a packed buffer (both 1-D uint8 device arrays):
    `kernel(pool, packed, index, unit, into_pool)`, index a device int64 array of the pool
    row of each packed row. Returns False, having launched nothing, when the rows are not
    its kind (see the module's docstring)."""

    def __init__(self, xp: ModuleType) -> None:
        self._kernel = xp.RawKernel(_SOURCE, "kvxferd_copy_rows")

    def warm(self) -> None:
        """Compile now (under the caller's current device) rather than in the first copy."""
        compile_now = getattr(self._kernel, "compile", None)
        if callable(compile_now):
            compile_now()

    def __call__(self, pool: Any, packed: Any, index: Any, unit: int, into_pool: bool) -> bool:
        if unit < MIN_UNIT or unit % VECTOR or index.dtype != np.int64:
            return False
        if _address(pool) % VECTOR or _address(packed) % VECTOR:
            return False
        rows = int(index.size)
        if rows == 0:
            return True
        vecs = unit // VECTOR
        grid, block = launch_shape(rows, vecs)
        src, dst = (packed, pool) if into_pool else (pool, packed)
        self._kernel(
            grid, block, (src, dst, index, np.int64(rows), np.int64(vecs), np.int32(not into_pool))
        )
        return True
