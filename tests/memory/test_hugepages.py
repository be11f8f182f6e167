"""Huge pages (kvxferd.memory.hugepages): which kind a region gets and why, the fallbacks,
`required`, hugetlb memfds sized and unmapped in whole pages, THP on shared memory, and the
daemon's own regions (transceiver/staging.py). Tests that need huge pages reserve them only
where root allows, and put the host back (hugepage_fixtures)."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
from hugepage_fixtures import hugetlb_pages, no_free_hugetlb, shmem_thp

from kvxferd.errors import StartupError
from kvxferd.memory.hugepages import (
    FOUR_K,
    HostPages,
    HugePagesError,
    Pages,
    hugetlb_page_bytes,
)
from kvxferd.memory.memfd import ENGINE_SEALS, MemfdError, MemfdRegion, check_memfd
from kvxferd.transceiver.staging import HostStaging

# Reserves hugetlb pages or changes shmem THP for the whole host, which daemons (and UCX)
# of tests running beside it would take or see: run alone (scripts/run-tests.sh).
pytestmark = pytest.mark.host_global

MIB = 1 << 20
HUGE = 2 * MIB


def _mapped(label: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line for line in f if f"/memfd:{label} " in line]


def _host(**kw: object) -> HostPages:
    base: dict[str, object] = dict(
        hugetlb_page_bytes=HUGE,
        hugetlb_free=0,
        nr_hugepages=0,
        shmem_enabled="never",
        anon_enabled="madvise",
    )
    base.update(kw)
    return HostPages(**base)  # type: ignore[arg-type]


# -- what the host offers, in words ------------------------------------------------------------


def test_reasons_name_what_the_host_lacks() -> None:
    assert _host().hugetlb_shortage(5 * MIB) == (
        "hugetlb: 0 free 2 MiB pages, 3 needed (vm.nr_hugepages 0)"
    )
    assert _host(hugetlb_free=3, nr_hugepages=3).hugetlb_shortage(5 * MIB) is None
    assert _host(hugetlb_page_bytes=0).hugetlb_shortage(MIB) == (
        "hugetlb: the kernel has no huge pages"
    )
    assert _host().thp_refusal(shared=True) == ("THP: transparent_hugepage/shmem_enabled is never")
    assert _host(shmem_enabled="advise").thp_refusal(shared=True) is None
    assert _host().thp_refusal(shared=False) is None  # anonymous memory: madvise is enough
    assert _host(anon_enabled="never").thp_refusal(shared=False) == (
        "THP: transparent_hugepage/enabled is never"
    )


def test_labels() -> None:
    assert Pages("hugetlb", HUGE).label == "hugetlb 2 MiB"
    assert Pages("thp", HUGE).describe() == "THP 2 MiB"
    assert FOUR_K.label == "4 KiB" and not FOUR_K.huge
    why = Pages("4k", 4096, "hugetlb: 0 free 2 MiB pages, 1 needed (vm.nr_hugepages 0)")
    assert why.describe() == "4 KiB (hugetlb: 0 free 2 MiB pages, 1 needed (vm.nr_hugepages 0))"
    assert why.to_status()["label"] == "4 KiB" and why.to_status()["reason"] == why.reason


# -- pools (memfds) -------------------------------------------------------------------------------


def test_off_is_what_it_always_was() -> None:
    with MemfdRegion.create(3 * 4096 + 5, "hp-off", huge_pages="off") as region:
        assert region.pages == FOUR_K
        assert os.fstat(region.fd).st_size == region.nbytes == 3 * 4096 + 5
        assert hugetlb_page_bytes(region.fd) is None


def test_an_unknown_mode_is_refused_by_name() -> None:
    with pytest.raises(MemfdError, match="huge_pages must be one of auto, off, required"):
        MemfdRegion.create(4096, "hp-bad", huge_pages="always")  # type: ignore[arg-type]


def test_auto_without_huge_pages_falls_back_and_says_why() -> None:
    no_free_hugetlb()
    host = HostPages.read()
    if host.thp_refusal(shared=True) is None:
        pytest.skip(f"shmem_enabled is {host.shmem_enabled}: THP would be taken")
    with MemfdRegion.create(5 * MIB, "hp-auto", huge_pages="auto") as region:
        assert region.pages.kind == "4k"
        assert "hugetlb: 0 free 2 MiB pages, 3 needed" in region.pages.reason
        assert f"shmem_enabled is {host.shmem_enabled}" in region.pages.reason
    with pytest.raises(HugePagesError, match=r"huge pages are required.*0 free 2 MiB pages"):
        MemfdRegion.create(5 * MIB, "hp-req", huge_pages="required")
    assert _mapped("hp-req") == []


def test_a_hugetlb_memfd_is_whole_pages_sealed_shared_and_unmapped() -> None:
    nbytes = 5 * MIB + 3
    with hugetlb_pages(3):
        free = HostPages.read().hugetlb_free
        region = MemfdRegion.create(nbytes, "hp-tlb", huge_pages="required")
        assert region.pages == Pages("hugetlb", HUGE)
        assert HostPages.read().hugetlb_free == free - 3  # allocated now (reserve=True)
        fd = region.fd
        # hugetlbfs takes whole pages only; the region is still the size asked for.
        assert os.fstat(fd).st_size == 6 * MIB and region.nbytes == region.array.size == nbytes
        assert hugetlb_page_bytes(fd) == HUGE
        assert check_memfd(fd, nbytes) == fcntl.fcntl(fd, fcntl.F_GET_SEALS) == ENGINE_SEALS
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        # What the daemon does with a handed-over fd: the same pages, mapped in whole pages.
        other = MemfdRegion.attach(fd, nbytes, "pool 'p'")
        assert other.pages == Pages("hugetlb", HUGE)
        region.array[nbytes - 1] = 9
        assert int(other.array[nbytes - 1]) == 9
        other.close()
        region.close()
        # A mapping of part of a huge page could not be unmapped: none is left.
        assert _mapped("hp-tlb") == []
        assert HostPages.read().hugetlb_free == free


def test_a_hugetlb_memfd_crosses_to_another_process() -> None:
    nbytes = 4 * MIB
    child = textwrap.dedent(
        """
        import sys
        from kvxferd.memory.memfd import MemfdRegion
        region = MemfdRegion.attach(int(sys.argv[1]), int(sys.argv[2]))
        assert region.pages.kind == "hugetlb", region.pages
        assert int(region.array[-1]) == 5
        region.array[0] = 7
        region.close()
        """
    )
    with hugetlb_pages(2), MemfdRegion.create(nbytes, "hp-x", huge_pages="required") as region:
        region.array[-1] = 5
        subprocess.run(
            [sys.executable, "-c", child, str(region.fd), str(nbytes)],
            pass_fds=(region.fd,),
            check=True,
            timeout=60,
        )
        assert int(region.array[0]) == 7


def test_too_few_hugetlb_pages_fall_back_or_are_refused() -> None:
    with hugetlb_pages(2):
        free = HostPages.read().hugetlb_free
        need = free + 1
        if HostPages.read().thp_refusal(shared=True) is None:
            pytest.skip("shmem_enabled allows THP: auto would take it")
        with MemfdRegion.create(need * HUGE, "hp-few", huge_pages="auto") as region:
            assert region.pages.kind == "4k"
            assert f"hugetlb: {free} free 2 MiB pages, {need} needed" in region.pages.reason
        with pytest.raises(HugePagesError, match=f"{free} free 2 MiB pages, {need} needed"):
            MemfdRegion.create(need * HUGE, "hp-few", huge_pages="required")
        assert HostPages.read().hugetlb_free == free  # nothing kept on the way out


def test_thp_on_shared_memory_where_shmem_enabled_allows() -> None:
    no_free_hugetlb()
    nbytes = 8 * MIB + 4096
    with shmem_thp(), MemfdRegion.create(nbytes, "hp-thp", huge_pages="required") as region:
        assert region.pages.kind == "thp", region.pages
        assert region.pages.page_bytes == HUGE
        assert "hugetlb: 0 free" in region.pages.reason  # why not the better kind
        # Sized in whole huge pages, so the last one can be huge too.
        assert os.fstat(region.fd).st_size == 10 * MIB
        other = MemfdRegion.attach(region.fd, nbytes, "pool 'p'")
        assert other.pages == Pages("thp", HUGE)
        other.close()


# -- the daemon's own regions --------------------------------------------------------------------


def test_daemon_regions_off_take_normal_pages() -> None:
    region = HostStaging(4 * MIB, "send", "off")
    try:
        assert region.pages == FOUR_K
        assert region.array.size == region.nbytes == 4 * MIB
        region.array[:] = 1  # writable, all of it
    finally:
        region.close()


def test_daemon_regions_auto_take_the_best_the_host_gives() -> None:
    host = HostPages.read()
    region = HostStaging(4 * MIB, "send", "auto")
    try:
        if host.thp_refusal(shared=False) is None:
            # THP on anonymous memory first; the kernel may still give small pages, and says.
            assert region.pages.kind == "thp" or "gave no huge pages" in region.pages.reason
        elif host.hugetlb_free >= 2:
            assert region.pages.kind == "hugetlb"
        else:
            assert region.pages.kind == "4k" and "THP:" in region.pages.reason
    finally:
        region.close()


def test_daemon_regions_take_hugetlb_pages_only_without_thp() -> None:
    with hugetlb_pages(2):
        host = HostPages.read()
        no_thp = replace(host, anon_enabled="never")
        region = HostStaging(4 * MIB, "recv", "required", no_thp)
        assert region.pages == Pages("hugetlb", HUGE)
        assert HostPages.read().hugetlb_free == host.hugetlb_free - 2
        region.close()
        assert HostPages.read().hugetlb_free == host.hugetlb_free
        if host.thp_refusal(shared=False) is None:
            # Where THP is on, the reserved pages stay for the engines' pools.
            region = HostStaging(4 * MIB, "recv", "auto")
            assert region.pages.kind != "hugetlb"
            assert HostPages.read().hugetlb_free == host.hugetlb_free
            region.close()


def test_daemon_regions_required_refuse_with_the_reason() -> None:
    nothing = replace(HostPages.read(), hugetlb_free=0, anon_enabled="never")
    with pytest.raises(
        StartupError,
        match=r"daemon.huge_pages is required, but the send region \(4194304 bytes\) cannot be "
        r"on huge pages here: THP: transparent_hugepage/enabled is never; hugetlb: 0 free",
    ):
        HostStaging(4 * MIB, "send", "required", nothing)
    # auto on the same host: normal pages, and why.
    region = HostStaging(4 * MIB, "send", "auto", nothing)
    assert region.pages.kind == "4k" and region.pages.reason.startswith("THP: ")
    region.close()
