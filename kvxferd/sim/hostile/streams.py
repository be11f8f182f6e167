"""The fuzzers' raw connections to a daemon: a connection whose frames are read in the
background, waiting for a close, and slow-loris connections (issue 14)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from kvxferd.errors import ProtocolError
from kvxferd.peers.framing import FrameCodec, until_heard
from kvxferd.sim.hostile.report import FuzzReport

T = TypeVar("T")


class Listened(Generic[T]):
    """A connection we write raw bytes to while a task reads its frames (`on_message` for
    each), notes the error that ended it and sets `eof` when it ends; `got` is set on
    every frame and at the end."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, codec: FrameCodec[T]
    ) -> None:
        self.reader, self.writer = reader, writer
        self.codec = codec
        self.got = asyncio.Event()
        self.eof = asyncio.Event()
        self.error = ""
        self._task = asyncio.create_task(self._read())

    def on_message(self, msg: T) -> None:
        raise NotImplementedError

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.codec.read(self.reader)
                if msg is None:
                    break
                self.on_message(msg)
                self.got.set()
        except (ProtocolError, ConnectionError, OSError) as exc:
            self.error = str(exc)
        finally:
            self.eof.set()
            self.got.set()

    async def until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """True once `done()` holds or the connection has ended; False at the deadline."""
        return await until_heard(
            lambda: done() or self.eof.is_set(), self.got, time.monotonic() + timeout_s
        )

    async def close(self) -> None:
        self.writer.close()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def until_closed(reader: asyncio.StreamReader, timeout_s: float) -> bool:
    """Read (and drop) until the other side closes; False if it is still open at the
    deadline. A reset counts as closed."""

    async def drain() -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while await reader.read(64 << 10):
                pass

    try:
        await asyncio.wait_for(drain(), timeout_s)
    except asyncio.TimeoutError:
        return False
    return True


def short_hex(data: bytes, limit: int = 96) -> str:
    return data[:limit].hex() + ("..." if len(data) > limit else "")


Opener = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


async def stalled(
    open_: Opener,
    partial: list[bytes],
    n: int,
    report: FuzzReport,
    kind: str,
    who: str,
    deadline_s: float,
) -> None:
    """`n` connections (`open_`) that send one of `partial` and then nothing: the daemon
    must close each within `deadline_s`."""

    async def one(data: bytes) -> None:
        reader, writer = await open_()
        try:
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(data)
                await writer.drain()
            report.connections += 1
            report.count(kind)
            if await until_closed(reader, deadline_s):
                report.closed += 1
            else:
                report.hang(f"{who} sending {short_hex(data)} still open after {deadline_s} s")
        finally:
            writer.close()

    await asyncio.gather(*(one(partial[i % len(partial)]) for i in range(n)))
