"""What the two host regions (ShmRegion, MemfdRegion) share: one read-write mapping, the
region's one long-lived uint8 view of it, an fd that may be kept beside it, and a close()
that waits for the caller's views (the module doc of kvxferd.memory.shm says why).
"""

from __future__ import annotations

import logging
import mmap
import os
from types import TracebackType
from typing import ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

from kvxferd.memory.hugepages import FOUR_K, Pages

__all__ = ["MappedRegion", "unmap_unless_viewed"]

_R = TypeVar("_R", bound="MappedRegion")


def unmap_unless_viewed(mm: mmap.mmap) -> bool:
    """Unmap `mm` now, or (False) leave it to its last view: a view still alive (one handed
    out by a region's .array, a transport's posted buffer) has the mmap object as its base,
    which unmaps when that view goes away. Closing under it would leave it dangling."""
    try:
        mm.close()
    except BufferError:
        return False
    return True


class MappedRegion:
    """One mapped region; subclasses say what they are called in messages (`_kind`), which
    error their properties raise once closed (`_error`) and where close() logs (`_log`)."""

    _kind: ClassVar[str]
    _error: ClassVar[type[Exception]]
    _log: ClassVar[logging.Logger]

    def __init__(
        self, label: str, nbytes: int, mm: mmap.mmap, fd: int | None = None, pages: Pages = FOUR_K
    ) -> None:
        self._label = label
        self._nbytes = nbytes
        self._mmap: mmap.mmap | None = mm
        self._fd = fd  # closed by close()
        # The kind of page the region is on (kvxferd.memory.hugepages), for status and logs.
        self.pages = pages
        # The region's one long-lived export of the mapping; close() drops it before closing.
        # A huge-page mapping may be longer than `nbytes` (whole huge pages): the view is not.
        self._view: npt.NDArray[np.uint8] | None = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        # A mapping does not move: its address is read once. `ndarray.ctypes` builds an object
        # per call, which was 3 % of a context daemon's samples under small requests (every
        # request computes its descriptors from the pool's base; docs/benchmarks.md).
        self._address = int(self._view.ctypes.data)

    # -- properties --------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes mapped."""
        return self._nbytes

    @property
    def closed(self) -> bool:
        """True after close()."""
        return self._view is None

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """A writable uint8 view of the whole mapping (see kvxferd.memory.shm about close())."""
        if self._view is None:
            raise self._error(f"{self._kind} {self._label!r} is closed")
        return self._view

    @property
    def address(self) -> int:
        """The mapping's base address, for registering it with a backend."""
        if self._view is None:
            raise self._error(f"{self._kind} {self._label!r} is closed")
        return self._address

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Close the kept fd, if any, and unmap (deferred while the caller still holds views).
        Idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        mm, self._mmap, self._view = self._mmap, None, None
        if mm is not None and not unmap_unless_viewed(mm):
            self._log.debug("%s %r: views still alive, unmap deferred", self._kind, self._label)

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """close(); a named region is not unlinked (its creator decides its lifetime)."""
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"at 0x{self.address:x}"
        return f"{type(self).__name__}({self._label!r}, {self._nbytes} bytes, {state})"
