"""What a new two-sided link (UCX's endpoint, MPI's intercommunicator) proves.

The transport's own listener takes any client that reaches it; the proofs of
link_proof.py make a link only with a peer that holds the key they are made with:

* the daemons' shared secret (daemon.shared_secret_file), the same for every peer;
* with mutual TLS and no shared secret, a key per pair of daemon processes: each daemon
  draws a random secret for each peer (by its name and incarnation) and sends it in the
  Info to that peer only, which only that peer reads (the peer channel is TLS by then).
  The pair's key is a hash of the two secrets the pair gave each other and of both keys,
  so only those two processes can make a link as each other: a third daemon, however
  authenticated, never sees either secret. A restarted daemon (a new incarnation) gets
  new secrets, and has to authenticate again first. A link from a peer whose Info has
  not come over TLS is refused;
* neither: no key, and the proofs are empty (only the keys the peers name are compared;
  start-up already warned that nothing is authenticated).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets

from kvxferd.errors import TransferError
from kvxferd.service.logs import shown

SECRET_BYTES = 32
# A link's first message can outrun the Info that brings its peer's secret: both sides
# exchange Info at once, and a context daemon links as soon as it has the peer's.
INFO_WAIT_S = 5.0


def pair_key(a: tuple[str, bytes], b: tuple[str, bytes]) -> bytes:
    """The same bytes on both sides: the two (key, secret) pairs in key order."""
    parts = [p for key, secret in sorted((a, b)) for p in (key.encode(), secret)]
    msg = b"".join(len(p).to_bytes(4, "big") + p for p in (b"kvxferd link key", *parts))
    return hashlib.sha256(msg).digest()


class LinkSecrets:
    """The key each new link proves (the module's docstring). `me`: our transport key
    (name/incarnation)."""

    def __init__(self, me: str, shared: bytes = b"", per_pair: bool = False) -> None:
        self.me = me
        self.shared = shared
        self.per_pair = per_pair and not shared
        # What we gave each peer (in our Info to it, over TLS), by its transport key.
        self._given: dict[str, bytes] = {}
        # By peer transport key (name/incarnation): one entry per peer process ever
        # authenticated, 32 bytes each; kept, as a link may be made again any time.
        self._pairs: dict[str, bytes] = {}
        self._learned: dict[str, asyncio.Event] = {}

    def given(self, peer: str) -> bytes:
        """The secret for our Info to `peer` (its transport key), once that peer
        authenticated over TLS: drawn for it alone, the same in every Info to it. Empty
        unless keys are made per pair."""
        if not self.per_pair:
            return b""
        return self._given.setdefault(peer, secrets.token_bytes(SECRET_BYTES))

    def learn(self, peer: str, their: bytes) -> None:
        """The secret `peer` gave us, from its Info over the authenticated (TLS) peer
        channel."""
        if not self.per_pair or len(their) != SECRET_BYTES:
            return  # checked when a link asks for it: a peer without one gets no link
        self._pairs[peer] = pair_key((self.me, self.given(peer)), (peer, their))
        self._event(peer).set()

    def _event(self, peer: str) -> asyncio.Event:
        return self._learned.setdefault(peer, asyncio.Event())

    async def for_peer(self, peer: str, wait_s: float = INFO_WAIT_S) -> bytes:
        """The key a link with `peer` (its transport key) proves; TransferError when keys
        are made per pair and `peer` has not sent its secret over TLS within `wait_s`."""
        if not self.per_pair:
            return self.shared
        if peer not in self._pairs:
            try:
                await asyncio.wait_for(self._event(peer).wait(), min(wait_s, INFO_WAIT_S))
            except asyncio.TimeoutError:
                pass
            finally:
                if peer not in self._pairs:
                    self._learned.pop(peer, None)  # a stranger's name leaves nothing here
        key = self._pairs.get(peer)
        if key is None:
            raise TransferError(
                f"no link with {shown(peer)}: it has not authenticated over the TLS peer "
                "channel (not a daemon this one knows, or an older kvxferd that sends no "
                "link secret: give both daemon.shared_secret_file)"
            )
        return key
