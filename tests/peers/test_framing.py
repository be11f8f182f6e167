"""CorkedWriter over real TCP sockets: frames in order, and a close that cannot hang."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import msgspec
import pytest

from kvxferd.api.messages import ENGINE_CODEC
from kvxferd.errors import MalformedMessageError
from kvxferd.peers.framing import CorkedWriter
from kvxferd.peers.messages import PEER_CODEC


async def _connect(handler: object) -> tuple[asyncio.AbstractServer, asyncio.StreamWriter]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    return server, writer


def test_frames_arrive_in_order_and_close_delivers_the_buffered_ones() -> None:
    frames = [bytes([i % 251]) * (1 + i * 997 % 70_000) for i in range(200)]

    async def scenario() -> bytes:
        got = asyncio.get_running_loop().create_future()

        async def handler(reader: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            got.set_result(await reader.read())  # to end of stream
            w.close()

        server, writer = await _connect(handler)
        out = CorkedWriter(writer)
        for f in frames:
            out.write(f)
        out.close()  # before any flush ran: close must still send everything
        data: bytes = await asyncio.wait_for(got, 30)
        server.close()
        return data

    assert asyncio.run(scenario()) == b"".join(frames)


def test_close_fails_a_drain_stuck_on_a_peer_that_stopped_reading() -> None:
    """The peer never reads: the kernel buffers fill, drain() waits; close() must end it."""

    async def scenario() -> None:
        stalled: list[asyncio.StreamWriter] = []

        async def handler(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            stalled.append(w)  # accepted, never read

        server, writer = await _connect(handler)
        sock = writer.transport.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        out = CorkedWriter(writer)
        chunk = b"x" * (1 << 20)
        # Fill the kernel buffers and then the transport's own past its high-water mark.
        for _ in range(64):
            out.write(chunk)
            if writer.transport.get_write_buffer_size() > 8 << 20:
                break
        assert writer.transport.get_write_buffer_size() > 0, "the peer took everything"
        waiting = asyncio.ensure_future(out.drain())
        done, _ = await asyncio.wait({waiting}, timeout=0.2)
        assert not done, "drain returned while the peer reads nothing"
        out.close()
        # Deadline-bounded: without the abort this waits forever. (asyncio ends a
        # drain woken by an aborted transport quietly or with ConnectionError.)
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(waiting, CorkedWriter.ABORT_GRACE_S + 20)
        assert writer.transport.is_closing()
        assert writer.transport.get_write_buffer_size() == 0  # dropped, not pending
        server.close()
        for w in stalled:
            w.close()

    asyncio.run(scenario())


def _deeply_nested_message(kind: str, fields: dict[str, object], key: str) -> bytes:
    """A msgpack map of `fields` plus `key` holding a value nested 200,000 deep."""
    enc = msgspec.msgpack.encode
    body = bytes([0x80 | (len(fields) + 2)]) + enc("type") + enc(kind)
    for name, value in fields.items():
        body += enc(name) + enc(value)
    return body + enc(key) + b"\x81" + enc("a") + b"\x91" * 200_000 + b"\xc0"


def test_a_value_nested_too_deep_is_a_malformed_message_not_a_recursion_error() -> None:
    engine = _deeply_nested_message(
        "register_pool", {"call_id": 1, "pool_id": "p", "shm_name": "", "nbytes": 1}, "layout"
    )
    with pytest.raises(MalformedMessageError, match="nested too deeply"):
        ENGINE_CODEC.decode(engine)
    peer = _deeply_nested_message("info", {"agent_name": "a"}, "compat")
    with pytest.raises(MalformedMessageError, match="nested too deeply"):
        PEER_CODEC.decode(peer)
