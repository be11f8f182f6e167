"""An engine cannot crash its daemon through its pool.

A sealed memfd pool (the default) cannot be shrunk, even by its own engine mid-transfer: the
truncate fails with EPERM, the request completes verified, the daemons stay up. A shm-name
pool (legacy) that its engine shrinks is refused for new work with a clear error instead of
being touched (which would kill the daemon with SIGBUS). Bad handoff connections get a clear
error, leave no fd behind in the daemon, and the daemon goes on.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import SimEngine, assert_clean, layout_for, status, wait_for

import kvxferd
from kvxferd import PROTOCOL_VERSION
from kvxferd.api.messages import DAEMON_CODEC, ENGINE_CODEC, PoolHandoff, RegisterPool, Reply
from kvxferd.client import AsyncClient, CallError
from kvxferd.memory import MemfdRegion, ShmRegion
from kvxferd.memory.shm import SHM_DIR
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.reference_engine import ReferenceEngine
from kvxferd.sim.workload import Item

REPO_ROOT = Path(kvxferd.__file__).resolve().parent.parent


def _start(cluster: LocalCluster, runtime: str) -> tuple[DaemonProc, DaemonProc]:
    t: dict[str, object] = {
        "backend": "NIXL",
        "transceiver_runtime": runtime,
        "kv_transfer_timeout_ms": 20000,
    }
    if runtime == "CPP":
        t["max_tokens_in_buffer"] = 128  # 4 blocks of staging: a long prompt moves in rounds
    return (
        cluster.start_daemon("ctx", "context", transceiver=t),
        cluster.start_daemon("gen", "generation", transceiver=t),
    )


async def memfd_engine(
    daemon: DaemonProc, major: str = "block-major", num_blocks: int = 512, pool_id: str = "pool0"
) -> SimEngine:
    """A SimEngine whose pool is a sealed memfd handed to its daemon."""
    client = await AsyncClient.connect(daemon.api_socket, engine=f"test-{daemon.name}")
    engine = SimEngine(client, layout_for(major, num_blocks), pool_id)
    region = MemfdRegion.create(engine.layout.pool_bytes, f"test-{pool_id}")
    try:
        await client.register_pool(pool_id, region, engine.layout)
    except BaseException:
        region.close()
        await client.close()
        raise
    engine.region = region  # type: ignore[assignment]  # the harness's field says ShmRegion
    return engine


def try_to_shrink(region: Any) -> list[str]:
    """Every way an engine has to shrink its own memfd; each must fail with EPERM."""
    fd = region.fd
    failures = []
    for size in (0, region.nbytes // 2, region.nbytes - 1):
        for how, target in (("ftruncate", fd), ("truncate /proc/self/fd", f"/proc/self/fd/{fd}")):
            try:
                os.truncate(target, size)  # an int is an fd: ftruncate
            except PermissionError:
                continue
            failures.append(f"{how} to {size} bytes succeeded")
    assert os.fstat(fd).st_size == region.nbytes
    return failures


async def _move(c: SimEngine, g: SimEngine, ctx: DaemonProc, rid: str, tokens: int) -> None:
    dst = await g.recv(rid, tokens, ctx.peer_address)
    await c.send(rid, tokens)
    got = await g.client.wait(rid, 60)
    sent = await c.client.wait(rid, 60)
    assert (got.status, got.reason) == ("done", "ok"), got
    assert sent.status == "done" and sent.nbytes == got.nbytes
    result = g.verify(rid, dst, tokens)
    assert result.ok, result.first_mismatch
    await g.client.release(rid)
    await c.client.release(rid)


@pytest.mark.parametrize("runtime", ["CPP", "PYTHON"])
def test_a_memfd_pool_cannot_be_shrunk_mid_transfer(cluster: LocalCluster, runtime: str) -> None:
    ctx, gen = _start(cluster, runtime)

    async def scenario() -> None:
        c = await memfd_engine(ctx)
        g = await memfd_engine(gen, "layer-major")
        try:
            # 4000 tokens = 125 blocks of 256 KiB: 32 rounds through the CPP staging buffer.
            tokens = 4000
            dst = await g.recv("big", tokens, ctx.peer_address)
            others = asyncio.gather(*(_move(c, g, ctx, f"other-{i}", 300) for i in range(3)))
            await c.send("big", tokens)
            # While the request is under way, both engines try to shrink their pools.
            failures = try_to_shrink(c.region) + try_to_shrink(g.region)
            assert not failures, failures
            got = await g.client.wait("big", 60)
            sent = await c.client.wait("big", 60)
            # The seals held, so nothing could go wrong: it completes, every byte verified.
            assert (got.status, got.reason) == ("done", "ok"), got
            assert (sent.status, sent.reason) == ("done", "ok"), sent
            result = g.verify("big", dst, tokens)
            assert result.ok, result.first_mismatch
            await g.client.release("big")
            await c.client.release("big")
            await others  # the requests alongside were unaffected
            await _move(c, g, ctx, "after", 1000)
        finally:
            await c.close()
            await g.close()

    asyncio.run(scenario())
    for d in (ctx, gen):
        assert d.alive(), d.log_text()[-2000:]
        assert "handed over as a sealed memfd" in d.log_text()
        assert "shared by shm name" not in d.log_text()
        assert_clean(d)
    assert cluster.stop_all() == {"ctx": 0, "gen": 0}


async def shm_engine_shrunk(daemon: DaemonProc, pool_id: str) -> SimEngine:
    """A legacy engine: its pool is a POSIX shm object shared by name, which it then shrinks
    (while no request uses it, so the daemon has not touched the lost pages)."""
    client = await AsyncClient.connect(daemon.api_socket, engine=f"legacy-{daemon.name}")
    engine = SimEngine(client, layout_for("block-major", 64), pool_id)
    name = f"kvxferd-test-shrink-{pool_id}-{os.getpid()}"
    engine.region = ShmRegion.create(name, engine.layout.pool_bytes)
    try:
        await client.register_pool(pool_id, name, engine.layout)
        os.truncate(os.path.join(SHM_DIR, name), engine.layout.pool_bytes // 2)
    finally:
        engine.region.unlink()
    return engine


def test_a_shrunk_shm_name_pool_is_refused_and_the_daemon_lives(cluster: LocalCluster) -> None:
    ctx, gen = _start(cluster, "PYTHON")

    async def scenario() -> None:
        c_legacy = await shm_engine_shrunk(ctx, "legacy")
        g_legacy = await shm_engine_shrunk(gen, "legacy")
        c = await memfd_engine(ctx)
        g = await memfd_engine(gen)
        try:
            half = c_legacy.layout.pool_bytes // 2
            with pytest.raises(CallError) as sent:
                await c_legacy.send("s1", 100)
            assert sent.value.code == "pool_shrunk"
            assert f"pool 'legacy': its shared memory object shrank to {half} bytes" in str(
                sent.value
            )
            with pytest.raises(CallError) as got:
                await g_legacy.recv("r1", 100, ctx.peer_address)
            assert got.value.code == "pool_shrunk" and "SIGBUS" in got.value.message
            # Nothing was started; the engines can withdraw the pools.
            await c_legacy.client.deregister_pool("legacy")
            await g_legacy.client.deregister_pool("legacy")
            # The daemons serve everyone else as before.
            await _move(c, g, ctx, "unaffected", 700)
        finally:
            for e in (c_legacy, g_legacy, c, g):
                await e.close(deregister=e is c or e is g)

    asyncio.run(scenario())
    for d in (ctx, gen):
        assert d.alive(), d.log_text()[-2000:]
        assert "pool legacy is shared by shm name" in d.log_text()
        assert_clean(d)
    assert cluster.stop_all() == {"ctx": 0, "gen": 0}


def _daemon_pid(daemon: DaemonProc) -> int:
    return daemon.proc.pid


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _exchange(path: str, data: bytes, fds: list[int]) -> Reply | None:
    """One raw connection: send `data` (fds as SCM_RIGHTS), read the answer frame; None if the
    daemon closed without one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)  # the daemon closes a silent connection well before this
        sock.connect(path)
        if fds:
            socket.send_fds(sock, [data], fds)
        elif data:
            sock.sendall(data)
        buf = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except ConnectionResetError:
            pass
    if len(buf) < 4:
        return None
    reply = DAEMON_CODEC.decode(buf[4 : 4 + int.from_bytes(buf[:4], "big")])
    assert isinstance(reply, Reply)
    return reply


def test_bad_handoffs_get_clear_errors_and_the_daemon_goes_on(cluster: LocalCluster) -> None:
    ctx, gen = _start(cluster, "CPP")
    layout = layout_for("block-major", 512)
    frame = ENGINE_CODEC.encode(
        PoolHandoff(call_id=5, version=PROTOCOL_VERSION, pool_id="p0", nbytes=layout.pool_bytes)
    )
    pid = _daemon_pid(ctx)
    baseline = _fd_count(pid)

    unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, layout.pool_bytes)
    pipe_r, pipe_w = os.pipe()
    try:
        sealed = MemfdRegion.create(layout.pool_bytes)
        cases: list[tuple[str, bytes, list[int], str | None]] = [
            ("garbage", b"GET / HTTP/1.1\r\n\r\n", [], "exceeds the 65536-byte limit"),
            ("silence", b"", [], "no complete first frame"),
            ("no fd", frame, [], "the handoff carries no file descriptor"),
            ("two fds", frame, [sealed.fd, sealed.fd], "carries 2 file descriptors"),
            ("unsealed", frame, [unsealed], "not sealed against shrinking"),
            ("a pipe", frame, [pipe_r], "is not a memfd"),
        ]
        for what, data, fds, match in cases:
            reply = _exchange(ctx.api_socket, data, fds)
            assert reply is not None and not reply.ok, (what, reply)
            assert match is None or match in reply.message, (what, reply.message)
            assert "pool 'p0'" in reply.message or what in ("garbage", "silence"), reply.message
        wait_for(lambda: _fd_count(pid) <= baseline, 20, "the daemon to close every fd it got")
        sealed.close()
    finally:
        for fd in (unsealed, pipe_r, pipe_w):
            os.close(fd)

    # A token handed over by another process cannot be used by this one.
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from kvxferd.api.handoff import hand_off_fd\n"
            "from kvxferd.memory import MemfdRegion\n"
            f"r = MemfdRegion.create({layout.pool_bytes})\n"
            f"reply = hand_off_fd(sys.argv[1], r.fd, 'p0', {layout.pool_bytes})\n"
            "assert reply.ok, reply\n"
            "print(reply.result)\n",
            ctx.api_socket,
        ],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    token = child.stdout.strip()

    async def scenario() -> None:
        client = await AsyncClient.connect(ctx.api_socket, engine="thief")
        try:
            msg = RegisterPool(
                call_id=1,
                pool_id="p0",
                shm_name="",
                nbytes=layout.pool_bytes,
                layout=dict(layout.to_wire()),
                handoff=token,
            )
            with pytest.raises(CallError, match="belongs to another process"):
                await client._call(msg)  # the raw call: the token is the point here
        finally:
            await client.close()
        # The daemon goes on: real engines register and move KV as ever.
        c = await memfd_engine(ctx)
        g = await memfd_engine(gen)
        try:
            await _move(c, g, ctx, "after-bad-handoffs", 1000)
        finally:
            await c.close()
            await g.close()

    asyncio.run(scenario())
    assert ctx.alive() and gen.alive()
    assert status(ctx)["pools"] == []
    assert "pool handoff from" in ctx.log_text() and "refused" in ctx.log_text()
    assert_clean(ctx)
    assert_clean(gen)
    assert cluster.stop_all() == {"ctx": 0, "gen": 0}


def test_the_reference_engine_hands_memfds_by_default_and_shm_names_on_request(
    cluster: LocalCluster,
) -> None:
    ctx, gen = _start(cluster, "PYTHON")

    async def scenario() -> None:
        layout = layout_for("block-major", 64)
        clients = [
            await AsyncClient.connect(ctx.api_socket, engine="ref-ctx"),
            await AsyncClient.connect(gen.api_socket, engine="ref-gen"),
        ]
        c = ReferenceEngine(clients[0], layout, "pool0")
        g = ReferenceEngine(clients[1], layout, "pool0")
        try:
            await c.open(shm_names=True)  # the compatibility path
            await g.open()
            assert isinstance(c.region, ShmRegion) and isinstance(g.region, MemfdRegion)
            item = Item("ref-1", 500)
            receiving = asyncio.create_task(g.recv_one(item, ctx.peer_address))
            sent = await c.send_one(item)
            got = await receiving
            assert (sent.status, got.status, got.verified) == ("done", "done", True), (sent, got)
        finally:
            await c.close()
            await g.close()
            for client in clients:
                await client.close()

    asyncio.run(scenario())
    assert "pool pool0 is shared by shm name" in ctx.log_text()
    assert "handed over as a sealed memfd" in gen.log_text()
    assert cluster.stop_all() == {"ctx": 0, "gen": 0}
