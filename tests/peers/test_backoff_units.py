"""Dial backoff per peer address (kvxferd.peers.backoff), on an injected clock."""

from __future__ import annotations

import pytest

from kvxferd.errors import HandshakeError
from kvxferd.peers.backoff import DialBackoff, PeerBackoffError

A = "127.0.0.1:7001"
B = "127.0.0.1:7002"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_waits_grow_exponentially_with_jitter_up_to_the_cap() -> None:
    clock = Clock()
    lows = DialBackoff(base_s=0.25, cap_s=4.0, clock=clock, jitter=lambda: 0.0)
    highs = DialBackoff(base_s=0.25, cap_s=4.0, clock=clock, jitter=lambda: 0.999999)
    low = [lows.failed(A, "refused") for _ in range(8)]
    high = [highs.failed(A, "refused") for _ in range(8)]
    # Half the step at least, the whole step at most; the step doubles up to the cap.
    assert low == [0.125, 0.25, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert high == pytest.approx([0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0], rel=1e-5)
    assert max(high) <= 4.0


def test_a_peer_in_backoff_is_refused_with_when_and_why_until_its_time() -> None:
    clock = Clock()
    backoff = DialBackoff(base_s=1.0, cap_s=4.0, clock=clock, jitter=lambda: 0.5)
    backoff.check(A)  # never failed: may dial
    backoff.dialing(A)
    wait_s = backoff.failed(A, "cannot connect to peer 127.0.0.1:7001: Connection refused")
    assert wait_s == 0.75
    clock.now += 0.5
    with pytest.raises(PeerBackoffError) as err:
        backoff.check(A)
    assert isinstance(err.value, HandshakeError)  # a receive fails peer_unreachable
    text = str(err.value)
    assert "dial backoff after 1 failed dial(s)" in text and "Connection refused" in text
    assert "not dialed again for 0.25 s" in text, text
    backoff.check(B)  # another address is not affected
    assert set(backoff.waiting()) == {A}
    clock.now += 0.25
    backoff.check(A)  # its time has come: dial again
    assert backoff.waiting() == {}
    assert backoff.refused_total == 1 and backoff.dials_total == 1
    # Still failing in a row: the next wait is longer.
    assert backoff.failed(A, "again") == 1.5
    assert backoff.status()["peers"] == {
        A: {"failures": 2, "next_dial_in_s": 1.5, "last_error": "again"}
    }


def test_a_successful_handshake_or_an_answer_resets_the_backoff() -> None:
    clock = Clock()
    backoff = DialBackoff(base_s=1.0, clock=clock, jitter=lambda: 0.0)
    for _ in range(3):
        backoff.failed(A, "refused")
    backoff.succeeded(A)
    backoff.check(A)
    assert backoff.failed(A, "refused") == 0.5  # from the first step again
    backoff.answered(A)  # it refused us (incompatible): alive, dialed freely
    backoff.check(A)
    assert backoff.status()["peers"] == {} and backoff.dials_ok_total == 1
