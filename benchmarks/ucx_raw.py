"""UCX transport (kvxferd.backends.ucx) by ucxx progress mode: throughput and idle CPU.

Two processes on loopback per run, one UcxTransport each. After connecting,
both sit idle for --idle seconds while their CPU time is measured; then the
sender sends --count messages of --mib MiB (after one warm-up message), one at
a time, and the receiver times them. Modes are interleaved over --reps runs
and the medians reported, since the dev hosts are shared and noisy.

    .venv/bin/python benchmarks/ucx_raw.py [--modes blocking,thread,polling] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

MIB = 1 << 20


async def _idle_cpu(seconds: float) -> float:
    """Percent of one core this process used while its loop had nothing to do."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    await asyncio.sleep(seconds)
    return 100.0 * (time.process_time() - cpu0) / (time.monotonic() - wall0)


async def _receiver(count: int, size: int, idle: float) -> dict[str, float | str | None]:
    from kvxferd.backends.ucx import UcxTransport

    t = UcxTransport("bench-rx", "1")
    print(json.dumps({"address": await t.start()}), flush=True)
    while "bench-tx/1" not in t.peers():
        await asyncio.sleep(0.01)
    idle_cpu = await _idle_cpu(idle)
    out = memoryview(bytearray(size))
    await t.recv("bench-tx/1", 0, out, 60)  # warm-up
    cpu0, t0 = time.process_time(), time.perf_counter()
    for i in range(count):
        await t.recv("bench-tx/1", i + 1, out, 60)
    dt = time.perf_counter() - t0
    busy_cpu = 100.0 * (time.process_time() - cpu0) / dt
    # send() returning only frees the sender's buffer; it must not close
    # before the last message is in.
    await t.send("bench-tx/1", 0, memoryview(b"k"))
    await t.close()
    return {
        "mode": t.progress_mode,
        "gbps": count * size / dt / 1e9,
        "rx_idle_cpu": idle_cpu,
        "rx_busy_cpu": busy_cpu,
    }


async def _sender(address: str, count: int, size: int, idle: float) -> dict[str, float]:
    from kvxferd.backends.ucx import UcxTransport

    t = UcxTransport("bench-tx", "1")
    await t.connect("bench-rx/1", address, 10)
    idle_cpu = await _idle_cpu(idle)
    data = memoryview(os.urandom(size))
    for i in range(count + 1):
        await t.send("bench-rx/1", i, data)
    await t.recv("bench-rx/1", 0, memoryview(bytearray(1)), 60)
    await t.close()
    return {"tx_idle_cpu": idle_cpu}


def _run_once(mode: str, count: int, mib: int, idle: float) -> dict[str, float | str | None]:
    env = {**os.environ, "UCXPY_PROGRESS_MODE": mode}
    common = ["--count", str(count), "--mib", str(mib), "--idle", str(idle)]
    rx = subprocess.Popen(
        [sys.executable, __file__, "--role", "rx", *common],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert rx.stdout is not None
    address = json.loads(rx.stdout.readline())["address"]
    tx = subprocess.run(
        [sys.executable, __file__, "--role", "tx", "--address", address, *common],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    res: dict[str, float | str | None] = json.loads(rx.stdout.readline())
    rx.wait(timeout=60)
    res.update(json.loads(tx.stdout.strip().splitlines()[-1]))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="blocking,thread,polling,thread-polling")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--count", type=int, default=8)
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--idle", type=float, default=3.0)
    p.add_argument("--role", choices=["rx", "tx"], help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    a = p.parse_args()
    size = a.mib * MIB
    if a.role == "rx":
        print(json.dumps(asyncio.run(_receiver(a.count, size, a.idle))), flush=True)
        return
    if a.role == "tx":
        print(json.dumps(asyncio.run(_sender(a.address, a.count, size, a.idle))), flush=True)
        return

    modes = a.modes.split(",")
    runs: dict[str, list[dict[str, float | str | None]]] = {m: [] for m in modes}
    for rep in range(a.reps):
        for mode in modes:
            r = _run_once(mode, a.count, a.mib, a.idle)
            runs[mode].append(r)
            print(f"rep {rep} {json.dumps(r)}", file=sys.stderr, flush=True)

    def med(mode: str, key: str) -> float:
        return statistics.median(float(r[key] or 0.0) for r in runs[mode])

    print(
        f"{a.count} x {a.mib} MiB, two processes on loopback, median of {a.reps}; "
        f"idle = % of one core over {a.idle:g}s with a connected transport"
    )
    print(
        f"{'mode':<16}{'GB/s':>8}{'GB/s min-max':>16}{'rx idle %':>11}{'tx idle %':>11}"
        f"{'rx busy %':>11}"
    )
    for mode in modes:
        g = [float(r["gbps"] or 0.0) for r in runs[mode]]
        print(
            f"{mode:<16}{med(mode, 'gbps'):>8.2f}{f'{min(g):.2f}-{max(g):.2f}':>16}"
            f"{med(mode, 'rx_idle_cpu'):>11.1f}{med(mode, 'tx_idle_cpu'):>11.1f}"
            f"{med(mode, 'rx_busy_cpu'):>11.1f}"
        )


if __name__ == "__main__":
    main()
