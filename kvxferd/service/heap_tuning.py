"""glibc's malloc keeps the large buffers a process frees, instead of handing them back to
the kernel and faulting every page in again on the next request.

numpy takes every array's memory from malloc. glibc serves a buffer of 128 KiB or more with
its own mmap; once one is freed, its dynamic threshold rises to that size (so later ones come
from the heap) and the heap is trimmed (given back to the kernel) whenever more than twice
that size lies free at its top. A process that makes a few MiB of temporaries per request
and frees them therefore gives the heap back and takes it again every time, one page fault
per 4 KiB page, and on this VM a fault costs microseconds. The reference engine's check of
a request whose blocks are scattered makes exactly that pattern (a gathered copy and a
scratch array per MiB of blocks): 7,680 page faults per 16 MiB request and 0.76 GB/s,
against none and 5.5 GB/s with the thresholds below (benchmarks/issue16_heap_faults.py);
in 1000-request `kvxferd demo` runs with a head-split (context TP 1, generation TP 2) the
engines' CPU per GB fell from 1.11 to 0.71 s and the pair moved 0.93 against 0.70 GB/s
(docs/benchmarks.md, issue 16 "tensor parallelism", 2026-12-05).

Both thresholds are fixed (setting one through mallopt turns glibc's adjustment off):
buffers up to MMAP_THRESHOLD come from the heap, and up to TRIM_THRESHOLD of free heap is
kept. The cost is memory a process keeps after a burst: at most TRIM_THRESHOLD of free
heap per arena. Unlike glibc's tunables (copy_tuning.py), mallopt applies to a running
process, so no restart is needed. An operator who sets malloc's thresholds in the
environment (MALLOC_*_ or GLIBC_TUNABLES glibc.malloc.*) keeps them: nothing is changed.
Only kvxferd's own processes call this (the daemon, the reference and bench engines, the
bench's bare pairs, which must get the same allocator as the path they are compared with);
the vLLM connector runs inside the engine's process and leaves its allocator alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Mapping

log = logging.getLogger("kvxferd.daemon")

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# 32 MiB is the largest threshold glibc's own adjustment would ever reach on 64-bit hosts.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
# What an operator sets to choose malloc's thresholds themselves.
_OPERATOR_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")
_OPERATOR_TUNABLES = (
    "glibc.malloc.trim_threshold",
    "glibc.malloc.mmap_threshold",
    "glibc.malloc.top_pad",
)


def operator_choice(environ: Mapping[str, str]) -> str | None:
    """The environment variable by which the operator chose malloc's thresholds, if any."""
    for name in _OPERATOR_ENV:
        if name in environ:
            return name
    tunables = environ.get("GLIBC_TUNABLES", "")
    for name in _OPERATOR_TUNABLES:
        if name in tunables:
            return f"GLIBC_TUNABLES {name}"
    return None


def keep_freed_heap(environ: Mapping[str, str] | None = None) -> str:
    """Fix malloc's thresholds in this process where it is glibc and the operator did not
    choose them; returns what happened, for the log."""
    chosen = operator_choice(os.environ if environ is None else environ)
    if chosen is not None:
        return f"malloc thresholds left as set by {chosen}"
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return "malloc thresholds left alone: the C library is not glibc"
        mallopt = ctypes.CDLL(None, use_errno=True).mallopt
    except (ValueError, OSError, AttributeError):
        return "malloc thresholds left alone: the C library is not glibc"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # The mmap threshold first: setting the trim threshold alone would leave every buffer
    # of 128 KiB or more to a fresh mmap, faulted in on each use.
    if (
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1
        or mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1
    ):
        return "malloc thresholds not (all) set: mallopt refused them"
    return (
        f"malloc keeps freed buffers: mmap threshold {MMAP_THRESHOLD >> 20} MiB, "
        f"trim threshold {TRIM_THRESHOLD >> 20} MiB (set MALLOC_TRIM_THRESHOLD_ or "
        "MALLOC_MMAP_THRESHOLD_ to choose otherwise)"
    )


def log_keep_freed_heap() -> None:
    """keep_freed_heap, its outcome in the daemon's log (once logging is set up)."""
    log.info("%s", keep_freed_heap())
