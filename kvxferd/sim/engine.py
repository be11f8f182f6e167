"""The reference engine: a stand-in for an inference server, for demo, tests and bench.

It allocates a KV pool in POSIX shared memory, shares it with its daemon through
kvxferd.client, and runs a workload. As the context engine it fills every
source block with content derived from (request, block, layer, kv, token) and
sends it; as the generation engine it zeroes the destination blocks, posts the
receive and verifies every byte that arrives.

Tensor parallelism: one engine process drives every rank of its instance, as
one scheduler does (the same block ids on every rank). Give `--socket` once per
rank (rank order); each rank's pool holds its share of `--kv-heads` (the
model's KV heads). The generation engine gets every context daemon as `--peer`
(rank order) and names, for each of its ranks, the context ranks that hold its
heads: one (head-split or equal sizes) or several (head-merge).

GPU pools (`--memory vram`): each rank's pool is a DevicePool in device memory, shared
with its daemon by CUDA IPC handle (`--vram-share ipc`) or VMM fd (`vmm`); its content is
made and verified on the device (kvxferd.sim.device_content), and the engine synchronises
the device before every send and recv, the ordering contract of device pools: the daemon
copies from and into the pool on its own streams, in its own process, and sees only what
the device has finished. Without a usable CUDA device it exits at once with the reason.

Run as `python -m kvxferd.sim.engine --role context|generation ...`; it prints
one JSON object with per-request records on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import asdict

from kvxferd.client import AsyncClient, DaemonGoneError
from kvxferd.service.heap_tuning import keep_freed_heap
from kvxferd.sim.announce import Announcements, Announcer
from kvxferd.sim.engine_pools import add_geometry_args, add_memory_args, layout_from_args
from kvxferd.sim.reference_engine import EngineReport, ReferenceEngine
from kvxferd.sim.workload import fixed_workload, make_workload


async def _main(args: argparse.Namespace) -> EngineReport:
    sockets = args.socket
    layout = layout_from_args(args, len(sockets))
    clients = [
        await AsyncClient.connect(path, engine=f"sim-{args.role}-{i}")
        for i, path in enumerate(sockets)
    ]
    engine = ReferenceEngine(
        clients,
        layout,
        args.pool_id,
        memory=args.memory,
        vram_share=args.vram_share,
        cuda_device=args.cuda_device,
        huge_pages=args.huge_pages,
    )
    peer: str | None = None
    if args.role == "generation":
        peers = args.peer or []
        if len(sockets) == 1 and len(peers) <= 1:
            peer = peers[0] if peers else ""
        else:
            engine.set_context_peers(peers)
            peer = ""
    engine.refusals_are_outcomes = args.record_refusals
    if args.tokens is not None:
        items = fixed_workload(args.seed, args.requests, args.tokens, args.prefix)
    else:
        items = make_workload(
            args.seed, args.requests, args.min_tokens, args.max_tokens, args.prefix
        )
    await engine.open()
    reader_task = None
    if args.notify_fd is not None:
        engine.notify = Announcer(args.notify_fd)
    if args.wait_fd is not None:
        engine.announced = Announcements()
        reader_task = asyncio.create_task(engine.announced.listen(args.wait_fd))
    cpu0 = time.process_time()

    async def close() -> None:
        if reader_task is not None:
            reader_task.cancel()
        try:
            await engine.close()
        finally:
            for client in clients:
                await client.close()

    try:
        records = await engine.run(items, args.in_flight, peer, args.progress)
        cpu_s = time.process_time() - cpu0
    except BaseException:
        # The run's own error is the one to tell. Cleaning up after it can fail too: when
        # one rank's daemon died mid-split, the other ranks' daemons still hold live legs
        # of the same requests and refuse to deregister the pool (pool_busy), and that
        # error used to replace "its daemon went away" with a traceback. Exiting closes
        # every connection, and each daemon then ends what its engine left.
        with contextlib.suppress(Exception):
            await close()
        raise
    await close()
    return EngineReport(
        role=args.role,
        records=records,
        pool_bytes=layout.pool_bytes * len(sockets),
        cpu_s=round(cpu_s, 4),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvxferd.sim.engine")
    p.add_argument("--role", choices=["context", "generation"], required=True)
    p.add_argument(
        "--socket",
        action="append",
        required=True,
        help="the daemon's engine API socket; once per tensor-parallel rank, in rank order",
    )
    p.add_argument(
        "--peer",
        action="append",
        help="generation: the context daemon (name or HOST:PORT); once per context rank, "
        "in rank order",
    )
    p.add_argument("--pool-id", default="pool0")
    p.add_argument("--pool-blocks", type=int, default=1024)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--prefix", default="req")
    p.add_argument("--min-tokens", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=None, help="fixed prompt length")
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--notify-fd", type=int, help="generation: announce posted receives here")
    p.add_argument("--wait-fd", type=int, help="context: send only announced requests")
    p.add_argument(
        "--record-refusals",
        action="store_true",
        help="generation: a refused receive is a failed request (reason: the refusal's "
        "code), not the end of the run",
    )
    add_memory_args(p)
    add_geometry_args(p)
    args = p.parse_args(argv)
    if args.memory == "vram":
        from kvxferd.sim.device_content import vram_problem

        problem = vram_problem()
        if problem is not None:
            # Before any daemon is asked for anything: one line, no traceback.
            print(f"{p.prog}: error: {problem}", file=sys.stderr)
            return 2
    keep_freed_heap()  # its checks of scattered blocks make MiB of temporaries per request
    try:
        report = asyncio.run(_main(args))
    except DaemonGoneError as exc:
        # Its daemon died or hung (the demo's fault tests do that): one line saying so,
        # not a traceback of whichever call noticed first.
        print(f"{p.prog} ({args.role}): its daemon went away: {exc}", file=sys.stderr)
        return 1
    json.dump(asdict(report), sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
