"""The bounce buffer (kv_cache_bounce_size_mb > 0) of the PYTHON runtime.

Each daemon allocates two regions of that size once, one for sending and one
for receiving, and registers them with the backend. A request whose blocks are
scattered in small segments is gathered into a reservation of the sender's
send region, written with ONE descriptor into a reservation the receiver made
in its receive region, and scattered there into the destination blocks.

Bytes in a reservation are packed in the canonical order (logical block,
layer, K/V), whole blocks, so each side gathers or scatters with its own
layout and the two never need to know each other's layout. Between different
tensor-parallel sizes each leg (context rank, generation rank) has its own
reservations and moves only the heads both hold, packed (logical block, layer,
K/V, token, heads): the side whose pool holds more heads gathers or scatters
the slice, the other copies whole blocks.

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
import mmap
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvxferd.backends.base import HOST, Memory
from kvxferd.memory.hugepages import Pages
from kvxferd.memory.layout import KvLayout
from kvxferd.memory.mapping import unmap_unless_viewed
from kvxferd.transceiver.copyplan import (
    CopyPlan,
    Heads,
    check_packed,
    check_pool,
    copy_plan,
    word_rows,
)
from kvxferd.transceiver.head_gather import SplitGather

# Bounce only when the per-block path would need at least this many
# descriptors of this average size or less. Measured here (docs/benchmarks.md,
# issue 5): each NIXL descriptor costs ~1.6 us beyond its bytes, while gather +
# scatter cost ~15 ms per 62.5 MiB, so bouncing pays below ~5-6 KiB per
# segment: 1.3-1.6x the per-block path at 4 KiB, 0.5-1.2x at 8 KiB.
MIN_DESCRIPTORS = 8
MAX_AVG_SEGMENT_BYTES = 6 << 10

# Every reservation is rounded up to whole pages.
RESERVATION_ALIGN = 4096

Bytes = npt.NDArray[np.uint8]


def reserved_bytes(nbytes: int) -> int:
    """What a reservation of `nbytes` takes of its region: whole pages."""
    return -(-nbytes // RESERVATION_ALIGN) * RESERVATION_ALIGN


# Copies this large are split over the copier's threads; below it a thread
# hand-off (tens of microseconds) would eat the gain.
_SPLIT_MIN_BYTES = 4 << 20


@dataclass(frozen=True)
class Reservation:
    offset: int
    nbytes: int


class RegionBacking(Protocol):
    """Memory a BounceRegion can sit on instead of its own host mapping: the daemon's
    device staging (kvxferd.memory.device.DeviceRegion.allocate) has this shape."""

    nbytes: int
    address: int

    @property
    def array(self) -> Any:
        """The memory as a 1-D uint8 array of its own array module (cupy for VRAM)."""
        ...

    def close(self) -> None: ...


#: Makes the backing of one region: (nbytes, label "send"/"recv") -> backing.
Backing = Callable[[int, str], RegionBacking]


class BounceRegion:
    """A page-aligned region with a first-fit allocator of reservations: a host mapping of
    its own, or, given a `backing`, that memory (device staging) in `memory`."""

    def __init__(
        self, nbytes: int, label: str, backing: RegionBacking | None = None, memory: Memory = HOST
    ) -> None:
        self.label = label
        self.nbytes = nbytes
        # What the backend registers the region as, and what peers name when they write
        # into it (Info.bounce_memory).
        self.memory = memory
        self._backing = backing
        self._map: mmap.mmap | None = None
        if backing is not None:
            if backing.nbytes < nbytes:
                backing.close()  # ours once handed over: device memory must not linger
                raise ValueError(
                    f"the {label} region's backing holds {backing.nbytes} bytes, {nbytes} needed"
                )
            self.array: npt.NDArray[np.uint8] = backing.array
            self.address = int(backing.address)
        else:
            # Populated up front: the first touch of a fresh page costs more than the copy.
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(-1, nbytes, flags=flags)
            self.array = np.frombuffer(self._map, dtype=np.uint8)
            self.address = int(self.array.ctypes.data)
        self._free: list[tuple[int, int]] = [(0, nbytes)]  # sorted (offset, length)
        self.in_use_bytes = 0
        self.reservations = 0
        self.registration: object | None = None

    @property
    def pages(self) -> Pages | None:
        """The host pages the region is on (kvxferd.memory.hugepages), when its backing says
        (transceiver/staging.py: HostStaging); None for device memory."""
        pages = getattr(self._backing, "pages", None)
        return pages if isinstance(pages, Pages) else None

    def reserve(self, nbytes: int) -> Reservation | None:
        """Room for `nbytes` now, or None (never waits)."""
        need = reserved_bytes(nbytes)
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
        if self._backing is not None:
            self._backing.close()
        if self._map is not None:
            # A transport may still hold a view (an MPI receive from a peer that died
            # mid-message never ends): the mapping then goes with that view.
            unmap_unless_viewed(self._map)


def worth_bouncing(descriptors: int, nbytes: int) -> bool:
    return descriptors >= MIN_DESCRIPTORS and nbytes <= descriptors * MAX_AVG_SEGMENT_BYTES


class Copier(Protocol):
    """Gathers blocks into, and scatters them out of, a packed buffer.

    HostCopier works on host memory with numpy; ArrayCopier makes the same calls over any
    numpy-like module (cupy for device pools). Both follow kvxferd.transceiver.copyplan.

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

    def gather_slices(
        self, pool: Bytes, layout: KvLayout, blocks: list[int], slices: list[tuple[Heads, Bytes]]
    ) -> None:
        """`gather_heads` of each (heads, out) of `slices`: every leg of a head-split."""
        ...


class _PlannedCopier:
    """The Copier calls as one copy plan each, executed by the subclass's `_copy`: host
    and device copiers differ only in how they move a plan's units."""

    def _copy(
        self, packed: Bytes, pool: Bytes, layout: KvLayout, plan: CopyPlan, into_pool: bool
    ) -> None:
        raise NotImplementedError

    def gather(self, pool: Bytes, layout: KvLayout, blocks: list[int], out: Bytes) -> None:
        self._copy(out, pool, layout, copy_plan(layout, blocks), into_pool=False)

    def scatter(self, packed: Bytes, pool: Bytes, layout: KvLayout, blocks: list[int]) -> None:
        self._copy(packed, pool, layout, copy_plan(layout, blocks), into_pool=True)

    def gather_heads(
        self, pool: Bytes, layout: KvLayout, blocks: list[int], heads: Heads, out: Bytes
    ) -> None:
        self._copy(out, pool, layout, copy_plan(layout, blocks, heads), into_pool=False)

    def scatter_heads(
        self, packed: Bytes, pool: Bytes, layout: KvLayout, blocks: list[int], heads: Heads
    ) -> None:
        self._copy(packed, pool, layout, copy_plan(layout, blocks, heads), into_pool=True)

    def gather_slices(
        self, pool: Bytes, layout: KvLayout, blocks: list[int], slices: list[tuple[Heads, Bytes]]
    ) -> None:
        # Every slice checked before the first copy: a device copy is only launched, so one
        # that raised after another had started would hand back room still being written.
        plans = [(copy_plan(layout, blocks, heads), out) for heads, out in slices]
        check_pool(pool, layout)
        for plan, out in plans:
            check_packed(out, plan)
        for plan, out in plans:
            self._copy(out, pool, layout, plan, into_pool=False)


class HostCopier(_PlannedCopier):
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

    def _copy(
        self, packed: Bytes, pool: Bytes, layout: KvLayout, plan: CopyPlan, into_pool: bool
    ) -> None:
        """Copy between the planned units of the pool and `packed` (in order): out of the
        pool (gather), or into it (scatter, `into_pool`)."""
        check_pool(pool, layout)
        check_packed(packed, plan)
        unit = np.dtype(f"V{plan.unit}")
        index = plan.index
        pool_units = pool[: layout.pool_bytes].view(unit)
        packed_units = packed[: plan.nbytes].view(unit)

        def copy(share: slice) -> None:
            if into_pool:
                np.put(pool_units, index[share], packed_units[share], mode="clip")
            else:
                # mode="clip" skips numpy's bounds check, which would also make it
                # copy through a temporary: check_blocks already bounded every index.
                np.take(pool_units, index[share], out=packed_units[share], mode="clip")

        self._split(copy, index.size, plan.nbytes)

    def gather_slices(
        self, pool: Bytes, layout: KvLayout, blocks: list[int], slices: list[tuple[Heads, Bytes]]
    ) -> None:
        """Every leg in one pass over the blocks (head_gather.py), split over the threads
        by logical block when large."""
        ids = layout.check_blocks(blocks)
        gather = SplitGather(pool, layout, ids, slices)
        nbytes = sum(out.size for _, out in slices)
        self._split(gather.copy, gather.count, nbytes)


# Copies a plan's rows (pool, packed, device index, unit bytes, into_pool) if it can.
RowCopy = Callable[[Any, Any, Any, int, bool], bool]


class ArrayCopier(_PlannedCopier):
    """Gather/scatter over any numpy-like array module `xp` (numpy, cupy): one 2-D take
    (gather) or one fancy-index assignment (scatter) per copy.

    The pool and the packed buffer are viewed as (units, words) arrays of the widest
    unsigned word dividing the plan's unit (copyplan.word_rows), so a copy is a single
    indexed row copy: one kernel launch in cupy, the same form in numpy and about as fast
    as HostCopier's void-dtype take on the host (../shared/GPU.md). Arguments are checked
    as HostCopier checks them, with the same messages.

    `run(fn)` executes each copy in the executor's context and returns only once it
    completed (a device copier: under its device and stream, then synchronising the
    stream): a gather's reservation is written, and a scatter's blocks are reported done,
    only after the bytes are where they belong. By default the copy runs inline.

    `rows(pool, packed, index, unit, into_pool)`, when given, is tried first: a faster
    copy of the plan's rows for the kinds it takes (device_rows.RowKernel), returning
    False, having copied nothing, for the others.
    """

    def __init__(
        self,
        xp: ModuleType = np,
        *,
        run: Callable[[Callable[[], None]], None] | None = None,
        rows: RowCopy | None = None,
    ) -> None:
        self.xp = xp
        self._run: Callable[[Callable[[], None]], None] = run or _inline
        self.rows = rows

    def close(self) -> None:
        pass

    def _copy(
        self, packed: Any, pool: Any, layout: KvLayout, plan: CopyPlan, into_pool: bool
    ) -> None:
        check_pool(pool, layout)
        check_packed(packed, plan)
        xp = self.xp
        word, row = word_rows(plan.unit)

        def copy() -> None:
            index = xp.asarray(plan.index)
            if self.rows is not None and self.rows(pool, packed, index, plan.unit, into_pool):
                return
            # Every unit divides the pool size (copyplan), so both views are whole rows.
            pool_rows = pool[: layout.pool_bytes].view(word).reshape(-1, row)
            packed_rows = packed[: plan.nbytes].view(word).reshape(-1, row)
            if into_pool:
                pool_rows[index] = packed_rows
            else:
                xp.take(pool_rows, index, axis=0, out=packed_rows)

        self._run(copy)


# Runs copy(*args) and returns once its bytes are in place.
CopyRunner = Callable[..., Awaitable[None]]


def _inline(copy: Callable[[], None]) -> None:
    copy()


def _backed(backing: Backing | None, nbytes: int, label: str) -> RegionBacking | None:
    return None if backing is None else backing(nbytes, label)


class BounceBuffers:
    """A daemon's two regions (send and receive), their copier and counters.

    By default both regions are host mappings copied by HostCopier, each copy on a thread
    of our own. Device staging passes `memory` (VRAM on its device), a `backing` that
    allocates each region there, a copier that runs on the device and `run_copy`, how a
    copy runs and is awaited (transceiver/device_copy.py: device_buffers launches it from
    the event loop and awaits the device, without a thread in between)."""

    def __init__(
        self,
        nbytes: int,
        copier: Copier | None = None,
        *,
        memory: Memory = HOST,
        backing: Backing | None = None,
        run_copy: CopyRunner | None = None,
    ) -> None:
        self.memory = memory
        self.send = BounceRegion(nbytes, "send", _backed(backing, nbytes, "send"), memory)
        try:
            self.recv = BounceRegion(nbytes, "recv", _backed(backing, nbytes, "recv"), memory)
        except BaseException:
            self.send.close()  # device memory is not reclaimed by the garbage collector soon
            raise
        self.copier: Copier = copier or HostCopier()
        # Copies run off the event loop (and off the data-plane thread, so
        # transfers of other requests keep moving while one request is gathered).
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvxferd-bounce"
        )
        self._run_copy: CopyRunner = run_copy or self._off_loop
        self.reservations_made = 0
        self.fallbacks = 0
        # Reservations that found no room at once and waited in line for it (a
        # tensor-parallel leg, a copy-only request): BOUNCE_ROOM_WAIT_S in staging.py.
        self.room_waits = 0
        # Copies made, and tensor-parallel legs moved with one side's copy only
        # (BouncePlanner.one_sided): what an operator or a test reads the path from.
        self.gathers = 0
        self.scatters = 0
        self.one_sided_legs = 0
        # Staged rounds written straight out of the pool, without a gather (round_source.py),
        # counted as each is posted.
        self.pool_rounds = 0
        # Receive bytes whose request ended while the transport may still write them (MPI
        # mid-message: staged_rx.py), counted in recv_in_use_bytes until it lets go.
        self.recv_lent_bytes = 0

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
        self.gathers += 1
        if heads is None:
            await self._run_copy(self.copier.gather, pool, layout, blocks, out)
        else:
            await self._run_copy(self.copier.gather_heads, pool, layout, blocks, heads, out)

    async def gather_slices(
        self,
        pool: Bytes,
        layout: KvLayout,
        blocks: list[int],
        slices: list[tuple[Heads, Reservation, int]],
    ) -> None:
        """Gather, for each (heads, reservation, nbytes) of `slices`, the pool's heads of
        `blocks` into that send reservation: a head-split's legs in one copy."""
        outs = [(heads, self.send.view(res, nbytes)) for heads, res, nbytes in slices]
        self.gathers += len(slices)
        await self._run_copy(self.copier.gather_slices, pool, layout, blocks, outs)

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
        self.scatters += 1
        if heads is None:
            await self._run_copy(self.copier.scatter, packed, pool, layout, blocks)
        else:
            await self._run_copy(self.copier.scatter_heads, packed, pool, layout, blocks, heads)

    async def _off_loop(self, copy: Callable[..., None], *args: object) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, copy, *args)

    def status(self) -> dict[str, object]:
        return {
            "region_bytes": self.send.nbytes,
            "memory": "vram" if self.memory.on_device else "host",
            "send_in_use_bytes": self.send.in_use_bytes,
            "recv_in_use_bytes": self.recv.in_use_bytes,
            "recv_lent_bytes": self.recv_lent_bytes,
            "send_reservations": self.send.reservations,
            "recv_reservations": self.recv.reservations,
            "reservations_made": self.reservations_made,
            "fallbacks": self.fallbacks,
            "room_waits": self.room_waits,
            "gathers": self.gathers,
            "scatters": self.scatters,
            "one_sided_legs": self.one_sided_legs,
            "pool_rounds": self.pool_rounds,
            "pages": self.send.pages.to_status() if self.send.pages is not None else None,
        }

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        close = getattr(self.copier, "close", None)
        if callable(close):
            close()
        self.send.close()
        self.recv.close()
