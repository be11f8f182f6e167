"""What the transceiver's mover tests share: a one-sided backend that records its posts, the
pieces of a context session (its pool, its receiver's connection), and Writes over a
started data plane on that backend."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast
from unittest import mock

import msgspec
import numpy as np

from kvxferd.backends.base import HOST, Memory, XferHandle, XferStatus
from kvxferd.memory.layout import KvLayout
from kvxferd.peers.messages import PoolInfo, RequestData, Result
from kvxferd.peers.process import me
from kvxferd.service.pools import LocalPool
from kvxferd.sim.content import fill_blocks
from kvxferd.transceiver import tx_drains
from kvxferd.transceiver.dataplane import DataPlane
from kvxferd.transceiver.legs import TxLeg
from kvxferd.transceiver.sessions import TxSession
from kvxferd.transceiver.writes import Writes


class RecordingBackend:
    """A one-sided backend that records each post's memory kinds and copies the bytes
    (host memory stands in for both sides), completing every write inline."""

    name = "NIXL"
    agent_name = "ctx"

    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.pending_polls = 0  # polls that answer IN_PROGRESS before a write is DONE

    def post_write(
        self, local: Any, remote: Any, agent_name: str, notif: bytes = b"", **kinds: Memory
    ) -> tuple[XferHandle, XferStatus]:
        self.posts.append({"descriptors": len(local), "kinds": kinds})
        for (laddr, n), (raddr, _) in zip(local.tolist(), remote.tolist(), strict=True):
            ctypes.memmove(raddr, laddr, n)
        handle = XferHandle(object(), agent_name, int(local[:, 1].sum()), len(local))
        return handle, XferStatus.IN_PROGRESS if self.pending_polls else XferStatus.DONE

    def poll(self, handle: XferHandle) -> XferStatus:
        if self.pending_polls:
            self.pending_polls -= 1
            return XferStatus.IN_PROGRESS
        return XferStatus.DONE

    def release(self, handle: XferHandle) -> None:
        handle.released = True

    def close(self) -> None:
        pass


def region(array: np.ndarray) -> Any:
    return SimpleNamespace(array=array, address=int(array.ctypes.data))


def pool(
    layout: KvLayout, array: np.ndarray, memory: Memory = HOST, zero_copy: bool = True
) -> LocalPool:
    return LocalPool("p0", layout, region(array), None, None, memory=memory, zero_copy=zero_copy)


def peer_conn(
    layout: KvLayout,
    dst: np.ndarray,
    *,
    memory: str = "host",
    device: int = 0,
    writable: bool = True,
    bounce: np.ndarray | None = None,
    bounce_memory: str = "host",
    bounce_device: int = 0,
) -> Any:
    info = PoolInfo(
        "p0", {}, int(dst.ctypes.data), dst.nbytes, memory=memory, device=device, writable=writable
    )
    sent: list[Any] = []

    async def send(msg: Any) -> bool:
        sent.append(msg)
        return True

    async def fresh() -> None:
        return None

    return SimpleNamespace(
        pools={"p0": info},
        layouts={"p0": layout},
        info=SimpleNamespace(
            bounce_base=0 if bounce is None else int(bounce.ctypes.data),
            bounce_nbytes=0 if bounce is None else bounce.nbytes,
            bounce_memory=bounce_memory,
            bounce_device=bounce_device,
            transport_address="",
            round_offsets=False,  # one round per reservation: one post to look at
            # A daemon of this host whose UCX takes CMA writes, as ours does (the backend's
            # name is NIXL): a write in flight is cancelled, not drained.
            process=me(),
            ucx_cma=True,
        ),
        agent_name="gen",
        regions=((info.base, info.nbytes),) if writable else (),
        closed=asyncio.Event(),
        close_reason="",
        clock_offset_ms=0,
        stale=False,
        peer=SimpleNamespace(name="gen"),
        key="gen/1",
        send=send,
        fresh=fresh,
        sent=sent,
    )


def tx_session(
    pool: LocalPool, conn: Any, blocks: list[int], dst_blocks: list[int], **req: Any
) -> TxSession:
    request = RequestData(request_id="r1", rx_token=1, pool_id="p0", blocks=dst_blocks, **req)
    s = TxSession(request_id="r1", engine=None)
    s.pool, s.blocks, s.last_seen = pool, blocks, True
    s.request, s.conn = request, conn
    s.legs = [TxLeg(conn, request)]
    s.deadline = time.monotonic() + 5.0
    return s


def two_rank_split(
    ours: KvLayout, theirs: KvLayout, blocks: list[int], dst_blocks: list[list[int]], seed: int
) -> tuple[TxSession, list[np.ndarray]]:
    """A send of `blocks` (filled with request `seed`'s content) of our pool to both ranks of
    a generation instance of 2 (pools of `theirs`, named gen0 and gen1), rank r into its
    `dst_blocks[r]`: the session, with both legs, and each rank's pool."""
    src = np.zeros(ours.pool_bytes, np.uint8)
    fill_blocks(src, ours, blocks, seed=seed)
    dsts = [np.zeros(theirs.pool_bytes, np.uint8) for _ in range(2)]
    conns = [peer_conn(theirs, dst) for dst in dsts]
    for rank, conn in enumerate(conns):
        conn.pools["p0"] = msgspec.structs.replace(conn.pools["p0"], tp_rank=rank, tp_size=2)
        conn.agent_name = conn.peer.name = f"gen{rank}"
    s = tx_session(pool(ours, src), conns[0], blocks, dst_blocks[0])
    s.legs.append(TxLeg(conns[1], RequestData("r1", 2, "p0", dst_blocks[1])))
    return s, dsts


def acking(conn: Any, s: TxSession) -> None:
    """The receiver scatters and acknowledges each round as soon as its Result arrives."""
    record = conn.send

    async def send(msg: Any) -> bool:
        await record(msg)
        if isinstance(msg, Result):
            s.legs[0].acked_block = max(s.legs[0].acked_block, msg.end_block)
            s.wake.set()
        return True

    conn.send = send


@contextlib.asynccontextmanager
async def writes_over(backend: Any) -> AsyncIterator[Writes]:
    """Writes over a started data plane on `backend`; closed after. They run as on a host
    where UCX may use CMA, whatever this one's UCX_TLS or Yama say (that decision is
    tests/backends/test_cma.py's): with peer_conn's ucx_cma, an ended write to it is
    cancelled, not drained."""
    dp = DataPlane(lambda: cast(Any, backend))
    await dp.start()
    try:
        with mock.patch.object(tx_drains, "cma_writes_here", lambda name: True):
            yield Writes(dp, lambda: 1.0)
    finally:
        await dp.close()
