"""What a benchmark report says about the machine it ran on, and the check that its pools fit.

Kept apart from the runner (kvxferd.bench.runner, the modes) and the processes of each
measurement (kvxferd.bench.phases): these only read the host (/proc, /dev/shm, package
metadata, the CUDA device).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
from pathlib import Path
from typing import Any

from kvxferd import __version__
from kvxferd.backends.nixl import NIXL_MODULES, nixl_module_name, package_name
from kvxferd.bench.children import BenchError
from kvxferd.bench.plan import Plan


def gpu_info() -> dict[str, Any]:
    """The CUDA device 0 a vram run used, and the cupy and CUDA versions it ran with."""
    from kvxferd.memory.device import probe

    found = probe()
    info: dict[str, Any] = {
        "devices": found.count,
        "cupy_version": found.cupy_version,
        "cuda_runtime": found.runtime_version,
        "cuda_driver": found.driver_version,
        "name": "",
    }
    with contextlib.suppress(Exception):  # a name is informative; the run has happened
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        info["name"] = name.decode() if isinstance(name, bytes) else str(name)
    return info


def host_info(memory: str = "host") -> dict[str, Any]:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = 0.0
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 2**20, 1)
    nixl_package = package_name(nixl_module_name() or NIXL_MODULES[0])
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 0
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": model,
        "memory_gib": mem_gib,
        "python": platform.python_version(),
        "platform": platform.platform(),
        # Which NIXL wheel the daemons load (nixl-cu12 or nixl-cu13), and its version.
        "nixl_package": nixl_package,
        "nixl_version": version(nixl_package),
        "numpy_version": version("numpy"),
        "kvxferd_version": __version__,
        # Other work on the machine skews every number: the 1/5/15-minute load averages
        # when the run started (and, in the report, when it ended).
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    } | ({"gpu": gpu_info()} if memory == "vram" else {})


def check_memory(plan: Plan, memory: str = "host") -> None:
    """Fail early, with numbers, when two pools (plus a memcpy pair) cannot fit. (Device
    pools: the device says so itself when they do not, at the first allocation.)"""
    if memory != "host":
        return
    pool = plan.layout().pool_bytes
    need = 2 * pool
    st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    if st is not None:
        free = st.f_bavail * st.f_frsize
        if free < need:
            raise BenchError(
                f"the run needs two KV pools of {pool / 2**20:.0f} MiB in /dev/shm at a time, "
                f"but only {free / 2**20:.0f} MiB are free there; use fewer --tokens, a lower "
                "--in-flight or a smaller geometry"
            )
    avail = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    if avail is not None and avail < need:
        raise BenchError(
            f"the run needs two KV pools of {pool / 2**20:.0f} MiB at a time, but only "
            f"{avail / 2**20:.0f} MiB of memory are available; use fewer --tokens, a lower "
            "--in-flight or a smaller geometry"
        )
