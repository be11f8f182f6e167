"""A head-split's legs are written at once under the PYTHON runtime (DirectMover.write_slice):
one rank's write moves while the next rank's leg is planned, gathered and posted, and each
rank still gets its own bytes and its own Result."""

from __future__ import annotations

import asyncio
import ctypes
from typing import Any

from layout_harness import tiny_layout
from mover_harness import two_rank_split, writes_over

from kvxferd.backends.base import XferHandle, XferStatus
from kvxferd.memory.heads import TpRank
from kvxferd.memory.layout import BLOCK_MAJOR, KvLayout
from kvxferd.peers.messages import Result
from kvxferd.sim.content import verify_blocks
from kvxferd.transceiver.bounce import BounceBuffers
from kvxferd.transceiver.direct import DirectMover

BLOCKS = [3, 0, 5, 1]


def _layout(heads: int) -> KvLayout:
    return tiny_layout(
        num_kv_heads=heads, head_dim=8, tokens_per_block=8, major=BLOCK_MAJOR, num_blocks=8
    )


class TwoLegBackend:
    """Copies each write at its post, but reports none of them done before both ranks'
    writes were posted: a mover that waits for one leg before it posts the next never
    finishes (its deadline ends it)."""

    name = "NIXL"
    agent_name = "ctx"

    def __init__(self) -> None:
        self.agents: list[str] = []

    def post_write(
        self, local: Any, remote: Any, agent_name: str, notif: bytes = b"", **kinds: Any
    ) -> tuple[XferHandle, XferStatus]:
        self.agents.append(agent_name)
        for (laddr, n), (raddr, _) in zip(local.tolist(), remote.tolist(), strict=True):
            ctypes.memmove(raddr, laddr, n)
        return XferHandle(object(), agent_name, int(local[:, 1].sum()), len(local)), (
            XferStatus.IN_PROGRESS
        )

    def poll(self, handle: XferHandle) -> XferStatus:
        return XferStatus.DONE if len(set(self.agents)) == 2 else XferStatus.IN_PROGRESS

    def release(self, handle: XferHandle) -> None:
        handle.released = True

    def close(self) -> None:
        pass


def _run(bounce_bytes: int) -> None:
    theirs = _layout(2)
    s, dsts = two_rank_split(_layout(4), theirs, BLOCKS, [[0, 1, 2, 3], [4, 5, 6, 7]], seed=7)
    conns = [leg.conn for leg in s.legs]
    bounce = BounceBuffers(bounce_bytes) if bounce_bytes else None
    backend = TwoLegBackend()

    async def go() -> None:
        async with writes_over(backend) as writes:
            mover = DirectMover(writes, bounce, pipelined=False)
            await asyncio.wait_for(mover.write_slice(s, 0, len(BLOCKS), True), 10)

    try:
        asyncio.run(go())
        # Through the bounce buffer each leg was gathered and written into its rank's blocks.
        assert bounce is None or bounce.one_sided_legs == 2
    finally:
        if bounce is not None:
            bounce.close()
    assert s.terminal is None and s.written == len(BLOCKS)
    assert sorted(set(backend.agents)) == ["gen0", "gen1"]
    for rank, (dst, dst_blocks) in enumerate(zip(dsts, ([0, 1, 2, 3], [4, 5, 6, 7]), strict=True)):
        got = verify_blocks(dst, theirs, dst_blocks, 7, len(BLOCKS) * 8, tp=TpRank(rank, 2))
        assert got.ok, (rank, got.first_mismatch)
        results = [m for m in conns[rank].sent if isinstance(m, Result)]
        assert len(results) == 1 and results[0].last, results


def test_a_split_posts_both_legs_before_either_completes_per_block() -> None:
    _run(0)


def test_a_split_posts_both_legs_before_either_completes_through_the_bounce_buffer() -> None:
    _run(1 << 20)
