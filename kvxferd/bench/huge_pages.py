"""`kvxferd bench --huge-pages`: every host pool of the run (both engines' and the raw NIXL
pair's) on huge pages, so that the ratio to raw compares like with like.

`auto` uses what the host has (a hugetlb memfd where enough pages are free, else
transparent huge pages on shared memory where shmem_enabled allows); `reserve` first
reserves enough hugetlb pages for the pools that exist at one time (two: the raw pair's,
then each configuration's two engines'), where root allows it, waits for the host to settle
(SETTLE_S), and puts vm.nr_hugepages back afterwards. Either way the pools are made with
huge_pages "required", so a run that cannot have huge pages fails with what the host
lacks instead of measuring 4 KiB pages. The daemons' own regions follow daemon.huge_pages
(auto by default: transparent huge pages where the kernel gives them, which leaves the
reserved hugetlb pages to the pools).

The mode reaches every process the run starts through the environment (bench/plan.py:
HUGE_PAGES_ENV). What the host had, what was reserved and what was restored go into the
report's `huge_pages`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from kvxferd.bench.plan import HUGE_PAGES_ENV
from kvxferd.memory.hugepages import HostPages, HugetlbReservation, round_up

MODES = ("auto", "reserve")
# Pools alive at one time: the raw pair's two, or one configuration's two engines'.
_POOLS_AT_ONCE = 2
# After raising vm.nr_hugepages the host stays busy for a while (compaction, most likely):
# raw NIXL measured right after a fresh reservation moved 1.2 GB/s (median of 7 runs), 4-5
# GB/s with the same pages reserved 20 s ahead (docs/benchmarks.md, issue 16). The raw pair
# runs first, so the run waits this long after reserving: else it favours the daemons.
SETTLE_S = 20.0
# UCX takes a few hugetlb pages of its own where it finds free ones (its shared-memory
# segments; 4 per process were seen here): room for them, so the pools still fit.
_SLACK_PAGES = 64


@contextlib.contextmanager
def huge_pages_run(mode: str | None, pool_bytes: int) -> Iterator[dict[str, Any] | None]:
    """Around a bench run: sets the environment (and with `reserve` the hugetlb pages) for
    huge-page pools; yields what goes into the report (None without --huge-pages)."""
    if mode is None:
        yield None
        return
    if mode not in MODES:
        raise ValueError(f"--huge-pages {mode!r}: expected one of {', '.join(MODES)}")
    before = HostPages.read()
    info: dict[str, Any] = {"mode": mode, "host_before": asdict(before)}
    reservation: HugetlbReservation | None = None
    if mode == "reserve":
        page = before.hugetlb_page_bytes or 2 << 20
        reservation = HugetlbReservation(
            _POOLS_AT_ONCE * (round_up(pool_bytes, page) // page) + _SLACK_PAGES
        )
        reservation.__enter__()
        info["reserved_pages"] = reservation.got
        info["reservation_problem"] = reservation.problem or None
        if reservation.changed:
            time.sleep(SETTLE_S)
            info["settled_s"] = SETTLE_S
    info["host_during"] = asdict(HostPages.read())
    saved = os.environ.get(HUGE_PAGES_ENV)
    os.environ[HUGE_PAGES_ENV] = "required"
    try:
        yield info
    finally:
        if saved is None:
            os.environ.pop(HUGE_PAGES_ENV, None)
        else:
            os.environ[HUGE_PAGES_ENV] = saved
        if reservation is not None:
            reservation.restore()
        info["host_after"] = asdict(HostPages.read())


def summary_line(info: dict[str, Any]) -> str:
    """One line for the table output: what the run had."""
    during = info["host_during"]
    parts = [f"huge pages ({info['mode']}):"]
    if info["mode"] == "reserve":
        parts.append(f"reserved {info.get('reserved_pages', 0)} hugetlb pages")
        if info.get("reservation_problem"):
            parts.append(f"({info['reservation_problem']})")
        parts.append(
            f"vm.nr_hugepages {info['host_before']['nr_hugepages']} -> "
            f"{during['nr_hugepages']} -> {info['host_after']['nr_hugepages']}"
        )
    parts.append(
        f"{during['hugetlb_free']} free hugetlb pages at the start, "
        f"shmem_enabled {during['shmem_enabled']}"
    )
    return " ".join(parts)
