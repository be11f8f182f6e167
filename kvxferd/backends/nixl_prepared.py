"""NIXL's prepared descriptor lists: a small write as indices into lists made once.

A write's usual path builds two descriptor lists and a transfer request from them; NIXL
then looks up every descriptor in the registrations of both sides (get_xfer_descs twice,
initialize_xfer). For a one-block request that is most of the post: measured here, 27 us
for a 32 KiB write against 11 us when both sides were prepared once (prep_xfer_dlist) and
the request names indices (make_prepped_xfer). kvxferd bench --small spends its context
daemon's time on such posts.

A prepared list covers one registered region in units of one length: every unit of the
region from the first segment's offset modulo that length on. A write qualifies when all its
segments have that length and lie in one region on each side; any other write (runs of
several blocks, head slices) takes the usual path, as do regions too large to list
(MAX_UNITS) and lengths beyond LISTS_PER_REGION per region.

Lifetimes:
- local lists belong to a registration and are released with it;
- a peer's lists are only as good as the metadata NIXL holds for it: they are released
  whenever that metadata is loaded again (a pools update after the peer registered
  memory) or removed. A list built from metadata the peer has since replaced could
  address memory the peer no longer uses;
- a peer's regions are what it announced (its pools and bounce region); NIXL checks
  every descriptor against the peer's registrations when it prepares a list, so a stale
  announcement costs a failed preparation (then the usual path), never a wrong write.

A prepared list's release does not touch requests made from it: each request holds its own
copy of the descriptors.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from kvxferd.backends.base import Memory

log = logging.getLogger("kvxferd.backends.nixl")

#: Units one list may hold: NIXL keeps ~80 bytes per prepared descriptor (measured: 40,000
#: units, 3.3 MiB, 3 ms to prepare), so a list stays under ~20 MiB.
MAX_UNITS: Final = 1 << 18
#: Unit lengths prepared per region: a pool is written in one length (its blocks, or its
#: pieces); more than a few means writes of many shapes, which the usual path serves.
LISTS_PER_REGION: Final = 4
#: Segments a prepared write may have: above this the index lists cost what the usual
#: path's numpy descriptors do.
MAX_SEGMENTS: Final = 64

Region = tuple[int, int]  # (address, nbytes)


@dataclass
class _List:
    handle: Any  # NIXL's prepared list; None: this shape cannot be prepared
    first: int  # address of unit 0


@dataclass
class _Region:
    address: int
    nbytes: int
    memory: Memory
    lists: dict[tuple[int, int], _List]  # (unit length, phase) -> list

    def holds(self, lo: int, hi: int) -> bool:
        return self.address <= lo and hi <= self.address + self.nbytes


def _same(a: Memory, b: Memory) -> bool:
    return a is b or a == b  # HOST is one object: the comparison of fields is rare


class PreparedLists:
    """The prepared lists of one NIXL agent (kvxferd.backends.nixl.NixlBackend owns one).

    Not thread-safe: called only where the backend's other calls are (one at a time,
    kvxferd.transceiver.dataplane)."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self._local: dict[object, _Region] = {}  # registration -> region
        # agent name -> its announced regions (address, nbytes) -> prepared region
        self._remote: dict[str, dict[Region, _Region]] = {}
        self._last_local: _Region | None = None  # the region the last write came from
        self.prepared_writes = 0  # writes posted from prepared lists (status, tests)

    # -- lifetimes -----------------------------------------------------------------------

    def registered(self, registration: object, address: int, nbytes: int, memory: Memory) -> None:
        self._local[id(registration)] = _Region(address, nbytes, memory, {})

    def deregistered(self, registration: object) -> None:
        region = self._local.pop(id(registration), None)
        if region is self._last_local:
            self._last_local = None
        if region is not None:
            self._release(region)

    def peer_reloaded(self, agent_name: str) -> None:
        """The peer's metadata was loaded again or removed: its lists are stale."""
        for region in self._remote.pop(agent_name, {}).values():
            self._release(region)

    def close(self) -> None:
        for region in self._local.values():
            self._release(region)
        for name in list(self._remote):
            self.peer_reloaded(name)
        self._local.clear()
        self._last_local = None

    def _release(self, region: _Region) -> None:
        for lst in region.lists.values():
            if lst.handle is not None:
                try:
                    self._agent.release_dlist_handle(lst.handle)
                except Exception as exc:  # the agent is closing: nothing to keep
                    log.debug("release of a prepared list: %s", exc)
        region.lists.clear()

    # -- posts ---------------------------------------------------------------------------

    def make(
        self,
        local: np.ndarray,
        remote: np.ndarray,
        agent_name: str,
        notif: bytes,
        local_memory: Memory,
        remote_memory: Memory,
        remote_regions: Sequence[Region],
    ) -> Any | None:
        """A NIXL transfer request for WRITE `local` -> `remote` made from prepared lists,
        or None when this write does not qualify (the caller takes the usual path).
        NIXL's errors propagate, as from initialize_xfer."""
        n = len(local)
        if n == 0 or n > MAX_SEGMENTS or not remote_regions or len(remote) != n:
            return None
        lsegs, rsegs = local.tolist(), remote.tolist()
        unit = lsegs[0][1]
        if unit <= 0:
            return None
        laddrs, raddrs = [], []
        for (la, ll), (ra, rl) in zip(lsegs, rsegs, strict=True):
            if ll != unit or rl != unit:
                return None
            laddrs.append(la)
            raddrs.append(ra)
        lo, hi = (laddrs[0], laddrs[0] + unit) if n == 1 else (min(laddrs), max(laddrs) + unit)
        lregion = self._local_region(lo, hi, local_memory)
        if lregion is None:
            return None
        lo, hi = (raddrs[0], raddrs[0] + unit) if n == 1 else (min(raddrs), max(raddrs) + unit)
        rregion = self._remote_region(agent_name, lo, hi, remote_memory, remote_regions)
        if rregion is None:
            return None
        lside = self._indices(lregion, laddrs, unit, "NIXL_INIT_AGENT")
        if lside is None:
            return None
        rside = self._indices(rregion, raddrs, unit, agent_name)
        if rside is None:
            return None
        native = self._agent.make_prepped_xfer("WRITE", *lside, *rside, notif)
        self.prepared_writes += 1
        return native

    def _local_region(self, lo: int, hi: int, memory: Memory) -> _Region | None:
        last = self._last_local
        if last is not None and last.holds(lo, hi) and _same(last.memory, memory):
            return last
        for region in self._local.values():
            if region.holds(lo, hi) and _same(region.memory, memory):
                self._last_local = region
                return region
        return None

    def _remote_region(
        self, agent_name: str, lo: int, hi: int, memory: Memory, announced: Sequence[Region]
    ) -> _Region | None:
        regions = self._remote.setdefault(agent_name, {})
        for address, nbytes in announced:
            if address <= lo and hi <= address + nbytes:
                region = regions.get((address, nbytes))
                if region is None or not _same(region.memory, memory):
                    if region is not None:
                        self._release(region)
                    region = regions[(address, nbytes)] = _Region(address, nbytes, memory, {})
                return region
        return None

    def _indices(
        self, region: _Region, addrs: list[int], unit: int, agent: str
    ) -> tuple[Any, list[int]] | None:
        phase = (addrs[0] - region.address) % unit
        lst = region.lists.get((unit, phase))
        if lst is None:
            lst = self._prepare(region, unit, phase, agent)
        if lst.handle is None:
            return None
        out = []
        for address in addrs:
            offset = address - lst.first
            if offset % unit:
                return None  # another phase: a write of mixed alignment
            out.append(offset // unit)
        return lst.handle, out

    def _prepare(self, region: _Region, unit: int, phase: int, agent: str) -> _List:
        first = region.address + phase
        count = (region.nbytes - phase) // unit
        handle = None
        if 0 < count <= MAX_UNITS and len(region.lists) < LISTS_PER_REGION:
            descs = np.empty((count, 3), dtype=np.uint64)
            descs[:, 0] = first + unit * np.arange(count, dtype=np.uint64)
            descs[:, 1] = unit
            descs[:, 2] = region.memory.device
            try:
                handle = self._agent.prep_xfer_dlist(agent, descs, region.memory.kind)
            except Exception as exc:
                # The region is not what the agent registered (a stale announcement): the
                # usual path serves it, and names the problem if a write really is wrong.
                log.debug(
                    "no prepared list of %d-byte units at %#x for %s: %s",
                    unit,
                    first,
                    agent,
                    exc,
                )
        lst = _List(handle, first)
        region.lists[(unit, phase)] = lst
        return lst
