"""PeerConnection.pools_announced: what a head-merge's receive waits on for a context daemon
that has announced no pool yet (Receiver._await_sources). It must wake on the pools
message, on the connection closing, and otherwise after its timeout, leaving nothing
behind."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from kvxferd.peers.channel import PeerConnection
from kvxferd.peers.handshake import PeerIdentity
from kvxferd.peers.messages import Info, PoolInfo


def _info() -> Info:
    return Info(
        agent_name="ctx",
        agent_metadata=b"",
        pools=[],
        fingerprint="",
        compat={},
        transceiver={},
        tensor_parallel_size=2,
        pipeline_parallel_size=1,
        context_parallel_size=1,
    )


def _with_conn(scenario: Callable[[PeerConnection], Awaitable[Any]]) -> Any:
    async def go() -> Any:
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        conn = PeerConnection(
            reader, writer, PeerIdentity("ctx", "i1", "context"), _info(), "ctx", "ctx", 1.0, 5.0
        )
        try:
            return await scenario(conn)
        finally:
            writer.close()
            theirs.close()

    return asyncio.run(go())


def test_a_pools_message_wakes_the_wait() -> None:
    async def scenario(conn: PeerConnection) -> Any:
        waiting = asyncio.ensure_future(conn.pools_announced(30.0))
        await asyncio.sleep(0)
        conn.set_pools([PoolInfo("p0", {}, 4096, 4096, tp_rank=1, tp_size=2)])
        return await asyncio.wait_for(waiting, 5.0), conn._pools_changed._waiters

    assert _with_conn(scenario) == (True, [])


def test_the_connection_closing_wakes_the_wait() -> None:
    async def scenario(conn: PeerConnection) -> Any:
        waiting = asyncio.ensure_future(conn.pools_announced(30.0))
        await asyncio.sleep(0)
        conn.close("peer lost")
        return await asyncio.wait_for(waiting, 5.0), conn._pools_changed._waiters

    assert _with_conn(scenario) == (True, [])


def test_without_either_the_wait_ends_at_its_timeout_and_leaves_nothing() -> None:
    async def scenario(conn: PeerConnection) -> Any:
        return await conn.pools_announced(0.05), conn._pools_changed._waiters

    assert _with_conn(scenario) == (False, [])
