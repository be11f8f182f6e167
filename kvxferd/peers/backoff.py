"""Dial backoff per peer address: a dead peer is not dialed again by every receive.

Without it each receive naming a dead peer dials at once (143 refused dials in 120 s for
one dead peer, measured; issue 18). After a failed dial the address waits before the next
one, exponentially longer after each failure in a row (with jitter, so that the ranks of
a host do not redial a restarted peer in lockstep), capped at a few seconds; a successful
handshake resets it. While an address waits, a dial is refused at once with
PeerBackoffError, which says how long until the next dial and what the last one met; the
receive fails with it (peer_unreachable) instead of dialing.

Only failures to reach the peer or complete the handshake back off. A peer that answered
and refused us (IncompatiblePeerError: a version, settings or name_in_use refusal) is
alive; its refusal is what the receive is told, every time.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvxferd.errors import HandshakeError

# The first wait after a failure; each further failure in a row doubles it, up to CAP_S.
BASE_S = 0.25
CAP_S = 4.0


class PeerBackoffError(HandshakeError):
    """A dial refused without dialing: the address failed recently and waits."""

    def __init__(self, address: str, wait_s: float, failures: int, last_error: str) -> None:
        super().__init__(
            f"peer {address} is in dial backoff after {failures} failed dial(s) in a row "
            f"(last: {last_error}); not dialed again for {wait_s:.2f} s"
        )
        self.address = address
        self.wait_s = wait_s
        self.failures = failures
        self.last_error = last_error


@dataclass
class AddressBackoff:
    """One address that failed: how often in a row, when it may be dialed again (the
    clock's time), and what the last dial met."""

    failures: int
    retry_at: float
    last_error: str


class DialBackoff:
    """The backoff of every peer address, and counts of what it did (status, metrics)."""

    def __init__(
        self,
        base_s: float = BASE_S,
        cap_s: float = CAP_S,
        clock: Callable[[], float] = time.monotonic,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.base_s = base_s
        self.cap_s = cap_s
        self._clock = clock
        self._jitter = jitter  # uniform in [0, 1)
        self.addresses: dict[str, AddressBackoff] = {}
        self.dials_total = 0  # dials started
        self.dials_ok_total = 0  # ended in an established connection
        self.dials_failed_total = 0  # could not reach the peer or finish the handshake
        self.refused_total = 0  # dials refused while in backoff (receives failed fast)

    def check(self, address: str) -> None:
        """Raise PeerBackoffError when `address` may not be dialed yet."""
        state = self.addresses.get(address)
        if state is None:
            return
        wait_s = state.retry_at - self._clock()
        if wait_s > 0:
            self.refused_total += 1
            raise PeerBackoffError(address, wait_s, state.failures, state.last_error)

    def dialing(self, address: str) -> None:
        self.dials_total += 1

    def failed(self, address: str, error: str) -> float:
        """A dial of `address` failed with `error`: the wait before the next one (s)."""
        self.dials_failed_total += 1
        state = self.addresses.get(address)
        failures = 1 if state is None else state.failures + 1
        full = min(self.cap_s, self.base_s * (1 << min(failures - 1, 30)))
        # Half fixed, half random: never shorter than half the step, never over the cap.
        wait_s = full / 2 + full / 2 * self._jitter()
        self.addresses[address] = AddressBackoff(failures, self._clock() + wait_s, error)
        return wait_s

    def succeeded(self, address: str) -> None:
        """A handshake with `address` completed: it is dialed freely again."""
        self.dials_ok_total += 1
        self.addresses.pop(address, None)

    def answered(self, address: str) -> None:
        """The peer at `address` answered and refused us: alive, so no backoff."""
        self.addresses.pop(address, None)

    def waiting(self) -> dict[str, AddressBackoff]:
        """The addresses not to be dialed yet."""
        now = self._clock()
        return {a: s for a, s in self.addresses.items() if s.retry_at > now}

    def status(self) -> dict[str, object]:
        now = self._clock()
        return {
            "dials_total": self.dials_total,
            "dials_ok_total": self.dials_ok_total,
            "dials_failed_total": self.dials_failed_total,
            "refused_in_backoff_total": self.refused_total,
            "peers": {
                address: {
                    "failures": s.failures,
                    "next_dial_in_s": round(max(0.0, s.retry_at - now), 3),
                    "last_error": s.last_error,
                }
                for address, s in self.addresses.items()
            },
        }
