"""Bare MPI between two processes, without kvxferd: the baseline of the staged runtime
over MPI (docs/benchmarks.md, issue 16). Rank 0 sends `--mib` MiB messages to rank 1,
both waiting with MPI_Wait (MPICH spins inside it), with the transports the daemon
sets by default (kvxferd/backends/mpi/bootstrap.py: ucx netmod, UCX_TLS=^cma).

MPIR_CVAR_NOLOCAL=1 as well: two ranks of one mpiexec share MPI_COMM_WORLD on one host,
so MPICH would carry their bytes over its own shared memory with CMA (one copy), which the
daemons never use (they connect with MPI_Comm_connect, over the netmod). Measured
2026-12-04, 1000 MiB messages: 13.1-13.7 GB/s that way, 11.2-11.4 with the netmod; at
256 MiB 8.1 against 3.0-8.3, and 1.8 with MPICH's CMA off (MPIR_CVAR_CH4_CMA_ENABLE=0).
`kvxferd bench` measures its own bare MPI pair the daemons' way (kvxferd/bench/bare_mpi.py).

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/mpi_bare.py --mib 1000 --count 4
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("MPIR_CVAR_CH4_NETMOD", "ucx")
os.environ.setdefault("MPIR_CVAR_NOLOCAL", "1")
os.environ.setdefault("UCX_TLS", "^cma")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import numpy as np
from mpi4py import MPI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1000)
    ap.add_argument("--count", type=int, default=4)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    buf = np.ones(args.mib << 20, dtype=np.uint8)  # touched: no page faults while timed
    times = []
    for i in range(args.count + 1):  # the first one warms up
        comm.Barrier()
        t0 = time.perf_counter()
        if comm.rank == 0:
            comm.Isend([buf, MPI.BYTE], 1, i).Wait()
            comm.Recv([buf[:1], MPI.BYTE], 1, 99)  # the receiver has it all
        else:
            comm.Irecv([buf, MPI.BYTE], 0, i).Wait()
            comm.Send([buf[:1], MPI.BYTE], 0, 99)
        times.append(time.perf_counter() - t0)
    if comm.rank == 0:
        timed = sorted(times[1:])
        gbps = [buf.nbytes / t / 1e9 for t in timed]
        print(json.dumps({"mib": args.mib, "gbps_median": gbps[len(gbps) // 2], "gbps": gbps}))


if __name__ == "__main__":
    main()
