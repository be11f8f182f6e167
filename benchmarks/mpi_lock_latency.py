"""How long an MPI call from one thread waits while another thread blocks in MPI_Waitany.

MPICH guards every MPI call with one global lock under MPI_THREAD_MULTIPLE, and a thread
blocked in a wait holds it except when it yields (MPICH's issue threads call this "lock
monopoly"; `MPIR_CVAR_ENABLE_HEAVY_YIELD=1` is its remedy). kvxferd's MPI progress thread
waits in MPI_Waitany while the event loop's thread posts receives and tests headers
(kvxferd/backends/mpi/progress.py), so this is how long such a call can stall.

Two ranks over the daemons' transport (mpi_daemon_env.py): a second thread moves MSGS
messages of 16 MiB, 4 in flight, completing them in MPI_Waitany; the main thread calls
MPI_Iprobe once a millisecond meanwhile and reports the calls' p50, p99 and max.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_lock_latency.py
    MPIR_CVAR_ENABLE_HEAVY_YIELD=1 .venv/bin/mpiexec -n 2 \
        .venv/bin/python benchmarks/mpi_lock_latency.py
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
from mpi_daemon_env import MPI

SIZE = 16 << 20
DEPTH = 4
DATA_TAG, DONE_TAG, PROBE_TAG = 5, 9, 77


def main() -> None:
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    other = 1 - rank
    count = int(os.environ.get("MSGS", "300"))
    bufs = [np.zeros(SIZE, np.uint8) for _ in range(DEPTH)]

    def mover() -> None:
        reqs: list[MPI.Request] = []
        posted = 0
        while posted < count or reqs:
            while len(reqs) < DEPTH and posted < count:
                buf = [bufs[posted % DEPTH], MPI.BYTE]
                post = comm.Isend if rank == 0 else comm.Irecv
                reqs.append(post(buf, other, DATA_TAG))
                posted += 1
            reqs.pop(MPI.Request.Waitany(reqs))
        comm.Send([np.zeros(1, np.uint8), MPI.BYTE], other, DONE_TAG)

    thread = threading.Thread(target=mover)
    started = time.perf_counter()
    thread.start()
    waits: list[float] = []
    while thread.is_alive():
        t0 = time.perf_counter()
        comm.Iprobe(other, PROBE_TAG)  # never matches: only the wait for the lock counts
        waits.append(time.perf_counter() - t0)
        time.sleep(0.001)
    elapsed = time.perf_counter() - started
    comm.Recv([np.zeros(1, np.uint8), MPI.BYTE], other, DONE_TAG)
    waits.sort()
    heavy = os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD", "0")
    print(
        f"rank {rank} heavy_yield={heavy}: {count * SIZE / elapsed / 1e9:.2f} GB/s, "
        f"{len(waits)} calls, p50 {waits[len(waits) // 2] * 1e3:.2f} ms, "
        f"p99 {waits[int(0.99 * len(waits))] * 1e3:.1f} ms, max {waits[-1] * 1e3:.1f} ms",
        flush=True,
    )


if __name__ == "__main__":
    main()
