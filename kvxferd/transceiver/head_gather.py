"""Every leg of a head-split gathered in one pass over the pool (host memory).

A context rank that writes to N generation ranks sends each one its slice of the heads of
the same blocks. Gathered one leg after the other (a take per leg, copyplan's units), each
pass reads every token's row of every block and keeps a part of it, so the pool is read
from memory N times. Here the blocks are walked once, a few at a time, and every leg's
slice of them is copied while they are in the cache; each copy is a strided numpy
assignment of whole runs of heads (no index array), one per leg and run of consecutive
blocks. Measured on this host (one thread, the demo's 256 KiB blocks split in two,
benchmarks/issue16_head_gather.py): 8.2-8.5 GB/s against 6.1-6.9 for a take per leg with
the caches flushed, 13 against 8.3 with them warm (docs/benchmarks.md, issue 16 "tensor
parallelism", "2026-12-06 (stop 46): a split gathered in one pass").

The packed order of each leg is copyplan's for a head slice: (logical block, layer, K/V,
token, heads), so the receiver and the per-leg path agree byte for byte.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from kvxferd.memory.heads import check_head_slice, slice_block_bytes
from kvxferd.memory.layout import KvLayout, LayoutError, block_runs
from kvxferd.transceiver.copyplan import Heads, check_pool

Bytes = npt.NDArray[np.uint8]

# Blocks copied for every leg before the walk moves on: what the cache holds between the
# first leg's read of them and the last one's (a run is cut at this many bytes).
_CACHED_BYTES = 512 << 10


def _check_slices(
    layout: KvLayout, blocks: npt.NDArray[np.int64], slices: list[tuple[Heads, Bytes]]
) -> list[tuple[int, int]]:
    """Each slice's heads as ints, once every output holds its leg (ValueError naming the
    first that does not; LayoutError for a bad head slice)."""
    checked = []
    for i, (heads, out) in enumerate(slices):
        start, end = check_head_slice(layout, heads)
        need = blocks.shape[0] * slice_block_bytes(layout, end - start)
        if out.ndim != 1 or out.dtype != np.uint8 or out.size < need:
            raise ValueError(
                f"leg {i} (heads [{start}, {end})) needs a 1-D uint8 buffer of {need} bytes, "
                f"got shape {out.shape} of {out.dtype}"
            )
        checked.append((start, end))
    return checked


class SplitGather:
    """The views one gather of `slices` of `blocks` (checked ids) copies between; `copy`
    moves the logical blocks of a share, so that threads can take a share each."""

    def __init__(
        self,
        pool: Bytes,
        layout: KvLayout,
        blocks: npt.NDArray[np.int64],
        slices: list[tuple[Heads, Bytes]],
    ) -> None:
        check_pool(pool, layout)
        heads = _check_slices(layout, blocks, slices)
        # One element is the widest run of heads that every slice boundary falls on.
        group = math.gcd(layout.num_kv_heads, *(h for pair in heads for h in pair))
        element = np.dtype(f"V{group * layout.head_dim * layout.itemsize}")
        # (block, layer, kv, token, heads): a token's heads lie back to back in every named
        # order, so they fold into one row of bytes, viewed `group` heads to an element.
        logical = layout.logical_view(pool)
        if logical.strides[-2] != logical.shape[-1]:  # else the fold below would copy
            raise LayoutError(f"a pool of order {layout.major} has no contiguous token rows")
        self._pool = logical.reshape(*logical.shape[:-2], -1).view(element)
        shape = self._pool.shape
        n = blocks.shape[0]
        self._legs = [
            (
                start // group,
                end // group,
                out[: n * slice_block_bytes(layout, end - start)]
                .view(element)
                .reshape(n, *shape[1:-1], (end - start) // group),
            )
            for (start, end), (_, out) in zip(heads, slices, strict=True)
        ]
        self._ids = blocks
        self._cap = max(1, _CACHED_BYTES // layout.block_bytes)
        self.count = n

    def copy(self, share: slice) -> None:
        """Gather logical blocks [share.start, share.stop) into every leg's buffer."""
        pool = self._pool
        for i, j, a in block_runs(self._ids, self._cap, share.start, share.stop):
            src = pool[a : a + (j - i)]
            for start, end, out in self._legs:
                out[i:j] = src[..., start:end]
