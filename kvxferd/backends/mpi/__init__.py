"""MPI adapter for the staged (CPP) runtime: the only package that imports mpi4py.

MPI is the legacy two-sided path (docs/backends-mpi.md). Each round of a
request crosses as ONE tagged message from the context daemon's staging
buffer to the generation daemon's, over MPICH (the `mpich` wheel) through
mpi4py's buffer API: raw bytes only, never mpi4py's pickle-based calls. MPI
errors become kvxferd errors here: PeerLostError when the peer is gone,
TransferTimeoutError for a receive deadline, TransferError otherwise,
BackendUnavailableError when mpi4py (or the MPI library) does not load.

Importing this package does not import mpi4py: making a transport does (only
a daemon configured for MPI makes one, through registry.py), and MPI itself
loads and initialises on the transport's first use.

bootstrap  the process's MPI: a process manager of its own for a daemon
           started without mpiexec, MPI_Init once.
ucx_env    the MPICH/UCX defaults set before MPI_Init, and whether UCX's
           shared-memory receive queue (one per process) is in use.
link       the links to peers: TCP rendezvous, MPI accept/connect in
           threads, the TCP connection that tells a dead peer.
wire       what crosses: rendezvous frames, the 24-byte message header,
           the per-link data tags.
transport  MpiTransport: send/recv, deadlines, late messages.
progress   the thread that drives payloads while they move.

Surviving a peer's death
------------------------
MPICH was not made for peers that die: measured with MPICH 5.0.2 here,

* with its default transports (UCX, shared memory with CMA), a sender killed
  mid-message makes UCX abort the RECEIVING process (process_vm_readv fails,
  "No such process", SIGABRT);
* with the ofi netmod (libfabric tcp), the error completion of an operation
  to a dead peer is fatal to MPICH whatever the error handler (SIGABRT or
  exit), in one kill out of two;
* with the ucx netmod over TCP, or over shared memory without CMA
  (UCX_TLS=^cma), a kill mid-message leaves the survivor's requests pending
  forever but alive (no abort in 40 kills, either side): the TCP watch
  (link.py) then fails them;
* with any of them, a peer that dies DURING MPI_Comm_connect/accept (the
  link's set-up, ~10 ms over shared memory, 30-55 ms over TCP) makes MPICH
  crash the other side with SIGSEGV (it releases UCX's error status as a
  request, or sends on the endpoint it failed to create).

So, unless set already, MPIR_CVAR_CH4_NETMOD=ucx and UCX_TLS=^cma (UCX's
shared memory without CMA on one host, TCP or what else UCX finds between
hosts, with 1 MiB TCP segments; ucx_env.py sets them), and links are made
when a peer is accepted rather than at its first round
(`MpiTransport.link_ahead`: the daemon connects right after the peer
handshake), which keeps set-up away from transfers. Measured with
`kvxferd bench --runtime CPP` (1000 and 8000 tokens, 4 MiB blocks): 1.55 and
1.98 GB/s with UCX_TLS=^cma, 0.52 and 1.44 with UCX_TLS=tcp,self. With links
made ahead, no survivor died in 70 kills mid-transfer (nor in 40 over TCP);
with links made at the first round, 3 of 40 did (6 of 24 over TCP). A daemon can still
crash if its peer dies within the milliseconds of set-up; it is meant to run
under a supervisor that restarts it (the systemd unit does).

A peer stopped or killed inside a shared-memory send blocks the receiver's
MPI from every peer of that host (UCX's one receive queue per process), until
it resumes or, killed, until the receiver restarts: the daemon warns at start
when that applies (ucx_env.shared_memory_hazard); TCP alone avoids it.
"""

from kvxferd.backends.mpi.transport import MpiTransport

__all__ = ["MpiTransport"]
