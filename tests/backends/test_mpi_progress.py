"""The MPI progress thread when MPI cannot give it its wake-up receive (a fault real MPI
does not produce here, so a stand-in MPI plays it): it falls back to testing requests in
a loop and every request still completes. The thread's normal way, waiting in
MPI_Waitany, runs against real MPICH in test_mpi.py and the staged daemon tests."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from kvxferd.backends.mpi.progress import Progress


class _Request:
    """Completes on its `after`-th test."""

    def __init__(self, after: int) -> None:
        self.left = after
        self.tests = 0

    def Test(self, status: Any = None) -> bool:
        self.tests += 1
        self.left -= 1
        return self.left <= 0


class _Status:
    def Get_count(self, datatype: Any) -> int:
        return 4096


class _NoDup:
    def Dup(self) -> Any:
        raise RuntimeError("MPI_Comm_dup failed: out of communicators")


class _MPI:
    BYTE = object()
    REQUEST_NULL = object()
    COMM_SELF = _NoDup()
    Status = _Status

    class Request:
        @staticmethod
        def Testall(reqs: list[_Request]) -> bool:
            return all([r.Test() for r in reqs])


def test_without_its_wake_up_receive_the_thread_tests_in_a_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    progress = Progress(_MPI)
    one, pair = _Request(200), [_Request(50), _Request(120)]

    async def main() -> tuple[int, int]:
        a = progress.watch([one], _Status())
        b = progress.watch(pair)
        return await asyncio.wait_for(a, 10), await asyncio.wait_for(b, 10)

    with caplog.at_level(logging.WARNING, logger="kvxferd.mpi"):
        assert asyncio.run(main()) == (4096, 0)
    progress.close()
    assert one.tests >= 200 and all(r.left <= 0 for r in pair)
    assert "no wake-up receive" in caplog.text and "out of communicators" in caplog.text
