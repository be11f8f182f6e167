"""Issue 16, staged NIXL: what the staged design moves over NIXL on this host, without
kvxferd's protocol around it.

Two processes with a NIXL agent each (kvxferd.backends.nixl.NixlBackend, UCX over shared
memory with CMA, as the daemons) move a 1 GiB pool (shared memory, 4 KiB pages, as the
engines' pools) in three ways, alternating:

  bare-1    one write of the whole pool, pool to pool;
  bare      16 MiB writes, pool to pool, one after the other;
  staged    the staged runtime's copies around 16 MiB writes: the sender copies (gathers)
            each round into a slot of its staging ring on a copy thread, one round ahead
            of the writes, writes it into a slot of the receiver's ring, and tells the
            receiver over a pipe; the receiver copies (scatters) the slot into its pool and
            acknowledges it; a slot takes a later round only once acknowledged.

Writes are busy-polled to DONE, one at a time (as kvxferd's one-sided staged runtime: one
write, then its Result). The copies are plain 16 MiB memcpys (np.copyto), the best case of
a gather or a scatter. No event loop, no peer messages but the pipe: if `staged` here
moves little more than `kvxferd bench --configs nixl-cpp`, the copies and the transport
sharing the cores bound it, not kvxferd's own work.

    .venv/bin/python benchmarks/issue16_staged_nixl_skeleton.py [--passes 3] [--slots 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing as mp
import os
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

TOTAL = 1 << 30
ROUND = 16 << 20


def _write(backend: Any, peer: str, local: int, remote: int, nbytes: int) -> None:
    from kvxferd.backends.base import XferStatus

    segs = (np.array([[local, nbytes]], np.int64), np.array([[remote, nbytes]], np.int64))
    handle, status = backend.post_write(*segs, peer)
    while status is XferStatus.IN_PROGRESS:
        status = backend.poll(handle)
    backend.release(handle)
    if status is not XferStatus.DONE:
        raise RuntimeError("NIXL reported an error")


def _regions(tag: str, slots: int) -> tuple[Any, Any]:
    from kvxferd.memory.shm import ShmRegion

    pool = ShmRegion.create(f"kvxferd-skel-{tag}-pool-{os.getpid()}", TOTAL)
    ring = ShmRegion.create(f"kvxferd-skel-{tag}-ring-{os.getpid()}", slots * ROUND)
    for r in (pool, ring):
        r.unlink()
        r.array[:] = 1  # touched: no page faults while timed
    return pool, ring


def receiver(conn: Connection, slots: int) -> None:
    from kvxferd.backends.nixl import NixlBackend

    backend = NixlBackend(f"skel-rx-{os.getpid()}")
    pool, ring = _regions("rx", slots)
    backend.register(pool.address, TOTAL)
    backend.register(ring.address, slots * ROUND)
    conn.send((backend.metadata(), pool.address, ring.address))
    while (msg := conn.recv()) != "quit":
        if msg == "staged":
            for i in range(TOTAL // ROUND):
                assert conn.recv() == i
                s = (i % slots) * ROUND
                np.copyto(pool.array[i * ROUND : (i + 1) * ROUND], ring.array[s : s + ROUND])
                conn.send(i)
        conn.send("end")
    backend.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--slots", type=int, default=8)
    args = ap.parse_args()
    from kvxferd.backends.nixl import NixlBackend

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(there, args.slots))
    proc.start()
    meta, rpool, rring = here.recv()
    backend = NixlBackend(f"skel-tx-{os.getpid()}")
    pool, ring = _regions("tx", args.slots)
    backend.register(pool.address, TOTAL)
    backend.register(ring.address, args.slots * ROUND)
    peer = backend.add_peer(meta)
    backend.connect(peer)
    copier = concurrent.futures.ThreadPoolExecutor(1)
    n, slots = TOTAL // ROUND, args.slots

    def bare_one() -> None:
        _write(backend, peer, pool.address, rpool, TOTAL)

    def bare() -> None:
        for i in range(n):
            _write(backend, peer, pool.address + i * ROUND, rpool + i * ROUND, ROUND)

    def staged() -> None:
        acked = -1

        def gather(i: int) -> None:
            s = (i % slots) * ROUND
            np.copyto(ring.array[s : s + ROUND], pool.array[i * ROUND : (i + 1) * ROUND])

        ahead = copier.submit(gather, 0)
        for i in range(n):
            ahead.result()
            if i + 1 < n:
                while acked < i + 1 - slots:  # the slot it gathers into was acknowledged
                    acked = here.recv()
                ahead = copier.submit(gather, i + 1)
            s = (i % slots) * ROUND
            # The receiver's slot i % slots: free once it acknowledged round i - slots.
            while acked < i - slots:
                acked = here.recv()
            _write(backend, peer, ring.address + s, rring + s, ROUND)
            here.send(i)
        while acked < n - 1:
            acked = here.recv()

    ways = {"bare-1": bare_one, "bare": bare, "staged": staged}
    order = list(ways)
    for p in range(args.passes):
        for name in order[p % 3 :] + order[: p % 3]:
            runs = []
            for k in range(4):  # the first one warms up
                here.send(name)
                t0 = time.perf_counter()
                ways[name]()
                assert here.recv() == "end"
                if k:
                    runs.append(TOTAL / (time.perf_counter() - t0) / 1e9)
            shown = ", ".join(f"{g:.2f}" for g in sorted(runs))
            print(f"pass {p + 1} {name:7s}: GB/s {shown}", flush=True)
    here.send("quit")
    proc.join()
    copier.shutdown()
    backend.close()


if __name__ == "__main__":
    main()
