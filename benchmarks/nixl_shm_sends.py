"""Does a NIXL daemon send anything through UCX's shared-memory receive queue, from the
moment it first meets a peer?

Over MPI, a process stopped or killed inside a UCX shared-memory send holds up its
receiver's one receive queue, and with it every later message from every peer on the host
(docs/backends-mpi.md, "A peer stopped or killed inside a shared-memory send"). A NIXL
daemon writes through CMA (or RDMA), which needs no receiver; this checks the rest: the
UCX endpoints' wire-up when two daemons first move a request, and the requests after it.
gdb attaches to both daemons before they have met, with a breakpoint on each of UCX's
shared-memory sends (uct_mm_ep_am_short, _short_iov, _bcopy) that logs and goes on; then
the generation daemon receives three requests (1, 64 and 1,000 blocks, PYTHON runtime)
from the context daemon, and the sends each daemon made are counted.

What it found (results/2026-12-07/nixl_shm_sends.txt): none, on either side. NIXL creates
its UCX endpoints with peer failure handling, which UCX's shared-memory transports do not
have ("posix/memory - no peer failure handler" when UCX_TLS offers nothing else): active
messages, the wire-up's included, go over TCP on one host, and writes through CMA.

Usage: .venv/bin/python benchmarks/nixl_shm_sends.py    (needs gdb)
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from issue11_fencing import Engine, start, status, until

from kvxferd.sim.cluster import LocalCluster

CONFIG = {
    "transceiver": {
        "backend": "NIXL",
        "transceiver_runtime": "PYTHON",
        "kv_transfer_timeout_ms": 3000,
    },
    "daemon": {"heartbeat_interval_ms": 300, "heartbeat_timeout_ms": 1500},
}
SENDS = ("uct_mm_ep_am_short", "uct_mm_ep_am_short_iov", "uct_mm_ep_am_bcopy")


def log_sends(pid: int) -> subprocess.Popen[str]:
    """gdb on `pid`, logging a backtrace at every UCX shared-memory send; returns once armed."""
    cmds = [
        "set pagination off",
        *(f"break {f}" for f in SENDS),
        f"commands 1-{len(SENDS)}\nsilent\nbt 8\ncontinue\nend",
        "info breakpoints",
        "echo ARMED\\n",
        "continue",
    ]
    args = ["gdb", "-p", str(pid), "-batch", "-nx"] + [a for c in cmds for a in ("-ex", c)]
    gdb = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert gdb.stdout is not None
    armed: list[str] = []
    for line in gdb.stdout:
        if "breakpoint     keep y" in line:
            armed.append(line.split("<")[-1].rstrip(">\n"))
        if "ARMED" in line:
            if sorted(armed) != sorted(SENDS):
                raise RuntimeError(f"gdb set breakpoints on {armed}, not on all of {SENDS}")
            return gdb
    raise RuntimeError(f"gdb could not break on UCX's shared-memory sends in {pid}")


async def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="kvxferd-nixl-shm-"))
    with LocalCluster(workdir) as cluster:
        gen = cluster.start_daemon("gen", "generation", **CONFIG)
        ctx = cluster.start_daemon("ctx", "context", **CONFIG)
        g = await Engine.open(gen)
        watching = {
            name: await asyncio.to_thread(log_sends, d.proc.pid)
            for name, d in (("ctx", ctx), ("gen", gen))
        }
        # Not met yet: the generation daemon dials the context daemon at its first receive.
        assert not status(ctx)["peers"] and not status(gen)["peers"], "the daemons already met"
        c = await Engine.open(ctx)
        for i, n in enumerate((1, 64, 1000)):
            blocks = g.alloc.take(n)
            t0 = time.monotonic()
            mine = await start(c, ctx, g, f"r{i}", blocks)
            got = await g.client.wait(f"r{i}", 30)
            print(f"request of {n} block(s): {got.status}/{got.reason} in "
                  f"{time.monotonic() - t0:.3f} s")  # fmt: skip
            c.alloc.give(mine)
            await g.client.release(f"r{i}")
            g.alloc.give(blocks)
        await until(lambda: len(status(ctx)["peers"]) == 1)
        for name, gdb in watching.items():
            gdb.send_signal(signal.SIGINT)
            out = await asyncio.to_thread(lambda gdb=gdb: gdb.communicate(timeout=30)[0])
            frames = [line for line in out.splitlines() if line.startswith("#")]
            sends = [line for line in frames if line.startswith("#0")]
            print(f"{name}: {len(sends)} UCX shared-memory send(s)")
            for line in frames[:40]:
                print("   ", line[:160])
    print(f"daemon logs under {workdir}")


if __name__ == "__main__":
    asyncio.run(main())
