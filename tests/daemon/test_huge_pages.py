"""Huge pages through real daemons: a hugetlb memfd pool handed over SCM_RIGHTS, mapped
and registered with NIXL by the daemon, a verified transfer on it, the daemon's bounce
regions on hugetlb pages, what /v1/status and `kvxferd status` say; and a daemon with
daemon.huge_pages: required refusing to start on a host that has none.

Huge pages are reserved only where root allows (vm.nr_hugepages, restored afterwards);
"a host that has none" is the daemon's own view of /proc and /sys, bind-mounted in a
private mount namespace (the host itself is never changed). Either skips, with the
reason, where the host refuses."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_harness import layout_for, status

from kvxferd.client import AsyncClient
from kvxferd.commands.status_cmd import summary
from kvxferd.memory.hugepages import HostPages, HugetlbReservation
from kvxferd.memory.memfd import MemfdRegion
from kvxferd.sim.cluster import LocalCluster
from kvxferd.sim.reference_engine import ReferenceEngine
from kvxferd.sim.workload import Item

# Reserves hugetlb pages or changes shmem THP for the whole host, which daemons (and UCX)
# of tests running beside it would take or see: run alone (scripts/run-tests.sh).
pytestmark = pytest.mark.host_global

# Two 16 MiB pools (64 blocks of 256 KiB), two daemons' two 4 MiB bounce regions (should
# they take hugetlb pages), and room for the hugetlb pages UCX takes for itself.
PAGES = 2 * 8 + 4 * 2 + 32
BOUNCE_MB = 4


def test_a_hugetlb_pool_moves_through_real_daemons(cluster: LocalCluster) -> None:
    before = HostPages.read().nr_hugepages
    with HugetlbReservation(PAGES) as res:
        if res.got < PAGES:
            pytest.skip(f"needs {PAGES} free hugetlb pages: {res.problem or 'none free'}")
        settings = {
            "daemon": {"huge_pages": "required"},
            "transceiver": {"kv_transfer_timeout_ms": 20000, "kv_cache_bounce_size_mb": BOUNCE_MB},
        }
        ctx = cluster.start_daemon("ctx", "context", **settings)  # type: ignore[arg-type]
        gen = cluster.start_daemon("gen", "generation", **settings)  # type: ignore[arg-type]

        async def scenario() -> None:
            layout = layout_for("block-major", 64)
            clients = [
                await AsyncClient.connect(ctx.api_socket, engine="hp-ctx"),
                await AsyncClient.connect(gen.api_socket, engine="hp-gen"),
            ]
            c = ReferenceEngine(clients[0], layout, "pool0", huge_pages="required")
            g = ReferenceEngine(clients[1], layout, "pool0", huge_pages="required")
            try:
                await c.open()
                await g.open()
                for engine in (c, g):
                    assert isinstance(engine.region, MemfdRegion)
                    assert engine.region.pages.kind == "hugetlb", engine.region.pages
                for i in range(3):
                    item = Item(f"hp-{i}", 700)
                    receiving = asyncio.create_task(g.recv_one(item, ctx.peer_address))
                    sent = await c.send_one(item)
                    got = await receiving
                    assert (sent.status, got.status, got.verified) == ("done", "done", True), (
                        sent,
                        got,
                    )
                for daemon in (ctx, gen):
                    doc = status(daemon)
                    assert doc["pool_memory"]["pool0"]["sharing"] == "memfd"
                    assert doc["pool_memory"]["pool0"]["pages"]["kind"] == "hugetlb"
                    # The daemon's own regions: THP where the kernel gives it (the reserved
                    # hugetlb pages are the pools'), else hugetlb; `required` either way.
                    regions = doc["bounce"]["pages"]
                    assert regions["kind"] in ("thp", "hugetlb"), regions
                    text = summary(doc)
                    assert "pool pool0: host (memfd, hugetlb 2 MiB pages)" in text, text
                    assert (
                        f"bounce regions: 2 x {BOUNCE_MB:.1f} MiB, {regions['label']} pages" in text
                    ), text
            finally:
                await c.close()
                await g.close()
                for client in clients:
                    await client.close()

        asyncio.run(scenario())
        for daemon in (ctx, gen):
            assert re.search(
                rf"bounce buffer: two regions of {BOUNCE_MB:.1f} MiB registered, on "
                r"(THP|hugetlb) 2 MiB .*pages",
                daemon.log_text(),
            ), daemon.log_text()[-2000:]
        assert cluster.stop_all() == {"ctx": 0, "gen": 0}
    assert HostPages.read().nr_hugepages == before


def _no_huge_pages_view(tmp: Path) -> list[str]:
    """bind mounts that show a process a host without huge pages: no free hugetlb pages and
    transparent huge pages off, for anonymous and shared memory alike."""
    meminfo = tmp / "meminfo"
    lines = Path("/proc/meminfo").read_text().splitlines()
    meminfo.write_text(
        "\n".join(
            "HugePages_Free:        0" if line.startswith("HugePages_Free:") else line
            for line in lines
        )
        + "\n"
    )
    never = tmp / "thp-never"
    never.write_text("always madvise [never]\n")
    thp = "/sys/kernel/mm/transparent_hugepage"
    return [
        f"mount --bind {meminfo} /proc/meminfo",
        f"mount --bind {never} {thp}/enabled",
        f"mount --bind {never} {thp}/shmem_enabled",
    ]


def test_required_refuses_to_start_without_huge_pages(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1): the daemon's view of a host without huge pages")
    if not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        pytest.skip("no transparent huge pages on this kernel")
    config, _ = cluster.write_config(
        "hp",
        "context",
        daemon={"huge_pages": "required"},
        transceiver={"kv_transfer_timeout_ms": 20000, "kv_cache_bounce_size_mb": BOUNCE_MB},
    )
    script = " && ".join(
        [*_no_huge_pages_view(tmp_path), f'exec "$0" -m kvxferd.cli run --config {config}']
    )
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "true"], capture_output=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"unshare -m refused here: {probe.stderr.decode().strip()}")
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable],
        capture_output=True,
        timeout=120,
    )
    out = (proc.stdout + proc.stderr).decode()
    assert proc.returncode == 1, out
    assert "daemon.huge_pages is required, but the send region" in out, out
    assert "THP: transparent_hugepage/enabled is never" in out and "hugetlb: 0 free" in out
    assert "ready" not in out.splitlines()[-1]
