"""The reference engine's blocks when one tensor-parallel rank's daemon goes away mid-request:
the other ranks' daemons may still write into them (a receive) or read them (a send), so
their requests are cancelled and the blocks are never handed out again. Before, they went
back to the free list at once, and the next request could be given blocks a surviving
daemon was still writing into.

The rank clients are fakes: the fault is a daemon connection dying while another rank's
request lives on, in the engine's own bookkeeping."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from layout_harness import tiny_layout

from kvxferd.client.errors import DaemonGoneError
from kvxferd.sim.reference_engine import ReferenceEngine
from kvxferd.sim.workload import Item
from kvxferd.transceiver.state import Outcome

LAYOUT = tiny_layout(num_blocks=16)


class RankClient:
    """One rank's daemon link. `gone`: its daemon went away (every wait fails); otherwise a
    request's outcome comes only once it is cancelled."""

    def __init__(self, gone: bool) -> None:
        self.gone = gone
        self.cancelled: list[str] = []
        self._ended: dict[str, asyncio.Event] = {}

    async def recv(self, request_id: str, *args: Any, **kw: Any) -> None:
        self._ended[request_id] = asyncio.Event()

    async def send(self, request_id: str, *args: Any, **kw: Any) -> None:
        self._ended[request_id] = asyncio.Event()

    async def wait(self, request_id: str) -> Outcome:
        if self.gone:
            raise DaemonGoneError("connection to the daemon failed: reset by peer")
        await self._ended[request_id].wait()
        return Outcome(request_id, "recv", "cancelled", "cancelled", "local", "", 0, 1.0)

    async def cancel(self, request_id: str) -> None:
        if self.gone:
            raise DaemonGoneError("connection to the daemon failed: reset by peer")
        self.cancelled.append(request_id)
        self._ended[request_id].set()

    async def release(self, request_id: str) -> None:
        pass


def _engine(clients: list[RankClient]) -> ReferenceEngine:
    """A reference engine of two ranks on these clients, each pool plain host memory."""
    engine = ReferenceEngine(clients, LAYOUT, "p0")  # type: ignore[arg-type]
    for rank in engine.ranks:
        rank.region = SimpleNamespace(array=np.zeros(LAYOUT.pool_bytes, dtype=np.uint8))  # type: ignore[assignment]
    return engine


@pytest.mark.parametrize("side", ["recv", "send"])
def test_blocks_of_a_request_whose_rank_daemon_went_away_are_not_reused(side: str) -> None:
    survivor, dead = RankClient(gone=False), RankClient(gone=True)
    engine = _engine([survivor, dead])
    item = Item("r1", 3 * LAYOUT.tokens_per_block)

    async def go() -> None:
        one = engine.recv_one(item) if side == "recv" else engine.send_one(item)
        with pytest.raises(DaemonGoneError):
            await one
        # The surviving rank's request is cancelled, not left to its deadline.
        await asyncio.gather(*engine._returning)

    asyncio.run(go())
    assert survivor.cancelled == ["r1"]
    assert engine.alloc.free == LAYOUT.num_blocks - 3  # never handed out again
    assert engine.abandoned_blocks == 3


def test_a_request_that_ends_well_gives_its_blocks_back() -> None:
    """The same engine and clients, every rank answering: nothing is held back."""
    clients = [RankClient(gone=False), RankClient(gone=False)]
    engine = _engine(clients)

    async def go() -> None:
        task = asyncio.ensure_future(engine.recv_one(Item("r2", 3 * LAYOUT.tokens_per_block)))
        while not all("r2" in c._ended for c in clients):
            await asyncio.sleep(0)
        for c in clients:
            c._ended["r2"].set()  # each rank's outcome (cancelled: no content to check)
        await task

    asyncio.run(go())
    assert engine.alloc.free == LAYOUT.num_blocks
