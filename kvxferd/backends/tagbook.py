"""The per-tag bookkeeping both two-sided transports (UCX, MPI) keep.

One recv per peer and tag at a time: two would wait for the one message, and the loser's
receive would stay posted. A recv whose deadline passed abandons its tag: the transport
then receives a late message with that tag into scratch and drops it (so the sender's
`send` completes and the stale bytes never reach a later recv of that tag). A new recv of
an abandoned tag takes it back; abandoned tags are forgotten after `ttl_s`, when their
peer is removed, or when the transport closes.

A transport keys its tags as it matches messages: UCX by the tag on the wire (which
already names the sender), MPI by (peer key, tag). TaggedTransport is what both build on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

from kvxferd.backends.link_secrets import LinkSecrets
from kvxferd.errors import TransferError

__all__ = ["TagBook", "TaggedTransport"]

K = TypeVar("K", bound=Hashable)


class TagBook(Generic[K]):
    """The tags of one transport (`name` prefixes its messages) with a recv in progress,
    and the abandoned ones with their peer. Not thread-safe (the transports run on the
    daemon's event loop)."""

    def __init__(self, name: str, ttl_s: float) -> None:
        self._name = name
        self._ttl_s = ttl_s
        self._receiving: set[K] = set()
        # key -> (peer key, when it is forgotten)
        self._abandoned: dict[K, tuple[str, float]] = {}

    @contextlib.contextmanager
    def receiving(self, key: K, peer_key: str, tag: int) -> Iterator[None]:
        """Hold `key` for one recv (and take it back if it was abandoned). TransferError if
        another recv holds it."""
        if key in self._receiving:
            raise TransferError(
                f"{self._name}: tag {tag} from {peer_key} is already being received"
            )
        self._receiving.add(key)
        try:
            self._abandoned.pop(key, None)
            yield
        finally:
            self._receiving.discard(key)

    def abandon(self, key: K, peer_key: str) -> None:
        """The recv of `key` timed out: its late message is to be dropped, for `ttl_s`."""
        self._abandoned[key] = (peer_key, time.monotonic() + self._ttl_s)

    def take_back(self, key: K) -> bool:
        """Whether `key` was abandoned; it is not any more (its late message came)."""
        return self._abandoned.pop(key, None) is not None

    def expire(self, now: float | None = None) -> None:
        """Forget the abandoned tags whose time is up (`now`: time.monotonic())."""
        now = time.monotonic() if now is None else now
        for key, (_, expires) in list(self._abandoned.items()):
            if now > expires:
                del self._abandoned[key]

    def abandoned(self) -> list[tuple[K, str]]:
        """The abandoned tags and their peers, as a list (safe to change the book meanwhile)."""
        return [(key, peer_key) for key, (peer_key, _) in self._abandoned.items()]

    def forget_peer(self, peer_key: str) -> None:
        """The peer was removed: none of its late messages can come any more."""
        for key in [k for k, (p, _) in self._abandoned.items() if p == peer_key]:
            del self._abandoned[key]

    def clear(self) -> None:
        """The transport closed: forget every abandoned tag."""
        self._abandoned.clear()


class TaggedTransport(Generic[K]):
    """What both two-sided transports are made of: their peer key (daemon/incarnation),
    the grace a message past its deadline still gets to arrive whole (`stall_grace_s`),
    the daemons' shared secret (`secret`, b"" without one: their links prove it, or a
    key per pair of daemons: `per_pair_secrets`, link_secrets.py), and
    their TagBook. One constructor, so that both take the same options; `_open` does
    the transport's own set-up (loading its library first, which raises StartupError)."""

    name: str

    def __init__(
        self,
        daemon_name: str,
        incarnation: str,
        *,
        stall_grace_s: float = 5.0,
        abandon_ttl_s: float = 120.0,
        secret: bytes = b"",
        per_pair_secrets: bool = False,
    ) -> None:
        self.key = f"{daemon_name}/{incarnation}"
        self._stall_grace_s = stall_grace_s
        # What each new link proves (link_secrets.py): `secret`, or with
        # `per_pair_secrets` (mutual TLS, no shared secret) a key per pair of daemons.
        self.link_secrets = LinkSecrets(self.key, secret, per_pair_secrets)
        self._tags: TagBook[K] = TagBook(self.name, abandon_ttl_s)
        self._open()

    def _open(self) -> None:
        raise NotImplementedError
