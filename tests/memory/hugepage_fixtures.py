"""Huge pages for tests, only where root allows, and the host put back afterwards.

`hugetlb_pages(n)`: n free hugetlb pages for the test (vm.nr_hugepages raised, then
restored). `shmem_thp()`: transparent_hugepage/shmem_enabled set to `advise` for the test,
then restored. Either skips, with the reason, where the host refuses.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvxferd.memory.hugepages import HostPages, HugetlbReservation

SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


@contextlib.contextmanager
def hugetlb_pages(pages: int) -> Iterator[HugetlbReservation]:
    before = HostPages.read().nr_hugepages
    with HugetlbReservation(pages) as res:
        if res.got < pages:
            pytest.skip(f"needs {pages} free hugetlb pages: {res.problem or 'none free'}")
        yield res
    assert HostPages.read().nr_hugepages == before, "vm.nr_hugepages was not restored"


@contextlib.contextmanager
def shmem_thp() -> Iterator[None]:
    text = SHMEM_ENABLED.read_text() if SHMEM_ENABLED.exists() else ""
    if "[" not in text:
        pytest.skip(f"{SHMEM_ENABLED} is missing: no transparent huge pages on this kernel")
    before = text.split("[", 1)[1].split("]", 1)[0]
    try:
        SHMEM_ENABLED.write_text("advise\n")
    except OSError as e:
        pytest.skip(f"cannot write {SHMEM_ENABLED}: {os.strerror(e.errno or 0)} (needs root)")
    try:
        yield
    finally:
        SHMEM_ENABLED.write_text(f"{before}\n")


def no_free_hugetlb() -> None:
    """Skip unless the host has no free hugetlb pages (what auto's fallbacks are about)."""
    free = HostPages.read().hugetlb_free
    if free:
        pytest.skip(f"the host has {free} free hugetlb pages; this test is about none")
