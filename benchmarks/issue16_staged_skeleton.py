"""Issue 16, the staged runtime over a one-sided backend (NIXL or Mooncake): what the
staged design moves on this host, without kvxferd's protocol around it.

Two processes with an agent each (kvxferd.backends.nixl.NixlBackend, UCX over shared
memory with CMA, or kvxferd.backends.mooncake.MooncakeBackend, TCP: the daemons' own
adapters) move a 1 GiB pool (shared memory, 4 KiB pages, as the engines' pools) in three
ways, alternating:

  bare-1    one write of the whole pool, pool to pool;
  bare      16 MiB writes (`--round-mib`), pool to pool, one after the other;
  staged    the staged runtime's copies around 16 MiB writes: the sender copies (gathers)
            each round into a slot of its staging ring on a copy thread, ahead of the
            writes, writes it into a slot of the receiver's ring, and tells the receiver
            over a pipe; the receiver copies (scatters) the slot into its pool and
            acknowledges it; a slot takes a later round only once acknowledged.

`--in-flight K` (staged only) keeps up to K writes in flight, and the copy thread gathers
up to K rounds ahead; kvxferd's one-sided staged runtime keeps one write in flight per
request (K = 1). Writes are polled busily over NIXL (as the first version of this script)
and, over Mooncake, as the daemons poll (0.1 ms, doubling to 2 ms: a busy poll takes a core
from Mooncake's TCP workers, docs/benchmarks.md). The copies are plain 16 MiB memcpys
(np.copyto), the best case of a gather or a scatter. No event loop, no peer messages but the
pipe: if `staged` here moves little more than `kvxferd bench --configs X-cpp`, the copies
and the transport sharing the cores bound it, not kvxferd's own work.

    .venv/bin/python benchmarks/issue16_staged_skeleton.py [--backend nixl|mooncake]
        [--passes 3] [--slots 8] [--in-flight 1]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

TOTAL = 1 << 30
# The daemons' one-sided poll schedule (kvxferd/transceiver/writes.py).
POLL_FIRST_S = 0.0001
POLL_MAX_S = 0.002


def _backend(kind: str, name: str) -> Any:
    if kind == "nixl":
        from kvxferd.backends.nixl import NixlBackend

        return NixlBackend(name)
    from kvxferd.backends.mooncake import MooncakeBackend

    return MooncakeBackend(name, "127.0.0.1", 60000)


class Writer:
    """Posts 16 MiB writes to the peer and says when they are done, polling as `kind`'s
    daemons would."""

    def __init__(self, kind: str, backend: Any, peer: str, segments: int = 1) -> None:
        self.busy = kind == "nixl"
        self.backend = backend
        self.peer = peer
        self.segments = segments

    def post(self, local: int, remote: int, nbytes: int) -> Any:
        k = self.segments
        step = nbytes // k
        offsets = np.arange(k, dtype=np.int64) * step
        sizes = np.full(k, step, np.int64)
        sizes[-1] = nbytes - step * (k - 1)
        segs = (np.stack([local + offsets, sizes], 1), np.stack([remote + offsets, sizes], 1))
        handle, _ = self.backend.post_write(*segs, self.peer)
        return handle

    def done(self, handle: Any) -> bool:
        from kvxferd.backends.base import XferStatus

        status = self.backend.poll(handle)
        if status is XferStatus.IN_PROGRESS:
            return False
        self.backend.release(handle)
        if status is not XferStatus.DONE:
            raise RuntimeError(f"the write ended {status.name}")
        return True

    def wait(self, ready: Callable[[], bool]) -> None:
        """Until ready(): busily, or on the daemons' schedule."""
        pause = POLL_FIRST_S
        while not ready():
            if not self.busy:
                time.sleep(pause)
                pause = min(pause * 2, POLL_MAX_S)

    def write(self, local: int, remote: int, nbytes: int) -> None:
        handle = self.post(local, remote, nbytes)
        self.wait(lambda: self.done(handle))


def _regions(tag: str, slots: int, round_bytes: int) -> tuple[Any, Any]:
    from kvxferd.memory.shm import ShmRegion

    pool = ShmRegion.create(f"kvxferd-skel-{tag}-pool-{os.getpid()}", TOTAL)
    ring = ShmRegion.create(f"kvxferd-skel-{tag}-ring-{os.getpid()}", slots * round_bytes)
    for r in (pool, ring):
        r.unlink()
        r.array[:] = 1  # touched: no page faults while timed
    return pool, ring


def receiver(conn: Connection, kind: str, slots: int, round_bytes: int) -> None:
    backend = _backend(kind, f"skel-rx-{os.getpid()}")
    pool, ring = _regions("rx", slots, round_bytes)
    backend.register(pool.address, TOTAL)
    backend.register(ring.address, slots * round_bytes)
    conn.send((backend.metadata(), pool.address, ring.address))
    while (msg := conn.recv()) != "quit":
        if msg == "staged":
            for i in range(TOTAL // round_bytes):
                assert conn.recv() == i
                s, p = (i % slots) * round_bytes, i * round_bytes
                np.copyto(pool.array[p : p + round_bytes], ring.array[s : s + round_bytes])
                conn.send(i)
        conn.send("end")
    backend.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", choices=("nixl", "mooncake"), default="nixl")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--in-flight", type=int, default=1)
    ap.add_argument("--round-mib", type=int, default=16)
    ap.add_argument("--segments", type=int, default=1, help="segments per write")
    args = ap.parse_args()
    round_bytes = args.round_mib << 20
    if TOTAL % round_bytes:
        ap.error("--round-mib must divide 1024")
    if not 1 <= args.in_flight < args.slots:
        ap.error("--in-flight must be at least 1 and under --slots")

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(there, args.backend, args.slots, round_bytes))
    proc.start()
    meta, rpool, rring = here.recv()
    backend = _backend(args.backend, f"skel-tx-{os.getpid()}")
    pool, ring = _regions("tx", args.slots, round_bytes)
    backend.register(pool.address, TOTAL)
    backend.register(ring.address, args.slots * round_bytes)
    peer = backend.add_peer(meta)
    backend.connect(peer)
    writer = Writer(args.backend, backend, peer, args.segments)
    copier = concurrent.futures.ThreadPoolExecutor(1)
    n, slots, depth = TOTAL // round_bytes, args.slots, args.in_flight

    def bare_one() -> None:
        writer.write(pool.address, rpool, TOTAL)

    def bare() -> None:
        for i in range(n):
            writer.write(pool.address + i * round_bytes, rpool + i * round_bytes, round_bytes)

    def staged() -> None:
        acked = -1  # the receiver scattered rounds up to this one
        gathers: dict[int, concurrent.futures.Future[None]] = {}
        writes: list[tuple[int, Any]] = []  # (round, handle), in round order
        gathered = posted = finished = 0

        def gather(i: int) -> None:
            s, p = (i % slots) * round_bytes, i * round_bytes
            np.copyto(ring.array[s : s + round_bytes], pool.array[p : p + round_bytes])

        def step() -> bool:
            """Move whatever can move; True once every round is acknowledged."""
            nonlocal acked, gathered, posted, finished
            # Never past the last acknowledgement: "end" follows it on the pipe.
            while acked < n - 1 and here.poll():
                acked = here.recv()
            # Gather ahead into slots whose round the receiver has acknowledged (both
            # rings use the same slot for a round).
            while gathered < n and gathered < posted + depth and acked >= gathered - slots:
                gathers[gathered] = copier.submit(gather, gathered)
                gathered += 1
            while (
                posted < gathered
                and len(writes) < depth
                and gathers[posted].done()
                and acked >= posted - slots
            ):
                gathers.pop(posted).result()
                s = (posted % slots) * round_bytes
                writes.append((posted, writer.post(ring.address + s, rring + s, round_bytes)))
                posted += 1
            # Rounds are announced in order: the receiver scatters them in order.
            while writes and writer.done(writes[0][1]):
                here.send(writes.pop(0)[0])
                finished += 1
            return finished == n and acked == n - 1

        writer.wait(step)

    ways = {"bare-1": bare_one, "bare": bare, "staged": staged}
    order = list(ways)
    print(
        f"backend {args.backend}, {args.round_mib} MiB rounds, {args.segments} segment(s) a "
        f"write, staged with {depth} write(s) in flight",
        flush=True,
    )
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
