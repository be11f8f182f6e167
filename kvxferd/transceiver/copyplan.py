"""Which bytes of a pool a gather or scatter moves, in which packed order: pure arithmetic.

One plan serves every copier (HostCopier's numpy take/put on host memory, ArrayCopier's
2-D take over any numpy-like module, cupy on a GPU included), so the host path, which the
tests here check exhaustively, and the device path, which only a GPU runs, cannot disagree
about where a byte goes.

A plan cuts the pool into equal units and lists the pool index of each unit the request
moves, in packed order; the packed buffer holds those units back to back:

* whole blocks: packed order (logical block, layer, K/V); a unit is a whole block
  (block-major pool) or one (layer, K/V) piece (layer-major), every one of which sits on a
  multiple of its own size in the pool, so an index is a plain division;
* a head slice [start, end) (one leg of a tensor-parallel head-split or head-merge): packed
  (logical block, layer, K/V, token, heads); a unit is one token's run of the slice where
  every run starts on a multiple of its length, otherwise a common divisor of the run and
  every run's offset (at least one head), each run then taking consecutive units.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from kvxferd.memory.heads import check_head_slice, head_slice_offsets
from kvxferd.memory.layout import BLOCK_MAJOR, KvLayout, run_lengths

Index = npt.NDArray[np.intp]
Heads = tuple[int, int]  # a pool's heads [start, end), local indices

# Word sizes a unit's rows are read in, widest first: wider words, fewer elements per row.
_WORDS = (np.dtype(np.uint64), np.dtype(np.uint32), np.dtype(np.uint16), np.dtype(np.uint8))


@dataclass(frozen=True)
class CopyPlan:
    """`index[i]` is the pool unit that packed unit i is; units are `unit` bytes."""

    unit: int  # bytes per unit; every pool offset in the plan is a multiple of it
    index: Index  # pool unit index of each packed unit, in packed order
    nbytes: int  # packed bytes (= index.size * unit)

    def segments(self) -> npt.NDArray[np.int64]:
        """(N, 2) (pool offset, length) runs in packed order, consecutive units coalesced:
        what the plan moves written as the byte ranges the layout math speaks in."""
        index = self.index.astype(np.int64)
        if index.size == 0:
            return np.zeros((0, 2), dtype=np.int64)
        breaks = np.ones(index.size, dtype=bool)
        np.not_equal(index[1:], index[:-1] + 1, out=breaks[1:])
        starts = np.flatnonzero(breaks)
        out = np.empty((starts.size, 2), dtype=np.int64)
        out[:, 0] = index[starts] * self.unit
        out[:, 1] = run_lengths(starts, index.size, self.unit)
        return out


def _whole_blocks(layout: KvLayout, blocks: list[int]) -> CopyPlan:
    ids = layout.check_blocks(blocks)
    nbytes = len(blocks) * layout.block_bytes
    if layout.major == BLOCK_MAJOR:
        # A block is contiguous in the pool and in the packed buffer alike.
        return CopyPlan(layout.block_bytes, ids.astype(np.intp), nbytes)
    unit = layout.piece_bytes
    offsets = layout.piece_offsets(ids, block_first=True).ravel()
    return CopyPlan(unit, (offsets // unit).astype(np.intp), nbytes)


def _head_slice(layout: KvLayout, blocks: list[int], heads: Heads) -> CopyPlan:
    start, end = check_head_slice(layout, heads)
    head_bytes = layout.head_dim * layout.itemsize
    run = (end - start) * head_bytes
    # Every run offset is a sum of multiples of the token size (pieces and blocks are whole
    # tokens) plus the skipped heads: this divides them all, and the pool size.
    unit = math.gcd(run, layout.token_bytes, start * head_bytes)
    # Computed in units directly: dividing half a million byte offsets cost ~3 ms of a
    # 1000 MiB split's ~8 ms plan here.
    index = head_slice_offsets(layout, blocks, heads, unit)
    runs = index.size
    if unit != run:
        index = (index[:, None] + np.arange(run // unit, dtype=np.int64)).ravel()
    return CopyPlan(unit, index.astype(np.intp, copy=False), runs * run)


def whole_blocks(layout: KvLayout, heads: Heads | None) -> bool:
    """Whether a copy of `heads` (None: all) moves whole blocks: every head of the pool."""
    return heads is None or tuple(heads) == (0, layout.num_kv_heads)


def copy_plan(layout: KvLayout, blocks: list[int], heads: Heads | None = None) -> CopyPlan:
    """The plan for `blocks` of a pool of `layout`, or for only their heads [start, end).

    Raises LayoutError for a bad block id or head slice, or for a pool whose order has no
    contiguous (layer, K/V) pieces (only block-major and layer-major are planned for now).
    """
    # All heads: whole pieces pack the same bytes, with far fewer units.
    if whole_blocks(layout, heads):
        return _whole_blocks(layout, blocks)
    assert heads is not None
    return _head_slice(layout, blocks, heads)


def word_rows(unit: int) -> tuple[np.dtype[Any], int]:
    """The widest unsigned word (8, 4, 2 or 1 bytes) that divides `unit`, and how many of
    them a unit holds: a unit is then one row of a 2-D (units, words) array, which one
    take or fancy-index assignment copies in numpy and cupy alike."""
    if unit < 1:
        raise ValueError(f"a unit holds at least one byte, got {unit}")
    word = next(w for w in _WORDS if unit % w.itemsize == 0)
    return word, unit // word.itemsize


def check_pool(pool: Any, layout: KvLayout) -> None:
    """A pool is a 1-D uint8 array (numpy or cupy) holding at least the layout's bytes."""
    if pool.ndim != 1 or pool.dtype != np.uint8 or pool.size < layout.pool_bytes:
        raise ValueError(
            f"pool must be a 1-D uint8 array of at least {layout.pool_bytes} bytes, "
            f"got shape {pool.shape} of {pool.dtype}"
        )


def check_packed(packed: Any, plan: CopyPlan) -> None:
    if packed.size < plan.nbytes:
        raise ValueError(f"the packed buffer holds {packed.size} bytes, {plan.nbytes} needed")
