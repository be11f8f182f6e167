"""Bounded cost of unauthenticated peer connections (issue 14).

Before this, 24 strangers each announcing a 16 MiB frame grew the context daemon by
~300 MiB, and 2,000 idle strangers were all accepted until the handshake timeout. Now a
frame before authentication may be at most PREAUTH_MAX_FRAME_BYTES (checked on the length
prefix, before any of the body is read), and at most PREAUTH_MAX_CONNECTIONS connections
(PREAUTH_MAX_PER_SOURCE from one address) may be unauthenticated at once: more are closed
before anything is read, and counted. Authenticated peers are served throughout.

The strangers connect from distinct loopback addresses (127.0.0.x, all of 127/8 is local
on Linux), so the per-source cap is tested apart from the overall one.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from daemon_harness import metric, peer_names, serve_once, status, until
from test_faults import _cfg

from kvxferd.backends.ucx import UCX_MAX_GREETING
from kvxferd.peers.framing import MAX_FRAME_BYTES, PREAUTH_MAX_FRAME_BYTES, FrameTooLargeError
from kvxferd.peers.messages import PEER_CODEC, Auth
from kvxferd.peers.preauth import PREAUTH_MAX_CONNECTIONS, PREAUTH_MAX_PER_SOURCE
from kvxferd.sim.cluster import DaemonProc, LocalCluster
from kvxferd.sim.hostile.streams import until_closed

MiB = 1 << 20


def rss_bytes(daemon: DaemonProc) -> int:
    with open(f"/proc/{daemon.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


class RssPeak:
    """The largest VmRSS seen while the block runs (sampled every 5 ms in a thread)."""

    def __init__(self, daemon: DaemonProc) -> None:
        self.daemon = daemon
        self.peak = rss_bytes(daemon)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes(self.daemon))

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.peak = max(self.peak, rss_bytes(self.daemon))


async def connect_from(
    daemon: DaemonProc, source: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = daemon.peer_address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port), local_addr=(source, 0))


async def closed_by_daemon(reader: asyncio.StreamReader, timeout_s: float = 10.0) -> bool:
    """True when the daemon ends the connection (EOF or reset) within `timeout_s`."""
    return await until_closed(reader, timeout_s)


def test_the_length_prefix_is_checked_before_the_body_is_awaited() -> None:
    """Only the header of a frame over the limit has arrived: read raises at once (it does
    not wait for, nor buffer, the announced body); under the normal limit it would wait."""

    async def scenario() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(struct.pack(">I", PREAUTH_MAX_FRAME_BYTES + 1))
        with pytest.raises(FrameTooLargeError, match="exceeds the 65536-byte limit"):
            await asyncio.wait_for(PEER_CODEC.read(reader, PREAUTH_MAX_FRAME_BYTES), 5)
        reader = asyncio.StreamReader()
        reader.feed_data(struct.pack(">I", PREAUTH_MAX_FRAME_BYTES + 1))
        with pytest.raises(asyncio.TimeoutError):  # waits for the body: it may come
            await asyncio.wait_for(PEER_CODEC.read(reader), 0.2)
        reader = asyncio.StreamReader()
        reader.feed_data(PEER_CODEC.encode(Auth(proof=b"p" * 32)))
        assert await PEER_CODEC.read(reader, PREAUTH_MAX_FRAME_BYTES) == Auth(proof=b"p" * 32)

    asyncio.run(scenario())


def test_an_oversize_frame_before_authentication_is_refused_unread(cluster: LocalCluster) -> None:
    """Each stranger announces a 16 MiB frame and pushes its body: the daemon closes the
    connection on the length prefix; its memory grows by nowhere near 16 MiB each."""
    assert PREAUTH_MAX_FRAME_BYTES < MAX_FRAME_BYTES
    ctx = cluster.start_daemon("ctx", "context", **_cfg(10000))
    gen = cluster.start_daemon("gen", "generation", **_cfg(10000))
    n = 24
    announced = 16 * MiB
    chunk = b"\0" * MiB

    async def stranger(i: int) -> bool:
        reader, writer = await connect_from(ctx, f"127.0.0.{10 + i}")
        try:
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(struct.pack(">I", announced))
                for _ in range(announced // len(chunk)):
                    writer.write(chunk)
                    await writer.drain()
            return await closed_by_daemon(reader)
        finally:
            writer.close()

    async def scenario() -> None:
        await serve_once(ctx, gen, "before")
        failures = dict(status(ctx)["handshake_failures"])
        oversize_before = failures.get("oversize_frame", 0)
        before = rss_bytes(ctx)
        with RssPeak(ctx) as rss:
            closed = await asyncio.wait_for(asyncio.gather(*(stranger(i) for i in range(n))), 60)
        assert all(closed), closed
        await until(
            lambda: (
                status(ctx)["handshake_failures"].get("oversize_frame", 0) == oversize_before + n
            ),
            what="every oversize frame counted as a handshake failure",
        )
        assert metric(ctx, "kvxferd_handshake_failures_total", reason="oversize_frame") == n
        grown = rss.peak - before
        print(f"context daemon RSS: {before / MiB:.1f} MiB, peak +{grown / MiB:.1f} MiB")
        # Unbounded, this was n x 16 MiB (384 MiB); bounded, a few MiB at most.
        assert grown < n * announced // 8, f"RSS grew by {grown / MiB:.1f} MiB"
        assert f"exceeds the {PREAUTH_MAX_FRAME_BYTES}-byte limit" in ctx.log_text()
        assert metric(ctx, "kvxferd_peer_unauthenticated_connections") == 0
        assert peer_names(ctx) == ["gen"]
        await serve_once(ctx, gen, "after")

    asyncio.run(scenario())


def test_idle_strangers_beyond_the_caps_are_closed_at_once(cluster: LocalCluster) -> None:
    """Idle unauthenticated connections fill the caps (a long handshake timeout keeps them
    open): the next one, per source and overall, is closed at once and counted; the
    authenticated peer is served meanwhile, and after the strangers leave a new daemon
    completes its handshake and moves a request."""
    ctx = cluster.start_daemon("ctx", "context", **_cfg(10000, handshake_timeout_ms=120000))
    gen = cluster.start_daemon("gen", "generation", **_cfg(10000))
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    def unauthenticated() -> float:
        return metric(ctx, "kvxferd_peer_unauthenticated_connections")

    def refused(reason: str) -> float:
        return metric(ctx, "kvxferd_peer_connections_refused_total", reason=reason)

    async def hold(source: str, count: int) -> None:
        for _ in range(count):
            held.append(await connect_from(ctx, source))

    async def refused_at_once(source: str) -> None:
        reader, writer = await connect_from(ctx, source)
        try:
            # Closed long before the 120 s handshake timeout could close it.
            assert await closed_by_daemon(reader, 10.0), f"a connection from {source} stayed open"
        finally:
            writer.close()

    async def scenario() -> None:
        try:
            await caps()
        finally:
            for _, writer in held:
                writer.close()

    async def caps() -> None:
        await serve_once(ctx, gen, "before")  # gen is authenticated: it does not count
        assert refused("preauth_limit") == 0 and refused("preauth_per_source_limit") == 0

        # Per source: one address may hold PREAUTH_MAX_PER_SOURCE, not one more.
        await hold("127.0.0.2", PREAUTH_MAX_PER_SOURCE)
        await until(lambda: unauthenticated() == PREAUTH_MAX_PER_SOURCE, what="strangers held")
        await refused_at_once("127.0.0.2")
        await until(lambda: refused("preauth_per_source_limit") == 1, what="per-source refusal")
        assert unauthenticated() == PREAUTH_MAX_PER_SOURCE

        # Overall: fill the rest from other addresses, then any address is refused.
        sources = PREAUTH_MAX_CONNECTIONS // PREAUTH_MAX_PER_SOURCE
        for k in range(1, sources):
            await hold(f"127.0.0.{2 + k}", PREAUTH_MAX_PER_SOURCE)
        assert len(held) == PREAUTH_MAX_CONNECTIONS
        await until(lambda: unauthenticated() == PREAUTH_MAX_CONNECTIONS, what="caps full")
        await refused_at_once("127.0.0.200")
        await refused_at_once("127.0.0.1")  # where the real peers come from, too
        await until(lambda: refused("preauth_limit") == 2, what="overall refusals")
        assert refused("preauth_per_source_limit") == 1
        assert not any(r.at_eof() for r, _ in held)  # the held ones wait for their timeout

        # The authenticated connection is not affected by the full caps.
        await serve_once(ctx, gen, "during")

        for _, writer in held:
            writer.close()
        await until(lambda: unauthenticated() == 0, what="the strangers' slots freed")
        gen2 = cluster.start_daemon("gen2", "generation", **_cfg(10000))
        await serve_once(ctx, gen2, "after-new-peer")
        await serve_once(ctx, gen, "after")
        assert peer_names(ctx) == ["gen", "gen2"]
        assert "closed 1 peer connection(s) before their handshake" in ctx.log_text()

    asyncio.run(scenario())


def _staged_pair(cluster: LocalCluster, backend: str) -> tuple[DaemonProc, DaemonProc, str]:
    """A context and a generation daemon staged over `backend` (UCX or MPI), and the
    address of the generation daemon's own listener for that backend."""
    cfg = _cfg(10000)
    cfg["transceiver"].update(backend=backend, transceiver_runtime="CPP")
    ctx = cluster.start_daemon("ctx", "context", **cfg)
    gen = cluster.start_daemon("gen", "generation", **cfg)
    found = re.search(rf"{backend} transport listening on (\S+)", gen.log_text())
    assert found is not None, gen.log_text()
    return ctx, gen, found[1]


def test_strangers_on_the_ucx_listener_beyond_the_cap_are_closed_at_once(
    cluster: LocalCluster,
) -> None:
    """ucxx's listener accepts any endpoint, and each holds two descriptors of the daemon
    until its hellos end (at most 10 s): 300 silent endpoints took 600 descriptors, and
    each timed-out one logged a line. Beyond UCX_MAX_GREETING endpoints in their hellos,
    a new one is closed at once, in one log line for many; the refused ones log at most
    8 lines per 10 s. Once the strangers leave, the pair links and moves a
    request over UCX."""
    ctx, gen, address = _staged_pair(cluster, "UCX")
    fds = Path(f"/proc/{gen.proc.pid}/fd")
    before = len(list(fds.iterdir()))
    stranger = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("ucx_flood.py")), address, "400"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stranger.stdout is not None
        line = stranger.stdout.readline()
        while line and not line.startswith("HELD"):  # REFUSED lines: a listener's refusal
            line = stranger.stdout.readline()
        assert line, "the stranger ended before it held its endpoints"
        # The first UCX_MAX_GREETING wait for their hellos (two descriptors each); the
        # rest were closed as they came.
        asyncio.run(
            until(
                lambda: "closed 1 UCX endpoint(s) before their handshake" in gen.log_text(),
                what="the refusal's log line",
            )
        )
        # Refused endpoints close as UCX gets to them: within a few seconds, well before
        # the held ones' hello timeout (10 s), when all of them would go.
        asyncio.run(
            until(
                lambda: len(list(fds.iterdir())) <= before + 2 * UCX_MAX_GREETING + 64,
                timeout_s=5.0,
                what="the refused endpoints' descriptors to close",
            )
        )
        assert metric(gen, "kvxferd_transport_connections_refused_total", reason="preauth_limit")
    finally:
        assert stranger.stdin is not None
        stranger.stdin.close()
        stranger.wait(30)
    asyncio.run(serve_once(ctx, gen, "after-strangers"))
    # The held ones failed as the stranger left: 8 lines a 10 s window, not one each.
    refusals = gen.log_text().count("UCX: refused an incoming endpoint")
    assert refusals < PREAUTH_MAX_CONNECTIONS // 4, gen.log_text()


def test_strangers_on_the_mpi_listener_beyond_the_caps_are_closed_at_once(
    cluster: LocalCluster,
) -> None:
    """The MPI backend's rendezvous listener takes the peer channel's caps: 16 silent
    connections from one address wait for their hello (10 s), the 17th is closed at once,
    in one log line for many; then the pair links and moves a request over MPI."""
    ctx, gen, address = _staged_pair(cluster, "MPI")
    host, port = address.rsplit(":", 1)
    held: list[asyncio.StreamWriter] = []

    async def scenario() -> None:
        try:
            for _ in range(PREAUTH_MAX_PER_SOURCE):
                _, writer = await asyncio.open_connection(
                    host, int(port), local_addr=("127.0.0.2", 0)
                )
                held.append(writer)
            reader, writer = await asyncio.open_connection(
                host, int(port), local_addr=("127.0.0.2", 0)
            )
            try:
                # At once, not at the 10 s hello timeout.
                assert await closed_by_daemon(reader, 5.0), "the 17th connection stayed open"
            finally:
                writer.close()
            await until(
                lambda: (
                    "closed 1 MPI rendezvous connection(s) before their handshake" in gen.log_text()
                ),
                what="the refusal's log line",
            )
            assert "preauth_per_source_limit" in gen.log_text()
            refused = "kvxferd_transport_connections_refused_total"
            assert metric(gen, refused, reason="preauth_per_source_limit") == 1
            assert metric(gen, refused, reason="preauth_limit") == 0
        finally:
            for w in held:
                w.close()
        await serve_once(ctx, gen, "after-strangers")

    asyncio.run(scenario())


def test_a_stranger_holding_the_mpi_port_leaves_the_daemon_serving(cluster: LocalCluster) -> None:
    """A stranger takes the generation daemon's MPI port (hello, then the ACK) and stays.
    MPICH holds every other MPI call of the daemon while that accept waits, and the
    daemon's next MPI call (its tick, with a live MPI link) stopped its event loop for
    good: status, metrics and the engine API with it. Now the status page answers while
    the accept still waits (before the daemon logs that it gave the accept up), and once
    it is released the pair moves a request over MPI."""
    from kvxferd.backends.mpi.accepts import ACCEPT_WINDOW_S
    from kvxferd.backends.mpi.wire import ACK, HELLO, frame

    ctx, gen, address = _staged_pair(cluster, "MPI")
    asyncio.run(serve_once(ctx, gen, "before"))  # a live MPI link: the tick calls MPI
    host, port = address.rsplit(":", 1)
    gave_up = f"did not complete MPI_Comm_connect within {ACCEPT_WINDOW_S:g} s"
    served_while_waiting = False
    for attempt in range(3):  # a host too slow to answer within the window tries again
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(frame(HELLO, b"ghost/%d" % attempt, b"nonce of 16 byte"))
            head = s.recv(7, socket.MSG_WAITALL)
            assert head[5] == ACK, head
            before = gen.log_text().count(gave_up)
            assert status(gen)["role"] == "generation"
            served_while_waiting = gen.log_text().count(gave_up) == before
            asyncio.run(
                until(
                    lambda: gen.log_text().count(gave_up) > before,  # noqa: B023
                    what="the stranger's accept given up",
                )
            )
        if served_while_waiting:
            break
    assert served_while_waiting, gen.log_text()
    asyncio.run(serve_once(ctx, gen, "after"))


def test_rendezvous_beyond_those_waiting_for_the_mpi_accept_are_refused_and_counted(
    cluster: LocalCluster,
) -> None:
    """A stranger holds the MPI accept (hello, ACK, silence) while 16 more hellos from one
    address wait for it: the next from that address is refused, and /metrics counts it as
    accept_queue_limit (counted by the listener, it never reached /metrics before). Then
    the pair moves a request over MPI."""
    from kvxferd.backends.mpi.accept_turns import MAX_WAITING_PER_SOURCE
    from kvxferd.backends.mpi.wire import ACK, HELLO, frame

    ctx, gen, address = _staged_pair(cluster, "MPI")
    host, port = address.rsplit(":", 1)
    refused = "kvxferd_transport_connections_refused_total"

    async def hello(source: str, name: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
        writer.write(frame(HELLO, name, b"nonce of 16 byte"))
        await writer.drain()
        return reader, writer

    async def scenario() -> None:
        writers: list[asyncio.StreamWriter] = []
        try:
            reader, writer = await hello("127.0.0.2", b"ghost/holder")
            writers.append(writer)
            assert (await asyncio.wait_for(reader.readexactly(7), 10))[5] == ACK
            for n in range(MAX_WAITING_PER_SOURCE):
                writers.append((await hello("127.0.0.3", b"ghost/%d" % n))[1])
            # One more from that address until the listener has read the others' hellos
            # (before, the pre-hello cap refuses it instead): then it waits no more.
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while not metric(gen, refused, 0, reason="accept_queue_limit"):
                assert loop.time() < deadline, gen.log_text()
                reader, writer = await hello("127.0.0.3", b"ghost/extra")
                writers.append(writer)
                assert await closed_by_daemon(reader, 5.0), "the extra hello was kept"
            assert "rendezvous from 127.0.0.3 already wait" in gen.log_text()
        finally:
            for w in writers:
                w.close()

    asyncio.run(scenario())
    asyncio.run(serve_once(ctx, gen, "after-strangers"))
