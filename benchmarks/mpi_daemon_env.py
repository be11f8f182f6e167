"""mpi4py as the daemons run it, for the benchmarks run under one mpiexec: the ucx netmod
(MPIR_CVAR_NOLOCAL=1, or MPICH would use its own shared memory with CMA between ranks of
one MPI_COMM_WORLD), UCX without CMA, MPI_THREAD_MULTIPLE. Set only where not set already.

    from mpi_daemon_env import MPI
"""

from __future__ import annotations

import os

os.environ.setdefault("MPIR_CVAR_CH4_NETMOD", "ucx")
os.environ.setdefault("MPIR_CVAR_NOLOCAL", "1")
os.environ.setdefault("UCX_TLS", "^cma")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import mpi4py

mpi4py.rc.thread_level = "multiple"
from mpi4py import MPI  # noqa: E402

__all__ = ["MPI"]
