"""The key check on a new MPI link (link.py's docstring says why): each side sends its
key over the new intercommunicator and checks the other's against the key the TCP
rendezvous named; with a shared secret, each key comes with a proof of it (an HMAC over
the rendezvous's two nonces and both keys), so a client of the TCP port that lacks the
secret cannot link under any daemon's key."""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Proofs:
    """The proofs of one rendezvous, over the listener's and the connector's nonces."""

    secret: bytes
    listener_nonce: bytes
    connector_nonce: bytes
    listening: bool

    def _proof(self, by_listener: bool, sender: str, receiver: str) -> bytes:
        if not self.secret:
            return b""
        role = b"listener" if by_listener else b"connector"
        # Each part length-prefixed: the nonces' lengths come from the wire.
        parts = (
            *(b"kvxferd-mpi-link", role, self.listener_nonce, self.connector_nonce),
            *(sender.encode(), receiver.encode()),
        )
        msg = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
        return hmac.new(self.secret, msg, hashlib.sha256).digest()

    def ours(self, me: str, peer: str) -> bytes:
        return self._proof(self.listening, me, peer)

    def proves(self, proof: bytes, peer: str, me: str) -> bool:
        return hmac.compare_digest(proof, self._proof(not self.listening, peer, me))


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
        if time.monotonic() >= end and not (sent and received):
            if not received:
                recv.Cancel()
                recv.Wait()
            raise TransferError(
                f"no key from {expected} over the new MPI link within {timeout_s:g} s "
                f"({'our key was not taken either' if not sent else 'ours went out'}): "
                f"{_LOOK_ALIKE}"
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
            f"{expected} did not prove the shared secret over the new MPI link (another "
            "daemon.shared_secret_file, or none on one side)"
        )
