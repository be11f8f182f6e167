"""The peer channel after a real handshake: confusing well-formed messages that must leave
the channel served, and frames after which it must be closed (issue 14)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from kvxferd.errors import KvxferdError, ProtocolError
from kvxferd.peers.handshake import Identity
from kvxferd.peers.messages import (
    PEER_CODEC,
    Abort,
    AbortAck,
    CancelAnswer,
    CancelRequest,
    PeerMessage,
    Ping,
    Pong,
    PoolInfo,
    PoolsUpdate,
    RequestData,
    Result,
    RoundAck,
)
from kvxferd.sim.cluster import DaemonProc
from kvxferd.sim.hostile.bodies import HEADER, Bodies, frame
from kvxferd.sim.hostile.intruder import Credentials, fake_info, handshake
from kvxferd.sim.hostile.report import FuzzReport, http_status
from kvxferd.sim.hostile.streams import short_hex
from kvxferd.sim.hostile.values import Values, hostile_layout, message_types


def _semantic(rng: random.Random, values: Values, known_ids: list[str]) -> PeerMessage:
    """A well-formed steady-state message meant to confuse: unknown or stolen request ids,
    wrong tokens, bogus pools, offsets and lengths, handshake messages out of order."""
    rid = rng.choice(known_ids) if known_ids and rng.random() < 0.3 else values.str_()[:200]
    token = values.int_()
    blocks = [values.int_() for _ in range(values.length())]
    kind = rng.randrange(12)
    if kind == 0:
        return RequestData(
            request_id=rid, rx_token=token, pool_id=rng.choice(("pool0", values.str_()[:64])),
            blocks=blocks, num_tokens=rng.choice((None, values.int_())),
            bounce_offset=values.int_(), bounce_nbytes=values.int_(),
            expires_unix_ms=rng.choice((0, values.int_(), int(time.time() * 1e3) + 2000)),
            block_start=values.int_(),
        )  # fmt: skip
    if kind == 1:
        return Result(
            request_id=rid, rx_token=token, status=rng.choice(("ok", "error", values.str_())),
            nbytes=values.int_(), last=rng.random() < 0.5, message=values.str_(),
            bounced=rng.random() < 0.5, first_block=values.int_(), end_block=values.int_(),
        )  # fmt: skip
    if kind == 2:
        return Abort(request_id=rid, rx_token=token, reason=values.str_(), message=values.str_())
    if kind == 3:
        return AbortAck(request_id=rid, rx_token=token)
    if kind == 4:
        return CancelRequest(request_id=rid, rx_token=token)
    if kind == 5:
        return CancelAnswer(request_id=rid, rx_token=token, cancelled=rng.random() < 0.5)
    if kind == 6:
        return RoundAck(request_id=rid, rx_token=token, end_block=values.int_())
    if kind == 7:
        pools = [
            PoolInfo(pool_id=values.str_()[:64], layout=hostile_layout(rng, values),
                     base=values.int_(), nbytes=values.int_(), tp_rank=values.int_(),
                     tp_size=values.int_())
            for _ in range(rng.randint(0, 4))
        ]  # fmt: skip
        return PoolsUpdate(pools=pools)  # no agent metadata: that would end the connection
    if kind == 8:
        return Pong(seq=values.int_())
    # Handshake messages (and anything else of the union) after the handshake.
    others = [t for t in message_types(PeerMessage) if t not in (PoolsUpdate, Ping)]
    msg = values.message(rng.choice(others))
    return msg  # type: ignore[return-value]


def _closing_post_auth(rng: random.Random, bodies: Bodies) -> tuple[str, bytes]:
    """A frame after which the daemon must close the channel: it does not decode, its
    length is over the limit, or a PoolsUpdate carries agent metadata NIXL refuses."""
    r = rng.random()
    if r < 0.1:
        return "oversize_prefix", HEADER.pack(2**32 - 1) + rng.randbytes(16)
    if r < 0.2:
        pools = PoolsUpdate(pools=[], agent_metadata=rng.randbytes(rng.randint(1, 256)))
        return "bad_agent_metadata", PEER_CODEC.encode(pools)
    for _ in range(32):
        kind, body = bodies.any()
        try:
            PEER_CODEC.decode(body)
        except ProtocolError:
            return kind, frame(body)
    return "garbage", frame(b"\xc1")


async def _until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(predicate):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def fuzz_postauth(
    daemon: DaemonProc,
    creds: Credentials,
    count: int,
    seed: int,
    report: FuzzReport,
    closing_every: int = 40,
    batch: int = 50,
    deadline_s: float = 10.0,
) -> None:
    """`count` hostile messages on authenticated channels (a real handshake with the shared
    secret and a real NIXL agent's metadata). Most are well-formed but confusing
    (`_semantic`) and must leave the channel open: after each `batch` a Ping must be
    answered within `deadline_s`. One in `closing_every` must make the daemon close the
    channel at once (`_closing_post_auth`); the fuzzer then handshakes again."""
    rng = random.Random(seed)
    values = Values(rng, max_str=64 << 10, max_list=4096)
    bodies = Bodies(PeerMessage, rng, max_str=64 << 10)
    role = "generation" if daemon.role == "context" else "context"
    info = fake_info(daemon, creds)
    known: list[str] = ["r-0", "fuzz", *(f"r-{i}" for i in range(1, 4))]
    incarnation = 0
    sent = 0
    seq = 1 << 40  # far from the daemon's own ping numbers

    def gone(inc: str) -> Callable[[], bool]:
        def check() -> bool:
            peers = http_status(daemon)["peers"]
            return not any(p["name"] == "fuzzer" and p["incarnation"] == inc for p in peers)

        return check

    while sent < count:
        incarnation += 1
        me = Identity("fuzzer", f"{seed}-{incarnation}", role, creds.secret)
        try:
            conn = await handshake(daemon, me, info, deadline_s)
        except (KvxferdError, OSError, asyncio.TimeoutError) as exc:
            report.hang(f"post-auth handshake {me.incarnation} failed: {exc!r}")
            return
        report.connections += 1
        trace: list[str] = []  # the frames of this connection, for a reproduction
        try:
            while sent < count:
                closing = rng.randrange(closing_every) == 0
                if closing:
                    kind, data = _closing_post_auth(rng, bodies)
                    report.count("postauth_close_" + kind)
                    sent += 1
                    conn.write(data)
                    if await conn.closed_within(deadline_s):
                        report.closed += 1
                    else:
                        report.hang(
                            f"post-auth {kind} (seed {seed}, incarnation {me.incarnation}) "
                            f"left the channel open: {short_hex(data)}"
                        )
                    break
                msg = _semantic(rng, values, known)
                try:
                    data = PEER_CODEC.encode(msg)
                except (ProtocolError, OverflowError, TypeError, ValueError):
                    continue  # over the frame limit, or not encodable: not sent, not counted
                if len(data) > bodies.max_body:
                    continue
                if len(trace) < 2000:
                    trace.append(type(msg).__name__)
                report.count("postauth_" + type(msg).__name__)
                sent += 1
                if not conn.write(data):
                    report.surprise(
                        f"post-auth channel {me.incarnation} closed before message {sent} "
                        f"({type(msg).__name__}); last frames {trace[-5:]}"
                    )
                    report.closed += 1
                    break
                if sent % batch == 0 or sent == count:
                    seq += 1
                    got = await conn.pong(seq, deadline_s)
                    if got == "pong":
                        report.answered += 1
                    elif got == "hung":
                        report.hang(
                            f"post-auth channel {me.incarnation}: no Pong in {deadline_s} s"
                        )
                        break
                    else:
                        report.closed += 1
                        report.surprise(
                            f"post-auth channel {me.incarnation} (seed {seed}) closed by the "
                            f"daemon after well-formed messages; last {trace[-5:]}; "
                            f"last frame {short_hex(data)}"
                        )
                        break
                    await conn.writer.drain()
        finally:
            await conn.close()
        # The daemon must have dropped this incarnation before the next handshake reuses
        # the NIXL agent (its close evicts the agent).
        if not await _until(gone(me.incarnation), deadline_s):
            report.hang(f"post-auth channel {me.incarnation}: still listed as a peer")
