"""How long a finished write can go unseen, and how often it is polled: host writes double
their pause (the loop must not poll flat out beside the copy it waits for); writes of
device memory pause a quarter of the time waited, so they are never seen more than a
quarter of their time (or the first pause, or the cap) late (writes.next_pause)."""

from __future__ import annotations

import itertools

import pytest

from kvxferd.transceiver import writes
from kvxferd.transceiver.writes import next_pause

FIRST, CAP, SHARE = writes._POLL_FIRST_S, writes._POLL_MAX_S, writes._POLL_SHARE


def _polls_until(done_s: float, device: bool) -> tuple[list[float], float]:
    """(the pauses made, when the first poll at or after `done_s` came), as Writes._wait
    schedules them from the start of the wait."""
    t, pause, pauses = 0.0, FIRST, []
    while t < done_s:
        t += pause
        pauses.append(pause)
        pause = next_pause(pause, t, device)
    return pauses, t


@pytest.mark.parametrize("done_s", [0.00005, 0.0006, 0.0011, 0.004, 0.03, 0.25, 2.0])
def test_a_finished_device_write_is_seen_within_a_quarter_of_its_time_or_the_cap(
    done_s: float,
) -> None:
    _, seen = _polls_until(done_s, device=True)
    assert seen - done_s <= max(FIRST, min(CAP, done_s * SHARE)) + 1e-12


def test_host_writes_double_their_pause_up_to_the_cap() -> None:
    pauses, _ = _polls_until(0.25, device=False)
    assert pauses[:4] == pytest.approx([FIRST, 2 * FIRST, 4 * FIRST, 8 * FIRST])
    assert max(pauses) == CAP
    assert all(b == min(2 * a, CAP) for a, b in itertools.pairwise(pauses))


def test_a_device_write_polls_faster_early_and_settles_at_the_cap() -> None:
    host, _ = _polls_until(0.004, device=False)
    device, _ = _polls_until(0.004, device=True)
    assert len(device) > len(host)  # more polls while the write is young
    long_device, _ = _polls_until(0.25, device=True)
    assert long_device[-1] == CAP
    assert len(long_device) <= 0.25 / CAP + 25  # a long write costs about one poll per cap
