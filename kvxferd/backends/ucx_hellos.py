"""The hellos of a new UCX endpoint (their format: ucx_wire.py), for either side.

The connector sends HELLO (its key and nonce); the listener answers ACK (its key, nonce
and proof of the shared secret); the connector checks the listener's key and proof and
sends PROOF; the listener checks that, registers the endpoint (ucx.py) and sends READY.
Each wait is bounded by the caller's `bounded` (ucx.py's, which never cancels a ucxx
call, whose buffer UCX may still be using).
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvxferd.backends.link_proof import NONCE_BYTES, WRONG_SECRET, Proofs
from kvxferd.backends.link_secrets import LinkSecrets
from kvxferd.backends.ucx_wire import (
    ACK_TAG,
    HELLO_BYTES,
    HELLO_TAG,
    PROOF_TAG,
    READY_TAG,
    decode_hello,
    encode_hello,
)
from kvxferd.errors import PeerLostError, TransferError
from kvxferd.service.logs import shown

# What the proofs of the shared secret on a UCX endpoint are bound to (link_proof.py).
_LABEL = b"kvxferd-ucx-link"

Bounded = Callable[[Awaitable[Any], float], Awaitable[Any]]


@dataclass(frozen=True)
class Hellos:
    """One transport's side of its endpoints' hellos: its key and what its links prove."""

    key: str
    secrets: LinkSecrets
    bounded: Bounded

    async def _in(self, ep: Any, tag: int, timeout_s: float) -> tuple[str, bytes, bytes]:
        buf = bytearray(HELLO_BYTES)
        await self.bounded(ep.recv(buf, tag=tag), timeout_s)
        return decode_hello(buf)

    async def _out(self, ep: Any, tag: int, hello: bytearray, timeout_s: float) -> None:
        await self.bounded(ep.send(hello, tag=tag), timeout_s)

    # -- listener ------------------------------------------------------------

    async def greeted(self, ep: Any, timeout_s: float) -> tuple[str, bytes]:
        """The connector's key and nonce (its HELLO)."""
        key, nonce_c, _ = await self._in(ep, HELLO_TAG, timeout_s)
        return key, nonce_c

    async def answer(self, ep: Any, key: str, nonce_c: bytes, timeout_s: float) -> bytes:
        """ACK, then the connector's PROOF checked (TransferError if wrong); our nonce,
        for READY."""
        secret = await self.secrets.for_peer(key, timeout_s)
        nonce_l = secrets.token_bytes(NONCE_BYTES)
        proofs = Proofs(_LABEL, secret, nonce_l, nonce_c, listening=True)
        ack = encode_hello(self.key, nonce_l, proofs.ours(self.key, key))
        await self._out(ep, ACK_TAG, ack, timeout_s)
        again, nonce, proof = await self._in(ep, PROOF_TAG, timeout_s)
        if (again, nonce) != (key, nonce_c):
            raise TransferError(f"the proof came from {shown(again)}, not {shown(key)}")
        if not proofs.proves(proof, key, self.key):
            raise TransferError(
                f"{shown(key)} did not prove the shared secret over UCX ({WRONG_SECRET})"
            )
        return nonce_l

    async def ready(self, ep: Any, nonce_l: bytes, timeout_s: float) -> None:
        await self._out(ep, READY_TAG, encode_hello(self.key, nonce_l), timeout_s)

    # -- connector -----------------------------------------------------------

    async def make(self, ep: Any, peer_key: str, address: str, left: Callable[[], float]) -> None:
        """All four from the connecting side, each wait within `left()` seconds:
        PeerLostError if `address` is another daemon (or incarnation), TransferError if
        it did not prove the secret."""
        secret = await self.secrets.for_peer(peer_key, left())
        nonce_c = secrets.token_bytes(NONCE_BYTES)
        await self._out(ep, HELLO_TAG, encode_hello(self.key, nonce_c), left())
        got, nonce_l, proof = await self._in(ep, ACK_TAG, left())
        if got != peer_key:
            raise PeerLostError(
                f"UCX: {address} is {got}, not {peer_key} (the peer restarted or the "
                "address was reused)"
            )
        proofs = Proofs(_LABEL, secret, nonce_l, nonce_c, listening=False)
        if not proofs.proves(proof, peer_key, self.key):
            raise TransferError(
                f"UCX: {peer_key} at {address} did not prove the shared secret ({WRONG_SECRET})"
            )
        ours = encode_hello(self.key, nonce_c, proofs.ours(self.key, peer_key))
        await self._out(ep, PROOF_TAG, ours, left())
        # READY: the listener took our proof and registered us (or, refusing, aborts the
        # endpoint, which ends this wait with an error).
        await self._in(ep, READY_TAG, left())
