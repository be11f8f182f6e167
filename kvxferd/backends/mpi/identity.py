"""The key check on a new MPI link (link.py's docstring says why): each side sends its
key over the new intercommunicator and checks the other's against the key the TCP
rendezvous named; with a shared secret, each key comes with a proof of it
(kvxferd/backends/link_proof.py), so a client of the TCP port that lacks the secret
cannot link under any daemon's key."""

from __future__ import annotations

import time
from typing import Any

from kvxferd.backends.link_proof import WRONG_SECRET, Proofs
from kvxferd.backends.mpi import wire
from kvxferd.errors import TransferError
from kvxferd.service.logs import shown

# How long each side of a new intercommunicator waits for the other's key over it.
IDENTITY_TIMEOUT_S = 5.0
# What the refusal of such a link tells the operator.
_LOOK_ALIKE = (
    "MPICH connected it to another process: daemons must not look alike to MPICH "
    "(one hostname, pid and start second; docs/backends-mpi.md)"
)


def swap_identities(
    comm: Any, MPI: Any, mine: str, expected: str, proofs: Proofs, timeout_s: float
) -> None:
    """Send our key over the new intercommunicator and check that the peer's is
    `expected`, with its proof; TransferError saying what came instead. Blocking: run in
    a thread."""
    out = wire.identity(mine, proofs.ours(mine, expected))
    buf = bytearray(wire.IDENTITY_MAX)
    status = MPI.Status()
    send = comm.Isend([out, MPI.BYTE], dest=0, tag=wire.HEADER_TAG)
    recv = comm.Irecv([buf, MPI.BYTE], source=0, tag=wire.HEADER_TAG)
    end = time.monotonic() + timeout_s
    sent = received = False
    while not (sent and received):
        sent = sent or send.Test()
        received = received or recv.Test(status)
        if received and wire.is_keepalive(buf[: status.Get_count(MPI.BYTE)]):
            # Sent over an intercommunicator freed before this one had its context
            # (keepalive.py says how): not the peer's word, wait for its key.
            received = False
            recv = comm.Irecv([buf, MPI.BYTE], source=0, tag=wire.HEADER_TAG)
        if time.monotonic() >= end and not (sent and received):
            if not received:
                recv.Cancel()
                recv.Wait()
            # A stalled peer, or a link that went to another process: which, MPI
            # cannot tell.
            raise TransferError(
                f"no key from {expected} over the new MPI link within {timeout_s:g} s "
                f"({'our key was not taken either' if not sent else 'ours went out'}): "
                f"it stalled, or {_LOOK_ALIKE}"
            )
        time.sleep(0.0005)
    parts = wire.identity_parts(bytes(buf[: status.Get_count(MPI.BYTE)]))
    if parts is None:
        raise TransferError(f"{expected} sent no kvxferd key over the new MPI link")
    got, proof = parts
    if got != expected:
        raise TransferError(
            f"the new MPI link to {expected} reached {shown(got)} instead: {_LOOK_ALIKE}"
        )
    if not proofs.proves(proof, expected, mine):
        raise TransferError(
            f"{expected} did not prove the shared secret over the new MPI link ({WRONG_SECRET})"
        )
