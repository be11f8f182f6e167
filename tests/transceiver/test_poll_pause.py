"""How long a finished write can go unseen: the sender polls a write after pauses that grow
with the time waited (writes.poll_pause), never more than a quarter of it late, never more
than the cap, and a long write costs few polls."""

from __future__ import annotations

import pytest

from kvxferd.transceiver import writes
from kvxferd.transceiver.writes import poll_pause


def _polls_until(done_s: float) -> tuple[int, float]:
    """(polls made, when the first poll at or after `done_s` came), as Writes._wait
    schedules them from the start of the wait."""
    t, n = 0.0, 0
    while t < done_s:
        t += poll_pause(t)
        n += 1
    return n, t


@pytest.mark.parametrize("done_s", [0.00005, 0.0006, 0.0011, 0.004, 0.03, 0.25, 2.0])
def test_a_finished_write_is_seen_within_a_quarter_of_its_time_or_the_cap(done_s: float) -> None:
    _, seen = _polls_until(done_s)
    late = seen - done_s
    assert late <= max(writes._POLL_FIRST_S, min(writes._POLL_MAX_S, done_s * writes._POLL_SHARE))


def test_pauses_start_fast_and_stop_growing_at_the_cap() -> None:
    assert poll_pause(0.0) == writes._POLL_FIRST_S
    assert poll_pause(10.0) == writes._POLL_MAX_S
    pauses = [poll_pause(t / 1000) for t in range(0, 20)]
    assert pauses == sorted(pauses)


def test_a_long_write_costs_about_one_poll_per_cap() -> None:
    n, _ = _polls_until(0.25)
    assert n <= 0.25 / writes._POLL_MAX_S + 20
