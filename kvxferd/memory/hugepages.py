"""Huge pages for host regions: what the host allows, and which kind of page a region got.

Three kinds, best first:

* **hugetlb**: a memfd created with MFD_HUGETLB, out of the pages an administrator reserved
  (vm.nr_hugepages). Guaranteed huge, but only as many as are free; sizes are whole huge
  pages (hugetlbfs refuses any other ftruncate, and munmap of a partial huge page fails, so
  every mapping of such a memfd is rounded up as well).
* **THP**: transparent huge pages. On shared memory (a memfd, what pools are) the kernel
  gives them only where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows (`advise`
  needs MADV_HUGEPAGE on the mapping; `never`, the usual default, gives none); on the
  daemon's private regions (anonymous memory) where `enabled` is `madvise` or `always`.
  Best effort: the kernel falls back to small pages when memory is fragmented, so what a
  region really got is read back from /proc/self/smaps.
* **4 KiB**: normal pages.

`Pages` says which kind a region got and why it got no better one ("hugetlb: 0 free 2 MiB
pages, 128 needed (vm.nr_hugepages 0)"). The modes (daemon.huge_pages, the engines'
--huge-pages): `off` takes normal pages, `auto` the best the host allows, `required` refuses
with those reasons when it allows none.

Nothing here changes the host: reserving hugetlb pages is HugetlbReservation's, which tests
and the bench use only when asked, and which restores vm.nr_hugepages afterwards.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Final, Literal

from kvxferd.errors import KvxferdError

__all__ = [
    "FOUR_K",
    "HUGE_PAGES_MODES",
    "HostPages",
    "HugePagesError",
    "HugePagesMode",
    "HugetlbReservation",
    "PageKind",
    "Pages",
    "advise_huge",
    "huge_bytes_mapped",
    "hugetlb_page_bytes",
    "populate",
    "probe_shared",
    "round_up",
    "thp_page_bytes",
    "thp_pages",
]

HugePagesMode = Literal["auto", "off", "required"]
HUGE_PAGES_MODES: Final[tuple[HugePagesMode, ...]] = ("auto", "off", "required")
PageKind = Literal["hugetlb", "thp", "4k"]

# Linux's values; Python 3.11's os and mmap modules lack some of them.
MFD_HUGETLB: Final = getattr(os, "MFD_HUGETLB", 0x0004)
MADV_POPULATE_READ: Final = getattr(mmap, "MADV_POPULATE_READ", 22)
MADV_POPULATE_WRITE: Final = getattr(mmap, "MADV_POPULATE_WRITE", 23)
HUGETLBFS_MAGIC: Final = 0x958458F6

SMALL_PAGE: Final = mmap.PAGESIZE
_THP = Path("/sys/kernel/mm/transparent_hugepage")
_NR_HUGEPAGES = Path("/proc/sys/vm/nr_hugepages")
# The modes of shmem_enabled that give a memfd huge pages when its mapping asks for them.
_SHMEM_HUGE: Final = ("always", "within_size", "advise", "force")
_ANON_HUGE: Final = ("always", "madvise")


class HugePagesError(KvxferdError):
    """Huge pages were required and the host allows none (the message says why)."""


def round_up(nbytes: int, page_bytes: int) -> int:
    return -(-nbytes // page_bytes) * page_bytes


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):g} MiB"


@dataclass(frozen=True)
class Pages:
    """The kind of page a region is on, and (`reason`) why it is on no better kind."""

    kind: PageKind
    page_bytes: int
    reason: str = ""
    # THP only: bytes of the region found on huge pages when it was made (smaps).
    huge_bytes: int | None = None

    @property
    def huge(self) -> bool:
        return self.kind != "4k"

    @property
    def label(self) -> str:
        """'hugetlb 2 MiB', 'THP 2 MiB' or '4 KiB'."""
        mib = self.page_bytes >= 1 << 20
        size = _mib(self.page_bytes) if mib else f"{self.page_bytes >> 10} KiB"
        return {"hugetlb": f"hugetlb {size}", "thp": f"THP {size}", "4k": size}[self.kind]

    def describe(self) -> str:
        """The label, with the reason when there is one: for logs and `kvxferd status`."""
        return f"{self.label} ({self.reason})" if self.reason else self.label

    def to_status(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "page_bytes": self.page_bytes,
            "label": self.label,
            "reason": self.reason or None,
            "huge_bytes": self.huge_bytes,
        }


FOUR_K: Final = Pages("4k", SMALL_PAGE)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _selected(text: str) -> str:
    """'always [madvise] never' -> 'madvise' ('' when unreadable)."""
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else text


@dataclass(frozen=True)
class HostPages:
    """What the host offers right now (read from /proc and /sys)."""

    hugetlb_page_bytes: int  # the default huge page size (0: none)
    hugetlb_free: int  # free pages of that size not promised to a mapping (Free - Rsvd)
    nr_hugepages: int  # vm.nr_hugepages (-1: unreadable)
    shmem_enabled: str  # transparent_hugepage/shmem_enabled, the selected mode ('' if none)
    anon_enabled: str  # transparent_hugepage/enabled, the selected mode

    @classmethod
    def read(cls) -> HostPages:
        info: dict[str, int] = {}
        for line in _read(Path("/proc/meminfo")).splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                info[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
        nr = _read(_NR_HUGEPAGES)
        return cls(
            hugetlb_page_bytes=info.get("Hugepagesize", 0),
            # Rsvd pages are free but promised to mappings made already (a MAP_SHARED
            # mapping reserves its pages when it is made): nobody else can have them.
            hugetlb_free=max(0, info.get("HugePages_Free", 0) - info.get("HugePages_Rsvd", 0)),
            nr_hugepages=int(nr) if nr.isdigit() else -1,
            shmem_enabled=_selected(_read(_THP / "shmem_enabled")),
            anon_enabled=_selected(_read(_THP / "enabled")),
        )

    def hugetlb_shortage(self, nbytes: int) -> str | None:
        """Why `nbytes` of hugetlb pages cannot be had now, or None when they can."""
        if self.hugetlb_page_bytes == 0:
            return "hugetlb: the kernel has no huge pages"
        need = round_up(nbytes, self.hugetlb_page_bytes) // self.hugetlb_page_bytes
        if self.hugetlb_free >= need:
            return None
        return (
            f"hugetlb: {self.hugetlb_free} free {_mib(self.hugetlb_page_bytes)} pages, {need} "
            f"needed (vm.nr_hugepages {self.nr_hugepages})"
        )

    def thp_refusal(self, shared: bool) -> str | None:
        """Why THP cannot be had for shared (memfd) or private (anonymous) memory, or None."""
        if shared:
            if self.shmem_enabled in _SHMEM_HUGE:
                return None
            mode = self.shmem_enabled or "absent"
            return f"THP: transparent_hugepage/shmem_enabled is {mode}"
        if self.anon_enabled in _ANON_HUGE:
            return None
        return f"THP: transparent_hugepage/enabled is {self.anon_enabled or 'absent'}"


def _fstatfs_type(fd: int) -> int | None:
    """The file system magic of `fd` (statfs.f_type, the struct's first field), or None."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if libc.fstatfs(fd, buf) != 0:
        return None
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def hugetlb_page_bytes(fd: int) -> int | None:
    """The huge page size of a hugetlbfs file (a MFD_HUGETLB memfd), or None for any other
    file. hugetlbfs reports its page size as the block size."""
    if _fstatfs_type(fd) != HUGETLBFS_MAGIC:
        return None
    return int(os.fstat(fd).st_blksize)


def advise_huge(mm: mmap.mmap) -> bool:
    """Ask for transparent huge pages on a mapping (harmless where the host gives none)."""
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, AttributeError):
        return False
    return True


def populate(mm: mmap.mmap, write: bool = True) -> bool:
    """Fault every page of a mapping in now, failing with an error rather than SIGBUS when
    memory runs out (MADV_POPULATE_*, Linux 5.14). False where the kernel lacks it."""
    try:
        mm.madvise(MADV_POPULATE_WRITE if write else MADV_POPULATE_READ)
    except OSError as e:
        if e.errno == 22:  # EINVAL: an older kernel
            return False
        raise
    return True


def huge_bytes_mapped(address: int) -> int | None:
    """Bytes of the mapping containing `address` that are mapped with huge pages (THP on
    anonymous or shared memory, per /proc/self/smaps), or None when it is not found."""
    fields = ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:")
    inside = False
    total = 0
    found = False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    if found:
                        break
                    start, _, end = head.partition("-")
                    inside = int(start, 16) <= address < int(end, 16)
                    found = inside
                elif inside and head in fields:
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return total if found else None


def thp_pages(address: int, nbytes: int, page_bytes: int, asked: str) -> Pages:
    """What a mapping that asked for THP (`asked`: the host's mode) really got."""
    huge = huge_bytes_mapped(address)
    if not huge:
        return Pages("4k", SMALL_PAGE, f"THP: {asked}, but the kernel gave no huge pages")
    part = f"{_mib(huge)} of {_mib(nbytes)} huge" if huge < nbytes else ""
    return Pages("thp", page_bytes, part, huge)


def thp_page_bytes() -> int:
    """The transparent huge page size (PMD size), 2 MiB where the kernel does not say."""
    text = _read(_THP / "hpage_pmd_size")
    return int(text) if text.isdigit() else 2 << 20


def probe_shared(mm: mmap.mmap, address: int) -> Pages:
    """Which pages a mapping of someone else's shared memory (a pool an engine made) is on,
    where it is no hugetlbfs file: THP if the first huge page of it maps huge.

    Asks for THP on the mapping first (so that the kernel maps the engine's huge pages
    huge here too), then faults in that first piece only: cheap, and the engine's pages are
    all made the same way. /proc/self/smaps is read only where the host allows THP at all.
    """
    if HostPages.read().thp_refusal(shared=True) is not None:
        return FOUR_K
    advise_huge(mm)
    page = thp_page_bytes()
    if address % page or len(mm) < page:
        return FOUR_K  # not aligned: the kernel cannot map it huge
    try:
        mm.madvise(MADV_POPULATE_READ, 0, page)
    except OSError:
        return FOUR_K
    if not huge_bytes_mapped(address):
        return FOUR_K
    return Pages("thp", page)


class HugetlbReservation:
    """Reserve `pages` more hugetlb pages for a while (root only), restoring vm.nr_hugepages
    on exit. For tests and `kvxferd bench --huge-pages`: a daemon never changes the host.

    `got` is how many of them the kernel found (fewer when memory is fragmented); `problem`
    says why none could be reserved (not root, no /proc/sys/vm/nr_hugepages).
    """

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.got = 0
        self.problem = ""
        self._before: int | None = None

    @property
    def changed(self) -> bool:
        """vm.nr_hugepages was raised (and will be restored)."""
        return self._before is not None

    def __enter__(self) -> HugetlbReservation:
        before = HostPages.read()
        if before.nr_hugepages < 0:
            self.problem = f"{_NR_HUGEPAGES} cannot be read"
            return self
        if before.hugetlb_free >= self.pages:
            self.got = self.pages  # enough are free already: nothing to change
            return self
        want = before.nr_hugepages + self.pages - before.hugetlb_free
        try:
            _NR_HUGEPAGES.write_text(f"{want}\n")
        except OSError as e:
            self.problem = f"cannot write {_NR_HUGEPAGES}: {os.strerror(e.errno or 0)}"
            return self
        self._before = before.nr_hugepages
        self.got = min(self.pages, HostPages.read().hugetlb_free)
        if self.got < self.pages:
            self.problem = f"the kernel found {self.got} of {self.pages} huge pages"
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.restore()

    def restore(self) -> None:
        """Put vm.nr_hugepages back (idempotent). Pages still in use stay until freed."""
        before, self._before = self._before, None
        if before is not None:
            _NR_HUGEPAGES.write_text(f"{before}\n")
