"""Sizing and reserving the staged runtime's staging regions, shared by its two movers
(transceiver/staged.py sends, transceiver/staged_rx.py receives).

Both regions are sized by max_tokens_in_buffer (else the engine's max_seq_len, else
DEFAULT_STAGING_TOKENS) worth of whole blocks, so every request the admission window
lets in fits. On the host they are HostStaging regions, on huge pages where
daemon.huge_pages and the host allow (the PYTHON runtime's bounce regions too).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import mmap
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import numpy.typing as npt

from kvxferd.backends.base import host_only
from kvxferd.errors import StartupError
from kvxferd.memory.hugepages import (
    FOUR_K,
    HostPages,
    HugePagesMode,
    Pages,
    advise_huge,
    populate,
    thp_page_bytes,
    thp_pages,
)
from kvxferd.memory.mapping import unmap_unless_viewed
from kvxferd.memory.memfd import MemfdError, MemfdRegion
from kvxferd.service.logs import LogLimiter
from kvxferd.transceiver.bounce import BounceRegion, Reservation, reserved_bytes

if TYPE_CHECKING:
    from kvxferd.backends.twosided import TwoSidedTransport
    from kvxferd.transceiver.bounce import BounceBuffers
    from kvxferd.transceiver.legs import RxLeg

log = logging.getLogger("kvxferd.bounce")

DEFAULT_STAGING_TOKENS = 8192

# Why a request ended that found no room in time (on either side).
NO_ROOM = "kv_transfer_timeout_ms elapsed waiting for room in the staging buffer"
NO_BOUNCE_ROOM = "kv_transfer_timeout_ms elapsed waiting for room in the bounce buffer"

# How long a tensor-parallel leg of the PYTHON runtime waits for bounce room before it takes
# the per-block path. That path moves a head slice as one descriptor per (block, layer,
# K/V, token), ~1/10 of what the bounce moves, and keeps the daemon's cores busy while it
# does; room frees as the writes before it end (a 160 MiB region turns over several times
# a second here). Only a region held for longer, as by writes to a stalled peer, lets the
# leg fall back (docs/benchmarks.md, issue 16, "a leg waits for bounce room").
BOUNCE_ROOM_WAIT_S = 1.0


class RegionWarnings:
    """What a tensor-parallel leg's fall back to the per-block path (about ten times slower,
    otherwise visible only as the `fallbacks` counter) tells the operator: at most once a
    minute per daemon side and kind, the lines in between counted."""

    def __init__(self) -> None:
        self._limiter = LogLimiter(interval_s=60.0, burst=1)

    def never_fits(self, what: str, nbytes: int, region_bytes: int) -> None:
        """`what` (`nbytes`) is larger than the whole region: no wait would ever do."""
        self._say(
            "never fits",
            what,
            nbytes,
            region_bytes,
            "can never fit this daemon's %.1f MiB bounce region",
            "above it, or use transceiver_runtime CPP, which moves rounds",
        )

    def busy(self, what: str, nbytes: int, region_bytes: int, waited_s: float) -> None:
        """`what` fits the region but found no room in it within `waited_s` (or its
        deadline): the requests in flight held it."""
        self._say(
            "busy",
            what,
            nbytes,
            region_bytes,
            f"found no room in this daemon's %.1f MiB bounce region within {waited_s:g} s "
            "(the requests in flight held it)",
            "to hold the requests in flight together",
        )

    def _say(
        self, kind: str, what: str, nbytes: int, region_bytes: int, why: str, advice: str
    ) -> None:
        self._limiter.log(
            log,
            logging.WARNING,
            (kind, what),
            f"%s of %.1f MiB {why}: it moves per block, about ten times slower. Raise "
            f"kv_cache_bounce_size_mb {advice}",
            what,
            nbytes / (1 << 20),
            region_bytes / (1 << 20),
        )


_R = TypeVar("_R")

# How often a request waiting for staging room looks again (room frees when
# another request's round completes; the deadline bounds the wait).
_ROOM_POLL_S = 0.001


def staging_bytes(tokens: int, tokens_per_block: int, block_bytes: int) -> int:
    return math.ceil(tokens / tokens_per_block) * block_bytes


async def reserve_by(reserve: Callable[[], _R | None], deadline: float) -> _R | None:
    """Try `reserve` until it finds room or the deadline passes."""
    while True:
        res = reserve()
        if res is not None or time.monotonic() >= deadline:
            return res
        await asyncio.sleep(_ROOM_POLL_S)


class RoomLine:
    """Receives waiting for room in one receive region, served in the order they began to
    wait: the order their engine posted them.

    Polling waiters in any order let two generation ranks of a head-split grant their room
    to different requests. After a rank stalled and a backlog formed on both, rank 0 held
    room for requests whose rank-1 receives waited for room that rank 1 held for requests
    waiting on rank 0: each request's sender waits for every leg, so none moved until the
    receive deadline, and the backlog formed again (a 1->2 demo over Mooncake timed out
    every request for minutes after its rank 1 was stopped for 10 s). Every rank's engine
    posts the same requests in the same order, so granting in arrival order grants each
    rank's room to the oldest request first on every rank: no request holds room on one
    rank while an older one holds the other's. The cost: a waiter that fits no earlier
    than those before it."""

    def __init__(self) -> None:
        # Each waiter's future, set when it reaches the head of the line.
        self._waiting: collections.deque[asyncio.Future[None]] = collections.deque()

    def __len__(self) -> int:
        return len(self._waiting)

    async def take(
        self, reserve: Callable[[], _R | None], deadline: float
    ) -> tuple[_R | None, bool]:
        """`reserve()` at once when no one waits and it finds room, else in line (reserve_by);
        and whether it had to wait (what the bounce buffer's room_waits counts)."""
        if not self._waiting:
            got = reserve()
            if got is not None:
                return got, False
        return await self.reserve_by(reserve, deadline), True

    async def reserve_by(self, reserve: Callable[[], _R | None], deadline: float) -> _R | None:
        """Try `reserve` whenever no earlier waiter is left, until it finds room or the
        deadline passes (None). Only the head of the line polls: the others sleep until
        it leaves, so a long line costs one poll a millisecond, not one per waiter."""
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        self._waiting.append(turn)
        timer: asyncio.TimerHandle | None = None
        try:
            if self._waiting[0] is not turn:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if not math.isinf(left):
                    timer = loop.call_later(left, _wake, turn)
                await turn
                if self._waiting[0] is not turn:
                    return None  # woken by its deadline, not by its turn
            return await reserve_by(reserve, deadline)
        finally:
            if timer is not None:
                timer.cancel()
            head = self._waiting[0] is turn
            self._waiting.remove(turn)
            if head and self._waiting:
                _wake(self._waiting[0])


def _wake(turn: asyncio.Future[None]) -> None:
    if not turn.done():  # a cancelled waiter's own exit passes the turn on
        turn.set_result(None)


def reserve_all(region: BounceRegion, sizes: list[int]) -> list[Reservation] | None:
    """One reservation per size, all or none: a request never holds part of its room
    while it waits for the rest (two requests could then wait on each other)."""
    got: list[Reservation] = []
    for nbytes in sizes:
        res = region.reserve(nbytes)
        if res is None:
            for each in got:
                region.release(each)
            return None
        got.append(res)
    return got


def offer_legs(
    bounce: BounceBuffers, legs: list[RxLeg], got: list[Reservation], sizes: list[int]
) -> None:
    """Give each leg its reservation and offer it `size` bytes of it (the RequestData's
    bounce_offset/bounce_nbytes), counting the reservations made."""
    bounce.reservations_made += len(got)
    for leg, res, size in zip(legs, got, sizes, strict=True):
        leg.res = res
        leg.offer = Reservation(res.offset, size)


# Staged rounds of about this many bytes (at least one block, at most half the
# receiver's reservation): the gather of the next round, the move of this one and
# the scatter of the previous one then overlap, and a round's fixed costs (a
# Result, a RoundAck, a post) stay small. Measured in docs/benchmarks.md (issue 16).
ROUND_BYTES = 16 << 20
# One-sided rounds of a large leg are larger, up to this: such a leg has few writes in flight
# (ONE_SIDED_ROUNDS_AHEAD; one when this was measured), so each round's fixed costs come
# between two writes (0.31 ms median, 1.6 ms p90 between the end of one 16 MiB write and
# the start of the next, measured in the context daemon against 3.2 ms per write), while
# the pipeline's fill and drain (the first gather, the last scatter) grow with the round.
# A leg gets about ONE_SIDED_ROUNDS rounds, none under ROUND_BYTES: a 1000 MiB request
# moves in 60 MiB rounds, one of 256 MiB or less as before. Measured (docs/benchmarks.md,
# issue 16 "the staged runtime", 2026-12-04): 1000 MiB requests over NIXL moved 4.32 /
# 4.59 / 5.05 GB/s (medians of 4 rotating passes) in rounds of 16 / 32 / 64 MiB.
ONE_SIDED_ROUND_MAX_BYTES = 64 << 20
ONE_SIDED_ROUNDS = 16
# Two-sided rounds of one leg in flight at once: the sender sends this many ahead
# (staged.py) and the receiver posts the receives of this many announced rounds ahead
# (staged_rx.py), each in slots the sender knows free, so a send never waits for a receive
# and MPI's next receive is posted when one completes. Measured on a quiet host
# (docs/benchmarks.md, 2026-12-03): staged MPI moved ~30 % more at 4 than at 2, 8 no more
# than 4. A stalled peer still holds at most half the receive region (staged_rx.py).
TWO_SIDED_ROUNDS_AHEAD = 4
# One-sided writes of one leg in flight at once: the next round's write is posted while
# this one moves, each into slots the receiver has acknowledged. Staged Mooncake (TCP)
# moves ~20 % more with two writes in flight than with one
# (benchmarks/issue16_staged_skeleton.py).
ONE_SIDED_ROUNDS_AHEAD = 2


def two_sided_round_bytes(region_bytes: int) -> int:
    """The largest two-sided round that leaves half the send region free while one leg has
    TWO_SIDED_ROUNDS_AHEAD rounds moving and the next one gathered. A receiver that stalls
    (SIGSTOP) completes none of the sends to it, so it keeps those rounds' reservations until
    it is declared lost; the other half serves the requests to other receivers (measured,
    benchmarks/stalled_receiver.py: with 512 KiB regions and four 128 KiB rounds moving, a
    context daemon's request to another generation daemon waited for room until the stalled
    one was declared lost in 11 of 16 stops over UCX and 5 of 16 over MPI; in none with this
    sizing). round_blocks keeps every round at least one block."""
    return (region_bytes // 2) // (TWO_SIDED_ROUNDS_AHEAD + 1)


def rounds_moving(depth: int, region_bytes: int, round_bytes: int) -> int:
    """How many two-sided rounds of `round_bytes` one leg moves at once out of a send region
    of `region_bytes`: `depth`, fewer where that many moving and the next one gathered would
    hold more than half the region (blocks too large for two_sided_round_bytes); at least
    one."""
    return max(1, min(depth, (region_bytes // 2) // max(1, round_bytes) - 1))


def round_blocks(ring_blocks: int, block_bytes: int, target: int = ROUND_BYTES) -> int:
    """Blocks per round in a reservation of `ring_blocks` blocks: about `target` bytes, at
    least one block, at most half the reservation (so one round lands while the one before
    it is scattered)."""
    k = max(1, target // max(1, block_bytes))
    if ring_blocks >= 2:
        k = min(k, ring_blocks // 2)
    return max(1, min(k, ring_blocks))


# On device staging a round is at most this share of our send region: with the next round
# gathered ahead, one request then holds at most half of it, so a receiver that stalls
# (SIGSTOP, a full GPU) cannot keep every other request out of the region until its
# deadline. Host rounds are far smaller than that already.
DEVICE_ROUND_SHARE = 4


def one_sided_round_bytes(leg_bytes: int, *, device_region: int = 0) -> int:
    """The round target of a one-sided leg of `leg_bytes` in all (ONE_SIDED_ROUND_MAX_BYTES).

    `device_region`: the staging regions are GPU memory, our send region this many bytes.
    There a round's copies cost next to nothing against its fixed costs, so the target is
    the whole leg, up to DEVICE_ROUND_SHARE of the region (round_blocks also keeps each
    round to half the receiver's reservation, so two rounds overlap). Measured on an H200
    (docs/benchmarks.md, "GPU check"): gathering a 62.5 MiB round took 0.7 ms, of which the
    device needs ~0.05 ms, and 1000 MiB requests in 18 such rounds took 19.5 ms against
    2.6 ms for the bare NIXL pair; in 4 rounds, 6.5 ms."""
    if device_region:
        return max(ROUND_BYTES, min(leg_bytes, device_region // DEVICE_ROUND_SHARE))
    return max(ROUND_BYTES, min(ONE_SIDED_ROUND_MAX_BYTES, leg_bytes // ONE_SIDED_ROUNDS))


def plan_rounds(
    first: int, end: int, ring_blocks: int, per_round: int
) -> list[tuple[int, int, int]]:
    """The rounds (first, stop, slot) of the blocks [first, end) through a reservation of
    `ring_blocks` blocks used as a ring: each round of at most `per_round` blocks lies at
    block `slot` of the reservation, right after the one before it, and never wraps (a
    round that would is cut at the reservation's end). A round may land once the receiver
    scattered every block before `stop - ring_blocks` (the blocks that held its slots)."""
    if ring_blocks < 1 or per_round < 1:
        raise ValueError(f"rounds of {per_round} blocks through {ring_blocks} blocks")
    rounds: list[tuple[int, int, int]] = []
    b = first
    while b < end:
        slot = (b - first) % ring_blocks
        stop = min(end, b + per_round, b + ring_blocks - slot)
        rounds.append((b, stop, slot))
        b = stop
    return rounds


def blocks_per_round(region_bytes: int, blocks: int, leg_block_bytes: list[int]) -> int:
    """How many blocks each leg's reservation holds so that one reservation per leg fits the
    region together (each rounded up to the reservation alignment): every block when they
    can, else as many as fit; 0 when not even one block of every leg fits."""
    per_block = sum(leg_block_bytes)
    k = min(blocks, region_bytes // per_block)
    while k > 0 and sum(reserved_bytes(k * b) for b in leg_block_bytes) > region_bytes:
        k -= 1
    return k


class HostStaging:
    """One of the daemon's host regions (a bounce or staging region), private to it, on the
    pages daemon.huge_pages allows (kvxferd.memory.hugepages): anonymous memory asking for
    transparent huge pages where transparent_hugepage/enabled allows, else a hugetlb memfd
    where enough huge pages are free, else normal pages. Populated up front either way:
    the first touch of a fresh page costs more than the copy into it."""

    def __init__(
        self, nbytes: int, label: str, huge_pages: HugePagesMode, host: HostPages | None = None
    ) -> None:
        """`host`: what the host offers (read now when not given; tests pass their own)."""
        self.nbytes = nbytes
        self._memfd: MemfdRegion | None = None
        self._map: mmap.mmap | None = None
        self.array: npt.NDArray[np.uint8]
        self.pages = FOUR_K
        if huge_pages == "off":
            self._small([])
        else:
            host = host or HostPages.read()
            reasons: list[str] = []
            # THP first: hugetlb pages are what an administrator reserved for the engines'
            # pools (a daemon that starts first would take them); they serve here only
            # where the kernel gives no transparent huge pages.
            if not self._thp(host, reasons) and not self._hugetlb(host, label, reasons):
                self._small(reasons)
        self.address = int(self.array.ctypes.data)
        if huge_pages == "required" and not self.pages.huge:
            self.close()
            raise StartupError(
                f"daemon.huge_pages is required, but the {label} region ({nbytes} bytes) "
                f"cannot be on huge pages here: {self.pages.reason}; reserve hugetlb pages "
                "(sysctl vm.nr_hugepages), allow transparent huge pages, or set "
                "daemon.huge_pages: auto"
            )

    def _hugetlb(self, host: HostPages, label: str, reasons: list[str]) -> bool:
        shortage = host.hugetlb_shortage(self.nbytes)
        if shortage is not None:
            reasons.append(shortage)
            return False
        try:
            self._memfd = MemfdRegion.create_hugetlb(
                self.nbytes, f"kvxferd-{label}", host.hugetlb_page_bytes
            )
        except MemfdError as e:  # taken by someone else since we looked
            reasons.append(f"hugetlb: {e}")
            return False
        self.pages = self._memfd.pages
        self.array = self._memfd.array
        return True

    def _thp(self, host: HostPages, reasons: list[str]) -> bool:
        refusal = host.thp_refusal(shared=False)
        if refusal is not None:
            reasons.append(refusal)
            return False
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        advise_huge(self._map)
        if not populate(self._map):
            self.array[:: mmap.PAGESIZE] = 0  # an older kernel: touch every page
        asked = f"transparent_hugepage/enabled {host.anon_enabled}"
        got = thp_pages(int(self.array.ctypes.data), self.nbytes, thp_page_bytes(), asked)
        self.pages = replace(got, reason="; ".join(r for r in [*reasons, got.reason] if r))
        return True  # small pages if the kernel gave none (fragmented memory): got says so

    def _small(self, reasons: list[str]) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(-1, self.nbytes, flags=flags)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self.pages = Pages("4k", FOUR_K.page_bytes, "; ".join(reasons))

    def close(self) -> None:
        """Unmap, unless a transport still holds a view: a two-sided receive or send
        posted into a reservation for a peer that stalled or died mid-message never ends
        (UCX, MPI), and its buffer is a view of this region. The mapping then goes with that
        view; unmapping under it could let a late completion write into freed memory.
        Idempotent."""
        self.__dict__.pop("array", None)
        memfd, self._memfd = self._memfd, None
        if memfd is not None:
            memfd.close()  # defers its unmap itself while views are alive
        mapping, self._map = self._map, None
        if mapping is not None:
            unmap_unless_viewed(mapping)


def host_staging(huge_pages: HugePagesMode) -> Callable[[int, str], HostStaging]:
    """A BounceBuffers backing: each region a HostStaging on the pages `huge_pages` allows."""
    return lambda nbytes, label: HostStaging(nbytes, label, huge_pages)


def refuse_device_staging(transport: TwoSidedTransport, staging: BounceBuffers) -> None:
    """Two-sided transports (UCX, MPI) send and receive the staging regions as host
    buffers: with device staging they would read and write the wrong memory. Config
    resolution refuses the combination first; this keeps the movers from running it."""
    if staging.memory.on_device:
        name = getattr(transport, "name", type(transport).__name__)
        raise StartupError(host_only(name, staging.memory) or "")
