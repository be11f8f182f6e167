"""How many requests one generation daemon may have a context daemon keep before the
context engine sent them (generation-first sessions): half of daemon.max_requests.

Such a session is made by the peer alone and lives as long as its receive (or its
connection) does. Without a share, one receiving daemon that posts and never cancels (a
leak, a bug, a compromised host holding the shared secret) fills the whole table: every
other daemon's receive is then refused `overloaded`, and our own engine's sends
`too_many_requests`. With it, that daemon is refused first.

Counted without touching the request path: each such session is noted under its peer's
name when made, by a weak reference (a session that ended and was forgotten leaves the
notes by itself, and keeps no memory alive), and leaves them when our engine sends it;
what is left of sessions that ended but are still kept (not released yet) is dropped
only when a peer reaches its share, at most once a second per peer (a peer at its share
must not make each of its refused requests scan its notes).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

from kvxferd.transceiver.sessions import TxSession

# How often a peer at its share has its notes pruned.
_PRUNE_EVERY_S = 1.0


class PeerShare:
    def __init__(
        self, sessions: dict[str, TxSession], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._sessions = sessions
        self._clock = clock
        # peer -> request id -> session
        self._noted: dict[str, weakref.WeakValueDictionary[str, TxSession]] = {}
        self._pruned_at: dict[str, float] = {}

    @staticmethod
    def share(max_requests: int) -> int:
        """A peer's share of `max_requests` (0: no limit, no share)."""
        return max(1, max_requests // 2) if max_requests > 0 else 0

    def room(self, peer: str, max_requests: int) -> bool:
        """Whether `peer` may have one more generation-first session kept."""
        share = self.share(max_requests)
        noted = self._noted.get(peer)
        if not share or noted is None or len(noted) < share:
            return True
        now = self._clock()
        if now - self._pruned_at.get(peer, -_PRUNE_EVERY_S) >= _PRUNE_EVERY_S:
            self._pruned_at[peer] = now
            for rid, s in list(noted.items()):
                if self._sessions.get(rid) is not s or s.engine is not None:
                    del noted[rid]
        return len(noted) < share

    def note(self, peer: str, s: TxSession) -> None:
        """`s` was made for `peer`'s RequestData, before our engine sent it."""
        noted = self._noted.get(peer)
        if noted is None:
            noted = self._noted[peer] = weakref.WeakValueDictionary()
        noted[s.request_id] = s

    def sent(self, s: TxSession) -> None:
        """Our engine sent `s`: it is no longer kept for its peer alone. Without this a
        peer at its share would wait for the next prune (a second) while its requests
        were being served, refused meanwhile."""
        for noted in self._noted.values():
            if noted.get(s.request_id) is s:
                del noted[s.request_id]
                return

    def kept_by(self, peer: str) -> int:
        """Generation-first sessions noted for `peer` (some may have ended since)."""
        return len(self._noted.get(peer, {}))
