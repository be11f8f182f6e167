"""A generation daemon stopped (SIGSTOP) mid-receive: how long does the context daemon's
next request to ANOTHER generation daemon take meanwhile?

Three daemons on loopback (staged runtime, 512 KiB staging regions, heartbeat timeout
1.5 s, kv_transfer_timeout 3 s): gen1 asks ctx for a scattered 3,000-block request and is
stopped as soon as its first blocks land; then gen2 asks ctx for 500 blocks, and gen1 is
resumed once that ended. A request to gen2 that waits for ctx's send room held by the
rounds in flight to gen1 ends only when gen1 is declared lost (~1.5-2 s) or at its
deadline. Per backend: the other request's outcome and time, over `--stops` stops.

Usage: .venv/bin/python benchmarks/stalled_receiver.py [--backends UCX MPI] [--stops 8]
(Run from another worktree with PYTHONPATH set to it, `cd <tree> && PYTHONPATH=<tree>
.venv/bin/python <this script>`, it runs that tree's daemons: `python -m` puts the
working directory first on sys.path, as benchmarks/checkouts.py does.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from issue11_fencing import BIG, Engine, start, status, until

from kvxferd.sim.cluster import DaemonProc, LocalCluster


def config(backend: str) -> dict[str, dict[str, object]]:
    return {
        "transceiver": {
            "backend": backend,
            "transceiver_runtime": "CPP",
            "max_tokens_in_buffer": 64,
            "kv_transfer_timeout_ms": 3000,
        },
        "daemon": {"heartbeat_interval_ms": 300, "heartbeat_timeout_ms": 1500},
    }


async def stop_when_written(d: DaemonProc, g: Engine, blocks: list[int]) -> None:
    """SIGSTOP `d` as soon as the first of `blocks` holds a byte."""
    (o0, n0) = g.layout.block_segments(blocks)[0]
    first = g.pool[int(o0) : int(o0 + n0)]

    def spin() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if first.any():
                os.kill(d.proc.pid, signal.SIGSTOP)
                return
        raise RuntimeError("the write never started")

    await asyncio.to_thread(spin)


async def one_backend(workdir: Path, backend: str, stops: int) -> list[tuple[str, float]]:
    rows: list[tuple[str, float]] = []
    with LocalCluster(workdir) as cluster:
        cfg = config(backend)
        ctx = cluster.start_daemon("ctx", "context", **cfg)
        gen1 = cluster.start_daemon("gen1", "generation", **cfg)
        gen2 = cluster.start_daemon("gen2", "generation", **cfg)
        c, g1, g2 = await Engine.open(ctx), await Engine.open(gen1), await Engine.open(gen2)
        big, other = g1.alloc.take(BIG), g2.alloc.take(500)
        for i in range(stops):
            taken = await start(c, ctx, g1, f"big{i}", big)
            await stop_when_written(gen1, g1, big)
            t0 = time.monotonic()
            taken += await start(c, ctx, g2, f"other{i}", other)
            try:
                got = await g2.client.wait(f"other{i}", 30)
                rows.append((f"{got.status}/{got.reason}", time.monotonic() - t0))
            finally:
                gen1.kill(signal.SIGCONT)
            for e, rid in ((g1, f"big{i}"), (g2, f"other{i}"), (c, f"big{i}"), (c, f"other{i}")):
                await e.client.wait(rid, 30)
                await e.client.release(rid)
            c.alloc.give(taken)
            await until(lambda: status(ctx)["staging"]["send_in_use_bytes"] == 0)
            await until(lambda: status(gen1)["holds"]["requests"] == 0)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", nargs="+", default=["UCX", "MPI", "MOONCAKE", "NIXL"])
    ap.add_argument("--stops", type=int, default=8)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvxferd-stalled-rx-"))
    for backend in args.backends:
        rows = asyncio.run(one_backend(base / backend, backend, args.stops))
        times = [t for _, t in rows]
        outcomes = sorted({o for o, _ in rows})
        slow = sum(t > 1.0 for t in times)
        print(
            f"{backend:8} other request while gen1 stopped: median {statistics.median(times):.2f}"
            f" s, max {max(times):.2f} s, over 1 s in {slow} of {len(rows)}; outcomes "
            f"{', '.join(outcomes)}",
            flush=True,
        )
    print(f"daemon logs under {base}")


if __name__ == "__main__":
    main()
