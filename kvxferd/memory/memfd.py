"""Host KV pools as sealed memfds, handed to the daemon as a file descriptor.

Why not a POSIX shm name: an engine that shrinks (ftruncate) a /dev/shm object after its daemon
mapped it turns the daemon's next access past the new end into SIGBUS, which kills the daemon
(a gather, a NIXL write or read run in C, where Python cannot catch it). A memfd sealed with
F_SEAL_SHRINK can never become smaller than it is, by anyone holding it, so the daemon's mapping
stays valid for its whole life. Seals can only be added, never removed, so checking them once,
when the daemon receives the fd, is enough (no check-then-use race).

The engine creates the region (create), passes `.fd` to its daemon over the engine API socket
with SCM_RIGHTS (kvxferd.client does it), and keeps its own mapping. The daemon verifies the fd
(check_memfd) and maps it (attach). Both sides close their fd when done; the memory lives as
long as a mapping or an fd does, and nothing is ever left behind in /dev/shm.

Closing and live views behave as in kvxferd.memory.shm (see its module doc).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
from dataclasses import replace
from typing import Final, Protocol

import numpy as np
import numpy.typing as npt

from kvxferd.memory.hugepages import (
    FOUR_K,
    HUGE_PAGES_MODES,
    MFD_HUGETLB,
    HostPages,
    HugePagesError,
    HugePagesMode,
    Pages,
    advise_huge,
    hugetlb_page_bytes,
    populate,
    probe_shared,
    round_up,
    thp_page_bytes,
    thp_pages,
)
from kvxferd.memory.mapping import MappedRegion
from kvxferd.memory.shm import ShmError

__all__ = [
    "ENGINE_SEALS",
    "REQUIRED_SEALS",
    "HostRegion",
    "MemfdError",
    "MemfdRegion",
    "UnsealedMemfdError",
    "check_memfd",
    "describe_seals",
]

log = logging.getLogger(__name__)

# F_SEAL_FUTURE_WRITE (Linux 5.1) is missing from older Pythons' fcntl module.
F_SEAL_FUTURE_WRITE: Final = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)

#: What the daemon insists on: the object can never shrink under its mapping.
REQUIRED_SEALS: Final = fcntl.F_SEAL_SHRINK
#: What MemfdRegion.create applies: no shrinking, no growing (the size is the layout's, and a
#: pool that grew would only confuse whoever looks at it), and no further seals (so nobody can
#: add a write seal that would stop the daemon writing received KV into it).
ENGINE_SEALS: Final = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
# Seals that would make a pool unusable: the generation daemon writes into it.
_WRITE_SEALS: Final = fcntl.F_SEAL_WRITE | F_SEAL_FUTURE_WRITE

_SEAL_NAMES: Final = (
    (fcntl.F_SEAL_SEAL, "F_SEAL_SEAL"),
    (fcntl.F_SEAL_SHRINK, "F_SEAL_SHRINK"),
    (fcntl.F_SEAL_GROW, "F_SEAL_GROW"),
    (fcntl.F_SEAL_WRITE, "F_SEAL_WRITE"),
    (F_SEAL_FUTURE_WRITE, "F_SEAL_FUTURE_WRITE"),
)


class MemfdError(ShmError):
    """A memfd region could not be created, checked, attached, or used."""


class UnsealedMemfdError(MemfdError):
    """check_memfd() was given an fd that is not a memfd sealed against shrinking."""


class HostRegion(Protocol):
    """What the daemon and the engines use of a host pool, shm name or memfd alike."""

    @property
    def nbytes(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def array(self) -> npt.NDArray[np.uint8]: ...

    @property
    def address(self) -> int: ...

    def close(self) -> None: ...


def describe_seals(seals: int) -> str:
    names = [name for bit, name in _SEAL_NAMES if seals & bit]
    return " | ".join(names) or "none"


def _what_fd(fd: int) -> str:
    """What an fd refers to, for messages: '/memfd:kvxferd-pool (deleted)', 'pipe:[42]'..."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"fd {fd}"


def check_memfd(fd: int, nbytes: int, what: str = "the pool") -> int:
    """Check that `fd` is a memfd sealed against shrinking, of at least `nbytes`, and writable.

    Returns its seals. Raises UnsealedMemfdError (not a memfd, not sealed, write-sealed) or
    MemfdError (too small, not readable), with a message naming `what` and what is missing.
    Never closes `fd`.
    """
    try:
        st = os.fstat(fd)
    except OSError as e:
        raise MemfdError(
            f"{what}: cannot inspect the file descriptor: {os.strerror(e.errno or 0)}"
        ) from e
    if not stat.S_ISREG(st.st_mode):
        raise UnsealedMemfdError(
            f"{what}: the file descriptor is not a memfd ({_what_fd(fd)}); create the pool with "
            "memfd_create(MFD_ALLOW_SEALING) and seal it with F_SEAL_SHRINK "
            "(kvxferd.memory.MemfdRegion.create does)"
        )
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:
        # EINVAL: the file system does not do seals, so it is no memfd (a regular file on disk).
        raise UnsealedMemfdError(
            f"{what}: the file descriptor is not a memfd ({_what_fd(fd)}: no seals); create the "
            "pool with memfd_create(MFD_ALLOW_SEALING) and seal it with F_SEAL_SHRINK "
            "(kvxferd.memory.MemfdRegion.create does)"
        ) from e
    if not seals & REQUIRED_SEALS:
        hint = (
            "it can no longer be sealed (F_SEAL_SEAL is set: a /dev/shm or tmpfs file, or a memfd "
            "created without MFD_ALLOW_SEALING)"
            if seals & fcntl.F_SEAL_SEAL
            else "add it with fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) "
            "after sizing the memfd"
        )
        raise UnsealedMemfdError(
            f"{what}: the memfd is not sealed against shrinking (seals: {describe_seals(seals)}; "
            f"missing F_SEAL_SHRINK): the engine could truncate it under the daemon's mapping, "
            f"which would kill the daemon with SIGBUS; {hint}"
        )
    if seals & _WRITE_SEALS:
        raise UnsealedMemfdError(
            f"{what}: the memfd is write-sealed (seals: {describe_seals(seals)}); the daemon "
            "writes received KV into its pool, so seal it with F_SEAL_SHRINK | F_SEAL_GROW | "
            "F_SEAL_SEAL only"
        )
    if st.st_size < nbytes:
        raise MemfdError(f"{what}: the memfd has {st.st_size} bytes, {nbytes} bytes are needed")
    return int(seals)


class MemfdRegion(MappedRegion):
    """One mapped memfd. Use create() (the engine) or attach() (the daemon)."""

    _kind = "memfd"
    _error = MemfdError
    _log = log

    def __init__(
        self, fd: int | None, nbytes: int, mm: mmap.mmap, label: str, pages: Pages = FOUR_K
    ) -> None:
        super().__init__(label, nbytes, mm, fd, pages)

    @classmethod
    def create(
        cls,
        nbytes: int,
        name: str = "kvxferd-pool",
        *,
        reserve: bool = True,
        huge_pages: HugePagesMode = "off",
    ) -> MemfdRegion:
        """A new sealed memfd of `nbytes` (zeros), mapped read-write, keeping its fd (`.fd`).

        `name` only labels it (/proc/PID/fd, /proc/PID/maps). reserve=True allocates the memory
        now (fallocate), so a memory limit fails here with a clear error instead of a SIGBUS at
        the engine's first write.

        huge_pages (kvxferd.memory.hugepages): "off" takes normal pages; "auto" a hugetlb memfd
        where enough huge pages are free, else transparent huge pages where shmem_enabled
        allows them, else normal pages; "required" as auto, but raises HugePagesError (with
        what the host lacks) instead of taking normal pages. `.pages` says what it got and why
        no better. A huge-page memfd is sized in whole huge pages; `nbytes` stays as asked.
        """
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            raise MemfdError(f"memfd {name!r}: size must be a positive integer, got {nbytes!r}")
        if huge_pages not in HUGE_PAGES_MODES:
            raise MemfdError(
                f"memfd {name!r}: huge_pages must be one of {', '.join(HUGE_PAGES_MODES)}, "
                f"got {huge_pages!r}"
            )
        if huge_pages == "off":
            return cls._create(nbytes, name, reserve)
        host = HostPages.read()
        reasons: list[str] = []
        shortage = host.hugetlb_shortage(nbytes)
        if shortage is None:
            try:
                return cls._create(nbytes, name, reserve, hugetlb=host.hugetlb_page_bytes)
            except MemfdError as e:  # taken by someone else since we looked
                reasons.append(f"hugetlb: {e}")
        else:
            reasons.append(shortage)
        refusal = host.thp_refusal(shared=True)
        if refusal is None:
            region = cls._create(nbytes, name, reserve, thp=host.shmem_enabled)
            if region.pages.huge or huge_pages == "auto":
                why = "; ".join(r for r in [*reasons, region.pages.reason] if r)
                region.pages = replace(region.pages, reason=why)
                return region
            reasons.append(region.pages.reason)  # the kernel gave small pages
            region.close()
        else:
            reasons.append(refusal)
        why = "; ".join(reasons)
        if huge_pages == "required":
            raise HugePagesError(
                f"memfd {name!r}: huge pages are required (huge_pages: required), but this "
                f"host has none to give: {why}"
            )
        region = cls._create(nbytes, name, reserve)
        region.pages = Pages("4k", FOUR_K.page_bytes, why)
        return region

    @classmethod
    def create_hugetlb(cls, nbytes: int, name: str, page_bytes: int) -> MemfdRegion:
        """A sealed hugetlb memfd of `page_bytes` pages, allocated now; MemfdError (ENOSPC:
        not enough free huge pages) when it cannot be had."""
        return cls._create(nbytes, name, True, hugetlb=page_bytes)

    @classmethod
    def _create(
        cls, nbytes: int, name: str, reserve: bool, *, hugetlb: int = 0, thp: str = ""
    ) -> MemfdRegion:
        """One attempt: a hugetlb memfd of `hugetlb`-byte pages, a memfd asking for THP (the
        host's shmem_enabled mode `thp`), or (neither) a memfd of normal pages."""
        flags = os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC | (MFD_HUGETLB if hugetlb else 0)
        page = hugetlb or (thp_page_bytes() if thp else 0)
        size = round_up(nbytes, page) if page else nbytes
        try:
            fd = os.memfd_create(name, flags)
        except OSError as e:
            raise MemfdError(f"cannot create memfd {name!r}: {os.strerror(e.errno or 0)}") from e
        try:
            os.ftruncate(fd, size)
            if reserve and not thp:
                os.posix_fallocate(fd, 0, size)
            # Sealed before anyone else can hold it: from here on its size is fixed for good.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, ENGINE_SEALS)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            raise MemfdError(
                f"cannot size, seal or map {size} bytes of memfd {name!r}"
                f"{' on hugetlb pages' if hugetlb else ''}: {os.strerror(e.errno or 0)}"
            ) from e
        pages = Pages("hugetlb", hugetlb) if hugetlb else FOUR_K
        if thp:
            # The pages come at the first touch, huge only for a mapping that asked for them:
            # so ask, then populate (fallocate would allocate small pages, as no mapping asks).
            address = int(np.frombuffer(mm, dtype=np.uint8).ctypes.data)
            advise_huge(mm)
            try:
                populated = reserve and populate(mm)
                if reserve and not populated:
                    os.posix_fallocate(fd, 0, size)
            except OSError as e:
                mm.close()
                os.close(fd)
                raise MemfdError(
                    f"cannot allocate {size} bytes of memfd {name!r}: {os.strerror(e.errno or 0)}"
                ) from e
            if populated:
                pages = thp_pages(address, size, page, f"shmem_enabled {thp}")
            else:
                pages = Pages("thp", page, "asked for; the kernel decides at the first touch")
        return cls(fd, nbytes, mm, name, pages)

    @classmethod
    def attach(cls, fd: int, nbytes: int, what: str = "the pool") -> MemfdRegion:
        """Map the first `nbytes` of a received memfd after check_memfd. Does not take `fd`:
        the caller closes it (the mapping keeps the memory alive).

        A hugetlb memfd is mapped in whole huge pages (its size is, and a shorter mapping
        could not be unmapped); of any other, `.pages` says whether it maps huge here."""
        check_memfd(fd, nbytes, what)
        page = hugetlb_page_bytes(fd)
        try:
            mm = mmap.mmap(
                fd,
                round_up(nbytes, page) if page else nbytes,
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except OSError as e:
            raise MemfdError(f"{what}: cannot map the memfd: {os.strerror(e.errno or 0)}") from e
        if page:
            return cls(None, nbytes, mm, what, Pages("hugetlb", page))
        region = cls(None, nbytes, mm, what)
        region.pages = probe_shared(mm, region.address)
        return region

    # -- properties --------------------------------------------------------------------------

    @property
    def fd(self) -> int:
        """The memfd (create() only), to pass to the daemon; valid until close()."""
        if self._fd is None:
            raise MemfdError(f"memfd {self._label!r} holds no file descriptor (closed or attached)")
        return self._fd
