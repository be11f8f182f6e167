"""The bounce buffer (kv_cache_bounce_size_mb > 0) of the PYTHON runtime.

Each daemon allocates two regions of that size once, one for sending and one
for receiving, and registers them with the backend. A request whose blocks are
scattered in small segments is gathered into a reservation of the sender's
send region, written with ONE descriptor into a reservation the receiver made
in its receive region, and scattered there into the destination blocks.

Bytes in a reservation are packed in the canonical order (logical block,
layer, K/V), whole blocks, so each side gathers or scatters with its own
layout and the two never need to know each other's layout.

Reservations never queue: a request that finds no room takes the per-block
path (counted as a fallback), so one large request cannot hold up others. A
request larger than a region also takes the per-block path: splitting it into
region-sized rounds would add a round trip per round and hold a whole region.
Small or already-contiguous requests skip the bounce buffer (see
`worth_bouncing`). A reservation is freed only once no write into or out of it
can still happen: after the scatter, or after the request was quiesced.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvxferd.memory.heads import head_slice_offsets
from kvxferd.memory.layout import BLOCK_MAJOR, KvLayout

# Bounce only when the per-block path would need at least this many
# descriptors of this average size or less. Measured here (docs/benchmarks.md,
# issue 5): each NIXL descriptor costs ~1.6 us beyond its bytes, while gather +
# scatter cost ~15 ms per 62.5 MiB, so bouncing pays below ~5-6 KiB per
# segment: 1.3-1.6x the per-block path at 4 KiB, 0.5-1.2x at 8 KiB.
MIN_DESCRIPTORS = 8
MAX_AVG_SEGMENT_BYTES = 6 << 10

# Every reservation is rounded up to whole pages.
RESERVATION_ALIGN = 4096

Index = npt.NDArray[np.intp]
Bytes = npt.NDArray[np.uint8]
Heads = tuple[int, int]  # a pool's heads [start, end), local indices

# Copies this large are split over the copier's threads; below it a thread
# hand-off (tens of microseconds) would eat the gain.
_SPLIT_MIN_BYTES = 4 << 20


@dataclass(frozen=True)
class Reservation:
    offset: int
    nbytes: int


class BounceRegion:
    """A page-aligned host region with a first-fit allocator of reservations."""

    def __init__(self, nbytes: int, label: str) -> None:
        self.label = label
        self.nbytes = nbytes
        # Populated up front: the first touch of a fresh page costs more than the copy.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(-1, nbytes, flags=flags)
        self.array: npt.NDArray[np.uint8] = np.frombuffer(self._map, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (offset, length)
        self.in_use_bytes = 0
        self.reservations = 0
        self.registration: object | None = None

    def reserve(self, nbytes: int) -> Reservation | None:
        """Room for `nbytes` now, or None (never waits)."""
        need = -(-nbytes // RESERVATION_ALIGN) * RESERVATION_ALIGN
        for i, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, length - need)
                self.in_use_bytes += need
                self.reservations += 1
                return Reservation(offset, need)
        return None

    def release(self, res: Reservation) -> None:
        self.in_use_bytes -= res.nbytes
        self.reservations -= 1
        start, end = res.offset, res.offset + res.nbytes
        merged: list[tuple[int, int]] = []
        placed = False
        for offset, length in self._free:
            if not placed and offset > start:
                merged.append((start, end - start))
                placed = True
            merged.append((offset, length))
        if not placed:
            merged.append((start, end - start))
        # Coalesce neighbours so large reservations stay possible.
        out: list[tuple[int, int]] = []
        for offset, length in merged:
            if out and out[-1][0] + out[-1][1] == offset:
                out[-1] = (out[-1][0], out[-1][1] + length)
            else:
                out.append((offset, length))
        self._free = out

    def view(self, res: Reservation, nbytes: int) -> npt.NDArray[np.uint8]:
        return self.array[res.offset : res.offset + nbytes]

    def close(self) -> None:
        del self.array
        self._map.close()


def worth_bouncing(descriptors: int, nbytes: int) -> bool:
    return descriptors >= MIN_DESCRIPTORS and nbytes <= descriptors * MAX_AVG_SEGMENT_BYTES


class Copier(Protocol):
    """Gathers blocks into, and scatters them out of, a packed buffer.

    HostCopier works on host memory with numpy; a GPU pool would provide a cupy
    implementation of the same calls.

    `gather`/`scatter` move whole blocks, packed as (logical block, layer, K/V).
    `gather_heads`/`scatter_heads` move only the pool's heads [start, end) (local
    indices), packed as (logical block, layer, K/V, token, heads): what one leg of a
    head-split or head-merge moves under the staged runtime. With every head of the
    pool they pack the same bytes as `gather`/`scatter`.
    """

    def gather(self, pool: Bytes, layout: KvLayout, blocks: list[int], out: Bytes) -> None: ...

    def scatter(self, packed: Bytes, pool: Bytes, layout: KvLayout, blocks: list[int]) -> None: ...

    def gather_heads(
        self, pool: Bytes, layout: KvLayout, blocks: list[int], heads: Heads, out: Bytes
    ) -> None: ...

    def scatter_heads(
        self, packed: Bytes, pool: Bytes, layout: KvLayout, blocks: list[int], heads: Heads
    ) -> None: ...


class HostCopier:
    """Gather/scatter on host memory: one numpy take/put of whole pieces.

    The pool and the packed buffer are viewed as arrays of `V{unit}` elements,
    where a unit is a whole block (block-major pool) or one (layer, K/V) piece
    (layer-major), and the copy is a single `np.take` (gather) or `np.put`
    (scatter) with one index per unit: numpy then memmoves each unit in C with
    the GIL released. Measured here for 16,000 4 KiB pieces (62.5 MiB) this
    runs at memcpy speed (~10 ms), against ~23 ms for a Python loop of
    memoryview slice copies (one interpreter round trip per piece) and ~4 ms
    more to build that loop's run lists. Byte-wise fancy indexing would be ~20x
    slower (FACTS); whole-unit elements avoid it.

    A copy of `_SPLIT_MIN_BYTES` or more is split over `threads` threads (the
    caller's and helpers), each taking a contiguous share of the units: on this
    2-core host two concurrent copies take ~12 ms where two in a row take ~21,
    and a daemon's copy runs while the NIXL write it feeds or follows is not
    running, so the second core is otherwise idle.

    A head slice (`gather_heads`/`scatter_heads`) is copied the same way with one
    element per (block, layer, K/V, token) run of the slice's heads, or, when the
    runs do not all sit on multiples of their length (heads that do not divide
    evenly), with smaller elements of at least one head.
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads if threads is not None else min(2, os.cpu_count() or 1))
        # Threads start on first use; an idle executor costs nothing.
        self._helpers = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, self.threads - 1), thread_name_prefix="kvxferd-copy"
        )

    def close(self) -> None:
        self._helpers.shutdown(wait=True)

    def _split(self, copy: Callable[[slice], None], count: int, nbytes: int) -> None:
        """Run copy(share) over `count` units, split across threads when large."""
        parts = self.threads if nbytes >= _SPLIT_MIN_BYTES else 1
        if parts == 1:
            copy(slice(0, count))
            return
        bounds = [count * i // parts for i in range(parts + 1)]
        futures = [
            self._helpers.submit(copy, slice(bounds[i], bounds[i + 1])) for i in range(1, parts)
        ]
        try:
            copy(slice(bounds[0], bounds[1]))
        finally:
            # Never return while a helper may still touch the buffers: the
            # caller frees the reservation right after.
            concurrent.futures.wait(futures)
        for f in futures:
            f.result()

    @staticmethod
    def _check_pool(pool: Bytes, layout: KvLayout) -> None:
        if pool.ndim != 1 or pool.dtype != np.uint8 or pool.size < layout.pool_bytes:
            raise ValueError(
                f"pool must be a 1-D uint8 array of at least {layout.pool_bytes} bytes, "
                f"got shape {pool.shape} of {pool.dtype}"
            )

    @staticmethod
    def _units(layout: KvLayout, blocks: list[int]) -> tuple[np.dtype[np.void], Index, int]:
        """The unit dtype, the pool index of each unit in packed order, and the packed bytes.

        Packed order is (logical block, layer, K/V): block-major over the request's
        blocks. A unit is a whole block (block-major pool) or one piece (layer-major),
        and every unit sits on a multiple of its own size in the pool (a layer-major
        region is num_blocks whole pieces), so the index is a plain division.
        """
        ids = layout.check_blocks(blocks)
        nbytes = len(blocks) * layout.block_bytes
        if layout.major == BLOCK_MAJOR:
            # A block is contiguous in the pool and in the packed buffer alike.
            return np.dtype(f"V{layout.block_bytes}"), ids.astype(np.intp), nbytes
        unit = layout.piece_bytes
        offsets = layout.piece_offsets(ids, block_first=True).ravel()
        return np.dtype(f"V{unit}"), (offsets // unit).astype(np.intp), nbytes

    @staticmethod
    def _head_units(
        layout: KvLayout, blocks: list[int], heads: tuple[int, int]
    ) -> tuple[np.dtype[np.void], Index, int]:
        """As _units, for the heads [start, end) of `blocks`.

        An element is one token's run of the slice when every run starts on a multiple
        of its length (the pool's heads divide evenly into slices of that size: the
        usual TP case); otherwise a common divisor of the run length and every run's
        offset (at least one head), each run then taking consecutive elements.
        """
        offsets = head_slice_offsets(layout, blocks, heads)
        start, end = heads
        head_bytes = layout.head_dim * layout.itemsize
        run = (end - start) * head_bytes
        # Every run offset is a sum of multiples of the token size (pieces and blocks are
        # whole tokens) plus the skipped heads: this divides them all, and the pool size.
        unit = math.gcd(run, layout.token_bytes, start * head_bytes)
        index = offsets // unit
        if unit != run:
            index = (index[:, None] + np.arange(run // unit, dtype=np.int64)).ravel()
        return np.dtype(f"V{unit}"), index.astype(np.intp), offsets.size * run

    def _units_of(
        self, layout: KvLayout, blocks: list[int], heads: Heads | None
    ) -> tuple[np.dtype[np.void], Index, int]:
        """The units of `blocks`, or of only their heads [start, end) when `heads` is given."""
        # All heads: whole pieces pack the same bytes, with far fewer elements.
        if heads is None or tuple(heads) == (0, layout.num_kv_heads):
            return self._units(layout, blocks)
        return self._head_units(layout, blocks, heads)

    def _copy(
        self,
        packed: Bytes,
        pool: Bytes,
        layout: KvLayout,
        units: tuple[np.dtype[np.void], Index, int],
        into_pool: bool,
    ) -> None:
        """Copy between the indexed units of the pool and `packed` (in order): out of the
        pool (gather), or into it (scatter, `into_pool`)."""
        self._check_pool(pool, layout)
        unit, index, nbytes = units
        if packed.size < nbytes:
            raise ValueError(f"the packed buffer holds {packed.size} bytes, {nbytes} needed")
        pool_units = pool[: layout.pool_bytes].view(unit)
        packed_units = packed[:nbytes].view(unit)

        def copy(share: slice) -> None:
            if into_pool:
                np.put(pool_units, index[share], packed_units[share], mode="clip")
            else:
                # mode="clip" skips numpy's bounds check, which would also make it
                # copy through a temporary: check_blocks already bounded every index.
                np.take(pool_units, index[share], out=packed_units[share], mode="clip")

        self._split(copy, index.size, nbytes)

    def gather(self, pool: Bytes, layout: KvLayout, blocks: list[int], out: Bytes) -> None:
        self._copy(out, pool, layout, self._units_of(layout, blocks, None), into_pool=False)

    def scatter(self, packed: Bytes, pool: Bytes, layout: KvLayout, blocks: list[int]) -> None:
        self._copy(packed, pool, layout, self._units_of(layout, blocks, None), into_pool=True)

    def gather_heads(
        self, pool: Bytes, layout: KvLayout, blocks: list[int], heads: Heads, out: Bytes
    ) -> None:
        self._copy(out, pool, layout, self._units_of(layout, blocks, heads), into_pool=False)

    def scatter_heads(
        self, packed: Bytes, pool: Bytes, layout: KvLayout, blocks: list[int], heads: Heads
    ) -> None:
        self._copy(packed, pool, layout, self._units_of(layout, blocks, heads), into_pool=True)


class BounceBuffers:
    """A daemon's two regions (send and receive), their copier and counters."""

    def __init__(self, nbytes: int, copier: Copier | None = None) -> None:
        self.send = BounceRegion(nbytes, "send")
        self.recv = BounceRegion(nbytes, "recv")
        self.copier: Copier = copier or HostCopier()
        # Copies run off the event loop (and off the data-plane thread, so
        # transfers of other requests keep moving while one request is gathered).
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvxferd-bounce"
        )
        self.reservations_made = 0
        self.fallbacks = 0

    async def gather(
        self,
        pool: Bytes,
        layout: KvLayout,
        blocks: list[int],
        res: Reservation,
        nbytes: int,
        heads: Heads | None = None,
    ) -> None:
        """Gather `blocks` (only the pool's heads [start, end) when `heads` is given) into
        the send reservation."""
        out = self.send.view(res, nbytes)
        if heads is None:
            await self._off_loop(self.copier.gather, pool, layout, blocks, out)
        else:
            await self._off_loop(self.copier.gather_heads, pool, layout, blocks, heads, out)

    async def scatter(
        self,
        res: Reservation,
        nbytes: int,
        pool: Bytes,
        layout: KvLayout,
        blocks: list[int],
        heads: Heads | None = None,
    ) -> None:
        """Scatter the receive reservation into `blocks` (only into the pool's heads
        [start, end) when `heads` is given)."""
        packed = self.recv.view(res, nbytes)
        if heads is None:
            await self._off_loop(self.copier.scatter, packed, pool, layout, blocks)
        else:
            await self._off_loop(self.copier.scatter_heads, packed, pool, layout, blocks, heads)

    async def _off_loop(self, copy: Callable[..., None], *args: object) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, copy, *args)

    def status(self) -> dict[str, object]:
        return {
            "region_bytes": self.send.nbytes,
            "send_in_use_bytes": self.send.in_use_bytes,
            "recv_in_use_bytes": self.recv.in_use_bytes,
            "send_reservations": self.send.reservations,
            "recv_reservations": self.recv.reservations,
            "reservations_made": self.reservations_made,
            "fallbacks": self.fallbacks,
        }

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        close = getattr(self.copier, "close", None)
        if callable(close):
            close()
        self.send.close()
        self.recv.close()
