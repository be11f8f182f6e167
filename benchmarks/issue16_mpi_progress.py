"""Issue 16, staged MPI: how the progress thread waits, measured without kvxferd.

Two ranks (one mpiexec, over the ucx netmod without CMA as the daemons use it:
MPIR_CVAR_NOLOCAL=1, UCX_TLS=^cma) move 1 GiB as messages of `--mib` MiB, `--depth` in
flight. The main thread posts each Isend/Irecv and hands it to a second thread, which
completes it, as kvxferd/backends/mpi/progress.py does, in one of two ways:

  test     tests every held request from Python, one pass after another, yielding the
           GIL between passes (the progress thread before 2026-12-04);
  waitany  blocks in MPI_Waitany over the held requests and a receive of its own on a
           COMM_SELF duplicate, which the main thread completes with a one-byte send to
           itself when it hands over a request (the progress thread since).

Prints GB/s of three timed runs (after one warm-up) per mode, modes alternating.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/issue16_mpi_progress.py \\
        [--mib 16] [--depth 4] [--passes 2]
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np
from mpi_daemon_env import MPI

TOTAL = 1 << 30
WAKE_TAG = 7


class Completer:
    """The second thread: completes the requests handed to it, counting them."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.cond = threading.Condition()
        self.new: list[MPI.Request] = []
        self.done = 0
        self.waiting = False
        self.stop = False
        self.selfcomm = MPI.COMM_SELF.Dup()
        self.byte = bytearray(1)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def hand(self, req: MPI.Request) -> None:
        with self.cond:
            self.new.append(req)
            wake, self.waiting = self.waiting, False
        if wake:
            self.selfcomm.Send([self.byte, MPI.BYTE], 0, WAKE_TAG)

    def finished(self, req_count: int) -> None:
        with self.cond:
            self.done += req_count
            self.cond.notify_all()

    def run(self) -> None:
        held: list[MPI.Request] = []
        inbox = bytearray(1)
        wake = self.selfcomm.Irecv([inbox, MPI.BYTE], 0, WAKE_TAG)
        while True:
            with self.cond:
                if self.stop:
                    return
                held.extend(self.new)
                self.new.clear()
                if held and self.mode == "waitany":
                    self.waiting = True
            if not held:
                time.sleep(0)
                continue
            if self.mode == "waitany":
                index = MPI.Request.Waitany([wake, *held])
                with self.cond:
                    self.waiting = False
                if index == 0:
                    wake = self.selfcomm.Irecv([inbox, MPI.BYTE], 0, WAKE_TAG)
                else:
                    held.pop(index - 1)
                    self.finished(1)
                continue
            for r in list(held):
                if r.Test():
                    held.remove(r)
                    self.finished(1)
            time.sleep(0)


def timed_run(c: Completer, buf: np.ndarray, mib: int, depth: int) -> float:
    comm = MPI.COMM_WORLD
    n = TOTAL // (mib << 20)
    with c.cond:
        c.done = 0
    comm.Barrier()
    t0 = time.perf_counter()
    for i in range(n):
        view = buf[i * (mib << 20) : (i + 1) * (mib << 20)]
        if comm.rank == 0:
            c.hand(comm.Isend([view, MPI.BYTE], 1, i))
        else:
            c.hand(comm.Irecv([view, MPI.BYTE], 0, i))
        with c.cond:
            while i + 1 - c.done >= depth:
                c.cond.wait()
    with c.cond:
        while c.done < n:
            c.cond.wait()
    comm.Barrier()
    return TOTAL / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--passes", type=int, default=2)
    args = ap.parse_args()
    buf = np.ones(TOTAL, dtype=np.uint8)  # touched: no page faults while timed
    for p in range(args.passes):
        for mode in ("test", "waitany") if p % 2 == 0 else ("waitany", "test"):
            c = Completer(mode)
            timed_run(c, buf, args.mib, args.depth)  # warm-up
            runs = sorted(timed_run(c, buf, args.mib, args.depth) for _ in range(3))
            with c.cond:  # every request completed: it is not in Waitany
                c.stop = True
            c.thread.join()
            if MPI.COMM_WORLD.rank == 0:
                shown = ", ".join(f"{g:.2f}" for g in runs)
                print(f"pass {p + 1} {mode:8s} {args.mib} MiB x {args.depth}: GB/s {shown}")
            MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main()
