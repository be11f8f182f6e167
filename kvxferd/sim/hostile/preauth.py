"""The peer channel before authentication: strangers sending hostile bytes, and slow-loris
strangers that never finish a frame (issue 14)."""

from __future__ import annotations

import asyncio
import contextlib
import random

from kvxferd import PROTOCOL_VERSION
from kvxferd.hostport import split_hostport
from kvxferd.peers.framing import PREAUTH_MAX_FRAME_BYTES
from kvxferd.peers.messages import PEER_CODEC, Hello, PeerMessage
from kvxferd.sim.cluster import DaemonProc
from kvxferd.sim.hostile.bodies import HEADER, Bodies, frame
from kvxferd.sim.hostile.report import FuzzReport
from kvxferd.sim.hostile.streams import short_hex, stalled, until_closed


def _preauth_payload(rng: random.Random, bodies: Bodies) -> tuple[str, bytes]:
    """What a stranger sends on a fresh peer connection: one hostile frame, raw garbage, a
    lying length prefix, or a hostile frame after a well-formed Hello."""
    r = rng.random()
    if r < 0.1:
        return "raw_garbage", rng.randbytes(rng.randint(1, 512))
    if r < 0.15:
        return "http", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    if r < 0.2:
        length = rng.choice((PREAUTH_MAX_FRAME_BYTES + 1, 2**32 - 1, 1 << 24))
        return "oversize_prefix", HEADER.pack(length) + rng.randbytes(rng.randint(0, 64))
    if r < 0.25:
        n = rng.randint(1, 200)
        return "truncated_frame", HEADER.pack(n + rng.randint(1, 100)) + rng.randbytes(n)
    if r < 0.3:
        return "empty_frame", HEADER.pack(0)
    kind, body = bodies.any()
    if r < 0.45:
        hello = Hello(
            version=PROTOCOL_VERSION,
            name=f"stranger-{rng.randrange(1000)}",
            incarnation="1",
            role=rng.choice(("generation", "context")),
            nonce=rng.randbytes(32),
        )
        return "after_hello_" + kind, PEER_CODEC.encode(hello) + frame(body)
    return kind, frame(body)


async def _stranger(host: str, port: int, data: bytes, timeout_s: float) -> tuple[bool, bool]:
    """One unauthenticated connection: send `data`, end our side, wait for the close.
    (connected, closed in time)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return False, True
    try:
        with contextlib.suppress(ConnectionError, OSError):
            writer.write(data)
            await writer.drain()
            writer.write_eof()
        return True, await until_closed(reader, timeout_s)
    finally:
        writer.close()


async def fuzz_preauth(
    daemon: DaemonProc,
    count: int,
    seed: int,
    report: FuzzReport,
    concurrency: int = 8,
    deadline_s: float = 10.0,
) -> None:
    """`count` connections from strangers, each sending hostile bytes before any
    authentication. Every one must be closed by the daemon within `deadline_s` of our
    end of stream. `concurrency` stays under the daemon's per-source pre-auth cap."""
    rng = random.Random(seed)
    bodies = Bodies(PeerMessage, rng, max_str=16 << 10)
    host, port = split_hostport(daemon.peer_address)
    sem = asyncio.Semaphore(concurrency)
    cases = [_preauth_payload(rng, bodies) for _ in range(count)]

    async def one(i: int, kind: str, data: bytes) -> None:
        async with sem:
            connected, closed = await _stranger(host, int(port), data, deadline_s)
        report.connections += 1
        report.count("preauth_" + kind)
        if not connected:
            report.surprise(f"preauth #{i} ({kind}): could not connect (refused at the cap?)")
        elif closed:
            report.closed += 1
        else:
            report.hang(
                f"preauth #{i} ({kind}, seed {seed}): open {deadline_s} s: {short_hex(data)}"
            )

    await asyncio.gather(*(one(i, k, d) for i, (k, d) in enumerate(cases)))


async def stalled_strangers(
    daemon: DaemonProc, report: FuzzReport, deadline_s: float, n: int = 4
) -> None:
    """Slow-loris strangers on the peer port: silent, or half a frame and then nothing.
    The daemon must close each by its handshake timeout (`deadline_s` includes a margin)."""
    host, port = split_hostport(daemon.peer_address)
    partial = [b"", HEADER.pack(200) + b"\x85", b"\x00\x00", PEER_CODEC.encode(
        Hello(version=PROTOCOL_VERSION, name="slow", incarnation="1", role="generation",
              nonce=b"\0" * 32))]  # fmt: skip

    await stalled(
        lambda: asyncio.open_connection(host, int(port)),
        partial,
        n,
        report,
        "preauth_stalled",
        "stalled stranger",
        deadline_s,
    )
