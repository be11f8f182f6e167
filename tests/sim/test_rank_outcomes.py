"""The reference engine's wait for every tensor-parallel rank's outcome of a receive, when
a rank's daemon goes away: the failure goes on, and no other wait is left behind to print
"Task exception was never retrieved" with a traceback (a test of the split demo caught
one: the demo's error was its one line, then that traceback)."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace
from typing import Any

import pytest

from kvxferd.client.errors import DaemonGoneError
from kvxferd.sim.reference_engine import ReferenceEngine


class _GoneClient:
    """A rank's client whose daemon went away: `wait` fails once `gone` is set."""

    def __init__(self, gone: asyncio.Event) -> None:
        self.gone = gone

    async def wait(self, request_id: str) -> Any:
        await self.gone.wait()
        raise DaemonGoneError("connection to the daemon failed: reset by peer")

    async def cancel(self, request_id: str) -> None:
        raise AssertionError("no rank ended well: nothing to cancel")


def test_ranks_whose_daemons_go_away_together_leave_no_failure_unread() -> None:
    unread: list[dict[str, Any]] = []

    async def go() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: unread.append(ctx))
        gone = asyncio.Event()
        engine = SimpleNamespace(
            ranks=[SimpleNamespace(client=_GoneClient(gone)) for _ in range(3)]
        )
        waiting = asyncio.ensure_future(ReferenceEngine._rank_outcomes(engine, "r1"))  # type: ignore[arg-type]
        await asyncio.sleep(0)
        gone.set()  # every rank's wait fails in the same turn
        with pytest.raises(DaemonGoneError):
            await waiting
        await asyncio.sleep(0)
        gc.collect()  # an unread task failure is reported when the task is collected

    asyncio.run(go())
    gc.collect()
    assert not unread, [c.get("message") for c in unread]
