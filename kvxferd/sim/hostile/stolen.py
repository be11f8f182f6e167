"""Stolen sends: real sends asked for by the intruder into pools with hostile addresses and
blocks (issue 14)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from typing import TYPE_CHECKING

from kvxferd.errors import KvxferdError
from kvxferd.memory.shm import ShmRegion
from kvxferd.peers.handshake import Identity
from kvxferd.peers.messages import PEER_CODEC, PoolInfo, PoolsUpdate, RequestData
from kvxferd.sim.cluster import DaemonProc
from kvxferd.sim.hostile.intruder import Credentials, Intruder, fake_info, handshake
from kvxferd.sim.hostile.report import FuzzReport
from kvxferd.sim.hostile.values import fuzz_layout
from kvxferd.transceiver.state import Outcome

if TYPE_CHECKING:
    from kvxferd.client import AsyncClient


async def fuzz_stolen_sends(
    ctx: DaemonProc,
    creds: Credentials,
    count: int,
    seed: int,
    report: FuzzReport,
    deadline_s: float = 10.0,
) -> None:
    """`count` real sends on `ctx`, each asked for first by the intruder (an authenticated
    peer) into a pool it announced with hostile addresses (a base near 2**64, a size of a
    TiB) or with hostile block ids (negative, past the pool, near 2**63) and bounce
    offsets. Within `deadline_s` either the real send fails as the peer's fault (the
    intruder registered no memory there) or the intruder's RequestData is refused
    (`block_mismatch`: blocks outside its own pool) and the send waits on for a real
    receiver, which the victim then cancels; and the channel must stay served. What the
    daemon logs meanwhile is checked by the caller (no traceback)."""
    from kvxferd.client import AsyncClient

    rng = random.Random(seed)
    layout = fuzz_layout(64)
    wire: dict[str, object] = dict(layout.to_wire())
    client = await AsyncClient.connect(ctx.api_socket, engine="fuzz-victim")
    region = ShmRegion.create(f"kvxferd-victim-{os.getpid()}-{seed}", layout.pool_bytes)
    try:
        await client.register_pool("victim", region.name, layout)
    finally:
        region.unlink()
    info = fake_info(ctx, creds)
    role = "generation"
    me = Identity("fuzzer", f"steal-{seed}", role, creds.secret)
    conn = await handshake(ctx, me, info, deadline_s)
    report.connections += 1
    huge = (2**64 - 4096, 2**63, 2**63 - layout.block_bytes, 2**48)
    try:
        for i in range(count):
            rid = f"stolen-{seed}-{i}"
            base = rng.choice((0x1000, *huge))
            nbytes = rng.choice((layout.pool_bytes, 1 << 40, 2**64 - 1, 0, -1))
            blocks = rng.choice(
                (
                    [0, 1, 2, 3],
                    [-1, 0, 1, 2],
                    [60, 61, 62, 63 + 1000],
                    [2**63 - 1, 5, 6, 7],
                    [-(2**63), 1, 2, 3],
                )
            )
            bounce = rng.choice(((0, 0), (2**63, 2**63), (-1, 1 << 20), (1 << 40, 1 << 30)))
            pools = [PoolInfo(pool_id="evil", layout=wire, base=base, nbytes=nbytes)]
            request = RequestData(
                request_id=rid, rx_token=i + 1, pool_id="evil", blocks=blocks, num_tokens=100,
                bounce_offset=bounce[0], bounce_nbytes=bounce[1],
            )  # fmt: skip
            await client.send(rid, "victim", [0, 1, 2, 3], 100)
            conn.write(PEER_CODEC.encode(PoolsUpdate(pools=pools)))
            conn.write(PEER_CODEC.encode(request))
            report.count("stolen_RequestData", 2)
            case = f"base {base:#x}, nbytes {nbytes}, blocks {blocks}, bounce {bounce}"
            outcome, refused = await _outcome_or_refusal(client, conn, rid, deadline_s)
            if outcome is None and refused is not None:
                if refused != "block_mismatch":
                    report.surprise(f"stolen send {rid} ({case}): refused as {refused}")
                # Nobody else will ask for it: the victim gives up on the send.
                await client.cancel(rid)
                outcome = await client.wait(rid, timeout_s=deadline_s)
                if outcome.status != "cancelled":
                    report.surprise(f"stolen send {rid} ({case}): {outcome.status} after cancel")
                report.answered += 1
            elif outcome is None:
                report.hang(f"stolen send {rid} ({case}): no outcome or refusal in {deadline_s} s")
                continue
            elif outcome.status == "done":
                report.surprise(f"stolen send {rid} ({case}) reported done")
            elif outcome.reason == "internal" or outcome.fault == "local":
                # The peer's bogus pool or blocks: a peer fault with a reason of its own,
                # not an internal error of ours.
                report.surprise(
                    f"stolen send {rid} ({case}): {outcome.reason}, {outcome.fault} fault: "
                    f"{outcome.message[:200]}"
                )
            else:
                report.answered += 1
            await client.release(rid)
            if await conn.pong((1 << 41) + i, deadline_s) != "pong":
                report.surprise(f"stolen send {rid} ({case}): the intruder's channel closed")
                break
    finally:
        await conn.close()
        with contextlib.suppress(KvxferdError):
            await client.deregister_pool("victim")
        await client.close()
        region.close()


async def _outcome_or_refusal(
    client: AsyncClient, conn: Intruder, rid: str, timeout_s: float
) -> tuple[Outcome | None, str | None]:
    """The send's outcome, or the reason the intruder's RequestData was refused (an Abort
    to it), whichever comes first within `timeout_s`; (None, None) when neither did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(asyncio.TimeoutError):
            return await client.wait(rid, timeout_s=0.05), None
        if rid in conn.aborts:
            return None, conn.aborts[rid]
    return None, None
