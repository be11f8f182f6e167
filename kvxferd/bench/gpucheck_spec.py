"""What the GPU check is: its settings, its document's shape and its pass rule.

The steps and their caps, the bench's settings, the statuses of a step that did not run, the
files it writes, the keys of its document's host and of setup's result; each step's entry
before (or without) measurement (skeleton); the verdict on the figures and the exit status
(the rule is in kvxferd.bench.gpucheck's docstring). Nothing here starts a process, writes a
file or touches a device: the driver (kvxferd.bench.gpucheck) and the CPU tests use it as is.
"""

from __future__ import annotations

from typing import Any

from kvxferd.bench.gpu_foreign import FOREIGN_FIGURES

SCHEMA = "kvxferd-gpu-check/1"
STEPS = ("setup", "device_copy", "nixl_vram", "foreign_memory", "kvxferd_bench")
#: Caps in seconds. Expected together: ~3-4 minutes on an H200; the caps bound a hang.
CAPS_S = {
    "setup": 45.0,
    "device_copy": 60.0,
    "nixl_vram": 90.0,
    "foreign_memory": 80.0,  # ipc and vmm, half each
    "kvxferd_bench": 240.0,
}
#: A step is not started with less time than this left.
MIN_STEP_S = 15.0
SEGMENTS = ("4096", "65536")
BENCH_TOKENS = 8000
BENCH_REQUESTS = 20
BENCH_WARMUP = 3
BENCH_CONFIGS = ("nixl-python-bounce", "nixl-cpp")
ZERO_COPY_CONFIG = "nixl-python-zerocopy"
KVXFERD_MIN_RATIO = 0.8
GATHER_MIN_RATIO = 0.5

NO_DEVICE = "skipped: no CUDA device"
NO_MEMORY_FLAG = "skipped: kvxferd bench has no --memory vram yet"
NOT_SELECTED = "skipped: not selected (--steps)"
NO_TIME = "skipped: time budget"

JSON_NAME = "gpu-check.json"
LOGS_NAME = "gpu-check-logs.tar.gz"
#: Each log file keeps its last this many bytes in the tarball (the device tool brings back
#: files of at most 16 MiB).
LOG_TAIL = 2 << 20
#: The document's "host" (null until the setup probe says), then what else setup's result
#: adds to it, then what setup's result gives its own step.
HOST_KEYS = (
    "gpu",
    "gpu_uuid",
    "cuda_runtime",
    "cuda_driver",
    "cupy",
    "nixl_module",
    "nixl",
    "python",
    "ucx_env",
)
SETUP_HOST_KEYS = (
    *HOST_KEYS,
    "platform",
    "gpu_memory_bytes",
    "compute_capability",
    "nvidia_smi",
    "packages",
    "kvxferd",
    "cuda_visible_devices",
)
SETUP_STEP_KEYS = (
    "cuda",
    "why",
    "ipc_smoke",
    "vmm_smoke",
    "nixl_vram_register",
    "imports",
    "nixl_error",
    "kvxferd_device_probe",
    "device_count",
)


# -- what a step looks like before (or without) measurement ---------------------------------


def _rate_null() -> dict[str, Any]:
    return {"gbps": None, "p50_ms": None, "p99_ms": None, "verified": None}


def skeleton(step: str, status: str) -> dict[str, Any]:
    """A step's entry with every figure null: the shape readers can rely on."""
    base: dict[str, Any] = {"ok": False, "status": status, "seconds": None}
    if step == "setup":
        base.update(why=None, cuda=False, ipc_smoke=None, vmm_smoke=None, nixl_vram_register=None)
    elif step == "device_copy":
        base["memcpy_gbps"] = None
        for way in ("gather", "scatter"):
            base[way] = {
                s: {"cupy_gbps": None, "kernel_gbps": None, "verified": None} for s in SEGMENTS
            }
    elif step == "nixl_vram":
        base.update(module=None, writes={"64MiB": _rate_null(), "1GiB": _rate_null()})
    elif step == "foreign_memory":
        for kind in ("ipc", "vmm"):
            base[kind] = {"status": status, **dict.fromkeys(FOREIGN_FIGURES)}
    elif step == "kvxferd_bench":
        base.update(tokens=BENCH_TOKENS, request_bytes=None, command=None, configs={})
    return base


# -- the verdict -----------------------------------------------------------------------------


def get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _count(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _ratio(a: Any, b: Any) -> float | None:
    x, y = num(a), num(b)
    if x is None or y is None or y <= 0:
        return None
    return x / y


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def verdict(steps: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ratios, pass) from the steps' figures. A null input fails its criterion."""
    memcpy = num(get(steps, "device_copy", "memcpy_gbps"))
    nixl_1g = num(get(steps, "nixl_vram", "writes", "1GiB", "gbps"))
    configs = get(steps, "kvxferd_bench", "configs") or {}
    measured = {k: v for k, v in configs.items() if num(get(v, "gbps")) is not None}
    best_name = max(measured, key=lambda k: float(measured[k]["gbps"])) if measured else None
    best = measured[best_name] if best_name else None
    best_gbps = num(get(best, "gbps"))
    ratios: dict[str, Any] = {
        "best_config": best_name,
        "kvxferd_vs_nixl_1gib": _round(_ratio(best_gbps, nixl_1g)),
        "kvxferd_vs_bench_raw": _round(_ratio(best_gbps, get(best, "raw_gbps"))),
        "kvxferd_vs_memcpy": _round(_ratio(best_gbps, memcpy)),
        "gather_vs_memcpy": {},
        "scatter_vs_memcpy": {},
    }
    copy_ratios: list[float | None] = []
    for way in ("gather", "scatter"):
        for seg in SEGMENTS:
            r = _ratio(_copier_gbps(get(steps, "device_copy", way, seg) or {}), memcpy)
            ratios[f"{way}_vs_memcpy"][seg] = _round(r)
            copy_ratios.append(r)
    kv = _ratio(best_gbps, nixl_1g)
    failed = [get(v, "failed") for v in configs.values()]
    passed = {
        "kvxferd_ge_0_8_nixl": kv is not None and kv >= KVXFERD_MIN_RATIO,
        "gather_scatter_ge_half_copy": all(
            r is not None and r >= GATHER_MIN_RATIO for r in copy_ratios
        ),
        # Every configuration measured and none lost a request; an unknown count fails.
        "no_failed_requests": bool(failed) and all(_count(f) == 0 for f in failed),
    }
    passed["all"] = all(passed.values())
    return ratios, passed


def _copier_gbps(entry: dict[str, Any]) -> Any:
    """The rate of the copy the daemon's device copier makes of these rows: its row kernel
    where that ran and its bytes were right (rows of 512 B or more, as SEGMENTS are), else
    cupy's take / indexed assignment, which it falls back to."""
    if entry.get("kernel_verified") is True and num(entry.get("kernel_gbps")) is not None:
        return entry["kernel_gbps"]
    return entry.get("cupy_gbps")


def exit_code(doc: dict[str, Any]) -> int:
    """0 passed, 1 measured but failed, 2 incomplete (anything skipped, broken or unmeasured)."""
    if doc.get("skipped") or doc.get("errors"):
        return 2
    ratios = doc.get("ratios") or {}
    inputs = [
        ratios.get("kvxferd_vs_nixl_1gib"),
        *(ratios.get("gather_vs_memcpy") or {}).values(),
        *(ratios.get("scatter_vs_memcpy") or {}).values(),
    ]
    failed = [
        get(c, "failed") for c in (get(doc, "steps", "kvxferd_bench", "configs") or {}).values()
    ]
    if any(x is None for x in inputs) or len(inputs) < 1 + 2 * len(SEGMENTS) or not failed:
        return 2
    if any(_count(f) is None for f in failed):
        return 2
    return 0 if get(doc, "pass", "all") else 1
