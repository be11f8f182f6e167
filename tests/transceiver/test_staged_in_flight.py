"""A one-sided staged leg keeps two writes in flight (staging.ONE_SIDED_ROUNDS_AHEAD): the
next round's write is posted while this one moves, its receiver still learns of rounds in
order, and an end mid-flight gives every write back before the slice returns.

The backend is a stand-in whose writes finish when the test says: that a later write ends
first, or that none ends before the request does, is an order a real transport gives only
by chance."""

from __future__ import annotations

import asyncio
import ctypes
from typing import Any

import numpy as np
import pytest
from layout_harness import tiny_layout
from mover_harness import acking, peer_conn, pool, tx_session, writes_over

from kvxferd.backends.base import XferHandle, XferStatus
from kvxferd.memory.layout import LAYER_MAJOR, KvLayout
from kvxferd.peers.messages import Result
from kvxferd.transceiver import round_source
from kvxferd.transceiver import staging as staging_mod
from kvxferd.transceiver.bounce import BounceBuffers, HostCopier
from kvxferd.transceiver.sessions import Terminal, TxSession
from kvxferd.transceiver.staged import StagedMover
from kvxferd.transceiver.state import Reason, Status


class HeldBackend:
    """One-sided writes that copy their bytes at the post and stay in progress until
    `finish(handle)`; `on_post(handle)` runs after each post."""

    name = "NIXL"
    agent_name = "ctx"

    def __init__(self) -> None:
        self.live: list[XferHandle] = []
        self.done: set[int] = set()
        # Writes that finish once another was seen done: id(that one) -> this one.
        self.after: dict[int, XferHandle] = {}
        self.released: list[XferHandle] = []
        self.most_in_flight = 0
        self.on_post: Any = None
        self.session: TxSession | None = None  # the session writing, once it exists

    def post_write(
        self, local: Any, remote: Any, agent_name: str, notif: bytes = b"", **kinds: Any
    ) -> tuple[XferHandle, XferStatus]:
        for (laddr, n), (raddr, _) in zip(local.tolist(), remote.tolist(), strict=True):
            ctypes.memmove(raddr, laddr, n)
        handle = XferHandle(object(), agent_name, int(local[:, 1].sum()), len(local))
        self.live.append(handle)
        self.most_in_flight = max(self.most_in_flight, len(self.live))
        if self.on_post is not None:
            self.on_post(handle)
        return handle, XferStatus.IN_PROGRESS

    def finish(self, handle: XferHandle) -> None:
        self.done.add(id(handle))

    def poll(self, handle: XferHandle) -> XferStatus:
        if id(handle) not in self.done:
            return XferStatus.IN_PROGRESS
        then = self.after.pop(id(handle), None)
        if then is not None:
            self.finish(then)
        return XferStatus.DONE

    def release(self, handle: XferHandle) -> None:
        # As NIXL: a release of a write in flight cancels it.
        handle.released = True
        self.released.append(handle)
        self.live.remove(handle)

    def close(self) -> None:
        pass


def _layout() -> KvLayout:
    # 4 KiB blocks: a reservation takes whole pages (bounce.RESERVATION_ALIGN).
    return tiny_layout(
        num_kv_heads=2, head_dim=64, tokens_per_block=4, major=LAYER_MAJOR, num_blocks=8
    )


@pytest.fixture(params=["gathered", "from the pool"])
def one_block_rounds(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> KvLayout:
    """One-block rounds, each gathered into the send region or (round_source.py) written
    straight out of the pool."""
    layout = _layout()
    monkeypatch.setattr(staging_mod, "ROUND_BYTES", layout.block_bytes)
    monkeypatch.setattr(staging_mod, "ONE_SIDED_ROUND_MAX_BYTES", layout.block_bytes)
    if request.param == "from the pool":
        monkeypatch.setattr(round_source, "POOL_ROUND_MIN_RUN_BYTES", layout.piece_bytes)
    else:
        monkeypatch.setattr(round_source, "POOL_ROUND_MIN_RUN_BYTES", layout.block_bytes + 1)
    return layout


def _source_and_ring(layout: KvLayout, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A pool of random bytes, and a receiver's reservation of 4 one-block rounds."""
    src = np.random.default_rng(seed).integers(0, 256, layout.pool_bytes, dtype=np.uint8)
    return src, np.zeros(4 * layout.block_bytes, np.uint8)


async def _move(
    backend: HeldBackend, layout: KvLayout, src: np.ndarray, ring: np.ndarray, blocks: list[int]
) -> tuple[TxSession, Any, BounceBuffers]:
    staging = BounceBuffers(8 * layout.block_bytes, HostCopier(threads=1))
    conn = peer_conn(layout, np.zeros_like(src), bounce=ring)
    conn.info.round_offsets = True  # rounds through the reservation as a ring
    s = tx_session(
        pool(layout, src), conn, blocks, blocks, bounce_offset=0, bounce_nbytes=ring.nbytes
    )
    acking(conn, s)
    backend.session = s
    async with writes_over(backend) as writes:
        mover = StagedMover(writes, staging, False, lambda *a: None)
        await mover.write_slice(s, 0, len(blocks), True)
    return s, conn, staging


def test_the_next_write_is_posted_while_one_moves_and_results_stay_in_order(
    one_block_rounds: KvLayout,
) -> None:
    layout = one_block_rounds
    src, ring = _source_and_ring(layout, 1)
    blocks = [5, 2, 7, 0]
    backend = HeldBackend()

    def later_first(handle: XferHandle) -> None:
        # With two in flight the later one ends first, the earlier once the mover saw the
        # later one done; the last write, with none after it to wait for, ends at once.
        if len(backend.live) == 2:
            backend.finish(backend.live[1])
            backend.after[id(backend.live[1])] = backend.live[0]
        elif len(backend.done) == len(blocks) - 1:
            backend.finish(handle)

    backend.on_post = later_first

    async def go() -> None:
        s, conn, staging = await _move(backend, layout, src, ring, blocks)
        try:
            assert s.terminal is None
            assert not s.xfers and s.posting == 0
            assert staging.send.in_use_bytes == 0
            assert staging.gathers + staging.pool_rounds == len(blocks)
        finally:
            staging.close()
        results = [m for m in conn.sent if isinstance(m, Result)]
        assert [(r.first_block, r.end_block) for r in results] == [(i, i + 1) for i in range(4)]
        assert [r.last for r in results] == [False, False, False, True]

    asyncio.run(go())
    assert backend.most_in_flight == 2
    want = np.zeros_like(ring)  # each slot took one round: the packed blocks, in order
    copier = HostCopier(threads=1)
    copier.gather(src, layout, blocks, want)
    copier.close()
    assert np.array_equal(ring, want)


def test_an_end_with_two_writes_in_flight_gives_both_back_and_reports_neither(
    one_block_rounds: KvLayout,
) -> None:
    layout = one_block_rounds
    src, ring = _source_and_ring(layout, 2)
    backend = HeldBackend()

    def end_at_the_second(handle: XferHandle) -> None:
        if len(backend.live) == 2 and backend.session is not None:
            backend.session.request_end(
                Terminal.local(Status.CANCELLED, Reason.CANCELLED, "cancelled by the test")
            )

    backend.on_post = end_at_the_second

    async def go() -> None:
        s, conn, staging = await _move(backend, layout, src, ring, [1, 2, 3, 4])
        try:
            assert s.terminal is not None and s.terminal.reason == Reason.CANCELLED
            assert not s.xfers and s.posting == 0
            assert staging.send.in_use_bytes == 0  # both rounds' reservations back
        finally:
            staging.close()
        assert not [m for m in conn.sent if isinstance(m, Result)]

    asyncio.run(go())
    assert backend.most_in_flight == 2
    assert len(backend.released) == 2 and not backend.done and not backend.live
