"""A daemon's staging region closes at shutdown even while a transport still holds a view
of it: a UCX or MPI receive (or send) posted into a reservation for a peer that stalled
mid-message never ends, and its buffer is a view of the region. Closing raised BufferError
and the daemon exited 1 after an otherwise clean drain (seen with staged UCX and MPI demos
whose generation daemon was stopped for 8 s). The mapping must then stay until the process
ends: the view stays usable, and closing again is harmless."""

from __future__ import annotations

import pytest

from kvxferd.transceiver.staging import HostStaging

MIB = 1 << 20


@pytest.mark.parametrize("huge_pages", ["off", "auto"])
def test_a_region_with_a_view_still_held_closes_and_keeps_the_view_valid(
    huge_pages: str,
) -> None:
    region = HostStaging(MIB, "recv", huge_pages)  # type: ignore[arg-type]
    held = memoryview(region.array[4096:8192])  # as a posted receive holds its buffer
    region.close()
    held[:4] = b"late"  # a late completion lands in memory that is still mapped
    assert bytes(held[:4]) == b"late"
    region.close()  # again: nothing left to do
    held.release()


@pytest.mark.parametrize("huge_pages", ["off", "auto"])
def test_a_region_without_views_closes(huge_pages: str) -> None:
    region = HostStaging(MIB, "send", huge_pages)  # type: ignore[arg-type]
    region.close()
    region.close()
    assert not hasattr(region, "array")
