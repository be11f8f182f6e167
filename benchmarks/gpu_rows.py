"""Device gather/scatter rates: device_rows' kernel against cupy's take / indexed assignment
(what ArrayCopier does without it), and a device-to-device memcpy of the same bytes.

Run on a GPU (benchmarks/gpu_session.sh does): prints one line per (row size, copy) with GB/s
(bytes copied over time, medians of ITER launches timed with CUDA events) and the ratio to
memcpy, and checks that kernel and take produce the same bytes. Usage:
    python benchmarks/gpu_rows.py [--mib 1000] [--iters 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxferd.bench.gpu_buffers import time_device
from kvxferd.transceiver.copyplan import copy_plan, word_rows
from kvxferd.transceiver.device_rows import RowKernel


def timed(fn: Callable[[], object], iters: int) -> float:
    """Median seconds of fn() over `iters` launches, each timed alone with CUDA events on a
    stream of its own (gpu_buffers.time_device, as the GPU check times its copies)."""
    return statistics.median(time_device(fn, 1, iters)) / 1e3


def measure(cp: Any, kernel: RowKernel, unit: int, nbytes: int, iters: int) -> list[dict[str, Any]]:
    """Each copy of `nbytes` in rows of `unit` bytes (a shuffled fifth of the pool left out)."""
    count = nbytes // unit
    pool_rows = count + count // 5
    index = cp.asarray(np.random.default_rng(1).permutation(pool_rows)[:count].astype(np.int64))
    pool = cp.random.randint(0, 256, pool_rows * unit, dtype=cp.uint8)
    packed = cp.zeros(count * unit, dtype=cp.uint8)
    other = cp.empty_like(packed)
    word, row = word_rows(unit)
    pool_w, packed_w = pool.view(word).reshape(-1, row), packed.view(word).reshape(-1, row)
    cp.cuda.Device().synchronize()  # the timed stream does not wait for these fills
    runs: dict[str, Callable[[], object]] = {
        "memcpy": lambda: other.__setitem__(slice(None), packed),
        "take gather": lambda: cp.take(pool_w, index, axis=0, out=packed_w),
        "kernel gather": lambda: kernel(pool, packed, index, unit, False),
        "assign scatter": lambda: pool_w.__setitem__(index, packed_w),
        "kernel scatter": lambda: kernel(pool, packed, index, unit, True),
    }
    seconds = {name: timed(fn, iters) for name, fn in runs.items()}
    cp.take(pool_w, index, axis=0, out=packed_w)
    want = cp.asnumpy(packed)
    packed[:] = 0
    kernel(pool, packed, index, unit, False)
    same = bool(np.array_equal(cp.asnumpy(packed), want))
    return [
        {
            "unit": unit,
            "copy": name,
            "gbps": round(count * unit / s / 1e9, 1),
            "ms": round(s * 1e3, 3),
            "vs_memcpy": round(seconds["memcpy"] / s, 3),
            "kernel_bytes_match_take": same,
        }
        for name, s in seconds.items()
    ]


def cupyx_pinned(cp: Any, like: np.ndarray) -> np.ndarray:
    """A numpy array shaped as `like` in page-locked host memory."""
    mem = cp.cuda.alloc_pinned_memory(like.nbytes)
    return np.frombuffer(mem, like.dtype, like.size).reshape(like.shape)


def launch_costs(cp: Any, reps: int = 200) -> dict[str, float]:
    """Microseconds of host time (median of `reps`, the stream idle before each) for the
    pieces of one bounce copy's launch from the loop: a 250-block plan's index to the
    device, the kernel's launch, an event made and recorded, and DeviceCopier's whole
    deferred launch (what on_loop does before it awaits) of a 1000 MiB gather."""
    import time

    from kvxferd.memory.layout import BLOCK_MAJOR, KvLayout
    from kvxferd.transceiver.device_copy import DeviceCopier

    layout = KvLayout(
        num_layers=32, kv_factor=2, num_kv_heads=8, head_dim=128, tokens_per_block=32,
        dtype="float16", major=BLOCK_MAJOR, num_blocks=300,
    )  # fmt: skip
    blocks = [int(b) for b in np.random.default_rng(2).permutation(300)[:250]]
    pool = cp.zeros(layout.pool_bytes, dtype=cp.uint8)
    out = cp.zeros(250 * layout.block_bytes, dtype=cp.uint8)
    index_np = np.asarray(blocks, dtype=np.int64)
    index = cp.asarray(index_np)
    kernel = RowKernel(cp)
    copier = DeviceCopier(0)
    copier.warm()
    stream = cp.cuda.Stream(non_blocking=True)

    def event() -> None:
        e = cp.cuda.Event(block=False, disable_timing=True)
        e.record(stream)

    def deferred() -> None:
        copier.launch(copier.gather, pool, layout, blocks, out)

    pinned = cupyx_pinned(cp, index_np)
    into = cp.empty_like(index)

    def pinned_upload() -> None:
        pinned[:] = index_np
        into.set(pinned, stream)

    pieces: dict[str, Callable[[], object]] = {
        "copy_plan_us": lambda: copy_plan(layout, blocks),
        "index_to_device_us": lambda: cp.asarray(index_np),
        "index_via_pinned_us": pinned_upload,
        "kernel_launch_us": lambda: kernel(pool, out, index, layout.block_bytes, False),
        "event_record_us": event,
        "whole_deferred_launch_us": deferred,
    }
    result = {}
    with stream:
        for name, fn in pieces.items():
            fn()
            times = []
            for _ in range(reps):
                cp.cuda.Device().synchronize()
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            result[name] = round(statistics.median(times) * 1e6, 1)
    cp.cuda.Device().synchronize()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--mib", type=int, default=1000, help="bytes copied per launch")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default="", help="also write the rows here")
    args = ap.parse_args()
    import cupy as cp

    kernel = RowKernel(cp)
    out: list[dict[str, Any]] = []
    for unit in (4 << 20, 64 << 10, 4 << 10):
        rows = measure(cp, kernel, unit, args.mib << 20, args.iters)
        for r in rows:
            print(json.dumps(r), flush=True)
        out += rows
        cp.get_default_memory_pool().free_all_blocks()
    launch = launch_costs(cp)
    print(json.dumps(launch), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copies": out, "launch": launch}, f, indent=1)


if __name__ == "__main__":
    main()
