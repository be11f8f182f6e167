"""The engine API under fuzz: hostile calls and frames on a registered engine connection,
hostile first frames, silent engines (issue 14)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time

from kvxferd import PROTOCOL_VERSION
from kvxferd.api.messages import (
    DAEMON_CODEC,
    ENGINE_CODEC,
    Cancel,
    DaemonHello,
    DaemonMessage,
    DeregisterPool,
    EngineHello,
    EngineMessage,
    PoolHandoff,
    Query,
    Recv,
    RegisterPool,
    Release,
    Reply,
    Send,
)
from kvxferd.errors import KvxferdError, ProtocolError
from kvxferd.memory.shm import ShmRegion
from kvxferd.sim.cluster import DaemonProc
from kvxferd.sim.hostile.bodies import HEADER, Bodies, frame
from kvxferd.sim.hostile.report import FuzzReport
from kvxferd.sim.hostile.streams import Listened, short_hex, stalled, until_closed
from kvxferd.sim.hostile.values import Values, fuzz_layout, hostile_layout


def _engine_call(
    rng: random.Random, values: Values, call_id: int, pool_id: str, peer_hint: str
) -> EngineMessage:
    """A well-formed engine call with hostile values (answered with a Reply, never a close).
    Some are plausible (the fuzzer's real pool, blocks in range, the real context peer, a
    small set of request ids): they are accepted, and the calls after them (a duplicate,
    a cancel, a query, a release, a send of a receive's id) meet requests that exist."""
    rid = values.str_()[:300] if rng.random() < 0.4 else f"fz-{rng.randrange(40)}"
    if rng.random() < 0.25:
        n = rng.randint(1, 4)
        blocks = rng.sample(range(16), n)
        if rng.random() < 0.5:
            return Recv(
                call_id=call_id, request_id=rid, pool_id=pool_id, blocks=blocks,
                peer=peer_hint, num_tokens=rng.randint(1, 32 * n),
            )  # fmt: skip
        return Send(
            call_id=call_id, request_id=rid, pool_id=pool_id, blocks=blocks, token_start=0,
            token_end=rng.randint(1, 32 * n), last=rng.random() < 0.7,
        )  # fmt: skip
    pool = pool_id if rng.random() < 0.6 else values.str_()[:64]
    blocks = [rng.randrange(16) for _ in range(rng.randint(1, 4))]
    if rng.random() < 0.5:
        blocks = [values.int_() for _ in range(values.length())]
    kind = rng.randrange(9)
    if kind == 0:
        return Recv(
            call_id=call_id, request_id=rid, pool_id=pool, blocks=blocks,
            peer=rng.choice((peer_hint, "", "127.0.0.1:1", values.str_()[:64])),
            num_tokens=rng.choice((None, values.int_(), 32 * len(blocks))),
            beam_width=rng.choice((1, values.int_())),
            peers=rng.choice(([], [peer_hint, peer_hint], [values.str_()[:32]])),
            block_start=rng.choice((0, values.int_())),
        )  # fmt: skip
    if kind == 1:
        start, end = values.int_(), rng.choice((values.int_(), 32 * len(blocks)))
        return Send(
            call_id=call_id, request_id=rid, pool_id=pool, blocks=blocks, token_start=start,
            token_end=end, last=rng.random() < 0.7, beam_width=rng.choice((1, values.int_())),
            peer=rng.choice(("", "gen", values.str_()[:64])),
        )  # fmt: skip
    if kind == 2:
        return Cancel(call_id=call_id, request_id=rid)
    if kind == 3:
        return Release(call_id=call_id, request_id=rid)
    if kind == 4:
        return Query(call_id=call_id, request_id=rid)
    if kind == 5:
        # Never the fuzzer's own pool: later calls need it.
        return DeregisterPool(call_id=call_id, pool_id=values.str_()[:64] + "-x")
    if kind == 6:
        layout = hostile_layout(rng, values)
        return RegisterPool(
            call_id=call_id, pool_id=values.str_()[:64], shm_name=values.str_()[:255],
            nbytes=values.int_(), layout=layout, tp_rank=values.int_(), tp_size=values.int_(),
            handoff=rng.choice(("", values.str_()[:64])),
        )  # fmt: skip
    if kind == 7:
        return EngineHello(version=values.int_(), engine=values.str_())
    return PoolHandoff(
        call_id=call_id, version=values.int_(), pool_id=values.str_()[:64], nbytes=values.int_()
    )


class _Engine(Listened[DaemonMessage]):
    """A raw engine connection: every frame we send must get exactly one Reply."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.replies: list[Reply] = []
        self.call_ids: set[int] = set()
        self.others = 0
        super().__init__(reader, writer, DAEMON_CODEC)

    @classmethod
    async def connect(cls, path: str, timeout_s: float) -> _Engine:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), timeout_s)
        writer.write(ENGINE_CODEC.encode(EngineHello(version=PROTOCOL_VERSION, engine="fuzzer")))
        await writer.drain()
        hello = await asyncio.wait_for(DAEMON_CODEC.read(reader), timeout_s)
        if not isinstance(hello, DaemonHello):
            writer.close()
            raise ProtocolError(f"the daemon answered the hello with {hello!r}")
        return cls(reader, writer)

    def on_message(self, msg: DaemonMessage) -> None:
        if isinstance(msg, Reply):
            self.replies.append(msg)
            self.call_ids.add(msg.call_id)
        else:
            self.others += 1

    async def replies_within(self, n: int, timeout_s: float) -> bool:
        return (
            await self.until(lambda: len(self.replies) >= n, timeout_s) and len(self.replies) >= n
        )


async def _first_frame_case(
    path: str, rng: random.Random, bodies: Bodies, deadline_s: float
) -> tuple[str, bytes, str]:
    """A connection whose first frame is hostile: the daemon answers bad_request (or not)
    and closes. Returns (kind, data, 'closed' | 'hung')."""
    r = rng.random()
    if r < 0.2:
        kind, data = "oversize_first", HEADER.pack(rng.choice((2**32 - 1, 1 << 20))) + b"\0" * 8
    elif r < 0.3:
        kind, data = "truncated_first", HEADER.pack(100) + rng.randbytes(rng.randint(0, 99))
    elif r < 0.4:
        call = Query(call_id=1, request_id="x")  # a call before the hello
        kind, data = "call_before_hello", ENGINE_CODEC.encode(call)
    elif r < 0.5:
        handoff = PoolHandoff(call_id=3, version=PROTOCOL_VERSION, pool_id="p", nbytes=4096)
        kind, data = "handoff_without_fd", ENGINE_CODEC.encode(handoff)
    elif r < 0.6:
        hello = EngineHello(version=rng.choice((0, PROTOCOL_VERSION + 1, -1)), engine="old")
        kind, data = "hello_wrong_version", ENGINE_CODEC.encode(hello)
    else:
        kind, body = bodies.any()
        kind, data = "first_" + kind, frame(body)
    reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), deadline_s)
    try:
        with contextlib.suppress(ConnectionError, OSError):
            writer.write(data)
            await writer.drain()
            writer.write_eof()
        if kind == "hello_wrong_version" or await until_closed(reader, deadline_s):
            # A hello (of any version) that decodes leaves the stream to the next frame:
            # our end of stream closes it. Either way it must end within the deadline.
            if kind == "hello_wrong_version" and not await until_closed(reader, deadline_s):
                return kind, data, "hung"
            return kind, data, "closed"
        return kind, data, "hung"
    finally:
        writer.close()


async def _registered_engine(
    daemon: DaemonProc, pool_id: str, seed: int, deadline_s: float
) -> _Engine:
    """A raw engine connection with a small real pool of its own, registered."""
    layout = fuzz_layout()
    name = f"kvxferd-fuzz-{os.getpid()}-{seed}-{time.monotonic_ns()}"
    region = ShmRegion.create(name, layout.pool_bytes)
    try:
        engine = await _Engine.connect(daemon.api_socket, deadline_s)
        register = RegisterPool(
            call_id=1, pool_id=pool_id, shm_name=region.name, nbytes=layout.pool_bytes,
            layout=dict(layout.to_wire()),
        )  # fmt: skip
        engine.writer.write(ENGINE_CODEC.encode(register))
        if not await engine.replies_within(1, deadline_s) or not engine.replies[0].ok:
            await engine.close()
            raise KvxferdError(f"the fuzzer's pool was not registered: {engine.replies}")
    finally:
        region.unlink()
        region.close()  # the daemon has its own mapping
    engine.replies.clear()
    return engine


async def _culprit(
    daemon: DaemonProc, frames: list[tuple[str, bytes]], pool_id: str, deadline_s: float
) -> str:
    """Which frame of a batch made the daemon close the engine connection: each is replayed
    alone on a fresh registered connection. A reproduction, or why none was found."""
    for kind, data in frames:
        engine = await _registered_engine(daemon, pool_id, 0, deadline_s)
        try:
            with contextlib.suppress(ConnectionError, OSError):
                engine.writer.write(data)
                await engine.writer.drain()
            answered = await engine.replies_within(1, deadline_s)
            if not answered or engine.eof.is_set():
                await asyncio.sleep(0)  # a close right after the reply
                return f"{kind} alone closes the connection; frame: {data.hex()}"
        finally:
            await engine.close()
    return "no single frame of the batch closes a connection alone (an interaction)"


async def fuzz_engine(
    daemon: DaemonProc,
    count: int,
    seed: int,
    report: FuzzReport,
    peer_hint: str = "",
    first_frame_every: int = 25,
    batch: int = 32,
    deadline_s: float = 10.0,
) -> None:
    """`count` hostile frames to the engine API. On a registered engine connection (with
    a real pool, so calls get past the first checks) every frame (garbage, mutated,
    wrongly typed, deeply nested, well-formed with hostile values) must be answered by
    exactly one Reply within `deadline_s`, and a Reply to a call whose id the frame still
    carries must name that id. One in `first_frame_every` goes instead as the first frame
    of a fresh connection, which must be closed within `deadline_s`. A connection the
    daemon closes in the middle is a surprise: the frame that did it is found by replay."""
    rng = random.Random(seed)
    values = Values(rng, max_str=64 << 10, max_list=4096)
    bodies = Bodies(EngineMessage, rng, max_str=64 << 10)
    pool_id = "fuzzpool"
    engine = await _registered_engine(daemon, pool_id, seed, deadline_s)
    report.connections += 1
    sent = 0
    call_id = 1000
    pending: list[tuple[str, bytes, int | None]] = []  # the batch not yet answered
    try:
        while sent < count:
            if rng.randrange(first_frame_every) == 0:
                kind, data, how = await _first_frame_case(
                    daemon.api_socket, rng, bodies, deadline_s
                )
                report.connections += 1
                report.count("engine_" + kind)
                sent += 1
                if how == "closed":
                    report.closed += 1
                else:
                    report.hang(f"engine first frame {kind} (seed {seed}) open: {short_hex(data)}")
                continue
            call_id += 1
            if rng.random() < 0.45:
                msg = _engine_call(rng, values, call_id, pool_id, peer_hint)
                try:
                    kind, data = "call_" + type(msg).__name__, ENGINE_CODEC.encode(msg)
                except (ProtocolError, OverflowError, TypeError, ValueError):
                    continue  # not encodable: not sent, not counted
                if len(data) > bodies.max_body:
                    continue
                want = call_id if hasattr(msg, "call_id") else None
            else:
                kind, body = bodies.any()
                data, want = frame(body), None
            report.count("engine_" + kind)
            sent += 1
            pending.append((kind, data, want))
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                engine.writer.write(data)
            if len(pending) < batch and sent < count:
                continue
            with contextlib.suppress(ConnectionError, OSError):
                await engine.writer.drain()
            if await engine.replies_within(len(pending), deadline_s):
                report.answered += len(pending)
                for reply in engine.replies:
                    code = "ok" if reply.ok else reply.error
                    report.replies[code] = report.replies.get(code, 0) + 1
                for kind_, data_, want_ in pending:
                    if want_ is not None and want_ not in engine.call_ids:
                        report.surprise(
                            f"engine {kind_}: no Reply with call id {want_}: {short_hex(data_)}"
                        )
            else:
                kinds = [k for k, _, _ in pending]
                if engine.eof.is_set():
                    report.closed += 1
                    why = await _culprit(
                        daemon, [(k, d) for k, d, _ in pending], pool_id, deadline_s
                    )
                    report.surprise(
                        f"engine connection closed by the daemon (seed {seed}) in a batch "
                        f"of {kinds}: {why}"
                    )
                else:
                    report.hang(
                        f"engine: {len(pending) - len(engine.replies)} of a batch unanswered "
                        f"after {deadline_s} s (seed {seed}): {kinds}"
                    )
                await engine.close()
                engine = await _registered_engine(daemon, pool_id, seed, deadline_s)
                report.connections += 1
            engine.replies.clear()
            engine.call_ids.clear()
            pending.clear()
    finally:
        await engine.close()


async def silent_engines(
    daemon: DaemonProc, report: FuzzReport, deadline_s: float, n: int = 4
) -> None:
    """Engine connections that never send a full first frame: closed by the daemon's
    first-frame timeout (`deadline_s` includes a margin)."""

    partial = [b"", b"\x00", HEADER.pack(64) + b"\x82"]
    await stalled(
        lambda: asyncio.open_unix_connection(daemon.api_socket),
        partial,
        n,
        report,
        "engine_silent",
        "silent engine",
        deadline_s,
    )
