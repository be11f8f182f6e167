"""The bare MPI transport (`mpi-cpp`'s own baseline).

Each round ONE tagged message, through kvxferd.backends.mpi.MpiTransport, the daemons'
adapter: two processes started without mpiexec, each bootstrapping its own MPI
(kvxferd/backends/mpi/bootstrap.py: MPICH with the ucx netmod and UCX_TLS=^cma unless set),
linked by a TCP rendezvous and MPI_Comm_connect/accept (link.py); the payload received
into scratch and copied into the buffer, as in the daemons (kvxferd.bench.bare has the
protocol). Done is the receiver's `recv` returning. Rounds as over any two-sided backend:
the whole staging region.
"""

from __future__ import annotations

import sys

from kvxferd.backends.twosided import TwoSidedTransport
from kvxferd.bench import bare
from kvxferd.bench.bare_links import TwoSidedLink


def link() -> TwoSidedLink:
    def make(name: str, incarnation: str) -> TwoSidedTransport:
        from kvxferd.backends.mpi import MpiTransport

        return MpiTransport(name, incarnation)

    return TwoSidedLink(make)


if __name__ == "__main__":
    sys.exit(bare.main(link, "MPI"))
