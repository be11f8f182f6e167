"""RequestBook's waits (kvxferd/client/book.py): an outcome ends the wait, a timeout raises
TimeoutError, and neither a timed-out nor a cancelled wait leaves its future behind (an
engine polling with short timeouts would otherwise pile them up until the event came)."""

from __future__ import annotations

import asyncio

import pytest

from kvxferd.client.book import RequestBook
from kvxferd.transceiver.state import Outcome


def _outcome(request_id: str) -> Outcome:
    return Outcome(
        request_id=request_id, side="recv", status="done", reason="ok", fault="", message="",
        nbytes=0, elapsed_ms=0.0, peer="p",
    )  # fmt: skip


def test_an_outcome_ends_the_wait_and_a_timeout_raises_leaving_nothing() -> None:
    async def scenario() -> None:
        book = RequestBook()
        for _ in range(50):
            # Bounded from outside: a wait that never timed out fails here, not hangs.
            task = asyncio.ensure_future(book.wait_outcome("r1", None, 0.001))
            done, _ = await asyncio.wait({task}, timeout=5.0)
            assert task in done, "the wait did not time out"
            assert isinstance(task.exception(), asyncio.TimeoutError), task.exception()
        assert book._waiters == {}
        waiting = asyncio.ensure_future(book.wait_outcome("r1", "p", 30.0))
        await asyncio.sleep(0)
        book.on_outcome(_outcome("r1"))
        got = await asyncio.wait_for(waiting, 5.0)
        assert got.request_id == "r1" and book._waiters == {}

    asyncio.run(scenario())


def test_a_cancelled_wait_leaves_nothing() -> None:
    async def scenario() -> None:
        book = RequestBook()
        waiting = asyncio.ensure_future(book.wait_released("r2", None, 30.0))
        await asyncio.sleep(0)
        assert book._release_waiters
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert book._release_waiters == {}

    asyncio.run(scenario())
