"""The engine API's pool handoff (SCM_RIGHTS on a second connection), against an in-process
ApiServer: this process is both ends, so /proc/self/fd counts every fd the server keeps.

Bad handoffs (garbage, silence, no fd, too many fds, an fd that is no sealed memfd) get a
clear error and a closed connection, every fd received is closed, and the server goes on.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from fd_harness import fd_table
from layout_harness import tiny_layout

from kvxferd import PROTOCOL_VERSION
from kvxferd.api.handoff import HandoffError, PeerCred
from kvxferd.api.messages import (
    DAEMON_CODEC,
    ENGINE_CODEC,
    EngineHello,
    EngineMessage,
    PoolHandoff,
    RegisterPool,
    Reply,
)
from kvxferd.api.server import ApiServer, EngineConnection
from kvxferd.client import AsyncClient, CallError
from kvxferd.errors import RequestError
from kvxferd.memory import MemfdRegion

LAYOUT = tiny_layout(num_kv_heads=2, head_dim=64, tokens_per_block=32, num_blocks=8)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Handler:
    """Plays the daemon's part of RegisterPool: takes the handed-over fd, checks it, closes it."""

    daemon_name = "test"
    role = "context"
    tokens_per_block = 32

    def __init__(self) -> None:
        self.server: ApiServer | None = None
        self.registered: dict[str, int] = {}  # pool id -> size of the memfd it got

    async def handle_call(self, engine: EngineConnection, msg: EngineMessage) -> str:
        assert self.server is not None
        if not isinstance(msg, RegisterPool) or not msg.handoff:
            raise RequestError("bad_request", f"unexpected {type(msg).__name__}")
        fd = self.server.take_handoff(msg.handoff, engine, msg.pool_id)
        try:
            self.registered[msg.pool_id] = os.fstat(fd).st_size
        finally:
            os.close(fd)
        return ""

    async def engine_gone(self, engine: EngineConnection) -> None:
        pass


async def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


def run(scenario: Callable[[ApiServer, Handler, str], Awaitable[None]], tmp_path: Path) -> None:
    """Run `scenario` against a fresh server; afterwards no fd of it may be left open."""

    async def main() -> None:
        path = str(tmp_path / "api.sock")
        handler = Handler()
        server = ApiServer(path, handler, first_frame_timeout_s=0.5)
        handler.server = server
        baseline = fd_table()
        await server.start()
        try:
            await scenario(server, handler, path)
        finally:
            await server.close()
        # Nothing opened since is left (an equal count once failed: fd_harness).
        await wait_until(lambda: fd_table() <= baseline, "the server's fds to be closed")

    asyncio.run(main())


def raw_exchange(path: str, data: bytes, fds: list[int] | None = None) -> tuple[Any, bytes]:
    """Blocking: connect, send `data` (with `fds` as SCM_RIGHTS), read the answer frame (or
    None) and whatever follows until the server closes (b"" when it closes right after)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(path)
        if data:
            if fds:
                socket.send_fds(sock, [data], fds)
            else:
                sock.sendall(data)
        chunks = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks += chunk
    if len(chunks) < 4:
        return None, chunks
    n = int.from_bytes(chunks[:4], "big")
    return DAEMON_CODEC.decode(chunks[4 : 4 + n]), chunks[4 + n :]


def handoff_frame(pool_id: str = "p0", nbytes: int = LAYOUT.pool_bytes) -> bytes:
    return ENGINE_CODEC.encode(
        PoolHandoff(call_id=9, version=PROTOCOL_VERSION, pool_id=pool_id, nbytes=nbytes)
    )


def unsealed_memfd(nbytes: int = LAYOUT.pool_bytes) -> int:
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    return fd


def test_a_sealed_memfd_is_handed_over_and_registered(tmp_path: Path) -> None:
    async def scenario(server: ApiServer, handler: Handler, path: str) -> None:
        client = await AsyncClient.connect(path)
        try:
            with MemfdRegion.create(LAYOUT.pool_bytes) as region:
                await client.register_pool("p0", region, LAYOUT)
                await client.register_memfd_pool("p1", region.fd, LAYOUT)
            assert handler.registered == {"p0": LAYOUT.pool_bytes, "p1": LAYOUT.pool_bytes}
            assert len(server.handoffs) == 0
        finally:
            await client.close()

    run(scenario, tmp_path)


@pytest.mark.parametrize(
    ("case", "code", "match"),
    [
        ("garbage", "bad_request", "exceeds the 65536-byte limit"),
        ("bad-body", "bad_request", "malformed engine API message"),
        ("no-fd", "bad_request", "pool 'p0': the handoff carries no file descriptor"),
        ("three-fds", "bad_request", "pool 'p0': the handoff carries 3 file descriptors"),
        ("many-fds", "bad_request", "carries 4 or more file descriptors"),
        ("unsealed", "unsealed_pool", "pool 'p0': the memfd is not sealed.*F_SEAL_SHRINK"),
        ("pipe", "unsealed_pool", r"pool 'p0': the file descriptor is not a memfd \(pipe:"),
        ("small", "bad_request", "pool 'p0': the memfd has 4096 bytes"),
        ("fd-with-hello", "bad_request", "accepted only with a pool_handoff"),
        ("silence", "bad_request", "no complete first frame .* within 0.5 s"),
    ],
)
def test_a_bad_handoff_gets_a_clear_error_and_the_server_goes_on(
    tmp_path: Path, case: str, code: str, match: str
) -> None:
    async def scenario(server: ApiServer, handler: Handler, path: str) -> None:
        ours: list[int] = []  # the sender's own fds, closed by the test
        data, fds = handoff_frame(), []
        if case == "garbage":
            data = b"\xff" * 64
        elif case == "bad-body":
            data = b"\0\0\0\x03abc"
        elif case in ("three-fds", "many-fds"):
            with MemfdRegion.create(LAYOUT.pool_bytes) as good:
                ours += [os.dup(good.fd) for _ in range(3 if case == "three-fds" else 12)]
            fds = ours
        elif case == "unsealed":
            ours.append(unsealed_memfd())
        elif case == "pipe":
            ours.extend(os.pipe())
        elif case == "small":
            region = MemfdRegion.create(4096)
            ours.append(os.dup(region.fd))
            region.close()
        elif case == "fd-with-hello":
            data = ENGINE_CODEC.encode(EngineHello(version=PROTOCOL_VERSION, engine="x"))
            ours.append(unsealed_memfd())
        elif case == "silence":
            data = b""
        if case in ("unsealed", "pipe", "small", "fd-with-hello"):
            fds = ours[:1]
        before = open_fds()
        try:
            reply, rest = await asyncio.to_thread(raw_exchange, path, data, fds)
        finally:
            for fd in ours:
                os.close(fd)
        assert isinstance(reply, Reply) and not reply.ok, reply
        assert reply.error == code, reply
        assert __import__("re").search(match, reply.message), reply.message
        assert rest == b""  # the server closed the connection after its answer
        assert len(server.handoffs) == 0
        await wait_until(lambda: open_fds() <= before - len(ours), "received fds to be closed")
        # The server goes on: a good handoff right after works.
        client = await AsyncClient.connect(path)
        try:
            with MemfdRegion.create(LAYOUT.pool_bytes) as region:
                await client.register_pool("p0", region, LAYOUT)
            assert handler.registered == {"p0": LAYOUT.pool_bytes}
        finally:
            await client.close()

    run(scenario, tmp_path)


def test_tokens_are_used_once_expire_and_stay_with_their_process(tmp_path: Path) -> None:
    async def scenario(server: ApiServer, handler: Handler, path: str) -> None:
        client = await AsyncClient.connect(path)
        try:
            with MemfdRegion.create(LAYOUT.pool_bytes) as region:
                reply = await asyncio.to_thread(raw_exchange, path, handoff_frame(), [region.fd])
                token = reply[0].result
                assert reply[0].ok and token and len(server.handoffs) == 1
                # Another process (other credentials) cannot use it; the owner still can.
                other = PeerCred(pid=os.getpid() + 1, uid=os.getuid(), gid=os.getgid())
                with pytest.raises(HandoffError, match="belongs to another process"):
                    server.handoffs.take(token, other, "p0")

                def register(tok: str, pool_id: str = "p0") -> Awaitable[str]:
                    msg = RegisterPool(
                        call_id=1000 + len(handler.registered),
                        pool_id=pool_id,
                        shm_name="",
                        nbytes=LAYOUT.pool_bytes,
                        layout=dict(LAYOUT.to_wire()),
                        handoff=tok,
                    )
                    return client._call(msg)  # the raw call: the token is the point here

                with pytest.raises(CallError, match="issued for pool 'p0'"):
                    await register(token, "p9")
                await register(token)
                assert handler.registered == {"p0": LAYOUT.pool_bytes}
                with pytest.raises(CallError, match="unknown, already used or expired"):
                    await register(token)
                # An unused token expires and its fd is closed.
                server.handoffs.ttl_s = 0.1
                before = open_fds()
                reply = await asyncio.to_thread(raw_exchange, path, handoff_frame(), [region.fd])
                assert reply[0].ok
                await wait_until(lambda: len(server.handoffs) == 0, "the token to expire")
                await wait_until(lambda: open_fds() <= before, "the expired fd to be closed")
                with pytest.raises(CallError, match="unknown, already used or expired"):
                    await register(reply[0].result)
                # The seals are what the daemon checked: still the engine's, unchanged.
                assert fcntl.fcntl(region.fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        finally:
            await client.close()

    run(scenario, tmp_path)


def test_a_handoff_on_the_main_connection_is_refused(tmp_path: Path) -> None:
    async def scenario(server: ApiServer, handler: Handler, path: str) -> None:
        client = await AsyncClient.connect(path)
        try:
            msg = PoolHandoff(call_id=77, version=PROTOCOL_VERSION, pool_id="p0", nbytes=1)
            with pytest.raises(CallError, match="first frame of its own connection"):
                await client._call(msg)
        finally:
            await client.close()

    run(scenario, tmp_path)
