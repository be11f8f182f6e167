"""Issue 16, staged MPI: what the staged design moves over MPI on this host, without
kvxferd's protocol around it.

Two ranks (one mpiexec, over the daemons' transport: ucx netmod, UCX shared memory
without CMA) move a 1 GiB "pool" as 16 MiB rounds, `--depth` in flight, each round
completed by a thread blocked in MPI_Waitany (as kvxferd's progress thread since
2026-12-04), in two ways, alternating:

  bare     each round sent straight from the sender's pool into the receiver's;
  staged   the staged runtime's copies around it: the sender copies (gathers) each round
           into a slot of a staging ring on a copy thread, one round ahead of the sends,
           and sends it from there; the receiver receives into a slot of its own ring and
           copies (scatters) it into its pool, posting the receive of a
           later round into a slot once the round that slot held was scattered.

Both copies are plain memcpys of 16 MiB (np.copyto), the best case of a gather or a
scatter. No headers, no announcements, no acknowledgements over TCP, no event loop: if
`staged` here moves little more than `kvxferd bench --configs mpi-cpp`, the copies and the
transport sharing the cores are what bound it, not kvxferd's own work.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/issue16_staged_mpi_skeleton.py \\
        [--depth 4] [--passes 3]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import threading
import time
from collections.abc import Callable

import numpy as np
from mpi_daemon_env import MPI

TOTAL = 1 << 30
ROUND = 16 << 20
WAKE_TAG = 7


class Waiter:
    """A thread completing requests in MPI_Waitany; `hand(req, done)` calls done() on it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.new: list[tuple[MPI.Request, Callable[[], None]]] = []
        self.waiting = False
        self.stop = False
        self.selfcomm = MPI.COMM_SELF.Dup()
        self.byte = bytearray(1)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def hand(self, req: MPI.Request, done: Callable[[], None]) -> None:
        with self.lock:
            self.new.append((req, done))
            wake, self.waiting = self.waiting, False
        if wake:
            self.selfcomm.Send([self.byte, MPI.BYTE], 0, WAKE_TAG)

    def close(self) -> None:
        with self.lock:
            self.stop = True
        self.thread.join()

    def run(self) -> None:
        held: list[tuple[MPI.Request, Callable[[], None]]] = []
        inbox = bytearray(1)
        wake = self.selfcomm.Irecv([inbox, MPI.BYTE], 0, WAKE_TAG)
        while True:
            with self.lock:
                if self.stop and not held and not self.new:
                    return
                held.extend(self.new)
                self.new.clear()
                self.waiting = bool(held)
            if not held:
                time.sleep(0.0001)
                continue
            index = MPI.Request.Waitany([wake, *(r for r, _ in held)])
            with self.lock:
                self.waiting = False
            if index == 0:
                wake = self.selfcomm.Irecv([inbox, MPI.BYTE], 0, WAKE_TAG)
            else:
                held.pop(index - 1)[1]()


class Counter:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.n = 0

    def bump(self) -> None:
        with self.cond:
            self.n += 1
            self.cond.notify_all()

    def wait_for(self, n: int) -> None:
        with self.cond:
            while self.n < n:
                self.cond.wait()


def send_side(pool: np.ndarray, ring: np.ndarray, staged: bool, depth: int) -> None:
    comm, waiter = MPI.COMM_WORLD, WAITER
    n, slots = TOTAL // ROUND, ring.size // ROUND
    sent = Counter()

    def slot(i: int) -> np.ndarray:
        return ring[(i % slots) * ROUND : (i % slots + 1) * ROUND]

    def gather(i: int) -> None:
        np.copyto(slot(i), pool[i * ROUND : (i + 1) * ROUND])

    ahead = COPIER.submit(gather, 0) if staged else None
    for i in range(n):
        sent.wait_for(i + 1 - depth)  # at most `depth` in flight
        if staged:
            assert ahead is not None
            ahead.result()
            if i + 1 < n:
                sent.wait_for(i + 2 - slots)  # the slot it gathers into was sent
                ahead = COPIER.submit(gather, i + 1)
            buf = slot(i)
        else:
            buf = pool[i * ROUND : (i + 1) * ROUND]
        waiter.hand(comm.Isend([buf, MPI.BYTE], 1, i), sent.bump)
    sent.wait_for(n)


def recv_side(pool: np.ndarray, ring: np.ndarray, staged: bool, depth: int) -> None:
    comm, waiter = MPI.COMM_WORLD, WAITER
    n, slots = TOTAL // ROUND, ring.size // ROUND
    got = Counter()

    def target(i: int) -> np.ndarray:
        if staged:
            return ring[(i % slots) * ROUND : (i % slots + 1) * ROUND]
        return pool[i * ROUND : (i + 1) * ROUND]

    for i in range(min(depth, n)):
        waiter.hand(comm.Irecv([target(i), MPI.BYTE], 0, i), got.bump)
    for i in range(n):
        got.wait_for(i + 1)
        if staged:  # scatter it, then its slot takes a later round
            np.copyto(pool[i * ROUND : (i + 1) * ROUND], target(i))
        if i + depth < n:
            waiter.hand(comm.Irecv([target(i + depth), MPI.BYTE], 0, i + depth), got.bump)


def timed(pool: np.ndarray, ring: np.ndarray, staged: bool, depth: int) -> float:
    comm = MPI.COMM_WORLD
    comm.Barrier()
    t0 = time.perf_counter()
    (send_side if comm.rank == 0 else recv_side)(pool, ring, staged, depth)
    comm.Barrier()
    return TOTAL / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    pool = np.ones(TOTAL, dtype=np.uint8)  # touched: no page faults while timed
    ring = np.ones((args.depth + 2) * ROUND, dtype=np.uint8)
    for p in range(args.passes):
        for staged in (False, True) if p % 2 == 0 else (True, False):
            timed(pool, ring, staged, args.depth)  # warm-up
            runs = sorted(timed(pool, ring, staged, args.depth) for _ in range(3))
            if MPI.COMM_WORLD.rank == 0:
                shown = ", ".join(f"{g:.2f}" for g in runs)
                mode = "staged" if staged else "bare"
                print(f"pass {p + 1} {mode:6s} 16 MiB x {args.depth}: GB/s {shown}", flush=True)
    WAITER.close()
    COPIER.shutdown()


WAITER = Waiter()
COPIER = concurrent.futures.ThreadPoolExecutor(max_workers=1)

if __name__ == "__main__":
    main()
