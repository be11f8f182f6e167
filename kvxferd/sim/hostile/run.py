"""The whole live run against a context and a generation daemon, and the verified transfer
after it (issue 14)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterator

from kvxferd.memory.shm import ShmRegion
from kvxferd.sim.cluster import DaemonProc
from kvxferd.sim.hostile.engine import fuzz_engine, silent_engines
from kvxferd.sim.hostile.intruder import Credentials
from kvxferd.sim.hostile.postauth import fuzz_postauth
from kvxferd.sim.hostile.preauth import fuzz_preauth, stalled_strangers
from kvxferd.sim.hostile.report import FuzzReport, LiveResult, crash_lines, forged_lines, rss_bytes
from kvxferd.sim.hostile.stolen import fuzz_stolen_sends
from kvxferd.sim.hostile.values import fuzz_layout


async def verified_transfer(
    ctx: DaemonProc, gen: DaemonProc, request_id: str, tokens: int = 100, timeout_s: float = 30
) -> tuple[bool, str]:
    """One request from `ctx` to `gen` through fresh engines; (every byte verified, detail)."""
    from kvxferd.client import AsyncClient
    from kvxferd.sim.content import clear_blocks, fill_blocks, request_seed, verify_blocks

    layout = fuzz_layout(64)
    blocks = list(range(-(-tokens // layout.tokens_per_block)))
    regions: list[ShmRegion] = []
    clients: list[AsyncClient] = []
    try:
        for daemon in (ctx, gen):
            client = await AsyncClient.connect(daemon.api_socket, engine=f"verify-{daemon.name}")
            clients.append(client)
            region = ShmRegion.create(
                f"kvxferd-verify-{os.getpid()}-{daemon.name}", layout.pool_bytes
            )
            regions.append(region)
            try:
                await client.register_pool("verify", region.name, layout)
            finally:
                region.unlink()
        c, g = clients
        fill_blocks(regions[0].array, layout, blocks, request_seed(request_id))
        clear_blocks(regions[1].array, layout, blocks)
        await g.recv(request_id, "verify", blocks, ctx.peer_address, tokens)
        await c.send(request_id, "verify", blocks, tokens)
        got = await g.wait(request_id, timeout_s=timeout_s)
        sent = await c.wait(request_id, timeout_s=timeout_s)
        if (got.status, sent.status) != ("done", "done"):
            return False, f"recv {got.status}/{got.reason}: {got.message}; send {sent.status}"
        result = verify_blocks(regions[1].array, layout, blocks, request_seed(request_id), tokens)
        await g.release(request_id)
        await c.release(request_id)
        for client in clients:
            await client.deregister_pool("verify")
        if not result.ok or result.bytes_checked == 0:
            return False, f"content mismatch: {result.first_mismatch}"
        return True, f"{result.bytes_checked} bytes verified"
    finally:
        for client in clients:
            await client.close()
        for region in regions:
            region.close()


async def run_live(
    ctx: DaemonProc,
    gen: DaemonProc,
    secret: bytes,
    agent: tuple[str, bytes],
    peer_messages: int,
    engine_messages: int,
    seed: int,
    preauth_share: float = 0.4,
    stall_deadline_s: float = 15.0,
    stolen: int = 0,
    progress: Callable[[str], Awaitable[None] | None] | None = None,
) -> LiveResult:
    """The whole live run: hostile peer messages to both daemons (a `preauth_share` of
    them before authentication, the rest on authenticated channels), `stolen` real sends
    asked for by the intruder with hostile addresses (fuzz_stolen_sends), hostile engine
    frames to both, slow-loris connections throughout; then a verified transfer, and the
    daemons' liveness, logs and memory."""
    started = time.monotonic()
    daemons = (ctx, gen)
    rss_before = {d.name: rss_bytes(d) for d in daemons}
    log_start = {d.name: len(d.log_text()) for d in daemons}
    creds = Credentials(secret, *agent)
    reports: list[FuzzReport] = []

    async def say(text: str) -> None:
        if progress is not None:
            out = progress(text)
            if out is not None:
                await out

    def split(total: int) -> Iterator[int]:
        half = total // 2
        yield half
        yield total - half

    stalls = FuzzReport("peer-stalled")
    silent = FuzzReport("engine-silent")
    slow = asyncio.gather(
        stalled_strangers(ctx, stalls, stall_deadline_s),
        silent_engines(gen, silent, stall_deadline_s),
    )
    # Each part has a seed of its own, derived from `seed`: a failure names the part, and
    # rerunning with the same seed replays it.
    for i, (daemon, n) in enumerate(zip(daemons, split(peer_messages), strict=True)):
        pre = int(n * preauth_share)
        report = FuzzReport(f"peer-preauth-{daemon.name}")
        reports.append(report)
        await fuzz_preauth(daemon, pre, seed * 10 + i, report)
        await say(f"{report.name}: {report.summary()}")
        report = FuzzReport(f"peer-postauth-{daemon.name}")
        reports.append(report)
        await fuzz_postauth(daemon, creds, n - pre, seed * 10 + 2 + i, report)
        await say(f"{report.name}: {report.summary()}")
    if stolen:
        report = FuzzReport("peer-stolen-ctx")
        reports.append(report)
        await fuzz_stolen_sends(ctx, creds, stolen, seed * 10 + 6, report)
        await say(f"{report.name}: {report.summary()}")
    for i, (daemon, n) in enumerate(zip(daemons, split(engine_messages), strict=True)):
        report = FuzzReport(f"engine-{daemon.name}")
        reports.append(report)
        await fuzz_engine(daemon, n, seed * 10 + 4 + i, report, peer_hint=ctx.peer_address)
        await say(f"{report.name}: {report.summary()}")
    await slow
    reports += [stalls, silent]
    crashed = [f"{d.name} exited with {d.proc.returncode}" for d in daemons if not d.alive()]
    verified, detail = False, "not tried: a daemon is gone"
    if not crashed:
        verified, detail = await verified_transfer(ctx, gen, f"after-fuzz-{seed}")
    texts = {d.name: d.log_text()[log_start[d.name] :] for d in daemons}
    return LiveResult(
        reports=reports,
        crashed=crashed,
        tracebacks={name: crash_lines(text) for name, text in texts.items()},
        forged={name: forged_lines(text) for name, text in texts.items()},
        verified=verified,
        verify_detail=detail,
        rss_before=rss_before,
        rss_after={d.name: rss_bytes(d) if d.alive() else 0 for d in daemons},
        seconds=time.monotonic() - started,
    )
