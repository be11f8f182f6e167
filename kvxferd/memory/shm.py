"""Host KV pools in POSIX shared memory (/dev/shm), mapped with mmap.

An engine creates the region and fills it; its daemon attaches by name and registers the mapping
with the data-plane backend. Only the creator unlinks.

multiprocessing.shared_memory is deliberately not used: its resource tracker unlinks segments
that other processes still own and warns about "leaks" it caused itself.

Closing and live views: `.array` and `.address` hand out the mapping's memory. Unmapping it
under a live numpy view would turn the next access into a segfault, and mmap refuses to close
while buffers are exported. So close() drops the region's own view and closes the mmap when
nothing else holds one; if the caller still holds a view of `.array`, the mapping stays valid
until the last such view is garbage-collected, and is then unmapped. Either way the region
itself is closed: its properties raise ShmError afterwards.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import stat
from typing import Final

from kvxferd.errors import KvxferdError
from kvxferd.memory.hugepages import probe_shared
from kvxferd.memory.mapping import MappedRegion

__all__ = [
    "SHM_DIR",
    "ShmError",
    "ShmExistsError",
    "ShmNotFoundError",
    "ShmRegion",
    "ShmTooSmallError",
]

log = logging.getLogger(__name__)

#: Where POSIX shared memory objects live on Linux (what shm_open(3) uses).
SHM_DIR: Final = "/dev/shm"

_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.-]{1,200}")


class ShmError(KvxferdError):
    """A shared memory region could not be created, attached, or used."""


class ShmExistsError(ShmError):
    """create() found a region of that name already there."""


class ShmNotFoundError(ShmError):
    """attach() found no region of that name."""


class ShmTooSmallError(ShmError):
    """attach() found a region smaller than the caller needs."""


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name in (".", ".."):
        raise ShmError(
            f"invalid shared memory name {name!r}: use 1 to 200 characters of "
            "A-Z a-z 0-9 _ . - (not '.' or '..')"
        )
    return name


def _check_nbytes(name: str, nbytes: int) -> int:
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
        raise ShmError(f"shared memory {name!r}: size must be a positive integer, got {nbytes!r}")
    return nbytes


def _os_error(what: str, name: str, err: OSError) -> str:
    return f"{what} shared memory {name!r} ({SHM_DIR}/{name}): {os.strerror(err.errno or 0)}"


class ShmRegion(MappedRegion):
    """One mapped POSIX shared memory object. Use create() or attach(), not the constructor."""

    _kind = "shared memory"
    _error = ShmError
    _log = log

    def __init__(self, name: str, nbytes: int, mm: mmap.mmap, fd: int | None = None) -> None:
        # The fd is kept by attach(keep_fd=True), for size_now().
        super().__init__(name, nbytes, mm, fd)
        self._unlinked = False

    @classmethod
    def create(cls, name: str, nbytes: int, *, reserve: bool = True) -> ShmRegion:
        """Create a new region of `nbytes` (mode 0600). Fails if the name exists.

        reserve=True allocates the memory now (posix_fallocate), so a /dev/shm that is too
        small (64 MiB by default in containers) fails here with a clear error instead of
        killing the engine with SIGBUS at the first write past the limit.
        """
        _check_name(name)
        _check_nbytes(name, nbytes)
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError as e:
            raise ShmExistsError(
                _os_error("cannot create", name, e)
                + "; unlink the stale region or choose another name"
            ) from e
        except OSError as e:
            raise ShmError(_os_error("cannot create", name, e)) from e
        try:
            os.fchmod(fd, 0o600)  # the umask cannot widen it, but a restrictive one could narrow it
            os.ftruncate(fd, nbytes)
            if reserve:
                os.posix_fallocate(fd, 0, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise ShmError(
                _os_error(f"cannot size {nbytes} bytes of", name, e)
                + f"; check the free space of {SHM_DIR} (df -h {SHM_DIR})"
            ) from e
        os.close(fd)  # the mapping keeps the object alive
        return cls(name, nbytes, mm)

    @classmethod
    def attach(cls, name: str, nbytes: int, *, keep_fd: bool = False) -> ShmRegion:
        """Map the first `nbytes` of an existing region. Fails if missing or smaller.

        keep_fd=True keeps the object's fd open, so that size_now() can tell (after the name
        was unlinked) whether its creator shrank it under the mapping.
        """
        _check_name(name)
        _check_nbytes(name, nbytes)
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError as e:
            raise ShmNotFoundError(
                _os_error("cannot attach", name, e) + "; has the engine created its pool yet?"
            ) from e
        except OSError as e:
            raise ShmError(_os_error("cannot attach", name, e)) from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ShmError(f"cannot attach shared memory {name!r}: not a regular file")
            if st.st_size < nbytes:
                raise ShmTooSmallError(
                    f"cannot attach shared memory {name!r}: it has {st.st_size} bytes, "
                    f"{nbytes} bytes are needed"
                )
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(fd)
            raise ShmError(_os_error("cannot map", name, e)) from e
        except BaseException:
            os.close(fd)
            raise
        if not keep_fd:
            os.close(fd)
            region = cls(name, nbytes, mm)
        else:
            region = cls(name, nbytes, mm, fd)
        # /dev/shm gives huge pages only where it is mounted with huge=: say which it is.
        region.pages = probe_shared(mm, region.address)
        return region

    # -- properties --------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The region's name under /dev/shm."""
        return self._label

    def size_now(self) -> int | None:
        """The object's size right now (attach(keep_fd=True) only; else None).

        Smaller than `nbytes` means its creator truncated it: touching the mapping past the
        new end raises SIGBUS, which kills the process. Checking first narrows, but cannot
        close, that window (the object may shrink right after the check); only a sealed memfd
        (kvxferd.memory.memfd) closes it.
        """
        if self._fd is None:
            return None
        try:
            return os.fstat(self._fd).st_size
        except OSError as e:
            raise ShmError(_os_error("cannot inspect", self._label, e)) from e

    # -- lifecycle ---------------------------------------------------------------------------

    def unlink(self) -> None:
        """Remove the name from /dev/shm (mappings stay valid). Idempotent; a missing name is
        not an error. Only the creator should call it."""
        if self._unlinked:
            return
        self._unlinked = True
        try:
            os.unlink(os.path.join(SHM_DIR, self._label))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ShmError(_os_error("cannot unlink", self._label, e)) from e
