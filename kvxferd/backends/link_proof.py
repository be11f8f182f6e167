"""Proofs of the daemons' shared secret on a two-sided transport's new link.

A transport's own rendezvous (MPI's TCP port, UCX's listener) is reachable by anyone
who reaches the port, and proves nothing by itself. With a shared secret
(daemon.shared_secret_file) each side of a new link sends an HMAC-SHA256 of the secret
over both sides' fresh nonces, its role and both keys, and checks the other's: a client
without the secret makes no link, under its own key or a daemon's, and a proof seen on
the wire is worth nothing in another rendezvous (its nonces differ). Without a secret
the proofs are empty and only keys are compared.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

PROOF_BYTES = hashlib.sha256().digest_size
NONCE_BYTES = 16
# What a refusal for a wrong proof says about its cause.
WRONG_SECRET = "another daemon.shared_secret_file, or none on one side"


@dataclass(frozen=True)
class Proofs:
    """The proofs of one rendezvous of transport `label`, over the listener's and the
    connector's nonces; `listening`: we are the listener."""

    label: bytes
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
            *(self.label, role, self.listener_nonce, self.connector_nonce),
            *(sender.encode(), receiver.encode()),
        )
        msg = b"".join(len(p).to_bytes(4, "big") + p for p in parts)
        return hmac.new(self.secret, msg, hashlib.sha256).digest()

    def ours(self, me: str, peer: str) -> bytes:
        return self._proof(self.listening, me, peer)

    def proves(self, proof: bytes, peer: str, me: str) -> bool:
        """`proof`, from `peer`, is what only a holder of our secret could send here."""
        return hmac.compare_digest(proof, self._proof(not self.listening, peer, me))
