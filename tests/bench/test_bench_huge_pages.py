"""`kvxferd bench --huge-pages`: the engines' and the raw NIXL pair's pools on hugetlb pages
in one tiny run, every byte verified, what the host had in the report; and a run that
cannot have huge pages failing with what the host lacks. No timing is asserted."""

from __future__ import annotations

import json

import pytest
from cli_harness import kvxferd
from nixl_harness import nixl_or_skip

from kvxferd.memory.hugepages import HostPages, HugetlbReservation

# Reserves hugetlb pages or changes shmem THP for the whole host, which daemons (and UCX)
# of tests running beside it would take or see: run alone (scripts/run-tests.sh).
pytestmark = pytest.mark.host_global

nixl_or_skip("the bench runs real daemons over NIXL")

TINY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--tokens-per-block", "32"]
RUN = [*TINY, "--configs", "nixl-python", "--tokens", "100", "--requests", "2", "--json"]


@pytest.mark.timeout(180)
def test_pools_on_hugetlb_pages_through_daemons_and_raw() -> None:
    # Tiny pools (one huge page each), and UCX's own few pages per process.
    with HugetlbReservation(32) as res:
        if res.got < 32:
            pytest.skip(f"needs 32 free hugetlb pages: {res.problem or 'none free'}")
        proc = kvxferd("bench", *RUN, "--huge-pages", timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    (result,) = report["results"]
    assert result["verified"] == result["requests"] == 2
    assert result["raw_gbps"] > 0 and result["gbps"] > 0
    huge = report["huge_pages"]
    assert huge["mode"] == "auto" and huge["host_during"]["hugetlb_free"] >= 4
    assert "huge pages (auto):" in proc.stderr


@pytest.mark.timeout(120)
def test_a_run_without_huge_pages_fails_saying_why() -> None:
    host = HostPages.read()
    if host.hugetlb_free or host.thp_refusal(shared=True) is None:
        pytest.skip("this host has huge pages for shared memory")
    proc = kvxferd("bench", *RUN, "--huge-pages", timeout=110)
    assert proc.returncode != 0
    assert "huge pages are required" in proc.stderr and "0 free 2 MiB pages" in proc.stderr
