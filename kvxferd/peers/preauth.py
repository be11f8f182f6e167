"""How many peer connections may be unauthenticated at once, and what is refused beyond.

An accepted connection costs at most one pre-authentication frame
(PREAUTH_MAX_FRAME_BYTES) plus asyncio's buffers until its peer proves who it is (see
docs/operations.md, "Unauthenticated peer connections"), and lives at most
handshake_timeout_ms. A daemon has one connection per peer daemon; what arrives at once is
a reconnect wave (every generation rank redialing a restarted context daemon).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("kvxferd.peers")

# Overall: 64 handshakes in flight at once, far above a reconnect wave of a few hosts.
PREAUTH_MAX_CONNECTIONS = 64
# Per source address: 16 is twice the daemons of an 8-GPU host (one per rank, all of
# which may redial at once), and lets no single address take more than a quarter of
# PREAUTH_MAX_CONNECTIONS.
PREAUTH_MAX_PER_SOURCE = 16
# Refusals are counted each in /metrics but logged at most once per this many seconds
# (a flood of connections must not become a flood of log lines).
REFUSAL_LOG_INTERVAL_S = 10.0


class PreauthGate:
    """The unauthenticated connections, overall and by source address, and the refused
    ones by reason (preauth_limit, preauth_per_source_limit). `on_refused`: told each
    refusal's reason (the daemon's metrics)."""

    def __init__(
        self,
        what: str = "peer connection(s)",
        max_connections: int = PREAUTH_MAX_CONNECTIONS,
        max_per_source: int | None = PREAUTH_MAX_PER_SOURCE,
    ) -> None:
        # `what` names them in the log; `max_per_source` None: sources are not known
        # (ucxx's listener tells no remote address), only the overall cap applies.
        self.what = what
        self.max_connections = max_connections
        self.max_per_source = max_per_source
        self.connections = 0
        self._by_source: dict[str, int] = {}
        self.refused: dict[str, int] = {}
        self.on_refused: Callable[[str], None] | None = None
        self._unlogged = 0
        self._logged_at = -REFUSAL_LOG_INTERVAL_S

    def enter(self, source: str, label: str) -> Callable[[], None] | None:
        """Count a new connection from `source` (`label`: its address, for the log), or
        refuse it (None: close it before reading anything). The callable returned ends
        its count: once the peer authenticated, or the attempt ended; calling it again
        does nothing."""
        reason = self._refusal(source)
        if reason is not None:
            self._count_refusal(reason, label)
            return None
        self.connections += 1
        self._by_source[source] = self._by_source.get(source, 0) + 1
        counted = True

        def leave() -> None:
            nonlocal counted
            if counted:
                counted = False
                self.connections -= 1
                left = self._by_source[source] - 1
                if left:
                    self._by_source[source] = left
                else:
                    del self._by_source[source]

        return leave

    def _refusal(self, source: str) -> str | None:
        if self.connections >= self.max_connections:
            return "preauth_limit"
        limit = self.max_per_source
        if limit is not None and self._by_source.get(source, 0) >= limit:
            return "preauth_per_source_limit"
        return None

    def _count_refusal(self, reason: str, label: str) -> None:
        self.refused[reason] = self.refused.get(reason, 0) + 1
        if self.on_refused is not None:
            self.on_refused(reason)
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= REFUSAL_LOG_INTERVAL_S:
            per_source = self.max_per_source
            log.warning(
                "closed %d %s before their handshake (latest from %s: %s; %d "
                "unauthenticated now, at most %d%s)",
                self._unlogged,
                self.what,
                label,
                reason,
                self.connections,
                self.max_connections,
                "" if per_source is None else f", {per_source} per source address",
            )
            self._unlogged = 0
            self._logged_at = now
