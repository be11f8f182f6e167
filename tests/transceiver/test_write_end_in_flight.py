"""A write still in flight when its request ends: cancelled (released) at once, or drained
until the backend says it ended (Writes.post_and_wait, tx_drains.cancel_may_leak).
Cancelled only where nothing of it can land later: a peer on this kernel with UCX's CMA on
both ends, host memory on both sides. A copy into or out of device memory runs on a GPU
stream whatever its handle says, and CMA carries host memory only: drained."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
from layout_harness import tiny_layout
from mover_harness import peer_conn, pool, tx_session, writes_over

from kvxferd.backends.base import HOST, Memory, XferHandle, XferStatus, vram
from kvxferd.transceiver import tx_drains
from kvxferd.transceiver.sessions import Terminal
from kvxferd.transceiver.state import Reason, Status
from kvxferd.transceiver.tx_drains import Drains


class HeldBackend:
    """Writes that stay in progress until `finished`."""

    name = "NIXL"
    agent_name = "ctx"

    def __init__(self) -> None:
        self.finished = False
        self.released: list[XferHandle] = []

    def post_write(
        self, local: Any, remote: Any, agent_name: str, notif: bytes = b"", **kinds: Any
    ) -> tuple[XferHandle, XferStatus]:
        return XferHandle(object(), agent_name, int(local[:, 1].sum()), len(local)), (
            XferStatus.IN_PROGRESS
        )

    def poll(self, handle: XferHandle) -> XferStatus:
        return XferStatus.DONE if self.finished else XferStatus.IN_PROGRESS

    def release(self, handle: XferHandle) -> None:
        handle.released = True
        self.released.append(handle)

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("local_memory", "remote_memory", "drained"),
    [(HOST, HOST, False), (HOST, vram(0), True), (vram(1), HOST, True)],
    ids=["host", "into device memory", "out of device memory"],
)
def test_an_ended_write_is_cancelled_only_host_to_host_with_cma(
    monkeypatch: pytest.MonkeyPatch, local_memory: Memory, remote_memory: Memory, drained: bool
) -> None:
    monkeypatch.setattr(tx_drains, "cma_writes_here", lambda backend: True)  # both ends CMA
    layout = tiny_layout(num_blocks=4)
    src = np.zeros(layout.pool_bytes, np.uint8)
    dst = np.zeros(layout.pool_bytes, np.uint8)
    conn = peer_conn(layout, dst)  # a daemon of this host that says ucx_cma
    conn.peer.incarnation = "i1"  # a drain is kept by daemon incarnation
    s = tx_session(pool(layout, src), conn, [0], [0])
    local = np.array([[int(src.ctypes.data), layout.block_bytes]], np.int64)
    remote = np.array([[int(dst.ctypes.data), layout.block_bytes]], np.int64)
    backend = HeldBackend()

    async def run() -> None:
        async with writes_over(backend) as writes:
            writing = asyncio.create_task(
                writes.post_and_wait(
                    s, local, remote, conn, local_memory=local_memory, remote_memory=remote_memory
                )
            )
            deadline = time.monotonic() + 5
            while writes.open_handles != 1:
                assert time.monotonic() < deadline, "the write was never posted"
                await asyncio.sleep(0.001)
            s.request_end(Terminal.local(Status.CANCELLED, Reason.CANCELLED, "by the test"))
            s.wake.set()
            assert await asyncio.wait_for(writing, 5) is XferStatus.IN_PROGRESS
            if not drained:
                assert backend.released and not s.draining and writes.open_handles == 0
                return
            assert len(s.draining) == 1 and not backend.released and s.held
            backend.finished = True
            await asyncio.wait_for(Drains.wait(s.draining), 5)
            assert backend.released and not s.held

    asyncio.run(run())
